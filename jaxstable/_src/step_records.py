"""What the train step reports: its metrics, and the names its policy audit
gives the step's inputs.

``metrics`` holds ``loss``, ``grad_norm``, ``loss_scale`` (the scale USED),
``finite`` (applied), ``grads_finite``, ``skipped_total`` and, when they
apply, ``spike``, ``microbatches_dropped``, `low_precision_adamw`'s rounding
statistics and ``aux`` (the keys of `torchref.train.TrainStep`'s).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxstable._src.guard_state import SkipSpikesState, outer_guard
from jaxstable._src.low_precision import rounding_stats

__all__ = ["input_names", "step_metrics"]


def step_metrics(
    state: Any,
    new_state: Any,
    loss: jax.Array,
    grad_norm: jax.Array,
    flags: tuple[jax.Array, jax.Array],
    dropped: jax.Array | None,
    aux: Any,
    has_aux: bool,
) -> dict[str, Any]:
    """The metrics of the step from ``state`` to ``new_state``; ``flags`` is
    ``(applied, grads_finite)``."""
    applied, finite = flags
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "loss_scale": jnp.asarray(state.loss_scale.loss_scale, jnp.float32),
        "finite": applied,
        "grads_finite": finite,
        "skipped_total": new_state.skipped_total,
    }
    if isinstance(outer_guard(state.opt_state), SkipSpikesState):
        metrics["spike"] = outer_guard(new_state.opt_state).last_spike
    if dropped is not None:
        metrics["microbatches_dropped"] = dropped
    stats = rounding_stats(new_state.opt_state)
    if stats is not None:  # low_precision_adamw: what rounding lost
        metrics.update(stats._asdict())
    if has_aux:
        metrics["aux"] = aux
    return metrics


def input_names(state: Any, batch: Any) -> list[str]:
    """A dotted name per leaf of ``(state, batch)``: ``params.fc.kernel``,
    ``model_state.bn.mean``, ``batch.0``."""
    from jaxstable._src._locate import dotted

    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path((state, batch))[0]:
        rest = dotted(path[1:])
        names.append(rest if path[0].idx == 0 else ".".join(("batch", rest)).strip("."))
    return names
