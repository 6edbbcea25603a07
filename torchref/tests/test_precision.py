"""torchref.precision: jmp's policy grammar with torch dtypes, dtype limits
and headroom."""

import math
import re

import pytest
import torch

from torchref import precision as pr

# The same table is in jaxstable/tests/test_precision.py: one grammar on both sides.
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
    ("half", ("float16", "float16", "float16")),  # torch has no TPU: float16
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

# (spec, message): the same table in jaxstable/tests/test_precision.py.
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
    p = pr.get_policy(spec)
    got = tuple(
        str(d).removeprefix("torch.")
        for d in (p.param_dtype, p.compute_dtype, p.output_dtype)
    )
    assert got == expected
    assert pr.get_policy(p) is p


@pytest.mark.parametrize(("spec", "message"), POLICY_ERRORS)
def test_get_policy_errors_list_allowed(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        pr.get_policy(spec)
    text = str(info.value)
    for allowed in ("params|p, compute|c, output|o", "mixed_bfloat16", "fp16", "full"):
        assert allowed in text


def test_get_policy_type_error():
    with pytest.raises(TypeError, match="policy must be a string"):
        pr.get_policy(3)


def test_policy_casts_only_floating_tensors():
    p = pr.get_policy("p=f32,c=bf16,o=f32")
    x = {"a": torch.ones(2), "i": torch.arange(3), "l": [torch.zeros(1)], "s": 3}
    y = p.cast_to_compute(x)
    assert y["a"].dtype == torch.bfloat16 and y["l"][0].dtype == torch.bfloat16
    assert y["i"].dtype == torch.int64 and y["s"] == 3
    assert p.cast_to_output(y["a"]).dtype == torch.float32
    assert p.cast_to_param(torch.ones(1, dtype=torch.float16)).dtype == torch.float32


def test_dtype_limits_fp16():
    lim = pr.dtype_limits(torch.float16)
    assert lim.max == 65504.0 and lim.tiny == 2.0**-14 and lim.eps == 2.0**-10
    assert math.exp(lim.max_exp_arg) == pytest.approx(65504.0)
    # In fp16 itself: exp of the fp16 value just below the limit is finite,
    # just above it is inf (fp16 spacing at 11 is 2**-7).
    below = torch.tensor(lim.max_exp_arg - 2.0**-7, dtype=torch.float16)
    above = torch.tensor(lim.max_exp_arg + 2.0**-7, dtype=torch.float16)
    assert bool(torch.isfinite(torch.exp(below)))
    assert bool(torch.isinf(torch.exp(above)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtype_limits_exp_boundary(dtype):
    lim = pr.dtype_limits(dtype)
    assert lim.max == torch.finfo(dtype).max
    assert bool(
        torch.isinf(torch.exp(torch.tensor(lim.max_exp_arg * 1.01, dtype=dtype)))
    )
    assert bool(
        torch.isfinite(torch.exp(torch.tensor(lim.max_exp_arg * 0.99, dtype=dtype)))
    )


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.int8])
def test_dtype_limits_non_float_is_type_error(dtype):
    # Same error type and text as jaxstable.precision.dtype_limits.
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(TypeError) as info:
        pr.dtype_limits(dtype)
    assert str(info.value) == (
        "dtype_limits needs a floating dtype (float16, bfloat16, float32, "
        f"float64, float8 variants), got {name}"
    )


def test_dtype_limits_float8():
    assert pr.dtype_limits(torch.float8_e4m3fn).max == 448.0


def test_headroom():
    m = torch.nn.Linear(2, 1)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[-65504.0 / 4, 1.0]]))
        m.bias.fill_(0.0)
    h = pr.headroom(m, torch.float16)
    assert h == {"weight": 0.25, "bias": 0.0}
    assert pr.headroom([torch.empty(0), torch.tensor([2.0])], torch.float32)["0"] == 0.0
    assert math.isinf(
        pr.headroom({"x": torch.tensor([float("inf")])}, torch.float16)["x"]
    )
