"""A U-Net run carried from torch to JAX mid-way (and back) stays on course.

For Adam, AdamW and SGD-momentum: torch trains a tiny U-Net for K steps, the
run is converted (`examples.segmentation.carry_over`) and JAX trains K more;
the result matches torch training all 2K steps: parameters, batch-norm
statistics and optimizer moments to the float32 trajectory tolerance
(conftest), the Adam step count, the loss scale (scale, growth tracker) and
the skip counters exactly. And the reverse: JAX K steps, then torch K steps,
against JAX's 2K.

Both halves hold a NaN-input batch (steps 1 and 5), and the loss scale
(2**10, x2 after 3 finite steps in a row) is mid-count at the switch: the
first step after it grows the scale only if the growth tracker was carried.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from examples.common import carry_over
from examples.segmentation import carry_over as unet_carry
from examples.segmentation import convert, data, model_jax, model_torch
from jaxstable import loss_scale as jls
from jaxstable import losses as jlosses
from jaxstable import train as jtrain
from jaxstable import transforms
from parity_tests.test_trajectory_parity import _LR, _OPTIMIZERS
from torchref import loss_scale as tls
from torchref import losses as tlosses
from torchref import train as ttrain

_ARCH = dict(in_channels=3, num_classes=3, width=4, depth=1)
_K = 4  # steps before the switch, and after it
_POISON = (1, 5)  # a NaN input in each half
_BATCH, _HW = 2, 8
_SCALE, _PERIOD = 2.0**10, 3
_MAX_GRAD_NORM = 1.0


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # Tiny convolutions: intra-op threads would only spin on 2 shared cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@functools.cache
def _batches():
    """2K NHWC batches; the steps in _POISON hold one NaN input value."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(2 * _K):
        x = rng.standard_normal((_BATCH, _HW, _HW, 3)).astype(np.float32)
        y = rng.integers(0, _ARCH["num_classes"], (_BATCH, _HW, _HW), np.int32)
        if i in _POISON:
            x[0, 0, 0, 0] = np.nan
        out.append((x, y))
    return out


def _torch_step(opt_name: str) -> ttrain.TrainStep:
    torch.manual_seed(0)
    model = model_torch.UNet(**_ARCH).train()

    def loss_fn(m, batch):
        return tlosses.softmax_cross_entropy(m(batch[0]), batch[1], dim=1)

    return ttrain.TrainStep(
        model,
        _OPTIMIZERS[opt_name][1](model.parameters()),
        loss_fn,
        max_grad_norm=_MAX_GRAD_NORM,
        scaler=tls.DynamicLossScale(loss_scale=_SCALE, period=_PERIOD),
    )


def _torch_steps(step, batches):
    metrics = []
    for x, y in batches:
        xt = torch.from_numpy(data.to_nchw(x))
        metrics.append(step((xt, torch.from_numpy(y.astype(np.int64)))))
    return metrics


class _DecayState(NamedTuple):
    weight_decay: jax.Array


def _decay_in_state(weight_decay: float) -> optax.GradientTransformation:
    """optax.add_decayed_weights with the rate in the state, not the closure."""

    def init(params):
        del params
        return _DecayState(jnp.asarray(weight_decay, jnp.float32))

    def update(updates, state, params):
        u = jax.tree.map(lambda g, p: g + state.weight_decay * p, updates, params)
        return u, state

    return optax.GradientTransformation(init, update)


# Compiling the U-Net's JAX step takes 15-20 s on CPU while 5 jobs share the
# 2 cores, once per optimizer structure. Adam and AdamW share one: optax's
# adamw chain (scale_by_adam, add weight_decay * p, scale by -lr) with the rate
# in the state: 0.0 is Adam's update exactly (u + 0 * p = u), 0.05 AdamW's
# (the same float32 product as optax.adamw's). The optimizer states are
# inside a custom chain, so the converter's generic search is tested too.
# (optax.inject_hyperparams would do the same, but it rounds the Adam update
# differently: 7e-6 relative per step, which this U-Net amplified past the
# trajectory tolerance within 4 steps.)
_ADAM_CHAIN = transforms.stable_optimizer(
    optax.chain(
        optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
        _decay_in_state(0.0),
        optax.scale_by_learning_rate(_LR["adam"]),
    ),
    max_grad_norm=_MAX_GRAD_NORM,
)
assert _LR["adam"] == _LR["adamw"]
_WEIGHT_DECAY = {"adam": 0.0, "adamw": 0.05}  # as in _OPTIMIZERS


@functools.cache
def _train_step(family: str):
    graphdef = model_jax.split(convert.nnx_from_torch(_torch_step(family).model))[0]

    def loss_fn(p, s, batch):
        logits, s = model_jax.apply(graphdef, p, s, batch[0], train=True)
        return jlosses.softmax_cross_entropy(logits, batch[1]), s

    return jtrain.make_train_step(loss_fn, has_state=True)


@functools.cache
def _jax_parts(opt_name: str):
    """(initial TrainState, jitted step): the torch init, converted."""
    _, params, stats = model_jax.split(
        convert.nnx_from_torch(_torch_step(opt_name).model)
    )
    family = "sgd_momentum" if opt_name == "sgd_momentum" else "adam"
    tx = (
        _ADAM_CHAIN
        if family == "adam"
        else transforms.stable_optimizer(
            _OPTIMIZERS[opt_name][0](), max_grad_norm=_MAX_GRAD_NORM
        )
    )

    def create(params, stats, ls):
        state = jtrain.TrainState.create(
            params=params, optimizer=tx, loss_scale=ls, model_state=stats
        )
        if family == "sgd_momentum":
            return state
        decay = _DecayState(jnp.float32(_WEIGHT_DECAY[opt_name]))
        is_decay = lambda x: isinstance(x, _DecayState)  # noqa: E731
        opt_state = jax.tree.map(
            lambda x: decay if is_decay(x) else x, state.opt_state, is_leaf=is_decay
        )
        return state.replace(opt_state=opt_state)

    ls = jls.DynamicLossScale(loss_scale=_SCALE, period=_PERIOD)
    # One compiled init instead of one eager program per optax zeros_like.
    return jax.jit(create)(params, stats, ls), _train_step(family)


def _jax_steps(state, step, batches):
    metrics = []
    for x, y in batches:
        state, m = step(state, (jnp.asarray(x), jnp.asarray(y)))
        metrics.append(jax.device_get(m))
    return state, metrics


@functools.cache
def _references(opt_name: str):
    """Each framework alone for 2K steps, with its run at step K kept."""
    batches = _batches()
    tstep = _torch_step(opt_name)
    t_metrics = _torch_steps(tstep, batches[:_K])
    torch_at_k = carry_over.torch_run_state(tstep)
    t_metrics += _torch_steps(tstep, batches[_K:])
    state, jstep = _jax_parts(opt_name)
    jax_at_k, j_metrics = _jax_steps(state, jstep, batches[:_K])
    jax_2k, more = _jax_steps(jax_at_k, jstep, batches[_K:])
    return {
        "torch_at_k": torch_at_k,
        "torch_2k": carry_over.torch_run_state(tstep),
        "torch_metrics": t_metrics,
        "jax_at_k": jax_at_k,
        "jax_2k": jax_2k,
        "jax_metrics": j_metrics + more,
    }


def _assert_same_run(got, want, tol, where):
    """Two torch run dicts: values to `tol`, counts and the scaler exactly."""
    for key, value in want["model"].items():
        if not key.endswith("num_batches_tracked"):  # not carried (docs)
            np.testing.assert_allclose(
                got["model"][key].numpy(), value.numpy(), **tol, err_msg=where + key
            )
    want_opt, got_opt = want["optimizer"]["state"], got["optimizer"]["state"]
    assert sorted(got_opt) == sorted(want_opt), where
    for i, entries in want_opt.items():
        assert sorted(got_opt[i]) == sorted(entries), where
        for name, value in entries.items():
            if name == "step":
                assert float(got_opt[i][name]) == float(value), where
            else:
                np.testing.assert_allclose(
                    got_opt[i][name].numpy(), value.numpy(), **tol, err_msg=where
                )
    for name in ("scale", "_growth_tracker", "growth_interval", "growth_factor"):
        assert got["scaler"][name] == want["scaler"][name], (where, name)
    assert got["skip_state"] == want["skip_state"], where
    assert got["steps_done"] == want["steps_done"] == 2 * _K, where


def _assert_same_counts(got_metrics, want_metrics, tol, where):
    for i, (g, w) in enumerate(zip(got_metrics, want_metrics, strict=True)):
        assert float(g["loss_scale"]) == float(w["loss_scale"]), (where, i)
        assert int(g["skipped_total"]) == int(w["skipped_total"]), (where, i)
        assert bool(g["finite"]) is bool(w["finite"]) is (i + _K not in _POISON)
        if w["finite"]:
            np.testing.assert_allclose(float(g["loss"]), float(w["loss"]), **tol)
    # The scale grew on the first step after the switch: the growth tracker
    # (2 of 3 at step K) was carried over, not restarted.
    assert float(got_metrics[1]["loss_scale"]) == 2 * float(
        got_metrics[0]["loss_scale"]
    )


@pytest.mark.parametrize("opt_name", sorted(_OPTIMIZERS))
def test_torch_run_continues_in_jax(opt_name, tol):
    ref = _references(opt_name)
    target, jstep = _jax_parts(opt_name)
    layout = unet_carry.unet_layout(model_torch.UNet(**_ARCH))
    state = carry_over.train_state_from_torch(ref["torch_at_k"], target, layout)
    assert int(state.step) == _K and int(state.skipped_total) == 1
    assert int(state.loss_scale.counter) == 2
    state, metrics = _jax_steps(state, jstep, _batches()[_K:])

    traj = tol("float32_trajectory")
    where = f"torch {_K} + jax {_K} vs torch {2 * _K} ({opt_name}): "
    _assert_same_counts(metrics, ref["torch_metrics"][_K:], traj, where)
    got = carry_over.torch_run_from_train_state(state, layout, ref["torch_2k"])
    _assert_same_run(got, ref["torch_2k"], traj, where)


@pytest.mark.parametrize("opt_name", sorted(_OPTIMIZERS))
def test_jax_run_continues_in_torch(opt_name, tol):
    ref = _references(opt_name)
    tstep = _torch_step(opt_name)  # torch's init: overwritten by the JAX run
    unet_carry.jax_to_torch(ref["jax_at_k"], tstep)
    assert tstep.steps_done == _K and tstep.skip_state.skipped_total == 1
    assert tstep.scaler.get_scale() == float(ref["jax_at_k"].loss_scale.loss_scale)
    metrics = _torch_steps(tstep, _batches()[_K:])

    traj = tol("float32_trajectory")
    where = f"jax {_K} + torch {_K} vs jax {2 * _K} ({opt_name}): "
    _assert_same_counts(metrics, ref["jax_metrics"][_K:], traj, where)
    got = carry_over.torch_run_state(tstep)
    layout = unet_carry.unet_layout(tstep.model)
    want = carry_over.torch_run_from_train_state(ref["jax_2k"], layout, got)
    _assert_same_run(got, want, traj, where)


# ------------------------------------------------ what must not convert
_NAMES = {"weight": "kernel", "bias": "bias"}
_LINEAR = carry_over.Layout(
    path=lambda key: (_NAMES[key],),
    to_jax=lambda key, a: a.T if key == "weight" else a,
    to_torch=lambda key, a: a.T if key == "weight" else a,
)


def _linear_run(optimizer, scaler, out_features=1):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, out_features)
    step = ttrain.TrainStep(
        model, optimizer(model.parameters()), lambda m, b: m(b).sum(), scaler=scaler
    )
    step(torch.ones(4, 2))
    return carry_over.torch_run_state(step)


def _linear_target(tx, ls=None, out_features=1):
    params = {"kernel": jnp.zeros((2, out_features)), "bias": jnp.zeros(out_features)}
    return jtrain.TrainState.create(params=params, optimizer=tx, loss_scale=ls)


def _adam(p):
    return torch.optim.Adam(p, lr=0.1)


_REFUSED = {
    "adam into sgd": (
        lambda: _linear_run(_adam, None),
        lambda: _linear_target(optax.sgd(0.1, momentum=0.9)),
        r"torch optimizer is 'adam'.*one ScaleByAdamState.*\['TraceState'\]",
    ),
    "amsgrad": (
        lambda: _linear_run(lambda p: torch.optim.Adam(p, amsgrad=True), None),
        lambda: _linear_target(optax.adam(0.1)),
        r"amsgrad=True is not supported",
    ),
    "backoff not 1/growth": (
        lambda: _linear_run(
            _adam, torch.amp.GradScaler("cpu", growth_factor=2.0, backoff_factor=0.25)
        ),
        lambda: _linear_target(optax.adam(0.1), jls.DynamicLossScale()),
        r"backoff_factor=0.25 is not 1/growth_factor=0.5",
    ),
    "scaler into no-op": (
        lambda: _linear_run(_adam, tls.DynamicLossScale()),
        lambda: _linear_target(optax.adam(0.1)),
        r"the torch run has a GradScaler; the target NoOpLossScale",
    ),
    "shape": (
        lambda: _linear_run(_adam, None),
        lambda: _linear_target(optax.adam(0.1), out_features=3),
        r"params: torch 'bias' converts to shape \(1,\), the JAX leaf "
        r"\('bias',\) has \(3,\)",
    ),
}


@pytest.mark.parametrize("case", sorted(_REFUSED))
def test_a_mismatch_is_refused_naming_it(case):
    run, target, message = _REFUSED[case]
    with pytest.raises(ValueError, match=message):
        carry_over.train_state_from_torch(run(), target(), _LINEAR)


def test_hysteresis_is_not_dropped_into_a_plain_grad_scaler():
    state = _linear_target(optax.adam(0.1), jls.DynamicLossScale(hysteresis=2))
    plain = _linear_run(_adam, torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"hysteresis=2\) needs torchref's"):
        carry_over.torch_run_from_train_state(state, _LINEAR, plain)
    # torchref's DynamicGradScaler carries it.
    ours = _linear_run(_adam, tls.DynamicLossScale(hysteresis=2))
    run = carry_over.torch_run_from_train_state(state, _LINEAR, ours)
    assert run["scaler"]["hysteresis"] == 2
