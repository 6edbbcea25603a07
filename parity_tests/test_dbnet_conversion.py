"""torch DBNet weights converted into the Flax NNX DBNet compute the same thing.

float32 on both sides, on batches of the synthetic OCR data; tolerances from
conftest (`tol("float32")`). Checked: both heads (shrink logits, threshold
map) in eval and train mode, the approximate binary map, the batch-norm
running statistics over three train-mode steps, and the parameter gradients
of the stable DBNet loss (`db_loss`).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from examples.ocr import convert, data, loss_jax, loss_torch, model_jax, model_torch

WIDTH = 8
SIZE = 32


def _perturbed_torch_dbnet(seed=0):
    """Random torch DBNet with non-default BN affine params and running stats."""
    torch.manual_seed(seed)
    model = model_torch.DBNet(width=WIDTH)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5, generator=g)
                m.bias.normal_(0.0, 0.2, generator=g)
                m.running_mean.normal_(0.0, 0.2, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
    return model


def _batch(index=0, n=4):
    return data.batch_at(data.OCRConfig(height=SIZE, width=SIZE), "train", n, index)


_apply = jax.jit(model_jax.apply, static_argnames="train")


def _torch_out(tm, images):
    out = tm(torch.from_numpy(data.to_nchw(images)))
    return {k: v.detach().numpy() for k, v in out.items()}


def test_eval_heads_match(tol):
    tm = _perturbed_torch_dbnet().eval()
    jm = convert.nnx_from_torch(tm)
    images = _batch()["image"]
    got, _ = _apply(*model_jax.split(jm), jnp.asarray(images), train=False)
    want = _torch_out(tm, images)
    assert sorted(got) == sorted(want) == ["logits", "thresh"]
    for key in want:
        chex.assert_trees_all_close(np.asarray(got[key]), want[key], **tol("float32"))


def test_train_heads_binary_map_and_running_stats_match_for_three_steps(tol):
    tm = _perturbed_torch_dbnet().train()
    graphdef, params, stats = model_jax.split(convert.nnx_from_torch(tm))
    t = tol("float32")
    for i in range(3):  # running stats compound over steps: check each one
        images = _batch(index=i)["image"]
        got, stats = _apply(graphdef, params, stats, jnp.asarray(images), train=True)
        want = _torch_out(tm, images)
        for key in ("logits", "thresh"):
            chex.assert_trees_all_close(np.asarray(got[key]), want[key], **t)
        # binary = sigmoid(50 (P - T)) has slope up to 50/4 = 12.5: a float32
        # difference e in P - T becomes 12.5 e, so atol scales by 12.5
        chex.assert_trees_all_close(
            np.asarray(got["binary"]),
            want["binary"],
            rtol=t["rtol"],
            atol=12.5 * t["atol"],
        )
        torch_stats = {
            k: v.numpy()
            for k, v in tm.state_dict().items()
            if k.endswith(("running_mean", "running_var"))
        }
        # stem + 3 stages x 2 + 2 heads = 9 batch norms, mean and var each
        assert len(torch_stats) == 2 * 9
        for key, want_stat in torch_stats.items():
            *parts, name = key.split(".")
            node = stats
            for p in parts:
                node = node[p]
            got_stat = node["mean" if name == "running_mean" else "var"][...]
            chex.assert_trees_all_close(np.asarray(got_stat), want_stat, **t)


def test_db_loss_and_its_parameter_gradients_match(tol):
    tm = _perturbed_torch_dbnet().train()
    graphdef, params, stats = model_jax.split(convert.nnx_from_torch(tm))
    batch = _batch(n=2)
    maps_j = {k: jnp.asarray(batch[k]) for k in data.MAP_KEYS}
    maps_t = {k: torch.from_numpy(batch[k]) for k in data.MAP_KEYS}

    def loss_fn(p):
        out, _ = model_jax.apply(
            graphdef, p, stats, jnp.asarray(batch["image"]), train=True
        )
        return loss_jax.stable_loss(out, maps_j)[0]

    loss_j, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    loss_t, _ = loss_torch.stable_loss(
        tm(torch.from_numpy(data.to_nchw(batch["image"]))), maps_t
    )
    loss_t.backward()
    t = tol("float32")
    chex.assert_trees_all_close(float(loss_j), loss_t.item(), **t)

    # torch's gradients through the weight converter: the same layouts
    grad_sd = dict(tm.state_dict())
    grad_sd.update({name: p.grad for name, p in tm.named_parameters()})
    twin = model_torch.DBNet(width=WIDTH)
    twin.load_state_dict(grad_sd)
    _, want, _ = model_jax.split(convert.nnx_from_torch(twin))
    # Each entry sums N*H*W = 2048 pixel terms of both signs (see
    # test_unet_conversion): compare each tensor's error in norm.
    flat_got, flat_want = nnx.to_flat_state(grads), nnx.to_flat_state(want)
    assert len(flat_got) == len(list(tm.parameters()))
    for (path, g), (_, w) in zip(flat_got, flat_want, strict=True):
        g, w = np.asarray(g[...]), np.asarray(w[...])
        err, ref = np.linalg.norm(g - w), np.linalg.norm(w)
        assert np.isfinite(ref) and ref > 0, path
        assert err <= t["rtol"] * ref + t["atol"], (path, err, ref)


def _head_outputs(dtype_np):
    """A freshly initialised torch DBNet's train-mode heads on a data batch."""
    torch.manual_seed(0)
    tm = model_torch.DBNet(width=WIDTH).train()
    batch = _batch(n=4)
    out = _torch_out(tm, batch["image"])
    maps = {k: batch[k] for k in data.MAP_KEYS}
    return out["logits"].astype(dtype_np), out["thresh"].astype(dtype_np), maps


def test_naive_loss_in_float32_equals_db_loss_in_both_frameworks(tol):
    """The naive recipe differs from the stable one by its dtype, not its maths."""
    logits, thresh, maps = _head_outputs(np.float32)
    t = tol("float32")
    jax_out = {"logits": jnp.asarray(logits), "thresh": jnp.asarray(thresh)}
    torch_out = {"logits": torch.from_numpy(logits), "thresh": torch.from_numpy(thresh)}
    jmaps = {k: jnp.asarray(v) for k, v in maps.items()}
    tmaps = {k: torch.from_numpy(v) for k, v in maps.items()}
    stable, _ = loss_jax.stable_loss(jax_out, jmaps)
    for value in (
        loss_jax.naive_loss(jax_out, jmaps)[0],
        loss_torch.naive_loss(torch_out, tmaps)[0],
        loss_torch.stable_loss(torch_out, tmaps)[0],
    ):
        chex.assert_trees_all_close(float(value), float(stable), **t)


def test_naive_float16_step_gradient_is_nan_exactly_where_exp_overflows():
    """The observed failure: exp(-50 (P - T)) > 65504 -> 0 * inf in its backward."""
    logits, thresh, maps = _head_outputs(np.float16)
    jmaps = {k: jnp.asarray(v) for k, v in maps.items()}
    tmaps = {k: torch.from_numpy(v) for k, v in maps.items()}

    def jax_loss(t):
        return loss_jax.naive_loss({"logits": jnp.asarray(logits), "thresh": t}, jmaps)[
            0
        ]

    g_jax = np.asarray(jax.grad(jax_loss)(jnp.asarray(thresh)))
    t_thresh = torch.from_numpy(thresh).requires_grad_()
    loss_t, _ = loss_torch.naive_loss(
        {"logits": torch.from_numpy(logits), "thresh": t_thresh}, tmaps
    )
    loss_t.backward()
    g_torch = t_thresh.grad.numpy()

    # float16 exp overflows above ln(65504) = 11.09, i.e. where P - T < -0.2218
    p_jax = jax.nn.sigmoid(jnp.asarray(logits))
    over_jax = np.asarray(jnp.isinf(jnp.exp(-50 * (p_jax - jnp.asarray(thresh)))))
    p_torch = torch.sigmoid(torch.from_numpy(logits))
    over_torch = torch.isinf(torch.exp(-50 * (p_torch - torch.from_numpy(thresh))))
    assert 0 < over_jax.sum() < over_jax.size  # an untrained model has both
    np.testing.assert_array_equal(np.isnan(g_jax), over_jax)
    np.testing.assert_array_equal(np.isnan(g_torch), over_torch.numpy())
    assert np.isfinite(loss_t.item())  # the forward value is still finite
