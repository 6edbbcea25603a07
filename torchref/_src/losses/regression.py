"""Regression losses, in at least float32: the masked L1 (DBNet's
threshold map).
"""

from __future__ import annotations

import torch

from torchref._src.losses._checks import (
    as_tensors,
    check_float,
    check_non_negative_values,
    check_same_shape,
    compute_dtype,
    masked_mean,
)


def masked_l1_loss(
    pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    r"""Masked mean absolute error: ``sum(|p - t| m) / sum(m)``.

    An empty mask gives 0.0 with a zero gradient (no division by zero,
    unlike the DBNet reference's ``if mask.sum().item() == 0``). A negative
    mask value raises ``ValueError`` (reads the mask on the host: one sync
    per call). A mask of subnormal floats (1e-40) is a tiny non-empty mask
    here; XLA on CPU flushes it to zero, so jaxstable returns 0.0 for it.
    Where ``p == t`` the gradient is torch's ``abs``' 0 (``sign(0)``), as in
    DBNet's reference and jaxstable.

    Precision: float32; float64 for float64 ``pred``.

    Args:
      pred: predictions (any float dtype).
      target: same shape.
      mask: non-negative mask/weights, same shape.

    Returns:
      float32 scalar (float64 for float64 pred).

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> p, t = torch.tensor([0.5, 0.2, 0.9]), torch.tensor([0.3, 0.2, 0.0])
      >>> print(round(float(losses.masked_l1_loss(p, t, torch.tensor([1, 1, 0]))), 3))
      0.1
      >>> print(float(losses.masked_l1_loss(p, t, torch.zeros(3))))
      0.0
    """
    pred, target, mask = as_tensors(pred=pred, target=target, mask=mask)
    check_float("pred", pred)
    check_same_shape("pred", pred, "target", target)
    check_same_shape("pred", pred, "mask", mask)
    check_non_negative_values("mask", mask)
    ct = compute_dtype(pred)
    m = mask.to(ct)
    total = ((pred.to(ct) - target.to(ct)).abs() * m).sum()
    return masked_mean(total, m.sum())
