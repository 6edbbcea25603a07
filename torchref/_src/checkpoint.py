"""Checkpoints of a `TrainStep`: save, load, and a manager for a run."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from torchref._src.step import TrainStep, _scaler_kind

# classes: a StaticGradScaler's state has a plain GradScaler's keys, and two
# optimizers can share their option names.
_CLASSES_KEY = "classes"
_STATE_KEYS = ("model", "optimizer", "scaler", "skip_state", "steps_done")
# Mismatch lines listed in one error; the rest are counted.
_MAX_MISMATCH_LINES = 12


def save_checkpoint(path: str | os.PathLike, step: TrainStep) -> None:
    """Writes ``step.state_dict()`` (model, optimizer, scaler, counters) atomically.

    The mirror of `jaxstable.train.save_checkpoint`; the file is `torch.save`'s.
    It also names the optimizer and scaler classes (key ``"classes"``), so
    that `load_checkpoint` can refuse a checkpoint of another one by name.

    Args:
      path: file to write.
      step: the `TrainStep` whose state to save.

    Example:
      >>> import os, tempfile, torch
      >>> from torchref import train
      >>> model = torch.nn.Linear(2, 1)
      >>> step = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
      ...                        lambda m, b: m(b).pow(2).mean())
      >>> _ = step(torch.ones(4, 2))
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
      >>> train.save_checkpoint(path, step)
      >>> sorted(torch.load(path, weights_only=True))
      ['classes', 'model', 'optimizer', 'scaler', 'skip_state', 'steps_done']
    """
    state = step.state_dict()
    state[_CLASSES_KEY] = _classes(step)
    tmp = f"{os.fspath(path)}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a crash never leaves half a checkpoint


def load_checkpoint(path: str | os.PathLike, step: TrainStep) -> TrainStep:
    """Loads a checkpoint written by `save_checkpoint` into `step` and returns it.

    Nothing is loaded unless the checkpoint matches `step` exactly: the same
    scaler class (a `DynamicGradScaler`'s floor and hysteresis would be lost
    in a plain `GradScaler`), the same optimizer class (an Adam state in an
    SGD fails one step later with KeyError), the same parameter groups, and
    the same model state dict keys, shapes and dtypes (torch would copy a
    float16 checkpoint into float32 parameters without a word). The mirror
    of `jaxstable.train.load_checkpoint`, with the same messages.

    A file written before `save_checkpoint` named the classes is checked by
    its keys alone: another optimizer shows by its option names, a
    DynamicGradScaler by its floor and hysteresis, but a StaticGradScaler's
    state reads as a plain GradScaler's (the same keys).

    Args:
      path: file to read.
      step: a `TrainStep` over a model and optimizer of the same structure.

    Returns:
      `step`, with its model, optimizer, scaler and counters restored.

    Raises:
      ValueError: naming the file and the mismatch (saved vs expected scaler
        or optimizer class; each model leaf that is missing, extra, or of
        another shape or dtype, with its path; other parameter groups), or
        a file that is not a TrainStep checkpoint.

    Example:
      >>> import os, tempfile, torch
      >>> from torchref import train
      >>> model = torch.nn.Linear(1, 1, bias=False)
      >>> step = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
      ...                        lambda m, b: m(b).sum())
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
      >>> with torch.no_grad():
      ...     _ = model.weight.fill_(3.0)
      >>> train.save_checkpoint(path, step)
      >>> with torch.no_grad():
      ...     _ = model.weight.zero_()
      >>> train.load_checkpoint(path, step).model.weight.item()
      3.0
      >>> wide = torch.nn.Linear(2, 1, bias=False)
      >>> other = train.TrainStep(wide, torch.optim.SGD(wide.parameters(), lr=0.1),
      ...                         lambda m, b: m(b).sum())
      >>> try:
      ...     train.load_checkpoint(path, other)
      ... except ValueError as e:
      ...     print(str(e).splitlines()[1])
        model/weight: checkpoint (1, 1) float32, target (1, 2) float32
    """
    # weights_only: a checkpoint holds tensors, numbers and dicts, nothing to run
    state = torch.load(path, weights_only=True)
    missing = [k for k in _STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} is not a TrainStep checkpoint: it "
            f"lacks {missing} (save_checkpoint writes {list(_STATE_KEYS)})"
        )
    saved = state.pop(_CLASSES_KEY, None) or {}
    _check_scaler_class(path, saved, state["scaler"], step)
    _check_optimizer_class(path, saved, state["optimizer"], step.optimizer)
    lines = _structure_mismatches(
        {
            **_leaf_specs(state["model"], "model"),
            **_leaf_specs(state["skip_state"], "skip_state"),
        },
        {
            **_leaf_specs(step.model.state_dict(), "model"),
            **_leaf_specs(dataclasses.asdict(step.skip_state), "skip_state"),
        },
    )
    lines += _param_group_mismatches(state["optimizer"], step.optimizer)
    _raise_mismatches(path, lines)
    step.load_state_dict(state)
    return step


def _classes(step: TrainStep) -> dict[str, str | None]:
    """The class names `load_checkpoint` compares (scaler None: none enabled)."""
    scaler = type(step.scaler).__name__ if step._scaler_enabled() else None
    return {"optimizer": type(step.optimizer).__name__, "scaler": scaler}


def _check_scaler_class(path: Any, classes: dict, saved: dict, step: TrainStep) -> None:
    if "scaler" in classes:
        have = _classes(step)["scaler"]
        kinds = [
            f"a {c}" if c else "no enabled scaler" for c in (classes["scaler"], have)
        ]
    else:  # an older file: only the keys tell, and Static reads as GradScaler
        enabled = step._scaler_enabled()
        kinds = [
            _scaler_kind(saved),
            _scaler_kind(step.scaler.state_dict() if enabled else {}),
        ]
    if kinds[0] != kinds[1]:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} holds {kinds[0]} but this TrainStep "
            f"has {kinds[1]}: build it with the loss scale the checkpoint was "
            "saved with"
        )


def _check_optimizer_class(
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


def _param_group_mismatches(saved: dict, optimizer: torch.optim.Optimizer) -> list:
    sizes = [len(g["params"]) for g in saved.get("param_groups", [])]
    expected = [len(g["params"]) for g in optimizer.param_groups]
    if sizes == expected:
        return []
    return [
        f"  optimizer/param_groups: checkpoint sizes {sizes}, target sizes {expected}"
    ]


def _leaf_specs(tree: Any, prefix: str = "") -> dict[str, tuple[tuple, str]]:
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
            out.update(_leaf_specs(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    key = prefix or "<root>"  # as jaxstable's, for a single tensor
    if isinstance(tree, torch.Tensor):
        return {key: (tuple(tree.shape), str(tree.dtype).removeprefix("torch."))}
    return {key: ((), type(tree).__name__)}


def _structure_mismatches(saved: dict[str, tuple], expected: dict[str, tuple]):
    """One line per leaf missing, extra, or of another shape or dtype.

    ``saved`` and ``expected`` map a leaf path to ``(shape, dtype)`` (see
    `_leaf_specs`): the check does not depend on the file format.
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


def _raise_mismatches(path: Any, lines: list[str]) -> None:
    # Same text as jaxstable.train.load_checkpoint.
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
