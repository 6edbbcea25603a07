"""torchref.diagnostics: non-finite reports by name for tensors, models,
state dicts and grads."""

import math

import pytest
import torch

from torchref import diagnostics as dg


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 2, 3),
        torch.nn.BatchNorm2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 1),
    )


def test_report_counts_and_paths():
    t = torch.tensor([1.0, -7.0, float("nan"), float("inf"), float("-inf")])
    r = dg.non_finite_report(
        {"ok": torch.ones(3), "enc": {"w": t, "idx": torch.arange(2)}}
    )
    assert len(r) == 1
    leaf = r[0]
    assert (leaf.path, leaf.nan_count, leaf.inf_count, leaf.max_abs_finite) == (
        "enc/w",
        1,
        2,
        7.0,
    )
    assert leaf.shape == (5,) and leaf.dtype == "float32"
    assert dg.non_finite_report([torch.ones(2), torch.zeros(1)]) == []


def test_report_all_nan_leaf_and_bf16():
    r = dg.non_finite_report([torch.full((2, 3), float("nan"), dtype=torch.bfloat16)])
    assert r[0].path == "0" and r[0].nan_count == 6
    assert math.isnan(r[0].max_abs_finite)  # no finite element: nan, as JAX
    assert r[0].dtype == "bfloat16" and r[0].shape == (2, 3)


def test_model_report_names_params_and_buffers():
    m = _net()
    with torch.no_grad():
        m[0].weight[0, 0, 0, 0] = float("nan")
        m[1].running_var.fill_(float("inf"))
    assert [r.path for r in dg.non_finite_report(m)] == ["0.weight", "1.running_var"]
    assert [r.path for r in dg.non_finite_report(m.state_dict())] == [
        "0.weight",
        "1.running_var",
    ]


def test_grad_report_names_parameters():
    m = _net()
    x = torch.randn(2, 1, 4, 4)
    x[0, 0, 0, 0] = float("nan")
    m(x).sum().backward()
    names = [r.path for r in dg.non_finite_grad_report(m)]
    expected = [n for n, p in m.named_parameters() if not torch.isfinite(p.grad).all()]
    assert names == expected
    assert "0.weight" in names and "3.bias" not in names  # d(sum)/d(bias) = 1


def test_format_report_table():
    r = dg.non_finite_report({"layer.w": torch.tensor([float("nan"), 2.5])})
    text = dg.format_report(r)
    lines = text.splitlines()
    assert lines[0].split() == ["path", "nan", "inf", "max|finite|", "shape", "dtype"]
    assert lines[1].split() == ["layer.w", "1", "0", "2.5", "(2,)", "float32"]
    assert dg.format_report([]) == "all finite"


# The same literal is in jaxstable/tests/test_diagnostics.py: one layout.
TABLE = (
    "path   nan  inf  max|finite|  shape   dtype\n"
    "enc/w    1    2            7  (5,)    float32\n"
    "b        3    0          nan  (2, 3)  bfloat16"
)


def test_format_report_layout_is_shared():
    report = [
        dg.LeafReport("enc/w", 1, 2, 7.0, (5,), "float32"),
        dg.LeafReport("b", 3, 0, float("nan"), (2, 3), "bfloat16"),
    ]
    assert dg.format_report(report) == TABLE


def test_check_params_message_layout():
    tree = {"a": torch.ones(2), "w": torch.tensor([float("nan"), 2.5])}
    with pytest.raises(FloatingPointError) as info:
        dg.check_params(tree)
    report = dg.non_finite_report(tree)
    assert str(info.value) == (
        "1 of 2 leaves is not finite: w\n" + dg.format_report(report)
    )


def test_check_params():
    m = _net()
    dg.check_params(m)
    with torch.no_grad():
        m[3].bias.fill_(float("nan"))
    with pytest.raises(
        FloatingPointError, match=r"1 of 9 leaves is not finite: 3\.bias"
    ):
        dg.check_params(m)


# ------------------------------------------------------------ check points
def _checked_loss(model, x):
    """A loss that marks four points; an all-zero row of x makes log(|h|)
    -inf (a real op on finite inputs), so the first bad point is 'log'."""
    h = model(x)[:, 0]
    log_h = h.abs().log()
    loss = (log_h**2).mean()
    checks = (
        dg.CheckPoints()
        .add("inputs", x)
        .add("hidden", h)
        .add("log", log_h)
        .add("loss", loss)
    )
    return loss, {"checks": checks, "h_max": h.abs().max()}


def _xs(zero_row: bool):
    x = torch.tensor([[1.0, 2.0, 0.5], [0.3, -1.0, 2.0]])
    if zero_row:
        x[1] = 0.0  # model(x) == 0 whatever the weights are
    return x


def _checks_step():
    from torchref import train

    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    return train.TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=0.01), _checked_loss
    )


def test_check_points_values_order_and_dtypes():
    nan, inf = float("nan"), float("inf")
    c = dg.check_points(
        f32=torch.tensor([1.0, nan, -4.0]),
        bf16=torch.tensor([[-inf, 3.0]], dtype=torch.bfloat16),
        ints=torch.tensor([-7, 2]),
        scalar=2.5,
        empty=torch.zeros(0, 3),
        all_bad=torch.tensor([nan, inf]),
    )
    assert c.names == ("f32", "bf16", "ints", "scalar", "empty", "all_bad")
    assert [bool(f) for f in c.finite] == [False, False, True, True, True, False]
    got = [float(m) for m in c.max_abs]  # over the finite entries; none: nan
    assert got[:4] == [4.0, 3.0, 7.0, 2.5] and all(map(math.isnan, got[4:]))
    assert all(m.dtype == torch.float32 and m.ndim == 0 for m in c.max_abs)
    assert c.non_finite() == ["f32", "bf16", "all_bad"]
    more = c.add("z", torch.ones(1))  # functional: c is unchanged
    assert len(c) == 6 and len(more) == 7 and more.names[-1] == "z"


def test_check_points_refuse_bad_names_and_values():
    c = dg.check_points(a=torch.ones(2))
    with pytest.raises(ValueError, match=r"'a' is already used; .* \['a'\]"):
        c.add("a", torch.ones(2))
    with pytest.raises(ValueError, match="non-empty string"):
        c.add("", torch.ones(2))
    with pytest.raises(TypeError, match="must be a string, got 3"):
        c.add(3, torch.ones(2))
    with pytest.raises(TypeError, match=r"'m' must be a numeric array.*bool"):
        c.add("m", torch.ones(2) > 0)
    twice = {"x": c, "y": dg.check_points(a=torch.zeros(1))}
    with pytest.raises(ValueError, match="'a' is already used"):
        dg.check_record(twice)


def test_check_points_read_nothing_on_the_host(monkeypatch):
    """add() and the loss that calls it never read a tensor's value (no
    .item(), bool(), float(), .tolist(): a host sync on a GPU); no gradient
    flows through a check."""
    w = torch.ones(3, requires_grad=True)

    def refuse(*args, **kwargs):
        raise AssertionError("a check point read a value on the host")

    for name in ("item", "__bool__", "__float__", "__int__", "tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    h = _xs(True) @ w
    checks = dg.check_points(inputs=_xs(True), hidden=h, log=h.abs().log())
    monkeypatch.undo()
    assert not any(t.requires_grad for t in checks.finite + checks.max_abs)
    assert checks.non_finite() == ["log"]


def test_fit_records_and_error_name_the_non_finite_points(tmp_path):
    import json

    from torchref import train

    log = tmp_path / "log.jsonl"
    with pytest.raises(train.NonFiniteError) as err:
        train.fit(
            _checks_step(),
            [_xs(False), _xs(True)],
            nan_policy=train.NanPolicy.stop(max_consecutive=1),
            log=train.Log(log, progress=False),
        )
    first, last = err.value.history
    assert (first["non_finite_checks"], first["first_non_finite_check"]) == ([], None)
    assert last["non_finite_checks"] == ["log", "loss"]
    assert last["first_non_finite_check"] == "log"
    assert last["checks['inputs']['finite']"] is True
    assert last["checks['inputs']['max_abs']"] == 2.0
    assert "aux['h_max']" in last  # other aux scalars stay aux[...] keys
    hidden = last["checks['hidden']['max_abs']"]
    line = (
        f"inputs finite (max|x| 2), hidden finite (max|x| {hidden:.3g}), "
        "log NON-FINITE, loss NON-FINITE; first non-finite: log"
    )
    assert f"check points of the step, in order: {line}" in str(err.value)
    back = [json.loads(x) for x in log.read_text().splitlines()]
    assert dg.format_checks(last) == dg.format_checks(back[1]) == line
