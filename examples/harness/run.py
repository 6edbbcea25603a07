"""A comparison of one task: the plan of runs, each run, and the four outputs.

:func:`compare` is what ``compare.py TASK`` runs: the same initial weights
and batches for every run of :func:`run_plan`, each through
:func:`train_and_evaluate` (JAX on `jax_runner`, torch on `torch_runner`,
or in DDP processes with ``devices > 1``), then ``metrics.jsonl``,
``summary.json``, ``curves.png`` and ``report.md``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from examples.harness import ddp, devices, environment, jax_runner, torch_runner
from examples.harness.agreement import fp32_agreement
from examples.harness.config import BaseConfig, check_choice
from examples.harness.parts import Task
from examples.harness.report import metric_lines, plot_curves, write_report
from examples.harness.results import RunResult, json_float


def run_plan(precision: str) -> list[tuple[str, str, str]]:
    """The (framework, precision, mode) of each run, in the order they run.

    Example:
        >>> for run in run_plan("float16")[:3]:
        ...     print(run)
        ('jax', 'float32', 'stable')
        ('jax', 'float16', 'naive')
        ('jax', 'float16', 'stable')
        >>> len(run_plan("float32"))
        4
    """
    plan = []
    for fw in ("jax", "torch"):
        if precision != "float32":
            plan.append((fw, "float32", "stable"))
        plan += [(fw, precision, "naive"), (fw, precision, "stable")]
    return plan


def train_and_evaluate(
    task: Task,
    framework: str,
    config: BaseConfig,
    *,
    weights: Mapping[str, Any] | None = None,
    batches: list[dict[str, np.ndarray]] | None = None,
    heldout: Any = None,
    progress: bool = True,
    log: Callable[[dict[str, Any]], None] | None = None,
) -> RunResult:
    """One run of `task` in `framework` (``"jax"`` or ``"torch"``).

    What the task does not get passed (initial weights, batches, held-out
    set) is drawn from `config`; ``log`` is called with each `fit` record.
    """
    check_choice("framework", framework, ("jax", "torch"))
    task.check(config)
    weights = task.initial_weights(config) if weights is None else weights
    batches = task.train_batches(config) if batches is None else batches
    heldout = task.heldout_set(config) if heldout is None else heldout
    args = (task, config, weights, batches, heldout)
    if framework == "jax":
        return jax_runner.run_jax(*args, progress=progress, log=log)
    if config.devices > 1:  # N DDP processes (this process waits for them)
        return ddp.torch_multiprocess(*args, progress=progress, log=log)
    return torch_runner.run_torch(*args, progress=progress, log=log)


def compare(task: Task, base: BaseConfig, precision: str, out: str, *,
            command: str = "", progress: bool = True,
            one_device_reference: bool = False) -> dict[str, Any]:  # fmt: skip
    """Runs the plan of `task`, writes the four outputs, returns the summary.

    Writes into `out`:

    * ``metrics.jsonl``: one line per run per step (framework, precision,
      mode and the `fit` record: step, loss, grad_norm, loss_scale, finite,
      skipped_total, time_s; null = non-finite);
    * ``summary.json``: ``{"task", "precision", "metrics", "runs": [...],
      "fp32_agreement", "config", "wall_time_s", "environment"}``, each
      run with the task's held-out metrics and ``location``: ``{"step",
      "phase", "path", "op", "detail"}`` of what ``diagnostics.locate``
      found for its first non-finite step (naive) or first skipped step
      (stable), else None;
      with ``base.devices > 1`` each run also carries ``replicas``
      (`examples.harness.devices.replica_check`), and with
      ``one_device_reference`` the plan runs again on one device and
      ``"one_device"`` holds `examples.harness.devices.one_device_agreement`;
      ``"diagnosis"``: ``task.diagnose(runs)`` when the task has one;
      ``"environment"``: the versions, devices, CPU, git commit and time
      of the run (`examples.harness.environment.record`; a summary written
      before the harness recorded it has no such key);
    * ``curves.png``: loss, loss scale and gradient norm per step;
    * ``report.md``: the table, the plot, what failed where and why, and for
      each run that went non-finite what ``diagnostics.locate`` found, above
      the diagnostics table of its first non-finite step.
    """
    task.check(base)
    t0 = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    batches = task.train_batches(base)
    heldout = task.heldout_set(base)
    weights = task.initial_weights(base)
    runs = []
    for fw, p, mode in run_plan(precision):
        cfg = base.replace(precision=p, mode=mode)
        runs.append(
            train_and_evaluate(
                task,
                fw,
                cfg,
                weights=weights,
                batches=batches,
                heldout=heldout,
                progress=progress,
            )
        )
    with open(os.path.join(out, "metrics.jsonl"), "w", encoding="utf-8") as f:
        for r in runs:
            f.writelines(line + "\n" for line in metric_lines(r))
    agreement = fp32_agreement(runs)
    summary = {
        "task": task.name,
        "precision": precision,
        "metrics": list(task.metrics),
        "runs": [r.summary() for r in runs],
        "fp32_agreement": None if agreement is None else json_float(agreement),
        "config": base.as_dict(),
    }
    if one_device_reference and base.devices > 1:
        refs = [
            train_and_evaluate(task, fw, base.replace(precision=p, mode=mode,
                               devices=1), weights=weights, batches=batches,
                               heldout=heldout, progress=progress)
            for fw, p, mode in run_plan(precision)
        ]  # fmt: skip
        summary["one_device"] = devices.one_device_agreement(runs, refs)
    if task.diagnose is not None:
        summary["diagnosis"] = task.diagnose(runs)
    plot_curves(runs, os.path.join(out, "curves.png"), task.curves)
    summary["wall_time_s"] = time.perf_counter() - t0
    summary["environment"] = environment.record()
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, allow_nan=False)
        f.write("\n")
    summary["report"] = write_report(task, out, runs, summary, command)
    return summary
