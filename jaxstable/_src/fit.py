"""The fit loop: logging, progress, checkpoints and the NaN policy."""

from __future__ import annotations

import itertools
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from jaxstable._src._lock import DirectoryLock
from jaxstable._src.checkpoint import CheckpointManager, _check_int
from jaxstable._src.diagnostics import (
    CheckPoints,
    check_record,
    format_checks,
    format_location,
    format_report,
    locate,
    non_finite_report,
)
from jaxstable._src.loss_scale import StaticLossScale
from jaxstable._src.step import TrainState, TrainStep

NAN_POLICIES = ("skip", "stop", "rollback", "rewind")
# The policies that restore a saved state.
_RESTORES = ("rollback", "rewind")
_ROLLBACK_TARGETS = ("memory", "disk")


class NonFiniteError(FloatingPointError):
    """Raised by `fit` after too many non-finite steps in a row.

    With ``nan_policy="stop"`` at the first such run; with ``"rollback"``
    once ``max_rollbacks`` rollbacks have been used.

    Attributes:
      step: 0-based index (in the run, see `fit`) of the step that hit the
        limit, as in `torchref.train.NonFiniteError`.
      state: the `TrainState` produced by that step (its update was skipped;
        no later batch was applied).
      report: `non_finite_report` of that step's gradients, recomputed at the
        loss scale that step used.
      history: the per-step records, ending with that step.
      location: `jaxstable.diagnostics.locate` of that step (a
        `NonFiniteLocation`), None when the op-by-op re-run found it finite.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        state: Any,
        report: list,
        history: list,
        location: Any = None,
    ):
        super().__init__(message)
        self.step = step
        self.state = state
        self.report = report
        self.history = history
        self.location = location


def _add_skip_reason(rec: dict[str, Any], grads_finite: Any, spike: Any = None) -> None:
    # Only a guarded step reports grads_finite (a plain step that does not
    # skip has no reason to give); then its record tells why it skipped.
    if grads_finite is None:
        return
    # Same keys as torchref.train.fit: a skipped step says why.
    rec["grads_finite"] = bool(grads_finite)
    if not rec["finite"]:
        rec["skip_reason"] = (
            "spike"
            if spike
            else "non-finite update"
            if rec["grads_finite"]
            else "non-finite gradients"
        )


def _host_record(index: int, metrics: dict[str, Any]) -> dict[str, Any]:
    m = jax.device_get(metrics)
    rec = {
        "step": index,
        "loss": float(m["loss"]),
        "grad_norm": float(m["grad_norm"]),
        "loss_scale": float(m["loss_scale"]),
        "finite": bool(m["finite"]),
        "skipped_total": int(m["skipped_total"]),
    }
    _add_skip_reason(rec, m.get("grads_finite"), m.get("spike"))
    aux = m.get("aux")
    if aux is not None:
        rec.update(_scalar_record("aux", aux))
        # The loss's check points (diagnostics.CheckPoints): checks[...] keys
        # and the non-finite points in order, instead of aux[...] keys.
        rec.update(check_record(aux))
    return rec


def _may_donate(train_step: Callable) -> bool:
    # An unknown callable may donate its input (e.g. jax.jit(step.raw,
    # donate_argnums=0)); a TrainStep says whether it does.
    if isinstance(train_step, TrainStep):
        return train_step.jit and train_step.donate
    return True


def fit(
    state: TrainState,
    train_step: Callable,
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
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Runs ``train_step`` over ``batches`` with logging and a NaN policy.

    The records, the JSONL log, the checkpoints and `NonFiniteError` are
    those of `torchref.train.fit`: step indices are 0-based and count from
    the start of the run (a resumed call goes on where the checkpoint
    left off), checkpoints are named by the run's global step n (batches
    of the run consumed): ``checkpoint_dir/step_{n:08d}``.

    Checkpoints and resume: with ``checkpoint_dir`` (a directory, or a
    `CheckpointManager` for other retention, a best-by-metric checkpoint or
    synchronous saves; by default the last 3 are kept and saves run in the
    background) the whole `TrainState` and the data position are saved
    every ``checkpoint_every`` steps of the run and once at the end (not
    when fit raises). With ``resume=True`` fit first restores the latest
    intact checkpoint there (a damaged one is warned of and skipped) and
    goes on from its position: ``steps`` and the position in ``batches``
    count from the start of the run (a sequence is indexed from there, an
    iterator has its first batches dropped: pass it from the start), the
    JSONL log keeps its lines before that position and is appended to, and
    the progress bar starts there. So the very same call, re-run after a
    crash, finishes the very same run; with no checkpoint yet it starts
    one. Without ``resume``, a directory that already holds checkpoints is
    refused (they would be overwritten). Each checkpoint also holds the NaN
    policy's state (non-finite steps in a row, rollbacks used, steps
    located, the first non-finite step) and, for an in-memory rollback, the
    snapshot unless it is that very state; all of it, the data position
    included, is under the checkpoint's sha256. So a run killed and resumed
    skips, stops and rolls back exactly as the uninterrupted run. fit
    uses no RNG: keep a model's key in the state (``model_state``, a typed
    ``jax.random.key`` is fine) or derive it from ``state.step``, and it is
    checkpointed with the rest. One run at a time writes a directory: fit
    holds the lock ``checkpoint_dir/.fit.lock`` for the call (process 0
    for them all under ``jax.distributed``), and a second fit on the
    directory is refused with a RuntimeError naming the pid and host of
    the first (a killed run's lock is stale and taken over). When fit runs
    fewer steps than ``steps`` (the batches ended; the checkpoint it resumed
    from is already past ``steps``) it says so with a UserWarning.

    Pipelining: the metrics of step k are read to the host only after step
    k+1 has been dispatched, so the device is never idle waiting for the
    host (the step itself never syncs). With ``nan_policy="stop"`` this
    lookahead is kept only when the step does not donate its input (a
    `TrainStep` made with ``donate=False``): the state produced by the
    failing step must still exist when its metrics are read. With a donating
    step (or a callable that is not a `TrainStep`) "stop" reads each step's
    metrics before dispatching the next (one host sync per step). Either way
    the error carries the failing step's own state and nothing after it is
    applied, logged or checkpointed. "rollback" follows the same rule; when
    the lookahead is kept and a rollback happens, the step already queued on
    the discarded state is dropped and its batch re-run on the snapshot.

    Rollback (``nan_policy="rollback"``): fit keeps an on-device copy of the
    last state known good (``jax.tree.map(jnp.copy, state)``: no host
    transfer, and a donating step cannot invalidate it), taken before the
    first step and after every step n (n steps of the run done) with
    ``n % rollback_every == 0`` whose result was finite; each snapshot step
    is read before the next is queued. When ``max_consecutive_nonfinite``
    non-finite steps happen in a row, a copy of the snapshot replaces the
    state (params, optimizer state, loss scale, model state and the
    ``step``/``skipped_total`` counters: all of the `TrainState`), the run
    counter restarts, that step's record gets ``"rolled_back": True`` (the
    only record with that key) and training goes on with the NEXT batch
    (the bad ones are not retried). The trigger after ``max_rollbacks``
    rollbacks raises `NonFiniteError` as "stop" does. With
    ``rollback_to="disk"`` the state goes back to the last intact checkpoint
    in ``checkpoint_dir`` instead (one is written before the first step if
    there is none; ``rollback_every`` is then unused): no copy in device
    memory. The in-memory snapshot costs one more
    copy of the state in device memory.

    Rewind (``nan_policy="rewind"``, PaLM's recipe for loss spikes): when
    ``rewind_after`` of the last ``rewind_window`` steps were skipped
    (non-finite, or spikes with `transforms.skip_spikes`), not necessarily
    in a row, the state goes back to the same snapshot as "rollback" (the
    in-memory copy, or the last intact checkpoint with
    ``rollback_to="disk"``) and the data goes on after the trigger step and
    ``rewind_skip`` more batches: the batches from the restore point to
    the trigger are not replayed and the next ``rewind_skip`` are dropped,
    so the rewound run equals a run that never saw them (bit for bit, for
    a deterministic step). The trigger step's record gets ``"rewound":
    True``, ``"rewind_from"`` (its step), ``"rewind_to"`` (the step of the
    run restored) and ``"batches_skipped"`` (``rewind_from + 1 - rewind_to
    + rewind_skip``; fewer when the data ends first). Rewinds count
    against ``max_rollbacks``; the trigger after the last raises
    `NonFiniteError`. The window of skipped steps is checkpointed with the
    NaN policy's state, so a resumed run rewinds as the uninterrupted one.

    Args:
      state: the initial `TrainState`.
      train_step: ``train_step(state, batch) -> (state, metrics)``, usually
        from `make_train_step`.
      batches: an iterable of batches.
      steps: stop after this many steps (None: until ``batches`` ends).
      nan_policy: ``"skip"`` (non-finite steps are skipped, training goes on),
        ``"stop"`` (raise `NonFiniteError` after
        ``max_consecutive_nonfinite`` non-finite steps in a row) or
        ``"rollback"`` (restore the last good snapshot instead, see above)
        or ``"rewind"`` (restore it and skip a window of data, see above).
      max_consecutive_nonfinite: the limit for ``"stop"`` and
        ``"rollback"``, >= 1.
      log_path: JSONL file, overwritten at the start of a call that does not
        resume (see above for one that does): one line
        per step (keys ``step, loss, grad_norm, loss_scale, finite,
        skipped_total`` and ``aux[...]`` scalars; with a step that reports
        ``grads_finite``, as `make_train_step`'s does, that key too, and a
        skipped step has ``skip_reason``: ``"non-finite gradients"`` or
        ``"non-finite update"``; when ``aux`` holds a
        `jaxstable.diagnostics.CheckPoints`, its ``checks[...]``,
        ``non_finite_checks`` and ``first_non_finite_check`` keys, see
        `jaxstable.diagnostics.check_record`).
      progress: show a tqdm progress bar with loss, grad_norm, loss_scale,
        skipped.
      checkpoint_dir: None, a directory or a `CheckpointManager` (see
        above); a final checkpoint is always written when the loop ends (not
        when it raises).
      checkpoint_every: also write one every this many steps of the run
        (needs ``checkpoint_dir``). Without it, only the final checkpoint.
      rollback_every: snapshot period in steps for ``"rollback"``, int >= 1
        (accepted, unused, with the other policies).
      max_rollbacks: rollbacks allowed in the run for ``"rollback"``,
        int >= 1 (accepted, unused, with the other policies).
      locate_first: the first this many non-finite steps of the run (int
        >= 0) get ``"location"``: `jaxstable.diagnostics.locate` of the step
        (at the loss scale it used) as a dict of `NonFiniteLocation` fields,
        or None when the op-by-op re-run is finite; the step that makes
        "stop" raise or "rollback" roll back always gets it (and the error
        its ``location``). Costs one op-by-op re-run per located step, only
        on non-finite steps. With "skip" and a step that donates its input
        (``donate=True``) the input is gone when the step is read: such
        steps are not located.
      time_steps: add ``"time_s"`` to each record: the wall time from the
        call of ``train_step`` until its new state and metrics are ready
        (`jax.block_until_ready`). Off by default: it waits for every step,
        so the lookahead described above is dropped.
      eval_fn: ``eval_fn(state) -> {name: scalar}``, e.g. a held-out
        evaluation; called after every ``eval_every``-th step (n steps of
        the run done, ``n % eval_every == 0``) on that step's state, its
        scalars added to that step's record as ``eval[...]`` keys (named as
        ``aux``'s). Needs ``eval_every``.
      eval_every: int >= 1, the period of ``eval_fn`` (needs ``eval_fn``).
      on_step: ``on_step(record, state)``, called once per step with the
        step's record (after it is logged) and the state that step produced;
        if it returns True, fit stops after that step and returns normally.
      resume: continue the run from the latest intact checkpoint in
        ``checkpoint_dir`` (see above).
      rollback_to: ``"memory"`` (the in-memory snapshot) or ``"disk"`` (the
        last intact checkpoint; needs ``checkpoint_dir``).
      batch_transform: None, or ``batch_transform(batch) -> batch`` applied
        to each batch right before the step (after a resume's skip: skipped
        batches are not transformed), e.g. placing a global batch on a mesh:
        ``functools.partial(jaxstable.distributed.shard_batch, mesh=mesh)``
        with a state placed by ``distributed.shard_state`` (checkpoints are
        then written from, and restored onto, the sharded state).
      rewind_after: skipped steps (non-finite or spikes) among the last
        ``rewind_window`` that trigger a rewind, int >= 1 (used by
        ``"rewind"`` only).
      rewind_window: the window of steps those are counted in, int >=
        ``rewind_after``.
      rewind_skip: batches dropped after the trigger step, besides those
        from the restore point to it, int >= 0.
      stop_after_nonfinite: None, or an int >= 0: fit returns normally
        (nothing raised) this many steps after the first step of the run
        whose record has ``finite == False`` (0: stop at that step; a run
        resumed after that step runs none). For runs
        that are meant to fail (a naive low-precision baseline): a few steps
        show what follows, then nothing more is learned from NaN weights.

    Any ``train_step`` with the contract above works, a pure function over a
    plain dict (or any pytree) state included; the metrics must hold
    ``loss``, ``grad_norm``, ``loss_scale``, ``finite`` and
    ``skipped_total`` (and optionally ``aux``). Only a `TrainStep` gives the
    error report its gradient table (it has ``grads``).

    Returns:
      ``(state, history)``: the final state and a list of per-step metric
      dicts (Python numbers, the same records as the JSON lines; a rollback
      step's record also has ``"rolled_back": True``). When fit stops early
      (``stop_after_nonfinite``, ``on_step``), the state is that of the last
      recorded step: a step queued after it is dropped.

    Raises:
      NonFiniteError: with ``nan_policy="stop"``, or ``"rollback"`` once the
        rollbacks are used up (the message says so); the message names the step,
        the loss scale it used, and lists the non-finite gradient leaves
        (recomputed at that scale) and batch inputs.
      ValueError: bad ``nan_policy`` (lists the valid values) or limits.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import train, transforms
      >>> tx = transforms.stable_optimizer(optax.sgd(0.1))
      >>> state = train.TrainState.create(params=jnp.zeros(2), optimizer=tx)
      >>> step = train.make_train_step(lambda p, b: jnp.sum((p - b) ** 2))
      >>> data = [jnp.ones(2), jnp.array([jnp.nan, 1.0]), jnp.ones(2)]
      >>> state, hist = train.fit(state, step, data, progress=False)
      >>> [h["finite"] for h in hist], hist[-1]["skipped_total"]
      ([True, False, True], 1)
      >>> try:
      ...     train.fit(state, step, data[1:], nan_policy="stop",
      ...               max_consecutive_nonfinite=1, progress=False)
      ... except train.NonFiniteError as e:
      ...     print(e.step, "|", str(e).split(";")[0])
      0 | 1 non-finite step(s) in a row, the last at step 0
      >>> data = [jnp.ones(2), jnp.ones(2), jnp.array([jnp.nan, 1.0]), jnp.ones(2)]
      >>> before = int(state.step)
      >>> state, hist = train.fit(state, step, data, nan_policy="rollback",
      ...                         max_consecutive_nonfinite=1, rollback_every=2,
      ...                         progress=False)
      >>> # 4 steps, but the rollback undid the NaN one (back to the snapshot at 2)
      >>> [h.get("rolled_back", False) for h in hist], int(state.step) - before
      ([False, False, True, False], 3)
      >>> data = [jnp.ones(2), jnp.array([jnp.nan, 1.0])] + [jnp.ones(2)] * 5
      >>> state, hist = train.fit(state, step, data, progress=False, time_steps=True,
      ...                         eval_fn=lambda s: {"p0": s.params[0]}, eval_every=2,
      ...                         stop_after_nonfinite=2)
      >>> len(hist), [k for k in hist[1] if k not in hist[0]]  # stopped 2 after step 1
      (4, ['skip_reason', "eval['p0']", 'location'])
      >>> hist[3]["eval['p0']"] == float(state.params[0]), hist[0]["time_s"] > 0
      (True, True)
    """
    _check_fit_args(
        nan_policy, max_consecutive_nonfinite, rollback_every, max_rollbacks, steps,
        locate_first, checkpoint_dir, checkpoint_every, resume, rollback_to,
        time_steps, eval_fn, eval_every, on_step, stop_after_nonfinite,
    )  # fmt: skip
    _check_callable("batch_transform", batch_transform)
    _check_rewind_args(rewind_after, rewind_window, rewind_skip)
    mgr, own_mgr, lock = _manager(checkpoint_dir)
    try:
        state, start, resumed = _resume(mgr, state, resume)
        if mgr is not None and rollback_to == "disk" and mgr.latest_step() is None:
            mgr.save(start, state)  # what the first rollback goes back to
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
    state, train_step, batches, steps, nan_policy, max_consecutive_nonfinite,
    log_path, progress, checkpoint_every, rollback_every, max_rollbacks,
    locate_first, time_steps, eval_fn, eval_every, on_step, stop_after_nonfinite,
    rollback_to, mgr, start, batch_transform, resumed, rewind_after,
    rewind_window, rewind_skip, **_,
):  # fmt: skip
    """The loop of `fit` from global step `start` (its arguments checked)."""
    from tqdm.auto import tqdm  # imported here: only fit needs it

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
    # The lookahead needs each step's output state to outlive the next
    # dispatch whenever fit reads it (policy, callback, eval, early stop):
    # only a step that does not donate its input keeps it.
    reads_state = nan_policy != "skip" or on_step is not None
    reads_state = reads_state or eval_fn is not None
    reads_state = reads_state or stop_after_nonfinite is not None
    pipeline = not time_steps and (not reads_state or not _may_donate(train_step))
    history: list[dict[str, Any]] = []
    bar = tqdm(total=total, initial=start, disable=not progress, desc="train")
    log = _open_log(log_path, start if mgr is not None and start else None)
    rollback = nan_policy in _RESTORES
    # A device copy: the step may donate `state`, never the snapshot. A
    # resumed run goes on with the snapshot its checkpoint saved.
    in_memory = rollback and rollback_to == "memory"
    snapshot = resumed.get("snapshot", state) if in_memory else None
    snapshot = jax.tree.map(jnp.copy, snapshot) if in_memory else None

    def consume(pending) -> str | None:
        """Logs one step, applies the policy: "rollback", "stop" or None."""
        nonlocal snapshot
        index, metrics, batch, state_out, seconds = pending
        rec = _host_record(index, metrics)
        if seconds is not None:
            rec["time_s"] = seconds
        if eval_fn is not None and (index + 1) % eval_every == 0:
            rec.update(_scalar_record("eval", eval_fn(state_out)))
        action = policy.observe(index, rec["finite"])
        if action == "rollback":
            rec["rolled_back"] = True
        elif action == "rewind":
            at = policy.snapshot_at if in_memory else mgr.latest_step()
            rec.update(policy.rewind_record(index, at))
        location = None
        if policy.wants_location(_located_kind(rec), action):
            location = _locate_failed(train_step, state_out, metrics, batch, pipeline)
            if location is not False:
                policy.located += 1
                rec["location"] = None if location is None else location._asdict()
        history.append(rec)
        if log is not None:
            log.write(json.dumps(rec) + "\n")
            log.flush()
        _show(bar, rec)
        wants_stop = on_step is not None and on_step(rec, state_out) is True
        if action in _RESTORES:
            return action
        if action == "raise":
            _raise_non_finite(
                train_step, rec, policy.run, batch, state_out, metrics, history,
                nan_policy, max_rollbacks, location or None,
            )  # fmt: skip
        if in_memory and rec["finite"] and (index + 1) % rollback_every == 0:
            # Read before the next step is queued (see snapshot_due), so a
            # donating step has not consumed state_out yet.
            snapshot = jax.tree.map(jnp.copy, state_out)
            policy.snapshot_at = index + 1
        return "stop" if wants_stop or policy.stop_due(index) else None

    def restored(current):
        if not in_memory:  # the last good checkpoint on disk
            return mgr.restore(current)[0]
        # A copy again: a donating step must leave the snapshot intact for
        # the next rollback.
        return jax.tree.map(jnp.copy, snapshot)

    def save(done, state, metrics=None):
        # With the NaN policy's state and, unless it is this very state, the
        # rollback snapshot: a resumed run goes on as the uninterrupted one.
        kept = snapshot if in_memory and policy.snapshot_at != done else None
        mgr._save(done, state, None, metrics, policy.state(), kept)

    def drop(n: int) -> None:
        """Skips the next `n` batches (a rewind's data window)."""
        nonlocal done
        dropped = sum(1 for _ in itertools.islice(it, n))
        done += dropped
        bar.update(dropped)

    pending = None
    done = start  # steps of the run dispatched so far
    at_start = mgr is not None and start in (resumed.get("step"), mgr.latest_step())
    saved_at = start if at_start else None
    stopped = ended  # by on_step or stop_after_nonfinite
    try:
        for batch in it:
            t0 = time.perf_counter()
            new_state, metrics = train_step(state, batch)
            seconds = None
            if time_steps:
                jax.block_until_ready((new_state, metrics))
                seconds = time.perf_counter() - t0
            # Step done-1, read after step done is queued. If it rolled back,
            # the step just queued ran on a discarded state: re-run its batch
            # on the snapshot (it is the next batch, not a bad one retried).
            # If it stopped the run, the step just queued is dropped.
            action = None if pending is None else consume(pending)
            if action == "stop":
                state, pending, stopped = pending[3], None, True
                break
            if action == "rewind" and rewind_skip:
                # This batch ran on a discarded state: it is the first of
                # the rewind_skip batches dropped after the trigger.
                state, pending, done = restored(new_state), None, done + 1
                bar.update(1)
                drop(rewind_skip - 1)
                continue
            if action in _RESTORES:
                new_state, metrics = train_step(restored(new_state), batch)
            pending = (done, metrics, batch, new_state, seconds)
            done += 1
            state = new_state
            due = checkpoint_every is not None and done % checkpoint_every == 0
            snapshot_due = in_memory and done % rollback_every == 0
            if not pipeline or due or snapshot_due:
                # A checkpoint is written only after its step passed the check.
                action = consume(pending)
                pending = None
                if action in _RESTORES:
                    state = restored(state)
                    drop(rewind_skip if action == "rewind" else 0)
                elif action == "stop":
                    stopped = True
                    break
            if due:
                save(done, state, history[-1] if history else None)
                saved_at = done
        if pending is not None and consume(pending) in _RESTORES:
            state = restored(state)
            drop(rewind_skip if nan_policy == "rewind" else 0)
        if mgr is not None and saved_at != done:
            save(done, state)  # the final checkpoint
        if not stopped:
            _warn_if_short(steps, start, done)
    finally:
        bar.close()
        if log is not None:
            log.close()
    return state, history


def _show(bar, rec) -> None:
    bar.set_postfix(
        loss=f"{rec['loss']:.4g}",
        grad_norm=f"{rec['grad_norm']:.3g}",
        loss_scale=f"{rec['loss_scale']:.3g}",
        skipped=rec["skipped_total"],
        refresh=False,
    )
    bar.update(1)


def _manager(checkpoint_dir):
    """``(manager, owned, lock)``: a `CheckpointManager` for `checkpoint_dir`
    and the directory's lock, taken first (one run writes a directory; with
    several processes, process 0 takes it for them all)."""
    if checkpoint_dir is None:
        return None, False, None
    given = isinstance(checkpoint_dir, CheckpointManager)
    directory = checkpoint_dir.directory if given else checkpoint_dir
    lock = DirectoryLock(directory) if jax.process_index() == 0 else None
    if lock is not None:
        lock.acquire()
    try:
        mgr = checkpoint_dir if given else CheckpointManager(checkpoint_dir)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return mgr, not given, lock


def _resume(mgr, state, resume):
    """``(state, start, info)``: the latest intact checkpoint's state, data
    position and `CheckpointManager.restore` info with `resume`, else
    `state`, 0 and {} (refusing a directory that already holds a run: its
    checkpoints would be overwritten)."""
    latest = None if mgr is None else mgr.latest_step()
    if latest is None:
        return state, 0, {}
    if not resume:
        raise ValueError(
            f"checkpoint_dir {mgr.directory!r} already holds checkpoints (up to "
            f"step {latest}): pass resume=True to continue that run, or another "
            "directory to start a new one"
        )
    state, info = mgr.restore(state)
    return state, int(info["data_position"]), info


# Same in torchref.train.fit (the shared fit helpers below).
class _NanPolicy:
    """The NaN-policy bookkeeping of a run, checkpointed with it.

    ``run``: non-finite steps in a row; ``rollbacks``: rollbacks used;
    ``located``: non-finite steps located; ``first_bad``: index of the
    run's first non-finite step (for ``stop_after_nonfinite``);
    ``snapshot_at``: the step of the run the rollback snapshot holds;
    ``recent``: indices of the skipped steps among the last
    ``rewind_window`` (for "rewind"; rewinds count in ``rollbacks``). A
    resumed `fit` loads them from its checkpoint (`load`), so that a run
    killed and resumed counts, stops and rolls back as the uninterrupted one.
    """

    _SAVED = ("run", "rollbacks", "located", "first_bad", "snapshot_at", "recent")

    def __init__(
        self, policy, limit, max_rollbacks, locate_first, stop_after,
        rewind=(3, 100, 0),
    ):  # fmt: skip
        self.policy, self.limit, self.max_rollbacks = policy, limit, max_rollbacks
        self.locate_first, self.stop_after = locate_first, stop_after
        self.rewind_after, self.rewind_window, self.rewind_skip = rewind
        self.run = self.rollbacks = self.located = self.snapshot_at = 0
        self.first_bad = None
        self.recent: list[int] = []

    def state(self) -> dict[str, int | None]:
        """What a checkpoint keeps (JSON, under its checksum)."""
        return {k: getattr(self, k) for k in self._SAVED}

    def load(self, saved: dict | None, start: int) -> None:
        """The state of a checkpoint at step `start` (None: a new run, or a
        checkpoint written before fit saved it: counts from 0)."""
        self.snapshot_at = start
        for k in self._SAVED:
            if saved and k in saved:
                setattr(self, k, saved[k])

    def observe(self, index: int, finite: bool) -> str | None:
        """What the step just recorded triggers: "rollback", "rewind",
        "raise" or None."""
        self.run = 0 if finite else self.run + 1
        if not finite and self.first_bad is None:
            self.first_bad = index
        if self.policy == "rewind":
            return self._observe_rewind(index, finite)
        if self.policy == "skip" or self.run < self.limit:
            return None
        if self.policy == "rollback" and self.rollbacks < self.max_rollbacks:
            self.rollbacks, self.run = self.rollbacks + 1, 0
            return "rollback"
        return "raise"

    def _observe_rewind(self, index: int, finite: bool) -> str | None:
        # rewind_after skipped steps among the last rewind_window steps.
        if not finite:
            self.recent.append(index)
        self.recent = [i for i in self.recent if i > index - self.rewind_window]
        if len(self.recent) < self.rewind_after:
            return None
        if self.rollbacks < self.max_rollbacks:
            self.rollbacks, self.run, self.recent = self.rollbacks + 1, 0, []
            return "rewind"
        return "raise"

    def rewind_record(self, index: int, restored_at: int) -> dict[str, Any]:
        """The keys a rewind adds to its trigger step's record."""
        return {
            "rewound": True,
            "rewind_from": index,
            "rewind_to": restored_at,
            "batches_skipped": index + 1 - restored_at + self.rewind_skip,
        }

    def wants_location(self, finite: bool, action: str | None) -> bool:
        # `finite`: nothing to locate (a spike skipped with finite values
        # counts as finite here, see _located_kind).
        return not finite and (action is not None or self.located < self.locate_first)

    def stop_due(self, index: int) -> bool:
        if self.stop_after is None or self.first_bad is None:
            return False
        return index - self.first_bad >= self.stop_after


def _located_kind(rec: dict[str, Any]) -> bool:
    """False when the step has non-finite values for `locate` to find: a
    step skipped as a spike was finite (its re-run would find nothing)."""
    return rec["finite"] or rec.get("skip_reason") == "spike"


def _batches_from(batches, position: int, steps: int | None):
    """`batches` from the run's `position`, up to `steps` of the run in all.

    A sequence (``__getitem__`` and ``__len__``) is indexed from `position`;
    anything else is iterated and its first `position` batches dropped.
    """
    if position and hasattr(batches, "__getitem__") and hasattr(batches, "__len__"):
        it = (batches[i] for i in range(position, len(batches)))
    else:
        it = itertools.islice(iter(batches), position, None)
    return it if steps is None else itertools.islice(it, max(steps - position, 0))


def _open_log(log_path, resumed_at: int | None):
    """The JSONL log: overwritten, or on resume kept up to `resumed_at`
    (records of steps after the checkpoint are re-run, so dropped) and
    appended to. A missing log, and lines that are not records (damaged;
    the crash's torn last line excepted), give a RuntimeWarning; the valid
    records around a damaged line are kept."""
    if log_path is None:
        return None
    if resumed_at is None:
        return open(log_path, "w", encoding="utf-8")
    where = f"log_path {os.fspath(log_path)!r}"
    if not os.path.exists(log_path):
        warnings.warn(
            f"{where} does not exist: the run resumes at step {resumed_at} and "
            "its log starts there (the records of the steps before are not in "
            "it)",
            RuntimeWarning,
            4,
        )
        return open(log_path, "w", encoding="utf-8")
    with open(log_path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    kept, damaged = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            damaged.append(number)
        elif rec["step"] < resumed_at:
            kept.append(line + "\n")
    if damaged and damaged[-1] == len(lines):
        damaged.pop()  # torn by the crash: no newline after it
    if damaged:
        warnings.warn(
            f"{where}: line(s) {damaged} are not JSON records (damaged) and "
            f"were dropped; the records around them up to step {resumed_at} "
            "are kept",
            RuntimeWarning,
            4,
        )
    tmp = f"{os.fspath(log_path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, log_path)
    return open(log_path, "a", encoding="utf-8")


def _warn_if_short(steps: int | None, start: int, done: int) -> None:
    """A UserWarning when fit ran fewer steps than `steps` asked (not after a
    stop it was asked for). Same text in jaxstable.train and torchref.train."""
    if steps is None or (done >= steps and start <= steps):
        return
    if start > steps:
        why = (
            f"fit ran no step: the checkpoint it resumed from is at step {start}, "
            f"past steps={steps} (the state returned is that checkpoint's)"
        )
    else:
        why = (
            f"fit ran {done - start} of the {steps - start} step(s) asked "
            f"(steps={steps}, from step {start}): the batches ended at step {done}"
        )
    warnings.warn(why, UserWarning, 4)


def _check_callable(name: str, fn: Any) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be None or a callable, got {fn!r}")


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _check_needs(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_rewind_args(rewind_after, rewind_window, rewind_skip) -> None:
    # Same checks and texts in jaxstable.train.fit and torchref.train.fit.
    _check_int("rewind_after", rewind_after, 1)
    _check_int("rewind_window", rewind_window, 1)
    _check_int("rewind_skip", rewind_skip, 0)
    _check_needs(
        rewind_window >= rewind_after,
        f"rewind_window ({rewind_window}) must be >= rewind_after "
        f"({rewind_after}): a window of {rewind_window} steps never holds "
        f"{rewind_after} skipped ones",
    )


def _check_fit_args(
    nan_policy, max_consecutive, rollback_every, max_rollbacks, steps,
    locate_first, checkpoint_dir, checkpoint_every, resume, rollback_to,
    time_steps, eval_fn, eval_every, on_step, stop_after,
):  # fmt: skip
    # Same checks and texts as torchref.train.fit.
    _check_bool("time_steps", time_steps)
    _check_bool("resume", resume)
    _check_callable("eval_fn", eval_fn)
    _check_callable("on_step", on_step)
    _check_needs(
        (eval_fn is None) == (eval_every is None),
        "eval_fn and eval_every go together: pass both or neither, got "
        f"eval_fn={eval_fn!r}, eval_every={eval_every!r}",
    )
    _check_int("eval_every", eval_every, 1, optional=True)
    _check_int("stop_after_nonfinite", stop_after, 0, optional=True)
    _check_choice("nan_policy", nan_policy, NAN_POLICIES)
    _check_choice("rollback_to", rollback_to, _ROLLBACK_TARGETS)
    _check_int("max_consecutive_nonfinite", max_consecutive, 1)
    _check_int("rollback_every", rollback_every, 1)
    _check_int("max_rollbacks", max_rollbacks, 1)
    _check_int("steps", steps, 0, optional=True)
    _check_int("locate_first", locate_first, 0)
    _check_int("checkpoint_every", checkpoint_every, 1, optional=True)
    _check_needs(
        checkpoint_every is None or checkpoint_dir is not None,
        "checkpoint_every needs checkpoint_dir",
    )
    _check_needs(
        not resume or checkpoint_dir is not None, "resume needs checkpoint_dir"
    )
    _check_needs(
        rollback_to == "memory" or checkpoint_dir is not None,
        "rollback_to='disk' needs checkpoint_dir",
    )


# Same text in jaxstable.train and torchref.train.
_UPDATE_NOTE = (
    "its gradients were finite: the update it computed (new parameters or "
    "optimizer state) was non-finite, e.g. float16 Adam state whose second "
    "moment underflowed to 0 while eps is 0 in float16"
)


def _scalar_record(prefix: str, tree: Any) -> dict[str, float]:
    # prefix + keystr of every scalar leaf: the aux[...] naming of records.
    out = {}
    leaves = jax.tree_util.tree_flatten_with_path(
        jax.device_get(tree), is_leaf=lambda x: isinstance(x, CheckPoints)
    )[0]
    for path, leaf in leaves:
        if isinstance(leaf, CheckPoints):
            continue  # written by check_record
        if getattr(leaf, "size", 1) == 1:
            out[prefix + jax.tree_util.keystr(path)] = float(leaf)
    return out


def _policy_note(nan_policy: str, max_rollbacks: int) -> str:
    # Same text as torchref.train.fit.
    if nan_policy == "rewind":
        return f"nan_policy='rewind': rewinds exhausted (max_rollbacks={max_rollbacks})"
    if nan_policy == "rollback":
        return (
            "nan_policy='rollback': rollbacks exhausted "
            f"(max_rollbacks={max_rollbacks})"
        )
    return f"nan_policy={nan_policy!r}"


def _raise_non_finite(
    train_step,
    rec,
    consecutive,
    batch,
    state_out,
    metrics,
    history,
    nan_policy="stop",
    max_rollbacks=0,
    location=None,
):
    # state_out is the failing step's own output: a non-finite step leaves
    # params, opt_state and model_state as they were, but its loss scale has
    # already backed off. Recompute at the scale the step USED, or an
    # overflow of the scaled loss (not NaN data) would look all finite.
    used = StaticLossScale(metrics["loss_scale"])
    grads_fn = getattr(train_step, "grads", None)
    report = (
        non_finite_report(grads_fn(state_out.replace(loss_scale=used), batch))
        if grads_fn is not None
        else []
    )
    scale = f"{rec['loss_scale']:.6g}"
    parts = [
        f"{consecutive} non-finite step(s) in a row, the last at step "
        f"{rec['step']}; loss={rec['loss']:.6g}, grad_norm={rec['grad_norm']:.6g}, "
        f"loss_scale={scale} (the scale that step used); its update was skipped "
        f"({_policy_note(nan_policy, max_rollbacks)}).",
        f"non-finite gradients at loss_scale={scale}:\n" + format_report(report),
    ]
    if rec.get("skip_reason") == "non-finite update":
        parts.insert(1, _UPDATE_NOTE)
    batch_report = non_finite_report(batch)
    if batch_report:
        parts.append("non-finite batch inputs:\n" + format_report(batch_report))
    # A plain pytree state (a pure step over a dict) has no .params.
    param_report = non_finite_report(getattr(state_out, "params", state_out))
    if param_report:
        parts.append("non-finite parameters:\n" + format_report(param_report))
    if "first_non_finite_check" in rec:
        parts.append("check points of the step, in order: " + format_checks(rec))
    if "location" in rec:
        parts.append("where (diagnostics.locate):\n" + format_location(location))
    raise NonFiniteError(
        "\n".join(parts),
        step=rec["step"],
        state=state_out,
        report=report,
        history=history,
        location=location,
    )


def _locate_failed(train_step, state_out, metrics, batch, pipeline):
    """`locate` of a non-finite step from its output state (params, optimizer
    and model state unchanged by a skipped step) at the loss scale it used.
    False when it cannot be located: not a `TrainStep`, or its input state
    donated to the step already queued after it."""
    if not isinstance(train_step, TrainStep) or not hasattr(train_step, "loss_fn"):
        return False
    leaves = jax.tree_util.tree_leaves(state_out)
    if pipeline and any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
        return False
    used = StaticLossScale(metrics["loss_scale"])
    # finite=False: the compiled step was not applied (no need to re-run it).
    return locate(train_step, state_out.replace(loss_scale=used), batch, finite=False)
