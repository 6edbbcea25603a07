"""The framework-free parts of `fit`: the NaN policy's bookkeeping, the
batches of a resumed run, the JSONL log, argument checks and message texts
(the records, logs and errors of `jaxstable.train.fit` and
`torchref.train.fit` are the same)."""

from __future__ import annotations

import itertools
import json
import os
import warnings
from typing import Any

from _stablecore.checks import (
    check_bool,
    check_callable,
    check_choice,
    check_int,
    check_needs,
)

NAN_POLICIES = ("skip", "stop", "rollback", "rewind")
# The policies that restore a saved state.
RESTORES = ("rollback", "rewind")
ROLLBACK_TARGETS = ("memory", "disk")


def add_skip_reason(rec: dict[str, Any], grads_finite: Any, spike: Any = None) -> None:
    # Only a guarded step reports grads_finite (a plain step that does not
    # skip has no reason to give); then its record tells why it skipped.
    if grads_finite is None:
        return
    rec["grads_finite"] = bool(grads_finite)
    if not rec["finite"]:
        rec["skip_reason"] = (
            "spike"
            if spike
            else "non-finite update"
            if rec["grads_finite"]
            else "non-finite gradients"
        )


def show(bar, rec) -> None:
    bar.set_postfix(
        loss=f"{rec['loss']:.4g}",
        grad_norm=f"{rec['grad_norm']:.3g}",
        loss_scale=f"{rec['loss_scale']:.3g}",
        skipped=rec["skipped_total"],
        refresh=False,
        # low_precision_adamw's share of the update lost to rounding
        **({"lost": f"{rec['lost_update']:.0%}"} if "lost_update" in rec else {}),
    )
    bar.update(1)


class NanPolicy:
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


def batches_from(batches, position: int, steps: int | None):
    """`batches` from the run's `position`, up to `steps` of the run in all.

    A sequence (``__getitem__`` and ``__len__``) is indexed from `position`;
    anything else is iterated and its first `position` batches dropped.
    """
    if position and hasattr(batches, "__getitem__") and hasattr(batches, "__len__"):
        it = (batches[i] for i in range(position, len(batches)))
    else:
        it = itertools.islice(iter(batches), position, None)
    return it if steps is None else itertools.islice(it, max(steps - position, 0))


def open_log(log_path, resumed_at: int | None):
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


def warn_if_short(steps: int | None, start: int, done: int) -> None:
    """A UserWarning when fit ran fewer steps than `steps` asked (not after a
    stop it was asked for)."""
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


def check_fit_args(
    nan_policy, max_consecutive, rollback_every, max_rollbacks, steps,
    locate_first, checkpoint_dir, checkpoint_every, resume, rollback_to,
    time_steps, eval_fn, eval_every, on_step, stop_after,
):  # fmt: skip
    check_bool("time_steps", time_steps)
    check_bool("resume", resume)
    check_callable("eval_fn", eval_fn)
    check_callable("on_step", on_step)
    check_needs(
        (eval_fn is None) == (eval_every is None),
        "eval_fn and eval_every go together: pass both or neither, got "
        f"eval_fn={eval_fn!r}, eval_every={eval_every!r}",
    )
    check_int("eval_every", eval_every, 1, optional=True)
    check_int("stop_after_nonfinite", stop_after, 0, optional=True)
    check_choice("nan_policy", nan_policy, NAN_POLICIES)
    check_choice("rollback_to", rollback_to, ROLLBACK_TARGETS)
    check_int("max_consecutive_nonfinite", max_consecutive, 1)
    check_int("rollback_every", rollback_every, 1)
    check_int("max_rollbacks", max_rollbacks, 1)
    check_int("steps", steps, 0, optional=True)
    check_int("locate_first", locate_first, 0)
    check_int("checkpoint_every", checkpoint_every, 1, optional=True)
    check_needs(
        checkpoint_every is None or checkpoint_dir is not None,
        "checkpoint_every needs checkpoint_dir",
    )
    check_needs(not resume or checkpoint_dir is not None, "resume needs checkpoint_dir")
    check_needs(
        rollback_to == "memory" or checkpoint_dir is not None,
        "rollback_to='disk' needs checkpoint_dir",
    )


UPDATE_NOTE = (
    "its gradients were finite: the update it computed (new parameters or "
    "optimizer state) was non-finite, e.g. float16 Adam state whose second "
    "moment underflowed to 0 while eps is 0 in float16"
)


def policy_note(nan_policy: str, max_rollbacks: int) -> str:
    if nan_policy == "rewind":
        return f"nan_policy='rewind': rewinds exhausted (max_rollbacks={max_rollbacks})"
    if nan_policy == "rollback":
        return (
            "nan_policy='rollback': rollbacks exhausted "
            f"(max_rollbacks={max_rollbacks})"
        )
    return f"nan_policy={nan_policy!r}"


def check_rewind_args(rewind_after, rewind_window, rewind_skip) -> None:
    check_int("rewind_after", rewind_after, 1)
    check_int("rewind_window", rewind_window, 1)
    check_int("rewind_skip", rewind_skip, 0)
    check_needs(
        rewind_window >= rewind_after,
        f"rewind_window ({rewind_window}) must be >= rewind_after "
        f"({rewind_after}): a window of {rewind_window} steps never holds "
        f"{rewind_after} skipped ones",
    )
