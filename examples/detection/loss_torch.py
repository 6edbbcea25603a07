"""The detector's losses in torch: twin of `loss_jax` (same formulas, same order).

Outputs are NCHW (``cls`` (N, C, G, G), ``box`` (N, 4, G, G)); they are
moved to NHWC here so that cells are flattened row-major as on the JAX side.
See `loss_jax` for the naive and the stable loss.
"""

from __future__ import annotations

import math

import torch

from examples.detection import model_torch
from examples.detection.loss_jax import ALPHA, BOX_KIND, BOX_WEIGHT, GAMMA

__all__ = ["gather_boxes", "naive_ciou", "naive_focal", "naive_loss", "stable_loss"]


def gather_boxes(out: dict, batch: dict, dtype=None) -> torch.Tensor:
    """Decoded predicted boxes at each object's centre cell, (N, K, 4).

    Example:
        >>> out = {"box": torch.zeros(1, 4, 2, 2)}
        >>> gather_boxes(out, {"cells": torch.tensor([[3]])}).tolist()
        [[[2.0, 2.0, 10.0, 10.0]]]
    """
    raw = out["box"]
    n, g = raw.shape[0], raw.shape[2]
    raw = raw.permute(0, 2, 3, 1).reshape(n, g * g, 4)
    if dtype is not None:
        raw = raw.to(dtype)
    cells = batch["cells"].long()
    picked = torch.gather(raw, 1, cells[..., None].expand(-1, -1, 4))
    centers = model_torch.cell_centers(g)[cells]
    return model_torch.decode(picked, centers)


def naive_focal(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-element focal loss from the paper's formula, in the input's dtype.

    Example:
        >>> round(float(naive_focal(torch.tensor([0.0]), torch.tensor([1.0]))[0]), 4)
        0.0433
    """
    p = torch.sigmoid(logits)
    ce = -(targets * torch.log(p) + (1 - targets) * torch.log(1 - p))
    p_t = p * targets + (1 - p) * (1 - targets)
    a_t = ALPHA * targets + (1 - ALPHA) * (1 - targets)
    return a_t * (1 - p_t) ** GAMMA * ce


def naive_ciou(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-box CIoU loss as the paper writes it, no eps, in the input's dtype.

    Example:
        >>> b = torch.tensor([[0.0, 0.0, 2.0, 2.0]])
        >>> round(float(naive_ciou(b, torch.tensor([[1.0, 0.0, 3.0, 2.0]]))[0]), 4)
        0.7436
    """
    x1, y1, x2, y2 = pred.unbind(-1)
    gx1, gy1, gx2, gy2 = target.to(pred.dtype).unbind(-1)
    w, h, gw, gh = x2 - x1, y2 - y1, gx2 - gx1, gy2 - gy1
    iw = torch.clamp(torch.minimum(x2, gx2) - torch.maximum(x1, gx1), min=0)
    ih = torch.clamp(torch.minimum(y2, gy2) - torch.maximum(y1, gy1), min=0)
    inter = iw * ih
    iou = inter / (w * h + gw * gh - inter)
    cw = torch.maximum(x2, gx2) - torch.minimum(x1, gx1)
    ch = torch.maximum(y2, gy2) - torch.minimum(y1, gy1)
    rho2 = ((x1 + x2 - gx1 - gx2) ** 2 + (y1 + y2 - gy1 - gy2) ** 2) / 4
    v = (4 / math.pi**2) * (torch.atan(gw / gh) - torch.atan(w / h)) ** 2
    with torch.no_grad():
        alpha = v / (1 - iou + v)
    return 1 - iou + rho2 / (cw**2 + ch**2) + alpha * v


def _total(focal_sum, box, mask):
    count = torch.clamp(mask.to(box.dtype).sum(), min=1)
    box_sum = torch.where(mask, box, torch.zeros_like(box)).sum()
    return (focal_sum + BOX_WEIGHT * box_sum) / count


def _nhwc(x: torch.Tensor) -> torch.Tensor:
    return x.permute(0, 2, 3, 1)


def naive_loss(out: dict, batch: dict) -> tuple[torch.Tensor, dict]:
    """The first implementation's loss, in the dtype of ``out`` (see `loss_jax`).

    Returns:
      ``(loss, {"focal": per-element (N, G, G, C), "box": per-object (N, K)})``.
    """
    logits = _nhwc(out["cls"])
    focal = naive_focal(logits, batch["heatmap"].to(logits.dtype))
    box = naive_ciou(gather_boxes(out, batch), batch["boxes"])
    return _total(focal.sum(), box, batch["box_mask"]), {"focal": focal, "box": box}


def stable_loss(out: dict, batch: dict) -> tuple[torch.Tensor, dict]:
    """The library's float32 focal and CIoU losses (see `loss_jax`).

    The box term is `BOX_KIND`'s ("ciou" unless an experiment changed it).

    Returns:
      ``(loss, {"focal": per-element, "box": per-object})``, float32.
    """
    from torchref import losses

    focal = losses.sigmoid_focal_loss(
        _nhwc(out["cls"]), batch["heatmap"], alpha=ALPHA, gamma=GAMMA
    )
    pred = gather_boxes(out, batch, torch.float32)
    if BOX_KIND == "smooth_l1":
        target = batch["boxes"].to(torch.float32)
        box = torch.nn.functional.smooth_l1_loss(
            pred, target, reduction="none", beta=1.0
        ).sum(-1)
    else:
        box = losses.box_iou_loss(pred, batch["boxes"], kind=BOX_KIND)
    return _total(focal.sum(), box, batch["box_mask"]), {"focal": focal, "box": box}
