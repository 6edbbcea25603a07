"""Unit tests of jaxstable.diagnostics."""

import jax
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


# ------------------------------------------------------------ check points
def _checked_loss(params, x):
    """A loss that marks four points; an all-zero row of x makes log(|x @ w|)
    -inf (a real op on finite inputs), so the first bad point is 'log'."""
    h = x @ params["w"]
    log_h = jnp.log(jnp.abs(h))
    loss = jnp.mean(log_h**2)
    checks = (
        diagnostics.CheckPoints()
        .add("inputs", x)
        .add("hidden", h)
        .add("log", log_h)
        .add("loss", loss)
    )
    return loss, {"checks": checks, "h_max": jnp.max(jnp.abs(h))}


def _xs(zero_row: bool):
    x = np.array([[1.0, 2.0, 0.5], [0.3, -1.0, 2.0]], np.float32)
    if zero_row:
        x[1] = 0.0  # x @ w == 0 whatever w is
    return jax.device_put(jnp.asarray(x))


def _checks_state():
    import optax

    from jaxstable import train, transforms

    tx = transforms.stable_optimizer(optax.sgd(0.01))
    return train.TrainState.create(params={"w": jnp.ones(3)}, optimizer=tx)


def test_check_points_values_order_and_dtypes():
    nan, inf = jnp.nan, jnp.inf
    values = dict(
        f32=jnp.array([1.0, nan, -4.0]),
        bf16=jnp.array([[-inf, 3.0]], jnp.bfloat16),
        ints=jnp.array([-7, 2]),
        scalar=2.5,
        empty=jnp.zeros((0, 3)),
        all_bad=jnp.array([nan, inf]),
    )

    # one compile, not one per op (in the trace, the kwargs keep their order;
    # jax.jit(check_points)(**values) would pass them as a sorted dict)
    @jax.jit
    def build(v):
        return diagnostics.check_points(**dict(zip(values, v, strict=True)))

    c = build(list(values.values()))
    assert c.names == ("f32", "bf16", "ints", "scalar", "empty", "all_bad")
    assert [bool(f) for f in c.finite] == [False, False, True, True, True, False]
    got = [float(m) for m in c.max_abs]  # over the finite entries; none: nan
    np.testing.assert_array_equal(got, [4.0, 3.0, 7.0, 2.5, np.nan, np.nan])
    assert all(m.dtype == jnp.float32 and m.shape == () for m in c.max_abs)
    assert c.non_finite() == ["f32", "bf16", "all_bad"]
    # add is functional: the collector it was called on is unchanged
    more = c.add("z", jnp.ones(1))
    assert len(c) == 6 and len(more) == 7 and more.names[-1] == "z"


def test_check_points_refuse_bad_names_and_values():
    c = diagnostics.check_points(a=jnp.ones(2))
    with pytest.raises(ValueError, match=r"'a' is already used; .* \['a'\]"):
        c.add("a", jnp.ones(2))
    with pytest.raises(ValueError, match="non-empty string"):
        c.add("", jnp.ones(2))
    with pytest.raises(TypeError, match="must be a string, got 3"):
        c.add(3, jnp.ones(2))
    with pytest.raises(TypeError, match=r"'m' must be a numeric array.*bool"):
        c.add("m", jnp.ones(2) > 0)
    twice = {"x": c, "y": diagnostics.check_points(a=jnp.zeros(1))}
    with pytest.raises(ValueError, match="'a' is already used"):
        diagnostics.check_record(twice)


def test_check_points_in_the_jitted_step_no_transfer_no_conditional():
    from conftest import has_conditional
    from jaxstable import train

    step = train.make_train_step(_checked_loss, has_aux=True)
    state, good, bad = _checks_state(), _xs(False), _xs(True)
    assert not has_conditional(step.lower(state, good))
    state, _ = step(state, good)  # compile outside the guard
    with jax.transfer_guard("disallow"):  # no host transfer in the step
        state, m_good = step(state, good)
        state, m_bad = step(state, bad)
    ok, broken = m_good["aux"]["checks"], m_bad["aux"]["checks"]
    assert ok.names == broken.names == ("inputs", "hidden", "log", "loss")
    assert ok.non_finite() == [] and broken.non_finite() == ["log", "loss"]
    assert not bool(m_bad["finite"])
    assert float(broken.max_abs[0]) == 2.0  # |x| of the batch, its max


def test_check_points_cost_one_finiteness_reduction_each_and_none_unused():
    """Each point adds two outputs (flag, max) and one is_finite to the
    step's program; a loss that marks none adds nothing."""
    from jaxstable import train

    def plain(p, x):
        return _checked_loss(p, x)[0]

    def unmarked(p, x):
        return _checked_loss(p, x)[0], {}

    state, x = _checks_state(), _xs(False)
    lowered = {
        name: train.make_train_step(fn, has_aux=aux).lower(state, x)
        for name, fn, aux in (
            ("plain", plain, False),
            ("unmarked", unmarked, True),
            ("checked", _checked_loss, True),
        )
    }
    outs = {k: len(jax.tree.leaves(v.out_info)) for k, v in lowered.items()}
    finite = {k: v.as_text().count("is_finite") for k, v in lowered.items()}
    assert outs["unmarked"] == outs["plain"]
    assert finite["unmarked"] == finite["plain"]
    assert outs["checked"] == outs["plain"] + 2 * 4 + 1  # 4 points, h_max
    assert finite["checked"] == finite["plain"] + 4


def test_fit_records_name_the_non_finite_points_in_order(tmp_path):
    import json

    from jaxstable import train

    step = train.make_train_step(_checked_loss, has_aux=True)
    log = tmp_path / "log.jsonl"
    _, (first, last) = train.fit(
        _checks_state(),
        step,
        [_xs(False), _xs(True)],
        log=train.Log(log, progress=False),
        nan_policy=train.NanPolicy.skip(locate_first=0),
    )
    assert (first["non_finite_checks"], first["first_non_finite_check"]) == ([], None)
    assert last["non_finite_checks"] == ["log", "loss"]
    assert last["first_non_finite_check"] == "log"
    assert last["checks['inputs']['finite']"] is True
    assert last["checks['inputs']['max_abs']"] == 2.0
    assert "aux['h_max']" in last  # other aux scalars stay aux[...] keys
    assert not any(k.startswith("aux['checks']") for k in last)
    hidden = last["checks['hidden']['max_abs']"]
    line = (
        f"inputs finite (max|x| 2), hidden finite (max|x| {hidden:.3g}), "
        "log NON-FINITE, loss NON-FINITE; first non-finite: log"
    )
    back = [json.loads(x) for x in log.read_text().splitlines()]
    assert diagnostics.format_checks(last) == diagnostics.format_checks(back[1]) == line
