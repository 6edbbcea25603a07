"""The JAX side of a language-model run: the NNX decoder, loss and evaluation.

`jax_parts(config, weights)` hands the harness what is specific to the task
(see `examples.harness.parts.JaxParts`); the modes are those of
`parts_torch`. The naive loss casts the float32 master weights to the compute
dtype itself; the stable one gets them cast by the harness's jmp policy. The
optimizer is the twin of `parts_torch.optimizer`: Adam (b1, b2, eps; optax's
bias corrections are torch's), decoupled decay on the >= 2-d weights, the
schedule of `schedule.lr_at` (:func:`jax_schedule`). The stable runs'
spike guard is `jaxstable.transforms.skip_spikes` with the options of
`parts_torch.spike_guard_options`, outermost around the stable optimizer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from examples.harness.config import jax_dtype
from examples.harness.parts import JaxParts
from examples.lm import convert, loss_jax, metric, model_jax, probe
from examples.lm.config import Config
from examples.lm.parts_torch import build_model, spike_guard_options
from jaxstable import diagnostics, transforms


def jax_schedule(config: Config):
    """The jnp twin of `schedule.lr_at` (an optax schedule of the count).

    Example:
        >>> c = Config(learning_rate=0.1, warmup_steps=10, steps=110)
        >>> [round(float(jax_schedule(c)(jnp.asarray(n))), 4) for n in (0, 60, 200)]
        [0.01, 0.055, 0.01]
    """
    c = config
    f = c.final_lr_fraction

    def rate(count):
        count = jnp.asarray(count, jnp.float32)
        warm = c.learning_rate * (count + 1) / c.warmup_steps
        span = max(1, c.steps - c.warmup_steps)
        t = jnp.clip((count - c.warmup_steps) / span, 0.0, 1.0)
        cos = c.learning_rate * (f + (1 - f) * 0.5 * (1 + jnp.cos(jnp.pi * t)))
        return jnp.where(count < c.warmup_steps, warm, cos)

    return rate


def jax_optimizer(config: Config) -> optax.GradientTransformation:
    """AdamW with the task's schedule (twin of `parts_torch.optimizer`).

    Example:
        >>> tx = jax_optimizer(Config(warmup_steps=10))
        >>> u, _ = tx.update({"w": jnp.ones((2, 2))}, tx.init({"w": jnp.zeros((2, 2))}),
        ...                  {"w": jnp.zeros((2, 2))})
        >>> round(float(u["w"][0, 0]), 6)
        -0.01
    """
    parts = [optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps)]
    if config.weight_decay > 0:
        mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
        parts.append(optax.add_decayed_weights(config.weight_decay, mask=mask))
    parts.append(optax.scale_by_learning_rate(jax_schedule(config)))
    return optax.chain(*parts)


@functools.partial(jax.jit, static_argnames="graphdef")
def _nll(graphdef, params, inputs, targets):
    logits, _ = model_jax.apply(graphdef, params, inputs)
    return loss_jax.nll_sum(logits, targets)


def _evaluate(graphdef, params, heldout, config) -> dict[str, float]:
    total = 0.0
    for start in range(0, len(heldout["inputs"]), config.eval_batch_size):
        sl = slice(start, start + config.eval_batch_size)
        total += float(
            _nll(graphdef, params, heldout["inputs"][sl], heldout["targets"][sl])
        )
    return metric.scores(total, heldout["targets"].size)


def jax_parts(config: Config, weights) -> JaxParts:
    """The NNX decoder of a run (from the torch weights), loss, evaluation.

    Example:
        >>> from examples.lm.parts_torch import initial_weights
        >>> cfg = Config(width=16, n_heads=2, mode="naive", precision="bfloat16")
        >>> parts = jax_parts(cfg, initial_weights(cfg))
        >>> jax.tree_util.tree_leaves(parts.params)[0].dtype
        dtype('float32')
    """
    dtype = jax_dtype(config.precision)
    tm = build_model(config, weights)  # float32 weights in torch's layout
    graphdef, params = nnx.split(convert.nnx_from_torch(tm, dtype=dtype), nnx.Param)
    diagnostics.check_params(params)  # pre-flight: the weights are finite

    def cast(p):
        return jax.tree.map(lambda x: x.astype(dtype), p)

    if config.mode == "stable":

        def loss_fn(p, s, batch):
            logits, stats = model_jax.apply(graphdef, p, batch["inputs"])
            out = loss_jax.stable_loss(logits, batch["targets"], stats, config.z_loss)
            return out, s

    else:

        def loss_fn(p, s, batch):
            # float32 master weights cast for the forward (as the jmp policy
            # of the stable run does)
            logits, stats = model_jax.apply(graphdef, cast(p), batch["inputs"])
            return loss_jax.naive_loss(logits, batch["targets"], stats), s

    def probe_fn(p, s, batch):
        # one forward (off the hot path) from the weights before the bad step
        logits, stats = model_jax.apply(graphdef, cast(p), batch["inputs"])
        _, aux = loss_jax.naive_loss(logits, batch["targets"], stats)
        return probe.cause_note(
            {k: float(np.asarray(v)) for k, v in aux.items()}, config
        )

    spikes = spike_guard_options(config)
    return JaxParts(
        params=params,
        model_state=None,
        loss_fn=loss_fn,
        evaluate=lambda p, s, heldout: _evaluate(graphdef, p, heldout, config),
        probe=probe_fn if config.mode == "naive" else None,
        has_aux=True,
        optimizer=jax_optimizer(config),
        spike_guard=None
        if spikes is None
        else functools.partial(transforms.skip_spikes, **spikes),
    )
