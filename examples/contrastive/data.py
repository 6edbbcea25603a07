"""Paired images and captions where retrieval is learnable, numpy only.

Each image shows one shape with five attributes: its class (circle, square,
triangle, cross), colour (six), size (small, large), position (one of the
four quadrants, jittered by up to 2 px) and texture (solid, striped), on a
dark background with pixel noise. Its caption is a list of token ids naming
some of those attributes, in a random order, padded with ``PAD`` (0) to
``max_tokens``.

The edge cases real caption data has are all there:

* very short captions: 1 to 5 attributes are named (``CAPTION_LENGTHS``),
  so "red" alone describes a sixth of the images;
* duplicates in a batch: short captions repeat (two "red" in one batch of
  32 is common), so a row of InfoNCE can have a false negative;
* empty captions: a caption whose words are all outside the vocabulary
  ("a photo", "IMG_2041.jpg") tokenises to nothing, all padding. A
  fraction ``empty_rate`` of the train pairs has one, rounded up (so at
  least one pair of any train set when ``empty_rate > 0``; 0 turns them off);
* a last partial batch: the train set is ``train_pairs`` pairs, reshuffled
  each epoch and cut into batches in order, so the last batch of an epoch
  holds ``train_pairs % batch_size`` pairs when that is not 0.

The held-out split has distinct attribute combinations, each captioned with
all five attributes, so recall@1 has one right answer per query.

Every batch is a pure function of ``(config, seed, step)``: the JAX and the
torch loops read the very same arrays. Images are NHWC float32 in
``[-1, 1]``-ish (``(rgb - 0.5) / 0.5``), tokens int32 (B, max_tokens).

Example:
    >>> cfg = ContrastiveData(image_size=24)
    >>> b = make_pairs(cfg, "heldout", 4, seed=0)
    >>> b["image"].shape, b["tokens"].shape, b["tokens"].dtype
    ((4, 24, 24, 3), (4, 8), dtype('int32'))
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from examples.common.data import SPLITS, check_split, to_nchw  # noqa: F401

SHAPES = ("circle", "square", "triangle", "cross")
COLOURS = ("red", "green", "blue", "yellow", "magenta", "cyan")
SIZES = ("small", "large")
POSITIONS = ("top-left", "top-right", "bottom-left", "bottom-right")
TEXTURES = ("solid", "striped")
ATTRIBUTES = (SHAPES, COLOURS, SIZES, POSITIONS, TEXTURES)
PAD = 0
# token id of each word: 1.. in ATTRIBUTES order (0 is padding)
VOCAB = ("<pad>", *(w for values in ATTRIBUTES for w in values))
_OFFSETS = np.cumsum([1] + [len(v) for v in ATTRIBUTES[:-1]])
COMBINATIONS = math.prod(len(v) for v in ATTRIBUTES)  # 384
# How many attributes a train caption names, and how often (the rest of a
# caption's words are outside the vocabulary and dropped by the tokeniser).
CAPTION_LENGTHS = ((1, 0.15), (2, 0.2), (3, 0.25), (4, 0.2), (5, 0.2))
_RGB = np.array(
    [[1, 0.15, 0.15], [0.15, 0.9, 0.15], [0.2, 0.3, 1], [1, 0.95, 0.1],
     [1, 0.2, 1], [0.1, 0.95, 0.95]], np.float32,
)  # fmt: skip
_STREAM_POOL = 3
_STREAM_ORDER = 4


@dataclasses.dataclass(frozen=True)
class ContrastiveData:
    """The data set settings.

    Attributes:
      image_size: square side, divisible by 8 and >= 16.
      max_tokens: caption length with padding (>= 5: every attribute fits).
      train_pairs: pairs in the train set (one epoch).
      empty_rate: fraction of train captions that tokenise to nothing.

    Example:
        >>> ContrastiveData(max_tokens=3)
        Traceback (most recent call last):
        ...
        ValueError: max_tokens must be an int >= 5 (a caption names up to 5 ...
    """

    image_size: int = 24
    max_tokens: int = 8
    train_pairs: int = 2000
    empty_rate: float = 0.002

    def __post_init__(self):
        if self.image_size < 16 or self.image_size % 8:
            raise ValueError(
                f"image_size must be divisible by 8 and >= 16, got {self.image_size}"
            )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 5:
            raise ValueError(
                "max_tokens must be an int >= 5 (a caption names up to 5 "
                f"attributes), got {self.max_tokens!r}"
            )
        if not isinstance(self.train_pairs, int) or self.train_pairs < 1:
            raise ValueError(
                f"train_pairs must be an int >= 1, got {self.train_pairs!r}"
            )
        if not 0 <= self.empty_rate < 1:
            raise ValueError(f"empty_rate must be in [0, 1), got {self.empty_rate!r}")


def decode(tokens: np.ndarray) -> str:
    """The words of one caption (padding left out).

    Example:
        >>> decode(np.array([5, 1, 0, 0]))
        'red circle'
    """
    return " ".join(VOCAB[t] for t in np.asarray(tokens) if t != PAD)


def _draw(attrs: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """One (size, size, 3) image of the attribute indices `attrs`."""
    shape, colour, big, pos, striped = (int(a) for a in attrs)
    q = size / 2
    cx = (pos % 2 + 0.5) * q + rng.uniform(-2, 2)
    cy = (pos // 2 + 0.5) * q + rng.uniform(-2, 2)
    r = q * (0.38 if big else 0.2)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    dx, dy = xx - cx, yy - cy
    if shape == 0:
        inside = dx**2 + dy**2 <= r**2
    elif shape == 1:
        inside = (np.abs(dx) <= r * 0.85) & (np.abs(dy) <= r * 0.85)
    elif shape == 2:
        inside = (dy <= r * 0.8) & (dy >= -r) & (np.abs(dx) <= (dy + r) * 0.6)
    else:
        arm = r * 0.35
        inside = (np.abs(dx) <= arm) | (np.abs(dy) <= arm)
        inside &= (np.abs(dx) <= r) & (np.abs(dy) <= r)
    shade = np.ones((size, size), np.float32)
    if striped:
        shade = np.where((np.floor(yy) // 2) % 2 == 0, 1.0, 0.35)
    image = np.full((size, size, 3), 0.1, np.float32)
    image[inside] = _RGB[colour] * shade[inside][:, None]
    image += rng.normal(0, 0.04, image.shape).astype(np.float32)
    return (image - 0.5) / 0.5


def _caption(attrs: np.ndarray, n: int, max_tokens: int, rng) -> np.ndarray:
    tokens = np.full(max_tokens, PAD, np.int32)
    named = rng.permutation(len(ATTRIBUTES))[:n]
    tokens[:n] = _OFFSETS[named] + attrs[named]
    return tokens


def _render(config, attrs, lengths, rng) -> dict[str, np.ndarray]:
    images = np.stack([_draw(a, config.image_size, rng) for a in attrs])
    tokens = np.stack(
        [
            _caption(a, n, config.max_tokens, rng)
            for a, n in zip(attrs, lengths, strict=True)
        ]
    )
    return {"image": images, "tokens": tokens, "attributes": attrs.astype(np.int32)}


def make_pairs(
    config: ContrastiveData, split: str, n: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """`n` pairs of a split: ``image``, ``tokens`` and their ``attributes``.

    Train pairs have random attributes and 1-5 named attributes, ``empty_rate``
    of them (rounded up) an empty caption; held-out pairs have distinct
    attribute combinations (``n <= COMBINATIONS``) and name all five.

    Example:
        >>> cfg = ContrastiveData(image_size=16, train_pairs=10)
        >>> t = make_pairs(cfg, "train", 10)
        >>> int((t["tokens"] != PAD).sum(axis=1).min())  # the empty caption
        0
    """
    split_id = check_split(split)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, split_id, _STREAM_POOL]))
    sizes = [len(v) for v in ATTRIBUTES]
    if split == "heldout":
        if n > COMBINATIONS:
            raise ValueError(
                f"the held-out split has {COMBINATIONS} distinct attribute "
                f"combinations, {n} pairs were asked for"
            )
        codes = rng.choice(COMBINATIONS, n, replace=False)
        attrs = np.stack(np.unravel_index(codes, sizes), axis=1)
        return _render(config, attrs, np.full(n, len(ATTRIBUTES)), rng)
    attrs = np.stack([rng.integers(0, k, n) for k in sizes], axis=1)
    counts, probs = zip(*CAPTION_LENGTHS, strict=True)
    lengths = rng.choice(counts, n, p=probs)
    empty = math.ceil(config.empty_rate * n)
    lengths[rng.choice(n, empty, replace=False)] = 0
    return _render(config, attrs, lengths, rng)


def train_batches(
    config: ContrastiveData, batch_size: int, steps: int, seed: int = 0
) -> list[dict[str, np.ndarray]]:
    """`steps` train batches: epochs over the train set, reshuffled each epoch.

    The last batch of an epoch is partial when ``train_pairs % batch_size``
    is not 0 (no pair is dropped or repeated within an epoch).

    Example:
        >>> cfg = ContrastiveData(image_size=16, train_pairs=10)
        >>> [len(b["tokens"]) for b in train_batches(cfg, 4, 5)]
        [4, 4, 2, 4, 4]
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    pool = make_pairs(config, "train", config.train_pairs, seed)
    n = config.train_pairs
    out, epoch = [], 0
    while len(out) < steps:
        ss = np.random.SeedSequence([seed, _STREAM_ORDER, epoch])
        order = np.random.default_rng(ss).permutation(n)
        for start in range(0, n, batch_size):
            if len(out) == steps:
                break
            idx = order[start : start + batch_size]
            out.append({"image": pool["image"][idx], "tokens": pool["tokens"][idx]})
        epoch += 1
    return out
