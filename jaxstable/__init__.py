"""jaxstable: keep low-precision JAX training finite.

Float32-safe losses (`jaxstable.losses`), loss scaling on jmp
(`jaxstable.loss_scale`), guarded optax transforms (`jaxstable.transforms`),
precision policies (`jaxstable.precision`), NaN diagnostics
(`jaxstable.diagnostics`) and a train step and loop (`jaxstable.train`).
This package never imports torch; its twin `torchref` never imports jax.
"""

from jaxstable import diagnostics as diagnostics
from jaxstable import loss_scale as loss_scale
from jaxstable import losses as losses
from jaxstable import precision as precision
from jaxstable import train as train
from jaxstable import transforms as transforms

__version__ = "0.1.0"
