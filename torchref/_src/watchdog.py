"""`fit` under a process group: the ranks agree on a plan, and a failure on
one rank is named on the others."""

from __future__ import annotations

import os
from typing import Any

import torch

from torchref._src.checkpoint_manager import CheckpointManager
from torchref._src.checkpoint_sharded import is_sharded
from torchref._src.fit_report import NonFiniteError

_FAILED_KEY = "torchref.fit.failed."


class Group:
    """`fit` under a process group of more than one rank (DDP, FSDP2).

    Every rank takes the same path: the step's decision is global (the
    gradients are all-reduced, the loss agreed, see `TrainStep`); rank 0
    alone writes the log and the checkpoints (it holds the lock); a resume or
    a rollback to disk loads the one checkpoint rank 0 picks, on every rank;
    ``on_step`` stops every rank when it stops one. A rank that raises posts
    its rank, step and error in the process group's store; a rank whose
    collective then fails (the peer's process exited: at once; a peer that
    hangs: after the process group's ``timeout``) raises a RuntimeError
    naming them.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        on = dist.is_available() and dist.is_initialized()
        self.size = dist.get_world_size() if on else 1
        self.rank = dist.get_rank() if on else 0
        self.latest = None

    def plan(self, mgr, own_mgr, checkpoint_dir, resume, step):
        """One all-gather: the ranks agree on resuming and on rank 0's latest
        checkpoint (taken under its lock); the others open the directory to
        read it (under FSDP2 rank 0's, to write their shards there too, also
        when they were given none). Returns ``(manager, owned)``."""
        mine = {
            "resume": resume,
            "dir": checkpoint_dir is not None,
            "latest": None if mgr is None else mgr.latest_step(),
            "path": directory_of(checkpoint_dir),
        }
        every: list[Any] = [None] * self.size
        self.dist.all_gather_object(every, mine)
        resumes = sorted({p["resume"] for p in every})
        if len(resumes) > 1 or (resume and not all(p["dir"] for p in every)):
            raise ValueError(
                "under a process group every rank calls fit with the same resume "
                "and, to resume, the same checkpoint_dir (rank 0 writes it, every "
                "rank reads it); got "
                + ", ".join(
                    f"rank {r}: resume={p['resume']}, checkpoint_dir "
                    f"{'given' if p['dir'] else 'None'}"
                    for r, p in enumerate(every)
                )
            )
        paths = {p["path"] for p in every} - {None}
        if is_sharded(step) and len(paths) > 1:
            raise ValueError(
                "under FSDP2 every rank writes its shards into one checkpoint_dir "
                "(rank 0's; give the others the same one or None), got "
                + ", ".join(f"rank {r}: {p['path']}" for r, p in enumerate(every))
            )
        self.latest = every[0]["latest"]
        if self.rank != 0 and checkpoint_dir is not None:
            given = isinstance(checkpoint_dir, CheckpointManager)
            return (checkpoint_dir if given else CheckpointManager(checkpoint_dir)), (
                not given
            )
        if self.rank != 0 and every[0]["path"] is not None and is_sharded(step):
            return CheckpointManager(every[0]["path"]), True
        return mgr, own_mgr

    def latest_step(self, mgr):
        """Rank 0's latest checkpoint step (taken in `plan`) or this one's."""
        return self.latest if self.size > 1 else mgr.latest_step()

    def restore(self, mgr, step, **kwargs):
        """`CheckpointManager.restore` of the checkpoint rank 0 restores
        (under FSDP2 every rank restores together: the manager agrees)."""
        if self.size == 1 or is_sharded(step):
            return mgr.restore(step, **kwargs)
        chosen: list[Any] = [None]
        error = None
        if self.rank == 0:
            try:
                _, info = mgr.restore(step, **kwargs)
                chosen[0] = info["step"]
            except Exception as e:  # told to the others, then raised
                error = e
        self.dist.broadcast_object_list(chosen, src=0)
        if error is not None:
            raise error
        if chosen[0] is None:
            raise RuntimeError(
                "rank 0 could not restore a checkpoint (its error is on rank 0)"
            )
        if self.rank == 0:
            return step, info
        return mgr.restore(step, chosen[0], **kwargs)

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a broadcast; `obj` itself with one
        rank)."""
        if self.size == 1:
            return obj
        got = [obj]
        self.dist.broadcast_object_list(got, src=0)
        return got[0]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is True on some rank (a collective)."""
        if self.size == 1:
            return flag
        t = torch.tensor([float(flag)])
        self.dist.all_reduce(t)
        return bool(t.item() > 0)

    def _store(self):
        try:
            return self.dist.distributed_c10d._get_default_store()
        except Exception:  # no store to post to (a private torch API)
            return None

    def failed(self, error: BaseException, index: int) -> None:
        """Posts this rank's failure at step ``index``; if it is a collective
        that broke (a peer failed), raises the error naming the peer."""
        if self.size == 1 or isinstance(error, NonFiniteError):
            return  # NonFiniteError: raised on every rank at the same step
        store = self._store()
        if store is None:
            return
        collective = isinstance(error, self.dist.DistError) or (
            isinstance(error, RuntimeError) and "gloo" in str(error).lower()
        )
        text = f"step {index}: {type(error).__name__}: {str(error)[:300]}"
        try:
            if not collective:
                store.set(f"{_FAILED_KEY}{self.rank}", text)
                return
            peers = []
            for r in range(self.size):
                key = f"{_FAILED_KEY}{r}"
                if r != self.rank and store.check([key]):
                    peers.append(f"rank {r} failed at {store.get(key).decode()}")
        except Exception:  # the store itself is gone (rank 0 died)
            peers = []
        why = (
            "; ".join(peers)
            if peers
            else "a peer rank died, raised outside fit or did not join the "
            "collective within the process group's timeout "
            "(init_process_group(timeout=...))"
        )
        raise RuntimeError(
            f"fit on rank {self.rank} of {self.size} stopped at step {index}: a "
            f"collective failed because {why}"
        ) from error


def directory_of(checkpoint_dir) -> str | None:
    """The absolute directory of `checkpoint_dir` (a path or a manager)."""
    if checkpoint_dir is None:
        return None
    if isinstance(checkpoint_dir, CheckpointManager):
        return checkpoint_dir.directory
    return os.path.abspath(checkpoint_dir)
