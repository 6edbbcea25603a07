"""A small U-Net in ``torch.nn`` (NCHW), the twin of `model_jax.UNet` (NHWC).

Same architecture, same submodule names (``encoders.0.conv1`` here is
``encoders[0].conv1`` there), so that `convert.torch_to_nnx` maps the
state_dict by name. Batch norm is the stock ``nn.BatchNorm2d(momentum=0.1,
eps=1e-5)``; upsampling is ``nn.ConvTranspose2d(kernel_size=2, stride=2)``;
the skip connection is concatenated before the upsampled features.

For low precision use ``torch.autocast`` (float32 parameters) or, the naive
way, ``model.half()`` / ``model.bfloat16()``.
"""

from __future__ import annotations

import torch
from torch import nn


class DoubleConv(nn.Module):
    """(3x3 conv, no bias -> BatchNorm2d -> ReLU) x 2, NCHW.

    Example:
        >>> block = DoubleConv(3, 8).eval()
        >>> tuple(block(torch.ones(1, 3, 8, 8)).shape)
        (1, 8, 8, 8)
    """

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels, eps=1e-5, momentum=0.1)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels, eps=1e-5, momentum=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(x)))


class UNet(nn.Module):
    """Small U-Net: NCHW images -> NCHW logits, twin of ``model_jax.UNet``.

    Args:
      in_channels: image channels (3).
      num_classes: output channels (logits per class).
      width: channels of the first level; level i has ``width * 2**i``.
      depth: number of 2x down/upsamplings (height and width must be
        divisible by ``2**depth``).

    ``model.train()`` / ``model.eval()`` select batch vs running statistics.

    Example:
        >>> model = UNet(num_classes=6, width=8, depth=2).eval()
        >>> tuple(model(torch.zeros(2, 3, 32, 32)).shape)
        (2, 6, 32, 32)
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 6,
        width: int = 16,
        depth: int = 2,
    ):
        super().__init__()
        if min(in_channels, num_classes, width, depth) < 1:
            raise ValueError(
                "in_channels, num_classes, width and depth must be >= 1, got "
                f"{in_channels}, {num_classes}, {width}, {depth}"
            )
        self.in_channels, self.num_classes = in_channels, num_classes
        self.width, self.depth = width, depth
        chans = [width * 2**i for i in range(depth + 1)]
        self.encoders = nn.ModuleList(
            DoubleConv(c_in, c)
            for c_in, c in zip([in_channels, *chans[:-2]], chans[:-1], strict=True)
        )
        self.bottleneck = DoubleConv(chans[-2], chans[-1])
        self.upsamples = nn.ModuleList(
            nn.ConvTranspose2d(chans[i + 1], chans[i], kernel_size=2, stride=2)
            for i in reversed(range(depth))
        )
        self.decoders = nn.ModuleList(
            DoubleConv(2 * chans[i], chans[i]) for i in reversed(range(depth))
        )
        self.head = nn.Conv2d(chans[0], num_classes, kernel_size=1)

    def architecture(self) -> dict[str, int]:
        """The constructor arguments, to build the twin model.

        Example:
            >>> UNet(width=8).architecture()
            {'in_channels': 3, 'num_classes': 6, 'width': 8, 'depth': 2}
        """
        return dict(
            in_channels=self.in_channels,
            num_classes=self.num_classes,
            width=self.width,
            depth=self.depth,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        multiple = 2**self.depth
        if x.ndim != 4 or x.shape[2] % multiple or x.shape[3] % multiple:
            raise ValueError(
                f"expected NCHW input with H and W divisible by 2**depth={multiple}, "
                f"got shape {tuple(x.shape)}"
            )
        skips = []
        for enc in self.encoders:
            x = enc(x)
            skips.append(x)
            x = nn.functional.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for up, dec, skip in zip(
            self.upsamples, self.decoders, skips[::-1], strict=True
        ):
            # under autocast the two halves may differ in dtype; cat needs one
            x = dec(torch.cat([skip, up(x).to(skip.dtype)], dim=1))
        return self.head(x)
