"""The checkpoint format and its integrity (private).

One checkpoint is an orbax directory of two items: ``state`` (the leaves, a
list of numpy arrays) and ``meta`` (JSON: the format, step, data position,
metrics, fit's state, the type names, each leaf's path, shape and dtype, and
a sha256 over all of these and every leaf's bytes); see
`jaxstable._src.checkpoint`. Format 1 and flax-msgpack files are still read.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from _stablecore.checkpoint import CorruptCheckpoint as _CorruptCheckpoint
from jaxstable._src.checkpoint_checks import state_types
from jaxstable._src.checkpoint_sharded import flat_leaves
from jaxstable._src.distributed import to_host
from jaxstable._src.step import TrainState

_FORMAT = "jaxstable-checkpoint-2"
_FORMAT_1 = "jaxstable-checkpoint-1"
# Top-level key of an old msgpack file (not a TrainState field) naming the
# optimizer state's types: two optimizers can share a state layout (adam's
# and adabelief's are both (count, mu, nu)) but not their type names.
TYPES_KEY = "_types"


def orbax_checkpoint():
    # Imported on first use: orbax adds ~1.3 s to `import jaxstable`.
    import orbax.checkpoint as ocp

    return ocp


def _is_key(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and jnp.issubdtype(
        leaf.dtype, jax.dtypes.prng_key
    )


def leaf_spec(leaf: Any) -> tuple[tuple, str]:
    """``(shape, dtype)``; a Python number is ``((), "int")`` etc."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return tuple(leaf.shape), str(leaf.dtype)
    return (), type(leaf).__name__


def _encode(tree: Any, first_index: int = 0) -> tuple[list[dict], list[np.ndarray]]:
    """``(entries, arrays)``: one JSON entry per leaf (path, shape, dtype and
    how it is stored) and the arrays orbax writes (none for a zero-size one)."""
    flat = flat_leaves(tree)
    entries = []
    for path, leaf in flat.items():
        shape, dtype = leaf_spec(leaf)
        entry = {"path": list(path), "shape": list(shape), "dtype": dtype}
        if _is_key(leaf):
            entry["impl"] = str(jax.random.key_impl(leaf))
        entries.append(entry)
    # Key data, then one device-to-host transfer for all the leaves.
    leaves = [jax.random.key_data(x) if _is_key(x) else x for x in flat.values()]
    arrays = []
    # to_host: under jax.distributed a leaf split over several processes
    # (FSDP) is all-gathered, so that every process writes, and hashes, the
    # same global values (every process calls save, in the same order).
    for entry, leaf in zip(entries, to_host(leaves), strict=True):
        data = np.asarray(leaf)
        entry["data"] = [list(data.shape), data.dtype.name]
        if data.size:
            entry["index"] = first_index + len(arrays)
            # order="C", not ascontiguousarray: that makes a 0-d array (1,).
            arrays.append(np.asarray(data, order="C"))
    return entries, arrays


def _decode(entries: list[dict], arrays: list) -> tuple[dict, dict]:
    """``({path: value}, {path: (shape, dtype)})`` of saved `entries`."""
    values, specs = {}, {}
    for e in entries:
        path = tuple(e["path"])
        shape, dtype = e["data"]
        data = arrays[e["index"]] if "index" in e else np.zeros(shape, jnp.dtype(dtype))
        if "impl" in e:
            data = jax.random.wrap_key_data(data, impl=e["impl"])
        values[path] = data
        specs[path] = (tuple(e["shape"]), e["dtype"])
    return values, specs


def _digest(body: dict, arrays: list) -> str:
    """sha256 over the meta (all but the digest) and every array's bytes."""
    h = hashlib.sha256(json.dumps(body, sort_keys=True).encode())
    for a in arrays:
        a = np.asarray(a, order="C")
        h.update(f"|{a.dtype.name}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def migrate_v1(raw: Any) -> Any:
    """A format-1 (or msgpack) state dict in today's field names: its
    `DynamicLossScale` had one ``factor`` (growth; back-off 1 / factor),
    today's has GradScaler's two, ``growth_factor`` and ``backoff_factor``."""
    ls = raw.get("loss_scale") if isinstance(raw, dict) else None
    if isinstance(ls, dict) and "factor" in ls and "growth_factor" not in ls:
        ls = dict(ls)
        factor = float(np.asarray(ls.pop("factor")))
        ls["growth_factor"], ls["backoff_factor"] = factor, 1.0 / factor
        raw = {**raw, "loss_scale": ls}
    return raw


def _leaves_v1(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{path: leaf}`` of a format-1 state dict (as its digest saw it)."""
    if tree is None:
        return {}
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_leaves_v1(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    return {prefix or "<root>": tree}


def _digest_v1(tree: Any) -> str:
    """Format 1's sha256: every leaf's path, dtype, shape and bytes."""
    h = hashlib.sha256()
    for path, leaf in sorted(_leaves_v1(tree).items()):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{path}|{a.dtype}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


# -- writing and reading one checkpoint ----------------------------------------


def _types(state: Any) -> dict[str, str | None]:
    if not isinstance(state, TrainState):
        return {"opt_state": None, "loss_scale": None}
    return {
        "opt_state": state_types(state.opt_state),
        "loss_scale": type(state.loss_scale).__name__,
    }


def payload(
    state: Any,
    step: int | None,
    data_position: int | None,
    metrics: dict | None = None,
    fit_state: dict | None = None,
    snapshot: Any = None,
):
    """The two orbax items of a checkpoint: the arrays and their JSON meta."""
    entries, arrays = _encode(state)
    # A copy of fit's bookkeeping: orbax writes the meta in the background,
    # after the loop has gone on (and would have changed a live list).
    fit_state = json.loads(json.dumps(fit_state))
    metrics = json.loads(json.dumps(metrics))
    body = {
        "format": _FORMAT,
        "step": step,
        "data_position": step if data_position is None else int(data_position),
        "metrics": metrics,
        "fit_state": fit_state,
        "types": _types(state),
        "leaves": entries,
    }
    if snapshot is not None:  # fit's rollback snapshot, a state like `state`
        body["snapshot"], more = _encode(snapshot, len(arrays))
        arrays += more
    body["arrays"] = len(arrays)
    meta = {**body, "sha256": _digest(body, arrays)}
    ocp = orbax_checkpoint()
    # orbax refuses an empty tree: a state of zero-size arrays alone gets one
    # placeholder byte, outside the digest and never read.
    stored = arrays or [np.zeros((), np.uint8)]
    return ocp.args.Composite(
        state=ocp.args.StandardSave(stored), meta=ocp.args.JsonSave(meta)
    )


class Loaded(NamedTuple):
    """A checkpoint read and checked, not yet restored onto a target."""

    values: dict  # {path: value}
    specs: dict  # {path: (shape, dtype)}
    types: Any  # the saved type names (None in an older file)
    meta: dict
    raw: Any  # format 1 / msgpack: the state dict (for its loss-scale check)
    snapshot: tuple | None  # (values, specs) of fit's rollback snapshot


def read_checkpoint(path: Any, step: int | None = None) -> Loaded:
    """The checkpoint directory `path`, checked against its sha256 (and, for a
    manager's checkpoint `step`, against that step); `_CorruptCheckpoint`
    naming it when that fails."""
    ocp = orbax_checkpoint()
    args = ocp.args.Composite(
        state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()
    )
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            out = ckptr.restore(os.path.abspath(path), args=args)
    except Exception as e:  # orbax and tensorstore raise many types
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} cannot be read "
            f"({type(e).__name__}: {first})"
        ) from e
    meta = out.meta if isinstance(out.meta, dict) else {}
    if meta.get("format") == _FORMAT_1 and meta.get("sha256") == _digest_v1(out.state):
        raw = migrate_v1(out.state)
        values = flat_leaves(raw)
        specs = {p: leaf_spec(v) for p, v in values.items()}
        return Loaded(values, specs, meta.get("types"), meta, raw, None)
    body = {k: v for k, v in meta.items() if k != "sha256"}
    n = body.get("arrays")
    arrays = out.state if isinstance(out.state, list) else []
    intact = (
        meta.get("format") == _FORMAT
        and isinstance(n, int)
        and n <= len(arrays)
        and meta.get("sha256") == _digest(body, arrays[:n])
    )
    if not intact:
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} is corrupt: its arrays or meta "
            "(data position, step, NaN-policy state) do not match the sha256 "
            "saved with them"
        )
    if step is not None and meta.get("step") not in (None, step):
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} is not checkpoint {step}: its meta "
            f"names step {meta.get('step')}"
        )
    values, specs = _decode(meta["leaves"], arrays)
    snapshot = None
    if meta.get("snapshot") is not None:
        snapshot = _decode(meta["snapshot"], arrays)
    return Loaded(values, specs, meta.get("types"), meta, None, snapshot)
