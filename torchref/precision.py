"""PyTorch: public API of `torchref.precision`.

Implementation in `torchref._src.precision`.
"""

from torchref._src.precision import DtypeLimits as DtypeLimits
from torchref._src.precision import Policy as Policy
from torchref._src.precision import dtype_limits as dtype_limits
from torchref._src.precision import get_policy as get_policy
from torchref._src.precision import headroom as headroom
