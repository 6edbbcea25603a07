"""Mismatch checks of a checkpoint against its `TrainStep` (private).

Nothing is loaded into a step of another scaler or optimizer class, other
parameter groups, or other model leaves or optimizer parameters (names,
shapes, dtypes): each is refused with a ValueError naming the checkpoint
and what differs. Also the names those checks compare, which a save writes:
the optimizer's parameters by name and the optimizer and scaler classes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from _stablecore.checkpoint import raise_mismatches as _raise_mismatches
from torchref._src.distributed import inner_module
from torchref._src.step import TrainStep
from torchref._src.step_state import param_names, scaler_kind

_STATE_KEYS = ("model", "optimizer", "scaler", "skip_state", "steps_done")


def check_train_step(path: Any, state: Any, saved: dict, step: TrainStep) -> None:
    missing = [k for k in _STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} is not a TrainStep checkpoint: it "
            f"lacks {missing} (save_checkpoint writes {list(_STATE_KEYS)})"
        )
    check_scaler_class(path, saved, state["scaler"], step)
    check_optimizer_class(path, saved, state["optimizer"], step.optimizer)
    lines = structure_mismatches(
        {
            **leaf_specs(state["model"], "model"),
            **leaf_specs(state["skip_state"], "skip_state"),
        },
        {
            **leaf_specs(inner_module(step.model).state_dict(), "model"),
            **leaf_specs(dataclasses.asdict(step.skip_state), "skip_state"),
        },
    )
    lines += param_group_mismatches(state["optimizer"], step.optimizer)
    _raise_mismatches(path, lines)


def param_specs(step: TrainStep) -> tuple[list[str], dict[str, list]]:
    """The optimizer's parameters in its order: their names (`param_names`:
    the model's, else the one the optimizer was given, else ``<unnamed
    k>``) and ``{name: [shape, dtype]}``."""
    names = param_names(step.model, step.optimizer)
    specs = {
        name: [list(p.shape), str(p.dtype).removeprefix("torch.")]
        for name, p in zip(names, step._params(), strict=True)
    }
    return names, specs


def inner_state(state: dict) -> dict:
    """The torch optimizer state dict in `state` (a `SkipNonFinite`
    wrapper's holds it under ``"optimizer"``)."""
    if "param_groups" in state or not isinstance(state.get("optimizer"), dict):
        return state
    return inner_state(state["optimizer"])


def param_mismatches(saved: dict, state: dict, params: dict, step: TrainStep):
    """One line per optimizer parameter (by name) missing, extra, in another
    group, or of another shape or dtype (for one outside the model's state
    dict: the model check covers those)."""
    in_model = set(inner_module(step.model).state_dict())
    lines = []
    for name in [*params, *(n for n in saved if n not in params)]:
        s, e = saved.get(name), params.get(name)
        s = None if s is None else (tuple(s[0]), s[1])
        e = None if e is None else (tuple(e[0]), e[1])
        where = f"  optimizer/{name}"
        if s is None:
            lines.append(f"{where}: missing from the checkpoint (target {_spec(e)})")
        elif e is None:
            lines.append(f"{where}: in the checkpoint ({_spec(s)}), not in the target")
        elif s != e and name not in in_model:
            lines.append(f"{where}: checkpoint {_spec(s)}, target {_spec(e)}")
    if lines:
        return lines
    names = param_specs(step)[0]
    own = inner_state(step.optimizer.state_dict())["param_groups"]
    # The group sizes already match (param_group_mismatches).
    theirs = inner_state(state)["param_groups"]
    for g, (other, mine) in enumerate(zip(theirs, own, strict=True)):
        for name in sorted({names[i] for i in mine["params"]} - set(other["params"])):
            lines.append(
                f"  optimizer/{name}: in parameter group {g} of the target, "
                "another group in the checkpoint"
            )
    return lines


def class_names(step: TrainStep) -> dict[str, str | None]:
    """The class names `load_checkpoint` compares (scaler None: none enabled)."""
    scaler = type(step.scaler).__name__ if step._scaler_enabled() else None
    return {"optimizer": type(step.optimizer).__name__, "scaler": scaler}


def check_scaler_class(path: Any, classes: dict, saved: dict, step: TrainStep) -> None:
    if "scaler" in classes:
        have = class_names(step)["scaler"]
        kinds = [
            f"a {c}" if c else "no enabled scaler" for c in (classes["scaler"], have)
        ]
    else:  # an older file: only the keys tell, and Static reads as GradScaler
        enabled = step._scaler_enabled()
        kinds = [
            scaler_kind(saved),
            scaler_kind(step.scaler.state_dict() if enabled else {}),
        ]
    if kinds[0] != kinds[1]:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} holds {kinds[0]} but this TrainStep "
            f"has {kinds[1]}: build it with the loss scale the checkpoint was "
            "saved with"
        )


def check_optimizer_class(
    path: Any, classes: dict, saved: dict, optimizer: torch.optim.Optimizer
) -> None:
    have = type(optimizer).__name__
    if "optimizer" in classes:
        if classes["optimizer"] != have:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} holds the optimizer state of "
                f"{classes['optimizer']} but this TrainStep's optimizer is {have}: "
                "build it with the optimizer the checkpoint was saved with"
            )
        return
    # An older file: torch's load_state_dict takes the saved groups' options
    # as they are, so another optimizer's options surface as a KeyError later.
    options = [sorted(set(g) - {"params"}) for g in saved.get("param_groups", [])]
    expected = [sorted(set(g) - {"params"}) for g in optimizer.param_groups]
    if options[:1] != expected[:1]:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} holds an optimizer state with options "
            f"{options[0] if options else []} but this TrainStep's {have} has "
            f"{expected[0]}: build it with the optimizer the checkpoint was saved with"
        )


def param_group_mismatches(saved: dict, optimizer: torch.optim.Optimizer) -> list:
    sizes = [len(g["params"]) for g in saved.get("param_groups", [])]
    expected = [len(g["params"]) for g in optimizer.param_groups]
    if sizes == expected:
        return []
    return [
        f"  optimizer/param_groups: checkpoint sizes {sizes}, target sizes {expected}"
    ]


def leaf_specs(tree: Any, prefix: str = "") -> dict[str, tuple[tuple, str]]:
    """``{path: (shape, dtype)}`` of every leaf of a (nested) state dict.

    Paths join the keys with "/" (``model/0.weight``), dtypes are named as
    in `jaxstable.train` ("float32", not "torch.float32"). A Python number
    is ``((), "int")`` etc.; None and empty containers hold no leaf.
    """
    if tree is None:
        return {}
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(leaf_specs(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    key = prefix or "<root>"  # as jaxstable's, for a single tensor
    if isinstance(tree, torch.Tensor):
        return {key: (tuple(tree.shape), str(tree.dtype).removeprefix("torch."))}
    return {key: ((), type(tree).__name__)}


def structure_mismatches(saved: dict[str, tuple], expected: dict[str, tuple]):
    """One line per leaf missing, extra, or of another shape or dtype.

    ``saved`` and ``expected`` map a leaf path to ``(shape, dtype)`` (see
    `leaf_specs`): the check does not depend on the file format.
    """
    lines = []
    # The target's order, then the checkpoint's extras.
    for key in [*expected, *(k for k in saved if k not in expected)]:
        s, e = saved.get(key), expected.get(key)
        if s is None:
            lines.append(f"  {key}: missing from the checkpoint (target {_spec(e)})")
        elif e is None:
            lines.append(f"  {key}: in the checkpoint ({_spec(s)}), not in the target")
        elif s != e:
            lines.append(f"  {key}: checkpoint {_spec(s)}, target {_spec(e)}")
    return lines


def _spec(spec: tuple) -> str:
    shape, dtype = spec
    return f"{shape} {dtype}"
