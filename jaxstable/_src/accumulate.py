"""`accumulate_gradients`: one skip decision per window of micro-batches.

Placed outside the guard: `optax.MultiSteps` around `skip_non_finite` keeps
a NaN in its accumulator for good, and inside it stretches the window.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxstable._src.guard import check_optimizer, scalar_flag
from jaxstable._src.guard_state import outer_guard
from jaxstable._src.loss_scale_math import all_finite

__all__ = ["AccumulateGradientsState", "accumulate_gradients"]


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
    check_optimizer(optimizer, "accumulate_gradients")
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
            ok = jnp.logical_and(ok, scalar_flag(grads_finite))
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
