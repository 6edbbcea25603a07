"""A guarded PyTorch train step, mirroring `jaxstable._src.step`.

`TrainStep` runs the recipe of the torch.amp docs with the real
`torch.amp.GradScaler`, `torch.autocast` and `clip_grad_norm_` (as its two
halves: `get_total_norm`, and `clip_grads_with_norm_`'s coefficient) and
returns the same metrics as the JAX step: ``loss``, ``grad_norm``,
``loss_scale``, ``finite``, ``skipped_total``. GradScaler's ``step`` is not
called: it reads ``found_inf`` on the host before a non-fused
``optimizer.step()``; the step hands the flag to the optimizer itself, as
GradScaler does to a fused one (see `TrainStep`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from _stablecore.checks import check_microbatch_drop as _check_microbatch_drop
from _stablecore.checks import check_microbatches as _core_check_microbatches
from _stablecore.low_precision import STAT_NAMES
from torchref._src import distributed as _dist
from torchref._src.check_points import CheckPoints
from torchref._src.loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
)
from torchref._src.low_precision import rounding_stats
from torchref._src.precision import get_policy
from torchref._src.spikes import SkipSpikes
from torchref._src.transforms import (
    SkipNonFinite,
    SkipNonFiniteState,
    _all_finite_t,
    _check_bool,
    _check_max_consecutive,
    _check_optimizer,
    _clip_in_place,
    _DeferredRecords,
    _DeviceSelect,
    _GuardedStep,
    _needs_closure,
    _norm_and_finite,
    _to_host,
    clip_by_global_norm,
    norm_read_on_host,
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


def _warn_if_disabled_scaler(scaler: Any, device_type: str) -> None:
    """Warns when `scaler` is a GradScaler torch disabled for want of CUDA.

    ``torch.amp.GradScaler("cuda")`` on a machine without CUDA warns once, in
    torch's words, and turns itself off: every step then runs at loss scale
    1, unscaled, while the code reads as dynamic loss scaling (issue 35). A
    user's ``GradScaler("cuda", enabled=False)`` looks the same; it gets the
    warning too, whose last fix (``scaler=None``) silences it.
    """
    if (
        not isinstance(scaler, torch.amp.GradScaler)
        or scaler.is_enabled()
        or getattr(scaler, "_device", None) != "cuda"
        or torch.cuda.is_available()
    ):
        return
    warnings.warn(
        "scaler is a disabled torch.amp.GradScaler('cuda'): CUDA is not "
        "available here, so torch turned it off and TrainStep trains at loss "
        f"scale 1, without loss scaling. The model is on {device_type!r}: pass "
        f"torch.amp.GradScaler({device_type!r}) (or GradScaler(device) with "
        "device = next(model.parameters()).device.type, or "
        "torchref.loss_scale.DynamicLossScale(), which makes the GradScaler "
        "for the model's device); pass scaler=None to train unscaled without "
        "this warning",
        UserWarning,
        stacklevel=3,
    )


_MIXED_NAMES = ("mixed_float16", "mixed_bfloat16")


def _autocast_dtype(dtype: Any, model: torch.nn.Module) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        policy = get_policy(dtype)
        spec = dtype.strip().lower()
        # A bare dtype name is the autocast dtype (the argument's meaning);
        # a policy that states the params' dtype must match the model's, as
        # jaxstable.train.make_train_step(policy=...) requires.
        if "=" in spec or spec in _MIXED_NAMES:
            _check_param_dtypes(model, policy, dtype)
        dtype = policy.compute_dtype
    if dtype not in _AUTOCAST_DTYPES:
        raise ValueError(
            "autocast_dtype must be None, torch.float16 or torch.bfloat16, "
            f"got {dtype!r}"
        )
    return dtype


def _check_microbatches(microbatches: Any) -> int | None:
    return _core_check_microbatches(microbatches)


def _split_batch(batch: Any, k: int, path: str = "") -> list[Any]:
    """The k micro-batches: every tensor's first dimension in k equal
    consecutive slices (as ``torch.chunk``); other leaves go to each."""
    if isinstance(batch, torch.Tensor):
        if batch.ndim == 0 or batch.shape[0] % k:
            # Same text as jaxstable.train.make_train_step.
            raise ValueError(
                f"microbatches={k}: batch leaf {path or '(the batch)'} has shape "
                f"{tuple(batch.shape)}; every batch leaf needs a leading axis "
                f"divisible by {k} (micro-batch i is its i-th of {k} equal "
                "consecutive slices)"
            )
        return list(batch.split(batch.shape[0] // k))
    if isinstance(batch, Mapping):
        parts = {
            key: _split_batch(v, k, f"{path}[{key!r}]") for key, v in batch.items()
        }
        return [type(batch)((key, v[i]) for key, v in parts.items()) for i in range(k)]
    if isinstance(batch, list | tuple):
        parts = [_split_batch(v, k, f"{path}[{i}]") for i, v in enumerate(batch)]
        rows = [[p[i] for p in parts] for i in range(k)]
        if hasattr(batch, "_fields"):  # a NamedTuple
            return [type(batch)(*row) for row in rows]
        return [type(batch)(row) for row in rows]
    return [batch] * k


def _nanmax(values: Any) -> torch.Tensor:
    """The largest of 0-d tensors ignoring nan; nan when all are nan."""
    x = torch.stack(list(values))
    big = torch.where(torch.isnan(x), torch.full_like(x, -math.inf), x).amax()
    return torch.where(big == -math.inf, torch.full_like(big, math.nan), big)


def _combine_aux(auxes: list[Any]) -> Any:
    """One ``aux`` from the micro-batches': floating tensors and floats
    averaged (a mean over equal micro-batches is the whole batch's), booleans
    ANDed, integers summed; a `CheckPoints` collector is finite where every
    micro-batch was, with the largest ``max_abs`` (nan only when no
    micro-batch had a finite entry). The rule of
    `jaxstable.train.make_train_step`."""
    first = auxes[0]
    if isinstance(first, CheckPoints):
        return CheckPoints(
            first.names,
            [
                torch.stack(f).all()
                for f in zip(*(a.finite for a in auxes), strict=True)
            ],
            [_nanmax(m) for m in zip(*(a.max_abs for a in auxes), strict=True)],
        )
    if isinstance(first, Mapping):
        return type(first)(
            (key, _combine_aux([a[key] for a in auxes])) for key in first
        )
    if isinstance(first, list | tuple):
        items = [_combine_aux(list(v)) for v in zip(*auxes, strict=True)]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    if isinstance(first, torch.Tensor):
        stacked = torch.stack([a.detach() for a in auxes])
        if stacked.dtype == torch.bool:
            return stacked.all(dim=0)
        if stacked.is_floating_point() or stacked.is_complex():
            return stacked.mean(dim=0)
        return stacked.sum(dim=0)
    if isinstance(first, bool):
        return all(auxes)
    if isinstance(first, int):
        return sum(auxes)
    if isinstance(first, float):
        return sum(auxes) / len(auxes)
    return first if all(a is first for a in auxes) else list(auxes)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_param_dtypes(model: torch.nn.Module, policy: Any, spec: str) -> None:
    want = _dtype_name(policy.param_dtype)
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != policy.param_dtype:
            have, compute = _dtype_name(p.dtype), _dtype_name(policy.compute_dtype)
            mixed = f" or 'mixed_{compute}'" if have == "float32" else ""
            # Same text as jaxstable.train.make_train_step (leaf named its way).
            raise ValueError(
                f"policy {spec!r} stores params in {want}, but params "
                f"leaf {name} is {have} "
                "(a single dtype name such as 'bf16' sets params, compute and "
                f"output). For {have} params computed in {compute} say "
                f"'params={have},compute={compute},output=float32'{mixed}; for "
                f"{want} params, cast them first. Policy grammar: one dtype "
                "name for params, compute and output (bf16, f16, f32, ...), "
                "mixed_float16 or mixed_bfloat16 (float32 params and output), or "
                "comma-separated key=dtype pairs with keys params|p, compute|c, "
                "output|o"
            )


class TrainStep(_DeferredRecords):
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
            skips in its kernel, no copy, no sync), else ``"host"`` (one
            read per step, as GradScaler.step; no copy where the update is
            proved finite). ``"device"`` keeps a non-fused optimizer free
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
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"model must be a torch.nn.Module, got {type(model).__name__}"
            )
        self.spikes = None
        if isinstance(optimizer, SkipSpikes):
            if not optimizer.plain:
                raise TypeError(
                    "TrainStep takes skip_spikes(plain_optimizer) (it checks, clips "
                    "and skips itself), not skip_spikes around a torchref wrapper"
                )
            self.spikes, optimizer = optimizer, optimizer.optimizer.optimizer
        if isinstance(optimizer, SkipNonFinite):
            raise TypeError(
                "pass the plain torch optimizer (TrainStep skips non-finite steps "
                "itself), not a torchref.transforms wrapper: use wrapper.optimizer"
            )
        _check_optimizer(optimizer, "TrainStep")
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
        _warn_if_disabled_scaler(self.scaler, self.device_type)
        self.autocast_dtype = _autocast_dtype(autocast_dtype, model)
        self.max_consecutive = _check_max_consecutive(max_consecutive)
        self.clip = (
            None
            if max_grad_norm is None
            else clip_by_global_norm(max_grad_norm, eps=clip_eps)
        )
        self.restore_buffers_on_skip = bool(restore_buffers_on_skip)
        self.check_update = _check_bool("check_update", check_update)
        self.microbatches = _check_microbatches(microbatches)
        self.drop_non_finite_microbatches = _check_microbatch_drop(
            drop_non_finite_microbatches, microbatch_weight, self.microbatches
        )
        self.microbatch_weight = microbatch_weight
        self._guarded = _GuardedStep()
        self._guarded.decide_on = decide_on
        self._buffer_copy = _DeviceSelect()
        # Under DDP/FSDP2: the process group's size, the loss share each
        # replica backpropagates and the hook that tells a loss_fn bypassing
        # the wrapper (see `_step`); None / 1 in one process.
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

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _scaler_enabled(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

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
        sync = _check_bool("sync", sync)
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
        keys = ("loss", "grad_norm", "loss_scale", "grads_finite", "spike")[
            : 4 if self.spikes is None else 5
        ]
        flags = [t for pair in self._pending for t in pair]
        rounding = [metrics[k] for k in STAT_NAMES if k in metrics]
        dropped = [metrics[n] for n in ("microbatches_dropped",) if n in metrics]
        values = _to_host([metrics[key] for key in keys] + flags + rounding + dropped)
        self._record(values[len(keys) : len(keys) + len(flags)])
        at = len(keys) + len(flags)  # the rounding statistics, then dropped
        names = [k for k in STAT_NAMES if k in metrics]
        metrics.update(
            zip(names, map(float, values[at : at + len(names)]), strict=True)
        )
        state = self._skip_state
        metrics.update(zip(keys[:3], (float(v) for v in values), strict=False))
        metrics["grads_finite"] = bool(values[3])
        if self.spikes is not None:
            metrics["spike"] = bool(values[4])
        if "microbatches_dropped" in metrics:
            metrics["microbatches_dropped"] = int(values[-1])
        metrics["finite"] = state.last_finite
        metrics["skipped_total"] = state.skipped_total
        return metrics

    def _step(self, batch: Any) -> dict[str, Any]:
        model, opt, scaler = self.model, self.optimizer, self.scaler
        k = self.microbatches
        parts = [batch] if k is None else _split_batch(batch, k)
        opt.zero_grad(set_to_none=True)
        buffers = list(model.buffers()) if self.restore_buffers_on_skip else []
        if buffers:
            self._buffer_copy.take(buffers)
        losses, auxes = [], []
        rep = self._replicas
        if rep is not None:
            rep.forward_calls = 0
        kept = _KeptMicrobatches(self) if self.drop_non_finite_microbatches else None
        for part in parts:
            # GradScaler's accumulation recipe: scaler.scale(loss / k).backward()
            # for each micro-batch, the gradients adding up in .grad.
            self._stage = "forward"
            if kept is not None:
                kept.before(part)
            loss, aux = self._forward(part)
            self._stage = "backward"
            share = loss if k is None else loss / k
            if rep is not None:
                # Before the backward (DDP's own all-reduces): the global loss
                # and the ranks' agreement on the parameters it uses.
                share, loss = rep.share(share, loss, self.steps_done)
            (scaler.scale(share) if scaler is not None else share).backward()
            losses.append(loss.detach().float())
            auxes.append(aux)
            if kept is not None:
                kept.after(losses[-1])
        if kept is not None:
            losses = [kept.finish()]
        # The scale USED for this step (copied before update changes it).
        loss_scale = self._scale_used()
        # Under DDP/FSDP2 the losses are already the global ones (`share`): a
        # non-finite loss on one rank is one on every rank.
        if scaler is not None:
            scaler.unscale_(opt)
        self._stage = "check"
        params = self._params()
        grads = [p.grad for p in params if p.grad is not None]
        # ONE decision, on the device. A non-finite loss is a non-finite step
        # even when its gradients are finite (a -inf from log of a dropped
        # activation whose gradient the mask zeroes). GradScaler's found_inf
        # tests the SCALED gradients; the norm pass below tests the UNSCALED
        # ones too (with a scale below 1 the multiply by 1/scale can
        # overflow after GradScaler's test), so both agree with the JAX step.
        stacked = torch.stack(losses)
        finite = torch.isfinite(stacked).all()
        found = self._found_inf()
        for flag in found.values():
            finite = finite & (flag.to(finite.device) == 0)
        host = self._guarded.on_host(opt)
        buffers_bad = self._check_buffers(buffers)
        read = (
            norm_read_on_host(grads, [finite, buffers_bad], self.clip) if host else None
        )
        if read is not None:  # GradScaler's path: ONE read of flags and norm
            grad_norm, grads_ok = read[0], torch.ones((), dtype=torch.bool)
        elif self.clip is not None:
            grad_norm, grads_ok = _clip_in_place(
                grads, self.clip.max_norm, self.clip.eps, apply=finite
            )
        else:
            grad_norm, grads_ok, _ = _norm_and_finite(grads)
        bad = ~(finite & grads_ok.to(finite.device))
        # Written into GradScaler's flag (bad covers it), so that update()
        # backs off exactly when the step is skipped for its loss or grads.
        for flag in found.values():
            flag.copy_(bad)
        loss_value = losses[0] if k is None else stacked.mean()
        spike, spike_values, refuse = None, None, bad
        if self.spikes is not None:
            # The pre-clip norm and the loss against the window of applied
            # steps (jaxstable: the step passes value=loss to skip_spikes),
            # on the device too.
            _, spike, spike_values = self.spikes._decision.check(
                grad_norm, loss_value, ~bad
            )
            # A spike is no overflow: found_inf keeps `bad`, the scale goes on.
            refuse = bad | spike.to(bad.device)
        self._stage = "optimizer step"
        max_norm = None if self.clip is None else self.clip.max_norm
        norm = grad_norm
        if read is not None:
            norm, buffers_bad = read[1], bool(read[2][1])
            refuse = refuse if self.spikes is not None else not read[2][0]
        elif host:
            # The norm was not finite: the flag, the norm (a bound on every
            # gradient entry) and the buffers' flag in one read.
            refuse, norm, buffers_bad = _to_host([refuse, grad_norm, buffers_bad])
            refuse, buffers_bad = bool(refuse), bool(buffers_bad)
        skipped = self._guarded.run(opt, refuse, self.check_update, max_norm, norm).to(
            bad.device
        )
        if kept is not None:
            # One decision for the scale: it backs off when ANY micro-batch
            # was dropped, as GradScaler's found_inf over the whole sum would.
            for flag in found.values():
                flag.copy_(bad | (kept.dropped > 0).to(bad.device))
        if self._scaler_enabled():
            scaler.update()
        if self.spikes is not None:
            self.spikes._decision.record(spike_values, spike, ~skipped)
        self._put_buffers_back(buffers, skipped, buffers_bad)
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
        self.steps_done += 1
        self._stage = "ready"
        metrics = {
            "loss": loss_value,
            "grad_norm": grad_norm.to(torch.float32),
            "loss_scale": torch.as_tensor(loss_scale, dtype=torch.float32),
            "finite": applied,
            "grads_finite": grads_finite,
            "skipped_total": self._skipped_dev,
        }
        if self.spikes is not None:
            metrics["spike"] = spike
        if kept is not None:
            metrics["microbatches_dropped"] = kept.dropped
        stats = rounding_stats(opt)
        if stats is not None:  # low_precision_adamw: what rounding lost
            metrics.update(stats._asdict())
        if auxes[0] is not None:
            metrics["aux"] = auxes[0] if k is None else _combine_aux(auxes)
        return metrics

    def _check_buffers(self, buffers: list[torch.Tensor]) -> Any:
        """After the forward: whether it made a buffer element non-finite
        that was finite before (0-d bool tensor; False for nothing to
        check). An element already non-finite before the step (an additive
        ``-inf`` mask) is no bad write. The copy follows buffers the
        forward assigned anew (``self.mean = 0.9 * self.mean + ...``)."""
        if not buffers:
            return False
        now = list(self.model.buffers())
        same = len(now) == len(buffers) and all(
            a is b for a, b in zip(now, buffers, strict=True)
        )
        self._buffers_follow = same or self._buffer_copy.retarget(now)
        if not self._buffers_follow:
            return ~_all_finite_t(now)
        bad = self._buffer_copy.new_non_finite()
        return False if bad is None else bad

    def _put_buffers_back(self, buffers: list, skipped: Any, bad: Any) -> None:
        """Buffers go back on a skipped step, and also when the forward wrote
        a non-finite value on an applied step (a batch-norm running_var of
        inf from a feature of 1e20, with finite gradients), as the JAX step
        keeps a non-finite model_state out: selected on the device, or
        copied back when the host path already knows."""
        if not buffers:
            return
        host = self._guarded.host_skipped
        if not self._buffers_follow:
            if bool(skipped | bad):  # a host read only for such a module
                raise ValueError(
                    "the forward replaced model buffers by ones of other shapes, "
                    "dtypes or number: the skipped step cannot restore them; "
                    "build the TrainStep with restore_buffers_on_skip=False"
                )
        elif host is not None and isinstance(bad, bool):
            if host or bad:
                self._buffer_copy.restore()
        else:
            self._buffer_copy.put_back(
                skipped | torch.as_tensor(bad).to(skipped.device)
            )

    def _forward(self, batch: Any) -> tuple[torch.Tensor, Any]:
        """``loss_fn(model, batch)`` under autocast, checked: ``(loss, aux)``."""
        ctx = (
            torch.autocast(self.device_type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with ctx:
            out = self.loss_fn(self.model, batch)
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
        return loss, aux

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scaler and counters (for `torch.save`).

        ``"outside_params"`` holds the values of the optimizer's parameters
        that the model does not hold (a learned temperature used in
        `loss_fn`), by their `param_names` name: the model's state dict
        misses them, and the optimizer's holds their state, not their
        values.
        """
        model, optimizer, outside = (
            _dist._plain_state_dict(self.model),
            self.optimizer.state_dict(),
            {n: p.detach() for n, p in self._outside_params().items()},
        )
        if _dist._is_fsdp(self.model):
            # Every shard, gathered (a collective: every rank calls this).
            model, optimizer, outside = _dist._gather_full((model, optimizer, outside))
        # The unwrapped module's keys (no DDP "module." prefix) and full
        # tensors, so that a checkpoint restores in any placement.
        state = {"model": model, "optimizer": optimizer, "outside_params": outside}
        return state | self._counters_dict()

    def _counters_dict(self) -> dict[str, Any]:
        """The state besides model and optimizer: scaler, skip and spike
        counters, steps done (no collective; a sharded checkpoint saves the
        model and optimizer shards apart)."""
        return {
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "skip_state": dataclasses.asdict(self.skip_state),
            "steps_done": self.steps_done,
        } | ({} if self.spikes is None else {"spike_state": self._spikes_dict()})

    def _spikes_dict(self) -> dict[str, Any]:
        return self.spike_state.state_dict()

    @property
    def spike_state(self) -> Any:
        """The spike guard's `SkipSpikesState` (None without `skip_spikes`)."""
        return None if self.spikes is None else self.spikes.spike_state

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
        outside = self._outside_values(state.get("outside_params"))
        model, optimizer = state["model"], state["optimizer"]
        if _dist._is_fsdp(self.model):
            # Full tensors (any placement's checkpoint) sharded as here.
            model = _dist._shard_like(model, self.model.state_dict())
            like = _dist._fsdp_optimizer_like(self.optimizer, optimizer)
            optimizer = _dist._shard_like(optimizer, like)
        _dist._load_plain_state_dict(self.model, model)
        self.optimizer.load_state_dict(optimizer)
        self._set_outside_params(outside)
        self._load_counters(state)

    def _outside_params(self) -> dict[str, torch.Tensor]:
        """The optimizer's parameters the model does not hold, by name."""
        inside = {id(p) for p in _dist._plain(self.model).parameters()}
        names = param_names(self.model, self.optimizer)
        named = zip(names, self._params(), strict=True)
        return {n: p for n, p in named if id(p) not in inside}

    def _outside_values(self, saved: Mapping[str, Any] | None) -> dict[str, Any]:
        """The saved values of `_outside_params`, checked to be the same
        names, shapes and dtypes (a ValueError naming each that differs);
        {} with a RuntimeWarning naming them when `saved` is None (a state
        saved before torchref saved them: they keep their values)."""
        own = self._outside_params()
        if saved is None:
            if own:
                warnings.warn(
                    "the state holds no values for the optimizer's parameters "
                    f"outside the model ({', '.join(own)}): they keep their "
                    "current values (a checkpoint written before torchref saved "
                    "them)",
                    RuntimeWarning,
                    3,
                )
            return {}
        lines = []
        for name in [*own, *(n for n in saved if n not in own)]:
            s, e = _spec(saved.get(name)), _spec(own.get(name))
            where = f"  outside_params/{name}"
            if s is None:
                lines.append(f"{where}: missing from the state (target {e})")
            elif e is None:
                lines.append(f"{where}: in the state ({s}), not in the target")
            elif s != e:
                lines.append(f"{where}: state {s}, target {e}")
        if lines:
            raise ValueError(
                "the state's parameters outside the model do not match this "
                "TrainStep's optimizer:\n" + "\n".join(lines) + "\nbuild the "
                "optimizer over the parameters (and names) the state was saved with"
            )
        return dict(saved)

    def _set_outside_params(self, values: dict[str, Any]) -> None:
        """Copies `values` (checked by `_outside_values`) into the parameters."""
        own = self._outside_params()
        if values and _dist._is_fsdp(self.model):
            values = _dist._shard_like(values, own)
        with torch.no_grad():
            for name, value in values.items():
                own[name].copy_(value)

    def _load_counters(self, state: dict[str, Any]) -> None:
        """Inverse of `_counters_dict` (the scaler kind checked already)."""
        if self._scaler_enabled() and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.skip_state = SkipNonFiniteState(**state["skip_state"])
        self.steps_done = int(state["steps_done"])
        if self.spikes is not None and "spike_state" in state:
            self.spike_state.load_state_dict(state["spike_state"])


class _KeptMicrobatches:
    """`TrainStep`'s ``drop_non_finite_microbatches``: after each micro-batch's
    backward its gradient (alone in ``.grad``) and loss are checked on the
    device; a finite one is added, times its weight, to a float32 sum, a
    non-finite one is selected out (its NaN never enters) and the buffers
    its forward wrote are put back. `finish` writes the kept micro-batches'
    weighted mean into ``.grad`` (NaN when none was kept: ``0 * inf``) and
    returns their weighted mean loss. The arithmetic of
    `jaxstable.train.make_train_step`, operation for operation."""

    def __init__(self, step: TrainStep) -> None:
        self.step = step
        self.params = step._params()
        self.acc: list[torch.Tensor | None] = [None] * len(self.params)
        self.wsum = self.lsum = self.dropped = None
        self.weight = None
        self.buffers: list[torch.Tensor] = []

    def before(self, part: Any) -> None:
        self.step.optimizer.zero_grad(set_to_none=True)
        self.weight = (
            1.0
            if self.step.microbatch_weight is None
            else self.step.microbatch_weight(part)
        )
        self.buffers = [b.detach().clone() for b in self.step.model.buffers()]

    def after(self, loss: torch.Tensor) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        ok = torch.isfinite(loss) & _all_finite_t(grads).to(loss.device)
        w = torch.as_tensor(self.weight, dtype=torch.float32, device=loss.device)
        zero = torch.zeros((), dtype=torch.float32, device=loss.device)
        if self.wsum is None:
            self.wsum, self.lsum = zero, zero
            self.dropped = torch.zeros((), dtype=torch.int64, device=loss.device)
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            a = self.acc[i]
            if a is None:
                dtype = torch.promote_types(p.grad.dtype, torch.float32)
                a = torch.zeros_like(p.grad, dtype=dtype)
            ok_i = ok.to(a.device)
            self.acc[i] = torch.where(ok_i, a + w.to(a.device) * p.grad.to(a.dtype), a)
        self.wsum = self.wsum + torch.where(ok, w, zero)
        self.lsum = self.lsum + torch.where(ok, w * loss, zero)
        self.dropped = self.dropped + (~ok).to(torch.int64)
        now = list(self.step.model.buffers())
        if len(now) != len(self.buffers) or any(
            a.shape != b.shape for a, b in zip(now, self.buffers, strict=True)
        ):
            raise ValueError(
                "drop_non_finite_microbatches=True: the forward replaced model "
                "buffers by ones of other shapes or number, so a dropped "
                "micro-batch's buffers cannot be put back"
            )
        with torch.no_grad():
            for b, old in zip(now, self.buffers, strict=True):
                b.copy_(torch.where(ok.to(b.device), b, old))

    def finish(self) -> torch.Tensor:
        # Each share was scale * loss_i / k: times k / (sum of kept weights)
        # it is the kept micro-batches' weighted mean (see the JAX step).
        k = torch.tensor(float(self.step.microbatches), dtype=torch.float32)
        factor = k.to(self.wsum.device) / self.wsum
        for p, a in zip(self.params, self.acc, strict=True):
            p.grad = None if a is None else (a * factor.to(a.device)).to(p.dtype)
        return self.lsum / self.wsum


def _spec(t: Any) -> str | None:
    """``"(2, 3) float32"`` of a tensor (None for None)."""
    if t is None:
        return None
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of `optimizer`'s parameters, in its order.

    A parameter of `model` has the model's name (the unwrapped module's,
    without DDP's ``module.``); one outside the model has the name the
    optimizer was given for it (torch's named parameters:
    ``Adam([*model.named_parameters(), ("temperature", t)])``), else
    ``<unnamed k>`` for the k-th such parameter in the optimizer's order.
    Checkpoints key the optimizer state and the outside parameters' values
    by these names.

    Raises:
        ValueError: a name given to a parameter outside the model that the
            model or another such parameter already uses.
    """
    named: dict[int, str] = {}
    for name, p in _dist._plain(model).named_parameters():
        named.setdefault(id(p), name)
    taken = set(named.values())
    names, unnamed = [], 0
    for group in optimizer.param_groups:
        given = group.get("param_names") or [None] * len(group["params"])
        for p, label in zip(group["params"], given, strict=True):
            name = named.get(id(p))
            if name is None and label is not None:
                if label in taken:
                    raise ValueError(
                        f"the optimizer names a parameter outside the model "
                        f"{label!r}, a name the model or another parameter "
                        "already has: name it apart"
                    )
                name = label
            elif name is None:
                name, unnamed = f"<unnamed {unnamed}>", unnamed + 1
            taken.add(name)
            names.append(name)
    return names


def _scaler_kind(saved: dict[str, Any]) -> str:
    if not saved:
        return "no enabled scaler"
    # DynamicGradScaler.state_dict adds min_loss_scale to GradScaler's keys.
    return "a DynamicGradScaler" if "min_loss_scale" in saved else "a GradScaler"


# Key of the file (not a state_dict key) naming the optimizer and scaler
