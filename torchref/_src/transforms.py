"""The old home of the guarded optimizer wrappers, for `step.py` only.

They moved to `clipping`, `update_check`, `guard_step`, `guard`,
`stable_optimizer` and `accumulate` (issue 38); `torchref._src.step` still
imports these names from here until it is moved over.
"""

from torchref._src.clipping import all_finite_t as _all_finite_t
from torchref._src.clipping import clip_by_global_norm, norm_read_on_host
from torchref._src.clipping import clip_in_place as _clip_in_place
from torchref._src.clipping import norm_and_finite as _norm_and_finite
from torchref._src.clipping import to_host as _to_host
from torchref._src.guard import DeferredRecords as _DeferredRecords
from torchref._src.guard import SkipNonFinite, SkipNonFiniteState
from torchref._src.guard import check_bool as _check_bool
from torchref._src.guard import check_max_consecutive as _check_max_consecutive
from torchref._src.guard import check_optimizer as _check_optimizer
from torchref._src.guard import needs_closure as _needs_closure
from torchref._src.guard_step import GuardedStep as _GuardedStep
from torchref._src.update_check import DeviceSelect as _DeviceSelect

__all__ = [
    "SkipNonFinite",
    "SkipNonFiniteState",
    "_DeferredRecords",
    "_DeviceSelect",
    "_GuardedStep",
    "_all_finite_t",
    "_check_bool",
    "_check_max_consecutive",
    "_check_optimizer",
    "_clip_in_place",
    "_needs_closure",
    "_norm_and_finite",
    "_to_host",
    "clip_by_global_norm",
    "norm_read_on_host",
]
