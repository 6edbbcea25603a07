"""torchref.loss_scale: the scalers made by the loss-scale objects are real
GradScalers and follow GradScaler's trajectory, plus the floor/hysteresis."""

import numpy as np
import pytest
import torch

from torchref import loss_scale as ls


def _drive(scaler, finite_seq):
    """Runs the torch.amp recipe on a 1-parameter model; returns the scale
    after each update() and the parameter trajectory."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=1e-3)
    scales, params = [], []
    for ok in finite_seq:
        opt.zero_grad()
        x = torch.ones(3) if ok else torch.tensor([1.0, float("nan"), 1.0])
        scaler.scale((w * x).sum()).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        params.append(w.detach().clone())
    return scales, params


def test_dynamic_matches_real_gradscaler_over_thousands_of_steps():
    rng = np.random.default_rng(0)
    seq = (rng.random(3000) > 0.03).tolist()
    # min_loss_scale far below anything reached, so GradScaler alone decides.
    ours = ls.DynamicLossScale(loss_scale=2.0**10, period=17, min_loss_scale=2.0**-60)
    s1 = ours.make_scaler("cpu")
    assert isinstance(s1, torch.amp.GradScaler)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=17)
    a, pa = _drive(s1, seq)
    b, pb = _drive(ref, seq)
    assert a == b  # python floats of the float32 scale: bit for bit
    assert len(set(a)) > 3  # the sequence really grows and backs off
    assert min(a) > 2.0**-60
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))


def test_default_args_equal_gradscaler_defaults():
    s = ls.DynamicLossScale().make_scaler("cpu")
    ref = torch.amp.GradScaler("cpu")
    assert s.get_scale() == ref.get_scale() == 2.0**16
    assert s.get_growth_interval() == ref.get_growth_interval() == 2000
    assert s.get_growth_factor() == ref.get_growth_factor() == 2.0
    assert s.get_backoff_factor() == ref.get_backoff_factor() == 0.5


def test_min_loss_scale_floor():
    s = ls.DynamicLossScale(loss_scale=8.0, min_loss_scale=2.0).make_scaler("cpu")
    scales, _ = _drive(s, [False] * 5 + [True])
    assert scales == [4.0, 2.0, 2.0, 2.0, 2.0, 2.0]


def test_hysteresis_backs_off_on_nth_bad_step_in_a_row():
    s = ls.DynamicLossScale(loss_scale=64.0, hysteresis=2, period=100).make_scaler()
    seq = [False, True, False, False, False, True, False]
    scales, _ = _drive(s, seq)
    # 1st bad: held; good resets the run; 2 bad in a row: halve on the 2nd,
    # and on every later one in the same run; after a good one, held again.
    assert scales == [64.0, 64.0, 64.0, 32.0, 16.0, 16.0, 16.0]


def test_counter_starts_growth_tracker():
    s = ls.DynamicLossScale(loss_scale=4.0, period=3, counter=2).make_scaler()
    scales, _ = _drive(s, [True, True, True, True])
    assert scales == [8.0, 8.0, 8.0, 16.0]


def test_static_scale_is_constant_and_bad_steps_are_skipped():
    s = ls.StaticLossScale(128.0).make_scaler("cpu")
    assert isinstance(s, torch.amp.GradScaler)
    scales, params = _drive(s, [True, False, True])
    assert scales == [128.0, 128.0, 128.0]
    assert torch.equal(params[0], params[1])  # the NaN step changed nothing
    assert not torch.equal(params[1], params[2])


def test_noop_is_disabled_gradscaler():
    noop = ls.NoOpLossScale()
    s = noop.make_scaler("cpu")
    assert noop.loss_scale == 1.0
    assert not s.is_enabled() and s.get_scale() == 1.0


def test_state_dict_round_trip_keeps_every_field():
    a = ls.DynamicLossScale(
        loss_scale=32.0, period=5, min_loss_scale=4.0, hysteresis=3
    ).make_scaler()
    _drive(a, [True, True, False])
    b = ls.DynamicLossScale().make_scaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert (b.min_loss_scale, b.hysteresis, b.get_growth_interval()) == (4.0, 3, 5)
    assert b.state_dict()["_nonfinite_run"] == 1
    # The restored run continues: one more bad step is the 2nd of 3 in a row.
    scales, _ = _drive(b, [False, False])
    assert scales == [32.0, 16.0]  # held (run 2 < 3), then backed off (run 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"factor": 1}, "factor must be a finite number > 1"),
        ({"factor": 0.5}, "factor must be a finite number > 1"),
        ({"period": 0}, "period must be an int >= 1"),
        ({"loss_scale": 0.0}, "loss_scale must be a finite number > 0"),
        ({"loss_scale": float("inf")}, "loss_scale must be a finite number > 0"),
        ({"min_loss_scale": -1.0}, "min_loss_scale must be a finite number > 0"),
        ({"loss_scale": 1.0, "min_loss_scale": 2.0}, "must be <= loss_scale"),
        ({"hysteresis": 0}, "hysteresis must be an int >= 1"),
        ({"counter": 5, "period": 5}, "counter must be an int with 0 <= counter"),
    ],
)
def test_invalid_dynamic_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ls.DynamicLossScale(**kwargs)


def test_invalid_static_args():
    with pytest.raises(ValueError, match="loss_scale must be a finite number > 0"):
        ls.StaticLossScale(-2.0)


def test_all_finite():
    big = torch.full((100,), 300.0, dtype=torch.float16)  # squares overflow fp16
    assert ls.all_finite([big, torch.arange(3)])
    assert ls.all_finite([])
    assert not ls.all_finite({"a": torch.ones(2), "b": [torch.tensor([-float("inf")])]})
    assert not ls.all_finite(torch.tensor([float("nan")], dtype=torch.bfloat16))
    m = torch.nn.Linear(2, 2)
    assert ls.all_finite(m)
    with torch.no_grad():
        m.bias[0] = float("nan")
    assert not ls.all_finite(m)


# The same (kwargs, message) table is in jaxstable/tests/test_loss_scale.py.
OUT_OF_RANGE = [
    (
        dict(counter=5, period=5),
        "counter must be an int with 0 <= counter < period=5, got 5",
    ),
    (
        dict(counter=-1),
        "counter must be an int with 0 <= counter < period=2000, got -1",
    ),
    (
        dict(counter=1.5),
        "counter must be an int with 0 <= counter < period=2000, got 1.5",
    ),
    (
        dict(loss_scale=1.0, min_loss_scale=2.0),
        "min_loss_scale=2.0 must be <= loss_scale=1.0",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), OUT_OF_RANGE)
def test_out_of_range_counter_and_floor_are_rejected(kwargs, message):
    with pytest.raises(ValueError) as info:
        ls.DynamicLossScale(**kwargs)
    assert str(info.value) == message


def test_static_default_equals_jax_and_loss_scales_hash():
    assert ls.StaticLossScale().loss_scale == 2.0**15  # jaxstable's default
    assert ls.StaticLossScale().make_scaler("cpu").get_scale() == 2.0**15
    assert len({ls.DynamicLossScale(), ls.StaticLossScale(), ls.NoOpLossScale()}) == 3


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64]
)
def test_all_finite_is_exact_in_every_dtype(dtype):
    big = torch.finfo(dtype).max
    tensors = [torch.full((1000,), big, dtype=dtype), torch.ones(5, dtype=dtype)]
    tensors += [torch.arange(3), torch.tensor([True])]  # never non-finite
    # The L1 norm of the first tensor overflows: still all finite.
    assert ls.all_finite(tensors)
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = [t.clone() for t in tensors]
        poisoned[1][3] = bad
        assert not ls.all_finite(poisoned)
        poisoned[0][999] = bad  # in the overflowing tensor too
        assert not ls.all_finite(poisoned[:1])
    assert not ls.all_finite([torch.tensor([1 + 1j, complex("nan")])])
    assert ls.all_finite([]) and ls.all_finite({"a": None})
