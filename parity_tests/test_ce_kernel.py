"""The Pallas cross-entropy kernel in interpret mode, against the XLA loss
and torch's F.cross_entropy: values and gradients (issue 24)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from jaxstable._src._ce_kernel import ce_kernel_applies, softmax_cross_entropy_rows
from jaxstable._src.losses.cross_entropy import _ce_rows
from jaxstable.losses import softmax_cross_entropy

# Compile-bound: XLA with fewer optimisations (conftest.py; the same
# assertions pass either way, measured 2026-11-28).
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")

IGNORE = -100


def _case(n, c, dtype, seed):
    kx, ky = jax.random.split(jax.random.key(seed))
    x = (jax.random.normal(kx, (n, c)) * 4).astype(dtype)
    if n:
        # kinks and extremes: a row of equal logits, a logit exactly 0, a
        # row near the dtype's max (finite after the max shift).
        x = x.at[0].set(0).at[min(1, n - 1), 0].set(0.0)
        big = float(jnp.finfo(dtype).max) / 4
        x = x.at[n - 1, c - 1].set(big)
    y = jax.random.randint(ky, (n,), 0, c)
    if n > 2:
        y = y.at[2].set(IGNORE).at[n - 1].set(c - 1)
    return x, y


def _torch(x, y, w, eps, dtype):
    xt = torch.tensor(np.asarray(x.astype(jnp.float32)), requires_grad=True)
    wt = None if w is None else torch.tensor(np.asarray(w))
    loss = F.cross_entropy(
        xt,
        torch.tensor(np.asarray(y), dtype=torch.long),
        weight=wt,
        ignore_index=IGNORE,
        label_smoothing=eps,
        reduction="none",
    )
    return loss, xt


@pytest.mark.parametrize(
    ("n", "c", "dtype", "weighted", "eps"),
    [
        (8, 19, jnp.float32, True, 0.1),
        (5, 130, jnp.bfloat16, True, 0.0),  # 130 classes: a 256-wide block
        (11, 7, jnp.float16, False, 0.2),  # 11 rows: a partial row block
        (0, 19, jnp.float32, True, 0.1),  # zero rows
        # 2500 classes: three chunks of 1024, the last one partial
        (4, 2500, jnp.bfloat16, True, 0.1),
        (130, 3, jnp.float32, False, 0.0),  # 128 rows per program: 2, partial
    ],
)
def test_kernel_matches_xla_and_torch(n, c, dtype, weighted, eps):
    x, y = _case(n, c, dtype, seed=n + c)
    w = jnp.linspace(0.5, 2.0, c, dtype=jnp.float32) if weighted else None
    kw = dict(ignore_index=IGNORE, label_smoothing=eps, weights=w)
    upstream = 1.0 + jnp.arange(n, dtype=jnp.float32) % 7

    # On a GPU (make gpu-check) the compiled kernel, elsewhere interpret
    # mode; the reference is the XLA path itself (softmax_cross_entropy
    # would take the kernel on a GPU).
    interpret = jax.default_backend() != "gpu"

    def ours(x):
        return softmax_cross_entropy_rows(x, y, interpret=interpret, **kw)

    def xla(x):
        return _ce_rows(x, y, w, IGNORE, eps, 0.0)

    got, vjp = jax.vjp(ours, x)
    want, vjp_ref = jax.vjp(xla, x)
    (dx,) = vjp(upstream)
    (dx_ref,) = vjp_ref(upstream)
    assert got.dtype == jnp.float32 and dx.dtype == x.dtype
    tol = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(
        dx.astype(jnp.float32), dx_ref.astype(jnp.float32), rtol=tol, atol=tol
    )
    if n > 2:
        assert float(got[2]) == 0.0 and not np.any(np.asarray(dx[2], np.float32))
    # torch, on the same (already rounded) logits in float32.
    lt, xt = _torch(x, y, None if w is None else np.asarray(w), eps, dtype)
    lt.backward(torch.tensor(np.asarray(upstream)))
    np.testing.assert_allclose(got, lt.detach().numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(
        dx.astype(jnp.float32), xt.grad.numpy(), rtol=tol, atol=tol
    )


def test_kernel_a_chunk_of_minus_inf_logits_as_torch():
    # A masked vocabulary range: row 0's first chunk (1024 classes) is all
    # -inf, its label in the second; row 1 is -inf everywhere (torch: nan).
    x = jax.random.normal(jax.random.key(5), (2, 1100)).at[0, :1024].set(-jnp.inf)
    x = x.at[1].set(-jnp.inf)
    y = jnp.array([1050, 3])
    interpret = jax.default_backend() != "gpu"
    got, dx = jax.value_and_grad(
        lambda x: softmax_cross_entropy_rows(x, y, interpret=interpret)[0]
    )(x)
    rows = softmax_cross_entropy_rows(x, y, interpret=interpret)
    lt, xt = _torch(x, y, None, 0.0, jnp.float32)
    lt[0].backward()
    assert np.isnan(float(rows[1])) and np.isnan(lt[1].item())
    np.testing.assert_allclose(float(got), lt[0].item(), rtol=1e-5)
    np.testing.assert_allclose(dx[0], xt.grad.numpy()[0], rtol=1e-5, atol=1e-7)
    assert not np.any(np.asarray(dx[0, :1024]))


def test_the_kernel_runs_only_when_asked_for(monkeypatch):
    # Measured on an H200 (2026-11-28): the kernel was slower than the XLA
    # path on 8 of 10 benchmark rows, so a GPU takes the XLA path unless
    # JAXSTABLE_CE_KERNEL=1, on one device or several (shard_map).
    x = jnp.zeros((4, 19))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("JAXSTABLE_CE_KERNEL", raising=False)
    for devices, switch, applies in [
        (1, None, False),
        (1, "auto", False),
        (2, None, False),
        (1, "1", True),
        (2, "1", True),
        (1, "0", False),
    ]:
        monkeypatch.setattr(jax, "device_count", lambda n=devices: n)
        if switch is None:
            monkeypatch.delenv("JAXSTABLE_CE_KERNEL", raising=False)
        else:
            monkeypatch.setenv("JAXSTABLE_CE_KERNEL", switch)
        assert ce_kernel_applies(x) is applies, (devices, switch)


def _kernel_memory_ops(jaxpr):
    """(name, masked) of every ref read and write in the pallas_call kernels
    of ``jaxpr``, loop bodies included."""
    found = []

    def walk(j, in_kernel):
        for e in j.eqns:
            name = e.primitive.name
            if in_kernel and name in ("get", "swap"):  # x_ref[...]: never masked
                found.append((name, False))
            elif in_kernel and name in ("masked_load", "masked_swap"):
                args = e.params["args_tree"].unflatten(e.invars)
                mask = args[2] if name == "masked_load" else args[3]
                found.append((name, mask is not None))
            for v in e.params.values():
                sub = getattr(v, "jaxpr", v)
                if hasattr(sub, "eqns"):
                    walk(sub, in_kernel or name == "pallas_call")

    walk(jaxpr, False)
    return found


def test_every_kernel_load_and_store_is_masked():
    # Pallas' Triton lowering masks nothing: a block's addresses come from the
    # full array's strides, so an unmasked (rows, chunk) access past N or C
    # reads the next row and writes over its gradient on a GPU. Interpret
    # mode pads blocks and cannot see it; the kernels' programs can.
    c = 2500
    w = jnp.ones(c)

    def loss(x, y):
        rows = softmax_cross_entropy_rows(x, y, label_smoothing=0.1, weights=w)
        return rows.sum()

    x, y = jnp.zeros((37, c), jnp.bfloat16), jnp.zeros((37,), jnp.int32)
    ops = _kernel_memory_ops(jax.make_jaxpr(jax.grad(loss))(x, y).jaxpr)
    assert {name for name, _ in ops} == {"masked_load", "masked_swap"}
    assert all(masked for _, masked in ops), ops


def test_applies_only_where_the_kernel_runs(monkeypatch):
    x = jnp.zeros((4, 19))
    monkeypatch.setenv("JAXSTABLE_CE_KERNEL", "0")  # the user's off switch
    assert not ce_kernel_applies(x, interpret=True)
    monkeypatch.setenv("JAXSTABLE_CE_KERNEL", "yes")
    with pytest.raises(ValueError, match="'auto', '0' or '1', got 'yes'"):
        ce_kernel_applies(x)
    monkeypatch.delenv("JAXSTABLE_CE_KERNEL")
    assert not ce_kernel_applies(x)  # the default: the XLA path everywhere
    assert ce_kernel_applies(x, interpret=True)
    monkeypatch.setenv("JAXSTABLE_CE_KERNEL", "1")
    assert ce_kernel_applies(x) is (jax.default_backend() == "gpu")
    assert ce_kernel_applies(x, weights=jnp.ones(19), interpret=True)
    assert not ce_kernel_applies(x, weights=jnp.ones(18), interpret=True)
    assert not ce_kernel_applies(jnp.zeros((4, 0)), interpret=True)
    # a 32k vocabulary is looped over in chunks; past 2**18 classes or 2**31
    # elements, the XLA path
    assert ce_kernel_applies(jnp.zeros((4, 32000)), interpret=True)
    big = jax.ShapeDtypeStruct((4, 2**18 + 1), jnp.float32)
    assert not ce_kernel_applies(big, interpret=True)
    huge = jax.ShapeDtypeStruct((2**14, 2**17), jnp.bfloat16)
    assert not ce_kernel_applies(huge, interpret=True)
    assert not ce_kernel_applies(jnp.zeros((4, 19), jnp.int32), interpret=True)


def test_last_axis_wrapper_matches_xla_with_a_bad_label_under_jit():
    # The dispatch target of softmax_cross_entropy on a GPU: (..., C) logits,
    # and a label outside [0, C) that is not ignored gives NaN there, as the
    # XLA path does under jit (never a finite wrong loss).
    x = jax.random.normal(jax.random.key(3), (2, 3, 6))
    y = jnp.array([[0, 5, IGNORE], [9, 1, 2]])
    from jaxstable._src._ce_kernel import softmax_cross_entropy_last_axis

    got = jax.jit(
        lambda x, y: softmax_cross_entropy_last_axis(
            x, y, None, IGNORE, 0.1, interpret=True
        )
    )(x, y)
    want = jax.jit(
        lambda x, y: softmax_cross_entropy(
            x, y, ignore_index=IGNORE, label_smoothing=0.1, reduction="none"
        )
    )(x, y)
    assert np.isnan(got[1, 0]) and np.isnan(want[1, 0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("c", "dtype", "weighted", "eps"),
    [
        (19, jnp.bfloat16, False, 0.0),  # rows of 38 bytes
        (150, jnp.float16, True, 0.1),
        (1000, jnp.float32, True, 0.0),
        (32000, jnp.bfloat16, False, 0.1),  # a vocabulary: 32 chunks of 1024
    ],
)
def test_kernel_lowers_for_a_cuda_gpu(c, dtype, weighted, eps):
    # No GPU here, but the kernel's GPU lowering runs in Python: jax.export
    # for platform "cuda" turns forward and backward into Triton IR (custom
    # calls that XLA:GPU compiles). It found two bugs interpret mode cannot:
    # Pallas' default GPU backend (Mosaic GPU) refuses rows that are not a
    # multiple of 16 bytes, and the Triton lowering has no `slice`.
    from jax import export

    def loss(x, y):
        w = jnp.linspace(0.5, 2.0, c, dtype=jnp.float32) if weighted else None
        rows = softmax_cross_entropy_rows(
            x, y, ignore_index=IGNORE, label_smoothing=eps, weights=w
        )
        return rows.sum()

    triton = "__gpu$xla.gpu.triton"
    exported = export.export(
        jax.jit(jax.value_and_grad(loss)),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)],
    )(jax.ShapeDtypeStruct((37, c), dtype), jax.ShapeDtypeStruct((37,), jnp.int32))
    text = exported.mlir_module()
    assert text.count(f"custom_call @{triton}") == 2  # forward and backward
    assert 'name = "_forward_kernel"' in text and 'name = "_backward_kernel"' in text
