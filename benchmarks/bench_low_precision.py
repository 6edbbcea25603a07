"""low_precision_adamw against float32 master weights: memory and time, one run.

One optimizer step (update + apply, gradients given) over a decoder's
parameter shapes (``--width`` d_model, ``--layers`` blocks of attention
(4 x d^2) and a 4x MLP (8 x d^2), a 256 x d embedding and head), in each
framework:

  float32_master   float32 parameters and moments (low_precision_adamw with
                   every dtype float32: the classic recipe's 12 bytes)
  bf16_nearest     bfloat16 parameters and moments, round-to-nearest
  bf16_stochastic  the same, stochastic rounding
  bf16_kahan       the same, Kahan (a bfloat16 compensation buffer)
  bf16_fp8_moments bfloat16 parameters, float8_e4m3fn moments (scaled), Kahan

Memory: the bytes of the parameters and the optimizer state the step holds
(summed over the arrays, counted, not computed from dtypes), and for JAX the
compiled step's temporary bytes (XLA's memory analysis). Time: per-step
median over interleaved rounds (a fresh order each round); the ratio to
float32_master is the claim, within one framework and one run. CPU timings on
a shared machine are noisy: compare ratios, not seconds::

    python benchmarks/bench_low_precision.py            # writes results/
    python benchmarks/bench_low_precision.py --width 64 --rounds 2 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402

from jaxstable import transforms as jtx  # noqa: E402
from torchref import transforms as ttx  # noqa: E402

VARIANTS = {
    "float32_master": ("float32", "float32", "nearest"),
    "bf16_nearest": ("bfloat16", "bfloat16", "nearest"),
    "bf16_stochastic": ("bfloat16", "bfloat16", "stochastic"),
    "bf16_kahan": ("bfloat16", "bfloat16", "kahan"),
    "bf16_fp8_moments": ("bfloat16", "float8_e4m3fn", "kahan"),
}


def shapes(width: int, layers: int) -> list[tuple[int, ...]]:
    out = [(256, width), (width, 256)]
    for _ in range(layers):
        out += [(width, 3 * width), (width, width), (width, 4 * width)]
        out += [(4 * width, width), (width,), (width,)]
    return out


def jax_variant(shp, dtype, moments, mode):
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(0, 0.02, s), dtype) for s in shp]
    grads = [jnp.asarray(rng.normal(0, 1e-3, s), dtype) for s in shp]
    tx = jtx.low_precision_adamw(
        1e-4, mu_dtype=moments, nu_dtype=moments, param_update=mode
    )
    state = tx.init(params)

    def step(params, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    fn = jax.jit(step, donate_argnums=(0, 1))
    temp = fn.lower(params, state).compile().memory_analysis().temp_size_in_bytes
    held = sum(x.nbytes for x in jax.tree.leaves((params, state)))
    box = [params, state]

    def run(k):
        for _ in range(k):
            box[:] = fn(*box)
        jax.block_until_ready(box[0])

    return run, held, int(temp)


def torch_variant(shp, dtype, moments, mode):
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    params = [
        torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(dt)) for s in shp
    ]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(dt)
    opt = ttx.low_precision_adamw(
        params, 1e-4, mu_dtype=moments, nu_dtype=moments, param_update=mode
    )
    opt.step()  # creates the state

    def run(k):
        for _ in range(k):
            opt.step()

    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    held = sum(t.nbytes for t in params) + sum(t.nbytes for t in state)
    return run, held, None


def measure(framework, shp, rounds, k):
    make = jax_variant if framework == "jax" else torch_variant
    built = {name: make(shp, *spec) for name, spec in VARIANTS.items()}
    for run, _, _ in built.values():
        run(1)  # compile / warm up
    times = {name: [] for name in built}
    for _ in range(rounds):
        order = list(built)
        random.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            built[name][0](k)
            times[name].append((time.perf_counter() - t0) / k)
    base = built["float32_master"][1]
    rows = []
    for name, (_, held, temp) in built.items():
        ratios = [
            t / b for t, b in zip(times[name], times["float32_master"], strict=True)
        ]
        rows.append(
            {
                "framework": framework,
                "variant": name,
                "state_bytes": held,
                "bytes_vs_float32": held / base,
                "temp_bytes": temp,
                "ms_per_step": 1e3 * statistics.median(times[name]),
                "time_vs_float32": statistics.median(ratios),
            }
        )
    return rows


def table(rows) -> str:
    out = [
        "| framework | variant | param + state bytes | vs float32 master | "
        "XLA temp bytes | ms / step | time vs float32 master |",
        "|---" * 7 + "|",
    ]
    for r in rows:
        temp = "-" if r["temp_bytes"] is None else str(r["temp_bytes"])
        out.append(
            f"| {r['framework']} | {r['variant']} | {r['state_bytes']} | "
            f"{r['bytes_vs_float32']:.2f} | {temp} | {r['ms_per_step']:.2f} | "
            f"{r['time_vs_float32']:.2f} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    random.seed(0)
    shp = shapes(args.width, args.layers)
    n = sum(int(np.prod(s)) for s in shp)
    rows = []
    for fw in ("jax", "torch"):
        rows += measure(fw, shp, args.rounds, args.steps)
    text = table(rows)
    header = (
        f"{n:,} parameters (width {args.width}, {args.layers} blocks), "
        f"{args.rounds} rounds of {args.steps} steps, torch 1 thread"
    )
    print(header + "\n\n" + text)
    if not args.no_write:
        out = os.path.join(ROOT, "benchmarks", "results", "bench_low_precision_cpu")
        with open(out + ".json", "w", encoding="utf-8") as f:
            json.dump({"parameters": n, "args": vars(args), "rows": rows}, f, indent=2)
            f.write("\n")
        with open(out + ".md", "w", encoding="utf-8") as f:
            f.write(
                "# low_precision_adamw vs float32 master weights (CPU)\n\n"
                "`python benchmarks/bench_low_precision.py`: "
                + header
                + ".\n\n"
                + text
                + "\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
