"""Why two float32 runs agree or not: JAX and torch float32 against float64.

Runs the contrastive task's stable float32 training three times from the
same weights and batches, with the same maths (symmetric InfoNCE, logit
scale clamped at 100, clip at 1.0, Adam): torch in float64 (the reference
trajectory), torch in float32 and JAX in float32 (the task's own loss and
step), and prints, per run, the largest relative loss gap to the others
and the first step where it passes 1e-5::

    python examples/contrastive/agreement_probe.py --steps 100
    python examples/contrastive/agreement_probe.py --steps 100 --eps 1e-8 --optax

If float32 itself leaves the float64 run (torch32 vs torch64), training
amplifies rounding and no framework difference is needed to explain a gap;
if only JAX leaves it, the two frameworks compute something different.
Found with it (`README.md`): ``optax.adam``'s float32 bias corrections
(``--optax``) and Adam eps 1e-8 (``--eps 1e-8``).
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from examples import harness
from examples.contrastive import parts_jax, parts_torch
from examples.contrastive.task import TASK
from examples.harness import jax_runner


def torch_losses(config, weights, batches, dtype) -> np.ndarray:
    """torch.optim.Adam run in `dtype` with info_nce's maths written out."""
    import torch
    import torch.nn.functional as F

    model = parts_torch.build_model(config, weights).to(dtype)
    opt = harness.torch_optimizer(config, model.parameters())
    out = []
    for batch in batches:
        b = parts_torch.to_torch(batch)
        opt.zero_grad()
        img, txt = model(b["image"].to(dtype), b["tokens"], safe=True)
        a, c = F.normalize(img, dim=1, eps=1e-8), F.normalize(txt, dim=1, eps=1e-8)
        t = (-model.logit_scale).exp().clamp(min=1 / 100)
        sim, y = a @ c.T / t, torch.arange(len(img))
        loss = 0.5 * (F.cross_entropy(sim, y) + F.cross_entropy(sim.T, y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        opt.step()
        out.append(loss.item())
    return np.array(out)


def jax_losses(config, weights, batches, *, use_optax: bool) -> np.ndarray:
    """The task's JAX stable step (``use_optax``: plain ``optax.adam``)."""
    parts = parts_jax.jax_parts(config, weights)
    if use_optax:
        parts = dataclasses.replace(parts, optimizer=None)
    step, state = jax_runner.stable_step(config, parts)
    out = []
    for batch in batches:
        state, metrics = step(state, batch)
        out.append(metrics["loss"])
    return np.array([float(x) for x in out])


def gaps(a: np.ndarray, b: np.ndarray, window: int) -> str:
    """Largest relative gap in the first `window` steps, overall, first > 1e-5.

    Example:
        >>> gaps(np.array([1.0, 1.1]), np.array([1.0, 1.0]), 1)
        'max[:1] 0.0e+00, max 1.0e-01, first > 1e-5 at step 1'
    """
    rel = np.abs(a - b) / np.abs(b)
    over = np.nonzero(rel > 1e-5)[0]
    first = f"step {int(over[0])}" if len(over) else "never"
    return (
        f"max[:{window}] {rel[:window].max():.1e}, max {rel.max():.1e}, "
        f"first > 1e-5 at {first}"
    )


def main(argv=None) -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eps", type=float, default=None, help="Adam eps (default: task)")
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--optax", action="store_true", help="JAX with plain optax.adam")
    args = p.parse_args(argv)
    over = {"steps": args.steps}
    if args.eps is not None:
        over["eps"] = args.eps
    if args.learning_rate is not None:
        over["learning_rate"] = args.learning_rate
    config = TASK.get_config(**over)
    weights = TASK.initial_weights(config)
    batches = TASK.train_batches(config)
    torch.set_num_threads(config.torch_threads)
    t64 = torch_losses(config, weights, batches, torch.float64)
    t32 = torch_losses(config, weights, batches, torch.float32)
    j32 = jax_losses(config, weights, batches, use_optax=args.optax)
    w = harness.AGREEMENT_STEPS
    name = "optax.adam" if args.optax else "optim_jax.adam"
    print(
        f"eps {config.eps:g}, lr {config.learning_rate:g}, {args.steps} steps, "
        f"JAX optimizer: {name}"
    )
    print("jax32 vs torch32:", gaps(j32, t32, w))
    print("torch32 vs torch64:", gaps(t32, t64, w))
    print("jax32 vs torch64:", gaps(j32, t64, w))


if __name__ == "__main__":
    main()
