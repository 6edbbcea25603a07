"""Low-precision optimizer state and parameters: the shared tables and texts.

Both packages' `low_precision_adamw` read their options through these
validators, store moments with these limits, and report a stall with this
monitor, so the two cannot drift apart.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

# Storage dtypes for Adam's moments. bfloat16 has float32's exponent range
# (8 bits), so it is stored as is; float16 and the float8 formats have a far
# narrower range and are stored with a per-tensor scale (value / scale, the
# tensor's max |value| mapped onto the format's largest finite value).
STATE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
SCALED_DTYPES = ("float16", "float8_e4m3fn", "float8_e5m2")

# (largest finite, smallest normal) of each storage dtype. float8_e4m3fn has
# no infinity: its largest finite is 448, and a cast above it gives NaN in
# JAX but 448 in torch, so both packages clip to it before casting.
DTYPE_LIMITS = {
    "float32": (3.4028234663852886e38, 2.0**-126),
    "bfloat16": (3.3895313892515355e38, 2.0**-126),
    "float16": (65504.0, 2.0**-14),
    "float8_e4m3fn": (448.0, 2.0**-6),
    "float8_e5m2": (57344.0, 2.0**-14),
}

# How the float32 update reaches a parameter stored in a narrower dtype.
PARAM_UPDATES = ("nearest", "stochastic", "kahan")

# The per-step rounding statistics, in this order in both packages.
STAT_NAMES = ("lost_update", "lost_params", "lost_decay", "nu_underflow")


class RoundingStats(NamedTuple):
    """What rounding did to the latest applied step (float32 scalars).

    Attributes:
      lost_update: ``||applied - intended|| / ||intended||`` over all
        parameters (0 when nothing was intended). ``applied`` is what the
        stored parameter moved (``nearest``), what the parameter plus its
        compensation buffer moved (``kahan``), or the expected move
        (``stochastic``: unbiased, so only the float32 rounding of
        ``p + u`` remains). 1.0 means the whole update vanished: a stall.
      lost_params: the fraction of entries with a non-zero intended update
        whose (expected) applied update is exactly 0.
      lost_decay: the fraction of the weight decay ``lr * wd * |p|`` that
        fell on entries whose update vanished (decay below half an ulp
        rounds to nothing with round-to-nearest: bf16 weights never shrink).
      nu_underflow: the fraction of second-moment entries that underflowed
        their storage dtype (non-zero, below its smallest normal after the
        per-tensor scale); such an entry is stored as the smallest normal,
        never as 0, so it can only shrink the next update, never blow it up.

    Example:
      >>> from jaxstable.transforms import RoundingStats  # torchref: the same
      >>> RoundingStats(1.0, 1.0, 0.0, 0.0)._fields
      ('lost_update', 'lost_params', 'lost_decay', 'nu_underflow')
    """

    lost_update: Any
    lost_params: Any
    lost_decay: Any
    nu_underflow: Any


def dtype_name(value: Any) -> str:
    """The storage dtype's name from a string or a framework dtype
    (``jnp.bfloat16``, ``torch.bfloat16``, ``"bfloat16"``)."""
    if isinstance(value, str):
        return value
    name = getattr(value, "__name__", None) or str(value)
    return name.removeprefix("torch.").removeprefix("dtype(").strip("')")


def check_state_dtype(name: str, value: Any) -> str:
    """The validated dtype name of a moment's storage."""
    text = dtype_name(value)
    if text not in STATE_DTYPES:
        raise ValueError(
            f"{name} must be one of {STATE_DTYPES} (or the framework's dtype of "
            f"that name), got {value!r}"
        )
    return text


def check_param_update(value: Any) -> str:
    if value not in PARAM_UPDATES:
        raise ValueError(
            f"param_update must be one of {PARAM_UPDATES} (how the float32 "
            "update is rounded into lower-precision parameters), got "
            f"{value!r}"
        )
    return value


def check_hyper(name: str, value: Any, low: float, high: float | None) -> float:
    """A finite real hyper-parameter with ``low <= value`` (``< high``)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    ok = ok and math.isfinite(value) and low <= value
    ok = ok and (high is None or value < high)
    if not ok:
        upper = "" if high is None else f" and < {high}"
        raise ValueError(f"{name} must be a float >= {low}{upper}, got {value!r}")
    return float(value)


def stochastic_dtype_error(path: str, dtype: str) -> str:
    return (
        f"param_update='stochastic' rounds float32 into bfloat16 parameters "
        f"(float32 ones take the update as is), got {dtype} at {path}: use "
        "'kahan' or 'nearest' for it"
    )


class StallMonitor:
    """Warns once a run's lost-update fraction stays above a threshold.

    Feed it ``lost_update`` once per step (on the host: `fit` does, from the
    records); it returns a warning text the step the fraction has been above
    ``threshold`` for ``patience`` steps in a row, then stays quiet until the
    fraction drops below and the stall starts again.

    Example:
      >>> from jaxstable.transforms import StallMonitor  # torchref: the same
      >>> m = StallMonitor(threshold=0.5, patience=2)
      >>> m.update(0.9) is None
      True
      >>> print(m.update(0.9))  # doctest: +ELLIPSIS
      rounding lost more than 50% of the update for 2 steps in a row ...
    """

    def __init__(self, threshold: float = 0.5, patience: int = 50) -> None:
        self.threshold = check_hyper("threshold", threshold, 0.0, 1.0)
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an int >= 1, got {patience!r}")
        self.patience = patience
        self.run = 0

    def check(self, record: dict[str, Any]) -> None:
        """`update` with a `fit` record's ``lost_update`` (when it has one),
        the warning raised as a ``RuntimeWarning``."""
        if "lost_update" in record:
            message = self.update(record["lost_update"])
            if message is not None:
                warnings.warn(message, RuntimeWarning, stacklevel=3)

    def update(self, lost_update: float) -> str | None:
        self.run = self.run + 1 if lost_update > self.threshold else 0
        if self.run != self.patience:
            return None
        return (
            f"rounding lost more than {self.threshold:.0%} of the update for "
            f"{self.patience} steps in a row (latest {lost_update:.0%}): the "
            "parameters barely move. Use param_update='stochastic' or 'kahan', "
            "float32 parameters, or a larger learning rate"
        )
