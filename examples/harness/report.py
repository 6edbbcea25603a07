"""The outputs of a comparison: ``metrics.jsonl`` lines, ``curves.png``, ``report.md``.

Everything here reads `RunResult` s and writes text or a plot; the numbers
in the report's "What happened" section are the observed ones
(:func:`explain`).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from examples.harness import devices, environment
from examples.harness.agreement import AGREEMENT_STEPS, fp32_agreement
from examples.harness.parts import Task
from examples.harness.results import RunResult, fmt, json_float
from examples.harness.sections import marked


def metric_lines(result: RunResult) -> list[str]:
    """The ``metrics.jsonl`` lines of one run (non-finite floats as null).

    Each line: framework, precision, mode, then the `fit` record (step, loss,
    grad_norm, loss_scale, finite, skipped_total, time_s).

    Example:
        >>> from examples.harness.config import BaseConfig
        >>> r = RunResult("jax", BaseConfig(), [dict(
        ...     step=0, loss=float("nan"), grad_norm=1.0, loss_scale=1.0,
        ...     finite=False, skipped_total=0, time_s=0.5)], 0, float("nan"), 0,
        ...     {}, 0.1)
        >>> line = json.loads(metric_lines(r)[0])
        >>> line["framework"], line["loss"], line["finite"], len(line)
        ('jax', None, False, 10)
    """
    c = result.config
    lines = []
    for m in result.metrics:
        rec = {"framework": result.framework, "precision": c.precision}
        rec["mode"] = c.mode
        for key, value in m.items():
            rec[key] = _jsonable(value)
        lines.append(json.dumps(rec, allow_nan=False))
    return lines


def _jsonable(value: Any) -> Any:
    # Strict JSON: nan/inf become null, nested records (fit's "location")
    # keep their shape, strings (fit's "skip_reason") and ints stay.
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return json_float(value)


def plot_curves(runs: list[RunResult], path: str, extra=()) -> None:
    """Writes ``curves.png``: loss, loss scale and grad norm vs step, per run,
    and a panel per ``(record key, title)`` of `extra` (`Task.curves`; log
    scale unless a value is <= 0).

    Non-finite steps are marked with an x on the top edge of each panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import transforms as mtransforms

    colors = {
        ("jax", "float32"): "#9ecae1",
        ("jax", "low"): "#08519c",
        ("torch", "float32"): "#fdae6b",
        ("torch", "low"): "#a63603",
    }
    panels = (("loss", "loss (train batch)"), ("loss_scale", "loss scale"))
    panels += (("grad_norm", "grad norm (pre-clip)"), *tuple(extra))
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(9, 10 * len(panels) / 3), sharex=True
    )
    for ax, (key, title) in zip(axes, panels, strict=True):
        edge = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
        for r in runs:
            low = "float32" if r.config.precision == "float32" else "low"
            color = colors[(r.framework, low)]
            style = "--" if r.config.mode == "naive" else "-"
            steps = [m["step"] for m in r.metrics]
            ys = [m.get(key, math.nan) for m in r.metrics]
            ys = [y if math.isfinite(y) else math.nan for y in ys]
            ax.plot(steps, ys, style, color=color, lw=1.4, label=r.name)
            bad = [m["step"] for m in r.metrics if not m["finite"]]
            if bad:
                ax.plot(
                    bad,
                    [0.97] * len(bad),
                    "x",
                    color=color,
                    ms=7,
                    transform=edge,
                    clip_on=False,
                )
        values = [y for line in ax.get_lines() for y in line.get_ydata()]
        if all(not (v <= 0) for v in values):  # nan passes: not plotted
            ax.set_yscale("log")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3, which="both")
    broken = [
        f"{r.name}: non-finite at step {r.first_nonfinite_step}, "
        f"stopped after step {len(r.metrics) - 1}"
        for r in runs
        if r.first_nonfinite_step is not None
    ]
    if broken:  # a few steps at the left edge are easy to miss: say it
        axes[0].text(
            0.98,
            0.55,
            "\n".join(broken),
            transform=axes[0].transAxes,
            ha="right",
            fontsize=8,
            bbox=dict(facecolor="white", alpha=0.8, edgecolor="0.7"),
        )
    axes[0].legend(fontsize=8, ncol=2)
    axes[0].set_title("x on the top edge: non-finite step (grads or new params)")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(runs: list[RunResult], metrics: tuple[str, ...]) -> str:
    head = (
        "| framework | precision | mode | steps | first non-finite step | "
        "final loss | skipped | "
        + " | ".join(f"held-out {m}" for m in metrics)
        + " | steps/s |\n"
        + "|---" * (8 + len(metrics))
        + "|\n"
    )
    rows = []
    for r in runs:
        s = r.summary()
        first = s["first_nonfinite_step"]
        scores = " | ".join(fmt(s[m], ".3f") for m in metrics)
        rows.append(
            f"| {s['framework']} | {s['precision']} | {s['mode']} | {s['steps']} | "
            f"{'-' if first is None else first} | {fmt(s['final_loss'], '.4f')} | "
            f"{s['skipped_total']} | {scores} | {fmt(s['steps_per_s'], '.1f')} |"
        )
    return head + "\n".join(rows) + "\n"


def _short_report(text: str, rows: int = 8) -> str:
    """The count lines of a diagnostics report and the first `rows` of each table."""
    out, kept = [], 0
    for line in text.splitlines():
        starts = ("Adam", "non-finite", "Cause observed")
        if "entries non-finite" in line or line.startswith(starts):
            out.append(line)
            kept = 0
        elif kept < rows + 2:  # header lines + rows
            out.append(line)
            kept += 1
        elif kept == rows + 2:
            out.append("  ...")
            kept += 1
    return "\n".join(out)


def location_text(r: RunResult) -> str:
    """``format_location`` of the run's located step ("" when none was located).

    Both frameworks render the same text; the run's own module does it.

    Example:
        >>> from examples.harness.config import BaseConfig
        >>> r = RunResult("torch", BaseConfig(), [], 0, 1.0, 0, {}, 1.0,
        ...               location=dict(phase="input", path="image", op=None,
        ...                             source=None, detail="NaN in batch['image']"),
        ...               location_step=0)
        >>> print(location_text(r))
        non-finite value first in phase 'input' at image
          cause: NaN in batch['image']
    """
    if r.location_step is None:
        return ""
    if r.framework == "jax":
        from jaxstable import diagnostics
    else:
        from torchref import diagnostics
    if r.location is None:
        return (
            "all finite: re-run op by op, the step gave no non-finite value "
            "(it did in the run)"
        )
    return diagnostics.format_location(diagnostics.NonFiniteLocation(**r.location))


def _location_block(r: RunResult) -> list[str]:
    """The report lines of what ``diagnostics.locate`` found for `r`."""
    if r.location_step is None:
        return []
    what = (
        "the first non-finite step"
        if r.config.mode == "naive"
        else "the first step the guards skipped"
    )
    return [
        f"Where ({what}, step {r.location_step}; `diagnostics.locate`):",
        "",
        "```text",
        location_text(r),
        "```",
        "",
    ]


def _next_loss(r: RunResult) -> str:
    i = r.first_nonfinite_step + 1
    return fmt(r.metrics[i]["loss"], ".4g") if i < len(r.metrics) else "n/a"


def explain(task: Task, runs: list[RunResult], agreement: float | None) -> str:
    """The "what happened" paragraphs of ``report.md``, from the observed numbers."""
    key = task.metrics[0]
    parts = []
    for r in runs:
        if r.config.mode != "naive":
            continue
        if r.first_nonfinite_step is None:
            parts.append(
                f"- **{r.name}** stayed finite for its {len(r.metrics)} steps "
                f"(final loss {fmt(r.final_loss, '.4f')}, {key} "
                f"{fmt(r.scores[key], '.3f')}): no non-finite step at these "
                "settings"
                + (
                    " (the task's diagnosis below reads its check points)."
                    if task.diagnose is not None
                    else "."
                )
            )
            continue
        lines = r.non_finite_report.splitlines()
        counts = "; ".join(ln for ln in lines if "entries non-finite" in ln)
        adam = next((ln for ln in lines if ln.startswith("Adam")), "")
        cause = next((ln for ln in lines if ln.startswith("Cause observed")), "")
        adam = f"{cause} {adam}".strip()
        m0 = r.metrics[r.first_nonfinite_step]
        where = location_text(r).split("\n")[0]
        where = f" `diagnostics.locate`: {where}." if where else ""
        parts.append(
            f"- **{r.name}** became non-finite at step "
            f"{r.first_nonfinite_step} (loss there {fmt(m0['loss'], '.4f')}, "
            f"loss of the next step {_next_loss(r)}): {counts}. {adam}{where} "
            f"The run stopped {r.config.stop_after_nonfinite} steps later: nothing "
            "more can be learned from NaN weights."
        )
    for r in runs:
        if r.config.mode != "naive" and r.first_nonfinite_step is not None:
            parts.append(
                f"- **{r.name}** became non-finite at step {r.first_nonfinite_step} "
                "despite the guards (see its report below)."
            )
    ref = {
        r.framework: r
        for r in runs
        if r.config.precision == "float32" and r.config.mode == "stable"
    }
    for r in runs:
        if r.config.mode != "stable" or r.config.precision == "float32":
            continue
        base = ref.get(r.framework)
        gap = ""
        if base is not None:
            gap = (
                f" vs {fmt(base.scores[key], '.3f')} for its float32 run "
                f"(difference {fmt(r.scores[key] - base.scores[key], '+.3f')})"
            )
        scale = (
            "dynamic loss scale"
            if r.config.precision == "float16"
            else "no loss scale (bfloat16 has float32's range)"
        )
        parts.append(
            f"- **{r.name}** (float32 params, {r.config.precision} compute, "
            f"{task.stable_loss}, {scale}, clip at {r.config.max_grad_norm}, "
            f"skip non-finite): "
            + ("finite throughout" if r.first_nonfinite_step is None else "BROKE")
            + f", {r.skipped_total} step(s) skipped, held-out {key} "
            f"{fmt(r.scores[key], '.3f')}{gap}."
        )
    if agreement is not None:
        parts.append(
            f"- float32 JAX vs torch from the same weights and batches: "
            f"max relative loss difference over the first "
            f"{min(AGREEMENT_STEPS, runs[0].config.steps)} steps = "
            + (
                f"{agreement:.2e}."
                if math.isfinite(agreement)
                else "undefined (a float32 run stopped early, or a loss there "
                "was non-finite or zero)."
            )
        )
    parts.append(
        "- Step rates are CPU numbers (`fit`'s per-step `time_s`). torch's CPU "
        "convolution in float16/bfloat16 (autocast or `.half()`) is 8x (32x32, "
        "width 8) to 80x (64x64, width 16) slower than in float32 on this CPU "
        "(examples/segmentation/TIMINGS.md): the torch low-precision rates are a "
        "CPU artefact, not a cost of the method; XLA's CPU convolution costs about "
        "the same in all three dtypes. JAX rates leave out the first step "
        "(compile). Naive runs that stopped early are timed over a few steps only."
    )
    return "\n".join(parts) + "\n"


def write_report(
    task: Task, out: str, runs: list[RunResult], summary: dict[str, Any], command: str
) -> str:
    """Writes ``report.md`` (table, plot, explanation, first bad step's report)."""
    agreement = fp32_agreement(runs)  # NaN (not null) when undefined: said so
    c = runs[0].config
    text = [
        f"# {summary['task']}: naive vs stable {summary['precision']}, JAX and PyTorch",
        "",
        f"Command: `{command}`  ",
        f"Wall time: {summary['wall_time_s']:.0f} s on this machine "
        f"({os.cpu_count()} CPU cores, shared).  ",
        f"Environment: {environment.describe(summary.get('environment'))}.  ",
        f"Setup: {task.describe(c)}; batch {c.batch_size}; {c.optimizer} lr "
        f"{c.learning_rate:g} (b1 {c.b1}, b2 {c.b2}, eps {c.eps:g}); seed {c.seed}; "
        f"held-out {', '.join(task.metrics)} on {c.eval_images} "
        f"{task.heldout_unit}. Every run "
        "starts from the same torch-initialised weights and reads the same "
        "batches; every run is a `jaxstable.train.fit` / `torchref.train.fit`.",
        "",
        _table(runs, task.metrics),
        "![curves](curves.png)",
        "",
        "## What happened",
        "",
        explain(task, runs, agreement),
    ]
    if "diagnosis" in summary:
        text.append(summary["diagnosis"]["text"])
    text += devices.devices_report(summary)
    for r in runs:
        if r.non_finite_report:
            text += [
                f"### Diagnostics of the first non-finite step: {r.name} "
                f"(step {r.first_nonfinite_step})",
                "",
                *_location_block(r),
                "```",
                _short_report(r.non_finite_report),
                "```",
                "",
            ]
        elif r.location_step is not None:  # skipped steps, the model intact
            text += [f"### Where the first skipped step went non-finite: {r.name}", ""]
            text += _location_block(r)
    extra = task.report_sections(out) if task.report_sections is not None else ""
    if extra:
        text.append(marked(task.name, extra))
    path = os.path.join(out, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(text))
    return path
