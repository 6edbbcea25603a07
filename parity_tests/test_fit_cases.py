"""Issue 34's cases of `fit` in both frameworks: a stop asked on the step
that triggers a rollback or a rewind, the batches a rewind drops, spikes
against "stop"/"rollback", and the best-metric checkpoint of a restore step.

Each runs the same data through `jaxstable.train.fit` and
`torchref.train.fit` (y = x @ w, SGD, a dynamic loss scale; NaN in the
data where a step must be skipped) and checks both give the records asked.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from jaxstable import loss_scale as jls
from jaxstable import train as jtrain
from jaxstable import transforms as jtx
from torchref import loss_scale as tls
from torchref import train as ttrain
from torchref import transforms as ttx

NanPolicy = jtrain.NanPolicy


def _batches(nan_at, n, scale_from=None):
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        x = rng.normal(size=(4, 3)).astype(np.float32)
        if i in nan_at:
            x[1, 2] = np.nan
        if scale_from is not None and i >= scale_from:
            x *= 20.0  # a lasting, finite 20x shift of the gradient norm
        out.append(x)
    return out


# One jitted step for every JAX fit here (compiled once per state type).
_JSTEP = jtrain.make_train_step(lambda p, x: jnp.mean((x @ p["w"] - 1.0) ** 2))


def _parts(spikes=False):
    tx = jtx.stable_optimizer(optax.sgd(0.01))
    if spikes:
        tx = jtx.skip_spikes(tx, window=8, min_history=3)
    state = jtrain.TrainState.create(
        params={"w": jnp.ones((3,))}, optimizer=tx, loss_scale=jls.DynamicLossScale()
    )
    jstep = _JSTEP
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if spikes:
        opt = ttx.skip_spikes(opt, window=8, min_history=3)
    tstep = ttrain.TrainStep(
        model,
        opt,
        lambda m, x: ((m(x)[:, 0] - 1.0) ** 2).mean(),
        scaler=tls.DynamicLossScale(),
    )
    return state, jstep, tstep


def _fit_both(batches, spikes=False, **kwargs):
    """Both fits' histories (or ``("raised", step)`` for a NonFiniteError)."""
    state, jstep, tstep = _parts(spikes)
    try:
        jout = jtrain.fit(
            state, jstep, [jnp.asarray(b) for b in batches], log=None, **kwargs
        )[1]
    except jtrain.NonFiniteError as e:
        jout = ("raised", e.step)
    try:
        tout = ttrain.fit(
            tstep, [torch.from_numpy(b) for b in batches], log=None, **kwargs
        )
    except ttrain.NonFiniteError as e:
        tout = ("raised", e.step)
    return jout, tout


def _steps(hist):
    return [r["step"] for r in hist]


@pytest.mark.parametrize(
    "policy",
    [
        NanPolicy.rollback(max_consecutive=2, locate_first=0),
        NanPolicy.rewind(after=2, locate_first=0),
    ],
    ids=repr,
)
def test_on_step_stops_on_the_step_that_restores(policy):
    # NaN at 4 and 5: step 5 triggers the rollback (2 in a row) or the
    # rewind (2 in the window); on_step asks to stop there, so step 5 is the
    # last record (the old loop ignored it and ran to 11).
    for hist in _fit_both(
        _batches({4, 5}, 12), on_step=lambda r, s: r["step"] == 5, nan_policy=policy
    ):
        assert _steps(hist) == [0, 1, 2, 3, 4, 5]
        assert hist[-1].get("rolled_back") or hist[-1].get("rewound")


def test_stop_after_nonfinite_zero_on_the_trigger_step():
    # The first bad step (4) is the trigger itself: stop_after_nonfinite=0
    # stops there (the old loop ran step 5 too).
    for hist in _fit_both(
        _batches({4, 5}, 12),
        nan_policy=NanPolicy.rollback(max_consecutive=1, stop_after=0, locate_first=0),
    ):
        assert _steps(hist) == [0, 1, 2, 3, 4]
        assert hist[-1]["rolled_back"]


def test_batches_skipped_when_the_data_ends_inside_the_window():
    # Snapshot after step 3 (rollback_every=2: at 2 and 4), NaN at 4 triggers
    # the rewind to 4; rewind_skip=3 asks for 3 more but only batch 5 is
    # left: batches 4 and 5 are dropped, not 4 + 3.
    for hist in _fit_both(
        _batches({4}, 6),
        nan_policy=NanPolicy.rewind(after=1, window=1, skip=3, every=2, locate_first=0),
    ):
        assert [(r["rewind_to"], r["batches_skipped"]) for r in hist[-1:]] == [(4, 2)]


def test_batches_skipped_counts_only_new_batches_on_a_second_rewind():
    # Snapshot at 0 only; NaN at 2 rewinds (batches 0..2 dropped), batches 3
    # and 4 train on the snapshot, NaN at 5 rewinds again to 0: batches 3..5
    # are the new ones dropped (the old loop said 6, counting 0..2 twice).
    for hist in _fit_both(
        _batches({2, 5}, 8),
        nan_policy=NanPolicy.rewind(after=1, window=1, locate_first=0),
    ):
        rewound = [r for r in hist if r.get("rewound")]
        assert [(r["step"], r["rewind_to"], r["batches_skipped"]) for r in rewound] == [
            (2, 0, 3),
            (5, 0, 3),
        ]


@pytest.mark.parametrize("policy", ["stop", "rollback"])
def test_spikes_do_not_count_toward_stop_or_rollback(policy):
    # From step 6 on every batch is 20x larger: finite steps that
    # skip_spikes skips until its window has learned the new scale. They are
    # not non-finite: "stop" and "rollback" (which count non-finite steps in
    # a row) neither raise nor roll back; the records say why they skipped.
    jhist, thist = _fit_both(
        _batches(set(), 20, scale_from=6),
        spikes=True,
        nan_policy=getattr(NanPolicy, policy)(max_consecutive=2, locate_first=0),
    )
    for hist in (jhist, thist):
        assert hist != ("raised", hist[1]) and len(hist) == 20
        reasons = [r.get("skip_reason") for r in hist if not r["finite"]]
        assert len(reasons) >= 2 and set(reasons) == {"spike"}
        assert not any(r.get("rolled_back") for r in hist)
    assert [r["finite"] for r in jhist] == [r["finite"] for r in thist]


def test_spikes_still_count_toward_rewind():
    # PaLM's rewind is for spikes: two skipped steps in the window rewind.
    for hist in _fit_both(
        _batches(set(), 12, scale_from=6),
        spikes=True,
        nan_policy=NanPolicy.rewind(after=2, window=4, locate_first=0),
    ):
        assert any(r.get("rewound") for r in hist)


@pytest.mark.parametrize(
    "policy",
    [
        NanPolicy.rollback(max_consecutive=1, every=2, locate_first=0),
        NanPolicy.rewind(after=1, every=2, locate_first=0),
    ],
    ids=repr,
)
def test_best_checkpoint_records_the_metric_of_the_state_it_holds(policy, tmp_path):
    # NaN at 5 restores the snapshot of step 4; checkpoint 6 then holds the
    # state of 4 steps. The old loop gave it the metric of the discarded
    # state (6 steps), so best_step() named a checkpoint holding another.
    state, jstep, tstep = _parts()
    kw = dict(nan_policy=policy, log=None)
    opts = dict(max_to_keep=10, best_metric="eval['n']", best_mode="max")
    batches = _batches({5}, 6)
    jmgr = jtrain.CheckpointManager(tmp_path / "jax", **opts)
    _, jhist = jtrain.fit(
        state, jstep, [jnp.asarray(b) for b in batches],
        checkpoint=jtrain.Checkpointing(jmgr, every=1),
        evaluate=(lambda s: {"n": s.step}, 1), **kw,
    )  # fmt: skip
    tmgr = ttrain.CheckpointManager(tmp_path / "torch", **opts)
    thist = ttrain.fit(
        tstep, [torch.from_numpy(b) for b in batches],
        checkpoint=ttrain.Checkpointing(tmgr, every=1),
        evaluate=(lambda s: {"n": s.steps_done}, 1), **kw,
    )  # fmt: skip
    assert jmgr.best_step() == tmgr.best_step() == 5
    held = jmgr.restore(state, 5)[0]
    assert int(held.step) == jhist[4]["eval['n']"] == 5
    tmgr.restore(tstep, 5)
    assert tstep.steps_done == thist[4]["eval['n']"] == 5
    jmgr.close()
    tmgr.close()
