"""Unit tests of jaxstable.diagnostics."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxstable import diagnostics


def _tree():
    return {
        "encoder": {
            "conv": {"kernel": jnp.array([[1.0, jnp.nan], [jnp.inf, -7.0]])},
            "bias": jnp.zeros(3),
        },
        "head": [jnp.array([jnp.nan, jnp.nan], jnp.bfloat16), jnp.arange(3)],
        "scale": jnp.array([-jnp.inf, 2.0], jnp.float16),
    }


def test_non_finite_report_paths_and_counts():
    rep = diagnostics.non_finite_report(_tree())
    by_path = {r.path: r for r in rep}
    assert set(by_path) == {"['encoder']['conv']['kernel']", "['head'][0]", "['scale']"}
    k = by_path["['encoder']['conv']['kernel']"]
    assert (k.nan_count, k.inf_count, k.max_abs_finite, k.shape, k.dtype) == (
        1,
        1,
        7.0,
        (2, 2),
        "float32",
    )
    h = by_path["['head'][0]"]
    assert (h.nan_count, h.inf_count, h.dtype) == (2, 0, "bfloat16")
    assert np.isnan(h.max_abs_finite)  # no finite element
    assert by_path["['scale']"].inf_count == 1


def test_empty_when_finite():
    assert diagnostics.non_finite_report({"a": jnp.ones(3), "i": jnp.arange(2)}) == []
    assert diagnostics.non_finite_report({}) == []


def test_format_report_table():
    text = diagnostics.format_report(diagnostics.non_finite_report(_tree()))
    lines = text.splitlines()
    assert lines[0].split() == ["path", "nan", "inf", "max|finite|", "shape", "dtype"]
    assert len(lines) == 4
    assert "['encoder']['conv']['kernel']" in lines[1] and "bfloat16" in lines[2]
    assert diagnostics.format_report([]) == "all finite"


def test_check_params():
    diagnostics.check_params({"w": jnp.ones(2)})
    with pytest.raises(
        FloatingPointError, match=r"3 of 5 leaves are not finite: "
    ) as info:
        diagnostics.check_params(_tree())
    assert "['scale']" in str(info.value)


def test_float8_leaves_are_reported():
    tree = {
        "e4": jnp.array([1.0, jnp.nan, -3.0], jnp.float8_e4m3fn),
        "e5": jnp.array([jnp.inf, -2.0], jnp.float8_e5m2),
        "ok": jnp.ones(2, jnp.float8_e4m3fn),
    }
    rep = {r.path: r for r in diagnostics.non_finite_report(tree)}
    assert set(rep) == {"['e4']", "['e5']"}
    assert (rep["['e4']"].nan_count, rep["['e4']"].max_abs_finite) == (1, 3.0)
    assert rep["['e4']"].dtype == "float8_e4m3fn"
    assert (rep["['e5']"].inf_count, rep["['e5']"].max_abs_finite) == (1, 2.0)


# The same literal is in torchref/tests/test_diagnostics.py: one layout.
TABLE = (
    "path   nan  inf  max|finite|  shape   dtype\n"
    "enc/w    1    2            7  (5,)    float32\n"
    "b        3    0          nan  (2, 3)  bfloat16"
)


def test_format_report_layout_is_shared():
    report = [
        diagnostics.LeafReport("enc/w", 1, 2, 7.0, (5,), "float32"),
        diagnostics.LeafReport("b", 3, 0, float("nan"), (2, 3), "bfloat16"),
    ]
    assert diagnostics.format_report(report) == TABLE


def test_check_params_message_layout():
    tree = {"a": jnp.ones(2), "w": jnp.array([jnp.nan, 2.5])}
    with pytest.raises(FloatingPointError) as info:
        diagnostics.check_params(tree)
    report = diagnostics.non_finite_report(tree)
    assert str(info.value) == (
        "1 of 2 leaves is not finite: ['w']\n" + diagnostics.format_report(report)
    )
