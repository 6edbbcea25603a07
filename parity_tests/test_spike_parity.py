"""`transforms.skip_spikes` in both frameworks (issue 23).

The same sequences of gradient norms and losses (spikes, NaN, inf, a norm
of exactly 0, a window of equal values, a level that changes for good, a
non-finite update from finite gradients) give the same decisions and the
same window in JAX and torch; every step with finite values enters the
window, spikes too, NaN and inf never; a storm of spikes made by scaling the batch at
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
# (masking under mean + k sigma), and ordinary values. Window 9: the spikes
# enter it, and at step 11 it holds 9 values of which 4 are outliers (the
# unchecked 50 at step 1, 40, 30 and the 0): under half, so 35 is still a
# spike (with a window of 6 or 8 the outliers are half of it and the MAD
# takes them in: 35 passes, median/MAD's breakdown point).
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
KW = dict(window=9, min_history=4, threshold=6.0, min_ratio=1.5)


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
    # Every step with a finite norm and loss entered the window, spikes
    # included, NaN and inf not: its 9 slots hold the last 9 such steps'
    # values (the 0 norm as log(tiny)), ring order and all.
    entered = [(n, v) for n, v in SEQ if np.isfinite(n) and np.isfinite(v)]
    assert len(entered) == 13  # the ring has wrapped
    norms = np.log(np.maximum([n for n, _ in entered], np.finfo(np.float32).tiny))
    slots = np.arange(13 - 9, 13) % 9  # the slot each of the last 9 wrote
    assert jw[-1][2] == 9
    np.testing.assert_allclose(jw[-1][0][slots], norms[-9:], rtol=1e-6)
    np.testing.assert_allclose(jw[-1][1][slots], [v for _, v in entered[-9:]])


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


# A level that changes for good, after 10 steps that fill the window: norms
# x10 (a backbone unfrozen), losses x10. The new values enter the window as
# spikes; while they are under half of it the median and the MAD are the
# old level's; once they are half of a window of 8 (5 of 9) the median is
# halfway (in the new level) and the 5th (6th) is applied: exactly
# (window + 1) // 2 skips, then none. With only applied steps entering
# (the old rule) every later step was a spike. The first non-zero
# gradients (losses) after exact zeros: the zeros take no part in the
# statistics, so nothing is a spike (before: every one, forever).
WOBBLE = [1.0, 1.1, 0.9, 1.05, 0.95] * 5
SHIFTS = {  # case: (window, before, after)
    "norm_x10": (8, [(n, 2.0) for n in WOBBLE[:10]], [(10 * n, 2.0) for n in WOBBLE]),
    "loss_x10": (
        9,
        [(1.0, 2 * n) for n in WOBBLE[:10]],
        [(1.0, 20 * n) for n in WOBBLE],
    ),
    "zero_norms": (8, [(0.0, 2.0)] * 10, [(n, 2.0) for n in WOBBLE]),
    "zero_losses": (9, [(1.0, 0.0)] * 10, [(1.0, n) for n in WOBBLE]),
}
ZERO_CASES = ("zero_norms", "zero_losses")


@pytest.mark.parametrize("case", SHIFTS)
def test_a_lasting_shift_is_adopted_after_half_a_window_in_both(case):
    window, before, after = SHIFTS[case]
    seq = before + after[:12]
    skips = 0 if case in ZERO_CASES else (window + 1) // 2
    want = ["applied"] * 10 + ["spike"] * skips + ["applied"] * (12 - skips)
    jk, jw, jstate = _jax_run(seq, window=window, min_history=3)
    tk, tw, opt = _torch_run(seq, window=window, min_history=3)
    assert jk == want
    assert tk == want
    assert int(jstate.spikes_total) == opt.spike_state.spikes_total == skips
    for (jn, jl, jc), (tn, tl, tc) in zip(jw, tw, strict=True):
        np.testing.assert_allclose(jn, tn, rtol=1e-6)
        np.testing.assert_allclose(jl, tl, rtol=1e-6)
        assert jc == tc


def test_mostly_zero_gradients_and_losses_keep_the_nonzero_ones_statistics():
    # Sparse rewards or labels: two steps in three have a gradient and a
    # loss of exactly 0. Zeros take slots but not part in the statistics,
    # so the non-zero values are judged among themselves: none is a spike,
    # and a real spike among them still is. (With zeros in the statistics
    # the MAD is 0 and every non-zero value was a spike.)
    seq = []
    for n in WOBBLE[:12]:
        seq += [(0.0, 0.0), (0.0, 0.0), (n, 2 * n)]
    seq += [(0.0, 0.0), (80.0, 2.0), (0.0, 0.0), (1.0, 30.0), (1.0, 2.0)]
    want = ["applied"] * 36 + ["applied", "spike", "applied", "spike", "applied"]
    kw = dict(window=12, min_history=3)
    jk, jw, _ = _jax_run(seq, **kw)
    tk, tw, _ = _torch_run(seq, **kw)
    assert jk == tk == want
    for (jn, jl, jc), (tn, tl, tc) in zip(jw, tw, strict=True):
        np.testing.assert_allclose(jn, tn, rtol=1e-6)
        blank = np.float32(np.log(np.float32(np.finfo(np.float32).tiny)))
        np.testing.assert_array_equal(jn == blank, tn == blank)  # one constant
        np.testing.assert_allclose(jl, tl, rtol=1e-6)
        assert jc == tc


def test_an_isolated_spike_enters_the_window_and_the_next_is_still_caught():
    # One spike in a window of 8 moves the median and the MAD by one rank:
    # the step after it is applied, and a second isolated spike is skipped
    # with the first one inside the window.
    seq = [(n, 2.0) for n in WOBBLE[:10]]
    seq += [(50.0, 2.0), (1.0, 2.0), (1.05, 2.0), (60.0, 2.0), (0.95, 2.0)]
    want = ["applied"] * 10 + ["spike", "applied", "applied", "spike", "applied"]
    kw = dict(window=8, min_history=3)
    jk, jw, _ = _jax_run(seq, **kw)
    tk, tw, _ = _torch_run(seq, **kw)
    assert jk == tk == want
    for norms in (jw[-1][0], tw[-1][0]):  # both spikes are in the window
        assert np.isclose(norms, np.log(50.0)).sum() == 1
        assert np.isclose(norms, np.log(60.0)).sum() == 1


def test_a_non_finite_update_from_finite_gradients_enters_the_window():
    # lr 1e37: the norm of 100 writes -1e39, inf in float32, so that step is
    # refused as non-finite, but its gradient norm and loss were finite
    # observations of the data: they enter (the docstring's rule (a)).
    seq = [(1.0, 2.0), (100.0, 3.0), (1.0, 2.0)]
    kw = dict(window=4, min_history=4)
    tx = jtx.skip_spikes(jtx.stable_optimizer(optax.sgd(1e37)), **kw)
    state, update = tx.init(jnp.zeros(2)), jax.jit(tx.update)
    w = torch.nn.Parameter(torch.zeros(2))
    opt = ttx.skip_spikes(torch.optim.SGD([w], lr=1e37), **kw)
    jk, tk = [], []
    for norm, loss in seq:
        g = jnp.array([norm, 0.0], jnp.float32)
        _, state = update(g, state, jnp.zeros(2), value=jnp.float32(loss))
        jk.append(_kind(bool(state.last_spike), bool(state.last_finite)))
        w.grad = torch.tensor([norm, 0.0])
        opt.step(value=loss)
        tk.append(_kind(opt.spike_state.last_spike, opt.spike_state.last_finite))
    assert jk == tk == ["applied", "non-finite", "applied"]
    want = np.log([1.0, 100.0, 1.0, 1.0])
    want[3] = 0.0  # the slot not yet written
    for s in (state, opt.spike_state):
        np.testing.assert_allclose(np.asarray(s.log_norms), want, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(s.losses), [2.0, 3.0, 2.0, 0.0])
        assert int(s.norm_count) == int(s.loss_count) == 3


def test_accumulate_gradients_around_skip_spikes_in_both():
    """torch's `accumulate_gradients` takes a `SkipSpikes` as JAX's takes
    `skip_spikes` (it refused it: "needs an optimizer"): one spike test per
    window, on the mean gradient's norm; a NaN micro-batch skips its
    window and keeps out of the spike window in both."""
    micro = [1.0, 1.0, 1.1, 0.9, 0.9, 1.1, NAN, 1.0, 50.0, 50.0, 1.0, 1.1]
    want = ["applied"] * 3 + ["non-finite", "spike", "applied"]
    kw = dict(window=4, min_history=3)
    tx = jtx.accumulate_gradients(
        jtx.skip_spikes(jtx.stable_optimizer(optax.sgd(0.1)), **kw), 2
    )
    update = jax.jit(tx.update)
    params = jnp.zeros(2)
    state = tx.init(params)
    w = torch.nn.Parameter(torch.zeros(2))
    spikes = ttx.skip_spikes(ttx.stable_optimizer(torch.optim.SGD([w], lr=0.1)), **kw)
    opt = ttx.accumulate_gradients(spikes, 2)
    jk, tk = [], []
    for i, g in enumerate(micro):
        u, state = update(jnp.array([g, 0.0], jnp.float32), state, params)
        params = optax.apply_updates(params, u)
        opt.zero_grad()
        (w * torch.tensor([g, 0.0])).sum().backward()
        opt.step()
        if i % 2:
            js = jtx.find_spike_state(state)
            jk.append(_kind(bool(js.last_spike), bool(js.last_finite)))
            ts = ttx.find_spike_state(opt)
            tk.append(_kind(ts.last_spike, ts.last_finite))
    assert jk == tk == want
    np.testing.assert_allclose(np.asarray(params), w.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(float(params[0]), -0.1 * 4.05, rtol=1e-5)
    js, ts = jtx.find_spike_state(state), ttx.find_spike_state(opt)
    assert int(js.norm_count) == ts.norm_count == 4  # the NaN window not
    assert int(jtx.find_skip_state(state).skipped_total) == 2
    assert opt.skip_state.skipped_total == 2


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
    # Every finite step entered the window, the 4 spikes too: 38 writes.
    assert int(jtx.find_spike_state(state.opt_state).position) == 38 % 16
    assert ttx.find_spike_state(topt).position == 38 % 16
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
    _, hist = jtrain.fit(state, step, data, log=None)
    model = torch.nn.Linear(3, 1, bias=False)
    topt = ttx.skip_spikes(torch.optim.SGD(model.parameters(), lr=1e-2), **kw)
    tstep = ttrain.TrainStep(model, topt, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
    tdata = [
        (torch.from_numpy(a), torch.from_numpy(b))
        for a, b in zip(x[:21], y[:21], strict=True)
    ]
    thist = ttrain.fit(tstep, tdata, log=None)
    for h in (hist, thist):
        reasons = {r["step"]: r["skip_reason"] for r in h if "skip_reason" in r}
        assert reasons == {
            7: "non-finite gradients",
            12: "spike",
            19: "spike",
            20: "spike",
        }
