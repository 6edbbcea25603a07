"""Contrastive losses, in at least float32: symmetric InfoNCE (CLIP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchref._src.losses._checks import (
    as_tensors,
    check_eps,
    check_float,
    check_positive,
    check_same_shape,
    compute_dtype,
)


def info_nce(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 0.07,
    min_temperature: float = 0.01,
    eps: float = 1e-8,
) -> torch.Tensor:
    r"""Symmetric InfoNCE (CLIP) loss with ``F.normalize(eps=eps)``.

    ``S = normalize(a) normalize(b)^T / max(temperature, min_temperature)``;
    ``loss = (CE(S, arange N) + CE(S^T, arange N)) / 2``. At the ties (a row
    of norm exactly ``eps``, a temperature exactly ``min_temperature``)
    ``clamp`` passes the whole gradient, as jaxstable.

    Precision: float32; float64 when ``a`` or ``b`` is float64.

    Args:
      a, b: embeddings (N, D), any float dtype.
      temperature: a finite number > 0, a scalar: a number or a
        (learnable) 0-d tensor, clamped from below. A value <= 0, inf or NaN
        raises, except for a tensor that requires grad: that one is clamped,
        not checked (a check would sync with the device). Any other shape
        raises (a vector would divide each column of the similarities by its
        own temperature).
      min_temperature: a finite number >= 0.
      eps: norm floor, finite and >= 1.2e-38 (float32's smallest normal).

    Returns:
      float32 scalar (float64 for float64 embeddings).

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> a = torch.eye(3).bfloat16()
      >>> print(round(float(losses.info_nce(a, a, temperature=0.1)), 4))
      0.0001
      >>> print(bool(torch.isfinite(losses.info_nce(a * 0, a))))
      True
    """
    # a tensor temperature joins the device check; a number stays a number
    tensor_t = temperature if isinstance(temperature, torch.Tensor) else None
    a, b, _ = as_tensors(a=a, b=b, temperature=tensor_t)
    check_float("a", a)
    check_float("b", b)
    if a.ndim != 2:
        raise ValueError(f"a must have shape (N, D), got a.shape={tuple(a.shape)}")
    check_same_shape("a", a, "b", b)
    if a.shape[0] == 0:
        raise ValueError("info_nce needs at least one pair, got N=0")
    check_positive("temperature", temperature, finite=True)
    check_positive("min_temperature", min_temperature, allow_zero=True, finite=True)
    check_eps("eps", eps)
    ct = compute_dtype(a, b)
    an = F.normalize(a.to(ct), dim=1, eps=eps)
    bn = F.normalize(b.to(ct), dim=1, eps=eps)
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(ct).clamp(min=min_temperature)
    else:
        t = max(float(temperature), min_temperature)
    # matmul is on autocast's lower-precision list: inside
    # torch.autocast(bfloat16) `an @ bn.T` would run in bf16 (38.2367 instead
    # of 38.2670 for one similarity x 1/t seen in the contrastive example).
    with torch.autocast(a.device.type, enabled=False):
        sim = an @ bn.T / t
    target = torch.arange(a.shape[0], device=a.device)
    return 0.5 * (F.cross_entropy(sim, target) + F.cross_entropy(sim.T, target))
