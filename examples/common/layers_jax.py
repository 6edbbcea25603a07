"""Flax NNX layers the tasks share, each the twin of one in `layers_torch`.

`BatchNorm` is ``torch.nn.BatchNorm2d``'s semantics in NNX (unbiased running
variance, float32 maths), so a converted model keeps the torch model's
running statistics step after step; `ConvBN` / `Stage` are the conv-BN-ReLU
blocks of the OCR and detection backbones; :func:`split` / :func:`apply` are
the functional use of any model with batch statistics (a pure ``jax.jit``
train step)::

    graphdef, params, batch_stats = split(model)
    outputs, batch_stats = apply(graphdef, params, batch_stats, x, train=True)
"""

from __future__ import annotations

from typing import Any

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


class ConvBN(nnx.Module):
    """3x3 conv (no bias, stride 1 or 2, padding 1) -> BatchNorm -> ReLU, NHWC.

    Example:
        >>> block = ConvBN(3, 8, stride=2, rngs=nnx.Rngs(0))
        >>> block(jnp.ones((1, 8, 8, 3)), train=False).shape
        (1, 4, 4, 8)
    """

    def __init__(
        self,
        cin: int,
        cout: int,
        *,
        stride: int = 1,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.conv = nnx.Conv(
            cin,
            cout,
            kernel_size=(3, 3),
            strides=(stride, stride),
            padding=((1, 1), (1, 1)),  # torch's padding=1, also at stride 2
            use_bias=False,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.bn = BatchNorm(cout, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        return nnx.relu(self.bn(self.conv(x), train=train))


class Stage(nnx.Module):
    """A stride-2 ConvBN (``down``) then a stride-1 ConvBN (``conv``)."""

    def __init__(self, cin: int, cout: int, **kw):
        self.down = ConvBN(cin, cout, stride=2, **kw)
        self.conv = ConvBN(cout, cout, **kw)

    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        return self.conv(self.down(x, train=train), train=train)


def upsample(x: jax.Array, factor: int) -> jax.Array:
    """Nearest-neighbour upsampling by an integer factor (NHWC).

    Example:
        >>> y = upsample(jnp.arange(4.0).reshape(1, 2, 2, 1), 2)[0, :, :, 0]
        >>> y[0].tolist(), y[3].tolist()
        ([0.0, 0.0, 1.0, 1.0], [2.0, 2.0, 3.0, 3.0])
    """
    if factor == 1:
        return x
    return jnp.repeat(jnp.repeat(x, factor, axis=1), factor, axis=2)


def split(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """``nnx.split(model, nnx.Param, nnx.BatchStat)``: the pure pieces of a model.

    Returns:
      ``(graphdef, params, batch_stats)``: the static structure, the trainable
      parameters and the batch-norm running statistics, as pytrees that go
      through ``jax.jit`` / ``jax.grad`` / optax.

    Example:
        >>> model = nnx.eval_shape(lambda: ConvBN(3, 4, rngs=nnx.Rngs(0)))
        >>> graphdef, params, batch_stats = split(model)
        >>> sorted(batch_stats["bn"]), sorted(params["bn"])
        (['mean', 'var'], ['bias', 'scale'])
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
) -> tuple[Any, nnx.State]:
    """Pure forward pass: ``(outputs, new_batch_stats)``; jit- and grad-friendly.

    With ``train=True`` the batch statistics are used and the returned
    running statistics are updated (as torch's ``model.train()`` forward does);
    with ``train=False`` they are returned unchanged.

    Args:
      graphdef, params, batch_stats: from :func:`split`.
      x: images (N, H, W, C).
      train: training-mode batch norm.

    Returns:
      ``(outputs, batch_stats)``: what the model returns (logits, or a dict
      of maps) and its running statistics.

    Example:
        >>> graphdef, params, stats = split(ConvBN(3, 4, rngs=nnx.Rngs(0)))
        >>> x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
        >>> f = jax.jit(apply, static_argnames="train")
        >>> y, new_stats = f(graphdef, params, stats, x, train=True)
        >>> y.shape, bool(jnp.any(new_stats["bn"]["mean"][...] != 0))
        ((2, 8, 8, 4), True)
    """
    # copy=True: under jit(grad(...)) the Variables inside `batch_stats` belong
    # to the outer trace, and NNX refuses to let BatchNorm write to a Variable
    # of another trace level; fresh copies also keep the caller's state intact.
    model = nnx.merge(graphdef, params, batch_stats, copy=True)
    out = model(x, train=train)
    return out, nnx.state(model, nnx.BatchStat)
