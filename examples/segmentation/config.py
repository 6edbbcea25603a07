"""Settings of the segmentation example, shared by the JAX and the torch loops.

Configs are plain functions returning settings, as in the flax examples:
:func:`get_config` returns the float32 default; a mixed-precision run is the
same config with ``precision`` (and ``mode``) overridden::

    cfg = get_config()                                   # float32 reference
    cfg = get_config(precision="float16", mode="naive")  # what users ran
    cfg = get_config(precision="float16")                # the stable recipe

The defaults are sized for a 2-core CPU (``examples/segmentation/TIMINGS.md``):
32x32 images, batch 8, a width-8 depth-2 U-Net, 400 Adam steps at lr 2e-3; torch's CPU
convolution in fp16/bf16 is ~8x (32x32) to 80x (64x64, width 16) slower than
in float32, which bounds the image size.

This module also holds the data-set settings derived from a config, the train
batches and the held-out set. The settings common to every task (sizes,
optimizer, precision, mode, guards) are those of `examples.harness.BaseConfig`.

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
from examples.harness import MODES, OPTIMIZERS, PRECISIONS  # noqa: F401
from examples.segmentation import data

IGNORE_INDEX = 255


@dataclasses.dataclass(frozen=True)
class Config(harness.BaseConfig):
    """Every setting of one segmentation run (frozen; build with :func:`get_config`).

    The common fields (image_size, batch_size, width, steps, learning_rate,
    optimizer, b1, b2, eps, weight_decay, seed, precision, mode,
    max_grad_norm, eval_images, eval_batch_size, stop_after_nonfinite,
    torch_threads) are documented in `examples.harness.BaseConfig`; in the
    stable mode the loss is the float32 cross-entropy. Segmentation adds:

    Attributes:
      num_classes: classes including the background.
      boundary_width: ignored band (label 255) along object boundaries, px.
      ignore_fraction: target fraction of ignored pixels per image.
      depth: number of U-Net levels (``image_size`` divisible by
        ``2**depth``); ``width`` is the channels of level 0.

    Example:
        >>> Config(optimizer="rmsprop")
        Traceback (most recent call last):
        ...
        ValueError: optimizer must be one of ['adam', 'adamw', 'sgd'], got 'rmsprop'
    """

    num_classes: int = 6
    boundary_width: int = 1
    ignore_fraction: float = 0.15
    depth: int = 2

    def __post_init__(self):
        super().__post_init__()
        for name, minimum in (("num_classes", 2), ("boundary_width", 0), ("depth", 1)):
            harness.check_int(name, getattr(self, name), minimum)
        if self.image_size % 2**self.depth:
            raise ValueError(
                f"image_size={self.image_size} must be divisible by "
                f"2**depth={2**self.depth}"
            )


def get_config(**overrides: Any) -> Config:
    """The default (float32, stable) config with `overrides` applied.

    Args:
      **overrides: any :class:`Config` field, e.g. ``precision="float16"``.

    Returns:
      A validated, frozen :class:`Config`.

    Raises:
      ValueError: an unknown field (the message lists the valid ones) or a
        bad value.

    Example:
        >>> get_config(precision="float16").precision
        'float16'
        >>> get_config(lr=0.1)
        Traceback (most recent call last):
        ...
        ValueError: unknown config field(s) ['lr']; valid fields: ['image_size', ...
    """
    return harness.make_config(Config, **overrides)


def data_config(config: Config) -> data.SegmentationConfig:
    """The synthetic data set of a run.

    Example:
        >>> d = data_config(get_config(image_size=16))
        >>> d.height, d.width, d.boundary_width
        (16, 16, 1)
    """
    return data.SegmentationConfig(
        height=config.image_size,
        width=config.image_size,
        num_classes=config.num_classes,
        boundary_width=config.boundary_width,
        ignore_fraction=config.ignore_fraction,
        ignore_index=IGNORE_INDEX,
    )


def train_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """The ``config.steps`` train batches (NHWC float32 images, int32 labels).

    Drawn once so that every run of a comparison reads the very same arrays.

    Example:
        >>> b = train_batches(get_config(image_size=16, batch_size=2, steps=3))
        >>> len(b), b[0]["image"].shape
        (3, (2, 16, 16, 3))
    """
    d = data_config(config)
    return list(data.batches(d, "train", config.batch_size, config.seed, config.steps))


def heldout_set(config: Config) -> dict[str, np.ndarray]:
    """The held-out evaluation images and labels (``config.eval_images``).

    Example:
        >>> heldout_set(get_config(image_size=16, eval_images=4))["label"].shape
        (4, 16, 16)
    """
    return data.make_dataset(
        data_config(config), "heldout", config.eval_images, config.seed
    )
