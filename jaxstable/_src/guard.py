"""`skip_non_finite`: no update that would write a non-finite value is applied.

Every transformation of this family is an optax `GradientTransformation`
built from two closures, composable with `optax.chain` and
`optax.inject_hyperparams`. None uses `lax.cond`: on a GPU a
``conditional`` copies its predicate to the host every step, so branches
are `jnp.where` (`jaxstable._src.guard_step`). Here also the argument
checks the other transformations share.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _stablecore.checks import check_bool as _core_check_bool
from jaxstable._src.clipping import concrete_float
from jaxstable._src.guard_state import SkipNonFiniteState, find_state
from jaxstable._src.guard_step import guarded_update
from jaxstable._src.loss_scale_math import all_finite

__all__ = ["SkipNonFiniteState", "find_skip_state", "skip_non_finite"]


def skip_non_finite(
    inner: optax.GradientTransformation,
    *,
    max_consecutive: int | None = None,
    check_update: bool = True,
    _proven: Callable[..., bool] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps `inner` so that no non-finite value is ever written by an update.

    With ``grads_ok = grads_finite if given else all_finite(grads)``::

        new_updates, new_inner = inner.update(grads, inner_state, params)
        written = apply_updates(params, new_updates) if params given else new_updates
        ok          = grads_ok and all_finite((written, new_inner))  # check_update
        updates'    = new_updates if ok else zeros_like(new_updates)
        inner_state = new_inner   if ok else inner_state   # e.g. Adam moments, count

    Finite gradients do not make a finite update: Adam with float16 state
    computes ``m / (sqrt(v) + eps)`` where ``(1 - b2) * g**2`` underflowed to
    0 and ``eps = 1e-8`` rounds to 0 in float16 (``m / 0``); ``eps=0``,
    a schedule or weight decay can do the same. With ``check_update`` such a
    step is skipped exactly like a non-finite gradient and counted, and
    ``last_grads_finite`` / ``non_finite_updates`` tell the two apart. The
    check tests every float leaf written: the new parameters (``params +
    update``, so an overflow of the sum in the parameters' dtype is caught
    too) and the new optimizer state, in the same jitted computation as the
    update. Nothing is inferred from the update alone (Adam's ``v`` can
    overflow to inf while ``m / (sqrt(v) + eps)`` is a finite 0).

    Cost: the check recomputes the update in a pass of its own that writes
    nothing and sums ``0 * leaf * leaf * ...`` (NaN exactly where a value is
    not finite), one reduction per leaf shape and per 4 parameters (their
    new values and optimizer state together); the update that is kept is
    computed again with the selection fused in (one compare per written
    element). Compiled on XLA:CPU, Adam's check reads gradients, moments and
    parameters once more and the step stores no param-sized array the plain
    step does not (only per-row sums); guarded Adam computes 61 FLOPs per
    parameter to plain Adam's 13 (`jaxstable/tests/test_guard_cost.py`);
    `benchmarks/bench_step.py` and `benchmarks/bench_models.py` have the
    bytes and times.

    Unlike `optax.apply_if_finite`, which applies the update once more than
    ``max_consecutive_errors`` bad steps happened in a row, a bad update is
    never applied: ``exceeded`` is raised in the state instead and the training
    loop decides (``fit(nan_policy="stop")``). Selection uses `jnp.where`, so
    the compiled update has no ``conditional``.

    Args:
      inner: the transformation to guard (plain or with extra args).
      max_consecutive: skipped updates in a row tolerated before ``exceeded``
        is set; None never sets it. >= 0.
      check_update: also skip when the update, the new parameters or the new
        optimizer state are non-finite (default True). False checks the
        gradients only (the flag alone decides).
      _proven: internal (`stable_optimizer`): ``_proven(grads, inner_state,
        params)`` True at trace time where the check provably cannot fail
        (`update_bound.UpdateBound`); its recompute pass is then left out.

    Returns:
      A `optax.GradientTransformationExtraArgs` whose ``update`` accepts
      ``grads_finite=`` (a bool scalar already computed by the train step,
      reused instead of a second reduction over the gradients); other extra
      args go to `inner`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import transforms
      >>> tx = transforms.skip_non_finite(optax.sgd(0.1))
      >>> state = tx.init(jnp.zeros(2))
      >>> u, state = tx.update(jnp.array([1.0, jnp.nan]), state)
      >>> u.tolist(), int(state.skipped_total), bool(state.last_finite)
      ([0.0, 0.0], 1, False)
      >>> # finite gradients, non-finite update: Adam with eps=0 divides 0 by 0
      >>> tx = transforms.skip_non_finite(optax.adam(1e-3, eps=0.0))
      >>> state = tx.init(jnp.ones(2))
      >>> u, state = tx.update(jnp.array([1.0, 0.0]), state, jnp.ones(2))
      >>> u.tolist(), bool(state.last_grads_finite), int(state.non_finite_updates)
      ([0.0, 0.0], True, 1)
    """
    check_optimizer(inner, "skip_non_finite")
    _check_optional_count("max_consecutive", max_consecutive)
    check_bool("check_update", check_update)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return SkipNonFiniteState(
            inner_state=inner.init(params),
            skipped_total=jnp.zeros([], jnp.int32),
            consecutive=jnp.zeros([], jnp.int32),
            last_finite=jnp.ones([], jnp.bool_),
            exceeded=jnp.zeros([], jnp.bool_),
            last_grads_finite=jnp.ones([], jnp.bool_),
            non_finite_updates=jnp.zeros([], jnp.int32),
        )

    def update_fn(updates, state, params=None, *, grads_finite=None, **extra_args):
        if grads_finite is None:
            grads_ok = all_finite(updates)
        else:
            grads_ok = scalar_flag(grads_finite)

        def update(updates, inner_state, params):
            return inner.update(updates, inner_state, params, **extra_args)

        check = check_update
        if check and _proven is not None and params is not None:
            proven = _proven(updates, state.inner_state, params, **extra_args)
            check = "proven" if proven else True
        new_updates, new_inner, ok = guarded_update(
            update, updates, state.inner_state, params, grads_ok, check
        )
        bad = jnp.logical_not(ok).astype(jnp.int32)
        consecutive = jnp.where(ok, 0, state.consecutive + 1).astype(jnp.int32)
        if max_consecutive is None:
            exceeded = jnp.zeros([], jnp.bool_)
        else:
            exceeded = consecutive > max_consecutive
        update_bad = jnp.logical_and(grads_ok, jnp.logical_not(ok))
        return new_updates, SkipNonFiniteState(
            inner_state=new_inner,
            skipped_total=(state.skipped_total + bad).astype(jnp.int32),
            consecutive=consecutive,
            last_finite=ok,
            exceeded=exceeded,
            last_grads_finite=grads_ok,
            non_finite_updates=(state.non_finite_updates + update_bad).astype(
                jnp.int32
            ),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# A bool option; ValueError, as this module always raised (fit: TypeError).
check_bool = functools.partial(_core_check_bool, error=ValueError)


def _check_optional_count(name: str, value: Any) -> None:
    """None or an int >= 0 (a concrete JAX/numpy integer scalar too)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer | jax.Array):
        raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
    limit = concrete_float(value)
    if limit is not None and limit < 0:
        raise ValueError(f"{name} must be None or an int >= 0, got {value}")


def find_skip_state(opt_state: Any) -> SkipNonFiniteState | None:
    """The first `SkipNonFiniteState` inside `opt_state` (depth first), or None.

    Looks through any nesting: `optax.chain` tuples, `optax.inject_hyperparams`
    and `optax.MultiSteps` states, dicts.

    Args:
      opt_state: an optimizer state pytree.

    Returns:
      The `SkipNonFiniteState`, or None when there is none.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import transforms
      >>> tx = optax.chain(optax.scale(1.0), transforms.skip_non_finite(optax.sgd(0.1)))
      >>> int(transforms.find_skip_state(tx.init(jnp.zeros(2))).skipped_total)
      0
    """
    return find_state(opt_state, SkipNonFiniteState)


def scalar_flag(flag: Any) -> jax.Array:
    """``grads_finite=`` as a boolean scalar, any other shape refused.

    It is broadcast against every update and counter: a flag of shape (1,)
    (``jnp.isfinite(loss)`` of a loss kept with ``keepdims``) turned scalar
    parameters and the state's counters into shape (1,), one of shape (n,)
    skipped element by element. `DynamicLossScale.adjust` refuses the same.
    """
    flag = jnp.asarray(flag, jnp.bool_)
    if flag.ndim != 0:
        raise ValueError(
            "grads_finite must be a boolean scalar (one flag for the whole "
            f"step), got shape {flag.shape}"
        )
    return flag


def check_optimizer(optimizer: Any, where: str) -> None:
    """Refuses what is not an optax transformation, naming the fix.

    The common slip is the factory itself (``optax.adam`` for
    ``optax.adam(1e-3)``), which otherwise fails only at ``init`` with
    "'function' object has no attribute 'init'".
    """
    if hasattr(optimizer, "init") and hasattr(optimizer, "update"):
        return
    if callable(optimizer):
        name = getattr(optimizer, "__name__", type(optimizer).__name__)
        module = getattr(optimizer, "__module__", None) or ""
        call = f"optax.{name}(1e-3)" if module.startswith("optax") else f"{name}(...)"
        raise TypeError(
            f"{where} needs an optimizer (an optax GradientTransformation), got "
            f"{name}, the function that makes one: call it: {call}"
        )
    raise TypeError(
        f"{where} needs an optimizer (an optax GradientTransformation such as "
        f"optax.adam(1e-3)), got {type(optimizer).__name__}"
    )
