"""The segmentation metric: mean intersection-over-union, label 255 ignored.

Computed on the host from the predicted class ids of the held-out images, as
the Cityscapes / VOC evaluation scripts do.
"""

from __future__ import annotations

import numpy as np

METRICS = ("miou",)


def confusion_matrix(
    pred: np.ndarray, label: np.ndarray, num_classes: int, ignore_index: int = 255
) -> np.ndarray:
    """(num_classes, num_classes) int64 counts, rows = true class, cols = predicted.

    Pixels whose label is `ignore_index` are not counted.

    Example:
        >>> confusion_matrix(np.array([0, 1, 1]), np.array([0, 1, 255]), 2).tolist()
        [[1, 0], [0, 1]]
    """
    pred, label = np.asarray(pred).ravel(), np.asarray(label).ravel()
    if pred.shape != label.shape:
        raise ValueError(f"pred and label sizes differ: {pred.size} vs {label.size}")
    keep = label != ignore_index
    pred, label = pred[keep], label[keep]
    bad = (label < 0) | (label >= num_classes) | (pred < 0) | (pred >= num_classes)
    if bad.any():
        raise ValueError(
            f"class ids must be in [0, {num_classes}) or {ignore_index}; found "
            f"labels {np.unique(label[bad]).tolist()[:5]} / preds "
            f"{np.unique(pred[bad]).tolist()[:5]}"
        )
    idx = label.astype(np.int64) * num_classes + pred.astype(np.int64)
    return np.bincount(idx, minlength=num_classes**2).reshape(num_classes, num_classes)


def mean_iou(
    pred: np.ndarray, label: np.ndarray, num_classes: int, ignore_index: int = 255
) -> tuple[float, np.ndarray]:
    """Mean intersection-over-union over classes, ignoring `ignore_index` pixels.

    IoU_c = TP_c / (TP_c + FP_c + FN_c); classes absent from both `pred` and
    `label` (union 0) are left out of the mean (NaN in the per-class array),
    as in the Cityscapes / VOC evaluation scripts.

    Args:
      pred: predicted class ids, any shape.
      label: true class ids (or `ignore_index`), same size as `pred`.
      num_classes: number of classes.
      ignore_index: label value that is not evaluated.

    Returns:
      ``(miou, per_class_iou)``: a float and a float64 (num_classes,) array.

    Example:
        >>> pred, label = np.array([0, 1, 1, 0]), np.array([0, 1, 0, 255])
        >>> miou, per_class = mean_iou(pred, label, 2)
        >>> round(miou, 3), per_class.round(3).tolist()
        (0.5, [0.5, 0.5])
    """
    cm = confusion_matrix(pred, label, num_classes, ignore_index).astype(np.float64)
    tp = np.diag(cm)
    union = cm.sum(0) + cm.sum(1) - tp
    with np.errstate(invalid="ignore", divide="ignore"):
        iou = np.where(union > 0, tp / union, np.nan)
    miou = float(np.nanmean(iou)) if np.any(union > 0) else float("nan")
    return miou, iou
