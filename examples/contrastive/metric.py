"""Retrieval recall@1 on the held-out split, numpy (both frameworks).

For N held-out pairs with image embeddings ``I`` and caption embeddings
``T`` (rows normalised in float32, eps-safe), ``S = I T^T``. Image -> text
recall@1 is the fraction of rows whose largest entry is on the diagonal;
text -> image the same for the columns. Ties count as misses unless the
diagonal entry is the first maximum (numpy's argmax), so a constant
embedding scores 1/N at most, not 1. The held-out captions name all five
attributes of distinct combinations: each query has one right answer.
"""

from __future__ import annotations

import numpy as np

METRICS = ("recall_at_1", "recall_i2t", "recall_t2i")


def recall_at_1(
    img: np.ndarray, txt: np.ndarray, eps: float = 1e-8
) -> dict[str, float]:
    """``{"recall_at_1" (mean of both), "recall_i2t", "recall_t2i"}``.

    Any non-finite embedding makes every value nan (a broken model has no
    recall to report).

    Example:
        >>> e = np.eye(3, 4, dtype=np.float32)
        >>> recall_at_1(e, e)["recall_at_1"]
        1.0
        >>> r = recall_at_1(e, e[[1, 0, 2]])
        >>> round(r["recall_i2t"], 4), round(r["recall_t2i"], 4)
        (0.3333, 0.3333)
        >>> recall_at_1(e, e * np.nan)["recall_at_1"]
        nan
    """
    img = np.asarray(img, np.float32)
    txt = np.asarray(txt, np.float32)
    if img.ndim != 2 or img.shape != txt.shape:
        raise ValueError(
            f"img and txt must be (N, D) of the same shape, got {img.shape} and "
            f"{txt.shape}"
        )
    if not (np.isfinite(img).all() and np.isfinite(txt).all()):
        return dict.fromkeys(METRICS, float("nan"))

    def unit(x):
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), eps)

    sim = unit(img) @ unit(txt).T
    idx = np.arange(len(sim))
    i2t = float(np.mean(sim.argmax(axis=1) == idx))
    t2i = float(np.mean(sim.argmax(axis=0) == idx))
    return {"recall_at_1": (i2t + t2i) / 2, "recall_i2t": i2t, "recall_t2i": t2i}
