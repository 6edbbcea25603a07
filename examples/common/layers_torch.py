"""``torch.nn`` layers the tasks share, each the twin of one in `layers_jax`.

`ConvBN` / `Stage` are the conv-BN-ReLU blocks of the OCR and detection
backbones (stock ``nn.BatchNorm2d(momentum=0.1, eps=1e-5)``); submodule
names equal the NNX twins', so `examples.common.convert.torch_to_nnx` maps
their state_dict by name.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class ConvBN(nn.Module):
    """3x3 conv (no bias, stride 1 or 2, padding 1) -> BatchNorm2d -> ReLU.

    Example:
        >>> tuple(ConvBN(3, 8, stride=2).eval()(torch.ones(1, 3, 8, 8)).shape)
        (1, 8, 4, 4)
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(
            in_channels, out_channels, 3, stride=stride, padding=1, bias=False
        )
        self.bn = nn.BatchNorm2d(out_channels, eps=1e-5, momentum=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class Stage(nn.Module):
    """A stride-2 ConvBN (``down``) then a stride-1 ConvBN (``conv``)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.down = ConvBN(in_channels, out_channels, stride=2)
        self.conv = ConvBN(out_channels, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.down(x))


def upsample(x: torch.Tensor, factor: int) -> torch.Tensor:
    """Nearest-neighbour upsampling by an integer factor (NCHW), as
    ``jnp.repeat`` does it (`layers_jax.upsample`).

    Example:
        >>> upsample(torch.arange(4.0).reshape(1, 1, 2, 2), 2)[0, 0, 0].tolist()
        [0.0, 0.0, 1.0, 1.0]
    """
    return x if factor == 1 else F.interpolate(x, scale_factor=factor, mode="nearest")
