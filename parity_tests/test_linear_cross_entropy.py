"""`losses.linear_cross_entropy` against the naive projection + CE (issue 23).

Each framework's lean loss equals its own ``softmax_cross_entropy`` of the
materialised logits (value and both gradients) with ignored rows, a
vocabulary the block does not divide, smoothing, z-loss, every reduction, a
zero-size batch and bf16 inputs; JAX (kernel ``(D, V)``) and torch (weight
``(V, D)``) agree with each other; bad inputs get the same errors; and the
compiled JAX program holds no ``[tokens, vocab]`` buffer.
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

IGN = -100
# (lead shape, D, V, block, smoothing, z_loss, reduction)
CASES = [
    ((13,), 8, 300, 128, 0.0, 0.0, "mean"),  # 300 = 2 x 128 + a tail of 44
    ((2, 5), 16, 256, 64, 0.1, 1e-2, "mean"),
    ((7,), 4, 97, None, 0.2, 1e-2, "sum"),  # block = the whole (prime) vocab
    ((3, 3), 8, 300, 128, 0.1, 1e-3, "none"),
    ((0,), 8, 300, 128, 0.1, 1e-2, "mean"),  # zero-size batch
]


def _inputs(lead, d, v, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    h = (rng.normal(size=(*lead, d)) * 2).astype(dtype)
    k = rng.normal(size=(d, v)).astype(dtype)
    y = rng.integers(0, v, size=lead)
    y.flat[::3] = IGN  # ignored rows
    if y.size > 1:
        y.flat[1] = v - 1  # the last class (in the tail block)
    return h, k, y


def _jax_value_grads(fn, h, k, ct):
    def f(h, k):
        out = fn(h, k)
        return jnp.sum(out * ct), out

    # jitted: one compilation instead of an op-by-op run of the loop
    (_, out), grads = jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(h, k)
    return out, grads


@pytest.mark.parametrize("lead, d, v, block, s, z, red", CASES)
def test_both_equal_their_naive_projection_and_each_other(lead, d, v, block, s, z, red):
    h, k, y = _inputs(lead, d, v)
    kw = dict(ignore_index=IGN, label_smoothing=s, z_loss=z, reduction=red)
    ct = np.random.default_rng(1).normal(size=lead if red == "none" else ())
    ct = ct.astype(np.float32)
    jy = jnp.asarray(y)
    lean = _jax_value_grads(
        lambda h, k: jl.linear_cross_entropy(h, k, jy, block_size=block, **kw),
        h, k, ct,
    )  # fmt: skip
    naive = _jax_value_grads(
        lambda h, k: jl.softmax_cross_entropy(h @ k, jy, **kw), h, k, ct
    )
    rtol = dict(rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(lean[0], naive[0], **rtol)
    for a, b in zip(lean[1], naive[1], strict=True):
        np.testing.assert_allclose(a, b, **rtol)

    th = torch.tensor(h, requires_grad=True)
    tw = torch.tensor(k.T.copy(), requires_grad=True)  # nn.Linear layout (V, D)
    ty = torch.from_numpy(y)
    tout = tl.linear_cross_entropy(th, tw, ty, block_size=block, **kw)
    (tout * torch.from_numpy(ct)).sum().backward()
    nh = torch.tensor(h, requires_grad=True)
    nw = torch.tensor(k.T.copy(), requires_grad=True)
    nout = tl.softmax_cross_entropy(nh @ nw.T, ty, dim=-1, **kw)
    (nout * torch.from_numpy(ct)).sum().backward()
    torch.testing.assert_close(tout, nout, **rtol)
    torch.testing.assert_close(th.grad, nh.grad, **rtol)
    torch.testing.assert_close(tw.grad, nw.grad, **rtol)
    # the twins: torch's weight gradient is the JAX kernel's, transposed
    np.testing.assert_allclose(tout.detach().numpy(), lean[0], **rtol)
    np.testing.assert_allclose(th.grad.numpy(), lean[1][0], **rtol)
    np.testing.assert_allclose(tw.grad.numpy().T, lean[1][1], **rtol)


def test_bf16_inputs_accumulate_in_float32_in_both(tol):
    h, k, y = _inputs((11,), 16, 300, seed=2)
    hb, kb = jnp.asarray(h, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16)
    h32, k32 = np.asarray(hb, np.float32), np.asarray(kb, np.float32)  # what is read
    jy = jnp.asarray(y)
    kw = dict(ignore_index=IGN, z_loss=1e-3, label_smoothing=0.1)

    def ref(h, k):
        return jl.softmax_cross_entropy(h @ k, jy, **kw)

    rv, (rdh, rdk) = jax.jit(jax.value_and_grad(ref, (0, 1)))(h32, k32)
    lean = lambda h, k: jl.linear_cross_entropy(h, k, jy, block_size=128, **kw)  # noqa: E731
    jv, (jdh, jdk) = jax.jit(jax.value_and_grad(lean, (0, 1)))(hb, kb)
    assert jv.dtype == jnp.float32 and jdh.dtype == jdk.dtype == jnp.bfloat16
    np.testing.assert_allclose(float(jv), float(rv), **tol("float32"))
    np.testing.assert_allclose(np.asarray(jdh, np.float32), rdh, **tol("bfloat16"))
    np.testing.assert_allclose(np.asarray(jdk, np.float32), rdk, **tol("bfloat16"))
    th = torch.tensor(h32).bfloat16().requires_grad_()
    tw = torch.tensor(k32.T.copy()).bfloat16().requires_grad_()
    tv = tl.linear_cross_entropy(th, tw, torch.from_numpy(y), block_size=128, **kw)
    tv.backward()
    assert tv.dtype == torch.float32 and th.grad.dtype == torch.bfloat16
    np.testing.assert_allclose(float(tv.detach()), float(rv), **tol("float32"))
    np.testing.assert_allclose(th.grad.float().numpy(), rdh, **tol("bfloat16"))
    np.testing.assert_allclose(tw.grad.float().numpy().T, rdk, **tol("bfloat16"))


def test_all_ignored_mean_is_zero_with_zero_gradient_in_both():
    h, k, _ = _inputs((5,), 4, 300)
    y = np.full(5, IGN)
    jy = jnp.asarray(y)
    jv, jg = jax.jit(
        jax.value_and_grad(
            lambda h: jl.linear_cross_entropy(h, k, jy, ignore_index=IGN)
        )
    )(h)
    th = torch.tensor(h, requires_grad=True)
    tv = tl.linear_cross_entropy(
        th, torch.tensor(k.T.copy()), torch.from_numpy(y), ignore_index=IGN
    )
    tv.backward()
    assert float(jv) == float(tv.detach()) == 0.0
    assert not np.any(np.asarray(jg)) and not torch.any(th.grad)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_jax_program_holds_no_tokens_by_vocab_buffer(dtype):
    # 64 tokens x 32768 classes of float32 logits: 8 MiB; a block: 256 kiB;
    # the kernel: 1 MiB in float32, 0.5 MiB in bfloat16.
    n, d, v = 64, 8, 32768
    h = jnp.ones((n, d), dtype)
    k = (jnp.ones((d, v)) * 0.01).astype(dtype)
    y = jnp.zeros(n, jnp.int32)

    def compiled(loss):
        return jax.jit(jax.value_and_grad(loss, (0, 1))).lower(h, k).compile()

    lean = compiled(lambda h, k: jl.linear_cross_entropy(h, k, y, block_size=1024))
    naive = compiled(lambda h, k: jl.softmax_cross_entropy(h @ k, y))
    lean_temp = lean.memory_analysis().temp_size_in_bytes
    naive_temp = naive.memory_analysis().temp_size_in_bytes
    assert naive_temp >= n * v * h.dtype.itemsize  # the naive program holds the logits
    assert lean_temp < n * v * 4 / 8, (lean_temp, naive_temp)
    # XLA:CPU computes a bf16 op it has no kernel for in float32, converting
    # the whole operand: the bound above fails with a float32 copy of the
    # kernel hoisted out of the block loop, and the gradient's block writes
    # must not be float32 [D, V] updates (a round trip of all of it per block).
    writes = [x for x in lean.as_text().splitlines() if "dynamic-update-slice(" in x]
    assert writes and not any(
        f"f32[{d},{v}]" in x for x in writes if dtype != "float32"
    )


@pytest.mark.parametrize(
    "change, err, match",
    [
        ("layout", ValueError, "must have shape"),
        ("dtype", TypeError, "must have the same dtype"),
        ("label_shape", ValueError, "labels.shape="),
        ("label_value", ValueError, r"labels must be in \[0, 300\)"),
        ("float_labels", TypeError, "labels must be an integer"),
        ("block", ValueError, "block_size must be None or an int >= 1"),
        ("z_loss", ValueError, "z_loss must be a finite"),
        ("smoothing", ValueError, r"label_smoothing must be in \[0, 1\]"),
        ("reduction", ValueError, "unknown reduction"),
    ],
)
def test_bad_inputs_same_errors(change, err, match):
    h, k, y = _inputs((4,), 8, 300)
    kw = {}
    w = k.T.copy()
    if change == "layout":  # each given the other framework's layout
        k, w = k.T.copy(), k
    elif change == "dtype":
        k, w = k.astype(np.float16), w.astype(np.float16)
    elif change == "label_shape":
        y = y[:3]
    elif change == "label_value":
        y[0] = 300
    elif change == "float_labels":
        y = y.astype(np.float32)
    else:
        kw = {
            "block": dict(block_size=0),
            "z_loss": dict(z_loss=-1.0),
            "smoothing": dict(label_smoothing=1.5),
            "reduction": dict(reduction="avg"),
        }[change]
    with pytest.raises(err, match=match):
        jl.linear_cross_entropy(h, k, y, **kw)
    with pytest.raises(err, match=match):
        tl.linear_cross_entropy(
            torch.from_numpy(h), torch.from_numpy(w), torch.from_numpy(y), **kw
        )
