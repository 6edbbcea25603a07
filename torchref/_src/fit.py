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

from torchref._src.checkpoint import save_checkpoint
from torchref._src.diagnostics import (
    format_location,
    format_report,
    locate,
    non_finite_grad_report,
    non_finite_report,
)
from torchref._src.step import TrainStep

NAN_POLICIES = ("skip", "stop", "rollback")


class NonFiniteError(FloatingPointError):
    """Training stopped on non-finite gradients.

    Raised by `fit` with ``nan_policy="stop"`` at the first run of
    ``max_consecutive_nonfinite`` non-finite steps; with ``"rollback"`` once
    ``max_rollbacks`` rollbacks have been used.

    Attributes:
        step: 0-based index (within the `fit` call) of the step that hit the
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


def _add_skip_reason(rec: dict[str, Any], grads_finite: Any) -> None:
    # Only a guarded step reports grads_finite (a plain step that does not
    # skip has no reason to give); then its record tells why it skipped.
    if grads_finite is None:
        return
    # Same keys as jaxstable.train.fit: a skipped step says why.
    rec["grads_finite"] = bool(grads_finite)
    if not rec["finite"]:
        rec["skip_reason"] = (
            "non-finite update" if rec["grads_finite"] else "non-finite gradients"
        )


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
    _add_skip_reason(rec, metrics.get("grads_finite"))
    if metrics.get("aux") is not None:
        for path, value in _scalar_leaves(metrics["aux"]):
            rec["aux" + path] = value
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
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    rollback_every: int = 100,
    max_rollbacks: int = 3,
    locate_first: int = 1,
    time_steps: bool = False,
    eval_fn: Callable[[Any], Any] | None = None,
    eval_every: int | None = None,
    on_step: Callable[[dict[str, Any], Any], Any] | None = None,
    stop_after_nonfinite: int | None = None,
) -> list[dict[str, Any]]:
    """Runs `step` over `batches` with a progress bar, a JSONL log and a NaN policy.

    Per batch: ``metrics = step(batch)``; the history entry (and JSONL line)
    is ``{"step": i, loss, grad_norm, loss_scale, finite, skipped_total}``
    plus one ``aux[...]`` key per scalar leaf of ``aux`` (i 0-based); with a
    step that reports ``grads_finite`` (a `TrainStep`) that key too, and on a
    skipped step ``skip_reason`` (``"non-finite gradients"`` or
    ``"non-finite update"``): the same record as `jaxstable.train.fit`.
    `log_path` is overwritten at the start of the call and gets one JSON line
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
      done in this call) with ``n % rollback_every == 0`` whose result was
      finite. After `max_consecutive_nonfinite` non-finite steps in a row,
      a deep copy of it is loaded with ``step.load_state_dict`` (a copy, as
      the optimizer may keep the loaded tensors and update them in place),
      the run counter restarts, that step's record gets
      ``"rolled_back": True`` (the only record with that key) and training
      goes on with the NEXT batch (the bad ones are not retried). The
      trigger after `max_rollbacks` rollbacks raises `NonFiniteError` as
      "stop" does, the message saying the rollbacks are exhausted. Same
      semantics as `jaxstable.train.fit`.

    Checkpoints: ``step.state_dict()`` is saved with `torch.save` to
    ``checkpoint_dir/step_{n:08d}.pt`` (n = steps done in this call) every
    `checkpoint_every` steps, and once more at the end (not when it raises);
    `checkpoint_dir` alone writes only that final checkpoint.

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
        nan_policy: "skip", "stop" or "rollback".
        max_consecutive_nonfinite: int >= 1, used by "stop" and "rollback".
        log_path: JSONL file (overwritten) or None.
        progress: show a tqdm bar (loss, grad_norm, loss_scale, skipped).
        checkpoint_dir: directory of the checkpoints, or None.
        checkpoint_every: int >= 1 or None; needs `checkpoint_dir`.
        rollback_every: snapshot period in steps for "rollback", int >= 1
            (accepted, unused, with the other policies).
        max_rollbacks: rollbacks allowed in this call for "rollback",
            int >= 1 (accepted, unused, with the other policies).
        locate_first: the first this many non-finite steps of the call
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
            done in this call, ``n % eval_every == 0``), its scalars added to
            that step's record as ``eval[...]`` keys (named as ``aux``'s).
            Needs `eval_every`.
        eval_every: int >= 1, the period of `eval_fn` (needs `eval_fn`).
        on_step: ``on_step(record, step)``, called once per step with the
            step's record (after it is logged); if it returns True, fit stops
            after that step and returns normally.
        stop_after_nonfinite: None, or an int >= 0: fit returns normally
            (nothing raised) this many steps after the first step of the call
            whose record has ``finite == False`` (0: stop at that step); for
            runs meant to fail, such as a naive low-precision baseline.
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
    _check_fit_extras(time_steps, eval_fn, eval_every, on_step, stop_after_nonfinite)
    if nan_policy not in NAN_POLICIES:
        raise ValueError(
            f"nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}"
        )
    if isinstance(max_consecutive_nonfinite, bool) or not isinstance(
        max_consecutive_nonfinite, int
    ):
        raise ValueError(
            "max_consecutive_nonfinite must be an int >= 1, "
            f"got {max_consecutive_nonfinite!r}"
        )
    if max_consecutive_nonfinite < 1:
        raise ValueError(
            "max_consecutive_nonfinite must be an int >= 1, "
            f"got {max_consecutive_nonfinite!r}"
        )
    for name, value in (
        ("rollback_every", rollback_every),
        ("max_rollbacks", max_rollbacks),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if steps is not None and (
        isinstance(steps, bool) or not isinstance(steps, int) or steps < 0
    ):
        raise ValueError(f"steps must be None or an int >= 0, got {steps!r}")
    if (
        isinstance(locate_first, bool)
        or not isinstance(locate_first, int)
        or locate_first < 0
    ):
        raise ValueError(f"locate_first must be an int >= 0, got {locate_first!r}")
    if checkpoint_every is not None:
        if (
            isinstance(checkpoint_every, bool)
            or not isinstance(checkpoint_every, int)
            or checkpoint_every < 1
        ):
            raise ValueError(
                f"checkpoint_every must be an int >= 1, got {checkpoint_every!r}"
            )
        if checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir")
    stateful = hasattr(step, "state_dict") and hasattr(step, "load_state_dict")
    if not stateful and (nan_policy == "rollback" or checkpoint_dir is not None):
        raise TypeError(
            "nan_policy='rollback' and checkpoint_dir need a step with "
            f"state_dict() and load_state_dict(), got {type(step).__name__}"
        )

    from tqdm.auto import tqdm

    total = (
        steps
        if steps is not None
        else (len(batches) if hasattr(batches, "__len__") else None)
    )
    it = iter(batches) if steps is None else itertools.islice(batches, steps)
    log = open(log_path, "w", encoding="utf-8") if log_path is not None else None
    if checkpoint_dir is not None:
        os.makedirs(checkpoint_dir, exist_ok=True)
    history: list[dict[str, Any]] = []
    bar = tqdm(total=total, disable=not progress, desc="fit")
    run = 0
    done = 0
    saved_at = None
    rollback = nan_policy == "rollback"
    rollbacks = 0
    located = 0
    # Deep copies: state_dict() holds references to the live tensors.
    snapshot = copy.deepcopy(step.state_dict()) if rollback else None

    def save(n: int) -> None:
        save_checkpoint(os.path.join(checkpoint_dir, f"step_{n:08d}.pt"), step)

    first_bad = None
    try:
        for i, batch in enumerate(it):
            start = time.perf_counter()
            metrics = step(batch)
            done = i + 1
            entry = _host_record(i, metrics)
            if time_steps:
                entry["time_s"] = time.perf_counter() - start
            if eval_fn is not None and done % eval_every == 0:
                for path, value in _scalar_leaves(eval_fn(step)):
                    entry["eval" + path] = value
            run = 0 if entry["finite"] else run + 1
            triggered = nan_policy != "skip" and run >= max_consecutive_nonfinite
            rolls = triggered and rollback and rollbacks < max_rollbacks
            if rolls:
                entry["rolled_back"] = True
            location = None
            locatable = isinstance(step, TrainStep)  # as jaxstable's fit
            wanted = triggered or located < locate_first
            if locatable and not entry["finite"] and wanted:
                # A skipped step left model and optimizer as they were; only
                # the scaler backed off: re-run at the scale the step used.
                location = locate(step, batch, loss_scale=entry["loss_scale"])
                located += 1
                entry["location"] = None if location is None else location._asdict()
            history.append(entry)
            if log is not None:
                log.write(json.dumps(entry) + "\n")
                log.flush()
            bar.update(1)
            bar.set_postfix(
                loss=f"{entry['loss']:.4g}",
                grad_norm=f"{entry['grad_norm']:.3g}",
                loss_scale=f"{entry['loss_scale']:.3g}",
                skipped=entry["skipped_total"],
                refresh=False,
            )
            wants_stop = on_step is not None and on_step(entry, step) is True
            if rolls:
                # A copy again: the optimizer may keep the loaded tensors and
                # update them in place, which must not reach the snapshot.
                step.load_state_dict(copy.deepcopy(snapshot))
                rollbacks += 1
                run = 0
            elif triggered:
                _raise_non_finite(
                    step,
                    entry,
                    run,
                    batch,
                    history,
                    nan_policy,
                    max_rollbacks,
                    location,
                )
            elif rollback and entry["finite"] and done % rollback_every == 0:
                snapshot = copy.deepcopy(step.state_dict())
            if first_bad is None and not entry["finite"]:
                first_bad = i
            if stop_after_nonfinite is not None and first_bad is not None:
                wants_stop = wants_stop or i - first_bad >= stop_after_nonfinite
            if wants_stop and not rolls:
                break
            if checkpoint_every is not None and done % checkpoint_every == 0:
                save(done)
                saved_at = done
        if checkpoint_dir is not None and saved_at != done:
            save(done)  # the final checkpoint
    finally:
        bar.close()
        if log is not None:
            log.close()
    return history


# Same text in jaxstable.train and torchref.train.
_UPDATE_NOTE = (
    "its gradients were finite: the update it computed (new parameters or "
    "optimizer state) was non-finite, e.g. float16 Adam state whose second "
    "moment underflowed to 0 while eps is 0 in float16"
)


def _check_fit_extras(time_steps, eval_fn, eval_every, on_step, stop_after):
    # Same checks and texts as jaxstable.train.fit.
    if not isinstance(time_steps, bool):
        raise TypeError(f"time_steps must be True or False, got {time_steps!r}")
    for name, fn in (("eval_fn", eval_fn), ("on_step", on_step)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be None or a callable, got {fn!r}")
    if (eval_fn is None) != (eval_every is None):
        raise ValueError(
            "eval_fn and eval_every go together: pass both or neither, got "
            f"eval_fn={eval_fn!r}, eval_every={eval_every!r}"
        )
    if eval_every is not None and (
        isinstance(eval_every, bool)
        or not isinstance(eval_every, int)
        or eval_every < 1
    ):
        raise ValueError(f"eval_every must be None or an int >= 1, got {eval_every!r}")
    if stop_after is not None and (
        isinstance(stop_after, bool)
        or not isinstance(stop_after, int)
        or stop_after < 0
    ):
        raise ValueError(
            f"stop_after_nonfinite must be None or an int >= 0, got {stop_after!r}"
        )


def _policy_note(nan_policy: str, max_rollbacks: int) -> str:
    # Same text as jaxstable.train.fit.
    if nan_policy == "rollback":
        return (
            "nan_policy='rollback': rollbacks exhausted "
            f"(max_rollbacks={max_rollbacks})"
        )
    return f"nan_policy={nan_policy!r}"


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
    if "location" in entry:
        parts.append("where (diagnostics.locate):\n" + format_location(location))
    raise NonFiniteError(
        "\n".join(parts),
        step=entry["step"],
        report=report,
        history=history,
        location=location,
    )
