"""Box regression, in at least float32: the IoU family (IoU, GIoU, DIoU,
CIoU) with torchvision's values.
"""

from __future__ import annotations

import math

import torch

from _stablecore.losses import check_kind as _check_kind
from _stablecore.losses import check_reduction as _check_reduction
from torchref._src.losses._checks import (
    as_tensors,
    check_eps,
    check_float,
    check_same_shape,
    compute_dtype,
    nan_if,
    reduce,
)


def _check_boxes(name: str, boxes: torch.Tensor) -> None:
    """Floating (..., 4) boxes."""
    check_float(name, boxes)
    if boxes.ndim == 0 or boxes.shape[-1] != 4:
        raise ValueError(
            f"{name} must have shape (..., 4) as (x1, y1, x2, y2), got shape "
            f"{tuple(boxes.shape)}"
        )


def _raise_inverted(name: str, boxes: torch.Tensor) -> None:
    """ValueError naming the boxes with x2 < x1 or y2 < y1 (reads them on the
    host: one sync)."""
    flat = boxes.detach().reshape(-1, 4).double()
    inverted = (flat[:, 2] < flat[:, 0]) | (flat[:, 3] < flat[:, 1])
    if bool(inverted.any()):  # a NaN is not inverted: it gives a NaN loss
        first = int(inverted.int().argmax())
        index = tuple(
            int(i) for i in torch.unravel_index(torch.tensor(first), boxes.shape[:-1])
        )
        raise ValueError(
            f"{name} must have x1 <= x2 and y1 <= y2 (x1, y1, x2, y2 format); "
            f"{int(inverted.sum())} box(es) do not, the first at index "
            f"{index}: {flat[first].tolist()}"
        )


def _aspect_angle(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """atan(w / h) in [0, pi/2] for w, h >= 0 with a finite gradient: the
    smaller side over the larger, a point box gets 0 (jaxstable's twin)."""
    tall = h >= w
    big = torch.where(tall, h, w)
    small = torch.where(tall, w, h)
    point = big == 0
    angle = torch.atan(small / torch.where(point, torch.ones_like(big), big))
    zero = torch.zeros_like(angle)
    return torch.where(point, zero, torch.where(tall, angle, math.pi / 2 - angle))


def _box_terms(b1, b2, kind: str, eps: float) -> torch.Tensor:
    """Per-box loss from coordinate tuples (compute dtype), torchvision's
    formulas."""
    x1, y1, x2, y2 = b1
    x1g, y1g, x2g, y2g = b2
    iw = torch.minimum(x2, x2g) - torch.maximum(x1, x1g)
    ih = torch.minimum(y2, y2g) - torch.maximum(y1, y1g)
    inter = torch.where((iw > 0) & (ih > 0), iw * ih, torch.zeros_like(iw))
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
    iou = inter / (union + eps)
    if kind == "iou":
        return 1.0 - iou
    cw = torch.maximum(x2, x2g) - torch.minimum(x1, x1g)  # enclosing box
    ch = torch.maximum(y2, y2g) - torch.minimum(y1, y1g)
    if kind == "giou":
        area_c = cw * ch
        # An enclosing box of zero area (both boxes on one line, or points)
        # has union = area_c = 0 and the term's value 0 / eps = 0; its
        # gradient would be (d area_c - d union) / eps, 1e7 times a side
        # (inf in fp16), from the ties of max/min splitting d area_c in
        # halves. Moving any coordinate the way that keeps the boxes valid
        # keeps the term 0, so it is 0 there with a zero gradient.
        flat = area_c > 0
        c = torch.where(flat, area_c, torch.ones_like(area_c))
        term = torch.where(flat, (c - union) / (c + eps), torch.zeros_like(c))
        return 1.0 - iou + term
    dx = (x2 + x1) / 2 - (x1g + x2g) / 2
    dy = (y2 + y1) / 2 - (y1g + y2g) / 2
    loss = 1.0 - iou + (dx * dx + dy * dy) / (cw * cw + ch * ch + eps)
    if kind == "diou":
        return loss
    delta = _aspect_angle(x2g - x1g, y2g - y1g) - _aspect_angle(x2 - x1, y2 - y1)
    v = (4 / math.pi**2) * delta * delta
    alpha = (v / (1.0 - iou + v + eps)).detach()  # torchvision: under no_grad
    return loss + alpha * v


def box_iou_loss(
    boxes1: torch.Tensor,
    boxes2: torch.Tensor,
    *,
    kind: str = "giou",
    reduction: str = "none",
    eps: float = 1e-7,
) -> torch.Tensor:
    r"""IoU-family box loss in at least float32: torchvision's values, finite gradients.

    ``(..., 4)`` boxes as ``(x1, y1, x2, y2)``; ``kind`` "iou" (``1 - iou``),
    "giou", "diou" or "ciou" give the values of
    ``torchvision.ops.generalized_box_iou_loss``, ``distance_box_iou_loss``
    and ``complete_box_iou_loss`` (formulas: ``jaxstable.losses.box_iou_loss``),
    computed on float32 upcasts (fp16 areas of a 640-pixel image reach 4e5,
    above fp16's 65504); gradients flow back in the boxes' dtype.

    Deviations from torchvision (documented, tested, as jaxstable): CIoU's
    ``atan(w / h)`` is taken as the smaller side over the larger, so a box of
    zero height keeps the value pi/2 with a finite gradient (torchvision:
    NaN), and a point box gets the angle 0 and a finite loss (torchvision:
    NaN). Where the enclosing box has zero area (both boxes on one line, or
    points: ``[3, 3, 3, 9]`` over itself) GIoU's enclosing term is 0 with a
    zero gradient (torchvision: a side / eps, 3e7 there, inf in fp16). A NaN
    or infinite coordinate makes that pair's loss and gradient NaN. A mean
    over zero boxes is 0.0 (as torchvision).

    Bad boxes (``x2 < x1`` or ``y2 < y1``), as jaxstable's concrete-vs-traced
    rule: when neither box tensor requires grad (an eager call on values, as
    a concrete JAX call) it raises ``ValueError`` naming the first such box
    (reads the boxes on the host: one sync); when either requires grad (a
    training step, as JAX's traced boxes under ``jit`` or ``jax.grad``) that
    pair's loss and gradient are NaN instead, with no host sync, so the
    step's finiteness guard skips the step instead of the run crashing.

    Ties have torchvision's gradients (its ``max``/``min``: half each at
    equal coordinates; a touching edge has a zero intersection gradient).

    Precision: float32; float64 when ``boxes1`` or ``boxes2`` is float64.

    Args:
      boxes1: predicted boxes, floating tensor ``(..., 4)``.
      boxes2: target boxes, same shape.
      kind: "iou", "giou", "diou" or "ciou".
      reduction: "none" (shape ``boxes1.shape[:-1]``), "mean" or "sum".
      eps: finite and >= 1.2e-38 (float32's smallest normal number).

    Returns:
      float32 tensor of shape ``boxes1.shape[:-1]``, or a float32 scalar
      (float64 for float64 boxes).

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> pred = torch.tensor([[0.0, 0.0, 2.0, 2.0], [0.0, 0.0, 4.0, 0.0]]).half()
      >>> gt = torch.tensor([[1.0, 1.0, 3.0, 3.0], [1.0, 0.0, 3.0, 2.0]]).half()
      >>> loss = losses.box_iou_loss(pred.requires_grad_(), gt, kind="ciou")
      >>> print(loss.dtype, [round(v, 4) for v in loss.tolist()])
      torch.float32 [0.9683, 1.1]
      >>> loss.sum().backward()
      >>> bool(pred.grad.isfinite().all())  # zero height: torchvision NaN
      True
    """
    _check_kind(kind)
    _check_reduction(reduction)
    check_eps("eps", eps)
    boxes1, boxes2 = as_tensors(boxes1=boxes1, boxes2=boxes2)
    _check_boxes("boxes1", boxes1)
    _check_boxes("boxes2", boxes2)
    check_same_shape("boxes1", boxes1, "boxes2", boxes2)
    if not (boxes1.requires_grad or boxes2.requires_grad):  # values: raise
        _raise_inverted("boxes1", boxes1)
        _raise_inverted("boxes2", boxes2)
    ct = compute_dtype(boxes1, boxes2)
    b1 = tuple(c.to(ct) for c in boxes1.unbind(-1))
    b2 = tuple(c.to(ct) for c in boxes2.unbind(-1))
    loss = _box_terms(b1, b2, kind, float(eps))
    # In a training step a bad box could not raise: its pair is NaN instead.
    bad = torch.zeros_like(loss, dtype=torch.bool)
    for x1, y1, x2, y2 in (b1, b2):
        finite = x1.isfinite() & y1.isfinite() & x2.isfinite() & y2.isfinite()
        bad = bad | ~finite | (x2 < x1) | (y2 < y1)
    return reduce(loss * nan_if(bad, ct), reduction)
