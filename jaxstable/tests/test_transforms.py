"""Unit tests of jaxstable.transforms."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import has_conditional
from jaxstable import transforms

# Compile-bound: XLA with fewer optimisations (conftest.py; the same
# assertions pass either way, measured 2026-11-28).
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")


def _params():
    return {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}


def _grads(bad=False):
    g = {"w": jnp.full((3, 2), 0.5), "b": jnp.array([1.0, -1.0])}
    if bad:
        g["w"] = g["w"].at[0, 1].set(jnp.nan)
    return g


def test_global_norm_float32_accumulation(tol):
    # fp16 grads of 300: each square (9e4) overflows fp16's max 65504.
    g = {
        "a": jnp.full((64,), 300.0, jnp.float16),
        "b": jnp.full((2, 2), -1.5, jnp.bfloat16),
    }
    n = transforms.global_norm(g)
    assert n.dtype == jnp.float32
    np.testing.assert_allclose(
        float(n), np.sqrt(64 * 300.0**2 + 4 * 1.5**2), **tol("float32")
    )
    assert float(transforms.global_norm({})) == 0.0
    # 1000 bf16 ones: a bf16 running sum would stall at 256 (8-bit mantissa).
    assert float(transforms.global_norm(jnp.ones(1000, jnp.bfloat16))) == pytest.approx(
        np.sqrt(1000.0), rel=1e-6
    )


def test_clip_formula_and_dtypes(tol):
    tx = transforms.clip_by_global_norm(1.0, eps=1e-6)
    g = {"w": jnp.array([3.0, 4.0]), "h": jnp.array([0.0], jnp.float16)}
    out, state = tx.update(g, tx.init(g))
    assert state == optax.EmptyState()
    assert out["h"].dtype == jnp.float16
    np.testing.assert_allclose(
        out["w"], np.array([3.0, 4.0]) / (5.0 + 1e-6), **tol("float32")
    )
    small = {"w": jnp.array([0.3, 0.4])}
    out, _ = tx.update(small, tx.init(small))
    np.testing.assert_array_equal(out["w"], small["w"])  # coef clamped to 1


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_clip_rejects_bad_max_norm(bad):
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        transforms.clip_by_global_norm(bad)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        transforms.stable_optimizer(optax.sgd(0.1), max_grad_norm=bad)


def test_clip_rejects_bad_eps():
    with pytest.raises(ValueError, match="eps must be >= 0"):
        transforms.clip_by_global_norm(1.0, eps=-1.0)


def test_skip_counters_step_by_step():
    tx = transforms.skip_non_finite(optax.adam(0.1), max_consecutive=1)
    params = _params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    pattern = [False, True, True, False, True, False]  # True = poisoned
    expected = [  # skipped_total, consecutive, last_finite, exceeded
        (0, 0, True, False),
        (1, 1, False, False),
        (2, 2, False, True),
        (2, 0, True, False),
        (3, 1, False, False),
        (3, 0, True, False),
    ]
    for bad, exp in zip(pattern, expected, strict=True):
        before = state
        updates, state = update(_grads(bad), state, params)
        got = (
            int(state.skipped_total),
            int(state.consecutive),
            bool(state.last_finite),
            bool(state.exceeded),
        )
        assert got == exp
        if bad:
            # zero update, inner state (moments and count) exactly as before
            for u in jax.tree.leaves(updates):
                np.testing.assert_array_equal(u, jnp.zeros_like(u))
            jax.tree.map(
                np.testing.assert_array_equal, state.inner_state, before.inner_state
            )
        else:
            assert all(bool(jnp.all(u != 0)) for u in jax.tree.leaves(updates))
            params = optax.apply_updates(params, updates)
    assert int(state.inner_state[0].count) == 3  # only the finite steps counted
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))


def test_skip_reuses_the_given_flag():
    tx = transforms.skip_non_finite(optax.sgd(1.0))
    params = _params()
    # A flag of False skips even finite grads: the given flag is used...
    u, s = tx.update(_grads(), tx.init(params), params, grads_finite=jnp.asarray(False))
    assert int(s.skipped_total) == 1 and float(jnp.sum(jnp.abs(u["w"]))) == 0.0

    # ...and is not recomputed: one is_finite (on the gradients' scaled sum
    # of squares) only when absent; the update check adds one (on its sum of
    # ``leaf * 0`` over the 2 new params; sgd without momentum has no float
    # state).
    def count(flag, tx=tx):
        f = lambda g: tx.update(g, tx.init(params), params, **flag)  # noqa: E731
        return jax.jit(f).lower(_grads()).as_text().count("is_finite")

    given = {"grads_finite": jnp.asarray(True)}
    assert count(given) == 1
    assert count({}) == 1 + 1
    grads_only = transforms.skip_non_finite(optax.sgd(1.0), check_update=False)
    assert count(given, grads_only) == 0
    assert count({}, grads_only) == 1


def test_no_conditional_in_compiled_update():
    tx = transforms.stable_optimizer(
        optax.adamw(1e-3), max_grad_norm=1.0, max_consecutive=3
    )
    params = _params()
    lowered = jax.jit(tx.update).lower(_grads(), tx.init(params), params)
    assert not has_conditional(lowered)
    # The check does see a lax.cond.
    cond = jax.jit(lambda f, x: jax.lax.cond(f, jnp.sin, jnp.cos, x))
    assert has_conditional(cond.lower(jnp.asarray(True), jnp.ones(3)))


def test_stable_optimizer_structure_and_find_skip_state():
    params = _params()
    state = transforms.stable_optimizer(optax.sgd(0.1), max_grad_norm=1.0).init(params)
    assert isinstance(state, transforms.SkipNonFiniteState)
    assert isinstance(transforms.find_skip_state(state), transforms.SkipNonFiniteState)
    plain = transforms.stable_optimizer(optax.sgd(0.1), skip_non_finite=False)
    assert transforms.find_skip_state(plain.init(params)) is None
    nested = optax.chain(optax.scale(1.0), transforms.skip_non_finite(optax.sgd(0.1)))
    assert transforms.find_skip_state(nested.init(params)) is not None
    with pytest.raises(ValueError, match="skip_non_finite must be True or False"):
        transforms.stable_optimizer(optax.sgd(0.1), skip_non_finite="yes")
    with pytest.raises(ValueError, match="max_consecutive must be None or an int >= 0"):
        transforms.skip_non_finite(optax.sgd(0.1), max_consecutive=-1)
    with pytest.raises(ValueError, match="max_consecutive must be None or an int >= 0"):
        transforms.skip_non_finite(optax.sgd(0.1), max_consecutive=1.5)


def test_stable_optimizer_equals_manual_chain(tol):
    params = _params()
    g = {"w": jnp.full((3, 2), 4.0), "b": jnp.array([3.0, -2.0])}
    a = transforms.stable_optimizer(optax.adam(1e-2), max_grad_norm=0.5)
    b = optax.chain(transforms.clip_by_global_norm(0.5), optax.adam(1e-2))
    ua, _ = a.update(g, a.init(params), params)
    ub, _ = b.update(g, b.init(params), params)
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, **tol("float32")), ua, ub
    )


def test_composes_with_chain_and_extra_args():
    tx = optax.chain(
        transforms.clip_by_global_norm(1.0), transforms.skip_non_finite(optax.sgd(1.0))
    )
    params = _params()
    state = tx.init(params)
    u, state = jax.jit(tx.update)(
        _grads(True), state, params, grads_finite=jnp.asarray(False)
    )
    assert float(jnp.sum(jnp.abs(u["b"]))) == 0.0
    assert int(transforms.find_skip_state(state).skipped_total) == 1


def test_composes_with_multisteps():
    params = _params()
    # skip outside MultiSteps: a non-finite micro-batch never reaches the accumulator.
    tx = transforms.skip_non_finite(
        optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
    )
    state = tx.init(params)
    update = jax.jit(tx.update)
    u, state = update(_grads(), state, params)
    assert float(jnp.sum(jnp.abs(u["w"]))) == 0.0  # accumulating
    u, state = update(_grads(True), state, params)  # skipped: accumulator untouched
    assert int(state.skipped_total) == 1
    u, state = update(_grads(), state, params)  # second good micro-batch: apply
    np.testing.assert_allclose(u["w"], -_grads()["w"])
    # skip inside MultiSteps (the inner optimizer is guarded).
    ms = optax.MultiSteps(
        transforms.stable_optimizer(optax.sgd(1.0)), every_k_schedule=1
    )
    state = ms.init(params)
    u, state = jax.jit(ms.update)(_grads(), state, params)
    np.testing.assert_allclose(u["b"], -_grads()["b"])
    assert transforms.find_skip_state(state) is not None


def test_composes_with_inject_hyperparams(tol):
    params = _params()
    g = {"w": jnp.full((3, 2), 4.0), "b": jnp.array([3.0, -2.0])}
    norm = float(transforms.global_norm(g))
    clip = optax.inject_hyperparams(transforms.clip_by_global_norm)(max_norm=1.0)
    state = clip.init(params)
    update = jax.jit(clip.update)
    u, state = update(g, state, params)
    np.testing.assert_allclose(float(transforms.global_norm(u)), 1.0, **tol("float32"))
    state.hyperparams["max_norm"] = jnp.asarray(2.0)  # change it without re-jit
    u, state = update(g, state, params)
    np.testing.assert_allclose(float(transforms.global_norm(u)), 2.0, **tol("float32"))
    assert norm > 2.0

    opt = optax.inject_hyperparams(transforms.stable_optimizer)(
        optax.sgd(1.0), max_grad_norm=1.0
    )
    state = opt.init(params)
    u, state = jax.jit(opt.update)(_grads(True), state, params)
    assert int(transforms.find_skip_state(state).skipped_total) == 1
    assert float(jnp.sum(jnp.abs(u["w"]))) == 0.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: transforms.stable_optimizer(optax.sgd(0.1)),
        lambda: transforms.accumulate_gradients(optax.sgd(0.1), 1),
        lambda: transforms.skip_spikes(optax.sgd(0.1)),
    ],
    ids=["skip_non_finite", "accumulate_gradients", "skip_spikes"],
)
@pytest.mark.parametrize("shape", [(1,), (3,)])
def test_a_grads_finite_flag_that_is_not_a_scalar_is_refused(make, shape):
    # jnp.isfinite(loss) of a loss of shape (1,): the flag was broadcast, so a
    # scalar parameter's update and the counters came back with its shape.
    tx = make()
    params = {"s": jnp.ones(()), "v": jnp.ones(3)}
    flag = jnp.ones(shape, jnp.bool_)
    with pytest.raises(ValueError, match=r"grads_finite must be a boolean scalar"):
        tx.update(params, tx.init(params), params, grads_finite=flag)
    if isinstance(tx.init(params), transforms.SkipSpikesState):
        with pytest.raises(ValueError, match=r"value must be a scalar"):
            tx.update(params, tx.init(params), params, value=jnp.ones(shape))
