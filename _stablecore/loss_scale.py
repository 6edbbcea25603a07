"""The framework-free parts of the loss scales: how jmp's ``factor`` and
GradScaler's growth and backoff factors combine (the same rules and messages
in `jaxstable.loss_scale` and `torchref.loss_scale`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def resolve_factors(
    factor: Any, growth: Any, backoff: Any, factor_value: Callable[..., float]
) -> tuple[float, float]:
    """(growth_factor, backoff_factor) from jmp's ``factor`` and/or
    GradScaler's two. ``factor_value(name, value, valid)`` reads one as a
    Python float (each framework knows its number types)."""
    if factor is not None:
        f = factor_value("factor", factor, "a finite number > 1")
        if not (math.isfinite(f) and f > 1):
            raise ValueError(f"factor must be a finite number > 1, got {factor!r}")
    if growth is None:
        growth = 2.0 if factor is None else f
    g = factor_value("growth_factor", growth, "a finite number > 1")
    if not (math.isfinite(g) and g > 1):
        raise ValueError(f"growth_factor must be a finite number > 1, got {growth!r}")
    if factor is not None and f != g:
        raise ValueError(
            f"factor={f!r} and growth_factor={g!r} disagree: factor is jmp's name "
            "for the growth factor; pass one of them"
        )
    if backoff is None:
        backoff = 0.5 if factor is None else 1.0 / f
    b = factor_value("backoff_factor", backoff, "a number with 0 < backoff < 1")
    if not 0 < b < 1:
        raise ValueError(
            f"backoff_factor must be a number with 0 < backoff_factor < 1, "
            f"got {backoff!r}"
        )
    return g, b
