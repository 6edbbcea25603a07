"""A small CLIP-style dual encoder in Flax NNX (NHWC), twin of `model_torch.CLIP`.

Same architecture and submodule names as `model_torch` (see its docstring).
The image tower's feature map is flattened in torch's (C, H, W) order, so
the converted projection reads the same features. Parameters are stored in
``param_dtype``; layers compute in the dtype of what they are given (the
train steps cast the parameters).

Functional use (for a pure ``jax.jit`` train step)::

    graphdef, params = split(model)
    img, txt, log_scale = apply(graphdef, params, images, tokens, safe=True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from examples.contrastive.model_torch import LOGIT_SCALE_INIT

__all__ = ["CLIP", "apply", "masked_mean", "split"]


def masked_mean(x: jax.Array, mask: jax.Array, *, safe: bool) -> jax.Array:
    """Mean of ``x`` (B, L, D) over the positions where ``mask`` (B, L) is 1.

    ``safe``: divide by ``max(count, 1)`` (an empty caption gives 0), else by
    the count (``0 / 0 = nan`` for an empty caption).

    Example:
        >>> x = jnp.ones((2, 3, 1)); m = jnp.array([[1.0, 1, 0], [0, 0, 0]])
        >>> masked_mean(x, m, safe=True)[:, 0].tolist()
        [1.0, 0.0]
        >>> bool(jnp.isnan(masked_mean(x, m, safe=False)[1, 0]))
        True
    """
    mask = mask.astype(x.dtype)
    total = jnp.sum(x * mask[..., None], axis=1)
    count = jnp.sum(mask, axis=1, keepdims=True)
    return total / (jnp.maximum(count, 1) if safe else count)


class ImageTower(nnx.Module):
    def __init__(self, width: int, image_size: int, embed_dim: int, *, rngs, **kw):
        def conv(cin, cout):
            return nnx.Conv(
                cin, cout, kernel_size=(3, 3), strides=(2, 2),
                padding=((1, 1), (1, 1)), rngs=rngs, **kw,
            )  # fmt: skip

        self.conv1 = conv(3, width)
        self.conv2 = conv(width, 2 * width)
        self.conv3 = conv(2 * width, 4 * width)
        side = image_size // 8
        self.proj = nnx.Linear(4 * width * side * side, embed_dim, rngs=rngs, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        for conv in (self.conv1, self.conv2, self.conv3):
            x = nnx.relu(conv(x))
        x = jnp.transpose(x, (0, 3, 1, 2)).reshape(x.shape[0], -1)  # torch's order
        return self.proj(x)


class TextTower(nnx.Module):
    def __init__(self, vocab_size: int, token_dim: int, embed_dim: int, *, rngs, **kw):
        self.embed = nnx.Embed(vocab_size, token_dim, rngs=rngs, **kw)
        self.proj = nnx.Linear(token_dim, embed_dim, rngs=rngs, **kw)

    def __call__(self, tokens: jax.Array, *, safe: bool) -> jax.Array:
        pooled = masked_mean(self.embed(tokens), tokens != 0, safe=safe)
        return self.proj(pooled)


class CLIP(nnx.Module):
    """The dual encoder: ``model(images, tokens, safe=...) -> (img, txt)``.

    Example (shapes only: ``nnx.eval_shape`` traces it, computing nothing):
        >>> m = lambda: CLIP(width=4, image_size=16, vocab_size=19, rngs=nnx.Rngs(0))
        >>> x, tokens = jnp.zeros((2, 16, 16, 3)), jnp.array([[1, 5], [0, 0]])
        >>> img, txt = nnx.eval_shape(lambda: m()(x, tokens))
        >>> img.shape, txt.shape
        ((2, 32), (2, 32))
    """

    def __init__(
        self,
        *,
        width: int,
        image_size: int,
        vocab_size: int,
        embed_dim: int = 32,
        token_dim: int = 32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        kw = dict(param_dtype=param_dtype)
        self.image = ImageTower(width, image_size, embed_dim, rngs=rngs, **kw)
        self.text = TextTower(vocab_size, token_dim, embed_dim, rngs=rngs, **kw)
        self.logit_scale = nnx.Param(jnp.asarray(LOGIT_SCALE_INIT, param_dtype))

    def __call__(self, images, tokens, *, safe: bool = True):
        return self.image(images), self.text(tokens, safe=safe)


def split(model: CLIP) -> tuple[nnx.GraphDef, nnx.State]:
    """``nnx.split(model, nnx.Param)``: graphdef and params (no other state).

    Example:
        >>> clip = lambda: CLIP(width=4, image_size=16, vocab_size=19, rngs=nnx.Rngs(0))
        >>> g, p = split(nnx.eval_shape(clip))  # abstract: nothing initialised
        >>> sorted(p)
        ['image', 'logit_scale', 'text']
    """
    return nnx.split(model, nnx.Param)


def apply(graphdef, params, images, tokens, *, safe: bool):
    """Pure forward pass ``(img, txt, logit_scale)``; jit- and grad-friendly.

    Example (shapes only: ``jax.eval_shape`` traces it, computing nothing):
        >>> clip = lambda: CLIP(width=4, image_size=16, vocab_size=19, rngs=nnx.Rngs(0))
        >>> g, p = split(nnx.eval_shape(clip))
        >>> f = lambda p, x, t: apply(g, p, x, t, safe=True)
        >>> x, tokens = jnp.zeros((1, 16, 16, 3)), jnp.ones((1, 3), int)
        >>> img, txt, s = jax.eval_shape(f, p, x, tokens)
        >>> img.shape, s.shape
        ((1, 32), ())
    """
    model = nnx.merge(graphdef, params, copy=True)
    img, txt = model(images, tokens, safe=safe)
    return img, txt, model.logit_scale[...]
