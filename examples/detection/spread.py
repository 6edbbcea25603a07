"""Side experiment: how far apart are the held-out mAP@0.5 of runs that
should agree? (the numbers in examples/detection/README.md)

For each seed (initial weights and data), trains the stable float32 and
float16 runs of the detection task in one framework, each evaluated on the
same held-out set both with the raw final weights (``ema_decay=0``) and
with the weight EMA, and prints one JSON line per run::

    python -m examples.detection.spread --framework jax --seeds 0,1 \\
        --steps 400 --eval-images 1024

Each line: seed, framework, precision, ema_decay, map50, skipped steps,
seconds. The float16 - float32 difference at one seed is what the report's
"within 5 points" compares; its spread over seeds says how much of it is
noise.
"""

from __future__ import annotations

import argparse
import json
import time

from examples import harness
from examples.detection.task import TASK


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", default="jax", choices=("jax", "torch"))
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval-images", type=int, default=1024)
    args = p.parse_args(argv)
    for seed in (int(s) for s in args.seeds.split(",")):
        base = TASK.get_config(
            seed=seed, steps=args.steps, eval_images=args.eval_images
        )
        weights, batches = TASK.initial_weights(base), TASK.train_batches(base)
        heldout = TASK.heldout_set(base)
        for precision in ("float32", "float16"):
            for ema in (0.0, base.ema_decay):
                t0 = time.perf_counter()
                cfg = base.replace(precision=precision, ema_decay=ema)
                run = harness.train_and_evaluate(
                    TASK, args.framework, cfg, weights=weights, batches=batches,
                    heldout=heldout, progress=False,
                )  # fmt: skip
                s = run.summary()
                line = dict(
                    seed=seed, framework=args.framework, precision=precision,
                    ema_decay=ema, map50=s["map50"], skipped=s["skipped_total"],
                    seconds=round(time.perf_counter() - t0, 1),
                )  # fmt: skip
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
