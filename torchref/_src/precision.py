"""Mixed-precision policies and dtype limits for PyTorch, mirroring
`jaxstable.precision` (whose policies are `jmp.Policy`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["DtypeLimits", "Policy", "dtype_limits", "get_policy", "headroom"]

# jmp's names (jmp/_src/policy.py: dtype_to_names), plus "half" which jmp maps
# to bf16 on TPU and fp16 elsewhere; torch has no TPU, so "half" = float16.
_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "f16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "full": torch.float32,
    "f32": torch.float32,
    "float32": torch.float32,
    "f64": torch.float64,
    "float64": torch.float64,
}
_KEYS = {"p": "param", "params": "param", "c": "compute", "compute": "compute"}
_KEYS |= {"o": "output", "output": "output"}
_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_SHORT[torch.float64] = "f64"


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, Mapping):
        return type(tree)((k, _cast_floating(v, dtype)) for k, v in tree.items())
    if isinstance(tree, list | tuple):
        cast = [_cast_floating(v, dtype) for v in tree]
        return type(tree)(*cast) if hasattr(tree, "_fields") else type(tree)(cast)
    return tree


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters are stored in, computed in, and output in.

    Like `jmp.Policy`: the `cast_to_*` methods cast the floating-point tensors
    of a tensor / mapping / list / tuple and leave other leaves alone.

    Example:
        >>> import torch
        >>> p = Policy(torch.float32, torch.bfloat16, torch.float32)
        >>> p.cast_to_compute({"x": torch.ones(2), "i": torch.arange(2)})["x"].dtype
        torch.bfloat16
        >>> str(p)
        'p=f32,c=bf16,o=f32'
    """

    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    output_dtype: torch.dtype

    def cast_to_param(self, x: Any) -> Any:
        """Casts floating tensors to `param_dtype`."""
        return _cast_floating(x, self.param_dtype)

    def cast_to_compute(self, x: Any) -> Any:
        """Casts floating tensors to `compute_dtype`."""
        return _cast_floating(x, self.compute_dtype)

    def cast_to_output(self, x: Any) -> Any:
        """Casts floating tensors to `output_dtype`."""
        return _cast_floating(x, self.output_dtype)

    def with_output_dtype(self, output_dtype: torch.dtype) -> Policy:
        """A copy with another output dtype."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        p, c, o = (
            _SHORT[d] for d in (self.param_dtype, self.compute_dtype, self.output_dtype)
        )
        return f"p={p},c={c},o={o}"


def _parse_dtype(value: str, spec: str) -> torch.dtype:
    try:
        return _NAMES[value.strip()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {value!r} in policy {spec!r}; allowed: {', '.join(_NAMES)}"
        ) from None


def get_policy(spec: str) -> Policy:
    """Parses a policy string with jmp's grammar.

    Grammar: either one dtype name for all three (``"float16"``, ``"half"``,
    ``"bf16"``, ``"f32"``, ...) or comma-separated ``key=dtype`` with keys
    ``params|p``, ``compute|c``, ``output|o``. Missing values: params
    defaults to float32, compute follows params, output follows compute
    (``"c=f16"`` -> ``p=f32,c=f16,o=f16``), as `jmp.get_policy`.

    Args:
        spec: the policy string.

    Returns:
        A `Policy` of torch dtypes.

    Raises:
        ValueError: unknown key or dtype, listing the allowed ones.

    Example:
        >>> print(get_policy("params=float32,compute=float16,output=float32"))
        p=f32,c=f16,o=f32
        >>> print(get_policy("c=bf16"))
        p=f32,c=bf16,o=bf16
        >>> print(get_policy("half"))
        p=f16,c=f16,o=f16
    """
    if not isinstance(spec, str):
        raise TypeError(f"policy must be a string, got {type(spec).__name__}")
    if "=" not in spec:
        d = _parse_dtype(spec, spec)
        return Policy(d, d, d)
    found: dict[str, torch.dtype] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise ValueError(
                f"bad entry {part!r} in policy {spec!r}; expected key=dtype with key "
                f"one of {', '.join(_KEYS)} and dtype one of {', '.join(_NAMES)}"
            )
        found[_KEYS[key]] = _parse_dtype(value, spec)
    param = found.get("param", torch.float32)
    compute = found.get("compute", param)
    return Policy(param, compute, found.get("output", compute))


class DtypeLimits(NamedTuple):
    """Numerical limits of a floating dtype (python floats).

    Attributes:
        max: largest finite value.
        tiny: smallest positive normal value.
        eps: gap between 1 and the next value.
        max_exp_arg: ``log(max)``, the largest real x whose exp(x) does not
            exceed `max` (11.09 for fp16, 88.72 for fp32/bf16-ish ranges).
    """

    max: float
    tiny: float
    eps: float
    max_exp_arg: float


def dtype_limits(dtype: torch.dtype) -> DtypeLimits:
    """`DtypeLimits` of a floating torch dtype.

    Maths: from `torch.finfo`; ``max_exp_arg = log(finfo.max)`` (exp
    overflows fp16 above 11.09, bf16 above 88.72, fp32 above 88.72).

    Args:
        dtype: a floating torch dtype.

    Returns:
        `DtypeLimits`.

    Raises:
        TypeError: a non-floating dtype.

    Example:
        >>> import torch
        >>> lim = dtype_limits(torch.float16)
        >>> lim.max, round(lim.max_exp_arg, 2)
        (65504.0, 11.09)
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch dtype, got {dtype!r}")
    fi = torch.finfo(dtype)
    return DtypeLimits(float(fi.max), float(fi.tiny), float(fi.eps), math.log(fi.max))


def _named(tree: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        return [("", tree)]
    if isinstance(tree, torch.nn.Module):
        return list(tree.named_parameters())
    if isinstance(tree, Mapping):
        return [(str(k), v) for k, v in tree.items() if isinstance(v, torch.Tensor)]
    items = list(tree)
    if all(
        isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in items
    ):
        return [(k, v) for k, v in items if isinstance(v, torch.Tensor)]
    return [(str(i), v) for i, v in enumerate(items) if isinstance(v, torch.Tensor)]


def headroom(tensors: Any, dtype: torch.dtype) -> dict[str, float]:
    """How close each tensor is to overflowing `dtype`: max|x| / dtype max.

    Maths: ``max(|x|) / finfo(dtype).max`` per tensor (computed in float64,
    so exact for any input). 1.0 or more means casting to `dtype` overflows;
    0.0 for an empty tensor; inf/nan when the tensor holds them.

    Args:
        tensors: a module (named parameters), a mapping name->tensor, an
            iterable of (name, tensor) pairs, a sequence of tensors (names
            "0", "1", ...) or one tensor (name "").
        dtype: the floating dtype to measure against.

    Returns:
        dict name -> python float.

    Example:
        >>> import torch
        >>> h = headroom({"w": torch.tensor([-32752.0, 1.0])}, torch.float16)
        >>> round(h["w"], 4)
        0.5
    """
    dmax = dtype_limits(dtype).max
    out = {}
    for name, t in _named(tensors):
        t = t.detach()
        m = float(t.abs().max().double()) if t.numel() else 0.0
        out[name] = m / dmax
    return out
