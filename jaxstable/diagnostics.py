"""JAX: public API of `jaxstable.diagnostics`.

Implementation in `jaxstable._src.diagnostics`.
"""

from jaxstable._src.check_points import CheckPoints as CheckPoints
from jaxstable._src.check_points import check_points as check_points
from jaxstable._src.check_points import check_record as check_record
from jaxstable._src.check_points import format_checks as format_checks
from jaxstable._src.diagnostics import PHASES as PHASES
from jaxstable._src.diagnostics import LeafReport as LeafReport
from jaxstable._src.diagnostics import NonFiniteLocation as NonFiniteLocation
from jaxstable._src.diagnostics import check_params as check_params
from jaxstable._src.diagnostics import format_location as format_location
from jaxstable._src.diagnostics import format_report as format_report
from jaxstable._src.diagnostics import locate as locate
from jaxstable._src.diagnostics import non_finite_report as non_finite_report
