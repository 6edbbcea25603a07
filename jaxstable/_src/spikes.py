"""A loss-spike guard: skip a step whose gradient norm or loss is an outlier.

`skip_spikes` keeps, in its optax state, a window of the log gradient norms
(and losses) of recent steps (every step whose values are finite, skipped
as a spike or not) and refuses a step whose value lies far above their
median, measured in robust deviations (median absolute deviation).
Everything is a select (`jnp.where`): no ``conditional``, no host
transfer. `torchref.transforms.skip_spikes` decides the same way.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _stablecore.checks import check_spike_args
from jaxstable._src.clipping import global_norm
from jaxstable._src.guard import check_optimizer, scalar_flag, skip_non_finite
from jaxstable._src.guard_state import (
    SkipNonFiniteState,
    SkipSpikesState,
    find_state,
    outer_guard,
)

__all__ = ["SkipSpikesState", "find_spike_state", "skip_spikes"]

# 1 / Phi^-1(3/4): the median absolute deviation of a normal sample times
# this is its standard deviation, so `threshold` reads in sigmas.
_MAD_TO_SIGMA = 1.482602218505602
# Norms are compared as logs; a norm of exactly 0 is taken as float32's
# smallest normal (log = -87.3), not log(0) = -inf.
_TINY = float(np.finfo(np.float32).tiny)
# log(tiny) as one float32 constant, written for a norm below tiny (0 above
# all) in both packages: the window tells such a step by this exact value.
_LOG_TINY = float(np.log(np.float32(_TINY)))


def _median(sorted_values: jax.Array, count: jax.Array) -> jax.Array:
    """Median of the first ``count`` entries of an ascending array (NaNs sort
    last, so they are the padding); NaN when ``count`` is 0."""
    lo = jnp.maximum((count - 1) // 2, 0)
    hi = jnp.maximum(count // 2, 0)
    mid = (sorted_values[lo] + sorted_values[hi]) * jnp.float32(0.5)
    return jnp.where(count > 0, mid, jnp.float32(jnp.nan))


def _robust_stats(buffer: jax.Array, count: jax.Array, blank: jax.Array):
    """``(median, sigma, n)`` of the first ``count`` slots of ``buffer`` that
    are not ``blank`` (an exact zero: a norm of 0 is stored as log(tiny), a
    loss as 0), n of them: sigma = 1.4826 * median(|x - median|).
    Sort-based, static shapes: the other slots are NaN in the sorted copy,
    which puts them last."""
    used = jnp.logical_and(jnp.arange(buffer.shape[0]) < count, buffer != blank)
    n = jnp.sum(used, dtype=jnp.int32)
    window = jnp.where(used, buffer, jnp.float32(jnp.nan))
    med = _median(jnp.sort(window), n)
    mad = _median(jnp.sort(jnp.abs(window - med)), n)
    return med, jnp.float32(_MAD_TO_SIGMA) * mad, n


def _is_outlier(x, buffer, count, blank, min_history, threshold, floor):
    """Whether ``x`` exceeds the window's median by more than
    ``max(threshold * sigma, floor)`` while it holds >= ``min_history``
    values other than ``blank``. No division: a window of equal values
    (sigma 0) is fine."""
    med, sigma, n = _robust_stats(buffer, count, blank)
    margin = jnp.maximum(jnp.float32(threshold) * sigma, floor(med))
    return jnp.logical_and(n >= min_history, x - med > margin)


def _push(window: jax.Array, position: jax.Array, x: jax.Array, keep: jax.Array):
    return jnp.where(keep, window.at[position].set(x), window)


def _grow(count: jax.Array, keep: jax.Array, window: int) -> jax.Array:
    return jnp.minimum(count + keep, window).astype(jnp.int32)


def _guarded(state: Any) -> bool:
    return outer_guard(state, (SkipNonFiniteState,)) is not None


def _applied(inner_state: Any) -> jax.Array:
    return outer_guard(inner_state, (SkipNonFiniteState,)).last_finite


def skip_spikes(
    inner: optax.GradientTransformation,
    *,
    window: int = 128,
    min_history: int = 16,
    threshold: float = 6.0,
    min_ratio: float = 1.5,
) -> optax.GradientTransformationExtraArgs:
    """Skips a step whose gradient norm (or loss) spikes above recent steps.

    The statistics are robust ones over a window of the latest steps whose
    values are finite, kept in the state (a ring buffer of ``window``
    float32 slots and a count: the state holds only finite values)::

        x      = log(max(global_norm(grads), tiny))
        used   = the window's values that are not an exact zero
                 (a norm below tiny, stored as log(tiny); a loss of 0)
        med    = median(used);  sigma = 1.4826 * median(|used - med|)
        spike  = count(used) >= min_history
                 and x - med > max(threshold * sigma, log(min_ratio))

    and the same for the loss when the step passes ``value=loss`` (as
    `jaxstable.train.make_train_step` does), on raw values with the floor
    ``(min_ratio - 1) * |median|`` (pass ``value=`` on every step or on
    none: the losses share the norms' ring position). A step is applied
    only when it is no spike and its gradients, its loss and what it
    writes are finite.

    What enters the window is not what is applied: a step enters it when
    its gradient norm and its loss are finite and ``grads_finite`` is not
    False, whether it is skipped as a spike or not (norm and loss enter
    together); a NaN or an inf never does. (``grads_finite=False`` is the
    caller's word that the gradients are bad: `accumulate_gradients` says
    so of a window with a NaN micro-batch, whose finite partial mean must
    not enter, as torch's NaN ``.grad`` sum does not.) A step whose
    gradients and loss are finite but whose update is not (a NaN learning
    rate, an overflowing moment) enters too: its norm and loss describe the
    data, which is what the window models, so the next decisions depend on
    the gradients and losses seen, not on the inner optimizer. Why spikes
    enter: with only applied steps kept, a lasting change (the norm 10x
    higher for good once a frozen backbone is unfrozen) is a spike forever
    and training stalls, silently. With median/MAD a spike inside the window
    moves the median and the MAD by one rank at most, so an isolated spike
    is still skipped and does not mask the next one, while a level that
    lasts is adopted once it fills about half the window: a clean shift of
    a full window skips ``(window + 1) // 2`` steps, then steps are applied
    again (fewer when the window's spread widens first). The price: a run
    of spikes that lasts half a window is taken as the new level. Exact
    zeros (a gradient of 0, a loss of 0: a batch with nothing to learn,
    e.g. every label ignored) take a slot of the window but not part in its
    statistics: they say nothing about the scale, and a window made mostly
    of them would have a MAD of 0 and call every non-zero value a spike
    (sparse rewards, sparse labels); the statistics are those of the
    non-zero values, checked once there are ``min_history`` of them.
    There is no unguarded warm-up: while the window holds fewer than
    ``min_history`` values steps are not spike-checked but non-finite ones
    are still refused.

    Why median/MAD on logs and not OLMo-core's mean + k sigma of raw values:
    one spike of 1e4 in a window of norms near 1 moves the mean by 1e4 /
    window and the deviation by ~1e4 / sqrt(window), so the next spikes pass
    (masking), while the median and MAD move by at most one rank; norms are
    log-normal-ish (they vary by factors), so logs make "6 sigma" a factor.
    The floor ``min_ratio`` keeps a very steady window (sigma near 0, e.g.
    a repeated batch) from calling a 1 % rise a spike.

    The guard hands its decision to the guarded optimizer as
    ``grads_finite=False``: the inner `skip_non_finite` then leaves the
    optimizer state (Adam's moments and count) untouched and counts the step
    in its ``skipped_total`` (so `find_skip_state` sees spikes too), and the
    train step reports ``finite=False``, ``spike=True``. Order with
    `stable_optimizer`: ``skip_spikes(stable_optimizer(opt, max_grad_norm=...))``
    (the guard outermost sees the pre-clip norm; inside the chain it would see
    the clipped one). A plain optimizer is guarded with
    ``skip_non_finite(inner)`` for you.

    Args:
      inner: the optimizer to guard, typically
        ``stable_optimizer(optax.adamw(...), max_grad_norm=1.0)``.
      window: how many steps (with finite values) the statistics cover,
        int >= 1.
      min_history: values needed in the window before a step can be called a
        spike, 1 <= min_history <= window.
      threshold: robust deviations (sigmas) above the median that make a
        spike, > 0.
      min_ratio: a spike is also at least this factor above the median norm
        (and the loss this factor above its median, for a positive loss),
        >= 1.

    Returns:
      An `optax.GradientTransformationExtraArgs` with state `SkipSpikesState`;
      ``update`` accepts ``grads_finite=`` (reused as the gradients' flag) and
      ``value=`` (the loss); other extra args go to ``inner``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import transforms
      >>> tx = transforms.skip_spikes(transforms.stable_optimizer(optax.sgd(0.1)),
      ...                             window=8, min_history=3)
      >>> state = tx.init(jnp.zeros(2))
      >>> seen = []
      >>> for g in [1.0, 1.1, 0.9, 1.0, 50.0, jnp.nan, 1.05]:
      ...     u, state = tx.update(jnp.array([g, 0.0]), state)
      ...     seen.append("spike" if state.last_spike else
      ...                 "applied" if state.last_finite else "non-finite")
      >>> seen
      ['applied', 'applied', 'applied', 'applied', 'spike', 'non-finite', 'applied']
      >>> int(state.spikes_total), int(transforms.find_skip_state(state).skipped_total)
      (1, 2)
    """
    check_optimizer(inner, "skip_spikes")
    window, min_history, threshold, min_ratio = check_spike_args(
        window,
        min_history,
        threshold,
        min_ratio,
        int_types=(int, np.integer),
        real_types=(int, float, np.integer, np.floating),
    )
    inner = optax.with_extra_args_support(inner)
    wrapped = skip_non_finite(inner)
    log_ratio = float(np.log(min_ratio))

    def init_fn(params):
        inner_state = inner.init(params)
        if not _guarded(inner_state):
            inner_state = wrapped.init(params)
        empty = jnp.zeros([window], jnp.float32)
        zero = jnp.zeros([], jnp.int32)
        return SkipSpikesState(
            inner_state=inner_state,
            log_norms=empty,
            losses=empty,
            norm_count=zero,
            loss_count=zero,
            position=jnp.zeros([], jnp.int32),
            spikes_total=jnp.zeros([], jnp.int32),
            last_spike=jnp.zeros([], jnp.bool_),
            last_finite=jnp.ones([], jnp.bool_),
        )

    def guard_of(updates, inner_state):
        # Which transformation made inner_state: `inner` itself when it
        # guards (stable_optimizer), else our `skip_non_finite(inner)`.
        # Decided from shapes at trace time, no runtime cost.
        own = jax.eval_shape(inner.init, updates)
        same = jax.tree.structure(own) == jax.tree.structure(inner_state)
        return inner if same and _guarded(own) else wrapped

    def update_fn(updates, state, params=None, *, grads_finite=None, value=None,
                  **extra_args):  # fmt: skip
        norm = global_norm(updates)
        finite = jnp.isfinite(norm)
        if grads_finite is not None:
            finite = jnp.logical_and(finite, scalar_flag(grads_finite))
        log_tiny = jnp.float32(_LOG_TINY)
        x = jnp.where(norm >= _TINY, jnp.log(jnp.maximum(norm, _TINY)), log_tiny)
        spike = _is_outlier(
            x, state.log_norms, state.norm_count, log_tiny, min_history,
            threshold, lambda med: jnp.float32(log_ratio),
        )  # fmt: skip
        if value is not None:
            loss = jnp.asarray(value, jnp.float32)
            if loss.ndim != 0:
                raise ValueError(
                    f"value must be a scalar (the step's loss), got shape {loss.shape}"
                )
            finite = jnp.logical_and(finite, jnp.isfinite(loss))
            loss_spike = _is_outlier(
                loss, state.losses, state.loss_count, jnp.float32(0.0),
                min_history, threshold,
                lambda med: jnp.float32(min_ratio - 1.0) * jnp.abs(med),
            )  # fmt: skip
            spike = jnp.logical_or(spike, loss_spike)
            extra_args["value"] = value
        spike = jnp.logical_and(spike, finite)
        guard = guard_of(updates, state.inner_state)
        new_updates, inner_state = guard.update(
            updates,
            state.inner_state,
            params,
            grads_finite=jnp.logical_and(finite, jnp.logical_not(spike)),
            **extra_args,
        )
        applied = _applied(inner_state)
        # Every step with a finite norm and loss (and gradients not flagged
        # bad) enters the window, skipped as a spike or not: a lasting shift
        # is adopted after about half a window instead of never.
        keep = finite
        pos = state.position
        losses, loss_count = state.losses, state.loss_count
        if value is not None:
            losses = _push(losses, pos, loss, keep)
            loss_count = _grow(loss_count, keep, window)
        return new_updates, SkipSpikesState(
            inner_state=inner_state,
            log_norms=_push(state.log_norms, pos, x, keep),
            losses=losses,
            norm_count=_grow(state.norm_count, keep, window),
            loss_count=loss_count,
            position=jnp.where(keep, (pos + 1) % window, pos).astype(jnp.int32),
            spikes_total=(state.spikes_total + spike).astype(jnp.int32),
            last_spike=spike,
            last_finite=applied,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def find_spike_state(opt_state: Any) -> SkipSpikesState | None:
    """The first `SkipSpikesState` inside `opt_state` (depth first), or None.

    Args:
      opt_state: an optimizer state pytree.

    Returns:
      The `SkipSpikesState`, or None when there is none.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import transforms
      >>> tx = transforms.skip_spikes(optax.sgd(0.1))
      >>> int(transforms.find_spike_state(tx.init(jnp.zeros(2))).spikes_total)
      0
      >>> transforms.find_spike_state(optax.sgd(0.1).init(jnp.zeros(2))) is None
      True
    """
    return find_state(opt_state, SkipSpikesState)
