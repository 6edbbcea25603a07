"""Gradient accumulation in plain loops: every placement of the guard.

* ours, ``transforms.accumulate_gradients(inner, k)`` (JAX) and its torch
  twin: a NaN micro-batch skips its window once, wherever it sits in the
  window; the next windows apply; nothing non-finite is ever written; one
  count per skipped window; JAX and torch take the same steps.
* ``optax.MultiSteps`` inside or outside the skip, or ours, given to
  ``make_train_step``: refused, naming ``microbatches=k`` (each call would
  be one micro-batch: the loss scale would move per micro-batch and a bad
  micro-batch would stretch its window, or, inside, poison it for good).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from jaxstable import train as jtrain
from jaxstable import transforms as jtx
from torchref import transforms as ttx

_K, _WINDOWS = 4, 3
_RNG = np.random.default_rng(0)
_MICRO = _RNG.standard_normal((_K * _WINDOWS, 3)).astype(np.float32) * 2.0


def _micro(nan_at):
    g = _MICRO.copy()
    g[nan_at, 1] = np.nan
    return g


def _jax_tx(guarded):
    sgd = optax.sgd(0.1, momentum=0.9)
    inner = jtx.stable_optimizer(sgd, max_grad_norm=1.0) if guarded else sgd
    return jtx.accumulate_gradients(inner, _K)


_TX = {True: _jax_tx(True), False: _jax_tx(False)}
_UPDATE = {g: jax.jit(tx.update) for g, tx in _TX.items()}


def _jax_run(guarded, nan_at):
    tx, update = _TX[guarded], _UPDATE[guarded]
    params = jnp.zeros(3)
    state = tx.init(params)
    for g in _micro(nan_at):
        u, state = update(jnp.asarray(g), state, params)
        params = optax.apply_updates(params, u)
        chex.assert_tree_all_finite((params, state))
    return params, state


def _torch_run(guarded, nan_at):
    w = torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    opt = ttx.accumulate_gradients(
        ttx.stable_optimizer(sgd, max_grad_norm=1.0) if guarded else sgd, _K
    )
    for g in _micro(nan_at):
        opt.zero_grad()
        (w * torch.from_numpy(g)).sum().backward()  # grad = g
        opt.step()
        assert bool(torch.isfinite(w).all())
    return w.detach().numpy(), opt


def _reference(nan_at, clip):
    """(clip +) SGD, unguarded, on the means of the windows without the NaN."""
    sgd = optax.sgd(0.1, momentum=0.9)
    tx = optax.chain(jtx.clip_by_global_norm(1.0), sgd) if clip else sgd
    params = jnp.zeros(3)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for w in range(_WINDOWS):
        if w * _K <= nan_at < (w + 1) * _K:
            continue
        u, state = update(jnp.asarray(_MICRO[w * _K : (w + 1) * _K].mean(0)), state)
        params = optax.apply_updates(params, u)
    return params


@pytest.mark.parametrize("guarded", [True, False])
@pytest.mark.parametrize("position", [0, _K - 1])
def test_a_nan_micro_batch_skips_its_window_once(guarded, position, tol):
    nan_at = _K + position  # in the second window, first or last micro-step
    params, state = _jax_run(guarded, nan_at)
    wparams, topt = _torch_run(guarded, nan_at)
    chex.assert_trees_all_close(params, _reference(nan_at, guarded), **tol("float32"))
    if guarded:
        assert int(jtx.find_skip_state(state).skipped_total) == 1
        assert topt.skip_state.skipped_total == 1
    np.testing.assert_allclose(wparams, np.asarray(params), **tol("float32"))
    # Window 1 skipped, windows 0 and 2 applied (an unguarded inner is
    # guarded by the transform, without counters); the window closed clean.
    assert int(state.mini_step) == 0 and bool(state.window_finite)
    assert topt.mini_step == 0


def test_the_accumulator_is_reset_by_a_select_and_stays_finite():
    tx, update = _TX[True], _UPDATE[True]
    params = jnp.zeros(3)
    state = tx.init(params)
    for g in _micro(1)[:_K]:  # one full window with a NaN at micro-step 1
        _, state = update(jnp.asarray(g), state, params)
        chex.assert_tree_all_finite(state.acc)
    chex.assert_trees_all_equal(state.acc, jnp.zeros(3))
    lowered = jax.jit(tx.update).lower(jnp.zeros(3), state, params)
    assert "stablehlo.case" not in lowered.as_text()
    assert "stablehlo.if" not in lowered.as_text()


@pytest.mark.parametrize("check_update", [True, False])
def test_finite_micro_gradients_whose_sum_overflows_skip_as_in_torch(check_update):
    """Two finite micro-gradients of 3e38 sum to inf (float32's max is
    3.4e38), as they do in torch's ``.grad``: the window's gradient is
    non-finite, so both skip it as a non-finite GRADIENT (torch's guard sees
    the inf mean). The accumulator never holds the inf; without the update
    check the NaN update was applied (the window's flag said finite)."""
    micro = [[3e38, 1.0], [3e38, 1.0], [1.0, 1.0]]
    inner = jtx.stable_optimizer(optax.sgd(1.0), check_update=check_update)
    tx = jtx.accumulate_gradients(inner, 3)
    params = jnp.zeros(2)
    state = tx.init(params)
    for g in micro:
        u, state = jax.jit(tx.update)(jnp.asarray(g), state, params)
        params = optax.apply_updates(params, u)
        chex.assert_tree_all_finite((params, state))
    w = torch.nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([w], lr=1.0)
    opt = ttx.accumulate_gradients(
        ttx.stable_optimizer(sgd, check_update=check_update), 3
    )
    for g in micro:
        opt.zero_grad()
        (w * torch.tensor(g)).sum().backward()  # grad = g
        opt.step()
    skip, tskip = jtx.find_skip_state(state), opt.skip_state
    assert (
        int(skip.skipped_total),
        int(skip.non_finite_updates),
        bool(skip.last_grads_finite),
    ) == (tskip.skipped_total, tskip.non_finite_updates, tskip.last_grads_finite)
    assert tskip.skipped_total == 1 and not tskip.last_grads_finite
    np.testing.assert_array_equal(np.asarray(params), w.detach().numpy())
    np.testing.assert_array_equal(np.asarray(params), [0.0, 0.0])


@pytest.mark.parametrize("placement", ["inside", "outside", "ours"])
def test_make_train_step_refuses_accumulating_optimizers(placement):
    adam = optax.adam(1e-2)
    tx = {
        "inside": optax.MultiSteps(jtx.stable_optimizer(adam), 4),
        "outside": jtx.stable_optimizer(optax.MultiSteps(adam, 4)),
        "ours": jtx.accumulate_gradients(jtx.stable_optimizer(adam), 4),
    }[placement]
    state = jtrain.TrainState.create(params=jnp.zeros(2), optimizer=tx)
    step = jtrain.make_train_step(lambda p, b: jnp.sum((p - b) ** 2), jit=False)
    with pytest.raises(ValueError, match=r"make_train_step\(loss_fn, microbatches=k\)"):
        step(state, jnp.ones(2))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="every_k must be an int >= 1"):
        jtx.accumulate_gradients(optax.sgd(0.1), 0)
    with pytest.raises(TypeError, match="every_k must be an int >= 1"):
        jtx.accumulate_gradients(optax.sgd(0.1), 2.0)
    with pytest.raises(TypeError, match=r"call it: optax\.sgd\(1e-3\)"):
        jtx.accumulate_gradients(optax.sgd, 2)
    w = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match="every_k must be an int >= 1"):
        ttx.accumulate_gradients(torch.optim.SGD([w], lr=0.1), 0)
    with pytest.raises(TypeError, match="construct it"):
        ttx.accumulate_gradients(torch.optim.SGD, 2)
