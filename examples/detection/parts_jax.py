"""The JAX side of a detection run: the NNX detector, its loss and evaluation.

`jax_parts(config, weights)` hands the harness what is specific to
detection (see `examples.harness.parts.JaxParts`); the modes are those of
`parts_torch`, with a jmp-style cast of the float32 master weights for the
naive forward, and the YOLO recipe as an optax transformation
(`recipe_jax`), its weight EMA kept in the optimizer state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from examples.detection import convert, loss_jax, model_jax, recipe_jax
from examples.detection.config import Config
from examples.detection.parts_torch import build_model, scores
from examples.detection.probe import cause_note
from examples.detection.recipe import for_config, settings
from examples.harness.config import jax_dtype
from examples.harness.parts import JaxParts


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _predict(graphdef, params, stats, images):
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    out, _ = model_jax.apply(graphdef, params, stats, images.astype(dtype), train=False)
    return out["cls"].astype("float32"), out["box"].astype("float32")


def _evaluate(graphdef, params, stats, heldout, config) -> dict[str, float]:
    cls, box = [], []
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        images = heldout["image"][start : start + config.eval_batch_size]
        c, b = _predict(graphdef, params, stats, images)
        cls.append(np.asarray(c))
        box.append(np.asarray(b))
    return scores(np.concatenate(cls), np.concatenate(box), heldout)


def jax_parts(config: Config, weights) -> JaxParts:
    """The NNX detector of a run (from the torch weights), its loss and evaluation.

    Example:
        >>> from examples.detection.parts_torch import initial_weights
        >>> cfg = Config(width=4, mode="naive", precision="float16")
        >>> parts = jax_parts(cfg, initial_weights(cfg))
        >>> jax.tree_util.tree_leaves(parts.params)[0].dtype
        dtype('float32')
    """
    graphdef, params, stats = model_jax.split(
        convert.nnx_from_torch(build_model(config, weights))
    )
    dtype = jax_dtype(config.precision)

    def forward(p, s, batch):
        # float32 master weights cast for the forward (what the jmp policy
        # of the stable run does), batch statistics as they are
        p = jax.tree.map(lambda x: x.astype(dtype), p)
        out, new_stats = model_jax.apply(graphdef, p, s, batch["image"], train=True)
        return {key: out[key].astype(dtype) for key in ("cls", "box")}, new_stats

    if config.mode == "stable":

        def loss_fn(p, s, batch):
            out, new_stats = model_jax.apply(graphdef, p, s, batch["image"], train=True)
            return loss_jax.stable_loss(out, batch)[0], new_stats

    else:

        def loss_fn(p, s, batch):
            out, new_stats = forward(p, s, batch)
            return loss_jax.naive_loss(out, batch)[0], new_stats

    @jax.jit  # once per failed run; jitted: op by op it took 29 s on 2 cores
    def measure(p, s, batch):
        out, _ = forward(p, s, batch)
        pred = loss_jax.gather_boxes(out, batch)
        box, vjp = jax.vjp(lambda b: loss_jax.naive_ciou(b, batch["boxes"]), pred)
        (grad,) = vjp(jnp.ones_like(box))
        focal = loss_jax.naive_focal(out["cls"], batch["heatmap"].astype(dtype))
        return box, jnp.isfinite(grad).all(-1), focal, jax.nn.sigmoid(out["cls"])

    def probe(p, s, batch):
        box, grad_ok, focal, probs = measure(p, s, batch)
        as32 = functools.partial(np.asarray, dtype=np.float32)
        return cause_note(
            as32(box),
            np.asarray(grad_ok),
            as32(focal),
            as32(probs),
            {k: np.asarray(batch[k]) for k in ("boxes", "classes", "box_mask")},
            config.precision,
        )

    tx = eval_params = None
    if config.optimizer == "sgd":
        recipe = for_config(config)
        steps = recipe.steps
        tx = recipe_jax.yolo_optimizer(steps, **settings(recipe))
        if config.ema_decay > 0:
            tx = recipe_jax.with_ema(
                tx, steps, decay=config.ema_decay, tau=config.ema_tau
            )
            eval_params = lambda _p, opt_state: recipe_jax.ema_weights(opt_state)  # noqa: E731
    return JaxParts(
        params=params,
        model_state=stats,
        loss_fn=loss_fn,
        evaluate=lambda p, s, heldout: _evaluate(graphdef, p, s, heldout, config),
        probe=probe if config.mode == "naive" else None,
        optimizer=tx,
        eval_params=eval_params,
    )
