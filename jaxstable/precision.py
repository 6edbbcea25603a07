"""JAX: public API of `jaxstable.precision`.

Implementation in `jaxstable._src.precision`.
"""

from jaxstable._src.precision import DtypeLimits as DtypeLimits
from jaxstable._src.precision import Policy as Policy
from jaxstable._src.precision import PolicyNotAppliedWarning as PolicyNotAppliedWarning
from jaxstable._src.precision import dtype_limits as dtype_limits
from jaxstable._src.precision import get_policy as get_policy
from jaxstable._src.precision import headroom as headroom
