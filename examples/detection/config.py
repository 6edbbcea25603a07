"""Settings of the detection task, for both frameworks.

:func:`get_config` returns the float32 default; a mixed-precision run is the
same config with ``precision`` and ``mode`` overridden (see
`examples.harness.BaseConfig` for the common fields)::

    cfg = get_config()                                   # float32 reference
    cfg = get_config(precision="float16", mode="naive")  # the first implementation
    cfg = get_config(precision="float16")                # the stable recipe

Example:
    >>> cfg = get_config(precision="float16", mode="naive", steps=10)
    >>> cfg.precision, cfg.mode, cfg.steps, cfg.image_size
    ('float16', 'naive', 10, 32)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from examples import harness
from examples.detection import data


@dataclasses.dataclass(frozen=True)
class Config(harness.BaseConfig):
    """Every setting of one detection run (frozen; build with :func:`get_config`).

    The common fields are documented in `examples.harness.BaseConfig`
    (``width`` is the channels of the detector's first level). Detection
    adds:

    Attributes:
      max_objects: objects per image at most (1 at least).

    Example:
        >>> Config(image_size=36)
        Traceback (most recent call last):
        ...
        ValueError: image_size=36 must be a multiple of 8 and >= 16
    """

    image_size: int = 32
    batch_size: int = 8
    width: int = 8
    steps: int = 400
    optimizer: str = "sgd"
    learning_rate: float = 1e-2
    max_grad_norm: float | None = 10.0
    eval_images: int = 256
    eval_batch_size: int = 64
    max_objects: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.image_size % 8 or self.image_size < 16:
            raise ValueError(
                f"image_size={self.image_size} must be a multiple of 8 and >= 16"
            )
        harness.check_int("max_objects", self.max_objects, 1)


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


def data_config(config: Config) -> data.DetectionConfig:
    """The synthetic scenes of a run.

    Example:
        >>> data_config(get_config(image_size=48)).size
        48
    """
    return data.DetectionConfig(size=config.image_size, max_objects=config.max_objects)


def train_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """The ``config.steps`` augmented train batches: images (NHWC) and targets.

    Example:
        >>> b = train_batches(get_config(batch_size=2, steps=3))
        >>> len(b), sorted(b[0])
        (3, ['box_mask', 'boxes', 'cells', 'classes', 'heatmap', 'image'])
    """
    return list(
        _train_batches(
            data_config(config), config.batch_size, config.seed, config.steps
        )
    )


@functools.lru_cache(maxsize=1)
def _train_batches(d: data.DetectionConfig, batch_size: int, seed: int, steps: int):
    # drawn once per comparison (~40 ms a batch): the report's setup line
    # counts their degenerate boxes, the runs read them
    return tuple(data.batches(d, "train", batch_size, seed, steps))


def heldout_set(config: Config) -> dict[str, np.ndarray]:
    """The held-out images with their boxes (``config.eval_images``).

    Example:
        >>> heldout_set(get_config(eval_images=4))["image"].shape
        (4, 32, 32, 3)
    """
    return data.make_dataset(
        data_config(config), "heldout", config.eval_images, config.seed
    )


def degenerate_counts(config: Config) -> tuple[int, int, int]:
    """(boxes of zero width or height, point boxes, all boxes) in the train batches.

    Example:
        >>> flat, points, total = degenerate_counts(get_config(steps=2))
        >>> 0 <= points <= flat <= total
        True
    """
    flat = points = total = 0
    for batch in train_batches(config):
        total += int(batch["box_mask"].sum())
        for _, _, (x1, y1, x2, y2) in data.degenerate_boxes(batch):
            flat += 1
            points += x2 <= x1 and y2 <= y1
    return flat, points, total
