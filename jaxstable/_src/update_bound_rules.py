"""The interval rules of `update_bound`: what each jaxpr primitive can compute.

A `Val` bounds every element of a value as ``a * p + b`` (``p`` the matching
element of one parameter leaf, ``a`` and ``b`` intervals); each primitive's
rule maps the bounds of its inputs to a bound of its result, and raises
`Unprovable` where it cannot (a division by an interval holding 0, a square
root of one below 0, a bound past `_SAFE`, a primitive with no rule). The
twin of torch's per-optimizer rules (`torchref._src.update_bound_rules`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = [
    "CALL_PRIMITIVES",
    "Unprovable",
    "Val",
    "const_val",
    "primitive_rule",
    "refine",
    "union",
]

# Higher-order primitives that call one body, which a reader of the jaxpr
# inlines (control flow is not among them: `lax.cond` or a loop in an
# update makes it unprovable; `locate` evaluates those separately).
CALL_PRIMITIVES = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "remat",
        "checkpoint",
    }
)
# Every bound a proof accepts stays below this (float32's max is ~2**128): a
# parameter ``p`` written as ``c * p + d`` with ``|c| <= 1`` and ``|d| <=
# 2**100`` stays finite (see `UpdateBound`).
_SAFE = 2.0**100
# Float results are widened outward by this relative margin per operation:
# float32 rounds each result by at most 2**-24 of it.
_ROUND = 2.0**-20


class Unprovable(Exception):
    """Raised inside the evaluation where nothing can be proved."""


@dataclasses.dataclass(frozen=True)
class Val:
    """Every element of a value is in ``a * p + b`` for some ``a`` in the
    interval ``a``, ``b`` in ``b``, where ``p`` is the matching element of
    parameter leaf ``sym`` (``a = (0, 0)`` and ``sym`` None: no parameter).
    Integer and boolean values are intervals ``b`` of python ints."""

    b: tuple[float, float]
    a: tuple[float, float] = (0.0, 0.0)
    sym: int | None = None
    kind: str = "f"  # "f" float, "i" integer, "b" bool

    @property
    def free(self) -> bool:
        return self.sym is None or self.a == (0.0, 0.0)


def _hull(x: tuple, y: tuple) -> tuple:
    return (min(x[0], y[0]), max(x[1], y[1]))


def _mul_iv(x: tuple, y: tuple) -> tuple:
    c = [x[0] * y[0], x[0] * y[1], x[1] * y[0], x[1] * y[1]]
    c = [0.0 if math.isnan(v) else v for v in c]  # 0 * inf: a bound of 0
    return (min(c), max(c))


def _round(v: Val) -> Val:
    """Widen a float result for its rounding; refuse what may overflow."""
    if v.kind != "f":
        return v
    lo, hi = v.b
    b = (lo - abs(lo) * _ROUND, hi + abs(hi) * _ROUND)
    if not (-_SAFE <= b[0] and b[1] <= _SAFE) or max(map(abs, v.a)) > 1.0:
        raise Unprovable(f"a bound {b} / coefficient {v.a} past the safe range")
    return dataclasses.replace(v, b=b)


def _free(v: Val) -> tuple:
    if not v.free:
        raise Unprovable("a parameter inside an operation that is not affine")
    return v.b


def _sym(*vals: Val) -> int | None:
    syms = {v.sym for v in vals if not v.free}
    if len(syms) > 1:
        raise Unprovable("two parameters in one value")
    return syms.pop() if syms else None


def _int_result(kind: str, b: tuple, dtype: Any) -> Val:
    """An integer result past its dtype's range wraps: any value then."""
    if kind == "i":
        info = np.iinfo(dtype)
        if b[0] < info.min or b[1] > info.max:
            b = (int(info.min), int(info.max))
    return Val(b=b, kind=kind)


def _add(x: Val, y: Val, dtype) -> Val:
    b = (x.b[0] + y.b[0], x.b[1] + y.b[1])
    if x.kind != "f":
        return _int_result(x.kind, b, dtype)
    a = (x.a[0] + y.a[0], x.a[1] + y.a[1])
    return Val(b=b, a=a, sym=_sym(x, y))


def _neg(x: Val, dtype=None) -> Val:
    b = (-x.b[1], -x.b[0])
    if x.kind != "f":
        return _int_result(x.kind, b, dtype)
    return Val(b=b, a=(-x.a[1], -x.a[0]), sym=x.sym)


def _scale(x: Val, c: tuple) -> Val:
    """``x * c`` for a parameter-free interval ``c``."""
    return Val(b=_mul_iv(x.b, c), a=_mul_iv(x.a, c), sym=x.sym, kind=x.kind)


def _mul(x: Val, y: Val, dtype) -> Val:
    if x.kind != "f":
        return _int_result(x.kind, _mul_iv(x.b, y.b), dtype)
    if y.free:
        return _scale(x, y.b)
    return _scale(y, _free(x))


def _reciprocal(y: tuple) -> tuple:
    if y[0] <= 0.0 <= y[1]:
        raise Unprovable("a division by an interval that holds 0")
    return (1.0 / y[1], 1.0 / y[0])


def _div(x: Val, y: Val, dtype) -> Val:
    if x.kind != "f":
        raise Unprovable("integer division")
    return _scale(x, _reciprocal(_free(y)))


def _monotone(fn, lo_ok: float = -math.inf):
    """An increasing function of one parameter-free value, defined > lo_ok
    (>= when lo_ok is -inf)."""

    def rule(x: Val, dtype=None) -> Val:
        lo, hi = _free(x)
        if lo < lo_ok or (lo_ok > -math.inf and lo == lo_ok and fn is not math.sqrt):
            raise Unprovable(f"{fn.__name__} outside its domain: {(lo, hi)}")
        try:
            return Val(b=(fn(lo), fn(hi)))
        except (OverflowError, ValueError) as err:
            raise Unprovable(str(err)) from err

    return rule


def _abs(x: Val, dtype=None) -> Val:
    lo, hi = _free(x)
    top = max(abs(lo), abs(hi))
    return Val(b=(0.0 if lo <= 0.0 <= hi else min(abs(lo), abs(hi)), top), kind=x.kind)


def _integer_pow(x: Val, dtype=None, *, y: int) -> Val:
    if y == 1:
        return x
    lo, hi = _free(x)
    if y < 0:
        return _integer_pow(Val(b=_reciprocal((lo, hi))), y=-y)
    if y % 2 == 0:
        low = 0.0 if lo <= 0.0 <= hi else min(abs(lo), abs(hi)) ** y
        return Val(b=(low, max(abs(lo), abs(hi)) ** y))
    return Val(b=(lo**y, hi**y))


def _pow(x: Val, y: Val, dtype=None) -> Val:
    (xl, xh), (yl, yh) = _free(x), _free(y)
    if yl == yh and float(yl).is_integer() and abs(yl) <= 64:
        return _integer_pow(x, y=int(yl))  # x ** 1.0: any sign of x
    if xl < 0.0 or (xl == 0.0 and yl <= 0.0):
        raise Unprovable("pow of a base that may be negative or 0")
    try:  # x**y is monotone in x and in y for x > 0: the corners bound it
        c = [b**e for b in (xl, xh) for e in (yl, yh)]
    except OverflowError as err:
        raise Unprovable(str(err)) from err
    return Val(b=(min(c), max(c)))


def _minmax(pick):
    def rule(x: Val, y: Val, dtype=None) -> Val:
        (xl, xh), (yl, yh) = _free(x), _free(y)
        return Val(b=(pick(xl, yl), pick(xh, yh)), kind=x.kind)

    return rule


def _bounded(lo: float, hi: float):
    def rule(x: Val, dtype=None) -> Val:
        _free(x)
        return Val(b=(lo, hi))

    return rule


def _same(x: Val, *_, **__) -> Val:
    return x


def _convert(x: Val, dtype=None, *, new_dtype: Any) -> Val:
    if jnp.issubdtype(new_dtype, jnp.floating):
        b = (float(x.b[0]), float(x.b[1])) if x.kind != "f" else x.b
        return Val(b=b, a=x.a, sym=x.sym)
    lo, hi = _free(x)
    if new_dtype == jnp.bool_:
        return Val(
            b=(0 if lo == hi == 0 else 1 if lo > 0 or hi < 0 else 0, 1), kind="b"
        )
    if x.kind == "f":
        if any(math.isinf(v) for v in (lo, hi)):
            raise Unprovable("an infinite float converted to an integer")
        lo, hi = math.floor(lo), math.ceil(hi)
    return _int_result("i", (int(lo), int(hi)), new_dtype)


_COMPARE = {
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "eq": operator.eq,
    "ne": operator.ne,
}


def _compare(op: str):
    def rule(x: Val, y: Val, dtype=None) -> Val:
        (xl, xh), (yl, yh) = _free(x), _free(y)
        fn = _COMPARE[op]
        corners = {fn(a, b) for a in (xl, xh) for b in (yl, yh)}
        # lt/le/gt/ge are decided by the corners when they agree; eq and
        # ne only for two equal single points (or disjoint intervals).
        if op in ("eq", "ne") and not (xh < yl or yh < xl or xl == xh == yl == yh):
            corners = {False, True}
        return Val(b=(int(min(corners)), int(max(corners))), kind="b")

    return rule


def _reduce_sum(x: Val, dtype=None, *, size: int) -> Val:
    lo, hi = _free(x)
    if x.kind != "f":  # an integer sum past its dtype wraps
        return _int_result("i", (lo * size, hi * size), dtype)
    return Val(b=(lo * size, hi * size))


def _dot(x: Val, y: Val, dtype=None, *, size: int) -> Val:
    lo, hi = _mul_iv(_free(x), _free(y))
    return Val(b=(lo * size, hi * size))


def _clamp(lo: Val, x: Val, hi: Val, dtype=None) -> Val:
    m = _minmax(max)(lo, x)
    return _minmax(min)(m, hi)


def _logic(x: Val, y: Val, dtype=None) -> Val:
    """Boolean and/or: 0 or 1. Bitwise on integers: any value of the dtype
    (``4 | 3`` is 7, past both)."""
    if x.kind == "b":
        return Val(b=(0, 1), kind="b")
    info = np.iinfo(dtype)
    return Val(b=(int(info.min), int(info.max)), kind="i")


# Each primitive's interval rule: rule(*input Vals, dtype, **static params).
_UNARY = {
    "neg": _neg,
    "abs": _abs,
    "sqrt": _monotone(math.sqrt, 0.0),
    "rsqrt": lambda x, dtype=None: _div(
        Val(b=(1.0, 1.0)), _monotone(math.sqrt, 0.0)(x), dtype
    ),
    "exp": _monotone(math.exp),
    "exp2": _monotone(lambda v: 2.0**v),
    "log": _monotone(math.log, 0.0),
    "log1p": _monotone(math.log1p, -1.0),
    "expm1": _monotone(math.expm1),
    "tanh": _monotone(math.tanh),
    "logistic": _bounded(0.0, 1.0),
    "sin": _bounded(-1.0, 1.0),
    "cos": _bounded(-1.0, 1.0),
    "sign": _bounded(-1.0, 1.0),
    "floor": _monotone(math.floor),
    "ceil": _monotone(math.ceil),
    "round": _monotone(lambda v: float(round(v))),
    "square": lambda x, dtype=None: _integer_pow(x, y=2),
    "not": lambda x, dtype=None: (
        Val(b=(1 - x.b[1], 1 - x.b[0]), kind="b")
        if x.kind == "b"
        else Val(b=(-(2**63), 2**63 - 1), kind="i")
    ),
}
_BINARY = {
    "add": _add,
    "sub": lambda x, y, dtype: _add(x, _neg(y, dtype), dtype),
    "mul": _mul,
    "div": _div,
    "pow": _pow,
    "max": _minmax(max),
    "min": _minmax(min),
    "and": _logic,
    "or": _logic,
    **{op: _compare(op) for op in _COMPARE},
}
# Shape-only primitives: every element of the result is one of the input's.
_SHAPE = {
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "transpose",
    "slice",
    "rev",
    "copy",
    "copy_p",
    "reduce_precision",
    "optimization_barrier",
}
# ...and those that keep each element where it is (a parameter's value
# stays beside its own element only through these).
_IN_PLACE = {"copy", "copy_p", "reduce_precision", "optimization_barrier"}


def const_val(x: Any) -> Val:
    """The bound of a constant array: its smallest and largest element.

    Example:
      >>> const_val([1, 5]).b, const_val(2.5).b
      ((1, 5), (2.5, 2.5))
    """
    x = np.asarray(x)
    if x.size == 0:
        x = np.zeros(1, x.dtype)
    if x.dtype == np.bool_ or np.issubdtype(x.dtype, np.integer):
        return Val(
            b=(int(x.min()), int(x.max())), kind="b" if x.dtype == np.bool_ else "i"
        )
    if not np.issubdtype(x.dtype, np.floating) or not np.isfinite(x).all():
        raise Unprovable(f"a constant of dtype {x.dtype} that is not a finite float")
    return Val(b=(float(x.min()), float(x.max())))


def refine(cond: tuple, holds: bool) -> Val | None:
    """``x``'s interval where ``x op k`` is ``holds``; None where empty."""
    _, op, k, x = cond
    if not holds:
        op = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": None}[op]
        if op is None:
            return x
    step = 1 if x.kind != "f" else 0
    lo, hi = x.b
    if op in ("lt", "le"):
        hi = min(hi, k - step if op == "lt" else k)
    elif op in ("gt", "ge"):
        lo = max(lo, k + step if op == "gt" else k)
    else:
        lo, hi = max(lo, k), min(hi, k)
    if lo > hi:
        return None
    return dataclasses.replace(x, b=(lo, hi))


def union(x: Val, y: Val) -> Val:
    return Val(b=_hull(x.b, y.b), a=_hull(x.a, y.a), sym=_sym(x, y), kind=x.kind)


def primitive_rule(eqn: Any, ins: list[Val], dtype: Any) -> Val:
    """One primitive's result bound (see the tables above), widened for
    rounding and refused past the safe range.

    Example:
      >>> import types
      >>> eqn = types.SimpleNamespace(prim="sqrt", ins=[1], params={})
      >>> primitive_rule(eqn, [Val(b=(0.0, 4.0))], "float32").b[1] > 2.0
      True
    """
    return _round(_raw_rule(eqn, ins, dtype))


def _raw_rule(eqn: Any, ins: list[Val], dtype: Any) -> Val:
    prim, params = eqn.prim, eqn.params
    if prim in _SHAPE:
        # A parameter's value stays beside its own element only where the
        # elements do not move (an identity reshape or broadcast too).
        moved = prim not in _IN_PLACE and eqn.in_shapes[0] != eqn.out_shapes[0]
        if not ins[0].free and (moved or prim in ("transpose", "rev", "slice")):
            raise Unprovable(f"a parameter moved by {prim}")
        return ins[0]
    if prim in _UNARY:
        return _UNARY[prim](ins[0], dtype)
    if prim == "mul" and eqn.ins[0] == eqn.ins[1]:
        return _integer_pow(ins[0], y=2)  # x * x: never below 0
    if prim in _BINARY:
        return _BINARY[prim](ins[0], ins[1], dtype)
    if prim == "convert_element_type":
        return _convert(ins[0], new_dtype=params["new_dtype"])
    if prim == "integer_pow":
        return _integer_pow(ins[0], y=params["y"])
    if prim == "is_finite":  # every float value here has finite bounds
        return Val(b=(1, 1), kind="b")
    if prim == "clamp":
        return _clamp(*ins)
    return _gathering_rule(eqn, ins, dtype)


def _gathering_rule(eqn: Any, ins: list[Val], dtype: Any) -> Val:
    """Reductions, products and the primitives that pick elements."""
    prim, params, shape = eqn.prim, eqn.params, eqn.in_shapes[0]
    if prim in ("reduce_max", "reduce_min", "dynamic_slice", "gather"):
        return Val(b=_free(ins[0]), kind=ins[0].kind)
    if prim == "reduce_sum":
        size = math.prod(shape[a] for a in params["axes"])
        return _reduce_sum(ins[0], dtype, size=size)
    if prim == "dot_general":
        (contract, _), _ = params["dimension_numbers"]
        return _dot(ins[0], ins[1], size=math.prod(shape[a] for a in contract[0]))
    if prim in ("concatenate", "pad", "dynamic_update_slice"):
        out = ins[0]
        for v in ins[1:2] if prim != "concatenate" else ins[1:]:
            out = union(Val(b=_free(out), kind=out.kind), Val(b=_free(v), kind=v.kind))
        return out
    if prim == "iota":
        n = params["shape"][params["dimension"]]
        kind = "f" if jnp.issubdtype(dtype, jnp.floating) else "i"
        return Val(b=(0, max(n - 1, 0)), kind=kind)
    raise Unprovable(f"no interval rule for {prim}")
