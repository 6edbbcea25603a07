"""`locate` of a step whose state or batch is split over several processes.

Each process checks its own shards; only small records cross processes
(docs/locate.md, "Across processes"). `diagnostics.locate` calls
`locate_sharded` when `locate_shards.is_sharded` holds for the state and
the batch; the single-process engine is `_locate`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from _stablecore.locate import benign as _benign
from _stablecore.locate import checked as _checked
from _stablecore.locate import join, kind
from _stablecore.locate import origin_fields as _origin_fields
from _stablecore.locate import value_fields as _value_fields
from _stablecore.locate import where_text as _where
from jaxstable._src._locate import (
    UNDONATED,
    cause,
    check_step,
    dotted,
    named_key,
    scaled_loss,
)


def _named_leaves(tree: Any, root: str) -> list[tuple[str, Any]]:
    return [
        (named_key(p, root), x)
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _whole_step(step: Any, tx: Any):
    """The step's computation as one function: ``(ls, params, model_state,
    opt_state, batch) -> (loss, grads, new params, new opt_state, new
    model_state)``, the gradients unscaled, the update as `_update_phase`
    runs it."""
    import optax

    vag = scaled_loss(step)

    def whole(ls, params, model_state, opt_state, batch):
        (_, (loss, new_ms)), grads = vag(ls, params, model_state, batch)
        grads = ls.unscale(grads)
        if isinstance(tx, optax.GradientTransformationExtraArgs):
            updates, new_opt = tx.update(
                grads, opt_state, params, grads_finite=jnp.asarray(True), value=loss
            )
        else:
            updates, new_opt = tx.update(grads, opt_state, params)
        return loss, grads, optax.apply_updates(params, updates), new_opt, new_ms

    return whole


def _sharded_inputs(state: Any, batch: Any, cls: type) -> Any:
    """The input and params phases, each process checking its own shards."""
    from jaxstable._src.locate_shards import first_bad_named, where_devices

    bad = first_bad_named(_named_leaves(batch, ""))
    if bad is not None:
        name, _, s, rows = bad
        return cls(
            phase="input",
            path=name or None,
            op=None,
            source=None,
            detail=f"{kind(s.nan, s.inf)} in batch {name or '(the whole batch)'} "
            f"({s.nan + s.inf} of {s.size} values){where_devices(rows)}",
            **_value_fields(s),
        )
    for tree, root, masks_ok in (
        (state.params, "params", False),
        (state.model_state, "model_state", True),
    ):
        bad = first_bad_named(_named_leaves(tree, root), masks_ok)
        if bad is not None:
            name, _, s, rows = bad
            return cls(
                phase="params",
                path=name,
                op=None,
                source=None,
                detail=f"{kind(s.nan, s.inf)} in {name} before the step "
                f"({s.nan + s.inf} of {s.size} values){where_devices(rows)}: the "
                "parameters or model state were already non-finite",
                **_value_fields(s),
            )
    return None


def _sharded_target(c: Any) -> tuple | None:
    """``(phase, path, value id)`` of the first bad output of a counted run
    of `_whole_step`: the loss, then the first gradient, new parameter,
    optimizer state and model state leaf by name (a model state holding
    ``-inf`` only is a mask)."""
    groups: dict[int, list] = {}
    paths = jax.tree_util.tree_flatten_with_path(c.shape)[0]
    for (path, _), v in zip(paths, c.outs, strict=True):
        if v >= 0 and c.counts[v].any():
            nan, pinf, _ = c.counts[v]
            if path[0].idx == 4 and not (nan or pinf):
                continue
            groups.setdefault(path[0].idx, []).append((dotted(path[1:]), v))
    for idx, phase, root in (
        (0, "loss", None),
        (1, "backward", "params"),
        (2, "update", "params"),
        (3, "update", "opt_state"),
        (4, "update", "model_state"),
    ):
        if idx in groups:
            name, v = min(groups[idx])
            if root in ("opt_state", "model_state"):
                name = join(root, [name])
            return phase, (name or root), v
    return None


def _sharded_location(c: Any, cls: type) -> Any:
    from jaxstable._src.locate_shards import describe, origin_of, where_devices

    found = _sharded_target(c)
    if found is None:
        return None
    phase, path, v = found
    nan, pinf, ninf = (int(x) for x in c.counts[v])
    index, hint = origin_of(c, v)
    o = rows = None
    if index is not None:
        o, rows = describe(c, index, hint)
    at = (
        ""
        if o is None
        else cause(o, _where(o) if phase != "update" else "in the optimizer update")
    )
    at += where_devices(rows or [])
    if phase == "loss":
        if o is None:
            return cls(
                phase="loss",
                path=None,
                op=None,
                source=None,
                detail="loss not finite" + at,
            )
        return cls(
            phase="loss" if o.module is None else "forward",
            path=o.module,
            detail=at,
            **_origin_fields(o),
        )
    what = "the gradient of " if phase == "backward" else ""
    text = f"{kind(nan, pinf + ninf)} in {what}{path}"
    text += ", the loss finite" if phase == "backward" else " after the step"
    if o is not None:
        text += f"; it starts at {at}"
    return cls(phase=phase, path=path, detail=text, **_origin_fields(o))


def _sharded_finite(step: Any, state: Any, batch: Any) -> bool:
    from jaxstable._src.locate_shards import host_scalar

    fn = step
    if getattr(step, "donate", False):
        fn = UNDONATED.get(step)
        if fn is None:
            fn = UNDONATED[step] = jax.jit(step.raw)
    _, metrics = fn(state, batch)
    loss = host_scalar(metrics["loss"])
    return bool(host_scalar(metrics["finite"])) and bool(np.isfinite(loss).all())


def locate_sharded(step: Any, state: Any, batch: Any, cls: type, finite=None) -> Any:
    """`locate` of a step whose arrays span several processes, no value
    gathered (see `jaxstable._src.locate_shards`); every process calls it
    and gets the same answer."""
    from jaxstable._src import locate_shards as shards
    from jaxstable._src.loss_scale import StaticLossScale

    check_step(step)
    shards.stats["exchanged_bytes"] = 0
    loc = _sharded_inputs(state, batch, cls)
    if loc is not None:
        return loc
    if finite is None:
        finite = _sharded_finite(step, state, batch)
    if finite:
        return None
    ls, scale = state.loss_scale, float(shards.host_scalar(state.loss_scale.loss_scale))
    fun = _whole_step(step, state.tx)

    def run(at):
        args = (at, state.params, state.model_state, state.opt_state, batch)
        c = shards.count(fun, args, (step, "sharded", state.tx))
        found = _sharded_target(c)
        return c, None if found is None else (*found[:2], shards.origin_of(c, found[2]))

    c, seen = run(ls)
    if seen is None:
        return None
    loc = _sharded_location(c, cls)
    del c
    agreed = int(run(ls)[1] == seen)
    if agreed and seen[0] == "backward" and scale != 1.0:
        one = run(StaticLossScale(1.0))[1]
        if one is None:
            agreed += run(StaticLossScale(1.0))[1] is None
            if agreed == 2:
                return _checked(_benign(loc, scale), scale, 2, 2)
            return _checked(loc, scale, 2, agreed)
    return _checked(loc, scale, 1, agreed)
