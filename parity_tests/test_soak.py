"""NaN-storm soak: 2000 guarded float16 steps per framework, nothing leaks in.

A tiny MLP (12-16-5, tanh) trains for 2000 steps with float16 compute (JAX: a
jmp policy; torch: CPU autocast), float32 parameters, Adam, clipping and a
dynamic loss scale that grows x2 after every 5 finite steps. Two kinds of bad
step, both real:

* poisoned data: 6% of the batches, at random steps, hold a NaN or an
  (+-)Inf INPUT value (what a broken sample does);
* float16 overflow, produced by the arithmetic alone: the scale grows until
  the scaled backward pass exceeds fp16's max 65504, GradScaler-style
  backoff halves it, it grows again 5 steps later, and so on.

Checked per framework: no non-finite parameter or optimizer-state value at
the end; ``skipped_total`` equals the bad steps counted independently (the
poisoned batches, plus the clean batches whose gradients overflowed: the
``grads_finite`` flag, on the torch side GradScaler's own ``found_inf``); the
loss-scale trajectory equals a real `torch.amp.GradScaler` replayed over the
same finite/non-finite flags, bit for bit; JAX traced the step once; the
resident set size (RSS) stays flat between step 500 and step 2000 (the numbers
are printed; run with ``-s`` to see them).
"""

from __future__ import annotations

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from jaxstable import loss_scale as jls
from jaxstable import losses as jlosses
from jaxstable import train as jtrain
from jaxstable import transforms
from parity_tests.test_loss_scale_parity import _torch_scales
from torchref import loss_scale as tls
from torchref import losses as tlosses
from torchref import train as ttrain

_STEPS = 2000
_MEASURE_AT = 500  # first RSS reading; the second is after the last step
_POISON_RATE = 0.06  # of the batches: >= 5% as the issue asks, with margin
_BATCH, _FEATURES, _HIDDEN, _CLASSES = 8, 12, 16, 5
# 2**10 start, x2 after 5 finite steps: the scale climbs to where the scaled
# fp16 gradients pass 65504 (2**18-2**19 here) within ~50 steps, then
# overflows again every ~6 steps (a 5-step period; poisoned steps reset it).
_INIT_SCALE, _PERIOD = 2.0**10, 5
# RSS may grow by allocator noise and lazily filled caches, not per step:
# a leak of one 8x12 float32 batch (384 B) per step over the 1500 steps between
# the two readings is only 0.6 MB, but one of a state copy (~2 KB of params
# and ~4 KB of Adam moments per step) is ~9 MB: 8 MiB catches the latter.
_RSS_BOUND = 8 * 2**20
_POLICY = "params=float32,compute=float16,output=float32"
_LR, _MAX_GRAD_NORM = 1e-3, 1.0


def _rss_bytes() -> int:
    # /proc/self/statm field 2: resident pages (Linux, where `make test` runs).
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _data(seed: int = 0):
    """All batches up front (so the RSS readings do not see data being made):
    inputs (steps, B, F) float32, labels (steps, B), and the poisoned steps."""
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((_FEATURES, _CLASSES))
    x = rng.standard_normal((_STEPS, _BATCH, _FEATURES)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=-1).astype(np.int32)
    poisoned = np.sort(
        rng.choice(_STEPS, size=int(_POISON_RATE * _STEPS), replace=False)
    )
    bad_values = rng.choice([np.nan, np.inf, -np.inf], size=len(poisoned))
    for step, value in zip(poisoned, bad_values, strict=True):
        x[step].reshape(-1)[rng.integers(_BATCH * _FEATURES)] = value
    return x, y, poisoned, bad_values


class _TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(_FEATURES, _HIDDEN)
        self.head = torch.nn.Linear(_HIDDEN, _CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.fc1(x)))


def _jax_params(seed: int = 0):
    # numpy draws, not a flax init: an eager init compiles one XLA program per
    # initialiser (seconds on CPU) for a test about the step.
    rng = np.random.default_rng(seed)

    def dense(n_in, n_out):
        bound = n_in**-0.5
        return {
            "w": jnp.asarray(rng.uniform(-bound, bound, (n_in, n_out)), jnp.float32),
            "b": jnp.asarray(rng.uniform(-bound, bound, n_out), jnp.float32),
        }

    return {"fc1": dense(_FEATURES, _HIDDEN), "head": dense(_HIDDEN, _CLASSES)}


def _jax_mlp(params, x):
    h = jnp.tanh(x @ params["fc1"]["w"] + params["fc1"]["b"])
    return h @ params["head"]["w"] + params["head"]["b"]


def _run_jax(x, y):
    traces = []

    def loss_fn(params, batch):
        traces.append(1)  # a Python side effect: runs once per trace only
        xb, yb = batch
        return jlosses.softmax_cross_entropy(_jax_mlp(params, xb), yb)

    tx = transforms.stable_optimizer(optax.adam(_LR), max_grad_norm=_MAX_GRAD_NORM)
    ls = jls.DynamicLossScale(loss_scale=_INIT_SCALE, period=_PERIOD)
    # One compiled init instead of one eager program per zeros_like (slow).
    state = jax.jit(
        lambda p, ls: jtrain.TrainState.create(params=p, optimizer=tx, loss_scale=ls)
    )(_jax_params(), ls)
    step = jtrain.make_train_step(loss_fn, policy=_POLICY)

    def one(state, i):
        state, m = step(state, (x[i], y[i]))
        m = jax.device_get(m)
        return state, (m["loss_scale"], m["grads_finite"], m["finite"], m["loss"])

    return (*_soak(state, one, lambda s: int(s.skipped_total)), len(traces))


def _run_torch(x, y):
    torch.manual_seed(0)
    model = _TorchMLP()
    step = ttrain.TrainStep(
        model,
        torch.optim.Adam(model.parameters(), lr=_LR),
        lambda m, b: tlosses.softmax_cross_entropy(m(b[0]), b[1]),
        max_grad_norm=_MAX_GRAD_NORM,
        scaler=tls.DynamicLossScale(loss_scale=_INIT_SCALE, period=_PERIOD),
        autocast_dtype=torch.float16,
    )
    xt, yt = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))

    def one(state, i):
        m = step((xt[i], yt[i]))
        return state, (m["loss_scale"], m["grads_finite"], m["finite"], m["loss"])

    run = _soak(None, one, lambda _: step.skip_state.skipped_total)
    state = {
        "params": [p.detach().numpy() for p in model.parameters()],
        "opt": [
            v.numpy()
            for s in step.optimizer.state.values()
            for v in s.values()
            if v.ndim > 0
        ],
        "final_scale": step.scaler.get_scale(),
    }
    return (state, *run[1:])


def _soak(state, one, skipped_total):
    """Runs the steps, recording into preallocated arrays (a growing list of
    records would itself be the RSS growth the test looks for)."""
    scales = np.empty(_STEPS, np.float32)
    grads_finite = np.empty(_STEPS, bool)
    applied = np.empty(_STEPS, bool)
    losses = np.empty(_STEPS, np.float32)
    rss = []
    for i in range(_STEPS):
        state, (scales[i], grads_finite[i], applied[i], losses[i]) = one(state, i)
        if i + 1 == _MEASURE_AT:
            rss.append(_rss_bytes())
    rss.append(_rss_bytes())
    flags = grads_finite, applied, losses
    return state, scales, flags, skipped_total(state), rss


@pytest.fixture(scope="module")
def data():
    return _data()


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # Tiny ops: torch's intra-op threads would only spin on 2 shared cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_nan_storm_soak(framework, data):
    x, y, poisoned, bad_values = data
    assert len(poisoned) >= 0.05 * _STEPS
    assert {"nan", "inf", "-inf"} == {str(v) for v in bad_values}
    run = _run_jax if framework == "jax" else _run_torch
    state, scales, flags, skipped_total, rss, *traces = run(x, y)
    grads_finite, applied, losses = flags

    # Every poisoned batch gave non-finite gradients; the other bad steps are
    # fp16 overflows of clean batches, and there were plenty of them.
    is_poisoned = np.zeros(_STEPS, bool)
    is_poisoned[poisoned] = True
    assert not grads_finite[is_poisoned].any()
    overflows = int((~grads_finite & ~is_poisoned).sum())
    assert overflows >= 50, overflows  # real overflow, not an accident
    # An overflow is in the scaled backward pass only: the loss of a clean
    # batch is finite. A NaN input makes the loss NaN; an Inf one need not
    # (tanh(+-inf) = +-1), only its gradient x^T * delta is non-finite.
    assert np.isfinite(losses[~is_poisoned]).all()
    assert not np.isfinite(losses[poisoned[np.isnan(bad_values)]]).any()
    # Every bad step skipped, every good one applied: no update turned
    # non-finite on its own (float32 params and Adam state).
    np.testing.assert_array_equal(applied, grads_finite)
    assert skipped_total == len(poisoned) + overflows

    # The scale each step used, vs a real GradScaler over the same flags:
    # GradScaler's scale after step i is the one step i + 1 used.
    expected = _torch_scales(grads_finite, init=_INIT_SCALE, factor=2, period=_PERIOD)
    assert scales[0] == _INIT_SCALE
    np.testing.assert_array_equal(scales[1:], expected[:-1])
    assert expected.min() >= 1.0  # min_loss_scale never bound: a fair replay

    if framework == "jax":
        assert traces == [1]  # jitted once, never re-traced
        chex.assert_tree_all_finite((state.params, state.opt_state))
        assert float(state.loss_scale.loss_scale) == expected[-1]
    else:
        chex.assert_tree_all_finite(state["params"] + state["opt"])
        assert state["final_scale"] == expected[-1]
    growth = rss[1] - rss[0]
    print(
        f"\n{framework} soak: {len(poisoned)} poisoned + {overflows} fp16 "
        f"overflows = {skipped_total} skipped of {_STEPS}; RSS at step "
        f"{_MEASURE_AT}: {rss[0] / 2**20:.1f} MiB, at {_STEPS}: "
        f"{rss[1] / 2**20:.1f} MiB (growth {growth / 2**20:+.2f} MiB)"
    )
    assert growth < _RSS_BOUND, (rss, _RSS_BOUND)
