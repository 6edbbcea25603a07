"""PyTorch: public API of `torchref.distributed`.

Implementation in `torchref._src.distributed`.
"""

from torchref._src.distributed import DATA_AXIS as DATA_AXIS
from torchref._src.distributed import STRATEGIES as STRATEGIES
from torchref._src.distributed import global_mean as global_mean
from torchref._src.distributed import make_mesh as make_mesh
from torchref._src.distributed import replicas_identical as replicas_identical
from torchref._src.distributed import shard_batch as shard_batch
from torchref._src.distributed import shard_state as shard_state
