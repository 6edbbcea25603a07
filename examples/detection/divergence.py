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
    python -m examples.detection.divergence --steps 60 --box-kind smooth_l1
    python -m examples.detection.divergence --steps 50 --gradients

``--box-weight`` replaces the box term's weight (`loss_jax.BOX_WEIGHT`, 2)
in both frameworks, e.g. 0 to train on the focal loss alone; ``--box-kind``
its loss (`loss_jax.BOX_KIND`: ``ciou``, the task's, or ``iou``, ``giou``,
``diou``, ``smooth_l1``).

``--gradients`` asks a different question (:func:`gradient_split`): at the
same weights, on the same batch, do JAX and torch compute the same
gradient? It walks the torch run and reports the largest difference, and
the first step where they differ by more than 1e-5 with the ReLU inputs
whose signs differ there.

Example:
    >>> args = parse_args(["--steps", "8", "--box-weight", "0"])
    >>> args.steps, args.box_weight, args.rel
    (8, 0.0, 1e-07)
"""

from __future__ import annotations

import argparse
import contextlib
import json

import numpy as np

from examples import harness
from examples.detection import data, loss_jax, loss_torch
from examples.detection.config import Config
from examples.detection.task import TASK, data_config


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
    p.add_argument("--box-kind", choices=loss_jax.BOX_KINDS, default=loss_jax.BOX_KIND)
    p.add_argument("--every", type=int, default=3)
    p.add_argument(
        "--gradients",
        action="store_true",
        help="instead: the first step where JAX's and torch's gradients at "
        "the same weights differ by more than 1e-5 (gradient_split)",
    )
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
    box_kind: str = loss_jax.BOX_KIND,
    rel: float = 1e-7,
    seed: int = 0,
    eval_images: int = 4,
) -> dict[str, list[float]]:
    """Per-step losses of stable float32 detection runs on the same batches.

    Each run trains the default config's schedule on its first `steps`
    batches: ``"jax"`` and ``"torch"`` from the shared initial weights,
    ``"jax_nudged"`` and ``"torch_nudged"`` from those weights times
    ``1 + rel * N(0, 1)`` (the same nudge). The
    box term's weight and loss are `box_weight` and `box_kind` in both
    frameworks for these runs (restored after).

    Example (a run takes seconds; `tests/test_detection_agreement.py` runs
    them):
        >>> float32_losses(2, runs=("jax", "tf"))
        Traceback (most recent call last):
        ...
        ValueError: unknown runs ['tf']; allowed: ('jax', 'jax_nudged', ...)
    """
    import torch

    allowed = ("jax", "jax_nudged", "torch", "torch_nudged")
    unknown = set(runs) - set(allowed)
    if unknown:
        raise ValueError(f"unknown runs {sorted(unknown)}; allowed: {allowed}")
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
    batches = _first_batches(cfg, steps)
    heldout = TASK.heldout_set(cfg)
    with _box_term(box_weight, box_kind):
        losses = {}
        for name in runs:
            fw = name.split("_")[0]
            w = nudged if name.endswith("_nudged") else weights
            run = harness.train_and_evaluate(
                TASK, fw, cfg, weights=w, batches=batches, heldout=heldout,
                progress=False,
            )  # fmt: skip
            losses[name] = [m["loss"] for m in run.metrics]
    return losses


def _first_batches(cfg: Config, steps: int) -> list[dict]:
    """The run's first `steps` train batches (not all ``cfg.steps`` of them)."""
    d = data_config(cfg)
    return list(data.batches(d, "train", cfg.batch_size, cfg.seed, steps))


@contextlib.contextmanager
def _box_term(box_weight: float, box_kind: str):
    """Sets the box term's weight and loss in both frameworks, restores after."""
    if box_kind not in loss_jax.BOX_KINDS:
        raise ValueError(f"box_kind={box_kind!r}; allowed: {loss_jax.BOX_KINDS}")
    saved = [(m, m.BOX_WEIGHT, m.BOX_KIND) for m in (loss_jax, loss_torch)]
    for m, _, _ in saved:
        m.BOX_WEIGHT, m.BOX_KIND = box_weight, box_kind
    try:
        yield
    finally:
        for m, weight, kind in saved:
            m.BOX_WEIGHT, m.BOX_KIND = weight, kind


def gradient_split(
    steps: int,
    *,
    box_weight: float = loss_jax.BOX_WEIGHT,
    box_kind: str = loss_jax.BOX_KIND,
    seed: int = 0,
    threshold: float = 1e-4,
) -> dict:
    """Where JAX's and torch's gradients at the same weights first differ.

    `harness.gradient_agreement` on the default detection config (seed
    `seed`, the box term set as in :func:`float32_losses`), its split
    extended with ``relu_flips``: each ConvBN whose ReLU inputs have
    opposite signs in the two frameworks in that step's forward,
    ``{"layer", "count", "max_abs_input"}`` (the largest ``|input|`` among
    them).

    Example (a run: `tests/test_detection_agreement.py`; the harness's
    example runs two steps):
        >>> gradient_split(2, box_kind="huber")
        Traceback (most recent call last):
        ...
        ValueError: box_kind='huber'; allowed: ('iou', 'giou', 'diou', 'ciou', ...)
    """
    import torch

    def flips(model, batch):
        images = torch.from_numpy(data.to_nchw(batch["image"]))
        return {"relu_flips": _relu_flips(model, images, batch["image"])}

    cfg = TASK.get_config(seed=seed, eval_images=4)
    batches = _first_batches(cfg, steps)
    with _box_term(box_weight, box_kind):
        return harness.gradient_agreement(
            TASK, cfg, steps, threshold=threshold, on_split=flips, batches=batches
        )


def _relu_flips(model, torch_images, images) -> list[dict]:
    """ConvBN layers whose ReLU inputs differ in sign between torch and JAX."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from examples.common.layers_jax import ConvBN
    from examples.detection import convert

    torch_inputs, hooks = {}, []
    for name, module in model.named_modules():
        if type(module).__name__ == "ConvBN":
            hooks.append(module.bn.register_forward_hook(
                lambda _m, _i, out, name=name: torch_inputs.__setitem__(
                    name, out.detach().permute(0, 2, 3, 1).numpy())
            ))  # fmt: skip
    with torch.no_grad():
        model(torch_images)
    for hook in hooks:
        hook.remove()
    jax_model = convert.nnx_from_torch(model)
    names = {
        id(m): ".".join(map(str, path))
        for path, m in nnx.iter_modules(jax_model)
        if isinstance(m, ConvBN)
    }
    jax_inputs, call = {}, ConvBN.__call__

    def recording_call(self, x, *, train):
        pre = self.bn(self.conv(x), train=train)
        jax_inputs[names[id(self)]] = np.asarray(pre)
        return call(self, x, train=train)

    ConvBN.__call__ = recording_call
    try:
        jax_model(jnp.asarray(images), train=True)
    finally:
        ConvBN.__call__ = call
    flips = []
    for name, theirs in torch_inputs.items():
        ours = jax_inputs[name]
        differ = (ours > 0) != (theirs > 0)
        if differ.any():
            flips.append(dict(
                layer=name, count=int(differ.sum()),
                max_abs_input=float(np.abs(theirs[differ]).max()),
            ))  # fmt: skip
    return flips


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.gradients:
        out = gradient_split(
            args.steps,
            box_weight=args.box_weight,
            box_kind=args.box_kind,
            seed=args.seed,
            threshold=1e-5,
        )
        print(json.dumps(dict(
            box_weight=args.box_weight, box_kind=args.box_kind, seed=args.seed,
            threshold=1e-5, **out,
        )))  # fmt: skip
        return
    losses = float32_losses(
        args.steps,
        box_weight=args.box_weight,
        box_kind=args.box_kind,
        rel=args.rel,
        seed=args.seed,
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
        box_weight=args.box_weight, box_kind=args.box_kind, rel=args.rel,
        seed=args.seed,
        max_first_50={"jax_vs_nudged_jax": float(self_gap[:n].max()),
                      "jax_vs_torch": float(cross_gap[:n].max())},
        first_step_above_1e5={"jax_vs_nudged_jax": first(self_gap),
                              "jax_vs_torch": first(cross_gap)},
    )))  # fmt: skip


if __name__ == "__main__":
    main()
