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
import dataclasses
import functools
import math
import os
import sys
import sysconfig
import types
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from _stablecore.locate import ADAM_FP16 as ADAM_FP16
from _stablecore.locate import MASKED_NAN as MASKED_NAN
from _stablecore.locate import MASKED_ROW as MASKED_ROW
from _stablecore.locate import SOFTMAX_MASKED as SOFTMAX_MASKED
from _stablecore.locate import VARIANCE_ZERO as VARIANCE_ZERO
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
from torchref._src.step import TrainStep

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
    "_softmax": "softmax",
    "_log_softmax": "log_softmax",
    "native_layer_norm": "layer_norm",
    "native_group_norm": "group_norm",
}
# Ops mapping element i to element i (broadcasting) without torch's
# pointwise tag.
_POSITIONAL = {"masked_fill", "copy", "_to_copy", "clone", "detach", "alias"}
_SOFTMAX = {"softmax", "log_softmax"}
_NORMS = {"layer_norm", "group_norm"}
_LIB_MARKERS = (
    "site-packages",
    "dist-packages",
    os.sep + os.path.join("torchref", "_src") + os.sep,
)
_STDLIB = sysconfig.get_paths()["stdlib"]
_MODULE_TAG = "torchref.locate.module"
_SOURCE_TAG = "torchref.locate.source"
_TORCH_MODULE_FILE = os.path.join("torch", "nn", "modules", "module.py")
# In the last `locate` call: the peak bytes locate itself held (copies of
# buffers, of parameters an op wrote to, of one parameter and its optimizer
# state in the update, the re-run's gradients, masks), and the peak bytes of
# the tensors carrying a tag that were still alive (their tags are weak:
# only tensors the program itself keeps). Read by the memory tests and the
# benchmark.
stats = {"peak_live_bytes": 0, "peak_tagged_bytes": 0}


def _hold(nbytes: int) -> None:
    stats["peak_live_bytes"] = max(stats["peak_live_bytes"], nbytes)


def tensor_stats(t: torch.Tensor) -> Stats:
    """Computed where ``t`` lives, in its own dtype (no float64 copy)."""
    w = t.detach()
    if not (w.is_floating_point() or w.is_complex()):
        w = w.float()
    real = w.real if w.is_complex() else w
    nan, inf = torch.isnan(w), torch.isinf(w)
    fin = ~(nan | inf)
    n_fin = int(fin.sum())
    zero = torch.zeros((), dtype=real.dtype, device=w.device)
    return Stats(
        shape=tuple(t.shape),
        dtype=str(t.dtype).removeprefix("torch."),
        nan=int(nan.sum()),
        inf=int(inf.sum()),
        max_abs=float(torch.where(fin, w.abs(), zero).max()) if n_fin else math.nan,
        max=float(real[fin].max()) if n_fin else math.nan,
        zeros=int(((w == 0) & fin).sum()),
        negatives=int(((real < 0) & fin).sum()),
        size=int(w.numel()),
        neg_inf=int((inf & (real < 0)).sum()),
    )


@dataclasses.dataclass(eq=False)
class Origin:
    """Where non-finite elements started."""

    index: int
    op: str
    module: str | None  # dotted module path, "" for the root, None outside
    source: str | None
    out: Stats
    ins: list[Stats]
    would_be: float | None  # max |x| of its elements recomputed in float64
    intentional: bool = False  # a non-finite constant written on purpose
    hint: str | None = None  # MASKED_ROW, SOFTMAX_MASKED, MASKED_NAN, VARIANCE_ZERO


def _storage_key(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (a parameter and an in-place op's
    output share it), or None for a tensor without one: a sparse tensor
    raises NotImplementedError ("Cannot access storage of SparseTensorImpl"),
    a functional/wrapper tensor RuntimeError."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _bad_mask(t: Any) -> torch.Tensor | None:
    """Mask of the non-finite elements, or None when all are finite."""
    if not _is_float(t) or not t.numel() or bool(torch.isfinite(t.detach().sum())):
        return None
    m = ~torch.isfinite(t.detach())
    return m if bool(m.any()) else None


def _finite(t: Any) -> bool:
    if not _is_float(t) or not t.numel():
        return True
    # A finite sum has no NaN or Inf to add up: one pass, no mask (an
    # overflow of the sum itself falls through to the exact test).
    d = t.detach()
    return bool(torch.isfinite(d.sum())) or bool(torch.isfinite(d).all())


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


def _op_name(func: Any) -> str:
    name = func.overloadpacket.__name__
    base = name.rstrip("_") or name
    return CANONICAL_OPS.get(base, base)


def _functional(func: Any) -> Any:
    """``aten.mul.Tensor`` for ``aten.mul_.Tensor``; None when there is none."""
    name = func.overloadpacket.__name__
    if not name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, name.rstrip("_"), None)
    return getattr(packet, func._overloadname, None) if packet is not None else None


def _would_be(func, args, kwargs, k: int, sel) -> float | None:
    """max |output k| over the elements ``sel`` recomputed with every
    floating input in float64: tells an overflow (finite in float64, above
    the dtype's max) from a division by zero or a log of 0 (non-finite in
    float64 too), for float16, bfloat16 and float32 alike. An in-place op
    is recomputed through its functional twin (``mul`` for ``mul_``), on
    the values it read (``args`` holds those)."""
    name = func.overloadpacket.__name__.rstrip("_")
    if CANONICAL_OPS.get(name) == "cast":
        src = args[1] if name == "copy" else args[0]
        ref = src.detach().double() if _is_float(src) else None
    else:
        if func._schema.is_mutable:
            func = _functional(func)
            if func is None:
                return None

        def up(a):
            return a.detach().double() if _is_float(a) and not a.is_complex() else a

        kw = {
            key: (torch.float64 if isinstance(v, torch.dtype) else up(v))
            for key, v in kwargs.items()
        }
        try:
            with torch.no_grad():
                out = func(*[up(a) for a in args], **kw)
        except Exception:  # an op that refuses float64: no estimate
            return None
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        ref = outs[k] if k < len(outs) else None
    if ref is None or not ref.numel():
        return None
    a = ref.abs()
    if sel is not None:
        a = a[sel.expand_as(a)] if sel.shape != a.shape else a[sel]
    if not a.numel() or not bool(torch.isfinite(a).all()):
        return None
    return float(a.max())


# ------------------------------------------------------------------ tags
# A tag is ((origin, mask), ...): disjoint masks whose union is the tensor's
# non-finite elements; a single origin has the mask None ("all of them").


def _masks(tag: tuple, val: torch.Tensor) -> list[tuple[Origin, Any]]:
    if len(tag) == 1 and tag[0][1] is None:
        return [(tag[0][0], _bad_mask(val))]
    return list(tag)


def _union(masks, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    for m in masks:
        out = out | m
    return out


def _fit(m: torch.Tensor, shape) -> torch.Tensor:
    return m if tuple(m.shape) == tuple(shape) else m.broadcast_to(shape)


def _assign(acc: dict, explained: torch.Tensor) -> dict:
    """Each explained element to one origin, in `_order`."""
    taken = torch.zeros_like(explained)
    claims = {}
    for o in _order(acc):
        m = acc[o] & explained & ~taken
        if bool(m.any()):
            claims[o] = m
            taken = taken | m
    return claims


class Tracer(TorchDispatchMode):
    """Tags every non-finite tensor with its origins (see the module doc)."""

    def __init__(self, watched: dict | None = None, sources: bool = False) -> None:
        super().__init__()
        # With `sources`, each autograd node made by a forward op is tagged
        # with the user's line (what anomaly mode's tracebacks give, at a
        # fraction of the cost: no formatted stack per node).
        self.sources = sources
        self.unnamed: list[tuple[Any, str | None]] = []
        self.tags = WeakTensorKeyDictionary()
        self.count = 0
        self.stack: list[tuple[Any, str]] = []  # running modules, with paths
        # Copy on write: storage of a parameter -> the parameter; its value
        # is copied the first time an op writes to it (``saved``).
        self.watched = watched or {}
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.base = 0  # bytes held outside this tracer (buffer copies, ...)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._name_nodes()
        mutable = func._schema.is_mutable
        read_args, read_kwargs, before = args, kwargs, {}
        if mutable:
            # An in-place op overwrites its input: keep the values it read.
            written = _written(func, args, kwargs)
            self._copy_on_write(written)
            before = {id(t): t.detach().clone() for t in written if _is_float(t)}
            read_args, read_kwargs = _swap(args, kwargs, before)
        ins = [
            t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        ]
        pre = [self.tags.get(t) for t in ins]  # before an in-place op retags
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if self.sources and torch._C._current_autograd_node() is None:
            # The forward line of the autograd node autograd attaches to
            # these outputs when this returns (named at the next op).
            source = _python_source()
            self.unnamed.extend((weakref.ref(t), source) for t in outs)
        bad = [not _finite(t) for t in outs]
        if not any(bad):
            for t in outs:
                self.tags.pop(t, None)
            return out
        vals = [before.get(id(t), t) for t in ins]
        intags = [
            p if p is not None else self._constant_tag(t, v)
            for t, v, p in zip(ins, vals, pre, strict=True)
        ]
        tags = self._tags(
            func, read_args, read_kwargs, vals, intags, outs, bad, mutable
        )
        for t, tag in zip(outs, tags, strict=True):
            if tag is None:
                self.tags.pop(t, None)
                continue
            self.tags[t] = tag
            if mutable and t._base is not None:  # written through a view
                self.tags[t._base] = ((blame(tag), None),)
        self.account()
        return out

    def account(self) -> None:
        masks = sum(_tag_bytes(g) for g in self.tags.values())
        tagged = sum(_nbytes(t) for t in self.tags.keys())
        stats["peak_tagged_bytes"] = max(stats["peak_tagged_bytes"], tagged + masks)
        _hold(self.base + masks + sum(_nbytes(c) for _, c in self.saved.values()))

    def _constant_tag(self, t: torch.Tensor, value: torch.Tensor) -> tuple | None:
        """Non-finite and made by no op seen here: a buffer or a constant (a
        causal mask of -inf), intentional."""
        if _finite(value):
            return None
        self.count += 1
        o = Origin(
            self.count, "constant", None, None, tensor_stats(value), [], None, True
        )
        tag = ((o, None),)
        if value is t:
            self.tags[t] = tag
        return tag

    def _name_nodes(self) -> None:
        for ref, source in self.unnamed:
            t = ref()
            node = None if t is None else t.grad_fn
            if node is not None and _SOURCE_TAG not in node.metadata:
                node.metadata[_SOURCE_TAG] = source
        self.unnamed.clear()

    def _copy_on_write(self, written: list[torch.Tensor]) -> None:
        for t in written:
            key = _storage_key(t)
            param = None if key is None else self.watched.get(key)
            if param is not None and key not in self.saved:
                self.saved[key] = (param, param.detach().clone())
                self.account()

    # ---------------------------------------------------------------- tags
    def _tags(self, func, args, kwargs, vals, intags, outs, bad, mutable) -> list:
        literal = any(
            isinstance(a, float) and not math.isfinite(a)
            for a in tree_flatten((args, kwargs))[0]
        )
        if not any(intags):
            k = bad.index(True)
            o = self.new(func, args, kwargs, vals, outs, k, None, literal)
            return [((o, None),) if b else None for b in bad]
        origins = _order(dict.fromkeys(o for t in intags if t for o, _ in t))
        if len(origins) == 1 and not origins[0].intentional:
            # One real cause keeps every non-finite output: the first cause
            # wins anyway, and a NaN cascade stays cheap.
            return [((origins[0], None),) if b else None for b in bad]
        bad = [_bad_mask(t) if b else None for t, b in zip(outs, bad, strict=True)]
        name = func.overloadpacket.__name__.rstrip("_")
        if torch.Tag.pointwise in func.tags or name in _POSITIONAL:
            return self._pointwise(func, args, kwargs, vals, intags, outs, bad, literal)
        return self._ablated(
            func, args, kwargs, vals, intags, outs, bad, mutable, literal
        )

    def _pointwise(self, func, args, kwargs, vals, intags, outs, bad, literal) -> list:
        result = []
        for k, b in enumerate(bad):
            if b is None:
                result.append(None)
                continue
            acc: dict[Origin, torch.Tensor] = {}
            nan_in = torch.zeros_like(b)
            for v, t in zip(vals, intags, strict=True):
                if not t or not _broadcastable(v.shape, b.shape):
                    continue
                for o, m in _masks(t, v):
                    if m is not None:
                        m = _fit(m, b.shape)
                        acc[o] = acc[o] | m if o in acc else m
                nan_in = nan_in | _fit(torch.isnan(v.detach()), b.shape)
            explained = b & _union(acc.values(), b)
            claims = _assign(acc, explained)
            claims = self._masked_nan(
                func, args, kwargs, vals, outs, k, claims, nan_in, acc
            )
            result.append(
                self._finish(
                    func, args, kwargs, vals, outs, k, claims, b & ~explained, literal
                )
            )
        return result

    def _ablated(self, func, args, kwargs, vals, intags, outs, bad, mutable, literal):
        origins = _order(dict.fromkeys(o for t in intags if t for o, _ in t))
        if mutable or torch.Tag.nondeterministic_seeded in func.tags:
            # No re-run of an in-place op (it would write twice) nor of a
            # random one (it would draw again, and shift later draws).
            return [None if b is None else ((origins[0], None),) for b in bad]
        filled = self._rerun(func, args, kwargs, intags, vals, None)
        each = (
            {o: self._rerun(func, args, kwargs, intags, vals, o) for o in origins}
            if len(origins) > 1
            else {origins[0]: filled}
        )
        nan_in = any(
            t and bool(torch.isnan(v.detach()).any())
            for v, t in zip(vals, intags, strict=True)
        )
        result = []
        for k, b in enumerate(bad):
            if b is None:
                result.append(None)
                continue
            still = _bad_mask(filled[k]) if k < len(filled) else None
            new = torch.zeros_like(b) if still is None else b & _fit(still, b.shape)
            explained = b & ~new
            acc = {}
            for o in origins:
                s = _bad_mask(each[o][k]) if k < len(each[o]) else None
                acc[o] = explained if s is None else explained & ~_fit(s, b.shape)
            claims = _assign(acc, explained)
            rest = explained & ~_union(claims.values(), b)
            if bool(rest.any()):  # needs several origins at once: the first
                claims[origins[0]] = claims.get(origins[0], torch.zeros_like(b)) | rest
            claims = self._masked_row(func, args, kwargs, outs, k, claims)
            nan_here = torch.ones_like(b) if nan_in else torch.zeros_like(b)
            claims = self._masked_nan(
                func, args, kwargs, vals, outs, k, claims, nan_here, acc
            )
            result.append(
                self._finish(func, args, kwargs, vals, outs, k, claims, new, literal)
            )
        return result

    def _rerun(self, func, args, kwargs, intags, vals, only) -> list:
        ins = [
            t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        ]
        repl = {}
        for t, tag, v in zip(ins, intags, vals, strict=True):
            sel = None
            for o, m in _masks(tag, v) if tag else ():
                if only is None or o is only:
                    sel = m if sel is None else sel | m
            if sel is not None:
                repl[id(t)] = torch.where(
                    sel, torch.ones((), dtype=v.dtype, device=v.device), v.detach()
                )
        a, kw = _swap(args, kwargs, repl)
        with torch.no_grad():
            out = func(*a, **kw)
        return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]

    def _masked_row(self, func, args, kwargs, outs, k, claims) -> dict:
        """A max over elements all ``-inf`` by a mask is ``-inf``: marked,
        for the softmax that subtracts it next (NaN)."""
        if _op_name(func) != "max":
            return claims
        rows = [m for o, m in claims.items() if o.intentional]
        if not rows:
            return claims
        m = _union(rows, rows[0]) & (outs[k].detach() == -math.inf)
        if not bool(m.any()):
            return claims
        o = self.new(func, args, kwargs, [], outs, k, m, True, hint=MASKED_ROW)
        kept = {x: c & ~m for x, c in claims.items()}
        return {**{x: c for x, c in kept.items() if bool(c.any())}, o: m}

    def _masked_nan(self, func, args, kwargs, vals, outs, k, claims, nan_in, acc):
        """NaN made from masked infinities alone (``-inf - -inf``, a softmax
        over a fully masked row): a new, unintended origin."""
        masked = [c for o, c in claims.items() if o.intentional]
        if not masked:
            return claims
        m = _union(masked, nan_in) & torch.isnan(outs[k].detach()) & ~nan_in
        if not bool(m.any()):
            return claims
        row = _op_name(func) in _SOFTMAX or any(
            o.hint in (MASKED_ROW, SOFTMAX_MASKED) and bool((c & m).any())
            for o, c in acc.items()
        )
        hint = SOFTMAX_MASKED if row else MASKED_NAN
        o = self.new(func, args, kwargs, vals, outs, k, m, hint=hint)
        if row:
            o.op = "softmax"
        kept = {x: c & ~m for x, c in claims.items()}
        return {**{x: c for x, c in kept.items() if bool(c.any())}, o: m}

    def _finish(self, func, args, kwargs, vals, outs, k, claims, new, literal):
        if bool(new.any()):
            o = self.new(func, args, kwargs, vals, outs, k, new, literal)
            claims = {**claims, o: new}
        return _make_tag(claims)

    def new(self, func, args, kwargs, vals, outs, k, sel, intentional=False, hint=None):
        """A new origin: output ``k`` of the op at the elements ``sel``."""
        self.count += 1
        name = _op_name(func)
        node = torch._C._current_autograd_node()
        if node is not None:  # a backward op: the forward's line and module,
            # or the line of a user's autograd.Function.backward running it
            source = _python_source() or node.metadata.get(_SOURCE_TAG)
            module = node.metadata.get(_MODULE_TAG)
        else:
            source = _python_source()
            module = self.stack[-1][1] if self.stack else None
        if hint is None and name in _NORMS and not intentional:
            hint = _variance_zero(func, args)
        real = vals and not intentional
        return Origin(
            index=self.count,
            op=name,
            module=module,
            source=source,
            out=tensor_stats(outs[k]),
            ins=[tensor_stats(t) for t in vals if _is_float(t)],
            would_be=_would_be(func, args, kwargs, k, sel) if real else None,
            intentional=intentional,
            hint=hint,
        )


def _variance_zero(func, args) -> str | None:
    # native_layer_norm(x, shape, w, b, eps), native_group_norm(..., eps):
    # eps is the last argument; with eps 0 a constant row is 0 / sqrt(0).
    eps = args[-1] if args and isinstance(args[-1], float) else None
    return VARIANCE_ZERO if eps == 0.0 else None


def _broadcastable(shape, target) -> bool:
    try:
        return tuple(torch.broadcast_shapes(shape, target)) == tuple(target)
    except RuntimeError:
        return False


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an in-place or out= op writes to (its schema's ``a!``)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(arg.name)
        out.extend(t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor))
    return out


def _swap(args, kwargs, repl: dict):
    """``args``/``kwargs`` with the tensors whose id is in ``repl`` replaced."""
    if not repl:
        return args, kwargs

    def sub(x):
        if isinstance(x, torch.Tensor):
            return repl.get(id(x), x)
        if isinstance(x, list | tuple):
            return type(x)(sub(y) for y in x)
        return x

    return tuple(sub(a) for a in args), {k: sub(v) for k, v in kwargs.items()}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _state_bytes(state: dict):
    return (_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))


def _tag_bytes(tag: tuple | None) -> int:
    return sum(_nbytes(m) for _, m in tag if m is not None) if tag else 0


# ----------------------------------------------------------- module paths
def clean(path: str) -> str:
    """A path without the ``_orig_mod`` of `torch.compile`'s wrapper."""
    return ".".join(p for p in path.split(".") if p and p != "_orig_mod")


class _Paths:
    """The path of each module call: the attribute chain written at the call
    site when it resolves (``self.dec(x)``, ``m.head(...)``), else where the
    module sits in the running module (or the model). Inside a call of a
    copy of a module (none in torch but for user code that deep-copies), by
    its type within the running one: the mirror of jaxstable's."""

    def __init__(self, model: torch.nn.Module, tracer: Tracer) -> None:
        self.stack = tracer.stack
        self.index = {}
        for name, m in model.named_modules():
            self.index.setdefault(id(m), (m, clean(name)))
        self.subs: dict[int, tuple[Any, list]] = {}

    def call_path(self, module, frame) -> str:
        found = call_site(frame, module)
        if found is not None:
            base, parts = found
            at = self.path_of(base)
            if at is not None:
                return clean(join(at, parts))
        return self.path_of(module) or ""

    def path_of(self, obj) -> str | None:
        for entry in reversed(self.stack):
            if entry[0] is obj:
                return entry[1]
        if not isinstance(obj, torch.nn.Module):
            return None
        parent, at = self.stack[-1][:2] if self.stack else (None, "")
        if parent is not None:
            for rel, node in self._subgraph(parent):
                if node is obj:
                    return join(at, [rel])
        known = self.index.get(id(obj))
        if known is not None and known[0] is obj:
            return known[1]
        if parent is None:
            return ""
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
                (clean(n), m)
                for n, m in node.named_modules(remove_duplicate=False)
                if n
            ]
            cached = self.subs[id(node)] = (node, nodes)
        return cached[1]


def _caller(frame) -> Any:
    """The first frame outside ``nn.Module.__call__`` and this file."""
    while frame is not None and (
        frame.f_code.co_filename.endswith(_TORCH_MODULE_FILE)
        or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    return frame


_BASE_NAMES = set(dir(torch.nn.Module))


@contextlib.contextmanager
def module_hooks(model: torch.nn.Module, tracer: Tracer):
    """Keeps ``tracer.stack`` at the running module and its path (forward
    pre-hooks, and the public methods of the user's own module classes, as
    ``model.encode(x)``), and tags the autograd nodes created during each
    call with its path."""
    paths = _Paths(model, tracer)

    def pre(module, args):
        path = paths.call_path(module, _caller(sys._getframe(1)))
        tracer.stack.append((module, path, torch._C._autograd._get_sequence_nr()))

    def post(module, args, output):
        _, path, seq = tracer.stack.pop()
        _tag_nodes(output, path, seq)

    def wrap(orig):
        @functools.wraps(orig)
        def method(module, *args, **kwargs):
            path = paths.call_path(module, sys._getframe(1))
            seq = torch._C._autograd._get_sequence_nr()
            tracer.stack.append((module, path, seq))
            try:
                out = orig(module, *args, **kwargs)
            finally:
                tracer.stack.pop()
            _tag_nodes(out, path, seq)
            return out

        return method

    handles, patched = [], []
    modules = list(dict.fromkeys(model.modules()))
    for module in modules:
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    for cls in dict.fromkeys(type(m) for m in modules):
        if cls.__module__.startswith("torch."):
            continue
        for name, fn in list(vars(cls).items()):
            public = not name.startswith("_") and name not in _BASE_NAMES
            if public and isinstance(fn, types.FunctionType):
                setattr(cls, name, wrap(fn))
                patched.append((cls, name, fn))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for cls, name, fn in reversed(patched):
            setattr(cls, name, fn)


def _tag_nodes(output: Any, name: str, seq: int) -> None:
    # Only nodes created during the call (sequence number from its start):
    # the loss code's nodes before the model call stay untagged ("in the
    # loss"). Inner modules finish first and keep their own tag.
    todo = [t.grad_fn for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    while todo:
        node = todo.pop()
        if node is None or _MODULE_TAG in node.metadata or node._sequence_nr() < seq:
            continue
        node.metadata[_MODULE_TAG] = name
        todo.extend(n for n, _ in node.next_functions)


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
        if _is_float(t) and not _finite(t) and not (masks_ok and _masks_only(t))
    ]
    if not bad:
        return None
    path, t = min(bad, key=lambda item: _dotted(item[0]))
    return path, t, tensor_stats(t)


def _dotted(path: Any) -> str:
    return ".".join(map(str, path)) if isinstance(path, tuple) else str(path)


def _scale_of(step: Any) -> float:
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
def _grads_put_back(params: list[tuple[str, torch.Tensor]]):
    grads = [p.grad for _, p in params]
    for _, p in params:
        p.grad = None
    try:
        yield
    finally:
        for (_, p), g in zip(params, grads, strict=True):
            p.grad = g


def _eager_compiled():
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
        key = _storage_key(p)
        if key is not None:
            watched[key] = p
    tracer = Tracer(watched, sources=True)
    buffers = [(clean(n), b, b.detach().clone()) for n, b in model.named_buffers()]
    tracer.base = sum(_nbytes(c) for _, _, c in buffers)
    tracer.account()
    autocast = (
        torch.autocast(step.device_type, dtype=step.autocast_dtype)
        if step.autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with warnings.catch_warnings(), _grads_put_back(params):
        warnings.simplefilter("ignore")  # shown once already, when the step ran
        if rng_state is not None:
            set_rng(rng_state)
        try:
            with _eager_compiled(), module_hooks(model, tracer), tracer:
                with autocast:
                    out = step.loss_fn(model, batch)
                tracer._name_nodes()
                loss = out[0] if isinstance(out, tuple) else out
                loss_tag = tracer.tags.get(loss)
                if _finite(loss) and loss.requires_grad:
                    scaled = loss if scale == 1.0 else loss.float() * scale
                    scaled.backward()
            grads = {n: p.grad for n, p in params if p.grad is not None}
            grad_tags = {n: tracer.tags.get(g) for n, g in grads.items()}
            tracer.base += sum(_nbytes(g) for g in grads.values())
            tracer.account()
            buffer_bad = _first_bad([(n, b) for n, b, _ in buffers], masks_ok=True)
        finally:
            with torch.no_grad():
                for _, b, saved in buffers:
                    b.copy_(saved)
                for p, saved in tracer.saved.values():
                    p.copy_(saved)
    return _Run(loss.detach(), loss_tag, grads, grad_tags, buffer_bad)


def locate(
    step: Any, batch: Any, cls: type, loss_scale: float | None = None, rng_state=None
) -> Any:
    if not isinstance(step, TrainStep):
        raise TypeError(
            f"locate needs a torchref.train.TrainStep, got {type(step).__name__}"
        )
    _check_rng(rng_state)
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
    scale = _scale_of(step) if loss_scale is None else float(loss_scale)
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
    if run.loss_tag is not None or not _finite(run.loss):
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
    if run.loss_tag is not None or not _finite(run.loss):
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
    held = sum(_nbytes(g) for g in grads.values())
    if step.clip is not None:
        with _grads_swapped(params, grads):
            step.clip([p for n, p in params if n in grads])
    names = {id(p): n for n, p in params}
    first_param = first_state = None  # (name, group, parameter)
    for group in opt.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            if name not in grads:
                continue
            twin_p, state = _twin_step(opt, group, p, name, grads[name], held)
            if not _finite(twin_p) and (first_param is None or name < first_param[0]):
                first_param = (name, group, p)
            for k, v in state.items():
                where = f"opt_state.{name}.{k}"
                if isinstance(v, torch.Tensor) and not _finite(v):
                    if first_state is None or where < first_state[0]:
                        first_state = (where, v)
            del twin_p, state
    if first_param is not None:
        name, group, p = first_param
        tracer = Tracer()
        twin_p, state = _twin_step(opt, group, p, name, grads[name], held, tracer)
        s, o = tensor_stats(twin_p), blame(tracer.tags.get(twin_p))
        text = (
            f"{kind(s.nan, s.inf)} in {name} after the optimizer update "
            "(gradients finite)"
        )
        if _adam_nu_zero(state, twin_p):
            text = ADAM_FP16 + f": the update of {name} divides by 0"
        elif o is not None:
            text += f"; it starts at {cause(o, 'in the optimizer update')}"
        return cls(phase="update", path=name, detail=text, **_origin_fields(o))
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
    _hold(held + _nbytes(twin_p) + sum(_state_bytes(state)))
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
