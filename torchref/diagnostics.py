"""PyTorch: public API of `torchref.diagnostics`.

Implementation in `torchref._src.diagnostics`.
"""

from torchref._src.check_points import CheckPoints as CheckPoints
from torchref._src.check_points import check_points as check_points
from torchref._src.check_points import check_record as check_record
from torchref._src.check_points import format_checks as format_checks
from torchref._src.diagnostics import PHASES as PHASES
from torchref._src.diagnostics import LeafReport as LeafReport
from torchref._src.diagnostics import NonFiniteLocation as NonFiniteLocation
from torchref._src.diagnostics import check_params as check_params
from torchref._src.diagnostics import format_location as format_location
from torchref._src.diagnostics import format_report as format_report
from torchref._src.diagnostics import locate as locate
from torchref._src.diagnostics import non_finite_grad_report as non_finite_grad_report
from torchref._src.diagnostics import non_finite_report as non_finite_report
from torchref._src.diagnostics import rng_snapshot as rng_snapshot
