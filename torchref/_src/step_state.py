"""What `torchref.train.TrainStep` carries besides its model and optimizer,
and what a skipped step keeps.

`StepStateDict` is the step's ``state_dict``/``load_state_dict`` (model,
optimizer, the optimizer's parameters outside the model by their
`param_names` name, scaler, skip and spike counters), `BufferGuard` puts the
model's buffers back after a skipped step or a non-finite write (as the JAX
step keeps ``model_state``: `jaxstable._src.step_state`).
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from torchref._src import distributed as _dist
from torchref._src.clipping import all_finite_t
from torchref._src.guard import SkipNonFiniteState
from torchref._src.update_check import DeviceSelect

__all__ = ["BufferGuard", "StepStateDict", "param_names", "scaler_kind"]


class BufferGuard:
    """The model's buffers (batch-norm statistics) as they were before a
    step, put back where the step is skipped or wrote a non-finite value
    that was finite before.

    `take` copies them before the forward, `new_non_finite` (after the
    forward) says whether it made an element non-finite, `put_back` (after
    the optimizer step) selects them back on the device, or copies them back
    when the host path already knows.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.buffers: list[torch.Tensor] = []
        self.copy = DeviceSelect()
        # Whether the copy follows the model's buffers now (the forward may
        # assign new ones, ``self.mean = 0.9 * self.mean + ...``).
        self.follow = True

    def take(self, enabled: bool) -> None:
        """Copies the buffers before a step (none when not ``enabled``)."""
        self.buffers = module_buffers(self.model) if enabled else []
        if self.buffers:
            self.copy.take(self.buffers)

    def new_non_finite(self) -> Any:
        """After the forward: whether it made a buffer element non-finite
        that was finite before (0-d bool tensor; False for nothing to
        check). An element already non-finite before the step (an additive
        ``-inf`` mask) is no bad write. The copy follows buffers the
        forward assigned anew (``self.mean = 0.9 * self.mean + ...``)."""
        buffers = self.buffers
        if not buffers:
            return False
        now = module_buffers(self.model)
        same = len(now) == len(buffers) and all(map(operator.is_, now, buffers))
        self.follow = same or self.copy.retarget(now)
        if not self.follow:
            return ~all_finite_t(now)
        bad = self.copy.new_non_finite()
        return False if bad is None else bad

    def put_back(self, skipped: Any, bad: Any, host: bool | None) -> None:
        """Buffers go back on a skipped step, and also when the forward wrote
        a non-finite value on an applied step (a batch-norm running_var of
        inf from a feature of 1e20, with finite gradients), as the JAX step
        keeps a non-finite model_state out: selected on the device, or
        copied back when the host path already knows (``host``: the host
        path's decision, None on the device path)."""
        if not self.buffers:
            return
        if not self.follow:
            if bool(skipped | bad):  # a host read only for such a module
                raise ValueError(
                    "the forward replaced model buffers by ones of other shapes, "
                    "dtypes or number: the skipped step cannot restore them; "
                    "build the TrainStep with restore_buffers_on_skip=False"
                )
        elif host is not None and isinstance(bad, bool):
            if host or bad:
                self.copy.restore()
        else:
            self.copy.put_back(skipped | torch.as_tensor(bad).to(skipped.device))


_MODULE = torch.nn.Module
# What `nn.Module.buffers()` walks through; a class overriding none of them
# has its buffers listed by `module_buffers` without torch's generators.
_WALK = ("buffers", "named_buffers", "_named_members", "named_modules")
_PLAIN: set[type] = set()


def _plain(cls: type) -> bool:
    if cls not in _PLAIN and all(getattr(cls, n) is getattr(_MODULE, n) for n in _WALK):
        _PLAIN.add(cls)
    return cls in _PLAIN


def module_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """``list(model.buffers())``: the same tensors in the same order (each
    module once, depth first, each buffer once), listed in a loop where
    every module is a plain `nn.Module` in how it lists them (a third of
    the time of torch's nested generators: it runs twice a step)."""
    out: list[torch.Tensor] = []
    seen_modules, seen = set(), set()
    stack = [model]
    while stack:
        module = stack.pop()
        if module is None or module in seen_modules:  # None: an emptied slot
            continue
        cls = type(module)
        if cls not in _PLAIN and not _plain(cls):
            return list(model.buffers())
        seen_modules.add(module)
        if module._buffers:
            for b in module._buffers.values():
                # By id: a tensor's __hash__ is a python call (same identity).
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    out.append(b)
        if module._modules:
            stack.extend(reversed(module._modules.values()))
    return out


class StepStateDict:
    """`TrainStep`'s ``state_dict``/``load_state_dict`` and the pieces
    `torchref.train.save_checkpoint` reads apart (counters, the parameters
    outside the model). A mixin over the step's ``model``, ``optimizer``,
    ``scaler``, ``spikes``, ``skip_state`` and ``steps_done``."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    spikes: Any
    skip_state: SkipNonFiniteState
    steps_done: int

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _scaler_enabled(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scaler and counters (for `torch.save`).

        ``"outside_params"`` holds the values of the optimizer's parameters
        that the model does not hold (a learned temperature used in
        `loss_fn`), by their `param_names` name: the model's state dict
        misses them, and the optimizer's holds their state, not their
        values.
        """
        model, optimizer, outside = (
            _dist._plain_state_dict(self.model),
            self.optimizer.state_dict(),
            {n: p.detach() for n, p in self._outside_params().items()},
        )
        if _dist.is_fsdp(self.model):
            # Every shard, gathered (a collective: every rank calls this).
            model, optimizer, outside = _dist._gather_full((model, optimizer, outside))
        # The unwrapped module's keys (no DDP "module." prefix) and full
        # tensors, so that a checkpoint restores in any placement.
        state = {"model": model, "optimizer": optimizer, "outside_params": outside}
        return state | self._counters_dict()

    def _counters_dict(self) -> dict[str, Any]:
        """The state besides model and optimizer: scaler, skip and spike
        counters, steps done (no collective; a sharded checkpoint saves the
        model and optimizer shards apart)."""
        return {
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "skip_state": dataclasses.asdict(self.skip_state),
            "steps_done": self.steps_done,
        } | ({} if self.spikes is None else {"spike_state": self._spikes_dict()})

    def _spikes_dict(self) -> dict[str, Any]:
        return self.spike_state.state_dict()

    @property
    def spike_state(self) -> Any:
        """The spike guard's `SkipSpikesState` (None without `skip_spikes`)."""
        return None if self.spikes is None else self.spikes.spike_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict`.

        Raises:
            ValueError: the saved scaler state and this step's scaler do not
                match: a saved (non-empty) scaler state but no enabled scaler
                here, or the reverse (the mirror of `jaxstable.train.
                load_checkpoint` refusing another loss-scale type).
        """
        saved = state.get("scaler") or {}
        if bool(saved) != self._scaler_enabled():
            have = (
                type(self.scaler).__name__
                if self._scaler_enabled()
                else "no enabled scaler"
            )
            raise ValueError(
                f"the checkpoint holds {scaler_kind(saved)} but this TrainStep has "
                f"{have}: build it with the loss scale the checkpoint was saved with"
            )
        outside = self._outside_values(state.get("outside_params"))
        model, optimizer = state["model"], state["optimizer"]
        if _dist.is_fsdp(self.model):
            # Full tensors (any placement's checkpoint) sharded as here.
            model = _dist._shard_like(model, self.model.state_dict())
            like = _dist._fsdp_optimizer_like(self.optimizer, optimizer)
            optimizer = _dist._shard_like(optimizer, like)
        _dist.load_plain_state_dict(self.model, model)
        self.optimizer.load_state_dict(optimizer)
        self._set_outside_params(outside)
        self._load_counters(state)

    def _outside_params(self) -> dict[str, torch.Tensor]:
        """The optimizer's parameters the model does not hold, by name."""
        inside = {id(p) for p in _dist.inner_module(self.model).parameters()}
        names = param_names(self.model, self.optimizer)
        named = zip(names, self._params(), strict=True)
        return {n: p for n, p in named if id(p) not in inside}

    def _outside_values(self, saved: Mapping[str, Any] | None) -> dict[str, Any]:
        """The saved values of `_outside_params`, checked to be the same
        names, shapes and dtypes (a ValueError naming each that differs);
        {} with a RuntimeWarning naming them when `saved` is None (a state
        saved before torchref saved them: they keep their values)."""
        own = self._outside_params()
        if saved is None:
            if own:
                warnings.warn(
                    "the state holds no values for the optimizer's parameters "
                    f"outside the model ({', '.join(own)}): they keep their "
                    "current values (a checkpoint written before torchref saved "
                    "them)",
                    RuntimeWarning,
                    3,
                )
            return {}
        lines = []
        for name in [*own, *(n for n in saved if n not in own)]:
            s, e = _spec(saved.get(name)), _spec(own.get(name))
            where = f"  outside_params/{name}"
            if s is None:
                lines.append(f"{where}: missing from the state (target {e})")
            elif e is None:
                lines.append(f"{where}: in the state ({s}), not in the target")
            elif s != e:
                lines.append(f"{where}: state {s}, target {e}")
        if lines:
            raise ValueError(
                "the state's parameters outside the model do not match this "
                "TrainStep's optimizer:\n" + "\n".join(lines) + "\nbuild the "
                "optimizer over the parameters (and names) the state was saved with"
            )
        return dict(saved)

    def _set_outside_params(self, values: dict[str, Any]) -> None:
        """Copies `values` (checked by `_outside_values`) into the parameters."""
        own = self._outside_params()
        if values and _dist.is_fsdp(self.model):
            values = _dist._shard_like(values, own)
        with torch.no_grad():
            for name, value in values.items():
                own[name].copy_(value)

    def _load_counters(self, state: dict[str, Any]) -> None:
        """Inverse of `_counters_dict` (the scaler kind checked already)."""
        if self._scaler_enabled() and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.skip_state = SkipNonFiniteState(**state["skip_state"])
        self.steps_done = int(state["steps_done"])
        if self.spikes is not None and "spike_state" in state:
            self.spike_state.load_state_dict(state["spike_state"])


def _spec(t: Any) -> str | None:
    """``"(2, 3) float32"`` of a tensor (None for None)."""
    if t is None:
        return None
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of `optimizer`'s parameters, in its order.

    A parameter of `model` has the model's name (the unwrapped module's,
    without DDP's ``module.``); one outside the model has the name the
    optimizer was given for it (torch's named parameters:
    ``Adam([*model.named_parameters(), ("temperature", t)])``), else
    ``<unnamed k>`` for the k-th such parameter in the optimizer's order.
    Checkpoints key the optimizer state and the outside parameters' values
    by these names.

    Raises:
        ValueError: a name given to a parameter outside the model that the
            model or another such parameter already uses.
    """
    named: dict[int, str] = {}
    for name, p in _dist.inner_module(model).named_parameters():
        named.setdefault(id(p), name)
    taken = set(named.values())
    names, unnamed = [], 0
    for group in optimizer.param_groups:
        given = group.get("param_names") or [None] * len(group["params"])
        for p, label in zip(group["params"], given, strict=True):
            name = named.get(id(p))
            if name is None and label is not None:
                if label in taken:
                    raise ValueError(
                        f"the optimizer names a parameter outside the model "
                        f"{label!r}, a name the model or another parameter "
                        "already has: name it apart"
                    )
                name = label
            elif name is None:
                name, unnamed = f"<unnamed {unnamed}>", unnamed + 1
            taken.add(name)
            names.append(name)
    return names


def scaler_kind(saved: dict[str, Any]) -> str:
    """What a saved scaler state was written by, in words."""
    if not saved:
        return "no enabled scaler"
    # DynamicGradScaler.state_dict adds min_loss_scale to GradScaler's keys.
    return "a DynamicGradScaler" if "min_loss_scale" in saved else "a GradScaler"
