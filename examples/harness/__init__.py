"""The example harness: one naive-vs-stable comparison for every task.

``python examples/compare.py TASK`` trains one task six times from the same
initial weights (torch's seeded init, converted to JAX) and the same batches:
JAX and torch, each ``naive`` and ``stable`` at the low precision, plus a
float32 ``stable`` run of each framework as the reference (with
``--precision float32`` the reference is the stable run itself: four runs).
Every run goes through the libraries' own loops, `jaxstable.train.fit` and
`torchref.train.fit`. The harness writes ``metrics.jsonl``, ``summary.json``,
``curves.png`` and ``report.md`` (see `run.compare`).

One concern per module, the arrows pointing one way (``a <- b``: b imports a)::

    config        BaseConfig: the settings every task has, and their checks
    parts         Task, JaxParts, TorchParts: what a task hands the harness
    results       RunResult, the diagnostics text, number formats
    devices       --devices N: JAX's mesh, replica checks, the 1-device check
    jax_runner    the naive / stable JAX step, one run on jaxstable's fit
    torch_runner  the naive / stable torch step, one run on torchref's fit
    collective    global_mean, gather_rows: a torch loss made global under DDP
    ddp           one torch run in N DDP processes (<- torch_runner, collective)
    agreement     fp32_agreement, gradient_agreement (<- torch_runner)
    report        metrics.jsonl lines, curves.png, report.md
    run           train_and_evaluate, compare: the plan and its outputs
    cli           compare.py's command line (<- run)
    environment   the versions, devices, CPU and git commit a run came from

A task is a folder ``examples/<name>/`` whose ``task.py`` defines ``TASK``, a
`parts.Task`; shared models, converters and data helpers are
`examples.common`.

A run is "broken" at the first step after which the model is non-finite:
for naive runs the first record with ``finite == False`` (non-finite loss,
gradients or new parameters); for stable runs the first step after which the
parameters or the model state are non-finite (a step the guards *skipped*
leaves the model as it was and is counted in ``skipped_total`` instead).
``config.stop_after_nonfinite`` steps later the run stops: nothing more is
learned from NaN weights.

This package re-exports the names a user of the harness calls.
"""

from examples.harness.agreement import (
    AGREEMENT_STEPS,
    FP32_AGREEMENT_LIMIT,
    GRADIENT_THRESHOLD,
    fp32_agreement,
    gradient_agreement,
)
from examples.harness.cli import base_config, main, parse_args
from examples.harness.config import (
    MODES,
    OPTIMIZERS,
    PRECISIONS,
    BaseConfig,
    check_choice,
    check_int,
    check_positive,
    jax_dtype,
    make_config,
    torch_dtype,
)
from examples.harness.jax_runner import jax_optimizer, run_jax
from examples.harness.parts import JaxParts, Task, TorchParts
from examples.harness.report import metric_lines, write_report
from examples.harness.results import RunResult, fmt, json_float
from examples.harness.run import compare, run_plan, train_and_evaluate
from examples.harness.torch_runner import run_torch, torch_optimizer

__all__ = [
    "AGREEMENT_STEPS",
    "FP32_AGREEMENT_LIMIT",
    "GRADIENT_THRESHOLD",
    "MODES",
    "OPTIMIZERS",
    "PRECISIONS",
    "BaseConfig",
    "JaxParts",
    "RunResult",
    "Task",
    "TorchParts",
    "base_config",
    "check_choice",
    "check_int",
    "check_positive",
    "compare",
    "fmt",
    "fp32_agreement",
    "gradient_agreement",
    "jax_dtype",
    "jax_optimizer",
    "json_float",
    "main",
    "make_config",
    "metric_lines",
    "parse_args",
    "run_jax",
    "run_plan",
    "run_torch",
    "torch_dtype",
    "torch_optimizer",
    "train_and_evaluate",
    "write_report",
]
