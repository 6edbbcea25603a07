"""The learning-rate schedule of both frameworks: linear warm-up, then cosine.

``lr_at(config, count)`` is the rate of the update that follows ``count``
applied updates: ``lr * (count + 1) / warmup_steps`` during the warm-up, then
a cosine from ``lr`` down to ``lr * final_lr_fraction`` at ``config.steps``.
torch reads it through ``LambdaLR`` (stepped after every applied update: a
skipped step keeps the schedule, as optax's count does), JAX through
`parts_jax.jax_schedule`, its jnp twin (tested equal).
"""

from __future__ import annotations

import math


def lr_at(config, count: int) -> float:
    """The learning rate after `count` applied updates.

    Example:
        >>> from examples.lm.config import Config
        >>> c = Config(learning_rate=0.1, warmup_steps=10, steps=110)
        >>> [round(lr_at(c, n), 4) for n in (0, 9, 10, 60, 110, 200)]
        [0.01, 0.1, 0.1, 0.055, 0.01, 0.01]
    """
    c = config
    if count < c.warmup_steps:
        return c.learning_rate * (count + 1) / c.warmup_steps
    span = max(1, c.steps - c.warmup_steps)
    t = min(1.0, (count - c.warmup_steps) / span)
    f = c.final_lr_fraction
    return c.learning_rate * (f + (1 - f) * 0.5 * (1 + math.cos(math.pi * t)))
