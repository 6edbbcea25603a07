"""JAX: public API of `jaxstable.loss_scale`.

Implementation in `jaxstable._src.loss_scale`.
"""

from jaxstable._src.loss_scale import DynamicLossScale as DynamicLossScale
from jaxstable._src.loss_scale import NoOpLossScale as NoOpLossScale
from jaxstable._src.loss_scale import StaticLossScale as StaticLossScale
from jaxstable._src.loss_scale import all_finite as all_finite
from jaxstable._src.loss_scale import scaled_value_and_grad as scaled_value_and_grad
