"""Unit tests of jaxstable.train: the guarded step and the fit loop."""

import json

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import has_conditional
from jaxstable import loss_scale as jls
from jaxstable import train, transforms


def _init_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (4, 8)) * 0.5,
        "b1": jnp.zeros(8),
        "w2": jax.random.normal(k2, (8, 1)) * 0.5,
    }


def _mlp_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    pred = (h @ params["w2"])[:, 0]
    return jnp.mean((pred.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)


def _batch(seed, nan=False):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    if nan:
        x[3, 1] = np.nan
    y = x.sum(axis=1).astype(np.float32)
    return jax.device_put((jnp.asarray(x), jnp.asarray(y)))


def _state(tx=None, ls=None):
    tx = tx or transforms.stable_optimizer(optax.adam(1e-2), max_grad_norm=1.0)
    return train.TrainState.create(
        params=_init_params(), optimizer=tx, loss_scale=ls or jls.DynamicLossScale()
    )


_STEP = train.make_train_step(_mlp_loss)  # one jitted step reused by the tests


def test_step_trains_and_reports_metrics(tol):
    state = _state()
    first = None
    for i in range(30):
        state, m = _STEP(state, _batch(i % 4))
        first = first if first is not None else float(m["loss"])
    assert set(m) == {
        "loss",
        "grad_norm",
        "loss_scale",
        "finite",
        "grads_finite",
        "skipped_total",
    }
    assert m["loss"].dtype == jnp.float32 and m["grad_norm"].dtype == jnp.float32
    assert m["loss_scale"].dtype == jnp.float32 and m["finite"].dtype == jnp.bool_
    assert m["skipped_total"].dtype == jnp.int32
    assert float(m["loss"]) < 0.5 * first
    assert int(state.step) == 30 and int(m["skipped_total"]) == 0
    # grad_norm is the pre-clip norm of the unscaled gradients.
    grads = jax.grad(_mlp_loss)(state.params, _batch(1))
    _, m = _STEP(state, _batch(1))
    np.testing.assert_allclose(
        float(m["grad_norm"]), float(transforms.global_norm(grads)), **tol("float32")
    )


def test_nan_batch_is_skipped():
    state, _ = _STEP(_state(), _batch(0))
    new, m = _STEP(state, _batch(1, nan=True))
    assert not bool(m["finite"])
    assert int(m["skipped_total"]) == 1 and int(new.skipped_total) == 1
    assert float(m["loss_scale"]) == 2.0**16  # the scale used for this step
    assert float(new.loss_scale.loss_scale) == 2.0**15  # halved after it
    jax.tree.map(np.testing.assert_array_equal, new.params, state.params)
    jax.tree.map(
        np.testing.assert_array_equal, new.opt_state, _skip_counts_only(state, new)
    )
    assert int(new.step) == int(state.step) + 1


def _skip_counts_only(old, new):
    """old.opt_state with the skip counters that a skip is meant to change."""
    s_old, s_new = old.opt_state, new.opt_state
    return s_old._replace(
        skipped_total=s_new.skipped_total,
        consecutive=s_new.consecutive,
        last_finite=s_new.last_finite,
        exceeded=s_new.exceeded,
        last_grads_finite=s_new.last_grads_finite,
        non_finite_updates=s_new.non_finite_updates,
    )


def test_plain_optax_optimizer_is_guarded_by_the_step():
    state = _state(tx=optax.adam(1e-2))
    new, m = _STEP(state, _batch(1, nan=True))
    assert not bool(m["finite"]) and int(m["skipped_total"]) == 1
    jax.tree.map(
        np.testing.assert_array_equal,
        (new.params, new.opt_state),
        (state.params, state.opt_state),
    )


@pytest.mark.parametrize("eps, checks", [(1e-8, 0), (0.0, 1)])
def test_compiled_step_has_no_conditional_and_one_finiteness_reduction(eps, checks):
    tx = transforms.stable_optimizer(optax.adam(1e-2, eps=eps), max_grad_norm=1.0)
    state, batch = _state(tx), _batch(0)
    lowered = _STEP.lower(state, batch)
    assert not has_conditional(lowered)
    # One is_finite on the gradients' scaled sum of squares (the single
    # all_finite over the gradients, the norm's own reduction) and one on the
    # (scalar) loss: together the one flag reused by the skip and the loss
    # scale; one on the grown scalar scale inside DynamicLossScale.adjust;
    # and, where `UpdateBound` cannot prove the update finite (eps=0: 0 / 0
    # where a gradient is 0), one on the update check's sum of ``leaf * 0``
    # over everything the step writes (new params, Adam's mu and nu): no
    # is_finite per leaf.
    assert lowered.as_text().count("is_finite") == 1 + 1 + 1 + checks


def test_step_runs_under_transfer_guard_without_retracing():
    state, batch = _state(), _batch(0)
    bad = _batch(1, nan=True)
    step = jax.jit(
        chex.assert_max_traces(train.make_train_step(_mlp_loss, jit=False).raw, n=1)
    )
    state, _ = step(state, batch)  # warm: compile once
    with jax.transfer_guard("disallow"):
        for b in (batch, bad, batch):
            state, m = step(state, b)
    assert int(m["skipped_total"]) == 1
    chex.clear_trace_counter()


def test_has_aux_and_donate():
    def loss(params, batch):
        value = _mlp_loss(params, batch)
        return value, {"twice": 2 * value}

    step = train.make_train_step(loss, has_aux=True, donate=True)
    state, m = step(_state(), _batch(0))
    np.testing.assert_array_equal(m["aux"]["twice"], 2 * m["loss"])
    state, m = step(state, _batch(1))
    assert bool(m["finite"])


def test_float16_compute_policy():
    seen = []

    def loss(params, batch):
        seen.append((params["w1"].dtype, batch[0].dtype))
        return _mlp_loss(params, batch)

    step = train.make_train_step(
        loss, policy="params=float32,compute=float16,output=float32"
    )
    state = _state()
    losses = []
    for i in range(20):
        state, m = step(state, _batch(i % 4))
        losses.append(float(m["loss"]))
    assert seen[0] == (jnp.float16, jnp.float16)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(state.params))
    # Step 1 overflows: the fp16 cotangent of the loss is the scale, 2**16 > 65504.
    assert int(m["skipped_total"]) >= 1
    assert np.isfinite(losses[-1]) and losses[-1] < losses[0]
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(state.params))


class _BNNet(nn.Module):
    """Dense -> BatchNorm -> tanh -> Dense: the batch stats are model state."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(1)(jnp.tanh(x))[:, 0]


def test_batch_norm_model_state():
    model = _BNNet()
    variables = model.init(jax.random.key(0), jnp.ones((2, 4)))

    def loss(params, model_state, batch):
        x, y = batch
        pred, new_state = model.apply(
            {"params": params, **model_state}, x, mutable=["batch_stats"]
        )
        return jnp.mean((pred - y) ** 2), new_state

    step = train.make_train_step(loss, has_state=True)
    state = train.TrainState.create(
        params=variables["params"],
        optimizer=transforms.stable_optimizer(optax.sgd(0.05), max_grad_norm=1.0),
        loss_scale=jls.DynamicLossScale(),
        model_state={"batch_stats": variables["batch_stats"]},
    )
    new, m = step(state, _batch(0))
    assert bool(m["finite"])
    mean0 = state.model_state["batch_stats"]["BatchNorm_0"]["mean"]
    mean1 = new.model_state["batch_stats"]["BatchNorm_0"]["mean"]
    assert not np.allclose(mean0, mean1)  # running stats moved
    after_bad, m = step(new, _batch(1, nan=True))
    assert not bool(m["finite"])
    jax.tree.map(np.testing.assert_array_equal, after_bad.model_state, new.model_state)
    jax.tree.map(np.testing.assert_array_equal, after_bad.params, new.params)


def test_bad_flags():
    with pytest.raises(TypeError, match="has_aux must be True or False"):
        train.make_train_step(_mlp_loss, has_aux=1)
    with pytest.raises(ValueError, match="unknown dtype"):
        train.make_train_step(_mlp_loss, policy="compute=f8")


def test_fit_logs_and_skips(tmp_path, capsys):
    batches = [_batch(i, nan=(i == 2)) for i in range(6)]
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 99}\n')  # an older run's log: overwritten, not appended
    state, hist = train.fit(
        _state(),
        _STEP,
        batches,
        log=train.Log(log, progress=True),
        checkpoint=train.Checkpointing(tmp_path / "ckpt", every=4),
    )
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert json.dumps(lines) == json.dumps(hist) and len(hist) == 6  # NaN != NaN
    assert set(hist[0]) == {
        "step",
        "loss",
        "grad_norm",
        "loss_scale",
        "finite",
        "skipped_total",
        "grads_finite",
    }
    assert hist[2]["skip_reason"] == "non-finite gradients"
    assert [h["step"] for h in hist] == list(range(6))  # 0-based, as torchref
    assert [h["finite"] for h in hist] == [True, True, False, True, True, True]
    assert hist[-1]["skipped_total"] == 1 and hist[3]["loss_scale"] == 2.0**15
    err = capsys.readouterr().err
    assert "loss_scale" in err and "skipped" in err  # the tqdm bar
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "bad_batches.json",  # the NaN batch, located: it reproduced
        "step_00000004",
        "step_00000006",  # the final one (orbax checkpoint directories)
    ]
    blank = _state()
    restored = train.load_checkpoint(tmp_path / "ckpt" / "step_00000006", blank)
    jax.tree.map(np.testing.assert_array_equal, restored.params, state.params)
    assert float(restored.loss_scale.loss_scale) == float(state.loss_scale.loss_scale)
    assert int(restored.skipped_total) == 1
    _, short = train.fit(_state(), _STEP, iter(batches), steps=2, log=None)
    assert len(short) == 2


def test_fit_stop_raises_with_report():
    batches = [_batch(0)] + [_batch(i, nan=True) for i in range(1, 6)]
    with pytest.raises(train.NonFiniteError) as info:
        train.fit(
            _state(),
            _STEP,
            batches,
            nan_policy=train.NanPolicy.stop(max_consecutive=3),
            log=None,
        )
    err = info.value
    assert isinstance(err, FloatingPointError)
    assert err.step == 3  # 0-based, as torchref
    msg = str(err)
    assert msg.startswith("3 non-finite step(s) in a row, the last at step 3; ")
    assert "loss_scale=16384 (the scale that step used)" in msg
    assert "non-finite gradients at loss_scale=16384:" in msg
    assert "['w1']" in msg  # gradient leaf named in the report
    assert "non-finite batch inputs" in msg and "[0]" in msg
    assert {r.path for r in err.report} >= {"['w1']", "['b1']", "['w2']"}
    assert all(
        bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(err.state.params)
    )


@pytest.mark.parametrize(
    ("donate", "every"), [(False, None), (True, None), (False, 1), (True, 1)]
)
def test_fit_stop_state_is_that_of_the_failing_step(tmp_path, donate, every):
    # [ok, nan, nan, ok] with a limit of 2: step 2 fails; batch 3 must not be
    # trained on, and nothing of it may show in the error, history or files.
    # donate=False keeps fit's one-step lookahead (batch 3 is dispatched, its
    # result dropped); donate=True reads each step before the next. A
    # checkpoint due at a step also reads it first.
    step = train.make_train_step(_mlp_loss, donate=donate)
    batches = [_batch(0), _batch(1, nan=True), _batch(2, nan=True), _batch(3)]
    expected, _ = _STEP(_state(), batches[0])
    with pytest.raises(train.NonFiniteError) as info:
        train.fit(
            _state(),
            step,
            batches,
            nan_policy=train.NanPolicy.stop(max_consecutive=2),
            log=train.Log(tmp_path / "log.jsonl", progress=False),
            checkpoint=train.Checkpointing(tmp_path / "ck", every=every),
        )
    err = info.value
    assert err.step == 2 and int(err.state.step) == 3
    assert int(err.state.skipped_total) == 2
    jax.tree.map(np.testing.assert_array_equal, err.state.params, expected.params)
    assert [h["step"] for h in err.history] == [0, 1, 2]
    logged = [json.loads(s)["step"] for s in (tmp_path / "log.jsonl").open()]
    assert logged == [0, 1, 2]
    expected_files = [] if every is None else [f"step_{n:08d}" for n in (1, 2)]
    # and the bad-batch list: step 1's NaN batch, located, reproduced
    expected_files = ["bad_batches.json", *expected_files]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == expected_files


def test_fit_stop_report_uses_the_scale_the_failing_step_used():
    # Not NaN data: w * 7e33 scaled by 2**16 overflows float32 (max 3.4e38),
    # scaled by the backed-off 2**15 it does not.
    step = train.make_train_step(lambda p, b: p["w"] * b)
    state = train.TrainState.create(
        params={"w": jnp.ones([])},
        optimizer=transforms.stable_optimizer(optax.sgd(0.1)),
        loss_scale=jls.DynamicLossScale(),
    )
    with pytest.raises(train.NonFiniteError) as info:
        train.fit(
            state,
            step,
            [jnp.float32(7e33)],
            nan_policy=train.NanPolicy.stop(max_consecutive=1),
            log=None,
        )
    err = info.value
    assert [r.path for r in err.report] == ["['w']"]
    assert err.report[0].inf_count == 1
    assert "loss_scale=65536 (the scale that step used)" in str(err)
    assert "non-finite gradients at loss_scale=65536:" in str(err)
    assert "non-finite batch inputs" not in str(err)
    assert float(err.state.loss_scale.loss_scale) == 2.0**15


def test_fit_checkpoint_dir_alone_writes_a_final_checkpoint(tmp_path):
    train.fit(
        _state(),
        _STEP,
        [_batch(i) for i in range(3)],
        log=None,
        checkpoint=tmp_path,
    )
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000003"]
    restored = train.load_checkpoint(tmp_path / "step_00000003", _state())
    assert int(restored.step) == 3


def test_step_guards_when_skip_is_not_outermost():
    # The skip transform inside a chain only zeroes ITS part of the update;
    # add_decayed_weights after it would still move the params by 0.5 * p.
    tx = optax.chain(
        transforms.skip_non_finite(optax.sgd(0.1)), optax.add_decayed_weights(0.5)
    )
    step = train.make_train_step(lambda p, b: jnp.sum(p * b))
    state = train.TrainState.create(params=jnp.ones(2), optimizer=tx)
    new, m = step(state, jnp.array([1.0, jnp.nan]))
    assert not bool(m["finite"])
    assert new.params.tolist() == [1.0, 1.0]
    jax.tree.map(np.testing.assert_array_equal, new.opt_state, state.opt_state)
    new, m = step(new, jnp.array([1.0, 2.0]))
    assert bool(m["finite"]) and new.params.tolist() != [1.0, 1.0]


def test_inject_hyperparams_around_the_skip_is_trusted():
    tx = optax.inject_hyperparams(
        lambda learning_rate: transforms.stable_optimizer(optax.sgd(learning_rate))
    )(learning_rate=0.1)
    step = train.make_train_step(lambda p, b: jnp.sum(p * b))
    state = train.TrainState.create(params=jnp.ones(2), optimizer=tx)
    new, m = step(state, jnp.array([1.0, jnp.nan]))
    assert not bool(m["finite"]) and new.params.tolist() == [1.0, 1.0]
    # The skip transform itself recorded the skip (the step did not revert it).
    assert int(transforms.find_skip_state(new.opt_state).skipped_total) == 1


def _nan_at_count_one(count):
    return jnp.where(count == 1, jnp.nan, 0.1)


@pytest.mark.parametrize("spikes", [False, True], ids=["inject", "spikes_of_inject"])
def test_a_nan_schedule_value_is_not_kept_in_the_injected_hyperparams(spikes):
    # The schedule's NaN at count 1 makes step 1 a non-finite update: it is
    # skipped, and its learning rate is not written into opt_state (the
    # invariant), also with skip_spikes around inject_hyperparams, a form
    # skip_spikes takes (it wrote the NaN there).
    tx = optax.inject_hyperparams(
        lambda learning_rate: transforms.stable_optimizer(optax.sgd(learning_rate))
    )(learning_rate=_nan_at_count_one)
    if spikes:
        tx = transforms.skip_spikes(tx, window=4, min_history=2)
    step = train.make_train_step(lambda p, b: jnp.sum(p * b))
    state = train.TrainState.create(params=jnp.ones(2), optimizer=tx)
    state, m = step(state, jnp.array([1.0, 2.0]))
    assert bool(m["finite"])
    state, m = step(state, jnp.array([1.0, 2.0]))
    assert not bool(m["finite"]) and int(m["skipped_total"]) == 1
    chex.assert_tree_all_finite(state.opt_state)
    inject = state.opt_state.inner_state if spikes else state.opt_state
    assert float(inject.hyperparams["learning_rate"]) == pytest.approx(0.1)
    state, m = step(state, jnp.array([1.0, 2.0]))  # count 2: applied again
    assert bool(m["finite"])


def test_reduce_on_plateau_gets_the_loss_and_a_skipped_step_keeps_its_counters():
    # optax's reduce_on_plateau needs value= (the loss): the step passes it
    # to any extra-args optimizer (it raised "missing ... 'value'"). A flat
    # loss halves the scale every 2 steps; a NaN step is skipped and leaves
    # the plateau's counters as they were.
    plateau = optax.contrib.reduce_on_plateau(
        patience=2, factor=0.5, cooldown=0, accumulation_size=1
    )
    tx = optax.chain(transforms.stable_optimizer(optax.sgd(0.1)), plateau)
    step = train.make_train_step(lambda p, b: jnp.sum((p - b) ** 2))
    state = train.TrainState.create(params=jnp.ones(2), optimizer=tx)
    scales = []
    for b in [1.0, 1.0, 1.0, jnp.nan, 1.0, 1.0]:
        before = state.opt_state[1]
        state, m = step(state, jnp.array([b, 1.0]))
        if not bool(m["finite"]):
            jax.tree.map(np.testing.assert_array_equal, state.opt_state[1], before)
        scales.append(float(state.opt_state[1].scale))
    assert scales == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25]


def test_lower_without_jit():
    step = train.make_train_step(_mlp_loss, jit=False)
    lowered = step.lower(_state(), _batch(0))
    assert not has_conditional(lowered)


def test_non_scalar_loss_is_rejected():
    step = train.make_train_step(lambda p, b: p * b)
    state = train.TrainState.create(params=jnp.ones(2), optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError) as info:
        step(state, jnp.ones(2))
    # Same text as torchref.train.TrainStep.
    assert str(info.value) == (
        "loss_fn must return a scalar (0-d) loss, got shape (2,); "
        "reduce it, e.g. with .mean()"
    )


def test_load_checkpoint_rejects_another_loss_scale_type(tmp_path):
    path = tmp_path / "ck"
    train.save_checkpoint(path, _state(ls=jls.DynamicLossScale(period=7)))
    for other in (jls.NoOpLossScale(), jls.StaticLossScale(8.0)):
        target = _state().replace(loss_scale=other)
        with pytest.raises(ValueError) as info:
            train.load_checkpoint(path, target)
        msg = str(info.value)
        assert "DynamicLossScale" in msg and type(other).__name__ in msg
    restored = train.load_checkpoint(path, _state())
    assert restored.loss_scale.period == 7


def test_fit_invalid_arguments():
    with pytest.raises(
        ValueError,
        match=r"nan_policy must be one of \('skip', 'stop', 'rollback', 'rewind'\)",
    ):
        train.fit(_state(), _STEP, [], nan_policy="ignore")
    for name in ("rollback_every", "max_rollbacks"):
        for bad in (0, 1.5, True):
            with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
                train.fit(_state(), _STEP, [], **{name: bad})
    with pytest.raises(
        ValueError, match="max_consecutive_nonfinite must be an int >= 1"
    ):
        train.fit(_state(), _STEP, [], max_consecutive_nonfinite=0)
    with pytest.raises(ValueError, match="checkpoint_every needs checkpoint_dir"):
        train.fit(_state(), _STEP, [], checkpoint_every=2)


def _run(state, step, batches):
    for b in batches:
        state, _ = step(state, b)
    return state


def _assert_same_state(a, b):
    # Leaf by leaf: each _state() holds its own tx (static pytree metadata).
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)


def _same_records(logged, history):
    # json.loads gives NaN back for NaN, and NaN != NaN: compare as JSON text.
    return [json.dumps(r) for r in logged] == [json.dumps(r) for r in history]


@pytest.mark.parametrize("donate", [False, True])
def test_fit_rollback_restores_the_snapshot_and_goes_on(tmp_path, donate):
    # Batches 3 and 4 are NaN, limit 2, a snapshot every 2 steps: the state
    # after 2 steps (step 2 was not a snapshot point, step 3 was not finite)
    # comes back at step 4, then training goes on with batch 5 (3 and 4 are
    # not retried). donate=False keeps the one-step lookahead, so batch 5 was
    # already queued on the discarded state and is re-run on the snapshot.
    step = train.make_train_step(_mlp_loss, donate=donate)
    batches = [_batch(i, nan=i in (3, 4)) for i in range(7)]
    snap = _run(_state(), _STEP, batches[:2])
    kwargs = dict(
        nan_policy="rollback",
        max_consecutive_nonfinite=2,
        rollback_every=2,
        progress=False,
    )
    at_rollback, hist5 = train.fit(_state(), step, batches, steps=5, **kwargs)
    _assert_same_state(at_rollback, snap)
    assert int(at_rollback.step) == 2 and int(at_rollback.skipped_total) == 0
    assert [h.get("rolled_back", False) for h in hist5] == [False] * 4 + [True]

    log = tmp_path / "log.jsonl"
    final, hist = train.fit(_state(), step, batches, log_path=log, **kwargs)
    _assert_same_state(final, _run(snap, _STEP, batches[5:]))
    assert [h["finite"] for h in hist] == [True] * 3 + [False] * 2 + [True] * 2
    assert [h["step"] for h in hist if "rolled_back" in h] == [4]
    assert hist[4]["rolled_back"] is True
    assert [h["skipped_total"] for h in hist] == [0, 0, 0, 1, 2, 0, 0]
    assert _same_records([json.loads(s) for s in log.open()], hist)


@pytest.mark.parametrize("donate", [False, True])
def test_fit_rollback_snapshot_survives_two_restores(donate):
    # Two rollbacks to the same snapshot: restoring hands the step a copy, so
    # a donating step cannot invalidate the snapshot for the next rollback.
    step = train.make_train_step(_mlp_loss, donate=donate)
    bad = (2, 3, 5, 6)
    batches = [_batch(i, nan=i in bad) for i in range(8)]
    final, hist = train.fit(
        _state(),
        step,
        batches,
        nan_policy=train.NanPolicy.rollback(max_consecutive=2, every=2, max=2),
        log=None,
    )
    snap = _run(_state(), _STEP, batches[:2])
    # Batch 4 trained on S2, but its result is dropped by the second rollback.
    expected = _run(snap, _STEP, batches[7:])
    _assert_same_state(final, expected)
    assert [h["step"] for h in hist if h.get("rolled_back")] == [3, 6]


def test_fit_rollbacks_exhausted_raise_like_stop(tmp_path):
    step = train.make_train_step(_mlp_loss, donate=True)
    batches = [_batch(i, nan=i > 0) for i in range(6)]
    with pytest.raises(train.NonFiniteError) as info:
        train.fit(
            _state(),
            step,
            batches,
            nan_policy=train.NanPolicy.rollback(max_consecutive=2, every=1, max=1),
            log=train.Log(tmp_path / "log.jsonl", progress=False),
        )
    err = info.value
    assert err.step == 4  # rollback at step 2, then 3 and 4 hit the limit again
    msg = str(err)
    assert msg.startswith("2 non-finite step(s) in a row, the last at step 4; ")
    assert "rollbacks exhausted (max_rollbacks=1)" in msg
    assert "['w1']" in msg and "non-finite batch inputs" in msg
    assert [h["step"] for h in err.history] == [0, 1, 2, 3, 4]
    assert [h.get("rolled_back", False) for h in err.history] == [
        False,
        False,
        True,
        False,
        False,
    ]
    logged = [json.loads(s) for s in (tmp_path / "log.jsonl").open()]
    assert _same_records(logged, err.history)
    # The failing step's own state: the snapshot (after step 0) + 2 skipped steps.
    snap = _run(_state(), _STEP, batches[:1])
    jax.tree.map(np.testing.assert_array_equal, err.state.params, snap.params)
    assert int(err.state.step) == 3 and int(err.state.skipped_total) == 2


def test_fit_rollback_options_are_accepted_with_other_policies():
    batches = [_batch(0), _batch(1, nan=True), _batch(2)]
    _, hist = train.fit(
        _state(), _STEP, batches, rollback_every=1, max_rollbacks=1, progress=False
    )
    assert all("rolled_back" not in h for h in hist)
    assert train.NAN_POLICIES == ("skip", "stop", "rollback", "rewind")


def test_load_checkpoint_without_optimizer_types_still_checks_leaves(tmp_path):
    # A file written before save_checkpoint named the optimizer state's types:
    # the leaf check alone refuses adam's moments in an sgd target.
    from flax import serialization

    path = tmp_path / "old.msgpack"
    tree = serialization.to_state_dict(jax.device_get(_state()))
    path.write_bytes(serialization.msgpack_serialize(tree))
    sgd = _state(tx=transforms.stable_optimizer(optax.sgd(0.1), max_grad_norm=1.0))
    with pytest.raises(ValueError) as info:
        train.load_checkpoint(path, sgd)
    msg = str(info.value)
    assert repr(str(path)) in msg and "(7 leaf/leaves differ)" in msg
    assert "opt_state/inner_state/1/0/mu/w1: in the checkpoint ((4, 8) float32)" in msg
    restored = train.load_checkpoint(path, _state())  # the matching target loads
    chex.assert_trees_all_equal(restored.params, _state().params)


def test_load_checkpoint_lists_at_most_twelve_leaves_and_counts_the_rest(tmp_path):
    path = tmp_path / "ck"
    train.save_checkpoint(path, {f"p{i:02d}": jnp.zeros(2) for i in range(20)})
    with pytest.raises(ValueError) as info:
        train.load_checkpoint(path, {f"p{i:02d}": jnp.zeros(3) for i in range(20)})
    lines = str(info.value).splitlines()
    assert "(20 leaf/leaves differ)" in lines[0]
    assert lines[1] == "  p00: checkpoint (2,) float32, target (3,) float32"
    assert lines[13] == "  ... and 8 more" and len(lines) == 15


# -- fit's per-step extras: time_s, eval_fn/eval_every, on_step, stopping ---


def test_fit_times_steps_only_when_asked():
    data = [_batch(i) for i in range(3)]
    _, hist = train.fit(_state(), _STEP, data, log=None)
    assert all("time_s" not in r for r in hist)
    _, hist = train.fit(
        _state(), _STEP, data, log=train.Log(progress=False, time_steps=True)
    )
    assert all(r["time_s"] > 0 for r in hist)


@pytest.mark.parametrize("donate", [False, True])
def test_fit_on_step_sees_each_state_and_can_stop(donate):
    step = train.make_train_step(_mlp_loss, donate=donate)
    seen = []

    def on_step(rec, state):
        seen.append((dict(rec), int(state.step), float(state.params["b1"][0])))
        return rec["step"] == 2  # stop after the third step

    data = [_batch(i) for i in range(6)]
    state, hist = train.fit(_state(), step, data, log=None, on_step=on_step)
    assert [r for r, _, _ in seen] == hist and len(hist) == 3
    assert [n for _, n, _ in seen] == [1, 2, 3] and int(state.step) == 3
    # the returned state is the third step's own (the one queued after it was
    # dropped), the one on_step saw
    assert float(state.params["b1"][0]) == seen[-1][2]


def test_fit_eval_every_adds_eval_keys_of_that_steps_state():
    calls = []

    def eval_fn(state):
        calls.append(int(state.step))
        return {"b": state.params["b1"][0], "vec": state.params["b1"]}

    data = [_batch(i) for i in range(5)]
    _, hist = train.fit(_state(), _STEP, data, log=None, evaluate=(eval_fn, 2))
    assert calls == [2, 4]
    assert ["eval['b']" in r for r in hist] == [False, True, False, True, False]
    assert all("eval['vec']" not in r for r in hist)  # scalars only, as aux
    assert hist[3]["eval['b']"] != hist[1]["eval['b']"]


def test_fit_stop_after_nonfinite_returns_n_steps_after_the_first():
    data = [_batch(0), _batch(1, nan=True)] + [_batch(i) for i in range(2, 9)]
    state, hist = train.fit(
        _state(), _STEP, data, log=None, nan_policy=train.NanPolicy.skip(stop_after=3)
    )
    assert [r["finite"] for r in hist] == [True, False, True, True, True]
    assert int(state.step) == 5
    _, hist = train.fit(
        _state(), _STEP, data, log=None, nan_policy=train.NanPolicy.skip(stop_after=0)
    )
    assert len(hist) == 2


def _plain_sgd_step(state, batch):
    """A pure step over a dict state, no guard (the fit step contract)."""
    loss, grads = jax.value_and_grad(_mlp_loss)(state["params"], batch)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads)
    metrics = {
        "loss": loss,
        "grad_norm": transforms.global_norm(grads),
        "loss_scale": jnp.ones([]),
        "finite": jls.all_finite((loss, params)),
        "skipped_total": jnp.zeros([], jnp.int32),
    }
    return {"params": params, "count": state["count"] + 1}, metrics


def test_fit_runs_a_plain_step_over_a_dict_state():
    data = [_batch(0), _batch(1, nan=True), _batch(2), _batch(3)]
    start = {"params": _init_params(), "count": jnp.zeros([], jnp.int32)}
    step = jax.jit(_plain_sgd_step)
    state, hist = train.fit(
        start, step, data, log=None, nan_policy=train.NanPolicy.skip(stop_after=1)
    )
    assert [r["finite"] for r in hist] == [True, False, False]
    assert int(state["count"]) == 3
    # the stop policy raises its error (it used to fail on state.params)
    with pytest.raises(train.NonFiniteError, match="non-finite parameters") as e:
        train.fit(
            start,
            step,
            data,
            log=None,
            nan_policy=train.NanPolicy.stop(max_consecutive=1),
        )
    assert e.value.step == 1 and e.value.report == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(eval_every=2), "eval_fn and eval_every go together"),
        (dict(eval_fn=lambda s: {}), "eval_fn and eval_every go together"),
        (dict(eval_fn=lambda s: {}, eval_every=0), "eval_every must be None or"),
        (dict(stop_after_nonfinite=-1), "stop_after_nonfinite must be None or"),
        (dict(stop_after_nonfinite=True), "stop_after_nonfinite must be None or"),
    ],
)
def test_fit_extras_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        train.fit(_state(), _STEP, [_batch(0)], progress=False, **kwargs)
    with pytest.raises(TypeError, match="on_step must be None or a callable"):
        train.fit(_state(), _STEP, [_batch(0)], log=None, on_step=3)
    with pytest.raises(TypeError, match="time_steps must be True or False"):
        train.fit(
            _state(), _STEP, [_batch(0)], log=train.Log(progress=False, time_steps=1)
        )
