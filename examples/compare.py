"""Naive vs stable low-precision training, JAX and PyTorch side by side.

    python examples/compare.py segmentation --precision float16 --steps 400 \
        --out runs/demo
    python examples/compare.py demo    # the same with the defaults (`make demo`)

From the same initial weights (torch's seeded init, converted to Flax NNX)
and the same batches, trains the segmentation U-Net six times: JAX naive, JAX
stable, torch naive, torch stable at ``--precision``, and a float32 run of
each framework as the reference (with ``--precision float32`` the reference
is the stable run itself: four runs). Writes into ``--out``:

* ``metrics.jsonl``: one line per run per step (framework, precision, mode,
  step, loss, grad_norm, loss_scale, finite, skipped_total; null = non-finite);
* ``summary.json``: ``{"runs": [...], "fp32_agreement": ..., ...}``;
* ``curves.png``: loss, loss scale and gradient norm per step, non-finite
  steps marked;
* ``report.md``: the table, the plot and what failed where and why, with the
  diagnostics of the first non-finite step.

Nothing is injected: a naive run fails only if its arithmetic really
overflows or underflows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

# Runnable as a script from the repository root: `python examples/compare.py`.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from examples.segmentation import config as config_lib  # noqa: E402

TASKS = ("segmentation",)
DEMO_OUT = os.path.join("runs", "demo")
# --quick: a smoke run for tests (seconds, not minutes); the naive float16
# failure happens at the first optimizer step, so it still shows.
QUICK = dict(
    image_size=16,
    batch_size=2,
    width=4,
    depth=1,
    steps=6,
    eval_images=4,
    eval_batch_size=4,
)
# The issue's bound on `fp32_agreement`. The two float32 runs start
# bit-identical (step 0 losses are equal); float32 rounding differences of the
# two convolution / batch-norm implementations (~1e-7) are then amplified by
# training, faster at a larger learning rate (measured over 50 steps at the
# defaults: 1.3e-4 at lr 1e-3, 9.1e-4 at 2e-3, 1.3e-3 at 3e-3).
FP32_AGREEMENT_LIMIT = 1e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line: ``segmentation [options]`` or ``demo [options]``.

    Example:
        >>> a = parse_args(["segmentation", "--precision", "bfloat16", "--quick"])
        >>> a.task, a.precision, a.quick, a.out
        ('segmentation', 'bfloat16', True, 'runs/segmentation')
    """
    parser = argparse.ArgumentParser(
        prog="compare.py",
        description="Naive vs stable low-precision training in JAX and PyTorch.",
    )
    sub = parser.add_subparsers(dest="task", required=True, metavar="TASK")
    helps = {
        "segmentation": "semantic segmentation (U-Net on synthetic scenes)",
        "demo": "the segmentation comparison with the defaults (`make demo`)",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text)
        defaults = config_lib.get_config()
        p.add_argument(
            "--precision",
            choices=list(config_lib.PRECISIONS),
            default="float16",
            help="low precision of the naive and stable runs (default float16)",
        )
        p.add_argument("--steps", type=int, default=defaults.steps)
        p.add_argument("--batch-size", type=int, default=defaults.batch_size)
        p.add_argument("--image-size", type=int, default=defaults.image_size)
        p.add_argument("--width", type=int, default=defaults.width)
        p.add_argument("--lr", type=float, default=defaults.learning_rate)
        p.add_argument(
            "--optimizer", choices=config_lib.OPTIMIZERS, default=defaults.optimizer
        )
        p.add_argument("--seed", type=int, default=defaults.seed)
        p.add_argument(
            "--out",
            default=DEMO_OUT if name == "demo" else os.path.join("runs", name),
            help="output folder (created)",
        )
        p.add_argument(
            "--quick",
            action="store_true",
            help="tiny smoke run: 16x16 images, batch 2, width 4, depth 1, 6 steps",
        )
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.task == "demo":
        args.task = "segmentation"
    return args


def base_config(args: argparse.Namespace) -> config_lib.Config:
    """The float32 config of the command line (``--quick`` shrinks it).

    Example:
        >>> base_config(parse_args(["demo", "--quick"])).image_size
        16
    """
    settings = dict(
        steps=args.steps,
        batch_size=args.batch_size,
        image_size=args.image_size,
        width=args.width,
        learning_rate=args.lr,
        optimizer=args.optimizer,
        seed=args.seed,
    )
    if args.quick:
        settings.update(QUICK)
    return config_lib.get_config(**settings)


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


def fp32_agreement(runs: list[config_lib.RunResult], steps: int = 50) -> float | None:
    """max |loss_jax - loss_torch| / |loss_torch| over the first `steps` float32 steps.

    Compares the two float32 stable runs (same init, batches, optimizer) over
    exactly ``min(steps, config.steps)`` steps. None when there is no such
    pair; NaN (null in JSON) when the number is undefined: a run stopped
    before those steps, or a loss there is non-finite or zero, so a diverged
    run can never pass for an agreeing one.

    Example:
        >>> cfg = config_lib.get_config()
        >>> mk = lambda fw, l: config_lib.RunResult(
        ...     fw, cfg, [{"loss": x} for x in l], None, l[-1], 0, 0.5, 1.0)
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


def metric_lines(result: config_lib.RunResult) -> list[str]:
    """The ``metrics.jsonl`` lines of one run (non-finite floats as null).

    Example:
        >>> r = config_lib.RunResult("jax", config_lib.get_config(), [dict(
        ...     step=0, loss=float("nan"), grad_norm=1.0, loss_scale=1.0,
        ...     finite=False, skipped_total=0)], 0, float("nan"), 0, 0.1, 1.0)
        >>> line = json.loads(metric_lines(r)[0])
        >>> line["framework"], line["loss"], line["finite"], len(line)
        ('jax', None, False, 9)
    """
    c = result.config
    lines = []
    for m in result.metrics:
        rec = {
            "framework": result.framework,
            "precision": c.precision,
            "mode": c.mode,
            "step": m["step"],
            "loss": config_lib.json_float(m["loss"]),
            "grad_norm": config_lib.json_float(m["grad_norm"]),
            "loss_scale": config_lib.json_float(m["loss_scale"]),
            "finite": bool(m["finite"]),
            "skipped_total": int(m["skipped_total"]),
        }
        lines.append(json.dumps(rec, allow_nan=False))
    return lines


def _name(r: config_lib.RunResult) -> str:
    return f"{r.framework} {r.config.precision} {r.config.mode}"


def plot_curves(runs: list[config_lib.RunResult], path: str) -> None:
    """Writes ``curves.png``: loss, loss scale and grad norm vs step, per run.

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
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    panels = (("loss", "loss (train batch)"), ("loss_scale", "loss scale"))
    panels += (("grad_norm", "grad norm (pre-clip)"),)
    for ax, (key, title) in zip(axes, panels, strict=True):
        edge = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
        for r in runs:
            low = "float32" if r.config.precision == "float32" else "low"
            color = colors[(r.framework, low)]
            style = "--" if r.config.mode == "naive" else "-"
            steps = [m["step"] for m in r.metrics]
            ys = [m[key] if math.isfinite(m[key]) else math.nan for m in r.metrics]
            ax.plot(steps, ys, style, color=color, lw=1.4, label=_name(r))
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
        ax.set_yscale("log")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3, which="both")
    broken = [
        f"{_name(r)}: non-finite at step {r.first_nonfinite_step}, "
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


def _fmt(x: Any, spec: str) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and not math.isfinite(x):
        return "nan"
    return format(x, spec)


def _table(runs: list[config_lib.RunResult]) -> str:
    head = (
        "| framework | precision | mode | steps | first non-finite step | "
        "final loss | skipped | held-out mIoU | steps/s |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in runs:
        s = r.summary()
        first = s["first_nonfinite_step"]
        rows.append(
            f"| {s['framework']} | {s['precision']} | {s['mode']} | {s['steps']} | "
            f"{'-' if first is None else first} | {_fmt(s['final_loss'], '.4f')} | "
            f"{s['skipped_total']} | {_fmt(s['miou'], '.3f')} | "
            f"{_fmt(s['steps_per_s'], '.1f')} |"
        )
    return head + "\n".join(rows) + "\n"


def _short_report(text: str, rows: int = 8) -> str:
    """The count lines of a diagnostics report and the first `rows` of each table."""
    out, kept = [], 0
    for line in text.splitlines():
        if "entries non-finite" in line or line.startswith(("Adam", "non-finite")):
            out.append(line)
            kept = 0
        elif kept < rows + 2:  # header lines + rows
            out.append(line)
            kept += 1
        elif kept == rows + 2:
            out.append("  ...")
            kept += 1
    return "\n".join(out)


def explain(
    runs: list[config_lib.RunResult], agreement: float | None, precision: str
) -> str:
    """The "what happened" paragraphs of ``report.md``, from the observed numbers."""
    parts = []
    broken = [r for r in runs if r.first_nonfinite_step is not None]
    naive = [r for r in runs if r.config.mode == "naive"]
    for r in naive:
        if r.first_nonfinite_step is None:
            parts.append(
                f"- **{_name(r)}** stayed finite for its {len(r.metrics)} steps "
                f"(final loss {_fmt(r.final_loss, '.4f')}, mIoU "
                f"{_fmt(r.miou, '.3f')}): no failure observed at these settings."
            )
            continue
        lines = r.non_finite_report.splitlines()
        counts = "; ".join(ln for ln in lines if "entries non-finite" in ln)
        adam = next((ln for ln in lines if ln.startswith("Adam")), "")
        m0 = r.metrics[r.first_nonfinite_step]
        parts.append(
            f"- **{_name(r)}** became non-finite at step "
            f"{r.first_nonfinite_step} (loss there {_fmt(m0['loss'], '.4f')}, "
            f"loss of the next step {_next_loss(r)}): {counts}. {adam} "
            f"The run stopped {r.config.stop_after_nonfinite} steps later: nothing "
            "more can be learned from NaN weights."
        )
    others = [r for r in broken if r.config.mode != "naive"]
    for r in others:
        parts.append(
            f"- **{_name(r)}** became non-finite at step {r.first_nonfinite_step} "
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
        gap = (
            ""
            if base is None
            else (
                f" vs {_fmt(base.miou, '.3f')} for its float32 run "
                f"(difference {_fmt(r.miou - base.miou, '+.3f')})"
            )
        )
        scale = (
            "dynamic loss scale"
            if r.config.precision == "float16"
            else "no loss scale (bfloat16 has float32's range)"
        )
        parts.append(
            f"- **{_name(r)}** (float32 params, {r.config.precision} compute, "
            f"float32 cross-entropy, {scale}, clip at {r.config.max_grad_norm}, "
            f"skip non-finite): "
            + ("finite throughout" if r.first_nonfinite_step is None else "BROKE")
            + f", {r.skipped_total} step(s) skipped, held-out mIoU "
            f"{_fmt(r.miou, '.3f')}{gap}."
        )
    if agreement is not None:
        parts.append(
            f"- float32 JAX vs torch from the same weights and batches: "
            f"max relative loss difference over the first "
            f"{min(50, runs[0].config.steps)} steps = "
            + (
                f"{agreement:.2e}."
                if math.isfinite(agreement)
                else "undefined (a float32 run stopped early, or a loss there "
                "was non-finite or zero)."
            )
        )
    parts.append(
        "- Step rates are CPU numbers. torch's CPU convolution in float16/bfloat16 "
        "(autocast or `.half()`) is 8x (32x32, width 8) to 80x (64x64, width 16) "
        "slower than in float32 on this CPU "
        "(examples/segmentation/TIMINGS.md): the torch low-precision rates are a "
        "CPU artefact, not a cost of the method; XLA's CPU convolution costs about "
        "the same in all three dtypes. JAX rates leave out the first step "
        "(compile). Naive runs that stopped early are timed over a few steps only."
    )
    return "\n".join(parts) + "\n"


def _next_loss(r: config_lib.RunResult) -> str:
    i = r.first_nonfinite_step + 1
    return _fmt(r.metrics[i]["loss"], ".4g") if i < len(r.metrics) else "n/a"


def write_report(
    out: str,
    runs: list[config_lib.RunResult],
    summary: dict[str, Any],
    command: str,
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
        f"Setup: synthetic segmentation, {c.image_size}x{c.image_size} images, "
        f"{c.num_classes} classes, label 255 on boundaries and void; U-Net width "
        f"{c.width}, depth {c.depth}; batch {c.batch_size}; {c.optimizer} lr "
        f"{c.learning_rate:g} (b1 {c.b1}, b2 {c.b2}, eps {c.eps:g}); seed {c.seed}; "
        f"held-out mIoU on {c.eval_images} images. Every run starts from the same "
        "torch-initialised weights and reads the same batches.",
        "",
        _table(runs),
        "![curves](curves.png)",
        "",
        "## What happened",
        "",
        explain(runs, agreement, summary["precision"]),
    ]
    for r in runs:
        if r.non_finite_report:
            text += [
                f"### Diagnostics of the first non-finite step: {_name(r)} "
                f"(step {r.first_nonfinite_step})",
                "",
                "```",
                _short_report(r.non_finite_report),
                "```",
                "",
            ]
    path = os.path.join(out, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(text))
    return path


def compare_segmentation(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the plan, writes the four outputs, returns the summary dict."""
    from examples.segmentation import train_jax, train_torch

    t0 = time.perf_counter()
    base = base_config(args)
    os.makedirs(args.out, exist_ok=True)
    batches = config_lib.train_batches(base)
    heldout = config_lib.heldout_set(base)
    init = train_torch.initial_state_dict(base)
    runs = []
    for fw, precision, mode in run_plan(args.precision):
        cfg = config_lib.get_config(
            **{
                **{f: getattr(base, f) for f in base.__dataclass_fields__},
                "precision": precision,
                "mode": mode,
            }
        )
        module = train_jax if fw == "jax" else train_torch
        runs.append(
            module.train_and_evaluate(
                cfg,
                init_state_dict=init,
                batches=batches,
                heldout=heldout,
                progress=not args.no_progress,
            )
        )
    with open(os.path.join(args.out, "metrics.jsonl"), "w", encoding="utf-8") as f:
        for r in runs:
            f.writelines(line + "\n" for line in metric_lines(r))
    agreement = fp32_agreement(runs)
    summary = {
        "task": "segmentation",
        "precision": args.precision,
        "runs": [r.summary() for r in runs],
        "fp32_agreement": None
        if agreement is None
        else config_lib.json_float(agreement),
        "config": {f: getattr(base, f) for f in base.__dataclass_fields__},
    }
    plot_curves(runs, os.path.join(args.out, "curves.png"))
    summary["wall_time_s"] = time.perf_counter() - t0
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, allow_nan=False)
        f.write("\n")
    summary["report"] = write_report(args.out, runs, summary, args.command)
    return summary


def main(argv: list[str] | None = None) -> int:
    """Entry point; prints the table and where the report is."""
    args = parse_args(argv)
    args.command = "python examples/compare.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    summary = compare_segmentation(args)
    print(f"\nwall time {summary['wall_time_s']:.0f} s")
    for r in summary["runs"]:
        print(
            f"  {r['framework']:<5} {r['precision']:<8} {r['mode']:<6} "
            f"steps {r['steps']:>4}  first non-finite {r['first_nonfinite_step']}  "
            f"final loss {_fmt(r['final_loss'], '.4f')}  mIoU {_fmt(r['miou'], '.3f')}"
        )
    print(f"fp32_agreement {summary['fp32_agreement']}")
    print(f"report: {summary['report']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
