"""Helpers every task's synthetic data uses: split streams, smooth noise, layouts.

Every batch of every task is a pure function of ``(seed, split, stream,
index)``: :func:`batch_rng` / :func:`dataset_rng` give the numpy generator of
a streamed batch or of a materialised set, so the JAX and the torch runs read
the very same arrays and batch 7 is the same whether or not batches 0..6
were drawn. Images are NHWC float32 everywhere; :func:`to_nchw` is torch's
layout.

Example:
    >>> a = batch_rng(seed=0, split="train", index=3).standard_normal(2)
    >>> b = batch_rng(seed=0, split="train", index=3).standard_normal(2)
    >>> bool((a == b).all())
    True
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

SPLITS = ("train", "heldout")

# Distinct integers mixed into the seed so that the splits and the two kinds of
# draws (streamed batches vs. a materialised data set) never share a stream.
_SPLIT_IDS = {"train": 0, "heldout": 1}
STREAM_BATCHES = 1
STREAM_DATASET = 2


def check_split(split: str) -> int:
    """The id of `split` in the seeds; ValueError naming the valid splits.

    Example:
        >>> check_split("heldout")
        1
        >>> check_split("test")
        Traceback (most recent call last):
        ...
        ValueError: unknown split 'test'; valid splits: ['train', 'heldout']
    """
    if split not in _SPLIT_IDS:
        raise ValueError(f"unknown split {split!r}; valid splits: {list(SPLITS)}")
    return _SPLIT_IDS[split]


def batch_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator of batch number `index` of a split's stream (no state).

    Example:
        >>> batch_rng(0, "train", -1)
        Traceback (most recent call last):
        ...
        ValueError: index must be >= 0, got -1
    """
    split_id = check_split(split)
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    ss = np.random.SeedSequence([seed, split_id, STREAM_BATCHES, index])
    return np.random.default_rng(ss)


def dataset_rng(seed: int, split: str) -> np.random.Generator:
    """The generator of a materialised set (e.g. the held-out set) of a split:
    a stream of its own, not the concatenation of the batches.

    Example:
        >>> a, b = dataset_rng(0, "heldout"), batch_rng(0, "heldout", 0)
        >>> bool(a.random() != b.random())
        True
    """
    split_id = check_split(split)
    return np.random.default_rng(
        np.random.SeedSequence([seed, split_id, STREAM_DATASET])
    )


def interp_matrix(size: int, coarse: int) -> np.ndarray:
    """(size, coarse + 1) linear-interpolation weights from a coarse grid.

    Example:
        >>> interp_matrix(3, 2).tolist()
        [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    """
    pos = np.linspace(0, coarse, size, dtype=np.float32)
    lo = np.minimum(pos.astype(int), coarse - 1)
    frac = pos - lo
    m = np.zeros((size, coarse + 1), np.float32)
    m[np.arange(size), lo] = 1 - frac
    m[np.arange(size), lo + 1] = frac
    return m


def smooth_field(rng: np.random.Generator, n: int, h: int, w: int) -> np.ndarray:
    """Smooth random field (n, h, w): coarse noise (1 knot per 8 px), bilinear.

    Example:
        >>> smooth_field(np.random.default_rng(0), 2, 16, 8).shape
        (2, 16, 8)
    """
    ch, cw = max(h // 8, 2), max(w // 8, 2)
    coarse = rng.standard_normal((n, ch + 1, cw + 1), dtype=np.float32)
    return interp_matrix(h, ch) @ coarse @ interp_matrix(w, cw).T


def to_nchw(images: np.ndarray) -> np.ndarray:
    """NHWC -> NCHW (contiguous), for torch.

    Example:
        >>> to_nchw(np.zeros((2, 16, 8, 3), np.float32)).shape
        (2, 3, 16, 8)
    """
    if images.ndim != 4:
        raise ValueError(f"expected NHWC images (4 dims), got shape {images.shape}")
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2))


def to_nhwc(images: np.ndarray) -> np.ndarray:
    """NCHW -> NHWC (contiguous), the inverse of :func:`to_nchw`.

    Example:
        >>> to_nhwc(np.zeros((2, 3, 16, 8), np.float32)).shape
        (2, 16, 8, 3)
    """
    if images.ndim != 4:
        raise ValueError(f"expected NCHW images (4 dims), got shape {images.shape}")
    return np.ascontiguousarray(images.transpose(0, 2, 3, 1))


def stream(
    batch_at: Callable[..., dict[str, np.ndarray]],
    config: Any,
    split: str,
    batch_size: int,
    seed: int = 0,
    num_batches: int | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Batches 0, 1, 2, ... of a split: ``batch_at(config, split, batch_size,
    i, seed)`` (endless if num_batches is None).

    Example:
        >>> def batch_at(config, split, batch_size, index, seed):
        ...     return {"x": batch_rng(seed, split, index).random(batch_size)}
        >>> [b["x"].shape for b in stream(batch_at, None, "train", 3, num_batches=2)]
        [(3,), (3,)]
    """
    check_split(split)
    indices = itertools.count() if num_batches is None else range(num_batches)
    for i in indices:
        yield batch_at(config, split, batch_size, i, seed)
