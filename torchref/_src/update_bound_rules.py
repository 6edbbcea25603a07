"""The update rules `update_bound` proves: SGD, Adam and AdamW, case by case.

Each rule bounds, from a bound ``m`` on every gradient entry and bounds
``(a1, a2)`` on a parameter's state, the state after one step (``grow``) and
whether every value the step computes stays below `SAFE` (``fits``). The
twin of the JAX interval rules (`jaxstable._src.update_bound_rules`), which
read the optimizer's traced program instead of its class.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PROVABLE", "SAFE", "rule"]


# An update whose every intermediate and step is below 2**100 in magnitude
# cannot overflow a float32 parameter: p + d with |p| <= 3.4e38 and |d| <
# 2**103 (half a unit in the last place of float32's largest binade) rounds
# to at most float32's max. 8x of margin for the rounding of the bounds.
SAFE = 2.0**100
PROVABLE = {
    torch.optim.SGD: "sgd",
    torch.optim.Adam: "adam",
    torch.optim.AdamW: "adam",
}


def _number(x: Any, lo: float, hi: float) -> bool:
    """A python number in [lo, hi] (a tensor hyper-parameter is not proved)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and lo <= x <= hi


def _sgd_rule(group: dict[str, Any], m: float):
    lr, mu = group["lr"], group.get("momentum", 0)
    damp = group.get("dampening", 0)
    if group.get("weight_decay") != 0 or not (
        _number(mu, 0.0, SAFE) and _number(damp, -SAFE, SAFE)
    ):
        return None

    def grow(a1: float, a2: float) -> tuple[float, float]:
        # The first step's buffer is the gradient; |1 - d| <= 1 + |d|.
        return (max(a1, mu * a1 + (1 + abs(damp)) * m) if mu else 0.0), 0.0

    def fits(a1: float, a2: float) -> bool:
        n1 = grow(a1, a2)[0]
        return n1 <= SAFE and lr * (m + n1) <= SAFE  # Nesterov's g + mu * buf

    return grow, fits


def _adam_rule(group: dict[str, Any], m: float):
    lr, eps, wd = group["lr"], group.get("eps"), group.get("weight_decay")
    b1, b2 = (*group.get("betas", ()), None, None)[:2]
    if group.get("capturable") or not (
        _number(b1, 0.0, 1 - 1e-6)
        and _number(b2, 0.0, 1 - 1e-6)
        and _number(eps, 2.0**-100, SAFE)
        and m <= 2.0**50
    ):
        return None
    decoupled = group.get("decoupled_weight_decay", False)
    if not (wd == 0 or (decoupled and _number(lr * wd, 0.0, 1.0))):
        return None

    def grow(a1: float, a2: float) -> tuple[float, float]:
        # Convex blends: |m1'| <= b1 * a1 + (1 - b1) * m, at most max(a1, m)
        # in exact arithmetic. Twice the gradient's bound leaves room for
        # float32's rounding (2 ulps a step) without compounding: from a1 >=
        # 2 * m the blend is at most a1 * (1 - (1 - b1) / 2), which the
        # rounding cannot lift past a1 while 1 - b1 >= 1e-6; below it, at
        # most 2 * m. So the bounds do not grow with the number of steps
        # (a factor of 1.001 a step did: no proof after ~55k steps).
        return max(a1, 2.0 * m), max(a2, 2.0 * m * m)

    def fits(a1: float, a2: float) -> bool:
        n1, n2 = grow(a1, a2)
        step = lr * n1 / ((1.0 - b1) * eps)  # lr / (1 - b1**t) * m1 / eps
        return max(step, n1 / eps, n2 / (1.0 - b2)) <= SAFE

    return grow, fits


def rule(kind: str, group: dict[str, Any], m: float):
    """``(grow, fits)`` of one parameter group under a bound `m` on every
    |gradient| entry: ``grow(a1, a2)`` bounds the state after the step from
    bounds before it, ``fits(a1, a2)`` says every value the step computes
    stays below `SAFE`; None where nothing is proved (see `UpdateBound`)."""
    if not _number(group.get("lr"), 0.0, SAFE) or group.get("differentiable"):
        return None
    return (_sgd_rule if kind == "sgd" else _adam_rule)(group, m)
