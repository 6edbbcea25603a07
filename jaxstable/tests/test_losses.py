"""Unit tests of jaxstable.losses (JAX only; parity with torch is in parity_tests)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstable import losses

# Compile-bound: XLA with fewer optimisations (conftest.py; the same
# assertions pass either way, measured 2026-11-28).
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")

DTYPES = ["float32", "bfloat16", "float16"]


def _ce_inputs(shape=(8, 16, 16), n_classes=19, dtype="bfloat16", seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(*shape, n_classes)) * 3).astype(dtype)
    y = rng.integers(0, n_classes, size=shape)
    y[rng.random(shape) < 0.1] = 255
    return x, jnp.asarray(y, jnp.int32)


def _np_ce(x, y, ignore=255):
    x = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    y = np.asarray(y)
    valid = y != ignore
    ys = np.where(valid, y, 0)
    m = x.max(-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(x - m).sum(-1))
    per = lse - np.take_along_axis(x, ys[..., None], -1)[..., 0]
    return np.where(valid, per, 0.0), valid


@pytest.mark.parametrize("dtype", DTYPES)
def test_ce_matches_float64_reference_and_returns_float32(dtype, tol):
    x, y = _ce_inputs((4, 8), 7, dtype)
    per, valid = _np_ce(x, y)
    out = losses.softmax_cross_entropy(x, y, ignore_index=255, reduction="none")
    mean = losses.softmax_cross_entropy(x, y, ignore_index=255)
    assert out.dtype == mean.dtype == jnp.float32
    np.testing.assert_allclose(out, per, **tol("float32"))
    np.testing.assert_allclose(float(mean), per.sum() / valid.sum(), **tol("float32"))
    g = jax.grad(lambda v: losses.softmax_cross_entropy(v, y, ignore_index=255))(x)
    assert g.dtype == jnp.dtype(dtype)


@pytest.mark.parametrize(
    "shape,n_classes,dtype,smoothing",
    [
        ((8, 32, 32), 19, "bfloat16", 0.0),
        ((8, 32, 32), 19, "float16", 0.1),
        ((512,), 1000, "bfloat16", 0.1),
        ((512,), 1000, "float16", 0.0),
        # long rows that do not tile into the two-stage chunks (remainders)
        ((512,), 1001, "bfloat16", 0.1),
        ((512,), 1009, "float16", 0.1),
    ],
)
def test_ce_compiled_temp_memory_below_a_float32_copy(
    shape, n_classes, dtype, smoothing
):
    """fwd+bwd under jit never stores a float32 copy of bf16/fp16 logits
    (compile-time property: XLA's buffer assignment, not a timing)."""
    x, y = _ce_inputs(shape, n_classes, dtype)
    f32_copy = x.size * 4

    def loss(v, lab):
        return losses.softmax_cross_entropy(
            v, lab, ignore_index=255, label_smoothing=smoothing
        )

    for transform in (jax.value_and_grad, jax.grad):
        compiled = jax.jit(transform(loss)).lower(x, y).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp < f32_copy / 2, (transform.__name__, temp, f32_copy)


def _np_ce_weighted(x, y, w, smoothing, ignore=255):
    """float64 per-element loss and d(sum of losses)/dx (the docstring maths)."""
    x = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    y, w = np.asarray(y), np.asarray(w, np.float64)
    n_classes = x.shape[-1]
    valid = y != ignore
    ys = np.where(valid, y, 0)
    m = x.max(-1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(-1, keepdims=True))
    w_y = w[ys][..., None]
    per = (1 - smoothing) * w_y[..., 0] * (
        lse[..., 0] - np.take_along_axis(x, ys[..., None], -1)[..., 0]
    ) + smoothing / n_classes * ((lse - x) * w).sum(-1)
    p = np.exp(x - lse)
    onehot = np.arange(n_classes) == ys[..., None]
    grad = (
        p * ((1 - smoothing) * w_y + smoothing * w.sum() / n_classes)
        - (1 - smoothing) * w_y * onehot
        - smoothing * w / n_classes
    )
    return np.where(valid, per, 0.0), np.where(valid[..., None], grad, 0.0)


@pytest.mark.parametrize("n_classes", [33, 150, 1000, 1009])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ce_long_rows_weighted_smoothed_match_float64(n_classes, dtype, tol):
    """Rows > 32 classes take the two-stage (chunked) reductions: whole chunks,
    a remainder (33, 150, 1009) and no exact tiling of the max (prime 1009).
    A 3000 logit (exp overflows if the row max misses it) sits in the first
    chunk, the middle and the last class (in the remainder when there is one)."""
    x, y = _ce_inputs((12,), n_classes, dtype, seed=3)
    x = x.at[0, 0].set(3000.0).at[1, -1].set(3000.0).at[2, n_classes // 2].set(3000.0)
    y = y.at[1].set(n_classes - 1)
    w = jnp.asarray(np.random.default_rng(4).uniform(0.2, 3.0, n_classes), jnp.float32)

    def loss(v, reduction):
        return losses.softmax_cross_entropy(
            v, y, ignore_index=255, label_smoothing=0.1, weights=w, reduction=reduction
        )

    per, grad = _np_ce_weighted(x, y, w, 0.1)
    np.testing.assert_allclose(
        jax.jit(loss, static_argnums=1)(x, "none"), per, **tol("float32")
    )
    g = jax.jit(jax.grad(loss), static_argnums=1)(x, "sum")
    assert g.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(g, np.float64), grad, **tol(dtype))


def test_ce_naive_upcast_does_store_a_float32_copy():
    """The check above can fail: the obvious upcast-then-log-softmax does."""
    x, y = _ce_inputs((8, 32, 32), 19, "bfloat16")

    def naive(v, lab):
        logp = jax.nn.log_softmax(v.astype(jnp.float32), -1)
        return -jnp.mean(jnp.take_along_axis(logp, lab[..., None] % 19, -1))

    compiled = jax.jit(jax.value_and_grad(naive)).lower(x, y).compile()
    assert compiled.memory_analysis().temp_size_in_bytes >= x.size * 4


def _hlo_shapes(hlo: str) -> dict[str, tuple[int, ...]]:
    """Instruction name -> array shape (tuple-shaped instructions left out)."""
    found = re.findall(r"%([\w.-]+) = \w+\[([\d,]*)\]", hlo)
    return {name: tuple(int(d) for d in dims.split(",") if d) for name, dims in found}


@pytest.mark.parametrize("n_classes", [80, 150, 1000])
def test_ce_compiled_sums_vectorise_and_grad_stores_as_uint16(n_classes):
    """The CPU speed of the long-row CE, as properties of the compiled program
    (jaxstable/_src/losses/cross_entropy.py, `_sum_pieces` and `_to_bfloat16`):
    the variadic sums reduce (rows, k <= 20, lanes) over k (a loop LLVM
    unrolls) into lane sums whose count is a multiple of 8 (one <8 x float>
    per 8 neighbouring classes), then the lanes; the bf16 gradient is
    written as uint16 bits, never by a logits-shaped float32 -> bf16
    convert (stored lane by lane on XLA:CPU).
    Before: C = 150 summed 7 chunks of 20 (scalar code, 2.8x optax's time)."""
    x, y = _ce_inputs((64,), n_classes, "bfloat16")

    def loss(v, lab):
        return losses.softmax_cross_entropy(v, lab, ignore_index=255)

    hlo = jax.jit(jax.value_and_grad(loss)).lower(x, y).compile().as_text()
    shapes = _hlo_shapes(hlo)
    sums = re.findall(
        r"= \((f32\[[\d,]*\])[^=]*\) reduce\(%([\w.-]+),.*?dimensions=\{(\d+)\}", hlo
    )
    assert sums, hlo
    assert any(len(shapes[operand]) == 3 for _, operand, _ in sums), hlo
    for out, operand, dim in sums:
        reduced = shapes[operand]
        if len(reduced) == 3:  # (rows, k, lanes) -> (rows, lanes)
            assert dim == "1" and reduced[1] <= 20 and reduced[2] % 8 == 0, reduced
        else:  # (rows, lanes) -> rows, or the < 8 classes left over
            assert reduced[1] % 8 == 0 or reduced[1] < 8, (out, reduced)
    assert f"u16[64,{n_classes}]" in hlo
    assert not re.search(rf"bf16\[64,{n_classes}\]\S* convert\(", hlo)


def test_ce_bfloat16_rounding_is_xla_convert():
    """The gradient's float32 -> bf16 rounding by integer ops equals XLA's
    convert bit for bit: every rounding boundary (ties to even, the carry
    into the exponent and into inf), subnormals, +-0, +-inf, NaNs of both
    signs with any payload, and random bit patterns."""
    from jaxstable._src.losses.cross_entropy import _to_bfloat16

    rng = np.random.default_rng(0)
    high = np.concatenate(
        [rng.integers(0, 2**16, 2000), [0, 0x7F7F, 0x7F80, 0x7FC0, 0x8000, 0xFF80]]
    ).astype(np.uint32)
    low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    bits = np.concatenate(
        [((high[:, None] << 16) | low).ravel(), rng.integers(0, 2**32, 2**16)]
    ).astype(np.uint32)
    x = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.float32)
    ours = jax.jit(_to_bfloat16)(x)
    xla = jax.jit(lambda v: v.astype(jnp.bfloat16))(x)
    np.testing.assert_array_equal(
        np.asarray(ours).view(np.uint16), np.asarray(xla).view(np.uint16)
    )


def test_ce_all_ignored_and_empty_are_zero_with_zero_grad():
    x, y = _ce_inputs((2, 3), 5, "float32")
    y_ign = jnp.full_like(y, 255)
    f = jax.jit(
        jax.value_and_grad(
            lambda v, lab: losses.softmax_cross_entropy(
                v, lab, ignore_index=255, label_smoothing=0.1, weights=jnp.ones(5)
            )
        )
    )
    val, g = f(x, y_ign)
    assert float(val) == 0.0 and not np.any(np.asarray(g))
    val, g = f(x[:0], y[:0])
    assert float(val) == 0.0 and g.shape == (0, 3, 5)


def test_ce_out_of_range_under_jit_is_nan_eager_raises():
    x, y = _ce_inputs((2, 3), 5, "float32")
    y_bad = y.at[0, 1].set(5)
    per = jax.jit(
        lambda v, lab: losses.softmax_cross_entropy(v, lab, reduction="none")
    )(x, y_bad)
    assert (
        np.isnan(per[0, 1]) and np.isfinite(np.delete(np.asarray(per).ravel(), 1)).all()
    )
    with pytest.raises(ValueError, match=r"labels must be in \[0, 5\).*\[5\]"):
        losses.softmax_cross_entropy(x, y_bad)


def test_ce_non_finite_logits_give_nan():
    x, y = _ce_inputs((3,), 4, "float32")
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        out = losses.softmax_cross_entropy(x.at[1].set(bad), y % 4, reduction="none")
        assert np.isnan(out[1]) and np.isfinite(out[0]) and np.isfinite(out[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_ce_jit_vmap_and_axis(dtype, tol):
    x, y = _ce_inputs((4, 6), 5, dtype)
    eager = losses.softmax_cross_entropy(x, y, ignore_index=255, reduction="none")
    jitted = jax.jit(
        lambda v, lab: losses.softmax_cross_entropy(
            v, lab, ignore_index=255, reduction="none"
        )
    )(x, y)
    mapped = jax.vmap(
        lambda v, lab: losses.softmax_cross_entropy(
            v, lab, ignore_index=255, reduction="none"
        )
    )(x, y)
    moved = losses.softmax_cross_entropy(
        jnp.moveaxis(x, -1, 0), y, axis=0, ignore_index=255, reduction="none"
    )
    for out in (jitted, mapped, moved):
        np.testing.assert_allclose(out, eager, **tol("float32"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_db_step_gradient_finite_on_unit_square(dtype, tol):
    grid = jnp.linspace(0.0, 1.0, 101)
    xs, ys = (v.astype(dtype) for v in jnp.meshgrid(grid, grid))
    val = losses.db_step(xs, ys)
    gx, gy = jax.grad(lambda a, b: jnp.sum(losses.db_step(a, b)), argnums=(0, 1))(
        xs, ys
    )
    assert val.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(gx)) & jnp.all(jnp.isfinite(gy)))
    ref = 1.0 / (
        1.0 + np.exp(-50.0 * (np.asarray(xs, np.float64) - np.asarray(ys, np.float64)))
    )
    np.testing.assert_allclose(val, ref, **tol("float32"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_losses_return_float32(dtype):
    rng = np.random.default_rng(1)
    p = jnp.asarray(rng.random((2, 8, 8))).astype(dtype)
    g = jnp.asarray(rng.random((2, 8, 8)) < 0.3, jnp.float32)
    m = jnp.ones((2, 8, 8))
    outs = [
        losses.sigmoid_binary_cross_entropy(p, g),
        losses.balanced_binary_cross_entropy(p, g, m),
        losses.dice_loss(p, g, m),
        losses.masked_l1_loss(p, g, m),
        losses.db_loss(p, p, g, m, g, m),
        losses.info_nce(p[0], p[1]),
    ]
    assert all(o.dtype == jnp.float32 and o.shape == () for o in outs)


def test_balanced_bce_jit_matches_eager_with_data_dependent_k(tol):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(2, 16, 16)) * 3, jnp.float32)
    f = jax.jit(losses.balanced_binary_cross_entropy)
    for frac in (0.0, 0.02, 0.3, 0.9):
        g = jnp.asarray(rng.random((2, 16, 16)) < frac, jnp.float32)
        m = jnp.asarray(rng.random((2, 16, 16)) < 0.8, jnp.float32)
        np.testing.assert_allclose(
            f(x, g, m), losses.balanced_binary_cross_entropy(x, g, m), **tol("float32")
        )
        # reference by explicit selection in numpy
        bce = np.asarray(jnp.logaddexp(0.0, x) - x * g, np.float64).ravel()
        pos = (np.asarray(g) > 0.5).ravel() & (np.asarray(m) > 0.5).ravel()
        neg = ~(np.asarray(g) > 0.5).ravel() & (np.asarray(m) > 0.5).ravel()
        k = min(neg.sum(), int(pos.sum() * 3.0))
        top = np.sort(bce[neg])[::-1][:k].sum()
        ref = (bce[pos].sum() + top) / (pos.sum() + k + 1e-6)
        np.testing.assert_allclose(float(f(x, g, m)), ref, **tol("float32"))


def test_empty_masks_give_finite_values_and_gradients():
    p = jnp.full((4, 4), 0.3)
    z = jnp.zeros((4, 4))
    d, gd = jax.value_and_grad(losses.dice_loss)(p, z, z)
    l1, gl = jax.value_and_grad(losses.masked_l1_loss)(p, z + 1.0, z)
    assert float(d) == 1.0 and float(l1) == 0.0
    assert np.all(np.isfinite(gd)) and not np.any(np.asarray(gl))


@pytest.mark.parametrize("dtype", DTYPES)
def test_info_nce_zero_embeddings_and_tiny_temperature(dtype):
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.normal(size=(8, 16))).astype(dtype)
    b = jnp.asarray(rng.normal(size=(8, 16))).astype(dtype)
    f = jax.jit(
        jax.value_and_grad(
            lambda a, b, t, eps: losses.info_nce(
                a, b, temperature=t, min_temperature=1e-3, eps=eps
            ),
            argnums=(0, 1, 2),
        )
    )
    # tiny temperature (clamped to 1e-3: |logits| <= 1000): finite everywhere
    val, grads = f(a, b, jnp.float32(1e-6), 1e-8)
    assert np.isfinite(float(val))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
    assert float(grads[2]) == 0.0  # clamped: no gradient below min_temperature
    # zero rows: the normalisation's gradient there is upstream / eps, so fp16
    # (max 65504) needs a larger eps than the default 1e-8 (documented)
    eps = 1e-3 if dtype == "float16" else 1e-8
    val, grads = f(a.at[2].set(0), b.at[5].set(0), jnp.float32(0.07), eps)
    assert np.isfinite(float(val))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


def test_info_nce_learnable_temperature_has_gradient(tol):
    rng = np.random.default_rng(4)
    a = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    g = jax.grad(lambda t: losses.info_nce(a, a + 0.3, temperature=t))(
        jnp.float32(0.07)
    )
    eps = 1e-3
    fd = (
        losses.info_nce(a, a + 0.3, temperature=0.07 + eps)
        - losses.info_nce(a, a + 0.3, temperature=0.07 - eps)
    ) / (2 * eps)
    np.testing.assert_allclose(float(g), float(fd), **tol("bfloat16"))


def test_input_checks_add_no_host_transfer_under_jit():
    """The value checks (labels, masks, NaN targets, weight sums) read values
    on the host only for concrete inputs; a jitted step transfers nothing."""
    x, y = _ce_inputs((2, 8), 5, "bfloat16")
    w = jnp.linspace(0.5, 1.5, 5)
    p = jnp.linspace(-2.0, 2.0, 16).reshape(2, 8)
    g = (p > 0.5).astype(jnp.float32)
    m = jnp.ones((2, 8))

    def total(x, p):
        return (
            losses.softmax_cross_entropy(x, y, ignore_index=255, weights=w)
            + losses.balanced_binary_cross_entropy(p, g, m)
            + losses.masked_l1_loss(p, g, m)
            + losses.info_nce(p, g, temperature=jnp.float32(0.1))
        )

    step = jax.jit(jax.value_and_grad(total, argnums=(0, 1)))
    step(x, p)  # compile (constants are transferred once, here)
    with jax.transfer_guard("disallow"):
        value, _ = step(x, p)
    assert np.isfinite(float(value))


# ---------------------------------------------------------------------------
# issue 22: gradients at kinks, the precision rule (parity: test_loss_kinks.py)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_bce_gradient_at_logit_zero_is_sigmoid_minus_target(jit):
    """sigmoid(0) - t, not -t (autodiff of |x| and max(x, 0) at 0), also at
    -0.0; the targets' gradient is -x = 0 there."""
    grad = jax.grad(losses.sigmoid_binary_cross_entropy, argnums=(0, 1))
    grad = jax.jit(grad) if jit else grad
    t = jnp.array([1.0, 0.0, 1.0, 0.0, 0.25, 0.75])
    gx, gt = grad(jnp.zeros(6).at[1].set(-0.0), t)
    np.testing.assert_array_equal(gx, (0.5 - t) / 6)
    np.testing.assert_array_equal(gt, np.zeros(6))


def test_masked_l1_gradient_is_zero_where_pred_equals_target():
    """torch's abs: sign(0) = 0 (jax.grad(jnp.abs)(0.0) is 1)."""
    p = jnp.array([0.5, 0.25, 0.75, 0.5])
    t = jnp.array([0.5, 0.5, 0.75, 0.25])
    gp, gt = jax.grad(losses.masked_l1_loss, argnums=(0, 1))(p, t, jnp.ones(4))
    np.testing.assert_array_equal(gp, [0.0, -0.25, 0.0, 0.25])
    np.testing.assert_array_equal(gt, [0.0, 0.25, 0.0, -0.25])


def test_float64_inputs_compute_in_float64_with_x64():
    """The precision rule: with x64 on, float64 logits give a float64 loss
    and a float64 target alone does not widen (the predictions decide); with
    x64 off a float64 numpy input is float32 before the loss sees it. Every
    loss, values included: parity_tests/test_loss_kinks.py."""
    x = np.linspace(-3.0, 3.0, 6)
    t = (x > 0).astype(np.float64)
    with jax.enable_x64(True):
        wide = losses.sigmoid_binary_cross_entropy(jnp.asarray(x), t)
        narrow = losses.sigmoid_binary_cross_entropy(jnp.asarray(x, jnp.float32), t)
        assert wide.dtype == jnp.float64 and narrow.dtype == jnp.float32
    assert losses.sigmoid_binary_cross_entropy(x, t).dtype == jnp.float32
