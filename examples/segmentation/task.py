"""The segmentation task of `examples/compare.py` (the harness interface).

Semantic segmentation of synthetic scenes (`data.py`) with a small U-Net
(`model_jax.py`, `model_torch.py`, `convert.py`), label 255 ignored on
boundaries and void; stable loss: the float32 cross-entropy; metric: the
held-out mIoU. See `examples/harness/` for the interface.

Example:
    >>> TASK.name, TASK.metrics, TASK.get_config().image_size
    ('segmentation', ('miou',), 32)
"""

from __future__ import annotations

from examples.harness.parts import Task
from examples.segmentation import config as config_lib


def _describe(c: config_lib.Config) -> str:
    return (
        f"synthetic segmentation, {c.image_size}x{c.image_size} images, "
        f"{c.num_classes} classes, label 255 on boundaries and void; U-Net width "
        f"{c.width}, depth {c.depth}"
    )


def _initial_weights(config):
    from examples.segmentation import train_torch

    return train_torch.initial_state_dict(config)


def _jax_parts(config, weights):
    from examples.segmentation import train_jax

    return train_jax.jax_parts(config, weights)


def _torch_parts(config, weights):
    from examples.segmentation import train_torch

    return train_torch.torch_parts(config, weights)


TASK = Task(
    name="segmentation",
    help="semantic segmentation (U-Net on synthetic scenes, label 255 ignored)",
    metrics=("miou",),
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
    config_class=config_lib.Config,
    train_batches=config_lib.train_batches,
    heldout_set=config_lib.heldout_set,
    initial_weights=_initial_weights,
    describe=_describe,
    stable_loss="float32 cross-entropy",
    jax_parts=_jax_parts,
    torch_parts=_torch_parts,
    # `compare.py --devices N`: the torch loss is a mean over the global
    # batch under DDP (train_torch._labelled); the JAX side needs nothing
    multi_device=True,
)
