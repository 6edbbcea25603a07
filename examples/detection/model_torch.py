"""A small anchor-free detector in ``torch.nn`` (NCHW), twin of `model_jax.Detector`.

Architecture for ``width`` w (an FCOS / CenterNet-style single-scale head
on a two-scale neck, at toy size)::

    backbone: stem    3x3 conv-BN-ReLU, w channels                    (H)
              stage1  3x3/2 conv-BN-ReLU -> 3x3 conv-BN-ReLU, w        (H/2)
              stage2  same, 2w                                         (H/4)
              stage3  same, 4w                                         (H/8)
    neck:     1x1 laterals of stage2 and stage3 to 2w, stage3 nearest-2x
              upsampled and added (H/4)
    head:     3x3 conv-BN-ReLU (2w), then two 1x1 convs: ``cls``
              (num_classes logits per cell) and ``box`` (4 raw distances
              per cell)

The grid has stride `STRIDE` = 4. A cell at row i, column j (centre
``((j + 0.5) * 4, (i + 0.5) * 4)`` pixels) predicts its box as distances
``exp(raw) * 4`` to the left, top, right and bottom edges (FCOS's
``exp``); :func:`decode` does it. The class logits' bias starts at
``-log((1 - 0.01) / 0.01)`` (RetinaNet's prior: every cell starts at a
probability of 0.01, so the focal loss of the ~all-background grid starts
small).

The stages are `examples.common.layers_torch`'s `ConvBN` / `Stage` (same
names in the NNX twin), so `convert.nnx_from_torch` maps the state_dict by name.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from examples.common.layers_torch import ConvBN, Stage

STRIDE = 4
PRIOR = 0.01


class Detector(nn.Module):
    """Small anchor-free detector: NCHW images -> class logits, raw box distances.

    Args:
      in_channels: image channels (3).
      num_classes: object classes.
      width: channels of the first level (levels have w, 2w, 4w).

    ``forward(x)`` with x (N, C, H, W), H and W divisible by 8, returns
    ``{"cls": (N, num_classes, H/4, W/4), "box": (N, 4, H/4, W/4)}``.

    Example:
        >>> out = Detector(num_classes=3, width=4).eval()(torch.zeros(2, 3, 32, 32))
        >>> tuple(out["cls"].shape), tuple(out["box"].shape)
        ((2, 3, 8, 8), (2, 4, 8, 8))
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 3, width: int = 8):
        super().__init__()
        if min(in_channels, num_classes, width) < 1:
            raise ValueError(
                "need in_channels, num_classes and width >= 1, got "
                f"{in_channels}, {num_classes}, {width}"
            )
        self.in_channels, self.num_classes, self.width = in_channels, num_classes, width
        self.stem = ConvBN(in_channels, width)
        self.stage1 = Stage(width, width)
        self.stage2 = Stage(width, 2 * width)
        self.stage3 = Stage(2 * width, 4 * width)
        self.lateral2 = nn.Conv2d(2 * width, 2 * width, 1)
        self.lateral3 = nn.Conv2d(4 * width, 2 * width, 1)
        self.head = ConvBN(2 * width, 2 * width)
        self.cls = nn.Conv2d(2 * width, num_classes, 1)
        self.box = nn.Conv2d(2 * width, 4, 1)
        with torch.no_grad():
            self.cls.bias.fill_(-math.log((1 - PRIOR) / PRIOR))

    def architecture(self) -> dict:
        """The constructor arguments, to build the twin model.

        Example:
            >>> Detector(width=4).architecture()
            {'in_channels': 3, 'num_classes': 3, 'width': 4}
        """
        return dict(
            in_channels=self.in_channels, num_classes=self.num_classes, width=self.width
        )

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if x.ndim != 4 or x.shape[2] % 8 or x.shape[3] % 8:
            raise ValueError(
                "expected NCHW input with H and W divisible by 8 (three stride-2 "
                f"stages), got shape {tuple(x.shape)}"
            )
        c2 = self.stage2(self.stage1(self.stem(x)))
        c3 = self.stage3(c2)
        p = self.lateral2(c2) + F.interpolate(
            self.lateral3(c3), scale_factor=2, mode="nearest"
        )
        h = self.head(p)
        return {"cls": self.cls(h), "box": self.box(h)}


def cell_centers(grid: int) -> torch.Tensor:
    """(grid * grid, 2) pixel centres (x, y) of the cells, row-major.

    Example:
        >>> cell_centers(2).tolist()
        [[2.0, 2.0], [6.0, 2.0], [2.0, 6.0], [6.0, 6.0]]
    """
    idx = torch.arange(grid, dtype=torch.float32)
    ys, xs = torch.meshgrid(idx, idx, indexing="ij")
    return torch.stack([xs.reshape(-1), ys.reshape(-1)], 1).add(0.5).mul(STRIDE)


def decode(raw: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
    """Boxes ``(x1, y1, x2, y2)`` from raw distances ``(..., 4)`` at cell centres.

    ``exp(raw) * STRIDE`` pixels to the left, top, right and bottom edges,
    computed in the dtype of `raw`.

    Example:
        >>> decode(torch.zeros(1, 4), torch.tensor([[2.0, 2.0]])).tolist()
        [[-2.0, -2.0, 6.0, 6.0]]
    """
    d = torch.exp(raw) * STRIDE
    c = centers.to(raw.dtype)
    return torch.cat([c - d[..., :2], c + d[..., 2:]], -1)
