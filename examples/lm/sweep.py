"""The README's learning-rate sweep: naive vs stable bfloat16 at a few peak rates.

For each peak learning rate, trains the task's naive bfloat16 run (no
QK-norm, no guard) and its stable bfloat16 run (QK-norm, clip, skip) from
the same weights and batches (the harness's `train_and_evaluate`, one
framework) and prints a markdown table: held-out bits per byte, the peak
max attention logit, the step it passed the limit and the diagnosis of
`probe.mechanism`. Writes the rows as JSON to ``--out``, with the versions
and the machine of the sweep (``environment``,
`examples.harness.environment.record`)::

    python -m examples.lm.sweep --out examples/lm/results/sweep.json

Example:
    >>> a = parse_args(["--lrs", "0.01", "0.1", "--framework", "torch"])
    >>> a.lrs, a.framework, a.steps
    ([0.01, 0.1], 'torch', 300)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Runnable as a script from the repository root too.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from examples import harness  # noqa: E402
from examples.harness import environment  # noqa: E402
from examples.lm import probe  # noqa: E402
from examples.lm.task import TASK  # noqa: E402

LRS = (3e-3, 1e-2, 3e-2, 1e-1, 3e-1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of :func:`main`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    p.add_argument("--framework", choices=("jax", "torch"), default="jax")
    p.add_argument("--precision", default="bfloat16")
    p.add_argument("--steps", type=int, default=TASK.get_config().steps)
    p.add_argument("--out", default=None, help="JSON file of the rows")
    return p.parse_args(argv)


def row(result) -> dict:
    """One run's line of the sweep (from its records and scores)."""
    checks = probe.run_checks(result.metrics, result.config)
    return {
        "lr": result.config.learning_rate,
        "mode": result.config.mode,
        "bits_per_byte": result.scores["bits_per_byte"],
        "attn_logit_peak": checks["attn_logit_peak"],
        "attn_logit_over_limit_step": checks["attn_logit_over_limit_step"],
        "failure": probe.mechanism(checks, result.config, result.first_nonfinite_step),
    }


def table(rows: list[dict]) -> str:
    """The markdown table of the rows: one line per learning rate.

    Example:
        >>> r = [dict(lr=0.1, mode=m, bits_per_byte=b, attn_logit_peak=a,
        ...           attn_logit_over_limit_step=s, failure=f)
        ...      for m, b, a, s, f in (("naive", 4.2, 5e5, 9, "attention-logit growth"),
        ...                            ("stable", 3.5, 17.0, None, None))]
        >>> print(table(r).splitlines()[2])
        | 0.1 | 4.200 | 5e+05 (> limit @ 9) | attention-logit growth | 3.500 | 17 | - |
    """
    out = [
        "| peak lr | naive bpb | naive max attention logit | naive diagnosis | "
        "stable bpb | stable max attention logit | stable diagnosis |",
        "|---" * 7 + "|",
    ]
    for lr in sorted({r["lr"] for r in rows}):
        cells = [f"{lr:g}"]
        for mode in ("naive", "stable"):
            r = next(x for x in rows if x["lr"] == lr and x["mode"] == mode)
            peak = f"{r['attn_logit_peak']:.3g}"
            if r["attn_logit_over_limit_step"] is not None:
                peak += f" (> limit @ {r['attn_logit_over_limit_step']})"
            cells += [f"{r['bits_per_byte']:.3f}", peak, r["failure"] or "-"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Runs the sweep, prints the table, writes ``--out``."""
    args = parse_args(argv)
    base = TASK.get_config(steps=args.steps)
    weights = TASK.initial_weights(base)
    batches = TASK.train_batches(base)
    heldout = TASK.heldout_set(base)
    rows, t0 = [], time.perf_counter()
    for lr in args.lrs:
        for mode in ("naive", "stable"):
            cfg = base.replace(learning_rate=lr, precision=args.precision, mode=mode)
            result = harness.train_and_evaluate(
                TASK, args.framework, cfg, weights=weights, batches=batches,
                heldout=heldout, progress=False,
            )  # fmt: skip
            rows.append(row(result))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    print(f"{args.framework} {args.precision}, {args.steps} steps, "
          f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"framework": args.framework, "precision": args.precision,
                       "steps": args.steps, "rows": rows,
                       "environment": environment.record()}, f, indent=2)  # fmt: skip
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
