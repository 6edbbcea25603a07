"""The segmentation task of `examples/compare.py`: its `Task` wiring.

Semantic segmentation of synthetic scenes (`data.py`) with a small U-Net
(`model_jax.py`, `model_torch.py`, `convert.py`), label 255 ignored on
boundaries and void; stable loss: the float32 cross-entropy (`loss_jax.py`,
`loss_torch.py`); metric: the held-out mIoU (`metric.py`). The parts of a
run are `parts_jax.py` / `parts_torch.py`; the settings `config.py`.

Example:
    >>> TASK.name, TASK.metrics, TASK.get_config().image_size
    ('segmentation', ('miou',), 32)
"""

from __future__ import annotations

import numpy as np

from examples.harness.config import check_int
from examples.harness.parts import Task, own_part
from examples.segmentation import data, metric
from examples.segmentation.config import Config


def check_config(c: Config) -> None:
    """The values the data and the U-Net cannot take (ValueError naming them).

    Example:
        >>> TASK.get_config(image_size=20, depth=3)
        Traceback (most recent call last):
        ...
        ValueError: image_size=20 must be divisible by 2**depth=8
    """
    for name, minimum in (("num_classes", 2), ("boundary_width", 0), ("depth", 1)):
        check_int(name, getattr(c, name), minimum)
    if c.image_size % 2**c.depth:
        raise ValueError(
            f"image_size={c.image_size} must be divisible by 2**depth={2**c.depth}"
        )
    data_config(c)  # the data set's own checks


def describe(c: Config) -> str:
    """The "Setup:" sentence of the report."""
    return (
        f"synthetic segmentation, {c.image_size}x{c.image_size} images, "
        f"{c.num_classes} classes, label 255 on boundaries and void; U-Net width "
        f"{c.width}, depth {c.depth}"
    )


def data_config(config: Config) -> data.SegmentationConfig:
    """The synthetic data set of a run.

    Example:
        >>> d = data_config(Config(image_size=16))
        >>> d.height, d.width, d.boundary_width
        (16, 16, 1)
    """
    return data.SegmentationConfig(
        height=config.image_size,
        width=config.image_size,
        num_classes=config.num_classes,
        boundary_width=config.boundary_width,
        ignore_fraction=config.ignore_fraction,
        ignore_index=data.IGNORE_INDEX,
    )


def train_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """The ``config.steps`` train batches (NHWC float32 images, int32 labels).

    Drawn once so that every run of a comparison reads the very same arrays.

    Example:
        >>> b = train_batches(Config(image_size=16, batch_size=2, steps=3))
        >>> len(b), b[0]["image"].shape
        (3, (2, 16, 16, 3))
    """
    d = data_config(config)
    return list(data.batches(d, "train", config.batch_size, config.seed, config.steps))


def heldout_set(config: Config) -> dict[str, np.ndarray]:
    """The held-out evaluation images and labels (``config.eval_images``).

    Example:
        >>> heldout_set(Config(image_size=16, eval_images=4))["label"].shape
        (4, 16, 16)
    """
    return data.make_dataset(
        data_config(config), "heldout", config.eval_images, config.seed
    )


TASK = Task(
    name="segmentation",
    help="semantic segmentation (U-Net on synthetic scenes, label 255 ignored)",
    metrics=metric.METRICS,
    config_class=Config,
    # a smoke run (seconds): the naive float16 failure happens at the first
    # optimizer step, so it still shows
    quick=dict(
        image_size=16,
        batch_size=2,
        width=4,
        depth=1,
        steps=6,
        eval_images=4,
        eval_batch_size=4,
    ),
    stable_loss="float32 cross-entropy",
    describe=describe,
    train_batches=train_batches,
    heldout_set=heldout_set,
    # imported when a run needs them (`compare.py --help` starts neither)
    initial_weights=own_part(__package__, "parts_torch.initial_weights"),
    jax_parts=own_part(__package__, "parts_jax.jax_parts"),
    torch_parts=own_part(__package__, "parts_torch.torch_parts"),
    check_config=check_config,
    # the void-image run (`bad_data.py --out`), where there is one
    report_sections=own_part(__package__, "bad_data.report_section"),
    # `compare.py --devices N`: the torch loss is a mean over the global
    # batch under DDP (loss_torch); the JAX side needs nothing
    multi_device=True,
)
