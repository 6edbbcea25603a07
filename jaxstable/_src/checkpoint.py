"""Checkpoints of a `TrainState` on orbax-checkpoint.

One checkpoint is a directory that orbax writes under a temporary name and
renames once complete, so a crash mid-save never leaves a partial
checkpoint under the final name. It holds two items: ``state`` (the
`TrainState` as a state dict: params, optimizer state with its skip
counters, every loss-scale field, model state, step, skipped_total) and
``meta`` (JSON: the format, the run's global step, the data position, the
optimizer state's type names and a sha256 of every saved leaf, so that a
flipped byte is caught rather than loaded).

Files of the older flax-msgpack format (a single file) are still read by
`load_checkpoint`: telling a file from a directory costs nothing.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any

import jax
import numpy as np
from flax import serialization

from jaxstable._src.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jaxstable._src.step import TrainState

__all__ = ["CheckpointManager", "load_checkpoint", "save_checkpoint"]

_FORMAT = "jaxstable-checkpoint-1"
# Top-level key of an old msgpack file (not a TrainState field) naming the
# optimizer state's types: two optimizers can share a state layout (adam's
# and adabelief's are both (count, mu, nu)) but not their type names.
_TYPES_KEY = "_types"
# Mismatch lines listed in one error; the rest are counted.
_MAX_MISMATCH_LINES = 12


class _CorruptCheckpoint(ValueError):
    """A checkpoint that cannot be read back as saved (truncated, damaged)."""


def _ocp():
    # Imported on first use: orbax adds ~1.3 s to `import jaxstable`.
    import orbax.checkpoint as ocp

    return ocp


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{path: leaf}`` of a nested state dict, paths as in `_leaf_specs`."""
    if tree is None:
        return {}
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_leaves(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    return {prefix or "<root>": tree}


def _digest(tree: Any) -> str:
    """sha256 over every leaf's path, dtype, shape and bytes."""
    h = hashlib.sha256()
    for path, leaf in sorted(_leaves(tree).items()):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{path}|{a.dtype}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _payload(state: Any, step: int | None, data_position: int | None):
    """The two items of a checkpoint: the state dict and its JSON meta."""
    tree = serialization.to_state_dict(jax.device_get(state))
    types = _state_types(state.opt_state) if isinstance(state, TrainState) else None
    meta = {
        "format": _FORMAT,
        "step": step,
        "data_position": step if data_position is None else int(data_position),
        "types": {"opt_state": types},
        "sha256": _digest(tree),
    }
    ocp = _ocp()
    return ocp.args.Composite(
        state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)
    )


def _read(path: Any) -> tuple[Any, dict]:
    """The state dict and meta of the checkpoint directory `path`, checked
    against its sha256; `_CorruptCheckpoint` naming it when that fails."""
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
    if meta.get("format") != _FORMAT or meta.get("sha256") != _digest(out.state):
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} is corrupt: its arrays do not match "
            "the sha256 saved with them"
        )
    return out.state, meta


def _place(new: Any, old: Any) -> Any:
    # Onto the target's device and sharding (a sharded target gets sharded
    # arrays); a non-array target leaf takes the saved value as it is. An
    # uncommitted target leaf (a one-device state never device_put) gets an
    # uncommitted array: a committed one would make the jitted step compile
    # again on its first call after a restore (5.4 s instead of 0.6 ms for
    # the 4-leaf MLP of tests/test_distributed.py, on a loaded 2-core CPU).
    if not isinstance(old, jax.Array):
        return new
    return jax.device_put(new, old.sharding if old.committed else None)


def _restore_onto(path: Any, raw: Any, saved_types: Any, target: Any) -> Any:
    _check_loss_scale_type(path, raw, target)
    _check_optimizer_types(path, saved_types, target)
    _check_same_structure(
        path, _leaf_specs(raw), _leaf_specs(serialization.to_state_dict(target))
    )
    restored = serialization.from_state_dict(target, raw)
    # Leaf by leaf: static fields (a loss scale's period) may differ.
    leaves, treedef = jax.tree_util.tree_flatten(restored)
    placed = map(_place, leaves, jax.tree_util.tree_leaves(target))
    return jax.tree_util.tree_unflatten(treedef, list(placed))


def save_checkpoint(
    path: str | os.PathLike, state: Any, *, data_position: int | None = None
) -> None:
    """Writes `state` as an orbax checkpoint directory at `path` (replaced if present).

    Every pytree field is saved (loss-scale fields and skip counters
    included), with the optimizer state's type names, so that
    `load_checkpoint` can refuse a checkpoint of another optimizer by name,
    and a sha256 of the leaves, so that a damaged one is refused too. The
    write is atomic (orbax renames a complete temporary directory). For a
    run, `CheckpointManager` keeps several, by global step.

    Args:
      path: the checkpoint directory to write.
      state: a `TrainState` or any flax-serialisable pytree.
      data_position: batches of the run consumed so far (kept in the meta;
        `CheckpointManager.restore` returns it), or None.

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
    target, without a word. Arrays are placed on the devices and shardings
    of `target`'s arrays. A file (not a directory) is read as the older
    flax-msgpack format, without a checksum.

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
        return _restore_onto(path, raw, saved_types, target)
    raw, meta = _read(path)
    return _restore_onto(path, raw, meta.get("types"), target)


def _fsync_tree(root: str) -> None:
    """fsync every file and directory under `root`, and `root`'s parent.

    orbax renames a complete directory but does not fsync it: after a power
    loss the rename could survive while file contents did not.
    """
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(folder)
    _fsync_dir(os.path.dirname(root))


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    """One validator for every int option: ``name must be [None or ]an int >= m``."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = "None or " if optional else ""
        raise ValueError(f"{name} must be {none}an int >= {minimum}, got {value!r}")


class CheckpointManager:
    """The checkpoints of one run in a directory, named by the run's global step.

    Built on `orbax.checkpoint.CheckpointManager`. Checkpoint n lives in
    ``directory/step_{n:08d}`` (n: steps of the run done, not steps of one
    `fit` call). It keeps the last `max_to_keep` checkpoints and, with
    `best_metric`, also the best one by that metric. With `async_save` a
    save returns once the state is on the host and orbax writes it in the
    background (the next save, `wait` or `close` waits for it); a crash
    mid-save leaves only orbax's temporary directory, which the next
    manager on the directory removes. Finished checkpoints are fsynced (at
    the next save, `wait` or `close`).

    `restore` takes the latest intact checkpoint: a truncated or damaged
    one (unreadable, or its sha256 differs) gives a `RuntimeWarning` naming
    it and the one before it is tried. A checkpoint of another model,
    optimizer or loss scale raises the `load_checkpoint` ValueError.

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
        _check_int("max_to_keep", max_to_keep, 1)
        if best_metric is not None and not isinstance(best_metric, str):
            raise TypeError(f"best_metric must be None or a str, got {best_metric!r}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        ocp = _ocp()
        pol = ocp.checkpoint_managers
        policies = [pol.LatestN(n=max_to_keep)]
        best_fn = None
        if best_metric is not None:
            best_fn = lambda m: m[best_metric]  # noqa: E731
            policies.append(
                pol.BestN(
                    get_metric_fn=best_fn,
                    reverse=best_mode == "min",
                    n=1,
                    keep_checkpoints_without_metrics=False,
                )
            )
        options = ocp.CheckpointManagerOptions(
            best_fn=best_fn,
            best_mode=best_mode,
            preservation_policy=pol.AnyPreservationPolicy(policies),
            step_prefix="step",
            step_format_fixed_length=8,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=bool(async_save),
        )
        self.directory = os.path.abspath(directory)
        self.best_metric = best_metric
        self._mgr = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )
        self._synced = set(self.steps())

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{step:08d}")

    def steps(self) -> list[int]:
        """The global steps of the checkpoints on disk, ascending."""
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        """The highest global step on disk, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The step of the best checkpoint by `best_metric` (None without one)."""
        return None if self.best_metric is None else self._mgr.best_step()

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
        _check_int("step", step, 0)
        self.wait()  # orbax would wait for the previous save anyway
        if step in self._mgr.all_steps():
            self._mgr.delete(step)  # a re-run past a damaged checkpoint
        kept = None
        if self.best_metric is not None and metrics and self.best_metric in metrics:
            kept = {self.best_metric: float(metrics[self.best_metric])}
        args = _payload(state, step, data_position)
        self._mgr.save(step, args=args, metrics=kept, force=True)

    def wait(self) -> None:
        """Waits for a background save to finish and fsyncs finished ones."""
        self._mgr.wait_until_finished()
        for step in set(self.steps()) - self._synced:
            _fsync_tree(self._path(step))
            self._synced.add(step)

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """The latest intact checkpoint (or checkpoint `step`) restored onto `target`.

        Returns:
          ``(state, info)`` with ``info = {"step": n, "data_position": p}``.

        Raises:
          FileNotFoundError: no intact checkpoint (each damaged one warned of).
          ValueError: the checkpoint does not match `target` (see
            `load_checkpoint`), or `step` is given and damaged.
        """
        self.wait()
        candidates = [step] if step is not None else self.steps()[::-1]
        for n in candidates:
            try:
                raw, meta = _read(self._path(n))
            except _CorruptCheckpoint as e:
                if step is not None:
                    raise
                warnings.warn(
                    f"{e}; trying the checkpoint before it", RuntimeWarning, 2
                )
                continue
            state = _restore_onto(self._path(n), raw, meta.get("types"), target)
            return state, {"step": n, "data_position": meta["data_position"]}
        raise FileNotFoundError(
            f"no intact checkpoint in {self.directory!r} (steps on disk: "
            f"{self.steps()})"
        )

    def close(self) -> None:
        """Waits for pending saves, then releases orbax's manager."""
        self.wait()
        self._mgr.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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


def _leaf_specs(tree: Any, prefix: str = "") -> dict[str, tuple[tuple, str]]:
    """``{path: (shape, dtype)}`` of every leaf of a nested state dict.

    Paths join the keys with "/" (``params/w1``). A Python number is
    ``((), "int")`` etc.; None and empty containers hold no leaf.
    """
    if tree is None:
        return {}
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_leaf_specs(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    key = prefix or "<root>"  # a checkpoint of a single array
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return {key: (tuple(tree.shape), str(tree.dtype))}
    return {key: ((), type(tree).__name__)}


def _check_same_structure(
    path: Any, saved: dict[str, tuple], expected: dict[str, tuple]
) -> None:
    """Raises ValueError listing every leaf that differs (saved vs expected).

    ``saved`` and ``expected`` map a leaf path to ``(shape, dtype)`` (see
    `_leaf_specs`): the check does not depend on the file format.
    """
    _raise_mismatches(path, _structure_mismatches(saved, expected))


def _structure_mismatches(saved: dict[str, tuple], expected: dict[str, tuple]):
    """One line per leaf missing, extra, or of another shape or dtype."""
    lines = []
    # The target's order (params before opt_state), then the checkpoint's extras.
    for key in [*expected, *(k for k in saved if k not in expected)]:
        s, e = saved.get(key), expected.get(key)
        if s is None:
            lines.append(f"  {key}: missing from the checkpoint (target {_spec(e)})")
        elif e is None:
            lines.append(f"  {key}: in the checkpoint ({_spec(s)}), not in the target")
        elif s != e:
            lines.append(f"  {key}: checkpoint {_spec(s)}, target {_spec(e)}")
    return lines


def _raise_mismatches(path: Any, lines: list[str]) -> None:
    # Same text as torchref.train.load_checkpoint.
    if not lines:
        return
    more = len(lines) - _MAX_MISMATCH_LINES
    shown = lines[:_MAX_MISMATCH_LINES] + (
        [f"  ... and {more} more"] if more > 0 else []
    )
    raise ValueError(
        f"checkpoint {os.fspath(path)!r} does not match the target "
        f"({len(lines)} leaf/leaves differ):\n" + "\n".join(shown) + "\nbuild the "
        "target with the model, optimizer and dtypes the checkpoint was saved with"
    )


def _spec(spec: tuple) -> str:
    shape, dtype = spec
    return f"{shape} {dtype}"


def _loss_scale_kind(fields: dict) -> str:
    known = {
        frozenset(serialization.to_state_dict(cls())): cls.__name__
        for cls in (NoOpLossScale, StaticLossScale, DynamicLossScale)
    }
    return known.get(
        frozenset(fields), f"an unknown loss scale with fields {sorted(fields)}"
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
            f"checkpoint {os.fspath(path)!r} holds a {_loss_scale_kind(saved)} "
            f"but target.loss_scale is a {type(ls).__name__}: build the target "
            "with the loss-scale type the checkpoint was saved with"
        )
