"""Dropout and the skip decision, the same in both frameworks (issue 27.14/15).

* A non-finite LOSS makes the step non-finite even when every gradient is
  finite (``log`` of an element a mask zeroed is -inf, and the mask zeroes
  its gradient): skipped, counted, and the loss scale backs off, in JAX and
  in torch alike.
* A NaN that depends on the dropout mask is skipped once: the RNG moves on
  over a skipped step (torch's generator always did; JAX's RNG streams in
  ``model_state`` now do, see jaxstable/tests/test_nnx.py).
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from jaxstable import loss_scale as jls
from jaxstable import train as jtrain
from jaxstable import transforms
from torchref import loss_scale as tls
from torchref import train as ttrain

_X = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
_MASKS = [
    np.array([1, 0, 1, 1], bool),  # one element masked: loss -inf, grads finite
    np.ones(4, bool),
]


def _jax_run(scaler):
    def loss_fn(w, batch):
        x, keep = batch
        return jnp.mean(jnp.log(jnp.where(keep, w * x, 0.0)))

    ls = jls.DynamicLossScale(2.0**10) if scaler else None
    state = jtrain.TrainState.create(
        params=jnp.ones(4),
        optimizer=transforms.stable_optimizer(optax.sgd(0.1)),
        loss_scale=ls,
    )
    step = jtrain.make_train_step(loss_fn)
    out = []
    for keep in _MASKS:
        state, m = step(state, (jnp.asarray(_X), jnp.asarray(keep)))
        out.append(
            (
                float(m["loss"]),
                bool(m["finite"]),
                int(m["skipped_total"]),
                float(m["loss_scale"]),
                np.asarray(state.params),
            )
        )
    return out


def _torch_run(scaler):
    w = torch.nn.Parameter(torch.ones(4))
    model = torch.nn.Module()
    model.w = w

    def loss_fn(m, batch):
        x, keep = batch
        return torch.log(torch.where(keep, m.w * x, torch.zeros_like(x))).mean()

    step = ttrain.TrainStep(
        model,
        torch.optim.SGD([w], lr=0.1),
        loss_fn,
        scaler=tls.DynamicLossScale(2.0**10) if scaler else None,
    )
    out = []
    for keep in _MASKS:
        m = step((torch.from_numpy(_X), torch.from_numpy(keep)))
        out.append(
            (
                m["loss"],
                m["finite"],
                m["skipped_total"],
                m["loss_scale"],
                w.detach().numpy().copy(),
            )
        )
    return out


@pytest.mark.parametrize("scaler", [False, True])
def test_non_finite_loss_with_finite_gradients_is_skipped_alike(scaler):
    jax_out, torch_out = _jax_run(scaler), _torch_run(scaler)
    for (jl, jf, js, jscale, jp), (tl, tf, ts, tscale, tp) in zip(
        jax_out, torch_out, strict=True
    ):
        assert jl == tl or (np.isnan(jl) and np.isnan(tl)), (jl, tl)
        assert (jf, js, jscale) == (tf, ts, tscale)
        np.testing.assert_allclose(jp, tp, rtol=1e-6)
    # The -inf step was skipped (params untouched, scale backed off), the
    # next one applied.
    assert jax_out[0][0] == -np.inf
    assert [o[1] for o in jax_out] == [False, True]
    np.testing.assert_array_equal(jax_out[0][4], np.ones(4))
    assert [o[3] for o in jax_out] == ([1024.0, 512.0] if scaler else [1.0, 1.0])


def test_inf_loss_from_nnx_dropout_is_skipped():
    # The case of issue 27.15: nnx.Dropout zeroes an element, log gives -inf,
    # and the mask (a select) zeroes its inf gradient: all gradients finite.
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.ones(4))
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return jnp.mean(jnp.log(self.drop(self.w[...] * x)))

    model = Net(nnx.Rngs(dropout=0))
    state = jtrain.TrainState.from_nnx(
        model, transforms.stable_optimizer(optax.sgd(0.1))
    )
    step = jtrain.make_train_step(
        jtrain.nnx_loss(model, lambda m, x: m(x)), has_state=True
    )
    grads = step.grads(state, jnp.asarray(_X))
    new, m = step(state, jnp.asarray(_X))
    assert float(m["loss"]) == -np.inf  # seed 0 drops an element
    assert bool(jnp.all(jnp.isfinite(grads["w"][...])))
    assert not bool(m["finite"]) and int(m["skipped_total"]) == 1
    np.testing.assert_array_equal(new.params["w"][...], np.ones(4))


def test_mask_dependent_nan_is_skipped_once_torch():
    # The torch half of jaxstable/tests/test_nnx.py's test: torch's global
    # generator, seed 2, drops the element on the first draw, keeps it on the
    # second; a skipped step does not rewind it.
    torch.manual_seed(2)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.ones(1))
    model.drop = torch.nn.Dropout(0.5)

    def loss_fn(m, x):
        return (m.w * torch.log(m.drop(x))).sum()

    step = ttrain.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
    finite = [step(torch.ones(1))["finite"] for _ in range(2)]
    assert finite == [False, True]
