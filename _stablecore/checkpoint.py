"""The framework-free parts of checkpoints: the error a damaged checkpoint
gives and the mismatch report of `load_checkpoint` (the same texts in
`jaxstable.train` and `torchref.train`)."""

from __future__ import annotations

import os
from typing import Any

from _stablecore.checks import check_int

# Mismatch lines listed in one error; the rest are counted.
MAX_MISMATCH_LINES = 12


class CorruptCheckpoint(ValueError):
    """A checkpoint that cannot be read back as saved (truncated, damaged)."""


def raise_mismatches(path: Any, lines: list[str]) -> None:
    if not lines:
        return
    more = len(lines) - MAX_MISMATCH_LINES
    shown = lines[:MAX_MISMATCH_LINES] + (
        [f"  ... and {more} more"] if more > 0 else []
    )
    raise ValueError(
        f"checkpoint {os.fspath(path)!r} does not match the target "
        f"({len(lines)} leaf/leaves differ):\n" + "\n".join(shown) + "\nbuild the "
        "target with the model, optimizer and dtypes the checkpoint was saved with"
    )


def check_manager_options(max_to_keep: Any, best_metric: Any, best_mode: Any) -> None:
    """The options of a `CheckpointManager`, with the messages of both."""
    check_int("max_to_keep", max_to_keep, 1)
    if best_metric is not None and not isinstance(best_metric, str):
        raise TypeError(f"best_metric must be None or a str, got {best_metric!r}")
    if best_mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
