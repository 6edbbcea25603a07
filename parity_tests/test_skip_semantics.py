"""What advances on a skipped, rolled back and rewound step: the table of
docs/semantics.md, stated once here and checked in both frameworks.

Eight batches, NaN at step 5; snapshot every 4 steps (so at 4). Each policy
acts at step 5 (``max_consecutive=1``, ``after=1``); ``on_step`` stops the
run there, and the state is read: the optimizer's count (Adam's), the
learning-rate schedule's count (optax's `scale_by_schedule`; torch's
scheduler handed to fit), the loss scale, the spike window (`skip_spikes`'s
values), the global step and skip count,
and the data position (the final checkpoint's step). A run stopped there,
checkpointed and resumed must end where the uninterrupted run ends.
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

N, BAD, SCALE = 8, 5, 2.0**15

# After the trigger step (step 5 of the run: 5 applied steps before it, the
# snapshot holds 4): (optimizer count, schedule count, loss scale, spike
# window (values in it), global step, skipped_total, data position).
TABLE = {
    "skip": (5, 5, SCALE / 2, 5, 6, 1, 6),
    "rollback": (4, 4, SCALE, 4, 4, 0, 6),
    "rewind": (4, 4, SCALE, 4, 4, 0, 7),  # skip=1: batch 6 dropped too
}
# A spike guard that checks no step of this run (min_history = the 8
# steps): its window only fills.
SPIKES = dict(window=8, min_history=8)
POLICIES = {
    "skip": jtrain.NanPolicy.skip(locate_first=0),
    "rollback": jtrain.NanPolicy.rollback(max_consecutive=1, every=4, locate_first=0),
    "rewind": jtrain.NanPolicy.rewind(
        after=1, window=1, skip=1, every=4, locate_first=0
    ),
}


def _data():
    rng = np.random.default_rng(2)
    out = []
    for i in range(N):
        x = rng.normal(size=(4, 3)).astype(np.float32)
        if i == BAD:
            x[0, 0] = np.nan
        out.append(x)
    return out


def _jax_fit(policy, checkpoint, **kw):
    tx = jtx.stable_optimizer(optax.adam(optax.exponential_decay(0.01, 1, 0.9)))
    tx = jtx.skip_spikes(tx, **SPIKES)
    state = jtrain.TrainState.create(
        params={"w": jnp.ones(3)},
        optimizer=tx,
        loss_scale=jls.DynamicLossScale(SCALE),
    )
    step = _JSTEP
    data = [jnp.asarray(x) for x in _data()]
    state, _ = jtrain.fit(
        state, step, data, nan_policy=policy, checkpoint=checkpoint, log=None, **kw
    )
    counts = dict(
        (path[-1].tuple_name, int(v))
        for path, v in optax.tree_utils.tree_get_all_with_path(state.opt_state, "count")
    )
    return (
        counts["ScaleByAdamState"],
        counts["ScaleByScheduleState"],
        float(state.loss_scale.loss_scale),
        int(optax.tree_utils.tree_get(state.opt_state, "norm_count")),
        int(state.step),
        int(state.skipped_total),
    ), np.asarray(state.params["w"])


def _torch_fit(policy, checkpoint, **kw):
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)
    step = ttrain.TrainStep(
        model,
        ttx.skip_spikes(opt, **SPIKES),
        lambda m, x: ((m(x)[:, 0] - 1.0) ** 2).mean(),
        scaler=tls.DynamicLossScale(SCALE),
    )
    data = [torch.from_numpy(x) for x in _data()]
    ttrain.fit(
        step, data, nan_policy=policy, checkpoint=checkpoint, log=None,
        schedulers=sched, **kw,
    )  # fmt: skip
    adam = opt.state_dict()["state"][0]
    return (
        int(adam["step"]),
        sched.last_epoch,
        float(step.scaler.get_scale()),
        int(step.spike_state.norm_count),
        step.steps_done,
        int(step.skip_state.skipped_total),
    ), model.weight.detach().numpy()[0].copy()


FITS = {"jax": _jax_fit, "torch": _torch_fit}
# One jitted step for every JAX fit here (compiled once per state type).
_JSTEP = jtrain.make_train_step(lambda p, x: jnp.mean((x @ p["w"] - 1.0) ** 2))


@pytest.mark.parametrize("framework", sorted(FITS))
@pytest.mark.parametrize("kind", sorted(TABLE))
def test_what_advances_on_the_policys_step(kind, framework, tmp_path):
    fit, mgr_type = FITS[framework], {"jax": jtrain, "torch": ttrain}[framework]
    mgr = mgr_type.CheckpointManager(tmp_path, async_save=False)
    got, _ = fit(POLICIES[kind], mgr, on_step=lambda r, s: r["step"] == BAD)
    assert (*got, mgr.latest_step()) == TABLE[kind]
    mgr.close()


@pytest.mark.parametrize("framework", sorted(FITS))
@pytest.mark.parametrize("kind", sorted(TABLE))
def test_a_resume_right_after_the_policys_step_ends_as_the_uninterrupted_run(
    kind, framework, tmp_path
):
    fit = FITS[framework]
    train = {"jax": jtrain, "torch": ttrain}[framework]
    full, full_w = fit(POLICIES[kind], None)
    ckpt = train.Checkpointing(tmp_path, resume=True)
    fit(POLICIES[kind], ckpt, on_step=lambda r, s: r["step"] == BAD)
    resumed, resumed_w = fit(POLICIES[kind], ckpt)
    assert resumed == full
    np.testing.assert_array_equal(resumed_w, full_w)
