"""`UpdateBound`: where the update check is proved unable to fail, and where not.

The proof leaves the check's recompute pass out of `stable_optimizer`'s
step (`test_guard_cost` counts what that saves); here: which optimizers are
proved, that each refusal has its reason, that the interval rules hold at
their edges, and that proved optimizers stay finite under the worst
gradients a clip lets through (a check that could fail, not the proof).
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxstable import transforms
from jaxstable._src.update_bound import UpdateBound
from jaxstable._src.update_bound_rules import Unprovable, Val, primitive_rule

PARAMS = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}

PROVED = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.05),
    "adamw_warmup_cosine": lambda: optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100), weight_decay=0.1
    ),
    "sgd": lambda: optax.sgd(0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-4),
    "rmsprop": lambda: optax.rmsprop(1e-3),
}

# optimizer, the words its refusal names
REFUSED = {
    "adam_eps0": (lambda: optax.adam(1e-3, eps=0.0), "division"),
    "adam_bf16_moment": (lambda: optax.adam(1e-3, mu_dtype=jnp.bfloat16), "bfloat16"),
    "momentum_1": (lambda: optax.sgd(0.1, momentum=1.0), "no state bound"),
    "huge_lr": (lambda: optax.sgd(1e35), "safe range"),
    "decay_past_1": (lambda: optax.adamw(1.0, weight_decay=2000.0), "coefficient"),
    "lamb_param_norm": (lambda: optax.lamb(1e-3), "not affine"),
    "inject_hyperparams": (
        lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
        "inject_hyperparams",
    ),
    "adagrad_grows": (lambda: optax.adagrad(1e-2), "safe range"),
}


def _proof(tx, params=PARAMS, max_norm=1.0):
    bound = UpdateBound(tx, max_norm)
    return bound.proven(params, tx.init(params), params), bound.reason


@pytest.mark.parametrize("name", sorted(PROVED))
def test_the_usual_float32_optimizers_are_proved(name):
    assert _proof(PROVED[name]()) == (True, "")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_is_not_proved_says_why(name):
    make, words = REFUSED[name]
    proven, reason = _proof(make())
    assert not proven
    assert words in reason, reason


def test_complex_parameters_and_unbounded_clips_are_not_proved():
    p = {"w": jnp.zeros(3, jnp.complex64)}
    assert _proof(optax.sgd(0.1), params=p)[1] == "a complex leaf"
    assert "clip bound" in _proof(optax.sgd(0.1), max_norm=float("inf"))[1]
    bound = UpdateBound(optax.sgd(0.1), 1.0)
    assert not bound.proven(PARAMS, optax.sgd(0.1).init(PARAMS), None)


def _rule(prim, *vals, ins=None, dtype=jnp.float32, **params):
    eqn = types.SimpleNamespace(
        prim=prim,
        ins=ins or list(range(len(vals))),
        params=params,
        in_shapes=[(3,)] * len(vals),
        out_shapes=[(3,)],
    )
    return primitive_rule(eqn, list(vals), dtype)


def test_rules_refuse_a_divisor_or_root_that_may_reach_their_edge():
    with pytest.raises(Unprovable, match="division"):
        _rule("div", Val(b=(1.0, 1.0)), Val(b=(0.0, 2.0)))
    with pytest.raises(Unprovable, match="domain"):
        _rule("sqrt", Val(b=(-1e-9, 1.0)))
    with pytest.raises(Unprovable, match="domain"):
        _rule("log", Val(b=(0.0, 1.0)))
    assert _rule("sqrt", Val(b=(0.0, 4.0))).b[0] == 0.0  # sqrt(0) is fine


def test_rules_keep_a_square_non_negative_and_widen_for_rounding():
    x = Val(b=(-3.0, 2.0))
    assert _rule("mul", x, x, ins=[7, 7]).b[0] == 0.0  # the same value twice
    assert _rule("mul", x, x, ins=[7, 8]).b[0] < 0.0  # two values
    assert _rule("integer_pow", x, y=2).b == pytest.approx((0.0, 9.0), abs=1e-4)
    assert _rule("add", Val(b=(1.0, 1.0)), Val(b=(1.0, 1.0))).b[1] > 2.0


def test_rules_keep_a_parameter_only_where_its_elements_stay():
    p = Val(b=(0.0, 0.0), a=(1.0, 1.0), sym=0)
    assert _rule("mul", p, Val(b=(-0.5, 0.5))).a == (-0.5, 0.5)
    with pytest.raises(Unprovable, match="moved"):
        _rule("transpose", p, permutation=(0,))
    with pytest.raises(Unprovable, match="not affine"):
        _rule("sqrt", p)
    with pytest.raises(Unprovable, match="two parameters"):
        _rule("add", p, Val(b=(0.0, 0.0), a=(1.0, 1.0), sym=1))


def test_integer_rules_cover_bitwise_or_and_wrapping_sums():
    four, three = Val(b=(4, 4), kind="i"), Val(b=(3, 3), kind="i")
    lo, hi = _rule("or", four, three, dtype=jnp.int32).b
    assert lo <= 7 <= hi  # 4 | 3 is 7, past both inputs
    big = Val(b=(0, 2**30), kind="i")
    lo, hi = _rule("reduce_sum", big, axes=(0,), dtype=jnp.int32).b
    assert lo < 0  # three of 2**30 wrap past int32's max


def test_a_saturating_count_stays_in_its_dtype():
    # optax's count: where(c < max, c + 1, max). Without the select's
    # refinement c + 1 would wrap past int32's max and Adam's bias
    # correction 1 - b1**c could reach 0.
    tx = optax.scale_by_adam()
    assert _proof(tx) == (True, "")


def _worst_gradients(key, params, max_norm):
    """Clipped gradients at their extremes: all the norm on one element, an
    even spread, zeros, alternating signs."""
    k1, k2 = jax.random.split(key)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    n = sum(x.size for x in leaves)
    kind = int(jax.random.randint(k1, (), 0, 4))
    flat = [
        jnp.zeros(n).at[int(jax.random.randint(k2, (), 0, n))].set(max_norm),
        jnp.full(n, max_norm / np.sqrt(n)),
        jnp.zeros(n),
        jnp.where(jnp.arange(n) % 2 == 0, 1.0, -1.0) * max_norm / np.sqrt(n),
    ][kind]
    out, i = [], 0
    for x in leaves:
        out.append(flat[i : i + x.size].reshape(x.shape))
        i += x.size
    return jax.tree_util.tree_unflatten(treedef, out)


@pytest.mark.parametrize("name", ["adam", "adamw_warmup_cosine", "nesterov"])
def test_proved_optimizers_stay_finite_under_the_worst_clipped_gradients(name):
    tx = transforms.stable_optimizer(PROVED[name](), max_grad_norm=1.0)
    params = {"w": jnp.full((3, 4), 1e30), "b": jnp.full(4, -3e37)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for i in range(150):
        grads = _worst_gradients(jax.random.key(i), params, 1.0)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    leaves = jax.tree_util.tree_leaves((params, state))
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in leaves if x.dtype.kind == "f")
    assert int(transforms.find_skip_state(state).skipped_total) == 0


def test_outside_the_premise_nothing_non_finite_is_written():
    # A state no guarded step could reach (Adam's second moment set below 0
    # by hand): the proof's premise fails, the check is left out, and the
    # elementwise keep of the write still writes nothing that is not
    # finite (the NaN elements keep their old values).
    tx = transforms.stable_optimizer(optax.adam(1e-3), max_grad_norm=1.0)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    adam = state.inner_state[1][0]
    bad = adam._replace(nu={"w": jnp.array([-1.0, 0.0, 0.0])})
    state = state._replace(
        inner_state=(state.inner_state[0], (bad, *state.inner_state[1][1:]))
    )
    updates, state = jax.jit(tx.update)({"w": jnp.full(3, 0.1)}, state, params)
    new = optax.apply_updates(params, updates)
    assert bool(jnp.all(jnp.isfinite(new["w"])))
    assert float(new["w"][0]) == 1.0  # its update was NaN: kept
    assert float(new["w"][1]) != 1.0  # the others moved


def test_an_unproved_optimizer_keeps_the_check():
    # eps=0: Adam divides 0 by 0 where a gradient is 0. Not proved, so the
    # check runs and the step is skipped and counted, as without a clip.
    tx = transforms.stable_optimizer(optax.adam(1e-3, eps=0.0), max_grad_norm=1.0)
    params = jnp.ones(2)
    u, state = jax.jit(tx.update)(jnp.array([1.0, 0.0]), tx.init(params), params)
    assert u.tolist() == [0.0, 0.0]
    assert int(state.non_finite_updates) == 1


def test_an_eager_update_traces_the_optimizer_once(monkeypatch):
    # Outside jit every `tx.update` call runs the proof's trace: it is kept
    # per shapes and dtypes, so a loop of eager steps pays for it once.
    calls = []
    real = jax.make_jaxpr

    def counting(fn, *a, **k):
        calls.append(fn)
        return real(fn, *a, **k)

    monkeypatch.setattr(jax, "make_jaxpr", counting)
    tx = transforms.stable_optimizer(optax.adam(1e-3), max_grad_norm=1.0)
    params = jnp.ones(3)
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update(jnp.full(3, 0.1), state, params)
    assert len(calls) == 2  # init and update, once each
    _, state = tx.update(jnp.full(3, 0.1), state, params, value=jnp.zeros([]))
    assert len(calls) == 4  # new extra args: traced again
