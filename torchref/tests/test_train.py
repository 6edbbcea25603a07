"""torchref.train: TrainStep is the torch.amp docs recipe (real GradScaler,
clip_grad_norm_) with metrics, skipping and buffer restore; fit's policies."""

import copy
import itertools
import json
import math
import warnings

import pytest
import torch

from torchref import loss_scale as ls
from torchref import train
from torchref.transforms import skip_spikes


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )


def _mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _batches(n, poison=(), seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(16, 4, generator=g)
        if i in poison:
            x[3, 1] = float("nan")
        out.append((x, torch.randn(16, 1, generator=g)))
    return out


def _adam_state(opt):
    return copy.deepcopy(opt.state_dict()["state"])


def _states_equal(a, b):
    return a.keys() == b.keys() and all(
        all(torch.equal(a[k][n], b[k][n]) for n in a[k]) for k in a
    )


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_trajectory_equals_docs_recipe_with_nan_at_step_k(opt_name):
    k = 5
    batches = _batches(12, poison={k})
    make_opt = {
        "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
        "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    }[opt_name]
    model = _mlp()
    opt = make_opt(model.parameters())
    step = train.TrainStep(
        model,
        opt,
        _mse,
        max_grad_norm=0.5,
        scaler=ls.DynamicLossScale(2.0**8, period=3),
    )
    ref_model = _mlp()
    ref_opt = make_opt(ref_model.parameters())
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    for i, batch in enumerate(batches):
        params_before = [p.detach().clone() for p in model.parameters()]
        state_before = _adam_state(opt)
        m = step(batch)
        # The torch.amp docs recipe, by hand.
        ref_opt.zero_grad()
        used = ref_scaler.get_scale()
        loss = _mse(ref_model, batch)
        ref_scaler.scale(loss).backward()
        ref_scaler.unscale_(ref_opt)
        norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(p, q), f"step {i}"
        assert m["loss_scale"] == used
        assert m["finite"] is (i != k)
        assert m["skipped_total"] == (1 if i >= k else 0)
        assert step.scaler.get_scale() == ref_scaler.get_scale()
        if i == k:
            assert math.isnan(m["grad_norm"]) and math.isnan(m["loss"])
            assert all(
                torch.equal(p, q)
                for p, q in zip(model.parameters(), params_before, strict=True)
            )
            assert _states_equal(_adam_state(opt), state_before)
            assert step.scaler.get_scale() == m["loss_scale"] / 2
        else:
            assert m["grad_norm"] == float(norm) and m["loss"] == float(loss.detach())
            assert all(torch.isfinite(p).all() for p in model.parameters())
    assert step.scaler.get_scale() > 2.0**8  # it also grew (period 3)


def test_accepts_a_plain_gradscaler():
    model = _mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6)
    step = train.TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _mse, scaler=scaler
    )
    ms = [step(b) for b in _batches(3, poison={1})]
    assert step.scaler is scaler
    assert [m["loss_scale"] for m in ms] == [64.0, 64.0, 32.0]
    assert [m["finite"] for m in ms] == [True, False, True]


def test_no_scaler_skips_itself_and_counts():
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = train.TrainStep(model, opt, _mse, max_consecutive=1)
    ms = [step(b) for b in _batches(6, poison={2, 3})]
    assert [m["finite"] for m in ms] == [True, True, False, False, True, True]
    assert [m["skipped_total"] for m in ms] == [0, 0, 1, 2, 2, 2]
    assert all(m["loss_scale"] == 1.0 for m in ms)
    assert float(opt.state_dict()["state"][0]["step"]) == 4.0
    assert step.skip_state.exceeded is False and step.skip_state.consecutive == 0


def test_noop_scaler_still_skips():
    model = _mlp()
    step = train.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _mse,
        scaler=ls.NoOpLossScale(),
    )
    before = [p.detach().clone() for p in model.parameters()]
    m = step(_batches(1, poison={0})[0])
    assert not m["finite"]
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)
    )


def _bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 2, 3, padding=1),
        torch.nn.BatchNorm2d(2),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(2 * 4 * 4, 1),
    )


def _bn_loss(model, x):
    return model(x).pow(2).mean()


@pytest.mark.parametrize("restore", [True, False])
def test_batch_norm_buffers_restored_on_skip(restore):
    model = _bn_net()
    step = train.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _bn_loss,
        scaler=ls.DynamicLossScale(),
        restore_buffers_on_skip=restore,
    )
    step(torch.randn(2, 1, 4, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 1, 4, 4)
    x[0, 0, 0, 0] = float("nan")
    assert not step(x)["finite"]
    after = model.state_dict()
    bn = ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    if restore:
        assert all(torch.equal(before[k], after[k]) for k in before)
    else:  # the forward already folded the NaN batch into the statistics
        assert not torch.isfinite(after["1.running_mean"]).all()
        assert int(after[bn[2]]) == int(before[bn[2]]) + 1


class _AssignsBuffer(torch.nn.Module):
    """A running mean kept by assignment (``self.buf = ...``), not in place."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)
        self.register_buffer("mean", torch.zeros(2))
        self.grow = False

    def forward(self, x):
        if self.grow:  # a queue of every batch seen, reassigned
            self.mean = torch.cat([self.mean, x.detach().mean(0)])
        else:
            self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        return self.lin(x.clamp(-1, 1))


@pytest.mark.parametrize("bad", ["nan_batch", "huge_batch", "grown"])
def test_buffers_the_forward_reassigned_are_restored_too(bad):
    # A forward that assigns a new buffer tensor leaves the snapshot's
    # tensors behind: the restore (and the finiteness check) must act on
    # the buffers the model holds after the step. nan_batch: a skipped
    # step; huge_batch: finite gradients (lr=0) but a mean of inf.
    torch.manual_seed(0)
    model = _AssignsBuffer()
    model.grow = bad == "grown"
    step = train.TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=0.0), lambda m, x: m(x).mean()
    )
    step(torch.ones(4, 2))  # applied: a grown buffer is kept
    before = model.mean.clone()
    x = torch.full((4, 2), 3e38 if bad == "huge_batch" else math.nan)
    if bad == "grown":  # skipped: the old values fit no more
        with pytest.raises(ValueError, match="restore_buffers_on_skip=False"):
            step(x)
        return
    m = step(x)
    assert m["finite"] is (bad == "huge_batch")
    assert torch.equal(model.mean, before)


def test_a_torch_compiled_model_steps_and_skips_as_the_eager_one():
    # Users hand TrainStep a torch.compile'd model: its guard (buffers
    # snapshot and selected back, the skip on the device) must act on the
    # parameters and buffers the compiled graph updates in place. The
    # aot_eager backend: dynamo's graph and AOTAutograd's functionalised
    # buffer updates, as with inductor, without 10 s of C++ code generation
    # (inductor was checked by hand: the same results).
    def run(compile_model):
        torch.manual_seed(0)
        model = _bn_net()
        net = torch.compile(model, backend="aot_eager") if compile_model else model
        step = train.TrainStep(
            net,
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            _bn_loss,
            max_grad_norm=1.0,
            scaler=ls.DynamicLossScale(loss_scale=2.0**10),
        )
        gen = torch.Generator().manual_seed(1)
        metrics, before_skip = [], None
        for i in range(4):
            x = torch.randn(2, 1, 4, 4, generator=gen)
            if i == 2:
                x[0, 0, 0, 0] = math.nan
                before_skip = copy.deepcopy(model.state_dict())
            metrics.append(step(x))
            if i == 2:
                after = model.state_dict()
                assert all(torch.equal(before_skip[k], after[k]) for k in after)
        return metrics, model.state_dict()

    eager, eager_state = run(False)
    compiled, compiled_state = run(True)
    assert [m["finite"] for m in compiled] == [True, True, False, True]
    for e, c in zip(eager, compiled, strict=True):
        assert (c["finite"], c["skipped_total"], c["loss_scale"]) == (
            e["finite"],
            e["skipped_total"],
            e["loss_scale"],
        )
        assert c["loss"] == pytest.approx(e["loss"], rel=1e-5, nan_ok=True)
    for k, v in eager_state.items():
        torch.testing.assert_close(compiled_state[k], v, rtol=1e-5, atol=1e-6)


def test_autocast_bf16_on_cpu():
    model = _mlp()
    seen = []

    def loss_fn(m, batch):
        out = m(batch[0])
        seen.append(out.dtype)
        return ((out.float() - batch[1]) ** 2).mean(), {"out_dtype": str(out.dtype)}

    step = train.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn,
        autocast_dtype="bf16",
        max_grad_norm=1.0,
    )
    before = [p.detach().clone() for p in model.parameters()]
    m = step(_batches(1)[0])
    assert seen == [torch.bfloat16] and m["aux"] == {"out_dtype": "torch.bfloat16"}
    assert m["finite"] and math.isfinite(m["grad_norm"])
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not all(
        torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gradscaler_cuda_without_cuda_warns():
    # issue 35 item 5: torch turns GradScaler("cuda") off without CUDA (its
    # own warning, once per process); the step then trained at scale 1.
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = torch.amp.GradScaler("cuda")
    with pytest.warns(
        UserWarning,
        match=r"disabled torch\.amp\.GradScaler\('cuda'\).*loss scale 1.*"
        r"GradScaler\('cpu'\)",
    ) as caught:
        step = train.TrainStep(model, opt, _mse, scaler=scaler)
    assert caught[-1].filename == __file__  # points at the user's call
    assert step(_batches(1)[0])["loss_scale"] == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fixes (and no scaler) are quiet
        for ok in (torch.amp.GradScaler("cpu"), ls.DynamicLossScale(), None):
            train.TrainStep(model, opt, _mse, scaler=ok)
        train.TrainStep(model, opt, _mse, scaler=ls.NoOpLossScale())


def test_invalid_arguments():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        TypeError, match=r"scaler must be None, a torch\.amp\.GradScaler"
    ):
        train.TrainStep(model, opt, _mse, scaler="dynamic")
    with pytest.raises(
        ValueError, match=r"autocast_dtype must be None, torch\.float16"
    ):
        train.TrainStep(model, opt, _mse, autocast_dtype=torch.float32)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        train.TrainStep(model, opt, _mse, max_grad_norm=0.0)
    partial = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"does not own.*2\.weight, 2\.bias"):
        train.TrainStep(model, partial, _mse)
    step = train.TrainStep(model, opt, _mse)
    with pytest.raises(
        ValueError,
        match=r"nan_policy must be one of \('skip', 'stop', 'rollback', 'rewind'\)",
    ):
        train.fit(step, [], nan_policy="ignore")
    for name in ("rollback_every", "max_rollbacks"):
        for bad in (0, 1.5, True):
            with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
                train.fit(step, [], **{name: bad})
    with pytest.raises(
        ValueError, match="max_consecutive_nonfinite must be an int >= 1"
    ):
        train.fit(step, [], max_consecutive_nonfinite=0)
    with pytest.raises(ValueError, match="checkpoint_every needs checkpoint_dir"):
        train.fit(step, [], checkpoint_every=2)


@pytest.mark.parametrize("reduce", [lambda x: x, lambda x: x.sum(0, keepdim=True)])
def test_non_scalar_loss_is_rejected(reduce):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = train.TrainStep(model, opt, lambda m, b: reduce(m(b[0])[:, 0]))
    x = _batches(1)[0]
    with pytest.raises(ValueError) as info:
        step(x)
    shape = tuple(reduce(torch.zeros(16)).shape)
    # Same text as jaxstable.train.make_train_step.
    assert str(info.value) == (
        f"loss_fn must return a scalar (0-d) loss, got shape {shape}; "
        "reduce it, e.g. with .mean()"
    )


def test_state_machine_refuses_reentry_and_half_done_steps():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    holder = {}

    def reentrant(m, batch):
        return holder["step"](batch)

    holder["step"] = train.TrainStep(model, opt, reentrant)
    with pytest.raises(RuntimeError, match="re-entrantly"):
        holder["step"](_batches(1)[0])

    good = _batches(1)[0]
    step = train.TrainStep(model, opt, _mse, scaler=ls.DynamicLossScale())
    with pytest.raises(TypeError):
        step(None)  # fails in the forward: nothing half-done, no lock
    assert step(good)["finite"]
    # A loss that cannot be differentiated fails in backward, after
    # GradScaler.scale: the step stays locked until reset().
    detached = train.TrainStep(
        model, opt, lambda m, b: _mse(m, b).detach(), scaler=ls.DynamicLossScale()
    )
    with pytest.raises(RuntimeError, match="does not require grad"):
        detached(good)
    with pytest.raises(RuntimeError, match="previous step raised half-way"):
        detached(good)
    detached.loss_fn = _mse
    detached.reset()
    assert detached(good)["finite"]


def test_fit_stop_policy_names_step_and_report(tmp_path):
    model = _mlp()
    step = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse)
    batches = _batches(10, poison={4, 5, 6})
    log = tmp_path / "log.jsonl"
    with pytest.raises(
        train.NonFiniteError,
        match=r"3 non-finite step\(s\) in a row, the last at step 6",
    ) as e:
        train.fit(
            step,
            batches,
            nan_policy=train.NanPolicy.stop(max_consecutive=3),
            log=train.Log(log, progress=False),
        )
    assert isinstance(e.value, FloatingPointError) and e.value.step == 6
    assert "0.weight" in str(e.value) and e.value.report[0].path == "0.weight"
    lines = [json.loads(s) for s in log.read_text().splitlines()]
    assert [d["step"] for d in lines] == list(range(7))
    assert [d["finite"] for d in lines] == [True] * 4 + [False] * 3
    assert [h["step"] for h in e.value.history] == list(range(7))


def test_fit_stop_nothing_after_the_failing_step(tmp_path):
    # The mirror of jaxstable's test: [ok, nan, nan, ok], limit 2.
    model = _mlp()
    step = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse)
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 99}\n')  # an older run's log: overwritten
    with pytest.raises(train.NonFiniteError) as e:
        train.fit(
            step,
            _batches(4, poison={1, 2}),
            nan_policy=train.NanPolicy.stop(max_consecutive=2),
            log=train.Log(log, progress=False),
            checkpoint=train.Checkpointing(tmp_path / "ck", every=1),
        )
    assert e.value.step == 2 and step.steps_done == 3
    assert [h["step"] for h in e.value.history] == [0, 1, 2]
    assert [json.loads(s)["step"] for s in log.open()] == [0, 1, 2]
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    # and the bad-batch list: step 1's NaN batch, located, reproduced
    assert files == ["bad_batches.json", "step_00000001.pt", "step_00000002.pt"]


def test_fit_stop_overflow_report_names_leaf_and_scale():
    # Not NaN data: w * 7e33 scaled by 2**16 overflows float32 (max 3.4e38).
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    step = train.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda m, b: m.weight.sum() * b,
        scaler=ls.DynamicLossScale(),
    )
    with pytest.raises(train.NonFiniteError) as e:
        train.fit(
            step,
            [torch.tensor(7e33)],
            nan_policy=train.NanPolicy.stop(max_consecutive=1),
            log=None,
        )
    assert [r.path for r in e.value.report] == ["weight"]
    msg = str(e.value)
    assert "loss_scale=65536 (the scale that step used)" in msg
    assert "non-finite gradients at loss_scale=65536:" in msg
    assert "non-finite batch inputs" not in msg
    assert step.scaler.get_scale() == 2.0**15


def test_fit_checkpoint_dir_alone_writes_a_final_checkpoint(tmp_path):
    model = _mlp()
    step = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse)
    train.fit(step, _batches(3), log=None, checkpoint=tmp_path / "a")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["step_00000003.pt"]
    train.fit(
        step,
        _batches(6),
        log=None,
        checkpoint=train.Checkpointing(tmp_path / "b", every=4),
    )
    files = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert files == ["step_00000004.pt", "step_00000006.pt"]  # + the final one


@pytest.mark.parametrize("saved_scaler", [True, False])
def test_load_checkpoint_rejects_another_scaler_kind(tmp_path, saved_scaler):
    def make(scaler):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return train.TrainStep(model, opt, _mse, scaler=scaler)

    with_scaler, without = make(ls.DynamicLossScale()), make(None)
    with_scaler(_batches(1)[0])  # creates the scaler's state
    src, dst = (with_scaler, without) if saved_scaler else (without, with_scaler)
    path = tmp_path / "ck.pt"
    train.save_checkpoint(path, src)
    with pytest.raises(ValueError) as e:
        train.load_checkpoint(path, dst)
    msg = str(e.value)
    assert "DynamicGradScaler" in msg and "no enabled scaler" in msg


def test_fit_skip_policy_log_history_and_checkpoints(tmp_path):
    model = _mlp()
    step = train.TrainStep(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        _mse,
        max_grad_norm=1.0,
        scaler=ls.DynamicLossScale(2.0**4, period=2),
    )
    log = tmp_path / "run" / "log.jsonl"
    log.parent.mkdir()
    hist = train.fit(
        step,
        itertools.cycle(_batches(4, poison={1})),
        steps=8,
        log=train.Log(log, progress=True),
        checkpoint=train.Checkpointing(tmp_path / "ck", every=4),
    )
    assert len(hist) == 8 and [h["step"] for h in hist] == list(range(8))
    assert [h["finite"] for h in hist] == [True, False, True, True] * 2
    assert hist[-1]["skipped_total"] == 2
    lines = [json.loads(s) for s in log.read_text().splitlines()]
    keys = ["step", "loss", "grad_norm", "loss_scale", "finite", "skipped_total"]
    keys.append("grads_finite")
    skipped = [*keys, "skip_reason"]  # a skipped step says why
    # The first non-finite step (locate_first=1 by default) says where, that
    # it reproduced (a NaN in the batch) and that its batch is now listed.
    located = [*skipped, "location", "reproduced", "bad_batches_listed"]
    expected = [keys, located, keys, keys, keys, skipped, keys, keys]
    assert [list(d) for d in lines] == expected
    assert lines[1]["skip_reason"] == "non-finite gradients"
    assert lines[1]["location"]["phase"] == "input"
    assert [d["loss_scale"] for d in lines] == [h["loss_scale"] for h in hist]
    assert math.isnan(lines[1]["grad_norm"])
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert files == ["bad_batches.json", "step_00000004.pt", "step_00000008.pt"]
    fresh_model = _mlp(seed=3)
    fresh = train.TrainStep(
        fresh_model,
        torch.optim.Adam(fresh_model.parameters(), lr=1e-2),
        _mse,
        scaler=ls.DynamicLossScale(),
    )
    train.load_checkpoint(tmp_path / "ck" / files[-1], fresh)
    assert fresh.scaler.get_scale() == step.scaler.get_scale()
    assert fresh.skip_state == step.skip_state and fresh.steps_done == 8
    assert all(
        torch.equal(p, q)
        for p, q in zip(fresh_model.parameters(), model.parameters(), strict=True)
    )


def _adam_step(seed=0):
    model = _mlp(seed)
    return train.TrainStep(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        _mse,
        max_grad_norm=1.0,
        scaler=ls.DynamicLossScale(),
    )


def _same_records(logged, history):
    # json.loads gives NaN back for NaN, and NaN != NaN: compare as JSON text.
    return [json.dumps(r) for r in logged] == [json.dumps(r) for r in history]


def _run(step, batches):
    for b in batches:
        step(b)
    return step


def _assert_same_step(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])
    assert _states_equal(sa["optimizer"]["state"], sb["optimizer"]["state"])
    assert sa["scaler"] == sb["scaler"]
    assert sa["skip_state"] == sb["skip_state"]
    assert sa["steps_done"] == sb["steps_done"]


_ROLLBACK = dict(nan_policy="rollback", max_consecutive_nonfinite=2, rollback_every=2)


def test_fit_rollback_restores_the_snapshot_and_goes_on(tmp_path):
    # The mirror of jaxstable's test: batches 3 and 4 NaN, limit 2, a
    # snapshot every 2 steps: the state after 2 steps comes back at step 4,
    # then training goes on with batch 5 (3 and 4 are not retried).
    batches = _batches(7, poison={3, 4})
    snap = _run(_adam_step(), batches[:2])
    at_rollback = _adam_step()
    hist5 = train.fit(at_rollback, batches, steps=5, progress=False, **_ROLLBACK)
    _assert_same_step(at_rollback, snap)
    assert at_rollback.steps_done == 2
    assert [h.get("rolled_back", False) for h in hist5] == [False] * 4 + [True]

    log = tmp_path / "log.jsonl"
    step = _adam_step()
    hist = train.fit(step, batches, log_path=log, progress=False, **_ROLLBACK)
    _assert_same_step(step, _run(snap, batches[5:]))
    assert [h["finite"] for h in hist] == [True] * 3 + [False] * 2 + [True] * 2
    assert [h["step"] for h in hist if "rolled_back" in h] == [4]
    assert hist[4]["rolled_back"] is True
    assert [h["skipped_total"] for h in hist] == [0, 0, 0, 1, 2, 0, 0]
    assert _same_records([json.loads(s) for s in log.open()], hist)


def test_fit_rollback_snapshot_survives_two_restores():
    # Two rollbacks to the same snapshot: each restore loads a deep copy, so
    # Adam's in-place updates cannot write into the snapshot.
    batches = _batches(8, poison={2, 3, 5, 6})
    step = _adam_step()
    hist = train.fit(step, batches, progress=False, max_rollbacks=2, **_ROLLBACK)
    snap = _run(_adam_step(), batches[:2])
    # Batch 4 trained on the snapshot, but the second rollback drops it.
    _assert_same_step(step, _run(snap, batches[7:]))
    assert [h["step"] for h in hist if h.get("rolled_back")] == [3, 6]


def test_fit_rollbacks_exhausted_raise_like_stop(tmp_path):
    batches = _batches(6, poison={1, 2, 3, 4, 5})
    step = _adam_step()
    with pytest.raises(train.NonFiniteError) as e:
        train.fit(
            step,
            batches,
            nan_policy=train.NanPolicy.rollback(max_consecutive=2, every=1, max=1),
            log=train.Log(tmp_path / "log.jsonl", progress=False),
        )
    err = e.value
    assert err.step == 4  # rollback at step 2, then 3 and 4 hit the limit again
    msg = str(err)
    assert msg.startswith("2 non-finite step(s) in a row, the last at step 4; ")
    assert "rollbacks exhausted (max_rollbacks=1)" in msg
    assert "0.weight" in msg and "non-finite batch inputs" in msg
    assert [h.get("rolled_back", False) for h in err.history] == [
        False,
        False,
        True,
        False,
        False,
    ]
    logged = [json.loads(s) for s in (tmp_path / "log.jsonl").open()]
    assert _same_records(logged, err.history)
    snap = _run(_adam_step(), batches[:1])
    assert all(
        torch.equal(p, q)
        for p, q in zip(step.model.parameters(), snap.model.parameters(), strict=True)
    )
    assert step.steps_done == 3 and step.skip_state.skipped_total == 2


def test_fit_rollback_options_are_accepted_with_other_policies():
    step = _adam_step()
    hist = train.fit(
        step,
        _batches(3, poison={1}),
        rollback_every=1,
        max_rollbacks=1,
        progress=False,
    )
    assert all("rolled_back" not in h for h in hist)
    assert train.NAN_POLICIES == ("skip", "stop", "rollback", "rewind")


def _old_checkpoint(path, step):
    # A file written before save_checkpoint named the optimizer/scaler classes.
    torch.save(step.state_dict(), path)


def test_load_checkpoint_of_an_older_file_tells_optimizers_by_their_options(tmp_path):
    model = _mlp()
    adam = train.TrainStep(model, torch.optim.Adam(model.parameters(), lr=0.1), _mse)
    _old_checkpoint(tmp_path / "old.pt", adam)
    model = _mlp()
    sgd = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse)
    with pytest.raises(ValueError) as e:
        train.load_checkpoint(tmp_path / "old.pt", sgd)
    msg = str(e.value)
    assert repr(str(tmp_path / "old.pt")) in msg and "'betas'" in msg
    assert "but this TrainStep's SGD has" in msg and "'momentum'" in msg
    train.load_checkpoint(tmp_path / "old.pt", adam)  # the matching step loads


def test_load_checkpoint_of_an_older_file_keeps_hysteresis_from_a_grad_scaler(
    tmp_path,
):
    def make(scaler):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return train.TrainStep(model, opt, _mse, scaler=scaler)

    dyn = ls.DynamicLossScale(2.0**8, hysteresis=2, min_loss_scale=4.0)
    _old_checkpoint(tmp_path / "old.pt", make(dyn))
    with pytest.raises(ValueError, match="holds a DynamicGradScaler but this "):
        train.load_checkpoint(tmp_path / "old.pt", make(torch.amp.GradScaler("cpu")))
    back = train.load_checkpoint(tmp_path / "old.pt", make(ls.DynamicLossScale()))
    assert (back.scaler.hysteresis, back.scaler.min_loss_scale) == (2, 4.0)


def test_load_checkpoint_refuses_a_file_that_is_not_a_train_step_checkpoint(
    tmp_path,
):
    model = _mlp()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    step = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse)
    with pytest.raises(ValueError, match=r"weights\.pt' is not a TrainStep checkp"):
        train.load_checkpoint(tmp_path / "weights.pt", step)


def test_load_checkpoint_names_a_format_it_does_not_read(tmp_path):
    model = _mlp()
    step = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse)
    header = b'{"format": "torchref-checkpoint-9", "sha256": ""}\n'
    (tmp_path / "new.pt").write_bytes(header + b"payload")
    with pytest.raises(ValueError, match=r"format 'torchref-checkpoint-9', which "):
        train.load_checkpoint(tmp_path / "new.pt", step)


def test_load_checkpoint_refuses_other_param_groups(tmp_path):
    model = _mlp()
    one = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse)
    train.save_checkpoint(tmp_path / "ck.pt", one)
    groups = [
        {"params": list(model[0].parameters())},
        {"params": model[2].parameters()},
    ]
    two = train.TrainStep(model, torch.optim.SGD(groups, lr=0.1), _mse)
    with pytest.raises(ValueError) as e:
        train.load_checkpoint(tmp_path / "ck.pt", two)
    assert "optimizer/param_groups: checkpoint sizes [4], target sizes [2, 2]" in str(
        e.value
    )


# -- fit's per-step extras: time_s, eval_fn/eval_every, on_step, stopping ---


def _guarded(seed=0):
    model = _mlp(seed)
    return train.TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=0.05), _mse, max_grad_norm=1.0
    )


def test_fit_times_steps_only_when_asked():
    hist = train.fit(_guarded(), _batches(3), log=None)
    assert all("time_s" not in r for r in hist)
    hist = train.fit(
        _guarded(), _batches(3), log=train.Log(progress=False, time_steps=True)
    )
    assert all(r["time_s"] > 0 for r in hist)


def test_fit_on_step_sees_each_step_and_can_stop():
    step = _guarded()
    seen = []

    def on_step(rec, s):
        seen.append((dict(rec), s.steps_done))
        return rec["step"] == 2

    hist = train.fit(step, _batches(6), log=None, on_step=on_step)
    assert [r for r, _ in seen] == hist and len(hist) == 3
    assert [n for _, n in seen] == [1, 2, 3] and step.steps_done == 3


def test_fit_eval_every_adds_eval_keys():
    step = _guarded()
    calls = []

    def eval_fn(s):
        calls.append(s.steps_done)
        return {"b": s.model[0].bias[0], "vec": s.model[0].bias}

    hist = train.fit(step, _batches(5), log=None, evaluate=(eval_fn, 2))
    assert calls == [2, 4]
    assert ["eval['b']" in r for r in hist] == [False, True, False, True, False]
    assert all("eval['vec']" not in r for r in hist)  # scalars only, as aux


def test_fit_stop_after_nonfinite_returns_n_steps_after_the_first():
    step = _guarded()
    hist = train.fit(
        step,
        _batches(9, poison={1}),
        log=None,
        nan_policy=train.NanPolicy.skip(stop_after=3),
    )
    assert [r["finite"] for r in hist] == [True, False, True, True, True]
    assert step.steps_done == 5


def test_fit_runs_a_plain_step_callable():
    """A hand-written loop as `step(batch) -> metrics` (0-d tensors allowed)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def plain(batch):
        opt.zero_grad()
        loss = _mse(model, batch)
        loss.backward()
        opt.step()
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        return {
            "loss": loss.detach(),
            "grad_norm": torch.tensor(1.0),
            "loss_scale": 1.0,
            "finite": finite and bool(torch.isfinite(loss)),
            "skipped_total": 0,
        }

    hist = train.fit(
        plain,
        _batches(5, poison={1}),
        log=None,
        nan_policy=train.NanPolicy.skip(stop_after=1),
    )
    assert [r["finite"] for r in hist] == [True, False, False]
    assert isinstance(hist[0]["loss"], float) and json.dumps(hist[0])
    with pytest.raises(train.NonFiniteError, match="1 non-finite step") as e:
        train.fit(
            plain,
            _batches(2, poison={0}),
            log=None,
            nan_policy=train.NanPolicy.stop(max_consecutive=1),
        )
    assert e.value.report == []
    with pytest.raises(TypeError, match="need a step with state_dict"):
        train.fit(plain, _batches(2), log=None, nan_policy=train.NanPolicy.rollback())
    with pytest.raises(TypeError, match="TrainStep or a callable"):
        train.fit(3, _batches(2), log=None)


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
        train.fit(_guarded(), _batches(1), progress=False, **kwargs)
    with pytest.raises(TypeError, match="on_step must be None or a callable"):
        train.fit(_guarded(), _batches(1), log=None, on_step=3)
    with pytest.raises(TypeError, match="time_steps must be True or False"):
        train.fit(_guarded(), _batches(1), log=train.Log(progress=False, time_steps=1))


def _syncs_outside_optimizer(fn):
    """`aten::_local_scalar_dense` events (.item(), bool(t), float(t)) of
    one call, leaving out those inside ``Optimizer.step`` (Adam reads its
    CPU ``step`` counter; on a GPU that is no device->host sync)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    out = 0
    for e in prof.events():
        if e.name != "aten::_local_scalar_dense":
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("Optimizer.step"):
            parent = parent.cpu_parent
        out += parent is None
    return out


@pytest.mark.parametrize(
    ("opt", "check_update", "kw"),
    [
        ("sgd", True, {}),
        ("adam", True, {}),
        ("adam", False, {}),
        ("adam_fused", True, {}),
        ("adam", True, {"scaler": None, "microbatches": 2}),
        ("adam_spikes", True, {}),
    ],
)
def test_trainstep_makes_no_host_sync(opt, check_update, kw):
    # Issue 24: the skip decision, clip, scale back-off, buffer restore,
    # spike window and counters stay on the device: no .item() or
    # bool(tensor) inside one step, applied or skipped (a NaN batch), once
    # the optimizer state exists. The old step made 7-9 per call
    # (GradScaler.step's found_inf read, the loss and grads checks, the
    # norm, the update check, float metrics).
    model = _bn_net()
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
        "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
        "adam_spikes": lambda ps: skip_spikes(
            torch.optim.Adam(ps, lr=1e-3), window=4, min_history=1
        ),
    }[opt]
    step = train.TrainStep(
        model,
        make(model.parameters()),
        _bn_loss,
        max_grad_norm=1.0,
        check_update=check_update,
        # The no-sync path (the default for a fused optimizer; a non-fused
        # one reads its flag once per step by default, as GradScaler.step).
        decide_on="device",
        **({"scaler": ls.DynamicLossScale(2.0**8)} | kw),
    )
    x = torch.randn(4, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    step(x)  # creates the optimizer state (that first step may sync once)
    nan = torch.full_like(x, math.nan)
    # The default step(batch) first: python metrics through one transfer
    # (a .tolist(), no _local_scalar_dense); then tensor metrics.
    runs = ((x, True, True), (nan, False, False), (x, True, False))
    for batch, applied, sync in runs:
        before = [p.detach().clone() for p in model.parameters()]
        out = {}

        def run(b=batch, o=out, s=sync):
            o.update(step(b) if s else step(b, sync=False))

        assert _syncs_outside_optimizer(run) == 0
        assert isinstance(out["finite"], bool if sync else torch.Tensor)
        assert bool(out["finite"]) is applied
        moved = any(
            not torch.equal(p, q)
            for p, q in zip(model.parameters(), before, strict=True)
        )
        assert moved is applied
    assert int(out["skipped_total"]) == 1 and bool(out["grads_finite"])
    s = step.skip_state  # the two tensor steps, recorded in order on reading
    assert (s.skipped_total, s.consecutive, s.last_finite) == (1, 0, True)
    if step.spike_state is not None:  # the NaN step never entered the window
        assert (step.spike_state.norm_count, step.spike_state.spikes_total) == (3, 0)


def test_tensor_metrics_equal_the_python_ones():
    # step(sync=False) returns the very values step() reads in its one
    # transfer, and skip_state, read once at the end, counts the same steps
    # in the same order (a NaN batch, one inf pixel, then a batch of 1e20
    # that batch norm absorbs but whose running_var overflows: applied, its
    # buffers restored).
    x = torch.randn(4, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    inf = x.clone()
    inf[0, 0, 0, 0] = math.inf
    batches = [x, torch.full_like(x, math.nan), inf, x * 1e20, x]
    got = {}
    for sync in (True, False):
        model = _bn_net()
        step = train.TrainStep(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-2),
            _bn_loss,
            max_grad_norm=1.0,
            scaler=ls.DynamicLossScale(2.0**15),
            max_consecutive=1,
        )
        rows = [step(b, sync=sync) for b in batches]
        if not sync:
            assert all(isinstance(v, torch.Tensor) for r in rows for v in r.values())
            rows = [{k: v.item() for k, v in r.items()} for r in rows]
        got[sync] = (rows, step.skip_state, list(model.parameters()))
    (rows, state, params), (t_rows, t_state, t_params) = got[True], got[False]
    assert [r["finite"] for r in rows] == [True, False, False, True, True]
    assert repr(rows) == repr(t_rows) and state == t_state  # nan == nan, types
    assert state.skipped_total == 2 and state.exceeded is False
    for p, q in zip(params, t_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
