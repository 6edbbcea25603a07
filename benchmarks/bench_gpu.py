"""GPU benchmarks: cross-entropy against the bandwidth floor and torch.compile,
and the guarded train step against plain and compiled torch steps.

Written to run on a CUDA device (``make gpu-check`` calls it); ``--device cpu
--tiny`` runs the same code paths at toy sizes on a CPU, which is how the
test suite keeps it working on machines without a GPU (its numbers mean
nothing there).

Cross-entropy (fwd+bwd = value and d loss / d logits, bf16 and fp16 logits),
at the sizes users train with: Cityscapes crops 8x512x1024x19, ADE20K
(150 classes), COCO (80), ImageNet classification (1000), a language-model
vocabulary (32000). Variants:

  ours          jit(value_and_grad(jaxstable.losses.softmax_cross_entropy))
                with JAXSTABLE_CE_KERNEL=1: on a GPU the Pallas kernel
                (jaxstable/_src/_ce_kernel.py) where it applies (the default
                on a GPU is the XLA path, ours_xla's program)
  ours_xla      the same loss by its XLA path, the kernel's fallback (on a
                CPU, where the kernel never runs, the same program as ours);
                its value and gradient must match ours (checked each row)
  naive_optax   the same with optax's softmax_cross_entropy_with_integer_labels
                in the logits' dtype, masked mean
  torch_float   F.cross_entropy(x.float(), y, ignore_index) + backward
  torch_compile torch.compile of torch_float's loss (skipped with --no-compile)

Bandwidth floor: the bytes a fwd+bwd must move at least (read the logits and
the labels, write the gradient) divided by the device-to-device copy
bandwidth measured in the same run (``jnp.copy`` of a 1 GiB buffer, bytes
read + written). ``floor / time`` is reported (goal: >= 0.70) with the peak
memory (JAX: compiled temp + arguments + outputs; torch:
``max_memory_allocated`` above the inputs).

Guarded segmentation step (examples/segmentation's U-Net, fp16 and bf16
compute): JAX guarded (`jaxstable.train.make_train_step` with
`stable_optimizer` and `DynamicLossScale`) vs JAX plain (optax Adam), torch
`torchref.train.TrainStep` (GradScaler's per-step `.item()` sync included)
vs a plain torch autocast step and its `torch.compile`.

Timing: every repetition runs each variant once in a fresh random order
(interleaved); medians; the device is synchronised around each call. Ratios
come from this one run. Writes ``benchmarks/results/bench_gpu_<backend>.{md,json}``
(``--out`` to change the folder) with the device, driver and library versions.

Run: python benchmarks/bench_gpu.py [--device cuda|cpu] [--tiny] [--reps N]
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
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.nn.functional as F

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # examples/ and the packages, run as a script
    sys.path.insert(0, str(_ROOT))

from jaxstable import losses  # noqa: E402
from jaxstable._src.losses.cross_entropy import _ce_rows  # noqa: E402

IGNORE = 255
RESULTS = _ROOT / "benchmarks" / "results"
# name: (leading shape, classes, fraction of ignored labels)
CE_SHAPES = {
    "cityscapes 8x512x1024x19": ((8, 512, 1024), 19, 0.1),
    "ade20k 8x128x128x150": ((8, 128, 128), 150, 0.05),
    "coco 8x128x128x80": ((8, 128, 128), 80, 0.05),
    "classification 4096x1000": ((4096,), 1000, 0.0),
    "language model 8192x32000": ((8192,), 32000, 0.0),
}
CE_TINY = {
    "tiny 2x8x8x19": ((2, 8, 8), 19, 0.1),
    "tiny 64x1000": ((64,), 1000, 0.0),
}
FLOOR_GOAL = 0.70


def _sync_torch(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved(variants: dict[str, Callable[[], None]], reps: int, sync) -> dict:
    """Median seconds per call of each variant, run in a random order per rep."""
    times = {n: [] for n in variants}
    for fn in variants.values():  # warm-up / compile
        fn()
        sync()
    order = list(variants)
    for _ in range(reps):
        random.shuffle(order)
        for n in order:
            sync()
            t0 = time.perf_counter()
            variants[n]()
            sync()
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(ts) for n, ts in times.items()}


def copy_bandwidth(n_bytes: int) -> float:
    """Bytes/s of a device-to-device copy through JAX (read + written)."""
    x = jnp.zeros(n_bytes // 4, jnp.float32)
    copy = jax.jit(lambda a: a + 0)
    copy(x).block_until_ready()
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        copy(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return 2 * x.size * 4 / statistics.median(ts)


def _jax_ce(variant: str):
    """jit(value_and_grad) of the variant named: ours, ours_xla or naive_optax."""

    def ours(x, y):
        # The kernel, asked for: since the 2026-11-28 H200 run (the kernel
        # slower than the XLA path on 8 of 10 rows) the default on a GPU is
        # the XLA path. The switch is read while the loss is traced.
        before = os.environ.get("JAXSTABLE_CE_KERNEL")
        os.environ["JAXSTABLE_CE_KERNEL"] = "1"
        try:
            return losses.softmax_cross_entropy(x, y, ignore_index=IGNORE)
        finally:
            if before is None:
                del os.environ["JAXSTABLE_CE_KERNEL"]
            else:
                os.environ["JAXSTABLE_CE_KERNEL"] = before

    def ours_xla(x, y):  # the kernel's fallback: the loss's own XLA rows
        valid = y != IGNORE
        per = _ce_rows(x, y, None, IGNORE, 0.0, 0.0)
        return jnp.sum(per) / jnp.maximum(jnp.sum(valid), 1).astype(per.dtype)

    def naive_ce(x, y):
        valid = y != IGNORE
        per = optax.softmax_cross_entropy_with_integer_labels(x, jnp.where(valid, y, 0))
        return jnp.sum(jnp.where(valid, per, 0)) / jnp.maximum(jnp.sum(valid), 1)

    fns = {"ours": ours, "ours_xla": ours_xla, "naive_optax": naive_ce}
    return jax.jit(jax.value_and_grad(fns[variant]))


def _jax_peak_bytes(fn, *args) -> int:
    m = fn.lower(*args).compile().memory_analysis()
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def _ce_case(x32, y, dtype, reps, device, compile_torch, bw) -> dict:
    jx = jnp.asarray(x32).astype(dtype)
    jy = jnp.asarray(y)
    ours, naive, ours_xla = map(_jax_ce, ("ours", "naive_optax", "ours_xla"))
    # The kernel computes what its fallback does (bf16/fp16 gradients: a
    # rounding apart); a wrong kernel must not be timed as a fast one.
    (v, g), (v_ref, g_ref) = ours(jx, jy), ours_xla(jx, jy)
    np.testing.assert_allclose(float(v), float(v_ref), rtol=1e-4)
    g, g_ref = np.asarray(g, np.float32), np.asarray(g_ref, np.float32)
    np.testing.assert_allclose(g, g_ref, rtol=2e-2, atol=1e-2 * np.abs(g_ref).max())
    tx = torch.tensor(x32).to(device=device, dtype=getattr(torch, dtype))
    if tx.ndim > 2:  # NHWC -> NCHW (class dim 1, torch's convention)
        tx = tx.movedim(-1, 1).contiguous()
    tx.requires_grad_(True)
    ty = torch.tensor(y, dtype=torch.int64, device=device)

    def torch_loss(x, t):
        return F.cross_entropy(x.float(), t, ignore_index=IGNORE)

    def run_torch(fn=torch_loss):
        tx.grad = None
        fn(tx, ty).backward()

    variants = {
        "ours": lambda: ours(jx, jy)[1].block_until_ready(),
        "ours_xla": lambda: ours_xla(jx, jy)[1].block_until_ready(),
        "naive_optax": lambda: naive(jx, jy)[1].block_until_ready(),
        "torch_float": run_torch,
    }
    if compile_torch:
        compiled = torch.compile(torch_loss)
        variants["torch_compile"] = lambda: run_torch(compiled)
    med = interleaved(variants, reps, lambda: _sync_torch(device))
    floor_s = (2 * jx.size * jx.dtype.itemsize + jy.size * 4) / bw
    peak = {
        "ours": _jax_peak_bytes(ours, jx, jy),
        "ours_xla": _jax_peak_bytes(ours_xla, jx, jy),
        "naive_optax": _jax_peak_bytes(naive, jx, jy),
    }
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run_torch()
        torch.cuda.synchronize()
        peak["torch_float"] = torch.cuda.max_memory_allocated() - base
    return {
        "dtype": dtype,
        "median_s": med,
        "floor_s": floor_s,
        "fraction_of_floor": {n: floor_s / t for n, t in med.items()},
        "peak_bytes": peak,
    }


def bench_ce(shapes, reps: int, device: str, compile_torch: bool, bw: float):
    rows = []
    for name, (lead, n_classes, ignore_frac) in shapes.items():
        rng = np.random.default_rng(0)
        x32 = (rng.normal(size=(*lead, n_classes)) * 3).astype(np.float32)
        y = rng.integers(0, n_classes, size=lead).astype(np.int32)
        y[rng.random(lead) < ignore_frac] = IGNORE
        for dtype in ("bfloat16", "float16"):
            row = _ce_case(x32, y, dtype, reps, device, compile_torch, bw)
            rows.append({"shape": name, **row})
    return rows


def bench_step(reps: int, device: str, tiny: bool, compile_torch: bool):
    """Guarded vs plain segmentation train steps, fp16 and bf16 compute."""
    batch, hw, width, depth = (2, 16, 4, 1) if tiny else (16, 256, 32, 3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 3, hw, hw)).astype(np.float32)
    y = rng.integers(0, 19, size=(batch, hw, hw)).astype(np.int64)
    rows = []
    for dtype in ("float16", "bfloat16"):
        med = interleaved(
            _step_variants(x, y, dtype, width, depth, device, compile_torch),
            reps,
            lambda: _sync_torch(device),
        )
        rows.append(
            {
                "dtype": dtype,
                "shape": f"{batch}x{hw}x{hw}x3, width {width}, depth {depth}",
                "median_s": med,
                "jax_guard_overhead": med["jax_guarded"] / med["jax_plain"] - 1,
                # The yardstick: TrainStep against the torch.amp recipe.
                "torch_guard_overhead": med["torch_trainstep"] / med["torch_amp_recipe"]
                - 1,
            }
        )
    return rows


# dtype -> (TrainStep call, torch.amp recipe call), filled by _step_variants.
PROFILE_TARGETS: dict = {}


def profile_torch_steps(device: str, out: Path) -> str:
    """torch.profiler tables of 5 TrainStep and 5 recipe steps (float16)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(ProfilerActivity.CUDA)
    text = []
    names = ("TrainStep", "torch.amp recipe")
    for name, fn in zip(names, PROFILE_TARGETS["float16"], strict=True):
        for _ in range(3):
            fn()
        _sync_torch(device)
        with profile(activities=acts) as prof:
            for _ in range(5):
                fn()
            _sync_torch(device)
        ka = prof.key_averages()
        syncs = sum(e.count for e in ka if e.key == "aten::_local_scalar_dense")
        launches = sum(e.count for e in ka if e.key == "cudaLaunchKernel")
        text += [
            f"## {name}: 5 float16 steps; .item() syncs {syncs}, "
            f"kernel launches {launches}",
            ka.table(sort_by="self_cpu_time_total", row_limit=25),
        ]
    body = "\n".join(text)
    (out / f"profile_torch_step_{'gpu' if device == 'cuda' else 'cpu'}.txt").write_text(
        body
    )
    return body


def _step_variants(x, y, dtype, width, depth, device, compile_torch):
    from examples.segmentation import convert, model_jax, model_torch
    from jaxstable import loss_scale as jls
    from jaxstable import train as jtrain
    from jaxstable import transforms
    from torchref import loss_scale as tls
    from torchref import losses as tlosses
    from torchref import train as ttrain

    torch.manual_seed(0)
    tmodel = model_torch.UNet(3, 19, width=width, depth=depth)
    graphdef, params, stats = model_jax.split(convert.nnx_from_torch(tmodel))
    tmodel.to(device)
    jb = {"image": jnp.asarray(x.transpose(0, 2, 3, 1)), "label": jnp.asarray(y)}
    cdt = jnp.dtype(dtype)

    def loss_fn(p, s, b):
        logits, new_s = model_jax.apply(graphdef, p, s, b["image"], train=True)
        return losses.softmax_cross_entropy(logits, b["label"]), new_s

    ls = jls.DynamicLossScale() if dtype == "float16" else jls.NoOpLossScale()
    gstate = jtrain.TrainState.create(
        params=params,
        optimizer=transforms.stable_optimizer(optax.adam(1e-3), max_grad_norm=1.0),
        loss_scale=ls,
        model_state=stats,
    )
    gstep = jtrain.make_train_step(
        loss_fn, has_state=True, policy=f"params=float32,compute={dtype},output=float32"
    )
    tx = optax.adam(1e-3)

    @jax.jit
    def plain(p, o, s, b):
        def f(p):
            pc = jax.tree.map(lambda a: a.astype(cdt), p)
            logits, new_s = model_jax.apply(
                graphdef, pc, s, b["image"].astype(cdt), train=True
            )
            return losses.softmax_cross_entropy(logits, b["label"]), new_s

        (loss, new_s), g = jax.value_and_grad(f, has_aux=True)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, new_s, loss

    box = {"g": gstate, "p": (params, tx.init(params), stats)}

    def run_guarded():
        box["g"], m = gstep(box["g"], jb)
        jax.block_until_ready(m["loss"])

    def run_plain():
        p, o, s, loss = plain(*box["p"], jb)
        box["p"] = (p, o, s)
        loss.block_until_ready()

    tdt = getattr(torch, dtype)
    tb = (torch.tensor(x, device=device), torch.tensor(y, device=device))

    def tloss(m, b):
        return tlosses.softmax_cross_entropy(m(b[0]), b[1])

    def train_step(model, check_update=True):
        return ttrain.TrainStep(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-3),
            tloss,
            max_grad_norm=1.0,
            scaler=tls.DynamicLossScale() if dtype == "float16" else None,
            autocast_dtype=tdt if device == "cuda" else None,
            check_update=check_update,
        )

    tstep = train_step(tmodel)
    pmodel = model_torch.UNet(3, 19, width=width, depth=depth).to(device)
    popt = torch.optim.Adam(pmodel.parameters(), lr=1e-3)

    def torch_plain_step(b):
        popt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=tdt, enabled=device == "cuda"):
            loss = tlosses.softmax_cross_entropy(pmodel(b[0]), b[1])
        loss.backward()
        popt.step()

    # The standard torch.amp recipe the guard is measured against: GradScaler
    # (float16 only), unscale_, clip_grad_norm_, scaler.step, scaler.update.
    rmodel = model_torch.UNet(3, 19, width=width, depth=depth).to(device)
    ropt = torch.optim.Adam(rmodel.parameters(), lr=1e-3)
    rscaler = torch.amp.GradScaler(device, enabled=dtype == "float16")

    def torch_amp_recipe(b):
        ropt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=tdt, enabled=device == "cuda"):
            loss = tlosses.softmax_cross_entropy(rmodel(b[0]), b[1])
        rscaler.scale(loss).backward()
        rscaler.unscale_(ropt)
        torch.nn.utils.clip_grad_norm_(rmodel.parameters(), 1.0)
        rscaler.step(ropt)
        rscaler.update()

    nstep = train_step(
        model_torch.UNet(3, 19, width=width, depth=depth).to(device),
        check_update=False,
    )
    variants = {
        "jax_plain": run_plain,
        "jax_guarded": run_guarded,
        "torch_trainstep": lambda: tstep(tb),
        "torch_trainstep_no_update_check": lambda: nstep(tb),
        "torch_amp_recipe": lambda: torch_amp_recipe(tb),
        "torch_plain": lambda: torch_plain_step(tb),
    }
    PROFILE_TARGETS[dtype] = (lambda: tstep(tb), lambda: torch_amp_recipe(tb))
    if compile_torch:
        compiled = torch.compile(torch_plain_step)
        variants["torch_compile_plain"] = lambda: compiled(tb)
    return variants


def device_info(device: str) -> dict:
    info = {
        "jax": jax.__version__,
        "jax_devices": [str(d) for d in jax.devices()],
        "torch": torch.__version__,
        "torch_device": device,
        "python": platform.python_version(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            info["driver"] = "unknown"
    return info


def to_markdown(payload: dict) -> str:
    d = payload["device"]
    lines = [
        "# GPU benchmarks (`benchmarks/bench_gpu.py`)",
        "",
        f"Device: {d.get('gpu', d['torch_device'])}, driver {d.get('driver', '-')}; "
        f"jax {d['jax']} ({', '.join(d['jax_devices'])}), torch {d['torch']}; "
        f"Python {d['python']}. {payload['reps']} interleaved reps, medians. "
        f"Copy bandwidth measured in this run: {payload['copy_bandwidth'] / 1e9:.1f} "
        "GB/s (read + written).",
        "",
        "## Cross-entropy fwd+bwd",
        "",
        "| shape | dtype | variant | median ms | fraction of floor | peak MiB |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in payload["cross_entropy"]:
        for n, t in r["median_s"].items():
            peak = r["peak_bytes"].get(n)
            peak_s = f"{peak / 2**20:.1f}" if peak is not None else "-"
            lines.append(
                f"| {r['shape']} | {r['dtype']} | {n} | {t * 1e3:.3f} "
                f"| {r['fraction_of_floor'][n]:.2f} | {peak_s} |"
            )
    lines += [
        "",
        f"Goal: ours >= {FLOOR_GOAL:.0%} of the floor and faster than torch.compile.",
        "",
        "## Guarded segmentation step",
        "",
        "| dtype | shape | variant | median ms |",
        "|---|---|---|---:|",
    ]
    for r in payload["train_step"]:
        for n, t in r["median_s"].items():
            lines.append(f"| {r['dtype']} | {r['shape']} | {n} | {t * 1e3:.3f} |")
        lines.append(
            f"| {r['dtype']} | | guard overhead JAX / torch "
            f"| {r['jax_guard_overhead'] * 100:+.1f}% / "
            f"{r['torch_guard_overhead'] * 100:+.1f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="toy sizes (smoke test)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--only", choices=("all", "ce", "step"), default="all")
    ap.add_argument(
        "--profile", action="store_true", help="torch.profiler tables of the steps"
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu.py: torch sees no CUDA device; nothing was run")
        return 2
    if args.device == "cuda" and jax.default_backend() != "gpu":
        print("bench_gpu.py: jax sees no GPU; nothing was run")
        return 2
    random.seed(0)
    if args.tiny:  # a smoke test: one torch thread, no OpenMP oversubscription
        torch.set_num_threads(1)
    bw = copy_bandwidth(2**20 if args.tiny else 2**30)
    compile_torch = not args.no_compile
    payload = {
        "device": device_info(args.device),
        "reps": args.reps,
        "copy_bandwidth": bw,
        "cross_entropy": []
        if args.only == "step"
        else bench_ce(
            CE_TINY if args.tiny else CE_SHAPES,
            args.reps,
            args.device,
            compile_torch,
            bw,
        ),
        "train_step": []
        if args.only == "ce"
        else bench_step(args.reps, args.device, args.tiny, compile_torch),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.profile and payload["train_step"]:
        print(profile_torch_steps(args.device, out))
    tag = "gpu" if args.device == "cuda" else "cpu_smoke"
    if args.only != "all":
        tag += f"_{args.only}"
    (out / f"bench_gpu_{tag}.json").write_text(json.dumps(payload, indent=2))
    md = to_markdown(payload)
    (out / f"bench_gpu_{tag}.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
