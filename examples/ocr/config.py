"""The settings of the OCR (DBNet text detection) task: values only.

``TASK.get_config(**overrides)`` (`task.py`) builds and checks one; a
mixed-precision run is the float32 default with ``precision`` and ``mode``
overridden::

    cfg = TASK.get_config()                                   # float32 reference
    cfg = TASK.get_config(precision="float16", mode="naive")  # what the team ran
    cfg = TASK.get_config(precision="float16")                # the stable recipe

The defaults are sized for a 2-core CPU (torch's float16 CPU convolution is
several times slower than its float32 one, which bounds the image size); the
sweep behind them is in README.md.

Example:
    >>> Config(precision="float16", mode="naive").width
    12
"""

from __future__ import annotations

import dataclasses

from examples.harness.config import BaseConfig


@dataclasses.dataclass(frozen=True)
class Config(BaseConfig):
    """Every setting of one OCR run (frozen).

    ``width`` is the channels of the DBNet backbone's first level; the
    stable loss is the float32 `db_loss`. OCR adds to `BaseConfig`:

    Attributes:
      k: DBNet's amplification of the approximate binary map (50).
      max_words: words per image at most (1 at least).
      box_thresh: minimal mean probability inside a detected box (DBNet's
        post-processing; DBNet's configs use 0.6, README.md says why 0.5).
    """

    image_size: int = 32
    batch_size: int = 8
    width: int = 12  # with Adam 5e-3: float32 hmean ~0.78 in 400 steps
    steps: int = 400
    learning_rate: float = 5e-3
    # 256 documents hold ~575 scored words: a 0.25 recall is then known to
    # about +-0.02 (binomial), against +-0.04 with 64 documents (~150 words)
    eval_images: int = 256
    k: float = 50.0
    max_words: int = 4
    box_thresh: float = 0.5
