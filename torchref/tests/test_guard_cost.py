"""What the torch guard copies and allocates (issue 33), counted, not timed;
and buffers it must not mistake for bad writes (issue 35 item 4)."""

from __future__ import annotations

import copy
import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchref import transforms as tr
from torchref._src import (
    clipping,
    guard,
    guard_step,
    update_bound,
    update_bound_rules,
    update_check,
)
from torchref.train import TrainStep


class _Net(torch.nn.Module):
    """A used layer, and an unused one the optimizer holds too."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(16, 16)
        self.unused = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.used(x)


def _used_bytes(opt, params) -> int:
    """Bytes of `params` and their optimizer state: one copy of them."""
    return sum(t.nbytes for t in guard_step._written(opt, list(params)))


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors that ops outside ``Optimizer.step`` create
    and that are still alive (new storage only: views, in-place results and
    ``out=`` tensors alias their inputs)."""

    def __init__(self, opt):
        super().__init__()
        self.live = self.peak = 0
        self.inside = False
        step = opt.step

        def wrapped(*a, **k):
            self.inside = True
            try:
                return step(*a, **k)
            finally:
                self.inside = False

        opt.step = wrapped

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside:
            return out
        seen = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and t.untyped_storage().data_ptr() not in seen
            ):
                n = t.untyped_storage().nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, n)
        return out

    def _free(self, n: int) -> None:
        self.live -= n


def _set_grads(model, value):
    model.zero_grad(set_to_none=True)
    for p in model.used.parameters():
        p.grad = torch.full_like(p, value)


def test_parameters_without_gradients_are_never_copied_or_touched(monkeypatch):
    # The undo copy holds the used layer and its Adam state, element for
    # element: the unused Linear(64, 64) (4160 elements, 15x the used ones)
    # and its state are neither copied nor written, on a skipped step too.
    copied = []
    take = update_check.DeviceSelect.take
    monkeypatch.setattr(
        update_check.DeviceSelect,
        "take",
        lambda s, ts: copied.append(sum(t.numel() for t in ts)) or take(s, ts),
    )
    model = _Net()
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    # The device path (no clip: nothing proved, the copy is taken); the
    # host path, the default for a non-fused Adam, bounds the update by the
    # norm it reads and copies nothing here.
    opt = tr.skip_non_finite(adam, decide_on="device")
    _set_grads(model, 1.0)
    model.unused.weight.grad = torch.ones_like(model.unused.weight)
    opt.step()  # the unused layer has state now, from a step with a gradient
    versions = [
        t._version for t in guard_step._written(adam, [*model.unused.parameters()])
    ]
    copied.clear()
    for value in (1.0, math.nan, 1.0):
        _set_grads(model, value)
        opt.step()
    used = sum(t.numel() for t in guard_step._written(adam, [*model.used.parameters()]))
    assert copied == [used] * 3  # 272 + 2 * 272 + 2 step counts
    after = [
        t._version for t in guard_step._written(adam, [*model.unused.parameters()])
    ]
    assert after == versions
    assert opt.skip_state.skipped_total == 1


@pytest.mark.parametrize("fused", [False, True])
def test_peak_extra_memory_is_one_copy_of_what_the_step_writes(fused):
    # Everything the guard allocates and keeps alive (outside the optimizer's
    # own step), from the first step: at most one copy of the parameters
    # with a gradient and their state, plus the 0-d flags and norms (< 1
    # KiB). The old select took a flat copy of every parameter and state,
    # then a second, temporary one.
    model = _Net()
    adam = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
    # The device path (no clip: nothing proved, the copy is taken); the
    # host path, the default for a non-fused Adam, bounds the update by the
    # norm it reads and copies nothing here.
    opt = tr.skip_non_finite(adam, decide_on="device")
    mode = _LiveBytes(adam)
    for value in (1.0, 1.0, math.nan, 1.0):
        _set_grads(model, value)  # the gradients are the backward's, not counted
        with mode:
            opt.step()
    one_copy = _used_bytes(adam, model.used.parameters())
    assert mode.peak <= one_copy + 1024, (mode.peak, one_copy)
    assert opt.skip_state.skipped_total == 1


def test_a_proved_update_takes_no_copy(monkeypatch):
    # float32 Adam under a clip (device path, fused) and on the host path
    # (any Adam): no undo copy at all, and the skipped step is still skipped.
    takes = []
    take = update_check.DeviceSelect.take
    monkeypatch.setattr(
        update_check.DeviceSelect,
        "take",
        lambda s, ts: takes.append(len(ts)) or take(s, ts),
    )
    for fused, decide_on in ((True, "auto"), (False, "host")):
        model = _Net()
        adam = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused or None)
        opt = tr.stable_optimizer(adam, max_grad_norm=1.0, decide_on=decide_on)
        for value in (1.0, math.nan, 1.0):
            _set_grads(model, value)
            before = [
                t.clone() for t in guard_step._written(adam, [*model.used.parameters()])
            ]
            opt.step()
            after = guard_step._written(adam, [*model.used.parameters()])
            same = len(after) == len(before) and all(
                torch.equal(a, b) for a, b in zip(after, before, strict=True)
            )
            assert same is (value != 1.0)
        assert opt.skip_state.skipped_total == 1
    assert takes == []


def _bound(opt, params, m):
    return update_bound.UpdateBound().proven(opt, params, m)


def _adam_step(**kw):
    w = torch.nn.Parameter(torch.ones(3, dtype=kw.pop("dtype", torch.float32)))
    w.grad = torch.ones_like(w)
    make = kw.pop("make", torch.optim.Adam)
    lr = kw.pop("lr")  # set after construction: torch refuses a NaN one
    opt = make([w], lr=1e-3, **kw)
    opt.param_groups[0]["lr"] = lr
    return opt, [w]


@pytest.mark.parametrize(
    ("kw", "m", "proved"),
    [
        ({"lr": 1e-3}, 1.0, True),
        ({"lr": 1e-3}, None, False),  # no bound on the gradients
        ({"lr": 1e-3}, 2.0**51, False),  # g**2 could reach float32's max
        ({"lr": 1e-3, "eps": 0.0}, 1.0, False),  # 0 / 0
        ({"lr": 1e-3, "dtype": torch.float16}, 1.0, False),  # eps is 0 in fp16
        ({"lr": 1e-3, "dtype": torch.bfloat16}, 1.0, False),
        ({"lr": math.nan}, 1.0, False),
        ({"lr": torch.tensor(1e-3)}, 1.0, False),  # not read on the host
        ({"lr": 1e-3, "weight_decay": 1e-2}, 1.0, False),  # L2: wd * p
        ({"lr": 1e-3, "weight_decay": 1e-2, "make": torch.optim.AdamW}, 1.0, True),
        ({"lr": 1.0, "weight_decay": 2.0, "make": torch.optim.AdamW}, 1.0, False),
        ({"lr": 1e30, "eps": 1e-8}, 1.0, False),  # a step of 1e39
        ({"lr": 0.1, "make": torch.optim.SGD, "momentum": 0.9}, 1.0, True),
        ({"lr": 0.1, "make": torch.optim.SGD, "weight_decay": 1e-4}, 1.0, False),
        ({"lr": 0.1, "make": torch.optim.RMSprop}, 1.0, False),  # not proved
    ],
)
def test_update_bound_at_its_edges(kw, m, proved):
    opt, params = _adam_step(**kw)
    assert _bound(opt, params, m) is proved


def test_adams_state_bounds_do_not_grow_with_the_steps():
    # Twice the gradients' bound holds Adam's moments from step to step,
    # rounding included: a million steps prove as the first did (a factor
    # of 1.001 a step stopped proving after ~55k steps, lr 1e-3).
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    grow, fits = update_bound_rules.rule("adam", group, 1.0)
    bounds = (0.0, 0.0)
    for _ in range(1_000_000):
        bounds = grow(*bounds)
    assert bounds == (2.0, 2.0) and fits(*bounds)
    # ... and the moments a float32 Adam writes under |g| = 1 stay in them.
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.Adam([w], lr=1e-3)
    for _ in range(3000):
        w.grad = torch.tensor([1.0, -1.0, 1.0, 1.0])
        opt.step()
    st = opt.state[w]
    assert st["exp_avg"].abs().max() <= 2.0 and st["exp_avg_sq"].max() <= 2.0


def test_update_bound_reads_a_loaded_state_once_and_bounds_it():
    # A state the guard did not write (load_state_dict) is read once: small
    # moments are bounded from their values, huge ones are not proved.
    opt, params = _adam_step(lr=1e-3)
    opt.step()
    bound = update_bound.UpdateBound()
    assert bound.proven(opt, params, 1.0)
    bound.record(opt, params)
    assert bound.proven(opt, params, 1.0)  # known now, nothing read
    opt.state[params[0]]["exp_avg"].fill_(1e38)  # written by someone else
    assert not bound.proven(opt, params, 1.0)


def test_decide_on_is_validated():
    w = torch.nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match=r"decide_on must be one of .*'host'"):
        tr.skip_non_finite(torch.optim.SGD([w], lr=0.1), decide_on="gpu")
    opt = tr.stable_optimizer(torch.optim.SGD([w], lr=0.1))
    with pytest.raises(ValueError, match="got 'never'"):
        opt.decide_on = "never"
    assert opt.decide_on == "auto"


def test_host_path_does_not_call_the_optimizer_on_a_bad_step():
    # GradScaler's path: a bad step never reaches optimizer.step().
    model = torch.nn.Linear(3, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    calls = []
    sgd.register_step_pre_hook(lambda *a: calls.append(1))
    step = TrainStep(model, sgd, _mse, max_grad_norm=1.0, decide_on="host")
    x = torch.ones(2, 3)
    for batch, applied in ((x, True), (x * math.nan, False), (x, True)):
        before = [p.detach().clone() for p in model.parameters()]
        assert step((batch, torch.zeros(2, 1)))["finite"] is applied
        moved = any(
            not torch.equal(p, q)
            for p, q in zip(model.parameters(), before, strict=True)
        )
        assert moved is applied
    assert len(calls) == 2


def _mse(model, batch):
    return ((model(batch[0]) - batch[1]) ** 2).mean()


class _MaskedNorm(torch.nn.Module):
    """An additive causal mask (-inf above the diagonal) beside a BatchNorm1d."""

    def __init__(self, n=4):
        super().__init__()
        mask = torch.triu(torch.full((n, n), -math.inf), diagonal=1)
        self.register_buffer("mask", mask)
        self.norm = torch.nn.BatchNorm1d(n)
        self.proj = torch.nn.Linear(n, n)

    def forward(self, x):
        attn = torch.softmax(x @ x.T / 4 + self.mask, dim=-1)
        return self.proj(self.norm(attn @ x))


@pytest.mark.parametrize("decide_on", ["device", "host"])
def test_an_intentional_inf_buffer_does_not_freeze_batch_norm(decide_on):
    # Issue 35 item 4: the -inf mask was taken as a bad write on every step,
    # so every buffer went back: num_batches_tracked stayed 0.
    torch.manual_seed(0)
    model = _MaskedNorm()
    plain = _MaskedNorm()
    plain.load_state_dict(model.state_dict())
    x = torch.randn(4, 4) + 0.5
    batch = (x, torch.zeros(4, 4))
    step = TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=0.0), _mse, decide_on=decide_on
    )
    for _ in range(3):
        assert step(batch)["finite"]
        plain(x)
    assert int(model.norm.num_batches_tracked) == 3
    torch.testing.assert_close(model.norm.running_mean, plain.norm.running_mean)
    assert model.norm.running_mean.abs().max() > 0
    # A NaN batch still puts every buffer back, the mask included.
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    assert not step((x * math.nan, batch[1]))["finite"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, stats[k]), k


@pytest.mark.parametrize("make", ["adam", "sgd_noclip", "adam_spikes"])
def test_host_and_device_paths_step_alike(make):
    # The same batches through both paths: the same metrics, parameters and
    # optimizer state, bit for bit: a NaN batch, an inf pixel, gradients of
    # 1e20 whose float32 norm overflows (the host path's exact fallback
    # clips them by the float64 norm too) and a loss scale backing off.
    from torchref import loss_scale as ls

    x = torch.linspace(-1.0, 1.0, 12).reshape(4, 3)
    inf = x.clone()
    inf[0, 0] = math.inf
    y = torch.zeros(4, 1)
    batches = [x, x * math.nan, inf, x * 1e20, x, x]
    got = {}
    for decide_on in ("device", "host"):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt, clip = torch.optim.Adam(model.parameters(), lr=0.1), 1.0
        if make == "sgd_noclip":
            opt, clip = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), None
        if make == "adam_spikes":
            opt = tr.skip_spikes(opt, window=4, min_history=2)
        step = TrainStep(
            model,
            opt,
            lambda m, b: m(b[0]).sum(),  # finite at 1e20, its gradients too
            max_grad_norm=clip,
            scaler=ls.DynamicLossScale(2.0**4),
            decide_on=decide_on,
        )
        rows = [step((b, y)) for b in batches]
        state = [t.clone() for s in step.optimizer.state.values() for t in s.values()]
        got[decide_on] = (
            repr(rows),
            [p.detach().clone() for p in model.parameters()],
            state,
        )
    assert got["device"][0] == got["host"][0]
    for a, b in zip(
        got["device"][1] + got["device"][2],
        got["host"][1] + got["host"][2],
        strict=True,
    ):
        assert torch.equal(a, b)
    assert "'finite': False" in got["host"][0] and "'finite': True" in got["host"][0]


def test_device_path_reads_nothing_and_a_loaded_state_once(monkeypatch):
    # The device path reads no value on the host in a step (sync=False),
    # whether or not the update is proved (SGD with weight decay is not);
    # a state loaded from a checkpoint is read once (its magnitudes), then
    # proved from its bounds with no read.
    from torchref._src import step as step_impl

    reads = []

    def counting(values, real=clipping.to_host):
        reads.append(len(values))
        return real(values)

    for module in (clipping, update_bound, guard_step, guard):
        monkeypatch.setattr(module, "to_host", counting)
    monkeypatch.setattr(step_impl, "to_host", counting)
    x, y = torch.ones(2, 3), torch.zeros(2, 1)
    for wd in (1e-4, 0.0):
        model = torch.nn.Linear(3, 1)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=wd)
        step = TrainStep(model, sgd, _mse, max_grad_norm=1.0, decide_on="device")
        step((x, y), sync=False)  # creates the state (one host decision)
        reads.clear()
        for _ in range(3):
            step((x, y), sync=False)
        assert reads == []
    sgd.load_state_dict(copy.deepcopy(sgd.state_dict()))  # not ours
    for _ in range(3):
        step((x, y), sync=False)
    assert reads == [2]  # two momentum buffers, read once


@pytest.mark.parametrize("wrap", ["skip_non_finite", "stable_optimizer", "skip_spikes"])
def test_wrappers_step_alike_on_both_paths(wrap):
    # The wrappers' host path (one read, no float64 pass where torch's norm
    # is finite) against the device path: the same parameters, state and
    # counters, bit for bit, through NaN, inf and 1e20 gradients (whose
    # float32 norm overflows: the exact check and clip run then).
    grads = [1.0, math.nan, 2.0, math.inf, 1e20, 0.5, 1.0]
    got = {}
    for decide_on in ("device", "host"):
        w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 5))
        adam = torch.optim.Adam([w], lr=0.1)
        if wrap == "skip_non_finite":
            opt = tr.skip_non_finite(adam, decide_on=decide_on)
        else:
            opt = tr.stable_optimizer(adam, max_grad_norm=1.0, decide_on=decide_on)
        if wrap == "skip_spikes":
            opt = tr.skip_spikes(opt, window=4, min_history=2)
        norms = []
        for g in grads:
            w.grad = torch.full((5,), g)
            opt.step()
            norms.append(float(getattr(opt, "grad_norm", None) or 0.0))
        state = [t.clone() for t in adam.state[w].values()]
        got[decide_on] = (w.detach().clone(), state, opt.skip_state, norms)
    (w1, s1, k1, n1), (w2, s2, k2, n2) = got["device"], got["host"]
    assert torch.equal(w1, w2) and k1 == k2 and repr(n1) == repr(n2)
    assert all(torch.equal(a, b) for a, b in zip(s1, s2, strict=True))
    assert k2.skipped_total >= 2


@pytest.mark.parametrize(
    ("dtype", "make", "grad"),
    [
        # (1 - b2) g**2 underflows float16 and eps is 0 there: m / 0.
        (torch.float16, lambda ps: torch.optim.Adam(ps, lr=1e-3), 1e-3),
        (torch.float32, lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=0.0), 0.0),
    ],
)
def test_host_path_still_undoes_a_non_finite_update(dtype, make, grad):
    # The host path with a clip: nothing proved here, so the copy is taken,
    # the check read, and the step put back bit for bit (the invariant).
    w = torch.nn.Parameter(torch.full((4,), 0.5, dtype=dtype))
    opt = tr.stable_optimizer(make([w]), max_grad_norm=1.0, decide_on="host")
    w.grad = torch.full((4,), grad, dtype=dtype)
    opt.step()
    assert w.tolist() == [0.5] * 4 and opt.state == {}
    s = opt.skip_state
    assert (s.skipped_total, s.non_finite_updates, s.last_grads_finite) == (1, 1, True)


def test_auto_decides_on_the_device_for_a_fused_optimizer_else_on_the_host():
    # "auto": on an accelerator a fused optimizer takes GradScaler's
    # found_inf and skips in its kernel (no copy, no read); any other reads
    # the flag once per step, as GradScaler.step does. On the CPU a read is
    # no transfer, and every optimizer, fused too, takes the host path (no
    # copy, no select, no float64 pass: bench_guard_paths.py, bench_models.py).
    w = torch.nn.Parameter(torch.ones(3))
    fused = tr.skip_non_finite(torch.optim.Adam([w], lr=0.1, fused=True))
    plain = tr.skip_non_finite(torch.optim.Adam([w], lr=0.1))
    assert fused._guarded.on_host(fused.optimizer)  # on the CPU
    meta = torch.nn.Parameter(torch.ones(3, device="meta"))
    fused_meta = torch.optim.Adam([meta], lr=0.1, fused=True)
    assert not fused._guarded.on_host(fused_meta)  # off the CPU: in its kernel
    assert plain._guarded.on_host(plain.optimizer)
    plain.decide_on = "device"
    assert not plain._guarded.on_host(plain.optimizer)
