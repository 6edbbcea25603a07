"""The old home of the guarded transformations, for `step.py` only.

They moved to `clipping`, `update_check`, `guard_step`, `guard`,
`stable_optimizer` and `accumulate` (issue 38); `jaxstable._src.step` still
imports these names from here until it is moved over.
"""

from jaxstable._src.accumulate import AccumulateGradientsState
from jaxstable._src.clipping import global_norm
from jaxstable._src.guard import check_optimizer as _check_optimizer
from jaxstable._src.update_check import keep_finite as _keep_finite
from jaxstable._src.update_check import writes_finite as _writes_finite

__all__ = [
    "AccumulateGradientsState",
    "_check_optimizer",
    "_keep_finite",
    "_writes_finite",
    "global_norm",
]
