"""Sharded (FSDP2) checkpoints with `torch.distributed.checkpoint` (private).

A TrainStep over an FSDP2 model under a process group of N > 1 ranks is
saved with torch.distributed.checkpoint (DCP): every rank writes its own
shards, no rank gathers the model. The checkpoint is a directory
``step_{n:08d}.dcp`` holding DCP's files (``.metadata``, ``__{r}_0.distcp``)
and ``checkpoint.pt``: a file of `checkpoint_format`'s format (JSON header
line + payload) whose payload holds everything but the tensors of the model
and the optimizer state (scaler, counters, the optimizer's param_groups by
parameter name, each rank's RNG states, the data position, fit's snapshot)
and whose header holds the sha256 of every DCP file. The header's format
is `DCP_FORMAT`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import warnings
from typing import Any

import torch

from _stablecore.checkpoint import CorruptCheckpoint as _CorruptCheckpoint
from _stablecore.checkpoint import fsync_dir as _fsync_dir
from _stablecore.checkpoint import raise_mismatches as _raise_mismatches
from torchref._src.checkpoint_checks import (
    check_optimizer_class,
    check_scaler_class,
    class_names,
    leaf_specs,
    param_group_mismatches,
    param_mismatches,
    param_specs,
    structure_mismatches,
)
from torchref._src.checkpoint_format import (
    CLASSES_KEY,
    DCP_FORMAT,
    DCP_HEADER,
    PARAMS_KEY,
    digest,
    optimizer_state,
    read_header,
    rng_states,
    set_rng_states,
    state_by_index,
    state_by_name,
    write_durably,
)
from torchref._src.distributed import inner_module
from torchref._src.step import TrainStep

# DCP keys: "model/<name>", "optimizer/<parameter name>/<state key>" and
# "outside_params/<name>" (the optimizer's parameters outside the model).
_MODEL, _OPTIM, _OUTSIDE = "model/", "optimizer/", "outside_params/"


def is_sharded(step: Any) -> bool:
    """Whether `step` is saved with DCP: a TrainStep over an FSDP2 model
    under a process group of more than one rank."""
    import torch.distributed as dist

    from torchref._src.distributed import is_fsdp

    return (
        isinstance(step, TrainStep)
        and is_fsdp(step.model)
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _share_of_files(directory: str, collective: bool) -> list[str]:
    """The DCP files of `directory` this rank hashes: every ``r``-th one
    (sorted) under a collective, all of them otherwise."""
    import torch.distributed as dist

    names = sorted(n for n in os.listdir(directory) if n != DCP_HEADER)
    if not collective:
        return names
    return names[dist.get_rank() :: dist.get_world_size()]


def gathered(obj: Any) -> list[Any]:
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def _dcp_tensors(step: TrainStep) -> tuple[dict, dict]:
    """``(tensors for DCP, the rest of the optimizer state)``: the model's
    state dict (this rank's DTensor shards) and every tensor of the
    optimizer state keyed by parameter name; the rest holds the
    param_groups by name, the non-tensor state values and the saved keys.

    Not `torch.distributed.checkpoint.state_dict.get_state_dict`: on an
    optimizer without state yet (a save before the first step) it runs a
    step with zero gradients and lr 0 to create one, which sets Adam's
    step count to 1 on the live optimizer and in the checkpoint, so a run
    saved (or resumed) there would take another first step than the
    uninterrupted run.
    """
    tensors = {_MODEL + k: v for k, v in inner_module(step.model).state_dict().items()}
    outside = step._outside_params()
    tensors.update({_OUTSIDE + k: p.detach() for k, p in outside.items()})
    names, specs = param_specs(step)
    by_name = state_by_name(step.optimizer.state_dict(), names)
    keys, scalars = [], {}
    for name, state in by_name["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{_OPTIM}{name}/{key}"] = value
                keys.append([name, key])
            else:
                scalars.setdefault(name, {})[key] = value
    rest = {"param_groups": by_name["param_groups"], "keys": keys, "scalars": scalars}
    return tensors, {"optimizer": rest, PARAMS_KEY: specs}


def save_dcp(
    path: str,
    step: TrainStep,
    global_step: Any,
    data_position: Any,
    metrics: Any,
    fit_state: dict | None = None,
    snapshot: dict | None = None,
    fit_extras: dict | None = None,
) -> None:
    """Writes `step` as the DCP checkpoint directory `path` (a collective:
    every rank calls it and writes its shards; rank 0 writes the header).

    Written into ``path + ".partial"`` and renamed by rank 0 once every
    rank's files and their sha256 are in: a crash leaves the previous
    checkpoint as it was.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    tmp = f"{path}.partial"
    if rank == 0 and os.path.lexists(tmp):
        shutil.rmtree(tmp)
    dist.barrier()
    tensors, rest = _dcp_tensors(step)
    dcp.save(tensors, checkpoint_id=tmp)
    rng = gathered(rng_states())
    dist.barrier()  # every rank's files are written
    digests = {}
    for share in gathered(
        {n: _file_sha256(os.path.join(tmp, n)) for n in _share_of_files(tmp, True)}
    ):
        digests.update(share)
    error = None
    if rank == 0:
        try:
            payload = {**rest, **step._counters_dict(), "rng": rng}
            payload.update(data_position=data_position, world=dist.get_world_size())
            payload[CLASSES_KEY] = class_names(step)
            if snapshot is not None:
                names = param_specs(step)[0]
                by_name = optimizer_state(snapshot["optimizer"], state_by_name, names)
                payload["snapshot"] = {**snapshot, "optimizer": by_name}
            if fit_extras is not None:
                payload["fit_extras"] = fit_extras
            buf = io.BytesIO()
            torch.save(payload, buf)
            header = {
                "format": DCP_FORMAT,
                "step": global_step,
                "data_position": data_position,
                "metrics": metrics,
                "fit_state": fit_state,
                "files": digests,
            }
            header["sha256"] = digest(header, buf.getvalue())
            data = json.dumps(header).encode() + b"\n" + buf.getvalue()
            write_durably(os.path.join(tmp, DCP_HEADER), data)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.remove(path)
            os.replace(tmp, path)
            _fsync_dir(os.path.dirname(os.path.abspath(path)))
        except Exception as e:  # told to every rank, raised on each
            error = f"{type(e).__name__}: {e}"
    told = [error]
    dist.broadcast_object_list(told, src=0)
    if told[0] is not None:
        raise RuntimeError(
            f"rank 0 could not finish the sharded checkpoint {path!r}: {told[0]}"
        )


def _dcp_header(path: Any) -> tuple[dict, bytes]:
    """``(header, payload)`` of a DCP checkpoint directory, checked."""
    head = os.path.join(path, DCP_HEADER)
    if not os.path.isfile(head):
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} has no {DCP_HEADER} (an unfinished "
            "or foreign directory)"
        )
    header, payload = read_header(head)
    if (header or {}).get("format") != DCP_FORMAT:
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r}: {DCP_HEADER} is not a sharded "
            f"checkpoint's header ({DCP_FORMAT})"
        )
    return header, payload


def _check_dcp_files(path: Any, header: dict, collective: bool) -> None:
    """Each DCP file has the sha256 its header saved (under a collective,
    every rank hashes its share and all agree on the verdict)."""
    files = header.get("files") or {}
    have = set(os.listdir(path)) - {DCP_HEADER}
    bad = sorted(set(files) ^ have)
    mine = [n for n in _share_of_files(path, collective) if n in files]
    bad += [n for n in mine if _file_sha256(os.path.join(path, n)) != files[n]]
    if collective:
        bad = sorted({n for every in gathered(bad) for n in every})
    if bad:
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} is corrupt or incomplete: its files "
            f"{bad} are missing, extra, or do not match the sha256 saved with them"
        )


def load_dcp(path: Any, step: Any, restore_rng: bool, expected: int | None):
    """`load_into` for a DCP checkpoint directory: its header (with the data
    position and fit's snapshot, as `load_into` returns it).

    A collective when `step` is sharded (`is_sharded`): every rank reads
    its own shards. Otherwise (one process, DDP) this process reads the
    whole tensors alone (``no_dist``): a checkpoint of N FSDP2 ranks
    restores into any placement.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not isinstance(step, TrainStep):
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} is a sharded TrainStep checkpoint; "
            f"it loads into a TrainStep, not a {type(step).__name__}"
        )
    collective = is_sharded(step)
    header, payload = _dcp_header(path)
    if expected is not None and header.get("step") not in (None, expected):
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} is not checkpoint {expected}: its "
            f"header names step {header['step']}"
        )
    _check_dcp_files(path, header, collective)
    extras = torch.load(io.BytesIO(payload), weights_only=True)
    metadata = dcp.FileSystemReader(os.fspath(path)).read_metadata()
    saved = metadata.state_dict_metadata
    _check_dcp_structure(path, saved, extras, step)
    names = param_specs(step)[0]
    by_name = dict(zip(names, step._params(), strict=True))
    template = {_MODEL + k: v for k, v in inner_module(step.model).state_dict().items()}
    # The outside parameters' values: saved by checkpoints since issue 34
    # (an older one has none, and says so by a RuntimeWarning).
    own = step._outside_params()
    has_outside = any(k.startswith(_OUTSIDE) for k in saved)
    if has_outside:
        template.update(
            {_OUTSIDE + k: torch.zeros_like(p.detach()) for k, p in own.items()}
        )
    for name, key in extras["optimizer"]["keys"]:
        md, p = saved[f"{_OPTIM}{name}/{key}"], by_name[name]
        dtype = md.properties.dtype
        if tuple(md.size) == tuple(p.shape):  # placed as its parameter
            like = torch.zeros_like(p.detach(), dtype=dtype)
        else:  # e.g. Adam's step count
            like = torch.zeros(tuple(md.size), dtype=dtype)
        template[f"{_OPTIM}{name}/{key}"] = like
    with warnings.catch_warnings():
        # no_dist: DCP warns that it assumes a single process; we asked it.
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(template, checkpoint_id=os.fspath(path), no_dist=not collective)
    from torchref._src.distributed import load_plain_state_dict

    model = {k[len(_MODEL) :]: v for k, v in template.items() if k.startswith(_MODEL)}
    load_plain_state_dict(step.model, model)
    rest = extras["optimizer"]
    state: dict = {n: dict(v) for n, v in rest["scalars"].items()}
    for name, key in rest["keys"]:
        state.setdefault(name, {})[key] = template[f"{_OPTIM}{name}/{key}"]
    optimizer = {"state": state, "param_groups": rest["param_groups"]}
    step.optimizer.load_state_dict(state_by_index(optimizer, names, step))
    if has_outside or own:
        values = {k: template[_OUTSIDE + k] for k in own} if has_outside else None
        step._set_outside_params(step._outside_values(values))
    step._load_counters(extras)
    if restore_rng and extras.get("rng"):
        rngs = extras["rng"]
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        # Each rank its own states when the world is the one saved; else
        # rank 0's everywhere (as a checkpoint file restores them).
        set_rng_states(rngs[rank] if world == len(rngs) else rngs[0])
    out = dict(header)
    out["data_position"] = extras.get("data_position", header.get("data_position"))
    snapshot = extras.get("snapshot")
    if snapshot is not None:
        by_index = state_by_index(snapshot["optimizer"], names, step)
        out["snapshot"] = {**snapshot, "optimizer": by_index}
    if extras.get("fit_extras") is not None:
        out["fit_extras"] = extras["fit_extras"]
    return out


def _check_dcp_structure(path: Any, saved: dict, extras: dict, step: TrainStep):
    """`check_train_step` for a DCP checkpoint: classes, the model's keys,
    global shapes and dtypes (from DCP's metadata) and the optimizer's
    parameters by name."""
    classes = extras.get(CLASSES_KEY) or {}
    check_scaler_class(path, classes, extras.get("scaler") or {}, step)
    check_optimizer_class(path, classes, {}, step.optimizer)
    model = {
        "model/" + k[len(_MODEL) :]: (
            tuple(md.size),
            str(md.properties.dtype).removeprefix("torch."),
        )
        for k, md in saved.items()
        if k.startswith(_MODEL) and hasattr(md, "size")
    }
    lines = structure_mismatches(
        {**model, **leaf_specs(extras["skip_state"], "skip_state")},
        {
            **leaf_specs(inner_module(step.model).state_dict(), "model"),
            **leaf_specs(dataclasses.asdict(step.skip_state), "skip_state"),
        },
    )
    opt = {"state": {}, "param_groups": extras["optimizer"]["param_groups"]}
    lines += param_group_mismatches(opt, step.optimizer)
    if not lines:
        params = param_specs(step)[1]
        lines = param_mismatches(extras[PARAMS_KEY], opt, params, step)
    _raise_mismatches(path, lines)
