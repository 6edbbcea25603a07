"""Locating a sharded step without gathering it (private).

`jaxstable.diagnostics.locate` of a step whose arrays span several
processes (``jax.distributed``, FSDP or data parallel over a global mesh)
never brings a global value to one process. The step's whole computation
(loss, gradients, optimizer update) is traced as `_locate` traces it, with
module scopes, and compiled again as one program with the step's own input
shardings, in which every floating value an equation computes is reduced to
three counts (NaN, +inf, -inf): that program holds what the step holds
(XLA frees each value after its last use, the counts included; see
`program_memory`) and returns one small int32 matrix. On the host, the
first equation that made a value non-finite while the values it was
computed from were finite (or held only intentional ``-inf``: masks) and
whose non-finite output reaches the first bad output (the loss, then the
first gradient, new parameter, optimizer or model state leaf, by name) is
the origin. A second program, the same prefix of the step cut at that
equation (XLA drops the rest), returns the origin's stats and its bad-mask,
sharded as the value is: each process reads its own devices' shards of it,
and only rows of a few numbers per device are exchanged
(`multihost_utils.process_allgather`), naming the processes and devices
whose shards hold the first non-finite value.

Per value, not per element: a new overflow at another element of a value
that already holds a masked ``-inf`` is not told apart (the eager,
single-process `locate` is). Control flow (``cond``, ``while``, ``scan``)
counts as one equation (its outputs' devices named, the module that called
it); a ``shard_map``'s body is walked on each device, its flags coming out
per device.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore

from _stablecore.locate import MASKED_NAN, Stats
from jaxstable._src.locate_origins import CANONICAL_OPS, Origin, is_float
from jaxstable._src.locate_trace import (
    bind,
    literal_bad,
    module_of,
    sub_jaxpr,
    traced_jaxpr,
    user_source,
)

# What the last sharded locate exchanged between processes and the memory
# of its programs, for the tests and the docs.
stats: dict[str, Any] = {"exchanged_bytes": 0, "memory": {}}

_STATS_INT = ("nan", "inf", "neg_inf", "zeros", "negatives")


class Rec(NamedTuple):
    """One floating value the program computes (its index is its id)."""

    op: str  # "input" and "constant" for values not computed
    ins: tuple[int, ...]  # ids of the floating values it was computed from
    module: str | None
    source: str | None
    literal_bad: bool  # a non-finite literal was an input (a mask value)
    dtype: str = ""


def is_sharded(tree: Any) -> bool:
    """Whether a leaf of ``tree`` is split over several processes (a
    replicated one, such as a loss scale, is read where it is)."""
    return any(
        isinstance(x, jax.Array)
        and not x.is_fully_addressable
        and not x.is_fully_replicated
        for x in jax.tree_util.tree_leaves(tree)
    )


def host_scalar(x: Any) -> Any:
    """A replicated value on this host, without a collective."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


# ---------------------------------------------------------------- program
# Primitives whose output is non-finite exactly where their input is (the
# same elements, moved): not counted, their output is their input's value.
_MOVES = {
    *("broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims"),
    *("copy", "copy_p", "rev"),
}


def _flags(val) -> Any:
    """``[NaN, +inf, -inf]`` flags (0 or 1) of a value, in one reduction
    (one pass over the value, fused with its producer)."""
    real = jnp.real(val) if jnp.iscomplexobj(val) else val
    code = jnp.stack([jnp.isnan(val), real == jnp.inf, real == -jnp.inf], -1)
    return jnp.max(code.astype(jnp.int8), axis=tuple(range(val.ndim))).astype(jnp.int32)


class _Walk:
    """Evaluates a closed jaxpr inside a `jax.jit` trace, counting the
    non-finite elements of every floating value (``capture``: the id of the
    value whose inputs and mask are kept instead)."""

    def __init__(self, capture: int | None = None) -> None:
        self.recs: list[Rec] = []
        self.counts: list[Any] = []
        self.capture, self.got = capture, None

    def value(self, val, rec: Rec, ins: list) -> int:
        if not is_float(val):
            return -1
        i = len(self.recs)
        self.recs.append(rec._replace(dtype=np.dtype(val.dtype).name))
        self.counts.append(_flags(val))
        if i == self.capture:
            self.got = (val, ins)  # a tuple of 2: see `_shard_map` for 4
        return i

    def run(self, closed, vals: list, ids: list, module: str | None) -> list:
        jaxpr, env = closed.jaxpr, {}

        def read(v):
            return (v.val, -1) if isinstance(v, jcore.Literal) else env[v]

        for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
            env[v] = (c, self.value(c, Rec("constant", (), None, None, False), []))
        for v, x, i in zip(jaxpr.invars, vals, ids, strict=True):
            env[v] = (x, i)
        for eqn in jaxpr.eqns:
            pairs = [read(v) for v in eqn.invars]
            invals = [p[0] for p in pairs]
            sub = sub_jaxpr(eqn)
            moved = [p[1] for p in pairs if p[1] >= 0]
            if eqn.primitive.name in _MOVES and len(moved) == 1:
                outs = [(o, moved[0]) for o in bind(eqn, invals)]
            elif eqn.primitive.name == "shard_map":
                here = module_of(eqn.source_info, module)
                outs = self._shard_map(eqn, pairs, here)
            elif sub is not None:
                here = module_of(eqn.source_info, module)
                outs = self.run(sub, invals, [p[1] for p in pairs], here)
            else:
                rec = Rec(
                    CANONICAL_OPS.get(eqn.primitive.name, eqn.primitive.name),
                    tuple(p[1] for p in pairs if p[1] >= 0),
                    module_of(eqn.source_info, module),
                    user_source(eqn.source_info),
                    literal_bad(eqn, invals),
                )
                outs = [(o, self.value(o, rec, invals)) for o in bind(eqn, invals)]
            for v, o in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, jcore.DropVar):
                    env[v] = o
        return [read(v) for v in jaxpr.outvars]

    def _shard_map(self, eqn, pairs: list, module: str | None) -> list:
        """A ``shard_map`` evaluated with its body walked on each device:
        the body's flags come out per device (stacked on the mesh axes) and
        count as their maximum; the captured value's mask and stats come
        out the same way (`_Walk.got` then holds them, ``"blocks"``)."""
        from jax.sharding import PartitionSpec

        p = eqn.params
        mesh = p["mesh"]
        axes = tuple(a for a in mesh.axis_names if a in p["newly_manual_axes"])
        spec = PartitionSpec(axes)
        start = len(self.recs)
        inner = _Walk(self.capture)
        inner.recs = self.recs  # ids stay global: [start, start + n)
        ids = [q[1] for q in pairs]
        found: dict = {}

        def body(*xs):
            outs = inner.run(jcore.ClosedJaxpr(p["jaxpr"], ()), list(xs), ids, module)
            found["ids"] = [i for _, i in outs]
            flags = (
                jnp.stack([_varying(c, axes) for c in inner.counts])
                if inner.counts
                else jnp.zeros((0, 3), jnp.int32)
            )
            extra = [_varying(flags[None], axes)]
            if inner.got is not None:
                val, ins = inner.got
                one = [jax.tree.map(lambda a: a[None], _value_stats(val))]
                one += [
                    jax.tree.map(lambda a: a[None], _value_stats(x))
                    for x in ins
                    if is_float(x)
                ]
                found["ins"] = [
                    (x.shape, np.dtype(x.dtype).name) for x in ins if is_float(x)
                ]
                extra += [jnp.atleast_1d(~jnp.isfinite(val)), one]
            extra = jax.tree.map(lambda a: _varying(a, axes), extra)
            return tuple(o for o, _ in outs), extra

        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=tuple(p["in_specs"]),
            out_specs=(tuple(p["out_specs"]), spec),
            check_vma=p["check_vma"],
        )
        outs, extra = mapped(*[q[0] for q in pairs])
        flags = jnp.max(extra[0], axis=0)
        self.counts.extend(flags[k] for k in range(len(self.recs) - start))
        if len(extra) > 1:
            mask, (out, *ins) = extra[1], extra[2]
            self.got = ("blocks", mask, _merged(out), [_merged(x) for x in ins])
            self.got_ins = found["ins"]
        return list(zip(outs, found["ids"], strict=True))


def _varying(x, axes: tuple) -> Any:
    """``x`` marked as varying over ``axes`` (each device's own value) where
    it is not already, for an output stacked over them."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    have = getattr(mat, "varying", None) or getattr(aval, "vma", None) or ()
    missing = tuple(a for a in axes if a not in have)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _merged(stats: dict) -> dict:
    """Per-device stats (stacked) as the stats of all the blocks."""
    out = {k: jnp.sum(v) for k, v in stats.items() if k not in ("max_abs", "max")}
    out["max_abs"] = jnp.max(stats["max_abs"])
    out["max"] = jnp.max(stats["max"])
    return out


def _value_stats(x) -> dict:
    real = jnp.real(x) if jnp.iscomplexobj(x) else x
    fin = jnp.isfinite(x)
    absx = jnp.where(fin, jnp.abs(x), 0)
    return {
        "nan": jnp.sum(jnp.isnan(x), dtype=jnp.int32),
        "inf": jnp.sum(jnp.isinf(x), dtype=jnp.int32),
        "neg_inf": jnp.sum(real == -jnp.inf, dtype=jnp.int32),
        "zeros": jnp.sum((x == 0) & fin, dtype=jnp.int32),
        "negatives": jnp.sum((real < 0) & fin, dtype=jnp.int32),
        "n_fin": jnp.sum(fin, dtype=jnp.int32),
        "max_abs": jnp.max(absx.astype(jnp.float32)),
        "max": jnp.max(jnp.where(fin, real, -jnp.inf).astype(jnp.float32)),
    }


_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _program(closed, capture: int | None):
    """The jitted counting program of ``closed`` (``capture``: the prefix
    program returning the stats of value ``capture``, of its inputs and its
    bad-mask), and a list its records are put in when it is traced."""
    per = _PROGRAMS.setdefault(closed, {})
    if capture in per:
        return per[capture]
    meta: list = []

    def program(*leaves):
        walk = _Walk(capture)
        ids = [walk.value(x, Rec("input", (), None, None, False), []) for x in leaves]
        outs = walk.run(closed, list(leaves), ids, None)
        meta[:] = [walk.recs, [i for _, i in outs]]
        if capture is None:
            return jnp.stack(walk.counts)
        if walk.got[0] == "blocks":
            _, mask, out, ins = walk.got
            meta.append(walk.got_ins)
            return mask, out, ins
        val, ins = walk.got
        meta.append([(x.shape, np.dtype(x.dtype).name) for x in ins if is_float(x)])
        return (
            ~jnp.isfinite(val),
            _value_stats(val),
            [_value_stats(x) for x in ins if is_float(x)],
        )

    per[capture] = (jax.jit(program), meta)
    return per[capture]


def program_memory(fun, args, cache) -> dict:
    """Bytes of the counting program of ``fun(*args)`` (XLA's memory
    analysis: arguments, outputs, temporaries), per device."""
    closed, _ = traced_jaxpr(fun, args, cache, True)
    jitted, _ = _program(closed, None)
    mem = jitted.lower(*jax.tree_util.tree_leaves(args)).compile().memory_analysis()
    return _memory(mem)


def _memory(mem) -> dict:
    return {
        "argument": int(mem.argument_size_in_bytes),
        "output": int(mem.output_size_in_bytes),
        "temp": int(mem.temp_size_in_bytes),
        "alias": int(mem.alias_size_in_bytes),
    }


# ------------------------------------------------------------------ runs
class Counted(NamedTuple):
    """One run of the counting program."""

    closed: Any
    shape: Any  # output shape tree of ``fun``
    recs: list[Rec]
    counts: np.ndarray  # (values, 3): NaN, +inf, -inf flags (0/1)
    outs: list[int]  # value id of each output leaf (-1: not floating)
    args: list  # the leaves the program ran on


def count(fun, args, cache) -> Counted:
    """Runs the counting program of ``fun(*args)`` (every process)."""
    closed, shape = traced_jaxpr(fun, args, cache, True)
    jitted, meta = _program(closed, None)
    leaves = jax.tree_util.tree_leaves(args)
    counts = host_scalar(jitted(*leaves))
    return Counted(closed, shape, meta[0], counts, meta[1], leaves)


def tainted(c: Counted) -> tuple[list[bool], list[bool], list[str | None]]:
    """Per value: whether it is non-finite from a real cause, whether it is
    an origin, and its hint. Inputs and constants are intentional (the
    phases before refused any other non-finite input), and so is a value
    made from a non-finite literal (``where(mask, s, -inf)``) or only
    carrying intentional ``-inf``; a NaN or +inf made from finite or
    intentional values is an origin (`MASKED_NAN` when intentional
    infinities made the NaN), as is a -inf made from finite values alone."""
    n = len(c.recs)
    bad = [bool(c.counts[i].any()) for i in range(n)]
    real, origin, hint = [False] * n, [False] * n, [None] * n
    for i, r in enumerate(c.recs):
        if not bad[i] or r.op in ("input", "constant"):
            continue
        ins = [j for j in r.ins if bad[j]]
        if any(real[j] for j in ins):
            real[i] = True
            continue
        nan, pinf, _ = (int(x) for x in c.counts[i])
        had = np.sum([c.counts[j] for j in ins], axis=0) if ins else np.zeros(3)
        if not ins:
            origin[i] = not r.literal_bad
        elif nan or (pinf and not had[1]):
            origin[i] = True
            hint[i] = MASKED_NAN if nan and not (pinf and not had[1]) else None
        real[i] = origin[i]
    return real, origin, hint


def origin_of(c: Counted, target: int) -> tuple[int | None, str | None]:
    """The first origin (in evaluation order) whose non-finite values reach
    value ``target`` along non-finite values; and its hint."""
    real, origin, hint = tainted(c)
    seen, stack, found = set(), [target], []
    while stack:
        v = stack.pop()
        if v < 0 or v in seen or not real[v]:
            continue
        seen.add(v)
        if origin[v]:
            found.append(v)
        stack.extend(c.recs[v].ins)
    if not found:
        return None, None
    first = min(found)
    return first, hint[first]


def _stats(d: dict, shape, dtype) -> Stats:
    g = {k: int(host_scalar(v)) for k, v in d.items() if k not in ("max_abs", "max")}
    fin = g["n_fin"] > 0
    return Stats(
        shape=tuple(shape),
        dtype=np.dtype(dtype).name,
        nan=g["nan"],
        inf=g["inf"],
        max_abs=float(host_scalar(d["max_abs"])) if fin else float("nan"),
        max=float(host_scalar(d["max"])) if fin else float("nan"),
        zeros=g["zeros"],
        negatives=g["negatives"],
        size=int(np.prod(shape)),
        neg_inf=g["neg_inf"],
    )


def describe(c: Counted, index: int, hint: str | None) -> tuple[Origin, list]:
    """The origin ``index`` with its facts (stats of its output and inputs,
    from the prefix program) and ``[(process, device id, bad elements)]``
    of the devices whose shards of its output are non-finite."""
    jitted, meta = _program(c.closed, index)
    mask, out, ins = jitted(*c.args)
    r = c.recs[index]
    o = Origin(
        index=index,
        op=r.op,
        module=r.module,
        source=r.source,
        facts=(
            _stats(out, mask.shape, r.dtype),
            [_stats(s, *m) for s, m in zip(ins, meta[2], strict=True)],
            None,
        ),
        hint=hint,
    )
    return o, exchange(local_rows(mask))


def device_index(device: Any) -> int:
    """A device's position in ``jax.devices()`` (the global order every
    process shares; CPU device ids of several processes are not 0..n-1)."""
    return jax.devices().index(device)


def local_rows(mask: Any) -> list[tuple[int, int, int]]:
    """``(process, device id, bad elements)`` of this process's shards of
    a bad-mask (or of a value: its non-finite elements)."""
    rows = []
    for sh in mask.addressable_shards:
        a = np.asarray(sh.data)
        n = int(a.sum()) if a.dtype == bool else int((~np.isfinite(a)).sum())
        rows.append((jax.process_index(), device_index(sh.device), n))
    return rows


def exchange(rows: list[tuple], dtype: Any = np.int64) -> list[tuple]:
    """Every process's rows (a few numbers per device): the only values
    that cross processes. Counted in ``stats["exchanged_bytes"]``."""
    mine = np.asarray(rows, dtype).reshape(len(rows), -1)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        mine = np.asarray(multihost_utils.process_allgather(mine))
        mine = mine.reshape(-1, mine.shape[-1])
        stats["exchanged_bytes"] += mine.nbytes
    cast = int if np.dtype(dtype).kind == "i" else float
    return [tuple(cast(x) for x in r) for r in mine]


def _shards(leaf: Any) -> list[tuple[int, bool, np.ndarray]]:
    """``(device index, counted, values)`` of this process's shards of
    ``leaf`` (a replicated shard counted once; a host array: this
    process's first device's)."""
    if not isinstance(leaf, jax.Array):
        return [(device_index(jax.local_devices()[0]), True, np.asarray(leaf))]
    return [
        (device_index(sh.device), sh.replica_id == 0, np.asarray(sh.data))
        for sh in leaf.addressable_shards
    ]


def _local_bad(leaf: Any, masks_ok: bool) -> bool:
    """Whether this process's shards of ``leaf`` hold a non-finite value
    (with ``masks_ok``, other than ``-inf``)."""
    for _, _, a in _shards(leaf):
        bad = ~np.isfinite(a)
        if masks_ok:
            bad &= ~(a == -np.inf)
        if bad.any():
            return True
    return False


def first_bad_named(items: list[tuple[str, Any]], masks_ok: bool = False):
    """``(name, leaf, stats, rows)`` of the non-finite floating leaf whose
    name sorts first over every process, each checking its own shards;
    None when all are finite. Two exchanges of one row per process, then
    one per device: no leaf crosses processes."""
    items = sorted(((n, x) for n, x in items if is_float(x)), key=lambda t: t[0])
    first = next(
        (i for i, (_, x) in enumerate(items) if _local_bad(x, masks_ok)), len(items)
    )
    first = min(r[0] for r in exchange([(first,)]))
    if first == len(items):
        return None
    name, leaf = items[first]
    rows = []
    for device, once, a in _shards(leaf):
        fin = np.isfinite(a)
        rows.append(
            (
                jax.process_index(),
                device,
                int((~fin).sum()),
                int(np.isnan(a).sum()) * once,
                int(np.isinf(a).sum()) * once,
                int((a == -np.inf).sum()) * once,
                float(np.abs(np.where(fin, a, 0)).max(initial=0)),
            )
        )
    rows = exchange(rows, np.float64)
    s = Stats(
        shape=tuple(np.shape(leaf)),
        dtype=np.dtype(leaf.dtype).name,
        nan=int(sum(r[3] for r in rows)),
        inf=int(sum(r[4] for r in rows)),
        max_abs=max(r[6] for r in rows),
        max=float("nan"),
        zeros=0,
        negatives=0,
        size=int(np.size(leaf)),
        neg_inf=int(sum(r[5] for r in rows)),
    )
    return name, leaf, s, [(int(p), int(d), int(n)) for p, d, n, *_ in rows]


def where_devices(rows: list[tuple]) -> str:
    """Text naming the processes and devices whose rows count bad values."""
    bad = sorted((d, p, n) for p, d, n in rows if n)
    if not bad:
        return ""
    procs = sorted({p for _, p, _ in bad})
    devs = ", ".join(str(d) for d, _, _ in bad)
    return (
        f" [process {', '.join(map(str, procs))}, device{'s' if len(bad) > 1 else ''}"
        f" {devs}]"
    )
