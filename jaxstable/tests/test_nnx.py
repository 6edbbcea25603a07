"""Flax NNX through the guarded step: `TrainState.from_nnx` + `nnx_loss`.

Batch norm and dropout state through `make_train_step` without
``nnx.merge(..., copy=True)``; on a skipped step the statistics stay and the
RNG streams advance (a mask-dependent NaN is skipped once).
"""

import warnings

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


# ------------------------------------------------ a policy the model ignores
class _Block(nnx.Module):
    def __init__(self, d, rngs, dtype):
        self.ln = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, d, dtype=dtype, decode=False, rngs=rngs)
        self.mlp = nnx.Linear(d, d, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        h = self.ln(x)
        x = x + self.attn(h, h)
        return x + self.mlp(x)


class _LM(nnx.Module):
    """A transformer as users write it: nnx.Embed first."""

    def __init__(self, rngs, dtype=None, vocab=11, d=8):
        self.embed = nnx.Embed(vocab, d, dtype=dtype, rngs=rngs)
        self.block = _Block(d, rngs, dtype)
        self.head = nnx.Linear(d, vocab, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.block(self.embed(tokens)))


def _lm_loss(model, tokens):
    logits = model(tokens).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()


def _lm_step(model, **kw):
    state = train.TrainState.from_nnx(model, optax.sgd(0.1))
    step = train.make_train_step(train.nnx_loss(model, _lm_loss), has_state=True, **kw)
    return state, step


def test_policy_ignored_by_nnx_embed_warns_once_naming_it():
    from jaxstable import precision

    state, step = _lm_step(_LM(nnx.Rngs(0)), policy="mixed_bfloat16")
    tokens = jnp.zeros((2, 5), jnp.int32)
    with pytest.warns(precision.PolicyNotAppliedWarning) as got:
        state, m = step(state, tokens)
    assert bool(m["finite"])
    # nnx.Embed's dtype is its embedding's float32: every matmul after it too.
    assert set(step.compute_dtypes) == {"float32"}, step.compute_dtypes
    text = str(got[0].message)
    assert "only 0 of the 24 matmuls" in text, text
    assert "params.embed.embedding" in text and "Embed.__call__" in text, text
    assert "self.embed(tokens)" in text and "dtype=None" in text, text


@pytest.mark.parametrize("fix", ["embed_dtype_none", "dtype_bf16"])
def test_policy_applied_does_not_warn(fix):
    from jaxstable import precision

    model = _LM(nnx.Rngs(0), dtype=jnp.bfloat16 if fix == "dtype_bf16" else None)
    if fix == "embed_dtype_none":
        model.embed.dtype = None
    state, step = _lm_step(model, policy="mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", precision.PolicyNotAppliedWarning)
        step(state, jnp.zeros((2, 5), jnp.int32))
    counts = step.compute_dtypes
    assert counts["bfloat16"] >= 0.9 * sum(counts.values()), counts


@pytest.mark.parametrize("jit", [True, False])
def test_policy_audit_of_a_plain_loss(jit):
    from jaxstable import precision

    def loss(p, b):
        h = (b @ p["w"]).astype(jnp.float32)  # the user's own upcast
        return jnp.sum(h @ p["v"])

    params = {"w": jnp.ones((3, 4)), "v": jnp.ones((4, 2))}
    state = train.TrainState.create(params=params, optimizer=optax.sgd(0.1))
    step = train.make_train_step(loss, policy="mixed_float16", jit=jit)
    with pytest.warns(precision.PolicyNotAppliedWarning, match="only 2 of the 5") as w:
        state, _ = step(state, jnp.ones((2, 3)))
    # forward h @ v and both its gradients in float32, b @ w and its
    # gradient in float16
    assert step.compute_dtypes == {"float16": 2, "float32": 3}
    text = str(w[0].message)
    assert "convert_element_type on batch, params.w at " in text, text
    assert "test_nnx.py" in text and ".astype(jnp.float32)  # the user" in text, text
    with warnings.catch_warnings():  # once per step, also on a re-trace
        warnings.simplefilter("error", precision.PolicyNotAppliedWarning)
        step(state, jnp.ones((4, 3)))


def test_merge_of_outer_variables_names_the_fixes():
    """Issue 35 item 6: ``nnx.merge(graphdef, params, stats)`` in a
    has_state loss raised flax's bare "Cannot mutate BatchStat from a
    different trace level"; the step re-raises it with the two fixes,
    chained from flax's error. The second fix (copy=True) then trains."""
    import flax.errors

    model = _Net(nnx.Rngs(0))
    model.eval()  # no dropout: only the batch norm mutates (in train mode)
    model.bn.use_running_average = False
    graphdef, params, stats = nnx.split(model, nnx.Param, ...)

    def loss_fn(copy):
        def loss(p, s, x):
            m = nnx.merge(graphdef, p, s, copy=copy)
            return jnp.mean(m(x) ** 2), nnx.split(m, nnx.Param, ...)[2]

        return loss

    state = train.TrainState.create(
        params=params, optimizer=optax.sgd(0.1), model_state=stats
    )
    x = jnp.ones((4, 3))
    step = train.make_train_step(loss_fn(False), has_state=True)
    with pytest.raises(flax.errors.TraceContextError) as err:
        step(state, x)
    text = str(err.value)
    assert "train.nnx_loss(model, loss)" in text, text
    assert "nnx.merge(graphdef, params, model_state, copy=True)" in text, text
    assert isinstance(err.value.__cause__, flax.errors.TraceContextError)
    assert "Cannot mutate BatchStat" in str(err.value.__cause__)
    step = train.make_train_step(loss_fn(True), has_state=True)
    new, m = step(state, x)
    assert bool(m["finite"])
    assert not bool(jnp.all(new.model_state["bn"]["mean"][...] == 0.0))
