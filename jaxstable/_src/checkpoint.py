"""Checkpoints of a `TrainState` (or any pytree) on orbax-checkpoint.

One checkpoint is a directory that orbax writes under a temporary name and
renames once complete, so a crash mid-save never leaves a partial
checkpoint under the final name. It holds two items: ``state`` (the leaves,
a list of numpy arrays) and ``meta`` (JSON: the format, the run's global
step, the data position, the metrics, `fit`'s NaN-policy state, the
optimizer state's and loss scale's type names, each leaf's path, shape and
dtype, and a sha256 over all of these and every leaf's bytes, so that a
flipped bit anywhere, the data position included, is caught rather than
loaded).

Any pytree JAX can flatten is saved: through flax's state dicts where flax
knows the type (a `TrainState`, a loss scale with its period, FrozenDict,
NamedTuples), through JAX's own flattening elsewhere (``nnx.State``,
dataclasses). A typed PRNG key is saved as its key data and implementation
name, a zero-size array as its shape and dtype (orbax refuses to write
one), None as no leaf; a restore rebuilds the target's own structure and
types.

Older checkpoints are still read: format 1 (``jaxstable-checkpoint-1``,
whose sha256 covered the arrays only) and flax-msgpack files. Their data
position is not under a checksum, and they hold no NaN-policy state.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from _stablecore.checkpoint import CorruptCheckpoint as _CorruptCheckpoint
from _stablecore.checkpoint import check_manager_options as _check_manager_options
from _stablecore.checkpoint import fsync_tree as _fsync_tree
from _stablecore.checkpoint import raise_mismatches as _raise_mismatches
from _stablecore.checks import check_int as _check_int
from _stablecore.lock import locked_elsewhere
from jaxstable._src.distributed import _to_host
from jaxstable._src.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jaxstable._src.step import TrainState

__all__ = ["CheckpointManager", "load_checkpoint", "save_checkpoint"]

_FORMAT = "jaxstable-checkpoint-2"
_FORMAT_1 = "jaxstable-checkpoint-1"
# Top-level key of an old msgpack file (not a TrainState field) naming the
# optimizer state's types: two optimizers can share a state layout (adam's
# and adabelief's are both (count, mu, nu)) but not their type names.
_TYPES_KEY = "_types"
_NAME = re.compile(r"^step_(\d{8,})$")
# orbax writes checkpoint n under this name, renamed to step_n once complete.
_TMP = re.compile(r"^step_\d{8,}\.orbax-checkpoint-tmp")
# What a checkpoint stores as a leaf; any other pytree node is walked into.
_VALUES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def _ocp():
    # Imported on first use: orbax adds ~1.3 s to `import jaxstable`.
    import orbax.checkpoint as ocp

    return ocp


def _primary() -> bool:
    # Several processes (jax.distributed) save one checkpoint together:
    # process 0 alone removes, prunes and fsyncs.
    return jax.process_index() == 0


# -- leaves and paths ----------------------------------------------------------


def _key_name(entry: Any) -> str:
    """``DictKey('w')``, ``GetAttrKey('w')``, ``SequenceKey(0)``... as "w", "0"."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _path_str(path: tuple[str, ...]) -> str:
    return "/".join(path) or "<root>"  # "<root>": a checkpoint of one array


def _children(node: Any, path: tuple[str, ...]) -> tuple[list, Any]:
    """One level of JAX's flattening of `node`: ``([(key, child)], treedef)``."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )
    if len(pairs) == 1 and not pairs[0][0]:  # a JAX leaf that is no value
        raise TypeError(
            f"cannot checkpoint {_path_str(path)}: a {type(node).__name__} (a "
            "checkpoint holds arrays, numbers, typed PRNG keys and the pytrees "
            "around them)"
        )
    return [(_key_name(p[0]), child) for p, child in pairs], treedef


def _flat(tree: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """``{path: leaf}`` of any pytree, in the tree's order.

    flax's state dict where flax knows the type (it keeps a loss scale's
    period, which JAX's flattening leaves out), JAX's flattening elsewhere
    (an ``nnx.State``, a dataclass); None and empty containers hold no leaf.
    """
    tree = serialization.to_state_dict(tree)
    if tree is None:
        return {}
    if isinstance(tree, _VALUES):
        return {path: tree}
    if type(tree) is dict:
        items = [(str(k), v) for k, v in tree.items()]
    else:
        items = _children(tree, path)[0]
    out = {}
    for key, child in items:
        out.update(_flat(child, (*path, key)))
    return out


def _is_key(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and jnp.issubdtype(
        leaf.dtype, jax.dtypes.prng_key
    )


def _spec(leaf: Any) -> tuple[tuple, str]:
    """``(shape, dtype)``; a Python number is ``((), "int")`` etc."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return tuple(leaf.shape), str(leaf.dtype)
    return (), type(leaf).__name__


def _encode(tree: Any, first_index: int = 0) -> tuple[list[dict], list[np.ndarray]]:
    """``(entries, arrays)``: one JSON entry per leaf (path, shape, dtype and
    how it is stored) and the arrays orbax writes (none for a zero-size one)."""
    flat = _flat(tree)
    entries = []
    for path, leaf in flat.items():
        shape, dtype = _spec(leaf)
        entry = {"path": list(path), "shape": list(shape), "dtype": dtype}
        if _is_key(leaf):
            entry["impl"] = str(jax.random.key_impl(leaf))
        entries.append(entry)
    # Key data, then one device-to-host transfer for all the leaves.
    leaves = [jax.random.key_data(x) if _is_key(x) else x for x in flat.values()]
    arrays = []
    # _to_host: under jax.distributed a leaf split over several processes
    # (FSDP) is all-gathered, so that every process writes, and hashes, the
    # same global values (every process calls save, in the same order).
    for entry, leaf in zip(entries, _to_host(leaves), strict=True):
        data = np.asarray(leaf)
        entry["data"] = [list(data.shape), data.dtype.name]
        if data.size:
            entry["index"] = first_index + len(arrays)
            # order="C", not ascontiguousarray: that makes a 0-d array (1,).
            arrays.append(np.asarray(data, order="C"))
    return entries, arrays


def _decode(entries: list[dict], arrays: list) -> tuple[dict, dict]:
    """``({path: value}, {path: (shape, dtype)})`` of saved `entries`."""
    values, specs = {}, {}
    for e in entries:
        path = tuple(e["path"])
        shape, dtype = e["data"]
        data = arrays[e["index"]] if "index" in e else np.zeros(shape, jnp.dtype(dtype))
        if "impl" in e:
            data = jax.random.wrap_key_data(data, impl=e["impl"])
        values[path] = data
        specs[path] = (tuple(e["shape"]), e["dtype"])
    return values, specs


def _digest(body: dict, arrays: list) -> str:
    """sha256 over the meta (all but the digest) and every array's bytes."""
    h = hashlib.sha256(json.dumps(body, sort_keys=True).encode())
    for a in arrays:
        a = np.asarray(a, order="C")
        h.update(f"|{a.dtype.name}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _migrate_v1(raw: Any) -> Any:
    """A format-1 (or msgpack) state dict in today's field names: its
    `DynamicLossScale` had one ``factor`` (growth; back-off 1 / factor),
    today's has GradScaler's two, ``growth_factor`` and ``backoff_factor``."""
    ls = raw.get("loss_scale") if isinstance(raw, dict) else None
    if isinstance(ls, dict) and "factor" in ls and "growth_factor" not in ls:
        ls = dict(ls)
        factor = float(np.asarray(ls.pop("factor")))
        ls["growth_factor"], ls["backoff_factor"] = factor, 1.0 / factor
        raw = {**raw, "loss_scale": ls}
    return raw


def _leaves_v1(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{path: leaf}`` of a format-1 state dict (as its digest saw it)."""
    if tree is None:
        return {}
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_leaves_v1(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    return {prefix or "<root>": tree}


def _digest_v1(tree: Any) -> str:
    """Format 1's sha256: every leaf's path, dtype, shape and bytes."""
    h = hashlib.sha256()
    for path, leaf in sorted(_leaves_v1(tree).items()):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{path}|{a.dtype}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


# -- writing and reading one checkpoint ----------------------------------------


def _types(state: Any) -> dict[str, str | None]:
    if not isinstance(state, TrainState):
        return {"opt_state": None, "loss_scale": None}
    return {
        "opt_state": _state_types(state.opt_state),
        "loss_scale": type(state.loss_scale).__name__,
    }


def _payload(
    state: Any,
    step: int | None,
    data_position: int | None,
    metrics: dict | None = None,
    fit_state: dict | None = None,
    snapshot: Any = None,
):
    """The two orbax items of a checkpoint: the arrays and their JSON meta."""
    entries, arrays = _encode(state)
    # A copy of fit's bookkeeping: orbax writes the meta in the background,
    # after the loop has gone on (and would have changed a live list).
    fit_state = json.loads(json.dumps(fit_state))
    metrics = json.loads(json.dumps(metrics))
    body = {
        "format": _FORMAT,
        "step": step,
        "data_position": step if data_position is None else int(data_position),
        "metrics": metrics,
        "fit_state": fit_state,
        "types": _types(state),
        "leaves": entries,
    }
    if snapshot is not None:  # fit's rollback snapshot, a state like `state`
        body["snapshot"], more = _encode(snapshot, len(arrays))
        arrays += more
    body["arrays"] = len(arrays)
    meta = {**body, "sha256": _digest(body, arrays)}
    ocp = _ocp()
    # orbax refuses an empty tree: a state of zero-size arrays alone gets one
    # placeholder byte, outside the digest and never read.
    stored = arrays or [np.zeros((), np.uint8)]
    return ocp.args.Composite(
        state=ocp.args.StandardSave(stored), meta=ocp.args.JsonSave(meta)
    )


class _Loaded(NamedTuple):
    """A checkpoint read and checked, not yet restored onto a target."""

    values: dict  # {path: value}
    specs: dict  # {path: (shape, dtype)}
    types: Any  # the saved type names (None in an older file)
    meta: dict
    raw: Any  # format 1 / msgpack: the state dict (for its loss-scale check)
    snapshot: tuple | None  # (values, specs) of fit's rollback snapshot


def _read(path: Any, step: int | None = None) -> _Loaded:
    """The checkpoint directory `path`, checked against its sha256 (and, for a
    manager's checkpoint `step`, against that step); `_CorruptCheckpoint`
    naming it when that fails."""
    ocp = _ocp()
    args = ocp.args.Composite(
        state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()
    )
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            out = ckptr.restore(os.path.abspath(path), args=args)
    except Exception as e:  # orbax and tensorstore raise many types
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} cannot be read "
            f"({type(e).__name__}: {first})"
        ) from e
    meta = out.meta if isinstance(out.meta, dict) else {}
    if meta.get("format") == _FORMAT_1 and meta.get("sha256") == _digest_v1(out.state):
        raw = _migrate_v1(out.state)
        values = _flat(raw)
        specs = {p: _spec(v) for p, v in values.items()}
        return _Loaded(values, specs, meta.get("types"), meta, raw, None)
    body = {k: v for k, v in meta.items() if k != "sha256"}
    n = body.get("arrays")
    arrays = out.state if isinstance(out.state, list) else []
    intact = (
        meta.get("format") == _FORMAT
        and isinstance(n, int)
        and n <= len(arrays)
        and meta.get("sha256") == _digest(body, arrays[:n])
    )
    if not intact:
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} is corrupt: its arrays or meta "
            "(data position, step, NaN-policy state) do not match the sha256 "
            "saved with them"
        )
    if step is not None and meta.get("step") not in (None, step):
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} is not checkpoint {step}: its meta "
            f"names step {meta.get('step')}"
        )
    values, specs = _decode(meta["leaves"], arrays)
    snapshot = None
    if meta.get("snapshot") is not None:
        snapshot = _decode(meta["snapshot"], arrays)
    return _Loaded(values, specs, meta.get("types"), meta, None, snapshot)


def _place(new: Any, old: Any) -> Any:
    # Onto the target's device and sharding (a sharded target gets sharded
    # arrays). An uncommitted target leaf (a one-device state never
    # device_put) gets an uncommitted array: a committed one would make the
    # jitted step compile again on its first call after a restore (5.4 s
    # instead of 0.6 ms for the 4-leaf MLP of tests/test_distributed.py, on
    # a loaded 2-core CPU).
    if not old.sharding.is_fully_addressable:
        # Several processes (jax.distributed): each one read the same global
        # value and fills in its own devices' slices of it.
        host = np.asarray(new)
        return jax.make_array_from_callback(host.shape, old.sharding, lambda i: host[i])
    return jax.device_put(new, old.sharding if old.committed else None)


def _as_leaf(value: Any, like: Any) -> Any:
    """`value` (a numpy array, or a key array) as a leaf of `like`'s type."""
    if isinstance(like, jax.Array):
        return _place(value, like)
    if isinstance(like, np.ndarray):
        return np.array(value, like.dtype)
    if isinstance(like, np.generic):
        return like.dtype.type(np.asarray(value))
    return type(like)(np.asarray(value).item())  # a Python number


def _rebuild(target: Any, values: dict, path: tuple[str, ...] = ()) -> Any:
    """`target`'s structure and types, its leaves taken from `values`."""
    tree = serialization.to_state_dict(target)
    return serialization.from_state_dict(target, _fill(tree, values, path))


def _fill(node: Any, values: dict, path: tuple[str, ...]) -> Any:
    # A flax state dict with the saved leaves in it; a node flax leaves as it
    # is (an nnx.State) is rebuilt here, flax's restore then keeps it.
    if node is None:
        return None
    if isinstance(node, _VALUES):
        return _as_leaf(values[path], node)
    if type(node) is dict:
        return {k: _fill(v, values, (*path, str(k))) for k, v in node.items()}
    pairs, treedef = _children(node, path)
    children = [_rebuild(c, values, (*path, k)) for k, c in pairs]
    return jax.tree_util.tree_unflatten(treedef, children)


def _restore_onto(path: Any, loaded: _Loaded, target: Any, snapshot=False) -> Any:
    """`loaded` (or its snapshot) restored onto `target`, after checking that
    both have the same types and leaves (refused with a ValueError)."""
    if loaded.raw is not None:
        _check_loss_scale_type(path, loaded.raw, target)
    else:
        _check_loss_scale_name(path, loaded.types, target)
    _check_optimizer_types(path, loaded.types, target)
    values, specs = loaded.snapshot if snapshot else loaded[:2]
    expected = {p: _spec(v) for p, v in _flat(target).items()}
    _check_same_structure(path, specs, expected)
    return _rebuild(target, values)


def save_checkpoint(
    path: str | os.PathLike, state: Any, *, data_position: int | None = None
) -> None:
    """Writes `state` as an orbax checkpoint directory at `path` (replaced if present).

    Every leaf is saved (loss-scale fields and skip counters included), with
    the optimizer state's and loss scale's type names, so that
    `load_checkpoint` can refuse a checkpoint of another optimizer by name,
    and a sha256 of the leaves and the meta, so that a damaged one is
    refused too. Any pytree JAX can flatten is accepted (see the module
    docstring: ``nnx.State``, typed PRNG keys, zero-size arrays...). The
    write is atomic (orbax renames a complete temporary directory). For a
    run, `CheckpointManager` keeps several, by global step.

    Args:
      path: the checkpoint directory to write.
      state: a `TrainState` or any pytree of arrays, numbers and PRNG keys.
      data_position: batches of the run consumed so far (kept in the meta;
        `CheckpointManager.restore` returns it), or None.

    Raises:
      TypeError: a leaf that is not an array, a number or a PRNG key (named
        by its path).

    Example:
      >>> import os, tempfile, jax.numpy as jnp, optax
      >>> from jaxstable import loss_scale, train
      >>> s = train.TrainState.create(params=jnp.ones(2), optimizer=optax.sgd(0.1),
      ...                             loss_scale=loss_scale.DynamicLossScale(period=7))
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
      >>> train.save_checkpoint(path, s)
      >>> blank = train.TrainState.create(params=jnp.zeros(2), optimizer=optax.sgd(0.1),
      ...                                 loss_scale=loss_scale.DynamicLossScale())
      >>> r = train.load_checkpoint(path, blank)
      >>> r.params.tolist(), r.loss_scale.period
      ([1.0, 1.0], 7)
    """
    ocp = _ocp()
    args = _payload(state, None, data_position)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(os.path.abspath(path), args=args, force=True)
    _fsync_tree(os.path.abspath(path))


def load_checkpoint(path: str | os.PathLike, target: Any) -> Any:
    """Reads a checkpoint written by `save_checkpoint` into the structure of `target`.

    Nothing is restored unless the checkpoint is intact (its sha256) and
    matches `target` exactly: the same loss-scale type, the same optimizer
    state types, and the same leaf paths with the same shapes and dtypes
    (params, optimizer state, model state, counters). flax alone would load
    a (2, 3) array into a (3, 3) target, or a float16 one into a float32
    target, without a word. Leaves are matched by their path (a dict's
    keys, a field's name), never by position. The result has `target`'s
    pytree structure and types (an ``nnx.State`` stays one, a typed PRNG key
    a typed key), its arrays on the devices and shardings of `target`'s. A
    file (not a directory) is read as the older flax-msgpack format,
    without a checksum.

    Args:
      path: the checkpoint directory (or an older msgpack file).
      target: a state of the same structure (supplies ``tx`` and types).

    Returns:
      The restored state.

    Raises:
      FileNotFoundError: no checkpoint at `path`.
      ValueError: naming the file and what is wrong: a damaged or truncated
        checkpoint; the checkpoint's loss scale is of another type than
        ``target.loss_scale`` (e.g. saved `DynamicLossScale`, target
        `NoOpLossScale`: restoring would drop or invent fields); its
        optimizer state types differ from those of ``target.tx`` (e.g.
        adam's into sgd's); or leaves are missing, extra, or of another shape
        or dtype (each listed with its path, saved vs expected).

    Example:
      >>> import os, tempfile, jax.numpy as jnp, optax
      >>> from jaxstable import train
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
      >>> s = train.TrainState.create(params=jnp.full(2, 3.0), optimizer=optax.sgd(0.1))
      >>> train.save_checkpoint(path, s)
      >>> blank = s.replace(params=jnp.zeros(2))
      >>> train.load_checkpoint(path, blank).params.tolist()
      [3.0, 3.0]
      >>> try:
      ...     train.load_checkpoint(path, s.replace(params=jnp.zeros(3)))
      ... except ValueError as e:
      ...     print(str(e).splitlines()[1])
        params: checkpoint (2,) float32, target (3,) float32
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {os.fspath(path)!r}")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            raw = serialization.msgpack_restore(f.read())
        saved_types = raw.pop(_TYPES_KEY, None) if isinstance(raw, dict) else None
        raw = _migrate_v1(raw)
        values = _flat(raw)
        specs = {p: _spec(v) for p, v in values.items()}
        loaded = _Loaded(values, specs, saved_types, {}, raw, None)
    else:
        loaded = _read(path)
    return _restore_onto(path, loaded, target)


# -- a run's checkpoints -------------------------------------------------------


class CheckpointManager:
    """The checkpoints of one run in a directory, named by the run's global step.

    Checkpoint n lives in ``directory/step_{n:08d}`` (n: steps of the run
    done, not steps of one `fit` call), written by orbax as
    `save_checkpoint` writes. After each save it keeps the last
    `max_to_keep` checkpoints up to that step and, with `best_metric`, also
    the best one by that metric; the mirror of
    `torchref.train.CheckpointManager`. Only this manager's own checkpoints
    count and are deleted: an entry named like one that is not (a stray file
    or directory ``step_00000099``) is left alone and takes no slot, and
    neither does a checkpoint past the step just saved (one a resume went
    back from). With `async_save` a save returns once the state is on the
    host and orbax writes it in the background (the next save, `wait` or
    `close` waits for it); a crash mid-save leaves only orbax's temporary
    directory, which the next manager on the directory removes (unless a
    run holds the directory's lock, see `fit`). Finished checkpoints are
    fsynced (at the next save, `wait` or `close`).

    `restore` takes the latest intact checkpoint: a truncated, damaged or
    foreign one (unreadable, or its sha256 differs) gives a
    `RuntimeWarning` naming it and the one before it is tried. A checkpoint
    of another model, optimizer or loss scale raises the `load_checkpoint`
    ValueError.

    Args:
      directory: the run's checkpoint directory (created if missing).
      max_to_keep: int >= 1, how many of the latest checkpoints to keep.
      best_metric: None, or the key of the ``metrics`` passed to `save`
        (e.g. ``"eval['loss']"``) whose best checkpoint is kept too.
      best_mode: ``"min"`` or ``"max"``: which value of `best_metric` is best.
      async_save: write in the background (orbax's async save).

    Example:
      >>> import tempfile, jax.numpy as jnp, optax
      >>> from jaxstable import train
      >>> s = train.TrainState.create(params=jnp.zeros(2), optimizer=optax.sgd(0.1))
      >>> with train.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2,
      ...                              best_metric="loss") as mgr:
      ...     for n, loss in [(10, 0.5), (20, 0.9), (30, 0.7)]:
      ...         mgr.save(n, s.replace(params=jnp.full(2, float(n))),
      ...                  metrics={"loss": loss})
      ...     mgr.wait()
      ...     restored, info = mgr.restore(s)
      ...     print(mgr.steps(), mgr.best_step(), info, restored.params.tolist())
      [10, 20, 30] 10 {'step': 30, 'data_position': 30} [30.0, 30.0]
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int = 3,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool = True,
    ) -> None:
        _check_manager_options(max_to_keep, best_metric, best_mode)
        self.directory = os.path.abspath(directory)
        self.max_to_keep = max_to_keep
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.async_save = bool(async_save)
        self._ckptr: Any = None
        self._writing: int | None = None  # the step of a save in flight
        self._scores: dict[int, float | None] = {}  # best_metric by step
        if _primary():
            os.makedirs(self.directory, exist_ok=True)
            if not locked_elsewhere(self.directory):  # a killed save's leftovers
                for name in os.listdir(self.directory):
                    if _TMP.match(name):
                        shutil.rmtree(os.path.join(self.directory, name), True)

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{step:08d}")

    def _checkpointer(self) -> Any:
        if self._ckptr is None:
            ocp = _ocp()
            kind = ocp.AsyncCheckpointer if self.async_save else ocp.Checkpointer
            self._ckptr = kind(ocp.CompositeCheckpointHandler())
        return self._ckptr

    def steps(self) -> list[int]:
        """The global steps of the entries named like checkpoints, ascending."""
        names = (_NAME.match(n) for n in os.listdir(self.directory))
        return sorted(int(m.group(1)) for m in names if m)

    def latest_step(self) -> int | None:
        """The highest global step on disk, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The step of the best checkpoint by `best_metric` (None without one)."""
        if self.best_metric is None:
            return None
        scored = []
        for n in self.steps():
            value = self._score(n)
            if value is not None and not math.isnan(value):
                scored.append((value if self.best_mode == "min" else -value, n))
        return min(scored)[1] if scored else None

    def _score(self, step: int) -> float | None:
        """`best_metric` of checkpoint `step` (its meta read once), or None."""
        if step not in self._scores:
            meta = _read_json(self._path(step)) or {}
            metrics = meta.get("metrics")
            if "metrics" not in meta:  # format 1: orbax's manager's own file
                metrics = _read_json(
                    os.path.join(self._path(step), "metrics", "metrics")
                )
            value = metrics.get(self.best_metric) if isinstance(metrics, dict) else None
            self._scores[step] = None if value is None else float(value)
        return self._scores[step]

    def save(
        self,
        step: int,
        state: Any,
        *,
        data_position: int | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> None:
        """Saves `state` as checkpoint `step` (replacing one of that step).

        Args:
          step: int >= 0, the run's global step.
          state: the `TrainState` (or pytree) to save.
          data_position: batches of the run consumed (default: `step`).
          metrics: a dict holding `best_metric` (other keys are ignored).
        """
        self._save(step, state, data_position, metrics)

    def _save(
        self,
        step: int,
        state: Any,
        data_position: int | None = None,
        metrics: dict[str, Any] | None = None,
        fit_state: dict | None = None,
        snapshot: Any = None,
    ) -> None:
        """`save`, plus what `fit` keeps: its NaN-policy state and rollback
        snapshot (both under the checksum)."""
        _check_int("step", step, 0)
        self.wait()
        kept = None
        if self.best_metric is not None and metrics and self.best_metric in metrics:
            kept = {self.best_metric: float(metrics[self.best_metric])}
        path = self._path(step)
        if _primary() and os.path.lexists(path) and not os.path.isdir(path):
            os.remove(path)  # a stray file of that name (orbax replaces a dir)
        args = _payload(state, step, data_position, kept, fit_state, snapshot)
        self._checkpointer().save(path, args=args, force=True)
        self._scores[step] = None if kept is None else kept[self.best_metric]
        self._writing = step
        if not self.async_save:
            self.wait()

    def _prune(self, latest: int) -> None:
        """Deletes this manager's checkpoints up to `latest` beyond the last
        `max_to_keep` (and the best one)."""
        ours = [n for n in self.steps() if n <= latest and _is_ours(self._path(n))]
        keep = set(ours[-self.max_to_keep :]) | {self.best_step()}
        for n in ours:
            if n not in keep:
                shutil.rmtree(self._path(n))
                self._scores.pop(n, None)

    def wait(self) -> None:
        """Waits for a background save to finish, fsyncs it and prunes."""
        if self._ckptr is not None and self.async_save:
            self._ckptr.wait_until_finished()
        step, self._writing = self._writing, None
        if step is not None and _primary():
            _fsync_tree(self._path(step))
            self._prune(step)

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """The latest intact checkpoint (or checkpoint `step`) restored onto `target`.

        Returns:
          ``(state, info)`` with ``info = {"step": n, "data_position": p}``;
          for a checkpoint written by `fit`, also ``"fit_state"`` (its
          NaN-policy state) and, when it saved one, ``"snapshot"`` (its
          rollback snapshot restored onto `target`).

        Raises:
          FileNotFoundError: no intact checkpoint (each damaged one warned of).
          ValueError: the checkpoint does not match `target` (see
            `load_checkpoint`), or `step` is given and damaged.
        """
        self.wait()
        candidates = [step] if step is not None else self.steps()[::-1]
        for n in candidates:
            path = self._path(n)
            try:
                loaded = _read(path, n)
            except _CorruptCheckpoint as e:
                if step is not None:
                    raise
                warnings.warn(
                    f"{e}; trying the checkpoint before it", RuntimeWarning, 2
                )
                continue
            state = _restore_onto(path, loaded, target)
            info = {"step": n, "data_position": loaded.meta["data_position"]}
            if loaded.meta.get("fit_state") is not None:
                info["fit_state"] = loaded.meta["fit_state"]
            if loaded.snapshot is not None:
                info["snapshot"] = _restore_onto(path, loaded, target, snapshot=True)
            return state, info
        raise FileNotFoundError(
            f"no intact checkpoint in {self.directory!r} (steps on disk: "
            f"{self.steps()})"
        )

    def close(self) -> None:
        """Waits for pending saves, then releases orbax's checkpointer."""
        self.wait()
        if self._ckptr is not None:
            self._ckptr.close()
            self._ckptr = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _read_json(path: str) -> Any:
    """The meta of checkpoint directory `path` (or the JSON file `path`
    itself), None if there is none readable."""
    try:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        ocp = _ocp()
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            return ckptr.restore(path, args=args).meta
    except Exception:  # not a checkpoint, or a damaged one
        return None


def _is_ours(path: str) -> bool:
    """A checkpoint directory as orbax writes it (its two items), not a stray
    entry of the same name: only those are counted and pruned."""
    return all(os.path.isdir(os.path.join(path, item)) for item in ("state", "meta"))


def _state_types(tree: Any) -> str:
    """The optimizer state's type names, e.g. ``(ScaleByAdamState, EmptyState)``.

    Arrays and containers of arrays (moments shaped like the params) give "".
    """
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # an optax state
        name = type(tree).__name__
        inner = [s for s in map(_state_types, tree) if s]
        return f"{name}({', '.join(inner)})" if inner else name
    if isinstance(tree, tuple | list):
        return "(" + ", ".join(map(_state_types, tree)) + ")"
    if isinstance(tree, dict):
        inner = [f"{k}: {s}" for k, v in tree.items() if (s := _state_types(v))]
        return "{" + ", ".join(inner) + "}" if inner else ""
    return ""


def _check_optimizer_types(path: Any, saved_types: Any, target: Any) -> None:
    opt_state = getattr(target, "opt_state", None)
    saved = saved_types.get("opt_state") if isinstance(saved_types, dict) else None
    if saved is None or opt_state is None:
        return  # an older file or a plain pytree: the leaf check still runs
    expected = _state_types(opt_state)
    if saved != expected:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} was saved with optimizer state "
            f"{saved} but target.tx's state is {expected}: build the target "
            "with the optimizer the checkpoint was saved with"
        )


def _check_same_structure(path: Any, saved: dict, expected: dict) -> None:
    """Raises ValueError listing every leaf that differs (saved vs expected).

    ``saved`` and ``expected`` map a leaf path (a tuple of keys) to
    ``(shape, dtype)`` (see `_spec`): the check does not depend on the file
    format.
    """
    saved = {_path_str(p): s for p, s in saved.items()}
    expected = {_path_str(p): s for p, s in expected.items()}
    _raise_mismatches(path, _structure_mismatches(saved, expected))


def _structure_mismatches(saved: dict[str, tuple], expected: dict[str, tuple]):
    """One line per leaf missing, extra, or of another shape or dtype."""
    lines = []
    # The target's order (params before opt_state), then the checkpoint's extras.
    for key in [*expected, *(k for k in saved if k not in expected)]:
        s, e = saved.get(key), expected.get(key)
        if s is None:
            lines.append(f"  {key}: missing from the checkpoint (target {_as_text(e)})")
        elif e is None:
            lines.append(
                f"  {key}: in the checkpoint ({_as_text(s)}), not in the target"
            )
        elif s != e:
            lines.append(f"  {key}: checkpoint {_as_text(s)}, target {_as_text(e)}")
    return lines


def _as_text(spec: tuple) -> str:
    shape, dtype = spec
    return f"{shape} {dtype}"


def _loss_scale_kind(fields: dict) -> str:
    known = {
        frozenset(serialization.to_state_dict(cls())): cls.__name__
        for cls in (NoOpLossScale, StaticLossScale, DynamicLossScale)
    }
    name = known.get(frozenset(fields))
    return (
        f"a {name}" if name else f"an unknown loss scale with fields {sorted(fields)}"
    )


def _check_loss_scale_type(path: Any, raw: Any, target: Any) -> None:
    ls = getattr(target, "loss_scale", None)
    if ls is None or not isinstance(raw, dict) or "loss_scale" not in raw:
        return
    expected = serialization.to_state_dict(ls)
    saved = raw["loss_scale"]
    if not (isinstance(expected, dict) and isinstance(saved, dict)):
        return  # a loss scale flax does not serialise field by field (jmp's)
    if set(saved) != set(expected):
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} holds {_loss_scale_kind(saved)} "
            f"but target.loss_scale is a {type(ls).__name__}: build the target "
            "with the loss-scale type the checkpoint was saved with"
        )


def _check_loss_scale_name(path: Any, types: Any, target: Any) -> None:
    saved = types.get("loss_scale") if isinstance(types, dict) else None
    if saved is None or not isinstance(target, TrainState):
        return
    have = type(target.loss_scale).__name__
    if saved != have:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} holds a {saved} but target.loss_scale "
            f"is a {have}: build the target with the loss-scale type the "
            "checkpoint was saved with"
        )
