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

# the held-out metrics of the task, headline first (evaluate adds per-class APs)
METRICS = ("map50",)


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

    The result of running :func:`nms` per image and class on the candidates
    above `score_thresh`, merging the classes by score (ties: lower class,
    then NMS order) and keeping ``max_det``; computed for all images and
    classes at once (one IoU matrix per image, since every class decodes the
    same boxes, and greedy suppression stepped over the score ranks).

    Args:
      cls_logits: (N, G, G, C) class logits.
      box_raw: (N, G, G, 4) raw box distances.

    Example:
        >>> logits = np.full((1, 2, 2, 1), -9.0); logits[0, 1, 1, 0] = 2.0
        >>> boxes, scores, classes = detect(logits, np.zeros((1, 2, 2, 4)))[0]
        >>> boxes.tolist(), scores.round(3).tolist(), classes.tolist()
        ([[2.0, 2.0, 10.0, 10.0]], [0.881], [0])
    """
    logits = np.asarray(cls_logits, np.float64)
    n, g, _, c = logits.shape
    p = g * g
    scores = 1 / (1 + np.exp(-logits.reshape(n, p, c)))
    boxes = np.stack([decode_grid(raw) for raw in box_raw])  # (N, P, 4)
    lo = np.maximum(boxes[:, :, None, :2], boxes[:, None, :, :2])
    hi = np.minimum(boxes[:, :, None, 2:], boxes[:, None, :, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=-1)
    area = np.prod(np.clip(boxes[..., 2:] - boxes[..., :2], 0, None), axis=-1)
    union = area[:, :, None] + area[:, None, :] - inter
    overlaps = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
    # greedy NMS for every (image, class) at once, rank by rank
    per_class = scores.transpose(0, 2, 1)  # (N, C, P)
    order = np.argsort(-per_class, axis=-1, kind="stable")
    rows = np.arange(n)[:, None]
    suppressed = np.zeros((n, c, p), bool)
    kept = np.zeros((n, c, p), bool)
    nms_rank = np.zeros((n, c, p), np.int64)
    for k in range(p):
        i = order[:, :, k]  # (N, C): the k-th best cell of each image and class
        alive = (
            np.take_along_axis(per_class, i[..., None], -1)[..., 0] > score_thresh
        ) & ~np.take_along_axis(suppressed, i[..., None], -1)[..., 0]
        np.put_along_axis(kept, i[..., None], alive[..., None], -1)
        np.put_along_axis(nms_rank, i[..., None], np.full((n, c, 1), k), -1)
        # `not <=` as nms keeps `iou <= nms_iou`: a NaN overlap suppresses there too
        suppressed |= alive[..., None] & ~(overlaps[rows, i] <= nms_iou)
    out = []
    for b in range(n):
        cl, cell = np.nonzero(kept[b])
        score = per_class[b, cl, cell]
        pick = np.lexsort((nms_rank[b, cl, cell], cl, -score))[:max_det]
        out.append(
            (
                boxes[b, cell[pick]].reshape(-1, 4),
                score[pick].astype(np.float64),
                cl[pick].astype(np.int64),
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
        dets = []  # (score, image, row of that image's IoU table)
        ious = []  # per image: IoU of its class-`cl` detections with its gts
        for i, (boxes, scores, classes) in enumerate(detections):
            mine = np.asarray(classes) == cl
            ious.append(box_iou(np.asarray(boxes).reshape(-1, 4)[mine], gts[i]))
            dets += [(s, i, r) for r, s in enumerate(np.asarray(scores)[mine])]
        order = sorted(range(len(dets)), key=lambda j: -dets[j][0])
        taken = [np.zeros(len(g), bool) for g in gts]
        tp = np.zeros(len(dets))
        for rank, j in enumerate(order):
            _, i, row = dets[j]
            if len(gts[i]) == 0:
                continue
            best = int(np.argmax(ious[i][row]))
            if ious[i][row, best] >= iou_thresh and not taken[i][best]:
                taken[i][best] = True
                tp[rank] = 1
        aps.append(average_precision(tp, num_gt))
    present = [a for a in aps if a is not None]
    return (float(np.mean(present)) if present else math.nan), aps


def evaluate(
    cls_logits: np.ndarray, box_raw: np.ndarray, heldout: dict
) -> dict[str, float]:
    """mAP@0.5 of NHWC output maps on the held-out set, and where it is lost.

    Returns ``{"map50", "ap50_<class>" for each class in `data.CLASSES`,
    "ap50_any_class"}``: the mAP, each class's AP (nan for a class without
    ground truth), and the AP@0.5 of the boxes with the class ignored (each
    cell scored by its best class, every ground-truth box matchable). A
    model that finds the objects but confuses two classes keeps a high
    ``ap50_any_class`` while their APs drop. Every value is nan if an output
    is non-finite.

    Example:
        >>> h = {"boxes": np.array([[[2.0, 2, 10, 10]]]), "classes": np.array([[0]]),
        ...      "box_mask": np.array([[True]])}
        >>> logits = np.full((1, 2, 2, 3), -9.0); logits[0, 1, 1, 1] = 2.0
        >>> out = evaluate(logits, np.zeros((1, 2, 2, 4)), h)  # found, wrong class
        >>> out["map50"], out["ap50_rectangle"], out["ap50_disc"], out["ap50_any_class"]
        (0.0, 0.0, nan, 1.0)
    """
    num_classes = cls_logits.shape[-1]
    names = [f"ap50_{c}" for c in data.CLASSES[:num_classes]]
    names += [f"ap50_class{k}" for k in range(len(names), num_classes)]
    if not (np.isfinite(cls_logits).all() and np.isfinite(box_raw).all()):
        return dict.fromkeys(["map50", *names, "ap50_any_class"], math.nan)
    used = np.asarray(heldout["box_mask"], bool)
    gt_boxes = [b[m] for b, m in zip(heldout["boxes"], used, strict=True)]
    gt_classes = [c[m] for c, m in zip(heldout["classes"], used, strict=True)]
    dets = detect(cls_logits, box_raw)
    value, aps = mean_average_precision(dets, gt_boxes, gt_classes, num_classes)
    any_class, _ = mean_average_precision(
        detect(np.max(cls_logits, axis=-1, keepdims=True), box_raw),
        gt_boxes,
        [np.zeros(len(c), np.int64) for c in gt_classes],
        1,
    )
    per_class = {
        n: math.nan if a is None else a for n, a in zip(names, aps, strict=True)
    }
    return {"map50": value, **per_class, "ap50_any_class": any_class}
