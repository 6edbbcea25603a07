"""The jaxpr interpreter of `_locate` (private): following values through ops.

The loss (or the update) is traced to a jaxpr within `module_scopes` and
evaluated equation by equation, eagerly, each non-finite value carrying its
tag (see `jaxstable._src._locate` for the whole story).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore
from jax._src import source_info_util

from _stablecore.locate import MASKED_NAN, MASKED_ROW, SOFTMAX_MASKED, format_frame
from _stablecore.locate import make_tag as _make_tag
from _stablecore.locate import order as _order
from jaxstable._src.locate_origins import (
    CANONICAL_OPS,
    LIB_MARKERS,
    Origin,
    all_finite,
    array_module,
    array_stats,
    assign_claims,
    bad_mask,
    fill_with_ones,
    fit_shape,
    is_float,
    is_numeric,
    local_view,
    nbytes,
    slice_tag,
    stack_tags,
    tag_bytes,
    tag_masks,
    union,
    would_be,
)
from jaxstable._src.locate_scopes import MARK, module_scopes
from jaxstable._src.update_bound_rules import CALL_PRIMITIVES

# Higher-order primitives whose body is evaluated op by op (recursively).
_CALLS = CALL_PRIMITIVES
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
# Peak bytes held by the interpreter in the last `locate` call: values it
# computed still alive, their masks, and the outputs it kept (grads); one
# entry per op-by-op run in "peaks" (read by the memory tests and the
# benchmark).
stats: dict[str, Any] = {"peak_live_bytes": 0, "peaks": []}
# Origins whose facts may wait to be read, each holding its op's inputs.
_LAZY = 8


def user_source(source_info: Any) -> str | None:
    for fr in source_info_util.user_frames(source_info.traceback):
        if not any(m in fr.file_name for m in LIB_MARKERS):
            return format_frame(fr.file_name, fr.start_line, fr.function_name)
    return None


def module_of(source_info: Any, outer: str | None) -> str | None:
    module = outer
    for entry in source_info.name_stack.stack:
        name = getattr(entry, "name", "")
        if type(entry).__name__ == "Scope" and name.startswith(MARK):
            module = name[len(MARK) :]
    return module


def sub_jaxpr(eqn: Any) -> jcore.ClosedJaxpr | None:
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


class _Frame:
    """The values of one `_Interpreter.run` of a jaxpr: each variable's value
    and tag, dropped after its last use (the outputs kept unless a sink takes
    them as they are computed); the bytes it computed counted on the
    interpreter (``live``, and ``held`` for what the sink kept)."""

    def __init__(self, engine: _Interpreter, jaxpr: Any, sink: Any) -> None:
        self.engine, self.sink = engine, sink
        self.env: dict[Any, Any] = {}
        self.tag_of: dict[Any, Any] = {}
        self.last: dict[Any, int] = {}  # variable -> index of its last use
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if not isinstance(v, jcore.Literal):
                    self.last[v] = i
        self.out_at: dict[Any, list[int]] = {}
        for j, v in enumerate(jaxpr.outvars):
            if isinstance(v, jcore.Literal):
                if sink is not None:
                    sink(j, v.val, None)
            else:
                self.out_at.setdefault(v, []).append(j)
        self.keep = set() if sink is not None else set(self.out_at)
        self.sizes: dict[Any, int] = {}  # what this run computed (not its inputs)

    def write(self, v, val, t, computed=True) -> None:
        if isinstance(v, jcore.DropVar):
            return
        self.env[v], self.tag_of[v] = val, t
        if computed:
            self.sizes[v] = nbytes(val) + tag_bytes(t)
            self.engine.live += self.sizes[v]
        if self.sink is not None:
            for j in self.out_at.get(v, ()):
                if self.sink(j, val, t):
                    self.engine.held += nbytes(val)

    def drop(self, v) -> None:
        if v in self.env and v not in self.keep:
            del self.env[v], self.tag_of[v]
            self.engine.live -= self.sizes.pop(v, 0)

    def read(self, v) -> tuple[Any, Any]:
        if isinstance(v, jcore.Literal):
            return v.val, None
        return self.env[v], self.tag_of[v]

    def release(self, i: int, eqn: Any) -> None:
        """Drops what equation ``i`` used last and the outputs nothing uses."""
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal) and self.last.get(v) == i:
                self.drop(v)
        for v in eqn.outvars:
            if v not in self.last:
                self.drop(v)

    def close(self) -> None:
        """Drops every value left, the outputs too."""
        for v in list(self.env):
            self.keep.discard(v)
            self.drop(v)


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
        frame = _Frame(self, jaxpr, sink)
        for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
            frame.write(v, c, self.constant_tag(c, "constant"), computed=False)
        for v, a, t in zip(jaxpr.invars, args, tags, strict=True):
            frame.write(v, a, t, computed=False)
        for v in [*jaxpr.constvars, *jaxpr.invars]:
            if v not in frame.last:
                frame.drop(v)
        for i, eqn in enumerate(jaxpr.eqns):
            self._step(frame, i, eqn, module)
        results = [] if sink is not None else [frame.read(v) for v in jaxpr.outvars]
        frame.close()
        return [r[0] for r in results], [r[1] for r in results]

    def _step(self, frame: _Frame, i: int, eqn: Any, module: str | None) -> None:
        """Equation ``i``: its outputs written, the values it used last dropped."""
        pairs = [frame.read(v) for v in eqn.invars]
        invals = [p[0] for p in pairs]
        intags = [p[1] for p in pairs]
        outs, outtags = self._eval(eqn, invals, intags, module)
        for v, val, t in zip(eqn.outvars, outs, outtags, strict=True):
            frame.write(v, val, t)
        self.peak = max(self.peak, self.live + self.held)
        del pairs, invals, intags, outs, outtags
        frame.release(i, eqn)

    def constant_tag(self, c: Any, what: str) -> tuple | None:
        """The tag of a non-finite constant (intentional: a mask)."""
        if all_finite(c):
            return None
        self.count += 1
        o = Origin(self.count, what, None, None, (array_stats(c), [], None), True)
        return ((o, None),)

    def _eval(self, eqn, invals, intags, module) -> tuple[list, list]:
        name = eqn.primitive.name
        sub = sub_jaxpr(eqn)
        if sub is not None:
            return self.run(sub, invals, intags, module_of(eqn.source_info, module))
        if name in _BODIES:
            if not any(intags):
                outs = bind(eqn, invals)
                if all(all_finite(o) for o in outs):
                    return outs, [None] * len(outs)
            here = module_of(eqn.source_info, module)
            return getattr(self, "_" + name)(eqn, invals, intags, here)
        if self.unguard and name == "select_n":
            guarded = _unguarded(invals, intags)
            if guarded is not None:
                return guarded
        outs = bind(eqn, invals)
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
            xt_i = [slice_tag(t, x, i) for t, x in zip(xtags, xs, strict=True)]
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
            ytags.append(stack_tags([yt_at[i][j] for i in order], parts))
        return [*carry, *ys], [*ktags, *ytags]

    # ---------------------------------------------------------------- tags
    def _tags(self, eqn, invals, intags, outs, module) -> list:
        bad = [not all_finite(o) for o in outs]
        if not any(bad):
            return [None] * len(outs)
        if not any(intags):
            # Finite inputs: a new origin, intentional when a non-finite
            # literal (``-inf`` written as a mask value) was an input.
            k = bad.index(True)
            lit = literal_bad(eqn, invals)
            o = self.new(eqn, invals, outs, k, bad_mask(outs[k]), module, lit)
            return [((o, None),) if b else None for b in bad]
        origins = _order(dict.fromkeys(o for t in intags if t for o, _ in t))
        if len(origins) == 1 and not origins[0].intentional:
            # One real cause keeps every non-finite output: the first cause
            # wins anyway, and a NaN cascade stays cheap.
            return [((origins[0], None),) if b else None for b in bad]
        bad = [bad_mask(o) if b else None for o, b in zip(outs, bad, strict=True)]
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
                for o, m in tag_masks(t, v):
                    if m is not None:
                        m = fit_shape(m, b.shape)
                        acc[o] = acc[o] | m if o in acc else m
                nan_in = nan_in | fit_shape(xp.isnan(local_view(v)), b.shape)
            explained = b & union(acc.values(), b)
            claims = assign_claims(acc, explained)
            claims = self._masked_nan(eqn, invals, outs, k, claims, nan_in, module, acc)
            new = b & ~explained
            result.append(self._finish(eqn, invals, outs, k, claims, new, module))
        return result

    def _ablated(self, eqn, invals, intags, outs, bad, module) -> list:
        origins = _order(dict.fromkeys(o for t in intags if t for o, _ in t))
        filled = bind(eqn, fill_with_ones(invals, intags, None))
        each = (
            {o: bind(eqn, fill_with_ones(invals, intags, o)) for o in origins}
            if len(origins) > 1
            else {origins[0]: filled}
        )
        nan_in = any(
            t and bool(array_module(v).isnan(local_view(v)).any())
            for v, t in zip(invals, intags, strict=True)
        )
        result = []
        for k, b in enumerate(bad):
            if b is None:
                result.append(None)
                continue
            still = bad_mask(filled[k])
            new = b & False if still is None else b & fit_shape(still, b.shape)
            explained = b & ~new
            acc = {}
            for o in origins:
                s = bad_mask(each[o][k])
                acc[o] = explained if s is None else explained & ~fit_shape(s, b.shape)
            claims = assign_claims(acc, explained)
            rest = explained & ~union(claims.values(), b)
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
        m = union(rows, rows[0]) & (local_view(outs[k]) == -np.inf)
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
        out = local_view(outs[k])
        m = union(masked, nan_in) & array_module(outs[k]).isnan(out) & ~nan_in
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
            lit = literal_bad(eqn, invals)
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
                [array_stats(v) for v in invals if is_numeric(v)],
                would_be(eqn, invals, k, sel) if real else None,
            )

        o = Origin(
            index=self.count,
            op=CANONICAL_OPS.get(name, name),
            module=module_of(eqn.source_info, module),
            source=user_source(eqn.source_info),
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


def bind(eqn, invals) -> list:
    # As `jax.core.eval_jaxpr`: a higher-order primitive (``shard_map``)
    # is bound with its own parameters (its body as a function).
    params = eqn.primitive.get_bind_params(eqn.params)
    outs = eqn.primitive.bind(*invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def literal_bad(eqn, invals) -> bool:
    return any(
        isinstance(v, jcore.Literal) and is_float(val) and not all_finite(val)
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


def traced_jaxpr(fun, args, cache, scopes: bool):
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
    closed, shape = traced_jaxpr(fun, args, cache, scopes)
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
