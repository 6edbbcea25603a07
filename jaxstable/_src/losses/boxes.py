"""Box regression, in at least float32: the IoU family (IoU, GIoU, DIoU,
CIoU) with torchvision's values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from _stablecore.losses import check_kind as _check_kind
from _stablecore.losses import check_reduction as _check_reduction
from jaxstable._src.losses._checks import (
    Array,
    as_arrays,
    check_eps,
    check_float,
    check_same_shape,
    compute_dtype,
    is_concrete,
    nan_if,
    reduce,
)


def _check_boxes(name: str, boxes) -> None:
    """Floating (..., 4) boxes."""
    check_float(name, boxes)
    if boxes.ndim == 0 or boxes.shape[-1] != 4:
        raise ValueError(
            f"{name} must have shape (..., 4) as (x1, y1, x2, y2), got shape "
            f"{boxes.shape}"
        )


def _raise_inverted(name: str, flat: np.ndarray, boxes) -> None:
    """ValueError naming the boxes with x2 < x1 or y2 < y1 (a NaN is not
    inverted: it gives a NaN loss instead)."""
    inverted = (flat[:, 2] < flat[:, 0]) | (flat[:, 3] < flat[:, 1])
    if inverted.any():
        first = int(np.argmax(inverted))
        index = np.unravel_index(first, boxes.shape[:-1]) if boxes.ndim > 1 else ()
        raise ValueError(
            f"{name} must have x1 <= x2 and y1 <= y2 (x1, y1, x2, y2 format); "
            f"{int(inverted.sum())} box(es) do not, the first at index "
            f"{tuple(int(i) for i in index)}: {flat[first].tolist()}"
        )


def _aspect_angle(w, h):
    """atan(w / h) in [0, pi/2] for w, h >= 0, with a finite gradient.

    torchvision's ``atan(w / h)`` divides by h = 0 (a box of zero height:
    the value pi/2 is right, the gradient 0 * inf = NaN) and is 0 / 0 = NaN
    for a point box. Here the smaller side is divided by the larger, so the
    ratio is in [0, 1]: the same angle (pi/2 - atan(h / w) when w > h), a
    gradient of about 1 / max(w, h), and a point box gets the angle 0 (as a
    zero-width box; ultralytics' ``atan(w / (h + eps))`` gives 0 too) with a
    zero gradient.
    """
    tall = h >= w
    big = jnp.where(tall, h, w)
    small = jnp.where(tall, w, h)
    point = big == 0
    angle = jnp.arctan(small / jnp.where(point, 1.0, big))
    return jnp.where(point, 0.0, jnp.where(tall, angle, jnp.pi / 2 - angle))


def _box_terms(b1, b2, kind: str, eps: float):
    """Per-box loss from coordinate tuples (compute dtype), torchvision's
    formulas."""
    x1, y1, x2, y2 = b1
    x1g, y1g, x2g, y2g = b2
    iw = jnp.minimum(x2, x2g) - jnp.maximum(x1, x1g)
    ih = jnp.minimum(y2, y2g) - jnp.maximum(y1, y1g)
    # torchvision's mask: no overlap (or a touching edge) is exactly 0 with a
    # zero gradient, not a product of negative sides
    inter = jnp.where((iw > 0) & (ih > 0), iw * ih, 0.0)
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
    iou = inter / (union + eps)
    if kind == "iou":
        return 1.0 - iou
    cw = jnp.maximum(x2, x2g) - jnp.minimum(x1, x1g)  # enclosing box
    ch = jnp.maximum(y2, y2g) - jnp.minimum(y1, y1g)
    if kind == "giou":
        area_c = cw * ch
        # An enclosing box of zero area (both boxes on one line, or points)
        # has union = area_c = 0 and the term's value 0 / eps = 0; its
        # gradient would be (d area_c - d union) / eps, 1e7 times a side
        # (inf in fp16), from the ties of max/min splitting d area_c in
        # halves. Moving any coordinate the way that keeps the boxes valid
        # keeps the term 0, so it is 0 there with a zero gradient.
        flat = area_c > 0
        c = jnp.where(flat, area_c, 1.0)
        return 1.0 - iou + jnp.where(flat, (c - union) / (c + eps), 0.0)
    # DIoU: squared centre distance over the enclosing box's squared diagonal
    # (both halved centres: (x1 + x2) / 2, as torchvision)
    dx = (x2 + x1) / 2 - (x1g + x2g) / 2
    dy = (y2 + y1) / 2 - (y1g + y2g) / 2
    loss = 1.0 - iou + (dx * dx + dy * dy) / (cw * cw + ch * ch + eps)
    if kind == "diou":
        return loss
    delta = _aspect_angle(x2g - x1g, y2g - y1g) - _aspect_angle(x2 - x1, y2 - y1)
    v = (4 / jnp.pi**2) * delta * delta
    # torchvision computes alpha under no_grad: no gradient through it
    alpha = jax.lax.stop_gradient(v / (1.0 - iou + v + eps))
    return loss + alpha * v


def box_iou_loss(
    boxes1: Array,
    boxes2: Array,
    *,
    kind: str = "giou",
    reduction: str = "none",
    eps: float = 1e-7,
) -> jax.Array:
    r"""IoU-family box regression loss in at least float32: torchvision's values.

    Boxes are ``(..., 4)`` as ``(x1, y1, x2, y2)``; the loss of a pair, with
    ``iou = inter / (union + eps)`` and ``C`` the smallest enclosing box::

        iou:  1 - iou
        giou: 1 - iou + (area(C) - union) / (area(C) + eps)
        diou: 1 - iou + |centre1 - centre2|^2 / (diag(C)^2 + eps)
        ciou: diou + alpha v,  v = 4 / pi^2 (atan(w2 / h2) - atan(w1 / h1))^2,
              alpha = v / (1 - iou + v + eps), with no gradient (as torchvision)

    the values of ``torchvision.ops.generalized_box_iou_loss``,
    ``distance_box_iou_loss`` and ``complete_box_iou_loss`` (the loss is
    symmetric in the two boxes). The coordinates are upcast to float32 inside
    the computation, so fp16 boxes of a 640-pixel image do not overflow
    (their areas reach 4e5, fp16's maximum is 65504); the gradient comes back
    in the boxes' dtype.

    Deviations from torchvision (documented, tested): where its CIoU gradient
    is NaN, ours is finite: a box of zero height (``atan(w / 0)``: the value
    pi/2 is kept, its gradient is 0 * inf in torchvision). A point box (zero
    width and height) has a NaN CIoU in torchvision; here its aspect angle is
    0 (as a zero-width box), so the loss and gradient are finite. Coincident
    centres and zero-area unions are finite in both (the ``eps`` terms),
    except through CIoU's angle of a zero-height box (above). Where the
    enclosing box has zero area (both boxes on one vertical or horizontal
    line, or points: ``[3, 3, 3, 9]`` over itself) GIoU's term
    ``(area(C) - union) / (area(C) + eps)`` is 0, as in torchvision, but
    its gradient there is 0 too: torchvision's is of the order of a side /
    eps (3e7 for that box, inf in fp16), from the ties of ``max``/``min``
    splitting ``d area(C)`` in halves while ``d union`` is whole.

    Bad boxes: ``x2 < x1`` or ``y2 < y1`` raises ``ValueError`` naming the
    first such box when both box arrays are concrete (an eager call on
    values). When either is traced (under ``jit``, or differentiated by an
    eager ``jax.grad``: a training step) that pair's loss and gradient are
    NaN instead, as is any pair with a NaN or infinite coordinate, so a
    finiteness guard skips the step. torchref mirrors this with autograd:
    it raises when neither box tensor requires grad and gives NaN when one
    does. A mean over zero boxes is 0.0 (as torchvision).

    Ties have torchvision's gradients: equal boxes and shared edges are the
    ties of its ``max``/``min`` (each side gets half, in JAX and torch
    alike), a touching edge (zero overlap) has a zero intersection gradient.

    Precision: float32; float64 when ``boxes1`` or ``boxes2`` is float64 (x64
    on).

    Args:
      boxes1: predicted boxes, floating array ``(..., 4)`` (any float dtype).
      boxes2: target boxes, same shape.
      kind: "iou", "giou", "diou" or "ciou".
      reduction: "none" (a loss per box, shape ``boxes1.shape[:-1]``),
        "mean" or "sum".
      eps: added to the union, the enclosing area and diagonal: finite and
        >= 1.2e-38 (float32's smallest normal number).

    Returns:
      float32 array of shape ``boxes1.shape[:-1]``, or a float32 scalar
      (float64 for float64 boxes).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxstable import losses
      >>> pred = jnp.array([[0.0, 0.0, 2.0, 2.0], [0.0, 0.0, 4.0, 0.0]], jnp.float16)
      >>> gt = jnp.array([[1.0, 1.0, 3.0, 3.0], [1.0, 0.0, 3.0, 2.0]], jnp.float16)
      >>> loss = losses.box_iou_loss(pred, gt, kind="ciou")
      >>> print(loss.dtype, [round(float(v), 4) for v in loss])
      float32 [0.9683, 1.1]
      >>> grad = jax.grad(lambda p: losses.box_iou_loss(p, gt, kind="ciou").sum())
      >>> bool(jnp.isfinite(grad(pred)).all())  # zero height: torchvision NaN
      True
      >>> line = jnp.array([[3.0, 3.0, 3.0, 9.0]], jnp.float16)  # zero width
      >>> g = jax.grad(lambda p: losses.box_iou_loss(p, line).sum())(line)
      >>> g.tolist()  # torchvision: [[inf, 0, -inf, 0]] in fp16
      [[0.0, 0.0, 0.0, 0.0]]
    """
    _check_kind(kind)
    _check_reduction(reduction)
    check_eps("eps", eps)
    boxes1, boxes2 = as_arrays(boxes1=boxes1, boxes2=boxes2)
    _check_boxes("boxes1", boxes1)
    _check_boxes("boxes2", boxes2)
    check_same_shape("boxes1", boxes1, "boxes2", boxes2)
    if is_concrete(boxes1) and is_concrete(boxes2):  # an eager call: raise
        for name, boxes in (("boxes1", boxes1), ("boxes2", boxes2)):
            _raise_inverted(name, np.asarray(boxes, np.float64).reshape(-1, 4), boxes)
    ct = compute_dtype(boxes1, boxes2)
    b1 = tuple(boxes1[..., i].astype(ct) for i in range(4))
    b2 = tuple(boxes2[..., i].astype(ct) for i in range(4))
    loss = _box_terms(b1, b2, kind, float(eps))
    # A traced bad box could not raise: its pair's loss and gradient are NaN.
    bad = jnp.zeros(loss.shape, bool)
    for x1, y1, x2, y2 in (b1, b2):
        finite = jnp.isfinite(x1) & jnp.isfinite(y1) & jnp.isfinite(x2)
        bad = bad | ~(finite & jnp.isfinite(y2)) | (x2 < x1) | (y2 < y1)
    return reduce(loss * nan_if(bad, ct), reduction)
