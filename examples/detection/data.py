"""A synthetic object-detection data set with a detector's augmentation, numpy only.

Scenes: a cluttered background (a smooth colour field, uneven light, random
line segments and blobs in random colours, pixel noise) with 1 to
``max_objects`` objects of ``NUM_CLASSES`` shape classes (rectangle, disc,
triangle), each with a random texture (flat, stripes, checker) and a colour
whose hue scatters around its class's hue. A scene is drawn on a source
canvas ``source_scale`` times larger than the image; every object lies inside
the canvas, and its ground-truth box is the tight box of its pixels
``(x1, y1, x2, y2)`` in pixel-edge coordinates (pixel ``i`` spans
``[i, i + 1)``, so boxes are integers on the canvas).

Train images then go through the augmentation of detector pipelines
(YOLO's random crop / scale / flip / HSV jitter, in small):

* **random crop and scale**: a square window of integer side and position
  inside the canvas is resized (nearest neighbour) to the image size, boxes
  follow (``x' = (x - x0) * size / side``) and are clipped to the image;
* **flip**: left-right with probability 1/2;
* **HSV-like jitter**: hue rotation, saturation and value gains.

A box is kept when it touches the crop window (closed intervals, as a clip
followed by ``x2 >= x1`` keeps it). Like real pipelines that clip without a
minimum-size filter (Ultralytics' ``box_candidates`` drops boxes under 2 px;
a first implementation often has none), this keeps the boxes of objects
whose edge lies exactly on the crop border: they have **zero width or zero
height**, and an object touching a window corner gives a **point box**.
:func:`degenerate_boxes` lists them. Held-out images are the whole canvas
resized, without augmentation (no degenerate box).

Per image, up to ``max_objects`` slots: ``boxes`` (B, K, 4) float32 pixel
coordinates of the image, ``classes`` (B, K) int32, ``box_mask`` (B, K) bool
(used slots); unused slots hold the box ``(0, 0, 1, 1)`` of class 0 so that
any loss computed on them is finite (they are masked out). For the
single-scale anchor-free detector (stride ``STRIDE``): ``cells`` (B, K)
int32, the flat index ``row * G + col`` of the grid cell holding the box
centre (G = size / STRIDE; a centre on the far image border goes to the
last cell), and ``heatmap`` (B, G, G, NUM_CLASSES) float32, 1 at each used
object's cell and class (the later object wins a shared cell).

Every batch is a pure function of ``(config, split, seed, batch index)``: the
JAX and the torch loops read the very same arrays. Images are NHWC float32,
``(rgb - 0.5) / 0.25``; use `to_nchw` for torch.

Example:
    >>> cfg = DetectionConfig(size=32)
    >>> b = batch_at(cfg, "train", batch_size=2, index=0, seed=0)
    >>> b["image"].shape, b["boxes"].shape, b["heatmap"].shape
    ((2, 32, 32, 3), (2, 4, 4), (2, 8, 8, 3))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

# The split streams, smooth noise and the NHWC -> NCHW layout: one copy,
# shared by every task.
from examples.common.data import (  # noqa: F401 (to_nchw re-exported)
    SPLITS,
    batch_rng,
    dataset_rng,
    smooth_field,
    stream,
    to_nchw,
)

CLASSES = ("rectangle", "disc", "triangle")
NUM_CLASSES = len(CLASSES)
# Output stride of the detector's single grid (examples/detection/model_*.py).
STRIDE = 4
# The unused-slot box: finite for every box loss, masked out by box_mask.
PAD_BOX = (0.0, 0.0, 1.0, 1.0)
BOX_KEYS = ("boxes", "classes", "box_mask", "cells", "heatmap")


@dataclasses.dataclass(frozen=True)
class DetectionConfig:
    """Settings of the synthetic detection data set.

    Args:
      size: image side in pixels (a multiple of 8: the detector's stride-8
        level).
      max_objects: objects per image at most (1 at least); also the slots.
      min_size, max_size: object side as a fraction of the canvas side.
      source_scale: canvas side / image side (>= 1); the crop window's side
        is drawn between ``min_crop`` times the canvas side and all of it.
      min_crop: smallest crop window, as a fraction of the canvas side
        (0.5: up to 2x zoom on the canvas, 1.6x on the image; YOLO's default
        scale gain is +-50%).
      clutter: line segments and blobs on the background, per image, in
        random colours.
      hue_jitter: standard deviation (in turns) of an object's hue around
        its class's hue (``class / NUM_CLASSES``): colour hints at the
        class, clutter of every hue and the jitter make the shape matter.
        0.04 (it was 0.08): with 0.08, the default detector of the 1000-step
        comparison had learnt where the objects are but not always yet to
        tell rectangles from discs, and runs that should agree differed by
        up to 20 mAP@0.5 points there (see examples/detection/README.md).
      noise_std: Gaussian pixel noise in [0, 1] units.

    Example:
        >>> DetectionConfig(size=20)
        Traceback (most recent call last):
        ...
        ValueError: size must be a multiple of 8 and >= 16, got 20
    """

    size: int = 32
    max_objects: int = 4
    min_size: float = 0.18
    max_size: float = 0.4
    source_scale: float = 1.25
    min_crop: float = 0.5
    clutter: int = 6
    hue_jitter: float = 0.04
    noise_std: float = 0.04

    def __post_init__(self):
        if self.size % 8 or self.size < 16:
            raise ValueError(f"size must be a multiple of 8 and >= 16, got {self.size}")
        if self.max_objects < 1:
            raise ValueError(f"max_objects must be >= 1, got {self.max_objects}")
        if not 0 < self.min_size <= self.max_size <= 0.5:
            raise ValueError(
                "need 0 < min_size <= max_size <= 0.5, got "
                f"min_size={self.min_size}, max_size={self.max_size}"
            )
        if self.source_scale < 1 or not 0 < self.min_crop <= 1:
            raise ValueError(
                "need source_scale >= 1 and 0 < min_crop <= 1, got "
                f"source_scale={self.source_scale}, min_crop={self.min_crop}"
            )
        if self.clutter < 0 or self.noise_std < 0:
            raise ValueError(
                f"clutter and noise_std must be >= 0, got {self.clutter}, "
                f"{self.noise_std}"
            )

    @property
    def canvas(self) -> int:
        """Side of the source canvas in pixels.

        Example:
            >>> DetectionConfig(size=32).canvas
            40
        """
        return round(self.size * self.source_scale)

    @property
    def grid(self) -> int:
        """Side of the detector's grid (``size / STRIDE``).

        Example:
            >>> DetectionConfig(size=32).grid
            8
        """
        return self.size // STRIDE


# --------------------------------------------------------------------------
# Scenes on the canvas


def _shape_mask(kind: int, x0, y0, w, h, yy, xx) -> np.ndarray:
    """Pixels (centres at +0.5) of one shape in the box x0..x0+w, y0..y0+h."""
    u = (xx + 0.5 - x0) / w  # 0..1 across the box
    v = (yy + 0.5 - y0) / h
    inside = (u >= 0) & (u <= 1) & (v >= 0) & (v <= 1)
    if kind == 1:  # disc (ellipse inscribed in the box)
        return (u - 0.5) ** 2 + (v - 0.5) ** 2 <= 0.25
    if kind == 2:  # triangle, apex at the top centre
        return inside & (np.abs(u - 0.5) <= 0.5 * v)
    return inside


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """IoU of two (x1, y1, x2, y2) boxes (0 when both are empty)."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _hue_colors(rng: np.random.Generator, hue: np.ndarray) -> np.ndarray:
    """Saturated colours of the given hues (turns), (n, 3) in [0, 1]."""
    n = len(hue)
    k = (np.array([5.0, 3.0, 1.0]) + hue[:, None] * 6.0) % 6.0
    value = rng.uniform(0.55, 0.95, (n, 1))
    sat = rng.uniform(0.5, 0.9, (n, 1))
    return value - value * sat * np.clip(np.minimum(k, 4.0 - k), 0.0, 1.0)


def _scene(rng: np.random.Generator, c: DetectionConfig):
    """One canvas: (rgb (S, S, 3) in [0, 1], boxes (m, 4), classes (m,))."""
    s = c.canvas
    yy, xx = np.mgrid[0:s, 0:s].astype(np.float64)
    light = 1.0 + 0.15 * smooth_field(rng, 1, s, s)[0]
    base = rng.uniform(0.3, 0.7, 3)
    rgb = base + 0.12 * np.stack([smooth_field(rng, 1, s, s)[0] for _ in range(3)], -1)
    # clutter: segments and small blobs in object-like colours (not objects)
    colors = _hue_colors(rng, rng.random(c.clutter))
    for i in range(c.clutter):
        if rng.random() < 0.5:
            (ax, ay), (bx, by) = rng.uniform(0, s, (2, 2))
            t = np.clip(
                ((xx - ax) * (bx - ax) + (yy - ay) * (by - ay))
                / max((bx - ax) ** 2 + (by - ay) ** 2, 1e-9),
                0,
                1,
            )
            d = np.hypot(xx - ax - t * (bx - ax), yy - ay - t * (by - ay))
            rgb[d < rng.uniform(0.4, 1.0)] = colors[i]
        else:
            cx, cy, r = *rng.uniform(0, s, 2), rng.uniform(0.8, 2.0)
            rgb[(xx - cx) ** 2 + (yy - cy) ** 2 <= r * r] = colors[i]
    count = rng.integers(1, c.max_objects + 1)
    boxes, classes = [], []
    kinds = rng.integers(NUM_CLASSES, size=count)
    colors = _hue_colors(rng, kinds / NUM_CLASSES + rng.normal(0, c.hue_jitter, count))
    for i in range(count):
        for _ in range(20):  # a few tries for a place overlapping little
            w, h = np.round(rng.uniform(c.min_size, c.max_size, 2) * s).astype(int)
            w, h = max(w, 3), max(h, 3)
            x0, y0 = rng.integers(0, s - w + 1), rng.integers(0, s - h + 1)
            box = np.array([x0, y0, x0 + w, y0 + h], np.float64)
            if all(_overlap(box, b) < 0.15 for b in boxes):
                break
        else:
            continue
        kind = int(kinds[i])
        mask = _shape_mask(kind, x0, y0, w, h, yy, xx)
        ys, xs = np.nonzero(mask)
        if xs.size == 0:
            continue
        tex = rng.integers(3)
        f, ang = rng.uniform(0.25, 0.5), rng.uniform(0, np.pi)
        wave = np.sin(2 * np.pi * f * (xx * np.cos(ang) + yy * np.sin(ang)))
        gain = {0: 1.0, 1: 1.0 + 0.25 * wave, 2: 1.0 + 0.25 * np.sign(wave)}[tex]
        rgb = np.where(mask[..., None], colors[i] * np.asarray(gain)[..., None], rgb)
        boxes.append(
            np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float64)
        )
        classes.append(kind)
    rgb = rgb * light[..., None]
    return rgb, np.array(boxes).reshape(-1, 4), np.array(classes, np.int32)


# --------------------------------------------------------------------------
# Augmentation


def crop_boxes(boxes: np.ndarray, x0: int, y0: int, side: int, size: int):
    """Boxes of the crop window ``[x0, x0+side] x [y0, y0+side]`` resized to `size`.

    Returns ``(boxes', keep)``: every box mapped by ``(x - x0) * size / side``
    and clipped to ``[0, size]``; ``keep`` marks the boxes that touch the
    window (closed intervals: an object whose edge lies on the window border
    is kept with zero width or height).

    Example:
        >>> b = np.array([[0.0, 0.0, 4.0, 4.0], [4.0, 2.0, 8.0, 6.0]])
        >>> out, keep = crop_boxes(b, x0=4, y0=0, side=8, size=8)
        >>> keep.tolist(), out[0].tolist(), out[1].tolist()
        ([True, True], [0.0, 0.0, 0.0, 4.0], [0.0, 2.0, 4.0, 6.0])
    """
    lo = np.array([x0, y0, x0, y0], np.float64)
    hi = lo + side
    keep = (
        (boxes[:, 0] <= hi[0])
        & (boxes[:, 2] >= lo[0])
        & (boxes[:, 1] <= hi[1])
        & (boxes[:, 3] >= lo[1])
    )
    out = np.clip((boxes - lo) * (size / side), 0.0, float(size))
    return out, keep


def _hsv_jitter(rng: np.random.Generator, rgb: np.ndarray) -> np.ndarray:
    """Hue rotation (+-0.05 turn), saturation (x0.6..1.4), value (x0.7..1.3)."""
    luma = rgb @ np.array([0.299, 0.587, 0.114])
    chroma = rgb - luma[..., None]
    angle = rng.uniform(-0.1, 0.1) * np.pi
    axis = np.ones(3) / np.sqrt(3.0)  # rotate the chroma around the grey axis
    k = np.array(
        [[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]]
    )
    rot = np.eye(3) + np.sin(angle) * k + (1 - np.cos(angle)) * (k @ k)
    chroma = chroma @ rot.T * rng.uniform(0.6, 1.4)
    return (luma[..., None] + chroma) * rng.uniform(0.7, 1.3)


def _augment(rng: np.random.Generator, c: DetectionConfig, rgb, boxes):
    """Random crop/scale, flip, HSV jitter: (image rgb, boxes, keep)."""
    s, size = c.canvas, c.size
    side = int(rng.integers(int(np.ceil(c.min_crop * s)), s + 1))
    x0, y0 = (int(v) for v in rng.integers(0, s - side + 1, 2))
    src = x0 + np.floor((np.arange(size) + 0.5) * side / size).astype(int)
    srcy = y0 + np.floor((np.arange(size) + 0.5) * side / size).astype(int)
    image = rgb[srcy][:, src]
    out, keep = crop_boxes(boxes, x0, y0, side, size)
    if rng.random() < 0.5:
        image = image[:, ::-1]
        out = np.stack([size - out[:, 2], out[:, 1], size - out[:, 0], out[:, 3]], 1)
    return _hsv_jitter(rng, image), out, keep


def _resize_all(c: DetectionConfig, rgb, boxes):
    """The whole canvas resized to the image (held-out: no augmentation)."""
    src = np.floor((np.arange(c.size) + 0.5) * c.canvas / c.size).astype(int)
    out, keep = crop_boxes(boxes, 0, 0, c.canvas, c.size)
    return rgb[src][:, src], out, keep


# --------------------------------------------------------------------------
# Targets and batches


def center_cells(boxes: np.ndarray, size: int) -> np.ndarray:
    """Flat grid index ``row * G + col`` of each box centre (G = size / STRIDE).

    A centre on the far border (``cx == size``) belongs to the last cell.

    Example:
        >>> center_cells(np.array([[0.0, 0.0, 8.0, 8.0], [30.0, 0.0, 32.0, 0.0]]), 32)
        array([9, 7], dtype=int32)
    """
    g = size // STRIDE
    cx = (boxes[..., 0] + boxes[..., 2]) / 2
    cy = (boxes[..., 1] + boxes[..., 3]) / 2
    col = np.clip(np.floor(cx / STRIDE), 0, g - 1).astype(np.int32)
    row = np.clip(np.floor(cy / STRIDE), 0, g - 1).astype(np.int32)
    return row * g + col


def generate(config: DetectionConfig, num_images: int, rng, *, augment: bool):
    """Draws `num_images` images with their boxes and detector targets.

    Returns:
      ``{"image": float32 (N, S, S, 3), "boxes": float32 (N, K, 4), "classes":
      int32 (N, K), "box_mask": bool (N, K), "cells": int32 (N, K),
      "heatmap": float32 (N, G, G, C)}`` (see the module docstring).

    Example:
        >>> out = generate(DetectionConfig(), 3, np.random.default_rng(0),
        ...                augment=True)
        >>> bool(out["box_mask"].sum(1).min() >= 1), out["image"].dtype
        (True, dtype('float32'))
    """
    if num_images < 1:
        raise ValueError(f"num_images must be >= 1, got {num_images}")
    c = config
    n, k, g = num_images, c.max_objects, c.grid
    images = np.zeros((n, c.size, c.size, 3), np.float32)
    boxes = np.tile(np.array(PAD_BOX, np.float32), (n, k, 1))
    classes = np.zeros((n, k), np.int32)
    used = np.zeros((n, k), bool)
    heatmap = np.zeros((n, g, g, NUM_CLASSES), np.float32)
    for i in range(n):
        rgb, b, cls = _scene(rng, c)
        if augment:
            rgb, b, keep = _augment(rng, c, rgb, b)
        else:
            rgb, b, keep = _resize_all(c, rgb, b)
        b, cls = b[keep][:k], cls[keep][:k]
        rgb = rgb + c.noise_std * rng.standard_normal(rgb.shape)
        images[i] = (np.clip(rgb, 0.0, 1.0) - 0.5) / 0.25
        boxes[i, : len(b)] = b
        classes[i, : len(b)] = cls
        used[i, : len(b)] = True
        for cell, cl in zip(center_cells(b, c.size), cls, strict=True):
            heatmap[i, cell // g, cell % g] = 0.0  # one class per cell
            heatmap[i, cell // g, cell % g, cl] = 1.0
    cells = np.where(used, center_cells(boxes, c.size), 0).astype(np.int32)
    return {
        "image": images,
        "boxes": boxes,
        "classes": classes,
        "box_mask": used,
        "cells": cells,
        "heatmap": heatmap,
    }


def degenerate_boxes(batch: dict) -> list[tuple[int, int, list[float]]]:
    """``(image, slot, box)`` of every used box with zero width or height.

    Example:
        >>> b = {"boxes": np.array([[[0, 0, 0, 4], [1, 1, 3, 3]]], np.float32),
        ...      "box_mask": np.array([[True, True]])}
        >>> degenerate_boxes(b)
        [(0, 0, [0.0, 0.0, 0.0, 4.0])]
    """
    boxes = np.asarray(batch["boxes"], np.float64)
    flat = (boxes[..., 2] <= boxes[..., 0]) | (boxes[..., 3] <= boxes[..., 1])
    hit = np.argwhere(flat & np.asarray(batch["box_mask"], bool))
    return [(int(i), int(j), boxes[i, j].tolist()) for i, j in hit]


def batch_at(
    config: DetectionConfig, split: str, batch_size: int, index: int, seed: int = 0
) -> dict:
    """Batch number `index` of a split's stream (random access, no state).

    Train batches are augmented, held-out ones are not.

    Example:
        >>> cfg = DetectionConfig()
        >>> a = batch_at(cfg, "train", 2, index=5, seed=1)
        >>> b = batch_at(cfg, "train", 2, index=5, seed=1)
        >>> bool((a["image"] == b["image"]).all() and (a["boxes"] == b["boxes"]).all())
        True
    """
    rng = batch_rng(seed, split, index)
    return generate(config, batch_size, rng, augment=split == "train")


def batches(
    config: DetectionConfig,
    split: str,
    batch_size: int,
    seed: int = 0,
    num_batches: int | None = None,
) -> Iterator[dict]:
    """Iterates over a split's batches 0, 1, 2, ... (endless if num_batches is None).

    Example:
        >>> cfg = DetectionConfig()
        >>> [b["image"].shape for b in batches(cfg, "train", 4, num_batches=2)]
        [(4, 32, 32, 3), (4, 32, 32, 3)]
    """
    return stream(batch_at, config, split, batch_size, seed, num_batches)


def make_dataset(
    config: DetectionConfig, split: str, num_images: int, seed: int = 0
) -> dict:
    """A materialised set of `num_images` images (e.g. the held-out set).

    Drawn from a stream of its own (not the concatenation of :func:`batches`);
    augmented for ``"train"`` only.

    Example:
        >>> make_dataset(DetectionConfig(), "heldout", 5)["boxes"].shape
        (5, 4, 4)
    """
    rng = dataset_rng(seed, split)
    return generate(config, num_images, rng, augment=split == "train")
