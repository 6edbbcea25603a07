"""The train step's micro-batches: splitting a batch, summing their gradients,
combining their ``aux``, and keeping the finite ones.

`summed_microbatch_grads` is the ``microbatches=k`` branch of
`jaxstable.train.make_train_step`: one `lax.scan` over the k slices of the
batch, the scaled gradients added up in float32 at least; with
``drop_non_finite_microbatches`` a non-finite micro-batch is selected out of
the sum (`kept_microbatch_grads`). Each micro-batch's scaled share and its
gradient are `step_loss.share_grad`'s.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxstable._src.check_points import CheckPoints
from jaxstable._src.loss_scale_math import all_finite
from jaxstable._src.step_checks import StepSpec
from jaxstable._src.step_loss import share_grad
from jaxstable._src.step_state import keep_model_state

__all__ = [
    "combine_aux",
    "kept_microbatch_grads",
    "split_batch",
    "summed_microbatch_grads",
]


def split_batch(batch: Any, k: int) -> Any:
    """Every leaf ``x`` as ``x.reshape(k, n // k, ...)``: micro-batch ``i`` is
    rows ``i*n/k`` to ``(i+1)*n/k`` of the leading axis, as torch.chunk."""

    def split(path, x):
        shape = jnp.shape(x)
        if not shape or shape[0] % k:
            # Same text as torchref.train.TrainStep.
            name = jax.tree_util.keystr(path) or "(the batch)"
            raise ValueError(
                f"microbatches={k}: batch leaf {name} has shape {tuple(shape)}; "
                "every batch leaf needs a leading axis "
                f"divisible by {k} (micro-batch i is its i-th of {k} equal "
                "consecutive slices)"
            )
        return jnp.reshape(x, (k, shape[0] // k, *shape[1:]))

    return jax.tree_util.tree_map_with_path(split, batch)


def _combine_leaf(x: Any) -> Any:
    if isinstance(x, CheckPoints):
        return CheckPoints(
            x.names,
            tuple(jnp.all(f, axis=0) for f in x.finite),
            tuple(jnp.nanmax(m, axis=0) for m in x.max_abs),
        )
    dtype = jnp.result_type(x)
    if dtype == jnp.bool_:
        return jnp.all(x, axis=0)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.mean(x, axis=0)
    return jnp.sum(x, axis=0)


def combine_aux(aux: Any) -> Any:
    """One ``aux`` from the micro-batches' stacked ones (leading axis k):
    floating leaves averaged (a mean over equal micro-batches is the whole
    batch's), boolean leaves ANDed, integer leaves summed (counts add up); a
    `CheckPoints` collector is finite where every micro-batch was, with the
    largest ``max_abs`` (nan only when no micro-batch had a finite entry).
    The same rule as `torchref.train.TrainStep`."""
    return jax.tree_util.tree_map(
        _combine_leaf, aux, is_leaf=lambda x: isinstance(x, CheckPoints)
    )


def _accumulator(params: Any) -> Any:
    """Zeros shaped as ``params``, in float32 at least (torch adds into
    p.grad, in the params' dtype: the same for float32 params); the sum is
    cast back to the params' dtype after the unscale."""
    return jax.tree_util.tree_map(
        lambda p: jnp.zeros(
            jnp.shape(p), jnp.promote_types(jnp.result_type(p), jnp.float32)
        ),
        params,
    )


def _micro(spec, params, ls, parts, carry, mb):
    """One micro-batch of the plain sum: its scaled share's gradient added."""
    acc, ms = carry
    (_, (loss, (aux, ms))), g = share_grad(params, ls, ms, mb, parts, spec=spec)
    acc = jax.tree_util.tree_map(lambda a, x: a + x.astype(a.dtype), acc, g)
    return (acc, ms), (loss, aux)


def summed_microbatch_grads(
    spec: StepSpec,
    state: Any,
    params: Any,
    batch: Any,
    replicas: int,
) -> tuple:
    """``(losses, aux, model_state, scaled gradient sum[, dropped])`` over
    the ``spec.microbatches`` slices of ``batch``; ``params`` are the ones
    to differentiate (marked varying under ``spec.axis_name``)."""
    k = spec.microbatches
    ls = state.loss_scale
    acc, ms = _accumulator(state.params), state.model_state
    if spec.axis_name is not None:
        # The carry comes back varying over the axis (each replica's own
        # rows); under shard_map it must go in so.
        acc, ms = jax.tree_util.tree_map(
            lambda x: jax.lax.pcast(x, spec.axis_name, to="varying"), (acc, ms)
        )
    if spec.drop_non_finite_microbatches:
        return kept_microbatch_grads(spec, params, ls, acc, ms, batch)
    micro = functools.partial(_micro, spec, params, ls, k * replicas)
    (acc, ms), (losses, aux) = jax.lax.scan(micro, (acc, ms), split_batch(batch, k))
    return losses, (None if aux is None else combine_aux(aux)), ms, acc


def _kept_micro(spec, params, ls, carry, mb):
    """One micro-batch of the kept sum: added times its weight where its
    loss and scaled gradient are finite, selected out (with its model
    state's statistics) where not."""
    acc, ms, wsum, lsum, dropped = carry
    k = spec.microbatches
    (_, (loss, (aux, new_ms))), g = share_grad(params, ls, ms, mb, k, spec=spec)
    ok = jnp.logical_and(jnp.isfinite(loss), all_finite(g))
    weight = spec.microbatch_weight
    w = (
        jnp.ones([], jnp.float32)
        if weight is None
        else jnp.asarray(weight(mb), jnp.float32)
    )
    acc = jax.tree_util.tree_map(
        lambda a, x: jnp.where(ok, a + w * x.astype(a.dtype), a), acc, g
    )
    ms = keep_model_state(ok, new_ms, ms)
    wsum = wsum + jnp.where(ok, w, 0.0)
    lsum = lsum + jnp.where(ok, w * loss, 0.0)
    dropped = dropped + jnp.logical_not(ok).astype(jnp.int32)
    return (acc, ms, wsum, lsum, dropped), aux


def kept_microbatch_grads(spec: StepSpec, params, ls, acc, ms, batch) -> tuple:
    """`summed_microbatch_grads` with ``drop_non_finite_microbatches``: a
    micro-batch whose loss or scaled gradient is non-finite is left out
    of the sum (a select: its NaN never enters), and so are its model
    state's statistics; the others are weighted by ``microbatch_weight``
    and the sum is rescaled to their weighted mean. ``losses`` is then
    the kept micro-batches' weighted mean loss (shape ``(1,)``), NaN
    when none was kept (a zero weight sum): the gradients are NaN too
    (``0 * inf``), and the step is skipped by its usual check."""
    k = spec.microbatches
    zero = jnp.zeros([], jnp.float32)
    carry = (acc, ms, zero, zero, jnp.zeros([], jnp.int32))
    micro = functools.partial(_kept_micro, spec, params, ls)
    (acc, ms, wsum, lsum, dropped), aux = jax.lax.scan(
        micro, carry, split_batch(batch, k)
    )
    # Each share was scale * loss_i / k: times k / (sum of kept weights)
    # it is the kept micro-batches' weighted mean (k / k == 1 exactly
    # when all k are kept with the default weights). No kept weight:
    # k / 0 = inf, 0 * inf = NaN, a skipped step.
    factor = jnp.float32(k) / wsum
    acc = jax.tree_util.tree_map(lambda a: a * factor.astype(a.dtype), acc)
    aux = None if aux is None else combine_aux(aux)
    return (lsum / wsum)[None], aux, ms, acc, dropped
