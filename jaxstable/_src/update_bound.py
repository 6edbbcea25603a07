"""Where the update check cannot fail: a proof from the optimizer's own jaxpr.

The JAX twin of torch's `UpdateBound` (`torchref._src.update_bound`). torch
proves per step, on the host, from known update rules (SGD, Adam, AdamW);
JAX cannot read an optax transformation's hyper-parameters, which live in
closures, so this reads what the transformation computes: its ``update``
traced to a jaxpr, evaluated once at trace time over intervals (every
element of a leaf shares one interval) with the gradients bounded by the
clip. Where every value the update can compute, from any state it can
reach, stays far from overflow and no operation can make a NaN, the
recompute pass of the update check (`update_check.writes_finite`) is left
out of the compiled step: it could only ever say "finite".

What is proved, and under what premises (`UpdateBound`'s docstring lists
them); everything else falls back to the full check.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.extend import core

from jaxstable._src.update_bound_rules import (
    CALL_PRIMITIVES,
    Unprovable,
    Val,
    const_val,
    primitive_rule,
    refine,
    union,
)

__all__ = ["UpdateBound"]

# The clip's bound times this: the global norm that chose the clip factor is
# itself a rounded sum, and the proof needs a true bound on every element.
_NORM_MARGIN = 2.0**20
# Fixed-point rounds before a state bound is given up on.
_ROUNDS = 64
# Transformations whose state a user writes between steps (a learning rate
# set by hand): a bound proved from ``init`` says nothing about those values.
_WRITTEN_OUTSIDE = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


@dataclasses.dataclass
class _Eqn:
    prim: str
    ins: list[int]
    outs: list[int]
    params: dict
    in_shapes: list[tuple]
    out_shapes: list[tuple]
    out_dtypes: list[Any]


class _Program:
    """A jaxpr with its calls inlined, evaluated over `Val` intervals."""

    def __init__(self, closed: Any) -> None:
        self.eqns: list[_Eqn] = []
        self.defs: dict[int, int] = {}
        self.fixed: dict[int, Val] = {}
        self._next = 0
        self.inputs = [self._key() for _ in closed.jaxpr.invars]
        self.outputs = self._inline(closed.jaxpr, closed.consts, self.inputs)

    def _key(self, val: Val | None = None) -> int:
        self._next += 1
        if val is not None:
            self.fixed[self._next] = val
        return self._next

    def _inline(self, jaxpr: Any, consts: list, args: list[int]) -> list[int]:
        env: dict[Any, int] = dict(zip(jaxpr.invars, args, strict=True))
        env.update(
            (v, self._key(const_val(c)))
            for v, c in zip(jaxpr.constvars, consts, strict=True)
        )

        def read(v):
            return (
                self._key(const_val(v.val)) if isinstance(v, core.Literal) else env[v]
            )

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            if name in CALL_PRIMITIVES and sub is not None:
                body, body_consts = (
                    getattr(sub, "jaxpr", sub),
                    getattr(sub, "consts", []),
                )
                outs = self._inline(body, body_consts, ins)
            else:
                outs = [self._key() for _ in eqn.outvars]
                self.defs.update((k, len(self.eqns)) for k in outs)
                self.eqns.append(
                    _Eqn(
                        name,
                        ins,
                        outs,
                        dict(eqn.params),
                        [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars],
                        [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars],
                        [v.aval.dtype for v in eqn.outvars],
                    )
                )
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    def run(self, inputs: list[Val]) -> list[Val]:
        self.env = dict(self.fixed)
        self.env.update(zip(self.inputs, inputs, strict=True))
        for eqn in self.eqns:
            outs = self._apply(eqn, [self.env[k] for k in eqn.ins], narrow=True)
            self.env.update(zip(eqn.outs, outs, strict=True))
        return [self.env[k] for k in self.outputs]

    def _apply(self, eqn: _Eqn, ins: list[Val], narrow: bool) -> list[Val]:
        if eqn.prim == "select_n":
            return [self._select(eqn, ins, narrow)]
        dtype = eqn.out_dtypes[0]
        return [primitive_rule(eqn, ins, dtype)]

    def _select(self, eqn: _Eqn, ins: list[Val], narrow: bool) -> Val:
        """The hull of the cases the predicate can pick; a case picked by a
        comparison ``x < k`` (and the like) is re-evaluated with ``x`` so
        refined (optax's saturating count: ``where(c < max, c + 1, max)``)."""
        pred, cases = ins[0], list(ins[1:])
        reach = range(max(int(pred.b[0]), 0), min(int(pred.b[1]), len(cases) - 1) + 1)
        cond = self._condition(eqn.ins[0]) if narrow and len(cases) == 2 else None
        out = None
        for i in reach:
            case = cases[i]
            if cond is not None:
                x, refined = cond[0], refine(cond, bool(i))
                if refined is None:
                    continue  # the predicate cannot pick this case
                case = self._under(eqn.ins[1 + i], {x: refined}, {}, 0)
            out = case if out is None else union(out, case)
        if out is None:
            raise Unprovable("a select with no reachable case")
        return out

    def _condition(self, key: int) -> tuple | None:
        """``(x, op, k, x_val)`` when ``key`` is ``x op k`` for a single point
        ``k`` (either side)."""
        if key not in self.defs:
            return None
        eqn = self.eqns[self.defs[key]]
        if eqn.prim not in ("lt", "le", "gt", "ge", "eq"):
            return None
        (x, y), (vx, vy) = eqn.ins, (self.env[eqn.ins[0]], self.env[eqn.ins[1]])
        flip = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}
        if vy.free and vy.b[0] == vy.b[1] and vx.free:
            return (x, eqn.prim, vy.b[0], vx)
        if vx.free and vx.b[0] == vx.b[1] and vy.free:
            return (y, flip[eqn.prim], vx.b[0], vy)
        return None

    def _under(self, key: int, over: dict, memo: dict, depth: int) -> Val:
        """``key``'s value with the values in ``over`` replacing the base
        ones (a refinement: never wider, so falling back to the base value
        at any depth stays sound)."""
        if key in over:
            return over[key]
        if key not in self.defs or depth > 64:
            return self.env[key]
        if key not in memo:
            eqn = self.eqns[self.defs[key]]
            ins = [self._under(k, over, memo, depth + 1) for k in eqn.ins]
            if all(v is self.env[k] for v, k in zip(ins, eqn.ins, strict=True)):
                memo[key] = self.env[key]
            else:
                outs = self._apply(eqn, ins, narrow=False)
                memo.update(zip(eqn.outs, outs, strict=True))
        return memo[key]


class UpdateBound:
    """Proves, at trace time, that ``optimizer`` cannot write a non-finite
    value after a clip to ``max_norm``; `stable_optimizer` then leaves the
    update check's recompute pass out of the step (it could only say yes).

    ``proven(grads, state, params)`` is True where ALL of these hold, and
    anywhere else the full check runs as before:

    - every float leaf of the parameters, gradients and optimizer state is
      float32 or float64 (float16/bfloat16 state is never proved: Adam's
      ``(1 - b2) * g**2`` underflows to 0 and ``eps = 1e-8`` is 0 there, the
      ``m / 0`` case); no complex leaf; no `optax.inject_hyperparams` state
      (a value set between steps is outside what ``init`` and ``update``
      can reach);
    - the optimizer's ``init`` and ``update``, traced to jaxprs, use only
      primitives with an interval rule (arithmetic, comparisons, selects,
      shape changes, reductions; no ``cond``/``while``/``scan``) and
      evaluated over intervals (`update_bound_rules`) with every gradient
      element in ``[-C, C]``, ``C = max_norm * 2**20`` (a clipped gradient
      is at most ``max_norm``; the margin covers the rounding of the norm
      that chose the clip factor), reach a fixed point: a box of state
      bounds that holds ``init``'s state and that one update maps into
      itself. By induction every state the guarded steps reach is in it,
      whether a step was applied or skipped (a skipped step keeps a state
      from the box);
    - in that box every value the update computes stays within ``2**100``
      (each float result widened by ``2**-20`` of itself for rounding), no
      division's divisor interval holds 0, no square root's or logarithm's
      argument can be below its domain, and the new state does not depend
      on the parameters;
    - every value is ``a * p + b`` of at most one parameter ``p``, element
      for element, with ``|a| <= 1`` and ``|b| <= 2**100`` (AdamW's decay
      ``-lr * wd * p`` needs ``lr * wd <= 1``; plain Adam and SGD have ``a =
      0``), and each update leaf one of its own parameter: the update and
      the written ``p + u = (1 + a) * p + b`` then stay at most ``2 * |p| +
      2**100`` in magnitude, finite for any parameter at most ``2**126``
      (the premise on the parameters: float32's max is ``2**128``).

    Premises not checked on the device: the optimizer state is what this
    transformation's ``init`` and its own guarded updates made (not a state
    from another run or set by hand), and parameters are at most ``2**126``.
    Outside them nothing unsafe is written either: the step's selects still
    keep the old value of any element that is not finite (`keep_finite`),
    and only the whole-step skip and its count could be missed.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> p = {"w": jnp.zeros((2, 3))}
      >>> UpdateBound(optax.adamw(1e-3), 1.0).proven(p, optax.adamw(1e-3).init(p), p)
      True
      >>> bad = optax.adam(1e-3, eps=0.0)  # m / sqrt(v): 0 / 0 where g = 0
      >>> UpdateBound(bad, 1.0).proven(p, bad.init(p), p)
      False
    """

    def __init__(self, optimizer: optax.GradientTransformation, max_norm: float):
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.reason = ""
        # shapes and dtypes -> reason ("" where proved): an eager caller
        # (``tx.update`` outside jit) traces the optimizer once, not per step.
        self._done: dict[Any, str] = {}

    def proven(self, grads: Any, state: Any, params: Any, **extra_args: Any) -> bool:
        """Whether the guarded update cannot write a non-finite value (see
        the class docstring); ``reason`` says why not when it is False.
        ``extra_args`` (optax's ``value=`` and the like) are traced too, as
        any value of their dtype."""
        leaves, tree = jax.tree_util.tree_flatten((grads, state, params, extra_args))
        key = (tree, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))
        if key not in self._done:
            try:
                self._prove(grads, state, params, extra_args)
                self._done[key] = ""
            except Unprovable as err:
                self._done[key] = str(err)
        self.reason = self._done[key]
        return not self.reason

    def _prove(self, grads: Any, state: Any, params: Any, extra: dict) -> None:
        bound = float(self.max_norm) * _NORM_MARGIN
        if params is None or not bound < 2.0**50:
            raise Unprovable("no parameters, or no finite clip bound")
        _check_leaves(grads, state, params)
        spec = jax.tree_util.tree_map(_spec, (grads, state, params, extra))
        grads_s, state_s, params_s, _ = spec
        opt = optax.with_extra_args_support(self.optimizer)
        init = _Program(_jaxpr(opt.init, params_s))
        symbols = [
            Val(b=(0.0, 0.0), a=(1.0, 1.0), sym=i) for i in range(len(init.inputs))
        ]
        box = init.run(symbols)
        update = _Program(_jaxpr(lambda g, s, p, e: opt.update(g, s, p, **e), *spec))
        n_grads, n_state = len(jax.tree_util.tree_leaves(grads_s)), len(box)
        if len(update.outputs) != n_grads + n_state:
            raise Unprovable("the update's state is not shaped like init's")
        grad_vals = [Val(b=(-bound, bound)) for _ in range(n_grads)]
        extra_vals = [_any_value(x.dtype) for x in jax.tree_util.tree_leaves(extra)]
        for rounds in range(_ROUNDS):
            out = update.run(grad_vals + box + symbols + extra_vals)
            new = out[n_grads:]
            if all(_inside(n, b) for n, b in zip(new, box, strict=True)):
                break
            box = [
                _widen(b, n, rounds, d)
                for b, n, d in zip(box, new, _dtypes(state_s), strict=True)
            ]
        else:
            raise Unprovable("no state bound holds from step to step")
        for i, u in enumerate(out[:n_grads]):
            if not u.free and u.sym != i:
                raise Unprovable(f"update leaf {i} depends on another parameter")


def _jaxpr(fn: Any, *args: Any) -> Any:
    """``fn`` traced; a transformation that cannot be traced on its own
    (one that needs an argument the step does not pass) proves nothing."""
    try:
        return jax.make_jaxpr(fn)(*args)
    except Exception as err:  # any failure to trace: not proved
        raise Unprovable(f"could not trace the optimizer: {err}") from err


def _any_value(dtype: Any) -> Val:
    """Any value of ``dtype`` (a float bound past `_SAFE`: refused once used)."""
    if jnp.issubdtype(dtype, jnp.floating):
        top = float(jnp.finfo(dtype).max)
        return Val(b=(-top, top))
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return Val(b=(int(info.min), int(info.max)), kind="i")
    return Val(b=(0, 1), kind="b")


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def _dtypes(tree: Any) -> list:
    return [x.dtype for x in jax.tree_util.tree_leaves(tree)]


def _check_leaves(grads: Any, state: Any, params: Any) -> None:
    """float32/float64 floats only, no complex, no hand-set state."""
    is_written = lambda x: isinstance(x, _WRITTEN_OUTSIDE)  # noqa: E731
    if any(map(is_written, jax.tree_util.tree_leaves(state, is_leaf=is_written))):
        raise Unprovable("an inject_hyperparams state (values set between steps)")
    if jax.tree_util.tree_structure(grads) != jax.tree_util.tree_structure(params):
        raise Unprovable("gradients not shaped like the parameters")
    for x in jax.tree_util.tree_leaves((grads, state, params)):
        dtype = jnp.result_type(x)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise Unprovable("a complex leaf")
        if jnp.issubdtype(dtype, jnp.floating) and dtype not in (
            jnp.float32,
            jnp.float64,
        ):
            raise Unprovable(f"a {dtype} leaf (only float32 and float64 are proved)")


def _inside(new: Val, box: Val) -> bool:
    if not new.free:
        raise Unprovable("optimizer state that depends on the parameters")
    return box.b[0] <= new.b[0] and new.b[1] <= box.b[1]


def _widen(box: Val, new: Val, rounds: int, dtype: Any) -> Val:
    """The hull of ``box`` and ``new``; from the third round an end that
    still moves jumps out (a float end to twice its magnitude, or to 0 from
    the other side; an integer end to its dtype's limit): a contraction such
    as Adam's ``m' = b1 * m + (1 - b1) * g`` then overshoots its fixed point
    within a few doublings and the box holds from there."""
    lo, hi = min(box.b[0], new.b[0]), max(box.b[1], new.b[1])
    if rounds >= 2 and box.kind == "i":
        info = jnp.iinfo(dtype)
        lo = int(info.min) if lo < box.b[0] else lo
        hi = int(info.max) if hi > box.b[1] else hi
    elif rounds >= 2 and box.kind == "f":
        lo = lo - abs(lo) if lo < box.b[0] else lo
        hi = hi + abs(hi) if hi > box.b[1] else hi
    return dataclasses.replace(box, b=(lo, hi))
