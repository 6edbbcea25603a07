"""Settings of the contrastive image-text task, for both frameworks.

:func:`get_config` returns the float32 default; a mixed-precision run is the
same config with ``precision`` and ``mode`` overridden (see
`examples.harness.BaseConfig` for the common fields)::

    cfg = get_config()                                    # float32 reference
    cfg = get_config(precision="bfloat16", mode="naive")  # the first attempt
    cfg = get_config(precision="bfloat16")                # the stable recipe

Example:
    >>> cfg = get_config(precision="bfloat16", mode="naive", steps=10)
    >>> cfg.precision, cfg.mode, cfg.steps, cfg.image_size
    ('bfloat16', 'naive', 10, 24)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from examples import harness
from examples.contrastive import data

# The check points the loss functions mark (`loss_jax`, `loss_torch`), in the
# order a step computes them; `gradients` and `parameters`, the other two of
# the contrastive report's six checks, are the step's own `grad_norm` and
# `finite` metrics.
CHECKS = ("inputs", "image_emb", "text_emb", "logits", "loss")


@dataclasses.dataclass(frozen=True)
class Config(harness.BaseConfig):
    """Every setting of one contrastive run (frozen; build with :func:`get_config`).

    The common fields are documented in `examples.harness.BaseConfig`
    (``width``: channels of the image tower's first convolution; the
    stable loss is the float32 `info_nce`). The task adds:

    Attributes:
      embed_dim: the shared embedding size of the two projections.
      token_dim: the text tower's token embedding size.
      max_tokens: caption length with padding (>= 5).
      train_pairs: pairs in the train set (an epoch; the last batch of an
        epoch is partial when ``batch_size`` does not divide it).
      empty_rate: fraction of train captions that tokenise to nothing
        (rounded up: at least one when > 0; 0 turns them off).

    Example:
        >>> Config(image_size=20)
        Traceback (most recent call last):
        ...
        ValueError: image_size must be divisible by 8 and >= 16, got 20
    """

    image_size: int = 24
    batch_size: int = 32
    width: int = 8
    steps: int = 300
    learning_rate: float = 2e-3
    # Adam's eps: 1e-6, CLIP's and open_clip's for their ViTs, not 1e-8. With
    # 1e-8 float32 rounding grows until torch float32 leaves its own float64
    # run at step 29 (5.1e-3 by step 49); with 1e-6 it stays within 3.3e-7 of
    # it for 100 steps (examples/contrastive/agreement_probe.py, README.md).
    eps: float = 1e-6
    # 256 of the 384 attribute combinations: recall@1 among 256 candidates
    eval_images: int = 256
    eval_batch_size: int = 256
    embed_dim: int = 32
    token_dim: int = 32
    max_tokens: int = 8
    train_pairs: int = 2000
    empty_rate: float = 0.002

    def __post_init__(self):
        super().__post_init__()
        data_config(self)  # the data's own checks (image_size, max_tokens, ...)
        harness.check_int("embed_dim", self.embed_dim, 1)
        harness.check_int("token_dim", self.token_dim, 1)
        if self.eval_images > data.COMBINATIONS:
            raise ValueError(
                f"eval_images must be <= {data.COMBINATIONS} (distinct attribute "
                f"combinations), got {self.eval_images}"
            )


def get_config(**overrides: Any) -> Config:
    """The default (float32, stable) config with `overrides` applied.

    Example:
        >>> get_config(precision="bfloat16").precision
        'bfloat16'
    """
    return harness.make_config(Config, **overrides)


def data_config(config: Config) -> data.ContrastiveData:
    """The data set of a run.

    Example:
        >>> data_config(get_config(train_pairs=10)).train_pairs
        10
    """
    return data.ContrastiveData(
        image_size=config.image_size,
        max_tokens=config.max_tokens,
        train_pairs=config.train_pairs,
        empty_rate=config.empty_rate,
    )


def check_batch(batch: dict[str, np.ndarray], index: int) -> None:
    """Pre-flight check of a batch: finite images, token ids in the vocabulary.

    Example:
        >>> bad = {"image": np.zeros((1, 2, 2, 3)), "tokens": np.array([[99]])}
        >>> check_batch(bad, 0)
        Traceback (most recent call last):
        ...
        ValueError: batch 0: token ids must be in [0, 19), got 99 to 99
    """
    if not np.isfinite(batch["image"]).all():
        bad = int((~np.isfinite(batch["image"])).sum())
        raise ValueError(f"batch {index}: {bad} image entries are not finite")
    tok = batch["tokens"]
    if tok.min() < 0 or tok.max() >= len(data.VOCAB):
        raise ValueError(
            f"batch {index}: token ids must be in [0, {len(data.VOCAB)}), got "
            f"{tok.min()} to {tok.max()}"
        )


def train_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """The ``config.steps`` train batches (images NHWC, tokens), each checked.

    Example:
        >>> b = train_batches(get_config(batch_size=4, steps=3, train_pairs=10))
        >>> [len(x["tokens"]) for x in b], sorted(b[0])
        ([4, 4, 2], ['image', 'tokens'])
    """
    out = data.train_batches(
        data_config(config), config.batch_size, config.steps, config.seed
    )
    for i, batch in enumerate(out):
        check_batch(batch, i)
    return out


def heldout_set(config: Config) -> dict[str, np.ndarray]:
    """The held-out pairs (``config.eval_images``, distinct combinations).

    Example:
        >>> heldout_set(get_config(eval_images=4))["tokens"].shape
        (4, 8)
    """
    return data.make_pairs(
        data_config(config), "heldout", config.eval_images, config.seed
    )
