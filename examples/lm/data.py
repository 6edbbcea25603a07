"""Byte-level text from the Python standard library's own sources (no download).

Numpy only: the same arrays feed the JAX and the torch runs.

Corpus: a FIXED list of :data:`FILES`, stdlib modules that are plain
``name.py`` files in every CPython 3.11 to 3.14 install (modules that became
packages, e.g. pathlib or zipfile, or were removed in 3.13 are left out), read
from the running interpreter's stdlib folder (``sysconfig.get_paths()
["stdlib"]``). Each file is read as bytes (a vocabulary of 256); the last
:data:`HELDOUT_FRACTION` of EVERY file is held out (a split by file position,
so both splits see every module's style) and the pieces are joined with
``b"\\n\\n"`` in list order. The text differs between interpreter versions
(the files are edited upstream): :func:`load_corpus` reports the sha256 of
both splits; on one interpreter everything is bit-for-bit deterministic.

Batches: :func:`train_windows` draws random windows with
``np.random.default_rng([seed, step])``: a function of (seed, step) alone,
so a resumed run sees the same data and JAX and torch read the same bytes.
The held-out windows (:func:`heldout_windows`) are fixed and evenly spaced.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig

import numpy as np

# 59 modules, 2.8 MB on CPython 3.11.7; plain .py files in 3.11 to 3.14.
FILES = (
    "argparse", "ast", "base64", "bdb", "bisect", "calendar", "codecs",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "difflib",
    "dis", "doctest", "enum", "fractions", "ftplib", "functools", "gettext",
    "glob", "gzip", "heapq", "hmac", "imaplib", "inspect", "ipaddress",
    "locale", "mailbox", "operator", "optparse", "os", "pdb", "pickle",
    "pickletools", "platform", "plistlib", "poplib", "pprint", "pydoc",
    "queue", "random", "shlex", "shutil", "smtplib", "socket", "ssl",
    "statistics", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "tokenize", "traceback", "typing", "uuid", "weakref",
    "_pyio",
)  # fmt: skip
HELDOUT_FRACTION = 0.1
VOCAB = 256
SEP = b"\n\n"


def stdlib_dir() -> str:
    """The running interpreter's standard library folder.

    Example:
        >>> os.path.isfile(os.path.join(stdlib_dir(), "argparse.py"))
        True
    """
    return sysconfig.get_paths()["stdlib"]


@functools.lru_cache(maxsize=2)
def load_corpus(root: str | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """``(train, heldout, info)``: uint8 arrays of bytes and a description.

    Args:
      root: the folder holding the files (default: :func:`stdlib_dir`).

    Returns:
      The train and held-out bytes (read-only arrays, cached per root) and
      ``info``: ``root``, ``files``, ``train_bytes``, ``heldout_bytes``,
      ``train_sha256``, ``heldout_sha256`` (the first 16 hex digits).

    Raises:
      FileNotFoundError: a file of :data:`FILES` is missing under `root`
        (the message names it and the folder).

    Example:
        >>> train, held, info = load_corpus()
        >>> info["files"], train.dtype.name, len(held) < len(train) // 5
        (59, 'uint8', True)
        >>> load_corpus("/nonexistent")
        Traceback (most recent call last):
        ...
        FileNotFoundError: corpus file argparse.py not found under '/nonexistent'; ...
    """
    root = stdlib_dir() if root is None else root
    train, held = [], []
    for name in FILES:
        path = os.path.join(root, name + ".py")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"corpus file {name}.py not found under {root!r}; the lm task "
                f"reads {len(FILES)} plain .py files of the CPython standard "
                "library (data.FILES) from the running interpreter's stdlib "
                "folder: is it a full CPython install?"
            )
        with open(path, "rb") as f:
            text = f.read()
        cut = int(len(text) * (1.0 - HELDOUT_FRACTION))
        train.append(text[:cut])
        held.append(text[cut:])
    tr, he = SEP.join(train), SEP.join(held)
    info = {
        "root": root,
        "files": len(FILES),
        "train_bytes": len(tr),
        "heldout_bytes": len(he),
        "train_sha256": hashlib.sha256(tr).hexdigest()[:16],
        "heldout_sha256": hashlib.sha256(he).hexdigest()[:16],
    }
    out = []
    for b in (tr, he):
        a = np.frombuffer(b, dtype=np.uint8).copy()
        a.flags.writeable = False  # cached: shared by every caller
        out.append(a)
    return out[0], out[1], info


def _windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> dict:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    win = data[idx].astype(np.int32)
    return {"inputs": win[:, :-1], "targets": win[:, 1:]}


def train_windows(
    data: np.ndarray, step: int, *, batch: int, seq_len: int, seed: int
) -> dict[str, np.ndarray]:
    """``{"inputs", "targets"}`` int32 [batch, seq_len]: random windows of `data`.

    A function of (`seed`, `step`) alone; ``targets`` is ``inputs`` shifted by
    one byte.

    Example:
        >>> d = np.arange(100, dtype=np.uint8)
        >>> b = train_windows(d, 3, batch=2, seq_len=5, seed=0)
        >>> bool((b["targets"][:, :-1] == b["inputs"][:, 1:]).all())
        True
        >>> c = train_windows(d, 3, batch=2, seq_len=5, seed=0)
        >>> bool((b["inputs"] == c["inputs"]).all())
        True
    """
    if len(data) < seq_len + 2:
        raise ValueError(f"data has {len(data)} bytes, fewer than seq_len + 2")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
    return _windows(data, starts, seq_len)


def heldout_windows(
    data: np.ndarray, *, windows: int, seq_len: int
) -> dict[str, np.ndarray]:
    """Fixed, evenly spaced ``{"inputs", "targets"}`` [windows, seq_len].

    Example:
        >>> d = np.arange(100, dtype=np.uint8)
        >>> heldout_windows(d, windows=3, seq_len=4)["inputs"][:, 0].tolist()
        [0, 47, 95]
    """
    if len(data) < seq_len + 2:
        raise ValueError(f"data has {len(data)} bytes, fewer than seq_len + 2")
    starts = np.linspace(0, len(data) - seq_len - 1, windows).astype(np.int64)
    return _windows(data, starts, seq_len)
