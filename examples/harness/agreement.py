"""Do the JAX and the torch runs agree? Losses along two runs, gradients at one point.

:func:`fp32_agreement` compares the losses of the two float32 stable runs of
a comparison (they start bit-identical; float32 rounding differences of the
two convolution / batch-norm implementations are then amplified by
training). :func:`gradient_agreement` separates the frameworks from those
dynamics: both frameworks' gradients at the same weights, step by step
along the torch run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from examples.harness import torch_runner
from examples.harness.config import BaseConfig, check_int
from examples.harness.parts import Task
from examples.harness.results import RunResult

# The bound on `fp32_agreement` (max relative loss difference of the two
# float32 runs over the first 50 steps). Segmentation, 50 steps at the
# defaults: 1.3e-4 at lr 1e-3, 9.1e-4 at 2e-3, 1.3e-3 at 3e-3.
FP32_AGREEMENT_LIMIT = 1e-3
AGREEMENT_STEPS = 50
# `gradient_agreement`: the relative gradient difference that counts as a split
GRADIENT_THRESHOLD = 1e-4


def fp32_agreement(runs: list[RunResult], steps: int = AGREEMENT_STEPS) -> float | None:
    """max |loss_jax - loss_torch| / |loss_torch| over the first `steps` float32 steps.

    Compares the two float32 stable runs (same init, batches, optimizer) over
    exactly ``min(steps, config.steps)`` steps. None when there is no such
    pair; NaN (null in JSON) when the number is undefined: a run stopped
    before those steps, or a loss there is non-finite or zero, so a diverged
    run can never pass for an agreeing one.

    Example:
        >>> cfg = BaseConfig()
        >>> mk = lambda fw, l: RunResult(
        ...     fw, cfg, [{"loss": x} for x in l], None, l[-1], 0, {}, 1.0)
        >>> torch_run = mk("torch", [1.0, 0.4])
        >>> round(fp32_agreement([mk("jax", [1.0, 0.5]), torch_run], 2), 6)
        0.25
        >>> fp32_agreement([mk("jax", [1.0, float("nan")]), torch_run], 2)
        nan
    """
    pick = {
        r.framework: r
        for r in runs
        if r.config.precision == "float32" and r.config.mode == "stable"
    }
    if set(pick) != {"jax", "torch"}:
        return None
    n = min(steps, pick["jax"].config.steps, pick["torch"].config.steps)
    a = [m["loss"] for m in pick["jax"].metrics[:n]]
    b = [m["loss"] for m in pick["torch"].metrics[:n]]
    if len(a) < n or len(b) < n:
        return math.nan
    if not all(math.isfinite(x) for x in a + b) or any(y == 0.0 for y in b):
        return math.nan
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def gradient_agreement(
    task: Task,
    config: BaseConfig,
    steps: int = AGREEMENT_STEPS,
    *,
    threshold: float = GRADIENT_THRESHOLD,
    on_split: Callable[[Any, Mapping[str, np.ndarray]], dict] | None = None,
    batches: list[dict[str, np.ndarray]] | None = None,
) -> dict[str, Any]:
    """Do JAX and torch compute the same gradient at the same weights?

    Where `fp32_agreement` compares two runs that may drift apart through
    the training dynamics, this separates the frameworks from the dynamics:
    it trains the float32 stable torch run of `config` step by step and,
    before each step, loads torch's current weights into the JAX model
    (``task.jax_parts``) and takes both frameworks' gradients of the loss on
    that step's batch; per parameter the relative difference
    ``|g_jax - g_torch| / |g_torch|`` (norms; 0 where both are 0). It stops
    at the first step where one exceeds `threshold`. The torch gradients are
    brought to the JAX layout by ``task.jax_parts`` too (a state dict with
    the gradients in the parameters' places), so the task's converter must
    be linear in the parameters (transposes and reshapes are).

    Args:
      task, config: the task and a float32 stable config (its schedule and
        batches; the first `steps` are compared).
      threshold: the relative difference that counts as a split.
      on_split: optional ``on_split(torch_model, numpy_batch) -> dict``,
        called at the split (weights before that step); its entries go into
        the split.
      batches: the run's first batches if the caller has them (else drawn
        with ``task.train_batches(config)``, all ``config.steps`` of them).

    Returns:
      ``{"steps": steps compared, "max_relative_difference": the largest
      before the split (over all steps if none), "split": None or {"step",
      "param" (the worst, JAX path), "relative_difference", ...}}``.

    Example:
        >>> from examples.segmentation.task import TASK
        >>> cfg = TASK.get_config(**TASK.quick)
        >>> out = gradient_agreement(TASK, cfg, 2)
        >>> out["steps"], out["split"], out["max_relative_difference"] < 1e-4
        (2, None, True)
    """
    import jax
    import jax.numpy as jnp

    if config.precision != "float32" or config.mode != "stable":
        raise ValueError(
            "gradient_agreement compares float32 stable runs; got precision="
            f"{config.precision!r}, mode={config.mode!r}"
        )
    check_int("steps", steps, 1)
    task.check(config)
    weights = task.initial_weights(config)
    batches = (task.train_batches(config) if batches is None else batches)[:steps]
    parts = task.torch_parts(config, weights)
    model = parts.model
    train_step, scheduler = torch_runner.stable_step(config, parts)
    first = task.jax_parts(config, weights)

    def loss_only(params, model_state, batch):
        out, _ = first.loss_fn(params, model_state, batch)
        return out[0] if first.has_aux else out

    grad_fn = jax.jit(jax.grad(loss_only))

    @jax.jit  # one dispatch per step for every parameter
    def relative(ours, theirs):
        def rel(a, b):
            b_norm = jnp.linalg.norm(b)
            return jnp.linalg.norm(a - b) / jnp.where(b_norm > 0, b_norm, 1.0)

        return jax.tree.map(rel, ours, theirs)

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(config.torch_threads)  # as run_torch trains it
    try:
        largest = 0.0
        for step, batch in enumerate(batches):
            torch_batch = parts.to_torch(batch)
            model.zero_grad()
            loss = parts.loss_fn(model, torch_batch)
            (loss[0] if isinstance(loss, tuple) else loss).backward()
            state = model.state_dict()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            now = task.jax_parts(config, state)
            theirs = task.jax_parts(config, {**state, **grads}).params
            jax_batch = jax.tree.map(jnp.asarray, batch)
            ours = grad_fn(now.params, now.model_state, jax_batch)
            rel = jax.tree.map(float, relative(ours, theirs))
            path, worst = max(
                jax.tree_util.tree_leaves_with_path(rel), key=lambda kv: kv[1]
            )
            if worst > threshold:
                split = dict(
                    step=step,
                    param=jax.tree_util.keystr(path, simple=True, separator="."),
                    relative_difference=worst,
                )
                if on_split is not None:
                    split.update(on_split(model, batch))
                return dict(
                    steps=step + 1, max_relative_difference=largest, split=split
                )
            largest = max(largest, worst)
            model.zero_grad()
            record = train_step(torch_batch)
            if scheduler is not None and record["finite"]:
                scheduler.step()
        return dict(steps=len(batches), max_relative_difference=largest, split=None)
    finally:
        torch.set_num_threads(threads)  # leave no global state behind
