"""One guarded `optimizer.step()`: applied, skipped or selected back.

`GuardedStep` runs the step where the gradients' flag (and, with the update
check, what the step wrote) allows, on the device (a fused optimizer's
``found_inf``, or one copy that `torch.where` selects back) or on the host
(GradScaler's one read of the flag); see its docstring for which path a
step takes.
"""

from __future__ import annotations

import copy
import inspect
import math
import weakref
from typing import Any

import torch
from torch.optim import optimizer as _torch_optimizer

from torchref._src.clipping import all_finite_t, is_dtensor, to_host
from torchref._src.update_bound import UpdateBound
from torchref._src.update_check import DeviceSelect, refuse_sharded_update_check

__all__ = ["GuardedStep"]


def _on_cpu(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's first parameter is on the CPU (where a
    host read is no transfer)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device.type == "cpu"
    return True


def _takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` skips on the device from a ``found_inf``
    attribute, as `GradScaler.step` hands it to fused Adam/AdamW/SGD."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and (
        not _takes_grad_scaler(optimizer.step)
    )


# step function -> whether it takes a ``grad_scaler`` argument (a signature
# costs more than the rest of the guard's host work on a small step).
_TAKES_GRAD_SCALER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _takes_grad_scaler(step: Any) -> bool:
    func = getattr(step, "__func__", step)  # a bound method: its function
    try:
        return _TAKES_GRAD_SCALER[func]
    except (KeyError, TypeError):  # not seen, or no weak reference to it
        takes = "grad_scaler" in inspect.signature(step).parameters
    try:
        _TAKES_GRAD_SCALER[func] = takes
    except TypeError:
        pass
    return takes


def _stepped_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters this step writes: those with a gradient. torch's
    optimizers leave a parameter whose ``.grad`` is None alone, and its
    state too, so the guard neither copies nor checks them."""
    return [
        p for g in optimizer.param_groups for p in g["params"] if p.grad is not None
    ]


def _written(optimizer: torch.optim.Optimizer, params: list) -> list[torch.Tensor]:
    """`params` and every tensor of their optimizer state."""
    return params + [
        v
        for p in params
        for v in optimizer.state.get(p, {}).values()
        if isinstance(v, torch.Tensor)
    ]


_DECIDE_ON = ("auto", "device", "host")


class GuardedStep:
    """``optimizer.step()`` that leaves parameters and state as they were
    where a flag says; what it copies and where it decides.

    ``run(optimizer, bad_grads, check_update, max_norm, norm) -> skipped``
    (0-d bool tensor). Only the parameters with a gradient and their state
    are ever copied or checked (`_stepped_params`): the others are not
    touched by the step. Two paths, by `decide_on`:

    - **device** (no host sync): an optimizer that takes GradScaler's
      ``found_inf`` (``fused=True`` Adam/AdamW/SGD) is handed ``bad_grads``
      and skips on the device, step count included, with no copy when the
      update is proved finite (`UpdateBound`, with the clip's
      ``max_norm``) or `check_update` is off; any other optimizer steps
      unconditionally on parameters whose pre-step values were copied
      (ONE copy, `DeviceSelect`, kept from step to step) and a
      `torch.where` per tensor selects the copy back where ``bad_grads``,
      or (with `check_update`, unless proved) where what it wrote is not
      finite: the invariant "no step writes a non-finite value".
    - **host** (GradScaler's own path, one sync): the flag (and the
      gradients' norm) is read in one transfer; on a bad step
      ``optimizer.step()`` is not called at all; otherwise the step runs,
      with no copy when the update is proved finite, else with the copy
      and a check whose flag is read too (a second sync, only then) before
      the copy goes back.

    ``decide_on="auto"`` (default) takes the device path for an optimizer
    that takes ``found_inf`` (it skips in its own kernel: no copy, no
    sync) on an accelerator, and the host path for any other and for any
    optimizer whose parameters are on the CPU (a fused one too: its read is
    free there, and the host path saves the float64 finiteness pass; a
    ResNet-18-shaped net, fused AdamW, batch 2: 1.05x the recipe against
    1.08x, `benchmarks/bench_models.py`): on an accelerator
    GradScaler.step syncs there too and one sync costs less than copying
    and selecting parameters and state; on the CPU a read costs no
    transfer at all, and the host path saves the copy, the select and the
    float64 norm pass (ResNet-18-shaped net, bf16 autocast, AdamW: 1.00x
    the torch.amp recipe against 1.25-1.33x on the device path,
    `benchmarks/bench_guard_paths.py`). ``decide_on="device"`` keeps a
    non-fused optimizer free of host syncs (CUDA graphs, a step that must
    not wait), at the price of that copy.

    The device path still asks the host once where the step created
    optimizer state (the first step; entries must be removed, not
    selected), changed a python value in the state or replaced a state
    tensor: one ``bool(keep_old)``. A non-fused optimizer with step hooks
    reads the gradients' flag on the host and is not stepped when it is
    set (its hooks would see the values before the select). On a GPU, a
    non-fused optimizer whose state keeps CPU tensors (Adam's ``step``
    with ``capturable=False``) gets the flag copied to the CPU: a sync.
    """

    def __init__(self) -> None:
        self._select = DeviceSelect()
        self._bound = UpdateBound()
        self._decide_on = "auto"
        self.host_skipped: bool | None = None  # the last step's, host path

    @property
    def decide_on(self) -> str:
        """``"auto"``, ``"device"`` or ``"host"`` (see the class docstring)."""
        return self._decide_on

    @decide_on.setter
    def decide_on(self, value: str) -> None:
        if value not in _DECIDE_ON:
            raise ValueError(f"decide_on must be one of {_DECIDE_ON}, got {value!r}")
        self._decide_on = value

    def on_host(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the next step decides on the host (see `decide_on`)."""
        if self._decide_on != "auto":
            return self._decide_on == "host"
        return not _takes_found_inf(optimizer) or _on_cpu(optimizer)

    @torch.no_grad()
    def run(
        self,
        optimizer: torch.optim.Optimizer,
        bad_grads: torch.Tensor,
        check_update: bool,
        max_norm: float | None = None,
        norm: Any = None,
    ) -> torch.Tensor:
        self.host_skipped = None
        params = _stepped_params(optimizer)
        if any(is_dtensor(p) for p in params) and not check_update:
            # Sharded (FSDP2) parameters: no flat copy of DTensors; the
            # (global) flag is read on the host, one sync per step.
            if not bool(bad_grads):
                optimizer.step()
            # A python bool where the caller read the flag on the host.
            return torch.as_tensor(bad_grads, dtype=torch.bool)
        if check_update:
            refuse_sharded_update_check(params)
        if self.on_host(optimizer):
            return self._on_host(
                optimizer, params, bad_grads, check_update, max_norm, norm
            )
        fused = _takes_found_inf(optimizer)
        if not fused and _has_step_hooks(optimizer) and bool(bad_grads):
            # GradScaler calls no step() on a skip, so the optimizer's step
            # hooks (an EMA update, a logger) never see one; here a post hook
            # would read the values before they are selected back. With
            # hooks, the gradients' flag is read on the host (one sync).
            return bad_grads
        return self._on_device(optimizer, params, bad_grads, check_update, max_norm)

    def _on_host(self, optimizer, params, bad_grads, check_update, max_norm, norm):
        """GradScaler's path: one read of the flag (and the norm); no step
        on a bad one; a copy only where the update is not proved finite."""
        bad, m = _read_decision(bad_grads, norm, max_norm)
        flag = torch.as_tensor(bad_grads, dtype=torch.bool)
        self.host_skipped = bad
        if bad:
            return flag
        if not check_update or self._bound.proven(optimizer, params, m):
            optimizer.step()
            self._bound.record(optimizer, params)
            return flag
        before = self._take(optimizer, params)
        optimizer.step()
        self._follow(optimizer, params)
        wrote_bad = ~all_finite_t(_written(optimizer, params)).to(flag.device)
        if bool(wrote_bad):  # the second read, only with a copy taken
            self._select.restore()
            _restore_layout(optimizer, params, before, True)
            self.host_skipped = True
        self._bound.record(optimizer, params)
        return flag | wrote_bad

    def _on_device(self, optimizer, params, bad_grads, check_update, max_norm):
        fused = _takes_found_inf(optimizer)
        proven = not check_update or self._bound.proven(optimizer, params, max_norm)
        if fused and proven:
            _fused_without_copy(optimizer, params, bad_grads)
            self._bound.record(optimizer, params)
            return bad_grads
        before = self._take(optimizer, params)
        if fused:
            _fused_step(optimizer, bad_grads)
        else:
            optimizer.step()
        self._follow(optimizer, params)
        keep_old = bad_grads
        if not proven:
            keep_old = bad_grads | ~all_finite_t(_written(optimizer, params))
        self._select.put_back(keep_old)
        _restore_layout(optimizer, params, before, keep_old)
        self._bound.record(optimizer, params)
        return keep_old

    def _take(self, optimizer, params: list) -> dict:
        """Copies `params` and their state (the one undo copy); returns the
        state's layout before the step."""
        before = {p: _snapshot_layout(optimizer.state.get(p)) for p in params}
        self._storage = [p.data_ptr() for p in params]
        self._taken = _written(optimizer, params)
        self._select.take(self._taken)
        return before

    def _follow(self, optimizer, params: list) -> None:
        """A step that assigned ``p.data`` (new storage): the copy goes
        back into what the parameters hold now."""
        if all(p.data_ptr() == s for p, s in zip(params, self._storage, strict=True)):
            return
        now = [p.detach() for p in params] + self._taken[len(params) :]
        if not self._select.retarget(now):
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() changed a parameter's shape "
                "or dtype: the guard cannot select the old values back"
            )


def _read_decision(bad_grads: Any, norm: Any, max_norm: float | None):
    """``(bad, m)`` on the host in one transfer: the flag and the bound on
    each gradient entry, ``min(norm, max_norm)`` (None when unknown)."""
    bad, value = to_host([bad_grads, norm if norm is not None else math.nan])
    bounds = [b for b in (value, max_norm) if b is not None and math.isfinite(b)]
    return bool(bad), (min(bounds) * 1.001 if bounds else None)


def _fused_without_copy(optimizer, params: list, bad_grads: torch.Tensor) -> None:
    """The fused step skipping on ``found_inf``; state a skipped step
    created goes (one host read, first step only): fused SGD's momentum
    buffers are torch.empty_like ones its kernel fills, so a skip
    (GradScaler's too) would leave uninitialised memory (3.5e35 seen) as
    the next step's momentum."""
    fresh = [p for p in params if not optimizer.state.get(p)]
    _fused_step(optimizer, bad_grads)
    if any(optimizer.state.get(p) for p in fresh) and bool(bad_grads):
        for p in fresh:
            optimizer.state.pop(p, None)


def _restore_layout(optimizer, params: list, before: dict, keep_old: Any) -> None:
    """State entries the step created, replaced or changed as python values
    go back to `before` where `keep_old` (read on the host only then)."""
    changed = [p for p in params if not _same_layout(optimizer.state.get(p), before[p])]
    if not changed or not bool(keep_old):
        return
    for p in changed:
        if before[p] is None:
            optimizer.state.pop(p, None)
        else:
            optimizer.state[p] = {
                k: copy.deepcopy(v) if not isinstance(v, torch.Tensor) else v
                for k, v in before[p].items()
            }


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` runs step pre/post hooks (its own or global)."""
    return bool(
        getattr(optimizer, "_optimizer_step_pre_hooks", None)
        or getattr(optimizer, "_optimizer_step_post_hooks", None)
        or _torch_optimizer._global_optimizer_pre_hooks
        or _torch_optimizer._global_optimizer_post_hooks
    )


def _fused_step(optimizer: torch.optim.Optimizer, bad_grads: torch.Tensor) -> None:
    """GradScaler's hand-over to a fused optimizer: gradients already
    unscaled (``grad_scale`` None) and the skip flag as float32 ``found_inf``."""
    optimizer.grad_scale = None
    optimizer.found_inf = bad_grads.to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale
        del optimizer.found_inf


def _snapshot_layout(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """One parameter's state entries: tensors by object, python values by a
    copy (None when it has no state yet)."""
    if not state:
        return None
    return {
        k: v if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        for k, v in state.items()
    }


def _same_layout(state: dict[str, Any] | None, before: dict[str, Any] | None) -> bool:
    """Whether the step left the entries as `_snapshot_layout` saw them: no
    entry added or removed, no tensor replaced, no python value changed."""
    if not state or before is None:
        return not state and before is None
    if state.keys() != before.keys():
        return False
    for k, v in state.items():
        old = before[k]
        if isinstance(v, torch.Tensor) or isinstance(old, torch.Tensor):
            if v is not old:
                return False
        else:
            try:
                if not bool(old == v):
                    return False
            except Exception:  # not comparable: treat as changed
                return False
    return True
