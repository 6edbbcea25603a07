"""The naive detection run's probe: the observed cause of its first non-finite step.

The harness calls the parts' ``probe`` on the batch of the first non-finite
step of a naive run, from the state before it; both frameworks measure the
naive CIoU, its gradient and the focal loss and say it in the same words
(:func:`cause_note`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from examples.detection import data


def cause_note(
    box_loss: np.ndarray,
    box_grad_finite: np.ndarray,
    focal: np.ndarray,
    probs: np.ndarray,
    batch: Mapping[str, np.ndarray],
    dtype: str,
) -> str:
    """The observed cause of a naive run's first non-finite step, in one line.

    Names each object (batch element, slot, class, box) whose naive CIoU or
    its gradient is non-finite, and counts the focal-loss elements that are
    non-finite and the probabilities that rounded to exactly 0 or 1 in the
    compute dtype (``log(p)`` / ``log(1 - p)`` = -inf there).

    Args:
      box_loss: per-object naive CIoU (N, K), float32 copy.
      box_grad_finite: per object, its CIoU's gradient is finite (N, K).
      focal: per-element naive focal loss (N, G, G, C), float32 copy.
      probs: ``sigmoid(logits)`` in the compute dtype, as float32 (N, G, G, C).
      batch: the step's batch (``boxes``, ``classes``, ``box_mask``).
      dtype: the compute dtype's name.

    Example:
        >>> b = {"boxes": np.array([[[0, 32, 0, 32], [1, 1, 5, 5]]], np.float32),
        ...      "classes": np.array([[1, 0]]), "box_mask": np.array([[True, True]])}
        >>> print(cause_note(np.array([[np.nan, 0.5]]), np.array([[False, True]]),
        ...       np.zeros((1, 2, 2, 3)), np.full((1, 2, 2, 3), 0.01), b, "float16"))
        ... # doctest: +NORMALIZE_WHITESPACE
        Cause observed: on this step's batch, the naive CIoU was non-finite for 1
        of 2 objects, its gradient for 1: batch element 0, box slot 0 (disc) with
        box (0, 32, 0, 32): a point box (zero width and height), where atan(w/h)
        is atan(0/0) = NaN. The naive focal loss was non-finite at 0 of 12
        elements; sigmoid(x) rounded to 0 or 1 in float16 at 0.
    """
    used = np.asarray(batch["box_mask"], bool)
    bad_value = used & ~np.isfinite(box_loss)
    bad = used & (bad_value | ~np.asarray(box_grad_finite, bool))
    text = (
        f"Cause observed: on this step's batch, the naive CIoU was non-finite for "
        f"{int(bad_value.sum())} of {int(used.sum())} objects, its gradient for "
        f"{int((used & ~np.asarray(box_grad_finite, bool)).sum())}"
    )
    named = []
    for i, j in np.argwhere(bad)[:3]:
        x1, y1, x2, y2 = (float(v) for v in batch["boxes"][i, j])
        box = f"({x1:g}, {y1:g}, {x2:g}, {y2:g})"
        cls = data.CLASSES[int(batch["classes"][i, j])]
        what = "a box"
        if x2 <= x1 and y2 <= y1:
            what = (
                "a point box (zero width and height), where atan(w/h) is "
                "atan(0/0) = NaN"
            )
        elif x2 <= x1 or y2 <= y1:
            what = "a box of zero width or height"
        named.append(f"batch element {i}, box slot {j} ({cls}) with box {box}: {what}")
    text += (": " + "; ".join(named)) if named else ""
    saturated = int(np.sum((probs == 0) | (probs == 1)))
    return (
        f"{text}. The naive focal loss was non-finite at "
        f"{int(np.sum(~np.isfinite(focal)))} of {focal.size} elements; "
        f"sigmoid(x) rounded to 0 or 1 in {dtype} at {saturated}."
    )
