"""torchref.precision: jmp's policy grammar with torch dtypes, dtype limits
and headroom."""

import math

import pytest
import torch

from torchref import precision as pr


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("params=float32,compute=float16,output=float32", ("f32", "f16", "f32")),
        ("p=f32,c=bf16,o=f32", ("f32", "bf16", "f32")),
        ("c=f16", ("f32", "f16", "f16")),  # output follows compute, params f32
        ("p=f16", ("f16", "f16", "f16")),
        ("float16", ("f16", "f16", "f16")),
        ("half", ("f16", "f16", "f16")),
        ("bf16", ("bf16", "bf16", "bf16")),
        ("f32", ("f32", "f32", "f32")),
        ("full", ("f32", "f32", "f32")),
    ],
)
def test_get_policy(spec, expected):
    assert str(pr.get_policy(spec)) == "p={},c={},o={}".format(*expected)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("float8", "unknown dtype 'float8'.*allowed: bf16, bfloat16"),
        ("p=f32,x=f16", "bad entry 'x=f16'.*key one of p, params"),
        ("p=f32,c=int8", "unknown dtype 'int8'"),
        ("p=f32,c", "bad entry 'c'"),
    ],
)
def test_get_policy_errors_list_allowed(spec, match):
    with pytest.raises(ValueError, match=match):
        pr.get_policy(spec)


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


def test_dtype_limits_rejects_int():
    with pytest.raises(TypeError, match="floating torch dtype"):
        pr.dtype_limits(torch.int32)


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
