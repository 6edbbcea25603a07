"""The guard's state types and the one walker that finds a state by type.

`skip_non_finite` (`jaxstable._src.guard`) and `skip_spikes`
(`jaxstable._src.spikes`) keep these states; the train step, the
accumulation and the spike guard tell a guard by them. Kept apart so that
every module imports them from here and none imports a sibling transform
for a type (optax's ``tree_utils.tree_get`` finds a state by type likewise).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

__all__ = [
    "GUARD_STATES",
    "INJECT_STATES",
    "SkipNonFiniteState",
    "SkipSpikesState",
    "find_state",
    "outer_guard",
]


class SkipNonFiniteState(NamedTuple):
    """State of `skip_non_finite`.

    Attributes:
      inner_state: the wrapped transformation's state (unchanged by a skip).
      skipped_total: int32, number of skipped updates so far, whatever made
        them non-finite (gradients, or the update the optimizer computed).
      consecutive: int32, skipped updates in a row up to now (0 after an
        applied one).
      last_finite: bool, whether the latest update was applied (its
        gradients, the update and the new optimizer state all finite).
      exceeded: bool, ``consecutive > max_consecutive`` (always False when
        ``max_consecutive`` is None). A flag for the training loop to act on.
      last_grads_finite: bool, whether the latest gradients were finite (the
        flag a loss scale reacts to). ``last_grads_finite and not
        last_finite`` means the gradients were finite but the update or the
        new state was not (e.g. Adam's float16 second moment underflowing).
      non_finite_updates: int32, how many of the skipped updates had finite
        gradients (the update or the new state was non-finite).
    """

    inner_state: Any
    skipped_total: jax.Array
    consecutive: jax.Array
    last_finite: jax.Array
    exceeded: jax.Array
    last_grads_finite: jax.Array
    non_finite_updates: jax.Array


class SkipSpikesState(NamedTuple):
    """State of `skip_spikes`.

    Attributes:
      inner_state: the guarded optimizer's state (a `SkipNonFiniteState`, or
        one inside `optax.inject_hyperparams`); unchanged by a skipped step
        except for its skip counters, which count spikes too.
      log_norms: float32 ``[window]``, ``log(global_norm(grads))`` of the
        latest steps whose values were finite, spikes included (a ring
        buffer; 0 in slots not yet written, so the state stays finite).
      losses: float32 ``[window]``, the losses (``value=``) of the same
        steps, 0 in slots not yet written.
      norm_count: int32, values in ``log_norms`` (at most ``window``).
      loss_count: int32, values in ``losses`` (steps given ``value=``).
      position: int32, the slot the next step with finite values writes.
      spikes_total: int32, steps skipped as spikes so far.
      last_spike: bool, whether the latest step was skipped as a spike.
      last_finite: bool, whether the latest step was applied (the field the
        train step and `find_skip_state` users read on every guard).
    """

    inner_state: Any
    log_norms: jax.Array
    losses: jax.Array
    norm_count: jax.Array
    loss_count: jax.Array
    position: jax.Array
    spikes_total: jax.Array
    last_spike: jax.Array
    last_finite: jax.Array


# The states an `optax.inject_hyperparams` wraps a transformation's in.
INJECT_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
# The states of a transformation that makes the skip decision itself.
GUARD_STATES = (SkipNonFiniteState, SkipSpikesState)


def find_state(tree: Any, kind: type | tuple[type, ...]) -> Any:
    """The first node of type ``kind`` inside ``tree`` (depth first), or None.

    Looks through any nesting: `optax.chain` tuples, `optax.inject_hyperparams`
    and `optax.MultiSteps` states, dicts.
    """
    found = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, kind))
    for node in found:
        if isinstance(node, kind):
            return node
    return None


def outer_guard(state: Any, guards: tuple[type, ...] = GUARD_STATES) -> Any:
    """``state`` when it is one of ``guards``, the one inside it when it is an
    `optax.inject_hyperparams` state around one, else None."""
    if isinstance(state, guards):
        return state
    if isinstance(state, INJECT_STATES) and isinstance(state.inner_state, guards):
        return state.inner_state
    return None
