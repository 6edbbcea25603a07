"""Locating a DDP or FSDP2 step without gathering it (private).

`torchref.diagnostics.locate` of a step whose model is wrapped by DDP or
sharded by FSDP2 in a process group of several ranks re-runs the step on
every rank at once (FSDP2's forward and backward are collectives: every
rank runs them, or none), each on its own rows, under `FirstBad`: a
`TorchDispatchMode` that keeps no tensor, only the facts of the first op
whose output is non-finite on this rank while its inputs were finite (its
name, module, user line, and the stats of its output and inputs), checked
on this rank's local values (a `DTensor`'s local shard). A collective
(``c10d``, functional collectives, FSDP's own copy ops) is never an
origin: its non-finite output came from another rank. Then only small
records cross ranks (`exchange`, ``all_gather_object`` of a few hundred
bytes per rank): which rank's rows, which layer, which op. The memory is
the step's own forward and backward (FSDP2 gathers each layer's
parameters as its step does).

Per op, not per element: an op whose inputs already hold a masked
``-inf`` is not an origin here (the single-process `locate` tells a new
overflow beside a mask).
"""

from __future__ import annotations

import math
import pickle
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchref._src.locate_origins import Origin, all_finite, is_float, tensor_stats
from torchref._src.locate_scopes import MODULE_TAG
from torchref._src.locate_trace import SOURCE_TAG, op_name, python_source

# What the last distributed locate sent to the other ranks, in bytes.
stats: dict[str, Any] = {"exchanged_bytes": 0}

# Namespaces of ops that move values between ranks (or FSDP's buffers).
_COLLECTIVES = ("c10d", "_c10d_functional", "c10d_functional", "fsdp", "_dtensor")
# Ops that make a tensor of uninitialised memory (FSDP's buffers): whatever
# it holds is no value of the step's.
_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty"}
_UNINITIALISED |= {"new_empty_strided", "resize_", "resize"}


def distributed_kind(step: Any) -> str | None:
    """``"ddp"`` or ``"fsdp"`` for a `TrainStep` on a wrapped model in a
    process group of several ranks, else None."""
    rep = getattr(step, "_replicas", None)
    if rep is None or not dist.is_available() or not dist.is_initialized():
        return None
    if dist.get_world_size() < 2:
        return None
    return "ddp" if rep.ddp is not None else "fsdp"


def local(t: Any) -> Any:
    """This rank's values of ``t`` (a `DTensor`'s local shard)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _floats(tree: Any) -> list[torch.Tensor]:
    return [local(t) for t in tree_flatten(tree)[0] if is_float(t)]


def _literal_bad(tree: Any) -> bool:
    """A non-finite Python float among an op's arguments (a mask value)."""
    return any(
        isinstance(a, float) and not math.isfinite(a) for a in tree_flatten(tree)[0]
    )


class FirstBad(TorchDispatchMode):
    """Records the first op, forward or backward, whose output is
    non-finite on this rank while its inputs were finite (see the module
    doc); keeps no tensor. ``stack``: the running modules, as
    `locate_scopes.module_hooks` keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list = []
        self.first: dict | None = None
        self.unnamed: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        node = torch._C._current_autograd_node()
        if node is None:
            self._note_sources(out)
        if self.first is None:
            self._check(func, args, kwargs, out, node)
        return out

    def _note_sources(self, out: Any) -> None:
        """Each tensor a forward op made, with the user's line: its
        autograd node (attached once the op returns) gets it in
        `name_nodes`, for the backward op that runs it (weak references:
        no tensor kept)."""
        source = python_source()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.unnamed.append((weakref.ref(t), source))

    def name_nodes(self) -> None:
        for ref, source in self.unnamed:
            t = ref()
            node = None if t is None else t.grad_fn
            if node is not None and SOURCE_TAG not in node.metadata:
                node.metadata[SOURCE_TAG] = source
        self.unnamed.clear()

    def _check(self, func, args, kwargs, out, node) -> None:
        bad = [t for t in _floats(out) if not all_finite(t)]
        if not bad or func.namespace in _COLLECTIVES:
            return
        if func.overloadpacket.__name__ in _UNINITIALISED:
            return
        ins = _floats((args, kwargs))
        if any(not all_finite(t) for t in ins) or _literal_bad((args, kwargs)):
            return
        if node is None:
            module = self.stack[-1][1] if self.stack else None
            source = python_source()
        else:
            module = node.metadata.get(MODULE_TAG)
            source = node.metadata.get(SOURCE_TAG)
        self.first = {
            "phase": "forward" if node is None else "backward",
            "op": op_name(func),
            "module": module,
            "source": source,
            "out": tensor_stats(bad[0]),
            "ins": [tensor_stats(t) for t in ins],
        }


def origin(record: dict) -> Origin:
    """An `Origin` of a `FirstBad` record (no float64 recomputation)."""
    return Origin(
        index=0,
        op=record["op"],
        module=record["module"],
        source=record["source"],
        out=record["out"],
        ins=record["ins"],
        would_be=None,
    )


def exchange(obj: Any) -> list:
    """Every rank's ``obj`` (a small record), by rank; its pickled size
    counted in ``stats["exchanged_bytes"]``."""
    every = [None] * dist.get_world_size()
    stats["exchanged_bytes"] += len(pickle.dumps(obj)) * len(every)
    dist.all_gather_object(every, obj)
    return every


def ranks_text(ranks: list[int]) -> str:
    if not ranks:
        return ""
    return f" [rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}]"


def first_named(items: list[tuple[str, Any]], masks_ok: bool = False) -> tuple:
    """``(name, stats, ranks)`` of the non-finite tensor whose name sorts
    first over every rank (each checking its own values), or None."""
    mine = None
    for name, t in sorted(items, key=lambda x: x[0]):
        w = local(t)
        if not is_float(w) or all_finite(w):
            continue
        if (
            masks_ok
            and not bool(torch.isnan(w).any())
            and not bool((w == float("inf")).any())
        ):
            continue
        mine = (name, tensor_stats(w))
        break
    every = exchange(mine)
    found = [(r[0], rank, r[1]) for rank, r in enumerate(every) if r is not None]
    if not found:
        return None
    name = min(found)[0]
    hits = [(rank, s) for n, rank, s in found if n == name]
    return name, hits[0][1], [rank for rank, _ in hits]
