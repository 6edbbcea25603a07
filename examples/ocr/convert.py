"""Load the weights of a torch `model_torch.DBNet` into a Flax NNX `model_jax.DBNet`.

The two DBNets name their submodules alike and use the layers the
common converter maps (``Conv2d``, ``ConvTranspose2d`` with its
spatial flip, ``BatchNorm2d`` -> `examples.common.layers_jax.BatchNorm`), so the
name-by-name copy is `examples.common.convert.torch_to_nnx`, reused
as is; this module only builds the NNX twin of a torch DBNet.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from examples.common.convert import nnx_twin, torch_to_nnx
from examples.ocr import model_jax

__all__ = ["nnx_from_torch", "torch_to_nnx"]


def nnx_from_torch(
    source: torch.nn.Module,
    *,
    dtype: model_jax.Dtype = None,
    param_dtype: model_jax.Dtype = jnp.float32,
) -> model_jax.DBNet:
    """A new NNX DBNet with the architecture and the weights of a torch DBNet.

    Built abstractly (``nnx.eval_shape``, no random initialisation) and
    filled by `torch_to_nnx`, which checks that every NNX variable is set
    exactly once, with matching shapes.

    Args:
      source: a ``model_torch.DBNet``.
      dtype: compute dtype of the NNX model (None: the input's).
      param_dtype: storage dtype of its parameters and batch statistics.

    Returns:
      A ``model_jax.DBNet`` with the same in_channels, width and k.

    Example:
        >>> import numpy as np
        >>> from examples.ocr import model_torch
        >>> _ = torch.manual_seed(0)
        >>> tm = model_torch.DBNet(width=4).eval()
        >>> jm = nnx_from_torch(tm)
        >>> x = np.random.default_rng(0).normal(size=(1, 16, 16, 3)).astype(np.float32)
        >>> yj = np.asarray(jm(jnp.asarray(x), train=False)["logits"])
        >>> yt = tm(torch.from_numpy(x).permute(0, 3, 1, 2))["logits"].detach().numpy()
        >>> bool(np.allclose(yj, yt, atol=1e-5))
        True
    """
    return nnx_twin(model_jax.DBNet, source, dtype=dtype, param_dtype=param_dtype)
