"""Void images on the segmentation task: a dropped micro-batch and a skip list.

A segmentation data set can hold an image with no labelled pixel: a crop
that falls entirely inside a void region (Cityscapes' out-of-ROI and
ego-vehicle "void", VOC's unlabeled border), or an image whose annotation
came out empty. Its label map is 255 everywhere. The mean cross-entropy over
the labelled pixels, as torch's ``F.cross_entropy(logits, labels,
ignore_index=255)`` computes it (the task's loss of `loss_torch.naive_loss`,
and its JAX twin `loss_jax.naive_loss`, here in float32), is then
``0 / 0 = NaN``. With gradient accumulation over one image per micro-batch
(how a segmentation model of large images is usually trained) one such
image makes its micro-batch's loss and gradients NaN, and with them, in the
usual recipe, the whole optimizer step.

Both frameworks, the same run: the task's U-Net (the `--quick` sizes:
16x16 images, width 4, depth 1), float32, batches of 4 images split into
4 micro-batches (``microbatches=4``) with ``drop_non_finite_microbatches=True``
and each micro-batch weighted by its labelled pixels (``microbatch_weight``),
so the step equals the masked mean over the batch's labelled pixels; a
`Checkpointing` every 2 steps with ``resume=True, skip_listed=True`` and
``NanPolicy.stop(max_consecutive=1)``. Two records of the drawn batches are
made void (their labels set to 255 everywhere; the images, and every other
value, are the generator's; no NaN is written into any tensor): image 1 of
batch 3, and all four images of batch 6 (a batch drawn from a shard whose
annotations are empty). Then:

1. ``fit`` runs. Step 3 drops the void image's micro-batch and is applied
   with the other three (``microbatches_dropped`` 1). Step 6 has no valid
   micro-batch: it is non-finite, ``fit`` locates it, the re-run fails the
   same way (``reproduced``), its position goes into ``bad_batches.json``
   beside the checkpoints, and the policy stops the run (a crash).
2. The very same ``fit`` call again (the restart): it resumes from the
   checkpoint at step 6, reads ``bad_batches.json`` and skips batch 6
   without running it; the next record lists it in ``bad_batches_skipped``.
3. A run from the start over the batches without batch 6 (no checkpoint):
   its parameters are compared with the restarted run's, bit for bit.

::

    # results/bad_data.json and report.md's section (both frameworks, ~1 min):
    python -m examples.segmentation.bad_data \\
        --out examples/segmentation/results/bad_data.json \\
        --report examples/segmentation/results/report.md

Example:
    >>> a = parse_args(["--framework", "jax"])
    >>> a.framework, a.steps, VOID
    ('jax', 10, {3: (1,), 6: (0, 1, 2, 3)})
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
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
from examples.segmentation import data  # noqa: E402
from examples.segmentation.task import TASK  # noqa: E402

# batch position -> the images of that batch made void (labels all 255)
VOID = {3: (1,), 6: (0, 1, 2, 3)}
MICROBATCHES = 4  # one image per micro-batch
CHECKPOINT_EVERY = 2
# the record keys the result keeps (those `fit` writes for these events)
KEYS = (
    "step",
    "finite",
    "loss",
    "microbatches_dropped",
    "skip_reason",
    "reproduced",
    "bad_batches_listed",
    "bad_batches_skipped",
)
# the report's column headings of `KEYS`
HEADINGS = (
    "step",
    "finite",
    "loss",
    "dropped",
    "skip reason",
    "reproduced",
    "listed",
    "skipped",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of :func:`main`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("jax", "torch", "both"), default="both")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", help="the result JSON (results/bad_data.json)")
    p.add_argument("--report", help="a report.md to put the section into")
    return p.parse_args(argv)


def make_config(steps: int = 10):
    """The run's settings: the task's quick sizes, batch 4, float32, the
    masked-mean loss (``mode="naive"`` in float32: no low precision).

    Example:
        >>> c = make_config()
        >>> c.image_size, c.batch_size, c.precision, c.mode
        (16, 4, 'float32', 'naive')
    """
    quick = dict(TASK.quick, batch_size=4, steps=steps)
    return TASK.get_config(**quick, precision="float32", mode="naive")


def void_batches(config) -> list[dict[str, np.ndarray]]:
    """The task's train batches with the images of `VOID` made void.

    Example:
        >>> b = void_batches(make_config())
        >>> [int((x["label"] != 255).sum(axis=(1, 2)).min()) for x in b[2:7]]
        [210, 0, 200, 194, 0]
        >>> int((b[6]["label"] != 255).sum())
        0
    """
    batches = TASK.train_batches(config)
    for position, images in VOID.items():
        for i in images:
            batches[position]["label"][i] = data.IGNORE_INDEX
    return batches


def _record(r: dict) -> dict:
    out = {k: r[k] for k in KEYS if k in r}
    loc = r.get("location")
    if loc:
        out["location_phase"] = loc.get("phase")
    if isinstance(out.get("loss"), float) and not np.isfinite(out["loss"]):
        out["loss"] = str(out["loss"])  # JSON has no NaN
    return out


def _three_calls(train, fresh, batches, folder) -> dict:
    """The crash, the restart and the run without the listed batch."""
    ckpt = train.Checkpointing(
        folder, every=CHECKPOINT_EVERY, resume=True, skip_listed=True
    )
    policy = train.NanPolicy.stop(max_consecutive=1)
    run, first = fresh(batches)
    try:
        run(nan_policy=policy, checkpoint=ckpt)
        raise AssertionError("the all-void batch did not stop the run")
    except train.NonFiniteError as e:
        first = {"stopped_at": e.step, "records": [_record(r) for r in e.history]}
    with open(os.path.join(folder, "bad_batches.json"), encoding="utf-8") as f:
        listed = json.load(f)
    run, final = fresh(batches)
    restart = run(nan_policy=policy, checkpoint=ckpt)
    skipped = {p for r in restart for p in r.get("bad_batches_skipped") or ()}
    kept = [b for i, b in enumerate(batches) if i not in skipped]
    never, never_final = fresh(kept)
    never(nan_policy=policy, checkpoint=None)
    return {
        "first_call": first,
        "bad_batches_json": listed,
        "restart": {"records": [_record(r) for r in restart]},
        "equal_to_run_without_listed": bool(
            all(
                np.array_equal(a, b)
                for a, b in zip(final(), never_final(), strict=True)
            )
        ),
    }


def run_jax(config, batches, weights, folder) -> dict:
    """The three calls of `jaxstable.train.fit` (module docstring)."""
    import jax
    import jax.numpy as jnp

    from examples.harness.jax_runner import jax_optimizer
    from jaxstable import train, transforms

    def fresh(data_):
        parts = TASK.jax_parts(config, weights)
        tx = transforms.stable_optimizer(
            jax_optimizer(config), max_grad_norm=config.max_grad_norm
        )
        state = train.TrainState.create(
            params=parts.params, optimizer=tx, model_state=parts.model_state
        )
        step = train.make_train_step(
            parts.loss_fn,
            has_state=True,
            microbatches=MICROBATCHES,
            drop_non_finite_microbatches=True,
            microbatch_weight=lambda b: jnp.sum(b["label"] != data.IGNORE_INDEX),
        )
        box = {}

        def run(**kw):
            box["state"], hist = train.fit(state, step, data_, log=None, **kw)
            return hist

        def params():
            return [
                np.asarray(x) for x in jax.tree_util.tree_leaves(box["state"].params)
            ]

        return run, params

    return _three_calls(train, fresh, batches, folder)


def run_torch(config, batches, weights, folder) -> dict:
    """The three calls of `torchref.train.fit` (module docstring)."""
    from examples.harness.torch_runner import torch_optimizer
    from torchref import train

    def fresh(data_):
        parts = TASK.torch_parts(config, weights)
        model = parts.model
        step = train.TrainStep(
            model,
            torch_optimizer(config, model.parameters()),
            parts.loss_fn,
            max_grad_norm=config.max_grad_norm,
            microbatches=MICROBATCHES,
            drop_non_finite_microbatches=True,
            microbatch_weight=lambda b: (b[1] != data.IGNORE_INDEX).sum(),
        )
        torch_batches = [parts.to_torch(b) for b in data_]

        def run(**kw):
            return train.fit(step, torch_batches, log=None, **kw)

        def params():
            return [p.detach().numpy().copy() for p in model.parameters()]

        return run, params

    return _three_calls(train, fresh, batches, folder)


def _position(result: dict) -> list[int]:
    return [b["position"] if isinstance(b, dict) else b
            for b in result["bad_batches_json"]["batches"]]  # fmt: skip


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]" if value else "[]"
    return str(value)


def table(records: list[dict]) -> str:
    """The records as a markdown table (the keys of `KEYS`, `HEADINGS`).

    Example:
        >>> print(table([{"step": 3, "finite": True, "loss": 2.0,
        ...               "microbatches_dropped": 1}]))
        | step | finite | loss | dropped | skip reason | reproduced | listed | skipped |
        |---|---|---|---|---|---|---|---|
        | 3 | True | 2.0000 | 1 | - | - | - | - |
    """
    lines = ["| " + " | ".join(HEADINGS) + " |", "|" + "---|" * len(KEYS)]
    for r in records:
        lines.append("| " + " | ".join(_cell(r.get(k)) for k in KEYS) + " |")
    return "\n".join(lines)


def section(result: dict) -> str:
    """The report section of a result (`main`'s JSON), numbers read from it."""
    c = result["config"]
    voids = ", ".join(
        f"batch {p}: image{'s' if len(i) > 1 else ''} {', '.join(map(str, i))}"
        for p, i in sorted((int(k), v) for k, v in result["void"].items())
    )
    out = [
        "## Void images: a dropped micro-batch and a skip list kept across a restart",
        "",
        f"Command: `{result['command']}`  ",
        f"Setup: {c['image_size']}x{c['image_size']} images, U-Net width "
        f"{c['width']}, depth {c['depth']}, float32, batches of {c['batch_size']} "
        f"in {result['microbatches']} micro-batches weighted by their labelled "
        "pixels, `drop_non_finite_microbatches=True`; the loss is the mean "
        "cross-entropy over the labelled pixels (torch's `F.cross_entropy(..., "
        "ignore_index=255)`, 0/0 = NaN on an image with none); "
        f"`Checkpointing(every={result['checkpoint_every']}, resume=True, "
        "skip_listed=True)`, `NanPolicy.stop(max_consecutive=1)`. Records made "
        f"void (labels 255 everywhere, nothing else changed, no NaN written): "
        f"{voids}. Columns: the `fit` record keys "
        + ", ".join(f"`{k}`" for k in KEYS)
        + ".",
        "",
    ]
    for fw, r in result["frameworks"].items():
        first, restart = r["first_call"]["records"], r["restart"]["records"]
        dropped = [x for x in first if x.get("microbatches_dropped") and x["finite"]]
        listed = _position(r)
        out += [
            f"### {fw}",
            "",
            f"First call (stopped at step {r['first_call']['stopped_at']}):",
            "",
            table(first),
            "",
            "`bad_batches.json` after it: "
            f"`{json.dumps(r['bad_batches_json']['batches'])}`",
            "",
            "Restart (the same call):",
            "",
            table(restart),
            "",
            f"Reading: step{'s' if len(dropped) != 1 else ''} "
            f"{', '.join(str(x['step']) for x in dropped) or 'none'} dropped "
            f"{', '.join(str(x['microbatches_dropped']) for x in dropped) or 'no'} "
            "micro-batch(es) and went on with the valid ones (finite); position"
            f"{'s' if len(listed) != 1 else ''} {', '.join(map(str, listed))} "
            "listed and skipped on the restart without running; the restarted "
            "run's parameters "
            + ("equal" if r["equal_to_run_without_listed"] else "differ from")
            + " bit for bit those of a run that never saw the listed batch"
            + ("." if r["equal_to_run_without_listed"] else " (!)."),
            "",
        ]
    gap = loss_gap(result)
    if gap is not None:
        out.append(
            f"The two frameworks' finite losses agree to {gap:.1e} (largest "
            "relative difference, both calls)."
        )
    return "\n".join(out).rstrip() + "\n"


def loss_gap(result: dict) -> float | None:
    """The largest relative difference of the JAX and torch finite losses,
    step for step over both calls; None without both frameworks.

    Example:
        >>> rec = lambda loss: {"records": [{"finite": True, "loss": loss}]}
        >>> fw = lambda loss: {"first_call": rec(loss), "restart": rec(loss)}
        >>> loss_gap({"frameworks": {"jax": fw(2.5), "torch": fw(2.0)}})
        0.25
    """
    fws = result["frameworks"]
    if not {"jax", "torch"} <= set(fws):
        return None

    def losses(fw):
        calls = (fws[fw]["first_call"], fws[fw]["restart"])
        return [r["loss"] for c in calls for r in c["records"] if r["finite"]]

    pairs = zip(losses("jax"), losses("torch"), strict=True)
    return max(round(abs(a - b) / abs(b), 12) for a, b in pairs)


def report_section(out: str) -> str:
    """The task's `report_sections` (`examples.harness.parts.Task`):
    `section` of ``bad_data.json`` in the folder ``out``, ``""`` when there is
    none."""
    return json_section(out, "bad_data.json", section)


def main(argv: list[str] | None = None) -> int:
    """Runs the three calls in each framework, writes ``--out`` (and with
    ``--report`` its section into that report)."""
    args = parse_args(argv)
    config = make_config(args.steps)
    batches = void_batches(config)
    weights = TASK.initial_weights(config)
    frameworks = ("jax", "torch") if args.framework == "both" else (args.framework,)
    runners = {"jax": run_jax, "torch": run_torch}
    results, seconds = {}, {}
    for fw in frameworks:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            results[fw] = runners[fw](config, batches, weights, folder)
        seconds[fw] = round(time.perf_counter() - start, 1)
        print(fw, json.dumps(results[fw]), flush=True)
    from examples.harness import environment

    result = {
        "command": rerun_command(
            "examples.segmentation.bad_data", sys.argv[1:] if argv is None else argv
        ),
        "config": config.as_dict(),
        "void": {str(k): list(v) for k, v in VOID.items()},
        "microbatches": MICROBATCHES,
        "checkpoint_every": CHECKPOINT_EVERY,
        "frameworks": results,
        "seconds": seconds,
        "environment": environment.record(),
    }
    text = section(result)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if args.report:
        put_section(args.report, TASK.name, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
