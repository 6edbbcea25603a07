"""Pure bfloat16 parameters and Adam states on the lm task: the stall and its cures.

Four runs of the task's stable model (QK-norm, float32 cross-entropy,
bfloat16 compute, clip at 1.0) from the same weights and batches, with
`transforms.low_precision_adamw` in each framework:

* ``float32``: float32 parameters and moments (the float32-master reference);
* ``nearest``: bfloat16 parameters and moments, round-to-nearest (the stall);
* ``stochastic``: the same, stochastic rounding of the parameters;
* ``kahan``: the same, Kahan-compensated parameters (a bfloat16 buffer).

Per run: held-out bits per byte, the mean fraction of the update lost to
rounding (``lost_update``, over the run and over its last quarter), the
bytes of parameters and optimizer state (summed over the arrays the run
holds at its end: counted, not computed from dtypes) and the seconds per
step (this machine, this run: compare within one table only)::

    # the README's table, examples/lm/results/low_precision.json:
    python -m examples.lm.low_precision --steps 300 --width 64 --out FILE
    python -m examples.lm.low_precision --quick        # 60 steps at width 64

The learning rate is the sweep's lowest peak (3e-3, README.md), where the
stable bfloat16 recipe trains: the stall is a small-update problem, and
the cosine's tail (3e-4) makes it worse.

Example:
    >>> a = parse_args(["--quick", "--framework", "torch"])
    >>> a.framework, a.steps, a.width
    ('torch', 60, 64)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402

from examples.lm.task import TASK  # noqa: E402

# (name, parameter and moment dtype, param_update)
RUNS = (
    ("float32", "float32", "nearest"),
    ("nearest", "bfloat16", "nearest"),
    ("stochastic", "bfloat16", "stochastic"),
    ("kahan", "bfloat16", "kahan"),
)
LEARNING_RATE = 3e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of :func:`main`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("jax", "torch", "both"), default="both")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--lr", type=float, default=LEARNING_RATE)
    p.add_argument("--quick", action="store_true", help="60 steps at width 64")
    p.add_argument("--out", default=None, help="JSON file of the rows")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.width = 60, 64
    return args


def _config(args):
    return TASK.get_config(
        precision="bfloat16",
        learning_rate=args.lr,
        steps=args.steps,
        width=args.width,
        warmup_steps=max(1, args.steps // 10),
    )


def run_jax(config, weights, batches, heldout, dtype, param_update) -> dict:
    """One JAX run: `make_train_step` over `stable_optimizer(low_precision_adamw)`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from examples.lm import convert, loss_jax, metric, model_jax
    from examples.lm.parts_jax import jax_schedule
    from examples.lm.parts_torch import build_model
    from jaxstable import loss_scale, train, transforms

    tm = build_model(config, weights)
    model = convert.nnx_from_torch(tm, dtype=jnp.bfloat16)
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(lambda x: x.astype(dtype), params)

    def loss_fn(p, batch):
        p = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
        logits, stats = model_jax.apply(graphdef, p, batch["inputs"])
        return loss_jax.stable_loss(logits, batch["targets"], stats)

    tx = transforms.stable_optimizer(
        transforms.low_precision_adamw(
            jax_schedule(config),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mu_dtype=dtype,
            nu_dtype=dtype,
            param_update=param_update,
        ),
        max_grad_norm=config.max_grad_norm,
    )
    state = train.TrainState.create(
        params=params, optimizer=tx, loss_scale=loss_scale.NoOpLossScale()
    )
    step = train.make_train_step(loss_fn, has_aux=True)
    lost, t0 = [], time.perf_counter()
    for batch in batches:
        state, metrics = step(state, batch)
        lost.append(metrics["lost_update"])
    lost = [float(x) for x in jax.device_get(lost)]
    seconds = time.perf_counter() - t0

    @jax.jit
    def nll(p, inputs, targets):
        p = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
        return loss_jax.nll_sum(model_jax.apply(graphdef, p, inputs)[0], targets)

    total = sum(
        float(
            nll(
                state.params,
                heldout["inputs"][i : i + 16],
                heldout["targets"][i : i + 16],
            )
        )
        for i in range(0, len(heldout["inputs"]), 16)
    )
    held = jax.tree.leaves((state.params, state.opt_state))
    return _row(metric.scores(total, heldout["targets"].size), lost, seconds,
                sum(x.nbytes for x in held), len(batches))  # fmt: skip


def run_torch(config, weights, batches, heldout, dtype, param_update) -> dict:
    """One torch run: `TrainStep` over `low_precision_adamw`, the task's
    schedule as a ``LambdaLR``."""
    import torch

    from examples.lm import loss_torch, metric, schedule
    from examples.lm.parts_torch import build_model, to_torch
    from torchref import train, transforms

    # One intra-op thread, as the harness runs torch: on the shared 2-core
    # machine two threads spend most of a step spinning in OpenMP.
    torch.set_num_threads(1)
    model = build_model(config, weights).to(getattr(torch, dtype)).train()
    opt = transforms.low_precision_adamw(
        model.parameters(),
        config.learning_rate,
        betas=(config.b1, config.b2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        mu_dtype=dtype,
        nu_dtype=dtype,
        param_update=param_update,
    )
    lam = lambda n: schedule.lr_at(config, n) / config.learning_rate  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)

    def loss_fn(m, batch):
        logits, stats = m(batch["inputs"])
        return loss_torch.stable_loss(logits, batch["targets"], stats)

    step = train.TrainStep(model, opt, loss_fn, max_grad_norm=config.max_grad_norm)
    lost, t0 = [], time.perf_counter()
    for batch in batches:
        lost.append(step(to_torch(batch))["lost_update"])
        sched.step()
    seconds = time.perf_counter() - t0
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(heldout["inputs"]), 16):
            b = to_torch({k: v[i : i + 16] for k, v in heldout.items()})
            total += loss_torch.nll_sum(model(b["inputs"])[0], b["targets"])
    held = list(model.parameters()) + [
        t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)
    ]
    return _row(metric.scores(total, heldout["targets"].size), lost, seconds,
                sum(t.nbytes for t in held), len(batches))  # fmt: skip


def _row(scores, lost, seconds, nbytes, steps) -> dict:
    tail = lost[-max(1, len(lost) // 4) :]
    return {
        "bits_per_byte": scores["bits_per_byte"],
        "lost_update_mean": float(np.mean(lost)),
        "lost_update_last_quarter": float(np.mean(tail)),
        "state_bytes": int(nbytes),
        "seconds_per_step": seconds / steps,
    }


def table(rows: list[dict]) -> str:
    """The markdown table: one line per framework and run, bits per byte and
    memory also relative to the framework's float32 run.

    Example:
        >>> runs = (("float32", 2.0, 0.0, 1200), ("nearest", 2.5, 0.9, 600))
        >>> r = [dict(framework="jax", run=n, bits_per_byte=b, lost_update_mean=l,
        ...           lost_update_last_quarter=l, state_bytes=m, seconds_per_step=0.1)
        ...      for n, b, l, m in runs]
        >>> print(table(r).splitlines()[3])
        | jax | nearest | 2.500 | +25.0% | 90% | 90% | 600 | 0.50 | 0.100 |
    """
    out = [
        "| framework | run | bits per byte | vs float32 | lost update (mean) | "
        "lost update (last quarter) | param + state bytes | vs float32 | s / step |",
        "|---" * 9 + "|",
    ]
    for r in rows:
        ref = next(
            x
            for x in rows
            if x["framework"] == r["framework"] and x["run"] == "float32"
        )
        gap = r["bits_per_byte"] / ref["bits_per_byte"] - 1
        out.append(
            f"| {r['framework']} | {r['run']} | {r['bits_per_byte']:.3f} | "
            f"{gap:+.1%} | {r['lost_update_mean']:.0%} | "
            f"{r['lost_update_last_quarter']:.0%} | {r['state_bytes']} | "
            f"{r['state_bytes'] / ref['state_bytes']:.2f} | "
            f"{r['seconds_per_step']:.3f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Runs the four runs in each framework, prints the table, writes ``--out``."""
    args = parse_args(argv)
    config = _config(args)
    weights = TASK.initial_weights(config)
    batches = TASK.train_batches(config)
    heldout = TASK.heldout_set(config)
    frameworks = ("jax", "torch") if args.framework == "both" else (args.framework,)
    runners = {"jax": run_jax, "torch": run_torch}
    rows = []
    for fw in frameworks:
        for name, dtype, param_update in RUNS:
            row = runners[fw](config, weights, batches, heldout, dtype, param_update)
            rows.append({"framework": fw, "run": name, **row})
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.out:
        from examples.harness import environment

        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"steps": args.steps, "width": args.width, "lr": args.lr,
                       "rows": rows, "environment": environment.record()},
                      f, indent=2)  # fmt: skip
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
