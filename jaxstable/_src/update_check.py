"""Whether an update writes only finite values, and the select that keeps it so.

`writes_finite` recomputes an optimizer update in a pass that writes nothing
and tests everything it would write (new parameters and optimizer state) in
a few fused reductions; `keep_finite` and `keep_finite_updates` are the
selects of the pass that writes, which also keep the old value of any
element that is not finite. All of it is `jnp.where` and reductions: no
``lax.cond``, no host sync.
"""

from __future__ import annotations

import collections
import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxstable._src.clipping import inexact_leaves
from jaxstable._src.loss_scale_math import leading_rows, opaque, row_total

__all__ = ["keep_finite", "keep_finite_updates", "writes_finite"]


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
    that computes them (the whole optimizer update, see `writes_finite`)
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
        # loop (see `loss_scale_math.leading_rows`); either is NaN when a term is.
        added, largest = leading_rows((total, total), _add_and_max)
        rows.append(added + largest)
    return jnp.isfinite(row_total(rows))


def writes_finite(update_fn: Any, updates: Any, state: Any, params: Any) -> jax.Array:
    """Whether ``update_fn(updates, state, params)`` writes only finite values.

    What it writes: the new state and the new parameters ``params + update``
    (the update itself when ``params`` is None). The check recomputes the
    update from its inputs in a pass that writes nothing: `opaque` on the
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
    for i, x in zip(arrays, opaque([leaves[i] for i in arrays]), strict=True):
        leaves[i] = x
    state, params = treedef.unflatten(leaves)
    new_updates, new_state = update_fn(updates, state, params)
    written = (
        new_updates if params is None else optax.apply_updates(params, new_updates)
    )
    return _finite_together(inexact_leaves(written), inexact_leaves(new_state))


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


def keep_finite(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``ok``, else ``old``, and ``old`` for any element of
    ``new`` that is not finite.

    `writes_finite` tests a recomputation of what the step writes, not the
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


def keep_finite_updates(ok: jax.Array, updates: Any, params: Any) -> Any:
    """``updates`` where ``ok`` (zeros otherwise), and 0 for an element whose
    update, or the parameter it writes (``params + update`` in the params'
    dtype, as `optax.apply_updates` writes it), is not finite (see
    `keep_finite`)."""
    if params is None:
        return keep_finite(ok, updates, jax.tree_util.tree_map(jnp.zeros_like, updates))

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
