"""The engine of `torchref.diagnostics.locate` (private).

The step's forward and backward are re-run on its own model under a
`TorchDispatchMode` that sees every aten op, forward and backward, as it
runs (after autocast's casts), the mirror of the jaxpr interpreter of
`jaxstable`. Every non-finite tensor carries a *tag*: which origin explains
each of its non-finite elements. An origin is the op that made elements
non-finite while the elements they were computed from were finite. Origins
are tracked per element: an element that was ``-inf`` on purpose (an
attention mask) does not hide a new overflow at another element of the
same tensor. Pointwise ops map element i to element i (masks are
broadcast); any other op is *ablated* when an intentional value or several
origins reach it (re-run with the non-finite input elements of an origin
replaced by 1: what turns finite was that origin's, what stays non-finite
is the op's own); with one unintended origin at its inputs, it keeps that
origin without a re-run. *Intentional* values are non-finite constants
written on purpose (``masked_fill(mask, -inf)``, a ``-inf`` buffer): never
blamed over a real overflow, and the NaN they make (a softmax over a fully
masked row) is named for what it is.

Tags live in a weak dictionary keyed by tensor: only tensors still alive
keep theirs. Module paths come from forward pre-hooks and wrapped public
methods: the attribute chain written at the call site (``self.dec(x)`` is
``dec`` even when ``dec`` is ``enc``), else the ``named_modules()`` name;
``_orig_mod.`` of ``torch.compile`` is dropped. A backward op gets the
forward line from autograd's anomaly-mode traceback (or the line of a
user's ``autograd.Function.backward`` running it) and the module from a tag
left on each autograd node created during that module's call.

Nothing the step can touch is changed: parameters are copied only if an op
writes to them, buffers are copied and put back, gradients are put back,
the global (CPU and CUDA) RNG and every `torch.Generator` held by a module
are restored, and the update runs one parameter at a time on copies.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import math
import sys
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from _stablecore.locate import ADAM_FP16, blame, kind
from _stablecore.locate import benign as _benign
from _stablecore.locate import cause as _cause
from _stablecore.locate import checked as _checked
from _stablecore.locate import origin_fields as _origin_fields
from _stablecore.locate import outcome as _core_outcome
from _stablecore.locate import same_place as _same_place
from _stablecore.locate import value_fields as _value_fields
from _stablecore.locate import where_text as _where
from torchref._src.locate_origins import (
    Origin,
    all_finite,
    is_float,
    nbytes,
    tensor_stats,
)
from torchref._src.locate_scopes import clean, module_hooks
from torchref._src.locate_trace import Tracer, hold, stats, storage_key
from torchref._src.step import TrainStep


def _state_bytes(state: dict):
    return (nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))


# -------------------------------------------------------------------- RNG
def _generators(model: torch.nn.Module) -> list[torch.Generator]:
    found = {}
    for module in model.modules():
        for v in vars(module).values():
            if isinstance(v, torch.Generator):
                found[id(v)] = v
    return list(found.values())


def rng_snapshot(step: Any) -> dict[str, Any]:
    """The RNG state a step starts from: the global CPU generator, every
    initialised CUDA device's, and each `torch.Generator` held as an
    attribute by a module of the step's model."""
    model = getattr(step, "model", step)
    return {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "generators": [(g, g.get_state()) for g in _generators(model)],
    }


def set_rng(snapshot: dict[str, Any]) -> None:
    torch.set_rng_state(snapshot["cpu"])
    if snapshot["cuda"] is not None:
        torch.cuda.set_rng_state_all(snapshot["cuda"])
    for g, state in snapshot["generators"]:
        g.set_state(state)


def _check_rng(rng_state: Any) -> None:
    if rng_state is not None and not (
        isinstance(rng_state, Mapping)
        and {"cpu", "cuda", "generators"} <= set(rng_state)
    ):
        raise TypeError(
            "rng_state must be None or what torchref.diagnostics.rng_snapshot(step) "
            f"returns, got {type(rng_state).__name__}"
        )


# ------------------------------------------------------------------- text


def dtype_max(dtype: str) -> float | None:
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        return None
    return float(torch.finfo(dt).max)


def cause(o: Origin, where: str) -> str:
    """One line: why ``o.op`` gave a non-finite value (in float dtypes' limits)."""
    return _cause(o, where, dtype_max)


# ------------------------------------------------------------------ phases
def leaves(tree: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor]]:
    """``(key path, tensor)`` of every tensor in a nested mapping/sequence."""
    if isinstance(tree, torch.Tensor):
        return [(path, tree)]
    if isinstance(tree, Mapping):
        return [x for k, v in tree.items() for x in leaves(v, (*path, k))]
    if isinstance(tree, list | tuple):
        return [x for i, v in enumerate(tree) for x in leaves(v, (*path, i))]
    return []


def _masks_only(t: torch.Tensor) -> bool:
    """Non-finite only as ``-inf``: a mask kept in a buffer."""
    w = t.detach()
    return not bool(torch.isnan(w).any()) and not bool((w == math.inf).any())


def _first_bad(items: list[tuple[Any, torch.Tensor]], masks_ok: bool = False):
    """(path, tensor, stats) of the non-finite tensor whose dotted path sorts
    first: the rule of jaxstable's locate, so both name the same leaf
    whatever their own order (registration order here, sorted keys there).
    With ``masks_ok``, a tensor whose only non-finite values are ``-inf``
    (a mask) does not count."""
    bad = [
        (path, t)
        for path, t in items
        if is_float(t) and not all_finite(t) and not (masks_ok and _masks_only(t))
    ]
    if not bad:
        return None
    path, t = min(bad, key=lambda item: dotted_name(item[0]))
    return path, t, tensor_stats(t)


def dotted_name(path: Any) -> str:
    return ".".join(map(str, path)) if isinstance(path, tuple) else str(path)


def scale_of(step: Any) -> float:
    scaler = step.scaler
    if scaler is None or not scaler.is_enabled():
        return 1.0
    return float(scaler.get_scale())


def named_parameters(step: Any) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters (``_orig_mod`` dropped), then those the
    optimizer holds beyond them (a loss-side temperature): named by the
    group's ``param_names`` when given, else ``param_groups.G.params.I``."""
    out, seen = [], set()
    for name, p in step.model.named_parameters():
        out.append((clean(name), p))
        seen.add(id(p))
    for gi, group in enumerate(step.optimizer.param_groups):
        names = group.get("param_names")
        for pi, p in enumerate(group["params"]):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(
                    (names[pi] if names else f"param_groups.{gi}.params.{pi}", p)
                )
    return out


class _Run(NamedTuple):
    loss: torch.Tensor
    loss_tag: Any
    grads: dict[str, torch.Tensor]
    grad_tags: dict[str, Any]
    buffer_bad: Any  # (name, tensor, stats) of a buffer the forward made non-finite


@contextlib.contextmanager
def grads_put_back(params: list[tuple[str, torch.Tensor]]):
    grads = [p.grad for _, p in params]
    for _, p in params:
        p.grad = None
    try:
        yield
    finally:
        for (_, p), g in zip(params, grads, strict=True):
            p.grad = g


def eager_compiled():
    """A `torch.compile`d model runs eagerly (its ops seen one by one). No
    compiled model exists unless dynamo was imported (importing it costs
    1.5 s)."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def _run(step: Any, batch: Any, scale: float, rng_state, params) -> _Run:
    """Forward and backward of the step at ``scale``, on its own model (a
    ``loss_fn`` may close over it instead of using its argument), with every
    side effect undone: buffers (batch-norm statistics, non-persistent ones
    too) copied and put back, a parameter copied the first time an op
    writes to it and put back, gradients put back."""
    model = step.model
    watched = {}
    for _, p in params:
        key = storage_key(p)
        if key is not None:
            watched[key] = p
    tracer = Tracer(watched, sources=True)
    buffers = [(clean(n), b, b.detach().clone()) for n, b in model.named_buffers()]
    tracer.base = sum(nbytes(c) for _, _, c in buffers)
    tracer.account()
    autocast = (
        torch.autocast(step.device_type, dtype=step.autocast_dtype)
        if step.autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with warnings.catch_warnings(), grads_put_back(params):
        warnings.simplefilter("ignore")  # shown once already, when the step ran
        if rng_state is not None:
            set_rng(rng_state)
        try:
            with eager_compiled(), module_hooks(model, tracer), tracer:
                with autocast:
                    out = step.loss_fn(model, batch)
                tracer.name_nodes()
                loss = out[0] if isinstance(out, tuple) else out
                loss_tag = tracer.tags.get(loss)
                if all_finite(loss) and loss.requires_grad:
                    scaled = loss if scale == 1.0 else loss.float() * scale
                    scaled.backward()
            grads = {n: p.grad for n, p in params if p.grad is not None}
            grad_tags = {n: tracer.tags.get(g) for n, g in grads.items()}
            tracer.base += sum(nbytes(g) for g in grads.values())
            tracer.account()
            buffer_bad = _first_bad([(n, b) for n, b, _ in buffers], masks_ok=True)
        finally:
            with torch.no_grad():
                for _, b, saved in buffers:
                    b.copy_(saved)
                for p, saved in tracer.saved.values():
                    p.copy_(saved)
    return _Run(loss.detach(), loss_tag, grads, grad_tags, buffer_bad)


def check_locate_args(step: Any, rng_state: Any) -> None:
    """A `TrainStep`, and an RNG state `rng_snapshot` made (or None)."""
    if not isinstance(step, TrainStep):
        raise TypeError(
            f"locate needs a torchref.train.TrainStep, got {type(step).__name__}"
        )
    _check_rng(rng_state)


def locate(
    step: Any, batch: Any, cls: type, loss_scale: float | None = None, rng_state=None
) -> Any:
    check_locate_args(step, rng_state)
    bad = _first_bad(leaves(batch))
    if bad is not None:
        path, _, s = bad
        name = "batch" + "".join(f"[{k!r}]" for k in path)
        return cls(
            phase="input",
            path=".".join(map(str, path)) or None,
            op=None,
            source=None,
            detail=f"{kind(s.nan, s.inf)} in {name} "
            f"({s.nan + s.inf} of {s.size} values)",
            **_value_fields(s),
        )
    params = named_parameters(step)
    buffers = [(clean(n), b) for n, b in step.model.named_buffers()]
    bad = _first_bad(params) or _first_bad(buffers, masks_ok=True)
    if bad is not None:
        path, _, s = bad
        return cls(
            phase="params",
            path=path,
            op=None,
            source=None,
            detail=f"{kind(s.nan, s.inf)} in {path} before the step "
            f"({s.nan + s.inf} of {s.size} values): the parameters or model "
            "state were already non-finite",
            **_value_fields(s),
        )
    scale = scale_of(step) if loss_scale is None else float(loss_scale)
    stats["peak_live_bytes"] = stats["peak_tagged_bytes"] = 0
    now = rng_snapshot(step)
    try:
        # every run (and re-run) starts from the same random state
        rng = now if rng_state is None else rng_state
        return _locate_step(step, batch, cls, scale, rng, params)
    finally:
        set_rng(now)


def _outcome(run: _Run) -> tuple:
    """What a run gave (compared between a run and its re-run)."""
    if run.loss_tag is not None or not all_finite(run.loss):
        o = blame(run.loss_tag)
        return _core_outcome(False, None if o is None else o.module, None)
    bad = _first_bad(list(run.grads.items()))
    return _core_outcome(True, None, None if bad is None else bad[0])


def _locate_step(step, batch, cls, scale, rng_state, params) -> Any:
    """The traced run at ``scale``, its finding, and the re-runs that check
    it (see `NonFiniteLocation.reproduced`): a fault that strikes at random
    (a flaky kernel, torch's own non-determinism, hardware) is not given a
    cause from one run."""

    def again(at):
        return _outcome(_run(step, batch, at, rng_state, params))

    run = _run(step, batch, scale, rng_state, params)
    seen = _outcome(run)
    if seen[0] == "finite":
        loc = _update_phase(step, run, scale, params, cls)
        if loc is None:
            return None
        del run
        rerun = _run(step, batch, scale, rng_state, params)
        same = _outcome(rerun)[0] == "finite" and _same_place(
            _update_phase(step, rerun, scale, params, cls), loc
        )
        return _checked(loc, scale, 1, int(same))
    loc = _failure(run, cls)
    del run
    agreed = int(again(scale) == seen)
    if agreed and seen[0] == "gradients" and scale != 1.0:
        one = again(1.0)
        if one[0] == "finite":
            agreed += again(1.0) == one
            if agreed == 2:
                return _checked(_benign(loc, scale), scale, 2, 2)
            return _checked(loc, scale, 2, agreed)
    return _checked(loc, scale, 1, agreed)


def _failure(run: _Run, cls: type) -> Any:
    """The location of a run's non-finite loss or gradient, with its cause."""
    if run.loss_tag is not None or not all_finite(run.loss):
        o = blame(run.loss_tag)
        if o is None:
            return cls(
                phase="loss", path=None, op=None, source=None, detail="loss not finite"
            )
        phase = "loss" if o.module is None else "forward"
        return cls(
            phase=phase, path=o.module, detail=cause(o, _where(o)), **_origin_fields(o)
        )
    path, _, s = _first_bad(list(run.grads.items()))
    o = blame(run.grad_tags.get(path))
    text = f"{kind(s.nan, s.inf)} in the gradient of {path}, the loss finite"
    if o is not None:
        text += f"; it starts at {cause(o, _where(o))}"
    return cls(phase="backward", path=path, detail=text, **_origin_fields(o))


@contextlib.contextmanager
def _grads_swapped(params, grads: dict):
    saved = [p.grad for _, p in params]
    try:
        for n, p in params:
            p.grad = grads.get(n)
        yield
    finally:
        for (_, p), g in zip(params, saved, strict=True):
            p.grad = g


def _optimizer_for(opt, group: dict, p: torch.Tensor, state: dict, name: str):
    """A shallow twin of ``opt`` stepping ``p`` alone with ``state``: its
    class's ``step`` (not an instance-level wrapper, such as an LR
    scheduler's, which would step the real optimizer), no step hooks."""
    twin = object.__new__(type(opt))
    twin.__dict__.update(opt.__dict__)
    twin.__dict__.pop("step", None)
    twin.param_groups = [{**group, "params": [p]}]
    if "param_names" in group:
        twin.param_groups[0]["param_names"] = [name]
    twin.state = collections.defaultdict(dict)
    if state:
        twin.state[p] = state
    twin._optimizer_step_pre_hooks = collections.OrderedDict()
    twin._optimizer_step_post_hooks = collections.OrderedDict()
    return twin


def _update_phase(step: Any, run: _Run, scale: float, params, cls: type) -> Any:
    """The optimizer update (with the step's clipping) one parameter at a
    time, on a copy of that parameter and its state: exact for the
    per-parameter optimizers (every `torch.optim` one but LBFGS), with the
    memory of the largest parameter and its state, not of the model. Then
    the first parameter (by name) the update made non-finite is stepped once
    more under the tracer, for the op that did it."""
    opt = step.optimizer
    grads = dict(run.grads)  # the re-run's own tensors: unscaled in place
    if scale != 1.0:
        with torch.no_grad():
            for g in grads.values():
                g.div_(scale)
    held = sum(nbytes(g) for g in grads.values())
    if step.clip is not None:
        with _grads_swapped(params, grads):
            step.clip([p for n, p in params if n in grads])
    first_param, first_state = _first_bad_update(opt, params, grads, held)
    if first_param is not None:
        return _traced_update(opt, first_param, grads, held, cls)
    bad = first_state
    if bad is None and run.buffer_bad is not None:
        bad = (f"model_state.{run.buffer_bad[0]}", run.buffer_bad[1])
    if bad is None:
        return None
    path, s = bad[0], tensor_stats(bad[1])
    return cls(
        phase="update",
        path=path,
        op=None,
        source=None,
        detail=f"{kind(s.nan, s.inf)} in {path} after the step "
        "(loss and gradients finite)",
        **_value_fields(s),
    )


def _first_bad_update(opt, params, grads: dict, held: int) -> tuple:
    """``(first_param, first_state)``: ``(name, group, parameter)`` of the
    first parameter (by name) the update made non-finite, and ``(path,
    tensor)`` of the first optimizer state tensor it did (None: none)."""
    names = {id(p): n for n, p in params}
    first_param = first_state = None
    for group in opt.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            if name not in grads:
                continue
            twin_p, state = _twin_step(opt, group, p, name, grads[name], held)
            if not all_finite(twin_p) and (
                first_param is None or name < first_param[0]
            ):
                first_param = (name, group, p)
            for k, v in state.items():
                where = f"opt_state.{name}.{k}"
                if isinstance(v, torch.Tensor) and not all_finite(v):
                    if first_state is None or where < first_state[0]:
                        first_state = (where, v)
            del twin_p, state
    return first_param, first_state


def _traced_update(opt, first_param: tuple, grads: dict, held: int, cls: type):
    """The update of ``first_param`` stepped once more under the tracer: its
    location, with the op that made it non-finite."""
    name, group, p = first_param
    tracer = Tracer()
    twin_p, state = _twin_step(opt, group, p, name, grads[name], held, tracer)
    s, o = tensor_stats(twin_p), blame(tracer.tags.get(twin_p))
    text = (
        f"{kind(s.nan, s.inf)} in {name} after the optimizer update (gradients finite)"
    )
    if _adam_nu_zero(state, twin_p):
        text = ADAM_FP16 + f": the update of {name} divides by 0"
    elif o is not None:
        text += f"; it starts at {cause(o, 'in the optimizer update')}"
    return cls(phase="update", path=name, detail=text, **_origin_fields(o))


def _twin_step(opt, group, p, name, grad, held, tracer=None):
    """``opt``'s step for ``p`` alone, on a copy of it and of its state
    (under ``tracer`` when given): the new copy and its new state."""
    twin_p = p.detach().clone().requires_grad_(p.requires_grad)
    twin_p.grad = grad
    state = {
        k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        for k, v in opt.state.get(p, {}).items()
    }
    twin = _optimizer_for(opt, group, twin_p, state, name)
    hold(held + nbytes(twin_p) + sum(_state_bytes(state)))
    with tracer if tracer is not None else contextlib.nullcontext():
        type(opt).step(twin)
    return twin_p, twin.state.get(twin_p, {})


def _adam_nu_zero(state: dict, p: torch.Tensor) -> bool:
    """Whether Adam's ``exp_avg_sq`` of ``p`` is a float16 0 exactly where
    ``p`` became non-finite: ``m / (sqrt(0) + 0)``."""
    nu = state.get("exp_avg_sq")
    if not isinstance(nu, torch.Tensor) or nu.dtype != torch.float16:
        return False
    bad = ~torch.isfinite(p.detach())
    return bool((nu[bad] == 0).all())
