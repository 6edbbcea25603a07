"""The four model shapes of `bench_models.py`, built twice: torch and Flax NNX.

Each is the real model's structure (same layers, same depth, the same
parameter leaves in the same roles: ResNet-18 has 62 parameter tensors here
as in torchvision) at a smaller width and input, so that a CPU runs every
row in minutes. Which of the real model's numbers are kept and which are
not is said in `SHAPES` and in `bench_models.py`'s docstring.

Both frameworks build the same shapes from the same `Shape`; their weights
are initialised independently (no number here is compared across the two
frameworks, only each framework's guarded step against its own recipe).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
from flax import nnx
from torch import nn


@dataclasses.dataclass(frozen=True)
class Shape:
    """One model's scaled shape and what it stands for."""

    kind: str  # resnet | unet | gpt | vit
    real: str  # the model it stands for
    width: int  # base width (ResNet stage 1 / transformer d_model)
    size: int  # image side, or sequence length
    classes: int = 10  # classes, or vocabulary
    depth: int = 12  # transformer blocks
    heads: int = 4
    patch: int = 16
    decoder: tuple[int, ...] = ()  # U-Net decoder widths


# The real models' numbers (params, leaves, FLOPs per parameter per sample)
# are in bench_models.py's docstring, next to these scaled ones.
SHAPES = {
    "resnet18": Shape("resnet", "torchvision resnet18", width=8, size=96),
    "unet_r18_d3": Shape(
        "unet",
        "segmentation_models_pytorch Unet(resnet18, encoder_depth=3)",
        width=8,
        size=48,
        classes=19,
        decoder=(16, 8, 4),
    ),
    "gpt2_small": Shape(
        "gpt", "GPT-2 small, tied embeddings", width=64, size=32, classes=4096
    ),
    "vit_small": Shape("vit", "ViT-S/16", width=64, size=32, classes=100, patch=8),
    # bench_step.py's small conv net, as it is there (not scaled).
    "convnet": Shape("convnet", "bench_step's conv net", width=32, size=32),
}


# The real models' own shapes, for `bench_models.py --real-cost`: compiled
# from abstract values (nothing allocated, nothing run), for XLA's byte and
# FLOP counts at the size people train. smp's depth-3 U-Net with decoder
# widths (64, 32, 16): 0.9M of its 11.5M parameters get a gradient.
REAL_SHAPES = {
    "resnet18": Shape("resnet", "resnet18", width=64, size=224, classes=1000),
    "unet_r18_d3": Shape(
        "unet", "Unet", width=64, size=256, classes=19, decoder=(64, 32, 16)
    ),
    "gpt2_small": Shape(
        "gpt", "GPT-2 small", width=768, size=1024, classes=50257, heads=12
    ),
    "vit_small": Shape(
        "vit", "ViT-S/16", width=384, size=224, classes=1000, heads=6, patch=16
    ),
}


# ----------------------------------------------------------------- torch
class TorchBasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        idn = x if self.downsample is None else self.downsample(x)
        return F.relu(out + idn)


class TorchResNetEncoder(nn.Module):
    """torchvision's resnet18 without its head: stem + 4 stages of 2 blocks."""

    def __init__(self, width: int):
        super().__init__()
        w = [width, 2 * width, 4 * width, 8 * width]
        self.conv1 = nn.Conv2d(3, w[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(w[0])
        cin = w[0]
        for i, cout in enumerate(w, start=1):
            stride = 1 if i == 1 else 2
            blocks = [
                TorchBasicBlock(cin, cout, stride),
                TorchBasicBlock(cout, cout, 1),
            ]
            setattr(self, f"layer{i}", nn.Sequential(*blocks))
            cin = cout
        self.channels = w

    def features(self, x, depth: int):
        """smp's encoder features: [stem (/2), layer1 (/4), layer2 (/8), ...]."""
        x = F.relu(self.bn1(self.conv1(x)))
        feats = [x]
        x = F.max_pool2d(x, 3, 2, 1)
        for i in range(1, depth):
            x = getattr(self, f"layer{i}")(x)
            feats.append(x)
        return feats


class TorchResNet(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.encoder = TorchResNetEncoder(s.width)
        self.fc = nn.Linear(8 * s.width, s.classes)

    def forward(self, x):
        x = self.encoder.features(x, depth=5)[-1]
        return self.fc(x.mean(dim=(2, 3)))


class TorchConvBNReLU(nn.Sequential):
    def __init__(self, cin: int, cout: int):
        super().__init__(
            nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
        )


class TorchUNet(nn.Module):
    """smp's Unet(resnet18, encoder_depth=3): the whole resnet18 encoder is
    built (and held by the optimizer), its stages 3 and 4 are never run."""

    def __init__(self, s: Shape):
        super().__init__()
        self.encoder = TorchResNetEncoder(s.width)
        w = self.encoder.channels
        ins = [w[1], *s.decoder[:-1]]
        skips = [w[0], w[0], 0]
        self.blocks = nn.ModuleList(
            nn.Sequential(TorchConvBNReLU(i + k, o), TorchConvBNReLU(o, o))
            for i, k, o in zip(ins, skips, s.decoder, strict=True)
        )
        self.head = nn.Conv2d(s.decoder[-1], s.classes, 3, 1, 1)

    def forward(self, x):
        f0, f1, f2 = self.encoder.features(x, depth=3)
        x = f2
        for block, skip in zip(self.blocks, (f1, f0, None), strict=True):
            x = F.interpolate(x, scale_factor=2, mode="nearest")
            if skip is not None:
                x = torch.cat([x, skip], dim=1)
            x = block(x)
        return self.head(x)


class TorchAttention(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.heads, self.causal = heads, causal

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class TorchBlock(nn.Module):
    """Pre-norm transformer block (GPT-2's and ViT's): 12 parameter leaves."""

    def __init__(self, d: int, heads: int, causal: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = TorchAttention(d, heads, causal)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h = F.gelu(self.fc(self.ln_2(x)), approximate="tanh")
        return x + self.fc_proj(h)


class TorchGPT(nn.Module):
    """GPT-2: token + position embeddings, 12 blocks, final norm, and the
    output projection tied to the token embedding (no parameter of its own)."""

    def __init__(self, s: Shape):
        super().__init__()
        self.wte = nn.Embedding(s.classes, s.width)
        self.wpe = nn.Embedding(s.size, s.width)
        self.h = nn.ModuleList(
            TorchBlock(s.width, s.heads, True) for _ in range(s.depth)
        )
        self.ln_f = nn.LayerNorm(s.width)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


class TorchViT(nn.Module):
    """timm's ViT: patch embedding, class token, position embedding, 12
    blocks, final norm, linear head."""

    def __init__(self, s: Shape):
        super().__init__()
        n = (s.size // s.patch) ** 2 + 1
        self.patch = nn.Conv2d(3, s.width, s.patch, s.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, s.width))
        self.pos_embed = nn.Parameter(torch.randn(1, n, s.width) * 0.02)
        self.blocks = nn.ModuleList(
            TorchBlock(s.width, s.heads, False) for _ in range(s.depth)
        )
        self.norm = nn.LayerNorm(s.width)
        self.head = nn.Linear(s.width, s.classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class TorchConvNet(nn.Module):
    """bench_step's conv net: 3 conv3x3 (strides 1, 2, 2) + BN + ReLU, mean
    pool, linear head (11 parameter leaves)."""

    def __init__(self, s: Shape):
        super().__init__()
        layers, cin = [], 3
        for stride in (1, 2, 2):
            layers += [
                nn.Conv2d(cin, s.width, 3, stride, 1, bias=False),
                nn.BatchNorm2d(s.width),
                nn.ReLU(),
            ]
            cin = s.width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(s.width, s.classes)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


TORCH_MODELS = {
    "convnet": TorchConvNet,
    "resnet": TorchResNet,
    "unet": TorchUNet,
    "gpt": TorchGPT,
    "vit": TorchViT,
}


# -------------------------------------------------------------------- NNX
def _conv(cin, cout, k, stride, rngs, bias=False):
    pad = (k - 1) // 2
    return nnx.Conv(
        cin,
        cout,
        (k, k),
        (stride, stride),
        padding=((pad, pad), (pad, pad)),
        use_bias=bias,
        rngs=rngs,
    )


def _bn(c, rngs):
    return nnx.BatchNorm(c, momentum=0.9, rngs=rngs)


class NnxBasicBlock(nnx.Module):
    def __init__(self, cin: int, cout: int, stride: int, rngs: nnx.Rngs):
        self.conv1 = _conv(cin, cout, 3, stride, rngs)
        self.bn1 = _bn(cout, rngs)
        self.conv2 = _conv(cout, cout, 3, 1, rngs)
        self.bn2 = _bn(cout, rngs)
        self.has_down = stride != 1 or cin != cout
        if self.has_down:
            self.down = _conv(cin, cout, 1, stride, rngs)
            self.down_bn = _bn(cout, rngs)

    def __call__(self, x):
        out = nnx.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        idn = self.down_bn(self.down(x)) if self.has_down else x
        return nnx.relu(out + idn)


def _max_pool(x):
    return jax.lax.reduce_window(
        x,
        -jnp.inf,
        jax.lax.max,
        (1, 3, 3, 1),
        (1, 2, 2, 1),
        ((0, 0), (1, 1), (1, 1), (0, 0)),
    )


class NnxResNetEncoder(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        w = [width, 2 * width, 4 * width, 8 * width]
        self.conv1 = _conv(3, w[0], 7, 2, rngs)
        self.bn1 = _bn(w[0], rngs)
        cin, layers = w[0], []
        for i, cout in enumerate(w, start=1):
            stride = 1 if i == 1 else 2
            layers.append(
                nnx.List(
                    [
                        NnxBasicBlock(cin, cout, stride, rngs),
                        NnxBasicBlock(cout, cout, 1, rngs),
                    ]
                )
            )
            cin = cout
        self.layers = nnx.List(layers)
        self.channels = w

    def features(self, x, depth: int):
        x = nnx.relu(self.bn1(self.conv1(x)))
        feats = [x]
        x = _max_pool(x)
        for layer in self.layers[: depth - 1]:
            for block in layer:
                x = block(x)
            feats.append(x)
        return feats


class NnxResNet(nnx.Module):
    def __init__(self, s: Shape, rngs: nnx.Rngs):
        self.encoder = NnxResNetEncoder(s.width, rngs)
        self.fc = nnx.Linear(8 * s.width, s.classes, rngs=rngs)

    def __call__(self, x):
        return self.fc(self.encoder.features(x, depth=5)[-1].mean(axis=(1, 2)))


class NnxConvBNReLU(nnx.Module):
    def __init__(self, cin: int, cout: int, rngs: nnx.Rngs):
        self.conv = _conv(cin, cout, 3, 1, rngs)
        self.bn = _bn(cout, rngs)

    def __call__(self, x):
        return nnx.relu(self.bn(self.conv(x)))


class NnxUNet(nnx.Module):
    def __init__(self, s: Shape, rngs: nnx.Rngs):
        self.encoder = NnxResNetEncoder(s.width, rngs)
        w = self.encoder.channels
        ins = [w[1], *s.decoder[:-1]]
        skips = [w[0], w[0], 0]
        self.blocks = nnx.List(
            [
                nnx.List([NnxConvBNReLU(i + k, o, rngs), NnxConvBNReLU(o, o, rngs)])
                for i, k, o in zip(ins, skips, s.decoder, strict=True)
            ]
        )
        self.head = _conv(s.decoder[-1], s.classes, 3, 1, rngs, bias=True)

    def __call__(self, x):
        f0, f1, f2 = self.encoder.features(x, depth=3)
        x = f2
        for block, skip in zip(self.blocks, (f1, f0, None), strict=True):
            x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
            if skip is not None:
                x = jnp.concatenate([x, skip], axis=-1)
            for layer in block:
                x = layer(x)
        return self.head(x)


class NnxAttention(nnx.Module):
    def __init__(self, d: int, heads: int, causal: bool, rngs: nnx.Rngs):
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.heads, self.causal = heads, causal

    def __call__(self, x):
        b, t, d = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        out = jax.nn.dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(out.reshape(b, t, d))


class NnxBlock(nnx.Module):
    def __init__(self, d: int, heads: int, causal: bool, rngs: nnx.Rngs):
        self.ln_1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = NnxAttention(d, heads, causal, rngs)
        self.ln_2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc = nnx.Linear(d, 4 * d, rngs=rngs)
        self.fc_proj = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.fc_proj(nnx.gelu(self.fc(self.ln_2(x)), approximate=True))


class NnxGPT(nnx.Module):
    def __init__(self, s: Shape, rngs: nnx.Rngs):
        self.wte = nnx.Embed(s.classes, s.width, rngs=rngs)
        self.wpe = nnx.Embed(s.size, s.width, rngs=rngs)
        self.h = nnx.List(
            [NnxBlock(s.width, s.heads, True, rngs) for _ in range(s.depth)]
        )
        self.ln_f = nnx.LayerNorm(s.width, rngs=rngs)

    def __call__(self, tokens):
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
        for block in self.h:
            x = block(x)
        return self.wte.attend(self.ln_f(x))


class NnxViT(nnx.Module):
    def __init__(self, s: Shape, rngs: nnx.Rngs):
        n = (s.size // s.patch) ** 2 + 1
        self.patch = nnx.Conv(
            3,
            s.width,
            (s.patch, s.patch),
            (s.patch, s.patch),
            padding="VALID",
            rngs=rngs,
        )
        self.cls_token = nnx.Param(jnp.zeros((1, 1, s.width)))
        self.pos_embed = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (1, n, s.width))
        )
        self.blocks = nnx.List(
            [NnxBlock(s.width, s.heads, False, rngs) for _ in range(s.depth)]
        )
        self.norm = nnx.LayerNorm(s.width, rngs=rngs)
        self.head = nnx.Linear(s.width, s.classes, rngs=rngs)

    def __call__(self, x):
        x = self.patch(x)
        b = x.shape[0]
        x = x.reshape(b, -1, x.shape[-1])
        cls = jnp.broadcast_to(self.cls_token[...], (b, 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.pos_embed[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class NnxConvNet(nnx.Module):
    def __init__(self, s: Shape, rngs: nnx.Rngs):
        self.layers = nnx.List(
            [
                nnx.List([_conv(cin, s.width, 3, stride, rngs), _bn(s.width, rngs)])
                for cin, stride in ((3, 1), (s.width, 2), (s.width, 2))
            ]
        )
        self.head = nnx.Linear(s.width, s.classes, rngs=rngs)

    def __call__(self, x):
        for conv, bn in self.layers:
            x = nnx.relu(bn(conv(x)))
        return self.head(x.mean(axis=(1, 2)))


NNX_MODELS = {
    "convnet": NnxConvNet,
    "resnet": NnxResNet,
    "unet": NnxUNet,
    "gpt": NnxGPT,
    "vit": NnxViT,
}
