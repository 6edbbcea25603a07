"""One guarded update: the inner update kept only where everything is finite.

The JAX twin of torch's `GuardedStep` (`torchref._src.guard_step`): the
wrapped optimizer's update and state are selected against the previous
state with `jnp.where` (no ``lax.cond``: on a GPU a ``conditional`` copies
its predicate to the host every step). The counters around it are
`skip_non_finite`'s (`jaxstable._src.guard`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxstable._src.update_check import (
    keep_finite,
    keep_finite_updates,
    writes_finite,
)

__all__ = ["guarded_update"]


def guarded_update(
    update: Callable[[Any, Any, Any], tuple[Any, Any]],
    updates: Any,
    inner_state: Any,
    params: Any,
    grads_ok: jax.Array,
    check_update: bool | str,
) -> tuple[Any, Any, jax.Array]:
    """``update(updates, inner_state, params)`` where it may be applied.

    ``ok = grads_ok`` and, with ``check_update``, every value the update
    writes is finite (`writes_finite`); the result is ``(new_updates,
    new_inner, ok)`` with the update zeroed and the state kept where not
    ``ok`` (and, with ``check_update``, any element that is not finite kept
    too, `keep_finite`). Without ``check_update`` the gradients' flag alone
    decides. ``check_update="proven"`` (`update_bound.UpdateBound` proved
    at trace time that `writes_finite` can only be True) leaves that pass
    out and keeps the elementwise `keep_finite` selects.
    """
    ok = grads_ok
    if check_update is True:
        written_ok = writes_finite(update, updates, inner_state, params)
        ok = jnp.logical_and(grads_ok, written_ok)
    new_updates, new_inner = update(updates, inner_state, params)
    if check_update:
        new_updates = keep_finite_updates(ok, new_updates, params)
        new_inner = keep_finite(ok, new_inner, inner_state)
    else:  # the gradient flag alone decides, as documented
        new_updates = jax.tree_util.tree_map(
            lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates
        )
        new_inner = jax.tree_util.tree_map(
            lambda new, old: jnp.where(ok, new, old), new_inner, inner_state
        )
    return new_updates, new_inner, ok
