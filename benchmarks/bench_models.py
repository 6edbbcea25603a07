"""The guard's cost on real-model shapes: guarded step vs plain recipe, torch and JAX.

Four models, each built in this repository (`benchmarks/_models.py`, torch
`nn.Module` and Flax NNX, no download) with the real model's structure and
parameter leaves, at a width and input a 2-core CPU runs in minutes (real:
params, leaves; here: params, leaves, input):

- resnet18 (torchvision resnet18): 11.7M, 62; here 0.18M, 62 (stage widths
  8-64, 1/8 of the real ones), 96x96 images, 10 classes.
- unet_r18_d3 (segmentation_models_pytorch ``Unet("resnet18",
  encoder_depth=3)``): 11.3M of which 0.8M get a gradient, 80; here 0.19M of
  which 0.02M get one, 80; 48x48 images, 19 classes.
- gpt2_small (GPT-2 small, tied embeddings): 124M, 148; here 0.86M, 148
  (d 64, 12 blocks, vocabulary 4096), 32 tokens.
- vit_small (ViT-S/16): 22M, 152; here 0.62M, 152 (d 64, 12 blocks), 32x32
  images in patches of 8 (17 tokens).

How they were scaled, and why. Widths shrink (a parameter count shrinks
with the square of a width) and the depth, the layer kinds and so the
number of parameter leaves stay: the guard's cost grows with the
parameters' elements and with their leaf count (a per-leaf kernel, a
per-leaf fusion), the step's compute with its FLOPs. The U-Net keeps the
share of its encoder that gets no gradient (smp's depth-3 U-Net never runs
resnet18's stages 3 and 4, 10.5M of its 11.3M parameters; here 89% of the
parameters get none, 93% there). GPT-2 keeps the embedding's share of the
parameters (31%: the vocabulary shrinks with the width). What could not be
kept in minutes per model on 2 cores at bf16 (this CPU has no bf16 matmul unit):
the FLOPs per parameter. A step's compute per parameter grows with the
positions each weight is applied at (pixels, tokens), and those shrank more
than the widths: the table in the results gives XLA's FLOP count per
parameter of each scaled step, against the real model's at the same batch
(resnet18 at 224x224, GPT-2 at 1024 tokens, ViT-S at 224x224). Every
scaled model does fewer FLOPs per parameter than the real one, so the
optimizer's and the guard's share of a step is LARGER here than on the real
model: a ratio that meets a bound here meets it there (conservative), and a
ratio that misses it here may meet it there. The other way: a CPU without
a bf16 matmul unit (AVX512-BF16 or AMX; the one of the committed run has
none: a 2048x512 by 512x512 matmul ran at 26 GFLOP/s in bf16 and 115 in
float32 on one core) makes the torch steps' bf16 compute slow and the
guard's share of them small; `--torch-autocast none` measures float32.

Rows, per model, batch size (2 and 16) and optimizer:

- torch (bf16 autocast on CPU, as the issue measured): the torch.amp recipe
  (GradScaler + `clip_grad_norm_(1.0)` + the optimizer, written inline)
  against `torchref.train.TrainStep(max_grad_norm=1.0,
  scaler=DynamicLossScale(), autocast_dtype=bfloat16)` with every other
  setting at its default (the update check on). Optimizers: AdamW fused,
  AdamW foreach, SGD momentum 0.9 (foreach).
- JAX (float32: XLA:CPU computes bf16 through float32 conversions, which
  would add the same work to both steps and hide the guard): optax's own
  `chain(clip_by_global_norm(1.0), opt)` in a jitted value_and_grad step
  against `jaxstable.train.make_train_step` over
  `stable_optimizer(opt, max_grad_norm=1.0)` and `DynamicLossScale()` (clip,
  skip, loss scale, update check), the plain optimizer without clip as
  context. Optimizers: AdamW and SGD momentum; one XLA:CPU compile of a
  guarded step took 1-3 minutes at a load average of 10 on the
  2-core machine of the committed run, so the default run compiles
  AdamW at both batch sizes and SGD momentum at batch 2 (the smaller batch,
  where the guard's share is larger); `--jax-all` adds SGD at 16.
  Parameters without a gradient: an NNX model's unused stages get zero
  gradients, and optax updates them like any other (a JAX user freezes
  them with `optax.masked`; the U-Net row measures the optimizer holding
  them).

Time: every variant of one (model, batch) runs interleaved with the others
(`bench_step.measure`: a fresh random order per round, one untimed step
before each timed block), and the ratio is of the medians of the per-step
times, one run. Memory: torch, the peak of the bytes the CPU allocator holds
while a variant is built and runs two steps (`torch.profiler` with
``profile_memory``: every tensor allocation and free, summed in order; on
CUDA `torch.cuda.max_memory_allocated`); JAX, the compiled step's
`memory_analysis()` (arguments + outputs + temporaries, no donation) and
XLA's cost analysis ("bytes accessed").

The committed rows come from two runs, ``--only jax --rounds 21`` and
``--only torch --rounds 21`` (about 5 and 3 minutes on a quiet 2-core
machine): in one process that interleaved both frameworks, the torch steps
between the JAX ones made the JAX guarded step 1.17x optax's on the U-Net
at batch 16, against 1.01x in a process of its own.

Run: python benchmarks/bench_models.py   (writes benchmarks/results/)
     python benchmarks/bench_models.py --only torch   (torch rows only; the
         JAX rows of the committed results are kept)
     python benchmarks/bench_models.py --quick --out /tmp/x   (smoke test)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import flax
import jax
import numpy as np
import optax
import torch
from _device import cpu_name  # benchmarks/ is on sys.path when run as a script
from _models import NNX_MODELS, REAL_SHAPES, SHAPES, TORCH_MODELS
from bench_step import measure
from flax import nnx

from jaxstable import loss_scale as jls
from jaxstable import losses as jlosses
from jaxstable import train as jtrain
from jaxstable import transforms
from torchref import loss_scale as tls
from torchref import losses as tlosses
from torchref import train as ttrain

RESULTS = Path(__file__).resolve().parent / "results"
MAX_GRAD_NORM = 1.0
JAX_BOUND = 1.05  # issue 33: guarded <= 1.05x optax's clip + the same optimizer
TORCH_BOUND = 1.05  # issue 33: TrainStep <= 1.05x the torch.amp recipe
ALL_CPUS = sorted(os.sched_getaffinity(0))  # before any pinning

TORCH_OPTS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(
        ps, lr=1e-3, weight_decay=0.01, fused=True
    ),
    "adamw_foreach": lambda ps: torch.optim.AdamW(
        ps, lr=1e-3, weight_decay=0.01, foreach=True
    ),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
}
JAX_OPTS = {
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.01),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
}
# (optimizer, batch) -> the JAX variants compiled for it (see the docstring).
JAX_MATRIX = {
    ("adamw", 2): ("guarded", "optax_clip", "plain"),
    ("adamw", 16): ("guarded", "optax_clip"),
    ("sgd_momentum", 2): ("guarded", "optax_clip"),
}
JAX_ALL = {**JAX_MATRIX, ("sgd_momentum", 16): ("guarded", "optax_clip")}


def quick_shape(s):
    """--quick: the same structure, two blocks / tiny inputs (a smoke test)."""
    if s.kind in ("gpt", "vit"):
        return dataclasses.replace(s, depth=2, width=16, size=16, classes=64)
    return dataclasses.replace(s, width=4, size=32)


# ------------------------------------------------------------------- data
def make_batch(s, batch: int, seed: int = 0):
    """Inputs and labels in numpy: NCHW images (torch); JAX takes NHWC."""
    rng = np.random.default_rng(seed)
    if s.kind == "gpt":
        x = rng.integers(0, s.classes, (batch, s.size)).astype(np.int32)
        return x, rng.integers(0, s.classes, (batch, s.size)).astype(np.int32)
    x = rng.standard_normal((batch, 3, s.size, s.size)).astype(np.float32)
    shape = (batch, s.size, s.size) if s.kind == "unet" else (batch,)
    return x, rng.integers(0, s.classes, shape).astype(np.int32)


# ------------------------------------------------------------------ torch
def torch_variants(s, x, y, device: str, opts, autocast: str = "bfloat16") -> dict:
    """name -> factory() -> (run(k), sanity()) for the torch rows."""
    torch.manual_seed(0)
    init = TORCH_MODELS[s.kind](s).state_dict()
    xt = torch.from_numpy(x).to(device)
    if s.kind == "gpt":
        xt = xt.long()
    yt = torch.from_numpy(y.astype(np.int64)).to(device)
    dim = -1 if s.kind == "gpt" else 1
    kind = "cuda" if device.startswith("cuda") else "cpu"
    dtype = None if autocast == "none" else getattr(torch, autocast)

    def loss_fn(model, batch):
        return tlosses.softmax_cross_entropy(model(batch[0]), batch[1], dim=dim)

    def fresh(opt):
        model = TORCH_MODELS[s.kind](s).to(device)
        model.load_state_dict(init)
        model.train()
        return model, TORCH_OPTS[opt](list(model.parameters()))

    def sync():
        if kind == "cuda":
            torch.cuda.synchronize()

    def recipe(opt):
        model, optimizer = fresh(opt)
        scaler = tls.DynamicLossScale().make_scaler(device)
        last = {}

        def run(k):
            for _ in range(k):
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(kind, dtype=dtype, enabled=dtype is not None):
                    loss = loss_fn(model, (xt, yt))
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                scaler.step(optimizer)
                scaler.update()
            last["loss"] = loss
            sync()

        return run, lambda: {"loss": float(last["loss"].detach()), "skipped": 0}

    def guarded(opt):
        model, optimizer = fresh(opt)
        step = ttrain.TrainStep(
            model,
            optimizer,
            loss_fn,
            max_grad_norm=MAX_GRAD_NORM,
            scaler=tls.DynamicLossScale(),
            autocast_dtype=dtype,
        )
        last = {}

        def run(k):
            for _ in range(k):
                last["m"] = step((xt, yt))
            sync()

        return run, lambda: {
            "loss": float(last["m"]["loss"]),
            "skipped": int(last["m"]["skipped_total"]),
        }

    out = {}
    for opt in opts:
        out[f"torch/{opt}/recipe"] = lambda opt=opt: recipe(opt)
        out[f"torch/{opt}/trainstep"] = lambda opt=opt: guarded(opt)
    return out


def torch_peak_bytes(factory, device: str, steps: int = 2) -> int:
    """Peak bytes the allocator holds while `factory` builds a variant (model,
    optimizer, step object) and runs `steps` steps: everything it allocates
    (parameters, optimizer state, gradients, activations, the guard's
    copies), the batch excluded (allocated before)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run, _ = factory()
        run(steps)
        peak = torch.cuda.max_memory_allocated() - base
        del run
        return peak
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run, _ = factory()
        run(steps)
        del run
        gc.collect()
    events = prof.profiler.kineto_results.events()
    mem = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    )
    live = peak = 0
    for _, n in mem:
        live += n
        peak = max(peak, live)
    return peak


# -------------------------------------------------------------------- JAX
def _plain_step(loss_fn, tx):
    def step(params, opt_state, model_state, batch):
        (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, model_state, batch
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, model_state, loss

    return step


def jax_variants(s, x, y, opts_variants, workers: int = 2) -> tuple[dict, dict]:
    """name -> factory, and name -> compiled-program facts. Every program is
    lowered here and compiled up front (`workers` at a time: XLA compiles
    one program on one thread)."""
    model = NNX_MODELS[s.kind](s, nnx.Rngs(0))
    model.train()
    loss_fn = jtrain.nnx_loss(
        model, lambda m, b: jlosses.softmax_cross_entropy(m(b[0]), b[1])
    )
    _, params, model_state = nnx.split(model, nnx.Param, ...)
    xj = x if s.kind == "gpt" else x.transpose(0, 2, 3, 1)
    batch = (jax.numpy.asarray(xj), jax.numpy.asarray(y))
    lowered = {}
    for opt, variants in opts_variants:
        for variant in variants:
            name = f"jax/{opt}/{variant}"
            if variant == "guarded":
                tx = transforms.stable_optimizer(
                    JAX_OPTS[opt](), max_grad_norm=MAX_GRAD_NORM
                )
                state = jtrain.TrainState.from_nnx(
                    model, tx, loss_scale=jls.DynamicLossScale()
                )
                step = jtrain.make_train_step(loss_fn, has_state=True)
                lowered[name] = (step.lower(state, batch), (state, batch))
            else:
                tx = JAX_OPTS[opt]()
                if variant == "optax_clip":
                    tx = optax.chain(optax.clip_by_global_norm(MAX_GRAD_NORM), tx)
                args = (params, tx.init(params), model_state, batch)
                lowered[name] = (jax.jit(_plain_step(loss_fn, tx)).lower(*args), args)
    # Compile on every CPU even when the timing is pinned to one: Linux
    # affinity is per thread, and the pool's threads inherit this one's
    # (JAX's own thread pool was sized and pinned when it started).
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, ALL_CPUS or pinned)
    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            compiled = dict(
                zip(lowered, pool.map(_compile, lowered.values()), strict=True)
            )
    finally:
        os.sched_setaffinity(0, pinned)
    facts, factories = {}, {}
    for name, c in compiled.items():
        cost = c.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        mem = c.memory_analysis()
        facts[name] = {
            "bytes_accessed": float(cost["bytes accessed"]),
            "flops": float(cost.get("flops", 0.0)),
            "fusions": c.as_text().count(" fusion("),
            "temp_bytes": int(mem.temp_size_in_bytes),
            "peak_bytes": int(
                mem.argument_size_in_bytes
                + mem.output_size_in_bytes
                + mem.temp_size_in_bytes
                - mem.alias_size_in_bytes
            ),
        }
        factories[name] = _jax_factory(name, c, lowered[name][1])
    return factories, facts


def _compile(lowered_and_args):
    return lowered_and_args[0].compile()


def _jax_factory(name, compiled, args):
    def factory():
        carry = {"args": args, "out": None}

        def run(k):
            for _ in range(k):
                out = compiled(*carry["args"])
                if name.endswith("/guarded"):
                    carry["args"] = (out[0], carry["args"][1])
                else:
                    carry["args"] = (*out[:3], carry["args"][3])
                carry["out"] = out
            jax.block_until_ready(carry["args"][0])

        def sanity():
            out = carry["out"]
            if name.endswith("/guarded"):
                m = jax.device_get(out[1])
                return {"loss": float(m["loss"]), "skipped": int(m["skipped_total"])}
            return {"loss": float(out[3]), "skipped": 0}

        return run, sanity

    return factory


def real_shape_cost(name: str, batch: int = 2) -> dict:
    """XLA's bytes and FLOPs of the guarded and the optax-clip AdamW steps at
    the real model's size (`_models.REAL_SHAPES`), compiled from abstract
    values: nothing is allocated or run, so a CPU compiles GPT-2 small at
    2 x 1024 tokens in a minute or two."""
    s = REAL_SHAPES[name]
    model = nnx.eval_shape(lambda: NNX_MODELS[s.kind](s, nnx.Rngs(0)))
    model.train()
    loss_fn = jtrain.nnx_loss(
        model, lambda m, b: jlosses.softmax_cross_entropy(m(b[0]), b[1])
    )
    _, params, model_state = nnx.split(model, nnx.Param, ...)
    if s.kind == "gpt":
        x = y = jax.ShapeDtypeStruct((batch, s.size), np.int32)
    else:
        x = jax.ShapeDtypeStruct((batch, s.size, s.size, 3), np.float32)
        shape = (batch, s.size, s.size) if s.kind == "unet" else (batch,)
        y = jax.ShapeDtypeStruct(shape, np.int32)
    guarded_tx = transforms.stable_optimizer(
        JAX_OPTS["adamw"](), max_grad_norm=MAX_GRAD_NORM
    )
    state = jax.eval_shape(
        lambda p, m: jtrain.TrainState.create(
            params=p,
            optimizer=guarded_tx,
            loss_scale=jls.DynamicLossScale(),
            model_state=m,
        ),
        params,
        model_state,
    )
    clip_tx = optax.chain(optax.clip_by_global_norm(MAX_GRAD_NORM), JAX_OPTS["adamw"]())
    lowered = {
        "guarded": jtrain.make_train_step(loss_fn, has_state=True).lower(state, (x, y)),
        "optax_clip": jax.jit(_plain_step(loss_fn, clip_tx)).lower(
            params, jax.eval_shape(clip_tx.init, params), model_state, (x, y)
        ),
    }
    out = {"params": sum(p.size for p in jax.tree.leaves(params)), "batch": batch}
    for variant, lo in lowered.items():
        cost = lo.compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        out[variant] = {
            "bytes_accessed": float(cost["bytes accessed"]),
            "flops": float(cost["flops"]),
        }
    g, c = out["guarded"], out["optax_clip"]
    out["bytes_ratio"] = g["bytes_accessed"] / c["bytes_accessed"]
    out["flops_ratio"] = g["flops"] / c["flops"]
    out["flops_per_param_per_sample"] = c["flops"] / out["params"] / batch
    return out


# ------------------------------------------------------------------- runs
def param_counts(s) -> dict:
    model = TORCH_MODELS[s.kind](s)
    n = sum(p.numel() for p in model.parameters())
    return {"params": n, "leaves": len(list(model.parameters()))}


def trained_params(s, x, y) -> int:
    """Parameters that get a gradient in torch (the others' grad stays None)."""
    model = TORCH_MODELS[s.kind](s).eval()  # batch norm on one sample: eval
    xt = torch.from_numpy(x[:1])
    if s.kind == "gpt":
        xt = xt.long()
    out = model(xt).float()
    out.sum().backward()
    return sum(p.numel() for p in model.parameters() if p.grad is not None)


def run_one(name, s, batch, args, jax_matrix) -> dict:
    x, y = make_batch(s, batch)
    out = {"model": name, "batch": batch, "torch": {}, "jax": {}}
    variants = {}
    if args.only in ("all", "torch"):
        facts = torch_variants(
            s, x, y, args.device, args.torch_opts, args.torch_autocast
        )
        for v, factory in facts.items():
            out["torch"].setdefault(v, {})["peak_bytes"] = torch_peak_bytes(
                factory, args.device
            )
            variants[v] = factory()
    if args.only in ("all", "jax"):
        plan = [(o, vs) for (o, b), vs in jax_matrix.items() if b == batch]
        t0 = time.perf_counter()
        factories, facts = jax_variants(s, x, y, plan, workers=args.compile_workers)
        out["jax_compile_s"] = time.perf_counter() - t0
        for v, f in facts.items():
            out["jax"][v] = dict(f)
            variants[v] = factories[v]()
    per_step = measure(variants, args.rounds, args.k, args.warmup)
    for v, ts in per_step.items():
        fw = v.split("/")[0]
        out[fw][v]["median_ms"] = statistics.median(ts) * 1e3
        out[fw][v]["per_step_s"] = ts
        out[fw][v]["sanity"] = variants[v][1]()
        if out[fw][v]["sanity"]["skipped"] or not np.isfinite(
            out[fw][v]["sanity"]["loss"]
        ):
            raise RuntimeError(f"{v} did not train cleanly: {out[fw][v]['sanity']}")
    return out


def ratios(row: dict) -> dict:
    """The row's ratios: torch TrainStep / recipe, JAX guarded / optax clip."""
    r = {"torch": {}, "jax": {}}
    t = row["torch"]
    for opt in {v.split("/")[1] for v in t}:
        a, b = t[f"torch/{opt}/trainstep"], t[f"torch/{opt}/recipe"]
        r["torch"][opt] = {
            "time": a["median_ms"] / b["median_ms"],
            "peak": a["peak_bytes"] / b["peak_bytes"],
            "recipe_ms": b["median_ms"],
            "peak_mb": (a["peak_bytes"] / 2**20, b["peak_bytes"] / 2**20),
        }
    j = row["jax"]
    for opt in {v.split("/")[1] for v in j}:
        g, c = j[f"jax/{opt}/guarded"], j[f"jax/{opt}/optax_clip"]
        d = {
            "time": g["median_ms"] / c["median_ms"],
            "bytes": g["bytes_accessed"] / c["bytes_accessed"],
            "peak": g["peak_bytes"] / c["peak_bytes"],
            "temp": g["temp_bytes"] / max(c["temp_bytes"], 1),
            "clip_ms": c["median_ms"],
            "clip_flops": c["flops"],
        }
        p = j.get(f"jax/{opt}/plain")
        if p:
            d["time_vs_plain"] = g["median_ms"] / p["median_ms"]
            d["bytes_vs_plain"] = g["bytes_accessed"] / p["bytes_accessed"]
        r["jax"][opt] = d
    return r


def git_commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return sha + (" (with uncommitted changes)" if dirty else "")


def device_info(args, loadavg_start, commit) -> dict:
    return {
        "cpu": cpu_name(),
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "cores": os.cpu_count(),
        "cpus_pinned": len(os.sched_getaffinity(0)),
        "loadavg_start": loadavg_start,
        "loadavg_end": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "flax": flax.__version__,
        "optax": optax.__version__,
        "torch": torch.__version__,
        "torch_device": args.device,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "git_commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


# ---------------------------------------------------------------- report
def _mark(ratio: float, bound: float, digits: int = 2) -> str:
    return f"{ratio:.{digits}f}" + ("" if ratio <= bound else " **>**")


def _span(values: list[float], digits: int = 2) -> str:
    lo, hi = min(values), max(values)
    if f"{lo:.{digits}f}" == f"{hi:.{digits}f}":
        return f"{lo:.{digits}f}"
    return f"{lo:.{digits}f}-{hi:.{digits}f}"


def summary_table(payload: dict) -> str:
    """One line per model: the smallest and largest ratio over its rows
    (batch sizes and optimizers). The README and the docs carry this table
    between ``<!-- bench_models:summary -->`` markers (`--update-docs`)."""
    real = payload.get("real_shape_cost", {})
    lines = [
        "| model | torch `TrainStep` / recipe: time | peak memory "
        "| JAX guarded / optax clip: time | bytes accessed "
        "| bytes at the real size |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in [n for n in SHAPES if n in payload["models"]]:
        rows = [r["ratios"] for r in payload["rows"] if r["model"] == name]
        torch_r = [v for r in rows for v in r["torch"].values()]
        jax_r = [v for r in rows for v in r["jax"].values()]
        cells = [
            _span([v["time"] for v in torch_r]) if torch_r else "",
            _span([v["peak"] for v in torch_r]) if torch_r else "",
            _span([v["time"] for v in jax_r]) if jax_r else "",
            _span([v["bytes"] for v in jax_r], 3) if jax_r else "",
            f"{real[name]['bytes_ratio']:.3f}" if name in real else "",
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


DOCS_WITH_SUMMARY = ("README.md", "benchmarks/README.md", "docs/guard.md")
SUMMARY_START, SUMMARY_END = "<!-- bench_models:summary -->", "<!-- /bench_models -->"


def update_docs(payload: dict) -> list[str]:
    """Rewrites the summary table between the markers in `DOCS_WITH_SUMMARY`;
    returns the files changed."""
    root = Path(__file__).resolve().parents[1]
    table = summary_table(payload)
    changed = []
    for rel in DOCS_WITH_SUMMARY:
        path = root / rel
        text = path.read_text()
        if SUMMARY_START not in text:
            continue
        head, rest = text.split(SUMMARY_START, 1)
        _, tail = rest.split(SUMMARY_END, 1)
        new = f"{head}{SUMMARY_START}\n{table}\n{SUMMARY_END}{tail}"
        if new != text:
            path.write_text(new)
            changed.append(rel)
    return changed


def _provenance(rows: list[dict]) -> str:
    """Which run measured which rows (a run of some models, or of one
    framework, keeps the other rows of the last results)."""
    runs: dict[str, list[str]] = {}
    for r in rows:
        for fw, tag in r.get("measured", {}).items():
            label = f"{r['model']} {fw}"
            runs.setdefault(tag, [])
            if label not in runs[tag]:
                runs[tag].append(label)
    return (
        "Measured: "
        + "; ".join(f"{', '.join(labels)} on {tag}" for tag, labels in runs.items())
        + "."
    )


def to_markdown(payload: dict) -> str:
    d, cfg = payload["device"], payload["config"]
    lines = [
        "# The guard's cost on real-model shapes (`benchmarks/bench_models.py`)",
        "",
        "Each row is one run on one machine: **"
        + (f"{d['gpu']}** (host: {d['cpu']})" if d.get("gpu") else f"{d['cpu']}**")
        + ", "
        f"{d['cores']} cores visible, "
        f"process pinned to {d['cpus_pinned']} (`--cpus`); the last run's "
        f"load average {d['loadavg_start']} at start / {d['loadavg_end']} at "
        "end (the "
        "machine was shared with other jobs: ratios of interleaved medians, "
        "absolute times are noisy); "
        f"torch {d['torch']} ({d['torch_device']}, {d['torch_threads']} "
        f"thread(s), autocast {cfg.get('torch_autocast', 'bfloat16')}), "
        f"jax {d['jax']} ({d['jax_backend']}, "
        f"float32), flax {d['flax']}, optax {d['optax']}, Python "
        f"{d['python']}; commit {d['git_commit']}; {d['date']}.",
        _provenance(payload["rows"]),
        f"Interleaved: {cfg['rounds']} rounds x {cfg['k']} steps per variant "
        "per (model, batch), random order per round. Time = ratio of the "
        "median step times. Peak memory: torch, allocator bytes held at the "
        "peak while the variant is built and runs 2 steps (torch.profiler); "
        "JAX, compiled arguments + outputs + temporaries. `**>**`: above the "
        f"{JAX_BOUND}x bound.",
        "",
        "## Summary: smallest-largest ratio over each model's rows",
        "",
        summary_table(payload),
        "",
        f"## Models ({cfg.get('shape_set', 'scaled')} sizes; see the script's "
        "docstring)",
        "",
        "| model | stands for | params | with a gradient | leaves "
        "| FLOPs/param/sample here | at the real size |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    real = payload.get("real_shape_cost", {})
    for name in [n for n in SHAPES if n in payload["models"]]:
        m = payload["models"][name]
        fpp = m.get("flops_per_param_per_sample")
        rfpp = real.get(name, {}).get("flops_per_param_per_sample")
        lines.append(
            f"| {name} | {m['real']} | {m['params'] / 1e6:.2f}M "
            f"| {m['trained'] / 1e6:.3f}M | {m['leaves']} "
            f"| {'' if fpp is None else f'{fpp:.0f}'} "
            f"| {'' if rfpp is None else f'{rfpp:.0f}'} |"
        )
    rows = payload["rows"]
    if any(r["torch"] for r in rows):
        lines += [
            "",
            "## torch: `TrainStep` (defaults) / the torch.amp recipe",
            "",
            "| model | batch | optimizer | recipe ms | time | peak memory "
            "(MiB guarded / recipe) |",
            "|---|---:|---|---:|---:|---|",
        ]
        for r in rows:
            for opt, v in sorted(r["ratios"]["torch"].items()):
                lines.append(
                    f"| {r['model']} | {r['batch']} | {opt} | {v['recipe_ms']:.1f} "
                    f"| {_mark(v['time'], TORCH_BOUND)} | {v['peak']:.2f} "
                    f"({v['peak_mb'][0]:.1f} / {v['peak_mb'][1]:.1f}) |"
                )
    if any(r["jax"] for r in rows):
        lines += [
            "",
            "## JAX: `make_train_step` guarded / optax `clip_by_global_norm` + "
            "the same optimizer",
            "",
            "| model | batch | optimizer | optax clip ms | time | bytes accessed "
            "| peak memory | temp memory | vs plain optimizer: time, bytes |",
            "|---|---:|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            for opt, v in sorted(r["ratios"]["jax"].items()):
                plain = (
                    f"{v['time_vs_plain']:.2f}, {v['bytes_vs_plain']:.3f}"
                    if "time_vs_plain" in v
                    else ""
                )
                lines.append(
                    f"| {r['model']} | {r['batch']} | {opt} | {v['clip_ms']:.1f} "
                    f"| {_mark(v['time'], JAX_BOUND)} "
                    f"| {_mark(v['bytes'], JAX_BOUND, 3)} "
                    f"| {v['peak']:.3f} | {v['temp']:.2f} | {plain} |"
                )
    if real:
        lines += [
            "",
            "## JAX at the real models' size (compiled, not run)",
            "",
            "`--real-cost`: the AdamW steps compiled from abstract values at "
            "the real shapes (resnet18 224x224, the U-Net 256x256 with "
            "decoder widths 64/32/16, GPT-2 small 1024 tokens, ViT-S/16 "
            "224x224), batch 2; XLA's cost analysis, deterministic "
            f"({payload['device'].get('real_cost', '')}).",
            "",
            "| model | params | guarded / optax clip: bytes accessed | FLOPs |",
            "|---|---:|---:|---:|",
        ]
        for name, r in real.items():
            lines.append(
                f"| {name} | {r['params'] / 1e6:.1f}M "
                f"| {_mark(r['bytes_ratio'], JAX_BOUND, 3)} "
                f"| {_mark(r['flops_ratio'], JAX_BOUND, 3)} |"
            )
    return "\n".join(lines)


def merge_previous(payload: dict, path: Path, only: str) -> None:
    """--only torch|jax: keep the other framework's rows from the last run;
    the real-size cost table is kept by every run (`--real-cost` makes it)."""
    if not path.exists():
        return
    old = json.loads(path.read_text())
    if "real_shape_cost" in old:
        payload.setdefault("real_shape_cost", old["real_shape_cost"])
    # The (model, batch) rows this run has not measured (yet: the results
    # are written after every row) keep theirs from the last one.
    measured = {(r["model"], r["batch"]) for r in payload["rows"]}
    kept = [r for r in old["rows"] if (r["model"], r["batch"]) not in measured]
    if kept:
        for name in dict.fromkeys(r["model"] for r in kept):
            payload["models"].setdefault(name, old["models"][name])
        payload["rows"] = kept + payload["rows"]
        payload["rows"].sort(key=lambda r: (list(SHAPES).index(r["model"]), r["batch"]))
        payload["device"]["kept_from_earlier_run"] = {
            "models": sorted({r["model"] for r in kept}),
            "date": old["device"].get("date"),
            "git_commit": old["device"].get("git_commit"),
        }
    if only == "all":
        return
    keep = "jax" if only == "torch" else "torch"
    prev = {(r["model"], r["batch"]): r for r in old["rows"]}
    for r in payload["rows"]:
        o = prev.get((r["model"], r["batch"]))
        if o:
            r[keep] = o[keep]
            r["ratios"][keep] = o["ratios"][keep]
            if keep in o.get("measured", {}):
                r.setdefault("measured", {})[keep] = o["measured"][keep]
    for name, m in payload["models"].items():
        fpp = old["models"].get(name, {}).get("flops_per_param_per_sample")
        if fpp is not None:
            m.setdefault("flops_per_param_per_sample", fpp)
    payload["device"][f"{keep}_from"] = old["device"].get("date", "earlier run")


def add_real_cost(args) -> None:
    """--real-cost: the real-size table, added to the committed results."""
    path = Path(args.out) / "bench_models_cpu.json"
    payload = json.loads(path.read_text())
    cost = {}
    for name in args.models.split(","):
        if name not in REAL_SHAPES:  # the conv net is its own real size
            continue
        t0 = time.perf_counter()
        cost[name] = real_shape_cost(name)
        print(f"{name}: {time.perf_counter() - t0:.0f} s {cost[name]}", flush=True)
    payload["real_shape_cost"] = cost
    payload["device"]["real_cost"] = (
        f"jax {jax.__version__}, commit {git_commit()}, "
        + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    )
    path.write_text(json.dumps(payload, indent=1))
    md = to_markdown(payload)
    path.with_suffix(".md").write_text(md + "\n")
    print(md)
    if args.update_docs:
        print("summary table rewritten in:", ", ".join(update_docs(payload)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--batches", default="2,16")
    ap.add_argument("--only", choices=("all", "torch", "jax"), default="all")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--k", type=int, default=2, help="steps per variant per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--jax-all", action="store_true", help="SGD at batch 16 too")
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    ap.add_argument(
        "--torch-autocast",
        choices=("bfloat16", "float16", "none"),
        default="bfloat16",
        help="autocast dtype of both torch steps (none: float32)",
    )
    ap.add_argument("--cpus", type=int, default=1, help="pin to this many CPUs (0: no)")
    ap.add_argument("--compile-workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    ap.add_argument(
        "--shapes",
        choices=("scaled", "real"),
        default="scaled",
        help="scaled: the CPU sizes above; real: the real models' sizes "
        "(_models.REAL_SHAPES), for a GPU",
    )
    ap.add_argument(
        "--update-docs",
        action="store_true",
        help="also rewrite the summary table in " + ", ".join(DOCS_WITH_SUMMARY),
    )
    ap.add_argument(
        "--real-cost",
        action="store_true",
        help="only compile the JAX AdamW steps at the real models' size and put "
        "XLA's byte and FLOP ratios into the existing results",
    )
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # no profiler start/stop lines
    args.torch_opts = list(TORCH_OPTS)
    jax_matrix = JAX_ALL if args.jax_all else JAX_MATRIX
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here")
    if args.quick:
        args.rounds, args.k, args.warmup = 2, 1, 1
        args.batches = "2"
        args.torch_opts = ["adamw_foreach"]
        jax_matrix = {("adamw", 2): ("guarded", "optax_clip", "plain")}
    if args.cpus:
        # As bench_step: one core for both frameworks, before JAX's CPU
        # backend sizes its thread pool from the affinity mask.
        os.sched_setaffinity(0, ALL_CPUS[: args.cpus])
        torch.set_num_threads(args.cpus)
        jax.devices()  # starts the CPU backend on the pinned CPUs
    if args.real_cost:
        add_real_cost(args)
        return
    loadavg_start = " ".join(f"{v:.2f}" for v in os.getloadavg())
    commit = git_commit()  # the code measured (the tree may change meanwhile)
    run_tag = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()) + f" ({commit[:10]})"
    t_start = time.perf_counter()
    shapes = REAL_SHAPES if args.shapes == "real" else SHAPES
    models, rows = {}, []
    for name in args.models.split(","):
        s = shapes[name]
        if args.quick:
            s = quick_shape(s)
        x, y = make_batch(s, 2)
        models[name] = {
            "real": s.real,
            **param_counts(s),
            "trained": trained_params(s, x, y),
        }
        for batch in (int(b) for b in args.batches.split(",")):
            t0 = time.perf_counter()
            row = run_one(name, s, batch, args, jax_matrix)
            row["ratios"] = ratios(row)
            row["measured"] = {fw: run_tag for fw in ("torch", "jax") if row[fw]}
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            if "adamw" in row["ratios"]["jax"]:
                flops = row["ratios"]["jax"]["adamw"]["clip_flops"]
                fpp = flops / models[name]["params"] / batch
                models[name]["flops_per_param_per_sample"] = fpp
            print(
                f"{name} batch {batch}: {row['wall_s']:.0f} s; "
                + json.dumps(
                    {
                        fw: {o: round(v["time"], 3) for o, v in r.items()}
                        for fw, r in row["ratios"].items()
                    }
                ),
                flush=True,
            )
            # Written after every row: a run stopped at a time limit (a
            # GPU lease) keeps the rows it measured.
            write_results(args, loadavg_start, commit, t_start, shapes, models, rows)
    write_results(
        args, loadavg_start, commit, t_start, shapes, models, rows, final=True
    )


def write_results(
    args, loadavg_start, commit, t_start, shapes, models, rows, final=False
):
    payload = {
        "device": device_info(args, loadavg_start, commit),
        "config": {
            "rounds": args.rounds,
            "k": args.k,
            "warmup": args.warmup,
            "quick": args.quick,
            "only": args.only,
            "torch_autocast": args.torch_autocast,
            "wall_s": time.perf_counter() - t_start,
            "shape_set": args.shapes,
            "shapes": {n: dataclasses.asdict(shapes[n]) for n in models},
        },
        "models": models,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if args.device == "cpu" else "gpu"
    stem = f"bench_models_{tag}" + ("_quick" if args.quick else "")
    merge_previous(payload, out / f"{stem}.json", args.only)
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    md = to_markdown(payload)
    (out / f"{stem}.md").write_text(md + "\n")
    if not final:
        return
    print(md)
    if args.update_docs and not args.quick and args.shapes == "scaled":
        print("summary table rewritten in:", ", ".join(update_docs(payload)))


if __name__ == "__main__":
    main()
