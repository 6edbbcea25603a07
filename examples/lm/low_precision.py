"""Pure bfloat16 parameters and Adam states on the lm task: the stall and its cures.

Four runs of the task's stable model (QK-norm, float32 cross-entropy,
bfloat16 compute, clip at 1.0) from the same weights and batches, with
`transforms.low_precision_adamw` in each framework:

* ``float32``: float32 parameters and moments (the float32-master reference);
* ``nearest``: bfloat16 parameters and moments, round-to-nearest (the stall);
* ``stochastic``: the same, stochastic rounding of the parameters;
* ``kahan``: the same, Kahan-compensated parameters (a bfloat16 buffer).

Per run: held-out bits per byte, the rounding statistics (`RoundingStats`:
the mean fraction of the update lost to rounding, ``lost_update``, of the
entries that did not move, of the weight decay lost, of second moments that
underflowed; over the run and over its last quarter), the bytes of
parameters and optimizer state (summed over the arrays the run holds at its
end: counted, not computed from dtypes; all of them, and those shaped like
a parameter) and the seconds per step (this machine, this run: compare
within one table only)::

    # the README's table, results/low_precision.json and report.md's section:
    python -m examples.lm.low_precision --out examples/lm/results/low_precision.json \\
        --report examples/lm/results/report.md
    python -m examples.lm.low_precision --quick        # 60 steps

The optimizer settings are GPT-3 Small's (Brown et al. 2020, table 2.1 and
appendix B): peak learning rate 6e-4, AdamW b1 0.9, b2 0.95, eps 1e-8,
weight decay 0.1, a cosine to a tenth of the peak (the task's b2, eps and
cosine already are). Half a bfloat16 ulp of a weight of 0.02 (the init's
scale) is 6.1e-5: at the peak an Adam step below a tenth of the learning
rate rounds away, at the cosine's tail (6e-5) even a full-size one does,
and the decay (``lr * wd`` = 6e-5 of a weight, below 2**-9) rounds to
nothing: the classic stall, at an ordinary setting. At the sweep's lowest
peak (3e-3, README.md) the stall cost only +0.4% bits per byte.

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

from examples.harness.sections import (  # noqa: E402
    json_section,
    put_section,
    rerun_command,
)
from examples.lm.task import TASK  # noqa: E402

# (name, parameter and moment dtype, param_update)
RUNS = (
    ("float32", "float32", "nearest"),
    ("nearest", "bfloat16", "nearest"),
    ("stochastic", "bfloat16", "stochastic"),
    ("kahan", "bfloat16", "kahan"),
)
# GPT-3 Small's (module docstring)
LEARNING_RATE = 6e-4
WEIGHT_DECAY = 0.1
# The rounding statistics kept per step (`RoundingStats`' fields).
STATS = ("lost_update", "lost_params", "lost_decay", "nu_underflow")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of :func:`main`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("jax", "torch", "both"), default="both")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=LEARNING_RATE)
    p.add_argument("--quick", action="store_true", help="60 steps at width 64")
    p.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY)
    p.add_argument("--out", default=None, help="JSON file of the rows")
    p.add_argument(
        "--report",
        default=None,
        help="a report.md to write the run set's section into (in place of "
        "the one it has)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.width = 60, 64
    return args


def _config(args):
    return TASK.get_config(
        precision="bfloat16",
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
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
    stats, t0 = [], time.perf_counter()
    for batch in batches:
        state, metrics = step(state, batch)
        stats.append({k: metrics[k] for k in STATS})
    stats = jax.device_get(stats)
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
    shapes = {tuple(x.shape) for x in jax.tree.leaves(state.params)}
    held = jax.tree.leaves((state.params, state.opt_state))
    return _row(metric.scores(total, heldout["targets"].size), stats, seconds,
                _bytes(held, shapes), len(batches))  # fmt: skip


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
    stats, t0 = [], time.perf_counter()
    for batch in batches:
        metrics = step(to_torch(batch))
        stats.append({k: metrics[k] for k in STATS})
        sched.step()
    seconds = time.perf_counter() - t0
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(heldout["inputs"]), 16):
            b = to_torch({k: v[i : i + 16] for k, v in heldout.items()})
            total += loss_torch.nll_sum(model(b["inputs"])[0], b["targets"])
    shapes = {tuple(p.shape) for p in model.parameters()}
    held = list(model.parameters()) + [
        t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)
    ]
    return _row(metric.scores(total, heldout["targets"].size), stats, seconds,
                _bytes(held, shapes), len(batches))  # fmt: skip


def _bytes(arrays, shapes) -> tuple[int, int]:
    """``(all, per-entry)``: the bytes of the arrays held, and of those among
    them shaped like a parameter (the parameters, moments and Kahan buffers:
    bytes per parameter entry; the rest are scalars and keys)."""
    arrays = list(arrays)
    per_entry = [x for x in arrays if len(x.shape) and tuple(x.shape) in shapes]
    return sum(int(x.nbytes) for x in arrays), sum(int(x.nbytes) for x in per_entry)


def _row(scores, stats, seconds, nbytes, steps) -> dict:
    """The run's row: its bits per byte, each rounding statistic's mean over
    the run and over its last quarter, its bytes and seconds per step."""
    row = {"bits_per_byte": scores["bits_per_byte"]}
    tail = stats[-max(1, len(stats) // 4) :]
    for k in STATS:
        row[f"{k}_mean"] = float(np.mean([float(s[k]) for s in stats]))
        row[f"{k}_last_quarter"] = float(np.mean([float(s[k]) for s in tail]))
    row["state_bytes"], row["entry_bytes"] = nbytes
    row["seconds_per_step"] = seconds / steps
    return row


def _ref(rows: list[dict], r: dict) -> dict:
    return next(
        x for x in rows if x["framework"] == r["framework"] and x["run"] == "float32"
    )


def table(rows: list[dict]) -> str:
    """The markdown table: one line per framework and run, bits per byte and
    memory also relative to the framework's float32 run (all the bytes held,
    and those of the arrays shaped like a parameter).

    Example:
        >>> runs = (("float32", 2.0, 0.0, 1240), ("nearest", 2.5, 0.9, 640))
        >>> r = [dict(framework="jax", run=n, bits_per_byte=b, lost_update_mean=l,
        ...           lost_update_last_quarter=l, lost_decay_mean=l, state_bytes=m,
        ...           entry_bytes=m - 40, seconds_per_step=0.1)
        ...      for n, b, l, m in runs]
        >>> print(table(r).splitlines()[3])
        | jax | nearest | 2.500 | +25.0% | 90% | 90% | 90% | 640 | 0.51613 | 0.50000 | 0.100 |
    """  # noqa: E501
    out = [
        "| framework | run | bits per byte | vs float32 | lost update (mean) | "
        "lost update (last quarter) | lost decay (mean) | param + state bytes | "
        "vs float32 | per-entry arrays vs float32 | s / step |",
        "|---" * 11 + "|",
    ]
    for r in rows:
        ref = _ref(rows, r)
        gap = r["bits_per_byte"] / ref["bits_per_byte"] - 1
        out.append(
            f"| {r['framework']} | {r['run']} | {r['bits_per_byte']:.3f} | "
            f"{gap:+.1%} | {r['lost_update_mean']:.0%} | "
            f"{r['lost_update_last_quarter']:.0%} | {r['lost_decay_mean']:.0%} | "
            f"{r['state_bytes']} | {r['state_bytes'] / ref['state_bytes']:.5f} | "
            f"{r['entry_bytes'] / ref['entry_bytes']:.5f} | "
            f"{r['seconds_per_step']:.3f} |"
        )
    return "\n".join(out)


def reading(rows: list[dict]) -> str:
    """What the table shows, per framework, from its numbers (nothing
    written before the runs)."""
    lines = []
    for fw in dict.fromkeys(r["framework"] for r in rows):
        run = {r["run"]: r for r in rows if r["framework"] == fw}
        ref = run["float32"]

        def gap(name, run=run, ref=ref):
            return f"{run[name]['bits_per_byte'] / ref['bits_per_byte'] - 1:+.2%}"

        def mem(name, key, run=run, ref=ref):
            return f"{run[name][key] / ref[key]:.5f}"

        def rest(name, run=run):
            return run[name]["state_bytes"] - run[name]["entry_bytes"]

        near = run["nearest"]
        lines.append(
            f"- **{fw}**: round-to-nearest lost {near['lost_update_mean']:.0%} of "
            f"the update over the run ({near['lost_update_last_quarter']:.0%} in "
            f"its last quarter; {near['lost_params_mean']:.0%} of the moving "
            f"entries moved not at all, {near['lost_decay_mean']:.0%} of the "
            f"weight decay was lost) and ends at {gap('nearest')} bits per byte "
            f"from the float32 master; stochastic rounding at {gap('stochastic')}, "
            f"Kahan at {gap('kahan')}. Their parameter and optimizer-state bytes: "
            f"{mem('stochastic', 'state_bytes')} and {mem('kahan', 'state_bytes')} "
            f"of the float32 master's, {mem('stochastic', 'entry_bytes')} and "
            f"{mem('kahan', 'entry_bytes')} counting the arrays shaped like a "
            f"parameter only (the rest, {rest('float32')} bytes in float32 and "
            f"{rest('stochastic')} with stochastic rounding, are scalars: step "
            "counts, bias corrections and rounding statistics, per tensor in "
            "torch; JAX's stochastic rounding adds its key)."
        )  # fmt: skip
    return "\n".join(lines)


def section(data: dict) -> str:
    """The report's section on a run set (``--out``'s JSON; an optional
    ``"note"`` says how it was run where the command does not): the
    command, the settings, the table and `reading`."""
    from examples.harness import environment

    c = data["config"]
    return "\n".join([
        "## Pure bfloat16 parameters and states: the stall and its cures",
        "",
        f"Command: `{data['command']}`"
        + (f" ({data['note']})" if data.get("note") else "")
        + "  ",
        f"Environment: {environment.describe(data.get('environment'))}; one "
        "run on one machine (2 shared CPU cores: the seconds per step compare "
        "within this table only).  ",
        f"Setup: the stable model (QK-norm, float32 cross-entropy, bfloat16 "
        f"compute, clip at {c['max_grad_norm']}), width {c['width']}, "
        f"{c['steps']} steps of {c['batch_size']} x {c['seq_len']} bytes; AdamW "
        f"(b1 {c['b1']}, b2 {c['b2']}, eps {c['eps']:g}, weight decay "
        f"{c['weight_decay']:g}), peak lr {c['learning_rate']:g} after "
        f"{c['warmup_steps']} warm-up steps, a cosine to "
        f"{c['final_lr_fraction']:g} of it; `transforms.low_precision_adamw` "
        "in each framework, from the same weights and batches: float32 "
        "parameters and moments (the float32 master), then bfloat16 "
        "parameters and moments with no float32 copy, rounded to nearest, "
        "stochastically, and with Kahan compensation. Bytes: summed over the "
        "arrays each run holds at its end (counted, not computed from dtypes).",
        "",
        table(data["rows"]),
        "",
        reading(data["rows"]),
        "",
    ])  # fmt: skip


def report_section(out: str) -> str:
    """The task's `report_sections` (`examples.harness.parts.Task`):
    `section` of ``low_precision.json`` in the folder ``out``, ``""`` when there is
    none."""
    return json_section(out, "low_precision.json", section)


def main(argv: list[str] | None = None) -> int:
    """Runs the four runs in each framework, prints the table, writes
    ``--out`` (and with ``--report`` its section into that report)."""
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
    print(reading(rows))
    from examples.harness import environment

    data = {
        "command": rerun_command(
            "examples.lm.low_precision", sys.argv[1:] if argv is None else argv
        ),
        "config": config.as_dict(),
        "rows": rows,
        "environment": environment.record(),
    }  # fmt: skip
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    if args.report:
        put_section(args.report, TASK.name, section(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
