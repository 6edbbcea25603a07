"""`accumulate_gradients`: one guarded step per window of micro-batches."""

from __future__ import annotations

from typing import Any

import torch

from torchref._src.clipping import all_finite_t
from torchref._src.guard import OptimizerView, SkipNonFinite, check_optimizer
from torchref._src.guard_state import SkipNonFiniteState, SkipSpikesState

__all__ = ["AccumulateGradients", "accumulate_gradients"]


def _spike_guard(optimizer: Any) -> Any:
    """The `SkipNonFinite` a `skip_spikes` wrapper guards with, or None when
    ``optimizer`` is none: told by its `SkipSpikesState` (the spikes module
    imports this one, not the other way)."""
    if isinstance(getattr(optimizer, "spike_state", None), SkipSpikesState):
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, SkipNonFinite):
            return inner
    return None


class AccumulateGradients(OptimizerView):
    """An optimizer wrapper that steps once every ``every_k`` calls, guarded.

    Made by `accumulate_gradients`. `param_groups` and `state` are the
    wrapped optimizer's; `skip_state` holds its counters (one per window);
    `mini_step` is the number of micro-steps already taken in this window.

    Example:
        >>> import torch
        >>> from torchref import transforms
        >>> w = torch.nn.Parameter(torch.zeros(1))
        >>> opt = transforms.accumulate_gradients(torch.optim.SGD([w], lr=1.0), 2)
        >>> for g in (1.0, 3.0):
        ...     opt.zero_grad()
        ...     (w * g).sum().backward()
        ...     opt.step()
        >>> w.tolist(), opt.mini_step
        ([-2.0], 0)
    """

    def __init__(
        self,
        optimizer: Any,
        every_k: int,
        *,
        drop_non_finite_microbatches: bool = False,
    ):
        if isinstance(every_k, bool) or not isinstance(every_k, int):
            raise TypeError(f"every_k must be an int >= 1, got {every_k!r}")
        if not isinstance(drop_non_finite_microbatches, bool):
            raise TypeError(
                "drop_non_finite_microbatches must be True or False, got "
                f"{drop_non_finite_microbatches!r}"
            )
        if every_k < 1:
            raise ValueError(f"every_k must be an int >= 1, got {every_k}")
        if isinstance(optimizer, AccumulateGradients):
            raise TypeError("accumulate_gradients is already around this optimizer")
        spikes = _spike_guard(optimizer)
        if spikes is None and not isinstance(optimizer, SkipNonFinite):
            check_optimizer(optimizer, "accumulate_gradients")
            optimizer = SkipNonFinite(optimizer, None)
        # A SkipSpikes wraps a SkipNonFinite (its `optimizer`).
        guard = optimizer if spikes is None else spikes
        if guard._needs_closure:
            name = type(guard.optimizer).__name__
            raise TypeError(
                f"accumulate_gradients cannot drive {name}: its step() "
                "re-evaluates the loss through a closure"
            )
        self.optimizer = optimizer
        self.every_k = every_k
        self.mini_step = 0
        self.drop_non_finite_microbatches = drop_non_finite_microbatches
        # drop_non_finite_microbatches: the float32 sum of the window's kept
        # micro-gradients (by parameter), how many were kept, and a device
        # count of the dropped ones (read by `dropped_total`).
        self._acc: dict[int, torch.Tensor] = {}
        self._kept: Any = None
        self._dropped: Any = 0

    @property
    def dropped_total(self) -> int | None:
        """Micro-gradients dropped so far (``drop_non_finite_microbatches``;
        None without it). Reading it syncs with the device."""
        if not self.drop_non_finite_microbatches:
            return None
        return int(self._dropped)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _absorb(self) -> None:
        """Adds this micro-step's gradient (alone in ``.grad``) to the float32
        sum when the new sum is finite, as the JAX transform; clears ``.grad``."""
        params = [p for p in self._params() if p.grad is not None]
        added = []
        for p in params:
            acc = self._acc.get(id(p))
            if acc is None:
                dtype = torch.promote_types(p.grad.dtype, torch.float32)
                acc = torch.zeros_like(p.grad, dtype=dtype)
            added.append(acc + p.grad.to(acc.dtype))
        ok = all_finite_t(added)
        for p, new in zip(params, added, strict=True):
            old = self._acc.get(id(p))
            old = torch.zeros_like(new) if old is None else old
            self._acc[id(p)] = torch.where(ok.to(new.device), new, old)
            p.grad = None
        one = ok.to(torch.int64)
        self._kept = one if self._kept is None else self._kept + one
        self._dropped = self._dropped + (1 - one)

    @property
    def skip_state(self) -> SkipNonFiniteState:
        """The guard's counters: one decision (and count) per window."""
        return self.optimizer.skip_state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the grads at the start of a window only (they add up inside;
        with ``drop_non_finite_microbatches`` `step` takes them each time)."""
        if self.mini_step == 0 or self.drop_non_finite_microbatches:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """Counts a micro-step; the ``every_k``-th steps on the mean gradient.

        The guarded step (check, clip for a `StableOptimizer`, step, undo of
        a non-finite write) runs on ``sum / every_k`` of the window's
        gradients: a NaN in any micro-batch skips the whole window, once.
        The grads are then zeroed, so the next window starts clean.
        """
        if closure is not None:
            raise TypeError("accumulate_gradients takes no closure")
        if self.drop_non_finite_microbatches:
            self._absorb()
        self.mini_step += 1
        if self.mini_step < self.every_k:
            return
        self.mini_step = 0
        if self.drop_non_finite_microbatches:
            # The kept ones' mean; none kept: 0 / 0 = nan, a skipped window.
            for p in self._params():
                acc = self._acc.get(id(p))
                if acc is not None:
                    p.grad = (acc / self._kept.to(acc.dtype)).to(p.dtype)
            self._acc, self._kept = {}, None
        else:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.div_(self.every_k)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped guard's state dict and the position in the window."""
        out = {"optimizer": self.optimizer.state_dict(), "mini_step": self.mini_step}
        if self.drop_non_finite_microbatches:
            out["dropped_total"] = self.dropped_total
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of `state_dict`."""
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.mini_step = int(state_dict["mini_step"])
        if self.drop_non_finite_microbatches:
            self._dropped = int(state_dict.get("dropped_total", 0))


def accumulate_gradients(
    optimizer: Any, every_k: int, *, drop_non_finite_microbatches: bool = False
) -> AccumulateGradients:
    """Gradient accumulation with ONE skip decision per optimizer step.

    The twin of `jaxstable.transforms.accumulate_gradients`, for plain loops
    that call ``zero_grad(); loss.backward(); step()`` once per micro-batch:
    ``zero_grad`` acts at the start of a window only, so the k micro-batch
    gradients add up in ``.grad``; the k-th ``step()`` divides them by k
    (the mean, as the JAX transform takes) and runs the guarded step once:
    a window with a non-finite micro-batch is skipped as a whole and counted
    once, and the next window starts from zeroed grads. A plain optimizer is
    guarded with `skip_non_finite`; a `stable_optimizer` also clips the mean
    once. A `skip_spikes` wrapper is accepted as well, as the JAX transform
    takes one: its spike test and window see the mean's norm once per
    window (not the loss: ``step()`` takes none here; the JAX update checks
    a ``value=`` given with the window's last micro-batch). For a
    GradScaler, use ``TrainStep(..., microbatches=k)``, which runs its
    accumulation recipe (the scaler must unscale once per window).

    Args:
        optimizer: a `torch.optim.Optimizer`, or a `skip_non_finite` /
            `stable_optimizer` / `skip_spikes` wrapper.
        every_k: micro-steps per optimizer step, an int >= 1.
        drop_non_finite_microbatches: False (default: a non-finite
            micro-batch skips its whole window), or True: each ``step()``
            takes the micro-gradient out of ``.grad`` into a float32 sum
            when the new sum is finite (else drops it, counted in
            `AccumulateGradients.dropped_total`), and the window's step
            takes the mean of the kept ones; it is skipped only when none
            is kept (``0 / 0``) or the result is non-finite. The twin of
            the JAX transform's option (equal weights); no host sync.

    Returns:
        An `AccumulateGradients` wrapper.

    Example:
        >>> import torch
        >>> from torchref.transforms import stable_optimizer
        >>> w = torch.nn.Parameter(torch.zeros(1))
        >>> sgd = torch.optim.SGD([w], lr=1.0)
        >>> opt = accumulate_gradients(stable_optimizer(sgd), 2)
        >>> for g in (1.0, float("nan"), 1.0, 3.0):
        ...     opt.zero_grad()
        ...     (w * g).sum().backward()
        ...     opt.step()
        ...     print(w.tolist(), opt.skip_state.skipped_total)
        [0.0] 0
        [0.0] 1
        [0.0] 1
        [-2.0] 1
        >>> keep = accumulate_gradients(sgd, 2, drop_non_finite_microbatches=True)
        >>> for g in (1.0, float("nan")):
        ...     keep.zero_grad()
        ...     (w * g).sum().backward()
        ...     keep.step()
        >>> w.tolist(), keep.dropped_total
        ([-3.0], 1)
    """
    return AccumulateGradients(
        optimizer, every_k, drop_non_finite_microbatches=drop_non_finite_microbatches
    )
