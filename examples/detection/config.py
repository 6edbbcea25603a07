"""The settings of the detection task: values only.

``TASK.get_config(**overrides)`` (`task.py`) builds and checks one; a
mixed-precision run is the float32 default with ``precision`` and ``mode``
overridden::

    cfg = TASK.get_config()                                   # float32 reference
    cfg = TASK.get_config(precision="float16", mode="naive")  # the first implementation
    cfg = TASK.get_config(precision="float16")                # the stable recipe

How the defaults were chosen (steps, learning rate, held-out size) is in
README.md.

Example:
    >>> Config(precision="float16", mode="naive").optimizer
    'sgd'
"""

from __future__ import annotations

import dataclasses

from examples.harness.config import BaseConfig


@dataclasses.dataclass(frozen=True)
class Config(BaseConfig):
    """Every setting of one detection run (frozen).

    ``width`` is the channels of the detector's first level. With
    ``optimizer="sgd"`` (the default) both modes train with the YOLO recipe
    (`recipe.for_config`: SGD with Nesterov momentum, Ultralytics' three
    parameter groups, linear decay to ``final_lr_fraction``); the stable
    run warms up over ``warmup_steps`` (bias LR falling from
    ``warmup_bias_lr``, the others rising from 0, momentum rising from
    ``warmup_momentum``) and clips at ``max_grad_norm`` = 10, the naive run
    has no warmup, clip or skip. ``"adam"`` / ``"adamw"`` give the
    harness's plain optimizer instead. Detection adds to `BaseConfig`:

    Attributes:
      max_objects: objects per image at most (1 at least).
      warmup_steps: the recipe's warmup (Ultralytics: ``max(3 epochs,
        100)`` iterations; 100 of the 1000 steps here).
      momentum, warmup_momentum, warmup_bias_lr, final_lr_fraction,
      lr_decay: the recipe's settings (`recipe.Recipe`: Ultralytics'
        defaults ``momentum=0.937``, ``warmup_momentum=0.8``,
        ``warmup_bias_lr=0.1``, ``lrf=0.01``, linear decay; here lr and
        warmup bias LR are halved).
      ema_decay, ema_tau: the weight EMA every run is evaluated with
        (`recipe.ema_decays`, Ultralytics' ``ModelEMA``: 0.9999 and 2000
        there, for runs of 10^4-10^5 steps; 0.99 and 50 here for 1000; 0
        turns it off).
    """

    image_size: int = 32
    batch_size: int = 8
    width: int = 8
    steps: int = 1000
    optimizer: str = "sgd"
    learning_rate: float = 5e-3  # half Ultralytics' 0.01
    max_grad_norm: float | None = 10.0
    # ~2600 held-out objects: with 256 images one model's mAP@0.5 moved by
    # several points between disjoint held-out draws
    eval_images: int = 1024
    eval_batch_size: int = 64
    weight_decay: float = 5e-4
    max_objects: int = 4
    warmup_steps: int = 100
    momentum: float = 0.937
    warmup_momentum: float = 0.8
    warmup_bias_lr: float = 0.05  # half Ultralytics' 0.1
    final_lr_fraction: float = 0.01
    lr_decay: str = "linear"
    ema_decay: float = 0.99
    ema_tau: float = 50.0
