"""Validators of options, one line each (the messages both packages give)."""

from __future__ import annotations

import math
from typing import Any


def check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    """One validator for every int option: ``name must be [None or ]an int >= m``."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = "None or " if optional else ""
        raise ValueError(f"{name} must be {none}an int >= {minimum}, got {value!r}")


def check_bool(name: str, value: Any, error: type[Exception] = TypeError) -> bool:
    """`value` if it is True or False; else `error` (fit raises TypeError, the
    transforms ValueError: each keeps the type it always raised)."""
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False, got {value!r}")
    return value


def check_callable(name: str, fn: Any) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be None or a callable, got {fn!r}")


def check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_needs(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# The counters are int32 (GradScaler's growth tracker too): a period or a
# hysteresis of 2**31 could never be reached.
INT32_LIMIT = 2**31


def check_count(name: str, value: Any, int_types: Any = int) -> None:
    """An int with 1 <= value < 2**31 (the counters are int32); `int_types`
    are the types accepted as ints (jaxstable adds numpy's)."""
    if isinstance(value, bool) or not isinstance(value, int_types):
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value}")
    if value >= INT32_LIMIT:
        raise ValueError(
            f"{name} must be < 2**31 (its counter is an int32 and would never "
            f"reach it), got {value}"
        )


def check_microbatches(microbatches: Any, int_types: Any = int) -> Any:
    """None, or an int >= 1 (`int_types`: what counts as an int)."""
    if microbatches is None:
        return None
    if isinstance(microbatches, bool) or not isinstance(microbatches, int_types):
        raise TypeError(
            "microbatches must be None or an int >= 1 (the number of equal "
            f"micro-batches the batch is split into), got {microbatches!r}"
        )
    if microbatches < 1:
        raise ValueError(
            "microbatches must be None or an int >= 1 (the number of equal "
            f"micro-batches the batch is split into), got {microbatches}"
        )
    return microbatches


def check_microbatch_drop(drop: Any, weight: Any, microbatches: Any) -> bool:
    """Validates ``drop_non_finite_microbatches`` and ``microbatch_weight``
    against ``microbatches`` (already checked); the same texts in both train
    steps. Returns ``drop`` as a bool."""
    if not isinstance(drop, bool):
        raise TypeError(
            f"drop_non_finite_microbatches must be True or False, got {drop!r}"
        )
    if drop and microbatches is None:
        raise ValueError(
            "drop_non_finite_microbatches=True needs microbatches=k (k >= 1): "
            "without micro-batches there is nothing to drop but the whole step"
        )
    if weight is not None and not callable(weight):
        raise TypeError(
            "microbatch_weight must be None or a callable taking a micro-batch "
            f"and returning its weight (e.g. its number of tokens), got {weight!r}"
        )
    if weight is not None and not drop:
        raise ValueError(
            "microbatch_weight is used only with drop_non_finite_microbatches=True "
            "(it weights the kept micro-batches); set that too, or leave "
            "microbatch_weight=None"
        )
    return drop


def _spike_int(name: str, value: Any, low: int, int_types: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int_types):
        raise TypeError(f"{name} must be an int >= {low}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value}")
    return int(value)


def _spike_float(
    name: str, value: Any, low: float, strict: bool, real_types: Any
) -> float:
    if isinstance(value, bool) or not isinstance(value, real_types):
        raise TypeError(f"{name} must be a finite float, got {value!r}")
    value = float(value)
    bad = not math.isfinite(value) or (value <= low if strict else value < low)
    if bad:
        op = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite float {op} {low}, got {value}")
    return value


def check_spike_args(
    window: Any,
    min_history: Any,
    threshold: Any,
    min_ratio: Any,
    int_types: Any = int,
    real_types: Any = (int, float),
) -> tuple[int, int, float, float]:
    """`skip_spikes`' options, validated and converted (`int_types` /
    `real_types`: what counts as an int / a float; jaxstable adds numpy's)."""
    window = _spike_int("window", window, 1, int_types)
    min_history = _spike_int("min_history", min_history, 1, int_types)
    if min_history > window:
        raise ValueError(
            f"min_history ({min_history}) must be <= window ({window}): the "
            "window holds at most `window` values, so spikes would never be "
            "checked"
        )
    threshold = _spike_float("threshold", threshold, 0.0, True, real_types)
    min_ratio = _spike_float("min_ratio", min_ratio, 1.0, False, real_types)
    return window, min_history, threshold, min_ratio
