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
