"""Data-parallel and fully sharded training on a `jax.sharding.Mesh`.

The guarded step of `jaxstable.train.make_train_step` needs no change to run
on many devices: place the `TrainState` and the batch with the shardings
below and call the step. `jax.jit` then compiles one SPMD program; every
reduction in it (the gradient mean, the global norm, the ONE all-finite flag
of the guard) is global, so every replica takes the same skip decision and
the same loss-scale update from the same global gradient.

* ``"data_parallel"``: the state is replicated, the batch is split along its
  leading axis over the mesh axis ``"data"``.
* ``"fsdp"`` (ZeRO-3 style): parameters and optimizer state are split along
  their leading axis too, where the axis size is a multiple of the device
  count; other leaves (scalars, odd shapes), the loss scale, the counters
  and the model state are replicated.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "DATA_AXIS",
    "STRATEGIES",
    "batch_sharding",
    "count_collectives",
    "make_mesh",
    "replicas_identical",
    "shard_batch",
    "shard_state",
    "state_sharding",
]

DATA_AXIS = "data"
STRATEGIES = ("data_parallel", "fsdp")
_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)


def make_mesh(
    num_devices: int | None = None, *, devices: Any = None, axis_name: str = DATA_AXIS
) -> Mesh:
    """A 1-D mesh over ``num_devices`` devices, its axis named ``"data"``.

    Args:
      num_devices: how many devices to use (the first ones of ``devices``);
        None means all of them.
      devices: the devices to choose from; None means `jax.devices()` (every
        device of every process under `jax.distributed`).
      axis_name: the mesh axis name.

    Returns:
      A `jax.sharding.Mesh` of shape ``(num_devices,)``.

    Raises:
      ValueError: ``num_devices`` is not an int in ``[1, len(devices)]``.

    Example:
      >>> from jaxstable import distributed
      >>> mesh = distributed.make_mesh(1)
      >>> mesh.axis_names, mesh.devices.shape
      (('data',), (1,))
    """
    devs = list(jax.devices() if devices is None else devices)
    n = len(devs) if num_devices is None else num_devices
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(devs):
        raise ValueError(
            f"num_devices must be an int in [1, {len(devs)}] (the devices "
            f"available), got {num_devices!r}"
        )
    return Mesh(np.array(devs[:n]), (axis_name,))


def _axis(mesh: Mesh) -> str:
    if not isinstance(mesh, Mesh) or len(mesh.axis_names) != 1:
        raise ValueError(
            "mesh must be a 1-D jax.sharding.Mesh (see make_mesh), got "
            f"{getattr(mesh, 'axis_names', type(mesh).__name__)!r}"
        )
    return mesh.axis_names[0]


def _leaf_spec(x: Any, n: int, axis: str, split: bool) -> PartitionSpec:
    shape = np.shape(x)
    if split and len(shape) >= 1 and shape[0] >= n and shape[0] % n == 0:
        return PartitionSpec(axis)
    return PartitionSpec()


def state_sharding(state: Any, mesh: Mesh, strategy: str = "data_parallel") -> Any:
    """The `NamedSharding` of every leaf of a `TrainState` (a matching pytree).

    ``"data_parallel"``: all replicated. ``"fsdp"``: leaves of ``params`` and
    ``opt_state`` whose leading axis is a multiple of the mesh size are split
    along it; everything else is replicated.

    Args:
      state: a `jaxstable.train.TrainState`.
      mesh: a 1-D mesh (`make_mesh`).
      strategy: one of `STRATEGIES`.

    Returns:
      A pytree of `jax.sharding.NamedSharding` with the structure of
      ``state``; usable as ``in_shardings``/``out_shardings`` of `jax.jit`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import distributed, train
      >>> state = train.TrainState.create(params={"w": jnp.ones((4, 2))},
      ...                                 optimizer=optax.adam(1e-3))
      >>> sh = distributed.state_sharding(state, distributed.make_mesh(1), "fsdp")
      >>> sh.params["w"].spec, sh.step.spec
      (P('data',), P())
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    axis = _axis(mesh)
    n = mesh.devices.size

    def rule(split: bool):
        return lambda x: NamedSharding(mesh, _leaf_spec(x, n, axis, split))

    sharded = jax.tree.map(rule(False), state)
    if strategy == "fsdp":
        sharded = sharded.replace(
            params=jax.tree.map(rule(True), state.params),
            opt_state=jax.tree.map(rule(True), state.opt_state),
        )
    return sharded


def _place(x: Any, sharding: NamedSharding) -> jax.Array:
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    # Several processes (jax.distributed): each one holds the same global
    # value and fills in its own devices' slices of it.
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])


def shard_state(state: Any, mesh: Mesh, strategy: str = "data_parallel") -> Any:
    """Places a `TrainState` on ``mesh`` with `state_sharding`.

    Every process must pass the same state (e.g. built from the same seed).
    The jitted train step keeps the shardings: its output state is placed as
    its input was.

    Args:
      state: a `jaxstable.train.TrainState`.
      mesh: a 1-D mesh (`make_mesh`).
      strategy: ``"data_parallel"`` or ``"fsdp"``.

    Returns:
      The same state, its leaves `jax.Array` s placed on the mesh.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import distributed, train
      >>> mesh = distributed.make_mesh(1)
      >>> state = train.TrainState.create(params={"w": jnp.ones((4, 2))},
      ...                                 optimizer=optax.sgd(0.1))
      >>> state = distributed.shard_state(state, mesh, "fsdp")
      >>> state.params["w"].sharding.spec
      P('data',)
    """
    return jax.tree.map(_place, state, state_sharding(state, mesh, strategy))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of a batch leaf: split along its leading axis.

    Args:
      mesh: a 1-D mesh (`make_mesh`).

    Returns:
      ``NamedSharding(mesh, PartitionSpec("data"))``.

    Example:
      >>> from jaxstable import distributed
      >>> distributed.batch_sharding(distributed.make_mesh(1)).spec
      P('data',)
    """
    return NamedSharding(mesh, PartitionSpec(_axis(mesh)))


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Splits every leaf of a GLOBAL batch along its leading axis over ``mesh``.

    Device ``i`` of the mesh gets rows ``[i*b/n, (i+1)*b/n)``, so a loss that
    is a mean over the rows gives the gradient of the whole batch. Under
    `jax.distributed` every process passes the same global batch.

    Args:
      batch: a pytree of arrays, each with a leading axis whose size is a
        multiple of the mesh size.
      mesh: a 1-D mesh (`make_mesh`).

    Returns:
      The batch as sharded `jax.Array` s.

    Raises:
      ValueError: a leaf is a scalar or its leading axis is not a multiple
        of the number of devices (names the leaf).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import distributed
      >>> b = distributed.shard_batch({"x": jnp.ones((4, 3))},
      ...                             distributed.make_mesh(1))
      >>> b["x"].shape, b["x"].sharding.spec
      ((4, 3), P('data',))
    """
    sharding = batch_sharding(mesh)
    n = mesh.devices.size
    leaves, treedef = jax.tree_util.tree_flatten_with_path(batch)
    out = []
    for path, leaf in leaves:
        shape = np.shape(leaf)
        if not shape or shape[0] % n:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
                f"{shape}: its leading (batch) axis must be a multiple of the "
                f"{n} devices of the mesh"
            )
        out.append(_place(leaf, sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


def replicas_identical(tree: Any) -> bool:
    """Whether every copy of every array leaf is bitwise equal to the others.

    For each leaf, the addressable shards that hold the same slice (all of
    them for a replicated leaf) are compared byte for byte (NaN payloads
    included). Only this process's devices are seen.

    Args:
      tree: a pytree of `jax.Array` s (e.g. a sharded `TrainState`).

    Returns:
      True when no two copies of a slice differ.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import distributed
      >>> distributed.replicas_identical({"w": jnp.ones(3)})
      True
    """
    for leaf in jax.tree_util.tree_leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        seen: dict[str, bytes] = {}
        for shard in leaf.addressable_shards:
            key = repr(shard.index)
            data = np.asarray(shard.data).tobytes()
            if seen.setdefault(key, data) != data:
                return False
    return True


def count_collectives(compiled: Any) -> dict[str, int]:
    """Counts the collective ops (and ``conditional`` s) of a compiled program.

    Args:
      compiled: ``jax.jit(f).lower(...).compile()``, or its ``as_text()``.

    Returns:
      ``{kind: count}`` for all-reduce, all-gather, reduce-scatter,
      all-to-all, collective-permute and conditional (async ``-start`` ops
      counted as their kind), kinds with no op left out.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxstable import distributed
      >>> distributed.count_collectives(jax.jit(jnp.sin).lower(1.0).compile())
      {}
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    kinds = "|".join((*_COLLECTIVES, "conditional"))
    found = re.findall(rf"\s({kinds})(?:-start)?\(", text)
    return dict(Counter(found))
