"""The loss the train step differentiates: the user's ``loss_fn`` called
under the policy, scaled, as this call's share of the mean over the
micro-batches and replicas, and its gradient (`share_grad`).

Under ``axis_name`` each of the N replicas differentiates ``scale * loss /
N`` with respect to params marked varying over the axis (`as_varying`), so
that its backward holds what one device's holds for its rows (the same
float16 headroom); `replicas` says how many there are.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from jaxstable._src.distributed import axis_size
from jaxstable._src.precision import LOSS_SCOPE
from jaxstable._src.step_checks import StepSpec, check_loss

__all__ = ["as_varying", "compute_loss", "replicas", "share_grad"]


def _call_loss(spec: StepSpec, params, model_state, batch):
    """``(out, new_model_state)`` of the user's loss; flax's
    TraceContextError (an NNX model merged from variables made outside the
    trace, then mutated by batch norm or dropout) re-raised with the fixes."""
    try:
        if spec.has_state:
            return spec.loss_fn(params, model_state, batch)
        return spec.loss_fn(params, batch), model_state
    except Exception as e:
        errors = sys.modules.get("flax.errors")
        if errors is None or not isinstance(e, errors.TraceContextError):
            raise
        state = "" if spec.has_state else ", and build the step with has_state=True"
        raise errors.TraceContextError(
            f"loss_fn mutated an NNX variable made outside the traced step ({e}). "
            "Inside make_train_step the model must be rebuilt from the traced "
            "state with fresh variables: write the loss as loss(model, batch) "
            "and pass jaxstable.train.nnx_loss(model, loss) with "
            "TrainState.from_nnx(model, optimizer) and has_state=True; or merge "
            "with nnx.merge(graphdef, params, model_state, copy=True) and return "
            f"the model's new state (nnx.split(model, nnx.Param, ...)[2]){state}"
        ) from e


def compute_loss(spec: StepSpec, params, model_state, batch):
    """``(loss, (aux, new_model_state))``: the loss as a float32 scalar, the
    params and batch cast to the policy's compute dtype first."""
    pol = spec.policy
    if pol is not None:
        params = pol.cast_to_compute(params)
        batch = pol.cast_to_compute(batch)
    # The scope marks the loss's matmuls (forward and backward) for the
    # policy audit; it changes no computation.
    with jax.named_scope(LOSS_SCOPE):
        out, new_model_state = _call_loss(spec, params, model_state, batch)
    loss, aux = out if spec.has_aux else (out, None)
    return check_loss(loss), (aux, new_model_state)


def _share_loss(params, ls, model_state, batch, parts, *, spec: StepSpec):
    # This call's share of the mean over all `parts` (micro-batches times
    # replicas), scaled: each backward then holds what one device's
    # backward holds for these rows (the same float16 headroom). For
    # parts = 1 the division is exact (loss / 1 == loss).
    loss, rest = compute_loss(spec, params, model_state, batch)
    return ls.scale(loss / parts if parts > 1 else loss), (loss, rest)


# ``share_grad(params, ls, model_state, batch, parts, spec=spec)``: the
# scaled share and its gradient with respect to ``params``.
share_grad = jax.value_and_grad(_share_loss, has_aux=True)


def as_varying(params: Any, axis_name: str) -> Any:
    """``params`` marked as varying over ``axis_name`` inside `jax.shard_map`.

    Under shard_map's default ``check_vma=True``, `jax.grad` of a replica's
    loss with respect to REPLICATED params returns the SUM of the replicas'
    gradients (the transpose of the implicit broadcast is a psum): a pmean
    after it would give n times the gradient (measured: 4x on 4 devices).
    Marked varying, they get each replica's own gradient, which the step then
    averages, as under ``check_vma=False`` and `jax.pmap` (where this is a
    no-op). Params that already vary over the axis (sharded in_specs) are
    refused: the step averages gradients of replicated params only.
    """

    def mark(path, x):
        kind = getattr(jax.typeof(x), "manual_axis_type", None)
        if kind is not None and axis_name in kind.varying:
            raise ValueError(
                f"make_train_step(axis_name={axis_name!r}): params leaf "
                f"{jax.tree_util.keystr(path)} varies over {axis_name!r}; the "
                "state must be replicated over that axis (shard_map in_specs "
                "P() for the state, P(axis_name) for the batch only)"
            )
        return jax.lax.pcast(x, axis_name, to="varying")

    return jax.tree_util.tree_map_with_path(mark, params)


def replicas(axis_name: str | None) -> int:
    """How many replicas the step's gradients are summed over (1 without
    ``axis_name``); refuses an ``axis_name`` that is not mapped here and a
    step inside `jax.shard_map` without one."""
    if axis_name is not None:
        return axis_size(axis_name, "make_train_step")
    manual = tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
    if manual:
        # Without axis_name nothing is reduced over the replicas: each one
        # applies the gradient of its own rows, so under check_vma=False the
        # "replicated" state silently differs between devices (and under
        # check_vma=True the gradient is the SUM of the replicas' means).
        raise ValueError(
            f"make_train_step: the step runs inside jax.shard_map over the axes "
            f"{manual} but was built with axis_name=None, so the replicas' "
            "gradients would not be reduced and the replicas would drift apart; "
            f"build it with make_train_step(..., axis_name={manual[0]!r})"
        )
    return 1
