"""Side experiment: how fast do two float32 detection runs that start 1e-7
apart drift apart? (the numbers behind the detection `fp32_agreement` in
examples/detection/README.md)

Trains the stable float32 run of the detection task three times on the same
batches: JAX from the shared initial weights, JAX from those weights times
``1 + rel * N(0, 1)`` (``--rel``, 1e-7 by default: float32 rounding), and
torch from the shared weights; prints, every few steps, the relative loss
difference of JAX vs perturbed JAX (the dynamics' own amplification of a
rounding-sized change) and of JAX vs torch (what ``fp32_agreement`` reports,
its max over the first 50 steps)::

    python -m examples.detection.divergence --steps 60
    python -m examples.detection.divergence --steps 60 --box-weight 0

``--box-weight`` replaces the CIoU term's weight (`loss_jax.BOX_WEIGHT`, 2)
in both frameworks, e.g. 0 to train on the focal loss alone.

Example:
    >>> args = parse_args(["--steps", "8", "--box-weight", "0"])
    >>> args.steps, args.box_weight, args.rel
    (8, 0.0, 1e-07)
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from examples import harness
from examples.detection import config as config_lib
from examples.detection import data, loss_jax, loss_torch
from examples.detection.task import TASK


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of :func:`main`.

    Example:
        >>> parse_args([]).steps
        60
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rel", type=float, default=1e-7)
    p.add_argument("--box-weight", type=float, default=loss_jax.BOX_WEIGHT)
    p.add_argument("--every", type=int, default=3)
    return p.parse_args(argv)


def relative_differences(a: list[float], b: list[float]) -> np.ndarray:
    """``|a - b| / |b|`` step by step.

    Example:
        >>> relative_differences([1.0, 2.2], [1.0, 2.0]).round(3).tolist()
        [0.0, 0.1]
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b) / np.abs(b)


def float32_losses(
    steps: int,
    *,
    runs: tuple[str, ...] = ("jax", "jax_nudged", "torch"),
    box_weight: float = loss_jax.BOX_WEIGHT,
    rel: float = 1e-7,
    seed: int = 0,
    eval_images: int = 4,
) -> dict[str, list[float]]:
    """Per-step losses of stable float32 detection runs on the same batches.

    Each run trains the default config's schedule on its first `steps`
    batches: ``"jax"`` and ``"torch"`` from the shared initial weights,
    ``"jax_nudged"`` from those weights times ``1 + rel * N(0, 1)``. The
    box term's weight is `box_weight` in both frameworks for these runs
    (restored after).

    Example:
        >>> out = float32_losses(2, runs=("jax", "torch"), eval_images=1)
        >>> sorted(out), len(out["jax"])
        (['jax', 'torch'], 2)
    """
    import torch

    unknown = set(runs) - {"jax", "jax_nudged", "torch"}
    if unknown:
        raise ValueError(
            f"unknown runs {sorted(unknown)}; allowed: jax, jax_nudged, torch"
        )
    cfg = TASK.get_config(seed=seed, eval_images=eval_images)
    weights = TASK.initial_weights(cfg)
    rng = np.random.default_rng(seed + 1)
    nudged = {
        k: v
        * torch.from_numpy(1 + rel * rng.standard_normal(tuple(v.shape))).to(v.dtype)
        if v.is_floating_point()
        else v
        for k, v in weights.items()
    }
    d = config_lib.data_config(cfg)
    batches = list(data.batches(d, "train", cfg.batch_size, cfg.seed, steps))
    heldout = TASK.heldout_set(cfg)
    saved = loss_jax.BOX_WEIGHT, loss_torch.BOX_WEIGHT
    loss_jax.BOX_WEIGHT = loss_torch.BOX_WEIGHT = box_weight
    try:
        losses = {}
        for name in runs:
            fw = "torch" if name == "torch" else "jax"
            w = nudged if name == "jax_nudged" else weights
            run = harness.train_and_evaluate(
                TASK, fw, cfg, weights=w, batches=batches, heldout=heldout,
                progress=False,
            )  # fmt: skip
            losses[name] = [m["loss"] for m in run.metrics]
    finally:
        loss_jax.BOX_WEIGHT, loss_torch.BOX_WEIGHT = saved
    return losses


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    losses = float32_losses(
        args.steps, box_weight=args.box_weight, rel=args.rel, seed=args.seed
    )
    self_gap = relative_differences(losses["jax"], losses["jax_nudged"])
    cross_gap = relative_differences(losses["jax"], losses["torch"])
    for step in range(0, args.steps, args.every):
        print(f"step {step:4d}  jax vs nudged jax {self_gap[step]:.1e}  "
              f"jax vs torch {cross_gap[step]:.1e}")  # fmt: skip

    def first(gap: np.ndarray) -> int | None:
        above = np.nonzero(gap > 1e-5)[0]
        return int(above[0]) if above.size else None

    n = min(args.steps, harness.AGREEMENT_STEPS)
    print(json.dumps(dict(
        box_weight=args.box_weight, rel=args.rel, seed=args.seed,
        max_first_50={"jax_vs_nudged_jax": float(self_gap[:n].max()),
                      "jax_vs_torch": float(cross_gap[:n].max())},
        first_step_above_1e5={"jax_vs_nudged_jax": first(self_gap),
                              "jax_vs_torch": first(cross_gap)},
    )))  # fmt: skip


if __name__ == "__main__":
    main()
