"""The segmentation task in JAX / Flax NNX: model, losses and evaluation.

`jax_parts(config, weights)` hands the harness (`examples/harness/`) what
is specific to segmentation; the harness builds the steps and runs them on
`jaxstable.train.fit`. Two modes (see `examples.harness.BaseConfig.mode`):

* ``stable``: float32 parameters, the U-Net's batch statistics as the model
  state, `jaxstable.losses.softmax_cross_entropy` (float32,
  ``ignore_index=255``); the harness adds the jmp policy
  ``params=float32,compute=<precision>,output=float32``, the dynamic loss
  scale for float16, clipping and the skip of non-finite steps.
* ``naive``: what users ran before the fix: parameters and batch statistics
  in the low-precision dtype (``param_dtype=dtype``, so optax's state
  follows), ``optax.softmax_cross_entropy_with_integer_labels`` on the
  low-precision logits with a masked mean for label 255 in that dtype; the
  harness adds a plain optax optimizer and no guard.

Both start from the torch initial weights (converted by
`convert.nnx_from_torch`), so the two frameworks train the same network.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples import harness
from examples.segmentation import config as config_lib
from examples.segmentation import convert, metric, model_jax, train_torch
from jaxstable import losses


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _predict(graphdef, params, batch_stats, images):
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    logits, _ = model_jax.apply(
        graphdef, params, batch_stats, images.astype(dtype), train=False
    )
    logits = logits.astype(jnp.float32)
    return jnp.argmax(logits, axis=-1), jnp.all(jnp.isfinite(logits))


def evaluate(
    graphdef: Any,
    params: Any,
    batch_stats: Any,
    config: config_lib.Config,
    heldout: Mapping[str, np.ndarray],
) -> float:
    """Held-out mIoU in eval mode (running batch statistics), in the params' dtype.

    The harness passes parameters cast to the run's compute dtype. Returns
    nan when any logit is non-finite.

    Example:
        >>> from flax import nnx
        >>> cfg = config_lib.get_config(image_size=16, width=4, eval_images=2)
        >>> g, p, s = model_jax.split(model_jax.UNet(width=4, rngs=nnx.Rngs(0)))
        >>> 0.0 <= evaluate(g, p, s, cfg, config_lib.heldout_set(cfg)) <= 1.0
        True
    """
    preds, finite = [], True
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        images = jnp.asarray(heldout["image"][start : start + config.eval_batch_size])
        pred, ok = _predict(graphdef, params, batch_stats, images)
        preds.append(np.asarray(pred))
        finite = finite and bool(ok)
    if not finite:
        return float("nan")
    miou, _ = metric.mean_iou(
        np.concatenate(preds), heldout["label"], config.num_classes, 255
    )
    return miou


def _stable_loss(graphdef):
    def loss_fn(params, stats, batch):
        logits, new_stats = model_jax.apply(
            graphdef, params, stats, batch["image"], train=True
        )
        loss = losses.softmax_cross_entropy(
            logits, batch["label"], ignore_index=config_lib.IGNORE_INDEX
        )
        return loss, new_stats

    return loss_fn


def _naive_loss(graphdef):
    def loss_fn(params, stats, batch):
        logits, new_stats = model_jax.apply(
            graphdef, params, stats, batch["image"], train=True
        )
        label = batch["label"]
        valid = label != config_lib.IGNORE_INDEX
        ce = optax.softmax_cross_entropy_with_integer_labels(
            logits, jnp.where(valid, label, 0)
        )
        mask = valid.astype(ce.dtype)  # the masked mean in the compute dtype
        return jnp.sum(ce * mask) / jnp.sum(mask), new_stats

    return loss_fn


def jax_parts(
    config: config_lib.Config, weights: Mapping[str, Any]
) -> harness.JaxParts:
    """The NNX U-Net of a run (from torch weights), its loss and its evaluation.

    Example:
        >>> cfg = config_lib.get_config(width=4, depth=1, mode="naive",
        ...                             precision="float16")
        >>> parts = jax_parts(cfg, train_torch.initial_state_dict(cfg))
        >>> jax.tree_util.tree_leaves(parts.params)[0].dtype
        dtype('float16')
    """
    torch_model = train_torch.build_model(config, weights)
    if config.mode == "naive":
        # the `.half()` recipe in flax: param_dtype = dtype, so the batch
        # statistics and the optimizer state (optax follows the params) are too
        dtype = harness.jax_dtype(config.precision)
        model = convert.nnx_from_torch(torch_model, dtype=dtype, param_dtype=dtype)
        make_loss = _naive_loss
    else:
        model = convert.nnx_from_torch(torch_model)  # float32 params and stats
        make_loss = _stable_loss
    graphdef, params, batch_stats = model_jax.split(model)
    return harness.JaxParts(
        params=params,
        model_state=batch_stats,
        loss_fn=make_loss(graphdef),
        evaluate=lambda p, s, heldout: {
            "miou": evaluate(graphdef, p, s, config, heldout)
        },
    )


def train_and_evaluate(
    config: config_lib.Config,
    *,
    init_state_dict: Mapping[str, Any] | None = None,
    batches: list[dict[str, np.ndarray]] | None = None,
    heldout: Mapping[str, np.ndarray] | None = None,
    log: Callable[[dict[str, Any]], None] | None = None,
    progress: bool = True,
) -> harness.RunResult:
    """One JAX segmentation run (`harness.train_and_evaluate` of this task).

    Example:
        >>> cfg = config_lib.get_config(image_size=16, width=4, steps=2,
        ...                             eval_images=2)
        >>> r = train_and_evaluate(cfg, progress=False)
        >>> len(r.metrics), r.first_nonfinite_step, r.skipped_total
        (2, None, 0)
    """
    from examples.segmentation.task import TASK

    return harness.train_and_evaluate(
        TASK, "jax", config, weights=init_state_dict, batches=batches,
        heldout=heldout, log=log, progress=progress,
    )  # fmt: skip
