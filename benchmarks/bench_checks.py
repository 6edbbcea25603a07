"""What the check points cost per train step, JAX and PyTorch, one run.

    python benchmarks/bench_checks.py [--steps 150] [--cpus 1]

The contrastive task's stable train step (examples/contrastive: CNN image
tower + masked-mean text tower, float32 `info_nce`, default sizes: batch 32
of 32x32 images, bfloat16 compute, clip 1.0, skip non-finite) in two
variants per framework, on copies of the same initial weights and the same
batches:

  with     the loss marks five check points (`diagnostics.check_points`:
           inputs, image_emb, text_emb, logits, loss; a finite flag and a
           max |x| each, the logits point recomputing the (32, 32) float32
           similarities) and returns them in ``aux`` with the logit scale.
  without  the same loss, ``checks=False``: ``aux`` holds the logit scale only.

JAX: `jaxstable.train.make_train_step` (jitted); torch:
`torchref.train.TrainStep` with bfloat16 autocast. Timing: the two variants
of a framework interleaved batch by batch (load changes on a shared machine
hit both alike), the first step (compile) left out; each JAX step ends with
`jax.block_until_ready`, torch on CPU is synchronous. Reported: the median
step time of each variant and the median over batches of the paired ratio
with/without - 1 (with its interquartile range). Also the host cost when
`fit` logs a step: the median time of `diagnostics.check_record` on the
step's ``aux`` (one device-to-host read of the flags and maxima).

CPUs: pinned to ``--cpus`` cores (default 1, torch one intra-op thread, as
`bench_step.py`; 0: no pinning). Writes benchmarks/results/bench_checks_cpu.md
and .json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

RESULTS = _ROOT / "benchmarks" / "results"


def _pin(cpus: int) -> None:
    if cpus > 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cpus])


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def _summary(times: dict[str, list[float]], reads: list[float]) -> dict:
    ratios = [w / wo - 1 for w, wo in zip(times["with"], times["without"], strict=True)]
    lo, mid, hi = _quartiles(ratios)
    return {
        "with_ms": statistics.median(times["with"]) * 1e3,
        "without_ms": statistics.median(times["without"]) * 1e3,
        "overhead": mid,
        "overhead_iqr": [lo, hi],
        "record_read_ms": statistics.median(reads) * 1e3,
        "steps_timed": len(ratios),
    }


def _jax_steps(cfg, weights):
    """{variant: (step, state)} of the JAX stable step."""
    from examples import harness
    from examples.contrastive import convert, loss_jax, model_jax
    from examples.contrastive.parts_torch import build_model
    from jaxstable import train, transforms

    graphdef, params = model_jax.split(
        convert.nnx_from_torch(build_model(cfg, weights))
    )
    out = {}
    for name, checks in (("with", True), ("without", False)):

        def loss_fn(p, s, batch, checks=checks):
            img, txt, log_scale = model_jax.apply(
                graphdef, p, batch["image"], batch["tokens"], safe=True
            )
            out = loss_jax.stable_loss(
                img, txt, log_scale, batch["image"], checks=checks
            )
            return out, s

        tx = transforms.stable_optimizer(harness.jax_optimizer(cfg), max_grad_norm=1.0)
        state = train.TrainState.create(params=params, optimizer=tx)
        step = train.make_train_step(
            loss_fn, has_state=True, has_aux=True, policy=cfg.policy
        )
        out[name] = (step, state)
    return out


def bench_jax(cfg, weights, batches) -> dict:
    """Interleaved step times of the JAX variants, and the record read."""
    import jax

    from jaxstable import diagnostics

    batches = [jax.device_put(jax.tree.map(jax.numpy.asarray, b)) for b in batches]
    steps = _jax_steps(cfg, weights)
    states = {k: v[1] for k, v in steps.items()}
    times, reads = {k: [] for k in steps}, []
    for i, b in enumerate(batches):
        for name, (step, _) in steps.items():
            t = time.perf_counter()
            states[name], m = step(states[name], b)
            jax.block_until_ready((states[name], m))
            if i:  # step 0 compiles
                times[name].append(time.perf_counter() - t)
            if i and name == "with":
                t = time.perf_counter()
                diagnostics.check_record(m["aux"])
                reads.append(time.perf_counter() - t)
    return _summary(times, reads)


def bench_torch(cfg, weights, batches) -> dict:
    """Interleaved step times of the torch variants, and the record read."""
    import torch

    from examples import harness
    from examples.contrastive import loss_torch
    from examples.contrastive.task import TASK
    from torchref import diagnostics, train

    parts = TASK.torch_parts(cfg, weights)
    batches = [parts.to_torch(b) for b in batches]
    steps = {}
    for name, checks in (("with", True), ("without", False)):

        def loss_fn(m, batch, checks=checks):
            img, txt = m(batch["image"], batch["tokens"], safe=True)
            with torch.autocast("cpu", enabled=False):  # float32 info_nce
                return loss_torch.stable_loss(
                    img, txt, m.logit_scale, batch["image"], checks=checks
                )

        model = copy.deepcopy(parts.model)
        steps[name] = train.TrainStep(
            model,
            harness.torch_optimizer(cfg, model.parameters()),
            loss_fn,
            max_grad_norm=1.0,
            scaler=None,
            autocast_dtype=torch.bfloat16,
        )
    times, reads = {k: [] for k in steps}, []
    for i, b in enumerate(batches):
        for name, step in steps.items():
            t = time.perf_counter()
            m = step(b)
            if i:  # the first step warms the allocator and autocast caches
                times[name].append(time.perf_counter() - t)
            if i and name == "with":
                t = time.perf_counter()
                diagnostics.check_record(m["aux"])
                reads.append(time.perf_counter() - t)
    return _summary(times, reads)


def _markdown(payload: dict) -> str:
    c = payload["config"]
    lines = [
        "# Check point cost (`benchmarks/bench_checks.py`)",
        "",
        f"Device: **{payload['cpu']}**, {payload['cpus_used']} CPU core(s) used "
        f"(pinned), load average {payload['load_start']} at start / "
        f"{payload['load_end']} at end; {payload['versions']}.",
        f"Task: contrastive stable step, batch {c['batch_size']} of "
        f"{c['image_size']}x{c['image_size']} images, width {c['width']}, bfloat16 "
        f"compute, {payload['steps']} steps (the first, compiling, left out); the "
        "two variants interleaved batch by batch. Overhead = median over steps of "
        "the paired ratio with/without - 1 [interquartile range]. One run; the "
        "machine is shared with other jobs.",
        "",
        "| framework | with check points ms/step | without ms/step | overhead | IQR "
        "| `check_record` when logged, ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for fw, r in payload["results"].items():
        lo, hi = r["overhead_iqr"]
        lines.append(
            f"| {fw} | {r['with_ms']:.2f} | {r['without_ms']:.2f} | "
            f"{r['overhead'] * 100:+.1f}% | [{lo * 100:+.1f}%, {hi * 100:+.1f}%] | "
            f"{r['record_read_ms']:.3f} |"
        )
    lines += [
        "",
        "Unused, the check points cost nothing: a loss that marks none compiles "
        "to the same program (no extra output, no extra `is_finite`; "
        "jaxstable/tests/test_diagnostics.py checks it), and `fit` only looks "
        "for them in `aux`.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Runs the comparison, prints it and writes benchmarks/results/."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--cpus", type=int, default=1, help="cores to pin to (0: all)")
    p.add_argument("--frameworks", default="jax,torch")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    _pin(args.cpus)
    import torch

    if args.cpus > 0:
        torch.set_num_threads(args.cpus)
    import jax
    from _device import cpu_name  # benchmarks/ is on sys.path as a script

    from examples.contrastive.task import TASK

    cfg = TASK.get_config(steps=args.steps, train_pairs=32 * args.steps)
    cfg = cfg.replace(precision="bfloat16", mode="stable")  # whole batches only
    weights, batches = TASK.initial_weights(cfg), TASK.train_batches(cfg)
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results = {}
    for fw in args.frameworks.split(","):
        bench = {"jax": bench_jax, "torch": bench_torch}[fw]
        results[fw] = bench(cfg, weights, batches)
    payload = {
        "cpu": cpu_name(),
        "cpus_used": len(os.sched_getaffinity(0)),
        "load_start": load_start,
        "load_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "versions": f"jax {jax.__version__}, torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        "steps": args.steps,
        "config": {k: getattr(cfg, k) for k in ("batch_size", "image_size", "width")},
        "results": results,
    }
    text = _markdown(payload)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "bench_checks_cpu.json").write_text(json.dumps(payload, indent=2))
        (RESULTS / "bench_checks_cpu.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
