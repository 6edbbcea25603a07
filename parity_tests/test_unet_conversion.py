"""torch U-Net weights converted into the Flax NNX U-Net compute the same thing.

float32 on both sides; tolerances from conftest (`tol("float32")`).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from examples.common.data import to_nhwc
from examples.segmentation import convert, data, model_jax, model_torch

ARCH = dict(in_channels=3, num_classes=5, width=8, depth=2)


def _perturbed_torch_unet(seed=0, **arch):
    """Random torch U-Net with non-default BN affine params and running stats."""
    torch.manual_seed(seed)
    model = model_torch.UNet(**(arch or ARCH))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5, generator=g)
                m.bias.normal_(0.0, 0.2, generator=g)
                m.running_mean.normal_(0.0, 0.2, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
    return model


def _converted(tm, dtype=None):
    return convert.nnx_from_torch(tm, dtype=dtype)


def _images(n=4, size=32, seed=0):
    return np.random.default_rng(seed).normal(size=(n, size, size, 3)).astype("f4")


_apply = jax.jit(model_jax.apply, static_argnames="train")


def _jax_out(jm, x_nhwc, *, train):
    """Jitted forward (eager NNX dispatch is op by op: slow on CPU)."""
    logits, new_stats = _apply(*model_jax.split(jm), jnp.asarray(x_nhwc), train=train)
    nnx.update(jm, new_stats)
    return np.asarray(logits.astype(jnp.float32))


def _torch_out(tm, x_nhwc):
    y = tm(torch.from_numpy(data.to_nchw(x_nhwc)))
    return to_nhwc(y.detach().numpy())


def test_eval_forward_matches(tol):
    tm = _perturbed_torch_unet().eval()
    jm = _converted(tm)
    x = _images()
    got = _jax_out(jm, x, train=False)
    chex.assert_trees_all_close(got, _torch_out(tm, x), **tol("float32"))


def test_train_forward_and_running_stats_match_for_three_steps(tol):
    tm = _perturbed_torch_unet().train()
    graphdef, params, stats = model_jax.split(_converted(tm))
    for i in range(3):  # running stats compound over steps: check each one
        x = _images(seed=i)
        logits, stats = _apply(graphdef, params, stats, jnp.asarray(x), train=True)
        chex.assert_trees_all_close(
            np.asarray(logits), _torch_out(tm, x), **tol("float32")
        )
        torch_stats = {
            k: v.numpy()
            for k, v in tm.state_dict().items()
            if k.endswith(("running_mean", "running_var"))
        }
        assert len(torch_stats) == 2 * 2 * (2 * ARCH["depth"] + 1)
        for key, want in torch_stats.items():
            *parts, name = key.split(".")
            node = stats
            for p in parts:
                node = node[int(p) if p.isdigit() else p]
            got = node["mean" if name == "running_mean" else "var"][...]
            chex.assert_trees_all_close(np.asarray(got), want, **tol("float32"))


def test_flax_style_biased_running_var_would_not_match(tol):
    """The reason for model_jax.BatchNorm: nnx.BatchNorm's biased update differs."""
    tm = _perturbed_torch_unet().train()
    jm = _converted(tm)
    for _, m in nnx.iter_modules(jm):
        if isinstance(m, model_jax.BatchNorm):
            m.unbiased_running_var = False
    x = _images()
    _jax_out(jm, x, train=True)
    _torch_out(tm, x)
    # bottleneck: n = 4 * 8 * 8 = 256 values per channel, so one update of
    # momentum 0.1 moves the running variance by 0.1/255 = 4e-4 relative
    got = np.asarray(jm.bottleneck.bn1.var[...])
    want = tm.bottleneck.bn1.running_var.numpy()
    assert not np.allclose(got, want, **tol("float32"))


def test_parameter_gradients_match(tol):
    tm = _perturbed_torch_unet().train()
    graphdef, params, stats = model_jax.split(_converted(tm))
    x = _images(n=2)
    weights = np.random.default_rng(7).normal(size=(2, 32, 32, 5)).astype("f4")

    def loss(p):
        logits, _ = model_jax.apply(graphdef, p, stats, jnp.asarray(x), train=True)
        return jnp.sum(logits * weights)

    grads = jax.jit(jax.grad(loss))(params)
    y = tm(torch.from_numpy(data.to_nchw(x)))
    (y * torch.from_numpy(data.to_nchw(weights))).sum().backward()
    # Convert torch's gradients with the weight converter itself: same layouts.
    grad_sd = dict(tm.state_dict())
    grad_sd.update({name: p.grad for name, p in tm.named_parameters()})
    _, want, _ = model_jax.split(_converted(tm_from_state(grad_sd)))
    # Each gradient entry is a sum over N*H*W = 2048 pixels of terms of both
    # signs, so its float32 rounding is relative to the sum of |terms|, not to
    # the (possibly cancelled) entry: compare each tensor's error in norm,
    # ||g_jax - g_torch|| <= rtol * ||g_torch|| + atol.
    t = tol("float32")
    flat_got, flat_want = nnx.to_flat_state(grads), nnx.to_flat_state(want)
    assert len(flat_got) == len(list(tm.parameters()))
    for (path, g), (_, w) in zip(flat_got, flat_want, strict=True):
        g, w = np.asarray(g[...]), np.asarray(w[...])
        err, ref = np.linalg.norm(g - w), np.linalg.norm(w)
        assert err <= t["rtol"] * ref + t["atol"], (path, err, ref)


def tm_from_state(state_dict):
    tm = model_torch.UNet(**ARCH)
    tm.load_state_dict(state_dict)
    return tm


def test_transposed_conv_kernel_needs_the_spatial_flip(tol):
    """Without the flip the upsampling differs: the conversion rule is real."""
    torch.manual_seed(0)
    up = torch.nn.ConvTranspose2d(4, 3, kernel_size=2, stride=2)
    ju = nnx.ConvTranspose(
        4, 3, kernel_size=(2, 2), strides=(2, 2), padding="VALID", rngs=nnx.Rngs(0)
    )
    x = np.random.default_rng(0).normal(size=(1, 5, 5, 4)).astype("f4")
    want = to_nhwc(up(torch.from_numpy(data.to_nchw(x))).detach().numpy())
    ju.bias[...] = jnp.asarray(up.bias.detach().numpy())
    ju.kernel[...] = jnp.asarray(convert.convert_array(ju, "weight", up.weight))
    chex.assert_trees_all_close(np.asarray(ju(jnp.asarray(x))), want, **tol("float32"))
    unflipped = up.weight.detach().numpy().transpose(2, 3, 0, 1)
    ju.kernel[...] = jnp.asarray(unflipped)
    assert not np.allclose(np.asarray(ju(jnp.asarray(x))), want, **tol("float32"))


def _abstract_jax_unet(**arch):
    # shapes only: real random init compiles one initialiser per shape (slow)
    return nnx.eval_shape(lambda: model_jax.UNet(**arch, rngs=nnx.Rngs(0)))


def test_converter_rejects_a_model_of_another_width():
    tm = model_torch.UNet(width=8)
    jm = _abstract_jax_unet(width=4)
    with pytest.raises(ValueError, match="shape"):
        convert.torch_to_nnx(tm, jm)


def test_converter_reports_variables_left_unset():
    tm = model_torch.UNet(width=4)
    state = {k: v for k, v in tm.state_dict().items() if k != "head.bias"}
    with pytest.raises(KeyError, match=r"head\.bias"):
        convert.torch_to_nnx(state, _abstract_jax_unet(width=4))


def test_converter_rejects_a_deeper_torch_model():
    tm = model_torch.UNet(width=4, depth=3)
    with pytest.raises(KeyError, match="no submodule"):
        convert.torch_to_nnx(tm, _abstract_jax_unet(width=4, depth=2))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_compute_keeps_float32_params(dtype, tol):
    """dtype= is the compute dtype; params and batch stats stay float32."""
    tm = _perturbed_torch_unet().eval()
    jm = _converted(tm, dtype=dtype)
    _, params, stats = model_jax.split(jm)
    leaves = jax.tree.leaves((params, stats))
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype("float32")}
    x = _images()
    logits, _ = _apply(*model_jax.split(jm), jnp.asarray(x), train=False)
    assert logits.dtype == jnp.dtype(dtype)
    got = np.asarray(logits.astype(jnp.float32))
    want = _torch_out(tm, x)
    # compute in `dtype` vs torch in float32: `dtype`'s tolerance class
    chex.assert_trees_all_close(got, want, **tol(dtype))
