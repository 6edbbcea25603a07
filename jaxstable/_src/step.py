"""The train state and the guarded train step (loss scale, clip, skip).

The step does, in this order (torch.amp's order):
scaled loss -> grad -> unscale -> ONE all-finite reduction -> clip ->
optimizer update unless non-finite -> loss-scale adjust.
It is pure and jitted, contains no `lax.cond` and moves nothing to the host.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from _stablecore.checks import check_microbatch_drop as _check_microbatch_drop
from _stablecore.checks import check_microbatches as _core_check_microbatches
from jaxstable._src.check_points import CheckPoints
from jaxstable._src.distributed import _axis_size
from jaxstable._src.guard_state import INJECT_STATES, SkipSpikesState, outer_guard
from jaxstable._src.loss_scale import NoOpLossScale, all_finite
from jaxstable._src.low_precision import rounding_stats
from jaxstable._src.precision import LOSS_SCOPE, get_policy, warn_if_not_applied
from jaxstable._src.transforms import (
    AccumulateGradientsState,
    _check_optimizer,
    _keep_finite,
    _writes_finite,
    global_norm,
)

__all__ = ["TrainState", "TrainStep", "make_train_step", "nnx_loss"]


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
        _check_optimizer(optimizer, "TrainState.create")
        return cls(
            step=jnp.zeros([], jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            loss_scale=NoOpLossScale() if loss_scale is None else loss_scale,
            model_state=model_state,
            skipped_total=jnp.zeros([], jnp.int32),
            tx=optimizer,
        )

    @classmethod
    def from_nnx(
        cls,
        model: Any,
        optimizer: optax.GradientTransformation,
        *,
        loss_scale: Any = None,
        wrt: Any = None,
    ) -> TrainState:
        """The state of a Flax NNX model: its ``wrt`` variables as params,
        everything else (batch statistics, ``nnx.Rngs`` streams) as
        ``model_state``.

        ``params, model_state = nnx.split(model, wrt, ...)[1:]``; pair it with
        ``make_train_step(nnx_loss(model, loss), has_state=True)``. Write the
        trained values back with ``nnx.update(model, state.params,
        state.model_state)``.

        Args:
          model: an `nnx.Module`.
          optimizer: an optax transformation (e.g. `stable_optimizer(...)`).
          loss_scale: a loss scale; None means `NoOpLossScale()`.
          wrt: the trainable variables, an NNX filter (default `nnx.Param`);
            give `nnx_loss` the same.

        Returns:
          A `TrainState` whose ``params`` and ``model_state`` are `nnx.State`.

        Example:
          >>> import optax
          >>> from flax import nnx
          >>> from jaxstable import train
          >>> model = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
          >>> state = train.TrainState.from_nnx(model, optax.sgd(0.1))
          >>> sorted(state.params), sorted(state.model_state)
          (['bias', 'scale'], ['mean', 'var'])
        """
        from flax import nnx

        _check_nnx_module(model, "TrainState.from_nnx")
        _, params, model_state = nnx.split(
            model, nnx.Param if wrt is None else wrt, ...
        )
        return cls.create(
            params=params,
            optimizer=optimizer,
            loss_scale=loss_scale,
            model_state=model_state,
        )


def _check_nnx_module(model: Any, where: str) -> None:
    from flax import nnx

    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"{where} needs a flax.nnx.Module, got {type(model).__name__} (for "
            "a linen model or a params pytree use TrainState.create)"
        )


def nnx_loss(model: Any, loss: Callable, *, wrt: Any = None) -> Callable:
    """A ``make_train_step(..., has_state=True)`` loss for a Flax NNX model.

    ``loss(model, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``) is
    written as for eager NNX code; this returns ``loss_fn(params,
    model_state, batch) -> (out, new_model_state)`` that rebuilds the model
    from the traced state (fresh variables inside the traced function, so
    batch norm and dropout can update their state under `jax.grad`: merging
    the outer variables raises "Cannot mutate BatchStat from a different
    trace level"), calls ``loss`` and returns the updated batch statistics
    and RNG streams. On a skipped step the train step keeps the statistics
    and advances the RNG streams (see `make_train_step`).

    The model's mode is the one it has now: call ``model.train()`` before
    (``model.eval()`` for an evaluation loss).

    Args:
      model: the `nnx.Module` (its graph structure and mode are captured).
      loss: ``loss(model, batch)``.
      wrt: the trainable variables (default `nnx.Param`), as given to
        `TrainState.from_nnx`.

    Returns:
      ``loss_fn(params, model_state, batch)``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> from jaxstable import train, transforms
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.fc = nnx.Linear(3, 2, rngs=rngs)
      ...         self.bn = nnx.BatchNorm(2, rngs=rngs)
      ...         self.drop = nnx.Dropout(0.5, rngs=rngs)
      ...     def __call__(self, x):
      ...         return self.drop(self.bn(self.fc(x)))
      >>> model = Net(nnx.Rngs(0))
      >>> state = train.TrainState.from_nnx(model, transforms.stable_optimizer(
      ...     optax.adam(1e-2)))
      >>> step = train.make_train_step(
      ...     train.nnx_loss(model, lambda m, b: jnp.mean(m(b) ** 2)), has_state=True)
      >>> state, m = step(state, jnp.ones((4, 3)))
      >>> bool(m["finite"]), int(state.model_state["drop"]["rngs"]["count"][...])
      (True, 1)
      >>> nnx.update(model, state.params, state.model_state)  # back into the model
    """
    from flax import nnx

    _check_nnx_module(model, "nnx_loss")
    if not callable(loss):
        raise TypeError("loss must be callable as loss(model, batch)")
    graphdef = nnx.graphdef(model)
    wrt = nnx.Param if wrt is None else wrt

    def loss_fn(params, model_state, batch):
        # copy=True: fresh Variables at this trace level, which the forward
        # may then update (batch statistics, RNG counts).
        m = nnx.merge(graphdef, params, model_state, copy=True)
        out = loss(m, batch)
        return out, nnx.split(m, wrt, ...)[2]

    return loss_fn


def _select(pred: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), new, old)


def _is_rng(x: Any) -> bool:
    """A random-number stream of a model state: a typed PRNG key array
    (`jax.random.key`) or an NNX `RngState` variable (``nnx.Rngs`` keys and
    counts). A raw uint32 key (`jax.random.PRNGKey`) cannot be told from
    other integers and is treated as any other leaf."""
    nnx = sys.modules.get("flax.nnx")  # loaded whenever the state holds NNX types
    if nnx is not None and isinstance(x, nnx.RngState):
        return True
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _keep_model_state(keep: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``keep``, else ``old`` — but random-number streams are
    always advanced (``new``), as torch's generator is by a skipped step: a
    NaN that depends on a dropout mask is then skipped once, not on every
    later step with the same mask. Statistics (batch norm) stay ``old``."""
    try:
        same = jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(old)
    except TypeError:  # pragma: no cover - structures that cannot compare
        same = False
    if not same:
        raise ValueError(
            "loss_fn returned a model state whose structure differs from the "
            "state it was given (it must return the same collections, e.g. "
            f"the whole state, not a part):\n  given:    "
            f"{jax.tree_util.tree_structure(old)}\n  returned: "
            f"{jax.tree_util.tree_structure(new)}"
        )

    def pick(n: Any, o: Any) -> Any:
        if _is_rng(n):
            return n
        return jax.tree_util.tree_map(lambda a, b: jnp.where(keep, a, b), n, o)

    return jax.tree_util.tree_map(pick, new, old, is_leaf=_is_rng)


def _check_microbatches(microbatches: Any) -> int | None:
    checked = _core_check_microbatches(microbatches, int | np.integer)
    return None if checked is None else int(checked)


def _split_batch(batch: Any, k: int) -> Any:
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


def _combine_aux(aux: Any) -> Any:
    """One ``aux`` from the micro-batches' stacked ones (leading axis k):
    floating leaves averaged (a mean over equal micro-batches is the whole
    batch's), boolean leaves ANDed, integer leaves summed (counts add up); a
    `CheckPoints` collector is finite where every micro-batch was, with the
    largest ``max_abs`` (nan only when no micro-batch had a finite entry).
    The same rule as `torchref.train.TrainStep`."""

    def one(x):
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

    return jax.tree_util.tree_map(
        one, aux, is_leaf=lambda x: isinstance(x, CheckPoints)
    )


def _call_loss(loss_fn, has_state, params, model_state, batch):
    """``(out, new_model_state)`` of the user's loss; flax's
    TraceContextError (an NNX model merged from variables made outside the
    trace, then mutated by batch norm or dropout) re-raised with the fixes."""
    try:
        if has_state:
            return loss_fn(params, model_state, batch)
        return loss_fn(params, batch), model_state
    except Exception as e:
        errors = sys.modules.get("flax.errors")
        if errors is None or not isinstance(e, errors.TraceContextError):
            raise
        state = "" if has_state else ", and build the step with has_state=True"
        raise errors.TraceContextError(
            f"loss_fn mutated an NNX variable made outside the traced step ({e}). "
            "Inside make_train_step the model must be rebuilt from the traced "
            "state with fresh variables: write the loss as loss(model, batch) "
            "and pass jaxstable.train.nnx_loss(model, loss) with "
            "TrainState.from_nnx(model, optimizer) and has_state=True; or merge "
            "with nnx.merge(graphdef, params, model_state, copy=True) and return "
            f"the model's new state (nnx.split(model, nnx.Param, ...)[2]){state}"
        ) from e


def _check_param_dtypes(params: Any, pol: Any, spec: Any) -> None:
    """Refuses a policy whose parameter dtype is not that of ``params``.

    The step casts params to the compute dtype and never to the policy's
    parameter dtype: a single-dtype policy such as ``"bf16"`` (params,
    compute AND output bfloat16) over float32 params would otherwise be
    taken silently as "float32 params computed in bfloat16".
    """
    want = jnp.dtype(pol.param_dtype)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = jnp.result_type(x)
        if jnp.issubdtype(dtype, jnp.floating) and dtype != want:
            have, compute = dtype.name, jnp.dtype(pol.compute_dtype).name
            mixed = f" or 'mixed_{compute}'" if have == "float32" else ""
            # Same text as torchref.train.TrainStep (leaf named its way).
            raise ValueError(
                f"policy {spec!r} stores params in {want.name}, but params "
                f"leaf {jax.tree_util.keystr(path) or '(the params)'} is {have} "
                "(a single dtype name such as 'bf16' sets params, compute and "
                f"output). For {have} params computed in {compute} say "
                f"'params={have},compute={compute},output=float32'{mixed}; for "
                f"{want.name} params, cast them first. Policy grammar: one dtype "
                "name for params, compute and output (bf16, f16, f32, ...), "
                "mixed_float16 or mixed_bfloat16 (float32 params and output), or "
                "comma-separated key=dtype pairs with keys params|p, compute|c, "
                "output|o"
            )


def _find_accumulation(opt_state: Any) -> Any:
    def is_acc(x):
        return isinstance(x, optax.MultiStepsState | AccumulateGradientsState)

    for node in jax.tree_util.tree_leaves(opt_state, is_leaf=is_acc):
        if is_acc(node):
            return node
    return None


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


def _replicas(axis_name: str | None) -> int:
    """How many replicas the step's gradients are summed over (1 without
    ``axis_name``); refuses an ``axis_name`` that is not mapped here and a
    step inside `jax.shard_map` without one."""
    if axis_name is not None:
        return _axis_size(axis_name, "make_train_step")
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


def _pmean_floating(tree: Any, axis_name: str) -> Any:
    """`lax.pmean` of the floating leaves of ``tree``; the others as they are."""

    def mean(x):
        if jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return jax.lax.pmean(x, axis_name)
        return x

    return jax.tree.map(mean, tree)


def _outer_skip_state(opt_state: Any) -> Any:
    """``tx``'s OUTERMOST `SkipNonFiniteState` or `SkipSpikesState` (both
    have ``last_finite``), or None.

    Only an outermost skip transform sees (and zeroes) the whole update. A
    skip nested inside a chain zeroes its own part only: in
    ``chain(skip_non_finite(sgd), add_decayed_weights(0.5))`` the decay would
    still move the params on a NaN step. `optax.inject_hyperparams` around the
    skip is accepted too (its step count still advances on a skipped step, as
    a torch LR scheduler stepped every iteration does).
    """
    return outer_guard(opt_state)


def _keep_hyperparams(applied: jax.Array, new: Any, old: Any) -> Any:
    """``new`` with the hyperparameters of an `optax.inject_hyperparams`
    around the skip (outermost, or inside an outermost `skip_spikes`) taken
    from ``old`` unless the step was applied and they are finite.

    Its count advances on a skipped step (a torch scheduler stepped every
    iteration does), but hyperparameters of a skipped step (a schedule that
    gave NaN) are not kept in the state nor checkpointed. Inside
    ``skip_spikes(inject_hyperparams(...))`` they were: the NaN stayed in
    the optimizer state.
    """
    if isinstance(new, SkipSpikesState):
        inner = _keep_hyperparams(applied, new.inner_state, old.inner_state)
        return new._replace(inner_state=inner)
    if isinstance(new, INJECT_STATES):
        hyper = new.hyperparams
        keep = jnp.logical_and(applied, all_finite(hyper))
        return new._replace(hyperparams=_select(keep, hyper, old.hyperparams))
    return new


def _input_names(state: TrainState, batch: Any) -> list[str]:
    """A dotted name per leaf of ``(state, batch)``: ``params.fc.kernel``,
    ``model_state.bn.mean``, ``batch.0``."""
    from jaxstable._src._locate import dotted

    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path((state, batch))[0]:
        rest = dotted(path[1:])
        names.append(rest if path[0].idx == 0 else ".".join(("batch", rest)).strip("."))
    return names


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

    def __init__(self, raw: Callable, grads: Callable, jit: bool, donate: bool):
        self.raw = raw
        self.jit = bool(jit)
        self.donate = bool(donate)
        self.grads = jax.jit(grads) if jit else grads
        self._fn = jax.jit(raw, donate_argnums=(0,) if donate else ()) if jit else raw
        self.policy = self.policy_spec = self.compute_dtypes = None
        self.traced = False  # set by the raw step when it is traced
        self._policy_done = False

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
                closed, self.policy, self.policy_spec, _input_names(state, batch)
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
    for name, flag in (("has_aux", has_aux), ("has_state", has_state)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    if axis_name is not None and not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be None or a str, got {axis_name!r}")
    k = _check_microbatches(microbatches)
    drop = _check_microbatch_drop(drop_non_finite_microbatches, microbatch_weight, k)
    if drop and axis_name is not None:
        raise ValueError(
            "drop_non_finite_microbatches=True is not supported with axis_name "
            f"({axis_name!r}) yet: run the step under plain jax.jit with "
            "shardings (jaxstable.distributed), where XLA makes the reductions "
            "global itself"
        )
    pol = None if policy is None else get_policy(policy)

    def compute_loss(params, model_state, batch):
        if pol is not None:
            params = pol.cast_to_compute(params)
            batch = pol.cast_to_compute(batch)
        # The scope marks the loss's matmuls (forward and backward) for the
        # policy audit; it changes no computation.
        with jax.named_scope(LOSS_SCOPE):
            out, new_model_state = _call_loss(
                loss_fn, has_state, params, model_state, batch
            )
        loss, aux = out if has_aux else (out, None)
        loss = jnp.asarray(loss, jnp.float32)
        if loss.shape != ():
            # Same text as torchref.train.TrainStep.
            raise ValueError(
                f"loss_fn must return a scalar (0-d) loss, got shape {loss.shape}; "
                "reduce it, e.g. with .mean()"
            )
        return loss, (aux, new_model_state)

    def share_loss(params, ls, model_state, batch, parts):
        # This call's share of the mean over all `parts` (micro-batches times
        # replicas), scaled: each backward then holds what one device's
        # backward holds for these rows (the same float16 headroom). For
        # parts = 1 the division is exact (loss / 1 == loss).
        loss, rest = compute_loss(params, model_state, batch)
        return ls.scale(loss / parts if parts > 1 else loss), (loss, rest)

    share_grad = jax.value_and_grad(share_loss, has_aux=True)

    def summed_grads(state: TrainState, batch: Any):
        """``(losses, aux, model_state, scaled gradient sum)`` over the
        micro-batches (one call without ``microbatches``)."""
        ls = state.loss_scale
        replicas = _replicas(axis_name)
        params = state.params
        if axis_name is not None:
            params = _as_varying(params, axis_name)
        if k is None:
            (_, (loss, (aux, ms))), grads = share_grad(
                params, ls, state.model_state, batch, replicas
            )
            return loss[None], aux, ms, grads

        def micro(carry, mb):
            acc, ms = carry
            (_, (loss, (aux, ms))), g = share_grad(params, ls, ms, mb, k * replicas)
            acc = jax.tree_util.tree_map(lambda a, x: a + x.astype(a.dtype), acc, g)
            return (acc, ms), (loss, aux)

        # Accumulated in float32 at least (torch adds into p.grad, in the
        # params' dtype: the same for float32 params), cast back at the end.
        acc = jax.tree_util.tree_map(
            lambda p: jnp.zeros(
                jnp.shape(p), jnp.promote_types(jnp.result_type(p), jnp.float32)
            ),
            state.params,
        )
        ms = state.model_state
        if axis_name is not None:
            # The carry comes back varying over the axis (each replica's own
            # rows); under shard_map it must go in so.
            acc, ms = jax.tree_util.tree_map(
                lambda x: jax.lax.pcast(x, axis_name, to="varying"), (acc, ms)
            )
        if drop:
            return _kept_microbatches(share_grad, params, ls, acc, ms, batch)
        (acc, ms), (losses, aux) = jax.lax.scan(
            micro, (acc, ms), _split_batch(batch, k)
        )
        return losses, (None if aux is None else _combine_aux(aux)), ms, acc

    def _kept_microbatches(share_grad, params, ls, acc, ms, batch):
        """`summed_grads` with ``drop_non_finite_microbatches``: a
        micro-batch whose loss or scaled gradient is non-finite is left out
        of the sum (a select: its NaN never enters), and so are its model
        state's statistics; the others are weighted by ``microbatch_weight``
        and the sum is rescaled to their weighted mean. ``losses`` is then
        the kept micro-batches' weighted mean loss (shape ``(1,)``), NaN
        when none was kept (a zero weight sum): the gradients are NaN too
        (``0 * inf``), and the step is skipped by its usual check."""

        def micro(carry, mb):
            acc, ms, wsum, lsum, dropped = carry
            (_, (loss, (aux, new_ms))), g = share_grad(params, ls, ms, mb, k)
            ok = jnp.logical_and(jnp.isfinite(loss), all_finite(g))
            w = (
                jnp.ones([], jnp.float32)
                if microbatch_weight is None
                else jnp.asarray(microbatch_weight(mb), jnp.float32)
            )
            acc = jax.tree_util.tree_map(
                lambda a, x: jnp.where(ok, a + w * x.astype(a.dtype), a), acc, g
            )
            ms = _keep_model_state(ok, new_ms, ms)
            wsum = wsum + jnp.where(ok, w, 0.0)
            lsum = lsum + jnp.where(ok, w * loss, 0.0)
            dropped = dropped + jnp.logical_not(ok).astype(jnp.int32)
            return (acc, ms, wsum, lsum, dropped), aux

        zero = jnp.zeros([], jnp.float32)
        carry = (acc, ms, zero, zero, jnp.zeros([], jnp.int32))
        (acc, ms, wsum, lsum, dropped), aux = jax.lax.scan(
            micro, carry, _split_batch(batch, k)
        )
        # Each share was scale * loss_i / k: times k / (sum of kept weights)
        # it is the kept micro-batches' weighted mean (k / k == 1 exactly
        # when all k are kept with the default weights). No kept weight:
        # k / 0 = inf, 0 * inf = NaN, a skipped step.
        factor = jnp.float32(k) / wsum
        acc = jax.tree_util.tree_map(lambda a: a * factor.astype(a.dtype), acc)
        aux = None if aux is None else _combine_aux(aux)
        return (lsum / wsum)[None], aux, ms, acc, dropped

    def reduced_grads(state: TrainState, batch: Any):
        if pol is not None:
            _check_param_dtypes(state.params, pol, policy)
        ls = state.loss_scale
        losses, aux, model_state, grads, *dropped = summed_grads(state, batch)
        if axis_name is not None:
            # The SUM of the replicas' scaled shares, unscaled, is one
            # device's gradient of the mean; the flag taken from that sum is
            # the same on every replica.
            grads = jax.lax.psum(grads, axis_name)
        grads = ls.unscale(grads)
        grads = jax.tree_util.tree_map(
            lambda g, p: g.astype(jnp.result_type(p)), grads, state.params
        )
        if axis_name is not None:
            losses, aux, model_state = _pmean_floating(
                (losses, aux, model_state), axis_name
            )
        loss = losses[0] if k is None else jnp.mean(losses)
        # A non-finite loss is a non-finite step even when its gradients are
        # finite (a -inf from log of a dropped activation whose gradient the
        # mask zeroes), as in torchref: one flag for the skip and the scale.
        finite = jnp.logical_and(all_finite(grads), jnp.all(jnp.isfinite(losses)))
        return (loss, (aux, model_state)), grads, finite, (dropped or [None])[0]

    def step(state: TrainState, batch: Any):
        out.traced = True  # trace time only: the policy audit reads this trace
        if _find_accumulation(state.opt_state) is not None:
            raise ValueError(_ACCUMULATION_IN_TX)
        ls = state.loss_scale
        (loss, (aux, new_model_state)), grads, finite, dropped = reduced_grads(
            state, batch
        )
        # The scale backs off when any micro-batch overflowed, even when the
        # kept ones make an applied step (see drop_non_finite_microbatches).
        scale_ok = finite if dropped is None else jnp.logical_and(finite, dropped == 0)
        grad_norm = global_norm(grads)
        tx = state.tx
        extra = {}
        if isinstance(tx, optax.GradientTransformationExtraArgs):
            # optax's convention for the objective's value (`value=`):
            # skip_spikes checks it, reduce_on_plateau and polyak_sgd use it.
            extra = {"grads_finite": finite, "value": loss}
        spikes = _outer_skip_state(state.opt_state)
        spikes = spikes if isinstance(spikes, SkipSpikesState) else None

        def update(grads, opt_state, params):
            return tx.update(grads, opt_state, params, **extra)

        updates, opt_state = update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        skip = _outer_skip_state(opt_state)
        if skip is not None:
            # The skip transform checked gradients, update, new params and
            # new optimizer state (unless built with check_update=False).
            applied = skip.last_finite
            opt_state = _keep_hyperparams(applied, opt_state, state.opt_state)
        else:
            # No skip transform around the whole of tx: guard here, with the
            # same two checks (the gradient flag is reused; the new params
            # and optimizer state are checked in a pass that recomputes them,
            # as `skip_non_finite` does).
            written_ok = _writes_finite(update, grads, state.opt_state, state.params)
            applied = jnp.logical_and(finite, written_ok)
            params = _keep_finite(applied, params, state.params)
            opt_state = _keep_finite(applied, opt_state, state.opt_state)
        if state.model_state is not None:
            keep = jnp.logical_and(applied, all_finite(new_model_state))
            new_model_state = _keep_model_state(
                keep, new_model_state, state.model_state
            )
        skipped_total = (state.skipped_total + jnp.logical_not(applied)).astype(
            jnp.int32
        )
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
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "loss_scale": jnp.asarray(ls.loss_scale, jnp.float32),
            "finite": applied,
            "grads_finite": finite,
            "skipped_total": skipped_total,
        }
        if spikes is not None:
            metrics["spike"] = _outer_skip_state(opt_state).last_spike
        if dropped is not None:
            metrics["microbatches_dropped"] = dropped
        stats = rounding_stats(opt_state)
        if stats is not None:  # low_precision_adamw: what rounding lost
            metrics.update(stats._asdict())
        if has_aux:
            metrics["aux"] = aux
        return new_state, metrics

    def grads(state: TrainState, batch: Any):
        return reduced_grads(state, batch)[1]

    out = TrainStep(step, grads, jit=jit, donate=donate)
    out.policy_spec = policy
    # What `diagnostics.locate` needs to re-run the loss op by op, off the
    # hot path (the jitted step does not read these).
    out.loss_fn, out.policy, out.has_state, out.has_aux = (
        loss_fn,
        pol,
        has_state,
        has_aux,
    )
    out.microbatches = k
    out.drop_non_finite_microbatches = drop
    return out


_ACCUMULATION_IN_TX = (
    "the optimizer accumulates gradients itself (optax.MultiSteps or "
    "transforms.accumulate_gradients): inside make_train_step each call would "
    "be one micro-batch, so the loss scale would move per micro-batch and a "
    "non-finite micro-batch would be dropped (its window stretched) instead of "
    "skipping the whole step; with MultiSteps around the skip a NaN stays in "
    "its accumulator for good. Give the step the plain optimizer and let it "
    "accumulate: make_train_step(loss_fn, microbatches=k) with each batch "
    "holding the k micro-batches along its leading axis (one check, one clip, "
    "one skip decision and one loss-scale update per optimizer step, as "
    "torch's GradScaler accumulation recipe)"
)
