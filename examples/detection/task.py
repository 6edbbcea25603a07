"""The detection task of `examples/compare.py`: a YOLO-style anchor-free detector.

Synthetic scenes with a detector's augmentation (`data.py`, which keeps the
zero-width / zero-height boxes that crops produce at the window border), a
small anchor-free detector in Flax NNX and torch (`model_jax.py`,
`model_torch.py`, `convert.py`), its focal + CIoU losses (`loss_jax.py`,
`loss_torch.py`) and the VOC mAP@0.5 (`metric.py`). See
`examples/harness/` for the interface this module implements.

The two modes, as the harness runs them:

* ``naive``: a typical first implementation in mixed precision without any
  guard: float32 parameters and optimizer state, the forward in the compute
  dtype (a jmp-style cast in JAX, ``torch.autocast`` in torch), the focal
  and CIoU losses written from the papers with no eps, in the compute dtype
  (`loss_jax.naive_loss`); no loss scale, no clip, no skip.
* ``stable``: the library's float32 `sigmoid_focal_loss` and
  `box_iou_loss(kind="ciou")` (finite on degenerate boxes) and the harness's
  guards (dynamic loss scale for float16, clip, skip).

Example:
    >>> TASK.name, TASK.metrics
    ('detection', ('map50',))
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from examples import harness
from examples.detection import config as config_lib
from examples.detection import data
from examples.harness.parts import Task

METRICS = ("map50",)


def _describe(c: config_lib.Config) -> str:
    d = config_lib.data_config(c)
    flat, points, total = config_lib.degenerate_counts(c)
    from examples.detection.loss_jax import BOX_WEIGHT as loss_weight

    r = c.recipe()
    recipe = "the harness's plain optimizer"
    if c.optimizer == "sgd":
        recipe = (
            f"YOLO recipe: SGD Nesterov momentum {r.momentum}, 3 parameter groups "
            f"(weight decay {r.weight_decay:g} on conv weights), linear decay "
            f"to {r.final_lr_fraction:g} x lr; stable: {c.warmup_steps} warmup "
            f"steps (bias LR from {r.warmup_bias_lr:g}, momentum from "
            f"{r.warmup_momentum}), clip {c.max_grad_norm:g}, skip; naive: no "
            "warmup, clip or skip"
        )
        if c.ema_decay > 0:
            recipe += (
                f"; evaluated with the weight EMA (Ultralytics' ModelEMA, decay "
                f"{c.ema_decay:g}, tau {c.ema_tau:g} steps)"
            )
    return (
        f"synthetic scenes, {c.image_size}x{c.image_size} images (drawn on a "
        f"{d.canvas}x{d.canvas} canvas), 1-{c.max_objects} objects of "
        f"{data.NUM_CLASSES} shape classes on clutter, YOLO-style augmentation "
        f"(random crop/scale, flip, HSV jitter): {flat} of the {total} train "
        f"boxes have zero width or height ({points} point boxes); anchor-free "
        f"detector width {c.width}, stride {data.STRIDE}, focal + "
        f"{loss_weight:g} x CIoU loss; VOC mAP@0.5 (all-point); {recipe}"
    )


def cause_note(
    box_loss: np.ndarray,
    box_grad_finite: np.ndarray,
    focal: np.ndarray,
    probs: np.ndarray,
    batch: Mapping[str, np.ndarray],
    dtype: str,
) -> str:
    """The observed cause of a naive run's first non-finite step, in one line.

    Names each object (batch element, slot, class, box) whose naive CIoU or
    its gradient is non-finite, and counts the focal-loss elements that are
    non-finite and the probabilities that rounded to exactly 0 or 1 in the
    compute dtype (``log(p)`` / ``log(1 - p)`` = -inf there).

    Args:
      box_loss: per-object naive CIoU (N, K), float32 copy.
      box_grad_finite: per object, its CIoU's gradient is finite (N, K).
      focal: per-element naive focal loss (N, G, G, C), float32 copy.
      probs: ``sigmoid(logits)`` in the compute dtype, as float32 (N, G, G, C).
      batch: the step's batch (``boxes``, ``classes``, ``box_mask``).
      dtype: the compute dtype's name.

    Example:
        >>> b = {"boxes": np.array([[[0, 32, 0, 32], [1, 1, 5, 5]]], np.float32),
        ...      "classes": np.array([[1, 0]]), "box_mask": np.array([[True, True]])}
        >>> print(cause_note(np.array([[np.nan, 0.5]]), np.array([[False, True]]),
        ...       np.zeros((1, 2, 2, 3)), np.full((1, 2, 2, 3), 0.01), b, "float16"))
        ... # doctest: +NORMALIZE_WHITESPACE
        Cause observed: on this step's batch, the naive CIoU was non-finite for 1
        of 2 objects, its gradient for 1: batch element 0, box slot 0 (disc) with
        box (0, 32, 0, 32): a point box (zero width and height), where atan(w/h)
        is atan(0/0) = NaN. The naive focal loss was non-finite at 0 of 12
        elements; sigmoid(x) rounded to 0 or 1 in float16 at 0.
    """
    used = np.asarray(batch["box_mask"], bool)
    bad_value = used & ~np.isfinite(box_loss)
    bad = used & (bad_value | ~np.asarray(box_grad_finite, bool))
    text = (
        f"Cause observed: on this step's batch, the naive CIoU was non-finite for "
        f"{int(bad_value.sum())} of {int(used.sum())} objects, its gradient for "
        f"{int((used & ~np.asarray(box_grad_finite, bool)).sum())}"
    )
    named = []
    for i, j in np.argwhere(bad)[:3]:
        x1, y1, x2, y2 = (float(v) for v in batch["boxes"][i, j])
        box = f"({x1:g}, {y1:g}, {x2:g}, {y2:g})"
        cls = data.CLASSES[int(batch["classes"][i, j])]
        what = "a box"
        if x2 <= x1 and y2 <= y1:
            what = (
                "a point box (zero width and height), where atan(w/h) is "
                "atan(0/0) = NaN"
            )
        elif x2 <= x1 or y2 <= y1:
            what = "a box of zero width or height"
        named.append(f"batch element {i}, box slot {j} ({cls}) with box {box}: {what}")
    text += (": " + "; ".join(named)) if named else ""
    saturated = int(np.sum((probs == 0) | (probs == 1)))
    return (
        f"{text}. The naive focal loss was non-finite at "
        f"{int(np.sum(~np.isfinite(focal)))} of {focal.size} elements; "
        f"sigmoid(x) rounded to 0 or 1 in {dtype} at {saturated}."
    )


# --------------------------------------------------------------------------
# torch


def build_model(config: config_lib.Config, state_dict=None):
    """A float32 ``model_torch.Detector`` of the config's size (weights if given).

    Example:
        >>> build_model(config_lib.get_config(width=4)).architecture()["width"]
        4
    """
    from examples.detection import model_torch

    model = model_torch.Detector(
        in_channels=3, num_classes=data.NUM_CLASSES, width=config.width
    )
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def initial_weights(config: config_lib.Config) -> dict[str, Any]:
    """torch's seeded default init of the detector; both frameworks start from it.

    Example:
        >>> sd = initial_weights(config_lib.get_config(width=4))
        >>> round(float(sd["cls.bias"][0]), 6)  # RetinaNet's prior, p = 0.01
        -4.59512
    """
    import torch

    torch.manual_seed(config.seed)
    return copy.deepcopy(build_model(config).state_dict())


def _to_torch(batch: Mapping[str, np.ndarray]) -> dict[str, Any]:
    import torch

    out = {key: torch.from_numpy(np.asarray(batch[key])) for key in data.BOX_KEYS}
    out["image"] = torch.from_numpy(data.to_nchw(batch["image"]))
    return out


def _scores(cls_logits, box_raw, heldout) -> dict[str, float]:
    from examples.detection import metric

    return metric.evaluate(cls_logits, box_raw, heldout)


def _torch_evaluate(model, heldout, config) -> dict[str, float]:
    import torch

    param_dtype = next(model.parameters()).dtype
    cls, box = [], []
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        x = data.to_nchw(heldout["image"][start : start + config.eval_batch_size])
        out = model(torch.from_numpy(x).to(param_dtype))
        cls.append(out["cls"].float().permute(0, 2, 3, 1).numpy())
        box.append(out["box"].float().permute(0, 2, 3, 1).numpy())
    return _scores(np.concatenate(cls), np.concatenate(box), heldout)


def torch_parts(config: config_lib.Config, weights) -> harness.TorchParts:
    """The torch detector of a run, its loss and its evaluation.

    Example:
        >>> cfg = config_lib.get_config(width=4, mode="naive", precision="float16")
        >>> parts = torch_parts(cfg, initial_weights(cfg))
        >>> next(parts.model.parameters()).dtype  # float32 master weights
        torch.float32
    """
    import torch

    from examples.detection import loss_torch

    model = build_model(config, weights).train()
    dtype = harness.torch_dtype(config.precision)

    def forward(m, batch):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = m(batch["image"])
        # the loss in the compute dtype, outside autocast (whose float32 op
        # lists would otherwise decide the dtype of exp and log)
        return {key: out[key].to(dtype) for key in ("cls", "box")}

    if config.mode == "stable":

        def loss_fn(m, batch):
            return loss_torch.stable_loss(m(batch["image"]), batch)[0]

    else:

        def loss_fn(m, batch):
            return loss_torch.naive_loss(forward(m, batch), batch)[0]

    def probe(m, batch):
        out = forward(m.train(), batch)
        out = {key: v.detach() for key, v in out.items()}
        pred = loss_torch.gather_boxes(out, batch).requires_grad_(True)
        box = loss_torch.naive_ciou(pred, batch["boxes"])
        box.sum().backward()
        grad_ok = torch.isfinite(pred.grad).all(-1)
        logits = out["cls"].permute(0, 2, 3, 1)
        focal = loss_torch.naive_focal(logits, batch["heatmap"].to(logits.dtype))
        return cause_note(
            box.detach().float().numpy(),
            grad_ok.numpy(),
            focal.float().numpy(),
            torch.sigmoid(logits).float().numpy(),
            {k: batch[k].float().numpy() for k in ("boxes", "classes")}
            | {"box_mask": batch["box_mask"].numpy()},
            config.precision,
        )

    from examples.detection import recipe_torch

    ema = None
    if config.optimizer == "sgd" and config.ema_decay > 0:
        ema = recipe_torch.WeightEma(
            model, config.recipe().steps, decay=config.ema_decay, tau=config.ema_tau
        )

    def optimizer(m):
        opt, scheduler = recipe_torch.yolo_optimizer(
            m, config.recipe().steps, **config.recipe_settings()
        )
        return opt, scheduler if ema is None else recipe_torch.StepHooks(
            scheduler, ema, m
        )

    def evaluate(m, heldout):
        return _torch_evaluate(m if ema is None else ema.averaged(m), heldout, config)

    return harness.TorchParts(
        model=model,
        loss_fn=loss_fn,
        to_torch=_to_torch,
        evaluate=evaluate,
        probe=probe if config.mode == "naive" else None,
        optimizer=optimizer if config.optimizer == "sgd" else None,
    )


# --------------------------------------------------------------------------
# JAX


@functools.cache
def _jax_predict():
    import jax

    from examples.detection import model_jax

    @functools.partial(jax.jit, static_argnames=("graphdef",))
    def predict(graphdef, params, stats, images):
        dtype = jax.tree_util.tree_leaves(params)[0].dtype
        out, _ = model_jax.apply(
            graphdef, params, stats, images.astype(dtype), train=False
        )
        return out["cls"].astype("float32"), out["box"].astype("float32")

    return predict


def _jax_evaluate(graphdef, params, stats, heldout, config) -> dict[str, float]:
    predict = _jax_predict()
    cls, box = [], []
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        images = heldout["image"][start : start + config.eval_batch_size]
        c, b = predict(graphdef, params, stats, images)
        cls.append(np.asarray(c))
        box.append(np.asarray(b))
    return _scores(np.concatenate(cls), np.concatenate(box), heldout)


def jax_parts(config: config_lib.Config, weights) -> harness.JaxParts:
    """The NNX detector of a run (from the torch weights), its loss and evaluation.

    Example:
        >>> cfg = config_lib.get_config(width=4, mode="naive", precision="float16")
        >>> parts = jax_parts(cfg, initial_weights(cfg))
        >>> import jax; jax.tree_util.tree_leaves(parts.params)[0].dtype
        dtype('float32')
    """
    import jax
    import jax.numpy as jnp

    from examples.detection import convert, loss_jax, model_jax

    graphdef, params, stats = model_jax.split(
        convert.nnx_from_torch(build_model(config, weights))
    )
    dtype = harness.jax_dtype(config.precision)

    def forward(p, s, batch):
        # float32 master weights cast for the forward (what the jmp policy
        # of the stable run does), batch statistics as they are
        p = jax.tree.map(lambda x: x.astype(dtype), p)
        out, new_stats = model_jax.apply(graphdef, p, s, batch["image"], train=True)
        return {key: out[key].astype(dtype) for key in ("cls", "box")}, new_stats

    if config.mode == "stable":

        def loss_fn(p, s, batch):
            out, new_stats = model_jax.apply(graphdef, p, s, batch["image"], train=True)
            return loss_jax.stable_loss(out, batch)[0], new_stats

    else:

        def loss_fn(p, s, batch):
            out, new_stats = forward(p, s, batch)
            return loss_jax.naive_loss(out, batch)[0], new_stats

    @jax.jit  # once per failed run; jitted: op by op it took 29 s on 2 cores
    def measure(p, s, batch):
        out, _ = forward(p, s, batch)
        pred = loss_jax.gather_boxes(out, batch)
        box, vjp = jax.vjp(lambda b: loss_jax.naive_ciou(b, batch["boxes"]), pred)
        (grad,) = vjp(jnp.ones_like(box))
        focal = loss_jax.naive_focal(out["cls"], batch["heatmap"].astype(dtype))
        return box, jnp.isfinite(grad).all(-1), focal, jax.nn.sigmoid(out["cls"])

    def probe(p, s, batch):
        box, grad_ok, focal, probs = measure(p, s, batch)
        as32 = functools.partial(np.asarray, dtype=np.float32)
        return cause_note(
            as32(box),
            np.asarray(grad_ok),
            as32(focal),
            as32(probs),
            {k: np.asarray(batch[k]) for k in ("boxes", "classes", "box_mask")},
            config.precision,
        )

    tx = eval_params = None
    if config.optimizer == "sgd":
        from examples.detection import recipe_jax

        steps = config.recipe().steps
        tx = recipe_jax.yolo_optimizer(steps, **config.recipe_settings())
        if config.ema_decay > 0:
            tx = recipe_jax.with_ema(
                tx, steps, decay=config.ema_decay, tau=config.ema_tau
            )
            eval_params = lambda _p, opt_state: recipe_jax.ema_weights(opt_state)  # noqa: E731
    return harness.JaxParts(
        params=params,
        model_state=stats,
        loss_fn=loss_fn,
        evaluate=lambda p, s, heldout: _jax_evaluate(graphdef, p, s, heldout, config),
        probe=probe if config.mode == "naive" else None,
        optimizer=tx,
        eval_params=eval_params,
    )


TASK = Task(
    name="detection",
    help="object detection (anchor-free detector, focal + CIoU; VOC mAP@0.5)",
    metrics=METRICS,
    # a smoke run (seconds): 16x16 scenes, a width-4 detector, 2 steps
    # (with 6, the float16 stable runs also skipped step 2 for a loss-scale
    # overflow, and locating that skip op by op was ~14% of the smoke run)
    quick=dict(
        image_size=16,
        batch_size=2,
        width=4,
        steps=2,
        eval_images=4,
        eval_batch_size=4,
    ),
    config_class=config_lib.Config,
    train_batches=config_lib.train_batches,
    heldout_set=config_lib.heldout_set,
    initial_weights=initial_weights,
    describe=_describe,
    stable_loss="float32 focal and CIoU losses, the YOLO recipe with warmup",
    jax_parts=jax_parts,
    torch_parts=torch_parts,
)
