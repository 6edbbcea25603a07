"""What `fit` reports about a step: its record, its location and the
`NonFiniteError` it raises."""

from __future__ import annotations

from typing import Any

import jax

from _stablecore.fit import UPDATE_NOTE as _UPDATE_NOTE
from _stablecore.fit import add_skip_reason as _add_skip_reason
from _stablecore.fit import policy_note as _policy_note
from _stablecore.low_precision import STAT_NAMES
from _stablecore.nan_policy import NanPolicy
from jaxstable._src.diagnostics import (
    CheckPoints,
    check_record,
    format_checks,
    format_location,
    format_report,
    locate,
    non_finite_report,
)
from jaxstable._src.distributed import to_host
from jaxstable._src.loss_scale import StaticLossScale
from jaxstable._src.step import TrainStep


class NonFiniteError(FloatingPointError):
    """Raised by `fit` after too many non-finite steps in a row.

    With `NanPolicy.stop` at the first such run; with `NanPolicy.rollback`
    or `NanPolicy.rewind` once its ``max`` rollbacks have been used.

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


def host_record(index: int, metrics: dict[str, Any]) -> dict[str, Any]:
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
    if m.get("microbatches_dropped") is not None:
        # drop_non_finite_microbatches: the micro-batches this step dropped.
        rec["microbatches_dropped"] = int(m["microbatches_dropped"])
    rec.update({k: float(m[k]) for k in STAT_NAMES if k in m})
    aux = m.get("aux")
    if aux is not None:
        rec.update(scalar_record("aux", aux))
        # The loss's check points (diagnostics.CheckPoints): checks[...] keys
        # and the non-finite points in order, instead of aux[...] keys.
        rec.update(check_record(aux))
    return rec


def scalar_record(prefix: str, tree: Any) -> dict[str, float]:
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


def raise_non_finite(
    train_step,
    rec,
    consecutive,
    batch,
    state_out,
    metrics,
    history,
    policy=None,
    location=None,
):
    # state_out is the failing step's own output: a non-finite step leaves
    # params, opt_state and model_state as they were, but its loss scale has
    # already backed off. Recompute at the scale the step USED, or an
    # overflow of the scaled loss (not NaN data) would look all finite.
    used = StaticLossScale(metrics["loss_scale"])
    grads_fn = getattr(train_step, "grads", None)
    report = (
        non_finite_report(to_host(grads_fn(state_out.replace(loss_scale=used), batch)))
        if grads_fn is not None
        else []
    )
    # Global values (gathered under jax.distributed, on every process).
    batch, state_out_host = to_host((batch, state_out))
    scale = f"{rec['loss_scale']:.6g}"
    parts = [
        f"{consecutive} non-finite step(s) in a row, the last at step "
        f"{rec['step']}; loss={rec['loss']:.6g}, grad_norm={rec['grad_norm']:.6g}, "
        f"loss_scale={scale} (the scale that step used); its update was skipped "
        f"({_policy_note(policy or NanPolicy.stop())}).",
        f"non-finite gradients at loss_scale={scale}:\n" + format_report(report),
    ]
    if rec.get("skip_reason") == "non-finite update":
        parts.insert(1, _UPDATE_NOTE)
    batch_report = non_finite_report(batch)
    if batch_report:
        parts.append("non-finite batch inputs:\n" + format_report(batch_report))
    # A plain pytree state (a pure step over a dict) has no .params.
    param_report = non_finite_report(getattr(state_out_host, "params", state_out_host))
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


def locate_failed(train_step, state_out, metrics, batch, pipeline):
    """`locate` of a non-finite step from its output state (params, optimizer
    and model state unchanged by a skipped step) at the loss scale it used.
    False when it cannot be located: not a `TrainStep`, or its input state
    donated to the step already queued after it."""
    if not isinstance(train_step, TrainStep) or not hasattr(train_step, "loss_fn"):
        return False
    leaves = jax.tree_util.tree_leaves(state_out)
    if pipeline and any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
        return False
    # Under several processes every process calls locate at the same step
    # (the finite decision is global) with its own shards: nothing gathered.
    used = StaticLossScale(metrics["loss_scale"])
    # finite=False: the compiled step was not applied (no need to re-run it).
    return locate(train_step, state_out.replace(loss_scale=used), batch, finite=False)
