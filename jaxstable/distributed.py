"""JAX: public API of `jaxstable.distributed`.

Implementation in `jaxstable._src.distributed`.
"""

from jaxstable._src.distributed import DATA_AXIS as DATA_AXIS
from jaxstable._src.distributed import STRATEGIES as STRATEGIES
from jaxstable._src.distributed import batch_sharding as batch_sharding
from jaxstable._src.distributed import count_collectives as count_collectives
from jaxstable._src.distributed import global_mean as global_mean
from jaxstable._src.distributed import make_mesh as make_mesh
from jaxstable._src.distributed import replicas_identical as replicas_identical
from jaxstable._src.distributed import shard_batch as shard_batch
from jaxstable._src.distributed import shard_state as shard_state
from jaxstable._src.distributed import state_sharding as state_sharding
