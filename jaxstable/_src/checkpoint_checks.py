"""Mismatch checks of a checkpoint against its target (private).

Nothing is restored onto a target of another loss-scale type, optimizer
state types or leaves (paths, shapes, dtypes): each is refused with a
ValueError naming the checkpoint and what differs.
"""

from __future__ import annotations

import os
from typing import Any

from flax import serialization

from _stablecore.checkpoint import raise_mismatches as _raise_mismatches
from jaxstable._src.checkpoint_sharded import path_str
from jaxstable._src.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jaxstable._src.step import TrainState


def state_types(tree: Any) -> str:
    """The optimizer state's type names, e.g. ``(ScaleByAdamState, EmptyState)``.

    Arrays and containers of arrays (moments shaped like the params) give "".
    """
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # an optax state
        name = type(tree).__name__
        inner = [s for s in map(state_types, tree) if s]
        return f"{name}({', '.join(inner)})" if inner else name
    if isinstance(tree, tuple | list):
        return "(" + ", ".join(map(state_types, tree)) + ")"
    if isinstance(tree, dict):
        inner = [f"{k}: {s}" for k, v in tree.items() if (s := state_types(v))]
        return "{" + ", ".join(inner) + "}" if inner else ""
    return ""


def check_optimizer_types(path: Any, saved_types: Any, target: Any) -> None:
    opt_state = getattr(target, "opt_state", None)
    saved = saved_types.get("opt_state") if isinstance(saved_types, dict) else None
    if saved is None or opt_state is None:
        return  # an older file or a plain pytree: the leaf check still runs
    expected = state_types(opt_state)
    if saved != expected:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} was saved with optimizer state "
            f"{saved} but target.tx's state is {expected}: build the target "
            "with the optimizer the checkpoint was saved with"
        )


def check_same_structure(path: Any, saved: dict, expected: dict) -> None:
    """Raises ValueError listing every leaf that differs (saved vs expected).

    ``saved`` and ``expected`` map a leaf path (a tuple of keys) to
    ``(shape, dtype)`` (see `leaf_spec`): the check does not depend on the file
    format.
    """
    saved = {path_str(p): s for p, s in saved.items()}
    expected = {path_str(p): s for p, s in expected.items()}
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


def check_loss_scale_type(path: Any, raw: Any, target: Any) -> None:
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


def check_loss_scale_name(path: Any, types: Any, target: Any) -> None:
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
