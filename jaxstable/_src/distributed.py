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

import hashlib
import json
import re
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "DATA_AXIS",
    "STRATEGIES",
    "batch_sharding",
    "count_collectives",
    "global_mean",
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
    Under `jax.distributed` that is checked: every process hashes its copies
    (sha256, once, on the host) and the digests are gathered; a state that
    differs between processes is refused with a ValueError naming the first
    leaf that differs (a collective: every process must call it). The
    jitted train step keeps the shardings: its output state is placed as
    its input was.

    Args:
      state: a `jaxstable.train.TrainState`.
      mesh: a 1-D mesh (`make_mesh`).
      strategy: ``"data_parallel"`` or ``"fsdp"``.

    Returns:
      The same state, its leaves `jax.Array` s placed on the mesh.

    Raises:
      ValueError: a bad ``strategy`` or mesh, or (several processes) the
        processes passed different states.

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
    placed = jax.tree.map(_place, state, state_sharding(state, mesh, strategy))
    if jax.process_count() > 1:
        # Each process filled its own devices from its own copy: processes
        # built from different seeds would train different replicas without
        # a word (measured: params 1.59 apart, every step "finite").
        where = _first_difference(placed)
        if where is not None:
            raise ValueError(
                f"shard_state: the processes passed different states, first at "
                f"{where}; every process must pass the same state (build it "
                "from the same seed or load the same weights)"
            )
    return placed


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


def shard_batch(batch: Any, mesh: Mesh, *, process_local: bool = False) -> Any:
    """Splits every leaf of a GLOBAL batch along its leading axis over ``mesh``.

    Device ``i`` of the mesh gets rows ``[i*b/n, (i+1)*b/n)``, so a loss that
    is a mean over the rows gives the gradient of the whole batch. Under
    `jax.distributed` every process passes the same global batch, or, with
    ``process_local=True``, only its own rows: process ``p`` of ``P`` passes
    rows ``[p*b/P, (p+1)*b/P)`` of the global batch (the rows of its devices
    in `make_mesh`'s order) and the global array is assembled with
    `jax.make_array_from_process_local_data` (no process reads the others'
    data). With one process both are the same.

    Args:
      batch: a pytree of arrays, each with a leading axis whose size is a
        multiple of the mesh size (of this process's devices of the mesh,
        with ``process_local``).
      mesh: a 1-D mesh (`make_mesh`).
      process_local: ``batch`` holds this process's rows only.

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
    if not isinstance(process_local, bool):
        raise TypeError(f"process_local must be True or False, got {process_local!r}")
    sharding = batch_sharding(mesh)
    n = mesh.devices.size
    where = "devices of the mesh"
    if process_local:
        n = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
        where = f"devices of process {jax.process_index()} in the mesh"
    leaves, treedef = jax.tree_util.tree_flatten_with_path(batch)
    out = []
    for path, leaf in leaves:
        shape = np.shape(leaf)
        if not shape or n == 0 or shape[0] % n:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
                f"{shape}: its leading (batch) axis must be a multiple of the "
                f"{n} {where}"
            )
        if process_local:
            out.append(jax.make_array_from_process_local_data(sharding, leaf))
        else:
            out.append(_place(leaf, sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


def to_host(tree: Any) -> Any:
    """Every array leaf of ``tree`` as a numpy array of its GLOBAL value.

    A leaf this process holds completely (one process, or a replicated
    leaf) is read from its own devices; a leaf split over several processes
    (FSDP under `jax.distributed`) is all-gathered, so with several
    processes it is a collective: every process must call it, in the same
    order, on the same tree. Used by `fit` for checkpoints, error reports
    and `jaxstable.diagnostics.locate` of a multi-process run.

    Args:
      tree: a pytree; leaves that are not `jax.Array` s are kept as they are.

    Returns:
      The same pytree, its `jax.Array` leaves numpy arrays (typed PRNG keys
      are kept as they are when fully addressable).

    """
    from jax.experimental import multihost_utils

    def gathered(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    def is_key(x):
        return isinstance(x, jax.Array) and jax.dtypes.issubdtype(
            x.dtype, jax.dtypes.prng_key
        )

    tree = jax.tree.map(gathered, tree)
    # One device-to-host transfer for the rest (typed PRNG keys kept).
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    moved = [x for x in leaves if isinstance(x, jax.Array) and not is_key(x)]
    it = iter(jax.device_get(moved))
    out = [
        next(it) if isinstance(x, jax.Array) and not is_key(x) else x for x in leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def global_mean(values: Any, mask: Any = None, *, axis_name: str | None = None):
    """The mean of ``values`` over the GLOBAL batch, weighted by ``mask``.

    ``sum(values * mask) / sum(mask)`` over every element of every replica:
    what one device computes over the whole batch, also when the replicas
    hold different numbers of counted elements (labels equal to
    ``ignore_index``, padding, empty boxes). The mean of each replica's own
    mean is not that (measured: 1.797 instead of 1.283 with unevenly
    labelled rows on 2 replicas, 0.568 instead of 1.136 when one replica has
    no label, and the params 0.144 off after training).

    * ``axis_name=None``: under `jax.jit` with shardings (or one device) the
      sums are global already: a plain masked mean.
    * ``axis_name`` (inside `jax.shard_map` over that axis, with
      ``make_train_step(..., axis_name=...)``): the ``(sum, count)`` pair is
      `lax.psum`-ed (one all-reduce of two floats). The VALUE returned is
      the global mean on every replica; its GRADIENT is N times this
      replica's share, ``N * d sum_r / count``: the step differentiates
      ``loss / N`` on each replica and sums the gradients, which then add up
      to one device's gradient of the global mean. torchref's
      `global_mean` is the same under DDP (which averages the gradients).

    Nothing counted anywhere (all ignored, ``count == 0``): 0.0 with a zero
    gradient, as `jaxstable.losses.softmax_cross_entropy` returns for an
    all-ignored batch (torch's mean gives NaN, 0/0).

    Args:
      values: per-element losses, e.g. ``softmax_cross_entropy(...,
        reduction="none")`` (0 where the label is ignored).
      mask: None (every element counts 1), or booleans or non-negative
        weights broadcastable to ``values`` (e.g. ``labels != ignore_index``,
        or the class weights of the labels for a weighted mean).
      axis_name: None, or the `jax.shard_map` axis the replicas run over.

    Returns:
      A float32 scalar.

    Raises:
      ValueError: ``axis_name`` is not an axis of the enclosing
        `jax.shard_map` (names the axes there are).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxstable import distributed, losses
      >>> logits = jnp.array([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0], [3.0, 0.0]])
      >>> labels = jnp.array([0, -1, -1, 1])  # replica 1 holds 1 label of 2
      >>> def loss(logits, labels):
      ...     per = losses.softmax_cross_entropy(logits, labels, ignore_index=-1,
      ...                                        reduction="none")
      ...     return distributed.global_mean(per, labels != -1)
      >>> one = loss(logits, labels)  # one device: the mean over 2 labels
      >>> kept = jnp.array([0, 3])
      >>> bool(jnp.allclose(one, losses.softmax_cross_entropy(logits[kept],
      ...                                                     labels[kept])))
      True
      >>> def replica_loss(x, y):  # the value is the same on every replica
      ...     per = losses.softmax_cross_entropy(x, y, ignore_index=-1,
      ...                                        reduction="none")
      ...     return distributed.global_mean(per, y != -1, axis_name="data")[None]
      >>> dp = jax.shard_map(replica_loss, mesh=distributed.make_mesh(1),
      ...                    in_specs=(P("data"), P("data")), out_specs=P("data"))
      >>> bool(jnp.allclose(dp(logits, labels), one))
      True
    """
    values = jnp.asarray(values, jnp.float32)
    if mask is None:
        weights = jnp.ones_like(values)
    else:
        weights = jnp.broadcast_to(jnp.asarray(mask, jnp.float32), values.shape)
    # where, not values * weights: a masked-out NaN/inf (a padded row) must
    # not reach the sum (inf * 0 = NaN).
    total = jnp.sum(jnp.where(weights != 0, values * weights, 0.0))
    count = jnp.sum(weights)
    if axis_name is None:
        return jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)
    replicas = axis_size(axis_name, "global_mean")
    totals = jax.lax.psum(jax.lax.stop_gradient(jnp.stack([total, count])), axis_name)
    safe = jnp.where(totals[1] > 0, totals[1], 1.0)
    value = jnp.where(totals[1] > 0, totals[0] / safe, 0.0)
    share = jnp.where(totals[1] > 0, replicas * total / safe, 0.0)
    return share + jax.lax.stop_gradient(value - share)


def axis_size(axis_name: str, where: str) -> int:
    """The size of the `jax.shard_map` axis ``axis_name``, or a ValueError
    naming the axes that are there (jax's own error is a bare NameError or,
    from `lax.pcast`, an AssertionError)."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        pass
    manual = tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
    if manual:
        there = f"the enclosing jax.shard_map maps the axes {manual}"
    else:
        there = (
            "it is not called inside jax.shard_map (under jax.jit with "
            "shardings, leave axis_name=None: the reductions are global there)"
        )
    raise ValueError(
        f"{where}(axis_name={axis_name!r}): {axis_name!r} is not a mapped axis "
        f"here; {there}"
    )


def all_processes(data: bytes) -> list[bytes]:
    """``data`` of every process, by process index (a collective)."""
    from jax.experimental import multihost_utils

    # Two gathers: the lengths, then the bytes padded to the longest.
    mine = np.frombuffer(data, np.uint8)
    sizes = multihost_utils.process_allgather(np.int32(mine.size))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[: mine.size] = mine
    every = multihost_utils.process_allgather(padded)
    return [bytes(row[:size]) for row, size in zip(every, np.ravel(sizes), strict=True)]


def _digests(tree: Any) -> dict[str, str]:
    """``{"leaf i at index": sha256}`` of this process's copies, or raises
    `_Differ` naming a slice whose local copies differ."""
    out: dict[str, str] = {}
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, leaf in leaves:
        if not isinstance(leaf, jax.Array):
            continue
        name = jax.tree_util.keystr(path) or "<root>"
        for shard in leaf.addressable_shards:
            key = f"{name} {shard.index!r}"
            data = np.asarray(shard.data).tobytes()
            digest = hashlib.sha256(data).hexdigest()
            if out.setdefault(key, digest) != digest:
                raise _Differ(key)
    return out


class _Differ(Exception):
    pass


def _first_difference(tree: Any) -> str | None:
    """The first slice (leaf path and index) whose copies differ on some
    device of any process, or None. A collective with several processes."""
    try:
        mine = _digests(tree)
        local = None
    except _Differ as e:
        mine, local = {}, str(e)
    if jax.process_count() == 1:
        return local
    payload = json.dumps({"local": local, "digests": mine}).encode()
    seen: dict[str, tuple[int, str]] = {}
    for process, raw in enumerate(all_processes(payload)):
        got = json.loads(raw)
        if got["local"] is not None:
            return f"{got['local']} (on process {process})"
        for key, digest in got["digests"].items():
            first = seen.setdefault(key, (process, digest))
            if first[1] != digest:
                return f"{key} (process {first[0]} and process {process} differ)"
    return None


def replicas_identical(tree: Any) -> bool:
    """Whether every copy of every array leaf is bitwise equal to the others.

    For each leaf, the shards that hold the same slice (all of them for a
    replicated leaf) are compared byte for byte (NaN payloads included), on
    this process's devices and, under `jax.distributed`, across processes:
    each process hashes its copies (sha256) and the digests are gathered
    (two small all-gathers), so processes that started from different
    states are told apart. With several processes it is a collective:
    every process must call it, on the same tree.

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
    return _first_difference(tree) is None


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
