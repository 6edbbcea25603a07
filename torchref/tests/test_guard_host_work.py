"""The guard's host-side work per step, counted (issue: TrainStep at most
1.05x the torch.amp recipe): what `UpdateBound` looks at again every step
(each way its proof can stop holding between two steps), the buffer list
`BufferGuard` walks, the views `DeviceSelect` keeps, the signature read
once per step function."""

from __future__ import annotations

import math

import pytest
import torch

from torchref import transforms as tr
from torchref._src import guard_step, update_bound, update_bound_rules, update_check
from torchref._src.step_state import module_buffers


def _proved_adam(make=torch.optim.AdamW, n=3, **kw):
    """An optimizer whose step `UpdateBound` proves, after one recorded step."""
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(n)]
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt = make(params, lr=1e-3, **kw)
    bound = update_bound.UpdateBound()
    assert bound.proven(opt, params, 1.0)
    opt.step()
    bound.record(opt, params)
    assert bound.proven(opt, params, 1.0)  # the state's bounds are known
    return opt, params, bound


def test_a_parameter_made_float16_in_place_is_not_proved():
    # ``p.data = ...`` (module.half()) keeps the tensor object and its
    # version counter: only its dtype says so.
    opt, params, bound = _proved_adam()
    version = params[1]._version
    params[1].data = params[1].data.half()
    params[1].grad = None
    params[1].grad = torch.full_like(params[1], 0.5)
    assert params[1]._version == version
    assert not bound.proven(opt, params, 1.0)


def test_a_gradient_of_another_dtype_is_not_proved():
    opt, params, bound = _proved_adam()
    params[2].grad.data = params[2].grad.data.bfloat16()
    assert not bound.proven(opt, params, 1.0)
    params[2].grad = torch.full_like(params[2], 0.5)  # float32 again
    assert bound.proven(opt, params, 1.0)


def test_a_state_tensor_made_float16_in_place_is_not_proved():
    # Same object, same version counter, another dtype: the m / 0 case.
    opt, params, bound = _proved_adam()
    state = opt.state[params[0]]["exp_avg_sq"]
    version = state._version
    state.data = state.data.half()
    assert state._version == version and opt.state[params[0]]["exp_avg_sq"] is state
    assert not bound.proven(opt, params, 1.0)


def test_a_state_tensor_replaced_is_read_again(monkeypatch):
    # The same values in a new tensor: its bounds are read (one transfer),
    # as for a state loaded from a checkpoint; then known again.
    reads = []
    real = update_bound.to_host
    monkeypatch.setattr(
        update_bound, "to_host", lambda v: reads.append(len(v)) or real(v)
    )
    opt, params, bound = _proved_adam()
    st = opt.state[params[1]]
    st["exp_avg"] = st["exp_avg"].clone()
    assert bound.proven(opt, params, 1.0)
    assert reads == [2]  # exp_avg and exp_avg_sq of the one parameter
    bound.record(opt, params)
    assert bound.proven(opt, params, 1.0)
    assert reads == [2]
    st["exp_avg"] = st["exp_avg"].clone().fill_(1e38)  # huge: not proved
    assert not bound.proven(opt, params, 1.0)


def test_a_state_written_in_place_is_read_again():
    opt, params, bound = _proved_adam()
    opt.state[params[2]]["exp_avg"].fill_(1e38)  # same tensor, new version
    assert not bound.proven(opt, params, 1.0)


def test_a_state_entry_added_or_removed_is_read_again(monkeypatch):
    reads = []
    real = update_bound.to_host
    monkeypatch.setattr(
        update_bound, "to_host", lambda v: reads.append(len(v)) or real(v)
    )
    opt, params, bound = _proved_adam()
    opt.state[params[0]]["max_exp_avg_sq"] = torch.full((4,), 1e38)
    assert not bound.proven(opt, params, 1.0)
    assert reads == [3]
    del opt.state[params[0]]["max_exp_avg_sq"]
    assert bound.proven(opt, params, 1.0)
    assert reads == [3, 2]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lr", 1e30),  # a step of 1e38
        ("lr", math.nan),
        ("eps", 0.0),  # 0 / 0
        ("betas", (0.9, 1.0)),
        ("weight_decay", 1e4),  # lr * wd > 1: p * (1 - lr * wd) grows
        ("capturable", True),
    ],
)
def test_a_hyper_parameter_changed_between_steps_is_not_proved(key, value):
    # A scheduler or the user changes param_groups between two steps: the
    # rules are made again from the group's values every step.
    opt, params, bound = _proved_adam()
    old = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    assert not bound.proven(opt, params, 1.0)
    opt.param_groups[0][key] = old
    assert bound.proven(opt, params, 1.0)


def test_a_bound_on_the_gradients_too_large_is_not_proved():
    opt, params, bound = _proved_adam()
    assert not bound.proven(opt, params, 2.0**51)
    assert not bound.proven(opt, params, None)
    assert bound.proven(opt, params, 1.0)


def test_a_parameter_added_or_a_group_changed_is_looked_at():
    opt, params, bound = _proved_adam()
    new = torch.nn.Parameter(torch.ones(2))
    new.grad = torch.ones(2)
    opt.add_param_group({"params": [new], "eps": 0.0})  # never provable
    assert not bound.proven(opt, [*params, new], 1.0)
    opt.param_groups[1]["eps"] = 1e-8
    assert bound.proven(opt, [*params, new], 1.0)  # no state yet: (0, 0)
    opt.param_groups[0]["params"].append(opt.param_groups[1]["params"].pop())
    opt.param_groups[0]["params"][-1].grad = torch.ones(2)
    assert bound.proven(opt, [*params, new], 1.0)


def test_each_distinct_rule_and_bound_is_evaluated_once(monkeypatch):
    # 40 parameters of one group share their bounds: one `fits` a step, not
    # one per parameter (the host work that grew with the leaf count).
    calls = []
    real = update_bound_rules._adam_rule

    def counting(group, m):
        grow, fits = real(group, m)
        return grow, lambda *a: calls.append(a) or fits(*a)

    monkeypatch.setattr(update_bound_rules, "_adam_rule", counting)
    opt, params, bound = _proved_adam(n=40)
    calls.clear()
    assert bound.proven(opt, params, 1.0)
    assert len(calls) == 1
    opt.state[params[5]]["exp_avg"].mul_(2.0)  # its own bound from now on
    calls.clear()
    assert bound.proven(opt, params, 1.0)
    assert len(calls) == 2


class _Shared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.BatchNorm1d(3)
        self.b = torch.nn.Sequential(self.a, torch.nn.BatchNorm1d(2))
        self.c = self.b  # the same module twice
        self.register_buffer("none", None)
        self.register_buffer("mask", torch.ones(2))
        self.b[1].register_buffer("alias", self.mask)  # the same tensor twice
        self.register_module("gone", None)  # an emptied submodule slot


class _OwnBuffers(torch.nn.Module):
    """A module listing its buffers its own way."""

    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(2)

    def named_buffers(self, *args, **kwargs):
        yield from reversed(list(super().named_buffers(*args, **kwargs)))


@pytest.mark.parametrize("make", [_Shared, _OwnBuffers, lambda: torch.nn.Linear(2, 2)])
def test_module_buffers_lists_what_module_buffers_lists(make):
    model = torch.nn.Sequential(make(), torch.nn.BatchNorm2d(4))
    ours, torchs = module_buffers(model), list(model.buffers())
    assert len(ours) == len(torchs)
    assert all(a is b for a, b in zip(ours, torchs, strict=True))


def test_device_select_lays_out_its_views_once():
    # The flat copy's views are made when the shapes change, not per step
    # (a split per step cost more than the copy), and follow a new layout.
    splits = []
    real = torch.Tensor.split

    sel = update_check.DeviceSelect()
    ts = [torch.randn(3, 2), torch.randn(4)]

    def counting(self, *a, **k):
        splits.append(1)
        return real(self, *a, **k)

    torch.Tensor.split = counting
    try:
        for _ in range(3):
            sel.take(ts)
            keep = [t.clone() for t in ts]
            for t in ts:
                t.fill_(math.nan)
            sel.put_back(torch.tensor(True))
            assert all(torch.equal(a, b) for a, b in zip(ts, keep, strict=True))
        assert len(splits) == 1
        ts = [torch.randn(2, 3), torch.randn(4)]  # same size, other shape
        sel.take(ts)
        keep = [t.clone() for t in ts]
        ts[0].fill_(math.nan)
        sel.put_back(torch.tensor(True))
        assert all(torch.equal(a, b) for a, b in zip(ts, keep, strict=True))
        assert len(splits) == 2
    finally:
        torch.Tensor.split = real


def test_the_step_signature_is_read_once_per_step_function(monkeypatch):
    reads = []
    real = guard_step.inspect.signature
    monkeypatch.setattr(
        guard_step.inspect, "signature", lambda f: reads.append(f) or real(f)
    )
    w = torch.nn.Parameter(torch.ones(3))
    opt = tr.skip_non_finite(torch.optim.Adam([w], lr=0.1, fused=True))
    for i in range(3):
        w.grad = torch.ones(3)
        opt.step()
        if i == 0:  # construction and the first step may read it
            reads.clear()
    assert reads == []
    adam = opt.optimizer if hasattr(opt, "optimizer") else opt
    assert guard_step._takes_found_inf(adam)

    def step(closure=None, grad_scaler=None):  # a step that takes the scaler
        return None

    adam.step = step
    assert not guard_step._takes_found_inf(adam)


def test_a_parameter_left_out_for_a_while_keeps_its_bounds(monkeypatch):
    # Bounds are kept for parameters not stepped this time (no gradient)
    # and need no read when they are stepped again; looking at a parameter
    # with no state adds no entry to the optimizer's state (a defaultdict).
    reads = []
    real = update_bound.to_host
    monkeypatch.setattr(
        update_bound, "to_host", lambda v: reads.append(len(v)) or real(v)
    )
    opt, params, bound = _proved_adam(n=3)
    reads.clear()
    for stepped in (params[:2], params[:2], params):
        params[2].grad = torch.full_like(params[2], 0.5) if len(stepped) == 3 else None
        assert bound.proven(opt, stepped, 1.0)
        opt.step()  # leaves a parameter without a gradient alone
        bound.record(opt, stepped)
    assert bound.proven(opt, params, 1.0)
    assert reads == []
    fresh = torch.nn.Parameter(torch.ones(2))
    fresh.grad = torch.ones(2)
    opt.add_param_group({"params": [fresh]})
    assert bound.proven(opt, [*params, fresh], 1.0)
    bound.record(opt, [*params, fresh])
    assert fresh not in opt.state and reads == []


def test_the_bounds_grow_the_same_checked_in_bulk_or_one_by_one():
    # The bulk record of a step where every parameter was proved and the
    # one-by-one entries hold the same bounds and the same tensors.
    opt, params, bound = _proved_adam(n=4)
    for _ in range(3):
        assert bound.proven(opt, params, 1.0)
        opt.step()
        bound.record(opt, params)
    assert bound._flat is not None
    flat = dict(bound._flat.entries())
    bound._unflatten()
    assert bound._flat is None
    for p in params:
        versions, *bounds = bound._known[id(p)]
        assert flat[id(p)] == (versions, *bounds)
        state = opt.state[p]
        assert [(k, ref(), v) for k, ref, v in versions] == [
            (k, t, t._version) for k, t in state.items()
        ]
    assert bound.proven(opt, params, 1.0)  # one by one now, the same answer
