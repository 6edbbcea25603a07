"""The bad-batch list of a run: data positions `fit` skips without running
them, kept beside the checkpoints (standard library only, the same file for
`jaxstable.train.fit` and `torchref.train.fit`).

The file is ``<checkpoint directory>/bad_batches.json``::

    {"format": "bad_batches", "version": 1,
     "batches": [{"position": 3, "reason": "reproduced", "phase": "input",
                  "path": "x", "step": 3},
                 {"position": 7, "reason": "rewound", "rewind_from": 8},
                 12]}

``position`` is the batch's index in the run's data (the record's ``step``
of the step that ran it). `fit` adds an entry for every located non-finite
step that reproduced (``"reproduced"``: not a gradient overflow the loss
scale handles) and for every batch a rewind threw away (``"rewound"``),
and writes the file at once (atomically: a temporary file, fsync, rename).
A user may add entries, as a bare position or a dict with ``position``, and
remove them; every `fit` on the directory reads the file when it starts.
"""

from __future__ import annotations

import json
import os
from typing import Any

from _stablecore.checkpoint import temp_path

FILE = "bad_batches.json"
FORMAT = "bad_batches"
VERSION = 1


def file_in(directory: str | os.PathLike | None) -> str | None:
    """The list's path in a checkpoint directory (None: no directory)."""
    return None if directory is None else os.path.join(os.fspath(directory), FILE)


def _entry(item: Any, where: str) -> dict[str, Any]:
    entry = {"position": item} if not isinstance(item, dict) else dict(item)
    position = entry.get("position")
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise ValueError(
            f"{where}: each entry must be a data position (an int >= 0) or a "
            f"dict with one as 'position', got {item!r}"
        )
    return entry


def read(path: str | None) -> list[dict[str, Any]]:
    """The entries of the list at `path` ([] when there is none)."""
    if path is None or not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not a bad-batch list (JSON: {e})") from None
    items = data.get("batches") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ValueError(
            f"{path}: a bad-batch list is a JSON list of positions, or an object "
            f"whose 'batches' is one, got {type(items).__name__}"
        )
    return [_entry(item, path) for item in items]


def write(path: str, entries: list[dict[str, Any]]) -> None:
    """Writes the list atomically (a reader sees the old file or the new)."""
    data = {
        "format": FORMAT,
        "version": VERSION,
        "batches": sorted(entries, key=lambda e: e["position"]),
    }
    tmp = temp_path(path)
    with open(tmp, "x", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def given_positions(skip_batches: Any, where: str = "fit") -> frozenset[int]:
    """``skip_batches`` (None or positions) as a set, checked."""
    if skip_batches is None:
        return frozenset()
    name = f"{where}: skip_batches"
    if isinstance(skip_batches, str | bytes) or not hasattr(skip_batches, "__iter__"):
        raise TypeError(
            f"{name} must be None or data positions (ints), got {skip_batches!r}"
        )
    return frozenset(_entry(p, name)["position"] for p in skip_batches)


class BadBatches:
    """The positions a run skips: the list file's and those given.

    Args:
      path: the list file (None: nothing is written: no checkpoint
        directory, or a process that does not write).
      entries: the file's entries when the run started.
      given: `Checkpointing`'s ``skip_batches``.
      keeps: whether the run keeps a list (it has a checkpoint directory,
        on process 0 / rank 0): else `add` adds nothing.
      skips: whether the file's entries are skipped too
        (``Checkpointing(skip_listed=True)``).

    Example:
      >>> from _stablecore.bad_data import BadBatches
      >>> bad = BadBatches(None, [{"position": 3, "reason": "reproduced"}], {5})
      >>> 3 in bad, 4 in bad, 5 in bad
      (True, False, True)
      >>> bad.add([{"position": 4, "reason": "rewound"}, {"position": 3}])
      [3, 4]
      >>> [e["position"] for e in bad.entries]  # the first entry of each kept
      [3, 4]
    """

    def __init__(
        self, path: str | None, entries: list, given=frozenset(), keeps: bool = True,
        skips: bool = True,
    ):  # fmt: skip
        self.path, self.keeps, self.skips = path, keeps, skips
        self.entries = list(entries)
        listed = {e["position"] for e in self.entries} if skips else set()
        self.positions = listed | set(given)

    def __contains__(self, position: int) -> bool:
        return position in self.positions

    def add(self, new: list[dict[str, Any]]) -> list[int]:
        """Lists `new`'s positions: adds the entries whose position is not
        listed yet and writes the file; the positions of `new`, sorted
        (listed before or not: a step re-run after a resume says what the
        uninterrupted run said), [] when the run keeps no list."""
        if not self.keeps:
            return []
        listed = {e["position"] for e in self.entries}
        fresh = [e for e in new if e["position"] not in listed]
        fresh = list({e["position"]: e for e in fresh}.values())
        if fresh:
            self.entries += fresh
            if self.skips:
                self.positions |= {e["position"] for e in fresh}
            if self.path is not None:
                write(self.path, self.entries)
        return sorted({e["position"] for e in new})


def for_run(directory, given, writes: bool, skips: bool, shared=None) -> BadBatches:
    """The `BadBatches` of a run on checkpoint `directory` (None: none):
    the file's entries (skipped with `skips`), the positions `given`,
    written by this process when `writes`. `shared`: ``(entries, keeps)``
    as the writing process read them (torch ranks may have no directory of
    their own)."""
    path = file_in(directory)
    if writes and path is not None:  # a write a killed run left half done
        for name in os.listdir(directory):
            if name.startswith(FILE + ".tmp-"):
                os.remove(os.path.join(directory, name))
    entries, keeps = (read(path), path is not None) if shared is None else shared
    return BadBatches(path if writes else None, entries, given, keeps, skips)
