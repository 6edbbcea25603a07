"""Global norms and clipping by them, torch's formula, overflow-safe.

`global_norm` and `clip_by_global_norm` (an optax transformation), with the
norm helpers the update check and the guards share: float16/bfloat16 leaves
are reduced in float32, and a norm whose float32 sum of squares overflows is
recovered from the sum of the squares scaled by 2**-90.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxstable._src.loss_scale_math import (
    NORM_SCALE,
    computed_once,
    opaque,
    sums_of_squares,
)

__all__ = ["clip_by_global_norm", "global_norm"]


def concrete_float(x: Any) -> float | None:
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
# 2**-90 (`loss_scale_math.NORM_SCALE`), which cannot overflow below 2**52
# elements of float32's max; the squares it loses to underflow (elements
# below 2**27) change a norm above 2**64 by less than 2**-74 relative per
# element.
_NORM_UNSCALE = 2.0**90


def inexact_leaves(tree: Any) -> list[jax.Array]:
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
    times `NORM_SCALE`; ``overflow`` says that the plain sum of squares
    overflowed although the scaled one did not (the leaves are finite), in
    which case ``norm = scaled_norm * 2**90`` (inf only when the norm itself
    is above float32's max). One reduction per leaf reads it once for both
    sums (`loss_scale_math.sums_of_squares`), the same one `all_finite` uses.
    """
    leaves = inexact_leaves(tree)
    if not leaves:
        zero = jnp.zeros([], jnp.float32)
        return zero, zero, jnp.zeros([], jnp.bool_)
    plain, scaled = sums_of_squares(leaves)
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
    is recomputed with every element scaled by 2**-90 (see `NORM_SCALE`),
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
    value = concrete_float(max_norm)
    if value is not None and not value > 0:
        raise ValueError(f"max_norm must be > 0, got {value}")
    eps_value = concrete_float(eps)
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
        coef_s = (1.0 / (scaled_norm + eps32 * jnp.float32(NORM_SCALE))) * max32
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
    `opaque` keeps XLA from folding the two factors into one, which is
    subnormal, so flushed to 0, for a norm above 8.5e37, and
    `computed_once` makes each factor once per step (fused, the selects that
    choose them ran again for every element of every gradient, moment and
    parameter).
    """
    one = jnp.ones([], jnp.float32)
    unclipped = scaled_coef >= jnp.float32(_NORM_UNSCALE)
    scaled = jnp.logical_and(overflow, jnp.logical_not(unclipped))
    first = jnp.where(
        overflow, jnp.where(unclipped, one, jnp.float32(NORM_SCALE)), norm_coef
    )
    second = jnp.where(scaled, scaled_coef, one)
    return computed_once(opaque((first, second)))
