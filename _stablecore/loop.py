"""The loop of `fit`, once for both frameworks (standard library only).

`FitLoop` holds what a run decides: the NaN policy's bookkeeping, the data
position, the records, the log, the checkpoints' cadence, the early stops.
What touches a framework (running the step, reading its metrics, locating,
snapshots, restores, saves, the error) goes through a small adapter, one
per package (`jaxstable._src.fit`, `torchref._src.fit`), with the methods
named in `Adapter`.

One step reads in the order it happens: `run_step`, then `finish`:
`observe` (the record and the policy's decision), `locate`, `log`,
`call_back`, `apply_policy` (restore, raise or snapshot), then
`checkpoint`. The policy is applied before the checkpoint so that a
checkpoint holds the state the run goes on from (after a rollback, the
restored one), as a resumed run needs.

JAX reads a step's metrics only after the next step is queued (the
adapter's ``lookahead``): the step before is finished then, and when it
restores, the step just queued ran on a discarded state and is run again
on the restored one (or dropped, when a rewind drops that batch).
"""

from __future__ import annotations

import itertools
import json
import warnings
from typing import Any, Protocol

from _stablecore.bad_data import BadBatches
from _stablecore.fit import show, warn_if_short
from _stablecore.low_precision import StallMonitor
from _stablecore.nan_policy import RESTORES, NanPolicy, PolicyState


class Adapter(Protocol):
    """What `FitLoop` asks of a framework (``pending``: one step's output,
    whatever the adapter makes of it)."""

    lookahead: bool  # finish step k after step k+1 is queued

    def run_step(self, index: int, batch: Any) -> Any: ...
    def record(self, pending: Any) -> dict[str, Any]: ...
    def evaluate(self, pending: Any) -> dict[str, float]: ...
    def observed(self, rec: dict[str, Any]) -> None: ...
    def locate(self, pending: Any, rec: dict[str, Any]) -> Any: ...
    def callback_arg(self, pending: Any) -> Any: ...
    def any(self, flag: bool) -> bool: ...
    def keep(self, pending: Any) -> None: ...
    def restore(self) -> None: ...
    def snapshot(self, pending: Any) -> None: ...
    def latest_checkpoint(self) -> int: ...
    def save(self, done: int, metrics: Any, fit_state: dict, keep: bool) -> None: ...
    def raise_non_finite(self, rec, run, pending, history, policy, location): ...


def located_kind(rec: dict[str, Any]) -> bool:
    """False when the step has non-finite values for `locate` to find: a
    step skipped as a spike was finite (its re-run would find nothing)."""
    return rec["finite"] or rec.get("skip_reason") == "spike"


class FitLoop:
    """One run of `fit` from the run's position `start` (arguments checked).

    Args:
      adapter: the framework's `Adapter`.
      data_from: ``data_from(stop) -> iterator``: the batches from `start`
        up to the run's position `stop` (None: all).
      policy: the `NanPolicy`.
      resumed: `CheckpointManager.restore`'s info of the checkpoint resumed
        (``fit_state``, ``snapshot``), or {}.
      start: the run's position.
      steps: fit's ``steps`` (for the warning when the data ends first).
      evaluate_every: the period of the adapter's `evaluate`, or None.
      on_step: fit's ``on_step``, or None.
      checkpoint_every: the checkpoints' period, or None.
      saves: whether there is a checkpoint manager (the final checkpoint).
      saved_at: the step of the checkpoint already written, or None.
      bar: the progress bar (``update``, ``set_postfix``, ``close``).
      out: the JSONL log file, or None.
      bad: the run's `BadBatches` (``bad_batches.json`` beside the
        checkpoints and `Checkpointing`'s ``skip_batches``), or None.
    """

    def __init__(
        self, adapter, data_from, policy: NanPolicy, resumed: dict, start: int,
        steps, evaluate_every, on_step, checkpoint_every, saves: bool,
        saved_at, bar, out, bad: BadBatches | None = None,
    ):  # fmt: skip
        self.a, self.policy = adapter, policy
        self.book = PolicyState(policy)
        self.warned_chance = False
        self.book.load(resumed.get("fit_state"), start)
        if "snapshot" not in resumed:  # the snapshot is the state resumed
            self.book.snapshot_at = start
        # A run that stop_after ended before its checkpoint: no step.
        self.ended = self.book.stop_due(start - 1)
        self.data = data_from(start if self.ended else steps)
        self.start = self.done = start  # done: steps of the run dispatched
        self.steps, self.evaluate_every = steps, evaluate_every
        self.on_step, self.checkpoint_every = on_step, checkpoint_every
        self.saves, self.saved_at, self.bar, self.out = saves, saved_at, bar, out
        self.in_memory = policy.restores and policy.restore_to == "memory"
        self.history: list[dict[str, Any]] = []
        self.pending = self.location = None
        self.action: str | None = None
        self.stop_asked = False
        self.stall = StallMonitor()  # warns when rounding keeps eating updates
        self.bad = BadBatches(None, []) if bad is None else bad
        self.skipped_bad: list[int] = []  # listed batches not yet in a record

    # The run.

    def run(self) -> list[dict[str, Any]]:
        """Runs every batch of the data; the records."""
        stopped = self.ended
        try:
            for batch in self.data:
                if self.done in self.bad:  # listed: counted, never run
                    if self.skip_listed():
                        stopped = True
                        break
                    continue
                if self.step(batch):
                    stopped = True
                    break
            if self.pending is not None:
                self.finish(self.pending)
                self.pending = None
                stopped = stopped or self.stop_asked
            if self.saves and self.saved_at != self.done:
                self.a.save(self.done, None, self.book.state(), self._keep())
            if not stopped:
                warn_if_short(self.steps, self.start, self.done)
        finally:
            self.bar.close()
            if self.out is not None:
                self.out.close()
        return self.history

    def step(self, batch: Any) -> bool:
        """One batch: run the step (and, with the lookahead, finish the one
        before); True when the run stops here."""
        queued = self.a.run_step(self.done, batch)
        if self.pending is not None:  # the lookahead: the step before
            action = self.finish(self.pending, pulled=1)
            if self.stop_asked:
                if action not in RESTORES:
                    self.a.keep(self.pending)  # the step queued is dropped
                self.pending = None
                return True
            if action == "rewind" and self.policy.rewind_skip:
                self.pending = None  # its batch was the first dropped
                return False
            if action in RESTORES:  # it ran on a discarded state: again
                queued = self.a.run_step(self.done, batch)
        self.pending, self.done = queued, self.done + 1
        every = self.checkpoint_every
        due = every is not None and self.done % every == 0
        snapshot_due = self.in_memory and self.done % self.policy.snapshot_every == 0
        if not self.a.lookahead or due or snapshot_due:
            # A checkpoint is written only after its step passed the check.
            self.finish(self.pending)
            self.pending = None
        if due:
            self.checkpoint(self.history[-1] if self.history else None)
        return self.stop_asked and self.pending is None

    def skip_listed(self) -> bool:
        """The batch at `done` is on the bad-batch list: counted as a batch
        of the run but not run (the next step's record names it); True when
        the run stops here (a checkpoint due here finished the step before,
        which asked to stop)."""
        self.skipped_bad.append(self.done)
        self.done += 1
        self.bar.update(1)
        every = self.checkpoint_every
        if every is None or self.done % every:
            return False
        if self.pending is not None:
            self.finish(self.pending)
            self.pending = None
        self.checkpoint(self.history[-1] if self.history else None)
        return self.stop_asked

    # One step, in the order it happens.

    def finish(self, pending: Any, pulled: int = 0) -> str | None:
        """The step's record, location, log line, callback and policy: the
        policy's action ("rollback", "rewind" or None)."""
        rec = self.observe(pending, pulled)
        if self.policy.on_chance != "ignore":  # else located in `observe`
            self.locate(rec, pending)
        self.log(rec)
        self.call_back(rec, pending)
        return self.apply_policy(rec, pending)

    def observe(self, pending: Any, pulled: int = 0) -> dict[str, Any]:
        """The record of the step and what the policy makes of it (a rewind
        drops its batches here: its record counts them). `pulled`: batches
        already taken after this step's (the lookahead's)."""
        rec = self.a.record(pending)
        self.stall.check(rec)  # low_precision_adamw: rounding eating updates
        index = rec["step"]
        skipped = [p for p in self.skipped_bad if p < index]
        if skipped:  # listed batches skipped since the step before
            rec["bad_batches_skipped"] = skipped
            self.skipped_bad = [p for p in self.skipped_bad if p > index]
        every = self.evaluate_every
        if every is not None and (index + 1) % every == 0:
            rec.update(self.a.evaluate(pending))
        self.a.observed(rec)
        self.location = self.action = None
        if self.policy.on_chance == "ignore":  # the decision needs it
            self.locate(rec, pending)
        spike = rec.get("skip_reason") == "spike"
        chance = rec.get("reproduced") is False
        self.action = self.book.observe(index, rec["finite"], spike, chance)
        if self.action == "rollback":
            rec["rolled_back"] = True
            self.book.restored(index)
        elif self.action == "rewind":
            self.rewind(rec, index, pulled)
        return rec

    def rewind(self, rec: dict[str, Any], index: int, pulled: int) -> None:
        """The rewind's record and dropped batches; every batch it throws
        away (trained since the restore point, dropped after) is listed."""
        at = self.book.snapshot_at if self.in_memory else self.a.latest_checkpoint()
        since = max(at, self.book.trained_from)
        first = self.done  # the first batch dropped (taken, with the lookahead)
        dropped = self.drop(self.policy.rewind_skip, pulled)
        rec.update(self.book.rewind_record(index, at, dropped))
        self.book.restored(index, dropped)
        thrown = [*range(since, index + 1), *range(first, first + dropped)]
        entries = [
            {"position": p, "reason": "rewound", "rewind_from": index} for p in thrown
        ]
        self.list_bad(rec, entries)

    def list_bad(self, rec: dict[str, Any], entries: list[dict]) -> None:
        """Puts `entries` on the bad-batch list; the record names them."""
        listed = self.bad.add(entries)
        if listed:
            rec["bad_batches_listed"] = sorted(
                {*rec.get("bad_batches_listed", ()), *listed}
            )

    def locate(self, rec: dict[str, Any], pending: Any) -> None:
        """The step's ``"location"`` when the policy wants one, and whether
        it reproduced (``"reproduced"``: False when the re-run was finite,
        a location of None, or failed elsewhere); a step that reproduced is
        listed as bad data, unless it is a gradient overflow the loss scale
        handles (phase "loss_scale")."""
        self.location = None
        if not self.book.wants_location(located_kind(rec), self.action):
            return
        location = self.a.locate(pending, rec)
        if location is False:  # this step cannot be located
            self.warn_cannot_tell_chance()
            return
        self.book.located += 1
        rec["location"] = None if location is None else location._asdict()
        rec["reproduced"] = location is not None and location.reproduced is not False
        self.location = location
        if rec["reproduced"] and location.phase != "loss_scale":
            entry = {"position": rec["step"], "reason": "reproduced"}
            entry.update(phase=location.phase, path=location.path)
            self.list_bad(rec, [entry])

    def warn_cannot_tell_chance(self) -> None:
        """``on_chance="ignore"`` asked for, but the step cannot be located
        (not a `TrainStep`): said once, and every non-finite step counts."""
        if self.policy.on_chance != "ignore" or self.warned_chance:
            return
        self.warned_chance = True
        warnings.warn(
            'on_chance="ignore" has no effect here: this step cannot be '
            "located (it is not a TrainStep), so chance cannot be told from "
            "cause and every non-finite step counts",
            stacklevel=2,
        )

    def log(self, rec: dict[str, Any]) -> None:
        self.history.append(rec)
        if self.out is not None:
            self.out.write(json.dumps(rec) + "\n")
            self.out.flush()
        show(self.bar, rec)

    def call_back(self, rec: dict[str, Any], pending: Any) -> None:
        """``on_step``; a stop it asks for (or ``stop_after``) is noted."""
        wants = False
        if self.on_step is not None:
            wants = self.on_step(rec, self.a.callback_arg(pending)) is True
            wants = self.a.any(wants)  # every process stops together
        self.stop_asked = wants or self.book.stop_due(rec["step"])

    def apply_policy(self, rec: dict[str, Any], pending: Any) -> str | None:
        """Restores, raises, or takes the rollback snapshot."""
        if self.action in RESTORES:
            self.a.restore()
        elif self.action == "raise":
            self.a.raise_non_finite(
                rec, self.book.run, pending, self.history, self.policy, self.location
            )
        elif self.in_memory and rec["finite"]:
            if (rec["step"] + 1) % self.policy.snapshot_every == 0:
                self.a.snapshot(pending)
                self.book.snapshot_at = rec["step"] + 1
        return self.action

    def checkpoint(self, rec: dict[str, Any] | None) -> None:
        """Checkpoint `done`, with the NaN policy's state. A step that
        restored an older state: its record's metrics (eval included) are
        the discarded state's, so none are given (a best-metric manager
        would keep a checkpoint for a metric it does not hold)."""
        if rec is not None and (rec.get("rolled_back") or rec.get("rewound")):
            rec = None
        self.a.save(self.done, rec, self.book.state(), self._keep())
        self.saved_at = self.done

    def _keep(self) -> bool:
        """Whether a checkpoint keeps the snapshot (unless it is that state)."""
        return self.in_memory and self.book.snapshot_at != self.done

    def drop(self, n: int, pulled: int = 0) -> int:
        """Drops the next `n` batches (a rewind's), the first `pulled` of
        them already taken; how many were dropped (fewer when the data
        ends)."""
        first = min(n, pulled)
        dropped = first + sum(1 for _ in itertools.islice(self.data, n - first))
        self.done += dropped
        self.bar.update(dropped)
        return dropped
