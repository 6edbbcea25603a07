"""The engine of `jaxstable.diagnostics.locate` (private).

The loss of a train step is traced to a jaxpr (every Flax module method call
wrapped in a ``jax.named_scope`` naming the attribute path it was called
through) and evaluated equation by equation, eagerly, outside `jax.jit`.
Every value that is not finite carries a *tag*: which origin explains each
of its non-finite elements. An origin is the equation that made elements
non-finite while the elements they were computed from were finite. Origins
are tracked per element, not per array, so an element that was ``-inf`` on
purpose (an attention mask) does not hide a new overflow at another element
of the same array: the loss, and each gradient leaf, knows which operation
its NaN or Inf started from, in which module, at which line of user code.

Elementwise primitives map element i to element i (masks are broadcast).
Any other primitive (a matmul, a reduction, a reshape) is *ablated* when an
intentional value or several origins reach it: re-run with the non-finite
input elements of an origin replaced by 1; the output elements that turn
finite were explained by that origin, those still non-finite are the
primitive's own. With a single, unintended origin at its inputs, all its
non-finite outputs keep that origin without a re-run (the first cause wins
anyway), which keeps a NaN cascade cheap.

*Intentional* values are the non-finite constants a program writes on
purpose (``jnp.where(mask, s, -jnp.inf)``, a ``-inf`` constant, a model
state holding ``-inf`` only): tracked like any other value, never blamed
over a real overflow, and the NaN they make (``-inf - -inf`` in a softmax
over a fully masked row) is named for what it is.

Only the values still needed are kept: each variable is dropped after its
last use, and the outputs of the update are checked as they appear and
dropped (but the first non-finite parameter and its origin); an origin reads
its facts (stats, float64 recomputation) when reported, and at most `_LAZY`
unread origins hold their op's inputs. So locate holds about what the
compiled step holds (`benchmarks/bench_locate.py`). The traced jaxprs are
kept per step, as `jax.jit` keeps its traces. The jitted step is never
touched: nothing here runs on the hot path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import types
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore
from jax._src import custom_derivatives, source_info_util

from _stablecore.locate import ADAM_FP16 as ADAM_FP16
from _stablecore.locate import MASKED_NAN as MASKED_NAN
from _stablecore.locate import MASKED_ROW as MASKED_ROW
from _stablecore.locate import SOFTMAX_MASKED as SOFTMAX_MASKED
from _stablecore.locate import Stats as Stats
from _stablecore.locate import benign as _benign
from _stablecore.locate import blame as blame
from _stablecore.locate import call_site as call_site
from _stablecore.locate import cause as _cause
from _stablecore.locate import checked as _checked
from _stablecore.locate import format_frame as format_frame
from _stablecore.locate import join as join
from _stablecore.locate import kind as kind
from _stablecore.locate import make_tag as _make_tag
from _stablecore.locate import order as _order
from _stablecore.locate import origin_fields as _origin_fields
from _stablecore.locate import outcome as _core_outcome
from _stablecore.locate import same_place as _same_place
from _stablecore.locate import value_fields as _value_fields
from _stablecore.locate import where_text as _where

_MARK = "@jaxstable.module:"  # prefix of the named scope of a module call
# Higher-order primitives whose body is evaluated op by op (recursively).
_CALLS = {
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "remat",
    "checkpoint",
}
# Control flow: evaluated at once while its values are finite, op by op in
# its body otherwise (so the op inside the body is named).
_BODIES = {"cond", "while", "scan"}
# Primitives mapping element i of each input (same shape, or a scalar) to
# element i of the output.
_ELEMENTWISE = {
    *("add", "add_any", "sub", "mul", "div", "rem", "pow", "integer_pow"),
    *("max", "min", "neg", "sign", "abs", "exp", "exp2", "log", "log1p"),
    *("expm1", "sqrt", "rsqrt", "cbrt", "tanh", "logistic", "sin", "cos"),
    *("tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh"),
    *("acosh", "atanh", "erf", "erfc", "erf_inv", "lgamma", "digamma"),
    *("square", "select_n", "convert_element_type", "clamp", "nextafter"),
    *("floor", "ceil", "round", "is_finite", "copy", "copy_p", "real", "imag"),
    *("conj", "complex", "reduce_precision", "stop_gradient", "reciprocal"),
}
# Primitive names as people say them, the same words as torchref's.
CANONICAL_OPS = {
    "dot_general": "matmul",
    "conv_general_dilated": "conv",
    "integer_pow": "pow",
    "reduce_sum": "sum",
    "reduce_max": "max",
    "reduce_min": "min",
    "convert_element_type": "cast",
    "logistic": "sigmoid",
}
# Frames of these libraries are not the user's code.
_LIB_MARKERS = (
    "site-packages",
    "dist-packages",
    os.sep + os.path.join("jaxstable", "_src") + os.sep,
)
# Peak bytes held by the interpreter in the last `locate` call: values it
# computed still alive, their masks, and the outputs it kept (grads); one
# entry per op-by-op run in "peaks" (read by the memory tests and the
# benchmark).
stats: dict[str, Any] = {"peak_live_bytes": 0, "peaks": []}
# Origins whose facts may wait to be read, each holding its op's inputs.
_LAZY = 8


def _on_cpu(x: Any) -> bool:
    try:
        return all(d.platform == "cpu" for d in x.devices())
    except AttributeError:  # numpy, a Python scalar
        return True


def _xp(x: Any):
    """numpy for values on the CPU (a view, no copy: 30x faster than a jnp
    reduction per check), jax.numpy elsewhere (no transfer)."""
    return np if _on_cpu(x) else jnp


def _arr(x: Any) -> Any:
    return np.asarray(x) if _on_cpu(x) else x


def array_stats(x: Any) -> Stats:
    """Computed in ``x``'s own dtype, where it lives (no float64 copy)."""
    xp, a = _xp(x), _arr(x)
    shape, dtype = tuple(a.shape), np.dtype(a.dtype).name
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        a = a.astype(np.float32)
    real = a.real if jnp.iscomplexobj(a) else a
    nan, inf = xp.isnan(a), xp.isinf(a)
    fin = ~(nan | inf)
    n_fin = int(fin.sum())
    absmax = xp.max(xp.where(fin, xp.abs(a), 0)) if n_fin else math.nan
    top = xp.max(xp.where(fin, real, -xp.inf)) if n_fin else math.nan
    return Stats(
        shape=shape,
        dtype=dtype,
        nan=int(nan.sum()),
        inf=int(inf.sum()),
        max_abs=float(absmax),
        max=float(top),
        zeros=int(((a == 0) & fin).sum()),
        negatives=int(((real < 0) & fin).sum()),
        size=int(a.size),
        neg_inf=int((inf & (real < 0)).sum()),
    )


@dataclasses.dataclass(eq=False)
class Origin:
    """Where non-finite elements started.

    ``facts()`` gives ``(out, ins, would_be)``: the stats of the op's output
    and inputs and max |x| of its elements recomputed in float64. They are
    computed when first read (arrays are immutable), so an origin no
    reported value keeps (one per bad leaf of an update) costs nothing; as
    an unread origin holds its op's inputs, at most `_LAZY` of them wait at
    a time, the others are computed at once."""

    index: int
    op: str
    module: str | None  # dotted module path, "" for the root, None outside
    source: str | None
    facts: Any  # () -> (Stats, list[Stats], float | None), or that tuple
    intentional: bool = False  # a non-finite constant written on purpose
    hint: str | None = None  # MASKED_ROW, SOFTMAX_MASKED or MASKED_NAN

    def _get(self, i: int) -> Any:
        if callable(self.facts):
            self.facts = self.facts()
        return self.facts[i]

    out = property(lambda self: self._get(0))
    ins = property(lambda self: self._get(1))
    would_be = property(lambda self: self._get(2))


def _is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _numeric(x: Any) -> bool:
    # PRNG key arrays (extended dtypes) have no values to report.
    dtype = getattr(x, "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _bad_mask(x: Any) -> Any:
    """Mask of the non-finite elements, or None when all are finite."""
    if not _is_float(x):
        return None
    xp = _xp(x)
    m = ~xp.isfinite(_arr(x))
    return m if bool(m.any()) else None


def _finite(x: Any) -> bool:
    if not _is_float(x):
        return True
    return bool(_xp(x).isfinite(_arr(x)).all())


def _source(source_info: Any) -> str | None:
    for fr in source_info_util.user_frames(source_info.traceback):
        if not any(m in fr.file_name for m in _LIB_MARKERS):
            return format_frame(fr.file_name, fr.start_line, fr.function_name)
    return None


def _module_of(source_info: Any, outer: str | None) -> str | None:
    module = outer
    for entry in source_info.name_stack.stack:
        name = getattr(entry, "name", "")
        if type(entry).__name__ == "Scope" and name.startswith(_MARK):
            module = name[len(_MARK) :]
    return module


def _params64(params: dict) -> dict:
    def wide(v):
        try:
            if isinstance(v, np.dtype | type) and jnp.issubdtype(v, jnp.floating):
                return jnp.float64
        except TypeError:
            pass
        return v

    return {k: wide(v) for k, v in params.items()}


def _would_be(eqn: Any, invals: list, k: int, sel: Any) -> float | None:
    """max |output k| over the elements ``sel`` recomputed with every
    floating input in float64: tells an overflow (finite in float64, above
    the dtype's max) from a division by zero or a log of 0 (non-finite in
    float64 too), for float16, bfloat16 and float32 alike."""
    if eqn.primitive.name == "convert_element_type":
        ref = np.asarray(invals[0])
    else:
        dtype = eqn.outvars[k].aval.dtype
        if not jnp.issubdtype(dtype, jnp.floating) or dtype == jnp.float64:
            return None
        try:
            with jax.enable_x64(True):
                ups = [
                    jnp.asarray(v, jnp.float64)
                    if _is_float(v) and not jnp.iscomplexobj(v)
                    else v
                    for v in invals
                ]
                out = eqn.primitive.bind(*ups, **_params64(eqn.params))
                ref = np.asarray(out[k] if eqn.primitive.multiple_results else out)
        except Exception:  # a primitive that refuses float64: no estimate
            return None
    if ref.dtype.kind not in "fc":
        ref = ref.astype(np.float64)
    a = np.abs(ref.astype(np.complex128 if ref.dtype.kind == "c" else np.float64))
    if sel is not None and a.shape:
        a = a[np.broadcast_to(np.asarray(sel), a.shape)]
    if not a.size or not np.all(np.isfinite(a)):
        return None
    return float(a.max())


def _sub_jaxpr(eqn: Any) -> jcore.ClosedJaxpr | None:
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, jcore.ClosedJaxpr):
            closed = sub
        elif isinstance(sub, jcore.Jaxpr):
            closed = jcore.ClosedJaxpr(sub, ())
        else:
            continue
        if len(closed.jaxpr.invars) == len(eqn.invars):
            return closed
    return None


# ------------------------------------------------------------------ tags
# A tag is ((origin, mask), ...): disjoint masks whose union is the value's
# non-finite elements. A single origin has the mask None ("all of them").


def _masks(tag: tuple, val: Any) -> list[tuple[Origin, Any]]:
    if len(tag) == 1 and tag[0][1] is None:
        return [(tag[0][0], _bad_mask(val))]
    return list(tag)


def _tag_bytes(tag: tuple | None) -> int:
    return sum(_nbytes(m) for _, m in tag) if tag else 0


def _nbytes(x: Any) -> int:
    return int(getattr(x, "nbytes", 0) or 0)


def _union(masks, like) -> Any:
    out = like & False
    for m in masks:
        out = out | m
    return out


def _fit(m: Any, shape: tuple) -> Any:
    if tuple(m.shape) == tuple(shape):
        return m
    return (np if isinstance(m, np.ndarray) else jnp).broadcast_to(m, shape)


def _fill(invals: list, intags: list, only: Origin | None) -> list:
    """The inputs with the non-finite elements of origin ``only`` (None: of
    every origin) replaced by 1."""
    out = []
    for v, t in zip(invals, intags, strict=True):
        sel = None
        for o, m in _masks(t, v) if t else ():
            if only is None or o is only:
                sel = m if sel is None else sel | m
        out.append(v if sel is None else jnp.where(sel, jnp.ones((), v.dtype), v))
    return out


def _slice_tag(t: tuple | None, x: Any, i: int) -> tuple | None:
    if not t:
        return None
    if len(t) == 1:
        return t if not _finite(x[i]) else None
    parts = {o: m[i] for o, m in t if bool(m[i].any())}
    return _make_tag(parts) if parts else None


def _stack_tags(tags: list, values: list) -> tuple | None:
    if not any(tags):
        return None
    origins = list(dict.fromkeys(o for t in tags if t for o, _ in t))
    if len(origins) == 1:
        return ((origins[0], None),)
    stacked = {}
    for o in origins:
        rows = []
        for t, v in zip(tags, values, strict=True):
            mine = [m for oo, m in _masks(t, v) if oo is o] if t else []
            rows.append(np.asarray(mine[0]) if mine else np.zeros(np.shape(v), bool))
        stacked[o] = np.stack(rows)
    return tuple(stacked.items())


class _Interpreter:
    def __init__(self, unguard: bool = False) -> None:
        self.count = 0
        self.live = 0  # bytes of the values and masks computed here, alive
        self.held = 0  # bytes of the outputs a sink kept
        self.peak = 0
        self.waiting: list = []  # weak references to origins not yet read
        # Update phase: a guard's select (a uniform predicate keeping a
        # finite value over a non-finite new one, as `skip_non_finite` and
        # `optax.apply_if_finite` do) takes the new value, to see what the
        # step would have written without the guard.
        self.unguard = unguard

    def run(self, closed, args: list, tags: list, module=None, sink=None):
        """Evaluates ``closed``; returns ``(outputs, tags)``, or hands each
        output to ``sink(i, value, tag)`` as it is computed (not kept)."""
        jaxpr = closed.jaxpr
        env: dict[Any, Any] = {}
        tag_of: dict[Any, Any] = {}
        last: dict[Any, int] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if not isinstance(v, jcore.Literal):
                    last[v] = i
        out_at: dict[Any, list[int]] = {}
        for j, v in enumerate(jaxpr.outvars):
            if isinstance(v, jcore.Literal):
                if sink is not None:
                    sink(j, v.val, None)
            else:
                out_at.setdefault(v, []).append(j)
        keep = set() if sink is not None else set(out_at)
        sizes: dict[Any, int] = {}  # what this run computed (not its inputs)

        def write(v, val, t, computed=True):
            if isinstance(v, jcore.DropVar):
                return
            env[v], tag_of[v] = val, t
            if computed:
                sizes[v] = _nbytes(val) + _tag_bytes(t)
                self.live += sizes[v]
            if sink is not None:
                for j in out_at.get(v, ()):
                    if sink(j, val, t):
                        self.held += _nbytes(val)

        def drop(v):
            if v in env and v not in keep:
                del env[v], tag_of[v]
                self.live -= sizes.pop(v, 0)

        def read(v):
            if isinstance(v, jcore.Literal):
                return v.val, None
            return env[v], tag_of[v]

        for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
            write(v, c, self.constant_tag(c, "constant"), computed=False)
        for v, a, t in zip(jaxpr.invars, args, tags, strict=True):
            write(v, a, t, computed=False)
        for v in [*jaxpr.constvars, *jaxpr.invars]:
            if v not in last:
                drop(v)
        for i, eqn in enumerate(jaxpr.eqns):
            pairs = [read(v) for v in eqn.invars]
            invals = [p[0] for p in pairs]
            intags = [p[1] for p in pairs]
            outs, outtags = self._eval(eqn, invals, intags, module)
            for v, val, t in zip(eqn.outvars, outs, outtags, strict=True):
                write(v, val, t)
            self.peak = max(self.peak, self.live + self.held)
            del pairs, invals, intags, outs, outtags
            for v in eqn.invars:
                if not isinstance(v, jcore.Literal) and last.get(v) == i:
                    drop(v)
            for v in eqn.outvars:
                if v not in last:
                    drop(v)
        results = [] if sink is not None else [read(v) for v in jaxpr.outvars]
        for v in list(env):
            keep.discard(v)
            drop(v)
        return [r[0] for r in results], [r[1] for r in results]

    def constant_tag(self, c: Any, what: str) -> tuple | None:
        """The tag of a non-finite constant (intentional: a mask)."""
        if _finite(c):
            return None
        self.count += 1
        o = Origin(self.count, what, None, None, (array_stats(c), [], None), True)
        return ((o, None),)

    def _eval(self, eqn, invals, intags, module) -> tuple[list, list]:
        name = eqn.primitive.name
        sub = _sub_jaxpr(eqn)
        if sub is not None:
            return self.run(sub, invals, intags, _module_of(eqn.source_info, module))
        if name in _BODIES:
            if not any(intags):
                outs = _bind(eqn, invals)
                if all(_finite(o) for o in outs):
                    return outs, [None] * len(outs)
            here = _module_of(eqn.source_info, module)
            return getattr(self, "_" + name)(eqn, invals, intags, here)
        if self.unguard and name == "select_n":
            guarded = _unguarded(invals, intags)
            if guarded is not None:
                return guarded
        outs = _bind(eqn, invals)
        return outs, self._tags(eqn, invals, intags, outs, module)

    # -------------------------------------------------------- control flow
    def _cond(self, eqn, invals, intags, module):
        branch = eqn.params["branches"][int(np.asarray(invals[0]))]
        return self.run(branch, invals[1:], intags[1:], module)

    def _while(self, eqn, invals, intags, module):
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cvals, ctags = invals[:nc], intags[:nc]
        bvals, btags = invals[nc : nc + nb], intags[nc : nc + nb]
        carry, ktags = invals[nc + nb :], intags[nc + nb :]
        while True:
            (pred,), _ = self.run(p["cond_jaxpr"], cvals + carry, ctags + ktags, module)
            if not bool(np.asarray(pred)):
                return carry, ktags
            carry, ktags = self.run(
                p["body_jaxpr"], bvals + carry, btags + ktags, module
            )

    def _scan(self, eqn, invals, intags, module):
        p = eqn.params
        nc, nk = p["num_consts"], p["num_carry"]
        cvals, ctags = invals[:nc], intags[:nc]
        carry, ktags = invals[nc : nc + nk], intags[nc : nc + nk]
        xs, xtags = invals[nc + nk :], intags[nc + nk :]
        order = range(p["length"])
        ys_at, yt_at = {}, {}
        for i in reversed(order) if p["reverse"] else order:
            x_i = [x[i] for x in xs]
            xt_i = [_slice_tag(t, x, i) for t, x in zip(xtags, xs, strict=True)]
            outs, otags = self.run(
                p["jaxpr"], cvals + carry + x_i, ctags + ktags + xt_i, module
            )
            carry, ktags = outs[:nk], otags[:nk]
            ys_at[i], yt_at[i] = outs[nk:], otags[nk:]
        ys, ytags = [], []
        for j, var in enumerate(eqn.outvars[nk:]):
            parts = [ys_at[i][j] for i in order]
            ys.append(
                jnp.stack(parts) if parts else jnp.zeros(var.aval.shape, var.aval.dtype)
            )
            ytags.append(_stack_tags([yt_at[i][j] for i in order], parts))
        return [*carry, *ys], [*ktags, *ytags]

    # ---------------------------------------------------------------- tags
    def _tags(self, eqn, invals, intags, outs, module) -> list:
        bad = [not _finite(o) for o in outs]
        if not any(bad):
            return [None] * len(outs)
        if not any(intags):
            # Finite inputs: a new origin, intentional when a non-finite
            # literal (``-inf`` written as a mask value) was an input.
            k = bad.index(True)
            lit = _literal_bad(eqn, invals)
            o = self.new(eqn, invals, outs, k, _bad_mask(outs[k]), module, lit)
            return [((o, None),) if b else None for b in bad]
        origins = _order(dict.fromkeys(o for t in intags if t for o, _ in t))
        if len(origins) == 1 and not origins[0].intentional:
            # One real cause keeps every non-finite output: the first cause
            # wins anyway, and a NaN cascade stays cheap.
            return [((origins[0], None),) if b else None for b in bad]
        bad = [_bad_mask(o) if b else None for o, b in zip(outs, bad, strict=True)]
        if eqn.primitive.name in _ELEMENTWISE:
            return self._elementwise(eqn, invals, intags, outs, bad, module)
        return self._ablated(eqn, invals, intags, outs, bad, module)

    def _elementwise(self, eqn, invals, intags, outs, bad, module) -> list:
        result = []
        for k, b in enumerate(bad):
            if b is None:
                result.append(None)
                continue
            acc: dict[Origin, Any] = {}
            nan_in = b & False
            xp = np if isinstance(b, np.ndarray) else jnp
            for v, t in zip(invals, intags, strict=True):
                if not t:
                    continue
                for o, m in _masks(t, v):
                    if m is not None:
                        m = _fit(m, b.shape)
                        acc[o] = acc[o] | m if o in acc else m
                nan_in = nan_in | _fit(xp.isnan(_arr(v)), b.shape)
            explained = b & _union(acc.values(), b)
            claims = _assign(acc, explained)
            claims = self._masked_nan(eqn, invals, outs, k, claims, nan_in, module, acc)
            new = b & ~explained
            result.append(self._finish(eqn, invals, outs, k, claims, new, module))
        return result

    def _ablated(self, eqn, invals, intags, outs, bad, module) -> list:
        origins = _order(dict.fromkeys(o for t in intags if t for o, _ in t))
        filled = _bind(eqn, _fill(invals, intags, None))
        each = (
            {o: _bind(eqn, _fill(invals, intags, o)) for o in origins}
            if len(origins) > 1
            else {origins[0]: filled}
        )
        nan_in = any(
            t and bool(_xp(v).isnan(_arr(v)).any())
            for v, t in zip(invals, intags, strict=True)
        )
        result = []
        for k, b in enumerate(bad):
            if b is None:
                result.append(None)
                continue
            still = _bad_mask(filled[k])
            new = b & False if still is None else b & _fit(still, b.shape)
            explained = b & ~new
            acc = {}
            for o in origins:
                s = _bad_mask(each[o][k])
                acc[o] = explained if s is None else explained & ~_fit(s, b.shape)
            claims = _assign(acc, explained)
            rest = explained & ~_union(claims.values(), b)
            if bool(rest.any()):  # needs several origins at once: the first
                claims[origins[0]] = claims.get(origins[0], b & False) | rest
            claims = self._masked_row(eqn, outs, k, claims, module)
            nan_here = b | True if nan_in else b & False
            claims = self._masked_nan(
                eqn, invals, outs, k, claims, nan_here, module, acc
            )
            result.append(self._finish(eqn, invals, outs, k, claims, new, module))
        return result

    def _masked_row(self, eqn, outs, k, claims, module) -> dict:
        """A max over elements all ``-inf`` by a mask is ``-inf``: marked,
        for the softmax that subtracts it next (NaN)."""
        if eqn.primitive.name != "reduce_max":
            return claims
        rows = [m for o, m in claims.items() if o.intentional]
        if not rows:
            return claims
        m = _union(rows, rows[0]) & (_arr(outs[k]) == -np.inf)
        if not bool(m.any()):
            return claims
        o = self.new(eqn, [], outs, k, m, module, intentional=True, hint=MASKED_ROW)
        kept = {x: c & ~m for x, c in claims.items()}
        return {**{x: c for x, c in kept.items() if bool(c.any())}, o: m}

    def _masked_nan(self, eqn, invals, outs, k, claims, nan_in, module, acc):
        """NaN made from masked infinities alone (``-inf - -inf``,
        ``0 * -inf``): a new, unintended origin; a softmax's when one of
        them is the max of a fully masked row (``acc``: the elements each
        origin reached)."""
        masked = [c for o, c in claims.items() if o.intentional]
        if not masked:
            return claims
        out = _arr(outs[k])
        m = _union(masked, nan_in) & _xp(outs[k]).isnan(out) & ~nan_in
        if not bool(m.any()):
            return claims
        row = any(
            o.hint in (MASKED_ROW, SOFTMAX_MASKED) and bool((c & m).any())
            for o, c in acc.items()
        )
        hint = SOFTMAX_MASKED if row else MASKED_NAN
        o = self.new(eqn, invals, outs, k, m, module, hint=hint)
        if row:
            o.op = "softmax"
        kept = {x: c & ~m for x, c in claims.items()}
        return {**{x: c for x, c in kept.items() if bool(c.any())}, o: m}

    def _finish(self, eqn, invals, outs, k, claims, new, module) -> tuple:
        if bool(new.any()):
            lit = _literal_bad(eqn, invals)
            claims = {**claims, self.new(eqn, invals, outs, k, new, module, lit): new}
        return _make_tag(claims)

    def new(self, eqn, invals, outs, k, sel, module, intentional=False, hint=None):
        """A new origin: the equation's output ``k`` at the elements ``sel``."""
        self.count += 1
        name = eqn.primitive.name
        real = invals and not intentional
        out = outs[k]

        def facts():
            return (
                array_stats(out),
                [array_stats(v) for v in invals if _numeric(v)],
                _would_be(eqn, invals, k, sel) if real else None,
            )

        o = Origin(
            index=self.count,
            op=CANONICAL_OPS.get(name, name),
            module=_module_of(eqn.source_info, module),
            source=_source(eqn.source_info),
            facts=facts,
            intentional=intentional,
            hint=hint,
        )
        self.waiting = [
            r for r in self.waiting if (x := r()) is not None and callable(x.facts)
        ]
        if len(self.waiting) < _LAZY:
            self.waiting.append(weakref.ref(o))
        else:
            o.out  # noqa: B018 (computes the facts now, releasing the inputs)
        return o


def _assign(acc: dict, explained: Any) -> dict:
    """Each explained element to one origin, in `_order`."""
    taken = explained & False
    claims = {}
    for o in _order(acc):
        m = acc[o] & explained & ~taken
        if bool(m.any()):
            claims[o] = m
            taken = taken | m
    return claims


def _bind(eqn, invals) -> list:
    outs = eqn.primitive.bind(*invals, **eqn.params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _literal_bad(eqn, invals) -> bool:
    return any(
        isinstance(v, jcore.Literal) and _is_float(val) and not _finite(val)
        for v, val in zip(eqn.invars, invals, strict=True)
    )


def _unguarded(invals, intags):
    """A guard's select that keeps a finite case over a non-finite new one,
    with the same choice for every element: the non-finite case instead."""
    bad = [
        j
        for j, t in enumerate(intags[1:])
        if t and any(not o.intentional for o, _ in t)
    ]
    if not bad:
        return None
    pred = np.asarray(invals[0]).ravel()
    if not pred.size or not np.all(pred == pred[0]) or int(pred[0]) in bad:
        return None
    return [invals[1 + bad[0]]], [intags[1 + bad[0]]]


# Traced jaxprs: owner (a TrainStep) -> {(name, input types): (pin, jaxpr,
# output shape)}; `fit` locates up to `locate_first` steps of one TrainStep.
_TRACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _traced(fun, args, cache, scopes: bool):
    """``make_jaxpr(fun)(*args)`` with jit disabled (a jitted function inside
    the loss is traced inline, not taken from the hot path's trace cache,
    which has no module scopes); memoised per ``cache = (owner, name, pin)``
    and input types, as `jax.jit` memoises a trace (``pin``: an object the
    trace closes over, checked by identity)."""
    key = per = None
    if cache is not None:
        owner, name, pin = cache
        leaves, treedef = jax.tree_util.tree_flatten(args)
        key = (name, treedef, tuple(jax.typeof(x) for x in leaves))
        per = _TRACES.setdefault(owner, {})
        hit = per.get(key)
        if hit is not None and hit[0] is pin:
            return hit[1], hit[2]
    with jax.disable_jit(), module_scopes() if scopes else contextlib.nullcontext():
        closed, shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    if per is not None:
        per[key] = (cache[2], closed, shape)
    return closed, shape


def interpret(fun, *args, sink=None, unguard=False, cache=None, scopes=False):
    """Runs ``fun(*args)`` op by op; returns ``(output shape, outputs,
    tags)`` (flat lists; a tag is None for a finite leaf). Non-finite input
    leaves are intentional constants (the phases before refused any other).
    With ``sink``, each output leaf goes to ``sink(i, value, tag)`` as it is
    computed (kept, and counted as held, when it returns True) and the lists
    come back empty. ``scopes``: trace within `module_scopes`."""
    closed, shape = _traced(fun, args, cache, scopes)
    if sink is not None and hasattr(sink, "start"):
        sink.start(shape)
    leaves = jax.tree_util.tree_leaves(args)
    engine = _Interpreter(unguard=unguard)
    tags = [engine.constant_tag(x, "model_state") for x in leaves]
    try:
        outs, otags = engine.run(closed, leaves, tags, sink=sink)
    finally:
        stats["peaks"].append(engine.peak)
        stats["peak_live_bytes"] = max(stats["peak_live_bytes"], engine.peak)
    return shape, outs, otags


# --------------------------------------------------------- module scopes
class module_scopes:
    """While active, every Flax module method call runs in a
    ``jax.named_scope`` naming its path, read back from the equations' name
    stacks; a user's ``custom_vjp`` backward keeps its own source lines.

    NNX: the path of the attribute the call went through (``self.dec(x)``
    is ``dec`` even when ``dec`` is ``enc``), from the outermost module
    called or the object the loss called a submodule on (``m.head(...)`` is
    ``head``), the same names as torch's ``named_modules()``: ``""`` for
    that root, ``decoders.0.conv1`` for a child. Wrapped: ``__call__`` and
    ``attend`` of every `nnx.Module` subclass, and every public method of the
    user's own subclasses (``model.encode(x)``); restored on exit. Inside
    ``nnx.remat``/``nnx.scan`` (copies of the modules), a module is named by
    its type within the running one. Linen: the module's ``path`` joined
    with dots (``"Dense_0"``, ``"blocks_0.lin"``; ``""`` for the root),
    through linen's own method interceptor. Keras 3 (JAX backend): the
    names of the layers called, joined with "/" (``"block/d"``).
    """

    def __enter__(self):
        self.patched: list[tuple[type, str, Any]] = []
        self.stack: list[tuple[Any, str]] = []  # running modules, with paths
        self.index: dict[int, tuple[Any, str]] = {}  # roots' subgraphs
        self.subs: dict[int, tuple[Any, list]] = {}
        self.exits = contextlib.ExitStack()
        self.exits.enter_context(_own_backward_sources())
        self._keras_scopes()
        try:
            from flax import linen, nnx
        except ImportError:  # no flax: plain functions only
            self._module = None
            return self
        self._nnx, self._module = nnx, nnx.Module
        base = set(dir(nnx.Module))
        for cls in _subclasses(nnx.Module):
            user = not cls.__module__.startswith("flax.")
            for name, fn in list(vars(cls).items()):
                if not isinstance(fn, types.FunctionType):
                    continue
                public = not name.startswith("_") and name not in base
                if name == "__call__" or (public and (user or name == "attend")):
                    setattr(cls, name, self._wrap(fn))
                    self.patched.append((cls, name, fn))
        self.exits.enter_context(linen.intercept_methods(_linen_scope))
        return self

    def __exit__(self, *exc):
        for cls, name, fn in reversed(self.patched):
            setattr(cls, name, fn)
        self.exits.close()
        return False

    def _keras_scopes(self) -> None:
        """Keras 3 on the JAX backend, when it is loaded: every layer call
        (``layer(x)``; ``model.stateless_call`` calls its layers so) runs in
        a scope naming the layer names from the outermost one called,
        joined with "/" as Keras joins them in variable paths (``block/d``)."""
        keras = sys.modules.get("keras")
        layer = getattr(keras, "Layer", None)
        if layer is None or keras.backend.backend() != "jax":
            return
        orig, names = layer.__call__, []

        @functools.wraps(orig)
        def call(module, *args, **kwargs):
            names.append(str(getattr(module, "name", type(module).__name__)))
            try:
                with jax.named_scope(_MARK + "/".join(names)):
                    return orig(module, *args, **kwargs)
            finally:
                names.pop()

        layer.__call__ = call
        self.patched.append((layer, "__call__", orig))

    def _wrap(self, orig):
        scopes = self

        @functools.wraps(orig)
        def method(module, *args, **kwargs):
            path = scopes.call_path(module, sys._getframe(1))
            scopes.stack.append((module, path))
            try:
                with jax.named_scope(_MARK + path):
                    return orig(module, *args, **kwargs)
            finally:
                scopes.stack.pop()

        return method

    def call_path(self, module, frame) -> str:
        """The path of a call of ``module`` made in ``frame``: through the
        attribute chain written at the call site when it resolves."""
        found = call_site(frame, module)
        if found is not None:
            base, parts = found
            at = self.path_of(base)
            if at is not None:
                return join(at, parts)
        return self.path_of(module)

    def path_of(self, obj) -> str | None:
        for o, p in reversed(self.stack):
            if o is obj:
                return p
        if self._module is None or not isinstance(obj, self._module):
            return None
        parent, at = self.stack[-1] if self.stack else (None, "")
        if parent is not None:
            for rel, node in self._subgraph(parent):
                if node is obj:
                    return join(at, [rel])
        known = self.index.get(id(obj))
        if known is not None and known[0] is obj:
            return known[1]
        if parent is None:  # a root: the loss called it
            for rel, node in [("", obj), *self._subgraph(obj)]:
                self.index.setdefault(id(node), (node, rel))
            return ""
        # A copy made by a transform (nnx.remat, nnx.scan): the running
        # module itself, or its submodule of the same type.
        if type(obj) is type(parent):
            return at
        for rel, node in self._subgraph(parent):
            if type(node) is type(obj):
                return join(at, [rel])
        return at

    def _subgraph(self, node) -> list[tuple[str, Any]]:
        cached = self.subs.get(id(node))
        if cached is None or cached[0] is not node:
            nodes = [
                (".".join(str(p) for p in path), n)
                for path, n in self._nnx.iter_graph(node)
                if path and isinstance(n, self._module)
            ]
            cached = self.subs[id(node)] = (node, nodes)
        return cached[1]


def _linen_scope(next_fun, args, kwargs, context):
    if context.method_name == "setup":
        return next_fun(*args, **kwargs)
    path = ".".join(str(p) for p in context.module.path)
    with jax.named_scope(_MARK + path):
        return next_fun(*args, **kwargs)


def _subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


@contextlib.contextmanager
def _own_backward_sources():
    """A ``jax.custom_vjp`` backward is traced where JAX replays the forward
    call's traceback; while active, its ops keep the user's own lines."""
    cls = custom_derivatives.custom_vjp
    orig = cls.__call__

    def call(self, *args, **kwargs):
        bwd = self.bwd
        where = getattr(getattr(bwd, "__code__", None), "co_filename", "<")
        if bwd is None or any(m in where for m in _LIB_MARKERS):
            return orig(self, *args, **kwargs)

        @functools.wraps(bwd)
        def own(*a):
            # No traceback in the context: each op takes its own (its line
            # in ``bwd``); the name stack (the module) stays.
            ctx = source_info_util._source_info_context
            prev = ctx.context
            ctx.context = source_info_util.SourceInfo(None, prev.name_stack)
            try:
                return bwd(*a)
            finally:
                ctx.context = prev

        self.bwd = own
        try:
            return orig(self, *args, **kwargs)
        finally:
            self.bwd = bwd

    cls.__call__ = call
    try:
        yield
    finally:
        cls.__call__ = orig


# ------------------------------------------------------------------- text


def dtype_max(dtype: str) -> float | None:
    dt = jnp.dtype(dtype)
    return float(jnp.finfo(dt).max) if jnp.issubdtype(dt, jnp.floating) else None


def cause(o: Origin, where: str) -> str:
    """One line: why ``o.op`` gave a non-finite value (in float dtypes' limits)."""
    return _cause(o, where, dtype_max)


# ------------------------------------------------------------------ phases
def dotted(key_path: Any) -> str:
    """A jax key path as a dotted string: ``['a'][0].b`` -> ``a.0.b``; the
    ``.value`` of an NNX Variable is dropped (``conv1.kernel``, as in torch's
    ``conv1.weight``)."""
    key_path = tuple(key_path)
    if key_path and getattr(key_path[-1], "name", None) in ("value", "raw_value"):
        key_path = key_path[:-1]
    parts = []
    for k in key_path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def _named(key_path: Any, root: str) -> str:
    # A bare array (params = jnp.zeros(3)) has the empty path: name the tree.
    return dotted(key_path) or root


def _masks_only(leaf: Any) -> bool:
    """Non-finite only as ``-inf``: a mask kept in the model state."""
    a = _arr(leaf)
    xp = _xp(leaf)
    return not bool(xp.isnan(a).any()) and not bool((a == xp.inf).any())


def _first_bad(tree: Any, masks_ok: bool = False) -> tuple[Any, Any, Stats] | None:
    """(key path, leaf, stats) of the non-finite leaf of ``tree`` whose dotted
    path sorts first. torchref uses the same rule, so both name the same leaf
    whatever their own order (pytree keys sorted here, registration order in
    torch; ``bias`` sorts before ``kernel`` as before ``weight``). With
    ``masks_ok``, a leaf whose only non-finite values are ``-inf`` (a mask)
    does not count."""
    bad = [
        (dotted(path), path, leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if _is_float(leaf)
        and not _finite(leaf)
        and not (masks_ok and _masks_only(leaf))
    ]
    if not bad:
        return None
    _, path, leaf = min(bad, key=lambda item: item[0])
    return path, leaf, array_stats(leaf)


def _batch_name(key_path: Any) -> str:
    return "batch" + "".join(
        f"[{getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k)))!r}]"
        for k in key_path
    )


def _check_step(step: Any) -> None:
    missing = [
        a for a in ("loss_fn", "policy", "has_state", "has_aux") if not hasattr(step, a)
    ]
    if missing:
        raise TypeError(
            "locate needs a jaxstable.train.TrainStep made by make_train_step "
            f"(it keeps the loss function), got {type(step).__name__} without "
            f"{', '.join(missing)}"
        )


def _scaled_loss(step: Any):
    """The differentiated function of the step: ``(ls, params, model_state,
    batch) -> (scaled loss, (loss, new model state))``, as `make_train_step`
    builds it (policy casts, has_state, has_aux, float32 loss)."""
    pol = step.policy

    def fun(ls, params, model_state, batch):
        if pol is not None:
            params = pol.cast_to_compute(params)
            batch = pol.cast_to_compute(batch)
        if step.has_state:
            out, new_ms = step.loss_fn(params, model_state, batch)
        else:
            out, new_ms = step.loss_fn(params, batch), model_state
        loss = out[0] if step.has_aux else out
        loss = jnp.asarray(loss, jnp.float32)
        return ls.scale(loss), (loss, new_ms)

    return jax.value_and_grad(fun, argnums=1, has_aux=True)


class _LossNotFinite(Exception):
    pass


class _Run(NamedTuple):
    loss: Any
    loss_tag: Any
    grads: Any  # pytree of the params' structure (None: not computed)
    grad_tags: dict  # key path in grads -> tag
    model_state: Any


def _grads_run(step, ls, state, batch) -> _Run:
    """Forward and backward op by op; the backward is not run when the loss
    is already non-finite (the loss is computed first in the jaxpr)."""
    outs: dict[int, tuple[Any, Any]] = {}

    def sink(i, val, tag):
        outs[i] = (val, tag)
        if i == 1 and tag:  # leaf 1: the unscaled loss
            raise _LossNotFinite
        return True

    fun = _scaled_loss(step)
    args = (ls, state.params, state.model_state, batch)
    try:
        shape, _, _ = interpret(
            fun, *args, sink=sink, cache=(step, "grads", None), scopes=True
        )
    except _LossNotFinite:
        loss, tag = outs[1]
        return _Run(loss, tag, None, {}, None)
    treedef = jax.tree_util.tree_structure(shape)
    vals = jax.tree_util.tree_unflatten(treedef, [outs[i][0] for i in range(len(outs))])
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(vals)[0]]
    grad_tags = {tuple(p[1:]): outs[i][1] for i, p in enumerate(paths) if p[0].idx == 1}
    (_, (loss, new_ms)), grads = vals
    return _Run(loss, outs[1][1], grads, grad_tags, new_ms)


def locate(step: Any, state: Any, batch: Any, cls: type, finite=None) -> Any:
    stats["peak_live_bytes"], stats["peaks"] = 0, []
    _check_step(step)
    bad = _first_bad(batch)
    if bad is not None:
        path, _, s = bad
        return cls(
            phase="input",
            path=dotted(path) or None,
            op=None,
            source=None,
            detail=f"{kind(s.nan, s.inf)} in {_batch_name(path)} "
            f"({s.nan + s.inf} of {s.size} values)",
            **_value_fields(s),
        )
    for tree, root, masks_ok in (
        (state.params, "params", False),
        (state.model_state, "model_state", True),
    ):
        bad = _first_bad(tree, masks_ok)
        if bad is not None:
            path, _, s = bad
            name = _named(path, root)
            return cls(
                phase="params",
                path=name,
                op=None,
                source=None,
                detail=f"{kind(s.nan, s.inf)} in {name} before the step "
                f"({s.nan + s.inf} of {s.size} values): the parameters or model "
                "state were already non-finite",
                **_value_fields(s),
            )
    if finite is None and step.jit:
        # jit=False: the step that ran was eager, as the re-run below.
        finite = _compiled_finite(step, state, batch)
    if finite:  # the step that ran was finite: nothing to locate
        return None
    return _eager(step, state, batch, cls)


_UNDONATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled_finite(step: Any, state: Any, batch: Any) -> bool:
    """Whether the compiled step, run on (state, batch), was applied with a
    finite loss. A donating step is run through its own non-donating jit
    (compiled once per step), so ``state`` stays usable."""
    fn = step
    if getattr(step, "donate", False):
        fn = _UNDONATED.get(step)
        if fn is None:
            fn = _UNDONATED[step] = jax.jit(step.raw) if step.jit else step.raw
    _, metrics = fn(state, batch)
    return bool(metrics["finite"]) and _finite(metrics["loss"])


def _outcome(run: _Run, ls: Any) -> tuple:
    """What a run gave (compared between a run and its re-run)."""
    if run.loss_tag is not None or not _finite(run.loss):
        o = blame(run.loss_tag)
        return _core_outcome(False, None if o is None else o.module, None)
    bad = _first_bad(ls.unscale(run.grads))
    return _core_outcome(True, None, None if bad is None else _named(bad[0], "params"))


def _eager(step: Any, state: Any, batch: Any, cls: type) -> Any:
    """The op-by-op run at the state's loss scale, its finding, and the
    re-runs that check it (see `NonFiniteLocation.reproduced`): a fault
    that strikes at random (a flaky kernel or callback, hardware) is not
    given a cause from one run."""
    from jaxstable._src.loss_scale import StaticLossScale

    ls = state.loss_scale
    scale = float(np.asarray(ls.loss_scale))

    def again(at):
        return _outcome(_grads_run(step, at, state, batch), at)

    run = _grads_run(step, ls, state, batch)
    seen = _outcome(run, ls)
    if seen[0] == "finite":
        loc = _update_phase(step, state, ls.unscale(run.grads), run, cls)
        if loc is None:
            return None
        del run
        rerun = _grads_run(step, ls, state, batch)
        same = _outcome(rerun, ls)[0] == "finite" and _same_place(
            _update_phase(step, state, ls.unscale(rerun.grads), rerun, cls),
            loc,
        )
        return _checked(loc, scale, 1, int(same))
    loc = _failure(run, ls, cls)
    del run
    agreed = int(again(ls) == seen)
    if agreed and seen[0] == "gradients" and scale != 1.0:
        one = again(StaticLossScale(1.0))
        if one[0] == "finite":
            agreed += again(StaticLossScale(1.0)) == one
            if agreed == 2:
                return _checked(_benign(loc, scale), scale, 2, 2)
            return _checked(loc, scale, 2, agreed)
    return _checked(loc, scale, 1, agreed)


def _failure(run: _Run, ls: Any, cls: type) -> Any:
    """The location of a run's non-finite loss or gradient, with its cause."""
    if run.loss_tag is not None or not _finite(run.loss):
        o = blame(run.loss_tag)
        if o is None:  # cannot happen with finite inputs; said plainly anyway
            return cls(
                phase="loss", path=None, op=None, source=None, detail="loss not finite"
            )
        phase = "loss" if o.module is None else "forward"
        return cls(
            phase=phase, path=o.module, detail=cause(o, _where(o)), **_origin_fields(o)
        )
    path, _, s = _first_bad(ls.unscale(run.grads))
    name = _named(path, "params")
    o = blame(run.grad_tags.get(tuple(path)))
    text = f"{kind(s.nan, s.inf)} in the gradient of {name}, the loss finite"
    if o is not None:
        text += f"; it starts at {cause(o, _where(o))}"
    return cls(phase="backward", path=name, detail=text, **_origin_fields(o))


def _update_phase(step, state, grads, run, cls):
    """``state.tx.update`` op by op, guards off (see `_Interpreter`); each
    output leaf is checked as it is computed and dropped unless non-finite
    (or a float16 Adam ``nu``, for the message): no copy of the new
    parameters and optimizer state is held. The update gets what the
    step's does: ``value=`` the unscaled loss (`reduce_on_plateau` needs
    it) besides ``grads_finite``."""
    import optax

    tx = state.tx

    def apply(grads, opt_state, params):
        if isinstance(tx, optax.GradientTransformationExtraArgs):
            updates, new_opt = tx.update(
                grads, opt_state, params, grads_finite=jnp.asarray(True), value=run.loss
            )
        else:
            updates, new_opt = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt

    out_paths: list = []
    n_params = len(jax.tree_util.tree_leaves(state.params))
    first: dict[str, tuple] = {}  # "params"/"opt_state" -> (name, value, tag)
    nus: dict[int, Any] = {}  # float16 Adam nu leaves, for the message

    def sink(i, val, tag):
        path = out_paths[i][1:]
        if tag:
            tree = "params" if i < n_params else "opt_state"
            name = dotted(path)
            if tree not in first or name < first[tree][0]:
                first[tree] = (name, val, tag, path)
                return True
        nu = any(getattr(k, "name", None) == "nu" for k in path)
        if nu and getattr(val, "dtype", None) == jnp.float16:
            nus[i] = val
            return True
        return False

    sink.start = lambda shape: out_paths.extend(
        p for p, _ in jax.tree_util.tree_flatten_with_path(shape)[0]
    )
    args = (grads, state.opt_state, state.params)
    interpret(apply, *args, sink=sink, unguard=True, cache=(step, "update", tx))
    if "params" in first:
        _, leaf, tag, path = first["params"]
        name = _named(path, "params")
        s, o = array_stats(leaf), blame(tag)
        text = (
            f"{kind(s.nan, s.inf)} in {name} after the optimizer update "
            "(gradients finite)"
        )
        nu = [v for i, v in nus.items() if _ends_with(out_paths[i], path)]
        if nu and _adam_nu_zero(nu[0], leaf):
            text = ADAM_FP16 + f": the update of {name} divides by 0"
        elif o is not None:
            text += f"; it starts at {cause(o, 'in the optimizer update')}"
        return cls(phase="update", path=name, detail=text, **_origin_fields(o))
    where = leaf = None
    if "opt_state" in first:
        name, leaf, _, _ = first["opt_state"]
        where = join("opt_state", [name])
    else:
        ms_bad = _first_bad(run.model_state, masks_ok=True)
        if ms_bad is not None:
            where, leaf = join("model_state", [dotted(ms_bad[0])]), ms_bad[1]
    if where is None:
        return None
    s = array_stats(leaf)
    return cls(
        phase="update",
        path=where,
        op=None,
        source=None,
        detail=f"{kind(s.nan, s.inf)} in {where} after the step "
        "(loss and gradients finite)",
        **_value_fields(s),
    )


def _ends_with(path: Any, suffix: Any) -> bool:
    path, suffix = tuple(path), tuple(suffix)
    return len(path) >= len(suffix) and path[len(path) - len(suffix) :] == suffix


def _adam_nu_zero(nu: Any, new_param: Any) -> bool:
    """Whether Adam's new float16 ``nu`` for this parameter is 0 exactly
    where the new parameter is non-finite: ``m / (sqrt(0) + 0)``."""
    bad = ~np.isfinite(np.asarray(new_param, np.float64))
    return bool(np.all(np.asarray(nu, np.float64)[bad] == 0))
