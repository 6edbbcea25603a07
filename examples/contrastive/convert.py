"""Load the weights of a torch `model_torch.CLIP` into a Flax NNX `model_jax.CLIP`.

Name for name, by `examples.common.convert.torch_to_nnx`: ``Conv2d.weight``
(O, I, kh, kw) -> ``Conv.kernel`` (kh, kw, I, O), ``Linear.weight`` (out,
in) -> ``Linear.kernel`` (in, out), ``Embedding.weight`` ->
``Embed.embedding``, biases and ``logit_scale`` as they are. Every NNX
parameter must be set exactly once, with the shape it has.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from examples.common.convert import nnx_twin
from examples.contrastive import model_jax

__all__ = ["nnx_from_torch"]


def nnx_from_torch(
    source: torch.nn.Module, *, param_dtype=jnp.float32
) -> model_jax.CLIP:
    """A new NNX CLIP with the architecture and the weights of a torch CLIP.

    Example:
        >>> import numpy as np
        >>> from examples.contrastive import model_torch
        >>> _ = torch.manual_seed(0)
        >>> tm = model_torch.CLIP(width=4, image_size=16, vocab_size=19)
        >>> jm = nnx_from_torch(tm)
        >>> x = np.random.default_rng(0).normal(size=(2, 16, 16, 3)).astype(np.float32)
        >>> tok = np.array([[1, 5, 0], [2, 0, 0]])
        >>> ij, tj = jm(jnp.asarray(x), jnp.asarray(tok))
        >>> it, tt = tm(torch.from_numpy(x).permute(0, 3, 1, 2), torch.from_numpy(tok))
        >>> bool(np.allclose(ij, it.detach().numpy(), atol=1e-5))
        True
        >>> bool(np.allclose(tj, tt.detach().numpy(), atol=1e-5))
        True
    """
    return nnx_twin(model_jax.CLIP, source, param_dtype=param_dtype)
