"""The OCR task of `examples/compare.py`: DBNet text detection, its `Task` wiring.

Synthetic documents with DBNet's labels (`data.py`), a small DBNet in Flax
NNX and torch (`model_jax.py`, `model_torch.py`, `convert.py`), its losses
(`loss_jax.py`, `loss_torch.py`) and DBNet's post-processing with the ICDAR
precision / recall / hmean (`metric.py`). The parts of a run, naive and
stable, are `parts_jax.py` / `parts_torch.py`; the naive run's probe
`probe.py`; the settings `config.py`.

Example:
    >>> TASK.name, TASK.metrics
    ('ocr', ('hmean', 'precision_det', 'recall_det'))
"""

from __future__ import annotations

import numpy as np

from examples.harness.config import check_int, check_positive
from examples.harness.parts import Task, own_part
from examples.ocr import data, metric
from examples.ocr.config import Config


def check_config(c: Config) -> None:
    """The values the data and the DBNet cannot take (ValueError naming them).

    Example:
        >>> TASK.get_config(image_size=36)
        Traceback (most recent call last):
        ...
        ValueError: image_size=36 must be divisible by 8 (three stride-2 stages)
    """
    if c.image_size % 8 or c.image_size < 16:
        raise ValueError(
            f"image_size={c.image_size} must be divisible by 8 (three "
            "stride-2 stages)" + ("" if c.image_size >= 16 else " and >= 16")
        )
    check_positive("k", c.k)
    check_int("max_words", c.max_words, 1)
    if not 0 <= c.box_thresh < 1:
        raise ValueError(f"box_thresh must be in [0, 1), got {c.box_thresh}")


def describe(c: Config) -> str:
    """The "Setup:" sentence of the report."""
    return (
        f"synthetic documents, {c.image_size}x{c.image_size} images, up to "
        f"{c.max_words} words each (rotated quadrilaterals, don't-care words "
        f"excluded), DBNet labels (shrink r=0.4, threshold map in [0.3, 0.7]); "
        f"DBNet width {c.width}, k={c.k:g}; ICDAR matching at IoU 0.5, box "
        f"threshold {c.box_thresh}"
    )


def data_config(config: Config) -> data.OCRConfig:
    """The synthetic documents of a run.

    Example:
        >>> data_config(Config(image_size=48)).height
        48
    """
    return data.OCRConfig(
        height=config.image_size, width=config.image_size, max_words=config.max_words
    )


def train_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """The ``config.steps`` train batches: images (NHWC) and DBNet's maps.

    Example:
        >>> b = train_batches(Config(batch_size=2, steps=3))
        >>> len(b), sorted(b[0]), b[0]["gt"].shape
        (3, ['gt', 'image', 'mask', 'thresh_map', 'thresh_mask'], (2, 32, 32))
    """
    d = data_config(config)
    stream = data.batches(d, "train", config.batch_size, config.seed, config.steps)
    return [{key: b[key] for key in data.TRAIN_KEYS} for b in stream]


def heldout_set(config: Config) -> dict[str, np.ndarray]:
    """The held-out documents with their polygons (``config.eval_images``).

    Example:
        >>> heldout_set(Config(eval_images=4))["image"].shape
        (4, 32, 32, 3)
    """
    return data.make_dataset(
        data_config(config), "heldout", config.eval_images, config.seed
    )


TASK = Task(
    name="ocr",
    help="text detection (DBNet on synthetic documents; hmean, precision, recall)",
    metrics=metric.METRICS,
    config_class=Config,
    # a smoke run (seconds): 16x16 documents, a width-4 DBNet, 6 steps
    quick=dict(
        image_size=16,
        batch_size=2,
        width=4,
        steps=6,
        eval_images=4,
        eval_batch_size=4,
    ),
    stable_loss="float32 db_loss with db_step",
    describe=describe,
    train_batches=train_batches,
    heldout_set=heldout_set,
    # imported when a run needs them (`compare.py --help` starts neither)
    initial_weights=own_part(__package__, "parts_torch.initial_weights"),
    jax_parts=own_part(__package__, "parts_jax.jax_parts"),
    torch_parts=own_part(__package__, "parts_torch.torch_parts"),
    check_config=check_config,
    # `compare.py --devices N`: the torch loss is computed on the
    # global batch under DDP (parts_torch: gathered outputs and maps); JAX's
    # jitted step is one SPMD program over the global arrays already
    multi_device=True,
)
