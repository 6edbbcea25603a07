"""Gradient guards for PyTorch optimizers, mirroring `jaxstable.transforms`.

Clipping goes through `torch.nn.utils.get_total_norm` and the coefficient
of `torch.nn.utils.clip_grads_with_norm_` (the two halves of
`clip_grad_norm_`);
skipping wraps any `torch.optim.Optimizer` so that a non-finite step leaves
the parameters AND the optimizer state (Adam moments, step count) untouched,
as `torch.amp.GradScaler.step` does. Finite gradients can still give a
non-finite step (Adam's float16 second moment underflowing to 0, ``eps=0``),
and torch cannot tell before `optimizer.step()` has written it: with
``check_update`` the wrappers check what the step wrote and select the
values before it back when it is non-finite. Only parameters with a
gradient and their state are copied or checked; where the update is proved
finite (`_UpdateBound`) nothing is. On the device path every decision is a
device tensor (issue 24): a fused optimizer takes it as GradScaler's
``found_inf``, any other steps on one copy that `torch.where` selects back
(`_GuardedStep`); the host path reads the flag once and skips
``optimizer.step()`` as GradScaler does (`decide_on`). The counters read the
flags when they are read (`_DeferredRecords`). An optimizer that needs a
closure (LBFGS) decides on the host (`_StepUndo`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.utils import get_total_norm
from torch.optim import optimizer as _torch_optimizer

from _stablecore.checks import check_bool as _core_check_bool
from torchref._src.guard_state import SkipNonFiniteState, SkipSpikesState, find_state
from torchref._src.loss_scale import _tensors, all_finite

__all__ = [
    "AccumulateGradients",
    "SkipNonFinite",
    "SkipNonFiniteState",
    "StableOptimizer",
    "accumulate_gradients",
    "clip_by_global_norm",
    "find_skip_state",
    "global_norm",
    "skip_non_finite",
    "stable_optimizer",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _norm_inputs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The dense tensors whose norm is wanted: floating and complex ones
    (integer tensors have none), a sparse one by its coalesced values (its
    duplicate indices summed, so the norm is the dense tensor's)."""
    out = []
    for t in tensors:
        if not (t.is_floating_point() or t.is_complex()):
            continue
        if t.is_sparse:
            t = (t if t.is_coalesced() else t.coalesce())._values()
        out.append(t.detach())
    return out


def _total_norm(ts: list[torch.Tensor]) -> torch.Tensor:
    """get_total_norm, with fp16/bf16 leaves reduced in float32 first."""
    if not ts:
        return torch.zeros((), dtype=torch.float32)
    if not any(t.dtype in _LOW_PRECISION for t in ts):
        return get_total_norm(ts)
    per_leaf = [
        torch.linalg.vector_norm(t, 2, dtype=torch.float32)
        if t.dtype in _LOW_PRECISION
        else torch.linalg.vector_norm(t, 2)
        for t in ts
    ]
    # get_total_norm of per-leaf norms = sqrt(sum of their squares): the same
    # two-level reduction torch does, with the leaves already in float32.
    return get_total_norm(per_leaf)


def _by_device_dtype(tensors: list[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a (sharded) DTensor norm: its global value (a
    collective, no host sync); a plain tensor as is."""
    return t.full_tensor() if _is_dtensor(t) else t


def _home(tensors: list[torch.Tensor]) -> torch.device:
    """Where device-side flags and norms are combined: an accelerator when
    any tensor is on one (moving a CPU flag there never waits; the reverse
    is a device->host copy, i.e. a sync)."""
    for t in tensors:
        if t.device.type != "cpu":
            return t.device
    return tensors[0].device if tensors else torch.device("cpu")


def _finite_norms(ts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(finite, norm64)`` of dense floating tensors, on the device.

    One read pass per (device, dtype) group: `torch._foreach_norm` in float64.
    The float64 sum of squares of float32 (or narrower) values cannot
    overflow (3.4e38**2 = 1.2e77 per element), so the float64 norm is finite
    exactly when every element is: it is the finiteness flag AND the exact
    norm where the float32 one overflowed. float64/complex128 leaves, whose
    squares can overflow, add a max-|x| pass for the flag.
    """
    home = _home(ts)
    narrow, wide, flags = [], [], []
    for (_, dtype), group in _by_device_dtype(ts).items():
        if dtype.is_complex:
            group = [torch.view_as_real(t) for t in group]
            dtype = group[0].dtype
        if dtype == torch.float64:
            # torch's inf-norm of a zero-size tensor raises: it is finite.
            nonempty = [t for t in group if t.numel()]
            if nonempty:
                norms = torch._foreach_norm(nonempty, float("inf"))
                flags += [_local(n).to(home) for n in norms]
            wide += [_local(n).to(home) for n in torch._foreach_norm(group, 2)]
        else:
            norms = torch._foreach_norm(group, 2, dtype=torch.float64)
            narrow += [_local(n).to(home) for n in norms]
    norm64 = torch.linalg.vector_norm(torch.stack(narrow + wide))
    if not flags:
        # Leaf norms are at most ~1e43: their float64 squares add up finite.
        return torch.isfinite(norm64), norm64
    return torch.isfinite(torch.stack(narrow + flags)).all(), norm64


def _norm_and_finite(
    tensors: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(norm, finite, norm64)``, no host sync: `norm` is `_total_norm`
    (torch's float32 value, bit for bit) where it is finite; where it
    overflowed with every element finite it is the float64 norm `norm64`
    (None for no tensors) cast down; `finite` is a 0-d bool tensor."""
    ts = _norm_inputs(tensors)
    total = _total_norm(ts)
    if not ts:
        return total, torch.ones((), dtype=torch.bool), None
    finite, norm64 = _finite_norms(ts)
    total = _local(total).to(norm64.device)
    # Where torch's norm is not finite the float64 one is the same inf/nan
    # for a non-finite element, and the true norm where float32 overflowed.
    return (
        torch.where(torch.isfinite(total), total, norm64.to(total.dtype)),
        finite,
        norm64,
    )


def global_norm(tensors: Any) -> torch.Tensor:
    """The L2 norm of all tensors viewed as one vector, as a float32 tensor.

    Maths: ``sqrt(sum_i sum(|x_i|**2))``. For float32 tensors this is exactly
    `torch.nn.utils.get_total_norm`. fp16/bf16 tensors are reduced with
    ``vector_norm(x, dtype=float32)`` first: torch would otherwise return the
    norm in the tensor's dtype (fp16 keeps 11 bits, so a norm of 9534.15
    comes back as 9536, and any norm above 65504 as inf) whereas a float32
    accumulation of fp16 values of 300 is finite and correct. float64 norms
    are computed in float64 and returned as float32. Complex tensors add
    ``|z|**2``; integer and bool tensors are left out; a sparse tensor counts
    by its coalesced values (`get_total_norm` raises NotImplementedError on
    sparse tensors).

    Deviation from torch, only where torch overflows: when the float32 sum of
    squares overflows (a norm above 1.8e19; torch returns inf for two
    gradients of 1e20) the norm is the float64 one of a second read pass
    (`_foreach_norm(dtype=float64)`, which also gives the finiteness flag
    of the guarded steps), as `jaxstable.transforms.global_norm` rescues it
    too: 1.41e20 there. It is inf only for a non-finite element or a norm
    above float32's 3.4e38. No host sync: the choice is a `torch.where`.

    Args:
        tensors: a tensor, a module (its parameters), a mapping or a sequence
            of tensors; `None` entries are skipped.

    Returns:
        A 0-d float32 tensor (0.0 for no tensors); inf/nan if any element is.

    Example:
        >>> import torch
        >>> g = [torch.full((1000,), 300.0, dtype=torch.float16)]
        >>> round(float(global_norm(g)), 2)
        9486.83
        >>> round(float(global_norm(torch.tensor([0.3 + 0.4j, -0.1 + 0.2j]))), 3)
        0.548
        >>> float(global_norm(torch.tensor([1e20, 1e20]))) > 1.4e20
        True
    """
    return _norm_and_finite(_tensors(tensors))[0].to(torch.float32)


def _grads(parameters: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params = [parameters] if isinstance(parameters, torch.Tensor) else None
    if params is None:
        params = list(
            parameters.parameters()
            if isinstance(parameters, torch.nn.Module)
            else parameters
        )
    return params, [p.grad for p in params if p.grad is not None]


@torch.no_grad()
def _clip_in_place(
    grads: list[torch.Tensor],
    max_norm: float,
    eps: float,
    tensors_in: list[torch.Tensor] | None = None,
    apply: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clips `grads` in place, on the device; ``(pre-clip norm, finite)``.

    ``coef = clamp(max_norm / (norm + eps), max=1)`` as `clip_grads_with_norm_`
    computes it (bit for bit on torch's float32 norm), from the float64 norm
    where the float32 one overflowed (``max_norm / 1.4e20`` is a normal
    float32). Where the gradients are not finite, or `apply` (a 0-d bool
    tensor) is False, the coefficient is 1: the NaN coefficient is never
    multiplied in, so a later report still names the bad leaves. One
    `_foreach_mul_` per (device, dtype); no host sync.
    """
    norm, finite, norm64 = _norm_and_finite(grads if tensors_in is None else tensors_in)
    dense = [g for g in grads if (g.is_floating_point() or g.is_complex())]
    if norm64 is None or not dense:
        return norm, finite
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    wide = torch.clamp(max_norm / (norm64 + eps), max=1.0).to(coef.dtype)
    coef = torch.where(torch.isfinite(norm), coef, wide)
    ok = finite if apply is None else finite & apply.to(finite.device)
    _scale_in_place(dense, torch.where(ok, coef, 1.0))
    return norm, finite


def _scale_in_place(dense: list[torch.Tensor], coef: torch.Tensor) -> None:
    """``g *= coef`` for dense floating/complex gradients: one
    `_foreach_mul_` per (device, dtype), sparse ones by their values."""
    for (device, _), group in _by_device_dtype(
        [g for g in dense if not g.is_sparse]
    ).items():
        torch._foreach_mul_(group, coef.to(device))
    for g in dense:
        if g.is_sparse:  # no foreach kernel; scaling the values scales the sum
            g.mul_(coef.to(g.device))


def norm_read_on_host(
    grads: list[torch.Tensor], others: list[Any], clip: Any
) -> tuple[torch.Tensor, float, list[Any]] | None:
    """The host path's check: torch's float32 norm read with `others` (0-d
    flags, the first of which says the step may be applied) in ONE
    transfer; ``(norm, its host value, host values of others)``, the
    gradients clipped
    (`clip_grads_with_norm_`'s coefficient, bit for bit `_clip_in_place`)
    where the flag holds. A finite float32 norm says every gradient is
    finite, so the float64 pass of `_finite_norms` (a float64 copy of every
    gradient on the CPU) is skipped; None (nothing done) where the norm is
    not finite: the caller takes the exact device path."""
    ts = _norm_inputs(grads)
    norm = _local(_total_norm(ts))  # a sharded norm: its global value
    *values, value = _to_host([*others, norm])
    if not math.isfinite(value):
        return None
    dense = [g for g in grads if (g.is_floating_point() or g.is_complex())]
    if clip is not None and values[0] and dense:
        _scale_in_place(dense, torch.clamp(clip.max_norm / (norm + clip.eps), max=1.0))
    return norm, value, values


def clip_by_global_norm(
    max_norm: float, *, eps: float = 1e-6
) -> Callable[[Any], torch.Tensor]:
    """Clips gradients in place by their global norm, as `clip_grad_norm_`.

    Maths: ``norm = global_norm(grads)`` (float32 accumulation, see
    `global_norm`); ``coef = min(max_norm / (norm + eps), 1)``;
    ``grad *= coef``. The norm goes through `get_total_norm` and the
    scaling is `clip_grads_with_norm_`'s (the same clamped coefficient and
    one `_foreach_mul_` per device and dtype, written out so that a
    non-finite step can select a coefficient of 1 on the device), so for
    float32 grads and the default ``eps=1e-6`` the result equals
    `clip_grad_norm_` bit for bit (torch hard-codes that eps).

    Deviations from `clip_grad_norm_`, each where torch fails: sparse
    gradients are clipped (torch raises NotImplementedError); when the
    float32 sum of squares overflows (norm above 1.8e19) the coefficient
    comes from the float64 norm (``max_norm / 1.4e20`` is a normal float32),
    so finite gradients give a finite update of norm `max_norm` (torch's
    norm is inf and it multiplies every gradient by 0), as
    `jaxstable.transforms.clip_by_global_norm` does; non-finite gradients
    are left as they are (coefficient 1). No host sync: two read passes
    (torch's float32 norm, a float64 one) and one `_foreach_mul_`.

    Args:
        max_norm: largest allowed global norm, > 0.
        eps: added to the norm before dividing, >= 0.

    Returns:
        ``clip(parameters) -> pre-clip norm`` (0-d float32 tensor).

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> p.grad = torch.tensor([3.0, 4.0])
        >>> clip = clip_by_global_norm(1.0)
        >>> round(float(clip([p])), 4), [round(v, 4) for v in p.grad.tolist()]
        (5.0, [0.6, 0.8])
        >>> p.grad = torch.tensor([1e20, 1e20])
        >>> _ = clip([p])
        >>> [round(v, 4) for v in p.grad.tolist()]
        [0.7071, 0.7071]
    """
    max_norm = _check_max_norm(max_norm)
    if not (isinstance(eps, int | float) and eps >= 0):
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")

    def clip(parameters: Any) -> torch.Tensor:
        _, grads = _grads(parameters)
        return _clip_in_place(grads, max_norm, float(eps))[0].to(torch.float32)

    clip.max_norm, clip.eps = max_norm, float(eps)  # for the guarded steps

    return clip


def _check_max_norm(max_norm: Any) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float):
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    return float(max_norm)


class _StepUndo:
    """Undoes an `optimizer.step()` that wrote a non-finite value.

    ``take(optimizer)`` copies every parameter and every tensor of the
    optimizer state into buffers kept from step to step (allocated once);
    ``written_finite()`` checks the parameters and the state after the step
    (one `all_finite`, one host sync); ``restore()`` copies the saved values
    back and drops state the step created (Adam's first step creates it).
    Cost per step: one copy of parameters + state and one finiteness pass
    over them (`benchmarks/bench_step.py` measures it).
    """

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(id(t))
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty_like(t, memory_format=torch.preserve_format)
            self._buffers[id(t)] = buf
        return buf

    @torch.no_grad()
    def take(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        _refuse_sharded_update_check(self.params)
        live, saved = [p.detach() for p in self.params], []
        self.state: dict[torch.Tensor, dict[str, Any] | None] = {}
        for p in self.params:
            st = optimizer.state.get(p)
            if not st:
                self.state[p] = None
                continue
            entry = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    entry[k] = self._copy(v)
                    live.append(v.detach())
                    saved.append(entry[k])
                else:  # a python step count, None momentum buffer, ...
                    entry[k] = copy.deepcopy(v)
            self.state[p] = entry
        self._live_params = live[: len(self.params)]
        # Keyed by the parameter itself (a `.detach()` is a new object).
        self._saved_params = [self._copy(p) for p in self.params]
        _foreach_copy_by_device(self._saved_params + saved, live)

    def written_finite(self) -> bool:
        # Every tensor: all_finite checks the floating AND complex ones (a
        # complex64 Adam moment that overflows is caught) and skips integers.
        state = [
            v
            for p in self.params
            for v in self.optimizer.state.get(p, {}).values()
            if isinstance(v, torch.Tensor)
        ]
        return all_finite(self._live_params + state)

    @torch.no_grad()
    def restore(self) -> None:
        _foreach_copy_by_device(self._live_params, self._saved_params)
        for p, saved in self.state.items():
            if saved is None:
                self.optimizer.state.pop(p, None)
                continue
            live = self.optimizer.state[p]
            for k in list(live):
                if k not in saved:
                    del live[k]
            for k, v in saved.items():
                old = live.get(k)
                if isinstance(v, torch.Tensor):
                    if isinstance(old, torch.Tensor) and old.shape == v.shape:
                        old.copy_(v)
                    else:
                        live[k] = v.clone()
                else:
                    live[k] = copy.deepcopy(v)


def _refuse_sharded_update_check(params: list[torch.Tensor]) -> None:
    """The update check on sharded (DTensor / FSDP2) parameters is refused:
    each rank would check its own shard only and could decide differently
    from the others, and DTensor has no ``_foreach_copy_``."""
    if any(_is_dtensor(p) for p in params):
        raise NotImplementedError(
            "check_update does not support sharded (DTensor / FSDP2) "
            "parameters: build the step with check_update=False (the "
            "gradient check stays global through GradScaler's found_inf)"
        )


def _scalar_flag(flag: Any, device: torch.device) -> torch.Tensor:
    """``grads_finite=`` as a 0-d bool tensor on `device`; another shape is
    refused: a flag of shape (n,) was applied element by element by the
    select (parameters partly stepped, the step counted as applied)."""
    flag = torch.as_tensor(flag, device=device).to(torch.bool)
    if flag.dim() != 0:
        # Same text as jaxstable.transforms.skip_non_finite.
        raise ValueError(
            "grads_finite must be a boolean scalar (one flag for the whole "
            f"step), got shape {tuple(flag.shape)}"
        )
    return flag


def _all_finite_t(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`all_finite` as a 0-d bool tensor, with no host sync (see `_finite_norms`)."""
    ts = _norm_inputs(tensors)
    if not ts:
        return torch.ones((), dtype=torch.bool, device=_home(tensors))
    return _finite_norms(ts)[0]


class _DeviceSelect:
    """Keeps a copy of some tensors and puts it back where a flag says.

    ``take(tensors)`` copies them into one flat buffer per (device, dtype),
    allocated once and kept from step to step (one `torch.cat` each: the
    one extra copy). ``put_back(keep_old)`` sets ``t = keep_old ? saved :
    t`` with one in-place `torch.where` per tensor on a view of the flat
    buffer: no temporary, no host sync (`torch.where` selects, so a NaN the
    step wrote never mixes in; an arithmetic blend ``t*(1-k) + saved*k``
    would keep it: NaN * 0 is NaN). ``restore()`` copies everything back
    (a host that already knows), one `torch._foreach_copy_` per group.
    """

    def __init__(self) -> None:
        self._flat: dict[Any, torch.Tensor] = {}
        self._groups: dict[Any, list[torch.Tensor]] = {}

    @torch.no_grad()
    def take(self, tensors: list[torch.Tensor]) -> None:
        self._groups = _by_device_dtype([t.detach() for t in tensors])
        for key, group in self._groups.items():
            n = sum(t.numel() for t in group)
            old = self._flat.get(key)
            if old is None or old.numel() != n:
                old = self._flat.pop(key, None)
                del old  # freed first: never two copies at once
                self._flat[key] = torch.empty(n, dtype=key[1], device=key[0])
            buf = self._flat[key]
            torch.cat([t.reshape(-1) for t in group], out=buf)
        for key in [k for k in self._flat if k not in self._groups]:
            del self._flat[key]  # a group no longer stepped keeps no copy

    def retarget(self, tensors: list[torch.Tensor]) -> bool:
        """Puts the copy back into `tensors` instead of the ones taken (a
        module that assigned new buffers); False (nothing changed) when
        their shapes or dtypes do not match those taken one for one."""
        groups = _by_device_dtype([t.detach() for t in tensors])
        shapes = {k: [t.shape for t in g] for k, g in groups.items()}
        if shapes != {k: [t.shape for t in g] for k, g in self._groups.items()}:
            return False
        self._groups = groups
        return True

    def _saved(self, key: Any) -> list[torch.Tensor]:
        group = self._groups[key]
        parts = self._flat[key].split([t.numel() for t in group])
        return [v.view(t.shape) for v, t in zip(parts, group, strict=True)]

    @torch.no_grad()
    def put_back(self, keep_old: torch.Tensor) -> None:
        for key, group in self._groups.items():
            flag = keep_old.to(key[0])
            for t, old in zip(group, self._saved(key), strict=True):
                torch.where(flag, old, t, out=t)

    @torch.no_grad()
    def restore(self) -> None:
        for key, group in self._groups.items():
            torch._foreach_copy_(group, self._saved(key))

    @torch.no_grad()
    def new_non_finite(self) -> torch.Tensor | None:
        """Whether an element the copy held finite is non-finite now (0-d
        bool tensor; None for no floating tensor): an element that was
        already non-finite (an additive ``-inf`` mask) is no bad write."""
        flags = []
        for key, group in self._groups.items():
            if not (key[1].is_floating_point or key[1].is_complex):
                continue
            now = torch.cat([t.reshape(-1) for t in group])
            was = torch.isfinite(self._flat[key])
            flags.append((was & ~torch.isfinite(now)).any().to(_home(group)))
        return torch.stack(flags).any() if flags else None


def _takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` skips on the device from a ``found_inf``
    attribute, as `GradScaler.step` hands it to fused Adam/AdamW/SGD."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and (
        "grad_scaler" not in inspect.signature(optimizer.step).parameters
    )


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


# An update whose every intermediate and step is below 2**100 in magnitude
# cannot overflow a float32 parameter: p + d with |p| <= 3.4e38 and |d| <
# 2**103 (half a unit in the last place of float32's largest binade) rounds
# to at most float32's max. 8x of margin for the rounding of the bounds.
_SAFE = 2.0**100
_PROVABLE = {
    torch.optim.SGD: "sgd",
    torch.optim.Adam: "adam",
    torch.optim.AdamW: "adam",
}
_MOMENTS = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _number(x: Any, lo: float, hi: float) -> bool:
    """A python number in [lo, hi] (a tensor hyper-parameter is not proved)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and lo <= x <= hi


def _sgd_rule(group: dict[str, Any], m: float):
    lr, mu = group["lr"], group.get("momentum", 0)
    damp = group.get("dampening", 0)
    if group.get("weight_decay") != 0 or not (
        _number(mu, 0.0, _SAFE) and _number(damp, -_SAFE, _SAFE)
    ):
        return None

    def grow(a1: float, a2: float) -> tuple[float, float]:
        # The first step's buffer is the gradient; |1 - d| <= 1 + |d|.
        return (max(a1, mu * a1 + (1 + abs(damp)) * m) if mu else 0.0), 0.0

    def fits(a1: float, a2: float) -> bool:
        n1 = grow(a1, a2)[0]
        return n1 <= _SAFE and lr * (m + n1) <= _SAFE  # Nesterov's g + mu * buf

    return grow, fits


def _adam_rule(group: dict[str, Any], m: float):
    lr, eps, wd = group["lr"], group.get("eps"), group.get("weight_decay")
    b1, b2 = (*group.get("betas", ()), None, None)[:2]
    if group.get("capturable") or not (
        _number(b1, 0.0, 1 - 1e-6)
        and _number(b2, 0.0, 1 - 1e-6)
        and _number(eps, 2.0**-100, _SAFE)
        and m <= 2.0**50
    ):
        return None
    decoupled = group.get("decoupled_weight_decay", False)
    if not (wd == 0 or (decoupled and _number(lr * wd, 0.0, 1.0))):
        return None

    def grow(a1: float, a2: float) -> tuple[float, float]:
        return max(a1, m) * 1.001, max(a2, m * m) * 1.001  # convex blends

    def fits(a1: float, a2: float) -> bool:
        n1, n2 = grow(a1, a2)
        step = lr * n1 / ((1.0 - b1) * eps)  # lr / (1 - b1**t) * m1 / eps
        return max(step, n1 / eps, n2 / (1.0 - b2)) <= _SAFE

    return grow, fits


def _rule(kind: str, group: dict[str, Any], m: float):
    """``(grow, fits)`` of one parameter group under a bound `m` on every
    |gradient| entry: ``grow(a1, a2)`` bounds the state after the step from
    bounds before it, ``fits(a1, a2)`` says every value the step computes
    stays below `_SAFE`; None where nothing is proved (see `_UpdateBound`)."""
    if not _number(group.get("lr"), 0.0, _SAFE) or group.get("differentiable"):
        return None
    return (_sgd_rule if kind == "sgd" else _adam_rule)(group, m)


class _UpdateBound:
    """Proves on the host, per step, that an undo copy cannot be needed.

    The step takes no copy (and makes no update check) where ALL of these
    hold; anywhere else it copies and checks as before:

    - the optimizer is exactly `torch.optim.SGD`, `Adam` or `AdamW` (a
      subclass may change `step`); every parameter with a gradient, the
      gradient and every tensor of its state are dense float32 or float64;
      the hyper-parameters are python numbers (a tensor lr is not read),
      finite, ``differentiable`` and ``capturable`` off;
    - every gradient entry is at most ``m``: the clip's ``max_norm`` (a
      clipped gradient's norm is at most it; a non-finite gradient skips
      the step anyway), or on the host path ``min(norm, max_norm)`` with
      the norm read in the same transfer as the flag;
    - SGD: ``weight_decay == 0`` (an L2 term ``wd * p`` is as large as the
      parameter, which is not read), momentum >= 0: the buffer's bound
      grows as ``a' = momentum * a + (1 + |dampening|) * m`` (the first
      buffer is the gradient) and the step is at most ``lr * (m + a')``
      (Nesterov's ``g + momentum * buf`` included);
    - Adam/AdamW: ``eps > 0``, betas in [0, 1), ``m <= 2**50`` (``g**2`` and
      the second moment stay far below float32's max), weight decay 0 or
      decoupled with ``0 <= lr * wd <= 1`` (``p * (1 - lr * wd)`` does not
      grow): the moments are convex blends, ``|m1| <= max(a1, m)``, ``v <=
      max(a2, m**2)``; the step ``lr / (1 - b1**t) * m1 / (sqrt(v_hat) +
      eps)`` is at most ``lr * a1 / ((1 - b1) * eps)`` and ``v_hat <= a2 /
      (1 - b2)``. float16/bfloat16 state is never proved: there ``eps =
      1e-8`` is 0 and ``(1 - b2) * g**2`` underflows, the ``m / 0`` case;
    - every bound, the step and each intermediate stay below 2**100: then
      ``p + step`` rounds to at most float32's max (a step below half an
      ulp of 3.4e38 cannot carry a finite parameter past it), so a finite
      parameter stays finite.

    The bounds ``(a1, a2)`` of each parameter's state are kept from the
    step that created it, with its tensors' version counters: a state
    written by anything else (``load_state_dict``, user code) is read once
    (its largest magnitudes, one transfer) and bounded from there.
    """

    def __init__(self) -> None:
        self._known: dict[int, tuple[tuple, float, float]] = {}
        self._pre: dict[int, tuple[tuple[float, float], Any]] = {}

    def proven(self, optimizer, params: list, m: float | None) -> bool:
        """Whether this step cannot write a non-finite value (see above)."""
        self._pre = {}
        kind = _PROVABLE.get(type(optimizer))
        if kind is None or m is None or not 0.0 <= m <= 2.0**50:
            return False
        if not _dense_wide(optimizer, params):
            return False
        owner = {}
        for g in optimizer.param_groups:
            rule = _rule(kind, g, m)
            owner.update((id(p), rule) for p in g["params"])
        # Only a state a rule could prove is worth a read.
        self._learn(optimizer, [p for p in params if owner[id(p)] is not None])
        ok = True
        for p in params:
            rule, a = owner[id(p)], self._bounds(optimizer, p)
            if rule is None or a is None:
                ok = False
                continue
            self._pre[id(p)] = (a, rule[0])
            ok = ok and rule[1](*a)
        return ok

    def record(self, optimizer, params: list) -> None:
        """After the step `proven` looked at: each state's bounds grown by
        it (an upper bound whether it was applied or selected back), or
        forgotten where nothing was proved."""
        for p in params:
            pre, state = self._pre.get(id(p)), optimizer.state.get(p)
            if pre is None or not state:
                self._known.pop(id(p), None)
                continue
            a, grow = pre
            self._known[id(p)] = (_versions(state), *grow(*a))
        self._pre = {}

    def _bounds(self, optimizer, p) -> tuple[float, float] | None:
        state = optimizer.state.get(p)
        if not state:
            return (0.0, 0.0)
        known = self._known.get(id(p))
        if known is None or not _unchanged(known[0], state):
            return None
        return known[1:]

    def _learn(self, optimizer, params: list) -> None:
        """State written outside this guard: its largest magnitudes, read
        in one transfer, become its bounds (inf for a non-finite one)."""
        unknown = [
            p
            for p in params
            if optimizer.state.get(p) and self._bounds(optimizer, p) is None
        ]
        if not unknown:
            return
        found = [
            (p, k, optimizer.state[p][k])
            for p in unknown
            for k in _MOMENTS
            if isinstance(optimizer.state[p].get(k), torch.Tensor)
        ]
        values = _to_host([t.detach().abs().amax().double() for _, _, t in found])
        bounds = {id(p): [0.0, 0.0] for p in unknown}
        for (p, k, _), v in zip(found, values, strict=True):
            i = 1 if k.endswith("sq") else 0
            v = v if math.isfinite(v) else math.inf
            bounds[id(p)][i] = max(bounds[id(p)][i], v * 1.001)
        for p in unknown:
            self._known[id(p)] = (_versions(optimizer.state[p]), *bounds[id(p)])


def _dense_wide(optimizer, params: list) -> bool:
    """Every parameter, gradient and state tensor dense float32/float64."""
    wide = (torch.float32, torch.float64)
    return all(
        t.dtype in wide and not t.is_sparse
        for p in params
        for t in [p, p.grad, *_state_tensors(optimizer, p)]
    )


def _state_tensors(optimizer, p) -> list[torch.Tensor]:
    return [
        v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)
    ]


def _versions(state: dict[str, Any]) -> tuple:
    """Which tensors a state holds (weak references: a tensor loaded in
    place of a freed one may reuse its id) and how often each was written."""
    return tuple(
        (k, weakref.ref(v), v._version)
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    )


def _unchanged(recorded: tuple, state: dict[str, Any]) -> bool:
    """Whether `state` holds the very tensors `_versions` recorded, unwritten
    since."""
    now = [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor)]
    return len(now) == len(recorded) and all(
        k == rk and ref() is v and v._version == version
        for (k, v), (rk, ref, version) in zip(now, recorded, strict=True)
    )


_DECIDE_ON = ("auto", "device", "host")


class _GuardedStep:
    """``optimizer.step()`` that leaves parameters and state as they were
    where a flag says; what it copies and where it decides.

    ``run(optimizer, bad_grads, check_update, max_norm, norm) -> skipped``
    (0-d bool tensor). Only the parameters with a gradient and their state
    are ever copied or checked (`_stepped_params`): the others are not
    touched by the step. Two paths, by `decide_on`:

    - **device** (no host sync): an optimizer that takes GradScaler's
      ``found_inf`` (``fused=True`` Adam/AdamW/SGD) is handed ``bad_grads``
      and skips on the device, step count included, with no copy when the
      update is proved finite (`_UpdateBound`, with the clip's
      ``max_norm``) or `check_update` is off; any other optimizer steps
      unconditionally on parameters whose pre-step values were copied
      (ONE copy, `_DeviceSelect`, kept from step to step) and a
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
    sync) and the host path for any other: on an accelerator
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
        self._select = _DeviceSelect()
        self._bound = _UpdateBound()
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
        return not _takes_found_inf(optimizer)

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
        if any(_is_dtensor(p) for p in params) and not check_update:
            # Sharded (FSDP2) parameters: no flat copy of DTensors; the
            # (global) flag is read on the host, one sync per step.
            if not bool(bad_grads):
                optimizer.step()
            # A python bool where the caller read the flag on the host.
            return torch.as_tensor(bad_grads, dtype=torch.bool)
        if check_update:
            _refuse_sharded_update_check(params)
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
        wrote_bad = ~_all_finite_t(_written(optimizer, params)).to(flag.device)
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
            keep_old = bad_grads | ~_all_finite_t(_written(optimizer, params))
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
    bad, value = _to_host([bad_grads, norm if norm is not None else math.nan])
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


def _foreach_copy_by_device(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """`torch._foreach_copy_` per device: one list mixing devices (Adam keeps
    its ``step`` tensors on the CPU beside CUDA moments) takes torch's
    per-tensor slow path, one launch per tensor."""
    groups: dict[Any, tuple[list, list]] = {}
    for d, s in zip(dst, src, strict=True):
        pair = groups.setdefault(d.device, ([], []))
        pair[0].append(d)
        pair[1].append(s)
    for d, s in groups.values():
        torch._foreach_copy_(d, s)


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` must be given a closure (LBFGS's must)."""
    try:
        param = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


# A bool option; ValueError, as this module always raised (fit: TypeError).
_check_bool = functools.partial(_core_check_bool, error=ValueError)


def _check_optimizer(optimizer: Any, where: str) -> None:
    """Refuses what is not a `torch.optim.Optimizer`, naming the fix.

    The common slip is the class itself (``torch.optim.Adam`` for
    ``torch.optim.Adam(model.parameters(), lr=1e-3)``), the twin of passing
    ``optax.adam`` for ``optax.adam(1e-3)`` in JAX. A torchref wrapper is
    an Optimizer to torch (for its LR schedulers) but not here: where this
    check stands, a plain optimizer is wanted.
    """
    if isinstance(optimizer, _OptimizerView):
        raise TypeError(
            f"{where} needs a plain optimizer (a torch.optim.Optimizer such as "
            "torch.optim.Adam(model.parameters(), lr=1e-3)), got the torchref "
            f"wrapper {type(optimizer).__name__}"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        return
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        name = f"{optimizer.__module__.split('.')[0]}.optim.{optimizer.__name__}"
        if not optimizer.__module__.startswith("torch.optim"):
            name = optimizer.__name__
        raise TypeError(
            f"{where} needs an optimizer (a torch.optim.Optimizer), got the class "
            f"{optimizer.__name__}: construct it: {name}(model.parameters(), "
            "lr=1e-3)"
        )
    raise TypeError(
        f"{where} needs an optimizer (a torch.optim.Optimizer such as "
        "torch.optim.Adam(model.parameters(), lr=1e-3)), got "
        f"{type(optimizer).__name__}"
    )


def _check_max_consecutive(max_consecutive: Any) -> int | None:
    if max_consecutive is None:
        return None
    if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int):
        raise ValueError(
            f"max_consecutive must be None or an int >= 0, got {max_consecutive!r}"
        )
    if max_consecutive < 0:
        raise ValueError(
            f"max_consecutive must be None or an int >= 0, got {max_consecutive!r}"
        )
    return max_consecutive


# Pending steps kept on the device at most: a loop that never reads
# skip_state records them every 4096 steps (one transfer) instead of holding
# two 0-d device tensors per step for ever (a 512-byte CUDA block each).
_MAX_PENDING = 4096


class _OptimizerView(torch.optim.Optimizer):
    """What a wrapper passes through from ``self.optimizer`` (the wrapped
    optimizer), so that LR schedulers and user code treat the wrapper as
    the optimizer: its parameter groups, state and `defaults` (CyclicLR
    and OneCycleLR read ``defaults``), `zero_grad`, `add_param_group` and
    the hook registrations.

    A `torch.optim.Optimizer` subclass because ``torch.optim.lr_scheduler``
    refuses anything else (``StepLR(skip_non_finite(sgd))`` raised "is not
    an Optimizer"), as accelerate's ``AcceleratedOptimizer`` is one.
    ``Optimizer.__init__`` is not called: the wrapped optimizer holds the
    groups and state (a second copy would drift), and it would patch
    `step` for the profiler's hooks, which the wrapped one runs itself.

    A scheduler tracks the wrapper's `step` (its "``lr_scheduler.step()``
    before ``optimizer.step()``" warning): a call of the wrapper's `step`
    counts as the optimizer's step whether the guard applied or skipped
    it, so a skipped first step gives no false warning (GradScaler, which
    skips by not calling ``optimizer.step()``, gives one). The scheduler
    advances on every ``scheduler.step()`` either way.
    """

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's default options (``lr``, ``momentum``...)."""
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's `zero_grad`."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The wrapped optimizer's `add_param_group`."""
        self.optimizer.add_param_group(param_group)

    def register_step_pre_hook(self, hook: Any) -> Any:
        """Registers `hook` on the wrapped optimizer: it runs on applied steps."""
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> Any:
        """Registers `hook` on the wrapped optimizer: it runs on applied steps."""
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        """Registers `hook` on the wrapped optimizer's `state_dict`."""
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        """Registers `hook` on the wrapped optimizer's `state_dict`."""
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(
        self, hook: Any, prepend: bool = False
    ) -> Any:
        """Registers `hook` on the wrapped optimizer's `load_state_dict`."""
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(
        self, hook: Any, prepend: bool = False
    ) -> Any:
        """Registers `hook` on the wrapped optimizer's `load_state_dict`."""
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def __getstate__(self) -> dict[str, Any]:
        # Every attribute (Optimizer's keeps three), less what a scheduler
        # attached, as Optimizer's drops it: its patched `step` is a closure
        # over this object.
        return {
            k: v for k, v in self.__dict__.items() if k not in ("step", "_opt_called")
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


class _DeferredRecords:
    """`skip_state` whose per-step records wait on the device.

    A guarded step leaves ``(applied, grads_finite)`` as 0-d bool tensors in
    ``_pending`` instead of reading them (a host sync per step); reading
    `skip_state` moves every pending pair to the host in ONE transfer and
    records them in order, as does every 4096th pending step (`_push`).
    `TrainStep.step` returns its python metrics through the same single
    transfer.
    """

    _skip_state: SkipNonFiniteState
    _pending: list[tuple[Any, Any]]
    max_consecutive: int | None

    @property
    def skip_state(self) -> SkipNonFiniteState:
        """The counters, with every pending step recorded (one transfer)."""
        if self._pending:
            self._record(_to_host([t for pair in self._pending for t in pair]))
        return self._skip_state

    @skip_state.setter
    def skip_state(self, state: SkipNonFiniteState) -> None:
        self._pending = []
        self._skip_state = state
        self._skipped_dev: torch.Tensor | None = None  # TrainStep's count

    def _push(self, applied: torch.Tensor, grads_finite: torch.Tensor) -> None:
        """Leaves one step's flags pending (recorded once `_MAX_PENDING` wait)."""
        self._pending.append((applied, grads_finite))
        if len(self._pending) >= _MAX_PENDING:
            _ = self.skip_state

    def _record(self, flags: list[Any]) -> None:
        """Records the pending pairs from their host values (in order)."""
        pending, self._pending = self._pending, []
        for i in range(len(pending)):
            self._skip_state.record(
                bool(flags[2 * i]),
                self.max_consecutive,
                grads_finite=bool(flags[2 * i + 1]),
            )


def _to_host(values: list[Any]) -> list[Any]:
    """Python numbers of 0-d tensors (and python numbers) in ONE
    device->host transfer: stacked in float64 on their home device (exact
    for float32 values, bools and counts below 2**53), then `.tolist()`."""
    ts = [v for v in values if isinstance(v, torch.Tensor)]
    if not ts:
        return list(values)
    home = _home(ts)
    host = iter(torch.stack([t.to(home, torch.float64) for t in ts]).tolist())
    return [next(host) if isinstance(v, torch.Tensor) else v for v in values]


class SkipNonFinite(_OptimizerView, _DeferredRecords):
    """An optimizer wrapper whose `step()` is skipped on non-finite grads.

    Made by `skip_non_finite`. `param_groups`, `state`, `zero_grad`,
    `state_dict` and `load_state_dict` are the wrapped optimizer's;
    `skip_state` holds the counters (`SkipNonFiniteState`).

    Example:
        >>> import torch
        >>> from torchref import transforms
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = transforms.skip_non_finite(torch.optim.SGD([w], lr=0.1))
        >>> w.grad = torch.tensor([1.0, float("inf")])
        >>> opt.step()
        >>> w.tolist(), opt.skip_state.skipped_total
        ([1.0, 1.0], 1)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_consecutive: int | None,
        check_update: bool = True,
        decide_on: str = "auto",
    ):
        _check_optimizer(optimizer, type(self).__name__)
        self.optimizer = optimizer
        self.max_consecutive = _check_max_consecutive(max_consecutive)
        self.check_update = _check_bool("check_update", check_update)
        self.skip_state = SkipNonFiniteState()
        self._undo = _StepUndo()  # the closure path (LBFGS) decides on the host
        self._guarded = _GuardedStep()
        self._guarded.decide_on = decide_on
        self._needs_closure = _needs_closure(optimizer)
        self._norm: Any = None  # the last check's gradient norm (a bound)

    @property
    def decide_on(self) -> str:
        """Where a step's skip is decided: ``"auto"``, ``"device"`` or
        ``"host"`` (see `skip_non_finite`); settable."""
        return self._guarded.decide_on

    @decide_on.setter
    def decide_on(self, value: str) -> None:
        self._guarded.decide_on = value

    def grads(self) -> list[torch.Tensor]:
        """The gradients of every parameter that has one."""
        return [
            p.grad
            for g in self.optimizer.param_groups
            for p in g["params"]
            if p.grad is not None
        ]

    def _guards(self) -> bool:
        """Whether steps are checked and skipped (StableOptimizer may not)."""
        return True

    def _check(self, grads_finite: Any) -> torch.Tensor:
        """The gradients' flag (0-d bool tensor, no host sync): the
        caller's when given (a bool or a tensor), else `all_finite` on the
        device; StableOptimizer also clips here."""
        grads = self.grads()
        home = _home(grads)
        # skip_spikes hands its flag with the norm it computed.
        self._norm = getattr(self, "_norm_hint", None)
        if not self._guards():
            return torch.ones((), dtype=torch.bool, device=home)
        if grads_finite is not None:
            return _scalar_flag(grads_finite, home)
        read = self._read_on_host(grads, None, None)
        if read is not None:
            return read[0]
        ts = _norm_inputs(grads)
        if not ts:
            return torch.ones((), dtype=torch.bool, device=home)
        finite, self._norm = _finite_norms(ts)
        return finite

    def _read_on_host(self, grads: list, given: Any, clip: Any):
        """The host path's check (`norm_read_on_host`): ``(flag as a CPU
        tensor, norm)``, the norm's host value kept for the proof; None on
        the device path or where the float32 norm is not finite (then the
        exact check runs)."""
        if not self._guarded.on_host(self.optimizer):
            return None
        read = norm_read_on_host(grads, [True if given is None else given], clip)
        if read is None:
            return None
        self._norm = read[1]
        return torch.tensor(bool(read[2][0])), read[0]

    def _prepare(self, finite: bool) -> None:
        """Runs between the check and a closure step (StableOptimizer records
        `grad_norm` here)."""

    def _apply(self, grads_ok: torch.Tensor) -> torch.Tensor:
        """``optimizer.step()`` where `grads_ok`, selected back where it
        wrote a non-finite value (with `check_update`); whether the step
        was applied, as a 0-d bool tensor (see `_GuardedStep`)."""
        if not self._guards():
            self.optimizer.step()
            return grads_ok
        clip = getattr(self, "clip", None)
        return ~self._guarded.run(
            self.optimizer,
            ~grads_ok,
            self.check_update,
            None if clip is None else clip.max_norm,
            self._norm,
        )

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grads_finite: bool | None = None,
    ):
        """Steps the wrapped optimizer unless the step would be non-finite.

        Args:
            closure: forwarded to the wrapped `step` (evaluated before the
                check, so its backward produces the grads that are checked).
                Required by an optimizer whose `step` needs one
                (`torch.optim.LBFGS`): every evaluation it makes is checked,
                and the whole step is undone when one of them had non-finite
                gradients or loss, or when it wrote a non-finite value (with
                `check_update`; the copy is taken even without it, since the
                optimizer acts on its evaluations before any check can).
            grads_finite: a finiteness flag already computed by the caller
                (a bool or a 0-d bool tensor); REUSED when given (no second
                check), else `all_finite(grads)` on the device.

        Returns:
            The closure's loss (or None), a skipped step's as well.
        """
        if self._needs_closure:
            return self._closure_step(closure, grads_finite)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        finite = self._check(grads_finite)
        applied = self._apply(finite)
        self._push(applied, finite)  # read when skip_state is
        return loss

    def _closure_step(self, closure: Callable[[], Any] | None, grads_finite: Any):
        """A step of an optimizer that evaluates `closure` itself (LBFGS)."""
        name = type(self.optimizer).__name__
        if closure is None:
            raise TypeError(
                f"{name}.step() re-evaluates the loss, so it needs a closure: call "
                "step(closure) with a closure that zeroes the grads, computes the "
                "loss, calls backward() and returns the loss"
            )
        if grads_finite is not None:
            raise ValueError(
                f"grads_finite cannot be given to a {name} step: its closure runs "
                "several times per step and every evaluation is checked"
            )
        flags: list[bool] = []

        def guarded():
            with torch.enable_grad():
                loss = closure()
            ok = not self._guards() or all_finite([loss, *self.grads()])
            flags.append(ok)
            self._prepare(ok)
            return loss

        if not self._guards():
            return self.optimizer.step(guarded)
        self._undo.take(self.optimizer)
        loss = self.optimizer.step(guarded)
        grads_ok = all(flags)
        applied = grads_ok and (not self.check_update or self._undo.written_finite())
        if not applied:
            self._undo.restore()
        self.skip_state.record(applied, self.max_consecutive, grads_finite=grads_ok)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus the skip counters."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "skip_state": dataclasses.asdict(self.skip_state),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of `state_dict`."""
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.skip_state = SkipNonFiniteState(**state_dict["skip_state"])


def skip_non_finite(
    optimizer: torch.optim.Optimizer,
    *,
    max_consecutive: int | None = None,
    check_update: bool = True,
    decide_on: str = "auto",
) -> SkipNonFinite:
    """Wraps an optimizer so that a non-finite step is never applied.

    Maths: ``if all_finite(grads): optimizer.step() else: nothing`` — the
    parameters and the optimizer state (Adam's moments and step count) are
    left exactly as they were, as `torch.amp.GradScaler.step` does; the
    counters in `skip_state` are updated either way. With `check_update`,
    a step whose gradients were finite but which wrote a non-finite
    parameter or state value (float16 Adam: ``(1 - b2) * g**2`` underflows
    to 0 and ``eps = 1e-8`` is 0 in float16, so ``m / 0``) is undone and
    counted the same way (``skip_state.non_finite_updates``).

    What a step costs (`decide_on`): only the parameters with a gradient
    and their state are ever copied or checked. On the device path (no
    host sync, issue 24; the default for a fused optimizer)
    the flag stays a device tensor; a fused optimizer (``fused=True``
    Adam/AdamW/SGD) gets it as GradScaler's ``found_inf`` and skips
    itself, with no copy where its update is proved finite (float32
    SGD/Adam/AdamW under a clip, see `StableOptimizer`); any other one
    steps on ONE copy of its parameters and state taken just before,
    which a `torch.where` selects back (so `check_update=False` saves the
    check, not the copy, unless the optimizer is fused). On the host path
    (``decide_on="host"``, the default for a non-fused optimizer,
    GradScaler's own one sync) the flag and the gradients'
    norm are read in one transfer and a bad step does not call
    ``optimizer.step()``; a copy is taken only where the update is not
    proved finite (then its check is read too). The step that creates the
    optimizer state (the first) decides on the host once on the device
    path, a fused one included (its skipped first step would keep
    uninitialised momentum buffers). An
    optimizer with step pre/post hooks (``register_step_post_hook``, an
    EMA) is not stepped on non-finite gradients, as under GradScaler: that
    flag is read on the host (one sync per step); a step undone by
    `check_update` did run, so its post hooks saw what it wrote. `skip_state` is brought
    up to date when read, in one transfer for all steps since (and every
    4096 steps when it is never read).

    Args:
        optimizer: any `torch.optim.Optimizer`.
        max_consecutive: when more than this many steps in a row are skipped,
            ``skip_state.exceeded`` becomes True (the train loop acts on it;
            the wrapper still never applies a bad step). None: never.
        check_update: also undo a step that wrote a non-finite parameter or
            optimizer-state value (default True).
        decide_on: ``"auto"`` (default), ``"device"`` (no host sync) or
            ``"host"`` (one sync, no copy where the update is proved
            finite); ``"auto"`` is ``"device"`` for an optimizer that
            takes ``found_inf`` (fused), else ``"host"``. Also an
            attribute (``opt.decide_on``).

    Returns:
        A `SkipNonFinite` wrapper.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = skip_non_finite(torch.optim.Adam([w], lr=0.1))
        >>> w.grad = torch.tensor([1.0, float("nan")])
        >>> opt.step()
        >>> w.tolist(), opt.state == {}, opt.skip_state.skipped_total
        ([1.0, 1.0], True, 1)
        >>> # finite gradients, non-finite update: Adam with eps=0 divides 0 by 0
        >>> opt = skip_non_finite(torch.optim.Adam([w], lr=0.1, eps=0.0))
        >>> w.grad = torch.tensor([1.0, 0.0])
        >>> opt.step()
        >>> w.tolist(), opt.state == {}, opt.skip_state.non_finite_updates
        ([1.0, 1.0], True, 1)
    """
    return SkipNonFinite(optimizer, max_consecutive, check_update, decide_on)


class StableOptimizer(SkipNonFinite):
    """Finiteness check, clipping and the optimizer step in one `step()`.

    Made by `stable_optimizer`. After each `step()`, `grad_norm` holds the
    pre-clip global norm (0-d float32 tensor) and `skip_state` the counters.

    Example:
        >>> import torch
        >>> from torchref import transforms
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> opt = transforms.stable_optimizer(torch.optim.SGD([w], lr=1.0),
        ...                                   max_grad_norm=1.0)
        >>> w.grad = torch.tensor([3.0, 4.0])
        >>> opt.step()
        >>> round(opt.grad_norm.item(), 4), [round(v, 4) for v in w.tolist()]
        (5.0, [-0.6, -0.8])
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None,
        skip: bool,
        max_consecutive: int | None,
        clip_eps: float,
        check_update: bool = True,
        decide_on: str = "auto",
    ):
        super().__init__(optimizer, max_consecutive, check_update, decide_on)
        if max_grad_norm is not None and self._needs_closure:
            # Measured: LBFGS on a 2-parameter quadratic went to 1e6 with
            # max_grad_norm=1.0 and converged without it.
            raise ValueError(
                f"max_grad_norm cannot be used with {type(optimizer).__name__}: "
                "its step re-evaluates the loss through the closure and builds "
                "its curvature estimate from the gradients, which a clip would "
                "change; leave max_grad_norm=None and bound its steps with lr "
                "and line_search_fn='strong_wolfe'"
            )
        self.skip = bool(skip)
        self.clip = (
            None
            if max_grad_norm is None
            else clip_by_global_norm(max_grad_norm, eps=clip_eps)
        )
        self.grad_norm: torch.Tensor | None = None

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _guards(self) -> bool:
        return self.skip

    def _check(self, grads_finite: Any) -> torch.Tensor:
        """One pass gives the norm AND the flag: clips where finite (and
        `max_grad_norm` is set), records `grad_norm`; no host sync. On a
        non-finite step the norm is reported (inf/nan) but not multiplied
        into the grads, so a later report still names the bad leaves."""
        grads = self.grads()
        given = None
        if grads_finite is not None:
            given = torch.as_tensor(grads_finite, device=_home(grads)).to(torch.bool)
        read = self._read_on_host(grads, given, self.clip) if self.skip else None
        if read is not None:
            self.grad_norm = read[1].to(torch.float32)
            return read[0]
        if self.clip is not None:
            norm, finite = _clip_in_place(
                grads, self.clip.max_norm, self.clip.eps, apply=given
            )
        else:
            norm, finite, _ = _norm_and_finite(grads)
        self.grad_norm = self._norm = norm.to(torch.float32)
        if not self.skip:
            return torch.ones((), dtype=torch.bool, device=finite.device)
        return finite if given is None else given

    def _prepare(self, finite: bool) -> None:
        """The closure path (no clip there): records `grad_norm`."""
        self.grad_norm = global_norm(self.grads())


def stable_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    max_grad_norm: float | None = None,
    skip_non_finite: bool = True,
    max_consecutive: int | None = None,
    clip_eps: float = 1e-6,
    check_update: bool = True,
    decide_on: str = "auto",
) -> StableOptimizer:
    """Skip-non-finite around (clip by global norm, then the optimizer).

    Maths, per `step()`: ``finite = all_finite(grads)`` (one check, on the
    raw grads); ``norm = global_norm(grads)``; if `max_grad_norm`:
    ``grads *= min(max_grad_norm/(norm + clip_eps), 1)``; then
    ``optimizer.step()`` only if finite, undone (with `check_update`) when
    it wrote a non-finite parameter or state value. Mirrors
    ``jaxstable.transforms.stable_optimizer`` =
    ``skip_non_finite(chain(clip_by_global_norm(max_grad_norm), optimizer))``.

    Args:
        optimizer: any `torch.optim.Optimizer`.
        max_grad_norm: clip threshold (> 0) or None for no clipping (None for
            an optimizer whose step needs a closure, such as LBFGS).
        skip_non_finite: skip non-finite steps (default True). If False the
            step is always applied and `find_skip_state` returns None.
        max_consecutive: see `skip_non_finite`.
        clip_eps: eps of the clip formula.
        check_update: see `skip_non_finite` (default True; ignored when
            `skip_non_finite` is False). With `max_grad_norm` set, a
            float32 SGD (no weight decay) / Adam (eps > 0, no L2 decay) /
            AdamW step is proved finite on the host (`_UpdateBound`: every
            value it computes stays below 2**100) and takes no copy and
            no check on the host path, nor with a fused optimizer.
        decide_on: see `skip_non_finite`.

    Returns:
        A `StableOptimizer` (``.grad_norm`` = last pre-clip norm).

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> opt = stable_optimizer(torch.optim.SGD([w], lr=1.0), max_grad_norm=1.0)
        >>> w.grad = torch.tensor([3.0, 4.0])
        >>> opt.step()
        >>> round(float(opt.grad_norm), 4), [round(v, 4) for v in w.tolist()]
        (5.0, [-0.6, -0.8])
    """
    return StableOptimizer(
        optimizer,
        max_grad_norm=max_grad_norm,
        skip=skip_non_finite,
        max_consecutive=max_consecutive,
        clip_eps=clip_eps,
        check_update=check_update,
        decide_on=decide_on,
    )


def _spike_guard(optimizer: Any) -> Any:
    """The `SkipNonFinite` a `skip_spikes` wrapper guards with, or None when
    ``optimizer`` is none: told by its `SkipSpikesState` (the spikes module
    imports this one, not the other way)."""
    if isinstance(getattr(optimizer, "spike_state", None), SkipSpikesState):
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, SkipNonFinite):
            return inner
    return None


class AccumulateGradients(_OptimizerView):
    """An optimizer wrapper that steps once every ``every_k`` calls, guarded.

    Made by `accumulate_gradients`. `param_groups` and `state` are the
    wrapped optimizer's; `skip_state` holds its counters (one per window);
    `mini_step` is the number of micro-steps already taken in this window.

    Example:
        >>> import torch
        >>> from torchref import transforms
        >>> w = torch.nn.Parameter(torch.zeros(1))
        >>> opt = transforms.accumulate_gradients(torch.optim.SGD([w], lr=1.0), 2)
        >>> for g in (1.0, 3.0):
        ...     opt.zero_grad()
        ...     (w * g).sum().backward()
        ...     opt.step()
        >>> w.tolist(), opt.mini_step
        ([-2.0], 0)
    """

    def __init__(
        self,
        optimizer: Any,
        every_k: int,
        *,
        drop_non_finite_microbatches: bool = False,
    ):
        if isinstance(every_k, bool) or not isinstance(every_k, int):
            raise TypeError(f"every_k must be an int >= 1, got {every_k!r}")
        if not isinstance(drop_non_finite_microbatches, bool):
            raise TypeError(
                "drop_non_finite_microbatches must be True or False, got "
                f"{drop_non_finite_microbatches!r}"
            )
        if every_k < 1:
            raise ValueError(f"every_k must be an int >= 1, got {every_k}")
        if isinstance(optimizer, AccumulateGradients):
            raise TypeError("accumulate_gradients is already around this optimizer")
        spikes = _spike_guard(optimizer)
        if spikes is None and not isinstance(optimizer, SkipNonFinite):
            _check_optimizer(optimizer, "accumulate_gradients")
            optimizer = SkipNonFinite(optimizer, None)
        # A SkipSpikes wraps a SkipNonFinite (its `optimizer`).
        guard = optimizer if spikes is None else spikes
        if guard._needs_closure:
            name = type(guard.optimizer).__name__
            raise TypeError(
                f"accumulate_gradients cannot drive {name}: its step() "
                "re-evaluates the loss through a closure"
            )
        self.optimizer = optimizer
        self.every_k = every_k
        self.mini_step = 0
        self.drop_non_finite_microbatches = drop_non_finite_microbatches
        # drop_non_finite_microbatches: the float32 sum of the window's kept
        # micro-gradients (by parameter), how many were kept, and a device
        # count of the dropped ones (read by `dropped_total`).
        self._acc: dict[int, torch.Tensor] = {}
        self._kept: Any = None
        self._dropped: Any = 0

    @property
    def dropped_total(self) -> int | None:
        """Micro-gradients dropped so far (``drop_non_finite_microbatches``;
        None without it). Reading it syncs with the device."""
        if not self.drop_non_finite_microbatches:
            return None
        return int(self._dropped)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _absorb(self) -> None:
        """Adds this micro-step's gradient (alone in ``.grad``) to the float32
        sum when the new sum is finite, as the JAX transform; clears ``.grad``."""
        params = [p for p in self._params() if p.grad is not None]
        added = []
        for p in params:
            acc = self._acc.get(id(p))
            if acc is None:
                dtype = torch.promote_types(p.grad.dtype, torch.float32)
                acc = torch.zeros_like(p.grad, dtype=dtype)
            added.append(acc + p.grad.to(acc.dtype))
        ok = _all_finite_t(added)
        for p, new in zip(params, added, strict=True):
            old = self._acc.get(id(p))
            old = torch.zeros_like(new) if old is None else old
            self._acc[id(p)] = torch.where(ok.to(new.device), new, old)
            p.grad = None
        one = ok.to(torch.int64)
        self._kept = one if self._kept is None else self._kept + one
        self._dropped = self._dropped + (1 - one)

    @property
    def skip_state(self) -> SkipNonFiniteState:
        """The guard's counters: one decision (and count) per window."""
        return self.optimizer.skip_state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the grads at the start of a window only (they add up inside;
        with ``drop_non_finite_microbatches`` `step` takes them each time)."""
        if self.mini_step == 0 or self.drop_non_finite_microbatches:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """Counts a micro-step; the ``every_k``-th steps on the mean gradient.

        The guarded step (check, clip for a `StableOptimizer`, step, undo of
        a non-finite write) runs on ``sum / every_k`` of the window's
        gradients: a NaN in any micro-batch skips the whole window, once.
        The grads are then zeroed, so the next window starts clean.
        """
        if closure is not None:
            raise TypeError("accumulate_gradients takes no closure")
        if self.drop_non_finite_microbatches:
            self._absorb()
        self.mini_step += 1
        if self.mini_step < self.every_k:
            return
        self.mini_step = 0
        if self.drop_non_finite_microbatches:
            # The kept ones' mean; none kept: 0 / 0 = nan, a skipped window.
            for p in self._params():
                acc = self._acc.get(id(p))
                if acc is not None:
                    p.grad = (acc / self._kept.to(acc.dtype)).to(p.dtype)
            self._acc, self._kept = {}, None
        else:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.div_(self.every_k)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped guard's state dict and the position in the window."""
        out = {"optimizer": self.optimizer.state_dict(), "mini_step": self.mini_step}
        if self.drop_non_finite_microbatches:
            out["dropped_total"] = self.dropped_total
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of `state_dict`."""
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.mini_step = int(state_dict["mini_step"])
        if self.drop_non_finite_microbatches:
            self._dropped = int(state_dict.get("dropped_total", 0))


def accumulate_gradients(
    optimizer: Any, every_k: int, *, drop_non_finite_microbatches: bool = False
) -> AccumulateGradients:
    """Gradient accumulation with ONE skip decision per optimizer step.

    The twin of `jaxstable.transforms.accumulate_gradients`, for plain loops
    that call ``zero_grad(); loss.backward(); step()`` once per micro-batch:
    ``zero_grad`` acts at the start of a window only, so the k micro-batch
    gradients add up in ``.grad``; the k-th ``step()`` divides them by k
    (the mean, as the JAX transform takes) and runs the guarded step once:
    a window with a non-finite micro-batch is skipped as a whole and counted
    once, and the next window starts from zeroed grads. A plain optimizer is
    guarded with `skip_non_finite`; a `stable_optimizer` also clips the mean
    once. A `skip_spikes` wrapper is accepted as well, as the JAX transform
    takes one: its spike test and window see the mean's norm once per
    window (not the loss: ``step()`` takes none here; the JAX update checks
    a ``value=`` given with the window's last micro-batch). For a
    GradScaler, use ``TrainStep(..., microbatches=k)``, which runs its
    accumulation recipe (the scaler must unscale once per window).

    Args:
        optimizer: a `torch.optim.Optimizer`, or a `skip_non_finite` /
            `stable_optimizer` / `skip_spikes` wrapper.
        every_k: micro-steps per optimizer step, an int >= 1.
        drop_non_finite_microbatches: False (default: a non-finite
            micro-batch skips its whole window), or True: each ``step()``
            takes the micro-gradient out of ``.grad`` into a float32 sum
            when the new sum is finite (else drops it, counted in
            `AccumulateGradients.dropped_total`), and the window's step
            takes the mean of the kept ones; it is skipped only when none
            is kept (``0 / 0``) or the result is non-finite. The twin of
            the JAX transform's option (equal weights); no host sync.

    Returns:
        An `AccumulateGradients` wrapper.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(1))
        >>> sgd = torch.optim.SGD([w], lr=1.0)
        >>> opt = accumulate_gradients(stable_optimizer(sgd), 2)
        >>> for g in (1.0, float("nan"), 1.0, 3.0):
        ...     opt.zero_grad()
        ...     (w * g).sum().backward()
        ...     opt.step()
        ...     print(w.tolist(), opt.skip_state.skipped_total)
        [0.0] 0
        [0.0] 1
        [0.0] 1
        [-2.0] 1
        >>> keep = accumulate_gradients(sgd, 2, drop_non_finite_microbatches=True)
        >>> for g in (1.0, float("nan")):
        ...     keep.zero_grad()
        ...     (w * g).sum().backward()
        ...     keep.step()
        >>> w.tolist(), keep.dropped_total
        ([-3.0], 1)
    """
    return AccumulateGradients(
        optimizer, every_k, drop_non_finite_microbatches=drop_non_finite_microbatches
    )


def find_skip_state(obj: Any) -> SkipNonFiniteState | None:
    """The `SkipNonFiniteState` inside a wrapper or a `TrainStep`, or None.

    Args:
        obj: a `SkipNonFinite`/`StableOptimizer`, a `torchref.train.TrainStep`
            (anything with a `skip_state` attribute), or an iterable of them.

    Returns:
        The first skip state found; None when there is none (e.g. a plain
        optimizer or ``stable_optimizer(..., skip_non_finite=False)``).

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(1))
        >>> find_skip_state(skip_non_finite(torch.optim.SGD([w], lr=0.1))).skipped_total
        0
        >>> find_skip_state(torch.optim.SGD([w], lr=0.1)) is None
        True
    """
    return find_state(
        obj,
        SkipNonFiniteState,
        "skip_state",
        skip=lambda x: isinstance(x, StableOptimizer) and not x.skip,
    )
