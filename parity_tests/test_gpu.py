"""The same checks on a CUDA device, when one is present (skipped otherwise).

On a GPU the root conftest sets `jax_default_matmul_precision="highest"` and
disables TF32 in torch, so parity stays at the CPU tolerances.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import has_conditional, tolerance
from jaxstable import loss_scale as jls
from jaxstable import losses as jl
from jaxstable import train as jtrain
from jaxstable import transforms as jtx

pytestmark = pytest.mark.gpu


def _inputs(dtype, shape=(4, 32, 32), n_classes=19, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 4.0, (*shape, n_classes)).astype(np.float32)
    y = rng.integers(0, n_classes, shape).astype(np.int32)
    y[rng.random(shape) < 0.1] = 255
    return x, y


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cross_entropy_parity_on_cuda(dtype):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    from torchref import losses as tl

    x, y = _inputs(dtype)
    jx = jax.device_put(jnp.asarray(x).astype(dtype))
    value, grad = jax.value_and_grad(
        lambda v: jl.softmax_cross_entropy(v, jnp.asarray(y), ignore_index=255)
    )(jx)
    tx = torch.tensor(x).to(getattr(torch, dtype)).cuda().permute(0, 3, 1, 2)
    tx = tx.detach().requires_grad_(True)
    tloss = tl.softmax_cross_entropy(
        tx, torch.tensor(y, dtype=torch.int64).cuda(), ignore_index=255
    )
    tloss.backward()
    assert value.dtype == jnp.float32 and tloss.dtype == torch.float32
    tol = tolerance(dtype)
    np.testing.assert_allclose(float(value), tloss.item(), **tolerance("float32"))
    tgrad = tx.grad.permute(0, 2, 3, 1).float().cpu().numpy()
    chex.assert_trees_all_close(np.asarray(grad.astype(jnp.float32)), tgrad, **tol)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cross_entropy_stores_no_float32_copy_on_gpu(dtype):
    x, y = _inputs(dtype, shape=(8, 64, 64))
    jx = jnp.asarray(x).astype(dtype)

    def loss(v, lab):
        return jl.softmax_cross_entropy(v, lab, ignore_index=255)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(jx, jnp.asarray(y)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < jx.size * 4 / 2, (temp, jx.size * 4)


def test_guarded_step_on_gpu_has_no_conditional_and_no_transfer():
    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((x @ params["w"] - y) ** 2)

    tx = jtx.stable_optimizer(optax.adam(1e-3), max_grad_norm=1.0)
    state = jtrain.TrainState.create(
        params={"w": jnp.ones((8, 1))},
        optimizer=tx,
        # loss 49 x 2**8 fits fp16 (max 65504); the default 2**16 would
        # overflow and (correctly) skip the first steps
        loss_scale=jls.DynamicLossScale(loss_scale=2.0**8),
    )
    step = jtrain.make_train_step(loss_fn, policy="p=f32,c=f16,o=f32")
    batch = jax.device_put((jnp.ones((16, 8)), jnp.ones((16, 1))))
    assert not has_conditional(step.lower(state, batch))
    state, _ = step(state, batch)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        state, metrics = step(state, batch)
    assert bool(metrics["finite"])
