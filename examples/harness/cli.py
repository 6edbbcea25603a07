"""``compare.py``'s command line: ``TASK [options]``, and what it prints.

`examples/compare.py` lists the tasks and calls :func:`main`; the options
every task has map to `BaseConfig` fields (:data:`_OPTIONS`), ``--quick``
applies the task's ``quick`` overrides, ``--gradient-agreement`` runs
`gradient_agreement` instead of the comparison and ``--devices N`` makes
every run data parallel (`examples.harness.devices`, `examples.harness.ddp`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping

from examples.harness import devices, environment
from examples.harness.agreement import (
    AGREEMENT_STEPS,
    GRADIENT_THRESHOLD,
    gradient_agreement,
)
from examples.harness.config import OPTIMIZERS, PRECISIONS, BaseConfig
from examples.harness.parts import Task
from examples.harness.results import fmt
from examples.harness.run import compare

# The options every task has: (flag, config field, type).
_OPTIONS = (
    ("--steps", "steps", int),
    ("--batch-size", "batch_size", int),
    ("--image-size", "image_size", int),
    ("--width", "width", int),
    ("--lr", "learning_rate", float),
    ("--seed", "seed", int),
)


def parse_args(
    tasks: Mapping[str, Task], argv: list[str] | None = None, demo: str | None = None
) -> argparse.Namespace:
    """``TASK [options]``; ``demo`` (if given) is that task with its defaults.

    Returns the namespace with ``task`` (the TASK object), ``name``,
    ``precision``, ``out``, ``quick``, ``no_progress``, ``devices``,
    ``one_device_reference``, ``gradient_agreement`` and the config fields
    of :data:`_OPTIONS` and ``optimizer``. ``--devices`` > 1 is refused
    (exit 2, naming the tasks that have it) for a task without
    ``multi_device=True``, and with ``--gradient-agreement``.
    """
    parser = argparse.ArgumentParser(
        prog="compare.py",
        description="Naive vs stable low-precision training in JAX and PyTorch, "
        "one task at a time (outputs: metrics.jsonl, summary.json, curves.png, "
        "report.md).",
    )
    sub = parser.add_subparsers(dest="name", required=True, metavar="TASK")
    entries = [(name, task, task.help) for name, task in tasks.items()]
    if demo is not None:
        entries.append(
            (
                "demo",
                tasks[demo],
                f"the {demo} comparison with the defaults (make demo)",
            )
        )
    for name, task, text in entries:
        p = sub.add_parser(name, help=text, description=text)
        defaults = task.get_config()
        p.add_argument(
            "--precision",
            choices=list(PRECISIONS),
            default=task.precision,
            help=f"low precision of the naive and stable runs (default "
            f"{task.precision})",
        )
        for flag, field, kind in _OPTIONS:
            p.add_argument(
                flag, dest=field, type=kind, default=getattr(defaults, field)
            )
        p.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer)
        p.add_argument(
            "--out",
            default=os.path.join("runs", name),
            help="output folder (created)",
        )
        quick = ", ".join(f"{k}={v}" for k, v in task.quick.items())
        p.add_argument("--quick", action="store_true", help=f"tiny smoke run: {quick}")
        p.add_argument(
            "--eval-every",
            type=int,
            default=None,
            metavar="K",
            help="also evaluate on the held-out set every K steps (metrics.jsonl)",
        )
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
        p.add_argument(
            "--gradient-agreement",
            action="store_true",
            help="instead of the comparison: JAX's and torch's gradients at the "
            f"same weights over the first {AGREEMENT_STEPS} steps of the float32 "
            "stable run, printed as JSON (gradient_agreement)",
        )
        _add_device_options(p)
        p.set_defaults(task=task)
    args = parser.parse_args(argv)
    if args.gradient_agreement and args.devices > 1:
        parser.error("--gradient-agreement runs on one device; drop --devices")
    if args.devices > 1 and not args.task.multi_device:
        supported = [n for n, t in tasks.items() if t.multi_device]
        parser.error(
            f"--devices {args.devices}: task {args.name!r} runs on one device "
            f"only; --devices > 1 is supported for {supported}"
        )
    return args


def _add_device_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        metavar="N",
        help="data parallel over N devices: JAX on N devices (N forced host "
        "CPU devices on a CPU machine, the first N accelerators otherwise), "
        "torch in N DDP processes (gloo); the batch size must be a multiple "
        "of N",
    )
    p.add_argument(
        "--one-device-reference",
        action="store_true",
        help="with --devices N: run the plan on one device too and report "
        "the agreement of every run with it",
    )


def user_command(argv: list[str]) -> str:
    """The command a user types to get the same results: `argv` without the
    flags that change where and how the outputs are shown, not what they are
    (``--out PATH``, ``--no-progress``); ``report.md`` names it.

    Example:
        >>> user_command(["ocr", "--precision", "float16", "--no-progress",
        ...               "--out", "/tmp/scratch"])
        'python examples/compare.py ocr --precision float16'
        >>> user_command(["demo", "--out=/tmp/x"])
        'python examples/compare.py demo'
    """
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True  # and its value
        elif not (arg.startswith("--out=") or arg == "--no-progress"):
            kept.append(arg)
    return " ".join(["python examples/compare.py", *kept])


def base_config(args: argparse.Namespace) -> BaseConfig:
    """The float32 stable config of the command line (``--quick`` shrinks it)."""
    settings = {field: getattr(args, field) for _, field, _ in _OPTIONS}
    settings["optimizer"] = args.optimizer
    settings["eval_every"] = args.eval_every
    settings["devices"] = args.devices
    if args.quick:
        settings.update(args.task.quick)
    return args.task.get_config(**settings)


def main(
    tasks: Mapping[str, Task], argv: list[str] | None = None, demo: str | None = None
) -> int:
    """Entry point of ``compare.py``; prints the table and where the report is."""
    import sys

    args = parse_args(tasks, argv, demo)
    command = user_command(sys.argv[1:] if argv is None else argv)
    task = args.task
    base = base_config(args)  # validated before JAX starts
    if args.gradient_agreement:
        steps = min(AGREEMENT_STEPS, base.steps)
        threshold = task.gradient_threshold or GRADIENT_THRESHOLD
        out = gradient_agreement(task, base, steps, threshold=threshold)
        env = environment.record()
        print(
            json.dumps(
                {"task": args.name, "threshold": threshold, **out, "environment": env}
            )
        )
        return 0
    devices.force_host_devices(base.devices)
    summary = compare(
        task,
        base,
        args.precision,
        args.out,
        command=command,
        progress=not args.no_progress,
        one_device_reference=args.one_device_reference,
    )
    print(f"\nwall time {summary['wall_time_s']:.0f} s")
    print(f"environment: {environment.describe(summary.get('environment'))}")
    for r in summary["runs"]:
        scores = "  ".join(f"{m} {fmt(r[m], '.3f')}" for m in task.metrics)
        print(
            f"  {r['framework']:<5} {r['precision']:<8} {r['mode']:<6} "
            f"steps {r['steps']:>4}  first non-finite {r['first_nonfinite_step']}  "
            f"final loss {fmt(r['final_loss'], '.4f')}  {scores}"
        )
    print(f"fp32_agreement {summary['fp32_agreement']}")
    for a in summary.get("one_device", []):
        print(
            f"  vs 1 device: {a['run']:<22} max rel loss diff "
            f"{fmt(a['max_rel_loss_diff'], '.2e')}  same skips {a['same_decisions']}"
        )
    print(f"report: {summary['report']}")
    return 0
