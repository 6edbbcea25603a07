"""Parity of every loss: jaxstable (NHWC) vs torchref (NCHW) vs native torch.

Values and gradients, on the same low-precision input values in both
frameworks (fp32 / bf16 / fp16), compared with chex and the dtype tolerances
of the root conftest. Gradients come back in the input dtype on both sides and
are compared after upcasting both to float32.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tolerance, torch_device
from jaxstable import losses as jl
from torchref import losses as tl

# Compile-bound: XLA with fewer optimisations (conftest.py; the same
# assertions pass either way, measured 2026-11-28).
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")

DTYPES = ["float32", "bfloat16", "float16"]
DEV = torch_device()  # CUDA when present: both frameworks on the GPU
IGNORE = 255


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values that `x` takes once stored in `dtype`."""
    return np.array(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32))


def _jx(x: np.ndarray, dtype: str) -> jax.Array:
    return jnp.asarray(x).astype(dtype)


def _tx(x: np.ndarray, dtype: str, grad: bool = True) -> torch.Tensor:
    t = torch.tensor(np.ascontiguousarray(x, dtype=np.float32)).to(
        DEV, getattr(torch, dtype)
    )
    return t.requires_grad_(grad)


def _np(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().float().cpu().numpy()
    return np.asarray(jnp.asarray(t).astype(jnp.float32))


def _t(v) -> torch.Tensor:
    """A torch copy of a numpy array (labels, masks, weights) on DEV."""
    return torch.as_tensor(np.array(v)).to(DEV)


def _close(a, b, tol):
    chex.assert_trees_all_close(_np(a), _np(b), **tol)


# ---------------------------------------------------------------------------
# softmax cross-entropy
# ---------------------------------------------------------------------------


@functools.cache
def _jax_ce(reduction, smoothing, ignore_index, weighted, axis=-1):
    def f(x, y, w):
        out = jl.softmax_cross_entropy(
            x, y, axis=axis, ignore_index=ignore_index, label_smoothing=smoothing,
            weights=w if weighted else None, reduction=reduction,
        )  # fmt: skip
        return jnp.sum(out), out

    return jax.jit(jax.value_and_grad(f, has_aux=True))


def _ce_case(rng, shape, n_classes, dtype, ignore_frac=0.2, scale=4.0):
    x = _round(rng.normal(size=(*shape, n_classes)) * scale, dtype)  # NHWC
    y = rng.integers(0, n_classes, size=shape)
    y[rng.random(shape) < ignore_frac] = IGNORE
    w = rng.uniform(0.2, 3.0, size=n_classes).astype(np.float32)
    return x, y, w


def _compare_ce(x, y, w, dtype, reduction, smoothing, weighted, tol, native=True):
    ii = IGNORE
    (_, j_out), j_grad = _jax_ce(reduction, smoothing, ii, weighted)(
        _jx(x, dtype), jnp.asarray(y), jnp.asarray(w)
    )
    xt = _tx(np.moveaxis(x, -1, 1), dtype)  # NCHW
    yt = _t(y)
    wt = _t(w) if weighted else None
    t_out = tl.softmax_cross_entropy(
        xt, yt, dim=1, ignore_index=ii, label_smoothing=smoothing, weights=wt,
        reduction=reduction,
    )  # fmt: skip
    t_out.sum().backward()
    t_grad = np.moveaxis(_np(xt.grad), 1, -1)
    assert j_out.dtype == jnp.float32 and t_out.dtype == torch.float32
    assert j_grad.dtype == jnp.dtype(dtype) and xt.grad.dtype == getattr(torch, dtype)
    _close(j_out, t_out, tol("float32"))
    _close(j_grad, t_grad, tol(dtype))
    if native:
        xn = _tx(np.moveaxis(x, -1, 1), "float32")
        n_out = F.cross_entropy(
            xn, yt, weight=wt, ignore_index=ii, label_smoothing=smoothing,
            reduction=reduction,
        )  # fmt: skip
        n_out.sum().backward()
        _close(t_out, n_out, tol("float32"))
        _close(j_grad, np.moveaxis(_np(xn.grad), 1, -1), tol(dtype))
    return j_out, j_grad


@pytest.mark.parametrize(
    "smoothing,weighted", [(0.0, False), (0.2, False), (0.0, True), (0.2, True)]
)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_parity(dtype, reduction, smoothing, weighted, tol):
    rng = np.random.default_rng(hash((dtype, reduction, smoothing, weighted)) % 2**32)
    x, y, w = _ce_case(rng, (2, 5, 4), 6, dtype)
    _compare_ce(x, y, w, dtype, reduction, smoothing, weighted, tol)


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(DTYPES),
    shape=st.sampled_from([(3, 7), (1, 4, 4), (2, 3, 5)]),
    n_classes=st.sampled_from([2, 5, 19]),
    ignore_frac=st.sampled_from([0.0, 0.3, 0.9]),
    scale=st.sampled_from([0.1, 3.0, 30.0]),
    smoothing=st.sampled_from([0.0, 0.1]),
    weighted=st.booleans(),
)
def test_cross_entropy_parity_random(
    seed, dtype, shape, n_classes, ignore_frac, scale, smoothing, weighted
):
    rng = np.random.default_rng(seed)
    x, y, w = _ce_case(rng, shape, n_classes, dtype, ignore_frac, scale)
    if ignore_frac and (y != IGNORE).sum() == 0:
        y.flat[0] = 0  # all-ignored has its own test (torch's mean is NaN there)
    _compare_ce(x, y, w, dtype, "mean", smoothing, weighted, tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_one_valid_pixel(dtype, tol):
    rng = np.random.default_rng(1)
    x, y, w = _ce_case(rng, (1, 4, 4), 5, dtype, ignore_frac=0.0)
    y[:] = IGNORE
    y[0, 2, 3] = 4
    _, j_grad = _compare_ce(x, y, w, dtype, "mean", 0.1, True, tol)
    nonzero_rows = np.abs(_np(j_grad)).sum(-1) > 0
    assert nonzero_rows.sum() == 1 and nonzero_rows[0, 2, 3]


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_all_ignored_is_zero_not_nan(dtype, weighted, tol):
    """Documented deviation: mean over no valid element is 0.0, zero gradient."""
    rng = np.random.default_rng(2)
    x, y, w = _ce_case(rng, (2, 3, 3), 4, dtype)
    y[:] = IGNORE
    (_, j_out), j_grad = _jax_ce("mean", 0.1, IGNORE, weighted)(
        _jx(x, dtype), jnp.asarray(y), jnp.asarray(w)
    )
    xt = _tx(np.moveaxis(x, -1, 1), dtype)
    wt = _t(w) if weighted else None
    t_out = tl.softmax_cross_entropy(
        xt, _t(y), ignore_index=IGNORE, label_smoothing=0.1, weights=wt
    )
    t_out.backward()
    assert float(j_out) == 0.0 and t_out.item() == 0.0
    assert not np.any(_np(j_grad)) and not np.any(_np(xt.grad))
    # ... where torch's own F.cross_entropy gives NaN (0 / 0)
    native = F.cross_entropy(
        _tx(np.moveaxis(x, -1, 1), "float32"), _t(y), weight=wt,
        ignore_index=IGNORE, label_smoothing=0.1,
    )  # fmt: skip
    assert torch.isnan(native)


def test_cross_entropy_nchw_vs_nhwc(tol):
    """Class axis anywhere: jaxstable axis=1 on NCHW == torchref dim=-1 on NHWC."""
    rng = np.random.default_rng(3)
    x, y, _ = _ce_case(rng, (2, 3, 4), 5, "float32")
    x_nchw = np.moveaxis(x, -1, 1)
    kw = dict(ignore_index=IGNORE, label_smoothing=0.1, reduction="none")
    j_nchw = jl.softmax_cross_entropy(jnp.asarray(x_nchw), jnp.asarray(y), axis=1, **kw)
    j_nhwc = jl.softmax_cross_entropy(jnp.asarray(x), jnp.asarray(y), **kw)
    t_nhwc = tl.softmax_cross_entropy(_t(x), _t(y), dim=-1, **kw)
    t_nchw = tl.softmax_cross_entropy(_t(x_nchw), _t(y), **kw)
    for out in (j_nhwc, t_nhwc, t_nchw):
        _close(j_nchw, out, tol("float32"))
    g_nchw = jax.jit(
        jax.grad(
            lambda v: jl.softmax_cross_entropy(
                v, jnp.asarray(y), axis=1, ignore_index=255
            )
        )
    )(jnp.asarray(x_nchw))
    g_nhwc = jax.jit(
        jax.grad(
            lambda v: jl.softmax_cross_entropy(v, jnp.asarray(y), ignore_index=255)
        )
    )(jnp.asarray(x))
    _close(np.moveaxis(_np(g_nchw), 1, -1), g_nhwc, tol("float32"))


def test_cross_entropy_weights_gradient_matches_autodiff(tol):
    """d loss / d weights from the custom VJP == autodiff of a plain formula."""
    rng = np.random.default_rng(4)
    x, y, w = _ce_case(rng, (4, 6), 5, "float32")

    def plain(w):
        logp = jax.nn.log_softmax(jnp.asarray(x), -1)
        valid = jnp.asarray(y) != IGNORE
        ys = jnp.where(valid, jnp.asarray(y), 0)
        nll = -w[ys] * jnp.take_along_axis(logp, ys[..., None], -1)[..., 0]
        smooth = -jnp.sum(logp * w, -1)
        per = jnp.where(valid, 0.8 * nll + 0.2 / 5 * smooth, 0.0)
        return jnp.sum(per) / jnp.sum(jnp.where(valid, w[ys], 0.0))

    def ours(w):
        return jl.softmax_cross_entropy(
            jnp.asarray(x), jnp.asarray(y), ignore_index=IGNORE, label_smoothing=0.2,
            weights=w,
        )  # fmt: skip

    _close(
        jax.grad(ours)(jnp.asarray(w)), jax.grad(plain)(jnp.asarray(w)), tol("float32")
    )


# ---------------------------------------------------------------------------
# binary losses
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_bce_parity(dtype, reduction, weighted, tol):
    rng = np.random.default_rng(5)
    x = _round(rng.normal(size=(2, 3, 5)) * 6, dtype)
    x[0, 0, :2] = [-60000.0, 60000.0]  # fp16 extremes; larger in test_seed_failures
    x = _round(x, dtype)
    t = rng.random((2, 3, 5)).astype(np.float32)
    w = rng.uniform(0.1, 2, size=(3, 5)).astype(np.float32)
    wj = jnp.asarray(w) if weighted else None
    wt = _t(w) if weighted else None

    def f(v):
        out = jl.sigmoid_binary_cross_entropy(
            v, jnp.asarray(t), weights=wj, reduction=reduction
        )
        return jnp.sum(out), out

    (_, j_out), j_grad = jax.value_and_grad(f, has_aux=True)(_jx(x, dtype))
    xt = _tx(x, dtype)
    t_out = tl.sigmoid_binary_cross_entropy(xt, _t(t), weights=wt, reduction=reduction)
    t_out.sum().backward()
    xn = _tx(x, "float32")
    n_out = F.binary_cross_entropy_with_logits(
        xn, _t(t), weight=wt, reduction=reduction
    )
    n_out.sum().backward()
    assert j_out.dtype == jnp.float32 and t_out.dtype == torch.float32
    chex.assert_tree_all_finite(j_grad)
    _close(j_out, t_out, tol("float32"))
    _close(t_out, n_out, tol("float32"))
    _close(j_grad, xt.grad, tol(dtype))
    _close(j_grad, xn.grad, tol(dtype))


def _db_maps(rng, shape=(2, 8, 8), empty=False):
    gt = (rng.random(shape) < 0.25).astype(np.float32)
    mask = (rng.random(shape) < 0.9).astype(np.float32)
    if empty:
        gt[:] = 0.0
    return gt, mask


@pytest.mark.parametrize(
    "case", ["random", "no_positive", "ratio_caps", "all_negative"]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_balanced_bce_parity(dtype, case, tol):
    rng = np.random.default_rng(6)
    x = _round(rng.normal(size=(2, 8, 8)) * 3, dtype)
    gt, mask = _db_maps(rng, empty=case == "no_positive")
    ratio = {"ratio_caps": 0.5, "all_negative": 100.0}.get(case, 3.0)
    j_val, j_grad = jax.value_and_grad(
        lambda v: jl.balanced_binary_cross_entropy(
            v, jnp.asarray(gt), jnp.asarray(mask), negative_ratio=ratio
        )
    )(_jx(x, dtype))
    xt = _tx(x, dtype)
    t_val = tl.balanced_binary_cross_entropy(xt, _t(gt), _t(mask), negative_ratio=ratio)
    t_val.backward()
    _close(j_val, t_val, tol("float32"))
    _close(j_grad, xt.grad, tol(dtype))
    if case == "no_positive":
        assert float(j_val) == 0.0


@pytest.mark.parametrize("masked", ["none", "random", "empty"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dice_parity(dtype, masked, tol):
    rng = np.random.default_rng(7)
    p = _round(rng.random((2, 6, 6)), dtype)
    g = (rng.random((2, 6, 6)) < 0.3).astype(np.float32)
    m = {
        "none": None,
        "random": rng.random((2, 6, 6)) < 0.7,
        "empty": np.zeros((2, 6, 6)),
    }
    m = None if m[masked] is None else m[masked].astype(np.float32)
    mj = None if m is None else jnp.asarray(m)
    mt = None if m is None else _t(m)
    j_val, j_grad = jax.value_and_grad(lambda v: jl.dice_loss(v, jnp.asarray(g), mj))(
        _jx(p, dtype)
    )
    pt = _tx(p, dtype)
    t_val = tl.dice_loss(pt, _t(g), mt)
    t_val.backward()
    chex.assert_tree_all_finite(j_grad)
    _close(j_val, t_val, tol("float32"))
    _close(j_grad, pt.grad, tol(dtype))
    if masked == "empty":
        assert float(j_val) == 1.0 and not np.any(_np(j_grad))


@pytest.mark.parametrize("empty", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_l1_parity(dtype, empty, tol):
    rng = np.random.default_rng(8)
    p = _round(rng.random((2, 6, 6)), dtype)
    t = rng.random((2, 6, 6)).astype(np.float32)
    m = (
        np.zeros((2, 6, 6), np.float32)
        if empty
        else (rng.random((2, 6, 6)) < 0.5) * 1.0
    )
    m = m.astype(np.float32)
    j_val, j_grad = jax.value_and_grad(
        lambda v: jl.masked_l1_loss(v, jnp.asarray(t), jnp.asarray(m))
    )(_jx(p, dtype))
    pt = _tx(p, dtype)
    t_val = tl.masked_l1_loss(pt, _t(t), _t(m))
    t_val.backward()
    _close(j_val, t_val, tol("float32"))
    _close(j_grad, pt.grad, tol(dtype))
    if empty:
        assert float(j_val) == 0.0 and t_val.item() == 0.0
        assert not np.any(_np(j_grad)) and not torch.any(pt.grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_db_step_parity(dtype, tol):
    grid = np.linspace(0.0, 1.0, 41, dtype=np.float32)
    x, y = (_round(v, dtype) for v in np.meshgrid(grid, grid))  # x - y covers ±1
    (jgx, jgy) = jax.grad(lambda a, b: jnp.sum(jl.db_step(a, b)), argnums=(0, 1))(
        _jx(x, dtype), _jx(y, dtype)
    )
    xt, yt = _tx(x, dtype), _tx(y, dtype)
    t_val = tl.db_step(xt, yt)
    t_val.sum().backward()
    _close(jl.db_step(_jx(x, dtype), _jx(y, dtype)), t_val, tol("float32"))
    _close(jgx, xt.grad, tol(dtype))
    _close(jgy, yt.grad, tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_db_loss_parity(dtype, tol):
    rng = np.random.default_rng(9)
    logits = _round(rng.normal(size=(2, 8, 8)) * 3, dtype)
    thresh = _round(rng.random((2, 8, 8)), dtype)
    gt, mask = _db_maps(rng)
    tmap = rng.random((2, 8, 8)).astype(np.float32)
    tmask = (rng.random((2, 8, 8)) < 0.6).astype(np.float32)
    j_fn = jax.value_and_grad(
        lambda a, b: jl.db_loss(
            a,
            b,
            jnp.asarray(gt),
            jnp.asarray(mask),
            jnp.asarray(tmap),
            jnp.asarray(tmask),
        ),
        argnums=(0, 1),
    )
    j_val, (ja, jb) = j_fn(_jx(logits, dtype), _jx(thresh, dtype))
    ta, tb = _tx(logits, dtype), _tx(thresh, dtype)
    t_val = tl.db_loss(ta, tb, *(_t(v) for v in (gt, mask, tmap, tmask)))
    t_val.backward()
    _close(j_val, t_val, tol("float32"))
    _close(ja, ta.grad, tol(dtype))
    _close(jb, tb.grad, tol(dtype))


@pytest.mark.parametrize("case", ["random", "zero_rows", "tiny_temperature"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_info_nce_parity(dtype, case, tol):
    rng = np.random.default_rng(10)
    a = _round(rng.normal(size=(6, 8)), dtype)
    b = _round(a + 0.5 * rng.normal(size=(6, 8)), dtype)
    if case == "zero_rows":
        a[1] = 0.0
        b[3] = 0.0
    temp, min_t = (1e-4, 1e-3) if case == "tiny_temperature" else (0.07, 0.01)
    # At an exactly-zero row the normalisation's gradient is upstream / eps:
    # 1e8 with the default eps, beyond fp16's 65504 on both sides. A fp16
    # user with zero rows needs eps > 1.5e-5 (bf16/fp32 are fine with 1e-8).
    eps = 1e-4 if dtype == "float16" else 1e-8
    j_val, (ja, jb, jt) = jax.value_and_grad(
        lambda x, y, t: jl.info_nce(
            x, y, temperature=t, min_temperature=min_t, eps=eps
        ),
        argnums=(0, 1, 2),
    )(_jx(a, dtype), _jx(b, dtype), jnp.float32(temp))
    at, bt = _tx(a, dtype), _tx(b, dtype)
    tt = torch.tensor(temp, dtype=torch.float32, device=DEV, requires_grad=True)
    t_val = tl.info_nce(at, bt, temperature=tt, min_temperature=min_t, eps=eps)
    t_val.backward()
    chex.assert_tree_all_finite((j_val, ja, jb, jt))
    _close(j_val, t_val, tol("float32"))
    _close(ja, at.grad, tol(dtype))
    _close(jb, bt.grad, tol(dtype))
    _close(jt, tt.grad, tol("float32"))
