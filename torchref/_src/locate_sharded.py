"""`locate` of a DDP or FSDP2 step, every rank at once.

Each rank checks its own rows and shards; only small records cross ranks
(docs/locate.md, "Across processes"). `diagnostics.locate` calls
`locate_sharded` when `locate_shards.distributed_kind` names the step's
wrapper; the single-process engine is `_locate`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from _stablecore.locate import kind
from _stablecore.locate import origin_fields as _origin_fields
from _stablecore.locate import value_fields as _value_fields
from _stablecore.locate import where_text as _where
from torchref._src._locate import (
    cause,
    dotted_name,
    eager_compiled,
    grads_put_back,
    leaves,
    rng_snapshot,
    set_rng,
)
from torchref._src.locate_origins import all_finite
from torchref._src.locate_scopes import clean, module_hooks


def _sharded_inputs(step: Any, model: Any, batch: Any, cls: type) -> Any:
    """The input and params phases, each rank checking its own values."""
    from torchref._src.locate_shards import first_named, ranks_text

    found = first_named([(dotted_name(p), t) for p, t in leaves(batch)])
    if found is not None:
        name, s, ranks = found
        return cls(
            phase="input",
            path=name or None,
            op=None,
            source=None,
            detail=f"{kind(s.nan, s.inf)} in batch {name or '(the whole batch)'} "
            f"({s.nan + s.inf} of {s.size} values on the rank){ranks_text(ranks)}",
            **_value_fields(s),
        )
    params = [(clean(n), p) for n, p in model.named_parameters()]
    buffers = [(clean(n), b) for n, b in model.named_buffers()]
    found = first_named(params) or first_named(buffers, masks_ok=True)
    if found is None:
        return None
    name, s, ranks = found
    return cls(
        phase="params",
        path=name,
        op=None,
        source=None,
        detail=f"{kind(s.nan, s.inf)} in {name} before the step "
        f"({s.nan + s.inf} of {s.size} values on the rank){ranks_text(ranks)}: "
        "the parameters or model state were already non-finite",
        **_value_fields(s),
    )


def _sharded_run(step: Any, model: Any, batch: Any, scale: float, rng_state) -> dict:
    """Forward, then backward (on every rank, as the step: FSDP2's are
    collectives) at the
    step's scale per rank (``scale / world``, as `TrainStep` backpropagates
    under DDP and FSDP2), under `locate_shards.FirstBad`; side effects
    undone. This rank's record: the first bad op, whether its loss was
    finite, its first non-finite gradient (local values)."""
    from torchref._src.locate_shards import FirstBad, exchange, first_named, local

    params = [(clean(n), p) for n, p in model.named_parameters()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    tracer = FirstBad()
    world = torch.distributed.get_world_size()
    with warnings.catch_warnings(), grads_put_back(params):
        warnings.simplefilter("ignore")
        if rng_state is not None:
            set_rng(rng_state)
        try:
            with eager_compiled(), module_hooks(model, tracer), tracer:
                out = step.loss_fn(model, batch)
                tracer.name_nodes()
                loss = out[0] if isinstance(out, tuple) else out
                loss_ok = all_finite(local(loss))
                every = exchange(loss_ok)
                if loss.requires_grad:  # on every rank, as the step (FSDP2)
                    (loss.float() * (scale / world)).backward()
            grads = [(n, p.grad) for n, p in params if p.grad is not None]
            bad_grad = first_named(grads) if all(every) else None
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
    return {"first": tracer.first, "losses": every, "bad_grad": bad_grad}


def locate_sharded(step: Any, batch: Any, cls: type, scale: float, rng_state) -> Any:
    """`locate` of a DDP or FSDP2 step in a process group of several ranks,
    no parameter, gradient or activation gathered (see
    `torchref._src.locate_shards`); every rank calls it (with its own rows)
    and gets the same answer."""
    from torchref._src import locate_shards as shards

    shards.stats["exchanged_bytes"] = 0
    kind_of = shards.distributed_kind(step)
    model = step._replicas.ddp.module if kind_of == "ddp" else step.model
    loc = _sharded_inputs(step, model, batch, cls)
    if loc is not None:
        return loc
    now = rng_snapshot(step)
    try:
        run = _sharded_run(
            step, model, batch, scale, now if rng_state is None else rng_state
        )
    finally:
        set_rng(now)
    firsts = shards.exchange(run["first"])
    if not all(run["losses"]):
        ranks = [r for r, ok in enumerate(run["losses"]) if not ok]
        phase_of = "forward"
    elif run["bad_grad"] is not None:
        ranks, phase_of = None, "backward"
    else:
        return None  # the update phase is not located across ranks
    cands = [
        (r, f)
        for r, f in enumerate(firsts)
        if f is not None and (ranks is None or r in ranks)
    ]
    o = shards.origin(cands[0][1]) if cands else None
    where = shards.ranks_text([r for r, _ in cands])
    if phase_of == "forward":
        if o is None:
            return cls(
                phase="loss",
                path=None,
                op=None,
                source=None,
                detail="loss not finite" + shards.ranks_text(ranks),
            )
        phase = "loss" if o.module is None else "forward"
        return cls(
            phase=phase,
            path=o.module,
            detail=cause(o, _where(o)) + where,
            **_origin_fields(o),
        )
    name, s, _ = run["bad_grad"]
    text = f"{kind(s.nan, s.inf)} in the gradient of {name}, the loss finite"
    if o is not None:
        text += f"; it starts at {cause(o, _where(o))}{where}"
    return cls(phase="backward", path=name, detail=text, **_origin_fields(o))
