"""The guarded train step (loss scale, clip, skip) over a `TrainState`.

The step does, in this order (torch.amp's order):
scaled loss -> grad -> unscale -> ONE all-finite reduction -> clip ->
optimizer update unless non-finite -> loss-scale adjust.
It is pure and jitted, contains no `lax.cond` and moves nothing to the host.

`make_train_step` checks its arguments into one frozen `StepSpec`; the step
is the module-level functions below over that spec (`train_step`,
`reduced_grads`, ...), and `TrainStep` the dataclass that jits them and
audits the policy after a trace. The state and what a skipped step keeps of
it are in `step_state`, the micro-batches in `microbatches`, the checks in
`step_checks` and the metrics in `step_records`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxstable._src.clipping import global_norm
from jaxstable._src.guard_state import outer_guard
from jaxstable._src.loss_scale_math import all_finite
from jaxstable._src.microbatches import summed_microbatch_grads
from jaxstable._src.precision import warn_if_not_applied
from jaxstable._src.step_checks import (
    StepSpec,
    check_no_accumulation,
    check_param_dtypes,
    step_spec,
)
from jaxstable._src.step_loss import as_varying, replicas, share_grad
from jaxstable._src.step_records import input_names, step_metrics
from jaxstable._src.step_state import TrainState, keep_hyperparams, keep_model_state
from jaxstable._src.update_check import keep_finite, writes_finite

__all__ = ["TrainStep", "make_train_step"]


@dataclasses.dataclass(eq=False)
class TrainStep:
    """What `make_train_step` returns: ``step(state, batch) -> (state, metrics)``.

    Attributes:
      raw: the pure, un-jitted step function.
      grads: ``grads(state, batch) -> unscaled gradients`` (jitted), used by
        `fit` to report which gradient leaves went non-finite.
      jit: whether calls are jitted.
      donate: whether a jitted call donates its input state.
      spec: what `make_train_step` was given, checked (a frozen dataclass).
      loss_fn, policy, policy_spec, has_state, has_aux: read from ``spec``
        (``policy`` parsed to a `jmp.Policy` or None), read by
        `jaxstable.diagnostics.locate`.
      microbatches, drop_non_finite_microbatches: read from ``spec``.
      compute_dtypes: after a call that traced the step with a policy whose
        compute dtype differs from its params': ``{dtype name: count}`` of
        the matmuls and convolutions of the loss and its gradient; None
        before (see ``policy`` in `make_train_step`).

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

    spec: StepSpec
    jit: bool = True
    donate: bool = False
    raw: Callable = dataclasses.field(init=False, repr=False)
    grads: Callable = dataclasses.field(init=False, repr=False)
    compute_dtypes: dict[str, int] | None = dataclasses.field(default=None, init=False)
    traced: bool = dataclasses.field(default=False, init=False, repr=False)
    _fn: Callable = dataclasses.field(init=False, repr=False)
    _policy_done: bool = dataclasses.field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.jit, self.donate = bool(self.jit), bool(self.donate)
        self.raw = self._traced_step
        self.grads = jax.jit(self._grads) if self.jit else self._grads
        donate = (0,) if self.donate else ()
        self._fn = jax.jit(self.raw, donate_argnums=donate) if self.jit else self.raw

    # What `diagnostics.locate` reads to re-run the loss op by op, off the
    # hot path (the jitted step does not read these).
    loss_fn = property(lambda self: self.spec.loss_fn, doc="``loss_fn`` as given.")
    has_aux = property(lambda self: self.spec.has_aux, doc="``has_aux`` as given.")
    has_state = property(
        lambda self: self.spec.has_state, doc="``has_state`` as given."
    )
    policy = property(
        lambda self: self.spec.policy, doc="The parsed `jmp.Policy`, or None."
    )
    policy_spec = property(
        lambda self: self.spec.policy_spec, doc="``policy`` as given."
    )
    microbatches = property(
        lambda self: self.spec.microbatches, doc="None or the micro-batch count."
    )
    drop_non_finite_microbatches = property(
        lambda self: self.spec.drop_non_finite_microbatches,
        doc="``drop_non_finite_microbatches`` as given.",
    )

    def _traced_step(
        self, state: TrainState, batch: Any
    ) -> tuple[TrainState, dict[str, Any]]:
        self.traced = True  # trace time only: the policy audit reads this trace
        return train_step(self.spec, state, batch)

    def _grads(self, state: TrainState, batch: Any) -> Any:
        return reduced_grads(self.spec, state, batch)[1]

    def __call__(
        self, state: TrainState, batch: Any
    ) -> tuple[TrainState, dict[str, Any]]:
        out = self._fn(state, batch)
        if self.traced:
            self._audit_policy(state, batch)
        return out

    def _audit_policy(self, state: TrainState, batch: Any) -> None:
        """After a call that traced the step: which dtypes the loss's
        matmuls ran in (``compute_dtypes``), and a `PolicyNotAppliedWarning`
        (once) when the policy's compute dtype was mostly not used. Reads
        the trace the call made (jit's cache; ``jit=False``: traced once
        here); nothing runs on the device."""
        if self.policy is not None and not self._policy_done:
            if self.jit:
                closed = self._fn.trace(state, batch).jaxpr
            else:
                closed = jax.make_jaxpr(self.raw)(state, batch)
                self._policy_done = True  # eager: one trace, not one per call
            audit, warned = warn_if_not_applied(
                closed, self.policy, self.policy_spec, input_names(state, batch)
            )
            if audit is not None:
                self.compute_dtypes = audit.counts
            self._policy_done |= warned  # warned once per step
        self.traced = False

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
    microbatches: int | None = None,
    drop_non_finite_microbatches: bool = False,
    microbatch_weight: Callable | None = None,
) -> TrainStep:
    """Builds the guarded train step ``step(state, batch) -> (state, metrics)``.

    Per step, with ``ls = state.loss_scale``::

        (loss, grads) = value_and_grad(ls.scale(loss_fn(...)))(params); unscale
        finite = all_finite(grads) and isfinite(loss)
        updates, opt_state = tx.update(grads, opt_state, params, grads_finite=finite)
        params = params + updates     # tx skips (zero update) unless applied
        loss_scale = ls.adjust(finite)

    The invariant: no step writes a non-finite value into the parameters,
    the optimizer state or the model state. A step is *applied* only when
    its loss and gradients are finite AND the update, the new parameters and
    the new optimizer state are finite (float16 Adam state can turn finite
    gradients into ``m / 0``); otherwise it is skipped and counted in
    ``skipped_total``. A non-finite loss skips the step even when its
    gradients are finite (``log`` of an activation that dropout zeroed is
    -inf, and the mask zeroes its gradient), as `torchref.train.TrainStep`
    does. ``finite`` (the loss-and-gradient flag) is reduced once and reused
    by the skip transform and the loss scale, which reacts to it only, as
    GradScaler does: a non-finite update is no overflow of the scaled loss.
    When ``tx``'s OUTERMOST state is a `SkipNonFiniteState` (as with
    `stable_optimizer`, possibly inside `optax.inject_hyperparams`) the skip
    transform makes both checks (``check_update=False`` there leaves the
    second out); otherwise the step itself checks the new params and
    optimizer state and keeps the old ones: a skip nested inside a chain
    would zero only its own part of the update. Keeping the whole old
    optimizer state keeps that nested skip's counters too: its
    ``skipped_total``, ``consecutive`` and ``exceeded`` (``max_consecutive``)
    do not move; the step's own ``skipped_total`` (in the metrics and the
    `TrainState`) counts every skipped step.

    On a skipped step the model state's statistics (batch norm) are kept as
    they were (and also when the new ones are non-finite), while its
    random-number streams advance, as torch's generator does: typed PRNG
    keys (`jax.random.key`) and NNX `RngState` variables (``nnx.Rngs``
    counts and keys) take their new values, so a NaN that depends on a
    dropout mask is skipped once, not on every later step. A raw uint32 key
    (`jax.random.PRNGKey`) cannot be told from other integers and is kept.

    With `optax.inject_hyperparams` around the skip (``inject(skip(...))``,
    also inside ``skip_spikes``) the schedule's count advances on a skipped
    step (a torch scheduler stepped every iteration), and the
    hyperparameters of a skipped step (a schedule that gave NaN) are not
    kept in ``opt_state.hyperparams``: the previous ones stay. With the
    skip around it (``skip(inject(...))``) the count stays too. A ``tx``
    that accumulates gradients itself (`optax.MultiSteps`,
    `jaxstable.transforms.accumulate_gradients`) is refused: use
    ``microbatches``.

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
        dtype. The model state is passed uncast. The policy's params dtype
        must be that of the floating params (checked when the step is
        traced): ``"bf16"`` means params, compute and output bfloat16, so
        over float32 params it is refused with the fix
        (``"mixed_bfloat16"``) rather than read as "compute in bfloat16".
        After each trace the step counts the dtypes the loss's matmuls and
        convolutions (forward and backward) ran in (``step.compute_dtypes``)
        and warns once with a `jaxstable.precision.PolicyNotAppliedWarning`
        when less than half ran in the compute dtype (a Flax module with
        ``dtype=float32``, such as ``nnx.Embed`` built without ``dtype=``,
        promotes them back), naming the first promotion and the fix. Trace
        time only: the compiled step is unchanged.
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
        there XLA makes every reduction global itself. An ``axis_name``
        the enclosing `jax.shard_map` does not map, and a step built
        without ``axis_name`` that runs inside `jax.shard_map` (nothing
        would reduce the replicas' gradients: they would drift apart), are
        refused with a ValueError when the step is traced.
      microbatches: None, or k >= 1: gradient accumulation with torch's
        GradScaler recipe (``scaler.scale(loss / k).backward()`` k times,
        then one ``unscale_``, clip, ``step``, ``update``). Every batch leaf's
        leading axis is split into k equal consecutive micro-batches; a
        `lax.scan` adds the gradients of ``scale * loss_i / k`` in float32
        (cast back to the params' dtype at the end; torch adds in the grads'
        dtype, the same for float32 params), threading the model state
        through the micro-batches in order. Then ONE check (the k losses and
        the summed gradients), one clip, one skip decision, one
        ``skipped_total`` count and one loss-scale update per call. With a
        mean loss over equal micro-batches a finite step's gradient is the
        full batch's, to float32 rounding. ``metrics["loss"]`` is the mean of
        the k losses; ``metrics["aux"]`` combines the micro-batches' (floating
        leaves averaged, booleans ANDed, integers summed, a
        `jaxstable.diagnostics.CheckPoints` finite where all were, with the
        largest ``max_abs``), as `torchref.train.TrainStep` does. A batch leaf
        whose leading axis k does not divide raises ValueError; a k that is
        not an int >= 1, TypeError/ValueError. No ``conditional``, no host
        transfer.
      drop_non_finite_microbatches: False (default: one non-finite
        micro-batch skips the whole step, as GradScaler's recipe), or True
        (needs ``microbatches``): a micro-batch whose loss or scaled gradient
        is non-finite is dropped (selected out of the float32 sum; its model
        state statistics are not kept, its RNG streams advance) and the
        others are averaged with weights ``w_i``:
        ``grads = sum_kept w_i g_i / sum_kept w_i``, ``loss = sum_kept w_i
        loss_i / sum_kept w_i``. With a mean loss per micro-batch and
        ``w_i`` its number of rows (or tokens) that is the step on the kept
        rows alone. Then the usual single check, clip and skip: the step
        is skipped only when no micro-batch is kept (or the result is
        non-finite). The loss scale makes ONE decision per call and backs
        off when ANY micro-batch was dropped (the scale GradScaler's recipe
        would get: its ``found_inf`` covers the whole sum), while the step
        is still applied with the kept ones: a scale that overflows one
        micro-batch in k would otherwise never back off (or even grow) and
        would keep dropping the data with the largest gradients, a silent
        bias. ``metrics["microbatches_dropped"]`` (int32) counts them;
        ``metrics["aux"]`` still combines all k micro-batches. No
        ``conditional``, no host transfer. Not yet with ``axis_name``
        (ValueError); under plain `jax.jit` with shardings it works as is.
      microbatch_weight: None (every micro-batch weighs 1: equal rows), or
        ``microbatch_weight(micro_batch) -> scalar`` (traced, >= 0), e.g.
        ``lambda b: jnp.sum(b["mask"])`` for a per-micro-batch mean over
        its real tokens. Only with ``drop_non_finite_microbatches=True``.

    Returns:
      A `TrainStep`; calling it returns ``(new_state, metrics)`` where metrics
      holds device scalars: ``loss`` (unscaled, float32), ``grad_norm``
      (pre-clip, unscaled, float32), ``loss_scale`` (float32, the scale used
      for this step), ``finite`` (bool: the step was applied, see the
      invariant above), ``grads_finite`` (bool: the loss and the gradients,
      the flag the loss scale reacts to),
      ``skipped_total`` (int32), ``spike`` (bool, only when ``tx`` is a
      `jaxstable.transforms.skip_spikes`), the `RoundingStats` fields
      (``lost_update``, ...; only with a `low_precision_adamw` in ``tx``)
      and ``aux`` with ``has_aux``.
      A ``tx`` that takes extra args (an `optax.chain` of them, `skip_spikes`,
      `optax.contrib.reduce_on_plateau`) gets ``value=loss`` (the unscaled
      loss, the micro-batches' mean) and ``grads_finite=``; a skipped step
      keeps its state (a plateau's counters do not move).

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

      Gradient accumulation, 2 micro-batches of 2 rows (one optimizer step):

      >>> acc = train.make_train_step(lambda p, b: jnp.mean((p - b) ** 2),
      ...                             microbatches=2)
      >>> state, m = acc(state, jnp.array([[1.0, 2.0], [3.0, 4.0],
      ...                                  [5.0, 6.0], [jnp.nan, 0.0]]))
      >>> bool(m["finite"]), int(m["skipped_total"])
      (False, 2)

      Keeping the good micro-batches (the NaN one is dropped):

      >>> keep = train.make_train_step(lambda p, b: jnp.mean((p - b) ** 2),
      ...                              microbatches=2,
      ...                              drop_non_finite_microbatches=True)
      >>> state, m = keep(state, jnp.array([[1.0, 2.0], [3.0, 4.0],
      ...                                   [5.0, 6.0], [jnp.nan, 0.0]]))
      >>> bool(m["finite"]), int(m["microbatches_dropped"]), int(m["skipped_total"])
      (True, 1, 2)
    """
    spec = step_spec(
        loss_fn,
        has_aux=has_aux,
        has_state=has_state,
        policy=policy,
        axis_name=axis_name,
        microbatches=microbatches,
        drop_non_finite_microbatches=drop_non_finite_microbatches,
        microbatch_weight=microbatch_weight,
    )
    return TrainStep(spec, jit=jit, donate=donate)


# -- the step, over its spec ---------------------------------------------------


def summed_grads(spec: StepSpec, state: TrainState, batch: Any) -> tuple:
    """``(losses, aux, model_state, scaled gradient sum[, dropped])`` over
    the micro-batches (one call without ``microbatches``)."""
    parts = replicas(spec.axis_name)
    params = state.params
    if spec.axis_name is not None:
        params = as_varying(params, spec.axis_name)
    if spec.microbatches is not None:
        return summed_microbatch_grads(spec, state, params, batch, parts)
    (_, (loss, (aux, ms))), grads = share_grad(
        params, state.loss_scale, state.model_state, batch, parts, spec=spec
    )
    return loss[None], aux, ms, grads


def reduced_grads(spec: StepSpec, state: TrainState, batch: Any) -> tuple:
    """``((loss, (aux, model_state)), grads, finite, dropped)``: the
    gradients summed over the replicas and unscaled, in the params' dtypes,
    and ONE flag for the loss and the gradients (dropped is None without
    ``drop_non_finite_microbatches``)."""
    axis_name = spec.axis_name
    if spec.policy is not None:
        check_param_dtypes(state.params, spec.policy, spec.policy_spec)
    losses, aux, model_state, grads, *dropped = summed_grads(spec, state, batch)
    if axis_name is not None:
        # The SUM of the replicas' scaled shares, unscaled, is one
        # device's gradient of the mean; the flag taken from that sum is
        # the same on every replica.
        grads = jax.lax.psum(grads, axis_name)
    grads = state.loss_scale.unscale(grads)
    grads = jax.tree_util.tree_map(
        lambda g, p: g.astype(jnp.result_type(p)), grads, state.params
    )
    if axis_name is not None:
        losses, aux, model_state = _pmean_floating(
            (losses, aux, model_state), axis_name
        )
    loss = losses[0] if spec.microbatches is None else jnp.mean(losses)
    # A non-finite loss is a non-finite step even when its gradients are
    # finite (a -inf from log of a dropped activation whose gradient the
    # mask zeroes), as in torchref: one flag for the skip and the scale.
    finite = jnp.logical_and(all_finite(grads), jnp.all(jnp.isfinite(losses)))
    return (loss, (aux, model_state)), grads, finite, (dropped or [None])[0]


def _update(tx, extra, grads, opt_state, params):
    return tx.update(grads, opt_state, params, **extra)


def apply_update(
    state: TrainState, grads: Any, finite: jax.Array, loss: jax.Array
) -> tuple[Any, Any, jax.Array]:
    """``(params, opt_state, applied)``: ``tx``'s update where it writes
    finite values from finite gradients, the old params and optimizer state
    (but for an `inject_hyperparams` count) where it does not."""
    tx = state.tx
    extra = {}
    if isinstance(tx, optax.GradientTransformationExtraArgs):
        # optax's convention for the objective's value (`value=`):
        # skip_spikes checks it, reduce_on_plateau and polyak_sgd use it.
        extra = {"grads_finite": finite, "value": loss}
    update = functools.partial(_update, tx, extra)
    updates, opt_state = update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # Only an OUTERMOST skip transform (`SkipNonFiniteState` or
    # `SkipSpikesState`, possibly inside `optax.inject_hyperparams`) sees and
    # zeroes the whole update: in ``chain(skip_non_finite(sgd),
    # add_decayed_weights(0.5))`` the decay would still move the params on
    # a NaN step. The inject count still advances on a skipped step, as a
    # torch LR scheduler stepped every iteration does.
    skip = outer_guard(opt_state)
    if skip is not None:
        # The skip transform checked gradients, update, new params and
        # new optimizer state (unless built with check_update=False).
        applied = skip.last_finite
        return params, keep_hyperparams(applied, opt_state, state.opt_state), applied
    # No skip transform around the whole of tx: guard here, with the
    # same two checks (the gradient flag is reused; the new params and
    # optimizer state are checked in a pass that recomputes them, as
    # `skip_non_finite` does).
    written_ok = writes_finite(update, grads, state.opt_state, state.params)
    applied = jnp.logical_and(finite, written_ok)
    params = keep_finite(applied, params, state.params)
    return params, keep_finite(applied, opt_state, state.opt_state), applied


def train_step(
    spec: StepSpec, state: TrainState, batch: Any
) -> tuple[TrainState, dict[str, Any]]:
    """One guarded step: ``(new_state, metrics)`` (see `make_train_step`)."""
    check_no_accumulation(state.opt_state)
    ls = state.loss_scale
    (loss, (aux, new_model_state)), grads, finite, dropped = reduced_grads(
        spec, state, batch
    )
    # The scale backs off when any micro-batch overflowed, even when the
    # kept ones make an applied step (see drop_non_finite_microbatches).
    scale_ok = finite if dropped is None else jnp.logical_and(finite, dropped == 0)
    grad_norm = global_norm(grads)
    params, opt_state, applied = apply_update(state, grads, finite, loss)
    if state.model_state is not None:
        keep = jnp.logical_and(applied, all_finite(new_model_state))
        new_model_state = keep_model_state(keep, new_model_state, state.model_state)
    skipped_total = (state.skipped_total + jnp.logical_not(applied)).astype(jnp.int32)
    new_state = state.replace(
        step=(state.step + 1).astype(jnp.int32),
        params=params,
        opt_state=opt_state,
        # The scale reacts to the gradients (and the loss) only, as
        # GradScaler's does: a non-finite update is no overflow.
        loss_scale=ls.adjust(scale_ok),
        model_state=new_model_state,
        skipped_total=skipped_total,
    )
    metrics = step_metrics(
        state, new_state, loss, grad_norm, (applied, finite), dropped, aux, spec.has_aux
    )
    return new_state, metrics


def _pmean_floating(tree: Any, axis_name: str) -> Any:
    """`lax.pmean` of the floating leaves of ``tree``; the others as they are."""

    def mean(x):
        if jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return jax.lax.pmean(x, axis_name)
        return x

    return jax.tree.map(mean, tree)
