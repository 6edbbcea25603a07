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

Batch norm follows ``torch.nn.BatchNorm2d`` exactly (see :class:`BatchNorm`),
including its *unbiased* running variance, so that a converted model keeps
the same running statistics as the torch one step after step.

Functional use (for a pure ``jax.jit`` train step)::

    # split(model) is nnx.split(model, nnx.Param, nnx.BatchStat)
    graphdef, params, batch_stats = split(model)
    logits, batch_stats = apply(graphdef, params, batch_stats, x, train=True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

Dtype = jnp.dtype | type | str | None


class BatchNorm(nnx.Module):
    """Batch normalisation over N, H, W with ``torch.nn.BatchNorm2d``'s semantics.

    Train mode normalises with the batch statistics (biased variance) and
    updates the running ones; eval mode normalises with the running ones::

        y = (x - mean) / sqrt(var + epsilon) * scale + bias          (float32)
        running_mean <- momentum * running_mean + (1 - momentum) * mean
        running_var  <- momentum * running_var  + (1 - momentum) * var * n / (n - 1)

    with n = N * H * W elements per channel. ``momentum`` uses flax's
    convention (weight of the old value): flax's 0.9 is torch's 0.1.

    Why not ``nnx.BatchNorm``: it updates the running variance with the
    *biased* batch variance (var), torch with the *unbiased* one
    (var * n / (n - 1)). Once the averages settle, the two running variances
    differ by the factor n / (n - 1): 3e-5 relative at n = 8 * 64 * 64, 4.9e-4
    at the bottleneck of depth 2 (n = 8 * 16 * 16), both above float32 parity
    tolerance (rtol 2e-5), so eval-mode logits of the two frameworks would
    drift apart after training.
    ``unbiased_running_var=False`` gives flax's behaviour.

    Args:
      num_features: number of channels (last axis).
      momentum: weight of the old running statistics (torch's 1 - momentum).
      epsilon: added to the variance (torch's ``eps``, 1e-5 by default).
      unbiased_running_var: update the running variance with n / (n - 1).
      dtype: output dtype (None: the input's); the maths is float32.
      param_dtype: dtype of scale, bias and the running statistics.

    Example:
        >>> bn = BatchNorm(3)
        >>> x = jnp.arange(24.0).reshape(2, 2, 2, 3)
        >>> y = bn(x, train=True)
        >>> y.shape, [round(float(m), 2) for m in bn.mean[...]]
        ((2, 2, 2, 3), [1.05, 1.15, 1.25])
    """

    def __init__(
        self,
        num_features: int,
        *,
        momentum: float = 0.9,
        epsilon: float = 1e-5,
        unbiased_running_var: bool = True,
        dtype: Dtype = None,
        param_dtype: Dtype = jnp.float32,
    ):
        self.num_features = num_features
        self.momentum = momentum
        self.epsilon = epsilon
        self.unbiased_running_var = unbiased_running_var
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones((num_features,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((num_features,), param_dtype))
        self.mean = nnx.BatchStat(jnp.zeros((num_features,), param_dtype))
        self.var = nnx.BatchStat(jnp.ones((num_features,), param_dtype))

    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        if x.shape[-1] != self.num_features:
            raise ValueError(
                f"BatchNorm({self.num_features}) got {x.shape[-1]} channels "
                f"(input shape {x.shape}, channels last)"
            )
        f32 = jnp.float32
        xf = x.astype(f32)
        axes = tuple(range(x.ndim - 1))
        if train:
            mean = xf.mean(axes)
            # two-pass variance, clamped: no cancellation for large means
            var = jnp.square(xf - mean).mean(axes)
            n = xf.size // self.num_features
            unbiased = var * (n / max(n - 1, 1)) if self.unbiased_running_var else var
            m = self.momentum
            stat_dtype = self.mean[...].dtype
            self.mean[...] = jax.lax.stop_gradient(
                m * self.mean[...].astype(f32) + (1 - m) * mean
            ).astype(stat_dtype)
            self.var[...] = jax.lax.stop_gradient(
                m * self.var[...].astype(f32) + (1 - m) * unbiased
            ).astype(stat_dtype)
        else:
            mean, var = self.mean[...].astype(f32), self.var[...].astype(f32)
        mul = self.scale[...].astype(f32) * jax.lax.rsqrt(var + self.epsilon)
        y = (xf - mean) * mul + self.bias[...].astype(f32)
        return y.astype(self.dtype or x.dtype)


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

    Example:
        >>> model = UNet(num_classes=6, width=8, depth=2, rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((2, 32, 32, 3)), train=False).shape
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


def split(model: UNet) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """``nnx.split(model, nnx.Param, nnx.BatchStat)``: the pure pieces of a model.

    Returns:
      ``(graphdef, params, batch_stats)``: the static structure, the trainable
      parameters and the batch-norm running statistics, as pytrees that go
      through ``jax.jit`` / ``jax.grad`` / optax.

    Example:
        >>> graphdef, params, batch_stats = split(UNet(width=4, rngs=nnx.Rngs(0)))
        >>> sorted(batch_stats["bottleneck"]["bn1"])
        ['mean', 'var']
    """
    graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    return graphdef, params, batch_stats


def apply(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    batch_stats: nnx.State,
    x: jax.Array,
    *,
    train: bool,
) -> tuple[jax.Array, nnx.State]:
    """Pure forward pass: ``(logits, new_batch_stats)``; jit- and grad-friendly.

    With ``train=True`` the batch statistics are used and the returned
    running statistics are updated (as torch's ``model.train()`` forward does);
    with ``train=False`` they are returned unchanged.

    Args:
      graphdef, params, batch_stats: from :func:`split`.
      x: images (N, H, W, C).
      train: training-mode batch norm.

    Returns:
      ``(logits (N, H, W, num_classes), batch_stats)``.

    Example:
        >>> graphdef, params, stats = split(UNet(width=4, rngs=nnx.Rngs(0)))
        >>> f = jax.jit(apply, static_argnames="train")
        >>> x = jax.random.normal(jax.random.key(0), (2, 16, 16, 3))
        >>> logits, new_stats = f(graphdef, params, stats, x, train=True)
        >>> old = stats["encoders"][0]["bn1"]["mean"][...]
        >>> new = new_stats["encoders"][0]["bn1"]["mean"][...]
        >>> logits.shape, bool(jnp.any(old != new))
        ((2, 16, 16, 6), True)
    """
    # copy=True: under jit(grad(...)) the Variables inside `batch_stats` belong
    # to the outer trace, and NNX refuses to let BatchNorm write to a Variable
    # of another trace level; fresh copies also keep the caller's state intact.
    model = nnx.merge(graphdef, params, batch_stats, copy=True)
    logits = model(x, train=train)
    return logits, nnx.state(model, nnx.BatchStat)
