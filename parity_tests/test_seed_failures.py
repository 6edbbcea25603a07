"""The failure patterns of docs/failure_patterns.md reproduced: the naive
low-precision path really produces inf/NaN, ours is finite and equals a
float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F

from jaxstable import losses as jl
from torchref import losses as tl

# Compile-bound: XLA with fewer optimisations (conftest.py; the same
# assertions pass either way, measured 2026-11-28).
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")


def _f64_ce(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-row cross-entropy in float64 (classes last): the reference."""
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(x - m).sum(-1))
    return lse - np.take_along_axis(x, y[..., None], -1)[..., 0]


def _fp16_logits(scale: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = np.clip(rng.normal(size=(4, 8, 8, 19)) * scale, -65000, 65000)
    x = x.astype(np.float16).astype(np.float32)
    y = rng.integers(0, 19, size=(4, 8, 8))
    return x, y


def test_seed000_naive_exp_sum_in_fp16_overflows_ours_does_not(tol):
    """seeds/000: exp of fp16 logits in the thousands is inf; loss NaN."""
    x, y = _fp16_logits(scale=2000.0)
    assert np.abs(x).max() > 1000
    xh = jnp.asarray(x, jnp.float16)
    naive = -jnp.log(  # softmax without max-subtraction, all in fp16
        jnp.take_along_axis(jnp.exp(xh), jnp.asarray(y)[..., None], -1)[..., 0]
        / jnp.sum(jnp.exp(xh), -1)
    )
    assert not np.all(np.isfinite(np.asarray(naive, np.float32)))
    ours = jl.softmax_cross_entropy(xh, jnp.asarray(y), reduction="none")
    assert ours.dtype == jnp.float32
    np.testing.assert_allclose(ours, _f64_ce(x, y), **tol("float32"))
    # torch: the same naive formula on .half() tensors
    xt = torch.tensor(x).half()
    naive_t = -torch.log(torch.exp(xt).gather(-1, torch.tensor(y)[..., None])[..., 0])
    naive_t = naive_t + torch.log(torch.exp(xt).sum(-1))
    assert not torch.isfinite(naive_t).all()
    ours_t = tl.softmax_cross_entropy(xt, torch.tensor(y), dim=-1, reduction="none")
    np.testing.assert_allclose(ours_t.numpy(), _f64_ce(x, y), **tol("float32"))


def test_seed000_torch_cross_entropy_on_fp16_logits_outside_autocast(tol):
    """seeds/000's real failure mode in torch: F.cross_entropy on fp16 logits
    of a `.half()` model (outside autocast) is inf; torchref's is finite."""
    x, y = _fp16_logits(3000.0)
    xt = torch.tensor(x).half().permute(0, 3, 1, 2)
    yt = torch.tensor(y)
    assert not torch.isfinite(F.cross_entropy(xt, yt))
    ours = tl.softmax_cross_entropy(xt, yt)
    assert ours.dtype == torch.float32
    np.testing.assert_allclose(ours.item(), _f64_ce(x, y).mean(), **tol("float32"))


def test_seed000_max_subtracted_fp16_ce_overflows_when_range_exceeds_fp16(tol):
    """Even optax's / torch's max-subtracted CE in fp16 breaks once the logit
    spread exceeds 65504 (x - max is -inf in fp16); in float32 it is fine."""
    x, y = _fp16_logits(scale=30000.0, seed=1)
    xh = jnp.asarray(x, jnp.float16)
    naive = optax.softmax_cross_entropy_with_integer_labels(xh, jnp.asarray(y))
    assert naive.dtype == jnp.float16
    assert not np.all(np.isfinite(np.asarray(naive, np.float32)))
    naive_t = F.cross_entropy(
        torch.tensor(np.moveaxis(x, -1, 1).copy()).half(),
        torch.tensor(y),
        reduction="none",
    )
    assert not torch.isfinite(naive_t).all()
    ref = _f64_ce(x, y)
    ours = jax.jit(lambda a, b: jl.softmax_cross_entropy(a, b, reduction="none"))(
        xh, jnp.asarray(y)
    )
    np.testing.assert_allclose(ours, ref, **tol("float32"))
    xt = torch.tensor(np.moveaxis(x, -1, 1).copy()).half().requires_grad_()
    ours_t = tl.softmax_cross_entropy(xt, torch.tensor(y), reduction="none")
    np.testing.assert_allclose(ours_t.detach().numpy(), ref, **tol("float32"))
    # and the gradients stay finite in fp16
    ours_t.mean().backward()
    assert torch.isfinite(xt.grad).all()
    g = jax.grad(lambda a: jl.softmax_cross_entropy(a, jnp.asarray(y)))(xh)
    assert g.dtype == jnp.float16 and bool(jnp.all(jnp.isfinite(g)))


def test_seed000_fp16_sum_of_pixel_losses_overflows(tol):
    """Per-pixel losses in the thousands summed in fp16 exceed 65504."""
    x, y = _fp16_logits(scale=2000.0, seed=2)
    xh = jnp.asarray(x, jnp.float16)
    per = optax.softmax_cross_entropy_with_integer_labels(xh, jnp.asarray(y))
    assert np.isinf(float(jnp.sum(per)))  # fp16 accumulator
    ours = jl.softmax_cross_entropy(xh, jnp.asarray(y), reduction="sum")
    np.testing.assert_allclose(float(ours), _f64_ce(x, y).sum(), **tol("float32"))
    ours_t = tl.softmax_cross_entropy(
        torch.tensor(x).half(), torch.tensor(y), dim=-1, reduction="sum"
    )
    np.testing.assert_allclose(float(ours_t), _f64_ce(x, y).sum(), **tol("float32"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_extreme_logits_near_dtype_max_match_float64(dtype, tol):
    """|logits| up to near the dtype max: finite and equal to float64."""
    # 0.45 x max: the loss (up to ~2 x max|x|) must itself fit in float32
    big = min(float(jnp.finfo(dtype).max), 3.4e38) * 0.45
    rng = np.random.default_rng(3)
    x = rng.uniform(-big, big, size=(64, 7)).astype(np.float32)
    x = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))
    y = rng.integers(0, 7, size=64)
    ref = _f64_ce(x, y)
    ours = jl.softmax_cross_entropy(
        jnp.asarray(x).astype(dtype), jnp.asarray(y), reduction="none"
    )
    assert np.all(np.isfinite(ref))
    np.testing.assert_allclose(ours, ref, **tol("float32"))
    ours_t = tl.softmax_cross_entropy(
        torch.tensor(x).to(getattr(torch, dtype)), torch.tensor(y), reduction="none"
    )
    np.testing.assert_allclose(ours_t.numpy(), ref, **tol("float32"))


def _reference_step(x, y, k=50.0):
    """The DBNet references' step function, in the inputs' dtype."""
    return 1.0 / (1.0 + jnp.exp(-k * (x - y)))


def test_seed002_reciprocal_exp_step_gives_nan_grad_in_fp16_db_step_does_not(tol):
    """seeds/002: reciprocal(1 + exp(-k(x - y))) with k=50 on [0, 1] inputs."""
    grid = np.linspace(0.0, 1.0, 51, dtype=np.float32)
    xs, ys = np.meshgrid(grid, grid)
    xh, yh = jnp.asarray(xs, jnp.float16), jnp.asarray(ys, jnp.float16)
    ref_grad = jax.grad(lambda a: jnp.sum(_reference_step(a, yh)))(xh)
    assert not bool(jnp.all(jnp.isfinite(ref_grad)))  # the seed's failure
    xt = torch.tensor(xs).half().requires_grad_()
    ref_t = torch.reciprocal(1 + torch.exp(-50.0 * (xt - torch.tensor(ys).half())))
    ref_t.sum().backward()
    assert not torch.isfinite(xt.grad).all()
    # The reference is only broken in fp16: bf16 and fp32 have exp's range.
    for dtype in ("bfloat16", "float32"):
        g = jax.grad(lambda a, d=dtype: jnp.sum(_reference_step(a, ys.astype(d))))(
            jnp.asarray(xs, dtype)
        )
        assert bool(jnp.all(jnp.isfinite(g))), dtype
    for dtype in ("float16", "bfloat16", "float32"):
        gx, gy = jax.grad(lambda a, b: jnp.sum(jl.db_step(a, b)), argnums=(0, 1))(
            jnp.asarray(xs, dtype), jnp.asarray(ys, dtype)
        )
        assert bool(jnp.all(jnp.isfinite(gx)) & jnp.all(jnp.isfinite(gy))), dtype
        xt = torch.tensor(xs).to(getattr(torch, dtype)).requires_grad_()
        tl.db_step(xt, torch.tensor(ys).to(getattr(torch, dtype))).sum().backward()
        assert torch.isfinite(xt.grad).all(), dtype
    # Same values as the reference where the reference (in float64) is defined.
    ref64 = 1.0 / (1.0 + np.exp(-50.0 * (xs.astype(np.float64) - ys)))
    np.testing.assert_allclose(
        jl.db_step(jnp.asarray(xs), jnp.asarray(ys)), ref64, **tol("float32")
    )
    np.testing.assert_allclose(
        tl.db_step(torch.tensor(xs), torch.tensor(ys)).numpy(), ref64, **tol("float32")
    )


def test_seed004_bf16_contrastive_logits_over_tiny_temperature(tol):
    """seeds/004: similarity 13.57 / 0.07 = 193.8. A naive exp in bf16
    overflows (bf16 exp overflows above 88.7); a max-subtracted float32
    log-softmax does not (the seed's "softmax(193.8) overflows" is false for
    it); info_nce is finite and matches float64."""
    s = jnp.asarray([[13.57, 4.47], [4.47, 13.57]], jnp.bfloat16) / 0.07
    naive = jnp.exp(s) / jnp.sum(jnp.exp(s), -1, keepdims=True)
    assert not bool(jnp.all(jnp.isfinite(naive)))
    assert bool(jnp.all(jnp.isfinite(jax.nn.log_softmax(s.astype(jnp.float32)))))
    rng = np.random.default_rng(4)
    a = rng.normal(size=(16, 32)).astype(np.float32)
    b = (a + 0.1 * rng.normal(size=(16, 32))).astype(np.float32)
    ab = [
        np.asarray(jnp.asarray(v).astype(jnp.bfloat16).astype(jnp.float32))
        for v in (a, b)
    ]
    an, bn = (
        v / np.linalg.norm(v.astype(np.float64), axis=1, keepdims=True) for v in ab
    )
    sim = an @ bn.T / 0.01
    ref = 0.5 * (
        np.mean(_f64_ce(sim, np.arange(16))) + np.mean(_f64_ce(sim.T, np.arange(16)))
    )
    ours = jl.info_nce(*(jnp.asarray(v, jnp.bfloat16) for v in ab), temperature=0.001)
    np.testing.assert_allclose(float(ours), ref, **tol("float32"))
    ours_t = tl.info_nce(*(torch.tensor(v).bfloat16() for v in ab), temperature=0.001)
    np.testing.assert_allclose(float(ours_t), ref, **tol("float32"))
