"""A loss-spike guard for PyTorch optimizers, mirroring `jaxstable.transforms`.

`skip_spikes` wraps an optimizer (guarded with `skip_non_finite` when it is
not already) and refuses a step whose gradient norm or loss lies far above
the median of a window of recent steps (every step whose values are
finite, skipped as a spike or not), in robust deviations (median absolute
deviation). The statistics are the JAX guard's, computed
with the same float32 operations (a sort over a NaN-padded window).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from _stablecore.checks import check_spike_args
from torchref._src.accumulate import AccumulateGradients
from torchref._src.clipping import global_norm
from torchref._src.guard import (
    OptimizerView,
    SkipNonFinite,
    check_optimizer,
    scalar_flag,
    skip_non_finite,
)
from torchref._src.guard_state import SkipNonFiniteState, SkipSpikesState, find_state

__all__ = ["SkipSpikes", "SkipSpikesState", "find_spike_state", "skip_spikes"]

# As in jaxstable.transforms.skip_spikes: MAD * 1.4826 is a normal sample's
# sigma; a norm of 0 is taken as float32's smallest normal (log -87.3).
_MAD_TO_SIGMA = 1.482602218505602
_TINY = torch.finfo(torch.float32).tiny
# log(tiny) in float32, the value a norm below tiny (0 above all) is stored
# as, the same constant as jaxstable's `_LOG_TINY`.
_LOG_TINY = math.log(_TINY)


def _const(value: float, device: torch.device) -> torch.Tensor:
    """A float32 0-d constant made on `device` by a fill (`torch.tensor` on
    an accelerator copies from the host, which waits for the stream)."""
    return torch.full((), value, dtype=torch.float32, device=device)


def _flag(value: Any, device: torch.device) -> torch.Tensor:
    """A 0-d bool tensor on `device` from a bool or a bool tensor."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.bool)
    return torch.full((), bool(value), dtype=torch.bool, device=device)


def _median(sorted_values: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Median of the first `count` (a 0-d int tensor) sorted values; nan for
    none. Indexed on the device: no host read of `count`."""
    lo = torch.clamp((count - 1) // 2, min=0).reshape(1)
    hi = torch.clamp(count // 2, min=0).reshape(1)
    both = sorted_values.index_select(0, torch.cat([lo, hi]))
    med = (both[0] + both[1]) * _const(0.5, both.device)
    return torch.where(count == 0, torch.full_like(med, float("nan")), med)


def _robust_stats(buffer: torch.Tensor, count: torch.Tensor, blank: torch.Tensor):
    """``(median, sigma, n)`` of the first ``count`` slots that are not
    ``blank`` (an exact zero; the others NaN in the sorted copy, so last),
    as `jaxstable`'s `_robust_stats`."""
    slots = torch.arange(buffer.shape[0], device=buffer.device)
    used = (slots < count) & (buffer != blank)
    n = used.sum().to(torch.int32)
    window = torch.where(used, buffer, float("nan"))
    med = _median(torch.sort(window).values, n)
    mad = _median(torch.sort(torch.abs(window - med)).values, n)
    return med, _const(_MAD_TO_SIGMA, mad.device) * mad, n


class _Decision:
    """The spike test and the window update, shared by `SkipSpikes` and
    `torchref.train.TrainStep`."""

    def __init__(self, window, min_history, threshold, min_ratio):
        self.window, self.min_history, self.threshold, self.min_ratio = (
            check_spike_args(window, min_history, threshold, min_ratio)
        )
        self.state = SkipSpikesState(self.window)

    def _outlier(self, x, buffer, count, blank, floor) -> torch.Tensor:
        med, sigma, n = _robust_stats(buffer, count, blank)
        threshold = _const(self.threshold, x.device)
        margin = torch.maximum(threshold * sigma, floor(med))
        return (n >= self.min_history) & (x - med > margin)

    def check(self, norm: Any, value: Any, finite: Any) -> tuple[Any, Any, Any]:
        """``(finite, spike, (x, loss, finite))`` of a step with gradient
        norm `norm` and loss `value` (None: not checked): 0-d bool tensors
        on the norm's device, no host read (`finite` a bool or a bool
        tensor). The last triple is what `record` takes."""
        norm = torch.as_tensor(norm, dtype=torch.float32).detach()
        s, dev = self.state, norm.device
        s._to(dev)
        finite = scalar_flag(finite, dev) & torch.isfinite(norm)
        log_tiny = _const(_LOG_TINY, dev)
        x = torch.where(
            norm >= _TINY, torch.log(torch.clamp(norm, min=_TINY)), log_tiny
        )
        log_ratio = _const(math.log(self.min_ratio), dev)
        spike = finite & self._outlier(
            x, s.log_norms, s._t["norm_count"], log_tiny, lambda m: log_ratio
        )
        loss = None
        if value is not None:
            loss = torch.as_tensor(value, dtype=torch.float32).detach().to(dev)
            if loss.dim() != 0:  # same text as jaxstable.transforms.skip_spikes
                raise ValueError(
                    f"value must be a scalar (the step's loss), got shape "
                    f"{tuple(loss.shape)}"
                )
            finite = finite & torch.isfinite(loss)
            rel = _const(self.min_ratio - 1.0, dev)
            spike = spike | self._outlier(
                loss,
                s.losses,
                s._t["loss_count"],
                _const(0.0, dev),
                lambda m: rel * torch.abs(m),
            )
            spike = spike & finite
        return finite, spike, (x, loss, finite)

    def record(self, values: Any, spike: Any, applied: Any) -> None:
        """Counts the step; its values enter the window when they are finite
        (`check`'s `finite`), spike or not (selected on the device: `spike`
        and `applied` may be bools or bool tensors)."""
        s, (x, loss, keep) = self.state, values
        t, dev = s._t, s.log_norms.device
        spike, applied = _flag(spike, dev), _flag(applied, dev)
        keep = _flag(keep, dev)
        t["last_spike"], t["last_finite"] = spike.clone(), applied.clone()
        t["spikes_total"] = t["spikes_total"] + spike.to(torch.int64)
        here = keep & (torch.arange(self.window, device=dev) == t["position"])
        s.log_norms = torch.where(here, x, s.log_norms)
        grow = keep.to(torch.int64)
        t["norm_count"] = torch.clamp(t["norm_count"] + grow, max=self.window)
        if loss is not None:
            s.losses = torch.where(here, loss, s.losses)
            t["loss_count"] = torch.clamp(t["loss_count"] + grow, max=self.window)
        t["position"] = (t["position"] + grow) % self.window


class SkipSpikes(OptimizerView):
    """An optimizer wrapper that skips spikes and non-finite steps.

    Made by `skip_spikes`. `optimizer` is the guarded wrapper (a
    `SkipNonFinite`); `spike_state` holds the window and counters,
    `skip_state` the guard's skip counters (spikes included).

    Example:
        >>> import torch
        >>> from torchref import transforms
        >>> w = torch.nn.Parameter(torch.zeros(1))
        >>> opt = transforms.skip_spikes(torch.optim.SGD([w], lr=0.1),
        ...                              window=4, min_history=2)
        >>> for g in [1.0, 1.0, 100.0]:
        ...     w.grad = torch.tensor([g])
        ...     opt.step()
        >>> opt.spike_state.spikes_total, opt.skip_state.skipped_total
        (1, 1)
    """

    def __init__(self, optimizer, window, min_history, threshold, min_ratio):
        self.plain = not isinstance(optimizer, SkipNonFinite)
        if self.plain:  # a guard (stable_optimizer) is no torch Optimizer
            check_optimizer(optimizer, "skip_spikes")
        self.optimizer = skip_non_finite(optimizer) if self.plain else optimizer
        self._decision = _Decision(window, min_history, threshold, min_ratio)

    @property
    def spike_state(self) -> SkipSpikesState:
        """The window and the spike counters."""
        return self._decision.state

    @property
    def skip_state(self) -> SkipNonFiniteState:
        """The guard's skip counters (every skipped step, spikes included)."""
        return self.optimizer.skip_state

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grads_finite: bool | None = None,
        value: Any = None,
    ):
        """Steps unless the step is a spike or non-finite.

        Args:
            closure: evaluated first (under grad); its loss is `value` when
                `value` is None.
            grads_finite: the gradients' finiteness flag, when computed.
            value: the step's loss (checked for spikes too), or None.

        Returns:
            The closure's loss (or None).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            value = loss if value is None else value
        norm = global_norm(self.optimizer.grads())
        finite = True if grads_finite is None else grads_finite
        finite, spike, values = self._decision.check(norm, value, finite)
        # The norm bounds every gradient entry: the host path proves the
        # update finite from it (held for this one step only).
        self.optimizer._norm_hint = norm
        try:
            self.optimizer.step(grads_finite=finite & ~spike)
        finally:
            del self.optimizer._norm_hint
        # The guard's pending (applied, grads_finite) flags: no host read.
        pending = self.optimizer._pending
        applied = pending[-1][0] if pending else self.skip_state.last_finite
        self._decision.record(values, spike, applied)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The guarded optimizer's state dict plus the spike window."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "spike_state": self.spike_state.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of `state_dict`."""
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.spike_state.load_state_dict(state_dict["spike_state"])


def skip_spikes(
    optimizer: Any,
    *,
    window: int = 128,
    min_history: int = 16,
    threshold: float = 6.0,
    min_ratio: float = 1.5,
) -> SkipSpikes:
    """Skips a step whose gradient norm (or loss) spikes above recent steps.

    Same rule as `jaxstable.transforms.skip_spikes` (see there for the
    maths, why median/MAD on logs and why spikes enter the window): over a
    window of the latest steps whose values are finite,
    ``x = log(max(norm, tiny))`` is a spike when the window holds
    >= `min_history` values other than exact zeros (a norm below tiny, a
    loss of 0: they take a slot but not part in the statistics) and
    ``x - median > max(threshold * 1.4826 * MAD, log(min_ratio))`` over
    those values; the loss (``step(value=loss)``, or the closure's)
    likewise on raw values with the floor ``(min_ratio - 1) * |median|``.
    Every step whose norm and loss are finite (and ``grads_finite`` not
    False) enters the window, a spike or a step with a non-finite update
    too, so a lasting shift is adopted after about half a window instead
    of stalling training; a NaN or an inf never enters. Non-finite steps
    are refused from the first step. A spike is handed to the guard as
    ``grads_finite=False``: the optimizer state is untouched and the step is
    counted in ``skip_state.skipped_total``. A plain optimizer is guarded
    with `skip_non_finite` for you; wrap a `stable_optimizer` to clip too
    (the guard sees the pre-clip norm). The test, the window update and
    the skip are device tensors: no host sync in the step.
    `torchref.train.TrainStep` accepts
    ``skip_spikes(plain_optimizer)`` as its optimizer and feeds it the loss.

    Args:
        optimizer: a `torch.optim.Optimizer` or a `SkipNonFinite` /
            `StableOptimizer`.
        window: how many steps (with finite values) the statistics cover,
            int >= 1.
        min_history: values needed before a step can be a spike,
            1 <= min_history <= window.
        threshold: robust deviations above the median that make a spike, > 0.
        min_ratio: a spike is also at least this factor above the median
            norm, >= 1.

    Returns:
        A `SkipSpikes` wrapper.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(1))
        >>> opt = skip_spikes(torch.optim.SGD([w], lr=1.0), window=8, min_history=3)
        >>> seen = []
        >>> for g in [1.0, 1.1, 0.9, 1.0, 50.0, float("nan"), 1.05]:
        ...     w.grad = torch.tensor([g])
        ...     opt.step()
        ...     s = opt.spike_state
        ...     seen.append("spike" if s.last_spike else
        ...                 "applied" if s.last_finite else "non-finite")
        >>> seen
        ['applied', 'applied', 'applied', 'applied', 'spike', 'non-finite', 'applied']
    """
    return SkipSpikes(optimizer, window, min_history, threshold, min_ratio)


def find_spike_state(obj: Any) -> SkipSpikesState | None:
    """The `SkipSpikesState` of a `SkipSpikes`, of an `accumulate_gradients`
    around one, or of a `TrainStep`; None when there is none.

    Args:
        obj: a `SkipSpikes`, an `AccumulateGradients`, a
            `torchref.train.TrainStep`, or anything else.

    Returns:
        Its spike state, or None when it has none.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(1))
        >>> find_spike_state(skip_spikes(torch.optim.SGD([w], lr=0.1))).spikes_total
        0
        >>> find_spike_state(torch.optim.SGD([w], lr=0.1)) is None
        True
    """
    if isinstance(obj, AccumulateGradients):  # as JAX's search of the state
        obj = obj.optimizer
    return find_state(obj, SkipSpikesState, "spike_state")
