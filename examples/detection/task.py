"""The detection task of `examples/compare.py`: a YOLO-style anchor-free detector.

Synthetic scenes with a detector's augmentation (`data.py`, which keeps the
zero-width / zero-height boxes that crops produce at the window border), a
small anchor-free detector in Flax NNX and torch (`model_jax.py`,
`model_torch.py`, `convert.py`), its focal + CIoU losses (`loss_jax.py`,
`loss_torch.py`), the YOLO recipe (`recipe*.py`) and the VOC mAP@0.5
(`metric.py`). The parts of a run, naive and stable, are `parts_jax.py` /
`parts_torch.py`; the naive run's probe `probe.py`; the settings
`config.py`.

Example:
    >>> TASK.name, TASK.metrics
    ('detection', ('map50',))
"""

from __future__ import annotations

import functools

import numpy as np

from examples.detection import data, metric
from examples.detection import recipe as recipe_lib
from examples.detection.config import Config
from examples.harness.config import check_int
from examples.harness.parts import Task, own_part


def check_config(c: Config) -> None:
    """The values the data, the detector and the recipe cannot take.

    Example:
        >>> TASK.get_config(image_size=36)
        Traceback (most recent call last):
        ...
        ValueError: image_size=36 must be a multiple of 8 and >= 16
    """
    if c.image_size % 8 or c.image_size < 16:
        raise ValueError(f"image_size={c.image_size} must be a multiple of 8 and >= 16")
    check_int("max_objects", c.max_objects, 1)
    recipe_lib.for_config(c)  # the recipe's own validation, one place
    recipe_lib.ema_decays(1, c.ema_decay, c.ema_tau)  # and the EMA's


def describe(c: Config) -> str:
    """The "Setup:" sentence of the report (the recipe, the degenerate boxes)."""
    d = data_config(c)
    flat, points, total = degenerate_counts(c)
    from examples.detection.loss_jax import BOX_WEIGHT as loss_weight

    r = recipe_lib.for_config(c)
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


def data_config(config: Config) -> data.DetectionConfig:
    """The synthetic scenes of a run.

    Example:
        >>> data_config(Config(image_size=48)).size
        48
    """
    return data.DetectionConfig(size=config.image_size, max_objects=config.max_objects)


def train_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """The ``config.steps`` augmented train batches: images (NHWC) and targets.

    Example:
        >>> b = train_batches(Config(batch_size=2, steps=3))
        >>> len(b), sorted(b[0])
        (3, ['box_mask', 'boxes', 'cells', 'classes', 'heatmap', 'image'])
    """
    return list(
        _train_batches(
            data_config(config), config.batch_size, config.seed, config.steps
        )
    )


@functools.lru_cache(maxsize=1)
def _train_batches(d: data.DetectionConfig, batch_size: int, seed: int, steps: int):
    # drawn once per comparison (~40 ms a batch): the report's setup line
    # counts their degenerate boxes, the runs read them
    return tuple(data.batches(d, "train", batch_size, seed, steps))


def heldout_set(config: Config) -> dict[str, np.ndarray]:
    """The held-out images with their boxes (``config.eval_images``).

    Example:
        >>> heldout_set(Config(eval_images=4))["image"].shape
        (4, 32, 32, 3)
    """
    return data.make_dataset(
        data_config(config), "heldout", config.eval_images, config.seed
    )


def degenerate_counts(config: Config) -> tuple[int, int, int]:
    """(boxes of zero width or height, point boxes, all boxes) in the train batches.

    Example:
        >>> flat, points, total = degenerate_counts(Config(steps=2))
        >>> 0 <= points <= flat <= total
        True
    """
    flat = points = total = 0
    for batch in train_batches(config):
        total += int(batch["box_mask"].sum())
        for _, _, (x1, y1, x2, y2) in data.degenerate_boxes(batch):
            flat += 1
            points += x2 <= x1 and y2 <= y1
    return flat, points, total


TASK = Task(
    name="detection",
    help="object detection (anchor-free detector, focal + CIoU; VOC mAP@0.5)",
    metrics=metric.METRICS,
    config_class=Config,
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
    stable_loss="float32 focal and CIoU losses, the YOLO recipe with warmup",
    describe=describe,
    train_batches=train_batches,
    heldout_set=heldout_set,
    # imported when a run needs them (`compare.py --help` starts neither)
    initial_weights=own_part(__package__, "parts_torch.initial_weights"),
    jax_parts=own_part(__package__, "parts_jax.jax_parts"),
    torch_parts=own_part(__package__, "parts_torch.torch_parts"),
    check_config=check_config,
    # `compare.py --devices N`: the torch loss divides by the
    # global box count under DDP (parts_torch); JAX's jitted step is one
    # SPMD program over the global arrays already
    multi_device=True,
)
