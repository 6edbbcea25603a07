"""Global norms and clipping by them, as `clip_grad_norm_` computes them.

Clipping goes through `torch.nn.utils.get_total_norm` and the coefficient
of `torch.nn.utils.clip_grads_with_norm_` (the two halves of
`clip_grad_norm_`), with fp16/bf16 gradients reduced in float32 and a float64
pass that gives the finiteness flag and the norm where float32's overflowed.
Here also the device helpers the guards share: where flags are combined
(`home_device`) and reading 0-d tensors in one transfer (`to_host`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.utils import get_total_norm

from torchref._src.loss_scale_math import flat_tensors

__all__ = ["clip_by_global_norm", "global_norm"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def norm_inputs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The dense tensors whose norm is wanted: floating and complex ones
    (integer tensors have none), a sparse one by its coalesced values (its
    duplicate indices summed, so the norm is the dense tensor's)."""
    out = []
    for t in tensors:
        if not (t.is_floating_point() or t.is_complex()):
            continue
        if t.is_sparse:
            t = (t if t.is_coalesced() else t.coalesce())._values()
        # A gradient needs no detach (a new tensor object each, per leaf).
        out.append(t.detach() if t.requires_grad else t)
    return out


def _total_norm(ts: list[torch.Tensor], groups: dict | None = None) -> torch.Tensor:
    """get_total_norm, with fp16/bf16 leaves reduced in float32 first
    (`groups`: `by_device_dtype(ts)` where the caller has it)."""
    if not ts:
        return torch.zeros((), dtype=torch.float32)
    groups = by_device_dtype(ts) if groups is None else groups
    if not any(dtype in _LOW_PRECISION for _, dtype in groups):
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


def by_device_dtype(tensors: list[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a (sharded) DTensor norm: its global value (a
    collective, no host sync); a plain tensor as is."""
    return t.full_tensor() if is_dtensor(t) else t


def home_device(tensors: list[torch.Tensor]) -> torch.device:
    """Where device-side flags and norms are combined: an accelerator when
    any tensor is on one (moving a CPU flag there never waits; the reverse
    is a device->host copy, i.e. a sync)."""
    for t in tensors:
        if t.device.type != "cpu":
            return t.device
    return tensors[0].device if tensors else torch.device("cpu")


def _home_of(groups: dict) -> torch.device:
    """`home_device` of the tensors `by_device_dtype` grouped (its keys keep
    the order in which each device first came)."""
    for device, _ in groups:
        if device.type != "cpu":
            return device
    return next(iter(groups))[0] if groups else torch.device("cpu")


def _on(norms: list[torch.Tensor], device: Any, home: torch.device) -> list:
    """Per-leaf norms as plain tensors on `home` (a DTensor's global value);
    as they are where nothing moves (one call per leaf saved)."""
    if device == home and not any(map(is_dtensor, norms)):
        return list(norms)
    return [_local(n).to(home) for n in norms]


def finite_norms(
    ts: list[torch.Tensor], groups: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(finite, norm64)`` of dense floating tensors, on the device.

    One read pass per (device, dtype) group: `torch._foreach_norm` in float64.
    The float64 sum of squares of float32 (or narrower) values cannot
    overflow (3.4e38**2 = 1.2e77 per element), so the float64 norm is finite
    exactly when every element is: it is the finiteness flag AND the exact
    norm where the float32 one overflowed. float64/complex128 leaves, whose
    squares can overflow, add a max-|x| pass for the flag. `groups`:
    `by_device_dtype(ts)` where the caller has it.
    """
    groups = by_device_dtype(ts) if groups is None else groups
    home = _home_of(groups)
    narrow, wide, flags = [], [], []
    for (device, dtype), group in groups.items():
        if dtype.is_complex:
            group = [torch.view_as_real(t) for t in group]
            dtype = group[0].dtype
        if dtype == torch.float64:
            # torch's inf-norm of a zero-size tensor raises: it is finite.
            nonempty = [t for t in group if t.numel()]
            if nonempty:
                norms = torch._foreach_norm(nonempty, float("inf"))
                flags += _on(norms, device, home)
            wide += _on(torch._foreach_norm(group, 2), device, home)
        else:
            norms = torch._foreach_norm(group, 2, dtype=torch.float64)
            narrow += _on(norms, device, home)
    norm64 = torch.linalg.vector_norm(torch.stack(narrow + wide))
    if not flags:
        # Leaf norms are at most ~1e43: their float64 squares add up finite.
        return torch.isfinite(norm64), norm64
    return torch.isfinite(torch.stack(narrow + flags)).all(), norm64


def norm_and_finite(
    tensors: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(norm, finite, norm64)``, no host sync: `norm` is `_total_norm`
    (torch's float32 value, bit for bit) where it is finite; where it
    overflowed with every element finite it is the float64 norm `norm64`
    (None for no tensors) cast down; `finite` is a 0-d bool tensor."""
    ts = norm_inputs(tensors)
    return _norm_and_finite(ts, by_device_dtype(ts))


def _norm_and_finite(ts: list[torch.Tensor], groups: dict) -> tuple[Any, Any, Any]:
    """`norm_and_finite` of `norm_inputs` `ts`, grouped as `by_device_dtype`."""
    total = _total_norm(ts, groups)
    if not ts:
        return total, torch.ones((), dtype=torch.bool), None
    finite, norm64 = finite_norms(ts, groups)
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
    return norm_and_finite(flat_tensors(tensors))[0].to(torch.float32)


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
def clip_in_place(
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
    ts = norm_inputs(grads if tensors_in is None else tensors_in)
    groups = by_device_dtype(ts)
    norm, finite, norm64 = _norm_and_finite(ts, groups)
    dense = [g for g in grads if (g.is_floating_point() or g.is_complex())]
    if norm64 is None or not dense:
        return norm, finite
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    wide = torch.clamp(max_norm / (norm64 + eps), max=1.0).to(coef.dtype)
    coef = torch.where(torch.isfinite(norm), coef, wide)
    ok = finite if apply is None else finite & apply.to(finite.device)
    # The norm's own groups where it is the gradients'.
    same = tensors_in is None
    _scale_in_place(dense, torch.where(ok, coef, 1.0), groups if same else None)
    return norm, finite


def _scale_in_place(
    dense: list[torch.Tensor], coef: torch.Tensor, groups: dict | None = None
) -> None:
    """``g *= coef`` for dense floating/complex gradients: one
    `_foreach_mul_` per (device, dtype), sparse ones by their values
    (`groups`: `by_device_dtype` of their `norm_inputs`, where known: the
    dense ones themselves where none is sparse)."""
    sparse = [g for g in dense if g.is_sparse]
    if groups is None or sparse:
        groups = by_device_dtype([g for g in dense if not g.is_sparse])
    for (device, _), group in groups.items():
        torch._foreach_mul_(group, coef.to(device))
    for g in sparse:  # no foreach kernel; scaling the values scales the sum
        g.mul_(coef.to(g.device))


def norm_read_on_host(
    grads: list[torch.Tensor], others: list[Any], clip: Any
) -> tuple[torch.Tensor, float, list[Any]] | None:
    """The host path's check: torch's float32 norm read with `others` (0-d
    flags, the first of which says the step may be applied) in ONE
    transfer; ``(norm, its host value, host values of others)``, the
    gradients clipped
    (`clip_grads_with_norm_`'s coefficient, bit for bit `clip_in_place`)
    where the flag holds. A finite float32 norm says every gradient is
    finite, so the float64 pass of `finite_norms` (a float64 copy of every
    gradient on the CPU) is skipped; None (nothing done) where the norm is
    not finite: the caller takes the exact device path."""
    ts = norm_inputs(grads)
    groups = by_device_dtype(ts)
    norm = _local(_total_norm(ts, groups))  # a sharded norm: its global value
    *values, value = to_host([*others, norm])
    if not math.isfinite(value):
        return None
    dense = [g for g in grads if (g.is_floating_point() or g.is_complex())]
    if clip is not None and values[0] and dense:
        coef = torch.clamp(clip.max_norm / (norm + clip.eps), max=1.0)
        _scale_in_place(dense, coef, groups)
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
        return clip_in_place(grads, max_norm, float(eps))[0].to(torch.float32)

    clip.max_norm, clip.eps = max_norm, float(eps)  # for the guarded steps

    return clip


def _check_max_norm(max_norm: Any) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float):
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    return float(max_norm)


def all_finite_t(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`all_finite` as a 0-d bool tensor, with no host sync (see `finite_norms`)."""
    ts = norm_inputs(tensors)
    if not ts:
        return torch.ones((), dtype=torch.bool, device=home_device(tensors))
    return finite_norms(ts)[0]


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def to_host(values: list[Any]) -> list[Any]:
    """Python numbers of 0-d tensors (and python numbers) in ONE
    device->host transfer: stacked in float64 on their home device (exact
    for float32 values, bools and counts below 2**53), then `.tolist()`."""
    ts = [v for v in values if isinstance(v, torch.Tensor)]
    if not ts:
        return list(values)
    home = home_device(ts)
    host = iter(torch.stack([t.to(home, torch.float64) for t in ts]).tolist())
    return [next(host) if isinstance(v, torch.Tensor) else v for v in values]
