"""A small DBNet in ``torch.nn`` (NCHW), the twin of `model_jax.DBNet` (NHWC).

Architecture for ``width`` w (DBNet, Liao et al. 2020, at toy scale)::

    backbone: stem    3x3 conv-BN-ReLU, w channels, stride 1        (H)
              stage1  3x3/2 conv-BN-ReLU -> 3x3 conv-BN-ReLU, w      (H/2)
              stage2  same, 2w                                       (H/4)
              stage3  same, 4w                                       (H/8)
    neck (FPN): 1x1 lateral convs to 2w, top-down nearest-2x + add,
              3x3 smoothing convs to w channels, nearest upsampling of every
              level to H/2 and concatenation (DBNet fuses at 1/4)
    heads:    prob / thresh: 3x3 conv-BN-ReLU (w) -> 2x2/2 transposed conv
              to 1 channel at H (DBNet's deconvolutions)

The probability head returns *logits* (``P = sigmoid(logits)``): the
library's `db_loss` takes logits so that its BCE is computed stably; the
threshold head ends in a sigmoid, as DBNet's does (T in (0, 1)). In train
mode the model also returns DBNet's approximate binary map
``db_step(P, T, k)`` (float32, `torchref.losses.db_step`).

Submodule names equal the NNX model's (``backbone.stage1.down.conv`` here is
``backbone.stage1.down.conv`` there), so `convert.torch_to_nnx` maps the
state_dict by name. Batch norm is the stock ``nn.BatchNorm2d(momentum=0.1,
eps=1e-5)``; nearest upsampling is ``F.interpolate(scale_factor=s,
mode="nearest")``, which repeats pixels exactly as ``jnp.repeat`` does.
"""

from __future__ import annotations

import torch
from torch import nn

from examples.common.layers_torch import ConvBN, Stage, upsample
from torchref import losses


class Backbone(nn.Module):
    """stem (H) and three stride-2 stages (H/2, H/4, H/8); returns the stages."""

    def __init__(self, in_channels: int, width: int):
        super().__init__()
        self.stem = ConvBN(in_channels, width)
        self.stage1 = Stage(width, width)
        self.stage2 = Stage(width, 2 * width)
        self.stage3 = Stage(2 * width, 4 * width)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        c1 = self.stage1(self.stem(x))
        c2 = self.stage2(c1)
        return [c1, c2, self.stage3(c2)]


class Neck(nn.Module):
    """FPN: laterals, top-down sum, smoothing, all levels at H/2, concatenated."""

    def __init__(self, width: int):
        super().__init__()
        inner, out = 2 * width, width
        self.lateral1 = nn.Conv2d(width, inner, 1)
        self.lateral2 = nn.Conv2d(2 * width, inner, 1)
        self.lateral3 = nn.Conv2d(4 * width, inner, 1)
        self.smooth1 = nn.Conv2d(inner, out, 3, padding=1)
        self.smooth2 = nn.Conv2d(inner, out, 3, padding=1)
        self.smooth3 = nn.Conv2d(inner, out, 3, padding=1)

    def forward(self, feats: list[torch.Tensor]) -> torch.Tensor:
        c1, c2, c3 = feats
        p3 = self.lateral3(c3)
        p2 = self.lateral2(c2) + upsample(p3, 2)
        p1 = self.lateral1(c1) + upsample(p2, 2)
        return torch.cat(
            [
                self.smooth1(p1),
                upsample(self.smooth2(p2), 2),
                upsample(self.smooth3(p3), 4),
            ],
            dim=1,
        )


class Head(nn.Module):
    """3x3 conv-BN-ReLU then a 2x2 stride-2 transposed conv to one map at H."""

    def __init__(self, in_channels: int, width: int):
        super().__init__()
        self.conv = ConvBN(in_channels, width)
        self.up = nn.ConvTranspose2d(width, 1, kernel_size=2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.conv(x))[:, 0]


class DBNet(nn.Module):
    """Small DBNet: NCHW images -> shrink logits, threshold map (and binary map).

    Args:
      in_channels: image channels (3).
      width: channels of the first backbone level (levels have w, 2w, 4w).
      k: amplification of the approximate binary map ``db_step(P, T, k)``.

    ``forward(x)`` with x (N, C, H, W), H and W divisible by 8, returns a
    dict of (N, H, W) maps: ``logits`` (shrink-map logits), ``thresh`` (in
    (0, 1)) and, in train mode, ``binary`` (float32 ``db_step``).

    Example:
        >>> out = DBNet(width=8).train()(torch.zeros(2, 3, 32, 32))
        >>> sorted(out), tuple(out["binary"].shape)
        (['binary', 'logits', 'thresh'], (2, 32, 32))
    """

    def __init__(self, in_channels: int = 3, width: int = 8, k: float = 50.0):
        super().__init__()
        if min(in_channels, width) < 1 or not k > 0:
            raise ValueError(
                f"need in_channels >= 1, width >= 1 and k > 0, got {in_channels}, "
                f"{width}, {k}"
            )
        self.in_channels, self.width, self.k = in_channels, width, k
        self.backbone = Backbone(in_channels, width)
        self.neck = Neck(width)
        self.prob_head = Head(3 * width, width)
        self.thresh_head = Head(3 * width, width)

    def architecture(self) -> dict:
        """The constructor arguments, to build the twin model.

        Example:
            >>> DBNet(width=4).architecture()
            {'in_channels': 3, 'width': 4, 'k': 50.0}
        """
        return dict(in_channels=self.in_channels, width=self.width, k=self.k)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if x.ndim != 4 or x.shape[2] % 8 or x.shape[3] % 8:
            raise ValueError(
                "expected NCHW input with H and W divisible by 8 (three stride-2 "
                f"stages), got shape {tuple(x.shape)}"
            )
        fused = self.neck(self.backbone(x))
        logits = self.prob_head(fused)
        thresh = torch.sigmoid(self.thresh_head(fused))
        out = {"logits": logits, "thresh": thresh}
        if self.training:
            out["binary"] = losses.db_step(torch.sigmoid(logits), thresh, k=self.k)
        return out
