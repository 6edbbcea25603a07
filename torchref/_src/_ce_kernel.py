"""Twin of `jaxstable._src._ce_kernel` (the Pallas cross-entropy kernel).

torch needs no kernel of ours: ``F.cross_entropy`` already runs one fused
CUDA kernel per pass over the class axis (log-softmax + NLL, ignore_index,
class weights, label smoothing), which `torchref.losses` calls. This module
keeps the layout twin (tests/test_layout.py) and answers the same question
for torch: does the native fused kernel run for these logits?
"""

from __future__ import annotations

import torch

__all__ = ["ce_kernel_applies"]


def ce_kernel_applies(
    logits: torch.Tensor, *, dim: int = 1, weights: torch.Tensor | None = None
) -> bool:
    """Whether `F.cross_entropy` runs its fused device kernel here.

    True for floating logits on a CUDA device with at least one class along
    `dim` and weights None or of shape ``(C,)``; False on a CPU (the CPU
    path is ATen's loop, not a device kernel).

    Example:
        >>> import torch
        >>> ce_kernel_applies(torch.zeros(4, 19))
        False
    """
    if logits.device.type != "cuda" or not logits.is_floating_point():
        return False
    if logits.ndim < 2 or logits.shape[dim] < 1:
        return False
    return weights is None or tuple(weights.shape) == (logits.shape[dim],)
