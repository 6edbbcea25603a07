"""The checkpoint file format and its integrity (private).

One JSON header line (with a sha256 over the rest of the header and the
payload) followed by the `torch.save` payload, written durably; the
optimizer state keyed by parameter name in it (see
`torchref._src.checkpoint`). Format 1 and bare `torch.save` files are
still read.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from typing import Any

import torch

from _stablecore.checkpoint import CorruptCheckpoint as _CorruptCheckpoint
from _stablecore.checkpoint import fsync_dir as _fsync_dir
from _stablecore.checkpoint import temp_path as _temp_path
from torchref._src.checkpoint_checks import class_names, inner_state, param_specs
from torchref._src.step import TrainStep

FORMAT = "torchref-checkpoint-2"
_FORMAT_1 = "torchref-checkpoint-1"
# Key of the payload (not a state_dict key) naming the optimizer and scaler
# classes: a StaticGradScaler's state has a plain GradScaler's keys, and two
# optimizers can share their option names.
CLASSES_KEY = "classes"
# Key of the payload naming the optimizer's parameters, {name: [shape,
# dtype]} in the optimizer's order: its state is keyed by these names.
PARAMS_KEY = "params"
# Keys of the payload besides the state dict's.
# "fit_extras": what fit keeps besides the step (its schedulers' states,
# the RNG state its data was iterated with).
EXTRA_KEYS = (
    CLASSES_KEY, "rng", "data_position", PARAMS_KEY, "snapshot", "fit_extras"
)  # fmt: skip
# The largest header read; a header is ~200 bytes.
_MAX_HEADER = 1 << 16
# A sharded checkpoint's header (see `checkpoint_sharded`), and its file.
DCP_FORMAT = "torchref-dcp-1"
DCP_HEADER = "checkpoint.pt"


def rng_states() -> dict[str, Any]:
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if cuda else [],
        "python": random.getstate(),
    }


def set_rng_states(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    if rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(rng["python"])


def digest(header: dict, payload: bytes) -> str:
    """sha256 over the header (all but the digest) and the payload."""
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    h.update(b"\n")
    h.update(payload)
    return h.hexdigest()


def encode(
    step: Any,
    global_step: Any,
    data_position: Any,
    metrics: Any,
    fit_state: dict | None = None,
    snapshot: dict | None = None,
    fit_extras: dict | None = None,
) -> bytes:
    """Header line + payload of one checkpoint (the payload a deep copy)."""
    state = dict(step.state_dict())
    if isinstance(step, TrainStep):
        state[CLASSES_KEY] = class_names(step)
        names, state[PARAMS_KEY] = param_specs(step)
        state["optimizer"] = optimizer_state(state["optimizer"], state_by_name, names)
        if snapshot is not None:  # fit's rollback snapshot, a state_dict too
            by_name = optimizer_state(snapshot["optimizer"], state_by_name, names)
            snapshot = {**snapshot, "optimizer": by_name}
    state["rng"] = rng_states()
    state["data_position"] = data_position
    if snapshot is not None:
        state["snapshot"] = snapshot
    if fit_extras is not None:
        state["fit_extras"] = fit_extras
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    header = {
        "format": FORMAT,
        "step": global_step,
        "data_position": data_position,
        "metrics": metrics,
        "fit_state": fit_state,
    }
    header["sha256"] = digest(header, payload)
    return json.dumps(header).encode() + b"\n" + payload


def write_durably(path: str, data: bytes) -> None:
    """tmp file, flush, fsync, `os.replace`, fsync of the directory.

    The tmp name is unique to this process, thread and call (`_temp_path`):
    two threads saving to one path each rename their own complete file.
    """
    tmp = _temp_path(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_header(path: Any) -> tuple[dict | None, bytes]:
    """``(header, payload)``; header None for an older bare `torch.save` file."""
    if not os.path.isfile(path):  # e.g. a directory named like a checkpoint
        raise _CorruptCheckpoint(f"checkpoint {os.fspath(path)!r} is not a file")
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"PK":  # a zip: torch.save's own format, no header
        return None, data
    end = data.find(b"\n", 0, _MAX_HEADER)
    try:
        header = json.loads(data[:end]) if end > 0 else None
    except ValueError:
        header = None
    known = (FORMAT, _FORMAT_1, DCP_FORMAT)
    found = header.get("format") if isinstance(header, dict) else None
    if isinstance(found, str) and found.startswith("torchref-") and found not in known:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} is in format {found!r}, which this "
            f"torchref does not read (it reads {', '.join(known)} and bare "
            "torch.save files): load it with the torchref version that wrote it"
        )
    if found not in known:
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} is damaged or not a checkpoint: "
            f"no {FORMAT} header ({len(data)} bytes)"
        )
    payload = data[end + 1 :]
    if header["format"] == _FORMAT_1:  # its sha256 covered the payload alone
        intact = hashlib.sha256(payload).hexdigest() == header.get("sha256")
    else:
        body = {k: v for k, v in header.items() if k != "sha256"}
        intact = digest(body, payload) == header.get("sha256")
    if not intact:
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} is corrupt or truncated: its header "
            f"(data position, step, NaN-policy state) or payload ({len(payload)} "
            "bytes) does not match the sha256 saved with them"
        )
    return header, payload


def peek_header(path: str) -> dict:
    """The header line alone ({} if unreadable): cheap, for the metrics."""
    try:
        with open(path, "rb") as f:
            header = json.loads(f.readline(_MAX_HEADER))
    except (OSError, ValueError):
        return {}
    return header if isinstance(header, dict) else {}


def optimizer_state(state: dict, convert: Any, *args: Any) -> dict:
    """`state` with `convert` applied to the torch optimizer state dict in it."""
    if "param_groups" in state or not isinstance(state.get("optimizer"), dict):
        return convert(state, *args)
    inner = optimizer_state(state["optimizer"], convert, *args)
    return {**state, "optimizer": inner}


def state_by_name(state: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter name instead of position."""
    return {
        **state,
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]}
            for g in state["param_groups"]
        ],
    }


def state_by_index(saved: dict, names: list[str], step: TrainStep) -> dict:
    """A by-name optimizer state numbered as `step`'s optimizer numbers its
    parameters (the names already checked to match, group by group)."""
    index = {name: i for i, name in enumerate(names)}
    own = inner_state(step.optimizer.state_dict())["param_groups"]

    def convert(state: dict) -> dict:
        return {
            **state,
            "state": {index[n]: v for n, v in state["state"].items()},
            # torch pairs the saved groups' parameters with its own by
            # position: list them in its own order.
            "param_groups": [
                {**g, "params": list(mine["params"])}
                for g, mine in zip(state["param_groups"], own, strict=True)
            ],
        }

    return optimizer_state(saved, convert)
