"""Guard overhead of a train step: guarded vs plain, JAX and PyTorch, one run.

Model (both frameworks, same shapes): a CPU-sized conv net on a batch of
16 x 32x32x3 images, 10 classes::

    conv3x3(32)-BN-ReLU, conv3x3/2(32)-BN-ReLU, conv3x3/2(32)-BN-ReLU,
    global average pool, linear(10); softmax cross-entropy; Adam(1e-3).

Variants, each on its own copy of the same initial weights (one init per
framework; the two frameworks are never compared with each other here):

  jax_plain     jit(value_and_grad(loss) + tx.update + apply_updates),
                tx = optax.adam; batch stats updated as usual.
  jax_clip      the same step with tx = chain(jaxstable clip_by_global_norm(1.0),
                adam) (the middle: clipping only).
  jax_guarded   jaxstable.train.make_train_step over
                stable_optimizer(adam, max_grad_norm=1.0) and DynamicLossScale():
                scaled loss, unscale, one finiteness reduction, clip, skip
                (select), loss-scale adjust, metrics.
  torch_plain   zero_grad(set_to_none=True), forward, loss, backward, step.
  torch_clip    the same plus clip_grad_norm_(params, 1.0).
  torch_amp_recipe  the torch.amp docs' recipe inline: GradScaler scale,
                backward, unscale_, clip_grad_norm_, scaler.step, update (what
                a careful torch user writes by hand; no metrics, no counters).
  torch_guarded torchref.train.TrainStep(max_grad_norm=1.0,
                scaler=DynamicLossScale()): the real GradScaler (scale,
                unscale_, found-inf check, step, update), clip, buffer snapshot
                for restore-on-skip, python-float metrics, and the update
                check (copy of params + Adam state before the step, one
                finiteness check of what the step wrote, copy back if not).
  *_guarded_grads_only  the guarded step with check_update=False: gradients
                checked, the update not (the cost of the update check is the
                difference between the two guarded rows).

Also reported, deterministic: XLA's compiled cost analysis ("bytes accessed")
and top-level fusion count of the JAX steps, on this conv net and on an MLP
with 80 parameter leaves (40 Dense layers of width 64, Adam), where per-leaf
work dominates: plain (optax.adam, no loss scale), guarded_grads_only,
guarded, and step_guard (a plain optax chain(clip, adam) that
make_train_step guards itself, with the same update check). Goals (issue 24):
guarded/plain bytes <= 1.12 on the MLP and <= 1.02 on the conv net.
`--cost-only` computes only this table (no timing, any load) and rewrites it
in the committed results, saying so under the table.

CPUs: by default the process is pinned to ONE core and torch runs one
intra-op thread (`--cpus 1`), so both frameworks get the same compute. On the
2-core machine shared with other jobs where this was written, an unpinned
run (2 threads each, load average ~4) spent most of torch's time spinning in
OpenMP (~300 ms per step instead of ~30) and no ratio was meaningful. With
fewer threads the heavy convolutions take longer while the guard's small
element-wise work does not shrink as much, so the overhead measured on one
core can be lower than on many; `--cpus 0` disables pinning on a quiet box.

Timing: interleaved. Each round runs every variant for K steps (in a fresh
random order per round, after one untimed step), timing each block with
`time.perf_counter`; JAX blocks end with `jax.block_until_ready` on the new
params (torch on CPU is synchronous). Per-step time of a block = block / K.
Reported: median per-step time over rounds, and the guard overhead as the
median over rounds of the paired per-round ratio guarded/plain - 1 (with its
interquartile range), all from this one run. The loss / skipped counts at the
end are printed as a sanity check (no step may be skipped here).

Run: .venv/bin/python benchmarks/bench_step.py   (writes benchmarks/results/)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from _device import cpu_name  # benchmarks/ is on sys.path when run as a script

from jaxstable import loss_scale as jls
from jaxstable import losses as jlosses
from jaxstable import train as jtrain
from jaxstable import transforms
from torchref import loss_scale as tls
from torchref import losses as tlosses
from torchref import train as ttrain

RESULTS = Path(__file__).resolve().parent / "results"
BATCH, HW, WIDTH, CLASSES = 16, 32, 32, 10
LR, MAX_GRAD_NORM = 1e-3, 1.0
GOAL = 0.03  # issue 3: guard overhead at most 3% of the step
# issue 24: guarded/plain "bytes accessed" of the compiled step, per model.
BYTES_GOAL = {"conv net": 1.02, "MLP, 80 leaves": 1.12}


# ----------------------------------------------------------------- models
class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layers, c_in = [], 3
        for stride in (1, 2, 2):
            layers += [
                torch.nn.Conv2d(c_in, WIDTH, 3, stride, padding=1, bias=False),
                torch.nn.BatchNorm2d(WIDTH),
                torch.nn.ReLU(),
            ]
            c_in = WIDTH
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


class JaxNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        for stride in (1, 2, 2):
            x = nn.Conv(
                WIDTH,
                (3, 3),
                (stride, stride),
                padding=((1, 1), (1, 1)),
                use_bias=False,
            )(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        return nn.Dense(CLASSES)(x.mean(axis=(1, 2)))


# ------------------------------------------------------------------- JAX
def jax_variants(x_nhwc: np.ndarray, y: np.ndarray):
    """name -> (run K steps and block, final sanity dict)."""
    module = JaxNet()
    variables = module.init(jax.random.key(0), jnp.asarray(x_nhwc), train=False)
    params0, stats0 = variables["params"], {"batch_stats": variables["batch_stats"]}
    batch = (jnp.asarray(x_nhwc), jnp.asarray(y))

    def loss_with_state(params, model_state, batch):
        x, y = batch
        logits, new_state = module.apply(
            {"params": params, **model_state}, x, train=True, mutable=["batch_stats"]
        )
        return jlosses.softmax_cross_entropy(logits, y), new_state

    def make_plain(tx):
        @jax.jit
        def step(params, opt_state, model_state, batch):
            (loss, new_state), grads = jax.value_and_grad(
                loss_with_state, has_aux=True
            )(params, model_state, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, new_state, loss

        carry = {"p": params0, "o": tx.init(params0), "s": stats0, "loss": None}

        def run(k):
            for _ in range(k):
                carry["p"], carry["o"], carry["s"], carry["loss"] = step(
                    carry["p"], carry["o"], carry["s"], batch
                )
            jax.block_until_ready(carry["p"])

        return run, lambda: {"loss": float(carry["loss"]), "skipped_total": 0}

    def make_guarded(check_update=True):
        tx = transforms.stable_optimizer(
            optax.adam(LR), max_grad_norm=MAX_GRAD_NORM, check_update=check_update
        )
        state = jtrain.TrainState.create(
            params=params0,
            optimizer=tx,
            loss_scale=jls.DynamicLossScale(),
            model_state=stats0,
        )
        step = jtrain.make_train_step(loss_with_state, has_state=True)
        carry = {"state": state, "m": None}

        def run(k):
            for _ in range(k):
                carry["state"], carry["m"] = step(carry["state"], batch)
            jax.block_until_ready(carry["state"].params)

        def sanity():
            m = jax.device_get(carry["m"])
            return {"loss": float(m["loss"]), "skipped_total": int(m["skipped_total"])}

        return run, sanity

    clip = transforms.clip_by_global_norm(MAX_GRAD_NORM)
    return {
        "jax_plain": make_plain(optax.adam(LR)),
        "jax_clip": make_plain(optax.chain(clip, optax.adam(LR))),
        "jax_guarded_grads_only": make_guarded(check_update=False),
        "jax_guarded": make_guarded(),
    }


# ----------------------------------------------------------------- torch
def torch_variants(x_nchw: np.ndarray, y: np.ndarray, device: str):
    torch.manual_seed(0)
    init = TorchNet().state_dict()
    x = torch.from_numpy(x_nchw).to(device)
    yt = torch.from_numpy(y.astype(np.int64)).to(device)

    def fresh():
        model = TorchNet().to(device)
        model.load_state_dict(init)
        model.train()
        return model, torch.optim.Adam(model.parameters(), lr=LR)

    def loss_fn(model, batch):
        return tlosses.softmax_cross_entropy(model(batch[0]), batch[1])

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def make_plain(clip: bool):
        model, opt = fresh()
        last = {}

        def run(k):
            for _ in range(k):
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model, (x, yt))
                loss.backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                opt.step()
            last["loss"] = loss
            sync()

        return run, lambda: {"loss": float(last["loss"].detach()), "skipped_total": 0}

    def make_amp_recipe():
        # The torch.amp docs' recipe written inline, without TrainStep's
        # extras (buffer snapshot, metrics as python numbers, counters).
        model, opt = fresh()
        scaler = tls.DynamicLossScale().make_scaler(device)
        last = {}

        def run(k):
            for _ in range(k):
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model, (x, yt))
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                scaler.step(opt)
                scaler.update()
            last["loss"] = loss
            sync()

        return run, lambda: {"loss": float(last["loss"].detach()), "skipped_total": 0}

    def make_guarded(check_update=True):
        model, opt = fresh()
        step = ttrain.TrainStep(
            model,
            opt,
            loss_fn,
            max_grad_norm=MAX_GRAD_NORM,
            scaler=tls.DynamicLossScale(),
            check_update=check_update,
        )
        last = {}

        def run(k):
            for _ in range(k):
                last["m"] = step((x, yt))
            sync()

        return run, lambda: {
            "loss": last["m"]["loss"],
            "skipped_total": last["m"]["skipped_total"],
        }

    return {
        "torch_plain": make_plain(clip=False),
        "torch_clip": make_plain(clip=True),
        "torch_amp_recipe": make_amp_recipe(),
        "torch_guarded_grads_only": make_guarded(check_update=False),
        "torch_guarded": make_guarded(),
    }


# --------------------------------------------------- XLA cost analysis
def _compiled_cost(fn, *args) -> dict[str, float]:
    compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    fusions = compiled.as_text().count(" fusion(")
    return {"bytes": float(cost["bytes accessed"]), "fusions": fusions}


def _cost_rows(loss_fn, params, model_state, batch) -> dict[str, dict]:
    """Plain optax step vs guarded (grads only), guarded (grads + update) and
    the step's own guard around a plain optax chain (grads + update)."""
    tx = optax.adam(LR)

    def plain(params, opt_state, model_state, batch):
        (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, model_state, batch
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_state, loss

    rows = {"plain": _compiled_cost(plain, params, tx.init(params), model_state, batch)}
    # The usual recipe's clip too (no loss scale, no check): what the guard
    # costs over clip + Adam, beside what it costs over Adam alone.
    clipped = optax.chain(optax.clip_by_global_norm(MAX_GRAD_NORM), tx)

    def plain_clip(params, opt_state, model_state, batch):
        (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, model_state, batch
        )
        updates, opt_state = clipped.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_state, loss

    rows["plain_clip"] = _compiled_cost(
        plain_clip, params, clipped.init(params), model_state, batch
    )
    step = jtrain.make_train_step(loss_fn, has_state=True)
    clip = transforms.clip_by_global_norm(MAX_GRAD_NORM)
    for name, gtx in (
        (
            "guarded_grads_only",
            transforms.stable_optimizer(
                tx, max_grad_norm=MAX_GRAD_NORM, check_update=False
            ),
        ),
        ("guarded", transforms.stable_optimizer(tx, max_grad_norm=MAX_GRAD_NORM)),
        # No skip transform: make_train_step checks and selects itself.
        ("step_guard", optax.chain(clip, tx)),
    ):
        state = jtrain.TrainState.create(
            params=params,
            optimizer=gtx,
            loss_scale=jls.DynamicLossScale(),
            model_state=model_state,
        )
        rows[name] = _compiled_cost(step.raw, state, batch)
    for r in rows.values():
        r["bytes_vs_plain"] = r["bytes"] / rows["plain"]["bytes"]
    return rows


def cost_analysis(x_nhwc: np.ndarray, y: np.ndarray) -> dict[str, dict]:
    module = JaxNet()
    variables = module.init(jax.random.key(0), jnp.asarray(x_nhwc), train=False)

    def conv_loss(params, model_state, batch):
        logits, new_state = module.apply(
            {"params": params, **model_state},
            batch[0],
            train=True,
            mutable=["batch_stats"],
        )
        return jlosses.softmax_cross_entropy(logits, batch[1]), new_state

    mlp = nn.Sequential([nn.Dense(64) for _ in range(40)])
    mlp_x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 64)), "float32")
    mlp_params = mlp.init(jax.random.key(1), mlp_x)["params"]

    def mlp_loss(params, model_state, batch):
        return jnp.mean(mlp.apply({"params": params}, batch) ** 2), model_state

    return {
        "conv net": _cost_rows(
            conv_loss,
            variables["params"],
            {"batch_stats": variables["batch_stats"]},
            (jnp.asarray(x_nhwc), jnp.asarray(y)),
        ),
        "MLP, 80 leaves": _cost_rows(mlp_loss, mlp_params, None, mlp_x),
    }


# ------------------------------------------------------------------ main
def quartiles(values):
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def measure(variants, rounds: int, k: int, warmup: int, seed: int = 0):
    for run, _ in variants.values():  # compile + warm up
        run(warmup)
    names = list(variants)
    order_rng = np.random.default_rng(seed)
    per_step = {n: [] for n in names}
    for _ in range(rounds):
        # A fresh random order per round: a fixed cyclic order would make one
        # variant always follow the same other one (and e.g. always run while
        # torch's OpenMP threads are still spinning after their region).
        for j in order_rng.permutation(len(names)):
            run = variants[names[j]][0]
            run(1)  # untimed: absorbs the previous variant's after-effects
            t0 = time.perf_counter()
            run(k)
            per_step[names[j]].append((time.perf_counter() - t0) / k)
    return per_step


def summarise(per_step, fw: str):
    base = per_step[f"{fw}_plain"]
    out = {}
    for n, ts in per_step.items():
        if not n.startswith(fw):
            continue
        ratios = [t / b - 1.0 for t, b in zip(ts, base, strict=True)]
        q1, med, q3 = quartiles(ratios)
        out[n] = {
            "median_ms": statistics.median(ts) * 1e3,
            "overhead_median": med,
            "overhead_q1": q1,
            "overhead_q3": q3,
            "overhead_of_medians": statistics.median(ts) / statistics.median(base)
            - 1.0,
        }
    return out


def verdict(s) -> str:
    """'yes' / 'NO' when the whole interquartile range of the paired overhead
    is on one side of the goal, else 'borderline' (with the median's side)."""
    if s["overhead_q3"] <= GOAL:
        return "yes"
    if s["overhead_q1"] > GOAL:
        return "NO"
    side = "below" if s["overhead_median"] <= GOAL else "above"
    return f"borderline: IQR straddles {GOAL:.0%}, median {side}"


def to_markdown(payload) -> str:
    d, cfg = payload["device"], payload["config"]
    lines = [
        "# Guarded train step overhead (`benchmarks/bench_step.py`)",
        "",
        f"Device: **{d['cpu']}**, {d['cores']} cores visible, load average "
        f"{d['loadavg_start']} at start / {d['loadavg_end']} at end; "
        f"jax {d['jax']} ({d['jax_backend']}), flax {d['flax']}, optax "
        f"{d['optax']}; torch {d['torch']} ({d['torch_device']}, "
        f"{d['torch_threads']} threads); Python {d['python']}. "
        f"Process pinned to {d['cpus_pinned']} CPU(s) (`--cpus`).",
        f"Model: conv net (3 conv3x3 width {WIDTH} + BN + ReLU, linear head), "
        f"batch {BATCH}x{HW}x{HW}x3, Adam({LR}), clip {MAX_GRAD_NORM}, "
        "DynamicLossScale() defaults.",
        f"Interleaved: {cfg['rounds']} rounds x {cfg['k']} steps per variant "
        "(random order per round, one untimed step before each block). "
        "Overhead = median over rounds of the paired per-round ratio "
        "variant/plain - 1 [interquartile range]; "
        "`of medians` = ratio of the two median step times - 1. One run.",
        "The machine is shared with other jobs: the ratios are more robust "
        "than the absolute times.",
        "",
        "| variant | median ms/step | overhead vs plain | IQR | of medians "
        "| final loss | skipped |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n, s in payload["summary"].items():
        sane = payload["sanity"][n]
        lines.append(
            f"| {n} | {s['median_ms']:.2f} | {s['overhead_median'] * 100:+.1f}% "
            f"| [{s['overhead_q1'] * 100:+.1f}%, {s['overhead_q3'] * 100:+.1f}%] "
            f"| {s['overhead_of_medians'] * 100:+.1f}% "
            f"| {sane['loss']:.4f} | {sane['skipped_total']} |"
        )
    lines += [
        "",
        "XLA compiled cost analysis of the JAX steps (deterministic):",
        "",
        "| model | step | bytes accessed | vs plain | fusions |",
        "|---|---|---:|---:|---:|",
    ]
    for model, rows in payload["cost_analysis"].items():
        for n, r in rows.items():
            lines.append(
                f"| {model} | {n} | {r['bytes']:.4g} | {r['bytes_vs_plain']:.3f} "
                f"| {r['fusions']} |"
            )
    if payload.get("cost_analysis_note"):
        lines += ["", payload["cost_analysis_note"]]
    lines += ["", f"| goal (issue 3): guard overhead <= {GOAL:.0%} | met here |"]
    lines += ["|---|---|"]
    for fw, met in payload["goal_met"].items():
        lines.append(f"| {fw}_guarded vs {fw}_plain | {met} |")
    lines += ["", "| goal (issue 24): guarded/plain bytes accessed | met here |"]
    lines += ["|---|---|"]
    for model, limit in BYTES_GOAL.items():
        ratio = payload["cost_analysis"][model]["guarded"]["bytes_vs_plain"]
        met = "yes" if ratio <= limit else "NO"
        lines.append(f"| {model}: {ratio:.3f} <= {limit} | {met} |")
    if all("plain_clip" in rows for rows in payload["cost_analysis"].values()):
        lines += [
            "",
            "The guarded step clips; `plain` does not. Against `plain_clip` "
            "(optax's `clip_by_global_norm` + Adam, the recipe it replaces; "
            "not the issue's goal), guarded/plain_clip bytes: "
            + ", ".join(
                f"{model} {rows['guarded']['bytes'] / rows['plain_clip']['bytes']:.3f}"
                for model, rows in payload["cost_analysis"].items()
            )
            + ".",
        ]
    return "\n".join(lines)


def rewrite_cost_table(cost: dict) -> str:
    """Puts a new cost analysis into the committed results of this backend.

    The timing table stays the one measured before, and the note under the
    cost table says so: the cost analysis is deterministic, the timings need
    a quiet machine.
    """
    tag = jax.default_backend()
    path = RESULTS / f"bench_step_{tag}.json"
    payload = json.loads(path.read_text())
    payload["cost_analysis"] = cost
    payload["cost_analysis_note"] = (
        f"This cost table was recomputed alone (`--cost-only`, jax "
        f"{jax.__version__}, {time.strftime('%Y-%m-%d')}) after the timings "
        "above were measured: the timings are of the step as it was then."
    )
    path.write_text(json.dumps(payload, indent=2))
    md = to_markdown(payload)
    (RESULTS / f"bench_step_{tag}.md").write_text(md + "\n")
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--k", type=int, default=5, help="steps per variant per round")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--cost-only",
        action="store_true",
        help="compute the (deterministic) XLA cost analysis only, no timing, "
        "and rewrite it in the committed results",
    )
    ap.add_argument("--torch-device", default="cpu")
    ap.add_argument(
        "--cpus",
        type=int,
        default=1,
        help="pin the process to this many CPUs (0: no pinning, all threads)",
    )
    args = ap.parse_args()
    if args.cpus:
        # Before JAX's CPU backend starts: its thread pool sizes itself from
        # the affinity mask (the XLA_FLAGS thread options are ignored by this
        # jax's CPU runtime). torch gets as many intra-op threads.
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cpus])
        torch.set_num_threads(args.cpus)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 3, HW, HW)).astype(np.float32)
    y = rng.integers(0, CLASSES, BATCH).astype(np.int32)
    if args.cost_only:
        print(rewrite_cost_table(cost_analysis(x.transpose(0, 2, 3, 1), y)))
        return
    loadavg_start = " ".join(f"{v:.2f}" for v in os.getloadavg())
    variants = {
        **jax_variants(x.transpose(0, 2, 3, 1), y),
        **torch_variants(x, y, args.torch_device),
    }
    per_step = measure(variants, args.rounds, args.k, args.warmup)
    summary = {**summarise(per_step, "jax"), **summarise(per_step, "torch")}
    sanity = {n: v[1]() for n, v in variants.items()}
    for n, s in sanity.items():
        if s["skipped_total"] != 0 or not np.isfinite(s["loss"]):
            raise RuntimeError(f"{n} did not train cleanly: {s}")
    payload = {
        "device": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "loadavg_start": loadavg_start,
            "loadavg_end": " ".join(f"{v:.2f}" for v in os.getloadavg()),
            "jax": jax.__version__,
            "jax_backend": jax.default_backend(),
            "jax_devices": [str(dev) for dev in jax.devices()],
            "flax": flax.__version__,
            "optax": optax.__version__,
            "torch": torch.__version__,
            "torch_device": args.torch_device,
            "torch_threads": torch.get_num_threads(),
            "cpus_pinned": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
        },
        "config": {
            "rounds": args.rounds,
            "k": args.k,
            "warmup": args.warmup,
            "batch": BATCH,
            "hw": HW,
            "width": WIDTH,
            "lr": LR,
            "max_grad_norm": MAX_GRAD_NORM,
        },
        "summary": summary,
        "sanity": sanity,
        "goal_met": {fw: verdict(summary[f"{fw}_guarded"]) for fw in ("jax", "torch")},
        "per_step_s": per_step,
        "cost_analysis": cost_analysis(x.transpose(0, 2, 3, 1), y),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = jax.default_backend()
    (RESULTS / f"bench_step_{tag}.json").write_text(json.dumps(payload, indent=2))
    md = to_markdown(payload)
    (RESULTS / f"bench_step_{tag}.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
