"""A small CLIP-style dual encoder in torch (NCHW), twin of `model_jax.CLIP`.

* image tower: three 3x3 stride-2 convolutions with ReLU (width, 2 width,
  4 width channels), flattened in (C, H, W) order, a linear projection;
* text tower: a token embedding, a masked mean over the caption's tokens
  (padding, id 0, left out), a linear projection;
* ``logit_scale``: a learnable scalar initialised to ``log(1 / 0.07)``
  (CLIP's temperature 0.07 in log space); the losses clamp it (or not).

The masked mean is where an empty (all-padding) caption goes: ``safe=True``
divides by ``max(count, 1)`` (the embedding of an empty caption is then the
projection's bias), ``safe=False`` divides by the count, as a first attempt
writes it: ``0 / 0`` for an empty caption.
"""

from __future__ import annotations

import math

import torch
from torch import nn

LOGIT_SCALE_INIT = math.log(1 / 0.07)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, *, safe: bool) -> torch.Tensor:
    """Mean of ``x`` (B, L, D) over the positions where ``mask`` (B, L) is 1.

    Example:
        >>> x = torch.ones(2, 3, 1); m = torch.tensor([[1.0, 1, 0], [0, 0, 0]])
        >>> masked_mean(x, m, safe=True)[:, 0].tolist()
        [1.0, 0.0]
        >>> masked_mean(x, m, safe=False)[1, 0].isnan().item()
        True
    """
    mask = mask.to(x.dtype)
    total = (x * mask[..., None]).sum(dim=1)
    count = mask.sum(dim=1, keepdim=True)
    return total / (count.clamp(min=1) if safe else count)


class ImageTower(nn.Module):
    def __init__(self, width: int, image_size: int, embed_dim: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.conv3 = nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1)
        side = image_size // 8
        self.proj = nn.Linear(4 * width * side * side, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in (self.conv1, self.conv2, self.conv3):
            x = torch.relu(conv(x))
        return self.proj(x.flatten(1))


class TextTower(nn.Module):
    def __init__(self, vocab_size: int, token_dim: int, embed_dim: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, token_dim)
        self.proj = nn.Linear(token_dim, embed_dim)

    def forward(self, tokens: torch.Tensor, *, safe: bool) -> torch.Tensor:
        pooled = masked_mean(self.embed(tokens), (tokens != 0).float(), safe=safe)
        return self.proj(pooled)


class CLIP(nn.Module):
    """The dual encoder: ``model(images, tokens, safe=...) -> (img, txt)``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> m = CLIP(width=4, image_size=16, vocab_size=19)
        >>> img, txt = m(torch.zeros(2, 3, 16, 16), torch.tensor([[1, 5], [0, 0]]))
        >>> img.shape, txt.shape, round(m.logit_scale.item(), 4)
        (torch.Size([2, 32]), torch.Size([2, 32]), 2.6593)
    """

    def __init__(
        self,
        *,
        width: int,
        image_size: int,
        vocab_size: int,
        embed_dim: int = 32,
        token_dim: int = 32,
    ):
        super().__init__()
        self._arch = dict(
            width=width, image_size=image_size, vocab_size=vocab_size,
            embed_dim=embed_dim, token_dim=token_dim,
        )  # fmt: skip
        self.image = ImageTower(width, image_size, embed_dim)
        self.text = TextTower(vocab_size, token_dim, embed_dim)
        self.logit_scale = nn.Parameter(torch.tensor(LOGIT_SCALE_INIT))

    def architecture(self) -> dict:
        """The constructor's arguments (to build the NNX twin)."""
        return dict(self._arch)

    def forward(self, images, tokens, *, safe: bool = True):
        return self.image(images), self.text(tokens, safe=safe)
