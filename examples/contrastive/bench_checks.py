"""What the check points cost: the JAX stable step with and without them.

    python examples/contrastive/bench_checks.py [--steps 200]

Times the jitted `jaxstable.train.make_train_step` of the contrastive task
(default sizes, bfloat16 compute) over the same batches twice: with the
loss's ``aux`` (five check points: a finite flag and a max |x| each, and
the logit scale) and without it (the same loss, ``aux`` dropped, so XLA
removes the reductions). Prints the median step time of each (the two
steps interleaved batch by batch) and the difference. Unused, the check
points cost nothing: they are values of the loss function's ``aux``, not a
hook of the library.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def _median_steps(steps: dict, states: dict, batches) -> dict[str, float]:
    """Median step time of each step, the steps interleaved batch by batch
    (on a shared machine, load changes hit both alike)."""
    import jax

    times = {name: [] for name in steps}
    for i, b in enumerate(batches):
        for name, step in steps.items():
            t = time.perf_counter()
            states[name], m = step(states[name], b)
            jax.block_until_ready((states[name], m))
            if i:  # step 0 compiles
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    """Runs the comparison and prints it."""
    import jax

    from examples import harness
    from examples.contrastive.task import TASK
    from jaxstable import train, transforms

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    cfg = TASK.get_config(steps=args.steps, train_pairs=32 * args.steps)
    cfg = cfg.replace(precision="bfloat16")  # whole batches only: one compile
    parts = TASK.jax_parts(cfg, TASK.initial_weights(cfg))
    batches = [jax.tree.map(jax.numpy.asarray, b) for b in TASK.train_batches(cfg)]

    def without(p, s, batch):
        (loss, _), s = parts.loss_fn(p, s, batch)
        return loss, s

    steps, states = {}, {}
    for name, fn, aux in (("with", parts.loss_fn, True), ("without", without, False)):
        tx = transforms.stable_optimizer(harness.jax_optimizer(cfg), max_grad_norm=1.0)
        states[name] = train.TrainState.create(params=parts.params, optimizer=tx)
        steps[name] = train.make_train_step(
            fn, has_state=True, has_aux=aux, policy=cfg.policy
        )
    results = _median_steps(steps, states, batches)
    w, wo = results["with"], results["without"]
    print(
        f"median step over {args.steps - 1} steps (batch {cfg.batch_size}, "
        f"{cfg.image_size}x{cfg.image_size}, bfloat16 compute, "
        f"{os.cpu_count()} CPU cores): with check points {w * 1e3:.2f} ms, "
        f"without {wo * 1e3:.2f} ms, difference {(w - wo) * 1e3:+.2f} ms "
        f"({(w / wo - 1) * 100:+.1f}%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
