"""The contrastive task of `examples/compare.py`: CLIP-style image-text InfoNCE.

Paired shape images and attribute captions (`data.py`), a small dual
encoder in Flax NNX and torch (`model_jax.py`, `model_torch.py`,
`convert.py`), the InfoNCE losses with their check points (`loss_jax.py`,
`loss_torch.py`, `probe.py`) and held-out recall@1 (`metric.py`). The parts
of a run, naive and stable, are `parts_jax.py` / `parts_torch.py`; the
settings `config.py`. This module wires them into ``TASK`` and checks every
train batch before training (:func:`check_batch`).

Example:
    >>> TASK.name, TASK.metrics
    ('contrastive', ('recall_at_1', 'recall_i2t', 'recall_t2i'))
"""

from __future__ import annotations

import numpy as np

from examples.contrastive import data
from examples.contrastive.config import Config
from examples.contrastive.metric import METRICS
from examples.harness.config import check_int
from examples.harness.parts import Task, own_part


def check_config(c: Config) -> None:
    """The values the data and the model cannot take (ValueError naming them).

    Example:
        >>> TASK.get_config(image_size=20)
        Traceback (most recent call last):
        ...
        ValueError: image_size must be divisible by 8 and >= 16, got 20
    """
    data_config(c)  # the data's own checks (image_size, max_tokens, ...)
    check_int("embed_dim", c.embed_dim, 1)
    check_int("token_dim", c.token_dim, 1)
    if c.eval_images > data.COMBINATIONS:
        raise ValueError(
            f"eval_images must be <= {data.COMBINATIONS} (distinct attribute "
            f"combinations), got {c.eval_images}"
        )


def describe(c: Config) -> str:
    """The "Setup:" sentence of the report."""
    return (
        f"{c.train_pairs} train pairs of {c.image_size}x{c.image_size} shape images "
        f"and captions naming 1-5 of their 5 attributes (up to {c.max_tokens} "
        f"tokens; {c.empty_rate:g} of them empty, short and duplicate captions, a "
        f"partial last batch per epoch); CNN image tower (width {c.width}) and "
        f"masked-mean text tower, {c.embed_dim}-d embeddings, logit scale "
        f"initialised to 1/0.07; recall@1 among {c.eval_images} held-out pairs "
        "captioned with all 5 attributes"
    )


def data_config(config: Config) -> data.ContrastiveData:
    """The data set of a run.

    Example:
        >>> data_config(Config(train_pairs=10)).train_pairs
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
        >>> b = train_batches(Config(batch_size=4, steps=3, train_pairs=10))
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
        >>> heldout_set(Config(eval_images=4))["tokens"].shape
        (4, 8)
    """
    return data.make_pairs(
        data_config(config), "heldout", config.eval_images, config.seed
    )


TASK = Task(
    name="contrastive",
    help="image-text retrieval (CLIP-style InfoNCE on shape captions; recall@1)",
    metrics=METRICS,
    config_class=Config,
    # a smoke run: 16x16 images, width 4, 6 steps of 8 over 48 pairs (one
    # epoch: every pair, the empty caption included, is seen; no partial
    # batch, whose new shape would cost each JAX run a second compile)
    quick=dict(
        image_size=16,
        batch_size=8,
        width=4,
        steps=6,
        train_pairs=48,
        eval_images=16,
        eval_batch_size=16,
    ),
    stable_loss="float32 info_nce (eps-safe, logit scale clamped at 100), "
    "max(count, 1) caption pooling",
    describe=describe,
    train_batches=train_batches,
    heldout_set=heldout_set,
    # imported when a run needs them (`compare.py --help` starts neither)
    initial_weights=own_part(__package__, "parts_torch.initial_weights"),
    jax_parts=own_part(__package__, "parts_jax.jax_parts"),
    torch_parts=own_part(__package__, "parts_torch.torch_parts"),
    check_config=check_config,
    # `compare.py --devices N`: the torch InfoNCE sees every
    # rank's embeddings under DDP (parts_torch); JAX's jitted step is one
    # SPMD program over the global arrays already
    multi_device=True,
)
