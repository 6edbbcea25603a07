"""The framework-free parts of checkpoints: the error a damaged checkpoint
gives, the mismatch report of `load_checkpoint` (the same texts in
`jaxstable.train` and `torchref.train`) and the fsyncs that make a finished
checkpoint survive a power loss, and the temporary names they are written
under."""

from __future__ import annotations

import abc
import itertools
import os
import threading
from typing import Any

from _stablecore.checks import check_int

# Mismatch lines listed in one error; the rest are counted.
MAX_MISMATCH_LINES = 12
# Numbers the temporary files of this process (see `temp_path`).
_SERIAL = itertools.count()
_SERIAL_LOCK = threading.Lock()
# What `temp_path` appends to a name, as a regular expression (for the
# cleanup of a killed write's leftovers; the older ``.tmp-<pid>`` included).
TEMP_SUFFIX = r"\.tmp-\d+(?:-\d+-\d+)?"


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


def temp_path(path: str) -> str:
    """A temporary name beside `path` that no other write uses at the same time.

    ``path.tmp-<pid>-<thread>-<serial>``: the pid tells processes apart, the
    thread id threads of one process, and the serial calls of one thread, so
    that two threads saving to one path never write into each other's file
    (a name unique per process let the second truncate the first's file and
    rename it away under it). Open it with ``"xb"`` so that a name already
    taken is an error, not a file shared.
    """
    with _SERIAL_LOCK:  # next() on a shared counter, from any thread
        serial = next(_SERIAL)
    return f"{path}.tmp-{os.getpid()}-{threading.get_ident()}-{serial}"


def fsync_dir(folder: str) -> None:
    """fsync a directory, so that a rename or a new entry in it is durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file and directory under `root`, and `root`'s parent.

    orbax renames a complete directory but does not fsync it: after a power
    loss the rename could survive while file contents did not.
    """
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)
    fsync_dir(os.path.dirname(root))


class ManagerBase(abc.ABC):
    """What both frameworks' ``CheckpointManager`` share: the settings
    (checked), the latest and the best step over the subclass's ``steps()``
    and ``score(step)`` (a float, or None when the checkpoint has no such
    metric), and the context manager over ``close()``.

    Example:
        >>> class Listed(ManagerBase):
        ...     def steps(self):
        ...         return [10, 20]
        ...     def score(self, step):
        ...         return {10: 0.5, 20: 0.7}[step]
        ...     def close(self):
        ...         pass
        >>> m = Listed("/tmp/ckpt", best_metric="loss")
        >>> m.latest_step(), m.best_step()
        (20, 10)
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int = 3,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool = True,
    ) -> None:
        check_manager_options(max_to_keep, best_metric, best_mode)
        self.directory = os.path.abspath(directory)
        self.max_to_keep = max_to_keep
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.async_save = bool(async_save)

    @abc.abstractmethod
    def steps(self) -> list[int]:
        """Each framework's own (see the class docstring)."""

    @abc.abstractmethod
    def score(self, step: int) -> float | None:
        """Each framework's own (see the class docstring)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Each framework's own (see the class docstring)."""

    def latest_step(self) -> int | None:
        """The highest global step on disk, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The step of the best checkpoint by `best_metric` (None without one;
        checkpoints without the metric, or with NaN, are passed over)."""
        if self.best_metric is None:
            return None
        scored = []
        for n in self.steps():
            value = self.score(n)
            if value is not None and value == value:  # not NaN
                scored.append((value if self.best_mode == "min" else -value, n))
        return min(scored)[1] if scored else None

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
