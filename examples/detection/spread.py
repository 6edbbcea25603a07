"""Side experiment: how far apart are the held-out mAP@0.5 of runs that
should agree? (the numbers in examples/detection/README.md)

For each seed (initial weights and data), trains the stable float32 and
float16 runs of the detection task in one framework, scores each on the
same held-out set, and prints one JSON line per run and one per seed::

    python -m examples.detection.spread --framework jax --seeds 0,1,2,3

A run's line: seed, framework, precision, ema_decay, the held-out scores
(``map50``, each class's ``ap50_<class>``, ``ap50_any_class``), skipped
steps, seconds. A seed's line: the float16 - float32 difference of
``map50`` and of ``ap50_any_class`` in points. The difference at one seed
is what the comparison's "within 5 points" checks; its spread over seeds
says how much of it is noise. ``--raw`` also scores every run with its raw
final weights (``ema_decay=0``: a second training run each).

Example:
    >>> args = parse_args(["--seeds", "0,3", "--steps", "20"])
    >>> args.seeds, args.steps, args.raw
    ([0, 3], 20, False)
"""

from __future__ import annotations

import argparse
import json
import time

from examples import harness
from examples.detection.task import TASK


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of :func:`main` (``--steps`` defaults to the task's).

    Example:
        >>> parse_args([]).framework
        'jax'
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", default="jax", choices=("jax", "torch"))
    p.add_argument(
        "--seeds", default="0,1", type=lambda s: [int(x) for x in s.split(",")]
    )
    p.add_argument("--steps", type=int, default=TASK.get_config().steps)
    p.add_argument("--eval-images", type=int, default=TASK.get_config().eval_images)
    p.add_argument("--raw", action="store_true", help="also score raw weights")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for seed in args.seeds:
        base = TASK.get_config(
            seed=seed, steps=args.steps, eval_images=args.eval_images
        )
        weights, batches = TASK.initial_weights(base), TASK.train_batches(base)
        heldout = TASK.heldout_set(base)
        scores = {}
        for ema in (base.ema_decay, 0.0) if args.raw else (base.ema_decay,):
            for precision in ("float32", "float16"):
                t0 = time.perf_counter()
                cfg = base.replace(precision=precision, ema_decay=ema)
                run = harness.train_and_evaluate(
                    TASK, args.framework, cfg, weights=weights, batches=batches,
                    heldout=heldout, progress=False,
                )  # fmt: skip
                s = run.summary()
                scores[precision, ema] = s
                line = dict(
                    seed=seed, framework=args.framework, precision=precision,
                    ema_decay=ema, **{k: s[k] for k in run.scores},
                    skipped=s["skipped_total"],
                    seconds=round(time.perf_counter() - t0, 1),
                )  # fmt: skip
                print(json.dumps(line), flush=True)
            f32, f16 = scores["float32", ema], scores["float16", ema]
            gap = {  # None where a run's score is non-finite
                key: None
                if f32[key] is None or f16[key] is None
                else round(100 * (f16[key] - f32[key]), 1)
                for key in ("map50", "ap50_any_class")
            }
            print(json.dumps(dict(seed=seed, ema_decay=ema, float16_minus_float32=gap)))


if __name__ == "__main__":
    main()
