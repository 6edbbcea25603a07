"""Load the weights of a torch `model_torch.GPT` into a Flax NNX `model_jax.GPT`.

Name for name, by `examples.common.convert.torch_to_nnx`: ``Linear.weight``
(out, in) -> ``Linear.kernel`` (in, out), ``Embedding.weight`` ->
``Embed.embedding``, the LayerNorms' ``scale`` / ``bias`` as they are. Every
NNX parameter must be set exactly once, with the shape it has.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from examples.common.convert import nnx_twin
from examples.lm import model_jax

__all__ = ["nnx_from_torch"]


def nnx_from_torch(
    source: torch.nn.Module, *, dtype=jnp.float32, param_dtype=jnp.float32
) -> model_jax.GPT:
    """A new NNX GPT with the architecture and the weights of a torch GPT.

    Example:
        >>> import numpy as np
        >>> from examples.lm import model_torch
        >>> _ = torch.manual_seed(0)
        >>> tm = model_torch.GPT(d_model=16, n_layers=1, n_heads=2, max_len=8,
        ...                      qk_norm=True)
        >>> jm = nnx_from_torch(tm)
        >>> tok = np.random.default_rng(0).integers(0, 256, size=(2, 8))
        >>> lj, sj = jm(jnp.asarray(tok))
        >>> lt, st = tm(torch.from_numpy(tok))
        >>> bool(np.allclose(lj, lt.detach().numpy(), atol=1e-5))
        True
        >>> bool(np.allclose(sj, st.numpy(), atol=1e-5))
        True
    """
    return nnx_twin(model_jax.GPT, source, dtype=dtype, param_dtype=param_dtype)
