"""A synthetic text-detection data set with DBNet's labels, numpy + OpenCV only.

Images look like small crops of scanned documents: a light, unevenly lit
paper background with grain and a faint texture, dark "words" made of
glyph-like strokes (each character is 2-4 strokes between points of a 3x3
grid, drawn anti-aliased) inside rotated quadrilaterals of varied height,
length and angle, an occasional ruled line (ink that is *not* text), pixel
noise and a Gaussian blur. The ground truth is one quadrilateral per word.

As in the ICDAR sets, some words are "do not care" (ICDAR's ``###``): faded,
illegible words, words too small to read (1.5 px up to ``min_text_height``
high), and, as DBNet's label generation does, polygons whose bounding box is
thinner than ``min_text_size`` or whose shrunk polygon is empty.
They are excluded from the training mask and from the evaluation
(`metric.py`), as DBNet's references do.

Labels (DBNet, Liao et al. 2020, section 3.3), per image:

* ``gt``: the *shrunk* probability map. Each text polygon is offset inwards
  by ``D = A (1 - r**2) / L`` (A area, L perimeter, ``r = shrink_ratio`` =
  0.4) with pyclipper (Vatti clipping, round joins) and filled with 1.
* ``mask``: 1 everywhere but on don't-care polygons, and on polygons whose
  shrunk polygon is empty (degenerate), which are 0 (ignored by the loss).
* ``thresh_map``: each polygon is dilated by the same ``D``; inside the
  dilated polygon a pixel gets ``1 - min(dist to the polygon's border / D,
  1)``; the map is then scaled into ``[thresh_min, thresh_max]`` =
  ``[0.3, 0.7]`` (0.3 off the borders).
* ``thresh_mask``: 1 inside the dilated polygons, 0 elsewhere.

Every batch is a pure function of ``(config, split, seed, batch index)``, so
the JAX and the torch loops read the very same arrays. Images are NHWC
float32, normalised as ``(gray - 0.5) / 0.25`` on 3 channels; maps are float32
(B, H, W). Polygons are float32 (B, K, 4, 2) in pixel coordinates (x, y),
pixel centres at integers, with ``polygon_mask`` (B, K) for the used slots
and ``dont_care`` (B, K). Use :func:`to_nchw` for torch.

Example:
    >>> cfg = OCRConfig(height=32, width=32)
    >>> b = batch_at(cfg, "train", batch_size=2, index=0, seed=0)
    >>> b["image"].shape, b["gt"].shape, b["polygons"].shape[2:]
    ((2, 32, 32, 3), (2, 32, 32), (4, 2))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import cv2
import numpy as np
import pyclipper
from shapely.geometry import Polygon

# The split streams and the NHWC -> NCHW layout: one copy, shared by every task.
from examples.common.data import (  # noqa: F401 (to_nchw re-exported)
    SPLITS,
    batch_rng,
    dataset_rng,
    stream,
    to_nchw,
)

MAP_KEYS = ("gt", "mask", "thresh_map", "thresh_mask")
# The batch keys a train step reads (the polygons, of varying count, are
# only for the evaluation: fixed shapes keep the jitted step from retracing).
TRAIN_KEYS = ("image", *MAP_KEYS)

# Supersampling of the ink canvas: strokes are drawn 4x larger and area-averaged
# down, so a 1-px stroke at 32x32 has grey edges instead of jaggies.
_SUPER = 4
# cv2 fixed-point coordinates: 4 fractional bits (1/16 px) for fillPoly/line.
_SHIFT = 4
# The 3x3 glyph grid: 9 points, strokes join two of them (36 segments).
_GRID = np.array([(u, v) for v in (0.0, 0.5, 1.0) for u in (0.0, 0.5, 1.0)])
_SEGMENTS = np.array([(i, j) for i in range(9) for j in range(i + 1, 9)])


@dataclasses.dataclass(frozen=True)
class OCRConfig:
    """Settings of the synthetic text-detection data set.

    Args:
      height, width: image size in pixels (>= 16).
      min_words, max_words: words per image, drawn uniformly in between
        (placement gives up on a word that finds no free spot in 30 tries).
      min_text_height, max_text_height: word height in pixels (log-uniform).
      min_chars, max_chars: characters per word (each ~0.6 x height wide).
      max_angle: words are rotated by an angle uniform in [-max_angle,
        max_angle] degrees.
      dont_care_prob: probability that a word is faded / illegible (ICDAR's
        ``###``): drawn at low contrast and marked "do not care".
      tiny_prob: probability that a word is too small to read: its height is
        drawn in [1.5, min_text_height) px, it is drawn as ink like the
        others and marked "do not care" (ICDAR's annotators mark such words
        ``###``).
      min_text_size: polygons whose bounding box is thinner than this (px)
        are marked "do not care" too (DBNet's ``min_text_size``, 8 px at
        640 px input, scaled down to these images).
      shrink_ratio: DBNet's r (0.4).
      thresh_min, thresh_max: range of the threshold map (0.3, 0.7).
      rule_prob: probability of one ruled line (ink that is not text).
      noise_std: Gaussian pixel noise, in [0, 1] intensity units.
      max_blur: Gaussian blur sigma, uniform in [0, max_blur] pixels.

    Example:
        >>> OCRConfig(shrink_ratio=1.2)
        Traceback (most recent call last):
        ...
        ValueError: shrink_ratio must be in (0, 1), got 1.2
    """

    height: int = 32
    width: int = 32
    min_words: int = 1
    max_words: int = 4
    min_text_height: float = 4.0
    max_text_height: float = 9.0
    min_chars: int = 1
    max_chars: int = 4
    max_angle: float = 30.0
    dont_care_prob: float = 0.1
    tiny_prob: float = 0.1
    min_text_size: float = 3.0
    shrink_ratio: float = 0.4
    thresh_min: float = 0.3
    thresh_max: float = 0.7
    rule_prob: float = 0.3
    noise_std: float = 0.03
    max_blur: float = 0.7

    def __post_init__(self):
        if self.height < 16 or self.width < 16:
            raise ValueError(
                f"height and width must be >= 16, got {self.height}x{self.width}"
            )
        if not 0 <= self.min_words <= self.max_words or self.max_words < 1:
            raise ValueError(
                "need 0 <= min_words <= max_words and max_words >= 1, got "
                f"{self.min_words}, {self.max_words}"
            )
        if not 0 < self.min_text_height <= self.max_text_height:
            raise ValueError(
                "need 0 < min_text_height <= max_text_height, got "
                f"{self.min_text_height}, {self.max_text_height}"
            )
        if not 1 <= self.min_chars <= self.max_chars:
            raise ValueError(
                "need 1 <= min_chars <= max_chars, got "
                f"{self.min_chars}, {self.max_chars}"
            )
        if not 0 < self.shrink_ratio < 1:
            raise ValueError(f"shrink_ratio must be in (0, 1), got {self.shrink_ratio}")
        if not 0 <= self.thresh_min < self.thresh_max <= 1:
            raise ValueError(
                "need 0 <= thresh_min < thresh_max <= 1, got "
                f"{self.thresh_min}, {self.thresh_max}"
            )
        for name in ("dont_care_prob", "tiny_prob", "rule_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("max_angle", "min_text_size", "noise_std", "max_blur"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


# ---------------------------------------------------------------------------
# DBNet labels
# ---------------------------------------------------------------------------


def shrink_distance(polygon: np.ndarray, ratio: float) -> float:
    """DBNet's offset ``D = A (1 - r**2) / L`` of a polygon (area A, perimeter L).

    0.0 for a degenerate polygon (zero area or perimeter).

    Example:
        >>> square = np.array([[0, 0], [10, 0], [10, 10], [0, 10]], float)
        >>> round(shrink_distance(square, 0.4), 3)  # 100 * 0.84 / 40
        2.1
    """
    shape = Polygon(polygon)
    if not shape.is_valid or shape.area <= 0 or shape.length <= 0:
        return 0.0
    return shape.area * (1 - ratio**2) / shape.length


def offset_polygon(polygon: np.ndarray, distance: float) -> list[np.ndarray]:
    """The polygon offset by `distance` px (< 0 shrinks) with pyclipper.

    Round joins on a closed path, as DBNet's references do; returns the
    resulting polygons as float64 (n, 2) arrays (empty list when the shrink
    swallows the polygon).

    Example:
        >>> square = np.array([[0, 0], [10, 0], [10, 10], [0, 10]], float)
        >>> [p.shape for p in offset_polygon(square, -2.0)]
        [(4, 2)]
    """
    # pyclipper works on integers: scale by 2**_SHIFT so sub-pixel offsets of
    # these tiny polygons are kept (the references round to whole pixels at
    # 640 px, where a pixel is 0.2% of a word; here it is 20%).
    scale = float(2**_SHIFT)
    pco = pyclipper.PyclipperOffset()
    path = np.round(np.asarray(polygon, np.float64) * scale).astype(np.int64)
    pco.AddPath(path.tolist(), pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    out = pco.Execute(distance * scale)
    return [np.asarray(p, np.float64) / scale for p in out if len(p) >= 3]


def _fill(canvas: np.ndarray, polygon: np.ndarray, value: float) -> None:
    pts = np.round(np.asarray(polygon) * 2**_SHIFT).astype(np.int32)
    cv2.fillPoly(
        canvas, [pts.reshape(-1, 1, 2)], value, lineType=cv2.LINE_8, shift=_SHIFT
    )


def _segment_distance(xs, ys, a, b) -> np.ndarray:
    """Euclidean distance of points (xs, ys) to the segment a-b."""
    d = b - a
    length2 = float(d @ d)
    t = ((xs - a[0]) * d[0] + (ys - a[1]) * d[1]) / max(length2, 1e-12)
    t = np.clip(t, 0.0, 1.0)
    return np.hypot(xs - (a[0] + t * d[0]), ys - (a[1] + t * d[1]))


def _draw_border(polygon, canvas, mask, ratio) -> None:
    """Adds one polygon to the threshold canvas (values in [0, 1]) and mask."""
    distance = shrink_distance(polygon, ratio)
    if distance <= 0:
        return
    dilated = offset_polygon(polygon, distance)
    if not dilated:
        return
    dilated = dilated[0]
    _fill(mask, dilated, 1.0)
    h, w = canvas.shape
    x0, y0 = np.floor(dilated.min(0)).astype(int)
    x1, y1 = np.ceil(dilated.max(0)).astype(int)
    x0, y0, x1, y1 = max(x0, 0), max(y0, 0), min(x1, w - 1), min(y1, h - 1)
    if x0 > x1 or y0 > y1:
        return
    ys, xs = np.mgrid[y0 : y1 + 1, x0 : x1 + 1].astype(np.float64)
    poly = np.asarray(polygon, np.float64)
    dist = np.full(xs.shape, np.inf)
    for i in range(len(poly)):
        dist = np.minimum(
            dist, _segment_distance(xs, ys, poly[i], poly[(i + 1) % len(poly)])
        )
    value = 1.0 - np.clip(dist / distance, 0.0, 1.0)
    region = canvas[y0 : y1 + 1, x0 : x1 + 1]
    np.maximum(region, value, out=region)


def make_labels(
    polygons: list[np.ndarray],
    dont_care: list[bool],
    height: int,
    width: int,
    *,
    shrink_ratio: float = 0.4,
    min_text_size: float = 3.0,
    thresh_min: float = 0.3,
    thresh_max: float = 0.7,
) -> tuple[dict[str, np.ndarray], list[bool]]:
    """DBNet's four training maps of one image, and the final don't-care flags.

    A polygon is ignored (its region is 0 in ``mask``, nothing in the other
    maps) when it is flagged in `dont_care`, when its bounding box is thinner
    than `min_text_size`, when it is degenerate (fewer than 3 points, zero
    area, self-intersecting) or when its shrunk polygon is empty.

    Args:
      polygons: (n, 2) float arrays of (x, y) vertices, pixel centres at
        integers.
      dont_care: one flag per polygon.
      height, width: map size.
      shrink_ratio: DBNet's r.
      min_text_size: minimal bounding-box side in px.
      thresh_min, thresh_max: range of the threshold map.

    Returns:
      ``(maps, ignored)``: maps ``gt, mask, thresh_map, thresh_mask``
      (float32, (height, width)) and one "ignored" flag per polygon.

    Example:
        >>> box = np.array([[4, 4], [20, 4], [20, 12], [4, 12]], float)
        >>> maps, ignored = make_labels([box], [False], 24, 24)
        >>> ignored, float(maps["gt"].max()), float(maps["thresh_map"].max()) <= 0.7
        ([False], 1.0, True)
    """
    if len(polygons) != len(dont_care):
        raise ValueError(
            f"got {len(polygons)} polygons but {len(dont_care)} dont_care flags"
        )
    gt = np.zeros((height, width), np.float32)
    mask = np.ones((height, width), np.float32)
    canvas = np.zeros((height, width), np.float64)
    thresh_mask = np.zeros((height, width), np.float32)
    ignored = []
    for polygon, flag in zip(polygons, dont_care, strict=True):
        polygon = np.asarray(polygon, np.float64).reshape(-1, 2)
        ignore = bool(flag) or len(polygon) < 3
        shrunk = []
        if not ignore:
            extent = polygon.max(0) - polygon.min(0)
            distance = shrink_distance(polygon, shrink_ratio)
            ignore = extent.min() < min_text_size or distance <= 0
        if not ignore:
            shrunk = offset_polygon(polygon, -distance)
            ignore = not shrunk
        if ignore:
            if len(polygon) >= 3:
                _fill(mask, polygon, 0.0)
        else:
            _fill(gt, shrunk[0], 1.0)
            _draw_border(polygon, canvas, thresh_mask, shrink_ratio)
        ignored.append(ignore)
    thresh_map = (canvas * (thresh_max - thresh_min) + thresh_min).astype(np.float32)
    maps = {
        "gt": gt,
        "mask": mask,
        "thresh_map": thresh_map,
        "thresh_mask": thresh_mask,
    }
    return maps, ignored


# ---------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------


def _word_quad(cx, cy, length, height, angle) -> np.ndarray:
    """Corners (4, 2) of a rotated rectangle: top-left, top-right, ..."""
    c, s = np.cos(angle), np.sin(angle)
    u = np.array([c, s]) * length / 2
    v = np.array([-s, c]) * height / 2
    centre = np.array([cx, cy])
    return np.stack([centre - u - v, centre + u - v, centre + u + v, centre - u + v])


def _glyph_strokes(rng, quad, n_chars) -> list[tuple[np.ndarray, np.ndarray]]:
    """Stroke segments (image coordinates) of the characters of one word."""
    tl, tr, _, bl = quad
    along, across = tr - tl, bl - tl
    strokes = []
    for i in range(n_chars):
        picks = rng.choice(len(_SEGMENTS), size=rng.integers(2, 5), replace=False)
        for a, b in _SEGMENTS[picks]:
            pts = []
            for p in (a, b):
                # the cell leaves 15% margins along and 12% across the word
                u = (i + 0.15 + 0.7 * _GRID[p, 0]) / n_chars
                v = 0.12 + 0.76 * _GRID[p, 1]
                pts.append(tl + u * along + v * across)
            strokes.append((pts[0], pts[1]))
    return strokes


def _place_words(rng, c: OCRConfig) -> tuple[list, list, list, list]:
    """Non-overlapping words: quads, characters, faded flags, tiny flags."""
    n = int(rng.integers(c.min_words, c.max_words + 1))
    quads, chars, faded, tiny, shapes = [], [], [], [], []
    for _ in range(n):
        is_tiny = bool(rng.random() < c.tiny_prob)
        lo, hi = (
            (1.5, c.min_text_height)
            if is_tiny
            else (
                c.min_text_height,
                c.max_text_height,
            )
        )
        for _try in range(30):
            height = float(np.exp(rng.uniform(np.log(lo), np.log(hi))))
            n_chars = int(rng.integers(c.min_chars, c.max_chars + 1))
            length = height * (0.35 + 0.6 * n_chars) * rng.uniform(0.85, 1.15)
            angle = np.deg2rad(rng.uniform(-c.max_angle, c.max_angle))
            cx = rng.uniform(0, c.width - 1)
            cy = rng.uniform(0, c.height - 1)
            quad = _word_quad(cx, cy, length, height, angle)
            inside = (
                (quad.min() >= 0)
                and (quad[:, 0].max() <= c.width - 1)
                and (quad[:, 1].max() <= c.height - 1)
            )
            shape = Polygon(quad)
            # words keep a 1-px gap so their dilated borders barely touch
            if inside and all(shape.distance(s) > 1.0 for s in shapes):
                quads.append(quad)
                chars.append(n_chars)
                faded.append(bool(rng.random() < c.dont_care_prob))
                tiny.append(is_tiny)
                shapes.append(shape)
                break
    return quads, chars, faded, tiny


def _smooth(rng, h, w, knots=4) -> np.ndarray:
    coarse = rng.standard_normal((knots, knots)).astype(np.float32)
    return cv2.resize(coarse, (w, h), interpolation=cv2.INTER_CUBIC)


def _render(rng, c: OCRConfig, quads, chars, faded) -> np.ndarray:
    """One (H, W) grey image in [0, 1]."""
    h, w, s = c.height, c.width, _SUPER
    ink = np.zeros((h * s, w * s), np.float32)
    faint = np.zeros_like(ink)

    def fine(p):  # pixel centre x -> (x + 0.5) s - 0.5 on the fine canvas
        return np.round(((np.asarray(p) + 0.5) * s - 0.5) * 2**_SHIFT).astype(int)

    for quad, n_chars, is_faded in zip(quads, chars, faded, strict=True):
        height = np.linalg.norm(quad[3] - quad[0])
        thick = max(1, round(height * s * rng.uniform(0.1, 0.16)))
        target = faint if is_faded else ink
        for a, b in _glyph_strokes(rng, quad, n_chars):
            cv2.line(
                target, tuple(fine(a)), tuple(fine(b)), 1.0, thick, cv2.LINE_AA, _SHIFT
            )
    if rng.random() < c.rule_prob:  # a ruled line: ink that is not text
        y = rng.uniform(0, h - 1)
        dy = rng.uniform(-2, 2)
        cv2.line(
            ink,
            tuple(fine([0, y])),
            tuple(fine([w - 1, y + dy])),
            1.0,
            s // 2,
            cv2.LINE_AA,
            _SHIFT,
        )
    ink = cv2.resize(np.clip(ink, 0, 1), (w, h), interpolation=cv2.INTER_AREA)
    faint = cv2.resize(np.clip(faint, 0, 1), (w, h), interpolation=cv2.INTER_AREA)

    paper = rng.uniform(0.7, 0.95) + 0.05 * _smooth(rng, h, w)
    yy, xx = np.mgrid[0:h, 0:w]
    theta, freq = rng.uniform(0, np.pi), rng.uniform(0.15, 0.4)
    paper += rng.uniform(0, 0.04) * np.sin(
        freq * (xx * np.cos(theta) + yy * np.sin(theta))
    )
    paper += 0.03 * rng.standard_normal((h, w))  # paper grain
    ink_level = rng.uniform(0.05, 0.3)
    contrast = rng.uniform(0.12, 0.25)  # faded words: a quarter of the ink
    img = paper * (1 - ink) + ink_level * ink
    img = img * (1 - contrast * faint)
    sigma = rng.uniform(0, c.max_blur)
    if sigma > 0.05:
        img = cv2.GaussianBlur(img.astype(np.float32), (0, 0), sigma)
    img = img + c.noise_std * rng.standard_normal((h, w))
    return np.clip(img, 0.0, 1.0).astype(np.float32)


def generate(config: OCRConfig, num_images: int, rng: np.random.Generator) -> dict:
    """Draws `num_images` images with their polygons and DBNet maps from `rng`.

    Args:
      config: the data set settings.
      num_images: how many images (>= 1).
      rng: a numpy Generator; the result is a pure function of its state.

    Returns:
      ``image`` float32 (N, H, W, 3) normalised as ``(gray - 0.5) / 0.25``;
      ``gt, mask, thresh_map, thresh_mask`` float32 (N, H, W); ``polygons``
      float32 (N, K, 4, 2) with K = ``max_words``; ``polygon_mask`` bool
      (N, K), the used slots; ``dont_care`` bool (N, K), the ignored ones
      (faded, too small or degenerate).

    Example:
        >>> out = generate(OCRConfig(), 3, np.random.default_rng(0))
        >>> len(out), out["thresh_map"].shape, out["polygons"].shape
        (8, (3, 32, 32), (3, 4, 4, 2))
    """
    if num_images < 1:
        raise ValueError(f"num_images must be >= 1, got {num_images}")
    c = config
    k = c.max_words
    images = np.zeros((num_images, c.height, c.width, 3), np.float32)
    maps = {
        key: np.zeros((num_images, c.height, c.width), np.float32) for key in MAP_KEYS
    }
    polys = np.zeros((num_images, k, 4, 2), np.float32)
    used = np.zeros((num_images, k), bool)
    dont_care = np.zeros((num_images, k), bool)
    for i in range(num_images):
        quads, chars, faded, tiny = _place_words(rng, c)
        gray = _render(rng, c, quads, chars, faded)
        images[i] = ((gray - 0.5) / 0.25)[..., None]
        m, ignored = make_labels(
            quads,
            [f or t for f, t in zip(faded, tiny, strict=True)],
            c.height,
            c.width,
            shrink_ratio=c.shrink_ratio,
            min_text_size=c.min_text_size,
            thresh_min=c.thresh_min,
            thresh_max=c.thresh_max,
        )
        for key in MAP_KEYS:
            maps[key][i] = m[key]
        n = len(quads)
        if n:
            polys[i, :n] = np.stack(quads)
        used[i, :n] = True
        dont_care[i, :n] = ignored
    return {
        "image": images,
        **maps,
        "polygons": polys,
        "polygon_mask": used,
        "dont_care": dont_care,
    }


def polygons_of(batch: dict, index: int) -> tuple[list[np.ndarray], list[bool]]:
    """The ground-truth polygons of image `index` and their don't-care flags.

    Example:
        >>> b = generate(OCRConfig(min_words=2), 1, np.random.default_rng(0))
        >>> polys, flags = polygons_of(b, 0)
        >>> len(polys) == len(flags) >= 2, polys[0].shape
        (True, (4, 2))
    """
    used = np.asarray(batch["polygon_mask"][index])
    polys = [np.asarray(p, np.float64) for p in batch["polygons"][index][used]]
    return polys, [bool(f) for f in batch["dont_care"][index][used]]


def batch_at(
    config: OCRConfig, split: str, batch_size: int, index: int, seed: int = 0
) -> dict:
    """Batch number `index` of a split's stream (random access, no state).

    Each batch has its own numpy stream seeded by ``(seed, split, index)``.

    Example:
        >>> cfg = OCRConfig()
        >>> a = batch_at(cfg, "train", 2, index=5, seed=1)
        >>> b = batch_at(cfg, "train", 2, index=5, seed=1)
        >>> bool((a["image"] == b["image"]).all() and (a["gt"] == b["gt"]).all())
        True
    """
    return generate(config, batch_size, batch_rng(seed, split, index))


def batches(
    config: OCRConfig,
    split: str,
    batch_size: int,
    seed: int = 0,
    num_batches: int | None = None,
) -> Iterator[dict]:
    """Iterates over a split's batches 0, 1, 2, ... (endless if num_batches is None).

    Example:
        >>> [b["image"].shape for b in batches(OCRConfig(), "train", 4, num_batches=2)]
        [(4, 32, 32, 3), (4, 32, 32, 3)]
    """
    return stream(batch_at, config, split, batch_size, seed, num_batches)


def make_dataset(config: OCRConfig, split: str, num_images: int, seed: int = 0) -> dict:
    """A materialised set of `num_images` images (e.g. the held-out set).

    Drawn from a stream of its own (not the concatenation of :func:`batches`).

    Example:
        >>> make_dataset(OCRConfig(), "heldout", 5)["gt"].shape
        (5, 32, 32)
    """
    return generate(config, num_images, dataset_rng(seed, split))
