"""Precision policies (jmp), dtype limits and the headroom of a pytree."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jmp
import numpy as np

# The policy type is jmp's own (params/compute/output dtypes and their casts);
# re-exported so that both packages name it `precision.Policy`.
Policy = jmp.Policy

__all__ = ["DtypeLimits", "dtype_limits", "get_policy", "headroom"]

# The policy grammar is the same in torchref.precision (same names, same
# errors, same messages): one dtype name for all three parts, a Keras-style
# mixed name, or key=dtype pairs; case-insensitive. "half" follows jmp:
# float16 on CPU/GPU, bfloat16 on TPU (torch, without TPUs: float16).
_DTYPE_NAMES: dict[str, Any] = {
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "f32": jnp.float32,
    "f64": jnp.float64,
    "float16": jnp.float16,
    "float32": jnp.float32,
    "float64": jnp.float64,
    "fp16": jnp.float16,
    "fp32": jnp.float32,
    "full": jnp.float32,
}
_KEYS = {"params": "params", "p": "params", "compute": "compute", "c": "compute"}
_KEYS |= {"output": "output", "o": "output"}
# Keras-style names for the usual mixed-precision recipe: (params, compute, output).
_NAMED = {
    "mixed_float16": (jnp.float32, jnp.float16, jnp.float32),
    "mixed_bfloat16": (jnp.float32, jnp.bfloat16, jnp.float32),
}
_ALLOWED = (
    "one dtype name for params, compute and output "
    f"({', '.join(sorted([*_DTYPE_NAMES, 'half']))}), "
    f"{' or '.join(sorted(_NAMED))}, or comma-separated key=dtype pairs with "
    "keys params|p, compute|c, output|o (e.g. 'params=float32,compute=float16,"
    "output=float32' or 'p=f32,c=bf16,o=f32'); case-insensitive"
)


def _parse_dtype(name: str, spec: str):
    if name == "half":
        return jmp.half_dtype()
    if name not in _DTYPE_NAMES:
        raise ValueError(
            f"unknown dtype {name!r} in policy {spec!r}; allowed: {_ALLOWED}"
        )
    return _DTYPE_NAMES[name]


def get_policy(policy: str | jmp.Policy) -> jmp.Policy:
    """Parses a mixed-precision policy string into a `jmp.Policy`.

    Grammar (the same in `torchref.precision.get_policy`; case-insensitive,
    spaces ignored):

    - one dtype name for all three parts: ``bf16``, ``bfloat16``, ``f16``,
      ``fp16``, ``float16``, ``half``, ``f32``, ``fp32``, ``float32``,
      ``full``, ``f64``, ``float64`` (``half`` is jmp's: float16 on CPU/GPU,
      bfloat16 on TPU);
    - ``mixed_float16`` / ``mixed_bfloat16``: params and output float32,
      compute float16 / bfloat16;
    - comma-separated ``key=dtype`` pairs with keys ``params|p``,
      ``compute|c``, ``output|o``, each key at most once. Missing keys follow
      jmp: params default to float32, compute follows params, output follows
      compute.

    Args:
      policy: the string, or a `jmp.Policy` (returned unchanged).

    Returns:
      A `jmp.Policy`.

    Raises:
      ValueError: unknown key or dtype name, repeated key, empty string; the
        message lists what is allowed.
      TypeError: `policy` is neither a string nor a `jmp.Policy`.

    Example:
      >>> from jaxstable import precision
      >>> p = precision.get_policy("params=float32,compute=float16,output=float32")
      >>> [d.__name__ for d in (p.param_dtype, p.compute_dtype, p.output_dtype)]
      ['float32', 'float16', 'float32']
      >>> precision.get_policy("p=f32,c=bf16").output_dtype.__name__
      'bfloat16'
      >>> precision.get_policy("Mixed_Float16").compute_dtype.__name__
      'float16'
    """
    if isinstance(policy, jmp.Policy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(
            f"policy must be a string or jmp.Policy, got {type(policy).__name__}"
        )
    spec = policy.strip().lower()
    if not spec:
        raise ValueError(f"empty policy string {policy!r}; allowed: {_ALLOWED}")
    if spec in _NAMED:
        p, c, o = _NAMED[spec]
        return jmp.Policy(param_dtype=p, compute_dtype=c, output_dtype=o)
    if "=" not in spec:
        d = _parse_dtype(spec, policy)
        return jmp.Policy(param_dtype=d, compute_dtype=d, output_dtype=d)
    parts: dict[str, Any] = {}
    for item in spec.split(","):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in _KEYS:
            raise ValueError(
                f"bad part {item.strip()!r} in policy {policy!r}; allowed: {_ALLOWED}"
            )
        if _KEYS[key] in parts:
            raise ValueError(
                f"{_KEYS[key]!r} given twice in policy {policy!r}; allowed: {_ALLOWED}"
            )
        parts[_KEYS[key]] = _parse_dtype(value, policy)
    param = parts.get("params", jnp.float32)
    compute = parts.get("compute", param)
    output = parts.get("output", compute)
    return jmp.Policy(param_dtype=param, compute_dtype=compute, output_dtype=output)


class DtypeLimits(NamedTuple):
    """Numerical limits of a floating dtype.

    Attributes:
      max: largest finite value (65504 for float16).
      tiny: smallest positive normal value (6.1e-5 for float16).
      eps: spacing of 1.0 and the next value (9.8e-4 for float16).
      max_exp_arg: ``log(max)``, the largest x with ``exp(x) <= max``: exp
        overflows float16 above 11.09, float32 and bfloat16 above 88.72.
    """

    max: float
    tiny: float
    eps: float
    max_exp_arg: float


def dtype_limits(dtype: Any) -> DtypeLimits:
    """Returns `DtypeLimits` (max, tiny, eps, max_exp_arg) of a floating dtype.

    Args:
      dtype: a floating dtype or its name (``jnp.float16``, ``"bfloat16"``).

    Returns:
      `DtypeLimits` of Python floats.

    Raises:
      TypeError: `dtype` is not a floating dtype (the same error and text as
        `torchref.precision.dtype_limits`).

    Example:
      >>> from jaxstable import precision
      >>> lim = precision.dtype_limits("float16")
      >>> lim.max, round(lim.max_exp_arg, 2)
      (65504.0, 11.09)
    """
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        name = repr(dtype) if dt is None else dt.name
        raise TypeError(
            "dtype_limits needs a floating dtype (float16, bfloat16, float32, "
            f"float64, float8 variants), got {name}"
        )
    fi = jnp.finfo(dt)
    mx = float(fi.max)
    return DtypeLimits(
        max=mx, tiny=float(fi.tiny), eps=float(fi.eps), max_exp_arg=math.log(mx)
    )


def headroom(tree: Any, dtype: Any) -> Any:
    """Per-leaf ``max|x| / dtype_max``: how close each leaf is to overflowing `dtype`.

    A value above 1 means casting that leaf to `dtype` gives inf; 1e-3 leaves
    about 10 bits of room (a factor 1000). Computed in float32 on device
    (jit-safe); non-finite leaves give inf or nan, empty leaves 0.

    Args:
      tree: a pytree of arrays.
      dtype: the floating dtype to compare against (e.g. ``jnp.float16``).

    Returns:
      A pytree of float32 scalars with the structure of `tree`.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import precision
      >>> h = precision.headroom({"w": jnp.array([-32752.0, 1.0])}, jnp.float16)
      >>> round(float(h["w"]), 3)
      0.5
    """
    mx = (
        np.float32(dtype_limits(dtype).max) if jnp.dtype(dtype) != jnp.float64 else None
    )

    def leaf(x):
        x = jnp.asarray(x, jnp.float32)
        if x.size == 0:
            return jnp.zeros([], jnp.float32)
        m = jnp.max(jnp.abs(x))
        # float32 cannot hold float64's max; relative to it every float32 is tiny.
        return m / mx if mx is not None else m * 0.0

    return jax.tree_util.tree_map(leaf, tree)
