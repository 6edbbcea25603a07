"""Unit tests of jaxstable.precision."""

import re

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

from jaxstable import precision

# The same table is in torchref/tests/test_precision.py: one grammar on both sides.
POLICY_TABLE = [
    (
        "params=float32,compute=float16,output=float32",
        ("float32", "float16", "float32"),
    ),
    ("p=f32,c=bf16,o=f32", ("float32", "bfloat16", "float32")),
    ("c=f16", ("float32", "float16", "float16")),  # jmp: output follows compute
    ("p=bf16", ("bfloat16", "bfloat16", "bfloat16")),
    ("compute=fp16,output=fp32", ("float32", "float16", "float32")),
    ("o=full", ("float32", "float32", "float32")),
    ("bf16", ("bfloat16", "bfloat16", "bfloat16")),
    ("bfloat16", ("bfloat16", "bfloat16", "bfloat16")),
    ("f16", ("float16", "float16", "float16")),
    ("fp16", ("float16", "float16", "float16")),
    ("float16", ("float16", "float16", "float16")),
    ("half", ("float16", "float16", "float16")),  # float16 off TPU, as jmp
    ("f32", ("float32", "float32", "float32")),
    ("fp32", ("float32", "float32", "float32")),
    ("float32", ("float32", "float32", "float32")),
    ("full", ("float32", "float32", "float32")),
    ("f64", ("float64", "float64", "float64")),
    ("mixed_float16", ("float32", "float16", "float32")),
    ("mixed_bfloat16", ("float32", "bfloat16", "float32")),
    ("MIXED_BFLOAT16", ("float32", "bfloat16", "float32")),
    ("Half", ("float16", "float16", "float16")),
    (" P=F32, C=FP16 ", ("float32", "float16", "float16")),
]

# (spec, message): the same table in torchref/tests/test_precision.py.
POLICY_ERRORS = [
    ("float8", "unknown dtype 'float8' in policy 'float8'"),
    ("p=f32,q=f16", "bad part 'q=f16' in policy 'p=f32,q=f16'"),
    ("p=f32,c", "bad part 'c' in policy 'p=f32,c'"),
    ("compute", "unknown dtype 'compute'"),
    ("c=mixed_float16", "unknown dtype 'mixed_float16'"),
    ("p=f32,p=f16", "'params' given twice in policy 'p=f32,p=f16'"),
    ("P=f32,params=f16", "'params' given twice"),
    ("c=f16,o=f32,compute=bf16", "'compute' given twice"),
    ("", "empty policy string"),
    ("  ", "empty policy string"),
]


@pytest.mark.parametrize(("spec", "expected"), POLICY_TABLE)
def test_get_policy(spec, expected):
    p = precision.get_policy(spec)
    assert isinstance(p, jmp.Policy)
    got = tuple(
        jnp.dtype(d).name for d in (p.param_dtype, p.compute_dtype, p.output_dtype)
    )
    assert got == expected
    assert precision.get_policy(p) is p


@pytest.mark.parametrize(("spec", "message"), POLICY_ERRORS)
def test_get_policy_errors_list_allowed(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        precision.get_policy(spec)
    text = str(info.value)
    for allowed in ("params|p, compute|c, output|o", "mixed_bfloat16", "fp16", "full"):
        assert allowed in text


def test_get_policy_type_error():
    with pytest.raises(TypeError, match="policy must be a string"):
        precision.get_policy(3)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32"])
def test_dtype_limits(name):
    lim = precision.dtype_limits(name)
    fi = jnp.finfo(name)
    assert (
        lim.max == float(fi.max)
        and lim.tiny == float(fi.tiny)
        and lim.eps == float(fi.eps)
    )
    dt = jnp.dtype(name)
    # exp(max_exp_arg rounded down into the dtype) is finite; 1% above is inf.
    below = jnp.nextafter(jnp.asarray(lim.max_exp_arg, dt), jnp.asarray(0, dt))
    assert bool(jnp.isfinite(jnp.exp(below)))
    above = jnp.asarray(lim.max_exp_arg * 1.01, dt)
    assert not bool(jnp.isfinite(jnp.exp(above)))


def test_dtype_limits_known_values():
    assert precision.dtype_limits(jnp.float16).max == 65504.0
    assert round(precision.dtype_limits(jnp.float16).max_exp_arg, 2) == 11.09
    assert round(precision.dtype_limits(jnp.float32).max_exp_arg, 2) == 88.72


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, "int8"])
def test_dtype_limits_non_float_is_type_error(dtype):
    # Same error type and text as torchref.precision.dtype_limits.
    name = jnp.dtype(dtype).name
    with pytest.raises(TypeError) as info:
        precision.dtype_limits(dtype)
    assert str(info.value) == (
        "dtype_limits needs a floating dtype (float16, bfloat16, float32, "
        f"float64, float8 variants), got {name}"
    )


def test_dtype_limits_float8():
    lim = precision.dtype_limits(jnp.float8_e4m3fn)
    assert lim.max == 448.0


def test_headroom(tol):
    tree = {
        "a": jnp.array([-32752.0, 3.0]),
        "b": jnp.array([1e5]),
        "e": jnp.zeros((0,)),
    }
    h = jax.jit(lambda t: precision.headroom(t, jnp.float16))(tree)
    np.testing.assert_allclose(float(h["a"]), 0.5, **tol("float32"))
    assert float(h["b"]) > 1.0  # would overflow fp16
    assert float(h["e"]) == 0.0
    assert h["a"].dtype == jnp.float32
    big = jnp.full(3, 2.0**100, jnp.bfloat16)
    hb = precision.headroom({"x": big}, jnp.bfloat16)
    expected = 2.0**100 / float(jnp.finfo(jnp.bfloat16).max)
    np.testing.assert_allclose(float(hb["x"]), expected, **tol("float32"))
    assert not bool(jnp.isfinite(precision.headroom(jnp.array([jnp.inf]), jnp.float16)))
