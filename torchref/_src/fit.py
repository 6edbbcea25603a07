"""The fit loop: logging, progress, checkpoints and the NaN policy."""

from __future__ import annotations

import copy
import itertools
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from _stablecore.bad_data import BadBatches, file_in, for_run, read
from _stablecore.fit import NAN_POLICIES as NAN_POLICIES
from _stablecore.fit import Checkpointing as Checkpointing
from _stablecore.fit import Log as Log
from _stablecore.fit import accepts_old_keywords
from _stablecore.fit import batches_from as _batches_from
from _stablecore.fit import checked_options as _checked_options
from _stablecore.fit import open_log as _open_log
from _stablecore.lock import DirectoryLock
from _stablecore.loop import FitLoop as _FitLoop
from _stablecore.nan_policy import NanPolicy as NanPolicy
from torchref._src.checkpoint_manager import CheckpointManager
from torchref._src.checkpoint_sharded import is_sharded
from torchref._src.diagnostics import locate, rng_snapshot
from torchref._src.fit_report import NonFiniteError as NonFiniteError
from torchref._src.fit_report import (
    host_record,
    locate_step,
    raise_non_finite,
    scalar_leaves,
)
from torchref._src.step import TrainStep
from torchref._src.watchdog import Group

_SKIP = NanPolicy.skip()
_LOG = Log()


@accepts_old_keywords
def fit(
    step: TrainStep,
    batches: Iterable[Any],
    *,
    steps: int | None = None,
    nan_policy: NanPolicy = _SKIP,
    checkpoint: Checkpointing | str | os.PathLike | CheckpointManager | None = None,
    evaluate: tuple[Callable[[Any], Any], int] | None = None,
    on_step: Callable[[dict[str, Any], Any], Any] | None = None,
    log: Log | str | os.PathLike | None = _LOG,
    batch_transform: Callable[[Any], Any] | None = None,
    schedulers: Any = None,
) -> list[dict[str, Any]]:
    """Runs `step` over `batches` with a progress bar, a JSONL log and a NaN policy.

    Per batch: ``metrics = step(batch)``; the history entry (and JSONL line)
    is ``{"step": i, loss, grad_norm, loss_scale, finite, skipped_total}``
    plus one ``aux[...]`` key per scalar leaf of ``aux`` (i 0-based); with a
    step that reports ``grads_finite`` (a `TrainStep`) that key too, and on a
    skipped step ``skip_reason`` (``"non-finite gradients"``,
    ``"non-finite update"`` or ``"spike"``); when ``aux`` holds a
    `torchref.diagnostics.CheckPoints`, its ``checks[...]``,
    ``non_finite_checks`` and ``first_non_finite_check`` keys: the same
    record as `jaxstable.train.fit`, and the same semantics for every
    option (the NaN policies, checkpoints and resume, evaluation, the
    early stops; see there and docs/semantics.md for what advances on a
    skipped, rolled back or rewound step). What differs:

    * The state is the step's: ``step.state_dict()`` (model, optimizer,
      scaler, counters). A rollback snapshot is
      ``copy.deepcopy(step.state_dict())``, loaded back as a deep copy (the
      optimizer may keep the loaded tensors and update them in place).
    * Checkpoints are ``checkpoint_dir/step_{n:08d}.pt`` files holding the
      state, the RNG states, the data position, the schedulers' states and
      the RNG state the data was iterated with. A rollback to disk leaves
      the RNG states as they are.
    * Data: a sequence is indexed from the resumed position; another
      iterable (a `torch.utils.data.DataLoader`) is iterated anew and its
      first batches dropped. ``iter()`` of a DataLoader draws its sampler's
      permutation and its workers' base seed from the global RNG (or its
      ``generator``): fit saves that RNG state as it was when the run first
      iterated, and a resumed run iterates under it again before it restores
      the step's RNG, so a shuffling loader, with workers, resumes on the
      very batches (and augmentations) of the uninterrupted run. An
      iterable that draws its order elsewhere (a stream, numpy's RNG)
      cannot be resumed by fit: see docs/checkpoints.md for the recipe.
    * Schedulers: ``schedulers`` is None, one learning-rate scheduler (any
      object with ``step``, ``state_dict`` and ``load_state_dict``, e.g.
      ``torch.optim.lr_scheduler.OneCycleLR`` over the step's optimizer), a
      list of them, or ``(scheduler, "every")`` pairs in that list. fit
      steps each after every applied step (a skipped step leaves it where
      it was, as the optimizer's own step count and JAX's optax schedules
      do); a pair with ``"every"`` is stepped after every step instead.
      ``ReduceLROnPlateau`` gets the step's loss. They are rolled back with
      the state and saved in (and resumed from) every checkpoint.
    * Under a process group of N > 1 ranks (DDP, FSDP2) every rank calls fit
      with the same arguments and takes the same path (the decisions are
      global, see `TrainStep`); rank 0 alone writes the log and the
      checkpoints (under FSDP2 every rank writes its shards into rank 0's
      directory with `torch.distributed.checkpoint`), a resume loads rank
      0's checkpoint on every rank, ``on_step`` stopping one rank stops all,
      `locate` runs on every rank at once under DDP and FSDP2, each on its
      own rows and shards (small records exchanged; no re-run, so such a
      step counts as reproduced), the bad-batch list
      (``bad_batches.json``) is rank 0's, given to every rank; a rank that
      raises makes the others' next collective fail with a RuntimeError
      naming its rank, step and error (after the process group's timeout at
      worst). See docs/distributed.md.

    Steps: a `TrainStep`, or any callable ``step(batch) -> metrics`` whose
    metrics hold ``loss``, ``grad_norm``, ``loss_scale``, ``finite`` and
    ``skipped_total`` (numbers or 0-d tensors; optionally ``aux``), e.g. a
    hand-written baseline loop. A policy that restores and checkpoints need
    its ``state_dict`` / ``load_state_dict``; the error report names
    non-finite gradients of its ``model`` if it has one.

    Args:
        step: a `TrainStep` or a step callable (see above).
        batches: any iterable of batches.
        steps: stop after this many steps of the run (None: exhaust
            `batches`).
        nan_policy: a `NanPolicy` (`NanPolicy.skip` by default), as in
            `jaxstable.train.fit`; located steps get ``"location"``:
            `torchref.diagnostics.locate` of the step at the loss scale it
            used, as a dict of `NonFiniteLocation` fields.
        checkpoint: None, a directory, a `CheckpointManager` or a
            `Checkpointing` (``every``, ``resume``).
        evaluate: None, or ``(eval_fn, every)``: ``eval_fn(step) -> {name:
            scalar}`` after every ``every``-th step, its scalars added to
            that step's record as ``eval[...]`` keys.
        on_step: ``on_step(record, step)``, called once per step with the
            step's record (after it is logged); if it returns True, fit stops
            after that step and returns normally (on a step that rolls back
            or rewinds, with the state restored).
        log: a `Log` (``path``, ``progress``, ``time_steps``: the wall time
            of the step call until its metrics are host numbers), a bare
            path or None (no file, no bar).
        batch_transform: None, or ``batch_transform(batch) -> batch`` applied
            to each batch right before the step (after a resume's skip),
            e.g. this rank's rows of a global batch under DDP:
            ``lambda b: torchref.distributed.shard_batch(b, mesh)``.
        schedulers: None, a scheduler, or a list (see above).
        The same records and options as `jaxstable.train.fit`.

    The keywords of the old form (``max_consecutive_nonfinite``,
    ``checkpoint_dir``, ``eval_fn``, ``log_path``, ``progress`` ...) and a
    string ``nan_policy`` still work for one release, with a
    DeprecationWarning naming the new form.

    Returns:
        The history: list of per-step dicts (a rollback step's also has
        ``"rolled_back": True``).

    Raises:
        NonFiniteError: with `NanPolicy.stop`, or a rollback or rewind once
            the policy's ``max`` is used up.
        TypeError, ValueError: a bad argument (the message names it and
            what is allowed).

    Example:
        >>> import torch
        >>> from torchref.train import Log, NanPolicy
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(2, 1)
        >>> step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                  lambda m, b: m(b).pow(2).mean())
        >>> good, bad = torch.ones(4, 2), torch.full((4, 2), float("nan"))
        >>> hist = fit(step, [good, bad, good], log=None)
        >>> [h["finite"] for h in hist], hist[-1]["skipped_total"]
        ([True, False, True], 1)
        >>> try:
        ...     fit(step, [bad], nan_policy=NanPolicy.stop(max_consecutive=1),
        ...         log=None)
        ... except NonFiniteError as e:
        ...     print(e.step, "|", str(e).split(";")[0])
        0 | 1 non-finite step(s) in a row, the last at step 0
        >>> before = step.steps_done
        >>> policy = NanPolicy.rollback(max_consecutive=1, every=2)
        >>> hist = fit(step, [good, good, bad, good], nan_policy=policy, log=None)
        >>> # 4 steps, but the rollback undid the NaN one (back to the snapshot at 2)
        >>> [h.get("rolled_back", False) for h in hist], step.steps_done - before
        ([False, False, True, False], 3)
        >>> w = model.weight
        >>> hist = fit(step, [good, bad] + [good] * 5,
        ...            log=Log(progress=False, time_steps=True),
        ...            evaluate=(lambda s: {"w0": w[0, 0]}, 2),
        ...            nan_policy=NanPolicy.skip(stop_after=2))
        >>> len(hist), [k for k in hist[1] if k not in hist[0]]  # stops 2 after 1
        (4, ['skip_reason', "eval['w0']", 'location', 'reproduced'])
        >>> hist[3]["eval['w0']"] == float(w.detach()[0, 0]), hist[0]["time_s"] > 0
        (True, True)
        >>> sched = torch.optim.lr_scheduler.StepLR(step.optimizer, 1, gamma=0.5)
        >>> hist = fit(step, [good, bad, good], schedulers=sched, log=None)
        >>> sched.last_epoch  # stepped after the 2 applied steps only
        2
    """
    if not callable(step):
        raise TypeError(
            "step must be a torchref.train.TrainStep or a callable "
            f"step(batch) -> metrics, got {type(step).__name__}"
        )
    opts = _checked_options(
        nan_policy, checkpoint, evaluate, on_step, log, batch_transform, steps,
        CheckpointManager,
    )  # fmt: skip
    scheds = _as_schedulers(schedulers)
    policy, checkpoint_dir = opts["policy"], opts["checkpoint_dir"]
    checkpoint_every, resume = opts["checkpoint_every"], opts["resume"]
    log, eval_fn, eval_every = opts["log"], opts["eval_fn"], opts["eval_every"]
    stateful = hasattr(step, "state_dict") and hasattr(step, "load_state_dict")
    if not stateful and (policy.restores or checkpoint_dir is not None):
        raise TypeError(
            f"nan_policy={policy!r} and checkpoint need a step with "
            f"state_dict() and load_state_dict(), got {type(step).__name__}"
        )
    group = Group()
    writer = group.rank == 0
    mgr, own_mgr, lock = _manager(checkpoint_dir if writer else None)
    try:
        if group.size > 1:
            mgr, own_mgr = group.plan(mgr, own_mgr, checkpoint_dir, resume, step)
        start, resumed = _resume(mgr, step, resume, group)
        _load_schedulers(scheds, resumed.get("fit_extras"))
        to_disk = policy.restores and policy.restore_to == "disk"
        if mgr is not None and to_disk and group.latest_step(mgr) is None:
            if writer or is_sharded(step):  # FSDP2: every rank its shards
                extras = {"schedulers": [s.state_dict() for s, _ in scheds]}
                # what the first rollback goes back to
                mgr.save_for_fit(start, step, None, None, None, None, extras)
        bad = _bad_batches(mgr, opts, group)
        return _run(
            step, batches, steps, policy, log, checkpoint_every, eval_fn,
            eval_every, on_step, batch_transform, group, scheds,
            _Origin(mgr, start, resumed, bad),
        )  # fmt: skip
    finally:
        try:
            if own_mgr:
                mgr.close()  # waits for a background save
            elif mgr is not None:
                mgr.wait()
        finally:
            if lock is not None:
                lock.release()


def _bad_batches(mgr, opts: dict, group) -> BadBatches:
    """The run's bad-batch list (``bad_batches.json``): rank 0 reads it
    (and alone writes it) and gives every rank its entries, so that all
    skip the same batches and write the same records."""
    directory = None if mgr is None else mgr.directory
    writer = group.rank == 0
    path = file_in(directory)
    mine = (read(path), path is not None) if writer else None
    given, skips = opts["skip_batches"], opts["skip_listed"]
    return for_run(directory, given, writer, skips, group.from_rank0(mine))


def _as_schedulers(schedulers: Any) -> list[tuple[Any, str]]:
    """``[(scheduler, "applied" | "every")]`` of fit's ``schedulers=``."""
    if schedulers is None:
        return []
    items = schedulers if isinstance(schedulers, list | tuple) else [schedulers]
    if len(items) == 2 and items[1] in _WHEN and not isinstance(schedulers, list):
        items = [schedulers]  # one pair
    out = []
    for item in items:
        sched, when = item if isinstance(item, tuple) else (item, "applied")
        for name in ("step", "state_dict", "load_state_dict"):
            if not callable(getattr(sched, name, None)):
                raise TypeError(
                    "schedulers: each must have step(), state_dict() and "
                    f"load_state_dict() (a torch.optim.lr_scheduler), got {sched!r}"
                )
        if when not in _WHEN:
            raise ValueError(f"schedulers: when must be one of {_WHEN}, got {when!r}")
        out.append((sched, when))
    return out


_WHEN = ("applied", "every")


def _load_schedulers(scheds, extras: dict | None) -> None:
    """The schedulers' states of a checkpoint (or snapshot), if it has them."""
    saved = (extras or {}).get("schedulers")
    if not scheds or saved is None:
        return
    if len(saved) != len(scheds):
        raise ValueError(
            f"the checkpoint holds {len(saved)} scheduler state(s), fit was "
            f"given {len(scheds)} schedulers"
        )
    for (sched, _), state in zip(scheds, saved, strict=True):
        sched.load_state_dict(copy.deepcopy(state))


def _step_schedulers(scheds, rec: dict[str, Any]) -> None:
    for sched, when in scheds:
        if when == "every" or rec["finite"]:
            if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                sched.step(rec["loss"])
            else:
                sched.step()


def _data_iterator(batches, start: int, steps, resumed: dict):
    """`batches` from the run's position `start`, and the RNG state the run
    iterates them with (saved in its checkpoints).

    A resumed run iterates under the state the run first iterated with, so
    that a DataLoader draws the same permutation and worker seeds, and drops
    the batches before `start` under it too (a loader without workers draws
    their random augmentations from the global RNG); then the step's own
    RNG state is put back, and the next batch draws from it as it did in
    the uninterrupted run. A new run iterates under the global RNG as it
    is (its draws, lazy ones included, are part of the run's RNG stream).
    Returns ``(iterator, data_rng)``."""
    saved = (resumed.get("fit_extras") or {}).get("data_rng")
    generator = getattr(batches, "generator", None)
    generator = generator if isinstance(generator, torch.Generator) else None
    step_rng = torch.get_rng_state()
    if saved is not None:
        torch.set_rng_state(saved["torch"])
        if generator is not None and saved.get("generator") is not None:
            generator.set_state(saved["generator"])
    data_rng = {
        "torch": torch.get_rng_state(),
        "generator": None if generator is None else generator.get_state(),
    }
    if hasattr(batches, "__getitem__") and hasattr(batches, "__len__"):
        it = _batches_from(batches, start, steps)
    else:
        it = iter(batches)
        for _ in itertools.islice(it, start):
            pass
        it = itertools.islice(it, None if steps is None else max(steps - start, 0))
    if saved is not None:
        torch.set_rng_state(step_rng)
    return it, data_rng


class _Origin(NamedTuple):
    """Where `_run` starts: the checkpoint manager (or None), the global
    step, whether it was resumed, and the bad-batch list."""

    mgr: Any
    start: int
    resumed: Any
    bad: Any


def _run(
    step, batches, steps, policy, log, checkpoint_every, eval_fn, eval_every,
    on_step, batch_transform, group, scheds, origin,
):  # fmt: skip
    """The loop of `fit` from global step `start` (its arguments checked):
    `FitLoop` over a `_TorchAdapter`. Returns the history."""
    mgr, start, resumed, bad = origin
    from tqdm.auto import tqdm

    total = steps
    if total is None and hasattr(batches, "__len__"):
        total = len(batches)
    adapter = _TorchAdapter(step, policy, log, eval_fn, mgr, group, scheds)
    adapter.snapshot_from(resumed)

    def data_from(stop):
        it, adapter.data_rng = _data_iterator(batches, start, stop, resumed)
        return it if batch_transform is None else map(batch_transform, it)

    # Under a process group rank 0 alone writes the log and checkpoints.
    writer = group.rank == 0
    log_path, progress = (log.path, log.progress) if writer else (None, False)
    out = _open_log(log_path, start if mgr is not None and start else None)
    bar = tqdm(total=total, initial=start, disable=not progress, desc="fit")
    at_start = mgr is not None and start in (resumed.get("step"), mgr.latest_step())
    loop = _FitLoop(
        adapter, data_from, policy, resumed, start, steps, eval_every, on_step,
        checkpoint_every, mgr is not None, start if at_start else None, bar, out,
        bad,
    )  # fmt: skip
    try:
        return loop.run()
    except BaseException as e:
        group.failed(e, adapter.index)
        raise


class _TorchAdapter:
    """`FitLoop`'s adapter for a torch step (which holds its own state).

    A pending step is ``(index, metrics, batch, rng, seconds)``, ``rng`` the
    random state the step drew its dropout masks from (for `locate`). No
    lookahead: the metrics are host numbers when the step returns.
    """

    lookahead = False

    def __init__(self, step, policy, log, eval_fn, mgr, group, scheds):
        self.step, self.policy, self.eval_fn = step, policy, eval_fn
        self.mgr, self.group, self.scheds = mgr, group, scheds
        self.time_steps = log.time_steps
        self.in_memory = policy.restores and policy.restore_to == "memory"
        # As jaxstable's fit; under DDP and FSDP2 every rank locates at
        # the same step, on its own rows and shards (docs/locate.md).
        self.locate_step = locate_step(step)
        self.snapshot_state = self.snapshot_scheds = None
        self.data_rng = None
        self.index = 0

    def snapshot_from(self, resumed: dict) -> None:
        # Deep copies: state_dict() holds references to the live tensors. A
        # resumed run goes on with the snapshot its checkpoint saved.
        if not self.in_memory:
            return
        saved = resumed.get("snapshot")
        self.snapshot_state = saved or copy.deepcopy(self.step.state_dict())
        extras = resumed.get("fit_extras") or {}
        self.snapshot_scheds = extras.get("snapshot_schedulers")
        if self.snapshot_scheds is None:
            self.snapshot_scheds = self._sched_states()

    def _sched_states(self) -> list:
        return copy.deepcopy([s.state_dict() for s, _ in self.scheds])

    def run_step(self, index: int, batch: Any):
        self.index = index
        # The random state the step draws its dropout masks from, for
        # locate to re-run it with (a 5 kB copy, no device sync).
        rng = rng_snapshot(self.step) if self.locate_step is not None else None
        t0 = time.perf_counter()
        metrics = self.step(batch)
        return index, metrics, batch, rng, time.perf_counter() - t0

    def record(self, pending) -> dict[str, Any]:
        index, metrics, _, _, seconds = pending
        rec = host_record(index, metrics)
        if self.time_steps:
            rec["time_s"] = seconds
        return rec

    def evaluate(self, pending) -> dict[str, float]:
        del pending
        return {"eval" + p: v for p, v in scalar_leaves(self.eval_fn(self.step))}

    def observed(self, rec) -> None:
        _step_schedulers(self.scheds, rec)

    def locate(self, pending, rec):
        # A skipped step left model and optimizer as they were; only the
        # scaler backed off: re-run at the scale the step used.
        if self.locate_step is None:
            return False
        _, _, batch, rng, _ = pending
        scale = rec["loss_scale"]
        return locate(self.locate_step, batch, loss_scale=scale, rng_state=rng)

    def callback_arg(self, pending):
        del pending
        return self.step

    def any(self, flag: bool) -> bool:
        return self.group.any(flag)

    def keep(self, pending) -> None:
        del pending  # the step holds its state

    def restore(self) -> None:
        if self.in_memory:
            # A copy again: the optimizer may keep the loaded tensors and
            # update them in place, which must not reach the snapshot.
            self.step.load_state_dict(copy.deepcopy(self.snapshot_state))
            _load_schedulers(self.scheds, {"schedulers": self.snapshot_scheds})
            return
        # The last good checkpoint on disk, RNG states left as they are.
        _, info = self.group.restore(self.mgr, self.step, restore_rng=False)
        _load_schedulers(self.scheds, info.get("fit_extras"))

    def snapshot(self, pending) -> None:
        del pending
        self.snapshot_state = copy.deepcopy(self.step.state_dict())
        self.snapshot_scheds = self._sched_states()

    def latest_checkpoint(self) -> int:
        # A save still in flight (this very step's period) is not on disk
        # yet, but the restore waits for it: wait here too, or the record
        # names the one before it (seen: rewind_to 0 for 4, 1 run in 5).
        self.mgr.wait()
        return self.mgr.latest_step()

    def save(self, done: int, metrics, fit_state: dict, keep: bool) -> None:
        # FSDP2: every rank writes its shards (torch.distributed.checkpoint).
        if self.group.rank != 0 and not is_sharded(self.step):
            return
        extras = {
            "data_rng": self.data_rng,
            "schedulers": [s.state_dict() for s, _ in self.scheds],
            "snapshot_schedulers": self.snapshot_scheds if keep else None,
        }
        kept = self.snapshot_state if keep else None
        self.mgr.save_for_fit(done, self.step, None, metrics, fit_state, kept, extras)

    def raise_non_finite(self, rec, run, pending, history, policy, location):
        raise_non_finite(self.step, rec, run, pending[2], history, policy, location)


def _manager(checkpoint_dir):
    """``(manager, owned, lock)``: a `CheckpointManager` for `checkpoint_dir`
    and the directory's lock, taken first (one run writes a directory)."""
    if checkpoint_dir is None:
        return None, False, None
    given = isinstance(checkpoint_dir, CheckpointManager)
    lock = DirectoryLock(checkpoint_dir.directory if given else checkpoint_dir)
    lock.acquire()
    try:
        mgr = checkpoint_dir if given else CheckpointManager(checkpoint_dir)
    except BaseException:
        lock.release()
        raise
    return mgr, not given, lock


def _resume(mgr, step, resume, group) -> tuple[int, dict]:
    """``(start, info)``: the data position and `CheckpointManager.restore`
    info of the latest intact checkpoint, loaded into `step`, with `resume`;
    else 0 and {} (refusing a directory that already holds a run: its
    checkpoints would be overwritten)."""
    latest = None if mgr is None else mgr.latest_step()
    if group.size > 1:
        latest = group.latest
    if latest is None:
        return 0, {}
    if not resume:
        raise ValueError(
            f"checkpoint_dir {mgr.directory!r} already holds checkpoints (up to "
            f"step {latest}): pass resume=True to continue that run, or another "
            "directory to start a new one"
        )
    _, info = group.restore(mgr, step)
    return int(info["data_position"]), info
