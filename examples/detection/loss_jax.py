"""The detector's losses in JAX: the naive first implementation and the stable one.

Both read the model's outputs ``{"cls": (N, G, G, C) logits, "box": (N, G,
G, 4) raw distances}`` and the batch's targets (`data`: ``heatmap``,
``boxes``, ``box_mask``, ``cells``) and return ``(loss, parts)``, the loss
being ``(focal sum + BOX_WEIGHT * box-loss sum over the objects) /
max(objects, 1)`` (FCOS / RetinaNet normalise by the positives).

* :func:`naive_loss`: what a first implementation writes from the papers,
  in the compute dtype: the focal loss as ``-a_t (1 - p_t)**g log(p_t)``
  with ``p = sigmoid(x)`` (Lin et al. 2017, eq. 5), the CIoU loss as
  Zheng et al. 2020 write it, with no eps anywhere (``w / h``, ``inter /
  union``, ``rho**2 / c**2``, ``v / (1 - IoU + v)``).
* :func:`stable_loss`: the library's float32 losses,
  `jaxstable.losses.sigmoid_focal_loss` and `jaxstable.losses.box_iou_loss`
  (``kind="ciou"``), which accept float16 input and are finite on
  degenerate boxes.

`loss_torch` is the twin (same formulas, same order of operations).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from examples.detection import model_jax

ALPHA = 0.25  # RetinaNet's focal-loss alpha and gamma
GAMMA = 2.0
BOX_WEIGHT = 2.0  # the box term's weight (a GIoU/CIoU loss is in [0, ~2])
# the stable loss's box term: "ciou" (the task), or for experiments
# (divergence.py) another `box_iou_loss` kind or "smooth_l1" (Fast R-CNN's
# smooth L1 on the corners in pixels, beta 1, summed over the 4 coordinates)
BOX_KIND = "ciou"
BOX_KINDS = ("iou", "giou", "diou", "ciou", "smooth_l1")


def gather_boxes(out: dict, batch: dict, dtype=None) -> jax.Array:
    """Decoded predicted boxes at each object's centre cell, (N, K, 4).

    Example:
        >>> out = {"box": jnp.zeros((1, 2, 2, 4))}
        >>> gather_boxes(out, {"cells": jnp.array([[3]])}).tolist()
        [[[2.0, 2.0, 10.0, 10.0]]]
    """
    raw = out["box"]
    n, g = raw.shape[0], raw.shape[1]
    raw = raw.reshape(n, g * g, 4)
    if dtype is not None:
        raw = raw.astype(dtype)
    picked = jnp.take_along_axis(raw, batch["cells"][..., None], axis=1)
    centers = model_jax.cell_centers(g)[batch["cells"]]
    return model_jax.decode(picked, centers)


def naive_focal(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-element focal loss from the paper's formula, in the input's dtype.

    Example:
        >>> round(float(naive_focal(jnp.array([0.0]), jnp.array([1.0]))[0]), 4)
        0.0433
    """
    p = jax.nn.sigmoid(logits)
    ce = -(targets * jnp.log(p) + (1 - targets) * jnp.log(1 - p))
    p_t = p * targets + (1 - p) * (1 - targets)
    a_t = ALPHA * targets + (1 - ALPHA) * (1 - targets)
    return a_t * (1 - p_t) ** GAMMA * ce


def naive_ciou(pred: jax.Array, target: jax.Array) -> jax.Array:
    """Per-box CIoU loss as the paper writes it, no eps, in the input's dtype.

    Example:
        >>> b = jnp.array([[0.0, 0.0, 2.0, 2.0]])
        >>> loss = naive_ciou(b, jnp.array([[1.0, 0.0, 3.0, 2.0]]))
        >>> round(float(loss[0]), 4)
        0.7436
    """
    x1, y1, x2, y2 = jnp.moveaxis(pred, -1, 0)
    gx1, gy1, gx2, gy2 = jnp.moveaxis(target.astype(pred.dtype), -1, 0)
    w, h, gw, gh = x2 - x1, y2 - y1, gx2 - gx1, gy2 - gy1
    iw = jnp.maximum(jnp.minimum(x2, gx2) - jnp.maximum(x1, gx1), 0)
    ih = jnp.maximum(jnp.minimum(y2, gy2) - jnp.maximum(y1, gy1), 0)
    inter = iw * ih
    iou = inter / (w * h + gw * gh - inter)
    cw = jnp.maximum(x2, gx2) - jnp.minimum(x1, gx1)
    ch = jnp.maximum(y2, gy2) - jnp.minimum(y1, gy1)
    rho2 = ((x1 + x2 - gx1 - gx2) ** 2 + (y1 + y2 - gy1 - gy2) ** 2) / 4
    v = (4 / math.pi**2) * (jnp.arctan(gw / gh) - jnp.arctan(w / h)) ** 2
    alpha = jax.lax.stop_gradient(v / (1 - iou + v))
    return 1 - iou + rho2 / (cw**2 + ch**2) + alpha * v


def _total(focal_sum, box, mask):
    count = jnp.maximum(jnp.sum(mask.astype(box.dtype)), 1)
    box_sum = jnp.sum(jnp.where(mask, box, 0))
    return (focal_sum + BOX_WEIGHT * box_sum) / count


def naive_loss(out: dict, batch: dict) -> tuple[jax.Array, dict]:
    """The first implementation's loss, in the dtype of ``out`` (see the module).

    Returns:
      ``(loss, {"focal": per-element (N, G, G, C), "box": per-object (N, K)})``.
    """
    dtype = out["cls"].dtype
    focal = naive_focal(out["cls"], batch["heatmap"].astype(dtype))
    box = naive_ciou(gather_boxes(out, batch), batch["boxes"])
    return _total(jnp.sum(focal), box, batch["box_mask"]), {"focal": focal, "box": box}


def stable_loss(out: dict, batch: dict) -> tuple[jax.Array, dict]:
    """The library's float32 focal and CIoU losses (see the module).

    The box term is `BOX_KIND`'s ("ciou" unless an experiment changed it).

    Returns:
      ``(loss, {"focal": per-element, "box": per-object})``, float32.
    """
    from jaxstable import losses

    focal = losses.sigmoid_focal_loss(
        out["cls"], batch["heatmap"], alpha=ALPHA, gamma=GAMMA
    )
    pred = gather_boxes(out, batch, jnp.float32)
    if BOX_KIND == "smooth_l1":
        import optax

        target = batch["boxes"].astype(jnp.float32)
        box = jnp.sum(optax.huber_loss(pred, target, delta=1.0), axis=-1)
    else:
        box = losses.box_iou_loss(pred, batch["boxes"], kind=BOX_KIND)
    return _total(jnp.sum(focal), box, batch["box_mask"]), {"focal": focal, "box": box}
