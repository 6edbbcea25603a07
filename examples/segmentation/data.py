"""A synthetic semantic-segmentation data set, numpy only, read by both frameworks.

It behaves like Cityscapes / Pascal VOC where it matters for numerical
stability: several object classes of random shapes (ellipses, rotated
rectangles, regular polygons), sizes, colours and textures on a textured
background, with pixel noise; the label is ``ignore_index`` (255) on a band a
few pixels wide along every object boundary (as VOC marks them) and on
unlabeled "void" regions (as Cityscapes marks them), so that a configurable
fraction of the pixels carries no label. Background is class 0 and covers most
pixels, so the classes are imbalanced as in the real sets.

Every batch is a pure function of ``(config, split, seed, batch index)``: the
JAX and the torch training loops read the very same arrays. Images are NHWC
float32 (normalised to about zero mean, unit scale); labels are int32 (N, H, W).
Use :func:`to_nchw` for torch.

Example:
    >>> cfg = SegmentationConfig(height=32, width=32)
    >>> batch = batch_at(cfg, "train", batch_size=2, index=0, seed=0)
    >>> batch["image"].shape, batch["image"].dtype, batch["label"].dtype
    ((2, 32, 32, 3), dtype('float32'), dtype('int32'))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from examples.common.data import (  # noqa: F401 (to_nchw re-exported)
    SPLITS,
    batch_rng,
    dataset_rng,
    smooth_field,
    stream,
    to_nchw,
)

# the label of the pixels no loss or metric counts (boundaries, void)
IGNORE_INDEX = 255
SHAPES = ("ellipse", "rectangle", "polygon")
TEXTURES = ("flat", "stripes", "checker", "noise")

# The polygon test loops over this many half-planes; regular polygons have 3..6.
_MAX_SIDES = 6


@dataclasses.dataclass(frozen=True)
class SegmentationConfig:
    """Settings of the synthetic segmentation data set.

    Args:
      height, width: image size in pixels.
      num_classes: classes including the background (class 0); at least 2.
      min_objects, max_objects: objects per image, drawn uniformly in between.
      min_size, max_size: object radius as a fraction of ``min(height, width)``
        (log-uniform in between, so small objects are as common as large ones).
      boundary_width: width in pixels of the ignored band along every boundary
        between two instances (or an instance and the background); 0 disables it.
      ignore_fraction: target fraction of ignored pixels per image. Void blobs
        are added until boundary + void reach it (if the boundaries alone
        exceed it, no void is added: at 64x64 with 5 objects a 2-px band
        alone is about 10% of the pixels).
      shape_affinity: probability that an object takes its class's preferred
        shape (``SHAPES[class % 3]``) instead of a random one, so shape as well
        as colour carries class information.
      color_jitter: standard deviation of the per-instance RGB jitter around the
        class colour (colours live in [0, 1]).
      texture_strength: amplitude of the brightness texture (stripes, checker,
        per-pixel noise) of objects and background.
      noise_std: standard deviation of the Gaussian pixel noise in [0, 1] units.
      ignore_index: the label of ignored pixels.

    Example:
        >>> SegmentationConfig(num_classes=4).num_classes
        4
        >>> SegmentationConfig(ignore_fraction=1.5)
        Traceback (most recent call last):
        ...
        ValueError: ignore_fraction must be in [0, 1), got 1.5
    """

    height: int = 64
    width: int = 64
    num_classes: int = 6
    min_objects: int = 2
    max_objects: int = 6
    min_size: float = 0.08
    max_size: float = 0.3
    boundary_width: int = 2
    ignore_fraction: float = 0.15
    shape_affinity: float = 0.7
    color_jitter: float = 0.1
    texture_strength: float = 0.25
    noise_std: float = 0.05
    ignore_index: int = IGNORE_INDEX

    def __post_init__(self):
        if self.height < 8 or self.width < 8:
            raise ValueError(
                f"height and width must be >= 8, got {self.height}x{self.width}"
            )
        if not 2 <= self.num_classes <= 255:
            raise ValueError(f"num_classes must be in [2, 255], got {self.num_classes}")
        if not 0 <= self.min_objects <= self.max_objects or self.max_objects < 1:
            raise ValueError(
                "need 0 <= min_objects <= max_objects and max_objects >= 1, got "
                f"min_objects={self.min_objects}, max_objects={self.max_objects}"
            )
        if not 0 < self.min_size <= self.max_size:
            raise ValueError(
                "need 0 < min_size <= max_size, got "
                f"min_size={self.min_size}, max_size={self.max_size}"
            )
        if self.boundary_width < 0:
            raise ValueError(f"boundary_width must be >= 0, got {self.boundary_width}")
        if not 0 <= self.ignore_fraction < 1:
            raise ValueError(
                f"ignore_fraction must be in [0, 1), got {self.ignore_fraction}"
            )
        if not 0 <= self.shape_affinity <= 1:
            raise ValueError(
                f"shape_affinity must be in [0, 1], got {self.shape_affinity}"
            )
        if min(self.color_jitter, self.texture_strength, self.noise_std) < 0:
            raise ValueError(
                "color_jitter, texture_strength and noise_std must be >= 0, got "
                f"{self.color_jitter}, {self.texture_strength}, {self.noise_std}"
            )
        if 0 <= self.ignore_index < self.num_classes:
            raise ValueError(
                f"ignore_index={self.ignore_index} collides with a class id "
                f"(classes are 0..{self.num_classes - 1})"
            )


def class_colors(num_classes: int) -> np.ndarray:
    """The RGB colour of each class, (num_classes, 3) float64 in [0, 1].

    Background (class 0) is mid grey; object classes get hues spread evenly
    around the colour wheel, so neighbouring class ids differ in colour but the
    per-instance jitter makes nearby hues overlap (colour alone is not enough).

    Example:
        >>> class_colors(3).round(2).tolist()
        [[0.5, 0.5, 0.5], [0.85, 0.26, 0.26], [0.26, 0.85, 0.85]]
    """
    hue = np.arange(num_classes - 1) / max(num_classes - 1, 1)
    # HSV -> RGB with saturation 0.7 and value 0.85, written out for numpy.
    k = (np.array([5.0, 3.0, 1.0]) + hue[:, None] * 6.0) % 6.0
    rgb = 0.85 - 0.85 * 0.7 * np.clip(np.minimum(k, 4.0 - k), 0.0, 1.0)
    return np.concatenate([np.full((1, 3), 0.5), rgb])


def _shift_extreme(x: np.ndarray, lo: int, hi: int, axis: int, op) -> np.ndarray:
    """max/min of x over offsets lo..hi along `axis` (edge-padded)."""
    n = x.shape[axis]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (-lo, hi)
    xp = np.pad(x, pad, mode="edge")
    out = np.take(xp, np.arange(0, n), axis=axis)
    for s in range(1, hi - lo + 1):
        out = op(out, np.take(xp, np.arange(s, s + n), axis=axis))
    return out


def _boundary_band(instance: np.ndarray, width: int) -> np.ndarray:
    """Pixels within a (width+1)-square window of a change of instance id.

    A window of size s marks a band s-1 pixels wide across each edge, split
    between the two sides, so `width` is the band width in pixels.
    """
    if width == 0:
        return np.zeros(instance.shape, bool)
    lo, hi = -(width // 2), width - width // 2
    hi_ = _shift_extreme(
        _shift_extreme(instance, lo, hi, 1, np.maximum), lo, hi, 2, np.maximum
    )
    lo_ = _shift_extreme(
        _shift_extreme(instance, lo, hi, 1, np.minimum), lo, hi, 2, np.minimum
    )
    return hi_ != lo_


def _void_mask(
    rng: np.random.Generator, boundary: np.ndarray, target: float
) -> np.ndarray:
    """Void blobs covering `target` minus the boundary share of each image."""
    n, h, w = boundary.shape
    field = smooth_field(rng, n, h, w).reshape(n, -1)
    field[boundary.reshape(n, -1)] = -np.inf  # already ignored; do not count twice
    need = np.round(target * h * w - boundary.reshape(n, -1).sum(1)).astype(int)
    need = np.clip(need, 0, h * w - 1)
    # Threshold each image at its own quantile: the `need` largest values win.
    order = np.sort(field, axis=1)[:, ::-1]
    thresh = np.take_along_axis(order, need[:, None], axis=1)
    void = (field > thresh) & (need[:, None] > 0)
    return void.reshape(n, h, w)


def _shape_mask(kind, cx, cy, theta, size, aspect, sides, yy, xx) -> np.ndarray:
    """(m, h, w) masks of m objects of one shape kind, in their rotated frames."""

    def e(a):
        return np.asarray(a, np.float32)[:, None, None]

    dx, dy = xx - e(cx), yy - e(cy)
    cos, sin = np.cos(e(theta)), np.sin(e(theta))
    u = (dx * cos + dy * sin) / e(size)
    v = (dy * cos - dx * sin) / e(size * aspect)
    if kind == 0:  # ellipse
        return u * u + v * v <= 1.0
    if kind == 1:  # rectangle (half-width 0.85 radius: about the ellipse's area)
        return np.maximum(np.abs(u), np.abs(v)) <= 0.85
    # regular polygon with `sides` sides = intersection of half-planes; the
    # unused half-planes (j >= sides) get an infinite offset (always inside)
    inside = np.ones(u.shape, bool)
    for j in range(int(sides.max())):
        phi = 2 * np.pi * j / e(sides)
        offset = np.where(j < e(sides), np.cos(np.pi / e(sides)), np.inf)
        inside &= u * np.cos(phi) + v * np.sin(phi) <= offset
    return inside


def generate(
    config: SegmentationConfig, num_images: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Draws `num_images` image/label pairs from `rng` (vectorised over images).

    Objects are painted in order, later ones occluding earlier ones; each has a
    class c in 1..num_classes-1, a shape (its class's preferred shape with
    probability ``shape_affinity``), a radius, an aspect ratio, a rotation, a
    colour ``class_colors[c] + N(0, color_jitter)`` and a texture. The label is
    then set to ``ignore_index`` on the boundary band and on void blobs.

    Args:
      config: the data set settings.
      num_images: how many images to draw (>= 1).
      rng: a numpy Generator; the result is a pure function of its state.

    Returns:
      ``{"image": float32 (N, H, W, 3), "label": int32 (N, H, W)}``, the image
      normalised as ``(rgb - 0.5) / 0.25``.

    Example:
        >>> cfg = SegmentationConfig(height=64, width=64, ignore_fraction=0.2)
        >>> out = generate(cfg, 3, np.random.default_rng(0))
        >>> out["image"].shape, out["label"].shape
        ((3, 64, 64, 3), (3, 64, 64))
        >>> bool(abs((out["label"] == 255).mean() - 0.2) < 0.01)
        True
    """
    if num_images < 1:
        raise ValueError(f"num_images must be >= 1, got {num_images}")
    c = config
    n, k, h, w = num_images, c.max_objects, c.height, c.width
    f32 = np.float32
    yy, xx = np.mgrid[0:h, 0:w].astype(f32)

    # ---- per-object parameters, (n, k) ----
    count = rng.integers(c.min_objects, c.max_objects + 1, size=(n, 1))
    active = np.arange(k)[None, :] < count
    cls = rng.integers(1, c.num_classes, size=(n, k))
    preferred = rng.random((n, k)) < c.shape_affinity
    shape = np.where(preferred, cls % len(SHAPES), rng.integers(0, len(SHAPES), (n, k)))
    size = min(h, w) * np.exp(
        rng.uniform(np.log(c.min_size), np.log(c.max_size), (n, k))
    )
    aspect = rng.uniform(0.5, 1.0, (n, k))
    cy = rng.uniform(-0.1, 1.1, (n, k)) * h
    cx = rng.uniform(-0.1, 1.1, (n, k)) * w
    theta = rng.uniform(0, np.pi, (n, k))
    sides = rng.integers(3, _MAX_SIDES + 1, (n, k))

    # ---- shape masks, (n, k, h, w); each object only tests its own shape ----
    mask = np.zeros((n, k, h, w), bool)
    for kind in range(len(SHAPES)):
        sel = (shape == kind) & active
        if sel.any():
            mask[sel] = _shape_mask(
                kind,
                cx[sel],
                cy[sel],
                theta[sel],
                size[sel],
                aspect[sel],
                sides[sel],
                yy,
                xx,
            )

    # ---- paint: instance id 0 = background, i + 1 = object i ----
    instance = np.zeros((n, h, w), np.int32)
    label = np.zeros((n, h, w), np.int32)
    for i in range(k):
        instance = np.where(mask[:, i], i + 1, instance)
        label = np.where(mask[:, i], cls[:, i, None, None], label)

    # ---- appearance per instance (index 0 = background), (n, k + 1, ...) ----
    palette = class_colors(c.num_classes)
    inst_cls = np.concatenate([np.zeros((n, 1), int), cls], axis=1)
    color = palette[inst_cls] + rng.normal(0, c.color_jitter, (n, k + 1, 3))
    color[:, 0] += rng.normal(0, 0.1, (n, 1))  # scene brightness varies
    kind = rng.integers(0, len(TEXTURES), (n, k + 1))
    freq = rng.uniform(0.06, 0.25, (n, k + 1))
    angle = rng.uniform(0, np.pi, (n, k + 1))
    phase = rng.uniform(0, 2 * np.pi, (n, k + 1))

    # Per-pixel value of a per-instance parameter: one flat gather, (n, h, w).
    flat = instance + (k + 1) * np.arange(n, dtype=np.int32)[:, None, None]

    def at(a):
        return a.reshape(n * (k + 1), *a.shape[2:]).astype(f32)[flat]

    u = xx * at(np.cos(angle)) + yy * at(np.sin(angle))
    v = yy * at(np.cos(angle)) - xx * at(np.sin(angle))
    wave_u = np.sin(2 * np.pi * at(freq) * u + at(phase))
    wave_v = np.sin(2 * np.pi * at(freq) * v)
    noise = 0.6 * rng.standard_normal((n, h, w), dtype=f32)
    tex_kind = at(kind)  # TEXTURES: flat, stripes, checker, noise
    tex = np.select(
        [tex_kind == 1, tex_kind == 2, tex_kind == 3],
        [wave_u, np.sign(wave_u * wave_v), noise],
        np.float32(0.0),
    )
    light = 1.0 + 0.15 * smooth_field(rng, n, h, w)  # uneven illumination
    rgb = at(color) * (light * (1.0 + c.texture_strength * tex))[..., None]
    rgb += c.noise_std * rng.standard_normal(rgb.shape, dtype=f32)
    image = ((np.clip(rgb, 0.0, 1.0) - 0.5) / 0.25).astype(f32)

    # ---- ignored pixels: boundary band + void blobs up to the target ----
    boundary = _boundary_band(instance, c.boundary_width)
    void = _void_mask(rng, boundary, c.ignore_fraction)
    label = np.where(boundary | void, c.ignore_index, label).astype(np.int32)
    return {"image": image, "label": label}


def batch_at(
    config: SegmentationConfig, split: str, batch_size: int, index: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Batch number `index` of a split's stream (random access, no state).

    Each batch has its own numpy stream seeded by ``(seed, split, index)``, so
    batch 7 is the same whether or not batches 0..6 were drawn.

    Args:
      config: the data set settings.
      split: ``"train"`` or ``"heldout"``.
      batch_size: images per batch.
      index: batch number (>= 0).
      seed: the run's data seed.

    Returns:
      ``{"image": float32 (B, H, W, 3), "label": int32 (B, H, W)}``.

    Example:
        >>> cfg = SegmentationConfig(height=16, width=16)
        >>> a = batch_at(cfg, "train", 2, index=5, seed=1)
        >>> b = batch_at(cfg, "train", 2, index=5, seed=1)
        >>> bool((a["label"] == b["label"]).all())
        True
    """
    return generate(config, batch_size, batch_rng(seed, split, index))


def batches(
    config: SegmentationConfig,
    split: str,
    batch_size: int,
    seed: int = 0,
    num_batches: int | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Iterates over a split's batches 0, 1, 2, ... (endless if num_batches is None).

    Args:
      config: the data set settings.
      split: ``"train"`` or ``"heldout"``.
      batch_size: images per batch.
      seed: the run's data seed; the two splits never share a stream.
      num_batches: stop after this many batches (None: never stop).

    Returns:
      An iterator of ``{"image": (B, H, W, 3) float32, "label": (B, H, W) int32}``.

    Example:
        >>> cfg = SegmentationConfig(height=16, width=16)
        >>> [b["image"].shape for b in batches(cfg, "train", 4, num_batches=2)]
        [(4, 16, 16, 3), (4, 16, 16, 3)]
    """
    return stream(batch_at, config, split, batch_size, seed, num_batches)


def make_dataset(
    config: SegmentationConfig, split: str, num_images: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """A materialised set of `num_images` pairs (e.g. the held-out evaluation set).

    Drawn from a stream of its own (not the concatenation of :func:`batches`).

    Args:
      config: the data set settings.
      split: ``"train"`` or ``"heldout"``.
      num_images: number of images.
      seed: data seed.

    Returns:
      ``{"image": float32 (N, H, W, 3), "label": int32 (N, H, W)}``.

    Example:
        >>> cfg = SegmentationConfig(height=16, width=16)
        >>> make_dataset(cfg, "heldout", 5)["label"].shape
        (5, 16, 16)
    """
    return generate(config, num_images, dataset_rng(seed, split))
