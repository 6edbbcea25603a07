"""One writer per checkpoint directory: the lock `fit` takes on it.

Framework-free: `jaxstable.train.fit` and `torchref.train.fit` both take it.

The lock is the file ``DIRECTORY/.fit.lock`` holding the owner's pid, host
and process start time (JSON), held with ``flock``: the kernel drops it when
the process dies, so a killed run never blocks the next one. Where the
filesystem has no ``flock`` (some network filesystems), the file's content
decides instead: a lock whose pid is dead on this host (or was reused by a
newer process) is stale and taken over; one from another host is refused
(it cannot be checked from here).
"""

from __future__ import annotations

import errno
import json
import os
import socket
from typing import Any

LOCK_NAME = ".fit.lock"
# Directories locked by this process: its own checkpoint manager may still
# clean them (the lock is held by this process, not by another run).
_HELD: set[str] = set()
# flock errors that mean "not supported here", not "held".
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _start_time(pid: int) -> str | None:
    """The start time of `pid` (clock ticks since boot, /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            # Field 22; the command name (field 2) may hold spaces, so count
            # from its closing parenthesis.
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _me() -> dict[str, Any]:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "start": _start_time(pid)}


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the process named by a lock's content may still hold it."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname():
        return True  # another machine's process cannot be checked from here
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    started = holder.get("start")
    return started is None or started == _start_time(pid)


def _flock(fd: int) -> bool | None:
    """Takes the flock of `fd`: True, False if held elsewhere, None if the
    filesystem (or platform) has none."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return None
        raise
    return True


def _content(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        holder = json.loads(os.read(fd, 4096) or b"{}")
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


class DirectoryLock:
    """The exclusive lock of one checkpoint directory (`acquire`, `release`)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock, or raises RuntimeError naming the run holding it."""
        os.makedirs(self.directory, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                got = _flock(fd)
                holder = _content(fd)
                if got is False or (got is None and holder and _alive(holder)):
                    raise RuntimeError(self._refusal(holder))
                # A holder that released (and removed the file) between our
                # open and our flock leaves us a lock on a removed file.
                if got and not _same_file(fd, self.path):
                    os.close(fd)
                    continue
                os.ftruncate(fd, 0)
                os.lseek(fd, 0, os.SEEK_SET)
                os.write(fd, json.dumps(_me()).encode())
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            _HELD.add(self.directory)
            return

    def release(self) -> None:
        """Removes the lock file (while still holding it) and lets go."""
        if self._fd is None:
            return
        _HELD.discard(self.directory)
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def _refusal(self, holder: dict[str, Any]) -> str:
        who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
        return (
            f"checkpoint_dir {self.directory!r} is in use by another run ({who}): "
            "two runs writing one directory would delete each other's "
            "checkpoints. Wait for that run to end, or pass another "
            f"checkpoint_dir (if no such run exists, delete {self.path!r})"
        )

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def locked_elsewhere(directory: str | os.PathLike) -> bool:
    """Whether another process (or another lock of this one) holds the
    directory: its manager must then leave the temporary files alone."""
    directory = os.path.abspath(directory)
    if directory in _HELD:
        return False
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False  # no lock file (or none readable): nobody holds it
    try:
        got = _flock(fd)
        if got is None:
            holder = _content(fd)
            return bool(holder) and _alive(holder)
        return not got
    finally:
        os.close(fd)  # drops the flock taken just to test it
