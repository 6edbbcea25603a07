"""The guard's state types and the one walker that finds a state by type.

`SkipNonFinite` (`torchref._src.guard`) and `SkipSpikes`
(`torchref._src.spikes`) keep these states; the accumulation and the finders
tell a guard by them. Kept apart so that every module imports them from here
and none imports a sibling wrapper for a type (as `jaxstable._src.guard_state`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SkipNonFiniteState", "SkipSpikesState", "find_state"]


@dataclasses.dataclass
class SkipNonFiniteState:
    """Counters of a non-finite skip guard (same fields as the JAX state).

    Attributes:
        skipped_total: steps skipped since creation, whatever made them
            non-finite (the gradients, or what the step would have written).
        consecutive: skipped steps in a row up to the last step (0 after an
            applied one).
        last_finite: whether the last step was applied (its gradients, and
            the parameters and optimizer state it wrote, all finite).
        exceeded: ``consecutive > max_consecutive`` (False when
            `max_consecutive` is None); recomputed every step.
        last_grads_finite: whether the last step's gradients were finite
            (the flag GradScaler reacts to).
        non_finite_updates: how many skipped steps had finite gradients but
            a non-finite update (undone after `optimizer.step()`).

    Example:
        >>> s = SkipNonFiniteState()
        >>> s.skipped_total, s.consecutive, s.last_finite, s.exceeded
        (0, 0, True, False)
        >>> s.record(False, None, grads_finite=True)
        >>> s.skipped_total, s.last_grads_finite, s.non_finite_updates
        (1, True, 1)
    """

    skipped_total: int = 0
    consecutive: int = 0
    last_finite: bool = True
    exceeded: bool = False
    last_grads_finite: bool = True
    non_finite_updates: int = 0

    def record(
        self, finite: bool, max_consecutive: int | None, *, grads_finite=None
    ) -> None:
        """Counts one step: `finite` = applied; `grads_finite` defaults to it."""
        finite = bool(finite)
        grads_finite = finite if grads_finite is None else bool(grads_finite)
        self.last_finite = finite
        self.last_grads_finite = grads_finite
        if finite:
            self.consecutive = 0
        else:
            self.consecutive += 1
            self.skipped_total += 1
            self.non_finite_updates += int(grads_finite)
        self.exceeded = (
            max_consecutive is not None and self.consecutive > max_consecutive
        )


class SkipSpikesState:
    """The spike guard's window and counters (same fields as the JAX state).

    Attributes:
        log_norms: float32 ``[window]`` tensor, ``log(global_norm(grads))``
            of the latest steps whose values were finite, spikes included
            (ring buffer; 0 where not written).
        losses: float32 ``[window]``, their losses (when given).
        norm_count: values in `log_norms` (at most the window).
        loss_count: values in `losses`.
        position: the slot the next step with finite values writes.
        spikes_total: steps skipped as spikes so far.
        last_spike: whether the latest step was skipped as a spike.
        last_finite: whether the latest step was applied.

    The window lives on the device of the gradient norms (moved there on
    the first step) and the counters in 0-d tensors beside it, so that a
    step updates them without a host read (issue 24); reading a counter
    attribute returns a python int/bool (one device->host transfer).

    Example:
        >>> s = SkipSpikesState(window=4)
        >>> s.log_norms.tolist(), s.norm_count, s.spikes_total, s.last_finite
        ([0.0, 0.0, 0.0, 0.0], 0, 0, True)
    """

    # The counters live in 0-d device tensors (`_t`), so that the step
    # updates them without a host read (issue 24); reading an attribute is
    # one device->host transfer.
    _INTS = ("norm_count", "loss_count", "position", "spikes_total")
    _BOOLS = ("last_spike", "last_finite")

    def __init__(self, window: int) -> None:
        self.log_norms = torch.zeros(window, dtype=torch.float32)
        self.losses = torch.zeros(window, dtype=torch.float32)
        self._t: dict[str, torch.Tensor] = {}
        for name in self._INTS:
            self._t[name] = torch.zeros((), dtype=torch.int64)
        self._t["last_spike"] = torch.zeros((), dtype=torch.bool)
        self._t["last_finite"] = torch.ones((), dtype=torch.bool)

    def __getattr__(self, name: str) -> Any:
        if name in SkipSpikesState._INTS:
            return int(self.__dict__["_t"][name])
        if name in SkipSpikesState._BOOLS:
            return bool(self.__dict__["_t"][name])
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._INTS + self._BOOLS:
            dtype = torch.int64 if name in self._INTS else torch.bool
            self._t[name] = torch.as_tensor(value, dtype=dtype).to(
                self.log_norms.device
            )
        else:
            super().__setattr__(name, value)

    def _to(self, device: torch.device) -> None:
        """Moves the window and counters to `device` (once: the norms' own)."""
        if self.log_norms.device != device:
            self.log_norms = self.log_norms.to(device)
            self.losses = self.losses.to(device)
            self._t = {k: v.to(device) for k, v in self._t.items()}

    def state_dict(self) -> dict[str, Any]:
        """Every field, for a checkpoint (python numbers, CPU tensors)."""
        return {
            "log_norms": self.log_norms.detach().cpu().clone(),
            "losses": self.losses.detach().cpu().clone(),
            "norm_count": self.norm_count,
            "loss_count": self.loss_count,
            "position": self.position,
            "spikes_total": self.spikes_total,
            "last_spike": self.last_spike,
            "last_finite": self.last_finite,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Inverse of `state_dict` (a window of another length is refused)."""
        if saved["log_norms"].shape != self.log_norms.shape:
            raise ValueError(
                f"the saved spike window has {saved['log_norms'].shape[0]} slots, "
                f"this guard {self.log_norms.shape[0]}: build it with the same "
                "window"
            )
        device = self.log_norms.device
        self.log_norms = saved["log_norms"].clone().float().to(device)
        self.losses = saved["losses"].clone().float().to(device)
        self.norm_count = int(saved["norm_count"])
        self.loss_count = int(saved["loss_count"])
        self.position = int(saved["position"])
        self.spikes_total = int(saved["spikes_total"])
        self.last_spike = bool(saved["last_spike"])
        self.last_finite = bool(saved["last_finite"])


def find_state(
    obj: Any,
    kind: type,
    attr: str,
    *,
    skip: Callable[[Any], bool] = lambda obj: False,
) -> Any:
    """The first ``kind`` held at ``attr``: by ``obj``, or, for a list or tuple,
    by its items (depth first); None when there is none. An object for which
    ``skip`` is true holds none."""
    if skip(obj):
        return None
    state = getattr(obj, attr, None)
    if isinstance(state, kind):
        return state
    if isinstance(obj, list | tuple):
        for item in obj:
            found = find_state(item, kind, attr, skip=skip)
            if found is not None:
                return found
    return None
