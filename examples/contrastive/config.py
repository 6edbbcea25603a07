"""The settings of the contrastive image-text task: values only.

``TASK.get_config(**overrides)`` (`task.py`) builds and checks one; a
mixed-precision run is the float32 default with ``precision`` and ``mode``
overridden::

    cfg = TASK.get_config()                                    # float32 reference
    cfg = TASK.get_config(precision="bfloat16", mode="naive")  # the first attempt
    cfg = TASK.get_config(precision="bfloat16")                # the stable recipe

Example:
    >>> Config(precision="bfloat16", mode="naive").image_size
    24
"""

from __future__ import annotations

import dataclasses

from examples.harness.config import BaseConfig


@dataclasses.dataclass(frozen=True)
class Config(BaseConfig):
    """Every setting of one contrastive run (frozen).

    ``width`` is the channels of the image tower's first convolution; the
    stable loss is the float32 `info_nce`. The task adds to `BaseConfig`:

    Attributes:
      embed_dim: the shared embedding size of the two projections.
      token_dim: the text tower's token embedding size.
      max_tokens: caption length with padding (>= 5).
      train_pairs: pairs in the train set (an epoch; the last batch of an
        epoch is partial when ``batch_size`` does not divide it).
      empty_rate: fraction of train captions that tokenise to nothing
        (rounded up: at least one when > 0; 0 turns them off).
    """

    image_size: int = 24
    batch_size: int = 32
    width: int = 8
    steps: int = 300
    learning_rate: float = 2e-3
    # Adam's eps: CLIP's and open_clip's for their ViTs; with 1e-8 the float32
    # torch run leaves its own float64 run at step 29 (README.md)
    eps: float = 1e-6
    # 256 of the 384 attribute combinations: recall@1 among 256 candidates
    eval_images: int = 256
    eval_batch_size: int = 256
    embed_dim: int = 32
    token_dim: int = 32
    max_tokens: int = 8
    train_pairs: int = 2000
    empty_rate: float = 0.002
