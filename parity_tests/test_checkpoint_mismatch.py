"""The table of checkpoint mismatches: each one is refused at load time, in both
frameworks, with a ValueError naming the file and the mismatch (saved, then
expected); a matching checkpoint still restores every field bit for bit."""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import serialization

from jaxstable import loss_scale as jls
from jaxstable import train as jtrain
from jaxstable import transforms as jtransforms
from torchref import loss_scale as tls
from torchref import train as ttrain

# The model of a case: params named `keys` of `shape`/`dtype`, an optimizer, a
# loss scale and, with `bn`, batch statistics over `bn` channels.
BASE = {
    "opt": "adam",
    "ls": "dynamic",
    "shape": (2, 3),
    "dtype": "float32",
    "keys": ("w",),
    "bn": None,
}

# Non-default loss-scale fields, so that losing one would show.
JAX_SCALES = {
    "noop": jls.NoOpLossScale,
    "static": lambda: jls.StaticLossScale(8.0),
    "dynamic": lambda: jls.DynamicLossScale(
        2.0**10, period=3, hysteresis=2, min_loss_scale=4.0
    ),
}
TORCH_SCALES = {
    "noop": tls.NoOpLossScale,
    "static": lambda: tls.StaticLossScale(8.0),
    "dynamic": lambda: tls.DynamicLossScale(
        2.0**10, period=3, hysteresis=2, min_loss_scale=4.0
    ),
    "grad_scaler": lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10),
}
# How each framework names what the checkpoint holds / the target has.
NAMES = {
    "jax": {
        "noop": "NoOpLossScale",
        "static": "StaticLossScale",
        "dynamic": "DynamicLossScale",
        "adam": r"SkipNonFiniteState\(\(ScaleByAdamState, EmptyState\)\)",
        "sgd": r"SkipNonFiniteState\(\(EmptyState, EmptyState\)\)",
        "param": "params/{k}",
        "bn_mean": "model_state/batch_stats/bn/mean",
    },
    "torch": {
        "noop": "no enabled scaler",
        "static": "a StaticGradScaler",
        "dynamic": "a DynamicGradScaler",
        "grad_scaler": "a GradScaler",
        "adam": "Adam",
        "sgd": "SGD",
        "param": "model/{k}",
        "bn_mean": "model/bn.running_mean",
    },
}


def _ls_case(saved, target):
    return (f"loss_scale_{saved}_into_{target}", {"ls": saved}, {"ls": target})


# (case id, saved overrides, target overrides, expected): expected is a regex
# template ({adam}, {param}... filled from NAMES) or a pair of NAMES keys that
# must appear in that order (saved, then expected).
CASES = [
    *(
        (*_ls_case(a, b), (a, b))
        for a in ("noop", "static", "dynamic", "grad_scaler")
        for b in ("noop", "static", "dynamic", "grad_scaler")
        if a != b
    ),
    ("optimizer_adam_into_sgd", {}, {"opt": "sgd"}, ("adam", "sgd")),
    ("optimizer_sgd_into_adam", {"opt": "sgd"}, {}, ("sgd", "adam")),
    (
        "param_shape",
        {},
        {"shape": (3, 3)},
        r"{w}: checkpoint \(2, 3\) float32, target \(3, 3\) float32",
    ),
    (
        "param_dtype_float16_into_float32",
        {"dtype": "float16"},
        {},
        r"{w}: checkpoint \(2, 3\) float16, target \(2, 3\) float32",
    ),
    (
        "param_missing_from_checkpoint",
        {},
        {"keys": ("w", "v")},
        r"{v}: missing from the checkpoint \(target \(2, 3\) float32\)",
    ),
    (
        "param_extra_in_checkpoint",
        {"keys": ("w", "v")},
        {},
        r"{v}: in the checkpoint \(\(2, 3\) float32\), not in the target",
    ),
    (
        "batch_stats_shape",
        {"bn": 3},
        {"bn": 4},
        r"{bn_mean}: checkpoint \(3,\) float32, target \(4,\) float32",
    ),
    (
        "batch_stats_extra_in_checkpoint",
        {"bn": 3},
        {},
        r"{bn_mean}: in the checkpoint \(\(3,\) float32\), not in the target",
    ),
    (
        "batch_stats_missing_from_checkpoint",
        {},
        {"bn": 3},
        r"{bn_mean}: missing from the checkpoint \(target \(3,\) float32\)",
    ),
]


def _spec(overrides):
    return {**BASE, **overrides}


def _jax_state(spec, value=1.0):
    dtype = jnp.dtype(spec["dtype"])
    params = {k: jnp.full(spec["shape"], value, dtype) for k in spec["keys"]}
    inner = optax.adam(1e-2) if spec["opt"] == "adam" else optax.sgd(0.1)
    model_state = None
    if spec["bn"] is not None:
        stats = {"mean": jnp.full(spec["bn"], value), "var": jnp.ones(spec["bn"])}
        model_state = {"batch_stats": {"bn": stats}}
    return jtrain.TrainState.create(
        params=params,
        optimizer=jtransforms.stable_optimizer(inner),
        loss_scale=JAX_SCALES[spec["ls"]](),
        model_state=model_state,
    )


def _jax_loss(params, batch):
    return sum(jnp.sum((p.astype(jnp.float32) * batch) ** 2) for p in params.values())


def _torch_step(spec, value=1.0):
    model = torch.nn.Module()
    dtype = getattr(torch, spec["dtype"])
    for k in spec["keys"]:
        w = torch.full(spec["shape"], value, dtype=dtype)
        model.register_parameter(k, torch.nn.Parameter(w))
    if spec["bn"] is not None:
        model.bn = torch.nn.BatchNorm1d(spec["bn"], affine=False)
        model.bn.running_mean.fill_(value)
    params = list(model.parameters())
    opt = (
        torch.optim.Adam(params, lr=1e-2)
        if spec["opt"] == "adam"
        else torch.optim.SGD(params, lr=0.1)
    )

    def loss_fn(m, batch):
        return sum(((p.float() * batch) ** 2).sum() for p in m.parameters())

    return ttrain.TrainStep(model, opt, loss_fn, scaler=TORCH_SCALES[spec["ls"]]())


def _expected(framework, expected):
    names = NAMES[framework]
    if isinstance(expected, tuple):
        saved, target = (names[k] for k in expected)
        return f"{saved}.*{target}"  # (already regexes or plain words)
    fill = {
        "w": names["param"].format(k="w"),
        "v": names["param"].format(k="v"),
        "bn_mean": names["bn_mean"],
    }
    return expected.format(**fill)


def _applies(framework, saved, target):
    scales = JAX_SCALES if framework == "jax" else TORCH_SCALES
    return all(_spec(s)["ls"] in scales for s in (saved, target))


@pytest.mark.parametrize(
    ("framework", "saved", "target", "expected"),
    [
        pytest.param(fw, *c[1:], id=f"{c[0]}-{fw}")
        for c in CASES
        for fw in ("jax", "torch")
        if _applies(fw, c[1], c[2])  # torch.amp.GradScaler has no JAX twin
    ],
)
def test_mismatch_is_refused_naming_file_and_mismatch(
    tmp_path, framework, saved, target, expected
):
    path = tmp_path / "ck"
    if framework == "jax":
        jtrain.save_checkpoint(path, _jax_state(_spec(saved), value=3.0))
        dst = _jax_state(_spec(target))
        before = serialization.to_state_dict(jax.device_get(dst))
        with pytest.raises(ValueError) as info:
            jtrain.load_checkpoint(path, dst)
        # Nothing of the target changed (JAX states are immutable anyway).
        chex.assert_trees_all_equal(before, serialization.to_state_dict(dst))
    else:
        ttrain.save_checkpoint(path, _torch_step(_spec(saved), value=3.0))
        dst = _torch_step(_spec(target))
        before = {k: v.clone() for k, v in dst.model.state_dict().items()}
        with pytest.raises(ValueError) as info:
            ttrain.load_checkpoint(path, dst)
        # Refused before anything was loaded into the step.
        after = dst.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
    msg = str(info.value)
    assert repr(str(path)) in msg, msg
    assert re.search(_expected(framework, expected), msg, flags=re.S), msg


def _jax_train(state, batches):
    step = jtrain.make_train_step(_jax_loss)
    for b in batches:
        state, _ = step(state, b)
    return state


@pytest.mark.parametrize("ls", ["noop", "static", "dynamic"])
@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_matching_checkpoint_restores_every_field_bitwise(tmp_path, ls, opt):
    spec = _spec({"ls": ls, "opt": opt, "bn": 3, "keys": ("w", "v")})
    # A NaN batch: the skip counters and the loss scale's hysteresis move too.
    data = [np.full(spec["shape"], v, np.float32) for v in (0.5, np.nan, 1.5, 2.0)]

    saved = _jax_train(_jax_state(spec), [jnp.asarray(b) for b in data])
    jtrain.save_checkpoint(tmp_path / "j", saved)
    restored = jtrain.load_checkpoint(tmp_path / "j", _jax_state(spec, value=7.0))
    assert type(restored.loss_scale) is type(saved.loss_scale)
    chex.assert_trees_all_equal(
        serialization.to_state_dict(jax.device_get(restored)),
        serialization.to_state_dict(jax.device_get(saved)),
    )

    src = _torch_step(spec)
    for b in data:
        src(torch.from_numpy(b))
    ttrain.save_checkpoint(tmp_path / "t", src)
    dst = ttrain.load_checkpoint(tmp_path / "t", _torch_step(spec, value=7.0))
    _assert_same(dst.state_dict(), src.state_dict())
    assert int(src.skip_state.skipped_total) == int(saved.skipped_total) == 1


def _assert_same(a, b, path="state"):
    """Bitwise equality of two (nested) torch state dicts, naming the leaf."""
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, path
