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
rank or one process reads whole tensors alone (see `checkpoint_sharded`
and docs/distributed.md).

Older files are still read: format 1 (``torchref-checkpoint-1``, whose
sha256 covered the payload only; its data position is taken from the
payload, which has it too) and bare `torch.save` zips (no checksum; telling
them apart costs two bytes). Their optimizer state is positional, and they
hold no NaN-policy state.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from _stablecore.checkpoint import CorruptCheckpoint as _CorruptCheckpoint
from _stablecore.checkpoint import raise_mismatches as _raise_mismatches
from torchref._src.checkpoint_checks import (
    check_train_step,
    param_mismatches,
    param_specs,
)
from torchref._src.checkpoint_format import (
    CLASSES_KEY,
    DCP_HEADER,
    EXTRA_KEYS,
    PARAMS_KEY,
    encode,
    optimizer_state,
    read_header,
    set_rng_states,
    state_by_index,
    write_durably,
)
from torchref._src.checkpoint_sharded import is_sharded, load_dcp, save_dcp
from torchref._src.step import TrainStep

__all__ = ["load_checkpoint", "save_checkpoint"]


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
    if is_sharded(step):
        save_dcp(os.fspath(path), step, None, data_position, None)
        return
    write_durably(os.fspath(path), encode(step, None, data_position, None))


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
    load_into(path, step, restore_rng)
    return step


def load_into(path: Any, step: Any, restore_rng: bool, expected: int | None = None):
    """Loads `path` into `step`; returns its header (a synthesised one for an
    older file), with the data position the payload holds and, if saved,
    fit's rollback snapshot (``"snapshot"``, its optimizer state by index).
    `expected`: the step a manager's file is named for (its header must
    agree)."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no checkpoint file at {os.fspath(path)!r}")
    if os.path.isdir(path) and (
        os.fspath(path).endswith(".dcp")
        or os.path.lexists(os.path.join(path, DCP_HEADER))
    ):
        return load_dcp(path, step, restore_rng, expected)
    header, payload = read_header(path)
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
        k: state.pop(k) for k in EXTRA_KEYS if isinstance(state, dict) and k in state
    }
    snapshot = extras.get("snapshot")
    if isinstance(step, TrainStep):
        state, extras, snapshot = _without_ddp_prefix(state, extras, snapshot)
        check_train_step(path, state, extras.get(CLASSES_KEY) or {}, step)
        saved = extras.get(PARAMS_KEY)
        if saved is not None:  # keyed by name: checked, then numbered as here
            names, params = param_specs(step)
            _raise_mismatches(
                path, param_mismatches(saved, state["optimizer"], params, step)
            )
            state["optimizer"] = state_by_index(state["optimizer"], names, step)
            if snapshot is not None:
                by_index = state_by_index(snapshot["optimizer"], names, step)
                snapshot = {**snapshot, "optimizer": by_index}
    step.load_state_dict(state)
    if restore_rng and extras.get("rng") is not None:
        set_rng_states(extras["rng"])
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

    return optimizer_state(state, convert)


def _without_ddp_prefix(state: Any, extras: dict, snapshot: Any):
    """A checkpoint written from a DDP model's own state_dict (every key
    ``module.``-prefixed, as `TrainStep` wrote before it saved the unwrapped
    module's keys) as the unwrapped module's: it then restores into one
    process, DDP or FSDP2 alike."""
    model = state.get("model") if isinstance(state, dict) else None
    if not model or not all(str(k).startswith("module.") for k in model):
        return state, extras, snapshot
    state = {**state, "model": {_strip(k): v for k, v in model.items()}}
    names = extras.get(PARAMS_KEY)
    if names is not None:
        extras = {**extras, PARAMS_KEY: {_strip(k): v for k, v in names.items()}}
        state["optimizer"] = _strip_optimizer(state["optimizer"])
        if snapshot is not None:
            snapshot = {
                **snapshot,
                "model": {_strip(k): v for k, v in snapshot["model"].items()},
                "optimizer": _strip_optimizer(snapshot["optimizer"]),
            }
    return state, extras, snapshot
