"""The YOLO training recipe's schedule, framework-free: one source for both ports.

Ultralytics' detection trainer (``build_optimizer`` and the warmup in
``_do_train``) trains with SGD, Nesterov momentum, three parameter groups and
a warmup; `Recipe` holds its settings and `Recipe.hyperparameters` gives, for
an optimizer step, the learning rate of each group and the momentum:

* groups (Ultralytics' order): ``bias`` (every bias, no weight decay),
  ``decay`` (conv/linear weights, ``weight_decay``), ``no_decay``
  (normalisation weights: BatchNorm's ``weight`` / flax's ``scale``);
* decay factor at step ``s`` of ``steps``: linear
  ``(1 - s / steps) (1 - lrf) + lrf`` or cosine
  ``lrf + (1 - lrf) (1 + cos(pi s / steps)) / 2`` (Ultralytics'
  ``one_cycle``), ``lrf = final_lr_fraction``, held at ``lrf`` after
  ``steps``;
* warmup, ``s < warmup_steps``: linear interpolation from step 0 to
  ``warmup_steps``: the bias group's LR falls from ``warmup_bias_lr`` to
  ``lr * decay(s)``, the other groups' rise from 0 to it, the momentum rises
  from ``warmup_momentum`` to ``momentum`` (``np.interp`` over ``[0, nw]``
  in Ultralytics).

Two differences from Ultralytics, both for a step-based port: the decay is
per optimizer step (Ultralytics steps its LambdaLR once per epoch, so its LR
is a staircase of the same curve), and ``s`` counts *applied* steps: a step
skipped as non-finite leaves the schedule where it was in both frameworks
(the JAX schedule's count lives in the optimizer state that the skip keeps;
the torch loop calls ``scheduler.step()`` only after an applied step).
Ultralytics counts iterations; the two differ by the number of skipped
steps (2 in 41k batches in the report). Ultralytics also scales
``weight_decay`` by ``batch * accumulate / 64``: pass the value you want.

The hyperparameters are computed here in float64 and rounded once to
float32, so both frameworks step with the same numbers.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

GROUPS = ("bias", "decay", "no_decay")  # Ultralytics' param_groups order
DECAYS = ("linear", "cosine")


def _check(name: str, value, low: float, high: float | None = None, *, open_low=False):
    """ValueError naming `name` unless low <= value (< low when open_low)
    and value <= high (a finite number)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (value > low if open_low else value >= low)
    ok = ok and (high is None or value <= high)
    if not ok:
        rule = f"> {low}" if open_low else f">= {low}"
        rule += "" if high is None else f" and <= {high}"
        raise ValueError(f"{name} must be a number {rule}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Settings of the YOLO recipe (Ultralytics' defaults), validated.

    Attributes:
      steps: optimizer steps of the run (the decay reaches ``lrf`` there).
      warmup_steps: steps of warmup (Ultralytics: ``max(3 epochs, 100)``).
      lr: base learning rate (``lr0``).
      final_lr_fraction: ``lrf``, the LR at the end as a fraction of ``lr``.
      momentum: SGD's Nesterov momentum after warmup.
      warmup_momentum: momentum at step 0.
      warmup_bias_lr: the bias group's LR at step 0.
      weight_decay: L2 decay of the ``decay`` group (added to the gradient,
        torch's SGD ``weight_decay``).
      decay: "linear" (Ultralytics' default) or "cosine" (``cos_lr``).

    Example:
      >>> r = Recipe(steps=300, warmup_steps=100)
      >>> [round(v, 5) for v in r.hyperparameters(0)]
      [0.1, 0.0, 0.0, 0.8]
      >>> [round(v, 5) for v in r.hyperparameters(50)]
      [0.05418, 0.00417, 0.00417, 0.8685]
    """

    steps: int
    warmup_steps: int = 100
    lr: float = 0.01
    final_lr_fraction: float = 0.01
    momentum: float = 0.937
    warmup_momentum: float = 0.8
    warmup_bias_lr: float = 0.1
    weight_decay: float = 5e-4
    decay: str = "linear"

    def __post_init__(self):
        for name in ("steps", "warmup_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an int, got {value!r}")
        _check("steps", self.steps, 0, open_low=True)
        _check("warmup_steps", self.warmup_steps, 0)
        _check("lr", self.lr, 0.0, open_low=True)
        _check("final_lr_fraction", self.final_lr_fraction, 0.0, 1.0)
        _check("momentum", self.momentum, 0.0, 1.0)
        _check("warmup_momentum", self.warmup_momentum, 0.0, 1.0)
        _check("warmup_bias_lr", self.warmup_bias_lr, 0.0)
        _check("weight_decay", self.weight_decay, 0.0)
        if self.decay not in DECAYS:
            raise ValueError(
                f"unknown decay {self.decay!r}; valid values: {', '.join(DECAYS)}"
            )

    def decay_factor(self, step: int) -> float:
        """The LR multiplier after warmup: 1 at step 0, ``lrf`` at ``steps``."""
        x = min(step, self.steps) / self.steps
        lrf = self.final_lr_fraction
        if self.decay == "linear":
            return (1.0 - x) * (1.0 - lrf) + lrf
        return lrf + (1.0 - lrf) * (1.0 + math.cos(math.pi * x)) / 2.0

    def hyperparameters(self, step: int) -> tuple[float, float, float, float]:
        """(bias LR, decay LR, no_decay LR, momentum) for optimizer step
        `step` (0 = the first), float64 values rounded to float32."""
        target = self.lr * self.decay_factor(step)
        bias, other, mom = target, target, self.momentum
        if step < self.warmup_steps:
            w = step / self.warmup_steps  # np.interp(step, [0, nw], [a, b])
            bias = self.warmup_bias_lr + w * (target - self.warmup_bias_lr)
            other = w * target
            mom = self.warmup_momentum + w * (self.momentum - self.warmup_momentum)
        return tuple(float(np.float32(v)) for v in (bias, other, other, mom))

    def table(self) -> np.ndarray:
        """float32 ``(steps + 1, 4)``: `hyperparameters` of steps 0..steps
        (a step beyond ``steps`` uses the last row: the decay is held).
        16 bytes a step: 4.8 MB for 300 epochs of 1000 steps."""
        rows = [self.hyperparameters(s) for s in range(self.steps + 1)]
        return np.asarray(rows, np.float32)


def ema_decays(steps: int, decay: float = 0.9999, tau: float = 2000.0) -> np.ndarray:
    """float32 ``(steps + 1,)``: the weight EMA's decay after update ``u``.

    Ultralytics' ``ModelEMA``: ``d(u) = decay * (1 - exp(-u / tau))``, and
    after each applied optimizer step ``ema = d * ema + (1 - d) * weights``
    (``u`` counts the updates, 1 at the first; row 0 is ``d(0) = 0``). The
    ramp keeps the average from being dominated by the initial weights
    early on; an update beyond ``steps`` uses the last row. Computed in
    float64 and rounded once, so both frameworks average with the same
    numbers.

    Example:
      >>> [round(float(d), 4) for d in ema_decays(400, 0.99, 50)[[0, 50, 400]]]
      [0.0, 0.6258, 0.9897]
    """
    _check("decay", decay, 0.0, 1.0)
    _check("tau", tau, 0.0, open_low=True)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)):
        raise ValueError(f"steps must be an int, got {steps!r}")
    _check("steps", steps, 0, open_low=True)
    u = np.arange(steps + 1, dtype=np.float64)
    return (decay * (1.0 - np.exp(-u / tau))).astype(np.float32)


def for_config(config) -> Recipe:
    """The YOLO recipe of a detection run: no warmup for ``mode="naive"``.

    Args:
      config: a detection `Config` (its lr, steps, warmup and momentum fields).

    Example:
        >>> from examples.detection.config import Config
        >>> cfg = Config(steps=300)
        >>> naive = cfg.replace(mode="naive")
        >>> for_config(cfg).warmup_steps, for_config(naive).warmup_steps
        (100, 0)
    """
    return Recipe(
        steps=max(config.steps, 1),
        warmup_steps=config.warmup_steps if config.mode == "stable" else 0,
        lr=config.learning_rate,
        final_lr_fraction=config.final_lr_fraction,
        momentum=config.momentum,
        warmup_momentum=config.warmup_momentum,
        warmup_bias_lr=config.warmup_bias_lr,
        weight_decay=config.weight_decay,
        decay=config.lr_decay,
    )


def settings(recipe: Recipe) -> dict:
    """`recipe` as the keyword arguments of the ``yolo_optimizer`` s (no steps).

    Example:
        >>> sorted(settings(Recipe(steps=10)))[:2]
        ['decay', 'final_lr_fraction']
    """
    return {
        f.name: getattr(recipe, f.name)
        for f in dataclasses.fields(recipe)
        if f.name != "steps"
    }
