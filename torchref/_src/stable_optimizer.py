"""`stable_optimizer`: the finiteness check, the clip and the step in one call."""

from __future__ import annotations

from typing import Any

import torch

from torchref._src.clipping import (
    clip_by_global_norm,
    clip_in_place,
    global_norm,
    home_device,
    norm_and_finite,
)
from torchref._src.guard import SkipNonFinite

__all__ = ["StableOptimizer", "stable_optimizer"]


class StableOptimizer(SkipNonFinite):
    """Finiteness check, clipping and the optimizer step in one `step()`.

    Made by `stable_optimizer`. After each `step()`, `grad_norm` holds the
    pre-clip global norm (0-d float32 tensor) and `skip_state` the counters.

    Example:
        >>> import torch
        >>> from torchref import transforms
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> opt = transforms.stable_optimizer(torch.optim.SGD([w], lr=1.0),
        ...                                   max_grad_norm=1.0)
        >>> w.grad = torch.tensor([3.0, 4.0])
        >>> opt.step()
        >>> round(opt.grad_norm.item(), 4), [round(v, 4) for v in w.tolist()]
        (5.0, [-0.6, -0.8])
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None,
        skip: bool,
        max_consecutive: int | None,
        clip_eps: float,
        check_update: bool = True,
        decide_on: str = "auto",
    ):
        super().__init__(optimizer, max_consecutive, check_update, decide_on)
        if max_grad_norm is not None and self._needs_closure:
            # Measured: LBFGS on a 2-parameter quadratic went to 1e6 with
            # max_grad_norm=1.0 and converged without it.
            raise ValueError(
                f"max_grad_norm cannot be used with {type(optimizer).__name__}: "
                "its step re-evaluates the loss through the closure and builds "
                "its curvature estimate from the gradients, which a clip would "
                "change; leave max_grad_norm=None and bound its steps with lr "
                "and line_search_fn='strong_wolfe'"
            )
        self.skip = bool(skip)
        self.clip = (
            None
            if max_grad_norm is None
            else clip_by_global_norm(max_grad_norm, eps=clip_eps)
        )
        self.grad_norm: torch.Tensor | None = None

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _guards(self) -> bool:
        return self.skip

    def _check(self, grads_finite: Any) -> torch.Tensor:
        """One pass gives the norm AND the flag: clips where finite (and
        `max_grad_norm` is set), records `grad_norm`; no host sync. On a
        non-finite step the norm is reported (inf/nan) but not multiplied
        into the grads, so a later report still names the bad leaves."""
        grads = self.grads()
        given = None
        if grads_finite is not None:
            given = torch.as_tensor(grads_finite, device=home_device(grads)).to(
                torch.bool
            )
        read = self._read_on_host(grads, given, self.clip) if self.skip else None
        if read is not None:
            self.grad_norm = read[1].to(torch.float32)
            return read[0]
        if self.clip is not None:
            norm, finite = clip_in_place(
                grads, self.clip.max_norm, self.clip.eps, apply=given
            )
        else:
            norm, finite, _ = norm_and_finite(grads)
        self.grad_norm = self._norm = norm.to(torch.float32)
        if not self.skip:
            return torch.ones((), dtype=torch.bool, device=finite.device)
        return finite if given is None else given

    def _prepare(self, finite: bool) -> None:
        """The closure path (no clip there): records `grad_norm`."""
        self.grad_norm = global_norm(self.grads())


def stable_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    max_grad_norm: float | None = None,
    skip_non_finite: bool = True,
    max_consecutive: int | None = None,
    clip_eps: float = 1e-6,
    check_update: bool = True,
    decide_on: str = "auto",
) -> StableOptimizer:
    """Skip-non-finite around (clip by global norm, then the optimizer).

    Maths, per `step()`: ``finite = all_finite(grads)`` (one check, on the
    raw grads); ``norm = global_norm(grads)``; if `max_grad_norm`:
    ``grads *= min(max_grad_norm/(norm + clip_eps), 1)``; then
    ``optimizer.step()`` only if finite, undone (with `check_update`) when
    it wrote a non-finite parameter or state value. Mirrors
    ``jaxstable.transforms.stable_optimizer`` =
    ``skip_non_finite(chain(clip_by_global_norm(max_grad_norm), optimizer))``.

    Args:
        optimizer: any `torch.optim.Optimizer`.
        max_grad_norm: clip threshold (> 0) or None for no clipping (None for
            an optimizer whose step needs a closure, such as LBFGS).
        skip_non_finite: skip non-finite steps (default True). If False the
            step is always applied and `find_skip_state` returns None.
        max_consecutive: see `skip_non_finite`.
        clip_eps: eps of the clip formula.
        check_update: see `skip_non_finite` (default True; ignored when
            `skip_non_finite` is False). With `max_grad_norm` set, a
            float32 SGD (no weight decay) / Adam (eps > 0, no L2 decay) /
            AdamW step is proved finite on the host (`UpdateBound`: every
            value it computes stays below 2**100) and takes no copy and
            no check on the host path, nor with a fused optimizer.
        decide_on: see `skip_non_finite`.

    Returns:
        A `StableOptimizer` (``.grad_norm`` = last pre-clip norm).

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> opt = stable_optimizer(torch.optim.SGD([w], lr=1.0), max_grad_norm=1.0)
        >>> w.grad = torch.tensor([3.0, 4.0])
        >>> opt.step()
        >>> round(float(opt.grad_norm), 4), [round(v, 4) for v in w.tolist()]
        (5.0, [-0.6, -0.8])
    """
    return StableOptimizer(
        optimizer,
        max_grad_norm=max_grad_norm,
        skip=skip_non_finite,
        max_consecutive=max_consecutive,
        clip_eps=clip_eps,
        check_update=check_update,
        decide_on=decide_on,
    )
