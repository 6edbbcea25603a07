"""The naive OCR run's probe: the observed cause of its first non-finite step.

The harness calls the parts' ``probe`` on the batch of the first non-finite
step of a naive run, from the state before it; both frameworks measure the
step function's overflow and say it in the same words (:func:`overflow_note`).
"""

from __future__ import annotations

import numpy as np


def overflow_note(diff: np.ndarray, exp_inf: np.ndarray, k: float, dtype: str) -> str:
    """The observed cause of a naive run's NaN gradients, in one line.

    Args:
      diff: ``P - T`` per pixel, as the naive step function saw it.
      exp_inf: where ``exp(-k (P - T))`` was inf in the compute dtype.
      k: the step function's amplification.
      dtype: the compute dtype's name.

    Example:
        >>> d = np.array([-0.5, 0.1, 0.0])
        >>> print(overflow_note(d, np.array([True, False, False]), 50.0, "float16"))
        ... # doctest: +NORMALIZE_WHITESPACE
        Cause observed: on this step's batch, exp(-k (P - T)) of the step
        function reciprocal(1 + exp(-k (P - T))), k=50, was inf in float16 at 1 of
        3 pixels (P - T down to -0.500; float16's exp overflows above 11.09, i.e.
        once P - T < -0.2218): there its backward is 0 * inf = NaN.
    """
    limit = float(np.log(float(np.finfo(np.float16).max)))
    limit = limit if dtype == "float16" else 88.72
    n = int(np.sum(exp_inf))
    return (
        f"Cause observed: on this step's batch, exp(-k (P - T)) of the step function "
        f"reciprocal(1 + exp(-k (P - T))), k={k:g}, was inf in {dtype} at {n} of "
        f"{diff.size} pixels (P - T down to {float(np.min(diff)):.3f}; {dtype}'s exp "
        f"overflows above {limit:.2f}, i.e. once P - T < {-limit / k:.4f}): there "
        "its backward is 0 * inf = NaN."
    )
