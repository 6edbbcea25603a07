"""Input checks and shared reductions of every loss.

Host-side validators (they only look at static shapes/dtypes or at
concrete values, never at tracers), the NaN factor that marks what only
shows under `jit`, and the means of empty inputs.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

# The one host-readability test (not a tracer), shared with the loss scales.
from jaxstable._src.loss_scale_math import is_concrete

Array = Any  # jax.Array or anything jnp.asarray accepts

F32 = jnp.float32

# float32's smallest normal number 1.1754944e-38: the floor of every eps (a
# subnormal one is flushed to 0 by XLA on CPU: 0 / (0 + eps) = NaN) and of
# the focal loss' modulating base (see sigmoid_focal_loss)
TINY = float(np.finfo(np.float32).tiny)


def as_arrays(**inputs):
    """The inputs, in order, as jax arrays (None passes through); TypeError
    naming an input that is not array-like (torchref's `_as_tensors` twin)."""
    out = []
    for name, x in inputs.items():
        if x is not None:
            try:
                x = jnp.asarray(x)
            except TypeError:
                dtype = f" of dtype {x.dtype}" if hasattr(x, "dtype") else ""
                raise TypeError(
                    f"{name} must be a numeric array or array-like (list, "
                    f"numpy array), got {type(x).__name__}{dtype}"
                ) from None
        out.append(x)
    return out


def compute_dtype(*predictions) -> Any:
    """The dtype a loss computes in: float64 when a prediction is float64
    (possible only with x64 on), float32 otherwise ("at least float32")."""
    wide = any(x is not None and x.dtype == jnp.float64 for x in predictions)
    return jnp.float64 if wide else F32


def check_float(name: str, x: Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating array, got dtype {x.dtype}")


def check_same_shape(name_a: str, a: Array, name_b: str, b: Array) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} and {name_b} must have the same shape, got "
            f"{name_a}.shape={a.shape} and {name_b}.shape={b.shape}"
        )


def check_positive(
    name: str, value, *, allow_zero: bool = False, finite: bool = False
) -> None:
    """Raise for a non-scalar `value` (traced or not), and ValueError for a
    concrete one <= 0 (< 0 with allow_zero), NaN, or inf when `finite`
    (torchref's `check_positive` twin: the same messages)."""
    if np.ndim(value) != 0:  # static shape: checked for tracers too
        raise ValueError(f"{name} must be a scalar, got shape {np.shape(value)}")
    if not is_concrete(value):
        return  # a traced (e.g. learnable) value cannot be checked here
    v = float(np.asarray(value, dtype=np.float64))
    rule = ">= 0" if allow_zero else "> 0"
    if finite and not np.isfinite(v):
        raise ValueError(f"{name} must be a finite number {rule}, got {value}")
    if (v < 0 if allow_zero else v <= 0) or np.isnan(v):
        raise ValueError(f"{name} must be {rule}, got {value}")


def check_eps(name: str, value) -> None:
    """A finite eps >= float32's smallest normal number (see `TINY`)."""
    check_positive(name, value, finite=True)
    if is_concrete(value) and float(np.asarray(value, np.float64)) < TINY:
        raise ValueError(
            f"{name} must be >= {TINY:.8g} (float32's smallest normal number; "
            f"XLA on CPU flushes a smaller one to 0), got {value}"
        )


def check_non_negative_values(name: str, x) -> None:
    """ValueError if a concrete `x` holds a negative value (host check; a
    traced `x` is left to the caller, which turns the result into NaN)."""
    if not is_concrete(x):
        return
    values = np.asarray(x)
    negative = values < 0
    if negative.any():
        raise ValueError(
            f"{name} must be >= 0 everywhere (a weight per element); found "
            f"{int(negative.sum())} negative value(s), the lowest "
            f"{values[negative].min()}"
        )


def is_nan(x):
    """isnan for any dtype (an integer or bool array is never NaN)."""
    return (
        jnp.isnan(x)
        if jnp.issubdtype(x.dtype, jnp.inexact)
        else jnp.zeros_like(x, bool)
    )


def nan_if(condition, dtype=F32):
    """1.0, or NaN where `condition`: a factor that makes a loss and its
    gradient NaN for an input that has no defined loss (under jit, where
    nothing can raise), so a finiteness guard sees it."""
    return jnp.where(condition, jnp.nan, 1.0).astype(dtype)


def masked_mean(total, denominator):
    """total / denominator, and 0.0 (zero gradient) where denominator is 0."""
    nonzero = denominator > 0
    return jnp.where(nonzero, total / jnp.where(nonzero, denominator, 1.0), 0.0)


def reduce(loss, reduction: str):
    """'none' as is; 'sum'; 'mean' with the mean of an empty array 0.0."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return jnp.sum(loss)
    return jnp.sum(loss) / max(loss.size, 1)
