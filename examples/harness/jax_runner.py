"""The JAX runs: the naive and the stable step, and one run on `jaxstable.train.fit`.

:func:`run_jax` trains one run of a task as its config says (``mode``,
``precision``, ``devices``) and returns a `RunResult`; the naive step is a
plain jitted function with no guard (:func:`naive_step`), the stable one
`jaxstable.train.make_train_step` with the jmp policy, a dynamic loss scale
for float16, clipping and the skip of non-finite updates
(:func:`stable_step`). JAX is imported inside the functions: importing the
harness does not start it (``--devices`` must set ``XLA_FLAGS`` first).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from examples.harness import devices
from examples.harness.config import BaseConfig, jax_dtype
from examples.harness.parts import JaxParts
from examples.harness.results import (
    RunResult,
    Watch,
    adam_underflow_note,
    make_result,
    report_text,
)


def jax_optimizer(config: BaseConfig):
    """The plain optax optimizer of the config (twin of `torch_optimizer`).

    Adam(W) with the config's b1, b2, eps (optax adds eps outside the square
    root, as torch does); SGD with momentum 0.9 (``t = g + 0.9 t``, torch's
    buffer).

    Example:
        >>> import jax.numpy as jnp
        >>> tx = jax_optimizer(BaseConfig(optimizer="sgd"))
        >>> u, _ = tx.update(jnp.ones(2), tx.init(jnp.zeros(2)))
        >>> [round(float(x), 6) for x in u]
        [-0.002, -0.002]
    """
    import optax

    c = config
    if c.optimizer == "adam":
        return optax.adam(c.learning_rate, b1=c.b1, b2=c.b2, eps=c.eps)
    if c.optimizer == "adamw":
        return optax.adamw(
            c.learning_rate, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay
        )
    return optax.sgd(c.learning_rate, momentum=0.9)


def cast_floats(tree: Any, dtype: Any) -> Any:
    """`tree` with its floating leaves cast to `dtype` (the others as they are).

    Example:
        >>> import jax.numpy as jnp
        >>> out = cast_floats({"x": jnp.ones(2), "n": jnp.arange(2)}, jnp.float16)
        >>> str(out["x"].dtype), str(out["n"].dtype)
        ('float16', 'int32')
    """
    import jax
    import jax.numpy as jnp

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)


def _report(tree) -> str:
    import jax

    from jaxstable import diagnostics

    return report_text(
        tree,
        diagnostics,
        lambda sub: sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(sub)),
    )


def _eval_params(parts: JaxParts, params: Any, opt_state: Any) -> Any:
    """The params a JAX run is evaluated with (`JaxParts.eval_params`)."""
    return params if parts.eval_params is None else parts.eval_params(params, opt_state)


def _tx(config, parts):
    """The task's own optax optimizer if it has one, else the config's."""
    return parts.optimizer if parts.optimizer is not None else jax_optimizer(config)


def naive_step(config, parts):
    """The naive step: a pure ``(state, batch) -> (state, metrics)`` over a dict.

    The state also holds the step's gradients and updates (``"last"``) for
    the report of the first non-finite step: twice the parameters' memory,
    small next to a second compile of the whole step to recompute them.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from jaxstable import transforms
    from jaxstable.loss_scale import all_finite

    dtype = jax_dtype(config.precision)
    tx = _tx(config, parts)

    def step(state, batch):
        batch = cast_floats(batch, dtype)

        def loss(p):
            out, new_ms = parts.loss_fn(p, state["model_state"], batch)
            value, aux = out if parts.has_aux else (out, None)
            return value, (aux, new_ms)

        (value, (aux, new_ms)), grads = jax.value_and_grad(loss, has_aux=True)(
            state["params"]
        )
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {
            "loss": value.astype(jnp.float32),
            "grad_norm": transforms.global_norm(grads),
            "loss_scale": jnp.ones([], jnp.float32),
            "finite": all_finite((value, grads, params)),
            "skipped_total": jnp.zeros([], jnp.int32),
        }
        if parts.has_aux:
            metrics["aux"] = aux
        new = {
            "params": params,
            "opt_state": opt_state,
            "model_state": new_ms,
            "last": {"grads": grads, "updates": updates},
        }
        return new, metrics

    zeros = jax.tree.map(jnp.zeros_like, parts.params)
    state = {
        "params": parts.params,
        "opt_state": tx.init(parts.params),
        "model_state": parts.model_state,
        "last": {"grads": zeros, "updates": zeros},
    }
    return jax.jit(step), state


def _naive_report(config, after) -> str:
    import jax
    import optax

    grads, updates = after["last"]["grads"], after["last"]["updates"]
    text = _report({"grads": grads, "updates": updates, "params": after["params"]})
    adam = [
        s
        for s in jax.tree_util.tree_leaves(
            after["opt_state"], is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
        )
        if isinstance(s, optax.ScaleByAdamState)
    ]
    if adam:
        as_np = functools.partial(np.asarray, dtype=np.float32)
        g = [as_np(x) for x in jax.tree_util.tree_leaves(grads)]
        nus = jax.tree_util.tree_leaves(adam[0].nu)
        nu = [as_np(x) for x in nus]
        note = adam_underflow_note(g, nu, str(nus[0].dtype), config.eps)
        text += "\n" + note if note else ""
    return text


def _locate_naive(config, parts, before, batch) -> dict[str, Any] | None:
    """`jaxstable.diagnostics.locate` of a naive step, off the hot path.

    The naive step is a plain function, which `locate` does not take: the
    same step is rebuilt as an unguarded `TrainStep` (the task's naive loss,
    no policy, `NoOpLossScale`) over the state `before` the bad step, with
    the naive run's own optimizer state. ``batch``: cast as the step casts it.
    """
    from jaxstable import diagnostics, train

    step = train.make_train_step(
        parts.loss_fn, has_state=True, has_aux=parts.has_aux, jit=False
    )
    state = train.TrainState.create(
        params=before["params"],
        optimizer=_tx(config, parts),
        model_state=before["model_state"],
    ).replace(opt_state=before["opt_state"])
    loc = diagnostics.locate(step, state, batch)
    return None if loc is None else loc._asdict()


def stable_step(config, parts):
    """The stable step ``step(state, batch) -> (state, metrics)`` and its state.

    `jaxstable.train.make_train_step` over the task's loss with the jmp
    policy of ``config.precision``; the optimizer wrapped in
    `stable_optimizer` (clip at ``config.max_grad_norm``, skip non-finite
    updates), inside the task's ``spike_guard`` if it has one; a
    `DynamicLossScale` for float16.
    """
    from jaxstable import train, transforms
    from jaxstable.loss_scale import DynamicLossScale, NoOpLossScale

    tx = transforms.stable_optimizer(
        _tx(config, parts), max_grad_norm=config.max_grad_norm
    )
    if parts.spike_guard is not None:  # outermost: the pre-clip norm, the loss
        tx = parts.spike_guard(tx)
    # float16 only: its smallest subnormal is 6e-8, where small gradients of a
    # mean over thousands of pixels vanish; bfloat16 reaches 1e-38 like float32
    scale = DynamicLossScale() if config.precision == "float16" else NoOpLossScale()
    state = train.TrainState.create(
        params=parts.params,
        optimizer=tx,
        loss_scale=scale,
        model_state=parts.model_state,
    )
    step = train.make_train_step(
        parts.loss_fn, has_state=True, has_aux=parts.has_aux, policy=config.policy
    )
    return step, state


def run_jax(
    task, config, weights, batches, heldout, *, progress=True, log=None
) -> RunResult:
    """One JAX run of `task` as `config` says, on `jaxstable.train.fit`.

    ``log(record)``, if given, is called with each step's `fit` record.

    Returns:
      A :class:`RunResult` (``framework="jax"``).
    """
    import jax

    from jaxstable import train
    from jaxstable.loss_scale import all_finite

    parts = task.jax_parts(config, weights)
    batches = [jax.tree.map(np.asarray, b) for b in batches[: config.steps]]
    fit_args = dict(log=train.Log(progress=progress, time_steps=True))
    dtype = jax_dtype(config.precision)
    if config.eval_every is not None:

        def eval_fn(state):
            params, model_state, opt_state = (
                (state["params"], state["model_state"], state["opt_state"])
                if isinstance(state, dict)
                else (state.params, state.model_state, state.opt_state)
            )
            params = _eval_params(parts, params, opt_state)
            return parts.evaluate(cast_floats(params, dtype), model_state, heldout)

        fit_args.update(evaluate=(eval_fn, config.eval_every))
    if config.mode == "naive":
        step, state = naive_step(config, parts)
        state, batches = devices.jax_distribute(config, state, batches)
        # `before`: the state the next step starts from (no copy: jax arrays
        # are immutable and the naive step donates nothing)
        box = {"first": None, "text": "", "before": state, "location": None}

        def on_step(record, after):
            if log is not None:
                log(record)
            if box["first"] is None and not record["finite"]:
                box["first"] = record["step"]
                box["text"] = _naive_report(config, after)
                before = box["before"]
                batch = cast_floats(batches[record["step"]], dtype)
                if parts.probe is not None:
                    probe = parts.probe(before["params"], before["model_state"], batch)
                    box["text"] += "\n" + probe
                box["location"] = _locate_naive(config, parts, before, batch)
            box["before"] = after

        state, history = train.fit(
            state,
            step,
            batches,
            on_step=on_step,
            nan_policy=train.NanPolicy.skip(stop_after=config.stop_after_nonfinite),
            **fit_args,
        )
        first_bad, text = box["first"], box["text"]
        located = (first_bad, box["location"])
        params, model_state = state["params"], state["model_state"]
        params = _eval_params(parts, params, state["opt_state"])
    else:
        step, state = stable_step(config, parts)
        state, batches = devices.jax_distribute(config, state, batches)
        finite = jax.jit(all_finite)

        def report(record, st):
            grads = step.grads(st, batches[record["step"]])
            return _report({"grads (next step)": grads, "params": st.params})

        watch = Watch(
            config,
            lambda st: not bool(finite((st.params, st.model_state))),
            report,
            log,
        )
        state, history = train.fit(state, step, batches, on_step=watch, **fit_args)
        first_bad, text = watch.first_bad, watch.text
        located = None  # fit located the first skipped step (its record)
        params, model_state = state.params, state.model_state
        params = _eval_params(parts, params, state.opt_state)
    scores = parts.evaluate(cast_floats(params, dtype), model_state, heldout)
    result = make_result("jax", config, history, first_bad, text, scores, located)
    if config.devices > 1:
        from jaxstable import distributed

        identical = distributed.replicas_identical(state)
        result.replicas = devices.replica_check(config.devices, identical, [history])
    return result
