"""Cross-entropy fwd+bwd: jaxstable vs the naive low-precision optax path vs torch.

What is timed, for each shape (all fwd+bwd, i.e. value and d loss/d logits):
  ours_bf16 / ours_fp16   jit(value_and_grad(jaxstable.losses.softmax_cross_entropy))
                          on bf16 / fp16 logits (float32 maths inside, custom VJP)
  naive_bf16 / naive_fp16 jit(value_and_grad(...)) of optax's
                          softmax_cross_entropy_with_integer_labels on the
                          low-precision logits (its maths runs in that dtype),
                          masked mean over non-ignored labels
  torch_float             F.cross_entropy(logits.float(), ...) + backward on bf16
                          NCHW logits (the "hybrid AMP" fix of seeds/000)

Timing is interleaved (every rep runs each variant once, in a fresh random
order, so no variant always follows torch) and reported as medians; ratios
come from the same run. OMP_WAIT_POLICY=PASSIVE is set before torch loads:
otherwise torch's OpenMP workers spin after each op and slow whichever JAX
variant runs next (seen here: the variant after torch ran ~30% slower).
Compiled temporary memory is
`jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes`.
Run: .venv/bin/python benchmarks/bench_losses.py [--reps N]
(writes benchmarks/results/bench_losses_cpu.{md,json})
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

# Must be set before torch (and its OpenMP runtime) is imported; see above.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
import torch.nn.functional as F
from _device import cpu_name  # benchmarks/ is on sys.path when run as a script

from jaxstable import losses

IGNORE = 255
RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {
    # name: (leading shape, classes, fraction of ignored labels, reps)
    # The class counts users train with (issue 13): binary masks, Cityscapes,
    # COCO, ADE20K, ImageNet, a language-model vocabulary; ~2-5 M logits each.
    "binary 8x128x128x2": ((8, 128, 128), 2, 0.10, 200),
    "segmentation 8x128x128x19": ((8, 128, 128), 19, 0.10, 200),
    "coco 8x64x64x80": ((8, 64, 64), 80, 0.0, 150),
    "ade20k 8x64x64x150": ((8, 64, 64), 150, 0.10, 150),
    "classification 4096x1000": ((4096,), 1000, 0.0, 200),
    "language model 128x32000": ((128,), 32000, 0.0, 150),
}


def ours_fn():
    def f(x, y):
        return losses.softmax_cross_entropy(x, y, ignore_index=IGNORE)

    return jax.jit(jax.value_and_grad(f))


def naive_fn():
    def f(x, y):
        valid = y != IGNORE
        per = optax.softmax_cross_entropy_with_integer_labels(x, jnp.where(valid, y, 0))
        return jnp.sum(jnp.where(valid, per, 0)) / jnp.maximum(jnp.sum(valid), 1)

    return jax.jit(jax.value_and_grad(f))


def temp_bytes(fn, *args) -> int:
    return int(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def bench_shape(name, lead, n_classes, ignore_frac, reps, seed=0):
    rng = np.random.default_rng(seed)
    x32 = (rng.normal(size=(*lead, n_classes)) * 3).astype(np.float32)
    y = rng.integers(0, n_classes, size=lead)
    y[rng.random(lead) < ignore_frac] = IGNORE
    yj = jnp.asarray(y, jnp.int32)
    xs = {d: jnp.asarray(x32).astype(d) for d in ("bfloat16", "float16")}
    ours, naive = ours_fn(), naive_fn()

    # torch: NCHW bf16 logits (a model's output), loss on the float32 upcast
    xt = torch.tensor(np.moveaxis(x32, -1, 1) if len(lead) > 1 else x32)
    xt = xt.to(torch.bfloat16).contiguous().requires_grad_(True)
    yt = torch.tensor(y, dtype=torch.long)

    def torch_step():
        xt.grad = None
        loss = F.cross_entropy(xt.float(), yt, ignore_index=IGNORE)
        loss.backward()
        return loss

    variants = {
        "ours_bf16": lambda: jax.block_until_ready(ours(xs["bfloat16"], yj)),
        "ours_fp16": lambda: jax.block_until_ready(ours(xs["float16"], yj)),
        "naive_bf16": lambda: jax.block_until_ready(naive(xs["bfloat16"], yj)),
        "naive_fp16": lambda: jax.block_until_ready(naive(xs["float16"], yj)),
        "torch_float": torch_step,
    }
    for fn in variants.values():  # compile + warm up
        fn()
        fn()
    times = {k: [] for k in variants}
    order = list(variants)
    shuffle = np.random.default_rng(seed + 1)
    for _ in range(reps):
        shuffle.shuffle(order)  # no variant always runs right after torch
        for k in order:
            t0 = time.perf_counter()
            variants[k]()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    mem = {
        "ours_bf16": temp_bytes(ours, xs["bfloat16"], yj),
        "ours_fp16": temp_bytes(ours, xs["float16"], yj),
        "naive_bf16": temp_bytes(naive, xs["bfloat16"], yj),
        "naive_fp16": temp_bytes(naive, xs["float16"], yj),
    }
    ours_loss = float(ours(xs["bfloat16"], yj)[0])
    naive_loss = float(naive(xs["bfloat16"], yj)[0])
    return {
        "shape": name,
        "logits_bytes_bf16": int(xs["bfloat16"].nbytes),
        "float32_copy_bytes": int(x32.nbytes),
        "reps": reps,
        "median_ms": med,
        "temp_bytes": mem,
        "loss_bf16": {"ours": ours_loss, "naive": naive_loss},
        "ratios": {
            "ours_bf16 / naive_bf16 time": med["ours_bf16"] / med["naive_bf16"],
            "torch_float / ours_bf16 time": med["torch_float"] / med["ours_bf16"],
            "ours_bf16 / naive_bf16 temp": mem["ours_bf16"] / max(mem["naive_bf16"], 1),
        },
    }


def verdicts(r) -> dict[str, bool]:
    q = r["ratios"]
    return {
        "time <= 1.10x naive bf16": q["ours_bf16 / naive_bf16 time"] <= 1.10,
        "temp <= 0.5x naive bf16": q["ours_bf16 / naive_bf16 temp"] <= 0.5,
        ">= 1.5x faster than torch .float()": q["torch_float / ours_bf16 time"] >= 1.5,
    }


def to_markdown(results, device) -> str:
    lines = [
        "# Cross-entropy fwd+bwd benchmark (`benchmarks/bench_losses.py`)",
        "",
        f"Device: **{device['cpu']}**, {device['cores']} cores visible; "
        f"jax {device['jax']} ({device['backend']}), torch {device['torch']} "
        f"({device['torch_threads']} threads), Python {device['python']}; "
        f"load average (1 min) {device['load_before']:.1f} before the run, "
        f"{device['load_after']:.1f} after.",
        "Timing interleaved (each rep runs every variant once, random order; "
        "OMP_WAIT_POLICY=PASSIVE); medians of `reps` "
        "calls; ratios from this one run. Temp = XLA compiled temporary bytes.",
        "The machine is shared with other jobs: ratios are more robust than "
        "absolute times.",
        "",
    ]
    for r in results:
        m, t = r["median_ms"], r["temp_bytes"]
        lines += [
            f"## {r['shape']} (bf16 logits {r['logits_bytes_bf16'] / 2**20:.1f} MiB, "
            f"float32 copy {r['float32_copy_bytes'] / 2**20:.1f} MiB, "
            f"{r['reps']} reps)",
            "",
            "| variant | median ms | temp MiB |",
            "|---|---:|---:|",
        ]
        for k in m:
            mem = f"{t[k] / 2**20:.2f}" if k in t else "n/a"
            lines.append(f"| {k} | {m[k]:.2f} | {mem} |")
        lines += ["", "| ratio | value |", "|---|---:|"]
        for k, v in r["ratios"].items():
            lines.append(f"| {k} | {v:.2f} |")
        lines += ["", "| goal (issue 2) | met on this device |", "|---|---|"]
        for k, v in verdicts(r).items():
            lines.append(f"| {k} | {'yes' if v else 'NO'} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None, help="reps per shape")
    args = parser.parse_args()
    device = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "python": platform.python_version(),
        # other jobs on the machine slow the variants unevenly: say how busy
        "load_before": os.getloadavg()[0],
    }
    results = [
        bench_shape(name, lead, c, frac, args.reps or reps)
        for name, (lead, c, frac, reps) in SHAPES.items()
    ]
    device["load_after"] = os.getloadavg()[0]
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"device": device, "results": results}
    for r in payload["results"]:
        r["goals_met"] = verdicts(r)
    (RESULTS / "bench_losses_cpu.json").write_text(json.dumps(payload, indent=2))
    md = to_markdown(results, device)
    (RESULTS / "bench_losses_cpu.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
