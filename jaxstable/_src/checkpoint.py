"""Checkpoints of a `TrainState`: save, load, and a manager for a run."""

from __future__ import annotations

import os
from typing import Any

import jax
from flax import serialization

from jaxstable._src.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jaxstable._src.step import TrainState

# Top-level key of the file (not a TrainState field) naming the optimizer
# state's types: two optimizers can share a state layout (adam's and
# adabelief's are both (count, mu, nu)) but not their type names.
_TYPES_KEY = "_types"
# Mismatch lines listed in one error; the rest are counted.
_MAX_MISMATCH_LINES = 12


def save_checkpoint(path: str | os.PathLike, state: Any) -> None:
    """Writes `state` (every pytree field, loss-scale fields included) as flax msgpack.

    For a `TrainState` the file also names the types of the optimizer state
    (e.g. ``(ScaleByAdamState, EmptyState)``), so that `load_checkpoint` can
    refuse a checkpoint of another optimizer by name.

    Args:
      path: file to write.
      state: a `TrainState` or any flax-serialisable pytree.

    Example:
      >>> import os, tempfile, jax.numpy as jnp, optax
      >>> from jaxstable import loss_scale, train
      >>> s = train.TrainState.create(params=jnp.ones(2), optimizer=optax.sgd(0.1),
      ...                             loss_scale=loss_scale.DynamicLossScale(period=7))
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.msgpack")
      >>> train.save_checkpoint(path, s)
      >>> blank = train.TrainState.create(params=jnp.zeros(2), optimizer=optax.sgd(0.1),
      ...                                 loss_scale=loss_scale.DynamicLossScale())
      >>> r = train.load_checkpoint(path, blank)
      >>> r.params.tolist(), r.loss_scale.period
      ([1.0, 1.0], 7)
    """
    tree = serialization.to_state_dict(jax.device_get(state))
    if isinstance(state, TrainState):
        tree[_TYPES_KEY] = {"opt_state": _state_types(state.opt_state)}
    data = serialization.msgpack_serialize(tree)
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # atomic: a crash never leaves half a checkpoint


def load_checkpoint(path: str | os.PathLike, target: Any) -> Any:
    """Reads a checkpoint written by `save_checkpoint` into the structure of `target`.

    Nothing is restored unless the checkpoint matches `target` exactly: the
    same loss-scale type, the same optimizer state types, and the same leaf
    paths with the same shapes and dtypes (params, optimizer state, model
    state, counters). flax alone would load a (2, 3) array into a (3, 3)
    target, or a float16 one into a float32 target, without a word.

    Args:
      path: file to read.
      target: a state of the same structure (supplies ``tx`` and types).

    Returns:
      The restored state.

    Raises:
      ValueError: naming the file and the mismatch: the checkpoint's loss
        scale is of another type than ``target.loss_scale`` (e.g. saved
        `DynamicLossScale`, target `NoOpLossScale`: restoring would drop or
        invent fields); its optimizer state types differ from those of
        ``target.tx`` (e.g. adam's into sgd's); or leaves are missing, extra,
        or of another shape or dtype (each listed with its path, saved vs
        expected).

    Example:
      >>> import os, tempfile, jax.numpy as jnp, optax
      >>> from jaxstable import train
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.msgpack")
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
    with open(path, "rb") as f:
        raw = serialization.msgpack_restore(f.read())
    saved_types = raw.pop(_TYPES_KEY, None) if isinstance(raw, dict) else None
    _check_loss_scale_type(path, raw, target)
    _check_optimizer_types(path, saved_types, target)
    _check_same_structure(
        path, _leaf_specs(raw), _leaf_specs(serialization.to_state_dict(target))
    )
    return serialization.from_state_dict(target, raw)


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
