"""The fit loop: logging, progress, checkpoints and the NaN policy."""

from __future__ import annotations

import copy
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from _stablecore.checks import check_callable as _check_callable
from _stablecore.fit import NAN_POLICIES as NAN_POLICIES
from _stablecore.fit import RESTORES as _RESTORES
from _stablecore.fit import UPDATE_NOTE as _UPDATE_NOTE
from _stablecore.fit import NanPolicy as _NanPolicy
from _stablecore.fit import add_skip_reason as _add_skip_reason
from _stablecore.fit import batches_from as _batches_from
from _stablecore.fit import check_fit_args as _check_fit_args
from _stablecore.fit import check_rewind_args as _check_rewind_args
from _stablecore.fit import open_log as _open_log
from _stablecore.fit import policy_note as _policy_note
from _stablecore.fit import show as _show
from _stablecore.fit import warn_if_short as _warn_if_short
from _stablecore.lock import DirectoryLock
from _stablecore.low_precision import STAT_NAMES, StallMonitor
from torchref._src.checkpoint import CheckpointManager, _is_sharded
from torchref._src.diagnostics import (
    check_record,
    format_checks,
    format_location,
    format_report,
    locate,
    non_finite_grad_report,
    non_finite_report,
    rng_snapshot,
)
from torchref._src.step import TrainStep


class NonFiniteError(FloatingPointError):
    """Training stopped on non-finite gradients.

    Raised by `fit` with ``nan_policy="stop"`` at the first run of
    ``max_consecutive_nonfinite`` non-finite steps; with ``"rollback"`` once
    ``max_rollbacks`` rollbacks have been used.

    Attributes:
        step: 0-based index (in the run, see `fit`) of the step that hit the
            limit, as in `jaxstable.train.NonFiniteError`.
        report: `non_finite_grad_report` of the model at that step (its
            gradients at the loss scale that step used, unscaled).
        history: the per-step records, ending with that step.
        location: `torchref.diagnostics.locate` of that step (a
            `NonFiniteLocation`), None when the re-run found it finite.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        report: list,
        history: list | None = None,
        location: Any = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.report = report
        self.history = [] if history is None else history
        self.location = location


_LOGGED = ("loss", "grad_norm", "loss_scale", "finite", "skipped_total")


def _scalar_leaves(tree: Any, path: str = "") -> Iterable[tuple[str, float]]:
    """``(path, value)`` of every scalar leaf, paths as jax's ``keystr``."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _scalar_leaves(v, f"{path}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _scalar_leaves(v, f"{path}[{i}]")
    elif isinstance(tree, torch.Tensor):
        if tree.numel() == 1:
            yield path, float(tree.detach().float())
    elif isinstance(tree, (int, float)):
        yield path, float(tree)


def _host_record(index: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """One history/JSONL record: the metrics and the scalar leaves of ``aux``
    as ``aux[...]`` keys, the same record as `jaxstable.train.fit` writes."""
    rec = {"step": index}
    # Python numbers of the JAX record's types (a step callable may return
    # 0-d tensors; a TrainStep already returns numbers).
    for key, kind in zip(_LOGGED, (float, float, float, bool, int), strict=True):
        value = metrics[key]
        if isinstance(value, torch.Tensor):
            value = value.detach().float().item() if kind is not bool else value
        rec[key] = kind(value)
    _add_skip_reason(rec, metrics.get("grads_finite"), metrics.get("spike"))
    rec.update({k: float(metrics[k]) for k in STAT_NAMES if k in metrics})
    if metrics.get("aux") is not None:
        for path, value in _scalar_leaves(metrics["aux"]):
            rec["aux" + path] = value
        # The loss's check points (diagnostics.CheckPoints): checks[...] keys
        # and the non-finite points in order, instead of aux[...] keys.
        rec.update(check_record(metrics["aux"]))
    return rec


def fit(
    step: TrainStep,
    batches: Iterable[Any],
    *,
    steps: int | None = None,
    nan_policy: str = "skip",
    max_consecutive_nonfinite: int = 5,
    log_path: str | os.PathLike | None = None,
    progress: bool = True,
    checkpoint_dir: str | os.PathLike | CheckpointManager | None = None,
    checkpoint_every: int | None = None,
    rollback_every: int = 100,
    max_rollbacks: int = 3,
    locate_first: int = 1,
    time_steps: bool = False,
    eval_fn: Callable[[Any], Any] | None = None,
    eval_every: int | None = None,
    on_step: Callable[[dict[str, Any], Any], Any] | None = None,
    stop_after_nonfinite: int | None = None,
    resume: bool = False,
    rollback_to: str = "memory",
    batch_transform: Callable[[Any], Any] | None = None,
    rewind_after: int = 3,
    rewind_window: int = 100,
    rewind_skip: int = 0,
) -> list[dict[str, Any]]:
    """Runs `step` over `batches` with a progress bar, a JSONL log and a NaN policy.

    Per batch: ``metrics = step(batch)``; the history entry (and JSONL line)
    is ``{"step": i, loss, grad_norm, loss_scale, finite, skipped_total}``
    plus one ``aux[...]`` key per scalar leaf of ``aux`` (i 0-based); with a
    step that reports ``grads_finite`` (a `TrainStep`) that key too, and on a
    skipped step ``skip_reason`` (``"non-finite gradients"`` or
    ``"non-finite update"``); when ``aux`` holds a
    `torchref.diagnostics.CheckPoints`, its ``checks[...]``,
    ``non_finite_checks`` and ``first_non_finite_check`` keys (see
    `torchref.diagnostics.check_record`): the same record as
    `jaxstable.train.fit`.
    `log_path` is overwritten at the start of the call (unless it resumes,
    see below) and gets one JSON line
    per step with keys step, loss, grad_norm, loss_scale, finite,
    skipped_total (python's json writes non-finite floats as NaN/Infinity,
    which `json.loads` reads back). NaN policy:

    * ``"skip"``: non-finite steps are skipped (by the step) and training
      goes on.
    * ``"stop"``: after `max_consecutive_nonfinite` non-finite steps in a
      row, raise `NonFiniteError` naming the step, the loss scale it used,
      the non-finite gradients (their report) and batch inputs. Nothing after
      that step is run, logged or checkpointed.
    * ``"rollback"``: keep a snapshot of the last state known good,
      ``copy.deepcopy(step.state_dict())`` (model, optimizer, scaler,
      counters), taken before the first step and after every step n (n steps
      of the run done) with ``n % rollback_every == 0`` whose result was
      finite. After `max_consecutive_nonfinite` non-finite steps in a row,
      a deep copy of it is loaded with ``step.load_state_dict`` (a copy, as
      the optimizer may keep the loaded tensors and update them in place),
      the run counter restarts, that step's record gets
      ``"rolled_back": True`` (the only record with that key) and training
      goes on with the NEXT batch (the bad ones are not retried). The
      trigger after `max_rollbacks` rollbacks raises `NonFiniteError` as
      "stop" does, the message saying the rollbacks are exhausted. Same
      semantics as `jaxstable.train.fit`.
    * ``"rewind"`` (PaLM's recipe for loss spikes): when `rewind_after` of
      the last `rewind_window` steps were skipped (non-finite, or spikes
      with `transforms.skip_spikes`), not necessarily in a row, the same
      snapshot is loaded as for "rollback" (or the last intact checkpoint
      with ``rollback_to="disk"``) and the data goes on after the trigger
      step and `rewind_skip` more batches: the batches from the restore
      point to the trigger are not replayed and the next `rewind_skip` are
      dropped, so the rewound run equals a run that never saw them (bit for
      bit, for a deterministic step). The trigger step's record gets
      ``"rewound": True``, ``"rewind_from"`` (its step), ``"rewind_to"``
      (the step of the run restored) and ``"batches_skipped"``
      (``rewind_from + 1 - rewind_to + rewind_skip``; fewer when the data
      ends first). Rewinds count against `max_rollbacks`; the trigger after
      the last raises `NonFiniteError`. The window of skipped steps is
      checkpointed with the NaN policy's state.

    Checkpoints and resume: with `checkpoint_dir` (a directory, or a
    `CheckpointManager` for other retention, a best-by-metric checkpoint or
    synchronous saves; by default the last 3 are kept and written by a
    background thread) ``step.state_dict()``, the RNG states and the data
    position are saved to ``checkpoint_dir/step_{n:08d}.pt`` (n: the run's
    global step, batches of the run consumed) every `checkpoint_every` steps
    of the run, and once more at the end (not when it raises);
    `checkpoint_dir` alone writes only that final checkpoint. With
    ``resume=True`` fit first loads the latest intact checkpoint there (a
    damaged one is warned of and skipped) and goes on from its position:
    record indices, `steps` and the position in `batches` count from the
    start of the run (a sequence is indexed from there, an iterator has its
    first batches dropped: pass it from the start), the JSONL log keeps its
    lines before that position and is appended to, and the progress bar
    starts there. So the very same call, re-run after a crash, finishes the
    very same run; with no checkpoint yet it starts one. Without `resume`,
    a directory that already holds checkpoints is refused (they would be
    overwritten). With ``rollback_to="disk"``, "rollback" loads the last
    intact checkpoint instead of the in-memory snapshot (one is written
    before the first step if there is none), RNG states left as they are.
    Each checkpoint also holds the NaN policy's state (non-finite steps in a
    row, rollbacks used, steps located, the first non-finite step) and, for
    an in-memory rollback, the snapshot unless it is that very state; all of
    it, the data position included, is under the checkpoint's sha256. So a
    run killed and resumed skips, stops and rolls back exactly as the
    uninterrupted run. One run at a time writes a directory: fit holds the
    lock ``checkpoint_dir/.fit.lock`` for the call, and a second fit on the
    directory is refused with a RuntimeError naming the pid and host of the
    first (a killed run's lock is stale and taken over). When fit runs fewer
    steps than `steps` (the batches ended; the checkpoint it resumed from is
    already past `steps`) it says so with a UserWarning. Same semantics as
    `jaxstable.train.fit`.

    Steps: a `TrainStep`, or any callable ``step(batch) -> metrics`` whose
    metrics hold ``loss``, ``grad_norm``, ``loss_scale``, ``finite`` and
    ``skipped_total`` (numbers or 0-d tensors; optionally ``aux``), e.g. a
    hand-written baseline loop. "rollback" and checkpoints need its
    ``state_dict`` / ``load_state_dict``; the error report names non-finite
    gradients of its ``model`` if it has one.

    Args:
        step: a `TrainStep` or a step callable (see above).
        batches: any iterable of batches.
        steps: stop after this many steps (None: exhaust `batches`).
        nan_policy: "skip", "stop", "rollback" or "rewind".
        max_consecutive_nonfinite: int >= 1, used by "stop" and "rollback".
        log_path: JSONL file (overwritten, or trimmed and appended to on
            resume) or None.
        progress: show a tqdm bar (loss, grad_norm, loss_scale, skipped).
        checkpoint_dir: None, a directory or a `CheckpointManager`.
        checkpoint_every: int >= 1 or None; needs `checkpoint_dir`.
        rollback_every: snapshot period in steps for "rollback", int >= 1
            (accepted, unused, with the other policies).
        max_rollbacks: rollbacks allowed in the run for "rollback",
            int >= 1 (accepted, unused, with the other policies).
        locate_first: the first this many non-finite steps of the run
            (int >= 0) get ``"location"``: `torchref.diagnostics.locate` of
            the step (at the loss scale it used) as a dict of
            `NonFiniteLocation` fields, or None when the re-run is finite;
            the step that makes "stop" raise or "rollback" roll back always
            gets it (and the error its ``location``). Costs one re-run per
            located step, only on non-finite steps. Same keys as
            `jaxstable.train.fit`.
        time_steps: add ``"time_s"`` to each record: the wall time of the
            step call until its metrics are host numbers (a CUDA step has
            synchronised by then). Off by default.
        eval_fn: ``eval_fn(step) -> {name: scalar}``, e.g. a held-out
            evaluation; called after every `eval_every`-th step (n steps
            of the run done, ``n % eval_every == 0``), its scalars added to
            that step's record as ``eval[...]`` keys (named as ``aux``'s).
            Needs `eval_every`.
        eval_every: int >= 1, the period of `eval_fn` (needs `eval_fn`).
        on_step: ``on_step(record, step)``, called once per step with the
            step's record (after it is logged); if it returns True, fit stops
            after that step and returns normally.
        resume: continue the run from the latest intact checkpoint in
            `checkpoint_dir` (see above).
        rollback_to: "memory" (the snapshot) or "disk" (the last intact
            checkpoint; needs `checkpoint_dir`).
        rewind_after: skipped steps (non-finite or spikes) among the last
            `rewind_window` that trigger a rewind, int >= 1 (used by
            "rewind" only).
        rewind_window: the window of steps those are counted in, int >=
            `rewind_after`.
        rewind_skip: batches dropped after the trigger step, besides those
            from the restore point to it, int >= 0.
        stop_after_nonfinite: None, or an int >= 0: fit returns normally
            (nothing raised) this many steps after the first step of the run
            whose record has ``finite == False`` (0: stop at that step; a run
            resumed after that step runs none); for
            runs meant to fail, such as a naive low-precision baseline.
        batch_transform: None, or ``batch_transform(batch) -> batch`` applied
            to each batch right before the step (after a resume's skip:
            skipped batches are not transformed), e.g. this rank's rows of a
            global batch under DDP:
            ``lambda b: torchref.distributed.shard_batch(b, mesh)``. Under
            a process group of N > 1 ranks (DDP, FSDP2) every rank calls fit
            with the same arguments and takes the same path (the decisions
            are global, see `TrainStep`); rank 0 alone writes ``log_path``
            and the checkpoints (under FSDP2 every rank writes its shards
            into rank 0's ``checkpoint_dir`` with
            `torch.distributed.checkpoint`), ``resume=True`` loads rank
            0's checkpoint on every rank, ``on_step`` stopping one rank
            stops all, `locate` re-runs a DDP step on this rank's unwrapped module (no
            collective) and is not run under FSDP2; a rank that raises
            makes the others' next collective fail with a RuntimeError
            naming its rank, step and error (after the process group's
            timeout at worst). See docs/distributed.md.
        The same records and options as `jaxstable.train.fit`.

    Returns:
        The history: list of per-step dicts (a rollback step's also has
        ``"rolled_back": True``).

    Raises:
        NonFiniteError: with ``nan_policy="stop"``, or "rollback" once the
            rollbacks are used up.
        ValueError: invalid options (listing the valid values).

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(2, 1)
        >>> step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                  lambda m, b: m(b).pow(2).mean())
        >>> good, bad = torch.ones(4, 2), torch.full((4, 2), float("nan"))
        >>> hist = fit(step, [good, bad, good], progress=False)
        >>> [h["finite"] for h in hist], hist[-1]["skipped_total"]
        ([True, False, True], 1)
        >>> try:
        ...     fit(step, [bad], nan_policy="stop", max_consecutive_nonfinite=1,
        ...         progress=False)
        ... except NonFiniteError as e:
        ...     print(e.step, "|", str(e).split(";")[0])
        0 | 1 non-finite step(s) in a row, the last at step 0
        >>> before = step.steps_done
        >>> hist = fit(step, [good, good, bad, good], nan_policy="rollback",
        ...            max_consecutive_nonfinite=1, rollback_every=2, progress=False)
        >>> # 4 steps, but the rollback undid the NaN one (back to the snapshot at 2)
        >>> [h.get("rolled_back", False) for h in hist], step.steps_done - before
        ([False, False, True, False], 3)
        >>> w = model.weight
        >>> hist = fit(step, [good, bad] + [good] * 5, progress=False, time_steps=True,
        ...            eval_fn=lambda s: {"w0": w[0, 0]}, eval_every=2,
        ...            stop_after_nonfinite=2)
        >>> len(hist), [k for k in hist[1] if k not in hist[0]]  # stops 2 after 1
        (4, ['skip_reason', "eval['w0']", 'location'])
        >>> hist[3]["eval['w0']"] == float(w.detach()[0, 0]), hist[0]["time_s"] > 0
        (True, True)
    """
    if not callable(step):
        raise TypeError(
            "step must be a torchref.train.TrainStep or a callable "
            f"step(batch) -> metrics, got {type(step).__name__}"
        )
    _check_fit_args(
        nan_policy, max_consecutive_nonfinite, rollback_every, max_rollbacks, steps,
        locate_first, checkpoint_dir, checkpoint_every, resume, rollback_to,
        time_steps, eval_fn, eval_every, on_step, stop_after_nonfinite,
    )  # fmt: skip
    _check_callable("batch_transform", batch_transform)
    stateful = hasattr(step, "state_dict") and hasattr(step, "load_state_dict")
    _check_rewind_args(rewind_after, rewind_window, rewind_skip)
    if not stateful and (nan_policy in _RESTORES or checkpoint_dir is not None):
        raise TypeError(
            f"nan_policy={nan_policy!r} and checkpoint_dir need a step with "
            f"state_dict() and load_state_dict(), got {type(step).__name__}"
        )
    group = _Group()
    writer = group.rank == 0
    mgr, own_mgr, lock = _manager(checkpoint_dir if writer else None)
    try:
        if group.size > 1:
            mgr, own_mgr = group.plan(mgr, own_mgr, checkpoint_dir, resume, step)
        start, resumed = _resume(mgr, step, resume, group)
        if mgr is not None and rollback_to == "disk" and group.latest_step(mgr) is None:
            if writer or _is_sharded(step):  # FSDP2: every rank its shards
                mgr.save(start, step)  # what the first rollback goes back to
        return _run(**locals())
    finally:
        try:
            if own_mgr:
                mgr.close()  # waits for a background save
            elif mgr is not None:
                mgr.wait()
        finally:
            if lock is not None:
                lock.release()


def _run(
    step, batches, steps, nan_policy, max_consecutive_nonfinite, log_path,
    progress, checkpoint_every, rollback_every, max_rollbacks, locate_first,
    time_steps, eval_fn, eval_every, on_step, stop_after_nonfinite, rollback_to,
    mgr, start, batch_transform, resumed, group, rewind_after, rewind_window,
    rewind_skip, **_,
):  # fmt: skip
    """The loop of `fit` from global step `start` (its arguments checked)."""
    from tqdm.auto import tqdm

    total = steps
    if total is None and hasattr(batches, "__len__"):
        total = len(batches)
    policy = _NanPolicy(
        nan_policy, max_consecutive_nonfinite, max_rollbacks, locate_first,
        stop_after_nonfinite, (rewind_after, rewind_window, rewind_skip),
    )  # fmt: skip
    policy.load(resumed.get("fit_state"), start)
    if "snapshot" not in resumed:  # the snapshot is the state resumed
        policy.snapshot_at = start
    # A run that stop_after_nonfinite ended before its checkpoint: no step.
    ended = policy.stop_due(start - 1)
    it = _batches_from(batches, start, start if ended else steps)
    if batch_transform is not None:
        it = map(batch_transform, it)
    # Under a process group rank 0 alone writes the log and checkpoints.
    writer = group.rank == 0
    if not writer:
        log_path, progress = None, False
    log = _open_log(log_path, start if mgr is not None and start else None)
    history: list[dict[str, Any]] = []
    bar = tqdm(total=total, initial=start, disable=not progress, desc="fit")
    done = start
    at_start = mgr is not None and start in (resumed.get("step"), mgr.latest_step())
    saved_at = start if at_start else None
    stopped = ended  # by on_step or stop_after_nonfinite
    in_memory = nan_policy in _RESTORES and rollback_to == "memory"
    # Deep copies: state_dict() holds references to the live tensors. A
    # resumed run goes on with the snapshot its checkpoint saved.
    snapshot = None
    if in_memory:
        snapshot = resumed.get("snapshot") or copy.deepcopy(step.state_dict())

    def save(done, metrics=None):
        # With the NaN policy's state and, unless it is this very state, the
        # rollback snapshot: a resumed run goes on as the uninterrupted one.
        # FSDP2: every rank writes its shards (torch.distributed.checkpoint).
        if not writer and not _is_sharded(step):
            return
        kept = snapshot if in_memory and policy.snapshot_at != done else None
        mgr._save(done, step, None, metrics, policy.state(), kept)

    # As jaxstable's fit; under DDP locate re-runs the step on this rank's
    # unwrapped module (no collective: the ranks' re-runs take different
    # paths, e.g. one stops at its non-finite batch rows).
    locate_step = _locate_step(step)
    stall = StallMonitor()  # warns when rounding keeps eating the updates
    locatable = locate_step is not None
    i = start
    try:
        for batch in it:
            i = done
            # The random state the step draws its dropout masks from, for
            # locate to re-run it with (a 5 kB copy, no device sync).
            rng = rng_snapshot(step) if locatable else None
            t0 = time.perf_counter()
            metrics = step(batch)
            done = i + 1
            entry = _host_record(i, metrics)
            stall.check(entry)
            if time_steps:
                entry["time_s"] = time.perf_counter() - t0
            if eval_fn is not None and done % eval_every == 0:
                for path, value in _scalar_leaves(eval_fn(step)):
                    entry["eval" + path] = value
            action = policy.observe(i, entry["finite"])
            if action == "rollback":
                entry["rolled_back"] = True
            elif action == "rewind":
                at = policy.snapshot_at if in_memory else mgr.latest_step()
                entry.update(policy.rewind_record(i, at))
            location = None
            # A skipped step left model and optimizer as they were; only the
            # scaler backed off: re-run at the scale the step used.
            if locatable and policy.wants_location(_located_kind(entry), action):
                location = locate(
                    locate_step, batch, loss_scale=entry["loss_scale"], rng_state=rng
                )
                policy.located += 1
                entry["location"] = None if location is None else location._asdict()
            history.append(entry)
            if log is not None:
                log.write(json.dumps(entry) + "\n")
                log.flush()
            _show(bar, entry)
            wants_stop = on_step is not None and on_step(entry, step) is True
            if on_step is not None:
                wants_stop = group.any(wants_stop)  # every rank stops together
            if action in _RESTORES and in_memory:
                # A copy again: the optimizer may keep the loaded tensors and
                # update them in place, which must not reach the snapshot.
                step.load_state_dict(copy.deepcopy(snapshot))
            elif action in _RESTORES:  # the last good checkpoint on disk
                group.restore(mgr, step, restore_rng=False)
            elif action == "raise":
                _raise_non_finite(
                    step, entry, policy.run, batch, history, nan_policy,
                    max_rollbacks, location,
                )  # fmt: skip
            elif in_memory and entry["finite"] and done % rollback_every == 0:
                snapshot = copy.deepcopy(step.state_dict())
                policy.snapshot_at = done
            if action == "rewind" and rewind_skip:
                # The data window of the rewind: these batches are dropped.
                dropped = sum(1 for _ in itertools.islice(it, rewind_skip))
                done += dropped
                bar.update(dropped)
            if (wants_stop or policy.stop_due(i)) and action not in _RESTORES:
                stopped = True
                break
            if checkpoint_every is not None and done % checkpoint_every == 0:
                save(done, entry)
                saved_at = done
        if mgr is not None and saved_at != done:
            save(done)  # the final checkpoint
        if not stopped:
            _warn_if_short(steps, start, done)
    except BaseException as e:
        group.failed(e, i)
        raise
    finally:
        bar.close()
        if log is not None:
            log.close()
    return history


def _locate_step(step: Any) -> TrainStep | None:
    """The step `locate` re-runs: ``step`` itself in one process; under DDP a
    shallow copy on the unwrapped module (the same parameters, optimizer and
    scaler; no collective); None under FSDP2 (no rank holds the whole
    model) or for a plain step callable."""
    if not isinstance(step, TrainStep):
        return None
    rep = step._replicas
    if rep is None:
        return step
    if rep.ddp is None:
        return None
    local = copy.copy(step)
    local.model, local._replicas = rep.ddp.module, None
    return local


_FAILED_KEY = "torchref.fit.failed."


class _Group:
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
            "path": _directory_of(checkpoint_dir),
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
        if _is_sharded(step) and len(paths) > 1:
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
        if self.rank != 0 and every[0]["path"] is not None and _is_sharded(step):
            return CheckpointManager(every[0]["path"]), True
        return mgr, own_mgr

    def latest_step(self, mgr):
        """Rank 0's latest checkpoint step (taken in `plan`) or this one's."""
        return self.latest if self.size > 1 else mgr.latest_step()

    def restore(self, mgr, step, **kwargs):
        """`CheckpointManager.restore` of the checkpoint rank 0 restores
        (under FSDP2 every rank restores together: the manager agrees)."""
        if self.size == 1 or _is_sharded(step):
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


def _directory_of(checkpoint_dir) -> str | None:
    """The absolute directory of `checkpoint_dir` (a path or a manager)."""
    if checkpoint_dir is None:
        return None
    if isinstance(checkpoint_dir, CheckpointManager):
        return checkpoint_dir.directory
    return os.path.abspath(checkpoint_dir)


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


def _raise_non_finite(
    step: TrainStep,
    entry: dict[str, Any],
    run: int,
    batch: Any,
    history: list,
    nan_policy: str = "stop",
    max_rollbacks: int = 0,
    location: Any = None,
) -> None:
    # The grads left by the step: computed at the scale it used, unscaled by
    # GradScaler.unscale_ (not clipped on a non-finite step). Same message
    # layout as jaxstable.train.fit.
    # A plain step callable may have no model to report on.
    model = getattr(step, "model", None)
    report = non_finite_grad_report(model) if model is not None else []
    scale = f"{entry['loss_scale']:.6g}"
    parts = [
        f"{run} non-finite step(s) in a row, the last at step {entry['step']}; "
        f"loss={entry['loss']:.6g}, grad_norm={entry['grad_norm']:.6g}, "
        f"loss_scale={scale} (the scale that step used); its update was skipped "
        f"({_policy_note(nan_policy, max_rollbacks)}).",
        f"non-finite gradients at loss_scale={scale}:\n" + format_report(report),
    ]
    if entry.get("skip_reason") == "non-finite update":
        parts.insert(1, _UPDATE_NOTE)
    batch_report = non_finite_report(batch)
    if batch_report:
        parts.append("non-finite batch inputs:\n" + format_report(batch_report))
    param_report = non_finite_report(model) if model is not None else []
    if param_report:
        parts.append("non-finite parameters:\n" + format_report(param_report))
    if "first_non_finite_check" in entry:
        parts.append("check points of the step, in order: " + format_checks(entry))
    if "location" in entry:
        parts.append("where (diagnostics.locate):\n" + format_location(location))
    raise NonFiniteError(
        "\n".join(parts),
        step=entry["step"],
        report=report,
        history=history,
        location=location,
    )


def _located_kind(rec: dict[str, Any]) -> bool:
    """False when the step has non-finite values for `locate` to find: a
    step skipped as a spike was finite (its re-run would find nothing)."""
    return rec["finite"] or rec.get("skip_reason") == "spike"
