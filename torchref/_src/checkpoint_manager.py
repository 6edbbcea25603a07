"""`CheckpointManager`: the checkpoints of one run, by global step (private)."""

from __future__ import annotations

import os
import re
import shutil
import threading
import warnings
from typing import Any

from _stablecore.checkpoint import TEMP_SUFFIX as _TEMP_SUFFIX
from _stablecore.checkpoint import CorruptCheckpoint as _CorruptCheckpoint
from _stablecore.checkpoint import ManagerBase
from _stablecore.checks import check_int as _check_int
from _stablecore.lock import locked_elsewhere
from torchref._src.checkpoint import load_into
from torchref._src.checkpoint_format import (
    DCP_FORMAT,
    DCP_HEADER,
    FORMAT,
    encode,
    peek_header,
    write_durably,
)
from torchref._src.checkpoint_sharded import gathered, is_sharded, save_dcp

__all__ = ["CheckpointManager"]

_NAME = re.compile(r"^step_(\d{8,})\.pt$")
_DCP_NAME = re.compile(r"^step_(\d{8,})\.dcp$")


class CheckpointManager(ManagerBase):
    """The checkpoints of one run in a directory, named by the run's global step.

    The mirror of `jaxstable.train.CheckpointManager`. Checkpoint n is the
    file ``directory/step_{n:08d}.pt`` (n: steps of the run done, not steps
    of one `fit` call), written as `save_checkpoint` does. After each save
    it keeps the last `max_to_keep` checkpoints up to that step and, with
    `best_metric`, also the best one by that metric. Only this manager's own
    checkpoints count and are deleted: an entry named like one that is not
    (a stray file or directory ``step_00000099.pt``) is left alone and
    takes no slot, and neither does a checkpoint past the step just saved
    (one a resume went back from). With `async_save` the state is
    serialised in memory at `save` (a copy: training may go on) and written
    by a background thread (the next save, `wait` or `close` waits for it).
    A crash mid-write leaves a ``.tmp-<pid>-<thread>-<n>`` file, which the next manager
    on the directory removes (unless a run holds the directory's lock, see
    `fit`).

    Under FSDP2 (more than one rank) checkpoint n is the directory
    ``directory/step_{n:08d}.dcp`` (`torch.distributed.checkpoint`, every
    rank writing its shards: `save` and `restore` are collectives there,
    every rank calls them on the same directory; the save is synchronous
    and rank 0 prunes). A crash leaves ``step_{n:08d}.dcp.partial``, removed
    the same way. Files and directories count alike, by step.

    `restore` takes the latest intact checkpoint: a truncated, damaged or
    foreign one (its sha256 differs, or it is no checkpoint file) gives a
    `RuntimeWarning` naming it and the one before it is tried. A checkpoint
    of another model, optimizer or loss scale raises the `load_checkpoint`
    ValueError.

    Args:
      directory: the run's checkpoint directory (created if missing).
      max_to_keep: int >= 1, how many of the latest checkpoints to keep.
      best_metric: None, or the key of the ``metrics`` passed to `save`
        (e.g. ``"eval['loss']"``) whose best checkpoint is kept too.
      best_mode: ``"min"`` or ``"max"``: which value of `best_metric` is best.
      async_save: write in a background thread.

    Example:
      >>> import tempfile, torch
      >>> from torchref import train
      >>> model = torch.nn.Linear(2, 1, bias=False)
      >>> s = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
      ...                     lambda m, b: m(b).sum())
      >>> with train.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2,
      ...                              best_metric="loss") as mgr:
      ...     for n, loss in [(10, 0.5), (20, 0.9), (30, 0.7)]:
      ...         with torch.no_grad():
      ...             _ = model.weight.fill_(float(n))
      ...         mgr.save(n, s, metrics={"loss": loss})
      ...     mgr.wait()
      ...     restored, info = mgr.restore(s)
      ...     print(mgr.steps(), mgr.best_step(), info, model.weight.tolist())
      [10, 20, 30] 10 {'step': 30, 'data_position': 30} [[30.0, 30.0]]
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
        super().__init__(
            directory,
            max_to_keep=max_to_keep,
            best_metric=best_metric,
            best_mode=best_mode,
            async_save=async_save,
        )
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        os.makedirs(self.directory, exist_ok=True)
        if not locked_elsewhere(self.directory):  # a killed save's leftovers
            for name in os.listdir(self.directory):
                if re.match(rf"^step_\d{{8,}}\.pt{_TEMP_SUFFIX}$", name):
                    os.remove(os.path.join(self.directory, name))
                elif re.match(r"^step_\d{8,}\.dcp\.partial$", name):
                    shutil.rmtree(os.path.join(self.directory, name))

    def _path(self, step: int) -> str:
        """Checkpoint `step`'s entry: its sharded directory if there is one,
        else its file."""
        sharded = os.path.join(self.directory, f"step_{step:08d}.dcp")
        if os.path.isdir(sharded):
            return sharded
        return os.path.join(self.directory, f"step_{step:08d}.pt")

    def steps(self) -> list[int]:
        """The global steps of the checkpoints on disk, ascending."""
        names = os.listdir(self.directory)
        found = (_NAME.match(n) or _DCP_NAME.match(n) for n in names)
        return sorted({int(m.group(1)) for m in found if m})

    def score(self, step: int) -> float | None:
        """`best_metric` of checkpoint `step` from its header, or None (a
        value that is not a number counts as none)."""
        header = peek_header(_header_file(self._path(step)))
        value = (header.get("metrics") or {}).get(self.best_metric)
        return float(value) if isinstance(value, int | float) else None

    def save(
        self,
        step: int,
        train_step: Any,
        *,
        data_position: int | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> None:
        """Saves `train_step`'s state as checkpoint `step` (replacing one of that step).

        Args:
          step: int >= 0, the run's global step.
          train_step: the `TrainStep` (or object with ``state_dict``) to save.
          data_position: batches of the run consumed (default: `step`).
          metrics: a dict holding `best_metric` (other keys are ignored).
        """
        self.save_for_fit(step, train_step, data_position, metrics)

    def save_for_fit(
        self,
        step: int,
        train_step: Any,
        data_position: int | None = None,
        metrics: dict[str, Any] | None = None,
        fit_state: dict | None = None,
        snapshot: dict | None = None,
        fit_extras: dict | None = None,
    ) -> None:
        """`save`, plus what `fit` keeps: its NaN-policy state, rollback
        snapshot and extras (schedulers, data RNG), all under the checksum.
        `fit` calls it; use `save`."""
        _check_int("step", step, 0)
        self.wait()
        kept = None
        if self.best_metric is not None and metrics and self.best_metric in metrics:
            kept = {self.best_metric: float(metrics[self.best_metric])}
        position = step if data_position is None else int(data_position)
        if is_sharded(train_step):
            # Every rank writes its shards, synchronously (a collective);
            # rank 0 prunes.
            import torch.distributed as dist

            path = os.path.join(self.directory, f"step_{step:08d}.dcp")
            save_dcp(
                path, train_step, step, position, kept, fit_state, snapshot,
                fit_extras,
            )  # fmt: skip
            if dist.get_rank() == 0:
                file = os.path.join(self.directory, f"step_{step:08d}.pt")
                if os.path.isfile(file):  # the same step, saved unsharded
                    os.remove(file)
                self._prune(step)
            return
        data = encode(train_step, step, position, kept, fit_state, snapshot, fit_extras)
        path = os.path.join(self.directory, f"step_{step:08d}.pt")
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)  # a stray directory of that name (a file is replaced)

        def write() -> None:
            try:
                write_durably(path, data)
                self._prune(step)
            except BaseException as e:  # re-raised by wait()
                self._error = e

        if self.async_save:
            self._thread = threading.Thread(target=write, daemon=True)
            self._thread.start()
        else:
            write()
            self._raise_error()

    def _prune(self, latest: int) -> None:
        """Deletes this manager's checkpoints up to `latest` beyond the last
        `max_to_keep` (and the best one)."""
        ours = [n for n in self.steps() if n <= latest and _is_ours(self._path(n))]
        keep = set(ours[-self.max_to_keep :]) | {self.best_step()}
        for n in ours:
            if n not in keep:
                path = self._path(n)
                if os.path.isdir(path):  # a sharded checkpoint
                    shutil.rmtree(path)
                else:
                    os.remove(path)

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def wait(self) -> None:
        """Waits for a background save to finish (re-raising its error)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_error()

    def restore(
        self, train_step: Any, step: int | None = None, *, restore_rng: bool = True
    ) -> tuple[Any, dict]:
        """Loads the latest intact checkpoint (or checkpoint `step`) into `train_step`.

        Returns:
          ``(train_step, info)`` with ``info = {"step": n, "data_position": p}``;
          for a checkpoint written by `fit`, also ``"fit_state"`` (its
          NaN-policy state) and, when it saved one, ``"snapshot"`` (its
          rollback snapshot, a ``state_dict`` for this `train_step`) and
          ``"fit_extras"`` (its schedulers' states, the RNG state its data
          was iterated with).

        Raises:
          FileNotFoundError: no intact checkpoint (each damaged one warned of).
          ValueError: the checkpoint does not match `train_step` (see
            `load_checkpoint`), or `step` is given and damaged.
        """
        self.wait()
        candidates = [step] if step is not None else self.steps()[::-1]
        collective = is_sharded(train_step)
        if collective:  # every rank tries rank 0's list, in its order
            import torch.distributed as dist

            told = [candidates]
            dist.broadcast_object_list(told, src=0)
            candidates = told[0]
        for n in candidates:
            try:
                error = None
                header = load_into(self._path(n), train_step, restore_rng, n)
            except _CorruptCheckpoint as e:
                error = e
            if collective:  # one rank's damaged file is every rank's
                errors = [e for e in gathered(error and str(error)) if e]
                error = _CorruptCheckpoint(errors[0]) if errors else None
            if error is not None:
                if step is not None:
                    raise error
                warnings.warn(
                    f"{error}; trying the checkpoint before it", RuntimeWarning, 2
                )
                continue
            position = header.get("data_position")
            info = {"step": n, "data_position": n if position is None else position}
            if header.get("fit_state") is not None:
                info["fit_state"] = header["fit_state"]
            if header.get("snapshot") is not None:
                info["snapshot"] = header["snapshot"]
            if header.get("fit_extras") is not None:
                info["fit_extras"] = header["fit_extras"]
            return train_step, info
        raise FileNotFoundError(
            f"no intact checkpoint in {self.directory!r} (steps on disk: "
            f"{self.steps()})"
        )

    def close(self) -> None:
        """Waits for a pending save."""
        self.wait()


def _header_file(path: str) -> str:
    """The file holding the header of checkpoint entry `path`."""
    return os.path.join(path, DCP_HEADER) if os.path.isdir(path) else path


def _is_ours(path: str) -> bool:
    """A checkpoint file (ours or an older bare `torch.save` zip) or a
    sharded checkpoint directory, not a stray entry of the same name: only
    those are counted and pruned."""
    if os.path.isdir(path) and not os.path.islink(path):
        head = os.path.join(path, DCP_HEADER)
        return os.path.isfile(head) and peek_header(head).get("format") == DCP_FORMAT
    if not os.path.isfile(path) or os.path.islink(path):
        return False
    with open(path, "rb") as f:
        start = f.read(len(FORMAT) + 12)
    return start[:2] == b"PK" or start.startswith(b'{"format": "torchref-checkpoint-')
