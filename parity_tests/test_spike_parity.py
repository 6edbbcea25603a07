"""`transforms.skip_spikes` in both frameworks (issue 23).

The same sequences of gradient norms and losses (spikes, NaN, inf, a norm
of exactly 0, a window of equal values) give the same decisions and the same
window in JAX and torch; a storm of spikes made by scaling the batch at
random steps of a tiny model is skipped in both with exact counts and
nothing non-finite ever written; the JAX step has no ``conditional`` and no
host transfer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from conftest import has_conditional
from jaxstable import train as jtrain
from jaxstable import transforms as jtx
from torchref import train as ttrain
from torchref import transforms as ttx

NAN, INF = float("nan"), float("inf")
# norm, loss per step. Steps 0-3 fill min_history (a spike there is NOT a
# spike: not checked yet, but the NaN at 2 is refused); then a norm spike, a
# loss spike, a norm of exactly 0 (log taken at float32's tiny: accepted,
# below the median), an inf loss, a second spike right after the first
# (masking under mean + k sigma), and ordinary values.
SEQ = [
    (1.0, 2.0), (50.0, 2.1), (NAN, 2.0), (1.2, 1.9), (0.9, 2.05),
    (1.1, 2.0), (40.0, 2.0), (1.0, 9.0), (0.0, 2.0), (1.0, INF),
    (30.0, 2.0), (35.0, 2.0), (1.05, 2.02), (0.95, 1.98), (1.0, 2.0),
]  # fmt: skip
EXPECTED = [
    "applied", "applied", "non-finite", "applied", "applied",
    "applied", "spike", "spike", "applied", "non-finite",
    "spike", "spike", "applied", "applied", "applied",
]  # fmt: skip
KW = dict(window=6, min_history=4, threshold=6.0, min_ratio=1.5)


def _kind(spike, applied):
    return "spike" if spike else "applied" if applied else "non-finite"


def _jax_run(seq, use_loss=True, **kw):
    tx = jtx.skip_spikes(jtx.stable_optimizer(optax.adam(0.1)), **kw)
    state = tx.init(jnp.zeros(2))
    update = jax.jit(tx.update)
    kinds, windows = [], []
    for norm, loss in seq:
        extra = {"value": jnp.float32(loss)} if use_loss else {}
        _, state = update(jnp.array([norm, 0.0], jnp.float32), state, **extra)
        kinds.append(_kind(bool(state.last_spike), bool(state.last_finite)))
        count = int(state.norm_count)
        windows.append((np.asarray(state.log_norms), np.asarray(state.losses), count))
    return kinds, windows, state


def _torch_run(seq, use_loss=True, **kw):
    w = torch.nn.Parameter(torch.zeros(2))
    opt = ttx.skip_spikes(torch.optim.Adam([w], lr=0.1), **kw)
    kinds, windows = [], []
    for norm, loss in seq:
        w.grad = torch.tensor([norm, 0.0])
        opt.step(value=loss if use_loss else None)
        s = opt.spike_state
        kinds.append(_kind(s.last_spike, s.last_finite))
        copies = (s.log_norms.numpy().copy(), s.losses.numpy().copy())
        windows.append((*copies, s.norm_count))
    return kinds, windows, opt


def test_same_decisions_and_statistics_on_a_sequence_with_spikes():
    jk, jw, jstate = _jax_run(SEQ, **KW)
    tk, tw, opt = _torch_run(SEQ, **KW)
    assert jk == EXPECTED
    assert tk == EXPECTED
    for (jn, jl, jc), (tn, tl, tc) in zip(jw, tw, strict=True):
        np.testing.assert_allclose(jn, tn, rtol=1e-6)
        np.testing.assert_allclose(jl, tl, rtol=1e-6)
        assert jc == tc
    spikes, bad = EXPECTED.count("spike"), EXPECTED.count("non-finite")
    assert int(jstate.spikes_total) == opt.spike_state.spikes_total == spikes
    skip = jtx.find_skip_state(jstate)
    assert int(skip.skipped_total) == opt.skip_state.skipped_total == spikes + bad
    # Adam's count advanced only on applied steps: skipped ones left it.
    assert int(skip.inner_state[0].count) == EXPECTED.count("applied")
    assert opt.state[opt.param_groups[0]["params"][0]]["step"] == EXPECTED.count(
        "applied"
    )
    # Nothing non-finite or skipped entered the window: its 6 slots hold the
    # last 6 applied steps' values (the 0 norm as log(tiny)).
    applied = [v for v, k in zip(SEQ, EXPECTED, strict=True) if k == "applied"]
    want = np.log(np.maximum([n for n, _ in applied[-6:]], np.finfo(np.float32).tiny))
    assert np.isfinite(jw[-1][0]).all() and jw[-1][2] == 6
    np.testing.assert_allclose(np.sort(jw[-1][0]), np.sort(want), rtol=1e-6)


def test_norms_only_and_a_window_of_equal_values():
    # Equal norms: MAD = 0, so only the min_ratio floor decides (no 0/0).
    seq = [(1.0, 0.0)] * 5 + [(1.4, 0.0), (1.6, 0.0), (1.0, 0.0)]
    want = ["applied"] * 6 + ["spike", "applied"]
    assert _jax_run(seq, use_loss=False, **KW)[0] == want
    assert _torch_run(seq, use_loss=False, **KW)[0] == want


def test_min_history_one_and_a_first_step_nan():
    # NaN-safe from step 0: a first NaN is refused and never counted as history.
    seq = [(NAN, 1.0), (1.0, 1.0), (100.0, 1.0), (1.0, 1.0)]
    kw = dict(window=4, min_history=1)
    want = ["non-finite", "applied", "spike", "applied"]
    assert _jax_run(seq, **kw)[0] == want
    assert _torch_run(seq, **kw)[0] == want


def test_around_stable_optimizer_in_both():
    """``skip_spikes(stable_optimizer(opt, max_grad_norm=...))``, the order
    both docstrings give (the spike test sees the pre-clip norm): torch
    refused its own StableOptimizer ("needs a torch.optim.Optimizer")."""
    seq = [(1.0, 2.0), (1.2, 2.1), (0.9, 2.0), (1.1, 1.9), (40.0, 2.0), (NAN, 2.0)]
    seq += [(1.4, 2.0)]
    want = ["applied"] * 4 + ["spike", "non-finite", "applied"]
    kw = dict(window=4, min_history=3)
    tx = jtx.skip_spikes(jtx.stable_optimizer(optax.sgd(0.1), max_grad_norm=1.3), **kw)
    update = jax.jit(tx.update)
    params = jnp.zeros(2)
    state = tx.init(params)
    w = torch.nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([w], lr=0.1)
    opt = ttx.skip_spikes(ttx.stable_optimizer(sgd, max_grad_norm=1.3), **kw)
    jk, tk = [], []
    for norm, loss in seq:
        g = jnp.array([norm, 0.0], jnp.float32)
        u, state = update(g, state, params, value=jnp.float32(loss))
        params = optax.apply_updates(params, u)
        jk.append(_kind(bool(state.last_spike), bool(state.last_finite)))
        w.grad = torch.tensor([norm, 0.0])
        opt.step(value=loss)
        tk.append(_kind(opt.spike_state.last_spike, opt.spike_state.last_finite))
    assert jk == tk == want
    skip = jtx.find_skip_state(state)
    assert int(skip.skipped_total) == opt.skip_state.skipped_total == 2
    # The last step's 1.4 was clipped to 1.3 (max_grad_norm) in both.
    np.testing.assert_allclose(np.asarray(params), w.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(
        float(params[0]), -0.1 * (1.0 + 1.2 + 0.9 + 1.1 + 1.3), rtol=1e-5
    )


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(window=0), "window must be an int >= 1"),
        (dict(window=4, min_history=5), r"min_history \(5\) must be <= window"),
        (dict(min_history=True), "min_history must be an int >= 1"),
        (dict(threshold=0.0), "threshold must be a finite float > 0"),
        (dict(threshold=NAN), "threshold must be a finite float > 0"),
        (dict(min_ratio=0.5), "min_ratio must be a finite float >= 1"),
    ],
)
def test_bad_arguments_same_errors(kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        jtx.skip_spikes(optax.sgd(0.1), **kw)
    w = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises((TypeError, ValueError), match=match):
        ttx.skip_spikes(torch.optim.SGD([w], lr=0.1), **kw)


# ------------------------------------------------------------------- storm
STEPS, SPIKE_AT, NAN_AT = 40, (12, 19, 20, 31), (7, 26)


def _storm_batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, 64, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32))[..., None]
    for i in SPIKE_AT:  # a scaled batch: gradient norm x1e3 (a real spike)
        x[i] *= 1e3
    for i in NAN_AT:
        x[i, 0, 0] = np.nan
    return x, y


def test_storm_of_scaled_batches_in_both_frameworks():
    x, y = _storm_batches()
    kw = dict(window=16, min_history=5)
    tx = jtx.skip_spikes(jtx.stable_optimizer(optax.adam(1e-2)), **kw)
    params = {"w": jnp.zeros((3, 1)), "b": jnp.zeros(1)}
    state = jtrain.TrainState.create(params=params, optimizer=tx)

    def loss_fn(p, b):
        return jnp.mean((b[0] @ p["w"] + p["b"] - b[1]) ** 2)

    step = jtrain.make_train_step(loss_fn)
    model = torch.nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    topt = ttx.skip_spikes(torch.optim.Adam(model.parameters(), lr=1e-2), **kw)
    tstep = ttrain.TrainStep(model, topt, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
    jkinds, tkinds = [], []
    for i in range(STEPS):
        state, m = step(state, (jnp.asarray(x[i]), jnp.asarray(y[i])))
        tm = tstep((torch.from_numpy(x[i]), torch.from_numpy(y[i])))
        jkinds.append(_kind(bool(m["spike"]), bool(m["finite"])))
        tkinds.append(_kind(tm["spike"], tm["finite"]))
        for leaf in jax.tree.leaves((state.params, state.opt_state)):
            assert np.isfinite(np.asarray(leaf, np.float32)).all(), i
        assert all(torch.isfinite(p).all() for p in model.parameters()), i
        np.testing.assert_allclose(
            np.asarray(state.params["w"])[:, 0],
            model.weight.detach().numpy()[0],
            rtol=1e-4,
            atol=1e-6,
        )
    want = [
        "spike" if i in SPIKE_AT else "non-finite" if i in NAN_AT else "applied"
        for i in range(STEPS)
    ]
    assert jkinds == want
    assert tkinds == want
    assert int(m["skipped_total"]) == tm["skipped_total"] == 6
    assert int(jtx.find_spike_state(state.opt_state).spikes_total) == 4
    assert ttx.find_spike_state(topt).spikes_total == 4
    # A spike is no non-finite update: the skip counters agree field by field.
    jskip = jtx.find_skip_state(state.opt_state)
    assert {
        k: getattr(jskip, k).item() for k in dataclasses.asdict(tstep.skip_state)
    } == dataclasses.asdict(tstep.skip_state)


def test_jax_step_has_no_conditional_and_no_transfer():
    tx = jtx.skip_spikes(
        jtx.stable_optimizer(optax.adam(1e-2)), window=4, min_history=2
    )
    state = jtrain.TrainState.create(params=jnp.zeros(2), optimizer=tx)
    step = jtrain.make_train_step(lambda p, b: jnp.sum((p - b) ** 2))
    batch = jnp.ones(2)
    assert not has_conditional(step.lower(state, batch))
    state, _ = step(state, batch)  # compiled before the guard
    with jax.transfer_guard("disallow"):
        state, _ = step(state, batch)
    # Every field survives a tree map and jit (no field dropped).
    spike = jtx.find_spike_state(state.opt_state)
    again = jax.jit(lambda s: jax.tree.map(lambda x: x, s))(spike)
    assert type(again) is jtx.SkipSpikesState
    assert [np.asarray(a).tolist() for a in jax.tree.leaves(again)] == [
        np.asarray(a).tolist() for a in jax.tree.leaves(spike)
    ]


def test_fit_records_say_spike_in_both(tmp_path):
    x, y = _storm_batches()
    kw = dict(window=16, min_history=5)
    tx = jtx.skip_spikes(jtx.stable_optimizer(optax.sgd(1e-2)), **kw)
    state = jtrain.TrainState.create(params=jnp.zeros((3, 1)), optimizer=tx)
    step = jtrain.make_train_step(lambda p, b: jnp.mean((b[0] @ p - b[1]) ** 2))
    data = [
        (jnp.asarray(a), jnp.asarray(b)) for a, b in zip(x[:21], y[:21], strict=True)
    ]
    _, hist = jtrain.fit(state, step, data, progress=False)
    model = torch.nn.Linear(3, 1, bias=False)
    topt = ttx.skip_spikes(torch.optim.SGD(model.parameters(), lr=1e-2), **kw)
    tstep = ttrain.TrainStep(model, topt, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
    tdata = [
        (torch.from_numpy(a), torch.from_numpy(b))
        for a, b in zip(x[:21], y[:21], strict=True)
    ]
    thist = ttrain.fit(tstep, tdata, progress=False)
    for h in (hist, thist):
        reasons = {r["step"]: r["skip_reason"] for r in h if "skip_reason" in r}
        assert reasons == {
            7: "non-finite gradients",
            12: "spike",
            19: "spike",
            20: "spike",
        }
