"""The tracer of `_locate` (private): following values through ops.

`Tracer` is a `TorchDispatchMode` that sees every aten op, forward and
backward, and tags each non-finite tensor with its origins (see
`torchref._src._locate` for the whole story).
"""

from __future__ import annotations

import math
import sys
import sysconfig
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from _stablecore.locate import (
    MASKED_NAN,
    MASKED_ROW,
    SOFTMAX_MASKED,
    VARIANCE_ZERO,
    blame,
    format_frame,
)
from _stablecore.locate import make_tag as _make_tag
from _stablecore.locate import order as _order
from torchref._src.locate_origins import (
    CANONICAL_OPS,
    LIB_MARKERS,
    LOCATE_FILES,
    Origin,
    all_finite,
    assign_claims,
    bad_mask,
    fit_shape,
    is_float,
    nbytes,
    tag_bytes,
    tag_masks,
    tensor_stats,
    union,
    would_be,
)
from torchref._src.locate_scopes import MODULE_TAG

# Ops mapping element i to element i (broadcasting) without torch's
# pointwise tag.
_POSITIONAL = {"masked_fill", "copy", "_to_copy", "clone", "detach", "alias"}
_SOFTMAX = {"softmax", "log_softmax"}
_NORMS = {"layer_norm", "group_norm"}
_STDLIB = sysconfig.get_paths()["stdlib"]
SOURCE_TAG = "torchref.locate.source"
# In the last `locate` call: the peak bytes locate itself held (copies of
# buffers, of parameters an op wrote to, of one parameter and its optimizer
# state in the update, the re-run's gradients, masks), and the peak bytes of
# the tensors carrying a tag that were still alive (their tags are weak:
# only tensors the program itself keeps). Read by the memory tests and the
# benchmark.
stats = {"peak_live_bytes": 0, "peak_tagged_bytes": 0}


def hold(nbytes: int) -> None:
    stats["peak_live_bytes"] = max(stats["peak_live_bytes"], nbytes)


def storage_key(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (a parameter and an in-place op's
    output share it), or None for a tensor without one: a sparse tensor
    raises NotImplementedError ("Cannot access storage of SparseTensorImpl"),
    a functional/wrapper tensor RuntimeError."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _is_user(file_name: str) -> bool:
    return not (
        any(m in file_name for m in LIB_MARKERS)
        or file_name.startswith(_STDLIB)
        or file_name.startswith("<")
    )


def python_source() -> str | None:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in LOCATE_FILES:
        frame = frame.f_back  # the dispatch mode's own frames
    while frame is not None:
        code = frame.f_code
        if code.co_filename in LOCATE_FILES:
            return None  # reached locate itself: no user code issued the op
        if _is_user(code.co_filename):
            return format_frame(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


def op_name(func: Any) -> str:
    name = func.overloadpacket.__name__
    base = name.rstrip("_") or name
    return CANONICAL_OPS.get(base, base)


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
        self.name_nodes()
        mutable = func._schema.is_mutable
        read_args, read_kwargs, before = args, kwargs, {}
        if mutable:
            # An in-place op overwrites its input: keep the values it read.
            written = _written(func, args, kwargs)
            self._copy_on_write(written)
            before = {id(t): t.detach().clone() for t in written if is_float(t)}
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
            source = python_source()
            self.unnamed.extend((weakref.ref(t), source) for t in outs)
        bad = [not all_finite(t) for t in outs]
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
        masks = sum(tag_bytes(g) for g in self.tags.values())
        tagged = sum(nbytes(t) for t in self.tags.keys())
        stats["peak_tagged_bytes"] = max(stats["peak_tagged_bytes"], tagged + masks)
        hold(self.base + masks + sum(nbytes(c) for _, c in self.saved.values()))

    def _constant_tag(self, t: torch.Tensor, value: torch.Tensor) -> tuple | None:
        """Non-finite and made by no op seen here: a buffer or a constant (a
        causal mask of -inf), intentional."""
        if all_finite(value):
            return None
        self.count += 1
        o = Origin(
            self.count, "constant", None, None, tensor_stats(value), [], None, True
        )
        tag = ((o, None),)
        if value is t:
            self.tags[t] = tag
        return tag

    def name_nodes(self) -> None:
        for ref, source in self.unnamed:
            t = ref()
            node = None if t is None else t.grad_fn
            if node is not None and SOURCE_TAG not in node.metadata:
                node.metadata[SOURCE_TAG] = source
        self.unnamed.clear()

    def _copy_on_write(self, written: list[torch.Tensor]) -> None:
        for t in written:
            key = storage_key(t)
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
        bad = [bad_mask(t) if b else None for t, b in zip(outs, bad, strict=True)]
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
                for o, m in tag_masks(t, v):
                    if m is not None:
                        m = fit_shape(m, b.shape)
                        acc[o] = acc[o] | m if o in acc else m
                nan_in = nan_in | fit_shape(torch.isnan(v.detach()), b.shape)
            explained = b & union(acc.values(), b)
            claims = assign_claims(acc, explained)
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
            still = bad_mask(filled[k]) if k < len(filled) else None
            new = (
                torch.zeros_like(b) if still is None else b & fit_shape(still, b.shape)
            )
            explained = b & ~new
            acc = {}
            for o in origins:
                s = bad_mask(each[o][k]) if k < len(each[o]) else None
                acc[o] = explained if s is None else explained & ~fit_shape(s, b.shape)
            claims = assign_claims(acc, explained)
            rest = explained & ~union(claims.values(), b)
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
            for o, m in tag_masks(tag, v) if tag else ():
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
        if op_name(func) != "max":
            return claims
        rows = [m for o, m in claims.items() if o.intentional]
        if not rows:
            return claims
        m = union(rows, rows[0]) & (outs[k].detach() == -math.inf)
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
        m = union(masked, nan_in) & torch.isnan(outs[k].detach()) & ~nan_in
        if not bool(m.any()):
            return claims
        row = op_name(func) in _SOFTMAX or any(
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
        name = op_name(func)
        node = torch._C._current_autograd_node()
        if node is not None:  # a backward op: the forward's line and module,
            # or the line of a user's autograd.Function.backward running it
            source = python_source() or node.metadata.get(SOURCE_TAG)
            module = node.metadata.get(MODULE_TAG)
        else:
            source = python_source()
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
            ins=[tensor_stats(t) for t in vals if is_float(t)],
            would_be=would_be(func, args, kwargs, k, sel) if real else None,
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
