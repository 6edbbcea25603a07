"""The segmentation losses of the torch runs, on the U-Net's NCHW logits.

* `stable_loss`: `torchref.losses.softmax_cross_entropy` (float32,
  ``ignore_index=255``).
* `naive_loss`: ``F.cross_entropy`` on the low-precision logits of a
  ``model.half()`` model.

Both are a mean over the GLOBAL batch under DDP (``compare.py --devices
N``): the ranks' rows hold different numbers of labelled pixels, and
`examples.harness.ddp.global_mean` turns each rank's mean into its share of
the global batch's mean (one process: the mean as it is).

Example:
    >>> import torch
    >>> logits, labels = torch.zeros(1, 3, 2, 2), torch.tensor([[[0, 1], [2, 255]]])
    >>> round(float(stable_loss(logits, labels)), 4)
    1.0986
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from examples.harness import ddp
from examples.segmentation.data import IGNORE_INDEX
from torchref import losses


def _labelled(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()


def stable_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Float32 cross-entropy over the pixels not labelled 255."""
    loss = losses.softmax_cross_entropy(
        logits, labels, dim=1, ignore_index=IGNORE_INDEX
    )
    return ddp.global_mean(loss, _labelled(labels))


def naive_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy`` in the logits' dtype."""
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
    return ddp.global_mean(loss, _labelled(labels))
