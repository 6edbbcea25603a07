"""Settings of the OCR (DBNet text detection) task, for both frameworks.

:func:`get_config` returns the float32 default; a mixed-precision run is the
same config with ``precision`` and ``mode`` overridden (see
`examples.harness.BaseConfig` for the common fields)::

    cfg = get_config()                                   # float32 reference
    cfg = get_config(precision="float16", mode="naive")  # what the team ran
    cfg = get_config(precision="float16")                # the stable recipe

The defaults are sized for a 2-core CPU: the six runs of
``python examples/compare.py ocr`` take a few minutes (torch's float16 CPU
convolution is several times slower than its float32 one, which bounds the
image size; see the OCR section of the README for the measured wall time).

Example:
    >>> cfg = get_config(precision="float16", mode="naive", steps=10)
    >>> cfg.precision, cfg.mode, cfg.steps, cfg.image_size
    ('float16', 'naive', 10, 32)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from examples import harness
from examples.ocr import data

# The batch keys a train step reads (the polygons, of varying count, are
# only for the evaluation: fixed shapes keep the jitted step from retracing).
TRAIN_KEYS = ("image", *data.MAP_KEYS)


@dataclasses.dataclass(frozen=True)
class Config(harness.BaseConfig):
    """Every setting of one OCR run (frozen; build with :func:`get_config`).

    The common fields are documented in `examples.harness.BaseConfig`
    (``width`` is the channels of the DBNet backbone's first level; the
    stable loss is the float32 `db_loss`). OCR adds:

    Attributes:
      k: DBNet's amplification of the approximate binary map (50).
      max_words: words per image at most (1 at least).
      box_thresh: minimal mean probability inside a detected box (DBNet's
        post-processing; DBNet's configs use 0.6, see examples/ocr/README.md
        for why 0.5 here).

    Example:
        >>> Config(image_size=36)
        Traceback (most recent call last):
        ...
        ValueError: image_size=36 must be divisible by 8 (three stride-2 stages)
    """

    # examples/ocr/README.md: the sweep behind these (width 12 and Adam 5e-3
    # reach a float32 hmean of ~0.78 in 400 steps; box_thresh 0.5 because
    # DBNet's 0.6 keeps only the most confident boxes after 400 steps)
    image_size: int = 32
    batch_size: int = 8
    width: int = 12
    steps: int = 400
    learning_rate: float = 5e-3
    # 256 documents hold ~575 scored words: a 0.25 recall is then known to
    # about +-0.02 (binomial), against +-0.04 with 64 documents (~150 words)
    eval_images: int = 256
    k: float = 50.0
    max_words: int = 4
    box_thresh: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        if self.image_size % 8 or self.image_size < 16:
            raise ValueError(
                f"image_size={self.image_size} must be divisible by 8 (three "
                "stride-2 stages)" + ("" if self.image_size >= 16 else " and >= 16")
            )
        harness.check_positive("k", self.k)
        harness.check_int("max_words", self.max_words, 1)
        if not 0 <= self.box_thresh < 1:
            raise ValueError(f"box_thresh must be in [0, 1), got {self.box_thresh}")


def get_config(**overrides: Any) -> Config:
    """The default (float32, stable) config with `overrides` applied.

    Raises:
      ValueError: an unknown field (the message lists the valid ones) or a
        bad value.

    Example:
        >>> get_config(precision="float16").precision
        'float16'
    """
    return harness.make_config(Config, **overrides)


def data_config(config: Config) -> data.OCRConfig:
    """The synthetic documents of a run.

    Example:
        >>> data_config(get_config(image_size=48)).height
        48
    """
    return data.OCRConfig(
        height=config.image_size, width=config.image_size, max_words=config.max_words
    )


def train_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """The ``config.steps`` train batches: images (NHWC) and DBNet's maps.

    Example:
        >>> b = train_batches(get_config(batch_size=2, steps=3))
        >>> len(b), sorted(b[0]), b[0]["gt"].shape
        (3, ['gt', 'image', 'mask', 'thresh_map', 'thresh_mask'], (2, 32, 32))
    """
    d = data_config(config)
    stream = data.batches(d, "train", config.batch_size, config.seed, config.steps)
    return [{key: b[key] for key in TRAIN_KEYS} for b in stream]


def heldout_set(config: Config) -> dict[str, np.ndarray]:
    """The held-out documents with their polygons (``config.eval_images``).

    Example:
        >>> heldout_set(get_config(eval_images=4))["image"].shape
        (4, 32, 32, 3)
    """
    return data.make_dataset(
        data_config(config), "heldout", config.eval_images, config.seed
    )
