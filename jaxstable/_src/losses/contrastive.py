"""Contrastive losses, in at least float32: symmetric InfoNCE (CLIP)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxstable._src.losses._checks import (
    Array,
    as_arrays,
    check_eps,
    check_float,
    check_positive,
    check_same_shape,
    compute_dtype,
)


def _clamp_min(x, low):
    """max(x, low) with torch's ``clamp_min`` gradient: all of it to ``x`` at
    the tie ``x == low`` (``jnp.maximum`` would give it half)."""
    return jnp.where(x >= low, x, low)


def _safe_normalize(x, eps):
    """x / clamp_min(||x||, eps) along the last axis: ``F.normalize``'s
    formula and its gradients, also at ``||x|| == eps`` and at x = 0."""
    sq = jnp.sum(x * x, axis=-1, keepdims=True)
    nonzero = sq > 0
    # the norm's gradient at x = 0 is 0, as torch's vector_norm; sqrt's own
    # there would be inf * 0 = NaN, so sqrt never sees the 0
    norm = jnp.where(nonzero, jnp.sqrt(jnp.where(nonzero, sq, 1.0)), 0.0)
    return x / _clamp_min(norm, eps)


def info_nce(
    a: Array,
    b: Array,
    *,
    temperature: float | Array = 0.07,
    min_temperature: float = 0.01,
    eps: float = 1e-8,
) -> jax.Array:
    r"""Symmetric InfoNCE (CLIP) loss, with eps-safe normalisation.

    ``a_i`` and ``b_i`` are a positive pair. With ``â = a / max(||a||, eps)``
    (rows), ``t = max(temperature, min_temperature)`` and
    ``S = â b̂^T / t``::

        loss = (CE(S, arange(N)) + CE(S^T, arange(N))) / 2

    Finite for zero embeddings (they give a zero row of ``S``) and for bf16
    inputs with tiny temperatures: ``|S| <= 1 / t`` and the log-softmax is
    max-subtracted in float32.

    Gradients at the ties are torchref's (``F.normalize`` and ``clamp``): a
    row of norm exactly ``eps`` and a temperature exactly
    ``min_temperature`` get the whole gradient of the unclamped branch (a
    max would give half), a zero row ``upstream / eps``.

    Precision: float32; float64 when ``a`` or ``b`` is float64 (x64 on).

    Args:
      a, b: embeddings, shape (N, D), any float dtype.
      temperature: a finite number > 0, a scalar: a Python number or a
        (learnable) 0-d array, clamped from below by ``min_temperature``. A
        concrete value <= 0, inf or NaN raises; a traced one (being
        differentiated) is clamped, not checked. Any other shape raises,
        traced or not (a vector would divide each column of the similarities
        by its own temperature).
      min_temperature: a finite number >= 0.
      eps: norm floor, finite and >= 1.2e-38 (float32's smallest normal).

    Returns:
      float32 scalar (float64 for float64 embeddings).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import losses
      >>> a = jnp.eye(3, dtype=jnp.bfloat16)
      >>> print(round(float(losses.info_nce(a, a, temperature=0.1)), 4))
      0.0001
      >>> print(bool(jnp.isfinite(losses.info_nce(a * 0, a))))
      True
    """
    a, b = as_arrays(a=a, b=b)
    check_float("a", a)
    check_float("b", b)
    if a.ndim != 2:
        raise ValueError(f"a must have shape (N, D), got a.shape={a.shape}")
    check_same_shape("a", a, "b", b)
    if a.shape[0] == 0:
        raise ValueError("info_nce needs at least one pair, got N=0")
    check_positive("temperature", temperature, finite=True)
    check_positive("min_temperature", min_temperature, allow_zero=True, finite=True)
    check_eps("eps", eps)
    ct = compute_dtype(a, b)
    an = _safe_normalize(a.astype(ct), eps)
    bn = _safe_normalize(b.astype(ct), eps)
    t = _clamp_min(jnp.asarray(temperature, ct), min_temperature)
    sim = jnp.matmul(an, bn.T, precision=jax.lax.Precision.HIGHEST) / t
    diag = jnp.diagonal(sim)
    loss_ab = jnp.mean(jax.nn.logsumexp(sim, axis=1) - diag)
    loss_ba = jnp.mean(jax.nn.logsumexp(sim, axis=0) - diag)
    return 0.5 * (loss_ab + loss_ba)
