"""The loss `torchref.train.TrainStep` backpropagates: ``loss_fn(model,
batch)`` under autocast, checked, and its scaled share of the mean over the
micro-batches and ranks, mirroring `jaxstable._src.step_loss`.

Each of k micro-batches backpropagates ``scale * loss / k`` (GradScaler's
accumulation recipe, the gradients adding up in ``.grad``); under DDP or
FSDP2 each of N ranks backpropagates its share ``loss / N`` of the global
mean (`torchref.distributed`), one device's float16 headroom.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from torchref._src.step_checks import check_loss

__all__ = ["backward_share", "forward"]


def forward(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], Any],
    batch: Any,
    device_type: str,
    autocast_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, Any]:
    """``loss_fn(model, batch)`` under autocast, checked: ``(loss, aux)``."""
    ctx = (
        torch.autocast(device_type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with ctx:
        out = loss_fn(model, batch)
    return check_loss(out)


def backward_share(
    loss: torch.Tensor, k: int | None, replicas: Any, scaler: Any, steps_done: int
) -> torch.Tensor:
    """Backpropagates this call's scaled share of the mean over ``k``
    micro-batches (None: one) and the ranks; returns the loss, the global
    one under DDP/FSDP2 (``replicas``, None in one process)."""
    share = loss if k is None else loss / k
    if replicas is not None:
        # Before the backward (DDP's own all-reduces): the global loss
        # and the ranks' agreement on the parameters it uses.
        share, loss = replicas.share(share, loss, steps_done)
    (scaler.scale(share) if scaler is not None else share).backward()
    return loss
