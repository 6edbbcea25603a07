"""`CheckpointManager`: the checkpoints of one run, by global step (private)."""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import Any

import jax

from _stablecore.checkpoint import CorruptCheckpoint as _CorruptCheckpoint
from _stablecore.checkpoint import ManagerBase
from _stablecore.checkpoint import fsync_tree as _fsync_tree
from _stablecore.checks import check_int as _check_int
from _stablecore.lock import locked_elsewhere
from jaxstable._src.checkpoint import restore_onto
from jaxstable._src.checkpoint_format import orbax_checkpoint, payload, read_checkpoint

__all__ = ["CheckpointManager"]

_NAME = re.compile(r"^step_(\d{8,})$")
# orbax writes checkpoint n under this name, renamed to step_n once complete.
_TMP = re.compile(r"^step_\d{8,}\.orbax-checkpoint-tmp")


def _primary() -> bool:
    # Several processes (jax.distributed) save one checkpoint together:
    # process 0 alone removes, prunes and fsyncs.
    return jax.process_index() == 0


class CheckpointManager(ManagerBase):
    """The checkpoints of one run in a directory, named by the run's global step.

    Checkpoint n lives in ``directory/step_{n:08d}`` (n: steps of the run
    done, not steps of one `fit` call), written by orbax as
    `save_checkpoint` writes. After each save it keeps the last
    `max_to_keep` checkpoints up to that step and, with `best_metric`, also
    the best one by that metric; the mirror of
    `torchref.train.CheckpointManager`. Only this manager's own checkpoints
    count and are deleted: an entry named like one that is not (a stray file
    or directory ``step_00000099``) is left alone and takes no slot, and
    neither does a checkpoint past the step just saved (one a resume went
    back from). With `async_save` a save returns once the state is on the
    host and orbax writes it in the background (the next save, `wait` or
    `close` waits for it); a crash mid-save leaves only orbax's temporary
    directory, which the next manager on the directory removes (unless a
    run holds the directory's lock, see `fit`). Finished checkpoints are
    fsynced (at the next save, `wait` or `close`).

    `restore` takes the latest intact checkpoint: a truncated, damaged or
    foreign one (unreadable, or its sha256 differs) gives a
    `RuntimeWarning` naming it and the one before it is tried. A checkpoint
    of another model, optimizer or loss scale raises the `load_checkpoint`
    ValueError.

    Args:
      directory: the run's checkpoint directory (created if missing).
      max_to_keep: int >= 1, how many of the latest checkpoints to keep.
      best_metric: None, or the key of the ``metrics`` passed to `save`
        (e.g. ``"eval['loss']"``) whose best checkpoint is kept too.
      best_mode: ``"min"`` or ``"max"``: which value of `best_metric` is best.
      async_save: write in the background (orbax's async save).

    Example:
      >>> import tempfile, jax.numpy as jnp, optax
      >>> from jaxstable import train
      >>> s = train.TrainState.create(params=jnp.zeros(2), optimizer=optax.sgd(0.1))
      >>> with train.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2,
      ...                              best_metric="loss") as mgr:
      ...     for n, loss in [(10, 0.5), (20, 0.9), (30, 0.7)]:
      ...         mgr.save(n, s.replace(params=jnp.full(2, float(n))),
      ...                  metrics={"loss": loss})
      ...     mgr.wait()
      ...     restored, info = mgr.restore(s)
      ...     print(mgr.steps(), mgr.best_step(), info, restored.params.tolist())
      [10, 20, 30] 10 {'step': 30, 'data_position': 30} [30.0, 30.0]
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
        self._ckptr: Any = None
        self._writing: int | None = None  # the step of a save in flight
        self._scores: dict[int, float | None] = {}  # best_metric by step
        if _primary():
            os.makedirs(self.directory, exist_ok=True)
            if not locked_elsewhere(self.directory):  # a killed save's leftovers
                for name in os.listdir(self.directory):
                    if _TMP.match(name):
                        shutil.rmtree(os.path.join(self.directory, name), True)

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{step:08d}")

    def _checkpointer(self) -> Any:
        if self._ckptr is None:
            ocp = orbax_checkpoint()
            kind = ocp.AsyncCheckpointer if self.async_save else ocp.Checkpointer
            self._ckptr = kind(ocp.CompositeCheckpointHandler())
        return self._ckptr

    def steps(self) -> list[int]:
        """The global steps of the entries named like checkpoints, ascending."""
        names = (_NAME.match(n) for n in os.listdir(self.directory))
        return sorted(int(m.group(1)) for m in names if m)

    def score(self, step: int) -> float | None:
        """`best_metric` of checkpoint `step` (its meta read once), or None."""
        if step not in self._scores:
            meta = _read_json(self._path(step)) or {}
            metrics = meta.get("metrics")
            if "metrics" not in meta:  # format 1: orbax's manager's own file
                metrics = _read_json(
                    os.path.join(self._path(step), "metrics", "metrics")
                )
            value = metrics.get(self.best_metric) if isinstance(metrics, dict) else None
            self._scores[step] = None if value is None else float(value)
        return self._scores[step]

    def save(
        self,
        step: int,
        state: Any,
        *,
        data_position: int | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> None:
        """Saves `state` as checkpoint `step` (replacing one of that step).

        Args:
          step: int >= 0, the run's global step.
          state: the `TrainState` (or pytree) to save.
          data_position: batches of the run consumed (default: `step`).
          metrics: a dict holding `best_metric` (other keys are ignored).
        """
        self.save_for_fit(step, state, data_position, metrics)

    def save_for_fit(
        self,
        step: int,
        state: Any,
        data_position: int | None = None,
        metrics: dict[str, Any] | None = None,
        fit_state: dict | None = None,
        snapshot: Any = None,
    ) -> None:
        """`save`, plus what `fit` keeps: its NaN-policy state and rollback
        snapshot (both under the checksum). `fit` calls it; use `save`."""
        _check_int("step", step, 0)
        self.wait()
        kept = None
        if self.best_metric is not None and metrics and self.best_metric in metrics:
            kept = {self.best_metric: float(metrics[self.best_metric])}
        path = self._path(step)
        if _primary() and os.path.lexists(path) and not os.path.isdir(path):
            os.remove(path)  # a stray file of that name (orbax replaces a dir)
        args = payload(state, step, data_position, kept, fit_state, snapshot)
        self._checkpointer().save(path, args=args, force=True)
        self._scores[step] = None if kept is None else kept[self.best_metric]
        self._writing = step
        if not self.async_save:
            self.wait()

    def _prune(self, latest: int) -> None:
        """Deletes this manager's checkpoints up to `latest` beyond the last
        `max_to_keep` (and the best one)."""
        ours = [n for n in self.steps() if n <= latest and _is_ours(self._path(n))]
        keep = set(ours[-self.max_to_keep :]) | {self.best_step()}
        for n in ours:
            if n not in keep:
                shutil.rmtree(self._path(n))
                self._scores.pop(n, None)

    def wait(self) -> None:
        """Waits for a background save to finish, fsyncs it and prunes."""
        if self._ckptr is not None and self.async_save:
            self._ckptr.wait_until_finished()
        step, self._writing = self._writing, None
        if step is not None and _primary():
            _fsync_tree(self._path(step))
            self._prune(step)

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """The latest intact checkpoint (or checkpoint `step`) restored onto `target`.

        Returns:
          ``(state, info)`` with ``info = {"step": n, "data_position": p}``;
          for a checkpoint written by `fit`, also ``"fit_state"`` (its
          NaN-policy state) and, when it saved one, ``"snapshot"`` (its
          rollback snapshot restored onto `target`).

        Raises:
          FileNotFoundError: no intact checkpoint (each damaged one warned of).
          ValueError: the checkpoint does not match `target` (see
            `load_checkpoint`), or `step` is given and damaged.
        """
        self.wait()
        candidates = [step] if step is not None else self.steps()[::-1]
        for n in candidates:
            path = self._path(n)
            try:
                loaded = read_checkpoint(path, n)
            except _CorruptCheckpoint as e:
                if step is not None:
                    raise
                warnings.warn(
                    f"{e}; trying the checkpoint before it", RuntimeWarning, 2
                )
                continue
            state = restore_onto(path, loaded, target)
            info = {"step": n, "data_position": loaded.meta["data_position"]}
            if loaded.meta.get("fit_state") is not None:
                info["fit_state"] = loaded.meta["fit_state"]
            if loaded.snapshot is not None:
                info["snapshot"] = restore_onto(path, loaded, target, snapshot=True)
            return state, info
        raise FileNotFoundError(
            f"no intact checkpoint in {self.directory!r} (steps on disk: "
            f"{self.steps()})"
        )

    def close(self) -> None:
        """Waits for pending saves, then releases orbax's checkpointer."""
        self.wait()
        if self._ckptr is not None:
            self._ckptr.close()
            self._ckptr = None


def _read_json(path: str) -> Any:
    """The meta of checkpoint directory `path` (or the JSON file `path`
    itself), None if there is none readable."""
    try:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        ocp = orbax_checkpoint()
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            return ckptr.restore(path, args=args).meta
    except Exception:  # not a checkpoint, or a damaged one
        return None


def _is_ours(path: str) -> bool:
    """A checkpoint directory as orbax writes it (its two items), not a stray
    entry of the same name: only those are counted and pruned."""
    return all(os.path.isdir(os.path.join(path, item)) for item in ("state", "meta"))
