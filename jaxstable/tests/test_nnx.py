"""Flax NNX through the guarded step: `TrainState.from_nnx` + `nnx_loss`.

Batch norm and dropout state through `make_train_step` without
``nnx.merge(..., copy=True)``; on a skipped step the statistics stay and the
RNG streams advance (a mask-dependent NaN is skipped once).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxstable import train, transforms


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(self.bn(self.fc(x))))


def _mse(model, x):
    return jnp.mean(model(x) ** 2)


@pytest.fixture(scope="module")
def net():
    model = _Net(nnx.Rngs(0, dropout=1))
    step = train.make_train_step(train.nnx_loss(model, _mse), has_state=True)
    return model, step


def _count(state):
    return int(state.model_state["drop"]["rngs"]["count"][...])


def test_batch_norm_and_dropout_through_make_train_step(net):
    model, step = net
    tx = transforms.stable_optimizer(optax.sgd(0.1, momentum=0.9))
    state = train.TrainState.from_nnx(model, tx)
    x = jnp.arange(24.0).reshape(8, 3) / 10
    state, m = step(state, x)  # an applied step moves the statistics
    assert bool(m["finite"]) and _count(state) == 1
    assert not np.allclose(state.model_state["bn"]["mean"][...], 0.0)

    new, m = step(state, x.at[2, 1].set(jnp.nan))
    assert not bool(m["finite"]) and int(new.skipped_total) == 1
    # params, momentum and batch statistics bitwise unchanged...
    chex.assert_trees_all_equal(
        (new.params, new.opt_state.inner_state, new.model_state["bn"]),
        (state.params, state.opt_state.inner_state, state.model_state["bn"]),
    )
    assert _count(new) == 2  # ... the dropout stream advanced

    new, m = step(new, x)
    assert bool(m["finite"]) and _count(new) == 3
    chex.assert_tree_all_finite((new.params, new.opt_state, new.model_state["bn"]))
    nnx.update(model, new.params, new.model_state)  # back into the module
    np.testing.assert_array_equal(
        model.bn.mean[...], new.model_state["bn"]["mean"][...]
    )


def test_from_nnx_wrt_and_errors():
    model = _Net(nnx.Rngs(0))
    state = train.TrainState.from_nnx(model, optax.sgd(0.1), wrt=nnx.BatchStat)
    assert sorted(state.params["bn"]) == ["mean", "var"]
    with pytest.raises(TypeError, match=r"needs a flax\.nnx\.Module"):
        train.TrainState.from_nnx({"w": jnp.ones(2)}, optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"needs a flax\.nnx\.Module"):
        train.nnx_loss(lambda x: x, _mse)
    with pytest.raises(TypeError, match="loss must be callable"):
        train.nnx_loss(model, "mse")


class _Masked(nnx.Module):
    """``w * log(dropout(x))``: -inf, with a -inf gradient, when the single
    element is dropped."""

    def __init__(self, rngs):
        self.w = nnx.Param(jnp.ones(1))
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return jnp.sum(self.w[...] * jnp.log(self.drop(x)))


def test_mask_dependent_nan_is_skipped_once_nnx():
    # Seed 3: the first mask drops the element, the second keeps it. On a
    # skip the stream must move on, or the same mask fails forever.
    model = _Masked(nnx.Rngs(dropout=3))
    state = train.TrainState.from_nnx(
        model, transforms.stable_optimizer(optax.sgd(0.1))
    )
    step = train.make_train_step(
        train.nnx_loss(model, lambda m, x: m(x)), has_state=True
    )
    finite = []
    for _ in range(2):
        state, m = step(state, jnp.ones(1))
        finite.append(bool(m["finite"]))
    assert finite == [False, True]
    assert int(state.skipped_total) == 1


def test_mask_dependent_nan_is_skipped_once_typed_key():
    # The same with a typed key in model_state (no NNX): seed 4 drops, keeps.
    def loss_fn(w, key, x):
        key, sub = jax.random.split(key)
        keep = jax.random.bernoulli(sub, 0.5, x.shape)
        return jnp.sum(w * jnp.log(jnp.where(keep, x, 0.0))), key

    step = train.make_train_step(loss_fn, has_state=True)
    state = train.TrainState.create(
        params=jnp.ones(1), optimizer=optax.sgd(0.1), model_state=jax.random.key(4)
    )
    first, m1 = step(state, jnp.ones(1))
    _, m2 = step(first, jnp.ones(1))
    assert (bool(m1["finite"]), bool(m2["finite"])) == (False, True)
    # the key moved on over the skipped step
    assert bool(
        jnp.any(
            jax.random.key_data(first.model_state)
            != jax.random.key_data(state.model_state)
        )
    )


def test_model_state_structure_mismatch_is_named():
    def loss_fn(w, ms, x):
        return jnp.sum(w * x), {"other": ms["stat"]}

    step = train.make_train_step(loss_fn, has_state=True)
    state = train.TrainState.create(
        params=jnp.ones(1), optimizer=optax.sgd(0.1), model_state={"stat": jnp.ones(1)}
    )
    with pytest.raises(ValueError, match="model state whose structure differs"):
        step(state, jnp.ones(1))
