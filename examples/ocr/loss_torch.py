"""The OCR task's losses in torch: the stable `db_loss` and the naive recipe.

Twin of `loss_jax` (see there): :func:`stable_loss` is
`torchref.losses.db_loss` in float32; :func:`naive_loss` is DBNet's
reference loss in the compute dtype with the step written as
``torch.reciprocal(1 + torch.exp(-k (P - T)))`` and no guard. Both take
the model's output dict and a batch dict of (B, H, W) tensors ``gt, mask,
thresh_map, thresh_mask`` and return ``(loss, terms)``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from torchref import losses

__all__ = ["naive_loss", "naive_step", "stable_loss"]


def stable_loss(
    outputs: Mapping[str, torch.Tensor],
    batch: Mapping[str, torch.Tensor],
    *,
    k: float = 50.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`torchref.losses.db_loss` (float32) of a DBNet output on a batch.

    Example:
        >>> gt = torch.zeros(1, 8, 8); gt[:, 2:6, 2:6] = 1.0
        >>> ones = torch.ones(1, 8, 8)
        >>> out = {"logits": 6.0 * (2 * gt - 1), "thresh": 0.3 * ones}
        >>> batch = dict(gt=gt, mask=ones, thresh_map=0.3 * ones, thresh_mask=ones)
        >>> loss, terms = stable_loss(out, batch)
        >>> print(round(float(loss), 4), loss.dtype, sorted(terms))
        0.0124 torch.float32 ['bce', 'dice', 'l1']
    """
    return losses.db_loss(
        outputs["logits"],
        outputs["thresh"],
        batch["gt"],
        batch["mask"],
        batch["thresh_map"],
        batch["thresh_mask"],
        k=k,
        return_terms=True,
    )


def naive_step(
    prob: torch.Tensor, thresh: torch.Tensor, k: float = 50.0
) -> torch.Tensor:
    """DBNet's reference step ``reciprocal(1 + exp(-k (P - T)))``, input dtype.

    In float16 ``exp`` is inf once ``P - T < -0.2218`` (k=50) and the
    backward gives NaN (see `loss_jax.naive_step`).

    Example:
        >>> p = torch.tensor([0.1, 0.5], dtype=torch.float16, requires_grad=True)
        >>> t = torch.tensor([0.5, 0.3], dtype=torch.float16)
        >>> y = naive_step(p, t)
        >>> y.sum().backward()
        >>> [round(float(v), 4) for v in y.detach()], bool(p.grad[0].isnan())
        ([0.0, 1.0], True)
    """
    return torch.reciprocal(1 + torch.exp(-k * (prob - thresh)))


def _ohem_bce(prob, gt, mask, ratio=3.0, eps=1e-6):
    """DBNet's BalanceCrossEntropyLoss on probabilities, in their dtype."""
    positive = gt * mask
    negative = (1 - gt) * mask
    n_pos = int(positive.sum())
    n_neg = min(int(negative.sum()), int(n_pos * ratio))
    # F.binary_cross_entropy's formula (each log clamped at -100), written out:
    # F.binary_cross_entropy raises on a NaN input on CPU instead of returning NaN
    log_p = torch.clamp(torch.log(prob), min=-100)
    log_1p = torch.clamp(torch.log(1 - prob), min=-100)
    loss = -(gt * log_p + (1 - gt) * log_1p)
    neg_loss, _ = torch.topk((loss * negative).view(-1), n_neg)
    return ((loss * positive).sum() + neg_loss.sum()) / (n_pos + n_neg + eps)


def naive_loss(
    outputs: Mapping[str, torch.Tensor],
    batch: Mapping[str, torch.Tensor],
    *,
    k: float = 50.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DBNet loss as the report's team computed it: compute dtype, no guard.

    Example:
        >>> gt = torch.zeros(1, 8, 8); gt[:, 2:6, 2:6] = 1.0
        >>> ones = torch.ones(1, 8, 8)
        >>> out = {"logits": (6.0 * (2 * gt - 1)).half(), "thresh": (0.3 * ones).half()}
        >>> batch = dict(gt=gt, mask=ones, thresh_map=0.3 * ones, thresh_mask=ones)
        >>> loss, terms = naive_loss(out, batch)
        >>> print(round(float(loss), 2), loss.dtype)
        0.01 torch.float16
    """
    dtype = outputs["logits"].dtype
    gt, mask, tmap, tmask = (
        batch[key].to(dtype) for key in ("gt", "mask", "thresh_map", "thresh_mask")
    )
    prob = torch.sigmoid(outputs["logits"])
    thresh = outputs["thresh"].to(dtype)
    bce = _ohem_bce(prob, gt, mask)
    mask_sum = tmask.sum()
    # DBNet's MaskL1Loss returns the zero mask sum instead of dividing by it
    l1 = (
        (torch.abs(thresh - tmap) * tmask).sum() / mask_sum
        if mask_sum > 0
        else mask_sum
    )
    binary = naive_step(prob, thresh, k)
    inter = (binary * gt * mask).sum()
    union = (binary * mask).sum() + (gt * mask).sum() + 1e-6
    dice = 1 - 2 * inter / union
    total = 5 * bce + 10 * l1 + dice
    terms = {"bce": bce, "l1": l1, "dice": dice}
    return total, {name: v.detach().float() for name, v in terms.items()}
