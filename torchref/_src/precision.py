"""Mixed-precision policies and dtype limits for PyTorch, mirroring
`jaxstable.precision` (whose policies are `jmp.Policy`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["DtypeLimits", "Policy", "dtype_limits", "get_policy", "headroom"]

# The policy grammar is the same in jaxstable.precision (same names, same
# errors, same messages): one dtype name for all three parts, a Keras-style
# mixed name, or key=dtype pairs; case-insensitive. "half" is jmp's name,
# float16 on CPU/GPU (jmp maps it to bfloat16 on TPU; torch has no TPU).
_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "f16": torch.float16,
    "f32": torch.float32,
    "f64": torch.float64,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "full": torch.float32,
    "half": torch.float16,
}
_KEYS = {"params": "params", "p": "params", "compute": "compute", "c": "compute"}
_KEYS |= {"output": "output", "o": "output"}
# Keras-style names for the usual mixed-precision recipe: (params, compute, output).
_NAMED = {
    "mixed_float16": (torch.float32, torch.float16, torch.float32),
    "mixed_bfloat16": (torch.float32, torch.bfloat16, torch.float32),
}
_ALLOWED = (
    "one dtype name for params, compute and output "
    f"({', '.join(sorted(_NAMES))}), "
    f"{' or '.join(sorted(_NAMED))}, or comma-separated key=dtype pairs with "
    "keys params|p, compute|c, output|o (e.g. 'params=float32,compute=float16,"
    "output=float32' or 'p=f32,c=bf16,o=f32'); case-insensitive"
)
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


def _parse_dtype(name: str, spec: str) -> torch.dtype:
    if name not in _NAMES:
        raise ValueError(
            f"unknown dtype {name!r} in policy {spec!r}; allowed: {_ALLOWED}"
        )
    return _NAMES[name]


def get_policy(spec: str | Policy) -> Policy:
    """Parses a policy string with the grammar of `jaxstable.precision.get_policy`.

    Grammar (case-insensitive, spaces ignored):

    - one dtype name for all three parts: ``bf16``, ``bfloat16``, ``f16``,
      ``fp16``, ``float16``, ``half`` (float16), ``f32``, ``fp32``,
      ``float32``, ``full``, ``f64``, ``float64``;
    - ``mixed_float16`` / ``mixed_bfloat16``: params and output float32,
      compute float16 / bfloat16;
    - comma-separated ``key=dtype`` pairs with keys ``params|p``,
      ``compute|c``, ``output|o``, each key at most once. Missing values:
      params defaults to float32, compute follows params, output follows
      compute (``"c=f16"`` -> ``p=f32,c=f16,o=f16``), as `jmp.get_policy`.

    Args:
        spec: the policy string, or a `Policy` (returned unchanged).

    Returns:
        A `Policy` of torch dtypes.

    Raises:
        ValueError: unknown key or dtype, repeated key, empty string; the
            message lists what is allowed (same text as the JAX side).
        TypeError: `spec` is neither a string nor a `Policy`.

    Example:
        >>> print(get_policy("params=float32,compute=float16,output=float32"))
        p=f32,c=f16,o=f32
        >>> print(get_policy("c=bf16"))
        p=f32,c=bf16,o=bf16
        >>> print(get_policy("half"), get_policy("Mixed_BFloat16"))
        p=f16,c=f16,o=f16 p=f32,c=bf16,o=f32
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"policy must be a string or Policy, got {type(spec).__name__}")
    text = spec.strip().lower()
    if not text:
        raise ValueError(f"empty policy string {spec!r}; allowed: {_ALLOWED}")
    if text in _NAMED:
        return Policy(*_NAMED[text])
    if "=" not in text:
        d = _parse_dtype(text, spec)
        return Policy(d, d, d)
    found: dict[str, torch.dtype] = {}
    for part in text.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or key not in _KEYS:
            raise ValueError(
                f"bad part {part.strip()!r} in policy {spec!r}; allowed: {_ALLOWED}"
            )
        if _KEYS[key] in found:
            raise ValueError(
                f"{_KEYS[key]!r} given twice in policy {spec!r}; allowed: {_ALLOWED}"
            )
        found[_KEYS[key]] = _parse_dtype(value, spec)
    param = found.get("params", torch.float32)
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
        TypeError: not a floating torch dtype (the same error and text as
            `jaxstable.precision.dtype_limits`).

    Example:
        >>> import torch
        >>> lim = dtype_limits(torch.float16)
        >>> lim.max, round(lim.max_exp_arg, 2)
        (65504.0, 11.09)
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        name = (
            str(dtype).removeprefix("torch.")
            if isinstance(dtype, torch.dtype)
            else repr(dtype)
        )
        raise TypeError(
            "dtype_limits needs a floating dtype (float16, bfloat16, float32, "
            f"float64, float8 variants), got {name}"
        )
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
