"""A small DBNet in Flax NNX (NHWC), the twin of `model_torch.DBNet` (NCHW).

Same architecture and submodule names as `model_torch` (see its docstring):
a conv backbone (stem + three stride-2 stages with batch norm), an FPN neck
fused at H/2, and probability / threshold heads upsampled to the input size
by a 2x2 stride-2 transposed convolution. The probability head returns
logits; the threshold head ends in a sigmoid; in train mode the model also
returns ``db_step(P, T, k)`` (float32, `jaxstable.losses.db_step`).

The conv-BN blocks and the batch norm are `examples.common.layers_jax`'s
(`BatchNorm`: torch's semantics, unbiased running variance, float32 maths),
so a converted model keeps the torch model's running statistics step after
step. Parameters are stored in
``param_dtype``; convolutions compute in ``dtype``.

Functional use (for a pure ``jax.jit`` train step)::

    graphdef, params, batch_stats = split(model)
    outputs, batch_stats = apply(graphdef, params, batch_stats, x, train=True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from examples.common.layers_jax import (
    ConvBN,
    Dtype,
    Stage,
    apply,
    split,
    upsample,
)
from jaxstable import losses

__all__ = ["DBNet", "apply", "split"]


class Backbone(nnx.Module):
    """stem (H) and three stride-2 stages (H/2, H/4, H/8); returns the stages."""

    def __init__(self, in_channels: int, width: int, **kw):
        self.stem = ConvBN(in_channels, width, **kw)
        self.stage1 = Stage(width, width, **kw)
        self.stage2 = Stage(width, 2 * width, **kw)
        self.stage3 = Stage(2 * width, 4 * width, **kw)

    def __call__(self, x: jax.Array, *, train: bool) -> list[jax.Array]:
        c1 = self.stage1(self.stem(x, train=train), train=train)
        c2 = self.stage2(c1, train=train)
        return [c1, c2, self.stage3(c2, train=train)]


class Neck(nnx.Module):
    """FPN: laterals, top-down sum, smoothing, all levels at H/2, concatenated."""

    def __init__(self, width: int, **kw):
        inner, out = 2 * width, width

        def conv(cin, cout, size):
            pad = (size - 1) // 2
            return nnx.Conv(
                cin, cout, kernel_size=(size, size), padding=((pad, pad),) * 2, **kw
            )

        self.lateral1 = conv(width, inner, 1)
        self.lateral2 = conv(2 * width, inner, 1)
        self.lateral3 = conv(4 * width, inner, 1)
        self.smooth1 = conv(inner, out, 3)
        self.smooth2 = conv(inner, out, 3)
        self.smooth3 = conv(inner, out, 3)

    def __call__(self, feats: list[jax.Array]) -> jax.Array:
        c1, c2, c3 = feats
        p3 = self.lateral3(c3)
        p2 = self.lateral2(c2) + upsample(p3, 2)
        p1 = self.lateral1(c1) + upsample(p2, 2)
        return jnp.concatenate(
            [
                self.smooth1(p1),
                upsample(self.smooth2(p2), 2),
                upsample(self.smooth3(p3), 4),
            ],
            axis=-1,
        )


class Head(nnx.Module):
    """3x3 conv-BN-ReLU then a 2x2 stride-2 transposed conv to one map at H."""

    def __init__(
        self,
        cin: int,
        width: int,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.conv = ConvBN(cin, width, **kw)
        self.up = nnx.ConvTranspose(
            width, 1, kernel_size=(2, 2), strides=(2, 2), padding="VALID", **kw
        )

    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        return self.up(self.conv(x, train=train))[..., 0]


class DBNet(nnx.Module):
    """Small DBNet: NHWC images -> shrink logits, threshold map (and binary map).

    Args:
      in_channels: image channels (3).
      width: channels of the first backbone level (levels have w, 2w, 4w).
      k: amplification of the approximate binary map ``db_step(P, T, k)``.
      dtype: compute dtype of the convolutions (None: the input's).
      param_dtype: storage dtype of parameters and batch statistics.
      rngs: ``nnx.Rngs`` for initialisation.

    ``model(x, train=...)`` with x (N, H, W, C), H and W divisible by 8,
    returns a dict of (N, H, W) maps: ``logits`` (shrink-map logits),
    ``thresh`` (in (0, 1)) and, with ``train=True``, ``binary`` (float32).

    Example (shapes only: ``nnx.eval_shape`` traces it, computing nothing):
        >>> model = lambda: DBNet(width=8, rngs=nnx.Rngs(0))
        >>> out = nnx.eval_shape(lambda: model()(jnp.zeros((2, 32, 32, 3)), train=True))
        >>> sorted(out), out["binary"].shape, out["binary"].dtype
        (['binary', 'logits', 'thresh'], (2, 32, 32), dtype('float32'))
    """

    def __init__(
        self,
        in_channels: int = 3,
        width: int = 8,
        k: float = 50.0,
        *,
        dtype: Dtype = None,
        param_dtype: Dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if min(in_channels, width) < 1 or not k > 0:
            raise ValueError(
                f"need in_channels >= 1, width >= 1 and k > 0, got {in_channels}, "
                f"{width}, {k}"
            )
        self.k = k
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.backbone = Backbone(in_channels, width, **kw)
        self.neck = Neck(width, **kw)
        self.prob_head = Head(3 * width, width, **kw)
        self.thresh_head = Head(3 * width, width, **kw)

    def __call__(self, x: jax.Array, *, train: bool) -> dict[str, jax.Array]:
        if x.ndim != 4 or x.shape[1] % 8 or x.shape[2] % 8:
            raise ValueError(
                "expected NHWC input with H and W divisible by 8 (three stride-2 "
                f"stages), got shape {x.shape}"
            )
        fused = self.neck(self.backbone(x, train=train))
        logits = self.prob_head(fused, train=train)
        thresh = nnx.sigmoid(self.thresh_head(fused, train=train))
        out = {"logits": logits, "thresh": thresh}
        if train:
            out["binary"] = losses.db_step(nnx.sigmoid(logits), thresh, k=self.k)
        return out
