"""``softmax_cross_entropy(..., z_loss=z)`` in both frameworks (issue 23).

Value and gradient (logits and class weights) against a float64 reference
written from the definition (``l + z w_y lse**2``, reduced with the loss),
differentiated by torch's float64 autograd; with ignored rows, label
smoothing, class weights, every reduction, bf16 logits and an all-ignored
batch. Nothing here is compared with a constant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxstable import losses as jl
from torchref import losses as tl

# Compile-bound: XLA with fewer optimisations (conftest.py; the same
# assertions pass either way, measured 2026-11-28).
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")

Z = 1e-2
LABELS = np.array([0, 3, 6, 255, 2, 6], np.int64)


def _logits(dtype=np.float32):
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(6, 7)) * 4).astype(np.float32)
    x[0] = 0.0  # all-equal row: lse = log 7, p uniform (a tie)
    x[4, 2] = 30.0  # lse far from 0: the z-term dominates
    return x.astype(dtype)


def _reference(x, w, labels, smoothing, reduction):
    """float64 torch autograd of the definition: (value, d/dx, d/dw)."""
    x = torch.tensor(np.asarray(x, np.float64), requires_grad=True)
    w = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    y = torch.from_numpy(labels)
    valid = y != 255
    sy = torch.where(valid, y, 0)
    lse = torch.logsumexp(x, 1)
    nll = (lse - x[torch.arange(len(y)), sy]) * w[sy]
    smooth = (w[None] * (lse[:, None] - x)).sum(1) / x.shape[1]
    per = (1 - smoothing) * nll + smoothing * smooth + Z * w[sy] * lse**2
    per = torch.where(valid, per, 0.0)
    if reduction == "none":
        out = per
    elif reduction == "sum":
        out = per.sum()
    else:
        out = per.sum() / torch.where(valid, w[sy], 0.0).sum()
    out.backward(torch.ones_like(out))
    return out.detach().numpy(), x.grad.numpy(), w.grad.numpy()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_value_and_gradients_match_float64_in_both(reduction, smoothing, tol):
    x = _logits()
    w = np.linspace(0.5, 2.0, 7)
    ref, ref_dx, ref_dw = _reference(x, w, LABELS, smoothing, reduction)
    kw = dict(ignore_index=255, label_smoothing=smoothing, reduction=reduction)

    def jfun(x, w):
        out = jl.softmax_cross_entropy(
            x, jnp.asarray(LABELS), weights=w, z_loss=Z, **kw
        )
        return jnp.sum(out), out

    (_, jout), (jdx, jdw) = jax.value_and_grad(jfun, (0, 1), has_aux=True)(
        jnp.asarray(x), jnp.asarray(w, jnp.float32)
    )
    tx = torch.tensor(x, requires_grad=True)
    # F.cross_entropy has no gradient for its class weights: torch gives dx.
    tw = torch.tensor(w, dtype=torch.float32)
    tout = tl.softmax_cross_entropy(
        tx, torch.from_numpy(LABELS), weights=tw, z_loss=Z, **kw
    )
    tout.sum().backward()
    for out, dx in (
        (np.asarray(jout), np.asarray(jdx)),
        (tout.detach().numpy(), tx.grad.numpy()),
    ):
        np.testing.assert_allclose(out, ref, **tol("float32"))
        np.testing.assert_allclose(dx, ref_dx, **tol("float32"))
    np.testing.assert_allclose(np.asarray(jdw), ref_dw, **tol("float32"))
    assert np.all(np.asarray(jdx)[3] == 0) and np.all(tx.grad.numpy()[3] == 0)


def test_z_loss_adds_exactly_the_mean_of_lse_squared_and_zero_adds_nothing():
    x = jnp.asarray(_logits())
    y = jnp.asarray(LABELS)
    base = jl.softmax_cross_entropy(x, y, ignore_index=255)
    assert jl.softmax_cross_entropy(x, y, ignore_index=255, z_loss=0.0) == base
    valid = LABELS != 255
    lse = np.log(np.exp(np.asarray(x, np.float64)).sum(1))
    with_z = jl.softmax_cross_entropy(x, y, ignore_index=255, z_loss=Z)
    np.testing.assert_allclose(
        float(with_z) - float(base), Z * np.mean(lse[valid] ** 2), rtol=1e-5
    )


def test_bf16_logits_computed_in_float32_in_both(tol):
    x = _logits(np.float32)
    xb = jnp.asarray(x, jnp.bfloat16)
    x_up = np.asarray(xb.astype(jnp.float32))  # what both read
    ref, ref_dx, _ = _reference(x_up, np.ones(7), LABELS, 0.0, "mean")

    def jfun(x):
        return jl.softmax_cross_entropy(
            x, jnp.asarray(LABELS), ignore_index=255, z_loss=Z
        )

    jv, jdx = jax.value_and_grad(jfun)(xb)
    tx = torch.tensor(x_up).bfloat16().requires_grad_()
    tv = tl.softmax_cross_entropy(
        tx, torch.from_numpy(LABELS), ignore_index=255, z_loss=Z
    )
    tv.backward()
    assert jv.dtype == jnp.float32 and tv.dtype == torch.float32
    np.testing.assert_allclose(float(jv), ref, **tol("float32"))
    np.testing.assert_allclose(float(tv.detach()), ref, **tol("float32"))
    assert jdx.dtype == jnp.bfloat16 and tx.grad.dtype == torch.bfloat16
    np.testing.assert_allclose(np.asarray(jdx, np.float32), ref_dx, **tol("bfloat16"))
    np.testing.assert_allclose(tx.grad.float().numpy(), ref_dx, **tol("bfloat16"))


def test_all_ignored_mean_is_zero_with_zero_gradient_in_both():
    x = _logits()
    y = np.full(6, 255, np.int64)
    jv, jdx = jax.value_and_grad(
        lambda x: jl.softmax_cross_entropy(
            x, jnp.asarray(y), ignore_index=255, z_loss=Z
        )
    )(jnp.asarray(x))
    tx = torch.tensor(x, requires_grad=True)
    tv = tl.softmax_cross_entropy(tx, torch.from_numpy(y), ignore_index=255, z_loss=Z)
    tv.backward()
    assert float(jv) == float(tv.detach()) == 0.0
    assert not np.any(np.asarray(jdx)) and not torch.any(tx.grad)


@pytest.mark.parametrize(
    "bad, err", [(-1e-4, ValueError), (float("nan"), ValueError), (True, TypeError)]
)
def test_bad_z_loss_same_error(bad, err):
    with pytest.raises(err, match="z_loss must be a finite"):
        jl.softmax_cross_entropy(jnp.zeros((2, 3)), jnp.zeros(2, jnp.int32), z_loss=bad)
    with pytest.raises(err, match="z_loss must be a finite"):
        tl.softmax_cross_entropy(torch.zeros(2, 3), torch.zeros(2).long(), z_loss=bad)
