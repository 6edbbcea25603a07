"""The JAX side of a segmentation run: the NNX U-Net, its loss and evaluation.

`jax_parts(config, weights)` hands the harness what is specific to
segmentation; the harness builds the steps and runs them on
`jaxstable.train.fit`. Two modes (`examples.harness.config.BaseConfig.mode`):

* ``stable``: float32 parameters, the U-Net's batch statistics as the model
  state, `loss_jax.stable_loss`; the harness adds the jmp policy
  ``params=float32,compute=<precision>,output=float32``, the dynamic loss
  scale for float16, clipping and the skip of non-finite steps.
* ``naive``: what users ran before the fix: parameters and batch statistics
  in the low-precision dtype (``param_dtype=dtype``, so optax's state
  follows), `loss_jax.naive_loss`; the harness adds a plain optax optimizer
  and no guard.

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

from examples.harness.config import jax_dtype
from examples.harness.parts import JaxParts
from examples.segmentation import convert, data, loss_jax, metric, model_jax
from examples.segmentation.config import Config
from examples.segmentation.parts_torch import build_model


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
    config: Config,
    heldout: Mapping[str, np.ndarray],
) -> float:
    """Held-out mIoU in eval mode (running batch statistics), in the params' dtype.

    The harness passes parameters cast to the run's compute dtype. Returns
    nan when any logit is non-finite.
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
        np.concatenate(preds), heldout["label"], config.num_classes, data.IGNORE_INDEX
    )
    return miou


def _loss_fn(graphdef, loss: Callable) -> Callable:
    def loss_fn(params, stats, batch):
        logits, new_stats = model_jax.apply(
            graphdef, params, stats, batch["image"], train=True
        )
        return loss(logits, batch["label"]), new_stats

    return loss_fn


def jax_parts(config: Config, weights: Mapping[str, Any]) -> JaxParts:
    """The NNX U-Net of a run (from torch weights), its loss and its evaluation.

    Example:
        >>> from examples.segmentation.parts_torch import initial_weights
        >>> cfg = Config(width=4, depth=1, mode="naive", precision="float16")
        >>> parts = jax_parts(cfg, initial_weights(cfg))
        >>> jax.tree_util.tree_leaves(parts.params)[0].dtype
        dtype('float16')
    """
    torch_model = build_model(config, weights)
    if config.mode == "naive":
        # the `.half()` recipe in flax: param_dtype = dtype, so the batch
        # statistics and the optimizer state (optax follows the params) are too
        dtype = jax_dtype(config.precision)
        model = convert.nnx_from_torch(torch_model, dtype=dtype, param_dtype=dtype)
        loss = loss_jax.naive_loss
    else:
        model = convert.nnx_from_torch(torch_model)  # float32 params and stats
        loss = loss_jax.stable_loss
    graphdef, params, batch_stats = model_jax.split(model)
    return JaxParts(
        params=params,
        model_state=batch_stats,
        loss_fn=_loss_fn(graphdef, loss),
        evaluate=lambda p, s, heldout: {
            "miou": evaluate(graphdef, p, s, config, heldout)
        },
    )
