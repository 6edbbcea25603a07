"""Any pytree JAX can flatten checkpoints, checksums and resumes bitwise
(issue 21, item 1): an NNX model's ``nnx.State`` with batch norm and a typed
PRNG key resumes through `fit` as the uninterrupted run; FrozenDict,
dataclasses, NamedTuples, None, zero-size arrays, typed keys, complex and
bfloat16 leaves and Python numbers come back with the target's structure
and types, and a damaged one is refused."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import FrozenDict

from jaxstable import loss_scale, train, transforms


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.out = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.bn(self.lin(x)))


_GRAPH, _PARAMS, _STATS = nnx.split(_Net(nnx.Rngs(0)), nnx.Param, nnx.BatchStat)


def _loss(params, model_state, x):
    # The key lives in the model state and moves every step (input noise).
    key, sub = jax.random.split(model_state["key"])
    model = nnx.merge(_GRAPH, params, model_state["stats"], copy=True)
    y = model(x + 0.1 * jax.random.normal(sub, x.shape))
    stats = nnx.state(model, nnx.BatchStat)
    return jnp.mean((y - 1.0) ** 2), {"stats": stats, "key": key}


_STEP = train.make_train_step(_loss, has_state=True)


_TX = transforms.stable_optimizer(optax.adam(1e-2))


def _nnx_state():
    return train.TrainState.create(
        params=_PARAMS,
        optimizer=_TX,
        loss_scale=loss_scale.DynamicLossScale(2.0**4, period=2),
        model_state={"stats": _STATS, "key": jax.random.key(0)},
    )


def _bits(tree):
    """Leaves as bytes (typed keys as their key data), for bitwise equality."""

    def raw(x):
        if jnp.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x).tobytes()

    return [raw(x) for x in jax.tree.leaves(tree)]


def _types(tree):
    return [type(x) for x in jax.tree.leaves(tree)]


def test_an_nnx_model_with_batch_norm_and_a_key_resumes_bitwise(tmp_path):
    rng = np.random.default_rng(0)
    data = [jnp.asarray(rng.normal(size=(8, 3)), jnp.float32) for _ in range(6)]
    data[2] = data[2].at[0, 0].set(jnp.nan)  # a skipped step in between
    kw = {"log": None, "nan_policy": train.NanPolicy.skip(locate_first=0)}
    full, hist = train.fit(_nnx_state(), _STEP, data, **kw)
    ckpt = train.Checkpointing(tmp_path, resume=True)
    train.fit(_nnx_state(), _STEP, data, steps=3, checkpoint=ckpt, **kw)  # killed
    resumed, rest = train.fit(_nnx_state(), _STEP, data, checkpoint=ckpt, **kw)
    assert [r["step"] for r in rest] == [3, 4, 5] and not hist[2]["finite"]
    assert type(resumed.params) is nnx.State
    assert type(resumed.model_state["stats"]) is nnx.State
    assert resumed.model_state["key"].dtype == full.model_state["key"].dtype
    assert jax.tree.structure(resumed) == jax.tree.structure(full)
    assert _bits(resumed) == _bits(full)


@dataclasses.dataclass
class _Pair:
    w: jax.Array
    scale: float


jax.tree_util.register_dataclass(_Pair, data_fields=["w", "scale"], meta_fields=[])


class _Named(typing.NamedTuple):
    x: jax.Array
    count: int


def _key(seed, impl=None, n=None):
    key = jax.random.key(seed, impl=impl)
    return key if n is None else jax.random.split(key, n)


# id -> (saved tree, a target of the same structure with other values)
KINDS = {
    "frozen_dict": (FrozenDict(a={"b": jnp.ones(2)}),
                    FrozenDict(a={"b": jnp.zeros(2)})),
    "dataclass": (_Pair(jnp.arange(3.0), 2.5), _Pair(jnp.zeros(3), 0.0)),
    "named_tuple": (_Named(jnp.ones(1), 4), _Named(jnp.zeros(1), 0)),
    "none_leaves": ({"a": None, "b": (None, jnp.ones(2))},
                    {"a": None, "b": (None, jnp.zeros(2))}),
    "zero_size": ({"z": jnp.ones((0, 3)), "h": jnp.ones((2, 0), jnp.bfloat16)},
                  {"z": jnp.zeros((0, 3)), "h": jnp.zeros((2, 0), jnp.bfloat16)}),
    "typed_keys": ({"k": _key(3), "r": _key(1, "rbg", 2), "e": _key(0, n=0)},
                   {"k": _key(9), "r": _key(2, "rbg", 2), "e": _key(5, n=0)}),
    "complex_bf16": ({"c": jnp.array([1 + 2j, -3j], jnp.complex64),
                      "b": jnp.array([1.5, -2], jnp.bfloat16)},
                     {"c": jnp.zeros(2, jnp.complex64),
                      "b": jnp.zeros(2, jnp.bfloat16)}),
    "numpy_python": ({"n": np.arange(3, dtype=np.int64), "g": np.float32(1.5), "i": 7,
                      "f": 0.25, "t": True},
                     {"n": np.zeros(3, np.int64), "g": np.float32(0), "i": 0, "f": 0.0,
                      "t": False}),
}  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_a_pytree_round_trips_with_the_targets_structure_and_types(tmp_path, kind):
    saved, target = KINDS[kind]
    train.save_checkpoint(tmp_path / "ck", saved)
    restored = train.load_checkpoint(tmp_path / "ck", target)
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    assert _types(restored) == _types(target)
    assert _bits(restored) == _bits(saved)


def _flip_largest(path: Path) -> None:
    target = max(
        (p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    data = bytearray(target.read_bytes())
    data[-len(data) // 3] ^= 0x10
    target.write_bytes(bytes(data))


def test_the_checksum_covers_an_nnx_states_weights(tmp_path):
    state = _nnx_state()
    train.save_checkpoint(tmp_path / "ck", state)
    back = train.load_checkpoint(
        tmp_path / "ck",
        _nnx_state().replace(params=jax.tree.map(jnp.zeros_like, _PARAMS)),
    )
    assert _bits(back.params) == _bits(state.params)
    _flip_largest(tmp_path / "ck")
    with pytest.raises(ValueError, match=r"is corrupt|cannot be read"):
        train.load_checkpoint(tmp_path / "ck", state)


def test_a_leaf_that_is_no_array_is_refused_by_its_path(tmp_path):
    with pytest.raises(TypeError, match="cannot checkpoint opts/name: a str"):
        train.save_checkpoint(
            tmp_path / "ck", {"w": jnp.ones(2), "opts": {"name": "adam"}}
        )


def test_a_format_1_checkpoint_with_one_loss_scale_factor_restores(tmp_path):
    # Format 1 stored DynamicLossScale's single ``factor`` (growth; back-off
    # 1 / factor); today's loss scale has GradScaler's two factors.
    import orbax.checkpoint as ocp
    from flax import serialization

    from jaxstable._src.checkpoint_checks import state_types
    from jaxstable._src.checkpoint_format import _digest_v1

    tx = transforms.stable_optimizer(optax.sgd(0.1))
    saved = train.TrainState.create(
        params={"w": jnp.arange(3.0)}, optimizer=tx,
        loss_scale=loss_scale.DynamicLossScale(jnp.float32(1024.0), period=7),
    )  # fmt: skip
    tree = serialization.to_state_dict(jax.device_get(saved))
    ls = dict(tree["loss_scale"])
    del ls["growth_factor"], ls["backoff_factor"]
    tree["loss_scale"] = {**ls, "factor": 4.0}
    meta = {"format": "jaxstable-checkpoint-1", "step": 3, "data_position": 3,
            "types": {"opt_state": state_types(saved.opt_state)},
            "sha256": _digest_v1(tree)}  # fmt: skip
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)
    )
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(str(tmp_path / "ck"), args=args)
    target = saved.replace(
        params={"w": jnp.zeros(3)},
        loss_scale=loss_scale.DynamicLossScale(period=7, growth_factor=4.0,
                                               backoff_factor=0.25),
    )  # fmt: skip
    out = train.load_checkpoint(tmp_path / "ck", target)
    assert out.params["w"].tolist() == [0.0, 1.0, 2.0]
    assert float(out.loss_scale.loss_scale) == 1024.0
    assert (out.loss_scale.growth_factor, out.loss_scale.backoff_factor) == (4.0, 0.25)
