"""A guarded PyTorch train step and fit loop, mirroring `jaxstable.train`.

`TrainStep` runs the recipe of the torch.amp docs with the real
`torch.amp.GradScaler`, `torch.autocast` and `clip_grad_norm_` (as its two
halves `get_total_norm` + `clip_grads_with_norm_`) and returns the same
metrics as the JAX step: ``loss``, ``grad_norm``, ``loss_scale``, ``finite``,
``skipped_total``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from torchref._src.diagnostics import (
    format_location,
    format_report,
    locate,
    non_finite_grad_report,
    non_finite_report,
)
from torchref._src.loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
)
from torchref._src.precision import get_policy
from torchref._src.transforms import (
    SkipNonFinite,
    SkipNonFiniteState,
    _check_bool,
    _check_max_consecutive,
    _StepUndo,
    clip_by_global_norm,
    global_norm,
)

__all__ = ["NAN_POLICIES", "NonFiniteError", "TrainStep", "fit"]

NAN_POLICIES = ("skip", "stop", "rollback")
_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)


class NonFiniteError(FloatingPointError):
    """Training stopped on non-finite gradients.

    Raised by `fit` with ``nan_policy="stop"`` at the first run of
    ``max_consecutive_nonfinite`` non-finite steps; with ``"rollback"`` once
    ``max_rollbacks`` rollbacks have been used.

    Attributes:
        step: 0-based index (within the `fit` call) of the step that hit the
            limit, as in `jaxstable.train.NonFiniteError`.
        report: `non_finite_grad_report` of the model at that step (its
            gradients at the loss scale that step used, unscaled).
        history: the per-step records, ending with that step.
        location: `torchref.diagnostics.locate` of that step (a
            `NonFiniteLocation`), None when the re-run found it finite.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        report: list,
        history: list | None = None,
        location: Any = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.report = report
        self.history = [] if history is None else history
        self.location = location


def _make_scaler(scaler: Any, device_type: str) -> torch.amp.GradScaler | None:
    if scaler is None or isinstance(scaler, torch.amp.GradScaler):
        return scaler
    if isinstance(scaler, NoOpLossScale | StaticLossScale | DynamicLossScale):
        return scaler.make_scaler(device_type)
    raise TypeError(
        "scaler must be None, a torch.amp.GradScaler or a torchref.loss_scale "
        f"NoOpLossScale/StaticLossScale/DynamicLossScale, got {type(scaler).__name__}"
    )


def _autocast_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        dtype = get_policy(dtype).compute_dtype
    if dtype not in _AUTOCAST_DTYPES:
        raise ValueError(
            "autocast_dtype must be None, torch.float16 or torch.bfloat16, "
            f"got {dtype!r}"
        )
    return dtype


class TrainStep:
    """One guarded optimizer step: autocast, GradScaler, clip, skip.

    Order of work in ``step(batch)`` (that of the torch.amp docs):

    1. ``optimizer.zero_grad(set_to_none=True)``; snapshot the model's buffers
       (batch-norm statistics) if `restore_buffers_on_skip`.
    2. ``loss = loss_fn(model, batch)`` under ``torch.autocast(device_type,
       dtype=autocast_dtype)`` when `autocast_dtype` is set.
    3. ``scaler.scale(loss).backward()``; ``scaler.unscale_(optimizer)``.
    4. ONE finiteness check. With an enabled GradScaler this is GradScaler's
       own ``found_inf`` recorded by `unscale_` (read through its private
       ``_found_inf_per_device(optimizer)``: it is the flag `scaler.step`
       will act on, so both agree by construction); otherwise `all_finite`.
    5. ``grad_norm`` = pre-clip global norm (float32); when finite and
       `max_grad_norm` is set, grads are clipped (`clip_grads_with_norm_`,
       i.e. `clip_grad_norm_`). On a non-finite step the NaN coefficient is
       not multiplied in, so the grad report still names the bad leaves.
    6. ``scaler.step(optimizer)`` (GradScaler skips `optimizer.step()` itself
       on inf/NaN); with no (or a disabled) scaler we skip it ourselves.
       With `check_update` (default), parameters and optimizer state are
       copied before a step with finite gradients, checked after it, and
       copied back if the step wrote a non-finite value (finite gradients
       do not make a finite Adam step in float16): such a step counts as
       skipped, with ``grads_finite`` True.
    7. ``scaler.update()`` (`DynamicGradScaler` also clamps to
       `min_loss_scale`): the scale reacts to the gradients only, as
       GradScaler does (a non-finite update is no loss-scale overflow);
       counters; on a skipped step the buffers are restored, as the JAX step
       keeps `model_state` unchanged (the forward already updated batch-norm
       running stats).

    Args:
        model: the `nn.Module` (its device gives autocast's device type).
        optimizer: a `torch.optim.Optimizer` owning every trainable
            parameter of `model` (GradScaler unscales only its grads).
        loss_fn: ``loss_fn(model, batch) -> loss`` or ``(loss, aux)``; loss a
            0-d tensor (as on the JAX side; a shape-(1,) loss is refused too).
        max_grad_norm: clip threshold (> 0) or None.
        scaler: None, a `torch.amp.GradScaler`, or a torchref loss scale
            (`DynamicLossScale()` etc.; `make_scaler` is called for you).
        autocast_dtype: None, torch.float16/torch.bfloat16 or a dtype name.
        max_consecutive: sets ``skip_state.exceeded`` (see `skip_non_finite`).
        clip_eps: eps of the clip formula (torch's 1e-6 by default).
        restore_buffers_on_skip: restore buffers on non-finite steps.
        check_update: undo a step that wrote a non-finite parameter or
            optimizer-state value (default True; costs a copy of both and
            one more host sync per step).

    Example:
        >>> import torch
        >>> from torchref.loss_scale import DynamicLossScale
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(3, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> mse = lambda m, b: ((m(b[0]) - b[1]) ** 2).mean()
        >>> step = TrainStep(model, opt, mse, max_grad_norm=1.0,
        ...                  scaler=DynamicLossScale(loss_scale=2.0**10))
        >>> m = step((torch.ones(4, 3), torch.zeros(4, 1)))
        >>> sorted(m)
        ['finite', 'grad_norm', 'grads_finite', 'loss', 'loss_scale', 'skipped_total']
        >>> m["loss_scale"], m["finite"]
        (1024.0, True)
        >>> m = step((torch.full((4, 3), float("nan")), torch.zeros(4, 1)))
        >>> m["finite"], m["skipped_total"], step.scaler.get_scale()
        (False, 1, 512.0)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.nn.Module, Any], Any],
        *,
        max_grad_norm: float | None = None,
        scaler: Any = None,
        autocast_dtype: Any = None,
        max_consecutive: int | None = None,
        clip_eps: float = 1e-6,
        restore_buffers_on_skip: bool = True,
        check_update: bool = True,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"model must be a torch.nn.Module, got {type(model).__name__}"
            )
        if isinstance(optimizer, SkipNonFinite):
            raise TypeError(
                "pass the plain torch optimizer (TrainStep skips non-finite steps "
                "itself), not a torchref.transforms wrapper: use wrapper.optimizer"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer, "
                f"got {type(optimizer).__name__}"
            )
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable as loss_fn(model, batch)")
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [
            n
            for n, p in model.named_parameters()
            if p.requires_grad and id(p) not in owned
        ]
        if missing:
            raise ValueError(
                "optimizer does not own these trainable parameters of the model "
                f"(GradScaler would leave their grads scaled): {', '.join(missing)}"
            )
        first = next(itertools.chain(model.parameters(), model.buffers()), None)
        self.device_type = first.device.type if first is not None else "cpu"
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scaler = _make_scaler(scaler, self.device_type)
        self.autocast_dtype = _autocast_dtype(autocast_dtype)
        self.max_consecutive = _check_max_consecutive(max_consecutive)
        self.clip = (
            None
            if max_grad_norm is None
            else clip_by_global_norm(max_grad_norm, eps=clip_eps)
        )
        self.restore_buffers_on_skip = bool(restore_buffers_on_skip)
        self.check_update = _check_bool("check_update", check_update)
        self._undo = _StepUndo()
        self.skip_state = SkipNonFiniteState()
        self.steps_done = 0
        # State machine: "ready" between steps, else the stage a step is in
        # (or was in when it raised): refuses re-entry and a half-done step.
        self._stage = "ready"

    # --------------------------------------------------------------- helpers
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _scaler_enabled(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def _finite(self, grads: list[torch.Tensor]) -> bool:
        if self._scaler_enabled():
            try:
                found = self.scaler._found_inf_per_device(self.optimizer)
            except AttributeError:  # a GradScaler without the (private) hook
                found = None
            if found:
                return not bool(
                    sum(f.to(self.device_type) for f in found.values()).item()
                )
        return all_finite(grads)

    def reset(self) -> None:
        """Discards a step that raised half-way, so that `step` can run again.

        Zeroes the grads and clears the GradScaler's per-iteration record via
        its public ``update(new_scale=current_scale)`` (scale unchanged).
        """
        self.optimizer.zero_grad(set_to_none=True)
        # GradScaler creates its private `_scale` lazily in scale(); before
        # that it holds no per-iteration record and update() would refuse.
        if self._scaler_enabled() and self.scaler._scale is not None:
            self.scaler.update(float(self.scaler.get_scale()))
        self._stage = "ready"

    # ------------------------------------------------------------------ step
    def __call__(self, batch: Any) -> dict[str, Any]:
        """Same as `step`."""
        return self.step(batch)

    def step(self, batch: Any) -> dict[str, Any]:
        """Runs one guarded step; see the class docstring for the order.

        Returns:
            ``{"loss": float (unscaled), "grad_norm": float (pre-clip,
            unscaled, float32; inf/nan on a non-finite step), "loss_scale":
            float (the scale USED for this step), "finite": bool (the step
            was applied: gradients and what the step wrote all finite),
            "grads_finite": bool (the gradients alone; the flag the loss
            scale reacts to), "skipped_total": int}`` plus ``"aux"`` when
            `loss_fn` returns ``(loss, aux)``.
        """
        if self._stage != "ready":
            raise RuntimeError(
                f"TrainStep.step() called while a step is {self._stage!r}: either "
                "loss_fn called step() re-entrantly, or the previous step raised "
                "half-way (call .reset() to discard it)"
            )
        self._stage = "forward"
        try:
            return self._step(batch)
        except BaseException:
            # Before backward nothing but the grads (zeroed) and buffers was
            # touched: the step can simply be retried. Later, GradScaler holds
            # a half-done iteration, so the guard stays up until reset().
            if self._stage == "forward":
                self._stage = "ready"
            raise

    def _step(self, batch: Any) -> dict[str, Any]:
        model, opt, scaler = self.model, self.optimizer, self.scaler
        opt.zero_grad(set_to_none=True)
        saved = None
        if self.restore_buffers_on_skip:
            saved = [b.detach().clone() for b in model.buffers()]
        ctx = (
            torch.autocast(self.device_type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with ctx:
            out = self.loss_fn(model, batch)
        loss, aux = out if isinstance(out, tuple) else (out, None)
        if not isinstance(loss, torch.Tensor):
            raise ValueError(
                "loss_fn must return a scalar (0-d) loss tensor (or (loss, aux)), "
                f"got {type(loss).__name__}"
            )
        if loss.ndim != 0:
            # Same text as jaxstable.train.make_train_step.
            raise ValueError(
                "loss_fn must return a scalar (0-d) loss, got shape "
                f"{tuple(loss.shape)}; reduce it, e.g. with .mean()"
            )
        # The scale USED for this step (read before update changes it).
        loss_scale = float(scaler.get_scale()) if scaler is not None else 1.0
        self._stage = "backward"
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        self._stage = "check"
        params = self._params()
        grads = [p.grad for p in params if p.grad is not None]
        finite = self._finite(grads)
        if self.clip is not None and finite:
            grad_norm = self.clip(params)
        else:
            grad_norm = global_norm(grads)
        self._stage = "optimizer step"
        undo = finite and self.check_update
        if undo:
            self._undo.take(opt)
        if self._scaler_enabled():
            scaler.step(opt)  # GradScaler skips optimizer.step() on inf/NaN
            scaler.update()
        elif finite:
            opt.step()
        applied = finite
        if undo and not self._undo.written_finite():
            self._undo.restore()
            applied = False
        self.skip_state.record(applied, self.max_consecutive, grads_finite=finite)
        if not applied and saved is not None:
            with torch.no_grad():
                for b, s in zip(model.buffers(), saved, strict=True):
                    b.copy_(s)
        self.steps_done += 1
        self._stage = "ready"
        metrics = {
            "loss": float(loss.detach().float()),
            "grad_norm": float(grad_norm),
            "loss_scale": loss_scale,
            "finite": applied,
            "grads_finite": bool(finite),
            "skipped_total": int(self.skip_state.skipped_total),
        }
        if aux is not None:
            metrics["aux"] = aux
        return metrics

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scaler and counters (for `torch.save`)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "skip_state": dataclasses.asdict(self.skip_state),
            "steps_done": self.steps_done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict`.

        Raises:
            ValueError: the saved scaler state and this step's scaler do not
                match: a saved (non-empty) scaler state but no enabled scaler
                here, or the reverse (the mirror of `jaxstable.train.
                load_checkpoint` refusing another loss-scale type).
        """
        saved = state.get("scaler") or {}
        if bool(saved) != self._scaler_enabled():
            have = (
                type(self.scaler).__name__
                if self._scaler_enabled()
                else "no enabled scaler"
            )
            raise ValueError(
                f"the checkpoint holds {_scaler_kind(saved)} but this TrainStep has "
                f"{have}: build it with the loss scale the checkpoint was saved with"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self._scaler_enabled() and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.skip_state = SkipNonFiniteState(**state["skip_state"])
        self.steps_done = int(state["steps_done"])


def _scaler_kind(saved: dict[str, Any]) -> str:
    if not saved:
        return "no enabled scaler"
    # DynamicGradScaler.state_dict adds min_loss_scale to GradScaler's keys.
    return "a DynamicGradScaler" if "min_loss_scale" in saved else "a GradScaler"


# Key of the file (not a state_dict key) naming the optimizer and scaler
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


_LOGGED = ("loss", "grad_norm", "loss_scale", "finite", "skipped_total")


def _scalar_leaves(tree: Any, path: str = "") -> Iterable[tuple[str, float]]:
    """``(path, value)`` of every scalar leaf, paths as jax's ``keystr``."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _scalar_leaves(v, f"{path}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _scalar_leaves(v, f"{path}[{i}]")
    elif isinstance(tree, torch.Tensor):
        if tree.numel() == 1:
            yield path, float(tree.detach().float())
    elif isinstance(tree, (int, float)):
        yield path, float(tree)


def _add_skip_reason(rec: dict[str, Any], grads_finite: Any) -> None:
    # Only a guarded step reports grads_finite (a plain step that does not
    # skip has no reason to give); then its record tells why it skipped.
    if grads_finite is None:
        return
    # Same keys as jaxstable.train.fit: a skipped step says why.
    rec["grads_finite"] = bool(grads_finite)
    if not rec["finite"]:
        rec["skip_reason"] = (
            "non-finite update" if rec["grads_finite"] else "non-finite gradients"
        )


def _host_record(index: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """One history/JSONL record: the metrics and the scalar leaves of ``aux``
    as ``aux[...]`` keys, the same record as `jaxstable.train.fit` writes."""
    rec = {"step": index}
    # Python numbers of the JAX record's types (a step callable may return
    # 0-d tensors; a TrainStep already returns numbers).
    for key, kind in zip(_LOGGED, (float, float, float, bool, int), strict=True):
        value = metrics[key]
        if isinstance(value, torch.Tensor):
            value = value.detach().float().item() if kind is not bool else value
        rec[key] = kind(value)
    _add_skip_reason(rec, metrics.get("grads_finite"))
    if metrics.get("aux") is not None:
        for path, value in _scalar_leaves(metrics["aux"]):
            rec["aux" + path] = value
    return rec


def fit(
    step: TrainStep,
    batches: Iterable[Any],
    *,
    steps: int | None = None,
    nan_policy: str = "skip",
    max_consecutive_nonfinite: int = 5,
    log_path: str | os.PathLike | None = None,
    progress: bool = True,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    rollback_every: int = 100,
    max_rollbacks: int = 3,
    locate_first: int = 1,
    time_steps: bool = False,
    eval_fn: Callable[[Any], Any] | None = None,
    eval_every: int | None = None,
    on_step: Callable[[dict[str, Any], Any], Any] | None = None,
    stop_after_nonfinite: int | None = None,
) -> list[dict[str, Any]]:
    """Runs `step` over `batches` with a progress bar, a JSONL log and a NaN policy.

    Per batch: ``metrics = step(batch)``; the history entry (and JSONL line)
    is ``{"step": i, loss, grad_norm, loss_scale, finite, skipped_total}``
    plus one ``aux[...]`` key per scalar leaf of ``aux`` (i 0-based); with a
    step that reports ``grads_finite`` (a `TrainStep`) that key too, and on a
    skipped step ``skip_reason`` (``"non-finite gradients"`` or
    ``"non-finite update"``): the same record as `jaxstable.train.fit`.
    `log_path` is overwritten at the start of the call and gets one JSON line
    per step with keys step, loss, grad_norm, loss_scale, finite,
    skipped_total (python's json writes non-finite floats as NaN/Infinity,
    which `json.loads` reads back). NaN policy:

    * ``"skip"``: non-finite steps are skipped (by the step) and training
      goes on.
    * ``"stop"``: after `max_consecutive_nonfinite` non-finite steps in a
      row, raise `NonFiniteError` naming the step, the loss scale it used,
      the non-finite gradients (their report) and batch inputs. Nothing after
      that step is run, logged or checkpointed.
    * ``"rollback"``: keep a snapshot of the last state known good,
      ``copy.deepcopy(step.state_dict())`` (model, optimizer, scaler,
      counters), taken before the first step and after every step n (n steps
      done in this call) with ``n % rollback_every == 0`` whose result was
      finite. After `max_consecutive_nonfinite` non-finite steps in a row,
      a deep copy of it is loaded with ``step.load_state_dict`` (a copy, as
      the optimizer may keep the loaded tensors and update them in place),
      the run counter restarts, that step's record gets
      ``"rolled_back": True`` (the only record with that key) and training
      goes on with the NEXT batch (the bad ones are not retried). The
      trigger after `max_rollbacks` rollbacks raises `NonFiniteError` as
      "stop" does, the message saying the rollbacks are exhausted. Same
      semantics as `jaxstable.train.fit`.

    Checkpoints: ``step.state_dict()`` is saved with `torch.save` to
    ``checkpoint_dir/step_{n:08d}.pt`` (n = steps done in this call) every
    `checkpoint_every` steps, and once more at the end (not when it raises);
    `checkpoint_dir` alone writes only that final checkpoint.

    Steps: a `TrainStep`, or any callable ``step(batch) -> metrics`` whose
    metrics hold ``loss``, ``grad_norm``, ``loss_scale``, ``finite`` and
    ``skipped_total`` (numbers or 0-d tensors; optionally ``aux``), e.g. a
    hand-written baseline loop. "rollback" and checkpoints need its
    ``state_dict`` / ``load_state_dict``; the error report names non-finite
    gradients of its ``model`` if it has one.

    Args:
        step: a `TrainStep` or a step callable (see above).
        batches: any iterable of batches.
        steps: stop after this many steps (None: exhaust `batches`).
        nan_policy: "skip", "stop" or "rollback".
        max_consecutive_nonfinite: int >= 1, used by "stop" and "rollback".
        log_path: JSONL file (overwritten) or None.
        progress: show a tqdm bar (loss, grad_norm, loss_scale, skipped).
        checkpoint_dir: directory of the checkpoints, or None.
        checkpoint_every: int >= 1 or None; needs `checkpoint_dir`.
        rollback_every: snapshot period in steps for "rollback", int >= 1
            (accepted, unused, with the other policies).
        max_rollbacks: rollbacks allowed in this call for "rollback",
            int >= 1 (accepted, unused, with the other policies).
        locate_first: the first this many non-finite steps of the call
            (int >= 0) get ``"location"``: `torchref.diagnostics.locate` of
            the step (at the loss scale it used) as a dict of
            `NonFiniteLocation` fields, or None when the re-run is finite;
            the step that makes "stop" raise or "rollback" roll back always
            gets it (and the error its ``location``). Costs one re-run per
            located step, only on non-finite steps. Same keys as
            `jaxstable.train.fit`.
        time_steps: add ``"time_s"`` to each record: the wall time of the
            step call until its metrics are host numbers (a CUDA step has
            synchronised by then). Off by default.
        eval_fn: ``eval_fn(step) -> {name: scalar}``, e.g. a held-out
            evaluation; called after every `eval_every`-th step (n steps
            done in this call, ``n % eval_every == 0``), its scalars added to
            that step's record as ``eval[...]`` keys (named as ``aux``'s).
            Needs `eval_every`.
        eval_every: int >= 1, the period of `eval_fn` (needs `eval_fn`).
        on_step: ``on_step(record, step)``, called once per step with the
            step's record (after it is logged); if it returns True, fit stops
            after that step and returns normally.
        stop_after_nonfinite: None, or an int >= 0: fit returns normally
            (nothing raised) this many steps after the first step of the call
            whose record has ``finite == False`` (0: stop at that step); for
            runs meant to fail, such as a naive low-precision baseline.
        The same records and options as `jaxstable.train.fit`.

    Returns:
        The history: list of per-step dicts (a rollback step's also has
        ``"rolled_back": True``).

    Raises:
        NonFiniteError: with ``nan_policy="stop"``, or "rollback" once the
            rollbacks are used up.
        ValueError: invalid options (listing the valid values).

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(2, 1)
        >>> step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                  lambda m, b: m(b).pow(2).mean())
        >>> good, bad = torch.ones(4, 2), torch.full((4, 2), float("nan"))
        >>> hist = fit(step, [good, bad, good], progress=False)
        >>> [h["finite"] for h in hist], hist[-1]["skipped_total"]
        ([True, False, True], 1)
        >>> try:
        ...     fit(step, [bad], nan_policy="stop", max_consecutive_nonfinite=1,
        ...         progress=False)
        ... except NonFiniteError as e:
        ...     print(e.step, "|", str(e).split(";")[0])
        0 | 1 non-finite step(s) in a row, the last at step 0
        >>> before = step.steps_done
        >>> hist = fit(step, [good, good, bad, good], nan_policy="rollback",
        ...            max_consecutive_nonfinite=1, rollback_every=2, progress=False)
        >>> # 4 steps, but the rollback undid the NaN one (back to the snapshot at 2)
        >>> [h.get("rolled_back", False) for h in hist], step.steps_done - before
        ([False, False, True, False], 3)
        >>> w = model.weight
        >>> hist = fit(step, [good, bad] + [good] * 5, progress=False, time_steps=True,
        ...            eval_fn=lambda s: {"w0": w[0, 0]}, eval_every=2,
        ...            stop_after_nonfinite=2)
        >>> len(hist), [k for k in hist[1] if k not in hist[0]]  # stops 2 after 1
        (4, ['skip_reason', "eval['w0']", 'location'])
        >>> hist[3]["eval['w0']"] == float(w.detach()[0, 0]), hist[0]["time_s"] > 0
        (True, True)
    """
    if not callable(step):
        raise TypeError(
            "step must be a torchref.train.TrainStep or a callable "
            f"step(batch) -> metrics, got {type(step).__name__}"
        )
    _check_fit_extras(time_steps, eval_fn, eval_every, on_step, stop_after_nonfinite)
    if nan_policy not in NAN_POLICIES:
        raise ValueError(
            f"nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}"
        )
    if isinstance(max_consecutive_nonfinite, bool) or not isinstance(
        max_consecutive_nonfinite, int
    ):
        raise ValueError(
            "max_consecutive_nonfinite must be an int >= 1, "
            f"got {max_consecutive_nonfinite!r}"
        )
    if max_consecutive_nonfinite < 1:
        raise ValueError(
            "max_consecutive_nonfinite must be an int >= 1, "
            f"got {max_consecutive_nonfinite!r}"
        )
    for name, value in (
        ("rollback_every", rollback_every),
        ("max_rollbacks", max_rollbacks),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if steps is not None and (
        isinstance(steps, bool) or not isinstance(steps, int) or steps < 0
    ):
        raise ValueError(f"steps must be None or an int >= 0, got {steps!r}")
    if (
        isinstance(locate_first, bool)
        or not isinstance(locate_first, int)
        or locate_first < 0
    ):
        raise ValueError(f"locate_first must be an int >= 0, got {locate_first!r}")
    if checkpoint_every is not None:
        if (
            isinstance(checkpoint_every, bool)
            or not isinstance(checkpoint_every, int)
            or checkpoint_every < 1
        ):
            raise ValueError(
                f"checkpoint_every must be an int >= 1, got {checkpoint_every!r}"
            )
        if checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir")
    stateful = hasattr(step, "state_dict") and hasattr(step, "load_state_dict")
    if not stateful and (nan_policy == "rollback" or checkpoint_dir is not None):
        raise TypeError(
            "nan_policy='rollback' and checkpoint_dir need a step with "
            f"state_dict() and load_state_dict(), got {type(step).__name__}"
        )

    from tqdm.auto import tqdm

    total = (
        steps
        if steps is not None
        else (len(batches) if hasattr(batches, "__len__") else None)
    )
    it = iter(batches) if steps is None else itertools.islice(batches, steps)
    log = open(log_path, "w", encoding="utf-8") if log_path is not None else None
    if checkpoint_dir is not None:
        os.makedirs(checkpoint_dir, exist_ok=True)
    history: list[dict[str, Any]] = []
    bar = tqdm(total=total, disable=not progress, desc="fit")
    run = 0
    done = 0
    saved_at = None
    rollback = nan_policy == "rollback"
    rollbacks = 0
    located = 0
    # Deep copies: state_dict() holds references to the live tensors.
    snapshot = copy.deepcopy(step.state_dict()) if rollback else None

    def save(n: int) -> None:
        save_checkpoint(os.path.join(checkpoint_dir, f"step_{n:08d}.pt"), step)

    first_bad = None
    try:
        for i, batch in enumerate(it):
            start = time.perf_counter()
            metrics = step(batch)
            done = i + 1
            entry = _host_record(i, metrics)
            if time_steps:
                entry["time_s"] = time.perf_counter() - start
            if eval_fn is not None and done % eval_every == 0:
                for path, value in _scalar_leaves(eval_fn(step)):
                    entry["eval" + path] = value
            run = 0 if entry["finite"] else run + 1
            triggered = nan_policy != "skip" and run >= max_consecutive_nonfinite
            rolls = triggered and rollback and rollbacks < max_rollbacks
            if rolls:
                entry["rolled_back"] = True
            location = None
            locatable = isinstance(step, TrainStep)  # as jaxstable's fit
            wanted = triggered or located < locate_first
            if locatable and not entry["finite"] and wanted:
                # A skipped step left model and optimizer as they were; only
                # the scaler backed off: re-run at the scale the step used.
                location = locate(step, batch, loss_scale=entry["loss_scale"])
                located += 1
                entry["location"] = None if location is None else location._asdict()
            history.append(entry)
            if log is not None:
                log.write(json.dumps(entry) + "\n")
                log.flush()
            bar.update(1)
            bar.set_postfix(
                loss=f"{entry['loss']:.4g}",
                grad_norm=f"{entry['grad_norm']:.3g}",
                loss_scale=f"{entry['loss_scale']:.3g}",
                skipped=entry["skipped_total"],
                refresh=False,
            )
            wants_stop = on_step is not None and on_step(entry, step) is True
            if rolls:
                # A copy again: the optimizer may keep the loaded tensors and
                # update them in place, which must not reach the snapshot.
                step.load_state_dict(copy.deepcopy(snapshot))
                rollbacks += 1
                run = 0
            elif triggered:
                _raise_non_finite(
                    step,
                    entry,
                    run,
                    batch,
                    history,
                    nan_policy,
                    max_rollbacks,
                    location,
                )
            elif rollback and entry["finite"] and done % rollback_every == 0:
                snapshot = copy.deepcopy(step.state_dict())
            if first_bad is None and not entry["finite"]:
                first_bad = i
            if stop_after_nonfinite is not None and first_bad is not None:
                wants_stop = wants_stop or i - first_bad >= stop_after_nonfinite
            if wants_stop and not rolls:
                break
            if checkpoint_every is not None and done % checkpoint_every == 0:
                save(done)
                saved_at = done
        if checkpoint_dir is not None and saved_at != done:
            save(done)  # the final checkpoint
    finally:
        bar.close()
        if log is not None:
            log.close()
    return history


# Same text in jaxstable.train and torchref.train.
_UPDATE_NOTE = (
    "its gradients were finite: the update it computed (new parameters or "
    "optimizer state) was non-finite, e.g. float16 Adam state whose second "
    "moment underflowed to 0 while eps is 0 in float16"
)


def _check_fit_extras(time_steps, eval_fn, eval_every, on_step, stop_after):
    # Same checks and texts as jaxstable.train.fit.
    if not isinstance(time_steps, bool):
        raise TypeError(f"time_steps must be True or False, got {time_steps!r}")
    for name, fn in (("eval_fn", eval_fn), ("on_step", on_step)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be None or a callable, got {fn!r}")
    if (eval_fn is None) != (eval_every is None):
        raise ValueError(
            "eval_fn and eval_every go together: pass both or neither, got "
            f"eval_fn={eval_fn!r}, eval_every={eval_every!r}"
        )
    if eval_every is not None and (
        isinstance(eval_every, bool)
        or not isinstance(eval_every, int)
        or eval_every < 1
    ):
        raise ValueError(f"eval_every must be None or an int >= 1, got {eval_every!r}")
    if stop_after is not None and (
        isinstance(stop_after, bool)
        or not isinstance(stop_after, int)
        or stop_after < 0
    ):
        raise ValueError(
            f"stop_after_nonfinite must be None or an int >= 0, got {stop_after!r}"
        )


def _policy_note(nan_policy: str, max_rollbacks: int) -> str:
    # Same text as jaxstable.train.fit.
    if nan_policy == "rollback":
        return (
            "nan_policy='rollback': rollbacks exhausted "
            f"(max_rollbacks={max_rollbacks})"
        )
    return f"nan_policy={nan_policy!r}"


def _raise_non_finite(
    step: TrainStep,
    entry: dict[str, Any],
    run: int,
    batch: Any,
    history: list,
    nan_policy: str = "stop",
    max_rollbacks: int = 0,
    location: Any = None,
) -> None:
    # The grads left by the step: computed at the scale it used, unscaled by
    # GradScaler.unscale_ (not clipped on a non-finite step). Same message
    # layout as jaxstable.train.fit.
    # A plain step callable may have no model to report on.
    model = getattr(step, "model", None)
    report = non_finite_grad_report(model) if model is not None else []
    scale = f"{entry['loss_scale']:.6g}"
    parts = [
        f"{run} non-finite step(s) in a row, the last at step {entry['step']}; "
        f"loss={entry['loss']:.6g}, grad_norm={entry['grad_norm']:.6g}, "
        f"loss_scale={scale} (the scale that step used); its update was skipped "
        f"({_policy_note(nan_policy, max_rollbacks)}).",
        f"non-finite gradients at loss_scale={scale}:\n" + format_report(report),
    ]
    if entry.get("skip_reason") == "non-finite update":
        parts.insert(1, _UPDATE_NOTE)
    batch_report = non_finite_report(batch)
    if batch_report:
        parts.append("non-finite batch inputs:\n" + format_report(batch_report))
    param_report = non_finite_report(model) if model is not None else []
    if param_report:
        parts.append("non-finite parameters:\n" + format_report(param_report))
    if "location" in entry:
        parts.append("where (diagnostics.locate):\n" + format_location(location))
    raise NonFiniteError(
        "\n".join(parts),
        step=entry["step"],
        report=report,
        history=history,
        location=location,
    )
