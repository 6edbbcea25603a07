"""The framework-free parts of `fit`: the NaN policy's bookkeeping, the
batches of a resumed run, the JSONL log, argument checks and message texts
(the records, logs and errors of `jaxstable.train.fit` and
`torchref.train.fit` are the same)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

from _stablecore.bad_data import given_positions
from _stablecore.checkpoint import temp_path
from _stablecore.checks import (
    check_bool,
    check_callable,
    check_choice,
    check_int,
    check_needs,
)
from _stablecore.nan_policy import ARGUMENTS, NanPolicy
from _stablecore.nan_policy import KINDS as NAN_POLICIES
from _stablecore.nan_policy import RESTORES as RESTORES
from _stablecore.nan_policy import ROLLBACK_TARGETS as ROLLBACK_TARGETS


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


def batches_from(batches, position: int, steps: int | None):
    """`batches` from the run's `position`, up to `steps` of the run in all.

    A sequence (``__getitem__`` and ``__len__``) is indexed from `position`;
    anything else is iterated and its first `position` batches dropped.
    """
    if position and hasattr(batches, "__getitem__") and hasattr(batches, "__len__"):
        it: Iterator[Any] = (batches[i] for i in range(position, len(batches)))
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
    tmp = temp_path(os.fspath(log_path))  # per process, thread and call
    with open(tmp, "x", encoding="utf-8") as f:
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


UPDATE_NOTE = (
    "its gradients were finite: the update it computed (new parameters or "
    "optimizer state) was non-finite, e.g. float16 Adam state whose second "
    "moment underflowed to 0 while eps is 0 in float16"
)


def policy_note(policy: NanPolicy) -> str:
    """The policy's part of a `NonFiniteError` message."""
    used = f"(max_rollbacks={policy.max_restores})"
    if policy.kind == "rewind":
        return f"NanPolicy.rewind: rewinds exhausted {used}"
    if policy.kind == "rollback":
        return f"NanPolicy.rollback: rollbacks exhausted {used}"
    return f"NanPolicy.{policy.kind}"


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """Where and when `fit` writes checkpoints, and whether it resumes.

    ``directory``: a directory (str or path), or the framework's
    ``CheckpointManager`` for other retention, a best-by-metric checkpoint
    or synchronous saves. ``every``: None (only the final checkpoint) or an
    int >= 1, a checkpoint every this many steps of the run. ``resume``:
    first restore the latest intact checkpoint there and go on from its
    position (with no checkpoint yet, start the run). fit keeps the run's
    bad batches in the directory's ``bad_batches.json`` (docs/locate.md);
    ``skip_listed``: skip the positions listed there without running them
    (off by default: then a run killed and resumed is the uninterrupted
    run, whose steps ran those batches). ``skip_batches``: positions to
    skip too (not written to the list). `fit` also takes a bare directory or
    manager as ``checkpoint=`` (``every=None``, ``resume=False``).

    Example:
      >>> # from jaxstable.train (or torchref.train) import Checkpointing
      >>> c = Checkpointing("runs/ckpt", every=100, resume=True)
      >>> c.every, c.resume
      (100, True)
      >>> c = Checkpointing("runs/ckpt", skip_listed=True, skip_batches=[7, 3])
      >>> c.skip_listed, c.skip_batches
      (True, (3, 7))
      >>> Checkpointing("runs/ckpt", every=0)
      Traceback (most recent call last):
      ...
      ValueError: Checkpointing: every must be None or an int >= 1, got 0
    """

    directory: Any
    every: int | None = None
    resume: bool = False
    skip_listed: bool = False
    skip_batches: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_needs(
            self.directory is not None,
            "Checkpointing: directory must be a path or a CheckpointManager, got None",
        )
        check_int("Checkpointing: every", self.every, 1, optional=True)
        check_bool("Checkpointing: resume", self.resume)
        check_bool("Checkpointing: skip_listed", self.skip_listed)
        skip = tuple(sorted(given_positions(self.skip_batches, "Checkpointing")))
        object.__setattr__(self, "skip_batches", skip)


@dataclasses.dataclass(frozen=True)
class Log:
    """What `fit` reports as it runs.

    ``path``: None, or a JSONL file, one record per step (overwritten by a
    run that does not resume; kept up to the resumed step and appended to by
    one that does). ``progress``: a tqdm progress bar with loss, grad_norm,
    loss_scale and skipped. ``time_steps``: add ``"time_s"`` to each record
    (the wall time until the step's results are ready: it waits for every
    step, so JAX's lookahead is dropped). `fit` takes ``log=None`` for no
    file and no bar, and a bare path for ``Log(path)``.

    Example:
      >>> # from jaxstable.train (or torchref.train) import Log
      >>> Log("run.jsonl", progress=False)
      Log(path='run.jsonl', progress=False, time_steps=False)
    """

    path: Any = None
    progress: bool = True
    time_steps: bool = False

    def __post_init__(self) -> None:
        check_bool("Log: progress", self.progress)
        check_bool("Log: time_steps", self.time_steps)


def checked_options(
    nan_policy,
    checkpoint,
    evaluate,
    on_step,
    log,
    batch_transform,
    steps,
    manager_type: type,
) -> dict[str, Any]:
    """fit's arguments checked, each a value (the same in both packages):
    ``policy``, ``log``, ``eval_fn``, ``eval_every`` and, from
    ``checkpoint``, ``checkpoint_dir``, ``checkpoint_every`` and ``resume``.
    """
    policy = as_policy(nan_policy)
    ckpt = as_checkpointing(checkpoint, manager_type)
    eval_fn, eval_every = as_evaluation(evaluate)
    check_int("steps", steps, 0, optional=True)
    check_callable("on_step", on_step)
    check_callable("batch_transform", batch_transform)
    check_needs(
        not policy.restores or policy.restore_to == "memory" or ckpt is not None,
        f"nan_policy={policy!r} restores from disk: it needs checkpoint=",
    )
    return {
        "policy": policy,
        "log": as_log(log),
        "eval_fn": eval_fn,
        "eval_every": eval_every,
        "checkpoint_dir": None if ckpt is None else ckpt.directory,
        "checkpoint_every": None if ckpt is None else ckpt.every,
        "resume": ckpt is not None and ckpt.resume,
        "skip_batches": () if ckpt is None else ckpt.skip_batches,
        "skip_listed": ckpt is not None and ckpt.skip_listed,
    }


def as_checkpointing(value: Any, manager_type: type) -> Checkpointing | None:
    """`fit`'s ``checkpoint=`` as a `Checkpointing` (None: no checkpoints)."""
    if value is None or isinstance(value, Checkpointing):
        return value
    if isinstance(value, str | os.PathLike | manager_type):
        return Checkpointing(value)
    raise TypeError(
        "checkpoint must be None, a directory, a CheckpointManager or a "
        f"Checkpointing, got {value!r}"
    )


def as_log(value: Any) -> Log:
    """`fit`'s ``log=`` as a `Log` (None: no file, no progress bar)."""
    if value is None:
        return Log(progress=False)
    if isinstance(value, Log):
        return value
    if isinstance(value, str | os.PathLike):
        return Log(value)
    raise TypeError(f"log must be None, a path or a Log, got {value!r}")


def as_evaluation(value: Any) -> tuple[Any, int | None]:
    """`fit`'s ``evaluate=(eval_fn, every)`` as ``(eval_fn, every)``
    (``(None, None)``: no evaluation)."""
    if value is None:
        return None, None
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise TypeError(
            "evaluate must be None or a pair (eval_fn, every): eval_fn(state) "
            f"-> {{name: scalar}} called every `every` steps, got {value!r}"
        )
    fn, every = value
    if not callable(fn):
        raise TypeError(f"evaluate's eval_fn must be a callable, got {fn!r}")
    check_int("evaluate's every", every, 1)
    return fn, every


def as_policy(value: Any) -> NanPolicy:
    if value is None:
        return NanPolicy.skip()
    if not isinstance(value, NanPolicy):
        raise TypeError(
            "nan_policy must be a NanPolicy (NanPolicy.skip(), .stop(...), "
            f".rollback(...) or .rewind(...)), got {value!r}"
        )
    return value


# The keywords fit took before NanPolicy, Checkpointing, Log and evaluate=
# (accepted for one release, with a DeprecationWarning naming the new form).
_OLD_POLICY = {
    "max_consecutive_nonfinite": ("max_consecutive", 5),
    "rollback_every": ("every", 100),
    "max_rollbacks": ("max", 3),
    "rollback_to": ("to", "memory"),
    "rewind_after": ("after", 3),
    "rewind_window": ("window", 100),
    "rewind_skip": ("skip", 0),
    "locate_first": ("locate_first", 1),
    "stop_after_nonfinite": ("stop_after", None),
}
_OLD_CHECKPOINT = {"checkpoint_dir": None, "checkpoint_every": None, "resume": False}
_OLD_EVAL = {"eval_fn": None, "eval_every": None}
_OLD_LOG = {"log_path": None, "progress": True, "time_steps": False}
OLD_KEYWORDS = (*_OLD_POLICY, *_OLD_CHECKPOINT, *_OLD_EVAL, *_OLD_LOG)


def _deprecated(old: dict, new: str) -> None:
    given = ", ".join(f"{k}={v!r}" for k, v in old.items())
    warnings.warn(
        f"fit({given}) is deprecated and will be removed in the next release: "
        f"pass {new}",
        DeprecationWarning,
        4,
    )


def _pop(kwargs: dict, names: dict) -> dict:
    return {k: kwargs.pop(k) for k in list(kwargs) if k in names}


def _old_policy(kwargs: dict) -> None:
    old = _pop(kwargs, _OLD_POLICY)
    kind = kwargs.get("nan_policy")
    if not old and not isinstance(kind, str):
        return
    if kind is None:
        kind = "skip"
    elif not isinstance(kind, str):
        raise TypeError(
            f"fit: {sorted(old)} belong to the old form; with a NanPolicy pass "
            "them to it"
        )
    check_choice("nan_policy", kind, NAN_POLICIES)
    values = {k: old.get(k, default) for k, (_, default) in _OLD_POLICY.items()}
    for name, low in (
        ("max_consecutive_nonfinite", 1), ("rollback_every", 1),
        ("max_rollbacks", 1), ("locate_first", 0), ("rewind_after", 1),
        ("rewind_window", 1), ("rewind_skip", 0),
    ):  # fmt: skip
        check_int(name, values[name], low)
    check_int("stop_after_nonfinite", values["stop_after_nonfinite"], 0, optional=True)
    check_choice("rollback_to", values["rollback_to"], ROLLBACK_TARGETS)
    check_needs(
        values["rewind_window"] >= values["rewind_after"],
        f"rewind_window ({values['rewind_window']}) must be >= rewind_after "
        f"({values['rewind_after']}): a window of {values['rewind_window']} steps "
        f"never holds {values['rewind_after']} skipped ones",
    )
    check_needs(
        values["rollback_to"] == "memory"
        or kwargs.get("checkpoint_dir", kwargs.get("checkpoint")) is not None,
        "rollback_to='disk' needs checkpoint_dir",
    )
    factory = getattr(NanPolicy, kind)
    accepted = {name for name, _ in ARGUMENTS[kind]}
    new = {arg: values[k] for k, (arg, _) in _OLD_POLICY.items() if arg in accepted}
    kwargs["nan_policy"] = factory(**new)
    _deprecated({"nan_policy": kind, **old}, f"nan_policy={kwargs['nan_policy']!r}")


def _old_checkpoint(kwargs: dict) -> None:
    old = _pop(kwargs, _OLD_CHECKPOINT)
    if not old:
        return
    if kwargs.get("checkpoint") is not None:
        raise TypeError(f"fit: pass checkpoint= or {sorted(old)}, not both")
    values = {**_OLD_CHECKPOINT, **old}
    check_bool("resume", values["resume"])
    check_int("checkpoint_every", values["checkpoint_every"], 1, optional=True)
    missing = values["checkpoint_dir"] is None
    check_needs(
        values["checkpoint_every"] is None or not missing,
        "checkpoint_every needs checkpoint_dir",
    )
    check_needs(not values["resume"] or not missing, "resume needs checkpoint_dir")
    if missing:
        _deprecated(old, "checkpoint=None")
        return
    kwargs["checkpoint"] = Checkpointing(
        values["checkpoint_dir"], values["checkpoint_every"], values["resume"]
    )
    new = "checkpoint=Checkpointing(directory, every=..., resume=...)"
    _deprecated(old, new)


def _old_eval(kwargs: dict) -> None:
    old = _pop(kwargs, _OLD_EVAL)
    if not old:
        return
    if kwargs.get("evaluate") is not None:
        raise TypeError(f"fit: pass evaluate= or {sorted(old)}, not both")
    fn, every = old.get("eval_fn"), old.get("eval_every")
    check_callable("eval_fn", fn)
    check_needs(
        (fn is None) == (every is None),
        "eval_fn and eval_every go together: pass both or neither, got "
        f"eval_fn={fn!r}, eval_every={every!r}",
    )
    check_int("eval_every", every, 1, optional=True)
    kwargs["evaluate"] = None if fn is None else (fn, every)
    _deprecated(old, "evaluate=(eval_fn, every)")


def _old_log(kwargs: dict) -> None:
    old = _pop(kwargs, _OLD_LOG)
    if not old:
        return
    if "log" in kwargs:
        raise TypeError(f"fit: pass log= or {sorted(old)}, not both")
    values = {**_OLD_LOG, **old}
    check_bool("time_steps", values["time_steps"])
    check_bool("progress", values["progress"])
    log = Log(values["log_path"], values["progress"], values["time_steps"])
    kwargs["log"] = log
    args = [] if log.path is None else [repr(log.path)]
    args += [f"{k}={getattr(log, k)!r}" for k in ("progress", "time_steps")
             if getattr(log, k) != getattr(Log(), k)]  # fmt: skip
    quiet = log == Log(progress=False)
    _deprecated(old, "log=None" if quiet else f"log=Log({', '.join(args)})")


def accepts_old_keywords(fit):
    """`fit` taking, for one release, the keywords of its old form (each
    group with a DeprecationWarning naming the new form)."""

    @functools.wraps(fit)
    def wrapper(*args, **kwargs):
        _old_policy(kwargs)
        _old_checkpoint(kwargs)
        _old_eval(kwargs)
        _old_log(kwargs)
        return fit(*args, **kwargs)

    return wrapper
