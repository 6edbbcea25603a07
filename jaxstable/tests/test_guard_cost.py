"""What the guard costs in the compiled update: XLA's cost analysis, no timing.

``skip_non_finite(chain(clip, adam))`` (clip, skip, update check:
"checked") and ``stable_optimizer(adam, max_grad_norm=1.0)`` (the same,
where `UpdateBound` proves the check cannot fail and leaves its pass out:
"guarded") against plain ``optax.adam``, each followed by
``apply_updates``, on two matrices and a vector. ``bytes accessed`` is
deterministic for a given XLA. The plain update reads g, m, v, p and writes
m, v, p in three fusions (10 param-sized accesses); the checked one adds
one read of the gradients (norm and finiteness in one reduction), one read
of g, m, v, p by the update check (recomputed, nothing written) and one
read of g where the kept update recomputes the moments: 16 in all,
measured 1.62x with the per-row sums. The check that materialised the new
values to test and then select them measured 2.84x here.

XLA:CPU only: the fusion decisions are the CPU compiler's (a GPU fuses
differently; `benchmarks/bench_gpu.py` measures it there).
"""

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxstable import transforms

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="XLA:CPU's fusion decisions"
)

_SHAPES = {"w1": (32, 64), "b1": (64,), "w2": (64, 64)}


def _apply(tx):
    def update(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


@pytest.fixture(scope="module")
def compiled():
    params = {k: jnp.full(s, 0.5) for k, s in _SHAPES.items()}
    grads = {k: jnp.full(s, 0.1) for k, s in _SHAPES.items()}
    clipped = optax.chain(transforms.clip_by_global_norm(1.0), optax.adam(1e-3))
    txs = {
        "plain": optax.adam(1e-3),
        "optax_clip": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        "checked": transforms.skip_non_finite(clipped),
        "guarded": transforms.stable_optimizer(optax.adam(1e-3), max_grad_norm=1.0),
    }
    return {
        name: jax.jit(_apply(tx)).lower(grads, tx.init(params), params).compile()
        for name, tx in txs.items()
    }


def _bytes(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["bytes accessed"])


def _written(compiled) -> list[int]:
    """Elements written by each top-level instruction of the compiled update
    (parameters, constants and bitcasts write nothing), sorted."""
    text = compiled.as_text()
    sizes = []
    for line in text[text.index("\nENTRY") :].splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* (\w[\w-]*)\(", line)
        if m and m[2] not in ("parameter", "constant", "bitcast"):
            sizes.append(int(np.prod([int(d) for d in m[1].split(",") if d])))
    return sorted(sizes)


def test_checked_update_accesses_at_most_1_65x_the_plain_bytes(compiled):
    ratio = _bytes(compiled["checked"]) / _bytes(compiled["plain"])
    assert ratio <= 1.65, ratio


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


def test_checked_update_computes_at_most_4_8x_the_plain_flops(compiled):
    # Plain Adam + apply_updates: 13 FLOPs per parameter. The guard adds the
    # norm and finiteness reduction, the update check's recomputation and
    # its product-with-0 (one multiply per leaf, `_finite_together`), the
    # clip recomputed as two scalar multiplies where each value is used
    # (`_clip_factors`), and one compare per written element: 61 per
    # parameter measured (81, 6.2x, with the clip's three multiplies and two
    # selects, a sum of ``leaf * 0`` and a separate test of the update).
    ratio = _flops(compiled["checked"]) / _flops(compiled["plain"])
    assert ratio <= 4.8, ratio


def test_the_guard_stores_no_array_beyond_the_new_values(compiled):
    # The same matrix-sized arrays written as by the plain update (the new
    # m, v, p), nothing else: the check recomputes the new values in a pass
    # that writes nothing, and no is_finite array is stored. (Vectors are
    # written: per-row sums, and the squares of the 1-D leaves.)
    smallest = min(int(np.prod(s)) for s in _SHAPES.values() if len(s) == 2)

    def big(c):
        return [n for n in _written(c) if n >= smallest]

    assert big(compiled["checked"]) == big(compiled["plain"])
    assert big(compiled["guarded"]) == big(compiled["plain"])


def test_one_fused_reduction_per_gradient_and_per_written_shape(compiled):
    # Each 2-D gradient is read by ONE two-operand reduction (the squares
    # and the 2**-90-scaled squares: its norm, and its finiteness from the
    # scaled sum), and the update check is one (sum, max) reduction per
    # shape written, w1 and w2 (each shared by the new params and Adam's two
    # moments; b1's 1-D values are summed directly). Each keeps its leading
    # axis: 32 and 64 rows, summed by one-operand reductions afterwards.
    text = compiled["checked"].as_text()
    two = re.findall(r"= \(f32\[(\d+)\]\S*, f32\[\d+\]\S*\) reduce\(", text)
    assert sorted(two, key=int) == ["32", "32", "64", "64"]
    # is_finite only ever tests a reduced scalar, never an array.
    assert not re.search(r"= pred\[\d[\d,]*\]\S* is-finite\(", text)


def test_a_proven_update_has_no_check_pass(compiled):
    # Adam in float32 after a clip is proved finite (`UpdateBound`): the
    # recompute pass is gone, and the step accesses fewer bytes than optax's
    # own clip + Adam (measured 301 kB against 390 kB; plain Adam 248 kB,
    # the checked update 403 kB). The elementwise keep of the selects stays
    # (7 FLOPs per parameter, no bytes).
    nbytes = {k: _bytes(c) for k, c in compiled.items()}
    assert nbytes["guarded"] <= 1.25 * nbytes["plain"], nbytes
    assert nbytes["guarded"] < nbytes["optax_clip"], nbytes
    assert nbytes["guarded"] < 0.8 * nbytes["checked"], nbytes
    assert _flops(compiled["guarded"]) < 0.7 * _flops(compiled["checked"])
    text = compiled["guarded"].as_text()
    two = re.findall(r"= \(f32\[(\d+)\]\S*, f32\[\d+\]\S*\) reduce\(", text)
    assert sorted(two, key=int) == ["32", "64"]


# The one-pass tests are exact, whatever the dtype: a sum of finite squares
# scaled by 2**-90 never overflows (2 x 4096 elements at float32's max here,
# whose plain sum of squares is inf), and ``x * 0`` is NaN only for inf/NaN.
_LIMITS = [
    (jnp.float16, 65504.0),
    (jnp.bfloat16, 3.3895e38),
    (jnp.float32, 3.4028235e38),
    (jnp.complex64, 3.4028235e38 * (1 + 1j)),
]


@pytest.mark.parametrize(("dtype", "big"), _LIMITS)
def test_one_pass_checks_are_exact_at_the_dtype_limits(dtype, big):
    from jaxstable import loss_scale

    tx = transforms.skip_non_finite(optax.sgd(0.0))

    @jax.jit
    def checks(tree):
        # The update check: sgd(0) writes params + 0, here the tree itself.
        zeros = jax.tree.map(jnp.zeros_like, tree)
        _, state = tx.update(zeros, tx.init(tree), tree, grads_finite=True)
        return loss_scale.all_finite(tree), state.last_finite

    for bad in (None, np.inf, -np.inf, np.nan):
        b = np.full(3, -big, dtype)
        if bad is not None:
            b[1] = complex(0, bad) if dtype == jnp.complex64 else bad
        tree = {"a": np.full((2, 4096), big, dtype), "b": b}
        assert [bool(f) for f in checks(tree)] == [bad is None] * 2, bad


class _State(NamedTuple):
    scalar: jax.Array  # 0-D
    extra: jax.Array  # the shape of a param, but no moment of it
    other: jax.Array  # a shape no param has
    z: jax.Array  # complex


def _odd_state_tx() -> optax.GradientTransformation:
    """sgd with a state of odd leaves; state leaf ``i`` becomes 1/0 = inf
    when ``grads["pick"] == i`` and ``grads["w"][0, 0] == 0``."""

    def init(params):
        del params
        return _State(
            jnp.ones([]), jnp.ones((3, 2)), jnp.ones(5), jnp.ones(2, jnp.complex64)
        )

    def update(grads, state, params=None):
        del params
        blow = 1.0 / grads["w"][0, 0]
        new = [
            leaf * jnp.where(grads["pick"] == i, blow, 1.0)
            for i, leaf in enumerate(state)
        ]
        return jax.tree.map(lambda g: -g, grads), _State(*new)

    return optax.GradientTransformation(init, update)


def test_every_state_leaf_is_checked_whatever_its_shape():
    tx = transforms.skip_non_finite(_odd_state_tx())
    params = {"w": np.ones((3, 2), np.float32), "pick": np.float32(0)}
    update, init = jax.jit(tx.update), tx.init(params)
    for i, name in enumerate(_State._fields):
        grads = {"w": np.zeros((3, 2), np.float32), "pick": np.float32(i)}
        u, state = update(grads, init, params)
        assert not bool(state.last_finite), name
        assert int(state.non_finite_updates) == 1, name
        assert all(not bool(jnp.any(x)) for x in jax.tree.leaves(u)), name
    # A non-zero gradient: every leaf finite, the update applied.
    grads = {"w": np.ones((3, 2), np.float32), "pick": np.float32(0)}
    u, state = update(grads, init, params)
    assert bool(state.last_finite) and float(u["w"][0, 0]) == -1.0


def test_the_write_keeps_no_non_finite_element_whatever_the_check_said():
    # The update check tests a recomputation of what the step writes; the
    # write itself also keeps the old value of any non-finite element, so the
    # invariant never rests on two compilations agreeing bitwise.
    from jaxstable._src.update_check import keep_finite, keep_finite_updates

    ok = jnp.ones([], jnp.bool_)
    new = {"m": jnp.array([1.0, jnp.inf, jnp.nan]), "count": jnp.array(3)}
    old = {"m": jnp.array([5.0, 6.0, 7.0]), "count": jnp.array(2)}
    out = jax.jit(keep_finite)(ok, new, old)
    assert out["m"].tolist() == [1.0, 6.0, 7.0] and int(out["count"]) == 3
    out = jax.jit(keep_finite)(~ok, new, old)
    assert out["m"].tolist() == [5.0, 6.0, 7.0] and int(out["count"]) == 2
    # an update whose parameter overflows in the params' dtype is zeroed
    params = {"w": jnp.array([0.0, 60000.0, 1.0], jnp.float16)}
    updates = {"w": jnp.array([1.0, 8000.0, jnp.nan], jnp.float16)}
    out = jax.jit(keep_finite_updates)(ok, updates, params)
    assert out["w"].tolist() == [1.0, 0.0, 0.0]
    z = jnp.array([1 + 1j, complex(jnp.inf, 0.0)], jnp.complex64)
    out = keep_finite(ok, z, jnp.zeros(2, jnp.complex64))
    assert out.tolist() == [1 + 1j, 0j]
