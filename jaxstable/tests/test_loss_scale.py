"""Unit tests of jaxstable.loss_scale."""

import pickle

import chex
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from flax import serialization

from conftest import has_conditional
from jaxstable import loss_scale as jls

# Compile-bound: XLA with fewer optimisations (conftest.py; the same
# assertions pass either way, measured 2026-11-28).
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")

_NON_DEFAULT = dict(
    loss_scale=1024.0,
    counter=3,
    period=7,
    min_loss_scale=0.25,
    hysteresis=2,
    non_finite_counter=1,
    # Not float32 numbers: the float64 digits must survive too.
    growth_factor=1.1,
    backoff_factor=0.3,
)


def _assert_fields(ls, expected):
    for name, value in expected.items():
        got = getattr(ls, name)
        assert np.asarray(got).item() == value, name
    assert ls.loss_scale.dtype == jnp.float32
    assert ls.min_loss_scale.dtype == jnp.float32
    assert ls.counter.dtype == jnp.int32
    assert ls.non_finite_counter.dtype == jnp.int32
    assert isinstance(ls.period, int) and isinstance(ls.hysteresis, int)
    assert ls.factor == ls.growth_factor  # jmp's name reads the growth factor
    assert type(ls.growth_factor) is float and type(ls.backoff_factor) is float


def test_defaults_equal_grad_scaler():
    ls = jls.DynamicLossScale()
    _assert_fields(
        ls,
        dict(loss_scale=2.0**16, counter=0, period=2000, factor=2, min_loss_scale=1.0),
    )
    assert (ls.hysteresis, ls.growth_factor, ls.backoff_factor) == (1, 2.0, 0.5)
    # jmp's single factor: grow by it, back off by its reciprocal.
    jmp_style = jls.DynamicLossScale(2.0**15, 0, 100, 4.0)
    assert (jmp_style.growth_factor, jmp_style.backoff_factor) == (4.0, 0.25)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(factor=1), "factor must be a finite number > 1"),
        (dict(factor=0.5), "factor must be a finite number > 1"),
        (dict(period=0), "period must be an int >= 1"),
        (dict(period=2.5), "period must be an int >= 1"),
        (dict(loss_scale=0.0), "loss_scale must be a finite number > 0"),
        (dict(loss_scale=-1.0), "loss_scale must be a finite number > 0"),
        (dict(loss_scale=float("inf")), "loss_scale must be a finite number > 0"),
        (dict(min_loss_scale=0.0), "min_loss_scale must be a finite number > 0"),
        (dict(hysteresis=0), "hysteresis must be an int >= 1"),
    ],
)
def test_invalid_arguments_name_the_valid_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jls.DynamicLossScale(**kwargs)


def test_static_invalid():
    with pytest.raises(ValueError, match="loss_scale must be a finite number > 0"):
        jls.StaticLossScale(0.0)


def test_every_field_survives_jit_tree_map_and_checkpoints():
    ls = jls.DynamicLossScale(**_NON_DEFAULT)
    _assert_fields(ls, _NON_DEFAULT)
    # jit: as an argument and as a return value.
    _assert_fields(jax.jit(lambda x: x)(ls), _NON_DEFAULT)
    # tree.map (identity and a copy).
    _assert_fields(jax.tree.map(lambda x: x, ls), _NON_DEFAULT)
    _assert_fields(jax.tree.map(jnp.copy, ls), _NON_DEFAULT)
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    _assert_fields(jax.tree_util.tree_unflatten(treedef, leaves), _NON_DEFAULT)
    # flax state dict into a default target, and msgpack bytes.
    target = jls.DynamicLossScale()
    state = serialization.to_state_dict(ls)
    _assert_fields(serialization.from_state_dict(target, state), _NON_DEFAULT)
    raw = serialization.to_bytes(ls)
    _assert_fields(serialization.from_bytes(target, raw), _NON_DEFAULT)
    # A state dict written before the two factors holds jmp's single factor.
    old = {k: v for k, v in state.items() if not k.endswith("_factor")}
    old["factor"] = np.float32(4.0)
    restored = serialization.from_state_dict(target, old)
    assert (restored.growth_factor, restored.backoff_factor) == (4.0, 0.25)
    # pickle.
    _assert_fields(pickle.loads(pickle.dumps(ls)), _NON_DEFAULT)
    # Static scale too.
    st = serialization.from_bytes(
        jls.StaticLossScale(1.0), serialization.to_bytes(jls.StaticLossScale(8.0))
    )
    assert float(st.loss_scale) == 8.0
    assert float(jax.jit(lambda x: x)(jls.StaticLossScale(8.0)).loss_scale) == 8.0


def test_min_loss_scale_survives_where_jmp_forgets_it():
    # jmp 0.0.4 rebuilds DynamicLossScale from (loss_scale, counter) and
    # (period, factor) only, so min_loss_scale is reset by any jit boundary.
    ours = jax.jit(lambda x: x)(jls.DynamicLossScale(min_loss_scale=0.25))
    assert float(ours.min_loss_scale) == 0.25
    # A jmp-style loop sees the floor: many non-finite steps stop at 0.25.
    ls = jls.DynamicLossScale(loss_scale=4.0, min_loss_scale=0.25)
    step = jax.jit(lambda ls: ls.adjust(jnp.asarray(False)))
    for _ in range(10):
        ls = step(ls)
    assert float(ls.loss_scale) == 0.25


def test_adjust_growth_backoff_and_counter():
    ls = jls.DynamicLossScale(loss_scale=8.0, period=3, factor=2)
    seq = [True, True, True, True, False, True, True, True]
    expected = [(8, 1), (8, 2), (16, 0), (16, 1), (8, 0), (8, 1), (8, 2), (16, 0)]
    adjust = jax.jit(lambda ls, f: ls.adjust(f))
    for ok, (scale, counter) in zip(seq, expected, strict=True):
        ls = adjust(ls, jnp.asarray(ok))
        assert (float(ls.loss_scale), int(ls.counter)) == (scale, counter)


def test_hysteresis_backs_off_after_n_in_a_row():
    ls = jls.DynamicLossScale(loss_scale=64.0, period=100, hysteresis=3)
    seq = [False, False, True, False, False, False, False, True, False]
    expected = [64, 64, 64, 64, 64, 32, 16, 16, 16]
    adjust = jax.jit(lambda ls, f: ls.adjust(f))
    got = []
    for ok in seq:
        ls = adjust(ls, jnp.asarray(ok))
        got.append(float(ls.loss_scale))
    assert got == expected
    assert int(ls.non_finite_counter) == 1


def test_adjust_has_no_conditional_and_rejects_non_scalar():
    ls = jls.DynamicLossScale()
    assert not has_conditional(
        jax.jit(lambda ls, f: ls.adjust(f)).lower(ls, jnp.asarray(True))
    )
    # The check does see a lax.cond.
    cond = jax.jit(lambda f, x: jax.lax.cond(f, jnp.sin, jnp.cos, x))
    assert has_conditional(cond.lower(jnp.asarray(True), jnp.ones(3)))
    with pytest.raises(ValueError, match="boolean scalar"):
        ls.adjust(jnp.array([True, False]))


def test_noop_and_static():
    noop = jls.NoOpLossScale()
    assert noop.loss_scale.dtype == jnp.float32 and float(noop.loss_scale) == 1.0
    tree = {"a": jnp.ones(2)}
    assert noop.scale(tree) is tree and noop.unscale(tree) is tree
    assert noop.adjust(jnp.asarray(False)) is noop
    assert jax.tree_util.tree_leaves(noop) == []
    st = jls.StaticLossScale(4.0)
    assert st.adjust(jnp.asarray(False)) is st
    np.testing.assert_array_equal(
        st.unscale(st.scale(jnp.arange(3.0))), jnp.arange(3.0)
    )


def test_scale_keeps_leaf_dtypes_and_skips_integers():
    ls = jls.DynamicLossScale(loss_scale=2.0**10)
    tree = {
        "h": jnp.ones(3, jnp.float16),
        "b": jnp.ones(3, jnp.bfloat16),
        "i": jnp.arange(3),
    }
    out = ls.scale(tree)
    assert {k: v.dtype for k, v in out.items()} == {k: v.dtype for k, v in tree.items()}
    assert float(out["h"][0]) == 1024.0
    np.testing.assert_array_equal(out["i"], tree["i"])
    back = ls.unscale(out)
    assert float(back["b"][0]) == 1.0


def test_jmp_style_loop_accepts_our_loss_scale():
    # The loop from jmp's README, with jmp's own helpers, under jit.
    @jax.jit
    def step(ls, w, x):
        grads = jax.grad(lambda w: ls.scale(jnp.sum(w * x)))(w)
        grads = ls.unscale(grads)
        finite = jmp.all_finite(grads)
        w = jmp.select_tree(finite, w - 0.1 * grads, w)
        return ls.adjust(finite), w

    ls = jls.DynamicLossScale(loss_scale=2.0**15, period=1)
    ls, w = step(ls, jnp.ones(2), jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(w, [0.9, 0.8])
    assert float(ls.loss_scale) == 2.0**16
    ls, w2 = step(ls, w, jnp.array([jnp.nan, 2.0]))
    np.testing.assert_array_equal(w2, w)
    assert float(ls.loss_scale) == 2.0**15


def test_all_finite():
    assert bool(jls.all_finite({}))
    assert bool(
        jls.all_finite({"h": jnp.full(8, 60000.0, jnp.float16), "i": jnp.arange(3)})
    )
    assert not bool(jls.all_finite([jnp.ones(2), jnp.array([1.0, jnp.inf])]))
    assert not bool(jls.all_finite([jnp.array([jnp.nan], jnp.bfloat16)]))
    out = jax.jit(jls.all_finite)([jnp.ones(2)])
    assert out.dtype == jnp.bool_ and out.shape == ()


def test_scaled_value_and_grad_unscales_and_flags():
    def loss(w, x):
        return jnp.sum((w * x) ** 2), {"n": jnp.sum(x)}

    g = jax.jit(jls.scaled_value_and_grad(loss, has_aux=True))
    w, x = jnp.array([1.0, -2.0]), jnp.array([3.0, 0.5])
    ls = jls.DynamicLossScale(loss_scale=2.0**12)
    (value, aux), grads, finite = g(ls, w, x)
    ref_value, ref_grads = jax.value_and_grad(lambda w: loss(w, x)[0])(w)
    assert float(value) == float(ref_value) and float(aux["n"]) == 3.5
    np.testing.assert_array_equal(grads, ref_grads)  # powers of two: exact
    assert bool(finite)
    _, bad_grads, finite = g(ls, w, jnp.array([jnp.nan, 1.0]))
    assert not bool(finite) and not bool(jnp.all(jnp.isfinite(bad_grads)))


def test_scaling_rescues_float16_gradients_that_underflow():
    # d/dw of sum(w16 * 1e-4 * 1e-4) is 1e-8 in float16: below fp16's smallest
    # subnormal 6e-8, so it flushes to 0 unscaled; times 2**16 it survives.
    def loss(w):
        return jnp.sum(
            w.astype(jnp.float16) * jnp.float16(1e-4) * jnp.float16(1e-4)
        ).astype(jnp.float32)

    w = jnp.ones(4)
    _, plain, _ = jls.scaled_value_and_grad(loss)(jls.NoOpLossScale(), w)
    # 2**12, not 2**16: the cotangent of the float16 loss is the scale itself,
    # and 65536 overflows fp16's max 65504 (GradScaler would back off once).
    _, scaled, ok = jls.scaled_value_and_grad(loss)(jls.StaticLossScale(2.0**12), w)
    assert float(jnp.max(jnp.abs(plain))) == 0.0
    assert bool(ok)
    np.testing.assert_allclose(scaled, np.full(4, 1e-8), rtol=0.05)


def test_scaled_value_and_grad_no_retrace():
    g = jax.jit(
        chex.assert_max_traces(jls.scaled_value_and_grad(lambda w: jnp.sum(w**2)), n=1)
    )
    ls = jls.DynamicLossScale()
    for i in range(3):
        _, _, ok = g(ls, jnp.full(3, float(i)))
        ls = ls.adjust(ok)


# The same (kwargs, message) table is in torchref/tests/test_loss_scale.py.
OUT_OF_RANGE = [
    (
        dict(counter=5, period=5),
        "counter must be an int with 0 <= counter < period=5, got 5",
    ),
    (
        dict(counter=-1),
        "counter must be an int with 0 <= counter < period=2000, got -1",
    ),
    (
        dict(counter=1.5),
        "counter must be an int with 0 <= counter < period=2000, got 1.5",
    ),
    (
        dict(loss_scale=1.0, min_loss_scale=2.0),
        "min_loss_scale=2.0 must be <= loss_scale=1.0",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), OUT_OF_RANGE)
def test_out_of_range_counter_and_floor_are_rejected(kwargs, message):
    with pytest.raises(ValueError) as info:
        jls.DynamicLossScale(**kwargs)
    assert str(info.value) == message


def test_traced_fields_are_not_validated():
    # Only concrete values are checked: under jit the fields are tracers.
    @jax.jit
    def make(scale, counter):
        ls = jls.DynamicLossScale(loss_scale=scale, counter=counter, period=4)
        return ls.adjust(jnp.asarray(True)).loss_scale

    assert float(make(2.0, 3)) == 4.0


def test_loss_scales_are_hashable_and_compare_by_identity():
    dyn, static, noop = (
        jls.DynamicLossScale(),
        jls.StaticLossScale(),
        jls.NoOpLossScale(),
    )
    assert len({dyn, static, noop}) == 3  # hash() works (fields are arrays)
    assert dyn == dyn and dyn != jls.DynamicLossScale()  # identity, never elementwise
    assert noop == jls.NoOpLossScale()  # no fields: all NoOps are equal

    @jax.jit
    def same(ls):
        return jnp.asarray(ls == ls)  # no traced comparison of the fields

    assert bool(same(dyn))


def test_div_rn_rounds_like_ieee_division_where_the_gpu_does_not():
    # XLA:GPU divides float32 with div.full (<= 2 ulp); the loss scale's
    # divisions go through the integer long division instead, on every
    # backend, so checking it here on CPU checks the code the GPU runs.
    from jaxstable._src.loss_scale_math import _div_rn

    rng = np.random.default_rng(0)
    n = 200_000
    a = (rng.random(n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    b = (rng.random(n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    a[::7] *= -1
    a[:3], b[:3] = (1.0, 1000.3, 12345.678), (1000.3, 3.0, 1.5)
    got = np.asarray(jax.jit(_div_rn)(a, b))
    want = a / b
    normal = np.abs(want) >= np.finfo(np.float32).tiny
    assert normal.mean() > 0.9
    np.testing.assert_array_equal(
        got[normal].view(np.uint32), want[normal].view(np.uint32)
    )
    # Outside the normal range it is the plain division (inf, nan, zero).
    edge = np.float32([1.0, 0.0, np.inf, 3e38]), np.float32([0.0, 2.0, 2.0, 1e-3])
    np.testing.assert_array_equal(np.asarray(_div_rn(*edge)), edge[0] / edge[1])


def test_every_field_survives_an_orbax_checkpoint(tmp_path):
    import optax

    from jaxstable import train

    def state(ls):
        return train.TrainState.create(
            params=jnp.zeros(2), optimizer=optax.sgd(0.1), loss_scale=ls
        )

    train.save_checkpoint(tmp_path / "c", state(jls.DynamicLossScale(**_NON_DEFAULT)))
    restored = train.load_checkpoint(tmp_path / "c", state(jls.DynamicLossScale()))
    _assert_fields(restored.loss_scale, _NON_DEFAULT)


def test_mul_f64_is_torchs_float64_product_rounded_to_float32():
    # float32(float64(x) * g): the product rounded to float64, then to
    # float32 (what _amp_update_scale_ computes), on random pairs and on
    # pairs built so that the float64 product is exactly a float32 rounding
    # midpoint (where a single rounding of the exact product would differ).
    from jaxstable._src.loss_scale_math import float64_limbs as _float64_limbs
    from jaxstable._src.loss_scale_math import mul_f64 as _mul_f64

    rng = np.random.default_rng(0)
    n = 20_000
    x = (1 + rng.random(n)) * 2.0 ** rng.integers(-100, 100, n)
    g = np.concatenate([1 + rng.random(n // 2) * 3, rng.random(n // 2)])
    mids = (rng.integers(2**23, 2**24, 512) + 0.5) * 2.0**-23
    xs = (1 + rng.random(512)).astype(np.float32)
    x = np.concatenate([x.astype(np.float32), xs])
    g = np.concatenate([g, mids / xs.astype(np.float64)])
    on_midpoint = x[n:].astype(np.float64) * g[n:] == mids
    assert on_midpoint.sum() > 100
    limbs, exps = zip(*(_float64_limbs(float(v)) for v in g), strict=True)
    limbs = tuple(np.array(limbs, np.uint32).T)
    got = np.asarray(jax.jit(_mul_f64)(x, limbs, np.array(exps, np.int32)))
    want = (x.astype(np.float64) * g).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # Out of float32's range: inf above, 0 below its smallest normal.
    big = _mul_f64(np.float32(3e38), *_float64_limbs(2.0))
    small = _mul_f64(np.float32(2.0**-125), *_float64_limbs(0.25))
    assert np.isinf(big) and float(small) == 0.0
