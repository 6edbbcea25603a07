"""`torchref.train.TrainStep`'s micro-batches: splitting a batch,
combining their ``aux``, and keeping the finite ones.

With ``microbatches=k`` the step runs GradScaler's accumulation recipe over
`split_batch`'s k slices; with ``drop_non_finite_microbatches`` a
`KeptMicrobatches` selects a non-finite micro-batch out of a float32 sum (the
arithmetic of `jaxstable._src.microbatches`, operation for operation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torchref._src.check_points import CheckPoints
from torchref._src.clipping import all_finite_t

__all__ = ["KeptMicrobatches", "combine_aux", "split_batch"]


def split_batch(batch: Any, k: int, path: str = "") -> list[Any]:
    """The k micro-batches: every tensor's first dimension in k equal
    consecutive slices (as ``torch.chunk``); other leaves go to each."""
    if isinstance(batch, torch.Tensor):
        if batch.ndim == 0 or batch.shape[0] % k:
            # Same text as jaxstable.train.make_train_step.
            raise ValueError(
                f"microbatches={k}: batch leaf {path or '(the batch)'} has shape "
                f"{tuple(batch.shape)}; every batch leaf needs a leading axis "
                f"divisible by {k} (micro-batch i is its i-th of {k} equal "
                "consecutive slices)"
            )
        return list(batch.split(batch.shape[0] // k))
    if isinstance(batch, Mapping):
        parts = {key: split_batch(v, k, f"{path}[{key!r}]") for key, v in batch.items()}
        return [type(batch)((key, v[i]) for key, v in parts.items()) for i in range(k)]
    if isinstance(batch, list | tuple):
        parts = [split_batch(v, k, f"{path}[{i}]") for i, v in enumerate(batch)]
        rows = [[p[i] for p in parts] for i in range(k)]
        if hasattr(batch, "_fields"):  # a NamedTuple
            return [type(batch)(*row) for row in rows]
        return [type(batch)(row) for row in rows]
    return [batch] * k


def _nanmax(values: Any) -> torch.Tensor:
    """The largest of 0-d tensors ignoring nan; nan when all are nan."""
    x = torch.stack(list(values))
    big = torch.where(torch.isnan(x), torch.full_like(x, -math.inf), x).amax()
    return torch.where(big == -math.inf, torch.full_like(big, math.nan), big)


def combine_aux(auxes: list[Any]) -> Any:
    """One ``aux`` from the micro-batches': floating tensors and floats
    averaged (a mean over equal micro-batches is the whole batch's), booleans
    ANDed, integers summed; a `CheckPoints` collector is finite where every
    micro-batch was, with the largest ``max_abs`` (nan only when no
    micro-batch had a finite entry). The rule of
    `jaxstable.train.make_train_step`."""
    first = auxes[0]
    if isinstance(first, CheckPoints):
        return CheckPoints(
            first.names,
            [
                torch.stack(f).all()
                for f in zip(*(a.finite for a in auxes), strict=True)
            ],
            [_nanmax(m) for m in zip(*(a.max_abs for a in auxes), strict=True)],
        )
    if isinstance(first, Mapping):
        return type(first)((key, combine_aux([a[key] for a in auxes])) for key in first)
    if isinstance(first, list | tuple):
        items = [combine_aux(list(v)) for v in zip(*auxes, strict=True)]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    if isinstance(first, torch.Tensor):
        stacked = torch.stack([a.detach() for a in auxes])
        if stacked.dtype == torch.bool:
            return stacked.all(dim=0)
        if stacked.is_floating_point() or stacked.is_complex():
            return stacked.mean(dim=0)
        return stacked.sum(dim=0)
    if isinstance(first, bool):
        return all(auxes)
    if isinstance(first, int):
        return sum(auxes)
    if isinstance(first, float):
        return sum(auxes) / len(auxes)
    return first if all(a is first for a in auxes) else list(auxes)


class KeptMicrobatches:
    """`TrainStep`'s ``drop_non_finite_microbatches``: after each micro-batch's
    backward its gradient (alone in ``.grad``) and loss are checked on the
    device; a finite one is added, times its weight, to a float32 sum, a
    non-finite one is selected out (its NaN never enters) and the buffers
    its forward wrote are put back. `finish` writes the kept micro-batches'
    weighted mean into ``.grad`` (NaN when none was kept: ``0 * inf``) and
    returns their weighted mean loss. The arithmetic of
    `jaxstable.train.make_train_step`, operation for operation.

    Args:
        model: the module (its buffers are put back for a dropped one).
        optimizer: the optimizer (its grads are zeroed before each one).
        k: the number of micro-batches.
        weight: None or ``weight(micro_batch) -> number or 0-d tensor``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        k: int,
        weight: Callable[[Any], Any] | None,
    ) -> None:
        self.model, self.optimizer, self.k, self.weight_fn = model, optimizer, k, weight
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.acc: list[torch.Tensor | None] = [None] * len(self.params)
        self.wsum = self.lsum = self.dropped = None
        self.weight = None
        self.buffers: list[torch.Tensor] = []

    def before(self, part: Any) -> None:
        """Before micro-batch ``part``'s forward: an empty ``.grad``, its
        weight, and a copy of the buffers."""
        self.optimizer.zero_grad(set_to_none=True)
        self.weight = 1.0 if self.weight_fn is None else self.weight_fn(part)
        self.buffers = [b.detach().clone() for b in self.model.buffers()]

    def after(self, loss: torch.Tensor) -> None:
        """After its backward: added to the sum where finite, its buffers
        put back where not (selects on the device, no host read)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        ok = torch.isfinite(loss) & all_finite_t(grads).to(loss.device)
        w = torch.as_tensor(self.weight, dtype=torch.float32, device=loss.device)
        zero = torch.zeros((), dtype=torch.float32, device=loss.device)
        if self.wsum is None:
            self.wsum, self.lsum = zero, zero
            self.dropped = torch.zeros((), dtype=torch.int64, device=loss.device)
        self._add(ok, w)
        self.wsum = self.wsum + torch.where(ok, w, zero)
        self.lsum = self.lsum + torch.where(ok, w * loss, zero)
        self.dropped = self.dropped + (~ok).to(torch.int64)
        self._keep_buffers(ok)

    def _add(self, ok: torch.Tensor, w: torch.Tensor) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            a = self.acc[i]
            if a is None:
                dtype = torch.promote_types(p.grad.dtype, torch.float32)
                a = torch.zeros_like(p.grad, dtype=dtype)
            ok_i = ok.to(a.device)
            self.acc[i] = torch.where(ok_i, a + w.to(a.device) * p.grad.to(a.dtype), a)

    def _keep_buffers(self, ok: torch.Tensor) -> None:
        now = list(self.model.buffers())
        if len(now) != len(self.buffers) or any(
            a.shape != b.shape for a, b in zip(now, self.buffers, strict=True)
        ):
            raise ValueError(
                "drop_non_finite_microbatches=True: the forward replaced model "
                "buffers by ones of other shapes or number, so a dropped "
                "micro-batch's buffers cannot be put back"
            )
        with torch.no_grad():
            for b, old in zip(now, self.buffers, strict=True):
                b.copy_(torch.where(ok.to(b.device), b, old))

    def finish(self) -> torch.Tensor:
        """The kept micro-batches' weighted mean written into ``.grad``;
        returns their weighted mean loss."""
        # Each share was scale * loss_i / k: times k / (sum of kept weights)
        # it is the kept micro-batches' weighted mean (see the JAX step).
        k = torch.tensor(float(self.k), dtype=torch.float32)
        factor = k.to(self.wsum.device) / self.wsum
        for p, a in zip(self.params, self.acc, strict=True):
            p.grad = None if a is None else (a * factor.to(a.device)).to(p.dtype)
        return self.lsum / self.wsum
