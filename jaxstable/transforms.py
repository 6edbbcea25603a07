"""JAX: public API of `jaxstable.transforms`.

Implementation in `jaxstable._src`: `clipping`, `guard`, `stable_optimizer`,
`accumulate`, `spikes`, `low_precision`.
"""

from jaxstable._src.accumulate import (
    AccumulateGradientsState as AccumulateGradientsState,
)
from jaxstable._src.accumulate import accumulate_gradients as accumulate_gradients
from jaxstable._src.clipping import clip_by_global_norm as clip_by_global_norm
from jaxstable._src.clipping import global_norm as global_norm
from jaxstable._src.guard import find_skip_state as find_skip_state
from jaxstable._src.guard import skip_non_finite as skip_non_finite
from jaxstable._src.guard_state import SkipNonFiniteState as SkipNonFiniteState
from jaxstable._src.guard_state import SkipSpikesState as SkipSpikesState
from jaxstable._src.low_precision import (
    LowPrecisionAdamWState as LowPrecisionAdamWState,
)
from jaxstable._src.low_precision import RoundingStats as RoundingStats
from jaxstable._src.low_precision import StallMonitor as StallMonitor
from jaxstable._src.low_precision import low_precision_adamw as low_precision_adamw
from jaxstable._src.low_precision import rounding_stats as rounding_stats
from jaxstable._src.spikes import find_spike_state as find_spike_state
from jaxstable._src.spikes import skip_spikes as skip_spikes
from jaxstable._src.stable_optimizer import stable_optimizer as stable_optimizer
