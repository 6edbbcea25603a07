"""JAX: public API of `jaxstable.loss_scale`.

Implementation in `jaxstable._src.loss_scale` (the loss scales) and
`jaxstable._src.loss_scale_math` (their arithmetic and `all_finite`).
"""

from jaxstable._src.loss_scale import DynamicLossScale as DynamicLossScale
from jaxstable._src.loss_scale import NoOpLossScale as NoOpLossScale
from jaxstable._src.loss_scale import StaticLossScale as StaticLossScale
from jaxstable._src.loss_scale import scaled_value_and_grad as scaled_value_and_grad
from jaxstable._src.loss_scale_math import all_finite as all_finite
