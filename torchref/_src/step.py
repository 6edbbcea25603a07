"""A guarded PyTorch train step, mirroring `jaxstable._src.step`.

`TrainStep` runs the recipe of the torch.amp docs with the real
`torch.amp.GradScaler`, `torch.autocast` and `clip_grad_norm_` (as its two
halves: `get_total_norm`, and `clip_grads_with_norm_`'s coefficient) and
returns the same metrics as the JAX step: ``loss``, ``grad_norm``,
``loss_scale``, ``finite``, ``skipped_total``. GradScaler's ``step`` is not
called: it reads ``found_inf`` on the host before a non-fused
``optimizer.step()``; the step hands the flag to the optimizer itself, as
GradScaler does to a fused one (see `TrainStep`).

The step's phases are `TrainStep` methods (forward and backward, check,
optimizer step, bookkeeping); its arguments are checked in `step_checks`,
the loss and its share in `step_loss`, the micro-batches in `microbatches`,
the state dict and the buffers a skipped step keeps in `step_state` and the
metrics in `step_records`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from _stablecore.checks import check_microbatch_drop
from torchref._src import distributed as _dist

# The step's guard: the skip decision, the clip and the deferred records.
from torchref._src.clipping import (
    clip_by_global_norm,
    clip_in_place,
    norm_and_finite,
    norm_read_on_host,
    to_host,
)
from torchref._src.guard import (
    DeferredRecords,
    SkipNonFiniteState,
    check_bool,
    check_max_consecutive,
)
from torchref._src.guard_step import GuardedStep
from torchref._src.microbatches import KeptMicrobatches, combine_aux, split_batch
from torchref._src.step_checks import autocast_dtype as _autocast_dtype
from torchref._src.step_checks import (
    check_microbatches,
    check_step_parts,
    make_scaler,
    warn_if_disabled_scaler,
)
from torchref._src.step_loss import backward_share, forward
from torchref._src.step_records import device_metrics, read_metrics
from torchref._src.step_state import BufferGuard, StepStateDict

__all__ = ["TrainStep"]


class _Check(NamedTuple):
    """The step's ONE decision and what it read on the way (`TrainStep._check`)."""

    found: dict[Any, torch.Tensor]  # GradScaler's per-device found_inf
    host: bool  # the skip is decided on the host
    read: Any  # the host path's one read (norm_read_on_host), or None
    grad_norm: torch.Tensor  # pre-clip, unscaled
    bad: torch.Tensor  # the loss or the gradients are non-finite
    buffers_bad: Any  # the forward wrote a non-finite buffer element
    loss: torch.Tensor  # the loss (the mean over the micro-batches)


class TrainStep(DeferredRecords, StepStateDict):
    """One guarded optimizer step: autocast, GradScaler, clip, skip.

    Order of work in ``step(batch)`` (that of the torch.amp docs):

    1. ``optimizer.zero_grad(set_to_none=True)``; snapshot the model's buffers
       (batch-norm statistics) if `restore_buffers_on_skip`.
    2. ``loss = loss_fn(model, batch)`` under ``torch.autocast(device_type,
       dtype=autocast_dtype)`` when `autocast_dtype` is set.
    3. ``scaler.scale(loss).backward()``; ``scaler.unscale_(optimizer)``.
       With ``microbatches=k``, steps 2-3 are GradScaler's accumulation
       recipe: the batch's first dimension is split into k equal
       consecutive micro-batches and ``scaler.scale(loss_i / k).backward()``
       runs for each (the gradients add up in ``.grad``; the buffers are
       updated by each forward in turn), then one ``unscale_``.
    4. ONE skip decision, a 0-d bool tensor on the device: the loss
       (any micro-batch's) is finite, GradScaler's own ``found_inf``
       recorded by `unscale_` (read through its private
       ``_found_inf_per_device(optimizer)``) is 0, and the UNSCALED
       gradients are finite (the float64 pass of the norm in 5; with a
       scale below 1 the multiply by 1/scale can overflow after
       GradScaler's test). A non-finite loss makes the step non-finite
       even when the gradients are finite (``log`` of an activation a mask
       zeroed is -inf and the mask zeroes its gradient). The decision is
       written into GradScaler's found_inf, so the scale backs off exactly
       when the step is skipped for its loss or gradients, as in the JAX
       step.
    5. ``grad_norm`` = pre-clip global norm (float32, torch's value bit for
       bit); when finite and `max_grad_norm` is set, grads are multiplied
       by `clip_grads_with_norm_`'s coefficient. On a non-finite step the
       coefficient is 1 (selected on the device), so the grad report still
       names the bad leaves.
    6. The optimizer step, on one of two paths (`decide_on`). Only the
       parameters with a gradient and their state are copied or checked;
       the others are not touched. Device path (no host sync; the default
       on the CPU and for a fused optimizer): a fused optimizer
       (``fused=True`` Adam/AdamW/SGD) gets found_inf as GradScaler hands
       it, any other one steps on ONE copy of its parameters and state
       that `torch.where` selects back where the step is skipped. Host
       path (the default for a non-fused optimizer on an accelerator,
       where GradScaler.step syncs too): the flag, the gradients' norm and
       the buffers' flag are read in ONE transfer and a bad step does not
       call ``optimizer.step()``. With `check_update` (default) what the
       step wrote is checked too, and put back when not finite (finite
       gradients do not make a finite Adam step in float16): such a step
       counts as skipped, with ``grads_finite`` True; where the update is
       proved finite (float32 SGD without weight decay, Adam with eps > 0
       and no L2 decay, AdamW, under the clip or, on the host path, the
       norm read there: `torchref.transforms.stable_optimizer`) nothing is
       copied or checked. The step that creates the optimizer state (the
       first) decides on the host once on the device path.
    7. ``scaler.update()`` (`DynamicGradScaler` also clamps to
       `min_loss_scale`): the scale reacts to the loss and gradients only,
       as GradScaler does (a non-finite update is no loss-scale overflow);
       counters (a device count, and `skip_state` when read); on a skipped
       step the buffers are selected back, as the JAX step keeps
       `model_state` unchanged (the forward already updated batch-norm
       running stats), and so they are when the step was applied but the
       forward made a buffer element non-finite that was finite before (an
       element non-finite before the step, such as an additive ``-inf``
       causal mask, is no bad write).

    On the device path, no ``.item()`` and no ``bool(tensor)`` in 1-7 in
    one process (issue 24; `torchref/tests/test_train.py` profiles it; the
    host path reads once, twice where an unproved update is checked):
    ``step(batch)`` reads
    its python metrics in ONE transfer at the end, ``step(batch,
    sync=False)`` returns them as 0-d tensors
    (`benchmarks/bench_torch_syncs.py` counts syncs and ops). Some places
    still read the host, by design: DDP/FSDP2 (the loss all-reduce of
    `torchref.distributed` reads the global loss and the used-parameter
    counts to name a bad parameter), sharded FSDP2 parameters (one read of
    the flag; no flat copy of DTensors) and the first step (Adam creates
    its state: one read of the flag), and a non-fused optimizer with step
    hooks (one read per step: it is not stepped when skipped, as under
    GradScaler, so that its hooks never see a skipped step), and a state
    the guard did not write (``load_state_dict``: its largest magnitudes
    are read once to prove the updates after it finite).
    `skip_spikes`' window and counters are device tensors too.

    Under DDP or FSDP2 (a process group of N ranks) the step also
    all-reduces the ranks' losses before the backward: ``loss`` is the
    global mean and a non-finite loss on one rank is one on every rank;
    it backpropagates ``loss / N`` and sums the gradients (DDP: its comm
    hook; FSDP2: a gradient divide factor of 1), one device's float16
    headroom; under DDP it refuses a ``loss_fn`` that bypasses the wrapper
    and a parameter used on some ranks only (see `torchref.distributed`).

    Args:
        model: the `nn.Module` (its device gives autocast's device type).
        optimizer: a `torch.optim.Optimizer` owning every trainable
            parameter of `model` (GradScaler unscales only its grads); not
            one whose step needs a closure (LBFGS: refused with the fix).
        loss_fn: ``loss_fn(model, batch) -> loss`` or ``(loss, aux)``; loss a
            0-d tensor (as on the JAX side; a shape-(1,) loss is refused too).
        max_grad_norm: clip threshold (> 0) or None.
        scaler: None, a `torch.amp.GradScaler`, or a torchref loss scale
            (`DynamicLossScale()` etc.; `make_scaler` is called for you). A
            ``GradScaler("cuda")`` that torch turned off for want of CUDA
            gets a UserWarning (the steps would run unscaled).
        autocast_dtype: None, torch.float16/torch.bfloat16 or a dtype name.
        max_consecutive: sets ``skip_state.exceeded`` (see `skip_non_finite`).
        clip_eps: eps of the clip formula (torch's 1e-6 by default).
        restore_buffers_on_skip: restore buffers on skipped steps and when
            the step left a non-finite buffer (also buffers the forward
            assigned anew, ``self.buf = ...``; a ValueError when such a
            buffer changed shape and must be restored).
        check_update: undo a step that wrote a non-finite parameter or
            optimizer-state value (default True; one read pass per step
            where the update is not proved finite, see 6; a non-fused
            optimizer's parameters and state are copied before every step
            on the device path either way).
        microbatches: None, or k >= 1: gradient accumulation (see step 2-3;
            ``jaxstable.train.make_train_step(microbatches=k)`` does the
            same). One check, clip, skip decision, count and scaler update
            per call. ``metrics["loss"]`` is the mean of the k losses and
            ``metrics["aux"]`` combines the micro-batches' (floats averaged,
            booleans ANDed, integers summed, a `CheckPoints` finite where all
            were with the largest ``max_abs``). A tensor whose first
            dimension k does not divide raises ValueError, a k that is not
            an int >= 1 TypeError/ValueError (the JAX step's texts).
        drop_non_finite_microbatches: False (default: a non-finite
            micro-batch skips the whole step, GradScaler's recipe) or True
            (needs ``microbatches``): each micro-batch's backward runs into
            an empty ``.grad``, its loss and scaled gradient are checked on
            the device, and a non-finite one is dropped (selected out of a
            float32 sum; the buffers its forward wrote are put back); the
            kept ones are averaged with weights ``w_i``, ``grads = sum_kept
            w_i g_i / sum_kept w_i`` (so with a mean loss and ``w_i`` the
            micro-batch's rows or tokens, the step on the kept rows alone),
            ``metrics["loss"]`` their weighted mean loss. One ``unscale_``,
            check, clip and skip follow; the step is skipped only when none
            is kept or the result is non-finite. The scaler backs off when
            ANY micro-batch was dropped (written into its ``found_inf``
            before ``update``, as GradScaler's own recipe would back off),
            though the step is applied with the kept ones: otherwise a
            scale that overflows one micro-batch in k would never back off
            and would keep dropping the largest gradients.
            ``metrics["microbatches_dropped"]`` counts them; ``aux``
            combines all k. One extra gradient read and one float32 sum
            per micro-batch; no host sync. Refused (ValueError) under
            DDP/FSDP2 for now. The arithmetic of
            ``jaxstable.train.make_train_step`` op for op.
        microbatch_weight: None (each micro-batch weighs 1: equal rows) or
            ``microbatch_weight(micro_batch) -> number or 0-d tensor`` (>= 0),
            e.g. ``lambda b: b["mask"].sum()`` (its real tokens). Only with
            ``drop_non_finite_microbatches=True``.
        decide_on: ``"auto"`` (default), ``"device"`` or ``"host"``: where
            the skip is decided (see 6); ``"auto"`` is ``"device"`` for an
            optimizer that takes GradScaler's ``found_inf`` (fused: it
            skips in its kernel, no copy, no sync) off the CPU, else
            ``"host"`` (one read per step, as GradScaler.step, which on
            the CPU is no transfer; no copy where the update is proved
            finite). ``"device"`` keeps a non-fused optimizer free
            of host syncs at the price of one copy. Also an attribute
            (``step.decide_on``).

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
        >>> acc = TrainStep(model, opt, mse, microbatches=2)  # 2 x 2 rows
        >>> acc((torch.ones(4, 3), torch.zeros(4, 1)))["finite"]
        True
        >>> keep = TrainStep(model, opt, mse, microbatches=2,
        ...                  drop_non_finite_microbatches=True)
        >>> x = torch.ones(4, 3); x[3, 0] = float("nan")  # micro-batch 1
        >>> m = keep((x, torch.zeros(4, 1)))
        >>> m["finite"], m["microbatches_dropped"]
        (True, 1)
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
        microbatches: int | None = None,
        decide_on: str = "auto",
        drop_non_finite_microbatches: bool = False,
        microbatch_weight: Callable[[Any], Any] | None = None,
    ) -> None:
        self.spikes, optimizer = check_step_parts(model, optimizer, loss_fn)
        first = next(itertools.chain(model.parameters(), model.buffers()), None)
        self.device_type = first.device.type if first is not None else "cpu"
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scaler = make_scaler(scaler, self.device_type)
        warn_if_disabled_scaler(self.scaler, self.device_type)
        self.autocast_dtype = _autocast_dtype(autocast_dtype, model)
        self.max_consecutive = check_max_consecutive(max_consecutive)
        self.clip = (
            None
            if max_grad_norm is None
            else clip_by_global_norm(max_grad_norm, eps=clip_eps)
        )
        self.restore_buffers_on_skip = bool(restore_buffers_on_skip)
        self.check_update = check_bool("check_update", check_update)
        self.microbatches = check_microbatches(microbatches)
        self.drop_non_finite_microbatches = check_microbatch_drop(
            drop_non_finite_microbatches, microbatch_weight, self.microbatches
        )
        self.microbatch_weight = microbatch_weight
        self._guarded = GuardedStep()
        self._guarded.decide_on = decide_on
        self._buffer_guard = BufferGuard(model)
        # Under DDP/FSDP2: the process group's size, the loss share each
        # replica backpropagates and the hook that tells a loss_fn bypassing
        # the wrapper (see `step_loss.backward_share`); None / 1 in one process.
        self._replicas = _dist._Replicas.of(model)
        if self.drop_non_finite_microbatches and self._replicas is not None:
            raise ValueError(
                "drop_non_finite_microbatches=True is not supported under "
                "DDP/FSDP2 yet (each rank would drop its own micro-batches); "
                "leave it False there"
            )
        self.skip_state = SkipNonFiniteState()
        self.steps_done = 0
        # State machine: "ready" between steps, else the stage a step is in
        # (or was in when it raised): refuses re-entry and a half-done step.
        self._stage = "ready"

    # --------------------------------------------------------------- helpers
    @property
    def decide_on(self) -> str:
        """Where the skip is decided: ``"auto"``, ``"device"`` or ``"host"``
        (see the class docstring, 6); settable."""
        return self._guarded.decide_on

    @decide_on.setter
    def decide_on(self, value: str) -> None:
        self._guarded.decide_on = value

    def _found_inf(self) -> dict[Any, torch.Tensor]:
        """GradScaler's per-device found_inf recorded by `unscale_` ({} for
        no enabled scaler, or a GradScaler without the private hook)."""
        if not self._scaler_enabled():
            return {}
        try:
            return self.scaler._found_inf_per_device(self.optimizer) or {}
        except AttributeError:  # a GradScaler without the (private) hook
            return {}

    def _scale_used(self) -> Any:
        """The scale of this step as a 0-d tensor (a copy: `update` changes
        GradScaler's in place), 1.0 without an enabled scaler; no sync
        (`get_scale()` is an ``.item()``)."""
        if not self._scaler_enabled():
            return 1.0
        scale = getattr(self.scaler, "_scale", None)
        if scale is None:  # not created yet (or another GradScaler)
            return float(self.scaler.get_scale())
        return scale.detach().clone()

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
    def __call__(self, batch: Any, *, sync: bool = True) -> dict[str, Any]:
        """Same as `step`."""
        return self.step(batch, sync=sync)

    def step(self, batch: Any, *, sync: bool = True) -> dict[str, Any]:
        """Runs one guarded step; see the class docstring for the order.

        The step itself reads nothing back from the device (one process,
        no `skip_spikes`): every decision (skip, clip coefficient, scale
        back-off, buffer restore) is a device tensor. With ``sync=True``
        (default) the metrics are then read in ONE batched device->host
        transfer (which also records `skip_state`); with ``sync=False``
        they stay 0-d tensors and `skip_state` is brought up to date, in one
        transfer, when it is next read. ``sync`` is torch-only: the JAX
        step returns device arrays anyway (``jax.device_get`` reads them).

        Args:
            batch: the batch handed to ``loss_fn(model, batch)``.
            sync: return python numbers (True) or 0-d tensors (False).

        Returns:
            ``{"loss": float (unscaled), "grad_norm": float (pre-clip,
            unscaled, float32; inf/nan on a non-finite step), "loss_scale":
            float (the scale USED for this step), "finite": bool (the step
            was applied: gradients and what the step wrote all finite),
            "grads_finite": bool (the loss and the gradients; the flag the
            loss scale reacts to), "skipped_total": int}`` plus ``"aux"`` when
            `loss_fn` returns ``(loss, aux)``, and ``"spike": bool`` when the
            optimizer is ``torchref.transforms.skip_spikes(optimizer)`` (its
            window sees the pre-clip norm and the loss; a spike skips
            ``optimizer.step()`` and leaves the loss scale to the gradients'
            flag, as the JAX step does; `skip_state` counts it as the JAX
            step's inner guard does: ``last_grads_finite`` False, no
            ``non_finite_updates``), and the `RoundingStats` fields
            (``"lost_update"``, ...: floats, in the same host transfer) when
            the optimizer is a `low_precision_adamw`. With ``sync=False``
            the same keys hold 0-d tensors (float32, bool and int64;
            ``spike`` a bool).
        """
        if self._stage != "ready":
            raise RuntimeError(
                f"TrainStep.step() called while a step is {self._stage!r}: either "
                "loss_fn called step() re-entrantly, or the previous step raised "
                "half-way (call .reset() to discard it)"
            )
        sync = check_bool("sync", sync)
        self._stage = "forward"
        try:
            metrics = self._step(batch)
        except BaseException:
            # Before backward nothing but the grads (zeroed) and buffers was
            # touched: the step can simply be retried. Later, GradScaler holds
            # a half-done iteration, so the guard stays up until reset().
            if self._stage == "forward":
                self._stage = "ready"
            raise
        if not sync:
            return metrics
        # The one host sync of a step, outside it: the three floats and every
        # pending (applied, grads_finite) pair in one transfer.
        flags = [t for pair in self._pending for t in pair]
        self._record(read_metrics(metrics, flags, self.spikes is not None))
        state = self._skip_state
        metrics["finite"] = state.last_finite
        metrics["skipped_total"] = state.skipped_total
        return metrics

    def _step(self, batch: Any) -> dict[str, Any]:
        k = self.microbatches
        parts = [batch] if k is None else split_batch(batch, k)
        self.optimizer.zero_grad(set_to_none=True)
        self._buffer_guard.take(self.restore_buffers_on_skip)
        losses, auxes, kept = self._forward_backward(parts)
        # The scale USED for this step (copied before update changes it).
        loss_scale = self._scale_used()
        # Under DDP/FSDP2 the losses are already the global ones (`share`): a
        # non-finite loss on one rank is one on every rank.
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        self._stage = "check"
        check = self._check(losses)
        spike, spike_values, refuse = None, None, check.bad
        if self.spikes is not None:
            # The pre-clip norm and the loss against the window of applied
            # steps (jaxstable: the step passes value=loss to skip_spikes),
            # on the device too.
            _, spike, spike_values = self.spikes._decision.check(
                check.grad_norm, check.loss, ~check.bad
            )
            # A spike is no overflow: found_inf keeps `bad`, the scale goes on.
            refuse = check.bad | spike.to(check.bad.device)
        self._stage = "optimizer step"
        skipped, buffers_bad = self._optimizer_step(check, refuse)
        if kept is not None:
            # One decision for the scale: it backs off when ANY micro-batch
            # was dropped, as GradScaler's found_inf over the whole sum would.
            for flag in check.found.values():
                flag.copy_(check.bad | (kept.dropped > 0).to(check.bad.device))
        if self._scaler_enabled():
            self.scaler.update()
        if self.spikes is not None:
            self.spikes._decision.record(spike_values, spike, ~skipped)
        self._buffer_guard.put_back(skipped, buffers_bad, self._guarded.host_skipped)
        flags = self._count(skipped, check.bad, spike)
        self.steps_done += 1
        self._stage = "ready"
        aux = auxes[0] if k is None or auxes[0] is None else combine_aux(auxes)
        return device_metrics(
            check.loss,
            check.grad_norm,
            loss_scale,
            flags,
            self._skipped_dev,
            self.optimizer,
            spike=spike,
            dropped=None if kept is None else kept.dropped,
            aux=aux,
        )

    def _forward_backward(self, parts: list[Any]) -> tuple[list, list, Any]:
        """``(losses, auxes, kept)``: the forward and backward of each of
        the micro-batches ``parts`` (GradScaler's accumulation recipe,
        ``scaler.scale(loss / k).backward()`` for each, the gradients adding
        up in ``.grad``); ``kept`` the `KeptMicrobatches` with
        ``drop_non_finite_microbatches``, else None."""
        k = self.microbatches
        rep = self._replicas
        if rep is not None:
            rep.forward_calls = 0
        kept = None
        if self.drop_non_finite_microbatches:
            kept = KeptMicrobatches(
                self.model, self.optimizer, k, self.microbatch_weight
            )
        losses, auxes = [], []
        for part in parts:
            self._stage = "forward"
            if kept is not None:
                kept.before(part)
            loss, aux = forward(
                self.model, self.loss_fn, part, self.device_type, self.autocast_dtype
            )
            self._stage = "backward"
            loss = backward_share(loss, k, rep, self.scaler, self.steps_done)
            losses.append(loss.detach().float())
            auxes.append(aux)
            if kept is not None:
                kept.after(losses[-1])
        if kept is not None:
            losses = [kept.finish()]
        return losses, auxes, kept

    def _check(self, losses: list[torch.Tensor]) -> _Check:
        """ONE decision, on the device. A non-finite loss is a non-finite
        step even when its gradients are finite (a -inf from log of a
        dropped activation whose gradient the mask zeroes). GradScaler's
        found_inf tests the SCALED gradients; the norm pass tests the
        UNSCALED ones too (with a scale below 1 the multiply by 1/scale can
        overflow after GradScaler's test), so both agree with the JAX step."""
        grads = [p.grad for p in self._params() if p.grad is not None]
        stacked = torch.stack(losses)
        finite = torch.isfinite(stacked).all()
        found = self._found_inf()
        for flag in found.values():
            finite = finite & (flag.to(finite.device) == 0)
        host = self._guarded.on_host(self.optimizer)
        buffers_bad = self._buffer_guard.new_non_finite()
        read = (
            norm_read_on_host(grads, [finite, buffers_bad], self.clip) if host else None
        )
        if read is not None:  # GradScaler's path: ONE read of flags and norm
            grad_norm, grads_ok = read[0], torch.ones((), dtype=torch.bool)
        elif self.clip is not None:
            grad_norm, grads_ok = clip_in_place(
                grads, self.clip.max_norm, self.clip.eps, apply=finite
            )
        else:
            grad_norm, grads_ok, _ = norm_and_finite(grads)
        bad = ~(finite & grads_ok.to(finite.device))
        # Written into GradScaler's flag (bad covers it), so that update()
        # backs off exactly when the step is skipped for its loss or grads.
        for flag in found.values():
            flag.copy_(bad)
        loss = losses[0] if self.microbatches is None else stacked.mean()
        return _Check(found, host, read, grad_norm, bad, buffers_bad, loss)

    def _optimizer_step(self, check: _Check, refuse: Any) -> tuple[Any, Any]:
        """``(skipped, buffers_bad)``: the optimizer stepped unless
        ``refuse`` (see `decide_on`), ``skipped`` a 0-d bool tensor."""
        max_norm = None if self.clip is None else self.clip.max_norm
        norm, buffers_bad, read = check.grad_norm, check.buffers_bad, check.read
        if read is not None:
            norm, buffers_bad = read[1], bool(read[2][1])
            refuse = refuse if self.spikes is not None else not read[2][0]
        elif check.host:
            # The norm was not finite: the flag, the norm (a bound on every
            # gradient entry) and the buffers' flag in one read.
            refuse, norm, buffers_bad = to_host([refuse, norm, buffers_bad])
            refuse, buffers_bad = bool(refuse), bool(buffers_bad)
        skipped = self._guarded.run(
            self.optimizer, refuse, self.check_update, max_norm, norm
        )
        return skipped.to(check.bad.device), buffers_bad

    def _count(self, skipped: Any, bad: Any, spike: Any) -> tuple[Any, Any]:
        """``(applied, grads_finite)``, the step counted on the device and
        left pending for `skip_state`."""
        if self._skipped_dev is None:
            self._skipped_dev = torch.tensor(
                self._skip_state.skipped_total, device=bad.device
            )
        self._skipped_dev = self._skipped_dev + skipped
        applied, grads_finite = ~skipped, ~bad
        # skip_state records a spike as the JAX step's inner guard does
        # (grads_finite & ~spike: no non-finite update); the metric keeps
        # the gradients' own flag.
        recorded = (
            grads_finite if spike is None else grads_finite & ~spike.to(bad.device)
        )
        self._push(applied, recorded)
        return applied, grads_finite
