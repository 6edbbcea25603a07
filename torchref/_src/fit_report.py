"""What `fit` reports about a step: its record, the step `locate` re-runs
and the `NonFiniteError` it raises."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from _stablecore.fit import UPDATE_NOTE as _UPDATE_NOTE
from _stablecore.fit import add_skip_reason as _add_skip_reason
from _stablecore.fit import policy_note as _policy_note
from _stablecore.low_precision import STAT_NAMES
from _stablecore.nan_policy import NanPolicy
from torchref._src.diagnostics import (
    check_record,
    format_checks,
    format_location,
    format_report,
    non_finite_grad_report,
    non_finite_report,
)
from torchref._src.step import TrainStep


class NonFiniteError(FloatingPointError):
    """Training stopped on non-finite gradients.

    Raised by `fit` with `NanPolicy.stop` at the first run of
    ``max_consecutive`` non-finite steps; with `NanPolicy.rollback` or
    `NanPolicy.rewind` once its ``max`` rollbacks have been used.

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


def scalar_leaves(tree: Any, path: str = "") -> Iterable[tuple[str, float]]:
    """``(path, value)`` of every scalar leaf, paths as jax's ``keystr``."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from scalar_leaves(v, f"{path}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from scalar_leaves(v, f"{path}[{i}]")
    elif isinstance(tree, torch.Tensor):
        if tree.numel() == 1:
            yield path, float(tree.detach().float())
    elif isinstance(tree, (int, float)):
        yield path, float(tree)


def host_record(index: int, metrics: dict[str, Any]) -> dict[str, Any]:
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
    if metrics.get("microbatches_dropped") is not None:
        # drop_non_finite_microbatches: the micro-batches this step dropped.
        rec["microbatches_dropped"] = int(metrics["microbatches_dropped"])
    rec.update({k: float(metrics[k]) for k in STAT_NAMES if k in metrics})
    if metrics.get("aux") is not None:
        for path, value in scalar_leaves(metrics["aux"]):
            rec["aux" + path] = value
        # The loss's check points (diagnostics.CheckPoints): checks[...] keys
        # and the non-finite points in order, instead of aux[...] keys.
        rec.update(check_record(metrics["aux"]))
    return rec


def locate_step(step: Any) -> TrainStep | None:
    """The step `locate` re-runs: ``step`` itself, in one process and under
    DDP or FSDP2 (every rank locates at once, each on its own rows and
    shards); None for a plain step callable."""
    return step if isinstance(step, TrainStep) else None


def raise_non_finite(
    step: TrainStep,
    entry: dict[str, Any],
    run: int,
    batch: Any,
    history: list,
    policy: NanPolicy | None = None,
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
        f"({_policy_note(policy or NanPolicy.stop())}).",
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
