"""PyTorch: public API of `torchref.train`.

Implementation in `torchref._src.step` (the guarded step; its micro-batches,
checks, loss, state and records beside it),
`torchref._src.checkpoint` and `checkpoint_manager` (checkpoints) and
`torchref._src.fit` (the loop).
"""

from torchref._src.checkpoint import load_checkpoint as load_checkpoint
from torchref._src.checkpoint import save_checkpoint as save_checkpoint
from torchref._src.checkpoint_manager import CheckpointManager as CheckpointManager
from torchref._src.fit import NAN_POLICIES as NAN_POLICIES
from torchref._src.fit import Checkpointing as Checkpointing
from torchref._src.fit import Log as Log
from torchref._src.fit import NanPolicy as NanPolicy
from torchref._src.fit import NonFiniteError as NonFiniteError
from torchref._src.fit import fit as fit
from torchref._src.step import TrainStep as TrainStep
