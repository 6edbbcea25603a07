"""JAX: public API of `jaxstable.train`.

Implementation in `jaxstable._src.step` (the guarded step; its state in
`step_state`, its micro-batches, checks, loss and records beside it),
`jaxstable._src.checkpoint` and `checkpoint_manager` (checkpoints) and
`jaxstable._src.fit` (the loop).
"""

from jaxstable._src.checkpoint import load_checkpoint as load_checkpoint
from jaxstable._src.checkpoint import save_checkpoint as save_checkpoint
from jaxstable._src.checkpoint_manager import CheckpointManager as CheckpointManager
from jaxstable._src.fit import NAN_POLICIES as NAN_POLICIES
from jaxstable._src.fit import Checkpointing as Checkpointing
from jaxstable._src.fit import Log as Log
from jaxstable._src.fit import NanPolicy as NanPolicy
from jaxstable._src.fit import NonFiniteError as NonFiniteError
from jaxstable._src.fit import fit as fit
from jaxstable._src.step import TrainStep as TrainStep
from jaxstable._src.step import make_train_step as make_train_step
from jaxstable._src.step_state import TrainState as TrainState
from jaxstable._src.step_state import nnx_loss as nnx_loss
