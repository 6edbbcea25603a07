"""A guarded PyTorch train step, mirroring `jaxstable._src.step`.

`TrainStep` runs the recipe of the torch.amp docs with the real
`torch.amp.GradScaler`, `torch.autocast` and `clip_grad_norm_` (as its two
halves `get_total_norm` + `clip_grads_with_norm_`) and returns the same
metrics as the JAX step: ``loss``, ``grad_norm``, ``loss_scale``, ``finite``,
``skipped_total``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import torch

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
    _needs_closure,
    _StepUndo,
    clip_by_global_norm,
    global_norm,
)

__all__ = ["TrainStep"]

_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)


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
       With a scale below 1 the unscaled gradients are tested too (the
       multiply by 1/scale can overflow after GradScaler's test) and a
       non-finite one is written into GradScaler's flag, so the step is
       skipped and the scale backs off, as in the JAX step.
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
       running stats), and so they are when the step was applied but left a
       non-finite buffer (one more `all_finite` pass and host sync).

    Args:
        model: the `nn.Module` (its device gives autocast's device type).
        optimizer: a `torch.optim.Optimizer` owning every trainable
            parameter of `model` (GradScaler unscales only its grads); not
            one whose step needs a closure (LBFGS: refused with the fix).
        loss_fn: ``loss_fn(model, batch) -> loss`` or ``(loss, aux)``; loss a
            0-d tensor (as on the JAX side; a shape-(1,) loss is refused too).
        max_grad_norm: clip threshold (> 0) or None.
        scaler: None, a `torch.amp.GradScaler`, or a torchref loss scale
            (`DynamicLossScale()` etc.; `make_scaler` is called for you).
        autocast_dtype: None, torch.float16/torch.bfloat16 or a dtype name.
        max_consecutive: sets ``skip_state.exceeded`` (see `skip_non_finite`).
        clip_eps: eps of the clip formula (torch's 1e-6 by default).
        restore_buffers_on_skip: restore buffers on skipped steps and when
            the step left a non-finite buffer.
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
        if _needs_closure(optimizer):
            name = type(optimizer).__name__
            raise TypeError(
                f"TrainStep cannot drive {name}: its step() re-evaluates the loss "
                "through a closure, and TrainStep takes one forward and backward "
                "per step (torch.amp's recipe; GradScaler.step refuses closures "
                f"too). Guard it with torchref.transforms.skip_non_finite({name}"
                "(...)) and call .step(closure) yourself"
            )
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

    def _flag_unscaled_overflow(self, grads: list[torch.Tensor]) -> None:
        """Marks GradScaler's found_inf when the UNSCALED grads are not finite.

        GradScaler tests the scaled gradients, then multiplies them by
        1/scale. With a scale below 1 that multiply can overflow: finite
        scaled gradients become inf, GradScaler still steps (params went to
        [-inf, -inf]) and does not back off. The JAX step tests the unscaled
        gradients; so does this, and a non-finite one sets found_inf so that
        `scaler.step` skips and `scaler.update` backs off, exactly as there.
        Only for scales below 1 (one more pass and host sync): above, a
        finite scaled gradient times 1/scale <= 1 stays finite.
        """
        try:
            found = self.scaler._found_inf_per_device(self.optimizer)
        except AttributeError:  # a GradScaler without the (private) hook
            return
        if found and not all_finite(grads):
            for flag in found.values():
                flag.fill_(1.0)

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
        if loss_scale < 1.0 and self._scaler_enabled():
            self._flag_unscaled_overflow(grads)
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
        # Buffers go back on a skipped step, and also when the forward wrote
        # a non-finite one on an applied step (a batch-norm running_var of
        # inf from a feature of 1e20, with finite gradients), as the JAX step
        # keeps a non-finite model_state out.
        if saved is not None and (not applied or not all_finite(list(model.buffers()))):
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
