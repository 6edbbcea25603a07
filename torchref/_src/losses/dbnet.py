"""DBNet's differentiable binarisation and its total loss (balanced BCE +
masked L1 + dice), in at least float32.
"""

from __future__ import annotations

import torch

from torchref._src.losses._checks import (
    as_tensors,
    check_eps,
    check_float,
    check_positive,
    compute_dtype,
)
from torchref._src.losses.binary import balanced_binary_cross_entropy, dice_loss
from torchref._src.losses.regression import masked_l1_loss


def db_step(prob: torch.Tensor, thresh: torch.Tensor, *, k: float = 50.0):
    r"""DBNet's differentiable binarisation ``sigmoid(k (prob - thresh))``.

    Equal in value to the references' ``torch.reciprocal(1 + torch.exp(-k (x -
    y)))``, whose ``exp`` overflows fp16 once ``x - y < -0.222`` at k=50 (exp
    overflows fp16 above 11.09) and whose backward then yields NaN. At
    ``prob == thresh`` the gradient is ``k / 4``, as the reference's.

    Precision: float32; float64 when ``prob`` or ``thresh`` is float64.

    Args:
      prob: probability map (any float dtype).
      thresh: threshold map, broadcastable with ``prob``.
      k: a finite number > 0.

    Returns:
      float32 tensor (float64 when prob or thresh is float64).

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> out = losses.db_step(torch.tensor([0.0, 0.5, 1.0]).half(),
      ...                      torch.tensor([1.0, 0.5, 0.0]).half())
      >>> print(out.dtype, [round(float(v), 4) for v in out])
      torch.float32 [0.0, 0.5, 1.0]
    """
    prob, thresh = as_tensors(prob=prob, thresh=thresh)
    check_float("prob", prob)
    check_positive("k", k, finite=True)
    try:
        torch.broadcast_shapes(prob.shape, thresh.shape)
    except RuntimeError:
        raise ValueError(
            f"prob.shape={tuple(prob.shape)} and thresh.shape="
            f"{tuple(thresh.shape)} do not broadcast"
        ) from None
    ct = compute_dtype(prob, thresh)
    return torch.sigmoid(k * (prob.to(ct) - thresh.to(ct)))


def db_loss(
    shrink_logits: torch.Tensor,
    thresh: torch.Tensor,
    gt: torch.Tensor,
    mask: torch.Tensor,
    thresh_map: torch.Tensor,
    thresh_mask: torch.Tensor,
    *,
    k: float = 50.0,
    bce_weight: float = 5.0,
    l1_weight: float = 10.0,
    dice_weight: float = 1.0,
    negative_ratio: float = 3.0,
    eps: float = 1e-6,
    return_terms: bool = False,
):
    r"""DBNet's total loss in at least float32, on the shrink-map logits.

    ``bce_weight * balanced_bce(shrink_logits, gt, mask) + l1_weight *
    masked_l1(thresh, thresh_map, thresh_mask) + dice_weight *
    dice(db_step(sigmoid(shrink_logits), thresh, k), gt, mask)`` (5, 10, 1).

    Precision: each term follows its own loss (float64 for float64
    ``shrink_logits`` / ``thresh``), the total their promotion.

    Args:
      shrink_logits, thresh, gt, mask, thresh_map, thresh_mask: same shape.
      k, bce_weight, l1_weight, dice_weight, negative_ratio, eps: see
        ``jaxstable.losses.db_loss`` (the weights: finite numbers >= 0).
      return_terms: also return ``{"bce", "l1", "dice"}``.

    Returns:
      float32 scalar, or ``(total, terms)``.

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> gt = torch.zeros(1, 8, 8); gt[:, 2:6, 2:6] = 1.0
      >>> ones = torch.ones(1, 8, 8)
      >>> total, terms = losses.db_loss(6.0 * (2 * gt - 1), 0.3 * ones, gt, ones,
      ...                               0.3 * ones, ones, return_terms=True)
      >>> print(round(float(total), 4), sorted(terms))
      0.0124 ['bce', 'dice', 'l1']
    """
    shrink_logits, thresh, gt, mask, thresh_map, thresh_mask = as_tensors(
        shrink_logits=shrink_logits, thresh=thresh, gt=gt, mask=mask,
        thresh_map=thresh_map, thresh_mask=thresh_mask,
    )  # fmt: skip
    # the options first: a bad k or eps raises before any term is computed
    check_positive("k", k, finite=True)
    check_eps("eps", eps)
    for name, weight in (("bce_weight", bce_weight), ("l1_weight", l1_weight),
                         ("dice_weight", dice_weight)):  # fmt: skip
        check_positive(name, weight, allow_zero=True, finite=True)
    bce = balanced_binary_cross_entropy(
        shrink_logits, gt, mask, negative_ratio=negative_ratio, eps=eps
    )
    l1 = masked_l1_loss(thresh, thresh_map, thresh_mask)
    prob = torch.sigmoid(shrink_logits.to(compute_dtype(shrink_logits)))
    binary = db_step(prob, thresh, k=k)
    dice = dice_loss(binary, gt, mask, eps=eps)
    total = bce_weight * bce + l1_weight * l1 + dice_weight * dice
    if return_terms:
        return total, {"bce": bce, "l1": l1, "dice": dice}
    return total
