"""Cost of `diagnostics.locate` against one train step, JAX and PyTorch.

Models (both frameworks, same shapes, same ops), float32 weights, Adam(1e-3)
through the guarded step (`make_train_step` + `stable_optimizer` with
clipping 1.0; torch `TrainStep(max_grad_norm=1.0)`), loss in float32:

  mlp          64 layers 512 x 512 (+ bias), ReLU between them: 16.8 M
               parameters (67 MB), batch 64 (the case of issue 27).
  transformer  12 pre-LayerNorm blocks, width 128, 4 heads, MLP 512,
               sequence 64, batch 8, softmax attention written out (q k^T /
               sqrt(d), softmax, @ v), mean-squared loss: 2.4 M parameters.

Each model also holds a parameter of 4 zeros that the loss multiplies by 0
(its gradient is exactly 0). Three steps per model, each located:

  finite    every value finite. JAX: locate runs the compiled step, finds
            it applied, and returns None (the cost of one step); torch
            re-runs forward, backward and the update op by op (its full
            cost) and returns None.
  overflow  the last layer's weights 1e5 x larger and the step in float16
            (JAX policy ``compute=float16``, torch autocast): the forward
            overflows in the last layer; locate stops at the loss, before
            the backward.
  update    Adam with eps=0: the update of a zero gradient is 0 / 0 (the
            zero parameter's, and any weight of a dead ReLU unit's); locate
            runs forward, backward and the update op by op (the full cost)
            and names the parameter whose path sorts first.

Measured per (framework, model, step): the median wall time of one step
(compiled and warm for JAX; eager torch) and of one `locate` call, and
their ratio, and the first `locate` call's time; memory above the level
before the call: for torch the peak resident set (RSS) read by a thread
sampling ``/proc/self/statm`` every 0.2 ms (glibc returns blocks of 1 MB and
more to the system at once: ``MALLOC_MMAP_THRESHOLD_=1048576`` is set, by
re-running this script with it, so that RSS goes down when memory is
freed); for JAX, whose CPU allocator keeps what it frees, the compiled
step's own temporaries and outputs (``memory_analysis()``) and the peak
bytes of live jax arrays during `locate` (sampled every 1 ms); and
`locate`'s own deterministic count of the bytes it holds.

Interleaved: each round runs step, locate, step, locate ... for every case
in a fresh random order (one untimed warm-up call of each first); medians
over rounds; one run. Parameters are reported in MB so the memory rows read
as multiples of the model.

Run: .venv/bin/python benchmarks/bench_locate.py  (writes benchmarks/results/)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

# Freed blocks of >= 1 MB go back to the system at once, so that the RSS
# sampled after one call does not stay at an earlier call's peak.
if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "1048576":
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "1048576"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from _device import cpu_name
from flax import nnx

from jaxstable import diagnostics as jd
from jaxstable import train as jt
from jaxstable import transforms as jtx
from jaxstable._src import locate_trace as jengine
from torchref import diagnostics as td
from torchref import train as tt
from torchref._src import locate_trace as tengine

FP16 = "params=float32,compute=float16,output=float32"
PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1 << 20


# ------------------------------------------------------------------ memory
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _jax_live() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


class PeakMemory:
    """Peak memory above the level at entry, sampled by a thread: the
    resident set (torch; glibc returns freed blocks of 1 MB and more), or
    the bytes of the live jax arrays (JAX: XLA's CPU allocator keeps what it
    frees, so its resident set does not go down between calls)."""

    def __init__(self, framework: str):
        self.read = _rss if framework == "torch" else _jax_live
        self.every = 0.0002 if framework == "torch" else 0.001

    def __enter__(self):
        self.start = self.peak = self.read()
        self.done = False
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done:
            self.peak = max(self.peak, self.read())
            time.sleep(self.every)

    def __exit__(self, *exc):
        self.done = True
        self.thread.join()
        self.peak = max(self.peak, self.read())
        self.extra = self.peak - self.start
        return False


# ------------------------------------------------------------------ models
class JaxMLP(nnx.Module):
    def __init__(self, depth, width, last_scale):
        keys = nnx.Rngs(0)
        # He initialisation: activations keep their scale through 64 ReLU
        # layers (they would halve at each with the default, 1e-10 at the
        # end: a float16 zero).
        he = nnx.initializers.he_normal()
        self.layers = nnx.List(
            [nnx.Linear(width, width, kernel_init=he, rngs=keys) for _ in range(depth)]
        )
        self.layers[-1].kernel[...] *= last_scale
        self.unused = nnx.Param(jnp.zeros(4))

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jax.nn.relu(x)
        return x


class TorchMLP(torch.nn.Module):
    def __init__(self, depth, width, last_scale):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(width, width) for _ in range(depth)
        )
        with torch.no_grad():
            for layer in self.layers:
                torch.nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            self.layers[-1].weight.mul_(last_scale)
        self.unused = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class JaxBlock(nnx.Module):
    def __init__(self, d, heads, hidden, rngs):
        self.heads = heads
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.qkv, self.out = (
            nnx.Linear(d, 3 * d, rngs=rngs),
            nnx.Linear(d, d, rngs=rngs),
        )
        self.fc1, self.fc2 = (
            nnx.Linear(d, hidden, rngs=rngs),
            nnx.Linear(hidden, d, rngs=rngs),
        )

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        q, k, v = (
            z.reshape(b, t, self.heads, d // self.heads).transpose(0, 2, 1, 3)
            for z in (q, k, v)
        )
        att = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / (d // self.heads) ** 0.5, -1)
        x = x + self.out((att @ v).transpose(0, 2, 1, 3).reshape(b, t, d))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x)), approximate=True))


class TorchBlock(torch.nn.Module):
    def __init__(self, d, heads, hidden):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (
            z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
            for z in (q, k, v)
        )
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, -1)
        x = x + self.out((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(
            torch.nn.functional.gelu(self.fc1(self.ln2(x)), approximate="tanh")
        )


class JaxTransformer(nnx.Module):
    def __init__(self, depth, d, heads, hidden, last_scale):
        rngs = nnx.Rngs(0)
        self.blocks = nnx.List([JaxBlock(d, heads, hidden, rngs) for _ in range(depth)])
        self.blocks[-1].fc2.kernel[...] *= last_scale
        self.unused = nnx.Param(jnp.zeros(4))

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class TorchTransformer(torch.nn.Module):
    def __init__(self, depth, d, heads, hidden, last_scale):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            TorchBlock(d, heads, hidden) for _ in range(depth)
        )
        with torch.no_grad():
            self.blocks[-1].fc2.weight.mul_(last_scale)
        self.unused = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


MODELS = {
    # name: (jax class, torch class, constructor args, input shape)
    "mlp": (JaxMLP, TorchMLP, (64, 512), (64, 512)),
    "transformer": (JaxTransformer, TorchTransformer, (12, 128, 4, 512), (8, 64, 128)),
}


def _jax_case(model: str, kind: str):
    jcls, _, args, shape = MODELS[model]
    overflow = kind == "overflow"
    graphdef, params = nnx.split(jcls(*args, last_scale=1e5 if overflow else 1.0))

    def loss_fn(p, x):
        m = nnx.merge(graphdef, p)
        out = m(x).astype(jnp.float32)
        return jnp.mean(out**2) + 0.0 * jnp.sum(m.unused[...])

    step = jt.make_train_step(loss_fn, policy=FP16 if overflow else None)
    adam = optax.adam(1e-3, eps=0.0 if kind == "update" else 1e-8)
    tx = jtx.stable_optimizer(adam, max_grad_norm=1.0)
    state = jt.TrainState.create(params=params, optimizer=tx)
    x = jnp.asarray(np.random.default_rng(0).normal(size=shape).astype(np.float32))
    n_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
    # What the compiled step allocates beyond its arguments (XLA's own
    # count: temporaries and outputs).
    mem = step.lower(state, x).compile().memory_analysis()
    step_bytes = mem.temp_size_in_bytes + mem.output_size_in_bytes

    def run_step():
        jax.block_until_ready(step(state, x))

    def run_locate():
        return jd.locate(step, state, x)

    return run_step, run_locate, n_bytes, step_bytes


def _torch_case(model: str, kind: str):
    _, tcls, args, shape = MODELS[model]
    overflow = kind == "overflow"
    torch.manual_seed(0)
    net = tcls(*args, last_scale=1e5 if overflow else 1.0)
    eps = 0.0 if kind == "update" else 1e-8
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, eps=eps)
    step = tt.TrainStep(
        net,
        opt,
        lambda m, x: (m(x).float() ** 2).mean() + 0.0 * m.unused.sum(),
        max_grad_norm=1.0,
        autocast_dtype=torch.float16 if overflow else None,
    )
    x = torch.tensor(np.random.default_rng(0).normal(size=shape).astype(np.float32))
    n_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    # The step changes the model: time it on a copy restored before each
    # call, so every call sees the same weights as locate.
    start = {k: v.clone() for k, v in net.state_dict().items()}

    def run_step():
        step(x)
        with torch.no_grad():
            for k, v in net.state_dict().items():
                v.copy_(start[k])
        opt.state.clear()

    def run_locate():
        return td.locate(step, x)

    return run_step, run_locate, n_bytes, None


def measure(rounds: int):
    cases = {}
    for fw, make in (("jax", _jax_case), ("torch", _torch_case)):
        for model in MODELS:
            for kind in ("finite", "overflow", "update"):
                run_step, run_locate, n_bytes, step_bytes = make(model, kind)
                run_step()  # compiles (JAX)
                t0 = time.perf_counter()
                loc = run_locate()  # the first call: traces, eager op caches
                first = time.perf_counter() - t0
                phase = "none" if loc is None else loc.phase
                want = {"finite": "none", "overflow": "forward", "update": "update"}
                assert phase == want[kind], (fw, model, kind, loc)
                cases[(fw, model, kind)] = {
                    "step": run_step,
                    "locate": run_locate,
                    "param_mb": n_bytes / MB,
                    "phase": phase,
                    "path": None if loc is None else loc.path,
                    "times": {"step": [], "locate": []},
                    "mem": {"step": [], "locate": []},
                    "step_bytes": step_bytes,
                    "held": [],
                    "first_ms": first * 1e3,
                }
    keys = list(cases)
    for r in range(rounds):
        random.Random(r).shuffle(keys)
        for key in keys:
            c = cases[key]
            for what in ("step", "locate"):
                engine = jengine if key[0] == "jax" else tengine
                engine.stats["peak_live_bytes"] = 0
                with PeakMemory(key[0]) as mem:
                    t0 = time.perf_counter()
                    c[what]()
                    dt = time.perf_counter() - t0
                c["times"][what].append(dt)
                c["mem"][what].append(mem.extra)
                if what == "locate":
                    c["held"].append(engine.stats["peak_live_bytes"])
        print(f"round {r + 1}/{rounds}", flush=True)
    rows = []
    for (fw, model, kind), c in cases.items():
        ts, tl = (statistics.median(c["times"][w]) for w in ("step", "locate"))
        ms, ml = (statistics.median(c["mem"][w]) / MB for w in ("step", "locate"))
        if c["step_bytes"] is not None:
            ms = c["step_bytes"] / MB
        rows.append(
            {
                "framework": fw,
                "model": model,
                "step_kind": kind,
                "phase": c["phase"],
                "path": c["path"],
                "param_mb": c["param_mb"],
                "step_ms": ts * 1e3,
                "locate_ms": tl * 1e3,
                "first_locate_ms": c["first_ms"],
                "time_ratio": tl / ts,
                "step_mb": ms,
                "locate_mb": ml,
                "locate_mb_x_params": ml / c["param_mb"],
                "locate_held_mb": statistics.median(c["held"]) / MB,
            }
        )
    return rows


def to_markdown(payload) -> str:
    lines = [
        "# Cost of `diagnostics.locate` vs one train step "
        "(`benchmarks/bench_locate.py`)",
        "",
        f"Device: **{payload['device']}**; {payload['versions']}. "
        f"Load average {payload['load_start']} at start / {payload['load_end']} "
        "at end.",
        "",
        f"Interleaved, {payload['rounds']} rounds (random order per round); "
        "medians; one run. The step is the guarded one (Adam, clipping), "
        "compiled (JAX) or eager (torch); `first locate` is the first call "
        "in the process (JAX: tracing and the compilation of each distinct "
        "eager op, cached for later calls). Memory above the level before "
        "the call: JAX step, XLA's compiled temporaries and outputs; JAX "
        "locate, the peak bytes of live jax arrays (sampled every 1 ms); "
        "torch, the peak resident set (sampled every 0.2 ms). `held` is "
        "locate's own count of the bytes it keeps (values it computed still "
        "alive, masks and the gradients in JAX; copies, masks and the "
        "gradients in torch).",
        "",
        "| framework | model | step | located | params MB | step ms | locate ms "
        "| locate / step | first locate ms | step MB | locate MB "
        "| locate MB / params | held MB |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in payload["rows"]:
        where = r["phase"] if r["path"] is None else f"{r['phase']} {r['path']}"
        lines.append(
            f"| {r['framework']} | {r['model']} | {r['step_kind']} | {where} "
            f"| {r['param_mb']:.1f} | {r['step_ms']:.1f} | {r['locate_ms']:.0f} "
            f"| {r['time_ratio']:.1f}x | {r['first_locate_ms']:.0f} "
            f"| {r['step_mb']:.0f} | {r['locate_mb']:.0f} "
            f"| {r['locate_mb_x_params']:.2f} | {r['locate_held_mb']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = measure(args.rounds)
    platform_name = jax.devices()[0].platform
    payload = {
        "device": f"{cpu_name()}, {os.cpu_count()} cores visible ({platform_name}; "
        "torch 1 intra-op thread)",
        "versions": f"jax {jax.__version__}, torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        "load_start": load_start,
        "load_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "rounds": args.rounds,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = platform_name
    (out / f"bench_locate_{tag}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / f"bench_locate_{tag}.md").write_text(to_markdown(payload))
    print(to_markdown(payload))


if __name__ == "__main__":
    main()
