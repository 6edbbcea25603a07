"""JAX: public API of `jaxstable.train`.

Implementation in `jaxstable._src.train`.
"""

from jaxstable._src.train import NAN_POLICIES as NAN_POLICIES
from jaxstable._src.train import NonFiniteError as NonFiniteError
from jaxstable._src.train import TrainState as TrainState
from jaxstable._src.train import TrainStep as TrainStep
from jaxstable._src.train import fit as fit
from jaxstable._src.train import load_checkpoint as load_checkpoint
from jaxstable._src.train import make_train_step as make_train_step
from jaxstable._src.train import save_checkpoint as save_checkpoint
