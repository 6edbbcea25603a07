"""The engine of `jaxstable.diagnostics.locate` (private).

The loss of a train step is traced to a jaxpr (with every Flax NNX module
call wrapped in a ``jax.named_scope`` naming its attribute path) and then
evaluated equation by equation, eagerly, outside `jax.jit`. Every value that
is not finite carries its *origin*: the first equation whose output went
non-finite while its own inputs were finite (or, when an input already was
non-finite, that input's origin). So the loss, and each gradient leaf, knows
which operation its NaN or Inf started from, in which module, at which line
of the user's code. Only the values still needed are kept (each variable is
dropped after its last use), so memory stays that of the step itself.

The jitted step is never touched: nothing here runs on the hot path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore
from jax._src import source_info_util

_MARK = "@jaxstable.module:"  # prefix of the named scope of a module call
# Higher-order primitives whose body is evaluated op by op (recursively);
# any other primitive with a body (scan, while, cond) counts as one op.
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
# Peak bytes held by the interpreter's live values in the last `interpret`
# call (read by the bounded-memory test).
stats = {"peak_live_bytes": 0}


class Stats(NamedTuple):
    """Shape, dtype and the finite-value facts of one array."""

    shape: tuple[int, ...]
    dtype: str
    nan: int
    inf: int
    max_abs: float  # over finite elements; nan when none
    max: float  # largest finite (real part) value; nan when none
    zeros: int
    negatives: int
    size: int


def array_stats(x: Any) -> Stats:
    a = np.asarray(jax.device_get(x))
    shape, dtype = tuple(a.shape), a.dtype.name
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        a = a.astype(np.float64)
    w = a.astype(np.complex128 if np.iscomplexobj(a) else np.float64)
    nan = np.isnan(w)
    inf = np.isinf(w)
    fin = w[~(nan | inf)]
    real = fin.real if np.iscomplexobj(fin) else fin
    return Stats(
        shape=shape,
        dtype=dtype,
        nan=int(nan.sum()),
        inf=int(inf.sum()),
        max_abs=float(np.abs(fin).max()) if fin.size else float("nan"),
        max=float(real.max()) if fin.size else float("nan"),
        zeros=int((fin == 0).sum()),
        negatives=int((real < 0).sum()),
        size=int(w.size),
    )


@dataclasses.dataclass
class Origin:
    """Where a non-finite value started."""

    index: int
    op: str
    module: str | None  # dotted module path, "" for the root, None outside
    source: str | None
    out: Stats
    ins: list[Stats]
    would_be: float | None  # max |x| of the output recomputed in float32


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _numeric(x: Any) -> bool:
    # PRNG key arrays (extended dtypes) have no values to report.
    dtype = getattr(x, "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _finite(x: Any) -> bool:
    if not _is_float(x):
        return True
    return bool(jnp.all(jnp.isfinite(x)))


def _source(source_info: Any) -> str | None:
    frames = list(source_info_util.user_frames(source_info.traceback))
    for fr in frames:
        if not any(m in fr.file_name for m in _LIB_MARKERS):
            return format_frame(fr.file_name, fr.start_line, fr.function_name)
    return None


def format_frame(file_name: str, line: int, function: str) -> str:
    """``file:line in function`` (the same format as torchref's)."""
    rel = os.path.relpath(file_name)
    name = rel if not rel.startswith("..") else file_name
    return f"{name}:{line} in {function.split('.')[-1]}"


def _module_of(source_info: Any, outer: str | None) -> str | None:
    module = outer
    for entry in source_info.name_stack.stack:
        name = getattr(entry, "name", "")
        if type(entry).__name__ == "Scope" and name.startswith(_MARK):
            module = name[len(_MARK) :]
    return module


def _would_be(eqn: Any, invals: list) -> float | None:
    """max |output| with the low-precision inputs upcast to float32.

    Tells an overflow (finite in float32, above the dtype's max) from a
    division by zero or a log of 0 (non-finite in float32 too).
    """
    name = eqn.primitive.name
    if name == "convert_element_type":
        x = invals[0]
        return float(np.abs(np.asarray(x, np.float64)).max()) if _finite(x) else None
    low = (jnp.float16, jnp.bfloat16)
    if not any(_is_float(v) and v.dtype in low for v in invals):
        return None
    ups = [
        v.astype(jnp.float32) if _is_float(v) and v.dtype in low else v for v in invals
    ]
    params = dict(eqn.params)
    if params.get("preferred_element_type") in low:
        params["preferred_element_type"] = jnp.float32
    try:
        out = eqn.primitive.bind(*ups, **params)
    except Exception:  # a primitive that refuses mixed dtypes: no estimate
        return None
    out = out[0] if eqn.primitive.multiple_results else out
    a = np.asarray(out, np.float64)
    return float(np.abs(a).max()) if np.all(np.isfinite(a)) else None


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


class _Interpreter:
    def __init__(self) -> None:
        self.count = 0
        self.live = 0

    def run(
        self, closed: jcore.ClosedJaxpr, args: list, origins: list, module=None
    ) -> tuple[list, list]:
        jaxpr = closed.jaxpr
        env: dict[Any, Any] = {}
        orig: dict[Any, Origin | None] = {}
        last: dict[Any, int] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if not isinstance(v, jcore.Literal):
                    last[v] = i
        keep = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}

        def write(v, val, o):
            if isinstance(v, jcore.DropVar):
                return
            env[v] = val
            orig[v] = o
            self.live += _nbytes(val)

        def drop(v):
            if v in env and v not in keep:
                self.live -= _nbytes(env.pop(v))
                orig.pop(v, None)

        def read(v):
            if isinstance(v, jcore.Literal):
                return v.val, None
            return env[v], orig.get(v)

        for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
            write(v, c, None)
        for v, a, o in zip(jaxpr.invars, args, origins, strict=True):
            write(v, a, o)
        for v in [*jaxpr.constvars, *jaxpr.invars]:
            if v not in last:
                drop(v)
        for i, eqn in enumerate(jaxpr.eqns):
            pairs = [read(v) for v in eqn.invars]
            invals = [p[0] for p in pairs]
            inorig = [p[1] for p in pairs]
            here = _module_of(eqn.source_info, module)
            sub = _sub_jaxpr(eqn)
            if sub is not None:
                outs, outorig = self.run(sub, invals, inorig, here)
            else:
                outs = eqn.primitive.bind(*invals, **eqn.params)
                outs = list(outs) if eqn.primitive.multiple_results else [outs]
                outorig = self._origins(eqn, invals, inorig, outs, here)
            for v, val, o in zip(eqn.outvars, outs, outorig, strict=True):
                write(v, val, o)
            stats["peak_live_bytes"] = max(stats["peak_live_bytes"], self.live)
            for v in eqn.invars:
                if not isinstance(v, jcore.Literal) and last.get(v) == i:
                    drop(v)
        results = [read(v) for v in jaxpr.outvars]
        for v in list(env):
            keep.discard(v)
            drop(v)
        return [r[0] for r in results], [r[1] for r in results]

    def _origins(self, eqn, invals, inorig, outs, module) -> list:
        self.count += 1
        bad_in = [o for v, o in zip(invals, inorig, strict=True) if not _finite(v)]
        known = [o for o in bad_in if o is not None]
        result: list[Origin | None] = []
        created = None
        for out in outs:
            if _finite(out):
                result.append(None)
            elif known:
                result.append(min(known, key=lambda o: o.index))
            else:
                if created is None:
                    name = eqn.primitive.name
                    created = Origin(
                        index=self.count,
                        op=CANONICAL_OPS.get(name, name),
                        module=module,
                        source=_source(eqn.source_info),
                        out=array_stats(out),
                        ins=[array_stats(v) for v in invals if _numeric(v)],
                        would_be=_would_be(eqn, invals),
                    )
                result.append(created)
        return result


def _nbytes(x: Any) -> int:
    return int(getattr(x, "nbytes", 0) or 0)


def interpret(fun, *args) -> tuple[Any, Any]:
    """Runs ``fun(*args)`` op by op; returns ``(outputs, origins)`` as two
    pytrees of the output's structure (an origin is None for a finite leaf)."""
    # disable_jit: a jitted function inside the loss is traced inline, not
    # taken from the trace cache of the hot path (which has no module scopes).
    with jax.disable_jit():
        closed, shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    leaves = jax.tree_util.tree_leaves(args)
    stats["peak_live_bytes"] = 0
    outs, origins = _Interpreter().run(closed, leaves, [None] * len(leaves))
    treedef = jax.tree_util.tree_structure(shape)
    return (
        jax.tree_util.tree_unflatten(treedef, outs),
        jax.tree_util.tree_unflatten(treedef, origins),
    )


# ----------------------------------------------------------- module scopes
class module_scopes:
    """While active, every Flax module call runs in a ``jax.named_scope``
    naming its path, read back from the equations' name stacks.

    NNX: the attribute path from the outermost module called ("" for that
    root, "decoders.0.conv1" for a child), the same names as torch's
    ``named_modules()``; the ``__call__`` of every `nnx.Module` subclass is
    wrapped and restored on exit. Linen: the module's ``path`` joined with
    dots ("Dense_0", "blocks_0.lin"; "" for the root), through linen's own
    method interceptor.
    """

    def __enter__(self):
        self.patched: list[tuple[type, Any]] = []
        self.paths: dict[int, str] = {}
        self.depth = 0
        self.stack = contextlib.ExitStack()
        try:
            from flax import nnx
        except ImportError:  # no flax: plain functions only
            return self
        self._nnx = nnx
        for cls in _subclasses(nnx.Module):
            if "__call__" in vars(cls):
                orig = vars(cls)["__call__"]
                cls.__call__ = self._wrap(orig)
                self.patched.append((cls, orig))
        from flax import linen

        self.stack.enter_context(linen.intercept_methods(_linen_scope))
        return self

    def _wrap(self, orig):
        scopes = self

        def call(module, *args, **kwargs):
            if scopes.depth == 0:
                scopes._index(module)
            path = scopes.paths.get(id(module))
            if path is None:  # a module outside the root's graph: its own root
                scopes._index(module)
                path = scopes.paths.get(id(module), "")
            scopes.depth += 1
            try:
                with jax.named_scope(_MARK + path):
                    return orig(module, *args, **kwargs)
            finally:
                scopes.depth -= 1

        call.__wrapped__ = orig
        return call

    def _index(self, root) -> None:
        for path, node in self._nnx.iter_graph(root):
            if isinstance(node, self._nnx.Module):
                self.paths.setdefault(id(node), ".".join(str(p) for p in path))

    def __exit__(self, *exc):
        for cls, orig in reversed(self.patched):
            cls.__call__ = orig
        self.stack.close()
        return False


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


# ------------------------------------------------------------------- text
def kind(nan: int, inf: int) -> str:
    if nan and inf:
        return "NaN and Inf"
    return "NaN" if nan else "Inf"


def dtype_max(dtype: str) -> float:
    return float(jnp.finfo(jnp.dtype(dtype)).max)


def cause(o: Origin, where: str) -> str:
    """One line: why ``o.op`` gave a non-finite value (same text as torchref)."""
    op, ins, out = o.op, o.ins, o.out
    lim = (
        dtype_max(out.dtype)
        if jnp.issubdtype(jnp.dtype(out.dtype), jnp.floating)
        else None
    )
    exp_over = op == "exp" and ins and lim is not None and ins[0].max > math.log(lim)
    if o.would_be is not None and lim is not None and o.would_be > lim:
        text = (
            f"{out.dtype} overflow: max |x| = {o.would_be:.3g} > {lim:.6g} in "
            f"the output of {op} {where}"
        )
        if exp_over:
            text += f" (exp of up to {ins[0].max:.3g} > {math.log(lim):.4g})"
        return text
    if exp_over:  # float32 itself: no wider dtype to recompute in
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


def _first_bad(tree: Any) -> tuple[Any, Any, Stats] | None:
    """(key path, leaf, stats) of the non-finite leaf of ``tree`` whose dotted
    path sorts first. torchref uses the same rule, so both name the same leaf
    whatever their own order (pytree keys sorted here, registration order in
    torch; ``bias`` sorts before ``kernel`` as before ``weight``)."""
    bad = [
        (dotted(path), path, leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if _is_float(leaf) and not _finite(leaf)
    ]
    if not bad:
        return None
    _, path, leaf = min(bad, key=lambda item: item[0])
    return path, leaf, array_stats(leaf)


def _value_fields(s: Stats) -> dict[str, Any]:
    return {
        "shape": s.shape,
        "dtype": s.dtype,
        "nan_count": s.nan,
        "inf_count": s.inf,
        "max_abs": s.max_abs,
    }


def _origin_fields(o: Origin | None) -> dict[str, Any]:
    if o is None:
        return {"op": None, "source": None}
    return {
        "op": o.op,
        "source": o.source,
        **_value_fields(o.out),
        "input_shapes": tuple(s.shape for s in o.ins),
        "input_dtypes": tuple(s.dtype for s in o.ins),
        "input_max_abs": tuple(s.max_abs for s in o.ins),
    }


def _where(o: Origin) -> str:
    if o.module is None:
        return "in the loss"
    return f"in {o.module}" if o.module else "in the outermost module"


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


def _grads_run(step, ls, state, batch):
    with module_scopes():
        return interpret(_scaled_loss(step), ls, state.params, state.model_state, batch)


def locate(step: Any, state: Any, batch: Any, cls: type) -> Any:
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
    for tree in (state.params, state.model_state):
        bad = _first_bad(tree)
        if bad is not None:
            path, _, s = bad
            return cls(
                phase="params",
                path=dotted(path),
                op=None,
                source=None,
                detail=f"{kind(s.nan, s.inf)} in {dotted(path)} before the step "
                f"({s.nan + s.inf} of {s.size} values): the parameters or model "
                "state were already non-finite",
                **_value_fields(s),
            )
    ls = state.loss_scale
    outs, origins = _grads_run(step, ls, state, batch)
    (_, (loss, new_ms)), grads = outs
    (_, (loss_o, _)), grads_o = origins
    if loss_o is not None or not _finite(loss):
        o = loss_o
        if o is None:  # cannot happen with finite inputs; said plainly anyway
            return cls(
                phase="loss", path=None, op=None, source=None, detail="loss not finite"
            )
        phase = "loss" if o.module is None else "forward"
        return cls(
            phase=phase, path=o.module, detail=cause(o, _where(o)), **_origin_fields(o)
        )
    grads = ls.unscale(grads)
    bad = _first_bad(grads)
    if bad is not None:
        return _grad_failure(step, state, batch, bad, grads_o, cls)
    return _update_phase(state, grads, new_ms, cls)


def _grad_origin(grads_o: Any, path: Any) -> Origin | None:
    for p, o in jax.tree_util.tree_flatten_with_path(
        grads_o, is_leaf=lambda x: x is None or isinstance(x, Origin)
    )[0]:
        if p == path:
            return o
    return None


def _grad_failure(step, state, batch, bad, grads_o, cls):
    path, _, s = bad
    scale = float(np.asarray(state.loss_scale.loss_scale))
    if scale != 1.0:
        from jaxstable._src.loss_scale import StaticLossScale

        (_, _), grads1 = _grads_run(step, StaticLossScale(1.0), state, batch)[0]
        if _first_bad(grads1) is None:
            return cls(
                phase="loss_scale",
                path=dotted(path),
                detail=f"gradient overflow at loss scale {scale:.6g}, finite at "
                "scale 1 (benign: the scale backs off)",
                **_origin_fields(_grad_origin(grads_o, path)),
            )
    o = _grad_origin(grads_o, path)
    text = f"{kind(s.nan, s.inf)} in the gradient of {dotted(path)}, the loss finite"
    if o is not None:
        text += f"; it starts at {cause(o, _where(o))}"
    return cls(phase="backward", path=dotted(path), detail=text, **_origin_fields(o))


def _update_phase(state, grads, new_ms, cls):
    import optax

    tx = state.tx

    def apply(grads, opt_state, params):
        if isinstance(tx, optax.GradientTransformationExtraArgs):
            updates, new_opt = tx.update(
                grads, opt_state, params, grads_finite=jnp.asarray(True)
            )
        else:
            updates, new_opt = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt

    (params, opt_state), (params_o, _) = interpret(
        apply, grads, state.opt_state, state.params
    )
    bad = _first_bad(params)
    if bad is not None:
        path, leaf, s = bad
        o = _grad_origin(params_o, path)
        text = (
            f"{kind(s.nan, s.inf)} in {dotted(path)} after the optimizer update "
            "(gradients finite)"
        )
        if _adam_nu_zero(opt_state, path, leaf):
            text = ADAM_FP16 + f": the update of {dotted(path)} divides by 0"
        elif o is not None:
            text += f"; it starts at {cause(o, 'in the optimizer update')}"
        return cls(phase="update", path=dotted(path), detail=text, **_origin_fields(o))
    for name, tree in (("opt_state", opt_state), ("model_state", new_ms)):
        bad = _first_bad(tree)
        if bad is not None:
            path, _, s = bad
            where = f"{name}.{dotted(path)}" if dotted(path) else name
            return cls(
                phase="update",
                path=where,
                op=None,
                source=None,
                detail=f"{kind(s.nan, s.inf)} in {where} after the step "
                "(loss and gradients finite)",
                **_value_fields(s),
            )
    return None


ADAM_FP16 = (
    "Adam's second moment underflowed to 0 in float16 and its eps is 0 in "
    "float16 (eps < 6e-08 rounds to 0)"
)


def _adam_nu_zero(opt_state: Any, path: Any, new_param: Any) -> bool:
    """Whether Adam's ``nu`` for this parameter is a float16 0 exactly where
    the new parameter is non-finite: ``m / (sqrt(0) + 0)``."""
    import optax

    bad = ~np.isfinite(np.asarray(new_param, np.float64))
    states = [
        x
        for x in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
        )
        if isinstance(x, optax.ScaleByAdamState)
    ]
    for st in states:
        for p, nu in jax.tree_util.tree_flatten_with_path(st.nu)[0]:
            if p == path and nu.dtype == jnp.float16:
                return bool(np.all(np.asarray(nu, np.float64)[bad] == 0))
    return False
