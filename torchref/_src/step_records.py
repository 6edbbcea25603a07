"""What `torchref.train.TrainStep` reports: its metrics as 0-d tensors, and
as python numbers read in ONE device->host transfer.

The keys are `jaxstable.train.make_train_step`'s: ``loss``, ``grad_norm``,
``loss_scale`` (the scale USED), ``finite`` (applied), ``grads_finite``,
``skipped_total`` and, when they apply, ``spike``, ``microbatches_dropped``,
`low_precision_adamw`'s rounding statistics and ``aux``.
"""

from __future__ import annotations

from typing import Any

import torch

from _stablecore.low_precision import STAT_NAMES
from torchref._src.clipping import to_host
from torchref._src.low_precision import rounding_stats

__all__ = ["device_metrics", "read_metrics"]


def device_metrics(
    loss: torch.Tensor,
    grad_norm: torch.Tensor,
    loss_scale: Any,
    flags: tuple[torch.Tensor, torch.Tensor],
    skipped_total: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    *,
    spike: torch.Tensor | None = None,
    dropped: torch.Tensor | None = None,
    aux: Any = None,
) -> dict[str, Any]:
    """The step's metrics, 0-d tensors on the device; ``flags`` is
    ``(applied, grads_finite)``; ``spike``, ``microbatches_dropped`` and
    ``aux`` only when not None."""
    applied, grads_finite = flags
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm.to(torch.float32),
        "loss_scale": torch.as_tensor(loss_scale, dtype=torch.float32),
        "finite": applied,
        "grads_finite": grads_finite,
        "skipped_total": skipped_total,
    }
    if spike is not None:
        metrics["spike"] = spike
    if dropped is not None:
        metrics["microbatches_dropped"] = dropped
    stats = rounding_stats(optimizer)
    if stats is not None:  # low_precision_adamw: what rounding lost
        metrics.update(stats._asdict())
    if aux is not None:
        metrics["aux"] = aux
    return metrics


def read_metrics(metrics: dict[str, Any], flags: list[Any], spikes: bool) -> list[Any]:
    """Replaces the 0-d tensors of ``metrics`` (but ``finite`` and
    ``skipped_total``, which the skip state gives) by python numbers, read
    together with the pending ``flags`` in ONE transfer; returns the flags'
    values, in order."""
    keys = ("loss", "grad_norm", "loss_scale", "grads_finite", "spike")[
        : 5 if spikes else 4
    ]
    rounding = [metrics[k] for k in STAT_NAMES if k in metrics]
    dropped = [metrics[n] for n in ("microbatches_dropped",) if n in metrics]
    values = to_host([metrics[key] for key in keys] + flags + rounding + dropped)
    at = len(keys) + len(flags)  # the rounding statistics, then dropped
    names = [k for k in STAT_NAMES if k in metrics]
    metrics.update(zip(names, map(float, values[at : at + len(names)]), strict=True))
    metrics.update(zip(keys[:3], (float(v) for v in values), strict=False))
    metrics["grads_finite"] = bool(values[3])
    if spikes:
        metrics["spike"] = bool(values[4])
    if "microbatches_dropped" in metrics:
        metrics["microbatches_dropped"] = int(values[-1])
    return values[len(keys) : len(keys) + len(flags)]
