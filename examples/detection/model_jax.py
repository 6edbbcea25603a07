"""A small anchor-free detector in Flax NNX (NHWC), twin of `model_torch.Detector`.

Same architecture and submodule names as `model_torch` (see its docstring):
the conv-BN stages of `examples.common.layers_jax` (`ConvBN` / `Stage`,
with its `BatchNorm`: torch's semantics), a two-scale neck at stride 4
and a head of class logits and raw box distances. Parameters are stored in
``param_dtype``; convolutions compute in ``dtype``.

Functional use (for a pure ``jax.jit`` train step)::

    graphdef, params, batch_stats = split(model)
    outputs, batch_stats = apply(graphdef, params, batch_stats, x, train=True)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from examples.common.layers_jax import ConvBN, Dtype, Stage, apply, split, upsample

__all__ = ["Detector", "apply", "cell_centers", "decode", "split"]

STRIDE = 4
PRIOR = 0.01


class Detector(nnx.Module):
    """Small anchor-free detector: NHWC images -> class logits, raw box distances.

    Args:
      in_channels: image channels (3).
      num_classes: object classes.
      width: channels of the first level (levels have w, 2w, 4w).
      dtype: compute dtype of the convolutions (None: the input's).
      param_dtype: storage dtype of parameters and batch statistics.
      rngs: ``nnx.Rngs`` for initialisation.

    ``model(x, train=...)`` with x (N, H, W, C), H and W divisible by 8,
    returns ``{"cls": (N, H/4, W/4, num_classes), "box": (N, H/4, W/4, 4)}``.

    Example (shapes only: ``nnx.eval_shape`` traces it, computing nothing):
        >>> model = lambda: Detector(num_classes=3, width=4, rngs=nnx.Rngs(0))
        >>> x = jnp.zeros((2, 32, 32, 3))
        >>> out = nnx.eval_shape(lambda: model()(x, train=False))
        >>> out["cls"].shape, out["box"].shape
        ((2, 8, 8, 3), (2, 8, 8, 4))
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 3,
        width: int = 8,
        *,
        dtype: Dtype = None,
        param_dtype: Dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if min(in_channels, num_classes, width) < 1:
            raise ValueError(
                "need in_channels, num_classes and width >= 1, got "
                f"{in_channels}, {num_classes}, {width}"
            )
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.stem = ConvBN(in_channels, width, **kw)
        self.stage1 = Stage(width, width, **kw)
        self.stage2 = Stage(width, 2 * width, **kw)
        self.stage3 = Stage(2 * width, 4 * width, **kw)
        self.lateral2 = nnx.Conv(2 * width, 2 * width, kernel_size=(1, 1), **kw)
        self.lateral3 = nnx.Conv(4 * width, 2 * width, kernel_size=(1, 1), **kw)
        self.head = ConvBN(2 * width, 2 * width, **kw)
        prior = nnx.initializers.constant(-math.log((1 - PRIOR) / PRIOR))
        self.cls = nnx.Conv(
            2 * width, num_classes, kernel_size=(1, 1), bias_init=prior, **kw
        )
        self.box = nnx.Conv(2 * width, 4, kernel_size=(1, 1), **kw)

    def __call__(self, x: jax.Array, *, train: bool) -> dict[str, jax.Array]:
        if x.ndim != 4 or x.shape[1] % 8 or x.shape[2] % 8:
            raise ValueError(
                "expected NHWC input with H and W divisible by 8 (three stride-2 "
                f"stages), got shape {x.shape}"
            )
        c2 = self.stage2(
            self.stage1(self.stem(x, train=train), train=train), train=train
        )
        c3 = self.stage3(c2, train=train)
        p = self.lateral2(c2) + upsample(self.lateral3(c3), 2)
        h = self.head(p, train=train)
        return {"cls": self.cls(h), "box": self.box(h)}


def cell_centers(grid: int) -> jax.Array:
    """(grid * grid, 2) pixel centres (x, y) of the cells, row-major.

    Example:
        >>> cell_centers(2).tolist()
        [[2.0, 2.0], [6.0, 2.0], [2.0, 6.0], [6.0, 6.0]]
    """
    idx = jnp.arange(grid, dtype=jnp.float32)
    ys, xs = jnp.meshgrid(idx, idx, indexing="ij")
    return (jnp.stack([xs.reshape(-1), ys.reshape(-1)], 1) + 0.5) * STRIDE


def decode(raw: jax.Array, centers: jax.Array) -> jax.Array:
    """Boxes ``(x1, y1, x2, y2)`` from raw distances ``(..., 4)`` at cell centres.

    ``exp(raw) * STRIDE`` pixels to the left, top, right and bottom edges,
    computed in the dtype of `raw`.

    Example:
        >>> decode(jnp.zeros((1, 4)), jnp.array([[2.0, 2.0]])).tolist()
        [[-2.0, -2.0, 6.0, 6.0]]
    """
    d = jnp.exp(raw) * STRIDE
    c = centers.astype(raw.dtype)
    return jnp.concatenate([c - d[..., :2], c + d[..., 2:]], -1)
