"""Guarded optax transformations: torch-style clipping and non-finite skipping.

Every transformation here is an optax `GradientTransformation` built from two
closures, composable with `optax.chain` and `optax.inject_hyperparams`. For
gradient accumulation use `accumulate_gradients` (one skip decision per
window): `optax.MultiSteps` around the skip keeps a NaN in its accumulator
for good, and inside it stretches the window. None uses `lax.cond`: on a GPU
a `conditional` copies its predicate to the host every step, so branches
are `jnp.where`.
"""

from __future__ import annotations

import collections
import functools
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _stablecore.checks import check_bool as _core_check_bool
from jaxstable._src.guard_state import SkipNonFiniteState, find_state, outer_guard
from jaxstable._src.loss_scale import (
    _NORM_SCALE,
    _leading_rows,
    _opaque,
    _row_total,
    _sums_of_squares,
    all_finite,
)

__all__ = [
    "AccumulateGradientsState",
    "SkipNonFiniteState",
    "accumulate_gradients",
    "clip_by_global_norm",
    "find_skip_state",
    "global_norm",
    "skip_non_finite",
    "stable_optimizer",
]


def _concrete_float(x: Any) -> float | None:
    """`float(x)` when `x` is a concrete scalar, None for tracers."""
    if isinstance(x, jax.core.Tracer):
        return None
    arr = np.asarray(x)
    if arr.shape != ():
        raise ValueError(f"expected a scalar, got shape {arr.shape}")
    return float(arr)


# The float32 sum of squares overflows once the norm passes 2**64 = 1.8e19
# (finite gradients of 1e20 gave an inf norm, and the clip multiplied every
# gradient by 0). Then the norm comes from the sum with every element times
# 2**-90 (`loss_scale._NORM_SCALE`), which cannot overflow below 2**52
# elements of float32's max; the squares it loses to underflow (elements
# below 2**27) change a norm above 2**64 by less than 2**-74 relative per
# element.
_NORM_UNSCALE = 2.0**90


def _inexact_leaves(tree: Any) -> list[jax.Array]:
    # Integer and boolean leaves (step counters, float0 gradients of integer
    # inputs) have no norm to add and are never clipped.
    return [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]


def _norms(tree: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(norm, scaled_norm, overflow)`` of the inexact leaves of `tree`.

    ``norm`` is `global_norm`; ``scaled_norm`` the norm of every element
    times `_NORM_SCALE`; ``overflow`` says that the plain sum of squares
    overflowed although the scaled one did not (the leaves are finite), in
    which case ``norm = scaled_norm * 2**90`` (inf only when the norm itself
    is above float32's max). One reduction per leaf reads it once for both
    sums (`loss_scale._sums_of_squares`), the same one `all_finite` uses.
    """
    leaves = _inexact_leaves(tree)
    if not leaves:
        zero = jnp.zeros([], jnp.float32)
        return zero, zero, jnp.zeros([], jnp.bool_)
    plain, scaled = _sums_of_squares(leaves)
    inf = jnp.float32(jnp.inf)
    overflow = jnp.logical_and(jnp.logical_not(plain < inf), scaled < inf)
    scaled_norm = jnp.sqrt(scaled)
    norm = jnp.where(
        overflow, scaled_norm * jnp.float32(_NORM_UNSCALE), jnp.sqrt(plain)
    )
    return norm, scaled_norm, overflow


def global_norm(tree: Any) -> jax.Array:
    """L2 norm of all inexact leaves of `tree` together, accumulated in float32.

    ``sqrt(sum_leaves sum(|x|**2))``, each leaf upcast to float32 first:
    float16 gradients of 300 have squares of 9e4, above fp16's max 65504,
    and bfloat16 sums lose digits after 2**8 terms. A complex leaf adds
    ``re**2 + im**2`` (so ``[0.3+0.4j, -0.1+0.2j]`` has norm 0.548, as in
    torch). Integer and boolean leaves are left out; an empty leaf adds 0.

    Cannot overflow while the norm is representable: when the float32 sum of
    squares overflows (a norm above 1.8e19, e.g. two gradients of 1e20) it
    is recomputed with every element scaled by 2**-90 (see `_NORM_SCALE`),
    so the norm of ``[1e20, 1e20]`` is 1.41e20, not inf. torch's
    `clip_grad_norm_` returns inf there; `torchref.transforms.global_norm`
    does the same as this function (a documented deviation from torch, only
    where torch overflows). The result is inf only for non-finite leaves or
    a norm above float32's max 3.4e38.

    Args:
      tree: a pytree of arrays (any dtype).

    Returns:
      A float32 scalar (0.0 for a tree without inexact leaves).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import transforms
      >>> float(transforms.global_norm({"a": jnp.full(4, 300.0, jnp.float16)}))
      600.0
      >>> round(float(transforms.global_norm(jnp.array([0.3 + 0.4j, -0.1 + 0.2j]))), 3)
      0.548
      >>> float(transforms.global_norm(jnp.array([1e20, 1e20]))) > 1.4e20
      True
    """
    return _norms(tree)[0]


def clip_by_global_norm(
    max_norm: float, *, eps: float = 1e-6
) -> optax.GradientTransformation:
    """Clips updates by global norm with `torch.nn.utils.clip_grad_norm_`'s formula.

    ``coef = min(max_norm / (global_norm(updates) + eps), 1)`` and every leaf is
    multiplied by ``coef`` in float32 (complex64 for a complex leaf, whose
    imaginary part is kept) and cast back to its dtype; integer leaves pass
    through. Unlike `optax.clip_by_global_norm` there is an ``eps`` (torch's
    1e-6) and the norm is accumulated in float32 for float16/bfloat16 leaves.
    The coefficient is formed as ``(1 / (norm + eps)) * max_norm``, the order
    torch's ``Tensor.__rtruediv__`` uses, so float32 results round the same way.

    When the float32 sum of squares overflows (norm above 1.8e19, see
    `global_norm`) the clip is computed in the scaled domain:
    ``(g * 2**-90) * ((1 / (scaled_norm + eps * 2**-90)) * max_norm)``, so
    finite gradients always give a finite update of norm ``max_norm``. torch's
    `clip_grad_norm_` multiplies every gradient by 0 there (its norm is inf);
    `torchref.transforms.clip_by_global_norm` does what this does.

    Args:
      max_norm: the largest allowed global norm, > 0.
      eps: added to the norm before dividing (torch's 1e-6), >= 0.

    Returns:
      A stateless `optax.GradientTransformation` (state `optax.EmptyState`).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import transforms
      >>> tx = transforms.clip_by_global_norm(1.0)
      >>> u, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(None))
      >>> [round(v, 4) for v in u["w"].tolist()]
      [0.6, 0.8]
      >>> u, _ = tx.update({"w": jnp.array([1e20, 1e20])}, tx.init(None))
      >>> [round(v, 4) for v in u["w"].tolist()]
      [0.7071, 0.7071]
    """
    value = _concrete_float(max_norm)
    if value is not None and not value > 0:
        raise ValueError(f"max_norm must be > 0, got {value}")
    eps_value = _concrete_float(eps)
    if eps_value is not None and not eps_value >= 0:
        raise ValueError(f"eps must be >= 0, got {eps_value}")

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        norm, scaled_norm, overflow = _norms(updates)
        eps32 = jnp.asarray(eps, jnp.float32)
        max32 = jnp.asarray(max_norm, jnp.float32)
        coef = jnp.minimum((1.0 / (norm + eps32)) * max32, jnp.float32(1.0))
        # Scaled domain: the true coefficient is coef_s * 2**-90.
        coef_s = (1.0 / (scaled_norm + eps32 * jnp.float32(_NORM_SCALE))) * max32
        first, second = _clip_factors(
            norm_coef=coef, scaled_coef=coef_s, overflow=overflow
        )

        def clip(g):
            if not jnp.issubdtype(jnp.result_type(g), jnp.inexact):
                return g
            dtype = jnp.result_type(g)
            g32 = jnp.asarray(g, jnp.promote_types(dtype, jnp.float32))
            return ((g32 * first) * second).astype(dtype)

        return jax.tree_util.tree_map(clip, updates), state

    return optax.GradientTransformation(init_fn, update_fn)


def _clip_factors(
    *, norm_coef: jax.Array, scaled_coef: jax.Array, overflow: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The clip as two scalar factors: every gradient becomes ``(g * first) *
    second``, two multiplies per element whichever case holds.

    - the sum of squares did not overflow: ``(coef, 1)``, ``g * coef``
      (``x * 1`` is exact: the same bits as one multiply);
    - it overflowed and the norm is above ``max_norm``: ``(2**-90,
      coef_s)``, the scaled domain, ``(g * 2**-90) * coef_s``;
    - it overflowed but the norm is within ``max_norm`` (``coef_s >=
      2**90``): ``(1, 1)``, the gradient as it is.

    The same values as choosing among the three products element by
    element, with two multiplies instead of three and two selects (the
    update check and each written leaf recompute the clipped gradient).
    `_opaque` keeps XLA from folding the two factors into one, which is
    subnormal, so flushed to 0, for a norm above 8.5e37.
    """
    one = jnp.ones([], jnp.float32)
    unclipped = scaled_coef >= jnp.float32(_NORM_UNSCALE)
    scaled = jnp.logical_and(overflow, jnp.logical_not(unclipped))
    first = jnp.where(
        overflow, jnp.where(unclipped, one, jnp.float32(_NORM_SCALE)), norm_coef
    )
    second = jnp.where(scaled, scaled_coef, one)
    return _opaque((first, second))


def _add_and_max(a: Any, b: Any) -> tuple[jax.Array, jax.Array]:
    return a[0] + b[0], jnp.maximum(a[1], b[1])


# Parameters whose written values one reduction of the update check tests.
# Each brings the inputs of its update into the fusion (Adam: g, m, v, p and
# a few scalars), and XLA:GPU caps the operands of one fusion
# (kMaxOperandsAndOutputsPerFusion, 64 in the versions read): a larger group
# would not fuse and would store its partial sums.
_PARAMS_PER_CHECK = 4


def _finite_factors(x: jax.Array) -> list[jax.Array]:
    """float32 arrays whose product with 0 is NaN exactly where an element
    of ``x`` is not finite: ``x`` itself (float16 and bfloat16 values are
    float32 values), a complex leaf's real and imaginary parts, and ``x *
    0`` for a float64 leaf (whose finite values may overflow float32)."""
    parts = [jnp.real(x), jnp.imag(x)] if jnp.iscomplexobj(x) else [x]
    if jnp.finfo(jnp.result_type(parts[0])).bits > 32:
        parts = [p * jnp.zeros([], p.dtype) for p in parts]
    return [p.astype(jnp.float32) for p in parts]


def _finite_together(written: list[jax.Array], state: list[jax.Array]) -> jax.Array:
    """`all_finite` of the leaves ``written`` and ``state``, few reductions.

    ``0 * x`` is 0 for a finite element and NaN for inf or NaN, and so is
    ``0 * x * y * ...`` (a product of 0 with finite values stays 0, one of
    NaN stays NaN): that product over the leaves of one shape (each part of
    a complex one, see `_finite_factors`), then its sum over the elements,
    is NaN exactly when one of those elements is not finite, one multiply
    per leaf and element. Multiplying the leaves first lets XLA fuse all
    that computes them (the whole optimizer update, see `_writes_finite`)
    into one loop. An optax state mirrors the params (Adam's ``mu`` and
    ``nu`` have their tree), so the i-th state leaf of a shape goes with the
    i-th written leaf of that shape: both are computed from the same inputs,
    which their reduction then reads once; `_PARAMS_PER_CHECK` such sets per
    reduction. (Any other state leaf is checked too, only maybe beside
    leaves computed from other inputs.)
    """
    per_shape = collections.Counter(x.shape for x in written)
    seen: collections.Counter = collections.Counter()
    groups: dict[tuple, list[jax.Array]] = {}
    for x in written + state:
        k = seen[x.shape]
        seen[x.shape] += 1
        index = k % per_shape[x.shape] if per_shape[x.shape] else k
        key = (x.shape, index // _PARAMS_PER_CHECK)
        groups.setdefault(key, []).extend(_finite_factors(x))
    if not groups:
        return jnp.ones([], jnp.bool_)
    rows = []
    for factors in groups.values():
        # 0 * a * b * ...: 0 while every factor is finite, NaN from the
        # first that is not (0 * inf and 0 * nan are NaN, and NaN stays).
        total = functools.reduce(
            operator.mul, factors[1:], factors[0] * jnp.zeros([], jnp.float32)
        )
        # Sum and max: a second operand keeps the reduce XLA's own fused
        # loop (see `loss_scale._leading_rows`); either is NaN when a term is.
        added, largest = _leading_rows((total, total), _add_and_max)
        rows.append(added + largest)
    return jnp.isfinite(_row_total(rows))


def _writes_finite(update_fn: Any, updates: Any, state: Any, params: Any) -> jax.Array:
    """Whether ``update_fn(updates, state, params)`` writes only finite values.

    What it writes: the new state and the new parameters ``params + update``
    (the update itself when ``params`` is None). The check recomputes the
    update from its inputs in a pass that writes nothing: `_opaque` on the
    state and params keeps XLA from merging it with the caller's own call,
    whose result is selected with the flag this returns. Checking the
    caller's materialised result instead costs a write of every new value, a
    read to check it and a read to select it (the 80-leaf Adam MLP of
    `benchmarks/bench_step.py`: 1.93x the bytes of the plain step, against
    1.28x here, where the check reads gradients, state and params once).
    Nothing is derived: every float leaf written is tested, whatever the
    optimizer (Adam's v can overflow to inf under a finite update
    ``m / (sqrt(v) + eps) = 0``).
    """
    leaves, treedef = jax.tree_util.tree_flatten((state, params))
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    # Python numbers stay as they are (a barrier would make them arrays).
    for i, x in zip(arrays, _opaque([leaves[i] for i in arrays]), strict=True):
        leaves[i] = x
    state, params = treedef.unflatten(leaves)
    new_updates, new_state = update_fn(updates, state, params)
    written = (
        new_updates if params is None else optax.apply_updates(params, new_updates)
    )
    return _finite_together(_inexact_leaves(written), _inexact_leaves(new_state))


def _finite_elements(x: jax.Array) -> jax.Array:
    """Elementwise "x is finite" for an inexact array (True for any other).

    ``|x| <= max`` is False for inf and NaN: a compare that XLA fuses into the
    select that writes `x`, not an ``is_finite`` (those count the step's
    finiteness reductions in the tests).
    """
    dtype = jnp.result_type(x)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.logical_and(
            _finite_elements(jnp.real(x)), _finite_elements(jnp.imag(x))
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        return jnp.ones([], jnp.bool_)
    return jnp.abs(x) <= jnp.finfo(dtype).max


def _kept_elements(ok: jax.Array, x: jax.Array) -> jax.Array:
    """``ok and x is finite``, elementwise, for an inexact array (``ok`` for
    any other).

    ``|x| <= (max if ok else -1)``: one compare against a scalar chosen
    once, instead of a compare and an ``and`` per element (False for inf,
    NaN and, when not ``ok``, everything).
    """
    dtype = jnp.result_type(x)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.logical_and(
            _kept_elements(ok, jnp.real(x)), _kept_elements(ok, jnp.imag(x))
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        return ok
    bound = jnp.where(ok, jnp.finfo(dtype).max, -1).astype(dtype)
    return jnp.abs(x) <= bound


def _keep_finite(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``ok``, else ``old``, and ``old`` for any element of
    ``new`` that is not finite.

    `_writes_finite` tests a recomputation of what the step writes, not the
    written values themselves: two compilations of the same arithmetic, which
    agree unless XLA contracts ``a * b + c`` into an FMA in one and not the
    other (allowed on GPU), and then only at float32's overflow edge. This
    elementwise test, computed in the pass that writes (no extra read or
    write), makes the invariant hold whatever they do: no non-finite value is
    ever written. When both agree, as they do, it changes nothing.
    """

    def keep(a, b):
        return jnp.where(_kept_elements(ok, a), a, b)

    return jax.tree_util.tree_map(keep, new, old)


def _keep_finite_updates(ok: jax.Array, updates: Any, params: Any) -> Any:
    """``updates`` where ``ok`` (zeros otherwise), and 0 for an element whose
    update, or the parameter it writes (``params + update`` in the params'
    dtype, as `optax.apply_updates` writes it), is not finite (see
    `_keep_finite`)."""
    if params is None:
        return _keep_finite(
            ok, updates, jax.tree_util.tree_map(jnp.zeros_like, updates)
        )

    def keep(u, p):
        if u is None:
            return None
        written = jnp.asarray(p + u).astype(jnp.result_type(p))
        if jnp.issubdtype(jnp.result_type(p), jnp.inexact):
            # A non-finite update writes a non-finite parameter (inf + x,
            # nan + x and inf - inf are not finite, in any dtype they are
            # cast to), so the written value's test covers the update's.
            kept = _kept_elements(ok, written)
        else:
            kept = jnp.logical_and(ok, _finite_elements(u))
        return jnp.where(kept, u, jnp.zeros_like(u))

    return jax.tree_util.tree_map(keep, updates, params, is_leaf=lambda x: x is None)


def skip_non_finite(
    inner: optax.GradientTransformation,
    *,
    max_consecutive: int | None = None,
    check_update: bool = True,
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
    _check_optimizer(inner, "skip_non_finite")
    _check_optional_count("max_consecutive", max_consecutive)
    _check_bool("check_update", check_update)
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
            grads_ok = _scalar_flag(grads_finite)

        def update(updates, inner_state, params):
            return inner.update(updates, inner_state, params, **extra_args)

        ok = grads_ok
        if check_update:
            written_ok = _writes_finite(update, updates, state.inner_state, params)
            ok = jnp.logical_and(grads_ok, written_ok)
        new_updates, new_inner = update(updates, state.inner_state, params)
        if check_update:
            new_updates = _keep_finite_updates(ok, new_updates, params)
            new_inner = _keep_finite(ok, new_inner, state.inner_state)
        else:  # the gradient flag alone decides, as documented
            new_updates = jax.tree_util.tree_map(
                lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates
            )
            new_inner = jax.tree_util.tree_map(
                lambda new, old: jnp.where(ok, new, old), new_inner, state.inner_state
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
_check_bool = functools.partial(_core_check_bool, error=ValueError)


def _check_optional_count(name: str, value: Any) -> None:
    """None or an int >= 0 (a concrete JAX/numpy integer scalar too)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer | jax.Array):
        raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
    limit = _concrete_float(value)
    if limit is not None and limit < 0:
        raise ValueError(f"{name} must be None or an int >= 0, got {value}")


def stable_optimizer(
    optimizer: optax.GradientTransformation,
    *,
    max_grad_norm: float | None = None,
    skip_non_finite: bool = True,
    max_consecutive: int | None = None,
    clip_eps: float = 1e-6,
    check_update: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """The usual guarded chain in one call: skip(chain(clip, optimizer)).

    ``skip_non_finite(chain(clip_by_global_norm(max_grad_norm, eps=clip_eps),
    optimizer), max_consecutive=max_consecutive, check_update=check_update)``;
    the clip is left out when ``max_grad_norm`` is None and the skip when
    ``skip_non_finite`` is False.
    The order is torch's: clip the unscaled gradients, then step.

    Args:
      optimizer: any optax transformation (e.g. ``optax.adam(1e-3)``).
      max_grad_norm: global-norm clip threshold (> 0) or None for no clip.
      skip_non_finite: wrap everything in `skip_non_finite` (outermost state
        is then a `SkipNonFiniteState`).
      max_consecutive: passed to `skip_non_finite`.
      clip_eps: torch's eps in the clip coefficient.
      check_update: passed to `skip_non_finite`: also skip a step whose update
        or new optimizer state is non-finite although its gradients are not.

    Returns:
      A `optax.GradientTransformationExtraArgs`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import transforms
      >>> tx = transforms.stable_optimizer(optax.sgd(1.0), max_grad_norm=1.0)
      >>> params = jnp.zeros(2)
      >>> u, state = tx.update(jnp.array([30.0, 40.0]), tx.init(params))
      >>> [round(v, 3) for v in u.tolist()], type(state).__name__
      ([-0.6, -0.8], 'SkipNonFiniteState')
    """
    _check_optimizer(optimizer, "stable_optimizer")
    _check_bool("skip_non_finite", skip_non_finite)
    _check_bool("check_update", check_update)
    parts = []
    if max_grad_norm is not None:
        parts.append(clip_by_global_norm(max_grad_norm, eps=clip_eps))
    parts.append(optimizer)
    tx = (
        optax.chain(*parts)
        if len(parts) > 1
        else optax.with_extra_args_support(optimizer)
    )
    if skip_non_finite:
        tx = _skip(tx, max_consecutive=max_consecutive, check_update=check_update)
    return tx


_skip = skip_non_finite


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


def _scalar_flag(flag: Any) -> jax.Array:
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


def _check_optimizer(optimizer: Any, where: str) -> None:
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


class AccumulateGradientsState(NamedTuple):
    """State of `accumulate_gradients`.

    Attributes:
      inner_state: the wrapped optimizer's state; it changes only at the last
        micro-step of a window, and only when that window's step is applied.
      acc: the sum of this window's finite micro-gradients so far, each leaf
        in float32 at least (a non-finite micro-gradient is never added, so
        the state stays finite).
      mini_step: int32, micro-steps already taken in the current window
        (0 to ``every_k - 1``).
      window_finite: bool, whether every micro-gradient of the current window
        so far was finite.
      kept: None, or with ``drop_non_finite_microbatches=True`` int32, the
        micro-gradients of this window added to ``acc`` so far.
      dropped_total: None, or with ``drop_non_finite_microbatches=True``
        int32, the micro-gradients dropped since ``init``.
    """

    inner_state: Any
    acc: Any
    mini_step: jax.Array
    window_finite: jax.Array
    kept: Any = None
    dropped_total: Any = None


def _guards_itself(inner_state: Any) -> bool:
    # The skip transform outermost (stable_optimizer, skip_non_finite),
    # possibly inside optax.inject_hyperparams: it takes grads_finite= and
    # makes the whole decision itself, and counts it.
    return outer_guard(inner_state) is not None


def accumulate_gradients(
    optimizer: optax.GradientTransformation,
    every_k: int,
    *,
    drop_non_finite_microbatches: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Gradient accumulation with ONE skip decision per optimizer step.

    For plain ``tx.update`` loops that feed one micro-batch per call (with
    `jaxstable.train.make_train_step`, use ``microbatches=k`` instead). Each
    call adds the micro-gradient to a float32 sum; the ``every_k``-th call
    passes the mean of the window, ``sum / every_k``, to ``optimizer`` and
    returns its update (the other calls return zeros)::

        finite_i = all_finite(acc + g_i)   # g_i finite, and no overflow of the sum
        acc      = acc + g_i if finite_i else acc     # NaN never enters the state
        window   = window and finite_i
        at the k-th call:  update = optimizer(acc / k, grads_finite=window)
                           acc, window, mini_step = 0, True, 0   # a select

    A window with one non-finite micro-gradient is skipped as a whole, once,
    as torch's GradScaler recipe (``scaler.scale(loss / k).backward()`` k
    times, then one ``scaler.step``) skips it; the next window starts clean.
    So is a window whose float32 sum overflows (two micro-gradients of 3e38),
    as a non-finite gradient, as torch's sum in ``.grad`` is. (torch adds in
    the gradients' dtype: float16 micro-gradients summing past 65504 are inf
    there, a skipped window, and finite in this float32 sum.)
    The clip, the skip check and the counters of a guarded ``optimizer``
    (`stable_optimizer`, `skip_non_finite`, `skip_spikes`: its window takes
    the mean's norm and the ``value=`` of the window's last call) act once
    per window, on the mean.
    An unguarded ``optimizer`` is guarded here the same way (the window is
    applied only when its micro-gradients, the update, the new params and
    the new optimizer state are finite), without counters.

    Place it OUTSIDE the guard. ``optax.MultiSteps(stable_optimizer(...), k)``
    keeps a NaN in its accumulator for good (it resets it as
    ``(1 - emit) * acc`` and ``0 * nan`` is nan: every later window is
    skipped); ``stable_optimizer(optax.MultiSteps(...))`` drops the bad
    micro-batch and stretches its window to k + 1 micro-batches.
    `make_train_step` refuses both, and this transform too.

    Args:
      optimizer: the optimizer to step once per window, typically
        ``stable_optimizer(optax.adam(1e-3), max_grad_norm=1.0)``.
      every_k: micro-steps per optimizer step, an int >= 1.
      drop_non_finite_microbatches: False (default: a non-finite
        micro-gradient skips its whole window), or True: it is dropped
        (not added, counted in ``dropped_total``) and the window's
        ``optimizer`` step takes the mean of the kept ones, ``acc / kept``
        (equal weights: one micro-batch, one vote); the window is skipped
        only when none is kept (``0 / 0``) or the result is non-finite.
        As `jaxstable.train.make_train_step`'s option of the same name
        (which also takes weights and a loss scale).

    Returns:
      An `optax.GradientTransformationExtraArgs` with state
      `AccumulateGradientsState`; ``update`` accepts ``grads_finite=`` (the
      micro-gradient's flag, when already computed; ANDed with the test of
      the new sum).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import transforms
      >>> tx = transforms.accumulate_gradients(
      ...     transforms.stable_optimizer(optax.sgd(1.0)), every_k=2)
      >>> state = tx.init(jnp.zeros(2))
      >>> for g in ([1.0, 3.0], [jnp.nan, 0.0], [1.0, 3.0], [3.0, 5.0]):
      ...     u, state = tx.update(jnp.array(g), state, jnp.zeros(2))
      ...     print(u.tolist(), int(transforms.find_skip_state(state).skipped_total))
      [0.0, 0.0] 0
      [0.0, 0.0] 1
      [0.0, 0.0] 1
      [-2.0, -4.0] 1

      Keeping the window's good micro-gradients:

      >>> tx = transforms.accumulate_gradients(
      ...     transforms.stable_optimizer(optax.sgd(1.0)), every_k=2,
      ...     drop_non_finite_microbatches=True)
      >>> state = tx.init(jnp.zeros(2))
      >>> for g in ([1.0, 3.0], [jnp.nan, 0.0]):
      ...     u, state = tx.update(jnp.array(g), state, jnp.zeros(2))
      >>> u.tolist(), int(state.dropped_total)
      ([-1.0, -3.0], 1)
    """
    _check_optimizer(optimizer, "accumulate_gradients")
    if not isinstance(drop_non_finite_microbatches, bool):
        raise TypeError(
            "drop_non_finite_microbatches must be True or False, got "
            f"{drop_non_finite_microbatches!r}"
        )
    drop = drop_non_finite_microbatches
    if isinstance(every_k, bool) or not isinstance(every_k, int | np.integer):
        raise TypeError(f"every_k must be an int >= 1, got {every_k!r}")
    if every_k < 1:
        raise ValueError(f"every_k must be an int >= 1, got {every_k}")
    every_k = int(every_k)
    inner = optax.with_extra_args_support(optimizer)

    def acc_dtype(x):
        return jnp.promote_types(jnp.result_type(x), jnp.float32)

    def init_fn(params):
        return AccumulateGradientsState(
            inner_state=inner.init(params),
            acc=jax.tree_util.tree_map(
                lambda p: jnp.zeros(jnp.shape(p), acc_dtype(p)), params
            ),
            mini_step=jnp.zeros([], jnp.int32),
            window_finite=jnp.ones([], jnp.bool_),
            kept=jnp.zeros([], jnp.int32) if drop else None,
            dropped_total=jnp.zeros([], jnp.int32) if drop else None,
        )

    def update_fn(updates, state, params=None, *, grads_finite=None, **extra_args):
        added = jax.tree_util.tree_map(
            lambda a, g: a + jnp.asarray(g, a.dtype), state.acc, updates
        )
        # The new sum is tested, not the micro-gradient: finite ones of 3e38
        # add up to inf in float32, as in torch's .grad, whose guard then
        # sees a non-finite window (the inf mean had reached the optimizer
        # flagged finite). The old sum being finite, the new one is exactly
        # when the micro-gradient is and the addition did not overflow.
        ok = all_finite(added)
        if grads_finite is not None:
            ok = jnp.logical_and(ok, _scalar_flag(grads_finite))
        acc = jax.tree_util.tree_map(
            lambda new, old: jnp.where(ok, new, old), added, state.acc
        )
        window = jnp.logical_and(state.window_finite, ok)
        kept = dropped_total = None
        if drop:
            # The kept ones' mean; no kept one: 0 / 0 = nan, a skipped window.
            kept = state.kept + ok.astype(jnp.int32)
            dropped_total = state.dropped_total + jnp.logical_not(ok).astype(jnp.int32)
            window = kept > 0
            mean = jax.tree_util.tree_map(
                lambda a, g: (a / kept.astype(a.dtype)).astype(jnp.result_type(g)),
                acc,
                updates,
            )
        else:
            mean = jax.tree_util.tree_map(
                lambda a, g: (a / every_k).astype(jnp.result_type(g)), acc, updates
            )
        if _guards_itself(state.inner_state):
            new_updates, new_inner = inner.update(
                mean, state.inner_state, params, grads_finite=window, **extra_args
            )
        else:
            new_updates, new_inner = inner.update(
                mean, state.inner_state, params, **extra_args
            )
            written = (
                new_updates
                if params is None
                else optax.apply_updates(params, new_updates)
            )
            applied = jnp.logical_and(window, all_finite((written, new_inner)))
            new_updates = jax.tree_util.tree_map(
                lambda u: jnp.where(applied, u, jnp.zeros_like(u)), new_updates
            )
            new_inner = jax.tree_util.tree_map(
                lambda n, o: jnp.where(applied, n, o), new_inner, state.inner_state
            )
        emit = state.mini_step == every_k - 1
        new_updates = jax.tree_util.tree_map(
            lambda u: jnp.where(emit, u, jnp.zeros_like(u)), new_updates
        )
        # Reset by a select: (1 - emit) * acc would keep a NaN (0 * nan).
        return new_updates, AccumulateGradientsState(
            inner_state=jax.tree_util.tree_map(
                lambda n, o: jnp.where(emit, n, o), new_inner, state.inner_state
            ),
            acc=jax.tree_util.tree_map(
                lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc
            ),
            mini_step=jnp.where(emit, 0, state.mini_step + 1).astype(jnp.int32),
            window_finite=jnp.logical_or(emit, window),
            kept=None if kept is None else jnp.where(emit, 0, kept).astype(jnp.int32),
            dropped_total=dropped_total,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
