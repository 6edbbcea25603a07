"""PyTorch: public API of `torchref.loss_scale`.

Implementation in `torchref._src.loss_scale` (the loss scales) and
`torchref._src.loss_scale_math` (`all_finite` and the float32 range).
"""

from torchref._src.loss_scale import DynamicGradScaler as DynamicGradScaler
from torchref._src.loss_scale import DynamicLossScale as DynamicLossScale
from torchref._src.loss_scale import NoOpLossScale as NoOpLossScale
from torchref._src.loss_scale import StaticGradScaler as StaticGradScaler
from torchref._src.loss_scale import StaticLossScale as StaticLossScale
from torchref._src.loss_scale_math import all_finite as all_finite
