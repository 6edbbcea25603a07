"""The JAX side of a contrastive run: the NNX dual encoder, loss and evaluation.

`jax_parts(config, weights)` hands the harness what is specific to the task
(see `examples.harness.parts.JaxParts`); the modes are those of
`parts_torch`, with a cast of the float32 master weights for the naive
forward, and the run's optimizer is `optim_jax` 's Adam with torch's bias
corrections.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from examples.contrastive import convert, loss_jax, model_jax, optim_jax
from examples.contrastive.config import Config
from examples.contrastive.metric import recall_at_1
from examples.contrastive.parts_torch import build_model
from examples.contrastive.probe import empty_captions, note
from examples.harness.config import jax_dtype
from examples.harness.parts import JaxParts
from jaxstable import diagnostics


@functools.partial(jax.jit, static_argnames=("graphdef", "safe"))
def _embed(graphdef, params, images, tokens, safe):
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    img, txt, _ = model_jax.apply(
        graphdef, params, images.astype(dtype), tokens, safe=safe
    )
    return img.astype("float32"), txt.astype("float32")


def _evaluate(graphdef, params, heldout, config) -> dict[str, float]:
    imgs, txts = [], []
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        sl = slice(start, start + config.eval_batch_size)
        img, txt = _embed(
            graphdef, params, heldout["image"][sl], heldout["tokens"][sl],
            config.mode == "stable",
        )  # fmt: skip
        imgs.append(np.asarray(img))
        txts.append(np.asarray(txt))
    return recall_at_1(np.concatenate(imgs), np.concatenate(txts))


def jax_parts(config: Config, weights) -> JaxParts:
    """The NNX dual encoder of a run (from the torch weights), loss, evaluation.

    Example:
        >>> from examples.contrastive.parts_torch import initial_weights
        >>> cfg = Config(width=4, mode="naive", precision="bfloat16")
        >>> parts = jax_parts(cfg, initial_weights(cfg))
        >>> jax.tree_util.tree_leaves(parts.params)[0].dtype
        dtype('float32')
    """
    graphdef, params = model_jax.split(
        convert.nnx_from_torch(build_model(config, weights))
    )
    diagnostics.check_params(params)  # pre-flight: the weights are finite
    dtype = jax_dtype(config.precision)
    if config.mode == "stable":

        def loss_fn(p, s, batch):
            img, txt, log_scale = model_jax.apply(
                graphdef, p, batch["image"], batch["tokens"], safe=True
            )
            return loss_jax.stable_loss(img, txt, log_scale, batch["image"]), s

    else:

        def loss_fn(p, s, batch):
            # float32 master weights cast for the forward (what the jmp policy
            # of the stable run does)
            p = jax.tree.map(lambda x: x.astype(dtype), p)
            img, txt, log_scale = model_jax.apply(
                graphdef, p, batch["image"], batch["tokens"], safe=False
            )
            out = loss_jax.naive_loss(
                img.astype(dtype), txt.astype(dtype), log_scale, batch["image"]
            )
            return out, s

    def probe(p, s, batch):
        # one eager forward (off the hot path): the caption embeddings and
        # the check points of the naive loss on them
        q = jax.tree.map(lambda x: x.astype(dtype), p)
        img, txt, log_scale = model_jax.apply(
            graphdef, q, batch["image"], batch["tokens"], safe=False
        )
        img, txt = img.astype(dtype), txt.astype(dtype)
        _, aux = loss_jax.naive_loss(img, txt, log_scale, batch["image"])
        bad = int((~np.isfinite(np.asarray(txt, np.float32))).any(axis=1).sum())
        empty = empty_captions(batch["tokens"])
        return note(diagnostics, aux["checks"], bad, empty, len(batch["tokens"]))

    return JaxParts(
        params=params,
        model_state=None,
        loss_fn=loss_fn,
        evaluate=lambda p, s, heldout: _evaluate(graphdef, p, heldout, config),
        probe=probe if config.mode == "naive" else None,
        has_aux=True,
        optimizer=optim_jax.for_config(config),  # torch's Adam bias corrections
    )
