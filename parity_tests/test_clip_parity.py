"""clip_by_global_norm vs torch clip_grad_norm_: clipped grads and pre-clip norm."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import torch_device
from jaxstable import transforms

DEV = torch_device()  # CUDA when present: both frameworks on the GPU

_SHAPES = {"conv": (3, 3, 4, 8), "bias": (8,), "dense": (32, 10), "scalar": ()}


def _grads(dtype_name, scale, seed=0):
    rng = np.random.default_rng(seed)
    return {
        k: (rng.standard_normal(s) * scale).astype(np.float32)
        for k, s in _SHAPES.items()
    }


def _torch_clip(grads, dtype, max_norm):
    params = []  # in jax's (sorted) dict-key order
    for _, g in sorted(grads.items()):
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=dtype, device=DEV))
        p.grad = torch.from_numpy(np.array(g)).to(DEV, dtype)
        params.append(p)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm, [p.grad for p in params]


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(
    ("scale", "max_norm"), [(0.01, 1.0), (5.0, 1.0), (300.0, 10.0)]
)
def test_clip_matches_clip_grad_norm_(dtype_name, scale, max_norm, tol):
    grads32 = _grads(dtype_name, scale)
    jdtype = jnp.dtype(dtype_name)
    tdtype = getattr(torch, dtype_name)
    # Both sides start from the same low-precision values.
    jgrads = {k: jnp.asarray(v).astype(jdtype) for k, v in grads32.items()}
    start = {k: np.asarray(v.astype(jnp.float32)) for k, v in jgrads.items()}

    t_norm, t_clipped = _torch_clip(start, tdtype, max_norm)
    tx = transforms.clip_by_global_norm(max_norm)
    clipped, _ = tx.update(jgrads, tx.init(jgrads))
    norm = transforms.global_norm(jgrads)

    assert norm.dtype == jnp.float32
    ref_norm = float(np.sqrt(sum(np.sum(np.float64(v) ** 2) for v in start.values())))
    # Our norm is accumulated in float32 whatever the grad dtype: float32-close
    # to the float64 norm; torch returns its norm in the grad dtype.
    np.testing.assert_allclose(float(norm), ref_norm, **tol("float32"))
    np.testing.assert_allclose(float(norm), t_norm.float().item(), **tol(dtype_name))

    for (k, c), t in zip(sorted(clipped.items()), t_clipped, strict=True):
        assert c.dtype == jdtype, k
        c32 = np.asarray(c.astype(jnp.float32))
        t32 = t.float().cpu().numpy()
        if ref_norm < max_norm:  # coef clamps to 1: unchanged bit for bit
            np.testing.assert_array_equal(c32, start[k])
            np.testing.assert_array_equal(t32, start[k])
        else:
            np.testing.assert_allclose(c32, t32, **tol(dtype_name))
    if ref_norm >= max_norm:
        clipped_norm = float(transforms.global_norm(clipped))
        np.testing.assert_allclose(clipped_norm, max_norm, **tol(dtype_name))


def test_clip_float32_tight_on_many_draws(tol):
    # float32 grads over many seeds and thresholds around the norm itself.
    for seed in range(20):
        grads = _grads("float32", 1.0, seed)
        ref = float(np.sqrt(sum(np.sum(np.float64(v) ** 2) for v in grads.values())))
        for max_norm in (0.5 * ref, ref * 0.999, ref * 1.001, 2 * ref):
            t_norm, t_clipped = _torch_clip(grads, torch.float32, max_norm)
            tx = transforms.clip_by_global_norm(max_norm)
            jg = {k: jnp.asarray(v) for k, v in grads.items()}
            clipped, _ = tx.update(jg, tx.init(jg))
            np.testing.assert_allclose(
                float(transforms.global_norm(jg)), t_norm.item(), **tol("float32")
            )
            for c, t in zip(
                [clipped[k] for k in sorted(clipped)], t_clipped, strict=True
            ):
                np.testing.assert_allclose(
                    np.asarray(c), t.cpu().numpy(), **tol("float32")
                )
