"""Detections from the detector's maps and the VOC mAP@0.5 (all-point interpolation).

Post-processing (both frameworks hand numpy maps to :func:`evaluate`):
every cell and class whose probability ``sigmoid(logit)`` exceeds
``score_thresh`` proposes the box it decodes (`model_torch.decode`: FCOS's
``exp(raw) * stride`` distances from the cell centre); per image and class,
greedy non-maximum suppression at IoU ``nms_iou`` keeps the best-scored
boxes, then the ``max_det`` best of the image are kept.

Metric (PASCAL VOC 2010+ "all-point" AP, Everingham et al. 2010, and the
VOC devkit's matching): per class, the detections of all images are sorted
by score (descending; ties keep their order); each one is matched to the
ground-truth box of its image and class with the largest IoU; it is a true
positive when that IoU is >= 0.5 and that box is not yet matched, else a
false positive. With precision p(k) and recall r(k) after the k-th
detection, AP is the area under the precision envelope
``max_{k' >= k} p(k')`` as a step function of recall. mAP@0.5 is the mean AP
over the classes with at least one ground-truth box. IoU uses continuous
pixel-edge coordinates (no VOC ``+1``: the boxes here are not integer pixel
indices); a zero-area box has IoU 0 with everything.
"""

from __future__ import annotations

import math

import numpy as np

from examples.detection import data


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of boxes (M, 4) and (K, 4) -> (M, K), 0 where the union is 0.

    Example:
        >>> box_iou(np.array([[0.0, 0, 2, 2]]), np.array([[1.0, 0, 3, 2]])).tolist()
        [[0.3333333333333333]]
    """
    a = np.asarray(a, np.float64).reshape(-1, 4)
    b = np.asarray(b, np.float64).reshape(-1, 4)
    lo = np.maximum(a[:, None, :2], b[None, :, :2])
    hi = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=-1)
    area_a = np.prod(np.clip(a[:, 2:] - a[:, :2], 0, None), axis=-1)
    area_b = np.prod(np.clip(b[:, 2:] - b[:, :2], 0, None), axis=-1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def nms(boxes: np.ndarray, scores: np.ndarray, iou: float) -> np.ndarray:
    """Indices kept by greedy non-maximum suppression, best score first.

    Example:
        >>> b = np.array([[0.0, 0, 4, 4], [0.5, 0, 4.5, 4], [10, 10, 12, 12]])
        >>> nms(b, np.array([0.9, 0.8, 0.7]), 0.5).tolist()
        [0, 2]
    """
    order = np.argsort(-np.asarray(scores), kind="stable")
    keep = []
    while order.size:
        i = order[0]
        keep.append(i)
        rest = order[1:]
        order = rest[box_iou(boxes[i], boxes[rest])[0] <= iou]
    return np.array(keep, np.int64)


def decode_grid(box_raw: np.ndarray) -> np.ndarray:
    """Boxes (G*G, 4) decoded from raw distances (G, G, 4), row-major cells.

    Example:
        >>> decode_grid(np.zeros((2, 2, 4)))[3].tolist()
        [2.0, 2.0, 10.0, 10.0]
    """
    g = box_raw.shape[0]
    idx = (np.arange(g) + 0.5) * data.STRIDE
    cy, cx = np.meshgrid(idx, idx, indexing="ij")
    centers = np.stack([cx.ravel(), cy.ravel()], 1)
    d = np.exp(np.asarray(box_raw, np.float64).reshape(-1, 4)) * data.STRIDE
    return np.concatenate([centers - d[:, :2], centers + d[:, 2:]], 1)


def detect(
    cls_logits: np.ndarray,
    box_raw: np.ndarray,
    *,
    score_thresh: float = 0.05,
    nms_iou: float = 0.5,
    max_det: int = 20,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per image ``(boxes (M, 4), scores (M,), classes (M,))`` from NHWC maps.

    Args:
      cls_logits: (N, G, G, C) class logits.
      box_raw: (N, G, G, 4) raw box distances.

    Example:
        >>> logits = np.full((1, 2, 2, 1), -9.0); logits[0, 1, 1, 0] = 2.0
        >>> boxes, scores, classes = detect(logits, np.zeros((1, 2, 2, 4)))[0]
        >>> boxes.tolist(), scores.round(3).tolist(), classes.tolist()
        ([[2.0, 2.0, 10.0, 10.0]], [0.881], [0])
    """
    out = []
    for logits, raw in zip(cls_logits, box_raw, strict=True):
        scores = 1 / (
            1 + np.exp(-np.asarray(logits, np.float64).reshape(-1, logits.shape[-1]))
        )
        boxes = decode_grid(raw)
        picks = []
        for cl in range(scores.shape[1]):
            cand = np.nonzero(scores[:, cl] > score_thresh)[0]
            kept = cand[nms(boxes[cand], scores[cand, cl], nms_iou)]
            picks += [(scores[i, cl], i, cl) for i in kept]
        picks.sort(key=lambda t: -t[0])
        picks = picks[:max_det]
        out.append(
            (
                np.array([boxes[i] for _, i, _ in picks]).reshape(-1, 4),
                np.array([s for s, _, _ in picks], np.float64),
                np.array([c for _, _, c in picks], np.int64),
            )
        )
    return out


def average_precision(tp: np.ndarray, num_gt: int) -> float:
    """VOC all-point AP of detections sorted by score (``tp``: 1 = true positive).

    Example:
        >>> average_precision(np.array([1, 0, 1]), 2)  # 0.5 * 1 + 0.5 * 2/3
        0.8333333333333333
    """
    if num_gt <= 0:
        raise ValueError(f"num_gt must be >= 1, got {num_gt}")
    tp = np.asarray(tp, np.float64)
    hits = np.cumsum(tp)
    recall = hits / num_gt
    precision = hits / np.arange(1, len(tp) + 1)
    mrec = np.concatenate([[0.0], recall, [1.0]])
    mpre = np.concatenate([[0.0], precision, [0.0]])
    mpre = np.maximum.accumulate(mpre[::-1])[::-1]  # the precision envelope
    steps = np.nonzero(mrec[1:] != mrec[:-1])[0]
    return float(np.sum((mrec[steps + 1] - mrec[steps]) * mpre[steps + 1]))


def mean_average_precision(
    detections: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    gt_boxes: list[np.ndarray],
    gt_classes: list[np.ndarray],
    num_classes: int,
    iou_thresh: float = 0.5,
) -> tuple[float, list[float | None]]:
    """mAP and per-class AP (None for a class without ground truth).

    Args:
      detections: per image ``(boxes, scores, classes)`` (see :func:`detect`).
      gt_boxes, gt_classes: per image the ground-truth boxes (K, 4) and
        classes (K,).
      num_classes: classes 0..num_classes-1.
      iou_thresh: the match threshold (0.5: mAP@0.5).

    Example:
        >>> gt = [np.array([[0.0, 0, 4, 4]])]
        >>> det = [(np.array([[0.0, 0, 4, 4], [9.0, 9, 12, 12]]),
        ...         np.array([0.5, 0.9]), np.array([0, 0]))]
        >>> mean_average_precision(det, gt, [np.array([0])], 2)
        (0.5, [0.5, None])
    """
    if len(detections) != len(gt_boxes) or len(gt_boxes) != len(gt_classes):
        raise ValueError(
            f"need one entry per image, got {len(detections)} detections, "
            f"{len(gt_boxes)} box lists and {len(gt_classes)} class lists"
        )
    aps: list[float | None] = []
    for cl in range(num_classes):
        gts = [
            np.asarray(b)[np.asarray(c) == cl]
            for b, c in zip(gt_boxes, gt_classes, strict=True)
        ]
        num_gt = sum(len(g) for g in gts)
        if num_gt == 0:
            aps.append(None)
            continue
        dets = [
            (s, i, b)
            for i, (boxes, scores, classes) in enumerate(detections)
            for b, s, c in zip(boxes, scores, classes, strict=True)
            if c == cl
        ]
        order = sorted(range(len(dets)), key=lambda j: -dets[j][0])
        taken = [np.zeros(len(g), bool) for g in gts]
        tp = np.zeros(len(dets))
        for rank, j in enumerate(order):
            _, i, box = dets[j]
            if len(gts[i]) == 0:
                continue
            ious = box_iou(box, gts[i])[0]
            best = int(np.argmax(ious))
            if ious[best] >= iou_thresh and not taken[i][best]:
                taken[i][best] = True
                tp[rank] = 1
        aps.append(average_precision(tp, num_gt))
    present = [a for a in aps if a is not None]
    return (float(np.mean(present)) if present else math.nan), aps


def evaluate(
    cls_logits: np.ndarray, box_raw: np.ndarray, heldout: dict
) -> dict[str, float]:
    """``{"map50": mAP@0.5}`` of NHWC output maps on the held-out set; nan if
    any output is non-finite.

    Example:
        >>> h = {"boxes": np.array([[[2.0, 2, 10, 10]]]), "classes": np.array([[0]]),
        ...      "box_mask": np.array([[True]])}
        >>> logits = np.full((1, 2, 2, 3), -9.0); logits[0, 1, 1, 0] = 2.0
        >>> evaluate(logits, np.zeros((1, 2, 2, 4)), h)
        {'map50': 1.0}
    """
    if not (np.isfinite(cls_logits).all() and np.isfinite(box_raw).all()):
        return {"map50": math.nan}
    used = np.asarray(heldout["box_mask"], bool)
    gt_boxes = [b[m] for b, m in zip(heldout["boxes"], used, strict=True)]
    gt_classes = [c[m] for c, m in zip(heldout["classes"], used, strict=True)]
    dets = detect(cls_logits, box_raw)
    value, _ = mean_average_precision(dets, gt_boxes, gt_classes, cls_logits.shape[-1])
    return {"map50": value}
