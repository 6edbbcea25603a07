"""`losses.linear_cross_entropy` vs the naive projection + cross-entropy.

What is measured, fwd+bwd (the value and the gradients of hidden and the
output projection), for N tokens, D features and a vocabulary of V (32k and
128k), bf16 and float32 inputs:
  JAX    lean   jit(value_and_grad(jaxstable.losses.linear_cross_entropy))
         naive  jit(value_and_grad(softmax_cross_entropy(hidden @ kernel)))
                (the logits in the inputs' dtype, the library's float32 CE)
  torch  lean   torchref.losses.linear_cross_entropy + backward
         naive  torchref.losses.softmax_cross_entropy(hidden @ weight.T) + backward

JAX memory: the compiled program's temporary buffers,
``jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``
(inputs and outputs excluded: they are the same for both). torch memory: in
a fresh process, the peak resident set during one fwd+bwd minus the
resident set before it (the peak reset through ``/proc/self/clear_refs``;
allocations this large are mmap-ed and returned when freed, so this is the
peak of live memory) minus the two gradients (``hidden.grad``,
``weight.grad``) that both paths must write: like JAX's temp, the memory
above the inputs and the outputs. Time: interleaved reps (each rep
runs every variant of a
framework once, in a fresh random order), medians; ratios come from the same
run. OMP_WAIT_POLICY=PASSIVE is set before torch loads (see bench_losses.py).

Run: .venv/bin/python benchmarks/bench_linear_ce.py [--reps N] [--tokens N]
(writes benchmarks/results/bench_linear_ce_cpu.{md,json})
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import jax
import jax.numpy as jnp
import numpy as np
import torch
from _device import cpu_name  # benchmarks/ is on sys.path when run as a script

from jaxstable import losses as jl
from torchref import losses as tl

RESULTS = Path(__file__).resolve().parent / "results"
VOCABS = (32768, 131072)
DTYPES = ("bfloat16", "float32")
MiB = 2**20


def _inputs(n, d, v, seed=0):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(n, d)).astype(np.float32)
    k = (rng.normal(size=(d, v)) / np.sqrt(d)).astype(np.float32)
    y = rng.integers(0, v, size=n)
    y[::10] = -100  # some ignored tokens (padding)
    return h, k, y


def _jax_fns(y):
    yj = jnp.asarray(y)

    def lean(h, k):
        return jl.linear_cross_entropy(h, k, yj, ignore_index=-100)

    def naive(h, k):
        return jl.softmax_cross_entropy(h @ k, yj, ignore_index=-100)

    return {
        name: jax.jit(jax.value_and_grad(f, (0, 1)))
        for name, f in (("lean", lean), ("naive", naive))
    }


DEVICE = "cpu"  # --device cuda: torch on the GPU (JAX takes its default backend)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _torch_fns(y):
    yt = torch.from_numpy(y).to(DEVICE)

    def lean(h, w):
        return tl.linear_cross_entropy(h, w, yt, ignore_index=-100)

    def naive(h, w):
        return tl.softmax_cross_entropy(h @ w.T, yt, dim=-1, ignore_index=-100)

    return {"lean": lean, "naive": naive}


def _torch_run(f, h, w):
    h.grad = w.grad = None
    f(h, w).backward()
    return h.grad, w.grad


def _torch_inputs(h, k, dtype):
    dt = getattr(torch, dtype)
    th = torch.tensor(h).to(DEVICE, dt).requires_grad_()
    tw = torch.tensor(k.T.copy()).to(DEVICE, dt).requires_grad_()
    return th, tw


def torch_peak_child(args) -> None:
    """In a fresh process: the peak RSS increase of one fwd+bwd, less the
    gradients both paths write (printed)."""
    n, d, v, dtype, name = int(args[0]), int(args[1]), int(args[2]), args[3], args[4]
    h, k, y = _inputs(n, d, v)
    th, tw = _torch_inputs(h, k, dtype)
    del h, k
    f = _torch_fns(y)[name]
    # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the
    # current RSS, so the setup's own peak does not count.
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    _torch_run(f, th, tw)
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (th, tw))
    print((_status_kib("VmHWM") - before) * 1024 - grads)


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def torch_peak_cuda(n, d, v, dtype, name) -> int:
    """On the GPU: the peak of the bytes torch's allocator holds during one
    fwd+bwd above what it held before, less the gradients both paths write."""
    h, k, y = _inputs(n, d, v)
    th, tw = _torch_inputs(h, k, dtype)
    f = _torch_fns(y)[name]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _torch_run(f, th, tw)
    torch.cuda.synchronize()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (th, tw))
    return torch.cuda.max_memory_allocated() - before - grads


def torch_peak(n, d, v, dtype, name) -> int:
    if DEVICE == "cuda":
        return torch_peak_cuda(n, d, v, dtype, name)
    out = subprocess.run(
        [sys.executable, __file__, "--torch-peak", str(n), str(d), str(v), dtype, name],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout.strip().splitlines()[-1])


def bench(n, d, v, dtype, reps):
    h, k, y = _inputs(n, d, v)
    jdt = jnp.dtype(dtype)
    jh, jk = jnp.asarray(h, jdt), jnp.asarray(k, jdt)
    jfns = _jax_fns(y)
    temp = {
        name: f.lower(jh, jk).compile().memory_analysis().temp_size_in_bytes
        for name, f in jfns.items()
    }
    out = {name: f(jh, jk) for name, f in jfns.items()}  # compile, warm up
    jax.block_until_ready(out)
    err = float(abs(out["lean"][0] - out["naive"][0]))
    th, tw = _torch_inputs(h, k, dtype)
    tfns = _torch_fns(y)
    for f in tfns.values():
        _torch_run(f, th, tw)
    _sync()
    times = {f"jax_{k}": [] for k in jfns} | {f"torch_{k}": [] for k in tfns}
    rng = random.Random(0)
    for _ in range(reps):
        order = [("jax", k) for k in jfns] + [("torch", k) for k in tfns]
        rng.shuffle(order)
        for fw, name in order:
            t0 = time.perf_counter()
            if fw == "jax":
                jax.block_until_ready(jfns[name](jh, jk))
            else:
                _torch_run(tfns[name], th, tw)
                _sync()
            times[f"{fw}_{name}"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    peak = {name: torch_peak(n, d, v, dtype, name) for name in tfns}
    return {
        "tokens": n, "features": d, "vocab": v, "dtype": dtype, "reps": reps,
        "jax_temp_bytes": temp, "torch_peak_bytes": peak, "median_s": med,
        "jax_value_abs_diff": err,
        "jax_temp_ratio": temp["lean"] / temp["naive"],
        "jax_time_ratio": med["jax_lean"] / med["jax_naive"],
        "torch_peak_ratio": peak["lean"] / peak["naive"],
        "torch_time_ratio": med["torch_lean"] / med["torch_naive"],
    }  # fmt: skip


def to_markdown(results, device, load=None, load_end=None) -> str:
    where = f"Device: {device}" + (
        "" if load is None else f", load average {load[0]:.1f} at the start"
    )
    if load_end is not None:
        where += f", {load_end[0]:.1f} at the end"
    lines = [
        "# linear_cross_entropy vs naive projection + CE (fwd+bwd)",
        "",
        f"{where}. Ratios lean / naive from one interleaved run, medians.",
        "",
        "| V | dtype | JAX temp lean / naive (MiB) | JAX time lean / naive (ms) "
        "| torch peak above inputs and gradients, lean / naive (MiB) "
        "| torch time lean / naive (ms) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        t, p, m = r["jax_temp_bytes"], r["torch_peak_bytes"], r["median_s"]
        lines.append(
            f"| {r['vocab']} | {r['dtype']} "
            f"| {t['lean'] / MiB:.1f} / {t['naive'] / MiB:.1f} = "
            f"{r['jax_temp_ratio']:.3f} "
            f"| {m['jax_lean'] * 1e3:.3g} / {m['jax_naive'] * 1e3:.3g} = "
            f"{r['jax_time_ratio']:.2f} "
            f"| {p['lean'] / MiB:.1f} / {p['naive'] / MiB:.1f} = "
            f"{r['torch_peak_ratio']:.3f} "
            f"| {m['torch_lean'] * 1e3:.3g} / {m['torch_naive'] * 1e3:.3g} = "
            f"{r['torch_time_ratio']:.2f} |"
        )
    r0 = results[0]
    lines += [
        "",
        f"N = {r0['tokens']} tokens, D = {r0['features']}, 10% of the labels "
        f"ignored, {r0['reps']} reps. Goals (issue 23): temp <= 0.1x naive, "
        "time <= 1.3x naive. " + _unmet(results),
    ]
    return "\n".join(lines) + "\n"


def _unmet(results) -> str:
    """The goals this run missed, named with their ratios."""
    missed = [
        f"{label} at V = {r['vocab']} {r['dtype']} ({r[key]:.2f}x)"
        for r in results
        for key, label, goal in (
            ("jax_temp_ratio", "JAX temp", 0.1),
            ("jax_time_ratio", "JAX time", 1.3),
            ("torch_peak_ratio", "torch memory", 0.1),
            ("torch_time_ratio", "torch time", 1.3),
        )
        if r[key] > goal
    ]
    if not missed:
        return "All met in this run."
    return "Not met in this run: " + "; ".join(missed) + "."


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-peak":
        torch_peak_child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here")
    device = (
        f"{cpu_name()}, {os.cpu_count()} cores (CPU; jax {jax.__version__}, "
        f"torch {torch.__version__})"
    )
    if DEVICE == "cuda":
        device = (
            f"{torch.cuda.get_device_name()} (jax {jax.__version__} on "
            f"{jax.devices()[0]}, torch {torch.__version__})"
        )
    load = os.getloadavg()  # the machine is shared: timings depend on it
    results = []
    for v in VOCABS:
        for dtype in DTYPES:
            r = bench(args.tokens, args.features, v, dtype, args.reps)
            print(json.dumps(r), flush=True)
            results.append(r)
    RESULTS.mkdir(exist_ok=True)
    end = os.getloadavg()
    meta = {
        "device": device, "platform": platform.platform(),
        "load_start": load, "load_end": end,
    }  # fmt: skip
    stem = f"bench_linear_ce_{'gpu' if DEVICE == 'cuda' else 'cpu'}"
    (RESULTS / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1) + "\n"
    )
    text = to_markdown(results, device, load, end)
    (RESULTS / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
