"""Origins and their tags, for `_locate` (private).

An *origin* is the equation that made elements non-finite while the elements
they were computed from were finite; a *tag* says which origin explains each
non-finite element of a value (see `jaxstable._src._locate`). Here: the
facts an origin reports (a value's stats, its elements recomputed in
float64) and the per-element tag algebra the interpreter
(`locate_trace`) uses.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from _stablecore.locate import Stats
from _stablecore.locate import make_tag as _make_tag
from _stablecore.locate import order as _order

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
LIB_MARKERS = (
    "site-packages",
    "dist-packages",
    os.sep + os.path.join("jaxstable", "_src") + os.sep,
)


def _on_cpu(x: Any) -> bool:
    try:
        return all(d.platform == "cpu" for d in x.devices())
    except AttributeError:  # numpy, a Python scalar
        return True


def array_module(x: Any):
    """numpy for values on the CPU (a view, no copy: 30x faster than a jnp
    reduction per check), jax.numpy elsewhere (no transfer)."""
    return np if _on_cpu(x) else jnp


def local_view(x: Any) -> Any:
    return np.asarray(x) if _on_cpu(x) else x


def array_stats(x: Any) -> Stats:
    """Computed in ``x``'s own dtype, where it lives (no float64 copy)."""
    xp, a = array_module(x), local_view(x)
    shape, dtype = tuple(a.shape), np.dtype(a.dtype).name
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        a = a.astype(np.float32)
    real = a.real if jnp.iscomplexobj(a) else a
    nan, inf = xp.isnan(a), xp.isinf(a)
    fin = ~(nan | inf)
    n_fin = int(fin.sum())
    absmax = xp.max(xp.where(fin, xp.abs(a), 0)) if n_fin else math.nan
    top = xp.max(xp.where(fin, real, -xp.inf)) if n_fin else math.nan
    return Stats(
        shape=shape,
        dtype=dtype,
        nan=int(nan.sum()),
        inf=int(inf.sum()),
        max_abs=float(absmax),
        max=float(top),
        zeros=int(((a == 0) & fin).sum()),
        negatives=int(((real < 0) & fin).sum()),
        size=int(a.size),
        neg_inf=int((inf & (real < 0)).sum()),
    )


@dataclasses.dataclass(eq=False)
class Origin:
    """Where non-finite elements started.

    ``facts()`` gives ``(out, ins, would_be)``: the stats of the op's output
    and inputs and max |x| of its elements recomputed in float64. They are
    computed when first read (arrays are immutable), so an origin no
    reported value keeps (one per bad leaf of an update) costs nothing; as
    an unread origin holds its op's inputs, at most `locate_trace._LAZY` of
    them wait at a time, the others are computed at once."""

    index: int
    op: str
    module: str | None  # dotted module path, "" for the root, None outside
    source: str | None
    facts: Any  # () -> (Stats, list[Stats], float | None), or that tuple
    intentional: bool = False  # a non-finite constant written on purpose
    hint: str | None = None  # MASKED_ROW, SOFTMAX_MASKED or MASKED_NAN

    def _get(self, i: int) -> Any:
        if callable(self.facts):
            self.facts = self.facts()
        return self.facts[i]

    out = property(lambda self: self._get(0))
    ins = property(lambda self: self._get(1))
    would_be = property(lambda self: self._get(2))


def is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def is_numeric(x: Any) -> bool:
    # PRNG key arrays (extended dtypes) have no values to report.
    dtype = getattr(x, "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def bad_mask(x: Any) -> Any:
    """Mask of the non-finite elements, or None when all are finite."""
    if not is_float(x):
        return None
    xp = array_module(x)
    m = ~xp.isfinite(local_view(x))
    return m if bool(m.any()) else None


def all_finite(x: Any) -> bool:
    if not is_float(x):
        return True
    return bool(array_module(x).isfinite(local_view(x)).all())


def _params64(params: dict) -> dict:
    def wide(v):
        try:
            if isinstance(v, np.dtype | type) and jnp.issubdtype(v, jnp.floating):
                return jnp.float64
        except TypeError:
            pass
        return v

    return {k: wide(v) for k, v in params.items()}


def would_be(eqn: Any, invals: list, k: int, sel: Any) -> float | None:
    """max |output k| over the elements ``sel`` recomputed with every
    floating input in float64: tells an overflow (finite in float64, above
    the dtype's max) from a division by zero or a log of 0 (non-finite in
    float64 too), for float16, bfloat16 and float32 alike."""
    if eqn.primitive.name == "convert_element_type":
        ref = np.asarray(invals[0])
    else:
        dtype = eqn.outvars[k].aval.dtype
        if not jnp.issubdtype(dtype, jnp.floating) or dtype == jnp.float64:
            return None
        try:
            with jax.enable_x64(True):
                ups = [
                    jnp.asarray(v, jnp.float64)
                    if is_float(v) and not jnp.iscomplexobj(v)
                    else v
                    for v in invals
                ]
                out = eqn.primitive.bind(*ups, **_params64(eqn.params))
                ref = np.asarray(out[k] if eqn.primitive.multiple_results else out)
        except Exception:  # a primitive that refuses float64: no estimate
            return None
    if ref.dtype.kind not in "fc":
        ref = ref.astype(np.float64)
    a = np.abs(ref.astype(np.complex128 if ref.dtype.kind == "c" else np.float64))
    if sel is not None and a.shape:
        a = a[np.broadcast_to(np.asarray(sel), a.shape)]
    if not a.size or not np.all(np.isfinite(a)):
        return None
    return float(a.max())


# ------------------------------------------------------------------ tags
# A tag is ((origin, mask), ...): disjoint masks whose union is the value's
# non-finite elements. A single origin has the mask None ("all of them").


def tag_masks(tag: tuple, val: Any) -> list[tuple[Origin, Any]]:
    if len(tag) == 1 and tag[0][1] is None:
        return [(tag[0][0], bad_mask(val))]
    return list(tag)


def tag_bytes(tag: tuple | None) -> int:
    return sum(nbytes(m) for _, m in tag) if tag else 0


def nbytes(x: Any) -> int:
    return int(getattr(x, "nbytes", 0) or 0)


def union(masks, like) -> Any:
    out = like & False
    for m in masks:
        out = out | m
    return out


def fit_shape(m: Any, shape: tuple) -> Any:
    if tuple(m.shape) == tuple(shape):
        return m
    return (np if isinstance(m, np.ndarray) else jnp).broadcast_to(m, shape)


def fill_with_ones(invals: list, intags: list, only: Origin | None) -> list:
    """The inputs with the non-finite elements of origin ``only`` (None: of
    every origin) replaced by 1."""
    out = []
    for v, t in zip(invals, intags, strict=True):
        sel = None
        for o, m in tag_masks(t, v) if t else ():
            if only is None or o is only:
                sel = m if sel is None else sel | m
        out.append(v if sel is None else jnp.where(sel, jnp.ones((), v.dtype), v))
    return out


def slice_tag(t: tuple | None, x: Any, i: int) -> tuple | None:
    if not t:
        return None
    if len(t) == 1:
        return t if not all_finite(x[i]) else None
    parts = {o: m[i] for o, m in t if bool(m[i].any())}
    return _make_tag(parts) if parts else None


def stack_tags(tags: list, values: list) -> tuple | None:
    if not any(tags):
        return None
    origins = list(dict.fromkeys(o for t in tags if t for o, _ in t))
    if len(origins) == 1:
        return ((origins[0], None),)
    stacked = {}
    for o in origins:
        rows = []
        for t, v in zip(tags, values, strict=True):
            mine = [m for oo, m in tag_masks(t, v) if oo is o] if t else []
            rows.append(np.asarray(mine[0]) if mine else np.zeros(np.shape(v), bool))
        stacked[o] = np.stack(rows)
    return tuple(stacked.items())


def assign_claims(acc: dict, explained: Any) -> dict:
    """Each explained element to one origin, in `_order`."""
    taken = explained & False
    claims = {}
    for o in _order(acc):
        m = acc[o] & explained & ~taken
        if bool(m.any()):
            claims[o] = m
            taken = taken | m
    return claims
