"""PyTorch: public API of `torchref.transforms`.

Implementation in `torchref._src`: `clipping`, `guard`, `stable_optimizer`,
`accumulate`, `spikes`, `low_precision`.
"""

from torchref._src.accumulate import AccumulateGradients as AccumulateGradients
from torchref._src.accumulate import accumulate_gradients as accumulate_gradients
from torchref._src.clipping import clip_by_global_norm as clip_by_global_norm
from torchref._src.clipping import global_norm as global_norm
from torchref._src.guard import SkipNonFinite as SkipNonFinite
from torchref._src.guard import find_skip_state as find_skip_state
from torchref._src.guard import skip_non_finite as skip_non_finite
from torchref._src.guard_state import SkipNonFiniteState as SkipNonFiniteState
from torchref._src.guard_state import SkipSpikesState as SkipSpikesState
from torchref._src.low_precision import LowPrecisionAdamW as LowPrecisionAdamW
from torchref._src.low_precision import RoundingStats as RoundingStats
from torchref._src.low_precision import StallMonitor as StallMonitor
from torchref._src.low_precision import low_precision_adamw as low_precision_adamw
from torchref._src.low_precision import rounding_stats as rounding_stats
from torchref._src.spikes import SkipSpikes as SkipSpikes
from torchref._src.spikes import find_spike_state as find_spike_state
from torchref._src.spikes import skip_spikes as skip_spikes
from torchref._src.stable_optimizer import StableOptimizer as StableOptimizer
from torchref._src.stable_optimizer import stable_optimizer as stable_optimizer
