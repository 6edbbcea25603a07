"""Origins and their tags, for `_locate` (private).

An *origin* is the op that made elements non-finite while the elements they
were computed from were finite; a *tag* says which origin explains each
non-finite element of a tensor (see `torchref._src._locate`). Here: the
facts an origin reports (a tensor's stats, its elements recomputed in
float64), the per-element tag algebra the tracer (`locate_trace`) uses, and
which frames are the user's.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from _stablecore.locate import Stats
from _stablecore.locate import order as _order

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
LIB_MARKERS = (
    "site-packages",
    "dist-packages",
    os.sep + os.path.join("torchref", "_src") + os.sep,
)
# The files of locate itself: an op or a module call made from them (the
# step's loss and backward as `_locate` runs them) has no user line.
LOCATE_FILES = frozenset(
    os.path.join(os.path.dirname(__file__), name)
    for name in (
        "_locate.py",
        "locate_origins.py",
        "locate_scopes.py",
        "locate_sharded.py",
        "locate_shards.py",
        "locate_trace.py",
    )
)


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


def is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def bad_mask(t: Any) -> torch.Tensor | None:
    """Mask of the non-finite elements, or None when all are finite."""
    if not is_float(t) or not t.numel() or bool(torch.isfinite(t.detach().sum())):
        return None
    m = ~torch.isfinite(t.detach())
    return m if bool(m.any()) else None


def all_finite(t: Any) -> bool:
    if not is_float(t) or not t.numel():
        return True
    # A finite sum has no NaN or Inf to add up: one pass, no mask (an
    # overflow of the sum itself falls through to the exact test).
    d = t.detach()
    return bool(torch.isfinite(d.sum())) or bool(torch.isfinite(d).all())


def _functional(func: Any) -> Any:
    """``aten.mul.Tensor`` for ``aten.mul_.Tensor``; None when there is none."""
    name = func.overloadpacket.__name__
    if not name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, name.rstrip("_"), None)
    return getattr(packet, func._overloadname, None) if packet is not None else None


def would_be(func, args, kwargs, k: int, sel) -> float | None:
    """max |output k| over the elements ``sel`` recomputed with every
    floating input in float64: tells an overflow (finite in float64, above
    the dtype's max) from a division by zero or a log of 0 (non-finite in
    float64 too), for float16, bfloat16 and float32 alike. An in-place op
    is recomputed through its functional twin (``mul`` for ``mul_``), on
    the values it read (``args`` holds those)."""
    name = func.overloadpacket.__name__.rstrip("_")
    if CANONICAL_OPS.get(name) == "cast":
        src = args[1] if name == "copy" else args[0]
        ref = src.detach().double() if is_float(src) else None
    else:
        if func._schema.is_mutable:
            func = _functional(func)
            if func is None:
                return None

        def up(a):
            return a.detach().double() if is_float(a) and not a.is_complex() else a

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


def tag_masks(tag: tuple, val: torch.Tensor) -> list[tuple[Origin, Any]]:
    if len(tag) == 1 and tag[0][1] is None:
        return [(tag[0][0], bad_mask(val))]
    return list(tag)


def union(masks, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    for m in masks:
        out = out | m
    return out


def fit_shape(m: torch.Tensor, shape) -> torch.Tensor:
    return m if tuple(m.shape) == tuple(shape) else m.broadcast_to(shape)


def assign_claims(acc: dict, explained: torch.Tensor) -> dict:
    """Each explained element to one origin, in `_order`."""
    taken = torch.zeros_like(explained)
    claims = {}
    for o in _order(acc):
        m = acc[o] & explained & ~taken
        if bool(m.any()):
            claims[o] = m
            taken = taken | m
    return claims


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tag_bytes(tag: tuple | None) -> int:
    return sum(nbytes(m) for _, m in tag if m is not None) if tag else 0
