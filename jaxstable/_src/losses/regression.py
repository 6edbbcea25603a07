"""Regression losses, in at least float32: the masked L1 (DBNet's
threshold map).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxstable._src.losses._checks import (
    Array,
    as_arrays,
    check_float,
    check_non_negative_values,
    check_same_shape,
    compute_dtype,
    masked_mean,
    nan_if,
)


def _abs(d):
    """|d| with torch's gradient sign(d): 0 at d = 0 (jax.grad(abs)(0) is 1)."""
    return d * jnp.sign(d)


def masked_l1_loss(pred: Array, target: Array, mask: Array) -> jax.Array:
    r"""Masked mean absolute error: ``sum(|p - t| m) / sum(m)``.

    An empty mask gives 0.0 with a zero (finite) gradient, as DBNet's
    reference returns the zero mask sum instead of dividing by it. Where
    ``p == t`` the gradient is 0, as torch's ``abs`` (``sign(0) = 0``) in
    DBNet's reference (``jax.grad(jnp.abs)(0.0)`` is 1).

    Precision: float32; float64 for float64 ``pred`` (x64 on).

    A negative mask value raises ``ValueError`` when ``mask`` is concrete;
    under ``jit`` it makes the loss and its gradient NaN (a sum of mixed-sign
    weights could be 0 or negative: no mean is defined).

    Cannot be changed (documented): XLA on CPU flushes subnormal float32
    values (below 1.18e-38) to zero, so a mask of 1e-40 everywhere is an
    empty mask here (0.0) while torch divides by its tiny sum (the mean).

    Args:
      pred: predictions (any float dtype), e.g. DBNet's threshold map.
      target: same shape.
      mask: non-negative weights/mask, same shape.

    Returns:
      float32 scalar (float64 for float64 pred).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import losses
      >>> p, t = jnp.array([0.5, 0.2, 0.9]), jnp.array([0.3, 0.2, 0.0])
      >>> print(round(float(losses.masked_l1_loss(p, t, jnp.array([1, 1, 0]))), 3))
      0.1
      >>> print(float(losses.masked_l1_loss(p, t, jnp.zeros(3))))
      0.0
    """
    pred, target, mask = as_arrays(pred=pred, target=target, mask=mask)
    check_float("pred", pred)
    check_same_shape("pred", pred, "target", target)
    check_same_shape("pred", pred, "mask", mask)
    check_non_negative_values("mask", mask)
    ct = compute_dtype(pred)
    m = mask.astype(ct)
    total = jnp.sum(_abs(pred.astype(ct) - target.astype(ct)) * m)
    mean = masked_mean(total, jnp.sum(m))
    # A traced negative mask (a concrete one raised above): NaN value and
    # gradient. A NaN factor on `mean` would not do: for a mask sum <= 0 its
    # where() sends a zero gradient past the factor.
    negative = jnp.any(m < 0)
    return jnp.where(negative, total * nan_if(negative, ct), mean)
