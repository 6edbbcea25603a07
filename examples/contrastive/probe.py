"""The naive contrastive run's probe: its check points, in one line.

Both losses mark the check points of :data:`CHECKS` (a
``diagnostics.CheckPoints`` of the library); `fit` logs them in every
record, and on the first non-finite step of a naive run the parts' ``probe``
says which came first and why (:func:`cause_note`), in the same words in
both frameworks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from examples.contrastive import data

# The check points the loss functions mark (`loss_jax`, `loss_torch`), in the
# order a step computes them; `gradients` and `parameters`, the other two of
# the contrastive report's six checks, are the step's own `grad_norm` and
# `finite` metrics.
CHECKS = ("inputs", "image_emb", "text_emb", "logits", "loss")


def cause_note(checks_line: str, first: str | None, bad_rows, empty, batch) -> str:
    """The check points of a naive run's first non-finite step, in one line.

    Args:
      checks_line: the framework's ``diagnostics.format_checks`` of the
        step's ``aux["checks"]`` (the same text in both).
      first: the first non-finite point (``aux["checks"].non_finite()[0]``),
        or None.
      bad_rows: caption embeddings of the batch with a non-finite entry.
      empty: captions of the batch with no token.
      batch: pairs in the batch.

    Example:
        >>> line = ("inputs finite (max|x| 1), image_emb finite (max|x| 1), "
        ...         "text_emb NON-FINITE, logits NON-FINITE, loss NON-FINITE; "
        ...         "first non-finite: text_emb")
        >>> print(cause_note(line, "text_emb", 1, 1, 32))
        ... # doctest: +NORMALIZE_WHITESPACE
        Cause observed: check points of the step, in order: inputs finite
        (max|x| 1), image_emb finite (max|x| 1), text_emb NON-FINITE, logits
        NON-FINITE, loss NON-FINITE; first non-finite: text_emb (1 of 32 caption
        embeddings; 1 caption(s) of the batch have no token: the masked mean is
        0 / 0).
    """
    text = "Cause observed: check points of the step, in order: " + checks_line
    if first is None:
        return text + " in the loss: the gradients or the update broke."
    if first == "text_emb":
        text += (
            f" ({bad_rows} of {batch} caption embeddings; {empty} caption(s) of the "
            "batch have no token: the masked mean is 0 / 0)"
        )
    return text + "."


def note(diagnostics: Any, checks: Any, bad_rows: int, empty: int, batch: int) -> str:
    """`cause_note` of a ``CheckPoints``, with its framework's ``diagnostics``."""
    bad = checks.non_finite()
    line = diagnostics.format_checks(checks)
    return cause_note(line, bad[0] if bad else None, bad_rows, empty, batch)


def empty_captions(tokens: Any) -> int:
    """How many captions of a batch have no token.

    Example:
        >>> empty_captions(np.array([[3, 0], [0, 0]]))
        1
    """
    return int((np.asarray(tokens) != data.PAD).sum(axis=1).__eq__(0).sum())
