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
its facts (stats, float64 recomputation) when reported, and at most
`locate_trace._LAZY` unread origins hold their op's inputs. So locate holds
about what the compiled step holds (`benchmarks/bench_locate.py`). The
traced jaxprs are kept per step, as `jax.jit` keeps its traces. The jitted
step is never touched: nothing here runs on the hot path.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from _stablecore.locate import ADAM_FP16, Stats, blame, join, kind
from _stablecore.locate import benign as _benign
from _stablecore.locate import cause as _cause
from _stablecore.locate import checked as _checked
from _stablecore.locate import origin_fields as _origin_fields
from _stablecore.locate import outcome as _core_outcome
from _stablecore.locate import same_place as _same_place
from _stablecore.locate import value_fields as _value_fields
from _stablecore.locate import where_text as _where
from jaxstable._src.locate_origins import (
    Origin,
    all_finite,
    array_module,
    array_stats,
    is_float,
    local_view,
)
from jaxstable._src.locate_trace import interpret, stats

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


def named_key(key_path: Any, root: str) -> str:
    # A bare array (params = jnp.zeros(3)) has the empty path: name the tree.
    return dotted(key_path) or root


def _masks_only(leaf: Any) -> bool:
    """Non-finite only as ``-inf``: a mask kept in the model state."""
    a = local_view(leaf)
    xp = array_module(leaf)
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
        if is_float(leaf)
        and not all_finite(leaf)
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


def check_step(step: Any) -> None:
    missing = [
        a for a in ("loss_fn", "policy", "has_state", "has_aux") if not hasattr(step, a)
    ]
    if missing:
        raise TypeError(
            "locate needs a jaxstable.train.TrainStep made by make_train_step "
            f"(it keeps the loss function), got {type(step).__name__} without "
            f"{', '.join(missing)}"
        )


def scaled_loss(step: Any):
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

    fun = scaled_loss(step)
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
    check_step(step)
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
            name = named_key(path, root)
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


UNDONATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled_finite(step: Any, state: Any, batch: Any) -> bool:
    """Whether the compiled step, run on (state, batch), was applied with a
    finite loss. A donating step is run through its own non-donating jit
    (compiled once per step), so ``state`` stays usable."""
    fn = step
    if getattr(step, "donate", False):
        fn = UNDONATED.get(step)
        if fn is None:
            fn = UNDONATED[step] = jax.jit(step.raw) if step.jit else step.raw
    _, metrics = fn(state, batch)
    return bool(metrics["finite"]) and all_finite(metrics["loss"])


def _outcome(run: _Run, ls: Any) -> tuple:
    """What a run gave (compared between a run and its re-run)."""
    if run.loss_tag is not None or not all_finite(run.loss):
        o = blame(run.loss_tag)
        return _core_outcome(False, None if o is None else o.module, None)
    bad = _first_bad(ls.unscale(run.grads))
    return _core_outcome(
        True, None, None if bad is None else named_key(bad[0], "params")
    )


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
    if run.loss_tag is not None or not all_finite(run.loss):
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
    name = named_key(path, "params")
    o = blame(run.grad_tags.get(tuple(path)))
    text = f"{kind(s.nan, s.inf)} in the gradient of {name}, the loss finite"
    if o is not None:
        text += f"; it starts at {cause(o, _where(o))}"
    return cls(phase="backward", path=name, detail=text, **_origin_fields(o))


def _update_phase(step, state, grads, run, cls):
    """``state.tx.update`` op by op, guards off (see
    `locate_trace._Interpreter`); each output leaf is checked as it is
    computed and dropped unless non-finite (or a float16 Adam ``nu``, for
    the message): no copy of the new parameters and optimizer state is held.
    The update gets what the step's does: ``value=`` the unscaled loss
    (`reduce_on_plateau` needs it) besides ``grads_finite``."""
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
        name = named_key(path, "params")
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
