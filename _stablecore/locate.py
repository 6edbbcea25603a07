"""The framework-free parts of `locate`'s engines: the facts kept of a value,
who is blamed for a non-finite one, the call site of a module call read from
the caller's source, and the texts of causes (the same words in
`jaxstable.diagnostics.locate` and `torchref.diagnostics.locate`)."""

from __future__ import annotations

import ast
import linecache
import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

# What an origin is, beyond its op (see `cause`).
MASKED_ROW = "max of a fully masked row"
SOFTMAX_MASKED = "softmax over a fully masked row"
MASKED_NAN = "NaN from a masked -inf"
VARIANCE_ZERO = "variance 0"


class Stats(NamedTuple):
    """Shape, dtype and the finite-value facts of one array (tensor)."""

    shape: tuple[int, ...]
    dtype: str
    nan: int
    inf: int
    max_abs: float  # over finite elements; nan when none
    max: float  # largest finite (real part) value; nan when none
    zeros: int
    negatives: int
    size: int
    neg_inf: int = 0


def format_frame(file_name: str, line: int, function: str) -> str:
    """``file:line in function``."""
    rel = os.path.relpath(file_name)
    name = rel if not rel.startswith("..") else file_name
    return f"{name}:{line} in {function.split('.')[-1]}"


def order(origins) -> list:
    """Who claims an element first: real causes before intentional values,
    then the earliest."""
    return sorted(origins, key=lambda o: (o.intentional, o.index))


def blame(tag: tuple | None) -> Any:
    """The origin a non-finite value is reported with (see `order`)."""
    return order([o for o, _ in tag])[0] if tag else None


def make_tag(claims: dict) -> tuple:
    if len(claims) == 1:
        return ((next(iter(claims)), None),)
    return tuple(claims.items())


def join(base: str, parts) -> str:
    return ".".join(str(p) for p in [base, *parts] if str(p) != "")


# Per call instruction: the callee expression as (base name, ((kind, key), ...)).
SITES: dict[tuple[Any, int], Any] = {}


def call_site(frame, target) -> tuple[Any, list] | None:
    """``(base object, [attribute or key, ...])`` of the call being made in
    ``frame`` when its callee is written as a chain (``self.dec``,
    ``m.head``, ``self.layers[0]``) that resolves to ``target`` or to a
    method of it; None otherwise (a loop variable, a computed index)."""
    if frame is None:
        return None
    key = (frame.f_code, frame.f_lasti)
    chain = SITES.get(key, False)
    if chain is False:
        chain = SITES[key] = parse_callee(frame.f_code, frame.f_lasti)
    if chain is None:
        return None
    name, parts = chain
    sentinel = object()
    obj = frame.f_locals.get(name, frame.f_globals.get(name, sentinel))
    if obj is sentinel:
        return None
    base = obj
    try:
        for kind, key in parts:
            obj = getattr(obj, key) if kind == "attr" else obj[key]
    except Exception:  # a chain that does not resolve here: no site
        return None
    keys = [k for _, k in parts]
    if obj is target:
        return base, keys
    if keys and getattr(obj, "__self__", None) is target:  # model.encode
        return base, keys[:-1]
    return None


def parse_callee(code, lasti: int):
    try:
        positions = list(code.co_positions())
        line, end, col, end_col = positions[lasti // 2]
        lines = linecache.getlines(code.co_filename)
        if None in (line, end, col, end_col) or end > len(lines):
            return None
        text = [s.encode() for s in lines[line - 1 : end]]
        if len(text) == 1:
            seg = text[0][col:end_col]
        else:
            seg = text[0][col:] + b"".join(text[1:-1]) + text[-1][:end_col]
        node = ast.parse(b"(" + seg + b"\n)", mode="eval").body
    except (SyntaxError, ValueError, IndexError, TypeError):
        return None
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    parts: list[tuple[str, Any]] = []
    while True:
        if isinstance(func, ast.Attribute):
            parts.append(("attr", func.attr))
            func = func.value
        elif isinstance(func, ast.Subscript) and isinstance(func.slice, ast.Constant):
            parts.append(("item", func.slice.value))
            func = func.value
        elif isinstance(func, ast.Name):
            return func.id, tuple(reversed(parts))
        else:
            return None


def kind(nan: int, inf: int) -> str:
    if nan and inf:
        return "NaN and Inf"
    return "NaN" if nan else "Inf"


def constant(s: Stats) -> str:
    if s.neg_inf == s.inf and s.inf:
        return "-inf"
    return "inf" if not s.neg_inf and s.inf else "NaN or inf"


def cause(o: Any, where: str, dtype_max: Callable[[str], float | None]) -> str:
    """One line: why ``o.op`` gave a non-finite value; ``dtype_max(name)`` is
    the largest finite value of a dtype (None for a non-float one)."""
    op, ins, out = o.op, o.ins, o.out
    if o.hint == SOFTMAX_MASKED:
        return f"softmax over a fully masked row (every value -inf) {where}"
    if o.hint == MASKED_ROW:
        return f"max over a fully masked row (every value -inf) {where}"
    if o.hint == MASKED_NAN:
        return (
            f"{op} turned a masked -inf into NaN {where} "
            "(inf - inf, 0 * inf or inf / inf)"
        )
    if o.hint == VARIANCE_ZERO:
        return f"{op} of a row with variance 0 and eps 0 (0 / sqrt(0)) {where}"
    if o.intentional and op in ("constant", "model_state"):
        return f"the {constant(out)} held in the {op} (a mask) reaches it"
    if o.intentional:
        return (
            f"the constant {constant(out)} written by {op} {where} (a mask) reaches it"
        )
    lim = dtype_max(out.dtype)
    exp_over = op == "exp" and ins and lim is not None and ins[0].max > math.log(lim)
    if o.would_be is not None and lim is not None and o.would_be > lim:
        text = (
            f"{out.dtype} overflow: max |x| = {o.would_be:.3g} > {lim:.6g} in "
            f"the output of {op} {where}"
        )
        if exp_over:
            text += f" (exp of up to {ins[0].max:.3g} > {math.log(lim):.4g})"
        return text
    if exp_over and lim is not None:  # no finite float64 to compare (exp(1e4))
        return (
            f"{out.dtype} overflow: exp of up to {ins[0].max:.3g} > "
            f"{math.log(lim):.4g} (log of {lim:.6g}) {where}"
        )
    first = ins[0] if ins else None
    if op == "log" and first is not None and first.zeros:
        return f"log of 0 {where}"
    if op in ("log", "sqrt", "rsqrt") and first is not None and first.negatives:
        return f"{op} of a negative number {where}"
    if op == "rsqrt" and first is not None and first.zeros:
        return f"rsqrt of 0 {where}"
    if op == "div" and len(ins) == 2 and ins[1].zeros:
        return f"division by 0 {where}"
    if op == "reciprocal" and first is not None and first.zeros:
        return f"division by 0 (reciprocal of 0) {where}"
    return f"{op} gave {kind(out.nan, out.inf)} from finite inputs {where}"


def value_fields(s: Stats) -> dict[str, Any]:
    return {
        "shape": s.shape,
        "dtype": s.dtype,
        "nan_count": s.nan,
        "inf_count": s.inf,
        "max_abs": s.max_abs,
    }


def origin_fields(o: Any) -> dict[str, Any]:
    if o is None:
        return {"op": None, "source": None}
    return {
        "op": o.op,
        "source": o.source,
        **value_fields(o.out),
        "input_shapes": tuple(s.shape for s in o.ins),
        "input_dtypes": tuple(s.dtype for s in o.ins),
        "input_max_abs": tuple(s.max_abs for s in o.ins),
    }


def where_text(o: Any) -> str:
    if o.module is None:
        return "in the loss"
    return f"in {o.module}" if o.module else "in the outermost module"


ADAM_FP16 = (
    "Adam's second moment underflowed to 0 in float16 and its eps is 0 in "
    "float16 (eps < 6e-08 rounds to 0)"
)


# Re-runs (issue 35): a step's computation is deterministic or it is not; a
# finding that a re-run from the same state, batch and loss scale does not
# give again names no cause.
NOT_REPRODUCED = "did not reproduce on re-run: suspect non-determinism or hardware"


def outcome(loss_finite: bool, loss_path: Any, bad_grad: Any) -> tuple:
    """What one forward/backward run gave, compared between a run and its
    re-run: ``("loss", module)``, ``("gradients", first non-finite leaf)``
    or ``("finite", None)``."""
    if not loss_finite:
        return ("loss", loss_path)
    return ("finite", None) if bad_grad is None else ("gradients", bad_grad)


def checked(loc: Any, scale: float, reruns: int, agreed: int) -> Any:
    """``loc`` with its re-run counts; when a re-run disagreed with the run
    it repeated, its detail says so instead of naming a cause (the phase,
    path, op and value stay those of the first run that went non-finite)."""
    if agreed == reruns:
        return loc._replace(reproduced=True, reruns=reruns, reproduced_count=agreed)
    at = "" if loc.path is None else f" at {loc.path or '(the outermost module)'}"
    op = "" if loc.op is None else f", op {loc.op}"
    detail = (
        f"non-finite in phase {loc.phase!r}{at}{op} at loss scale {scale:.6g}, "
        f"then {NOT_REPRODUCED} ({agreed} of {reruns} re-runs from the same "
        "state and batch at the same loss scale gave the result of the run they "
        "repeated)"
    )
    return loc._replace(
        detail=detail, reproduced=False, reruns=reruns, reproduced_count=agreed
    )


def same_place(a: Any, b: Any) -> bool:
    """Whether a re-run's location ``b`` (None: finite) is ``a``'s."""
    return b is not None and (a.phase, a.path) == (b.phase, b.path)


def benign(loc: Any, scale: float) -> Any:
    """``loc`` (a gradient non-finite at ``scale``, finite at scale 1) as the
    overflow the dynamic loss scale handles."""
    return loc._replace(
        phase="loss_scale",
        detail=f"gradient overflow at loss scale {scale:.6g}, finite at "
        "scale 1 (benign: the scale backs off)",
    )
