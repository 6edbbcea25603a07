"""PyTorch: public API of `torchref.train`.

Implementation in `torchref._src.train`.
"""

from torchref._src.train import NAN_POLICIES as NAN_POLICIES
from torchref._src.train import NonFiniteError as NonFiniteError
from torchref._src.train import TrainStep as TrainStep
from torchref._src.train import fit as fit
from torchref._src.train import load_checkpoint as load_checkpoint
from torchref._src.train import save_checkpoint as save_checkpoint
