"""A small U-Net in Flax NNX (NHWC), the twin of `model_torch.UNet` (NCHW).

Architecture, for ``depth`` D and ``width`` w (channels ``w * 2**i`` at level i)::

    x -> [DoubleConv(w)] -> pool -> [DoubleConv(2w)] -> pool ... -> bottleneck
    bottleneck -> ConvTranspose 2x2/2 -> concat(skip, up) -> DoubleConv -> ...
    -> 1x1 conv -> logits (N, H, W, num_classes)

``DoubleConv`` = (3x3 conv without bias -> BatchNorm -> ReLU) twice. Upsampling
is a 2x2 transposed convolution with stride 2 (the original U-Net's "up-conv"):
its windows do not overlap, so every output pixel is one small dot product and
both frameworks compute it the same way. The skip connection is concatenated
*before* the upsampled features on the channel axis in both frameworks.

Parameters and batch statistics are stored in ``param_dtype`` (float32);
convolutions compute in ``dtype`` (e.g. bfloat16 / float16); batch norm always
normalises in float32 and returns ``dtype``, as ``flax.nnx.BatchNorm`` does.

Batch norm follows ``torch.nn.BatchNorm2d`` exactly
(`examples.common.layers_jax.BatchNorm`), including its *unbiased* running
variance, so that a converted model keeps the same running statistics as the
torch one step after step.

Functional use (for a pure ``jax.jit`` train step)::

    # split(model) is nnx.split(model, nnx.Param, nnx.BatchStat)
    # (`examples.common.layers_jax.split` / `apply`)
    graphdef, params, batch_stats = split(model)
    logits, batch_stats = apply(graphdef, params, batch_stats, x, train=True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from examples.common.layers_jax import BatchNorm, Dtype, apply, split

__all__ = ["BatchNorm", "DoubleConv", "Dtype", "UNet", "apply", "split"]


class DoubleConv(nnx.Module):
    """(3x3 conv, no bias -> BatchNorm -> ReLU) x 2, NHWC.

    Example:
        >>> block = DoubleConv(3, 8, rngs=nnx.Rngs(0))
        >>> block(jnp.ones((1, 8, 8, 3)), train=False).shape
        (1, 8, 8, 8)
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        *,
        dtype: Dtype = None,
        param_dtype: Dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        def conv(cin):
            return nnx.Conv(
                cin,
                out_channels,
                kernel_size=(3, 3),
                padding=((1, 1), (1, 1)),
                use_bias=False,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )

        def bn():
            return BatchNorm(out_channels, dtype=dtype, param_dtype=param_dtype)

        self.conv1, self.bn1 = conv(in_channels), bn()
        self.conv2, self.bn2 = conv(out_channels), bn()

    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        x = nnx.relu(self.bn1(self.conv1(x), train=train))
        return nnx.relu(self.bn2(self.conv2(x), train=train))


class UNet(nnx.Module):
    """Small U-Net: NHWC images -> NHWC logits, twin of ``model_torch.UNet``.

    Args:
      in_channels: image channels (3).
      num_classes: output channels (logits per class).
      width: channels of the first level; level i has ``width * 2**i``.
      depth: number of 2x down/upsamplings (height and width must be
        divisible by ``2**depth``).
      dtype: compute dtype of the convolutions (None: the input's).
      param_dtype: storage dtype of parameters and batch statistics.
      rngs: ``nnx.Rngs`` for initialisation.

    Call: ``model(x, train=...)`` with x (N, H, W, in_channels); returns
    logits (N, H, W, num_classes) in ``dtype``. ``train=True`` uses and updates
    batch statistics (torch's ``model.train()``), ``train=False`` uses the
    running ones (``model.eval()``).

    Example (shapes only: ``nnx.eval_shape`` traces it, computing nothing):
        >>> model = lambda: UNet(num_classes=6, width=8, depth=2, rngs=nnx.Rngs(0))
        >>> x = jnp.zeros((2, 32, 32, 3))
        >>> nnx.eval_shape(lambda: model()(x, train=False)).shape
        (2, 32, 32, 6)
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 6,
        width: int = 16,
        depth: int = 2,
        *,
        dtype: Dtype = None,
        param_dtype: Dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if min(in_channels, num_classes, width, depth) < 1:
            raise ValueError(
                "in_channels, num_classes, width and depth must be >= 1, got "
                f"{in_channels}, {num_classes}, {width}, {depth}"
            )
        self.depth = depth
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        chans = [width * 2**i for i in range(depth + 1)]
        self.encoders = nnx.List(
            [
                DoubleConv(c_in, c, **kw)
                for c_in, c in zip([in_channels, *chans[:-2]], chans[:-1], strict=True)
            ]
        )
        self.bottleneck = DoubleConv(chans[-2], chans[-1], **kw)
        self.upsamples = nnx.List(
            [
                nnx.ConvTranspose(
                    chans[i + 1],
                    chans[i],
                    kernel_size=(2, 2),
                    strides=(2, 2),
                    padding="VALID",
                    **kw,
                )
                for i in reversed(range(depth))
            ]
        )
        self.decoders = nnx.List(
            [DoubleConv(2 * chans[i], chans[i], **kw) for i in reversed(range(depth))]
        )
        self.head = nnx.Conv(chans[0], num_classes, kernel_size=(1, 1), **kw)

    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        multiple = 2**self.depth
        if x.ndim != 4 or x.shape[1] % multiple or x.shape[2] % multiple:
            raise ValueError(
                f"expected NHWC input with H and W divisible by 2**depth={multiple}, "
                f"got shape {x.shape}"
            )
        skips = []
        for enc in self.encoders:
            x = enc(x, train=train)
            skips.append(x)
            x = nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = self.bottleneck(x, train=train)
        for up, dec, skip in zip(
            self.upsamples, self.decoders, skips[::-1], strict=True
        ):
            x = jnp.concatenate([skip, up(x).astype(skip.dtype)], axis=-1)
            x = dec(x, train=train)
        return self.head(x)
