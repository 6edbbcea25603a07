"""Held-out loss and bits per byte, from the summed negative log-likelihood.

Both frameworks sum ``-log p(next byte)`` (nats, float32 log-softmax) over
the fixed held-out windows and hand the sum and the count here: the mean is
the held-out loss, divided by ln 2 the bits per byte (a uniform guess is 8,
the unigram frequencies of this corpus give 4.5).
"""

from __future__ import annotations

import math

METRICS = ("bits_per_byte", "heldout_loss")


def scores(nll_sum: float, count: int) -> dict[str, float]:
    """``{"bits_per_byte", "heldout_loss"}`` of a summed NLL over `count` bytes.

    nan for both when the sum is not finite (a broken model has no loss to
    report).

    Example:
        >>> s = scores(8 * math.log(2) * 10, 10)
        >>> round(s["bits_per_byte"], 6), round(s["heldout_loss"], 4)
        (8.0, 5.5452)
        >>> scores(float("inf"), 10)["bits_per_byte"]
        nan
    """
    if count <= 0:
        raise ValueError(f"count must be > 0, got {count}")
    if not math.isfinite(nll_sum):
        return dict.fromkeys(METRICS, float("nan"))
    loss = nll_sum / count
    return {"bits_per_byte": loss / math.log(2.0), "heldout_loss": loss}
