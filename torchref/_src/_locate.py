"""The engine of `torchref.diagnostics.locate` (private).

The step is re-run on its own model (its parameters, buffers and gradients
put back afterwards; the update runs on a deep copy of model and optimizer)
under a `TorchDispatchMode` that sees every aten op, forward and
backward, as it runs (after autocast's casts). Every non-finite tensor
carries its *origin*: the first op whose output went non-finite while its
own inputs were finite (or, when an input already was non-finite, that
input's origin), the mirror of the jaxpr interpreter of `jaxstable`. The
origins live in a weak dictionary keyed by tensor: only tensors still alive
keep theirs, so memory stays that of the step itself. Module paths come from
forward hooks (``named_modules()`` names); backward ops get the
forward source line from autograd's anomaly-mode traceback and the module
from a tag left on each autograd node by the module that created it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import re
import sys
import sysconfig
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

# Op names as people say them, the same words as jaxstable's.
CANONICAL_OPS = {
    **dict.fromkeys(
        ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "dot"),
        "matmul",
    ),
    **dict.fromkeys(
        ("convolution", "_convolution", "conv2d", "mkldnn_convolution"), "conv"
    ),
    **dict.fromkeys(("_to_copy", "to", "_to_dtype", "copy"), "cast"),
    "true_divide": "div",
    "amax": "max",
    "amin": "min",
}
_LIB_MARKERS = (
    "site-packages",
    "dist-packages",
    os.sep + os.path.join("torchref", "_src") + os.sep,
)
_STDLIB = sysconfig.get_paths()["stdlib"]
_MODULE_TAG = "torchref.locate.module"
_FRAME = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+), in (?P<func>\S+)')
_LOW = (torch.float16, torch.bfloat16)


class Stats(NamedTuple):
    """Shape, dtype and the finite-value facts of one tensor."""

    shape: tuple[int, ...]
    dtype: str
    nan: int
    inf: int
    max_abs: float  # over finite elements; nan when none
    max: float  # largest finite (real part) value; nan when none
    zeros: int
    negatives: int
    size: int


def tensor_stats(t: torch.Tensor) -> Stats:
    w = t.detach().to("cpu", torch.float64)
    nan = torch.isnan(w)
    inf = torch.isinf(w)
    fin = w[~(nan | inf)]
    return Stats(
        shape=tuple(t.shape),
        dtype=str(t.dtype).removeprefix("torch."),
        nan=int(nan.sum()),
        inf=int(inf.sum()),
        max_abs=float(fin.abs().max()) if fin.numel() else float("nan"),
        max=float(fin.max()) if fin.numel() else float("nan"),
        zeros=int((fin == 0).sum()),
        negatives=int((fin < 0).sum()),
        size=int(w.numel()),
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


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _finite(t: Any) -> bool:
    return not _is_float(t) or bool(torch.isfinite(t.detach()).all())


def format_frame(file_name: str, line: int, function: str) -> str:
    """``file:line in function`` (the same format as jaxstable's)."""
    rel = os.path.relpath(file_name)
    name = rel if not rel.startswith("..") else file_name
    return f"{name}:{line} in {function.split('.')[-1]}"


def _is_user(file_name: str) -> bool:
    return not (
        any(m in file_name for m in _LIB_MARKERS)
        or file_name.startswith(_STDLIB)
        or file_name.startswith("<")
    )


def _python_source() -> str | None:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back  # the dispatch mode's own frames
    while frame is not None:
        code = frame.f_code
        if code.co_filename == __file__:
            return None  # reached locate itself: no user code issued the op
        if _is_user(code.co_filename):
            return format_frame(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


def _node_source(node: Any) -> str | None:
    """The forward line that created an autograd node (anomaly-mode traceback)."""
    stack = node.metadata.get("traceback_") if node is not None else None
    for entry in reversed(stack or []):
        m = _FRAME.search(entry)
        if m and _is_user(m["file"]):
            return format_frame(m["file"], int(m["line"]), m["func"])
    return None


def _would_be(func: Any, args: tuple, kwargs: dict, ins: list) -> float | None:
    """max |output| with the low-precision inputs upcast to float32: tells an
    overflow (finite in float32) from a division by zero or a log of 0."""
    name = func.overloadpacket.__name__
    if CANONICAL_OPS.get(name) == "cast":
        x = ins[0] if ins else None
        return None if x is None or not _finite(x) else tensor_stats(x).max_abs
    if func._schema.is_mutable or not any(t.dtype in _LOW for t in ins if _is_float(t)):
        return None

    def up(a):
        return a.float() if _is_float(a) and a.dtype in _LOW else a

    kw = {k: (torch.float32 if v in _LOW else up(v)) for k, v in kwargs.items()}
    try:
        out = func(*[up(a) for a in args], **kw)
    except Exception:  # an op that refuses the upcast: no estimate
        return None
    out = out[0] if isinstance(out, tuple | list) else out
    if not isinstance(out, torch.Tensor) or not _finite(out):
        return None
    return float(out.detach().abs().max().double()) if out.numel() else None


class Tracer(TorchDispatchMode):
    """Records the origin of every non-finite tensor (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.origins = WeakTensorKeyDictionary()
        self.count = 0
        self.stack: list[str] = []  # module paths being run (forward hooks)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = [
            t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        ]
        mutable = func._schema.is_mutable
        pre_bad = [t for t in ins if not _finite(t)] if mutable else None
        # An in-place op overwrites its input: keep the values it read.
        before = [t.detach().clone() for t in ins] if mutable else ins
        out = func(*args, **kwargs)
        self.count += 1
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        bad_out = [t for t in outs if not _finite(t)]
        if not bad_out:
            return out
        bad_in = pre_bad if mutable else [t for t in ins if not _finite(t)]
        known = [self.origins.get(t) for t in bad_in]
        known = [o for o in known if o is not None]
        if known:
            origin = min(known, key=lambda o: o.index)
        else:
            origin = self._new(func, args, kwargs, before, bad_out[0])
        for t in bad_out:
            self.origins[t] = origin
        return out

    def _new(self, func, args, kwargs, ins, out) -> Origin:
        name = func.overloadpacket.__name__.rstrip("_") or "op"
        node = torch._C._current_autograd_node()
        if node is not None:  # a backward op: the forward's line and module
            source, module = _node_source(node), node.metadata.get(_MODULE_TAG)
        else:
            source = _python_source()
            module = self.stack[-1] if self.stack else None
        return Origin(
            index=self.count,
            op=CANONICAL_OPS.get(name, name),
            module=module,
            source=source,
            out=tensor_stats(out),
            ins=[tensor_stats(t) for t in ins if _is_float(t)],
            would_be=_would_be(func, args, kwargs, ins),
        )


@contextlib.contextmanager
def module_hooks(model: torch.nn.Module, tracer: Tracer):
    """Keeps ``tracer.stack`` at the running module's ``named_modules()``
    path and tags the autograd nodes each module created with its path."""

    def pre(name):
        def hook(module, args):
            tracer.stack.append(name)

        return hook

    def post(name):
        def hook(module, args, output):
            tracer.stack.pop()
            _tag_nodes(output, name)

        return hook

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name)))
        handles.append(module.register_forward_hook(post(name), always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _tag_nodes(output: Any, name: str) -> None:
    # Inner modules finish first: their nodes are tagged already and stop
    # the walk, so each node keeps the innermost module that made it.
    todo = [t.grad_fn for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    while todo:
        node = todo.pop()
        if node is None or _MODULE_TAG in node.metadata:
            continue
        node.metadata[_MODULE_TAG] = name
        todo.extend(n for n, _ in node.next_functions)


# ------------------------------------------------------------------- text
def kind(nan: int, inf: int) -> str:
    if nan and inf:
        return "NaN and Inf"
    return "NaN" if nan else "Inf"


def dtype_max(dtype: str) -> float | None:
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        return None
    return float(torch.finfo(dt).max)


def cause(o: Origin, where: str) -> str:
    """One line: why ``o.op`` gave a non-finite value (same text as jaxstable)."""
    op, ins, out = o.op, o.ins, o.out
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
def leaves(tree: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor]]:
    """``(key path, tensor)`` of every tensor in a nested mapping/sequence."""
    if isinstance(tree, torch.Tensor):
        return [(path, tree)]
    if isinstance(tree, Mapping):
        return [x for k, v in tree.items() for x in leaves(v, (*path, k))]
    if isinstance(tree, list | tuple):
        return [x for i, v in enumerate(tree) for x in leaves(v, (*path, i))]
    return []


def _first_bad(items: list[tuple[Any, torch.Tensor]]):
    """(path, tensor, stats) of the non-finite tensor whose dotted path sorts
    first: the rule of jaxstable's locate, so both name the same leaf
    whatever their own order (registration order here, sorted keys there)."""
    bad = [(path, t) for path, t in items if _is_float(t) and not _finite(t)]
    if not bad:
        return None
    path, t = min(bad, key=lambda item: _dotted(item[0]))
    return path, t, tensor_stats(t)


def _dotted(path: Any) -> str:
    return ".".join(map(str, path)) if isinstance(path, tuple) else str(path)


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


@contextlib.contextmanager
def _rng_kept():
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _scale_of(step: Any) -> float:
    scaler = step.scaler
    if scaler is None or not scaler.is_enabled():
        return 1.0
    return float(scaler.get_scale())


class _Run(NamedTuple):
    loss: torch.Tensor
    loss_origin: Origin | None
    grads: list[tuple[str, torch.Tensor]]
    grad_origins: dict[str, Origin | None]
    buffers: list[tuple[str, torch.Tensor]]  # after the forward


@contextlib.contextmanager
def _model_kept(model: torch.nn.Module):
    """Runs on the step's own model (a ``loss_fn`` may close over it instead
    of using its argument) and puts back its parameters, buffers (batch-norm
    statistics) and gradients afterwards."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(saved[k])
        for p, g in zip(params, grads, strict=True):
            p.grad = g


def _run(step: Any, batch: Any, scale: float) -> _Run:
    """Forward and backward of the step at ``scale``, side effects undone."""
    model = step.model
    tracer = Tracer()
    autocast = (
        torch.autocast(step.device_type, dtype=step.autocast_dtype)
        if step.autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with warnings.catch_warnings(), _model_kept(model):
        warnings.simplefilter("ignore")  # anomaly mode announces itself
        with (
            torch.autograd.detect_anomaly(check_nan=False),
            module_hooks(model, tracer),
            tracer,
        ):
            with autocast:
                out = step.loss_fn(model, batch)
            loss = out[0] if isinstance(out, tuple) else out
            loss_origin = tracer.origins.get(loss)
            if _finite(loss) and loss.requires_grad:
                scaled = loss if scale == 1.0 else loss.float() * scale
                scaled.backward()
        grads = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        grad_origins = {n: tracer.origins.get(g) for n, g in grads}
        buffers = [(n, b.detach().clone()) for n, b in model.named_buffers()]
    return _Run(loss.detach(), loss_origin, grads, grad_origins, buffers)


def locate(step: Any, batch: Any, cls: type, loss_scale: float | None = None) -> Any:
    from torchref._src.step import TrainStep

    if not isinstance(step, TrainStep):
        raise TypeError(
            f"locate needs a torchref.train.TrainStep, got {type(step).__name__}"
        )
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
    bad = _first_bad(list(step.model.state_dict(keep_vars=True).items()))
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
    scale = _scale_of(step) if loss_scale is None else float(loss_scale)
    with _rng_kept():
        return _locate_step(step, batch, cls, scale)


def _locate_step(step: Any, batch: Any, cls: type, scale: float) -> Any:
    run = _run(step, batch, scale)
    if run.loss_origin is not None or not _finite(run.loss):
        o = run.loss_origin
        if o is None:
            return cls(
                phase="loss", path=None, op=None, source=None, detail="loss not finite"
            )
        phase = "loss" if o.module is None else "forward"
        return cls(
            phase=phase, path=o.module, detail=cause(o, _where(o)), **_origin_fields(o)
        )
    bad = _first_bad(run.grads)
    if bad is not None:
        path, _, s = bad
        o = run.grad_origins.get(path)
        if scale != 1.0 and _first_bad(_run(step, batch, 1.0).grads) is None:
            return cls(
                phase="loss_scale",
                path=path,
                detail=f"gradient overflow at loss scale {scale:.6g}, finite at "
                "scale 1 (benign: the scale backs off)",
                **_origin_fields(o),
            )
        text = f"{kind(s.nan, s.inf)} in the gradient of {path}, the loss finite"
        if o is not None:
            text += f"; it starts at {cause(o, _where(o))}"
        return cls(phase="backward", path=path, detail=text, **_origin_fields(o))
    return _update_phase(step, run, scale, cls)


def _update_phase(step: Any, run: _Run, scale: float, cls: type) -> Any:
    # The optimizer and the model are copied together, so that the copied
    # optimizer owns the copied parameters (deepcopy's memo).
    model, opt = copy.deepcopy((step.model, step.optimizer))
    grads = dict(run.grads)
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = grads.get(name)
            p.grad = None if g is None else (g / scale if scale != 1.0 else g.clone())
    params = [p for g in opt.param_groups for p in g["params"]]
    tracer = Tracer()
    with tracer:
        if step.clip is not None:
            step.clip(params)
        opt.step()
    bad = _first_bad(list(model.named_parameters()))
    if bad is not None:
        path, p, s = bad
        o = tracer.origins.get(p)
        text = (
            f"{kind(s.nan, s.inf)} in {path} after the optimizer update "
            "(gradients finite)"
        )
        if _adam_nu_zero(opt, p):
            text = ADAM_FP16 + f": the update of {path} divides by 0"
        elif o is not None:
            text += f"; it starts at {cause(o, 'in the optimizer update')}"
        return cls(phase="update", path=path, detail=text, **_origin_fields(o))
    names = {id(p): n for n, p in model.named_parameters()}
    opt_leaves = [
        (f"opt_state.{names.get(id(p), '?')}.{k}", v)
        for p, st in opt.state.items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    ]
    buffers = [(f"model_state.{n}", b) for n, b in run.buffers]
    bad = _first_bad(opt_leaves) or _first_bad(buffers)
    if bad is not None:
        path, _, s = bad
        return cls(
            phase="update",
            path=path,
            op=None,
            source=None,
            detail=f"{kind(s.nan, s.inf)} in {path} after the step "
            "(loss and gradients finite)",
            **_value_fields(s),
        )
    return None


ADAM_FP16 = (
    "Adam's second moment underflowed to 0 in float16 and its eps is 0 in "
    "float16 (eps < 6e-08 rounds to 0)"
)


def _adam_nu_zero(opt: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    """Whether Adam's ``exp_avg_sq`` of ``p`` is a float16 0 exactly where
    ``p`` became non-finite: ``m / (sqrt(0) + 0)``."""
    nu = opt.state.get(p, {}).get("exp_avg_sq")
    if not isinstance(nu, torch.Tensor) or nu.dtype != torch.float16:
        return False
    bad = ~torch.isfinite(p.detach())
    return bool((nu[bad] == 0).all())
