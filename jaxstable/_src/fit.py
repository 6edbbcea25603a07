"""The fit loop: logging, progress, checkpoints and the NaN policy."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from _stablecore.bad_data import for_run as _bad_batches
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
from jaxstable._src.checkpoint_manager import CheckpointManager
from jaxstable._src.fit_report import NonFiniteError as NonFiniteError
from jaxstable._src.fit_report import (
    host_record,
    locate_failed,
    raise_non_finite,
    scalar_record,
)
from jaxstable._src.step import TrainState, TrainStep
from jaxstable._src.watchdog import Peers, check_same_on_every_process

_SKIP = NanPolicy.skip()
_LOG = Log()


def _may_donate(train_step: Callable) -> bool:
    # An unknown callable may donate its input (e.g. jax.jit(step.raw,
    # donate_argnums=0)); a TrainStep says whether it does.
    if isinstance(train_step, TrainStep):
        return train_step.jit and train_step.donate
    return True


@accepts_old_keywords
def fit(
    state: TrainState,
    train_step: Callable,
    batches: Iterable[Any],
    *,
    steps: int | None = None,
    nan_policy: NanPolicy = _SKIP,
    checkpoint: Checkpointing | str | os.PathLike | CheckpointManager | None = None,
    evaluate: tuple[Callable[[Any], Any], int] | None = None,
    on_step: Callable[[dict[str, Any], Any], Any] | None = None,
    log: Log | str | os.PathLike | None = _LOG,
    batch_transform: Callable[[Any], Any] | None = None,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Runs ``train_step`` over ``batches`` with logging and a NaN policy.

    The records, the JSONL log, the checkpoints and `NonFiniteError` are
    those of `torchref.train.fit`: step indices are 0-based and count from
    the start of the run (a resumed call goes on where the checkpoint
    left off), checkpoints are named by the run's global step n (batches
    of the run consumed): ``checkpoint_dir/step_{n:08d}``. What advances on
    a skipped, rolled back or rewound step is tabled in docs/semantics.md.

    Checkpoints and resume: with ``checkpoint=`` (a directory, a
    `Checkpointing` or a `CheckpointManager` for other retention, a
    best-by-metric checkpoint or synchronous saves; by default the last 3
    are kept and saves run in the background) the whole `TrainState` and
    the data position are saved every ``Checkpointing.every`` steps of the
    run and once at the end (not when fit raises). With
    ``Checkpointing(..., resume=True)`` fit first restores the latest
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

    Several processes (`jax.distributed`, a state placed with
    `jaxstable.distributed.shard_state`): every process calls fit with the
    same arguments and gets the same records; process 0 alone writes the
    log and shows the progress bar; checkpoints are saved and restored by
    all processes together (leaves split over processes are gathered, so
    ``checkpoint_dir`` must be one directory every process sees), and the
    first non-finite steps are located by every process on its own shards
    (nothing gathered; docs/locate.md). When
    fit fails on one process (an exception of its own, or a collective that
    failed because another process died), the others print its error
    (naming the process and the step) and exit with status 1 instead of
    waiting in the next collective; the failing process raises (after a
    failed collective, a RuntimeError naming the processes that no longer
    answer) and ends with status 1 when Python exits, without waiting in
    jax's shutdown barrier for processes that are gone (so an exception is
    no way to stop every process early and go on: return True from
    ``on_step`` instead). A dead process 0
    ends the others at once by jax's own abort (SIGABRT), and a collective
    that hangs instead of failing by jax's heartbeat timeout
    (``jax.distributed.initialize(heartbeat_timeout_seconds=)``). See
    docs/distributed.md.

    Pipelining: the metrics of step k are read to the host only after step
    k+1 has been dispatched, so the device is never idle waiting for the
    host (the step itself never syncs). With `NanPolicy.stop` this
    lookahead is kept only when the step does not donate its input (a
    `TrainStep` made with ``donate=False``): the state produced by the
    failing step must still exist when its metrics are read. With a donating
    step (or a callable that is not a `TrainStep`) "stop" reads each step's
    metrics before dispatching the next (one host sync per step). Either way
    the error carries the failing step's own state and nothing after it is
    applied, logged or checkpointed. "rollback" follows the same rule; when
    the lookahead is kept and a rollback happens, the step already queued on
    the discarded state is dropped and its batch re-run on the snapshot.

    Rollback (`NanPolicy.rollback`): fit keeps an on-device copy of the
    last state known good (``jax.tree.map(jnp.copy, state)``: no host
    transfer, and a donating step cannot invalidate it), taken before the
    first step and after every step n (n steps of the run done) with
    ``n % every == 0`` whose result was finite; each snapshot step
    is read before the next is queued. When ``max_consecutive``
    non-finite steps happen in a row, a copy of the snapshot replaces the
    state (params, optimizer state, loss scale, model state and the
    ``step``/``skipped_total`` counters: all of the `TrainState`), the run
    counter restarts, that step's record gets ``"rolled_back": True`` (the
    only record with that key) and training goes on with the NEXT batch
    (the bad ones are not retried). The trigger after ``max``
    rollbacks raises `NonFiniteError` as "stop" does. With
    ``to="disk"`` the state goes back to the last intact checkpoint
    in ``checkpoint_dir`` instead (one is written before the first step if
    there is none; ``every`` is then unused): no copy in device
    memory. The in-memory snapshot costs one more
    copy of the state in device memory.

    Rewind (`NanPolicy.rewind`, PaLM's recipe for loss spikes): when
    ``after`` of the last ``window`` steps were skipped
    (non-finite, or spikes with `transforms.skip_spikes`), not necessarily
    in a row, the state goes back to the same snapshot as "rollback" (the
    in-memory copy, or the last intact checkpoint with
    ``to="disk"``) and the data goes on after the trigger step and
    ``skip`` more batches: the batches from the restore point to
    the trigger are not replayed and the next ``rewind_skip`` are dropped,
    so the rewound run equals a run that never saw them (bit for bit, for
    a deterministic step). The trigger step's record gets ``"rewound":
    True``, ``"rewind_from"`` (its step), ``"rewind_to"`` (the step of the
    run restored) and ``"batches_skipped"`` (the batches trained since the
    restore point, or since the last rewind when a second one goes back to
    the same snapshot, plus those dropped after the trigger: fewer than
    ``skip`` when the data ends). Rewinds count
    against ``max``; the trigger after the last raises
    `NonFiniteError`. The window of skipped steps is checkpointed with the
    NaN policy's state, so a resumed run rewinds as the uninterrupted one.

    Args:
      state: the initial `TrainState`.
      train_step: ``train_step(state, batch) -> (state, metrics)``, usually
        from `make_train_step`.
      batches: an iterable of batches.
      steps: stop after this many steps of the run (None: until ``batches``
        ends).
      nan_policy: a `NanPolicy`: `NanPolicy.skip` (the default: non-finite
        steps are skipped, training goes on), `NanPolicy.stop` (raise
        `NonFiniteError`), `NanPolicy.rollback` or `NanPolicy.rewind` (see
        above); its ``locate_first`` (the first this many non-finite steps
        of the run get ``"location"``: `jaxstable.diagnostics.locate` of the
        step, at the loss scale it used, as a dict of `NonFiniteLocation`
        fields, or None when the op-by-op re-run is finite; the step that
        makes a policy act always gets it, and the error its ``location``;
        with "skip" and a donating step, ``donate=True``, the input is gone
        when the step is read: such steps are not located) and its
        ``stop_after`` (fit returns normally this many steps after the run's
        first non-finite step, 0: at that step; a run resumed after that
        step runs none: for runs meant to fail).
      checkpoint: None, a directory, a `CheckpointManager` or a
        `Checkpointing` (``every``, ``resume``; see above); a final
        checkpoint is always written when the loop ends (not when it
        raises).
      evaluate: None, or a pair ``(eval_fn, every)``: ``eval_fn(state) ->
        {name: scalar}`` (e.g. a held-out evaluation) is called after every
        ``every``-th step (n steps of the run done, ``n % every == 0``) on
        that step's state, its scalars added to that step's record as
        ``eval[...]`` keys (named as ``aux``'s).
      on_step: ``on_step(record, state)``, called once per step with the
        step's record (after it is logged) and the state that step produced;
        if it returns True, fit stops after that step and returns normally
        (on a step that rolls back or rewinds, with the state restored).
      log: a `Log` (``path``: the JSONL file, one line per step with keys
        ``step, loss, grad_norm, loss_scale, finite, skipped_total`` and
        ``aux[...]`` scalars; with a step that reports ``grads_finite``, as
        `make_train_step`'s does, that key too, and a skipped step has
        ``skip_reason``: ``"non-finite gradients"``, ``"non-finite update"``
        or ``"spike"``; when ``aux`` holds a
        `jaxstable.diagnostics.CheckPoints`, its ``checks[...]``,
        ``non_finite_checks`` and ``first_non_finite_check`` keys;
        ``progress``: a tqdm bar; ``time_steps``: ``"time_s"`` in each
        record, see `Log`), a bare path (``Log(path)``) or None (no file, no
        bar).
      batch_transform: None, or ``batch_transform(batch) -> batch`` applied
        to each batch right before the step (after a resume's skip: skipped
        batches are not transformed), e.g. placing a global batch on a mesh:
        ``functools.partial(jaxstable.distributed.shard_batch, mesh=mesh)``
        with a state placed by ``distributed.shard_state`` (checkpoints are
        then written from, and restored onto, the sharded state).

    Chance or cause: a located step's record has ``"reproduced"`` (False:
    `locate`'s re-run from the same state, batch and loss scale was finite or
    failed elsewhere, a non-deterministic kernel or hardware; True: it
    failed the same way, or the NaN is in the batch or parameters), and a
    policy made with ``on_chance="ignore"`` locates every non-finite step and
    lets one that did not reproduce count toward nothing (see `NanPolicy`).

    Bad batches: with a checkpoint directory, the positions of located
    non-finite steps that reproduced (a loss-scale overflow excepted) and of
    the batches a rewind threw away are written at once to
    ``checkpoint_dir/bad_batches.json`` (atomically, by process 0; the
    adding step's record names them in ``"bad_batches_listed"``). With
    ``Checkpointing(..., skip_listed=True)`` fit reads it when it starts
    and skips those positions (and those of ``skip_batches``) without
    running the step (the position advances; the next step's record lists
    them in ``"bad_batches_skipped"``): the run equals one whose data never
    held them. Off by default, so that a run killed after a listed batch
    and resumed is the uninterrupted run. The file may be edited
    (docs/locate.md).

    The keywords of the old form (``max_consecutive_nonfinite``,
    ``rollback_every``, ``checkpoint_dir``, ``eval_fn``, ``log_path``,
    ``progress`` ...) and a string ``nan_policy`` still work for one release,
    with a DeprecationWarning naming the new form.

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
      NonFiniteError: with `NanPolicy.stop`, or a rollback or rewind once
        the policy's ``max`` is used up (the message says so); the message
        names the step, the loss scale it used, and lists the non-finite gradient leaves
        (recomputed at that scale) and batch inputs.
      TypeError, ValueError: a bad argument (the message names it and what
        is allowed).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import train, transforms
      >>> tx = transforms.stable_optimizer(optax.sgd(0.1))
      >>> state = train.TrainState.create(params=jnp.zeros(2), optimizer=tx)
      >>> step = train.make_train_step(lambda p, b: jnp.sum((p - b) ** 2))
      >>> data = [jnp.ones(2), jnp.array([jnp.nan, 1.0]), jnp.ones(2)]
      >>> state, hist = train.fit(state, step, data, log=None)
      >>> [h["finite"] for h in hist], hist[-1]["skipped_total"]
      ([True, False, True], 1)
      >>> try:
      ...     train.fit(state, step, data[1:], log=None,
      ...               nan_policy=train.NanPolicy.stop(max_consecutive=1))
      ... except train.NonFiniteError as e:
      ...     print(e.step, "|", str(e).split(";")[0])
      0 | 1 non-finite step(s) in a row, the last at step 0
      >>> data = [jnp.ones(2), jnp.ones(2), jnp.array([jnp.nan, 1.0]), jnp.ones(2)]
      >>> before = int(state.step)
      >>> policy = train.NanPolicy.rollback(max_consecutive=1, every=2)
      >>> state, hist = train.fit(state, step, data, nan_policy=policy, log=None)
      >>> # 4 steps, but the rollback undid the NaN one (back to the snapshot at 2)
      >>> [h.get("rolled_back", False) for h in hist], int(state.step) - before
      ([False, False, True, False], 3)
      >>> data = [jnp.ones(2), jnp.array([jnp.nan, 1.0])] + [jnp.ones(2)] * 5
      >>> state, hist = train.fit(
      ...     state, step, data, log=train.Log(progress=False, time_steps=True),
      ...     evaluate=(lambda s: {"p0": s.params[0]}, 2),
      ...     nan_policy=train.NanPolicy.skip(stop_after=2))
      >>> len(hist), [k for k in hist[1] if k not in hist[0]]  # stopped 2 after step 1
      (4, ['skip_reason', "eval['p0']", 'location', 'reproduced'])
      >>> hist[3]["eval['p0']"] == float(state.params[0]), hist[0]["time_s"] > 0
      (True, True)
    """
    opts = _checked_options(
        nan_policy, checkpoint, evaluate, on_step, log, batch_transform, steps,
        CheckpointManager,
    )  # fmt: skip
    policy, checkpoint_dir = opts["policy"], opts["checkpoint_dir"]
    checkpoint_every, resume = opts["checkpoint_every"], opts["resume"]
    log, eval_fn, eval_every = opts["log"], opts["eval_fn"], opts["eval_every"]
    given = opts["skip_batches"]
    if jax.process_count() > 1:
        check_same_on_every_process(
            checkpoint_dir=_directory(checkpoint_dir),
            checkpoint_every=checkpoint_every,
            resume=resume, steps=steps, nan_policy=repr(policy),
            eval_every=eval_every, skip_batches=list(given),
            skip_listed=opts["skip_listed"],
        )  # fmt: skip
    peers = Peers()
    mgr, own_mgr, lock = _manager(checkpoint_dir)
    try:
        state, start, resumed = _resume(mgr, state, resume)
        to_disk = policy.restores and policy.restore_to == "disk"
        if mgr is not None and to_disk and mgr.latest_step() is None:
            mgr.save(start, state)  # what the first rollback goes back to
        directory = None if mgr is None else mgr.directory
        bad = _bad_batches(
            directory, given, jax.process_index() == 0, opts["skip_listed"]
        )
        return _run(
            state, train_step, batches, steps, policy, log, checkpoint_every,
            eval_fn, eval_every, on_step, batch_transform, peers,
            _Origin(mgr, start, resumed, bad),
        )  # fmt: skip
    except BaseException as e:
        message = peers.failed(e)
        if message is not None:
            raise RuntimeError(message) from e
        raise
    finally:
        peers.stop()
        try:
            if own_mgr:
                mgr.close()  # waits for a background save
            elif mgr is not None:
                mgr.wait()
        finally:
            if lock is not None:
                lock.release()


class _Origin(NamedTuple):
    """Where `_run` starts: the checkpoint manager (or None), the global
    step, whether it was resumed, and the bad-batch list."""

    mgr: Any
    start: int
    resumed: Any
    bad: Any


def _run(
    state, train_step, batches, steps, policy, log, checkpoint_every, eval_fn,
    eval_every, on_step, batch_transform, peers, origin,
):  # fmt: skip
    """The loop of `fit` from global step ``origin.start`` (its arguments
    checked): `FitLoop` over a `_JaxAdapter`. Returns ``(state, history)``."""
    mgr, start, resumed, bad = origin
    from tqdm.auto import tqdm  # imported here: only fit needs it

    total = steps
    if total is None and hasattr(batches, "__len__"):
        total = len(batches)

    def data_from(stop):
        it = _batches_from(batches, start, stop)
        return it if batch_transform is None else map(batch_transform, it)

    # Under jax.distributed process 0 alone writes the log and the progress.
    primary = jax.process_index() == 0
    bar = tqdm(
        total=total, initial=start, disable=not log.progress or not primary,
        desc="train",
    )  # fmt: skip
    resuming = mgr is not None and start
    out = _open_log(log.path if primary else None, start if resuming else None)
    adapter = _JaxAdapter(train_step, state, policy, log, eval_fn, on_step, mgr)
    adapter.snapshot_from(resumed.get("snapshot", state))
    adapter.peers = peers
    peers.step = start  # the step being loaded or run (named if this one fails)
    at_start = mgr is not None and start in (resumed.get("step"), mgr.latest_step())
    loop = _FitLoop(
        adapter, data_from, policy, resumed, start, steps, eval_every, on_step,
        checkpoint_every, mgr is not None, start if at_start else None, bar, out,
        bad,
    )  # fmt: skip
    history = loop.run()
    return adapter.state, history


class _JaxAdapter:
    """`FitLoop`'s adapter for a JAX train step: it holds the state.

    A pending step is ``(index, metrics, batch, state_out, seconds)``. The
    lookahead (metrics of step k read after step k+1 is queued) is kept
    unless fit reads each step's output state (policy, callback, eval, early
    stop) and the step donates its input (it would be gone), or steps are
    timed.
    """

    def __init__(self, train_step, state, policy, log, eval_fn, on_step, mgr):
        self.train_step, self.state, self.policy = train_step, state, policy
        self.eval_fn, self.mgr, self.time_steps = eval_fn, mgr, log.time_steps
        reads_state = policy.kind != "skip" or on_step is not None
        reads_state = reads_state or eval_fn is not None
        reads_state = reads_state or policy.stop_after is not None
        self.lookahead = not log.time_steps and (
            not reads_state or not _may_donate(train_step)
        )
        self.in_memory = policy.restores and policy.restore_to == "memory"
        self.snapshot_state = None
        self.peers = None

    def snapshot_from(self, state) -> None:
        # A device copy: the step may donate `state`, never the snapshot. A
        # resumed run goes on with the snapshot its checkpoint saved.
        if self.in_memory:
            self.snapshot_state = jax.tree.map(jnp.copy, state)

    def run_step(self, index: int, batch: Any):
        t0 = time.perf_counter()
        new_state, metrics = self.train_step(self.state, batch)
        # The step being run or saved next, named if this process fails.
        self.peers.step = index + 1
        seconds = None
        if self.time_steps:
            jax.block_until_ready((new_state, metrics))
            seconds = time.perf_counter() - t0
        self.state = new_state
        return index, metrics, batch, new_state, seconds

    def record(self, pending) -> dict[str, Any]:
        index, metrics, _, _, seconds = pending
        rec = host_record(index, metrics)
        if seconds is not None:
            rec["time_s"] = seconds
        return rec

    def evaluate(self, pending) -> dict[str, float]:
        return scalar_record("eval", self.eval_fn(pending[3]))

    def observed(self, rec) -> None:
        del rec  # optax schedules follow the optimizer's own count

    def locate(self, pending, rec):
        del rec
        _, metrics, batch, state_out, _ = pending
        return locate_failed(self.train_step, state_out, metrics, batch, self.lookahead)

    def callback_arg(self, pending):
        return pending[3]

    def any(self, flag: bool) -> bool:
        return flag  # every process computes the same records

    def keep(self, pending) -> None:
        self.state = pending[3]

    def restore(self) -> None:
        if not self.in_memory:  # the last good checkpoint on disk
            self.state = self.mgr.restore(self.state)[0]
            return
        # A copy again: a donating step must leave the snapshot intact for
        # the next rollback.
        self.state = jax.tree.map(jnp.copy, self.snapshot_state)

    def snapshot(self, pending) -> None:
        # Read before the next step is queued (the loop finishes a snapshot
        # step at once), so a donating step has not consumed it yet.
        self.snapshot_state = jax.tree.map(jnp.copy, pending[3])

    def latest_checkpoint(self) -> int:
        # An async save still in flight (the checkpoint of this very step's
        # period) is not on disk yet, but the restore waits for it: wait
        # here too, or the record names the one before it.
        self.mgr.wait()
        return self.mgr.latest_step()

    def save(self, done: int, metrics, fit_state: dict, keep: bool) -> None:
        # With the NaN policy's state and, unless it is this very state, the
        # rollback snapshot: a resumed run goes on as the uninterrupted one.
        kept = self.snapshot_state if keep else None
        self.mgr.save_for_fit(done, self.state, None, metrics, fit_state, kept)

    def raise_non_finite(self, rec, run, pending, history, policy, location):
        _, metrics, batch, state_out, _ = pending
        raise_non_finite(
            self.train_step, rec, run, batch, state_out, metrics, history, policy,
            location or None,
        )  # fmt: skip


def _directory(checkpoint_dir) -> str | None:
    if checkpoint_dir is None:
        return None
    if isinstance(checkpoint_dir, CheckpointManager):
        return checkpoint_dir.directory
    return os.path.abspath(checkpoint_dir)


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
