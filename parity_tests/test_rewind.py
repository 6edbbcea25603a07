"""`fit(nan_policy="rewind")` in both frameworks (issue 23).

Two skipped steps (a NaN batch and a spike made by a scaled batch, not in a
row) within the window trigger a rewind: the state goes back to the last
good snapshot and the data goes on past the trigger (and ``rewind_skip``
more batches). The rewound run must equal, bit for bit, a run that never saw
the skipped batches; a run killed between the two bad steps and resumed
rewinds as the uninterrupted one.
"""

from __future__ import annotations

import copy

import chex
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from jaxstable import train as jtrain
from jaxstable import transforms as jtx
from torchref import train as ttrain
from torchref import transforms as ttx

N, NAN_AT, SPIKE_AT = 14, 5, 7
# rollback_every=4: the snapshot is the state after 4 steps; the trigger is
# step 7 (2 skipped among the last 4), so batches 4..7 are never trained on.
KW = dict(
    rewind_after=2, rewind_window=4, rollback_every=4, locate_first=0, progress=False
)
SPIKES = dict(window=8, min_history=3)


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N, 32, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32))[..., None]
    x[NAN_AT, 0, 0] = np.nan
    x[SPIKE_AT] *= 1e3
    return x, y


def _kept(skip):
    return [i for i in range(N) if not 4 <= i <= SPIKE_AT + skip]


def _jax_parts():
    tx = jtx.skip_spikes(jtx.stable_optimizer(optax.adam(1e-2)), **SPIKES)
    state = jtrain.TrainState.create(
        params={"w": jnp.zeros((3, 1)), "b": jnp.zeros(1)}, optimizer=tx
    )
    step = jtrain.make_train_step(
        lambda p, b: jnp.mean((b[0] @ p["w"] + p["b"] - b[1]) ** 2)
    )
    return state, step


@pytest.fixture(scope="module")
def jax_parts():
    return _jax_parts()


def _jax_batches(idx):
    x, y = _data()
    return [(jnp.asarray(x[i]), jnp.asarray(y[i])) for i in idx]


def _rewind_to(where, tmp_path):
    """fit's arguments that make the rewind go back to the in-memory snapshot
    or to the checkpoint on disk: checkpoint_every=4 writes the state after 4
    steps, the same point as rollback_every=4."""
    if where == "memory":
        return {}
    return dict(rollback_to="disk", checkpoint_dir=tmp_path, checkpoint_every=4)


# (rewind_skip, where the rewind restores from)
REWINDS = [(0, "memory"), (2, "memory"), (2, "disk")]


@pytest.mark.parametrize("skip, where", REWINDS)
def test_jax_rewound_run_equals_a_run_without_the_batches(
    jax_parts, skip, where, tmp_path
):
    state, step = jax_parts
    out, hist = jtrain.fit(
        state, step, _jax_batches(range(N)), nan_policy="rewind",
        rewind_skip=skip, **_rewind_to(where, tmp_path), **KW,
    )  # fmt: skip
    rewound = [h for h in hist if h.get("rewound")]
    assert len(rewound) == 1
    assert {k: rewound[0][k] for k in ("step", "rewind_from", "rewind_to")} == {
        "step": SPIKE_AT, "rewind_from": SPIKE_AT, "rewind_to": 4,
    }  # fmt: skip
    assert rewound[0]["batches_skipped"] == SPIKE_AT + 1 - 4 + skip
    assert rewound[0]["skip_reason"] == "spike"
    assert [h["step"] for h in hist][SPIKE_AT + 1] == SPIKE_AT + 1 + skip
    ref, _ = jtrain.fit(state, step, _jax_batches(_kept(skip)), progress=False)
    chex.assert_trees_all_equal(
        (out.params, out.opt_state, out.step, out.skipped_total),
        (ref.params, ref.opt_state, ref.step, ref.skipped_total),
    )


def test_jax_resume_between_the_bad_steps_rewinds_the_same(jax_parts, tmp_path):
    state, step = jax_parts
    data = _jax_batches(range(N))
    full, _ = jtrain.fit(state, step, data, nan_policy="rewind", **KW)
    # Killed after step 5 (the NaN): the checkpoint holds the window [5].
    kw = dict(nan_policy="rewind", checkpoint_dir=tmp_path, **KW)
    jtrain.fit(state, step, data, steps=6, **kw)
    out, rest = jtrain.fit(state, step, data, resume=True, **kw)
    assert [h["step"] for h in rest if h.get("rewound")] == [SPIKE_AT]
    chex.assert_trees_all_equal(
        (out.params, out.opt_state, out.step), (full.params, full.opt_state, full.step)
    )


def _torch_step(model):
    opt = ttx.skip_spikes(torch.optim.Adam(model.parameters(), lr=1e-2), **SPIKES)
    return ttrain.TrainStep(model, opt, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())


def _torch_model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _torch_batches(idx):
    x, y = _data()
    return [(torch.from_numpy(x[i]), torch.from_numpy(y[i])) for i in idx]


def _torch_state(step):
    sd = step.state_dict()
    return [t.clone() for t in step.model.parameters()], sd["optimizer"]["state"]


@pytest.mark.parametrize("skip, where", REWINDS)
def test_torch_rewound_run_equals_a_run_without_the_batches(skip, where, tmp_path):
    model = _torch_model()
    ref_model = copy.deepcopy(model)
    step = _torch_step(model)
    hist = ttrain.fit(
        step, _torch_batches(range(N)), nan_policy="rewind", rewind_skip=skip,
        **_rewind_to(where, tmp_path), **KW,
    )  # fmt: skip
    rewound = [h for h in hist if h.get("rewound")]
    assert [(h["step"], h["rewind_to"], h["batches_skipped"]) for h in rewound] == [
        (SPIKE_AT, 4, SPIKE_AT + 1 - 4 + skip)
    ]
    ref = _torch_step(ref_model)
    ttrain.fit(ref, _torch_batches(_kept(skip)), progress=False)
    (params, opt), (ref_params, ref_opt) = _torch_state(step), _torch_state(ref)
    for a, b in zip(params, ref_params, strict=True):
        assert torch.equal(a, b)
    for key in opt:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt[key][name], ref_opt[key][name])
    assert step.steps_done == ref.steps_done
    torch.testing.assert_close(step.spike_state.log_norms, ref.spike_state.log_norms)


def test_torch_resume_between_the_bad_steps_rewinds_the_same(tmp_path):
    model = _torch_model()
    twin = copy.deepcopy(model)
    full = _torch_step(model)
    ttrain.fit(full, _torch_batches(range(N)), nan_policy="rewind", **KW)
    kw = dict(nan_policy="rewind", checkpoint_dir=tmp_path, **KW)
    first = copy.deepcopy(twin)
    ttrain.fit(_torch_step(first), _torch_batches(range(N)), steps=6, **kw)
    resumed = _torch_step(twin)
    rest = ttrain.fit(resumed, _torch_batches(range(N)), resume=True, **kw)
    assert [h["step"] for h in rest if h.get("rewound")] == [SPIKE_AT]
    for a, b in zip(_torch_state(resumed)[0], _torch_state(full)[0], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(rewind_after=0), "rewind_after must be an int >= 1"),
        (dict(rewind_window=2, rewind_after=3), r"rewind_window \(2\) must be >="),
        (dict(rewind_skip=-1), "rewind_skip must be an int >= 0"),
        (dict(rewind_skip=1.5), "rewind_skip must be an int"),
        (dict(nan_policy="rewnd"), "nan_policy must be one of"),
    ],
)
def test_bad_rewind_arguments_same_errors(jax_parts, kw, match):
    state, step = jax_parts
    with pytest.raises((TypeError, ValueError), match=match):
        jtrain.fit(state, step, [], progress=False, **kw)
    with pytest.raises((TypeError, ValueError), match=match):
        ttrain.fit(_torch_step(_torch_model()), [], progress=False, **kw)


def test_rewinds_exhausted_raise_in_both(jax_parts):
    state, step = jax_parts
    kw = dict(KW, max_rollbacks=1)
    idx = [*range(N), NAN_AT, NAN_AT]  # two more NaN steps at the end
    with pytest.raises(jtrain.NonFiniteError, match="rewinds exhausted"):
        jtrain.fit(state, step, _jax_batches(idx), nan_policy="rewind", **kw)
    with pytest.raises(ttrain.NonFiniteError, match="rewinds exhausted"):
        ttrain.fit(
            _torch_step(_torch_model()), _torch_batches(idx), nan_policy="rewind", **kw
        )
