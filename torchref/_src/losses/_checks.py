"""Input checks and shared reductions of every loss.

Validators (one device sync where a docstring says so), the NaN factor
that marks a bad input without a host sync, and the means of empty
inputs (jaxstable's `_checks` twin).
"""

from __future__ import annotations

import math

import torch

# float32's smallest normal number 1.1754944e-38: the floor of every eps (as
# jaxstable, where XLA on CPU flushes a subnormal eps to 0) and of the focal
# loss' modulating base (see sigmoid_focal_loss)
TINY = torch.finfo(torch.float32).tiny


def compute_dtype(*predictions) -> torch.dtype:
    """The dtype a loss computes in: float64 when a prediction is float64,
    float32 otherwise ("at least float32", jaxstable's `compute_dtype`)."""
    wide = any(x is not None and x.dtype == torch.float64 for x in predictions)
    return torch.float64 if wide else torch.float32


def check_float(name: str, x: torch.Tensor) -> None:
    if not torch.is_floating_point(x):
        raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")


def check_same_shape(name_a: str, a, name_b: str, b) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} and {name_b} must have the same shape, got "
            f"{name_a}.shape={tuple(a.shape)} and {name_b}.shape={tuple(b.shape)}"
        )


def shape_of(value) -> tuple:
    if hasattr(value, "shape"):  # tensor, numpy array
        return tuple(value.shape)
    return (len(value),) if isinstance(value, (list, tuple)) else ()


def check_positive(
    name: str, value, *, allow_zero: bool = False, finite: bool = False
) -> None:
    """Raise ValueError for a non-scalar value, a value <= 0 (< 0 with
    allow_zero), NaN, or inf/NaN when `finite` (jaxstable's messages)."""
    if shape_of(value) != ():
        raise ValueError(f"{name} must be a scalar, got shape {shape_of(value)}")
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            return  # learnable: clamped, not checked (that would sync every step)
        v = float(value.detach().double())
    else:
        v = float(value)
    rule = ">= 0" if allow_zero else "> 0"
    if finite and not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number {rule}, got {value}")
    if (v < 0 if allow_zero else v <= 0) or math.isnan(v):
        raise ValueError(f"{name} must be {rule}, got {value}")


def check_eps(name: str, value) -> None:
    """A finite eps >= float32's smallest normal number (see `TINY`)."""
    check_positive(name, value, finite=True)
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return
    if float(value) < TINY:
        raise ValueError(
            f"{name} must be >= {TINY:.8g} (float32's smallest normal number; "
            f"XLA on CPU flushes a smaller one to 0), got {value}"
        )


def check_non_negative_values(name: str, x: torch.Tensor) -> None:
    """ValueError if `x` holds a negative value (reads it on the host: one
    device sync)."""
    negative = x < 0
    if bool(negative.any()):
        raise ValueError(
            f"{name} must be >= 0 everywhere (a weight per element); found "
            f"{int(negative.sum())} negative value(s), the lowest "
            f"{x[negative].min().item()}"
        )


def as_tensors(**inputs):
    """The inputs, in order, as tensors on one device (one validator for
    every loss). None passes through; an array-like (list, numpy array,
    number) is converted with ``torch.as_tensor`` onto the tensors' device,
    as jaxstable converts with ``jnp.asarray``. Tensors on different devices
    raise ValueError naming each one's device (torch would compute a cpu @
    meta product, or fail deep inside)."""
    devices = {n: x.device for n, x in inputs.items() if isinstance(x, torch.Tensor)}
    if len(set(devices.values())) > 1:
        where = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all inputs must be on one device, got {where}")
    device = next(iter(devices.values()), None)
    out = []
    for name, x in inputs.items():
        if x is not None and not isinstance(x, torch.Tensor):
            try:
                x = torch.as_tensor(x, device=device)
            except (TypeError, ValueError, RuntimeError) as err:
                raise TypeError(
                    f"{name} must be a tensor or a numeric array-like (list, "
                    f"numpy array), got {type(x).__name__} ({err})"
                ) from None
        out.append(x)
    return out


def nan_if(condition: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """1.0, or NaN where `condition`: a factor that makes a loss and its
    gradient NaN for an input that has no defined loss (no host sync)."""
    return torch.where(condition, math.nan, 1.0).to(dtype)


def is_nan(x: torch.Tensor) -> torch.Tensor:
    """isnan for any dtype (an integer or bool tensor is never NaN)."""
    if x.is_floating_point() or x.is_complex():
        return torch.isnan(x)
    return torch.zeros_like(x, dtype=torch.bool)


def masked_mean(total: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """total / denominator, and 0.0 (zero gradient) where denominator is 0."""
    nonzero = denominator > 0
    safe = torch.where(nonzero, denominator, torch.ones_like(denominator))
    return torch.where(nonzero, total / safe, torch.zeros_like(total))


def reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    """'none' as is; 'sum'; 'mean' with the mean of an empty tensor 0.0."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / max(loss.numel(), 1)
