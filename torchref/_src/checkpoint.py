"""Checkpoints of a `TrainStep`: one file per checkpoint, written durably.

A checkpoint file is one JSON header line (format, the run's global step,
data position, metrics, `fit`'s NaN-policy state, and a sha256 over the rest
of the header and the payload, so that a flipped bit anywhere, the data
position included, is caught rather than loaded) followed by the payload,
`torch.save` of ``step.state_dict()`` (model, optimizer, the values of
the optimizer's parameters the model does not hold, GradScaler
``state_dict()``, skip counters, steps done) plus the RNG states (torch
CPU, CUDA when initialised, Python's `random`), the data position, the
optimizer and scaler class names, the parameters' names, shapes and
dtypes, and `fit`'s rollback snapshot when it keeps one. The optimizer
state is keyed by parameter NAME (torch's own state dict numbers the
parameters by their position in the optimizer): a model whose optimizer
lists its parameters in another order loads each state onto its own
parameter. A parameter outside the model (a learned temperature used in
the loss) has the name given to torch's named-parameter optimizer, else
``<unnamed k>`` (the k-th such in the optimizer's order). It is written
to a temporary file, flushed and fsynced, then renamed over the final
name with `os.replace` (and the directory fsynced): a crash leaves the
previous file intact.

Under FSDP2 (a `TrainStep` over a ``fully_shard`` model, a process group
of more than one rank) a checkpoint is a DIRECTORY ``step_{n:08d}.dcp``
written with `torch.distributed.checkpoint`: every rank writes its own
shards, no rank gathers the model, and rank 0 adds ``checkpoint.pt`` (the
header + payload format above, ``torchref-dcp-1``) with the rest of the
state, each rank's RNG states and the sha256 of every shard file. It
restores in any placement: FSDP2 ranks read their shards together, a DDP
rank or one process reads whole tensors alone (see `_save_dcp`,
`_load_dcp` and docs/distributed.md).

Older files are still read: format 1 (``torchref-checkpoint-1``, whose
sha256 covered the payload only; its data position is taken from the
payload, which has it too) and bare `torch.save` zips (no checksum; telling
them apart costs two bytes). Their optimizer state is positional, and they
hold no NaN-policy state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import random
import re
import shutil
import threading
import warnings
from typing import Any

import torch

from _stablecore.checkpoint import TEMP_SUFFIX as _TEMP_SUFFIX
from _stablecore.checkpoint import CorruptCheckpoint as _CorruptCheckpoint
from _stablecore.checkpoint import check_manager_options as _check_manager_options
from _stablecore.checkpoint import fsync_dir as _fsync_dir
from _stablecore.checkpoint import raise_mismatches as _raise_mismatches
from _stablecore.checkpoint import temp_path as _temp_path
from _stablecore.checks import check_int as _check_int
from _stablecore.lock import locked_elsewhere
from torchref._src.distributed import _plain
from torchref._src.step import TrainStep, _scaler_kind, param_names

__all__ = ["CheckpointManager", "load_checkpoint", "save_checkpoint"]

_FORMAT = "torchref-checkpoint-2"
_FORMAT_1 = "torchref-checkpoint-1"
# Key of the payload (not a state_dict key) naming the optimizer and scaler
# classes: a StaticGradScaler's state has a plain GradScaler's keys, and two
# optimizers can share their option names.
_CLASSES_KEY = "classes"
_STATE_KEYS = ("model", "optimizer", "scaler", "skip_state", "steps_done")
# Key of the payload naming the optimizer's parameters, {name: [shape,
# dtype]} in the optimizer's order: its state is keyed by these names.
_PARAMS_KEY = "params"
# Keys of the payload besides the state dict's.
# "fit_extras": what fit keeps besides the step (its schedulers' states,
# the RNG state its data was iterated with).
_EXTRA_KEYS = (
    _CLASSES_KEY, "rng", "data_position", _PARAMS_KEY, "snapshot", "fit_extras"
)  # fmt: skip
# The largest header read; a header is ~200 bytes.
_MAX_HEADER = 1 << 16
_NAME = re.compile(r"^step_(\d{8,})\.pt$")
# A sharded checkpoint (see `_save_dcp`).
_DCP_FORMAT = "torchref-dcp-1"
_DCP_NAME = re.compile(r"^step_(\d{8,})\.dcp$")
_DCP_HEADER = "checkpoint.pt"
# DCP keys: "model/<name>", "optimizer/<parameter name>/<state key>" and
# "outside_params/<name>" (the optimizer's parameters outside the model).
_MODEL, _OPTIM, _OUTSIDE = "model/", "optimizer/", "outside_params/"


def _rng_states() -> dict[str, Any]:
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if cuda else [],
        "python": random.getstate(),
    }


def _set_rng_states(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    if rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(rng["python"])


def _digest(header: dict, payload: bytes) -> str:
    """sha256 over the header (all but the digest) and the payload."""
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    h.update(b"\n")
    h.update(payload)
    return h.hexdigest()


def _encode(
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
        state[_CLASSES_KEY] = _classes(step)
        names, state[_PARAMS_KEY] = _param_names(step)
        state["optimizer"] = _optimizer_state(state["optimizer"], _by_name, names)
        if snapshot is not None:  # fit's rollback snapshot, a state_dict too
            by_name = _optimizer_state(snapshot["optimizer"], _by_name, names)
            snapshot = {**snapshot, "optimizer": by_name}
    state["rng"] = _rng_states()
    state["data_position"] = data_position
    if snapshot is not None:
        state["snapshot"] = snapshot
    if fit_extras is not None:
        state["fit_extras"] = fit_extras
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    header = {
        "format": _FORMAT,
        "step": global_step,
        "data_position": data_position,
        "metrics": metrics,
        "fit_state": fit_state,
    }
    header["sha256"] = _digest(header, payload)
    return json.dumps(header).encode() + b"\n" + payload


def _write_durably(path: str, data: bytes) -> None:
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


def _read_header(path: Any) -> tuple[dict | None, bytes]:
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
    known = (_FORMAT, _FORMAT_1, _DCP_FORMAT)
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
            f"no {_FORMAT} header ({len(data)} bytes)"
        )
    payload = data[end + 1 :]
    if header["format"] == _FORMAT_1:  # its sha256 covered the payload alone
        intact = hashlib.sha256(payload).hexdigest() == header.get("sha256")
    else:
        body = {k: v for k, v in header.items() if k != "sha256"}
        intact = _digest(body, payload) == header.get("sha256")
    if not intact:
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} is corrupt or truncated: its header "
            f"(data position, step, NaN-policy state) or payload ({len(payload)} "
            "bytes) does not match the sha256 saved with them"
        )
    return header, payload


def _peek_header(path: str) -> dict:
    """The header line alone ({} if unreadable): cheap, for the metrics."""
    try:
        with open(path, "rb") as f:
            header = json.loads(f.readline(_MAX_HEADER))
    except (OSError, ValueError):
        return {}
    return header if isinstance(header, dict) else {}


def save_checkpoint(
    path: str | os.PathLike,
    step: TrainStep,
    *,
    data_position: int | None = None,
) -> None:
    """Writes ``step.state_dict()`` (model, optimizer, scaler, counters) durably.

    The mirror of `jaxstable.train.save_checkpoint`. The file also holds the
    values of the parameters the optimizer holds outside the model (a
    learned temperature used in the loss, by the name given to a
    named-parameter optimizer, ``Adam([*model.named_parameters(),
    ("temperature", t)])``, else ``<unnamed k>``), the RNG states,
    `data_position`, the optimizer and scaler class names (so that
    `load_checkpoint` can refuse a checkpoint of another one by name) and a
    sha256 of the payload (so that it refuses a damaged one). See the
    module docstring for the layout; for a run, `CheckpointManager` keeps
    several, by global step. Under FSDP2 (more than one rank) `path`
    becomes a directory written with `torch.distributed.checkpoint`, each
    rank its shards: a collective, every rank calls it.

    Args:
      path: file to write.
      step: the `TrainStep` (or any object with ``state_dict``) to save.
      data_position: batches of the run consumed so far, or None.

    Example:
      >>> import os, tempfile, torch
      >>> from torchref import train
      >>> model = torch.nn.Linear(2, 1)
      >>> step = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
      ...                        lambda m, b: m(b).pow(2).mean())
      >>> _ = step(torch.ones(4, 2))
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
      >>> train.save_checkpoint(path, step, data_position=1)
      >>> with open(path, "rb") as f:
      ...     print(f.readline()[:40])
      b'{"format": "torchref-checkpoint-2", "ste'
    """
    if _is_sharded(step):
        _save_dcp(os.fspath(path), step, None, data_position, None)
        return
    _write_durably(os.fspath(path), _encode(step, None, data_position, None))


def load_checkpoint(
    path: str | os.PathLike, step: TrainStep, *, restore_rng: bool = True
) -> TrainStep:
    """Loads a checkpoint written by `save_checkpoint` into `step` and returns it.

    Nothing is loaded unless the file is intact (its sha256) and matches
    `step` exactly: the same scaler class (a `DynamicGradScaler`'s floor
    and hysteresis would be lost in a plain `GradScaler`), the same
    optimizer class (an Adam state in an SGD fails one step later with
    KeyError), the same parameter groups, and the same model state dict
    keys, shapes and dtypes (torch would copy a float16 checkpoint into
    float32 parameters without a word). The optimizer state is matched by
    parameter name, not by position (torch's own ``load_state_dict`` gives
    the first parameter the first saved state, whatever it was): an
    optimizer listing the same parameters in another order loads each one's
    state, and one over other parameters (another name, group, shape or
    dtype) is refused naming them. The parameters outside the model get
    their saved values back (a checkpoint written before torchref saved
    them gives a RuntimeWarning naming them: they keep their values). The mirror of
    `jaxstable.train.load_checkpoint` (which matches leaves by their pytree
    path), with the same messages. The RNG
    states saved with it are restored too (`restore_rng`), so that dropout
    after a resume draws what it would have drawn.

    A sharded checkpoint (a directory, written under FSDP2) loads into any
    placement: under FSDP2 every rank calls this (a collective) and reads
    its shards; in one process or on a DDP rank the whole tensors are read
    here alone. Its files are checked against the sha256 saved with them.

    A file written before `save_checkpoint` named the parameters loads its
    optimizer state by position, as torch does. One written before it named
    the classes is checked by its keys alone: another optimizer shows by
    its option names, a
    DynamicGradScaler by its floor and hysteresis, but a StaticGradScaler's
    state reads as a plain GradScaler's (the same keys).

    Args:
      path: file to read.
      step: a `TrainStep` over a model and optimizer of the same structure.
      restore_rng: also restore the saved RNG states (if the file has them).

    Returns:
      `step`, with its model, optimizer, scaler and counters restored.

    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: naming the file and the mismatch (a damaged or truncated
        file; saved vs expected scaler or optimizer class; each model leaf
        that is missing, extra, or of another shape or dtype, with its path;
        other parameter groups), or a file that is not a TrainStep checkpoint.

    Example:
      >>> import os, tempfile, torch
      >>> from torchref import train
      >>> model = torch.nn.Linear(1, 1, bias=False)
      >>> step = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
      ...                        lambda m, b: m(b).sum())
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
      >>> with torch.no_grad():
      ...     _ = model.weight.fill_(3.0)
      >>> train.save_checkpoint(path, step)
      >>> with torch.no_grad():
      ...     _ = model.weight.zero_()
      >>> train.load_checkpoint(path, step).model.weight.item()
      3.0
      >>> wide = torch.nn.Linear(2, 1, bias=False)
      >>> other = train.TrainStep(wide, torch.optim.SGD(wide.parameters(), lr=0.1),
      ...                         lambda m, b: m(b).sum())
      >>> try:
      ...     train.load_checkpoint(path, other)
      ... except ValueError as e:
      ...     print(str(e).splitlines()[1])
        model/weight: checkpoint (1, 1) float32, target (1, 2) float32
    """
    _load(path, step, restore_rng)
    return step


def _load(path: Any, step: Any, restore_rng: bool, expected: int | None = None):
    """Loads `path` into `step`; returns its header (a synthesised one for an
    older file), with the data position the payload holds and, if saved,
    fit's rollback snapshot (``"snapshot"``, its optimizer state by index).
    `expected`: the step a manager's file is named for (its header must
    agree)."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no checkpoint file at {os.fspath(path)!r}")
    if os.path.isdir(path) and (
        os.fspath(path).endswith(".dcp")
        or os.path.lexists(os.path.join(path, _DCP_HEADER))
    ):
        return _load_dcp(path, step, restore_rng, expected)
    header, payload = _read_header(path)
    if expected is not None and (header or {}).get("step") not in (None, expected):
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} is not checkpoint {expected}: its "
            f"header names step {header['step']}"
        )
    try:
        # weights_only: a checkpoint holds tensors, numbers and dicts, nothing
        # to run
        state = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:  # a bare old file can be truncated too
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} cannot be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''})"
        ) from e
    extras = {
        k: state.pop(k) for k in _EXTRA_KEYS if isinstance(state, dict) and k in state
    }
    snapshot = extras.get("snapshot")
    if isinstance(step, TrainStep):
        state, extras, snapshot = _without_ddp_prefix(state, extras, snapshot)
        _check_train_step(path, state, extras.get(_CLASSES_KEY) or {}, step)
        saved = extras.get(_PARAMS_KEY)
        if saved is not None:  # keyed by name: checked, then numbered as here
            names, params = _param_names(step)
            _raise_mismatches(
                path, _param_mismatches(saved, state["optimizer"], params, step)
            )
            state["optimizer"] = _to_index(state["optimizer"], names, step)
            if snapshot is not None:
                by_index = _to_index(snapshot["optimizer"], names, step)
                snapshot = {**snapshot, "optimizer": by_index}
    step.load_state_dict(state)
    if restore_rng and extras.get("rng") is not None:
        _set_rng_states(extras["rng"])
    # The payload's data position: under the checksum in every format.
    header = dict(header or {"step": None})
    header["data_position"] = extras.get("data_position", header.get("data_position"))
    if snapshot is not None:
        header["snapshot"] = snapshot
    if extras.get("fit_extras") is not None:
        header["fit_extras"] = extras["fit_extras"]
    return header


def _strip(name: Any) -> Any:
    return name[len("module.") :] if isinstance(name, str) else name


def _strip_optimizer(state: dict) -> dict:
    def convert(inner: dict) -> dict:
        return {
            **inner,
            "state": {_strip(k): v for k, v in inner["state"].items()},
            "param_groups": [
                {**g, "params": [_strip(n) for n in g["params"]]}
                for g in inner["param_groups"]
            ],
        }

    return _optimizer_state(state, convert)


def _without_ddp_prefix(state: Any, extras: dict, snapshot: Any):
    """A checkpoint written from a DDP model's own state_dict (every key
    ``module.``-prefixed, as `TrainStep` wrote before it saved the unwrapped
    module's keys) as the unwrapped module's: it then restores into one
    process, DDP or FSDP2 alike."""
    model = state.get("model") if isinstance(state, dict) else None
    if not model or not all(str(k).startswith("module.") for k in model):
        return state, extras, snapshot
    state = {**state, "model": {_strip(k): v for k, v in model.items()}}
    names = extras.get(_PARAMS_KEY)
    if names is not None:
        extras = {**extras, _PARAMS_KEY: {_strip(k): v for k, v in names.items()}}
        state["optimizer"] = _strip_optimizer(state["optimizer"])
        if snapshot is not None:
            snapshot = {
                **snapshot,
                "model": {_strip(k): v for k, v in snapshot["model"].items()},
                "optimizer": _strip_optimizer(snapshot["optimizer"]),
            }
    return state, extras, snapshot


def _check_train_step(path: Any, state: Any, saved: dict, step: TrainStep) -> None:
    missing = [k for k in _STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} is not a TrainStep checkpoint: it "
            f"lacks {missing} (save_checkpoint writes {list(_STATE_KEYS)})"
        )
    _check_scaler_class(path, saved, state["scaler"], step)
    _check_optimizer_class(path, saved, state["optimizer"], step.optimizer)
    lines = _structure_mismatches(
        {
            **_leaf_specs(state["model"], "model"),
            **_leaf_specs(state["skip_state"], "skip_state"),
        },
        {
            **_leaf_specs(_plain(step.model).state_dict(), "model"),
            **_leaf_specs(dataclasses.asdict(step.skip_state), "skip_state"),
        },
    )
    lines += _param_group_mismatches(state["optimizer"], step.optimizer)
    _raise_mismatches(path, lines)


class CheckpointManager:
    """The checkpoints of one run in a directory, named by the run's global step.

    The mirror of `jaxstable.train.CheckpointManager`. Checkpoint n is the
    file ``directory/step_{n:08d}.pt`` (n: steps of the run done, not steps
    of one `fit` call), written as `save_checkpoint` does. After each save
    it keeps the last `max_to_keep` checkpoints up to that step and, with
    `best_metric`, also the best one by that metric. Only this manager's own
    checkpoints count and are deleted: an entry named like one that is not
    (a stray file or directory ``step_00000099.pt``) is left alone and
    takes no slot, and neither does a checkpoint past the step just saved
    (one a resume went back from). With `async_save` the state is
    serialised in memory at `save` (a copy: training may go on) and written
    by a background thread (the next save, `wait` or `close` waits for it).
    A crash mid-write leaves a ``.tmp-<pid>-<thread>-<n>`` file, which the next manager
    on the directory removes (unless a run holds the directory's lock, see
    `fit`).

    Under FSDP2 (more than one rank) checkpoint n is the directory
    ``directory/step_{n:08d}.dcp`` (`torch.distributed.checkpoint`, every
    rank writing its shards: `save` and `restore` are collectives there,
    every rank calls them on the same directory; the save is synchronous
    and rank 0 prunes). A crash leaves ``step_{n:08d}.dcp.partial``, removed
    the same way. Files and directories count alike, by step.

    `restore` takes the latest intact checkpoint: a truncated, damaged or
    foreign one (its sha256 differs, or it is no checkpoint file) gives a
    `RuntimeWarning` naming it and the one before it is tried. A checkpoint
    of another model, optimizer or loss scale raises the `load_checkpoint`
    ValueError.

    Args:
      directory: the run's checkpoint directory (created if missing).
      max_to_keep: int >= 1, how many of the latest checkpoints to keep.
      best_metric: None, or the key of the ``metrics`` passed to `save`
        (e.g. ``"eval['loss']"``) whose best checkpoint is kept too.
      best_mode: ``"min"`` or ``"max"``: which value of `best_metric` is best.
      async_save: write in a background thread.

    Example:
      >>> import tempfile, torch
      >>> from torchref import train
      >>> model = torch.nn.Linear(2, 1, bias=False)
      >>> s = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
      ...                     lambda m, b: m(b).sum())
      >>> with train.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2,
      ...                              best_metric="loss") as mgr:
      ...     for n, loss in [(10, 0.5), (20, 0.9), (30, 0.7)]:
      ...         with torch.no_grad():
      ...             _ = model.weight.fill_(float(n))
      ...         mgr.save(n, s, metrics={"loss": loss})
      ...     mgr.wait()
      ...     restored, info = mgr.restore(s)
      ...     print(mgr.steps(), mgr.best_step(), info, model.weight.tolist())
      [10, 20, 30] 10 {'step': 30, 'data_position': 30} [[30.0, 30.0]]
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int = 3,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool = True,
    ) -> None:
        _check_manager_options(max_to_keep, best_metric, best_mode)
        self.directory = os.path.abspath(directory)
        self.max_to_keep = max_to_keep
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.async_save = bool(async_save)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        os.makedirs(self.directory, exist_ok=True)
        if not locked_elsewhere(self.directory):  # a killed save's leftovers
            for name in os.listdir(self.directory):
                if re.match(rf"^step_\d{{8,}}\.pt{_TEMP_SUFFIX}$", name):
                    os.remove(os.path.join(self.directory, name))
                elif re.match(r"^step_\d{8,}\.dcp\.partial$", name):
                    shutil.rmtree(os.path.join(self.directory, name))

    def _path(self, step: int) -> str:
        """Checkpoint `step`'s entry: its sharded directory if there is one,
        else its file."""
        sharded = os.path.join(self.directory, f"step_{step:08d}.dcp")
        if os.path.isdir(sharded):
            return sharded
        return os.path.join(self.directory, f"step_{step:08d}.pt")

    def steps(self) -> list[int]:
        """The global steps of the checkpoints on disk, ascending."""
        names = os.listdir(self.directory)
        found = (_NAME.match(n) or _DCP_NAME.match(n) for n in names)
        return sorted({int(m.group(1)) for m in found if m})

    def latest_step(self) -> int | None:
        """The highest global step on disk, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The step of the best checkpoint by `best_metric` (None without one)."""
        if self.best_metric is None:
            return None
        scored = []
        for n in self.steps():
            value = (
                _peek_header(_header_file(self._path(n))).get("metrics") or {}
            ).get(self.best_metric)
            if isinstance(value, int | float) and value == value:  # not NaN
                scored.append((value if self.best_mode == "min" else -value, n))
        return min(scored)[1] if scored else None

    def save(
        self,
        step: int,
        train_step: Any,
        *,
        data_position: int | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> None:
        """Saves `train_step`'s state as checkpoint `step` (replacing one of that step).

        Args:
          step: int >= 0, the run's global step.
          train_step: the `TrainStep` (or object with ``state_dict``) to save.
          data_position: batches of the run consumed (default: `step`).
          metrics: a dict holding `best_metric` (other keys are ignored).
        """
        self._save(step, train_step, data_position, metrics)

    def _save(
        self,
        step: int,
        train_step: Any,
        data_position: int | None = None,
        metrics: dict[str, Any] | None = None,
        fit_state: dict | None = None,
        snapshot: dict | None = None,
        fit_extras: dict | None = None,
    ) -> None:
        """`save`, plus what `fit` keeps: its NaN-policy state, rollback
        snapshot and extras (schedulers, data RNG), all under the checksum."""
        _check_int("step", step, 0)
        self.wait()
        kept = None
        if self.best_metric is not None and metrics and self.best_metric in metrics:
            kept = {self.best_metric: float(metrics[self.best_metric])}
        position = step if data_position is None else int(data_position)
        if _is_sharded(train_step):
            # Every rank writes its shards, synchronously (a collective);
            # rank 0 prunes.
            import torch.distributed as dist

            path = os.path.join(self.directory, f"step_{step:08d}.dcp")
            _save_dcp(
                path, train_step, step, position, kept, fit_state, snapshot,
                fit_extras,
            )  # fmt: skip
            if dist.get_rank() == 0:
                file = os.path.join(self.directory, f"step_{step:08d}.pt")
                if os.path.isfile(file):  # the same step, saved unsharded
                    os.remove(file)
                self._prune(step)
            return
        data = _encode(
            train_step, step, position, kept, fit_state, snapshot, fit_extras
        )
        path = os.path.join(self.directory, f"step_{step:08d}.pt")
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)  # a stray directory of that name (a file is replaced)

        def write() -> None:
            try:
                _write_durably(path, data)
                self._prune(step)
            except BaseException as e:  # re-raised by wait()
                self._error = e

        if self.async_save:
            self._thread = threading.Thread(target=write, daemon=True)
            self._thread.start()
        else:
            write()
            self._raise_error()

    def _prune(self, latest: int) -> None:
        """Deletes this manager's checkpoints up to `latest` beyond the last
        `max_to_keep` (and the best one)."""
        ours = [n for n in self.steps() if n <= latest and _is_ours(self._path(n))]
        keep = set(ours[-self.max_to_keep :]) | {self.best_step()}
        for n in ours:
            if n not in keep:
                path = self._path(n)
                if os.path.isdir(path):  # a sharded checkpoint
                    shutil.rmtree(path)
                else:
                    os.remove(path)

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def wait(self) -> None:
        """Waits for a background save to finish (re-raising its error)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_error()

    def restore(
        self, train_step: Any, step: int | None = None, *, restore_rng: bool = True
    ) -> tuple[Any, dict]:
        """Loads the latest intact checkpoint (or checkpoint `step`) into `train_step`.

        Returns:
          ``(train_step, info)`` with ``info = {"step": n, "data_position": p}``;
          for a checkpoint written by `fit`, also ``"fit_state"`` (its
          NaN-policy state) and, when it saved one, ``"snapshot"`` (its
          rollback snapshot, a ``state_dict`` for this `train_step`) and
          ``"fit_extras"`` (its schedulers' states, the RNG state its data
          was iterated with).

        Raises:
          FileNotFoundError: no intact checkpoint (each damaged one warned of).
          ValueError: the checkpoint does not match `train_step` (see
            `load_checkpoint`), or `step` is given and damaged.
        """
        self.wait()
        candidates = [step] if step is not None else self.steps()[::-1]
        collective = _is_sharded(train_step)
        if collective:  # every rank tries rank 0's list, in its order
            import torch.distributed as dist

            told = [candidates]
            dist.broadcast_object_list(told, src=0)
            candidates = told[0]
        for n in candidates:
            try:
                error = None
                header = _load(self._path(n), train_step, restore_rng, n)
            except _CorruptCheckpoint as e:
                error = e
            if collective:  # one rank's damaged file is every rank's
                errors = [e for e in _gathered(error and str(error)) if e]
                error = _CorruptCheckpoint(errors[0]) if errors else None
            if error is not None:
                if step is not None:
                    raise error
                warnings.warn(
                    f"{error}; trying the checkpoint before it", RuntimeWarning, 2
                )
                continue
            position = header.get("data_position")
            info = {"step": n, "data_position": n if position is None else position}
            if header.get("fit_state") is not None:
                info["fit_state"] = header["fit_state"]
            if header.get("snapshot") is not None:
                info["snapshot"] = header["snapshot"]
            if header.get("fit_extras") is not None:
                info["fit_extras"] = header["fit_extras"]
            return train_step, info
        raise FileNotFoundError(
            f"no intact checkpoint in {self.directory!r} (steps on disk: "
            f"{self.steps()})"
        )

    def close(self) -> None:
        """Waits for a pending save."""
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _header_file(path: str) -> str:
    """The file holding the header of checkpoint entry `path`."""
    return os.path.join(path, _DCP_HEADER) if os.path.isdir(path) else path


def _is_ours(path: str) -> bool:
    """A checkpoint file (ours or an older bare `torch.save` zip) or a
    sharded checkpoint directory, not a stray entry of the same name: only
    those are counted and pruned."""
    if os.path.isdir(path) and not os.path.islink(path):
        head = os.path.join(path, _DCP_HEADER)
        return os.path.isfile(head) and _peek_header(head).get("format") == _DCP_FORMAT
    if not os.path.isfile(path) or os.path.islink(path):
        return False
    with open(path, "rb") as f:
        start = f.read(len(_FORMAT) + 12)
    return start[:2] == b"PK" or start.startswith(b'{"format": "torchref-checkpoint-')


def _param_names(step: TrainStep) -> tuple[list[str], dict[str, list]]:
    """The optimizer's parameters in its order: their names (`param_names`:
    the model's, else the one the optimizer was given, else ``<unnamed
    k>``) and ``{name: [shape, dtype]}``."""
    names = param_names(step.model, step.optimizer)
    specs = {
        name: [list(p.shape), str(p.dtype).removeprefix("torch.")]
        for name, p in zip(names, step._params(), strict=True)
    }
    return names, specs


def _inner(state: dict) -> dict:
    """The torch optimizer state dict in `state` (a `SkipNonFinite`
    wrapper's holds it under ``"optimizer"``)."""
    if "param_groups" in state or not isinstance(state.get("optimizer"), dict):
        return state
    return _inner(state["optimizer"])


def _optimizer_state(state: dict, convert: Any, *args: Any) -> dict:
    """`state` with `convert` applied to the torch optimizer state dict in it."""
    if "param_groups" in state or not isinstance(state.get("optimizer"), dict):
        return convert(state, *args)
    inner = _optimizer_state(state["optimizer"], convert, *args)
    return {**state, "optimizer": inner}


def _by_name(state: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter name instead of position."""
    return {
        **state,
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]}
            for g in state["param_groups"]
        ],
    }


def _to_index(saved: dict, names: list[str], step: TrainStep) -> dict:
    """A by-name optimizer state numbered as `step`'s optimizer numbers its
    parameters (the names already checked to match, group by group)."""
    index = {name: i for i, name in enumerate(names)}
    own = _inner(step.optimizer.state_dict())["param_groups"]

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

    return _optimizer_state(saved, convert)


def _param_mismatches(saved: dict, state: dict, params: dict, step: TrainStep):
    """One line per optimizer parameter (by name) missing, extra, in another
    group, or of another shape or dtype (for one outside the model's state
    dict: the model check covers those)."""
    in_model = set(_plain(step.model).state_dict())
    lines = []
    for name in [*params, *(n for n in saved if n not in params)]:
        s, e = saved.get(name), params.get(name)
        s = None if s is None else (tuple(s[0]), s[1])
        e = None if e is None else (tuple(e[0]), e[1])
        where = f"  optimizer/{name}"
        if s is None:
            lines.append(f"{where}: missing from the checkpoint (target {_spec(e)})")
        elif e is None:
            lines.append(f"{where}: in the checkpoint ({_spec(s)}), not in the target")
        elif s != e and name not in in_model:
            lines.append(f"{where}: checkpoint {_spec(s)}, target {_spec(e)}")
    if lines:
        return lines
    names = _param_names(step)[0]
    own = _inner(step.optimizer.state_dict())["param_groups"]
    # The group sizes already match (_param_group_mismatches).
    theirs = _inner(state)["param_groups"]
    for g, (other, mine) in enumerate(zip(theirs, own, strict=True)):
        for name in sorted({names[i] for i in mine["params"]} - set(other["params"])):
            lines.append(
                f"  optimizer/{name}: in parameter group {g} of the target, "
                "another group in the checkpoint"
            )
    return lines


def _classes(step: TrainStep) -> dict[str, str | None]:
    """The class names `load_checkpoint` compares (scaler None: none enabled)."""
    scaler = type(step.scaler).__name__ if step._scaler_enabled() else None
    return {"optimizer": type(step.optimizer).__name__, "scaler": scaler}


def _check_scaler_class(path: Any, classes: dict, saved: dict, step: TrainStep) -> None:
    if "scaler" in classes:
        have = _classes(step)["scaler"]
        kinds = [
            f"a {c}" if c else "no enabled scaler" for c in (classes["scaler"], have)
        ]
    else:  # an older file: only the keys tell, and Static reads as GradScaler
        enabled = step._scaler_enabled()
        kinds = [
            _scaler_kind(saved),
            _scaler_kind(step.scaler.state_dict() if enabled else {}),
        ]
    if kinds[0] != kinds[1]:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} holds {kinds[0]} but this TrainStep "
            f"has {kinds[1]}: build it with the loss scale the checkpoint was "
            "saved with"
        )


def _check_optimizer_class(
    path: Any, classes: dict, saved: dict, optimizer: torch.optim.Optimizer
) -> None:
    have = type(optimizer).__name__
    if "optimizer" in classes:
        if classes["optimizer"] != have:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} holds the optimizer state of "
                f"{classes['optimizer']} but this TrainStep's optimizer is {have}: "
                "build it with the optimizer the checkpoint was saved with"
            )
        return
    # An older file: torch's load_state_dict takes the saved groups' options
    # as they are, so another optimizer's options surface as a KeyError later.
    options = [sorted(set(g) - {"params"}) for g in saved.get("param_groups", [])]
    expected = [sorted(set(g) - {"params"}) for g in optimizer.param_groups]
    if options[:1] != expected[:1]:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} holds an optimizer state with options "
            f"{options[0] if options else []} but this TrainStep's {have} has "
            f"{expected[0]}: build it with the optimizer the checkpoint was saved with"
        )


def _param_group_mismatches(saved: dict, optimizer: torch.optim.Optimizer) -> list:
    sizes = [len(g["params"]) for g in saved.get("param_groups", [])]
    expected = [len(g["params"]) for g in optimizer.param_groups]
    if sizes == expected:
        return []
    return [
        f"  optimizer/param_groups: checkpoint sizes {sizes}, target sizes {expected}"
    ]


def _leaf_specs(tree: Any, prefix: str = "") -> dict[str, tuple[tuple, str]]:
    """``{path: (shape, dtype)}`` of every leaf of a (nested) state dict.

    Paths join the keys with "/" (``model/0.weight``), dtypes are named as
    in `jaxstable.train` ("float32", not "torch.float32"). A Python number
    is ``((), "int")`` etc.; None and empty containers hold no leaf.
    """
    if tree is None:
        return {}
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_leaf_specs(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    key = prefix or "<root>"  # as jaxstable's, for a single tensor
    if isinstance(tree, torch.Tensor):
        return {key: (tuple(tree.shape), str(tree.dtype).removeprefix("torch."))}
    return {key: ((), type(tree).__name__)}


def _structure_mismatches(saved: dict[str, tuple], expected: dict[str, tuple]):
    """One line per leaf missing, extra, or of another shape or dtype.

    ``saved`` and ``expected`` map a leaf path to ``(shape, dtype)`` (see
    `_leaf_specs`): the check does not depend on the file format.
    """
    lines = []
    # The target's order, then the checkpoint's extras.
    for key in [*expected, *(k for k in saved if k not in expected)]:
        s, e = saved.get(key), expected.get(key)
        if s is None:
            lines.append(f"  {key}: missing from the checkpoint (target {_spec(e)})")
        elif e is None:
            lines.append(f"  {key}: in the checkpoint ({_spec(s)}), not in the target")
        elif s != e:
            lines.append(f"  {key}: checkpoint {_spec(s)}, target {_spec(e)}")
    return lines


def _spec(spec: tuple) -> str:
    shape, dtype = spec
    return f"{shape} {dtype}"


# --------------------------------------------- sharded (FSDP2) checkpoints
# A TrainStep over an FSDP2 model under a process group of N > 1 ranks is
# saved with torch.distributed.checkpoint (DCP): every rank writes its own
# shards, no rank gathers the model. The checkpoint is a directory
# ``step_{n:08d}.dcp`` holding DCP's files (``.metadata``, ``__{r}_0.distcp``)
# and ``checkpoint.pt``: a file of this module's format (JSON header line +
# payload) whose payload holds everything but the tensors of the model and
# the optimizer state (scaler, counters, the optimizer's param_groups by
# parameter name, each rank's RNG states, the data position, fit's snapshot)
# and whose header holds the sha256 of every DCP file. The header's format
# is _DCP_FORMAT.


def _is_sharded(step: Any) -> bool:
    """Whether `step` is saved with DCP: a TrainStep over an FSDP2 model
    under a process group of more than one rank."""
    import torch.distributed as dist

    from torchref._src.distributed import _is_fsdp

    return (
        isinstance(step, TrainStep)
        and _is_fsdp(step.model)
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

    names = sorted(n for n in os.listdir(directory) if n != _DCP_HEADER)
    if not collective:
        return names
    return names[dist.get_rank() :: dist.get_world_size()]


def _gathered(obj: Any) -> list[Any]:
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
    tensors = {_MODEL + k: v for k, v in _plain(step.model).state_dict().items()}
    outside = step._outside_params()
    tensors.update({_OUTSIDE + k: p.detach() for k, p in outside.items()})
    names, specs = _param_names(step)
    by_name = _by_name(step.optimizer.state_dict(), names)
    keys, scalars = [], {}
    for name, state in by_name["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{_OPTIM}{name}/{key}"] = value
                keys.append([name, key])
            else:
                scalars.setdefault(name, {})[key] = value
    rest = {"param_groups": by_name["param_groups"], "keys": keys, "scalars": scalars}
    return tensors, {"optimizer": rest, _PARAMS_KEY: specs}


def _save_dcp(
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
    rng = _gathered(_rng_states())
    dist.barrier()  # every rank's files are written
    digests = {}
    for share in _gathered(
        {n: _file_sha256(os.path.join(tmp, n)) for n in _share_of_files(tmp, True)}
    ):
        digests.update(share)
    error = None
    if rank == 0:
        try:
            payload = {**rest, **step._counters_dict(), "rng": rng}
            payload.update(data_position=data_position, world=dist.get_world_size())
            payload[_CLASSES_KEY] = _classes(step)
            if snapshot is not None:
                names = _param_names(step)[0]
                by_name = _optimizer_state(snapshot["optimizer"], _by_name, names)
                payload["snapshot"] = {**snapshot, "optimizer": by_name}
            if fit_extras is not None:
                payload["fit_extras"] = fit_extras
            buf = io.BytesIO()
            torch.save(payload, buf)
            header = {
                "format": _DCP_FORMAT,
                "step": global_step,
                "data_position": data_position,
                "metrics": metrics,
                "fit_state": fit_state,
                "files": digests,
            }
            header["sha256"] = _digest(header, buf.getvalue())
            data = json.dumps(header).encode() + b"\n" + buf.getvalue()
            _write_durably(os.path.join(tmp, _DCP_HEADER), data)
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
    head = os.path.join(path, _DCP_HEADER)
    if not os.path.isfile(head):
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} has no {_DCP_HEADER} (an unfinished "
            "or foreign directory)"
        )
    header, payload = _read_header(head)
    if (header or {}).get("format") != _DCP_FORMAT:
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r}: {_DCP_HEADER} is not a sharded "
            f"checkpoint's header ({_DCP_FORMAT})"
        )
    return header, payload


def _check_dcp_files(path: Any, header: dict, collective: bool) -> None:
    """Each DCP file has the sha256 its header saved (under a collective,
    every rank hashes its share and all agree on the verdict)."""
    files = header.get("files") or {}
    have = set(os.listdir(path)) - {_DCP_HEADER}
    bad = sorted(set(files) ^ have)
    mine = [n for n in _share_of_files(path, collective) if n in files]
    bad += [n for n in mine if _file_sha256(os.path.join(path, n)) != files[n]]
    if collective:
        bad = sorted({n for every in _gathered(bad) for n in every})
    if bad:
        raise _CorruptCheckpoint(
            f"checkpoint {os.fspath(path)!r} is corrupt or incomplete: its files "
            f"{bad} are missing, extra, or do not match the sha256 saved with them"
        )


def _load_dcp(path: Any, step: Any, restore_rng: bool, expected: int | None):
    """`_load` for a DCP checkpoint directory: its header (with the data
    position and fit's snapshot, as `_load` returns it).

    A collective when `step` is sharded (`_is_sharded`): every rank reads
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
    collective = _is_sharded(step)
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
    names = _param_names(step)[0]
    by_name = dict(zip(names, step._params(), strict=True))
    template = {_MODEL + k: v for k, v in _plain(step.model).state_dict().items()}
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
    from torchref._src.distributed import _load_plain_state_dict

    model = {k[len(_MODEL) :]: v for k, v in template.items() if k.startswith(_MODEL)}
    _load_plain_state_dict(step.model, model)
    rest = extras["optimizer"]
    state: dict = {n: dict(v) for n, v in rest["scalars"].items()}
    for name, key in rest["keys"]:
        state.setdefault(name, {})[key] = template[f"{_OPTIM}{name}/{key}"]
    optimizer = {"state": state, "param_groups": rest["param_groups"]}
    step.optimizer.load_state_dict(_to_index(optimizer, names, step))
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
        _set_rng_states(rngs[rank] if world == len(rngs) else rngs[0])
    out = dict(header)
    out["data_position"] = extras.get("data_position", header.get("data_position"))
    snapshot = extras.get("snapshot")
    if snapshot is not None:
        by_index = _to_index(snapshot["optimizer"], names, step)
        out["snapshot"] = {**snapshot, "optimizer": by_index}
    if extras.get("fit_extras") is not None:
        out["fit_extras"] = extras["fit_extras"]
    return out


def _check_dcp_structure(path: Any, saved: dict, extras: dict, step: TrainStep):
    """`_check_train_step` for a DCP checkpoint: classes, the model's keys,
    global shapes and dtypes (from DCP's metadata) and the optimizer's
    parameters by name."""
    classes = extras.get(_CLASSES_KEY) or {}
    _check_scaler_class(path, classes, extras.get("scaler") or {}, step)
    _check_optimizer_class(path, classes, {}, step.optimizer)
    model = {
        "model/" + k[len(_MODEL) :]: (
            tuple(md.size),
            str(md.properties.dtype).removeprefix("torch."),
        )
        for k, md in saved.items()
        if k.startswith(_MODEL) and hasattr(md, "size")
    }
    lines = _structure_mismatches(
        {**model, **_leaf_specs(extras["skip_state"], "skip_state")},
        {
            **_leaf_specs(_plain(step.model).state_dict(), "model"),
            **_leaf_specs(dataclasses.asdict(step.skip_state), "skip_state"),
        },
    )
    opt = {"state": {}, "param_groups": extras["optimizer"]["param_groups"]}
    lines += _param_group_mismatches(opt, step.optimizer)
    if not lines:
        params = _param_names(step)[1]
        lines = _param_mismatches(extras[_PARAMS_KEY], opt, params, step)
    _raise_mismatches(path, lines)
