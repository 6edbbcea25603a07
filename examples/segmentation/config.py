"""The settings of the segmentation task: values only.

``TASK.get_config(**overrides)`` (`task.py`) builds and checks one; a
mixed-precision run is the float32 default with ``precision`` and ``mode``
overridden::

    cfg = TASK.get_config()                                   # float32 reference
    cfg = TASK.get_config(precision="float16", mode="naive")  # what users ran
    cfg = TASK.get_config(precision="float16")                # the stable recipe

The common fields (sizes, optimizer, precision, mode, guards) are
`examples.harness.config.BaseConfig`'s. The defaults are sized for a 2-core
CPU (TIMINGS.md): 32x32 images, batch 8, a width-8 depth-2 U-Net, 400 Adam
steps at lr 2e-3.

Example:
    >>> Config(precision="float16", mode="naive").depth
    2
"""

from __future__ import annotations

import dataclasses

from examples.harness.config import BaseConfig


@dataclasses.dataclass(frozen=True)
class Config(BaseConfig):
    """Every setting of one segmentation run (frozen).

    In the stable mode the loss is the float32 cross-entropy. Segmentation
    adds to `BaseConfig`:

    Attributes:
      num_classes: classes including the background.
      boundary_width: ignored band (label 255) along object boundaries, px.
      ignore_fraction: target fraction of ignored pixels per image.
      depth: number of U-Net levels (``image_size`` divisible by
        ``2**depth``); ``width`` is the channels of level 0.
    """

    num_classes: int = 6
    boundary_width: int = 1
    ignore_fraction: float = 0.15
    depth: int = 2
