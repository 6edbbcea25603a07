"""The JAX side of an OCR run: the NNX DBNet, its loss and its evaluation.

`jax_parts(config, weights)` hands the harness what is specific to OCR (see
`examples.harness.parts.JaxParts`); the modes are those of `parts_torch`,
with a jmp-style cast of the float32 master weights for the naive forward.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from examples.harness.config import jax_dtype
from examples.harness.parts import JaxParts
from examples.ocr import convert, loss_jax, model_jax
from examples.ocr.config import Config
from examples.ocr.parts_torch import build_model, scores
from examples.ocr.probe import overflow_note


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _predict(graphdef, params, stats, images):
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    out, _ = model_jax.apply(graphdef, params, stats, images.astype(dtype), train=False)
    return jax.nn.sigmoid(out["logits"].astype("float32"))


def _evaluate(graphdef, params, stats, heldout, config) -> dict[str, float]:
    probs = []
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        images = heldout["image"][start : start + config.eval_batch_size]
        probs.append(np.asarray(_predict(graphdef, params, stats, images)))
    return scores(np.concatenate(probs), config, heldout)


def jax_parts(config: Config, weights) -> JaxParts:
    """The NNX DBNet of a run (from the torch weights), its loss and evaluation.

    Example:
        >>> from examples.ocr.parts_torch import initial_weights
        >>> cfg = Config(width=4, mode="naive", precision="float16")
        >>> parts = jax_parts(cfg, initial_weights(cfg))
        >>> jax.tree_util.tree_leaves(parts.params)[0].dtype
        dtype('float32')
    """
    graphdef, params, stats = model_jax.split(
        convert.nnx_from_torch(build_model(config, weights))
    )
    if config.mode == "stable":

        def loss_fn(p, s, batch):
            out, new_stats = model_jax.apply(graphdef, p, s, batch["image"], train=True)
            return loss_jax.stable_loss(out, batch, k=config.k)[0], new_stats

    else:
        dtype = jax_dtype(config.precision)

        def loss_fn(p, s, batch):
            # float32 master weights cast for the forward (what the jmp policy
            # of the stable run does), batch statistics as they are
            p = jax.tree.map(lambda x: x.astype(dtype), p)
            out, new_stats = model_jax.apply(graphdef, p, s, batch["image"], train=True)
            out = {key: out[key].astype(dtype) for key in ("logits", "thresh")}
            return loss_jax.naive_loss(out, batch, k=config.k)[0], new_stats

    def probe(p, s, batch):
        dtype = jax_dtype(config.precision)
        p = jax.tree.map(lambda x: x.astype(dtype), p)
        out, _ = model_jax.apply(graphdef, p, s, batch["image"], train=True)
        diff = jax.nn.sigmoid(out["logits"].astype(dtype)) - out["thresh"].astype(dtype)
        inf = jax.numpy.isinf(jax.numpy.exp(-config.k * diff))
        return overflow_note(
            np.asarray(diff, np.float32), np.asarray(inf), config.k, config.precision
        )

    return JaxParts(
        params=params,
        model_state=stats,
        loss_fn=loss_fn,
        evaluate=lambda p, s, heldout: _evaluate(graphdef, p, s, heldout, config),
        probe=probe if config.mode == "naive" else None,
    )
