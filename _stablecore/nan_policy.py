"""NaN policies as values (`NanPolicy`) and their bookkeeping in a run
(`PolicyState`), the same for `jaxstable.train.fit` and
`torchref.train.fit` (standard library only)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from _stablecore.checks import check_choice, check_int, check_needs

KINDS = ("skip", "stop", "rollback", "rewind")
# The policies that restore a saved state.
RESTORES = ("rollback", "rewind")
ROLLBACK_TARGETS = ("memory", "disk")
# What a policy makes of a located non-finite step that did not reproduce.
CHANCE = ("count", "ignore")


_COMMON = (
    ("locate_first", "locate_first"), ("stop_after", "stop_after"),
    ("on_chance", "on_chance"),
)  # fmt: skip
_RESTORE = (
    ("every", "snapshot_every"), ("max", "max_restores"), ("to", "restore_to"),
)  # fmt: skip
# Each factory's arguments and the fields they set.
ARGUMENTS = {
    "skip": _COMMON,
    "stop": (("max_consecutive", "max_consecutive"), *_COMMON),
    "rollback": (("max_consecutive", "max_consecutive"), *_RESTORE, *_COMMON),
    "rewind": (
        ("after", "rewind_after"),
        ("window", "rewind_window"),
        ("skip", "rewind_skip"),
        *_RESTORE,
        *_COMMON,
    ),
}


@dataclasses.dataclass(frozen=True, repr=False)
class NanPolicy:
    """What `fit` does about non-finite steps: a value, made by one of
    `skip`, `stop`, `rollback` and `rewind` (the fields are theirs).

    Every policy skips a non-finite step (the guard does: its update is
    never applied); they differ in what happens next. ``locate_first``: the
    first this many non-finite steps of the run are located (the step that
    makes a policy act always is). ``stop_after``: None, or fit returns
    normally this many steps after the run's first non-finite step (0: at
    that step), for runs meant to fail. A step skipped as a spike
    (``skip_reason == "spike"``, see ``transforms.skip_spikes``) had finite
    values: it is not non-finite, so it neither counts toward nor breaks a
    run of non-finite steps ("stop", "rollback", ``stop_after``); "rewind"
    counts it (PaLM's recipe is for spikes).

    Chance or cause (``on_chance``): `locate` re-runs a non-finite step
    from the same state, batch and loss scale; a step whose re-run is
    finite or fails elsewhere did not reproduce (chance: a non-deterministic
    kernel, a race, failing hardware), one whose re-run fails the same way,
    or whose NaN is in the batch or the parameters, did (cause: the data or
    the numerics). fit's record says which (``"reproduced"``).
    ``on_chance="count"`` (the default) counts both alike;
    ``on_chance="ignore"`` locates every non-finite step (not only the first
    ``locate_first``) and a step that did not reproduce, skipped as every
    non-finite step is, then counts toward nothing, like a spike for
    "stop" and "rollback" (neither counting toward nor breaking a run,
    nor starting ``stop_after``) and not at all for "rewind": so
    ``NanPolicy.stop(max_consecutive=1, on_chance="ignore")`` skips and goes
    on past a chance NaN and stops at the first that reproduces. A step that
    could not be located (a step that is not a `TrainStep`, a donated
    input) counts.

    Example:
      >>> # from jaxstable.train (or torchref.train) import NanPolicy
      >>> NanPolicy.skip().kind
      'skip'
      >>> p = NanPolicy.rollback(max_consecutive=2, every=50)
      >>> p.kind, p.max_consecutive, p.snapshot_every, p.max_restores, p.restore_to
      ('rollback', 2, 50, 3, 'memory')
      >>> NanPolicy.rewind(after=2, window=10, skip=4).rewind_skip
      4
      >>> NanPolicy.stop(max_consecutive=1, on_chance="ignore")
      NanPolicy.stop(max_consecutive=1, on_chance='ignore')
      >>> NanPolicy.stop(max_consecutive=0)
      Traceback (most recent call last):
      ...
      ValueError: NanPolicy.stop: max_consecutive must be an int >= 1, got 0
    """

    kind: str = "skip"
    max_consecutive: int = 5
    snapshot_every: int = 100
    max_restores: int = 3
    restore_to: str = "memory"
    rewind_after: int = 3
    rewind_window: int = 100
    rewind_skip: int = 0
    locate_first: int = 1
    stop_after: int | None = None
    on_chance: str = "count"

    def __post_init__(self) -> None:
        check_choice("NanPolicy kind", self.kind, KINDS)
        where = f"NanPolicy.{self.kind}: "
        check_int(where + "max_consecutive", self.max_consecutive, 1)
        check_int(where + "every", self.snapshot_every, 1)
        check_int(where + "max", self.max_restores, 1)
        check_choice(where + "to", self.restore_to, ROLLBACK_TARGETS)
        check_int(where + "after", self.rewind_after, 1)
        check_int(where + "window", self.rewind_window, 1)
        check_int(where + "skip", self.rewind_skip, 0)
        check_int(where + "locate_first", self.locate_first, 0)
        check_int(where + "stop_after", self.stop_after, 0, optional=True)
        check_choice(where + "on_chance", self.on_chance, CHANCE)
        check_needs(
            self.rewind_window >= self.rewind_after,
            f"{where}window ({self.rewind_window}) must be >= after "
            f"({self.rewind_after}): a window of {self.rewind_window} steps "
            f"never holds {self.rewind_after} skipped ones",
        )

    @classmethod
    def skip(
        cls, *, locate_first: int = 1, stop_after: int | None = None,
        on_chance: str = "count",
    ):  # fmt: skip
        """Skip every non-finite step and go on (the default)."""
        return cls(
            "skip", locate_first=locate_first, stop_after=stop_after,
            on_chance=on_chance,
        )  # fmt: skip

    @classmethod
    def stop(
        cls, *, max_consecutive: int = 5, locate_first: int = 1,
        stop_after: int | None = None, on_chance: str = "count",
    ):  # fmt: skip
        """Raise `NonFiniteError` after `max_consecutive` non-finite steps in
        a row (the error carries the step's report and location)."""
        return cls(
            "stop", max_consecutive=max_consecutive, locate_first=locate_first,
            stop_after=stop_after, on_chance=on_chance,
        )  # fmt: skip

    @classmethod
    def rollback(
        cls, *, max_consecutive: int = 5, every: int = 100, max: int = 3,
        to: str = "memory", locate_first: int = 1, stop_after: int | None = None,
        on_chance: str = "count",
    ):  # fmt: skip
        """After `max_consecutive` non-finite steps in a row, go back to the
        last good state: a snapshot taken every `every` steps (``to=
        "memory"``, one more copy of the state) or the last intact checkpoint
        (``to="disk"``); the bad batches are not retried. The trigger after
        `max` rollbacks raises `NonFiniteError`."""
        return cls(
            "rollback", max_consecutive=max_consecutive, snapshot_every=every,
            max_restores=max, restore_to=to, locate_first=locate_first,
            stop_after=stop_after, on_chance=on_chance,
        )  # fmt: skip

    @classmethod
    def rewind(
        cls, *, after: int = 3, window: int = 100, skip: int = 0,
        every: int = 100, max: int = 3, to: str = "memory",
        locate_first: int = 1, stop_after: int | None = None,
        on_chance: str = "count",
    ):  # fmt: skip
        """PaLM's recipe for loss spikes: when `after` of the last `window`
        steps were skipped (non-finite or spikes, not necessarily in a row),
        go back to the same snapshot as `rollback` (`every`, `to`) and go on
        after the trigger step and `skip` more batches (the batches from the
        restore point to the trigger are not replayed). Rewinds count
        against `max`."""
        return cls(
            "rewind", rewind_after=after, rewind_window=window, rewind_skip=skip,
            snapshot_every=every, max_restores=max, restore_to=to,
            locate_first=locate_first, stop_after=stop_after, on_chance=on_chance,
        )  # fmt: skip

    def __repr__(self) -> str:
        """The call that makes this policy (its non-default arguments)."""
        made = getattr(type(self), self.kind)()
        args = [
            f"{name}={getattr(self, field)!r}"
            for name, field in ARGUMENTS[self.kind]
            if getattr(self, field) != getattr(made, field)
        ]
        return f"NanPolicy.{self.kind}({', '.join(args)})"

    @property
    def restores(self) -> bool:
        """Whether the policy goes back to a saved state."""
        return self.kind in RESTORES


class PolicyState:
    """The NaN-policy bookkeeping of a run, checkpointed with it.

    ``run``: non-finite steps in a row; ``rollbacks``: rollbacks (and
    rewinds) used; ``located``: non-finite steps located; ``first_bad``:
    index of the run's first non-finite step (for a policy's ``stop_after``);
    ``snapshot_at``: the step of the run the rollback snapshot holds;
    ``recent``: indices of the skipped steps among the last ``window`` (for
    "rewind"); ``trained_from``: the position training went on from after
    the last rollback or rewind (a second rewind to the same snapshot drops
    only the batches trained since). A resumed `fit` loads them from its
    checkpoint (`load`), so that a run killed and resumed counts, stops and
    rolls back as the uninterrupted one.

    A step skipped as a spike (``skip_reason == "spike"``: finite values,
    see ``transforms.skip_spikes``) is not non-finite: it neither counts
    toward, nor breaks, a run of non-finite steps ("stop", "rollback",
    ``stop_after``); "rewind", PaLM's recipe for spikes, counts it.
    """

    _SAVED = (
        "run", "rollbacks", "located", "first_bad", "snapshot_at", "recent",
        "trained_from",
    )  # fmt: skip

    def __init__(self, policy: NanPolicy):
        self.policy = policy
        self.run = self.rollbacks = self.located = self.snapshot_at = 0
        self.trained_from = 0
        self.first_bad: int | None = None
        self.recent: list[int] = []

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON, under its checksum): a copy, never
        a live object (an asynchronous save writes it later)."""
        return copy.deepcopy({k: getattr(self, k) for k in self._SAVED})

    def load(self, saved: dict | None, start: int) -> None:
        """The state of a checkpoint at step `start` (None: a new run, or a
        checkpoint written before fit saved it: counts from 0)."""
        self.snapshot_at = start
        for k in self._SAVED:
            if saved and k in saved:
                setattr(self, k, copy.deepcopy(saved[k]))

    def observe(
        self, index: int, finite: bool, spike: bool = False, chance: bool = False
    ) -> str | None:
        """What the step just recorded triggers: "rollback", "rewind",
        "raise" or None (`spike`: skipped as a spike, see above; `chance`: a
        non-finite step that did not reproduce, ignored by the policy)."""
        if chance and self.policy.on_chance == "ignore":
            return None  # counts toward nothing, breaks nothing
        bad = not finite and not spike
        if bad:
            self.run += 1
        elif finite:
            self.run = 0
        if bad and self.first_bad is None:
            self.first_bad = index
        kind = self.policy.kind
        if kind == "rewind":
            return self._observe_rewind(index, finite)
        if kind == "skip" or not bad or self.run < self.policy.max_consecutive:
            return None
        if kind == "rollback" and self.rollbacks < self.policy.max_restores:
            self.rollbacks, self.run = self.rollbacks + 1, 0
            return "rollback"
        return "raise"

    def _observe_rewind(self, index: int, finite: bool) -> str | None:
        # `after` skipped steps among the last `window` steps.
        if not finite:
            self.recent = [*self.recent, index]
        self.recent = [i for i in self.recent if i > index - self.policy.rewind_window]
        if len(self.recent) < self.policy.rewind_after:
            return None
        if self.rollbacks < self.policy.max_restores:
            self.rollbacks, self.run, self.recent = self.rollbacks + 1, 0, []
            return "rewind"
        return "raise"

    def restored(self, index: int, dropped: int = 0) -> None:
        """The state went back after step `index`; training goes on from
        `index` + 1 + `dropped` (the batches a rewind drops)."""
        self.trained_from = index + 1 + dropped

    def rewind_record(self, index: int, restored_at: int, dropped: int) -> dict:
        """The keys a rewind adds to its trigger step's record: the batches
        trained since the restore point (or since the last restore, when a
        second rewind goes back to the same snapshot) plus those `dropped`
        after the trigger (fewer than ``skip`` when the data ended)."""
        since = max(restored_at, self.trained_from)
        return {
            "rewound": True,
            "rewind_from": index,
            "rewind_to": restored_at,
            "batches_skipped": index + 1 - since + dropped,
        }

    def wants_location(self, finite: bool, action: str | None) -> bool:
        # `finite`: nothing to locate (a spike skipped with finite values
        # counts as finite here, see _located_kind). on_chance="ignore"
        # locates every non-finite step (the policy's decision needs it).
        located = self.located < self.policy.locate_first
        located = located or self.policy.on_chance == "ignore"
        return not finite and (action is not None or located)

    def stop_due(self, index: int) -> bool:
        stop_after = self.policy.stop_after
        if stop_after is None or self.first_bad is None:
            return False
        return index - self.first_bad >= stop_after
