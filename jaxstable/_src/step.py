"""The train state and the guarded train step (loss scale, clip, skip).

The step does, in this order (torch.amp's order):
scaled loss -> grad -> unscale -> ONE all-finite reduction -> clip ->
optimizer update unless non-finite -> loss-scale adjust.
It is pure and jitted, contains no `lax.cond` and moves nothing to the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxstable._src.loss_scale import (
    NoOpLossScale,
    all_finite,
    scaled_value_and_grad,
)
from jaxstable._src.precision import get_policy
from jaxstable._src.transforms import (
    SkipNonFiniteState,
    _writes_finite,
    global_norm,
)

__all__ = ["TrainState", "TrainStep", "make_train_step"]


@flax.struct.dataclass
class TrainState:
    """Everything a guarded train step reads and writes (a pytree).

    Attributes:
      step: int32, number of train steps taken (skipped ones included).
      params: the trainable parameters (float32 under a mixed policy).
      opt_state: the optimizer state of ``tx``.
      loss_scale: a `jaxstable.loss_scale` (or jmp) loss scale.
      model_state: non-trainable collections (e.g. ``{"batch_stats": ...}``),
        None if the model has none. Kept unchanged on a non-finite step.
      skipped_total: int32, number of steps whose gradients were non-finite
        (their update was not applied).
      tx: the optax transformation (static, not a pytree leaf).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import loss_scale, train, transforms
      >>> tx = transforms.stable_optimizer(optax.sgd(0.1), max_grad_norm=1.0)
      >>> state = train.TrainState.create(
      ...     params={"w": jnp.ones(3)}, optimizer=tx,
      ...     loss_scale=loss_scale.DynamicLossScale())
      >>> int(state.step), int(state.skipped_total), float(state.loss_scale.loss_scale)
      (0, 0, 65536.0)
    """

    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: Any
    model_state: Any
    skipped_total: jax.Array
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)

    @classmethod
    def create(
        cls,
        *,
        params: Any,
        optimizer: optax.GradientTransformation,
        loss_scale: Any = None,
        model_state: Any = None,
    ) -> TrainState:
        """Builds the initial state: ``opt_state = optimizer.init(params)``.

        Args:
          params: the parameter pytree.
          optimizer: an optax transformation, typically
            `jaxstable.transforms.stable_optimizer(...)`.
          loss_scale: a loss scale; None means `NoOpLossScale()`.
          model_state: non-trainable collections or None.

        Returns:
          A `TrainState` with ``step = skipped_total = 0``.

        Example:
          >>> import jax.numpy as jnp, optax
          >>> from jaxstable import train
          >>> tx = optax.sgd(0.1)
          >>> s = train.TrainState.create(params={"w": jnp.zeros(2)}, optimizer=tx)
          >>> int(s.step), type(s.loss_scale).__name__
          (0, 'NoOpLossScale')
        """
        return cls(
            step=jnp.zeros([], jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            loss_scale=NoOpLossScale() if loss_scale is None else loss_scale,
            model_state=model_state,
            skipped_total=jnp.zeros([], jnp.int32),
            tx=optimizer,
        )


def _select(pred: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), new, old)


def _as_varying(params: Any, axis_name: str) -> Any:
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


def _pmean_floating(tree: Any, axis_name: str) -> Any:
    """`lax.pmean` of the floating leaves of ``tree``; the others as they are."""

    def mean(x):
        if jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return jax.lax.pmean(x, axis_name)
        return x

    return jax.tree.map(mean, tree)


_INJECT_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _outer_skip_state(opt_state: Any) -> SkipNonFiniteState | None:
    """``tx``'s OUTERMOST `SkipNonFiniteState`, or None.

    Only an outermost skip transform sees (and zeroes) the whole update. A
    skip nested inside a chain zeroes its own part only: in
    ``chain(skip_non_finite(sgd), add_decayed_weights(0.5))`` the decay would
    still move the params on a NaN step. `optax.inject_hyperparams` around the
    skip is accepted too (its step count still advances on a skipped step, as
    a torch LR scheduler stepped every iteration does).
    """
    if isinstance(opt_state, SkipNonFiniteState):
        return opt_state
    if isinstance(opt_state, _INJECT_STATES) and isinstance(
        opt_state.inner_state, SkipNonFiniteState
    ):
        return opt_state.inner_state
    return None


class TrainStep:
    """What `make_train_step` returns: ``step(state, batch) -> (state, metrics)``.

    Attributes:
      raw: the pure, un-jitted step function.
      grads: ``grads(state, batch) -> unscaled gradients`` (jitted), used by
        `fit` to report which gradient leaves went non-finite.
      jit: whether calls are jitted.
      donate: whether a jitted call donates its input state.
      loss_fn, policy, has_state, has_aux: what `make_train_step` was given
        (``policy`` parsed to a `jmp.Policy` or None), read by
        `jaxstable.diagnostics.locate`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import train
      >>> step = train.make_train_step(lambda p, b: jnp.sum((p["w"] * b) ** 2))
      >>> state = train.TrainState.create(params={"w": jnp.ones(2)},
      ...                                 optimizer=optax.sgd(0.1))
      >>> state, metrics = step(state, jnp.array([1.0, jnp.nan]))
      >>> bool(metrics["finite"]), int(metrics["skipped_total"])
      (False, 1)
      >>> state.params["w"].tolist()  # the NaN step was not applied
      [1.0, 1.0]
    """

    def __init__(self, raw: Callable, grads: Callable, jit: bool, donate: bool):
        self.raw = raw
        self.jit = bool(jit)
        self.donate = bool(donate)
        self.grads = jax.jit(grads) if jit else grads
        self._fn = jax.jit(raw, donate_argnums=(0,) if donate else ()) if jit else raw

    def __call__(
        self, state: TrainState, batch: Any
    ) -> tuple[TrainState, dict[str, Any]]:
        return self._fn(state, batch)

    def lower(self, state: TrainState, batch: Any):
        """`jax.jit(...).lower(state, batch)` of the step (for HLO inspection).

        With ``jit=False`` the raw step is jitted for the occasion (with the
        same donation), so the HLO is that of the jitted step.
        """
        fn = self._fn
        if not self.jit:
            fn = jax.jit(self.raw, donate_argnums=(0,) if self.donate else ())
        return fn.lower(state, batch)


def make_train_step(
    loss_fn: Callable,
    *,
    has_aux: bool = False,
    has_state: bool = False,
    policy: Any = None,
    jit: bool = True,
    donate: bool = False,
    axis_name: str | None = None,
) -> TrainStep:
    """Builds the guarded train step ``step(state, batch) -> (state, metrics)``.

    Per step, with ``ls = state.loss_scale``::

        value, grads, finite = scaled_value_and_grad(loss)(ls, params, ...)
        updates, opt_state = tx.update(grads, opt_state, params, grads_finite=finite)
        params = params + updates     # tx skips (zero update) unless applied
        loss_scale = ls.adjust(finite)

    The invariant: no step writes a non-finite value into the parameters,
    the optimizer state or the model state. A step is *applied* only when
    its gradients are finite AND the update, the new parameters and the new
    optimizer state are finite (float16 Adam state can turn finite gradients
    into ``m / 0``); otherwise it is skipped and counted in ``skipped_total``.
    ``finite`` (the gradient flag) is reduced once and reused by the skip
    transform and the loss scale, which reacts to the gradients only, as
    GradScaler does: a non-finite update is no overflow of the scaled loss.
    When ``tx``'s OUTERMOST state is a `SkipNonFiniteState` (as with
    `stable_optimizer`, possibly inside `optax.inject_hyperparams`) the skip
    transform makes both checks (``check_update=False`` there leaves the
    second out); otherwise the step itself checks the new params and
    optimizer state and keeps the old ones: a skip nested inside a chain
    would zero only its own part of the update. The model state (batch
    stats) is kept unchanged on a skipped step, and also when it is itself
    non-finite.

    Contracts of ``loss_fn``:
      - ``has_state=False``: ``loss_fn(params, batch) -> loss`` or, with
        ``has_aux``, ``-> (loss, aux)``.
      - ``has_state=True``: ``loss_fn(params, model_state, batch) ->
        (loss, new_model_state)`` or, with ``has_aux``,
        ``((loss, aux), new_model_state)``. With flax linen BatchNorm:
        ``model.apply({"params": p, **model_state}, x, mutable=["batch_stats"])``
        returns ``(out, new_model_state)``.
      The loss is cast to float32 before scaling (a float16 loss times 2**16
      overflows fp16's max 65504).

    Args:
      loss_fn: the loss function (see above).
      has_aux: ``loss_fn`` also returns ``aux``; it is put in ``metrics["aux"]``.
      has_state: ``loss_fn`` takes and returns a model state.
      policy: None, a `jmp.Policy` or a policy string
        (``"params=float32,compute=float16,output=float32"``): params and
        the floating leaves of the batch are cast to the compute dtype inside
        the differentiated function, so gradients come back in the params'
        dtype. The model state is passed uncast.
      jit: jit the step.
      donate: donate the input state's buffers to the output (saves memory;
        the input state must not be used after the call).
      axis_name: None, or the name of a mesh axis (flax ``DynamicScale``'s
        and `optax`'s idiom) when the step runs inside `jax.shard_map` (or
        `jax.pmap`) over it, each replica on its own rows of the batch and
        the state replicated (``in_specs=(P(), P(axis))``,
        ``out_specs=P()``). Each of the N replicas differentiates
        ``scale * loss / N`` (its share of the mean over all rows), the
        gradients are `lax.psum`-ed over the axis and then unscaled, so the
        result is one device's gradient of the global mean: a replica's
        backward holds what one device's holds for its rows (the same
        float16 headroom, where differentiating the replica's own mean held
        N times its share and overflowed at scale / N), and a sum of
        per-replica gradients of 2.5e38 no longer overflows where one
        device's gradient is finite. The loss and the floating leaves of
        ``aux`` and of the new model state are `lax.pmean`-ed. The guard's
        flag is taken from the summed gradients: it reuses the gradient
        all-reduce (a NaN or inf on any replica makes the sum non-finite on
        every replica), so every replica takes the same skip decision and
        the same loss-scale update with NO collective of its own. This is
        what torch's DDP does (GradScaler checks the all-reduced gradients)
        and what flax's ``DynamicScale(axis_name=...)`` does. For N a power
        of two the division is exact and the gradients equal those of a
        pmean of per-replica gradients bit for bit; otherwise ``loss / N``
        rounds once in float32 (a relative 6e-8). Not needed (leave None)
        under plain `jax.jit` with shardings (`jaxstable.distributed`):
        there XLA makes every reduction global itself.

    Returns:
      A `TrainStep`; calling it returns ``(new_state, metrics)`` where metrics
      holds device scalars: ``loss`` (unscaled, float32), ``grad_norm``
      (pre-clip, unscaled, float32), ``loss_scale`` (float32, the scale used
      for this step), ``finite`` (bool: the step was applied, see the
      invariant above), ``grads_finite`` (bool: the gradients alone),
      ``skipped_total`` (int32), and ``aux`` with ``has_aux``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import loss_scale, train, transforms
      >>> tx = transforms.stable_optimizer(optax.sgd(0.1), max_grad_norm=1.0)
      >>> state = train.TrainState.create(params=jnp.zeros(2), optimizer=tx,
      ...                                 loss_scale=loss_scale.DynamicLossScale())
      >>> step = train.make_train_step(lambda p, b: jnp.sum((p - b) ** 2))
      >>> state, m = step(state, jnp.array([1.0, 2.0]))
      >>> round(float(m["loss"]), 3), bool(m["finite"]), float(m["loss_scale"])
      (5.0, True, 65536.0)
      >>> state, m = step(state, jnp.array([jnp.nan, 2.0]))
      >>> bool(m["finite"]), int(m["skipped_total"]), float(state.loss_scale.loss_scale)
      (False, 1, 32768.0)

      Per device under `jax.shard_map` (here a 1-device mesh), state replicated:

      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxstable import distributed
      >>> mesh = distributed.make_mesh(1)
      >>> dp = train.make_train_step(lambda p, b: jnp.mean((p - b) ** 2),
      ...                            axis_name="data")
      >>> dp = jax.jit(jax.shard_map(dp, mesh=mesh, in_specs=(P(), P("data")),
      ...                            out_specs=P()))
      >>> state = distributed.shard_state(state, mesh)
      >>> batch = distributed.shard_batch(jnp.array([[1.0, 2.0]]), mesh)
      >>> state, m = dp(state, batch)
      >>> bool(m["finite"]), int(m["skipped_total"])
      (True, 1)
    """
    for name, flag in (("has_aux", has_aux), ("has_state", has_state)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    if axis_name is not None and not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be None or a str, got {axis_name!r}")
    pol = None if policy is None else get_policy(policy)

    def compute_loss(params, model_state, batch):
        if pol is not None:
            params = pol.cast_to_compute(params)
            batch = pol.cast_to_compute(batch)
        if has_state:
            out, new_model_state = loss_fn(params, model_state, batch)
        else:
            out, new_model_state = loss_fn(params, batch), model_state
        loss, aux = out if has_aux else (out, None)
        loss = jnp.asarray(loss, jnp.float32)
        if loss.shape != ():
            # Same text as torchref.train.TrainStep.
            raise ValueError(
                f"loss_fn must return a scalar (0-d) loss, got shape {loss.shape}; "
                "reduce it, e.g. with .mean()"
            )
        return loss, (aux, new_model_state)

    grad_fn = scaled_value_and_grad(compute_loss, has_aux=True)

    def replica_loss(params, ls, model_state, batch):
        # The replica's share of the mean over all replicas: its own mean
        # divided by their number, scaled. Its backward then holds what one
        # device's backward holds for these rows (same float16 headroom).
        loss, rest = compute_loss(params, model_state, batch)
        share = loss / jax.lax.axis_size(axis_name)
        return ls.scale(share), (loss, rest)

    def reduced_grads(state: TrainState, batch: Any):
        if axis_name is None:
            return grad_fn(state.loss_scale, state.params, state.model_state, batch)
        # Each replica differentiates scale * loss / N; the SUM of these over
        # the replicas, unscaled, is one device's gradient of the mean. The
        # flag is taken from that sum, so it is the same on every replica.
        ls = state.loss_scale
        params = _as_varying(state.params, axis_name)
        (_, (loss, (aux, model_state))), grads = jax.value_and_grad(
            replica_loss, has_aux=True
        )(params, ls, state.model_state, batch)
        grads = ls.unscale(jax.lax.psum(grads, axis_name))
        out = _pmean_floating((loss, aux, model_state), axis_name)
        return (out[0], out[1:]), grads, all_finite(grads)

    def step(state: TrainState, batch: Any):
        ls = state.loss_scale
        (loss, (aux, new_model_state)), grads, finite = reduced_grads(state, batch)
        grad_norm = global_norm(grads)
        tx = state.tx
        extra = {}
        if isinstance(tx, optax.GradientTransformationExtraArgs):
            extra = {"grads_finite": finite}

        def update(grads, opt_state, params):
            return tx.update(grads, opt_state, params, **extra)

        updates, opt_state = update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        skip = _outer_skip_state(opt_state)
        if skip is not None:
            # The skip transform checked gradients, update, new params and
            # new optimizer state (unless built with check_update=False).
            applied = skip.last_finite
        else:
            # No skip transform around the whole of tx: guard here, with the
            # same two checks (the gradient flag is reused; the new params
            # and optimizer state are checked in a pass that recomputes them,
            # as `skip_non_finite` does).
            written_ok = _writes_finite(update, grads, state.opt_state, state.params)
            applied = jnp.logical_and(finite, written_ok)
            params = _select(applied, params, state.params)
            opt_state = _select(applied, opt_state, state.opt_state)
        if state.model_state is not None:
            keep = jnp.logical_and(applied, all_finite(new_model_state))
            new_model_state = _select(keep, new_model_state, state.model_state)
        skipped_total = (state.skipped_total + jnp.logical_not(applied)).astype(
            jnp.int32
        )
        new_state = state.replace(
            step=(state.step + 1).astype(jnp.int32),
            params=params,
            opt_state=opt_state,
            # The scale reacts to the gradients only, as GradScaler's does: a
            # non-finite update is no overflow of the scaled loss.
            loss_scale=ls.adjust(finite),
            model_state=new_model_state,
            skipped_total=skipped_total,
        )
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "loss_scale": jnp.asarray(ls.loss_scale, jnp.float32),
            "finite": applied,
            "grads_finite": finite,
            "skipped_total": skipped_total,
        }
        if has_aux:
            metrics["aux"] = aux
        return new_state, metrics

    def grads(state: TrainState, batch: Any):
        return reduced_grads(state, batch)[1]

    out = TrainStep(step, grads, jit=jit, donate=donate)
    # What `diagnostics.locate` needs to re-run the loss op by op, off the
    # hot path (the jitted step does not read these).
    out.loss_fn, out.policy, out.has_state, out.has_aux = (
        loss_fn,
        pol,
        has_state,
        has_aux,
    )
    return out
