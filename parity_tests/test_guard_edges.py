"""The guards at their edges, in both frameworks (issue 22 items 2, 4, 5, 7).

Complex gradients are clipped by ``|z|**2`` with their imaginary part kept;
integer and empty leaves add nothing to a norm; finite gradients whose float32
sum of squares overflows (norm above 1.8e19) still get a finite norm and a
real clip (torch's own `clip_grad_norm_` returns inf and zeroes them); a loss
scale below 1 whose unscaling overflows finite scaled gradients is a
non-finite step in torch as in JAX; and a batch-norm statistic that the
forward made non-finite is not kept although the gradients were finite.
Every number is computed by both frameworks, nothing is injected.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from jaxstable import loss_scale as jls
from jaxstable import train as jtrain
from jaxstable import transforms as jtx
from torchref import loss_scale as tls
from torchref import train as ttrain
from torchref import transforms as ttx

# ------------------------------------------------------------------ complex
COMPLEX = np.array([0.3 + 0.4j, -0.1 + 0.2j], np.complex64)  # |g| = 0.548


@pytest.mark.parametrize("max_norm", [0.1, 1.0])
def test_complex_gradients_clip_by_their_modulus_in_both(max_norm, tol):
    ref = float(np.sqrt(np.sum(np.abs(COMPLEX.astype(np.complex128)) ** 2)))
    tx = jtx.clip_by_global_norm(max_norm)
    jclipped, _ = jax.jit(tx.update)(jnp.asarray(COMPLEX), tx.init(None))
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    p.grad = torch.from_numpy(COMPLEX.copy())
    np.testing.assert_allclose(float(jtx.global_norm(COMPLEX)), ref, **tol("float32"))
    np.testing.assert_allclose(float(ttx.global_norm(p.grad)), ref, **tol("float32"))
    tnorm = torch.nn.utils.clip_grad_norm_([p], max_norm)  # torch's own
    assert jclipped.dtype == jnp.complex64
    np.testing.assert_allclose(np.asarray(jclipped), p.grad.numpy(), **tol("float32"))
    assert float(tnorm) == pytest.approx(ref, rel=1e-6)
    if max_norm < ref:
        assert np.abs(np.asarray(jclipped)).max() < np.abs(COMPLEX).max()
    assert np.any(np.imag(np.asarray(jclipped)) != 0)


def test_stable_optimizer_keeps_the_imaginary_part_in_both(tol):
    jtxo = jtx.stable_optimizer(optax.sgd(1.0), max_grad_norm=0.1)
    zeros = jnp.zeros(2, jnp.complex64)
    ju, _ = jax.jit(jtxo.update)(jnp.asarray(COMPLEX), jtxo.init(zeros), zeros)
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    opt = ttx.stable_optimizer(torch.optim.SGD([w], lr=1.0), max_grad_norm=0.1)
    w.grad = torch.from_numpy(COMPLEX.copy())
    opt.step()
    expected = -COMPLEX * np.float32(0.1 / np.linalg.norm(COMPLEX))
    np.testing.assert_allclose(np.asarray(ju), expected, **tol("float32"))
    np.testing.assert_allclose(w.detach().numpy(), expected, **tol("float32"))


def test_complex_adam_state_overflow_is_skipped_in_both():
    # Finite complex gradients of 1e22 + 1e22j: Adam's second moment
    # (1 - b2) |g|**2 overflows float32. torch's update m / (sqrt(inf) + eps)
    # is 0, so only the complex state holds the inf; optax's nu is real.
    g = np.array([1e22 + 1e22j, 1.0 + 0j], np.complex64)
    tx = jtx.stable_optimizer(optax.adam(1e-3))
    params = jnp.ones(2, jnp.complex64)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(jnp.asarray(g), state, params)
    skip = jtx.find_skip_state(state)
    assert not bool(skip.last_finite) and bool(skip.last_grads_finite)
    np.testing.assert_array_equal(np.asarray(updates), np.zeros(2, np.complex64))
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
    opt = ttx.stable_optimizer(torch.optim.Adam([w], lr=1e-3))
    w.grad = torch.from_numpy(g.copy())
    opt.step()
    s = opt.skip_state
    assert (s.last_finite, s.last_grads_finite, s.non_finite_updates) == (
        False,
        True,
        1,
    )
    assert opt.state == {} and torch.equal(
        w.detach(), torch.ones(2, dtype=torch.complex64)
    )


# ------------------------------------------------- integer and empty leaves
def test_integer_and_empty_leaves_add_nothing_and_pass_through(tol):
    grads = {
        "w": np.array([3.0, 4.0], np.float32),
        "count": np.array([7, 100], np.int32),
        "mask": np.array([True, False]),
        "empty": np.zeros((0, 3), np.float32),
    }
    tx = jtx.clip_by_global_norm(1.0)
    jg = {k: jnp.asarray(v) for k, v in grads.items()}
    clipped, _ = tx.update(jg, tx.init(jg))
    assert float(jtx.global_norm(jg)) == 5.0
    np.testing.assert_array_equal(clipped["count"], grads["count"])
    np.testing.assert_array_equal(clipped["mask"], grads["mask"])
    assert clipped["empty"].shape == (0, 3)
    np.testing.assert_allclose(clipped["w"], [0.6, 0.8], **tol("float32"))
    assert bool(jls.all_finite(jg))
    tensors = [torch.from_numpy(v.copy()) for v in grads.values()]
    assert float(ttx.global_norm(tensors)) == 5.0
    assert tls.all_finite(tensors)
    w, e = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(0, 3))
    w.grad, e.grad = tensors[0], tensors[3]
    assert float(ttx.clip_by_global_norm(1.0)([w, e])) == 5.0
    np.testing.assert_allclose(w.grad.numpy(), [0.6, 0.8], **tol("float32"))


# ------------------------------------------------------ norm overflow (item 5)
# Finite float32 gradients whose squares overflow (1e20**2 = 1e40 > 3.4e38);
# with 2e38 the true clip coefficient (4e-39) is itself a float32 subnormal.
HUGE = {
    "a": np.array([1e20, -1e20], np.float32),
    "b": np.array([3.0, 0.0, 1e-3], np.float32),
    "c": np.array([2e38], np.float32),
}
HUGE_NORM = float(np.sqrt(sum(np.sum(np.float64(v) ** 2) for v in HUGE.values())))


def _torch_params(grads, dtype=torch.float32):
    params = []
    for _, g in sorted(grads.items()):
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=dtype))
        p.grad = torch.from_numpy(g.copy()).to(dtype)
        params.append(p)
    return params


def test_torch_clip_grad_norm_overflows_where_ours_does_not():
    # The reference itself: inf norm, every gradient multiplied by 0.
    params = _torch_params(HUGE)
    assert float(torch.nn.utils.clip_grad_norm_(params, 1.0)) == float("inf")
    assert all(float(p.grad.abs().max()) == 0.0 for p in params)


@pytest.mark.parametrize("max_norm", [1.0, 1e30])
def test_overflowing_norm_is_finite_and_clips_alike_in_both(max_norm, tol):
    jg = {k: jnp.asarray(v) for k, v in HUGE.items()}
    tx = jtx.clip_by_global_norm(max_norm)
    # Jitted: XLA must not fold the scaled clip's factors into a subnormal.
    jclipped, _ = jax.jit(tx.update)(jg, tx.init(jg))
    params = _torch_params(HUGE)
    tnorm = ttx.clip_by_global_norm(max_norm)(params)
    jnorm = float(jax.jit(jtx.global_norm)(jg))
    np.testing.assert_allclose(jnorm, HUGE_NORM, **tol("float32"))
    np.testing.assert_allclose(float(tnorm), HUGE_NORM, **tol("float32"))
    coef = min(max_norm / HUGE_NORM, 1.0)
    for (k, g), p in zip(sorted(HUGE.items()), params, strict=True):
        expected = np.float64(g) * coef
        np.testing.assert_allclose(np.asarray(jclipped[k]), expected, **tol("float32"))
        np.testing.assert_allclose(p.grad.numpy(), expected, **tol("float32"))
    if max_norm < HUGE_NORM:
        clipped_norm = float(jtx.global_norm(jclipped))
        np.testing.assert_allclose(clipped_norm, max_norm, **tol("float32"))


def test_overflowing_norm_steps_are_applied_alike_in_both_steps(tol):
    # The train steps: an Adam step from gradients of 1e20 moves the
    # parameters by a clipped update, the same in both frameworks (before:
    # a zero update was applied, recorded finite, Adam's count advanced).
    x = np.array([1e20, -1e20, 3.0], np.float32)
    tx = jtx.stable_optimizer(optax.sgd(0.5), max_grad_norm=1.0)
    state = jtrain.TrainState.create(params=jnp.zeros(3), optimizer=tx)
    step = jtrain.make_train_step(lambda p, b: jnp.sum(p * b))
    state, m = step(state, jnp.asarray(x))
    w = torch.nn.Parameter(torch.zeros(3))
    model = torch.nn.Module()
    model.w = w
    tstep = ttrain.TrainStep(
        model,
        torch.optim.SGD([w], lr=0.5),
        lambda mod, b: (mod.w * b).sum(),
        max_grad_norm=1.0,
    )
    tm = tstep(torch.from_numpy(x.copy()))
    expected = -0.5 * np.float64(x) / np.linalg.norm(np.float64(x))
    assert bool(m["finite"]) and tm["finite"]
    np.testing.assert_allclose(float(m["grad_norm"]), tm["grad_norm"], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state.params), expected, **tol("float32"))
    np.testing.assert_allclose(w.detach().numpy(), expected, **tol("float32"))


# --------------------------------------------------- loss scale below 1 (item 4)
def _jax_scale_below_one(check_update):
    tx = jtx.stable_optimizer(optax.sgd(1.0), check_update=check_update)
    ls = jls.DynamicLossScale(loss_scale=0.5, min_loss_scale=0.125)
    state = jtrain.TrainState.create(
        params=jnp.full(2, 1e-3), optimizer=tx, loss_scale=ls
    )
    step = jtrain.make_train_step(lambda p, b: jnp.sum(p * b) * 2.0)
    state, m = step(state, jnp.full(2, 2e38))
    return np.asarray(state.params), float(state.loss_scale.loss_scale), m


def _torch_scale_below_one(check_update):
    w = torch.nn.Parameter(torch.full((2,), 1e-3))
    model = torch.nn.Module()
    model.w = w
    step = ttrain.TrainStep(
        model,
        torch.optim.SGD([w], lr=1.0),
        lambda mod, b: (mod.w * b).sum() * 2.0,
        scaler=tls.DynamicLossScale(loss_scale=0.5, min_loss_scale=0.125),
        check_update=check_update,
    )
    m = step(torch.full((2,), 2e38))
    return w.detach().numpy(), step.scaler.get_scale(), m


@pytest.mark.parametrize("check_update", [False, True])
def test_scale_below_one_unscaled_overflow_is_a_non_finite_step_in_both(
    check_update,
):
    # Scaled by 0.5 the gradient is 2e38 (finite); unscaled it is 4e38 = inf.
    # GradScaler tests before it unscales: torch stepped to [-inf, -inf] with
    # finite=True, or (with the update check) undid it without backing off.
    jparams, jscale, jm = _jax_scale_below_one(check_update)
    tparams, tscale, tm = _torch_scale_below_one(check_update)
    np.testing.assert_array_equal(jparams, np.full(2, 1e-3, np.float32))
    np.testing.assert_array_equal(tparams, np.full(2, 1e-3, np.float32))
    assert not bool(jm["finite"]) and not bool(jm["grads_finite"])
    assert not tm["finite"] and not tm["grads_finite"]
    assert jscale == tscale == 0.25  # backed off once, in both


# --------------------------------------------- non-finite batch stats (item 7)
_BN_X = np.array([[1e20, 1.0], [-1e20, 2.0], [0.5, -1.0]], np.float32)


class _JaxBN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(2, kernel_init=nn.initializers.ones)(x)
        return nn.BatchNorm(use_running_average=False, momentum=0.9)(x)


def test_non_finite_running_var_is_not_kept_in_either_framework():
    # var(1e20, -1e20, .) = 1e40 overflows float32: running_var would be inf
    # although every gradient is finite (the normalised output is 0 there).
    model = _JaxBN()
    variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 2)))
    params, stats = variables["params"], {"batch_stats": variables["batch_stats"]}

    def loss_fn(p, ms, x):
        out, new = model.apply({"params": p, **ms}, x, mutable=["batch_stats"])
        return jnp.mean(out**2), new

    state = jtrain.TrainState.create(
        params=params, optimizer=jtx.stable_optimizer(optax.sgd(0.1)), model_state=stats
    )
    new, m = jtrain.make_train_step(loss_fn, has_state=True)(state, jnp.asarray(_BN_X))
    assert bool(m["finite"])
    jax.tree.map(np.testing.assert_array_equal, new.model_state, state.model_state)

    torch.manual_seed(0)
    tmodel = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    tmodel[1].momentum = 0.1  # torch's momentum is 1 - flax's
    before = [b.clone() for b in tmodel.buffers()]
    weights = [p.detach().clone() for p in tmodel.parameters()]
    tstep = ttrain.TrainStep(
        tmodel,
        torch.optim.SGD(tmodel.parameters(), lr=0.1),
        lambda mod, x: mod(x).pow(2).mean(),
    )
    tm = tstep(torch.from_numpy(_BN_X.copy()))
    assert tm["finite"]
    for b, old in zip(tmodel.buffers(), before, strict=True):
        assert torch.equal(b, old)
    # The step itself was applied: the parameters moved.
    assert any(
        not torch.equal(p.detach(), w)
        for p, w in zip(tmodel.parameters(), weights, strict=True)
    )


# ------------------------------------------------------- a flag per element
_PER_ELEMENT = (
    r"grads_finite must be a boolean scalar \(one flag for the whole step\), "
    r"got shape \(3,\)"
)


@pytest.mark.parametrize("spikes", [False, True], ids=["skip", "skip_spikes"])
def test_a_grads_finite_flag_per_element_is_refused_alike_in_both(spikes):
    # A (3,)-shaped flag was applied element by element by the select: torch
    # stepped w[0] and w[2] only and counted the step as applied; JAX gave
    # the params its shape. (JAX's skip_spikes and accumulate_gradients:
    # jaxstable/tests/test_transforms.py, the same texts.)
    flag = np.array([True, False, True])
    if not spikes:
        tx = jtx.skip_non_finite(optax.sgd(0.1))
        params = jnp.ones(3)
        with pytest.raises(ValueError, match=_PER_ELEMENT):
            tx.update(params, tx.init(params), params, grads_finite=jnp.asarray(flag))
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    sgd = torch.optim.SGD([w], lr=0.1)
    opt = ttx.skip_spikes(sgd) if spikes else ttx.skip_non_finite(sgd)
    with pytest.raises(ValueError, match=_PER_ELEMENT):
        opt.step(grads_finite=torch.from_numpy(flag))
    assert w.tolist() == [1.0, 1.0, 1.0]
    if spikes:  # the loss too: one value per step
        msg = r"value must be a scalar \(the step's loss\), got shape \(3,\)"
        with pytest.raises(ValueError, match=msg):
            opt.step(value=torch.ones(3))
