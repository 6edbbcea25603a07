"""`stable_optimizer`: the usual guarded chain, skip(chain(clip, optimizer))."""

from __future__ import annotations

from typing import Any

import optax

from jaxstable._src.clipping import clip_by_global_norm, concrete_float
from jaxstable._src.guard import check_bool, check_optimizer
from jaxstable._src.guard import skip_non_finite as _skip
from jaxstable._src.update_bound import UpdateBound

__all__ = ["stable_optimizer"]


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
        With a clip, where `UpdateBound` proves at trace time that the
        clipped update cannot write a non-finite value (float32/float64
        SGD, momentum, Adam, AdamW, Lion, RMSprop... with finite, moderate
        hyper-parameters and schedules), the check's recompute pass is left
        out of the step: it could only say "finite".

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
    check_optimizer(optimizer, "stable_optimizer")
    check_bool("skip_non_finite", skip_non_finite)
    check_bool("check_update", check_update)
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
        tx = _skip(
            tx,
            max_consecutive=max_consecutive,
            check_update=check_update,
            _proven=_clipped_bound(optimizer, max_grad_norm),
        )
    return tx


def _clipped_bound(optimizer: optax.GradientTransformation, max_norm: Any):
    """``proven(grads, inner_state, params)`` for ``chain(clip, optimizer)``:
    `UpdateBound` on the optimizer's part of the state; None without a
    clip (unbounded gradients prove nothing)."""
    norm = concrete_float(max_norm) if max_norm is not None else None
    if norm is None:
        return None
    bound = UpdateBound(optimizer, norm)
    return lambda grads, state, params, **extra: bound.proven(
        grads, state[1], params, **extra
    )
