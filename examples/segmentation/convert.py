"""Load the weights of a torch `model_torch.UNet` into a Flax NNX `model_jax.UNet`.

Both U-Nets name their submodules alike, so the name-by-name copy is
`examples.common.convert.torch_to_nnx` (its docstring has the layout table:
convolutions, the spatially flipped transposed convolution, batch norm);
this module builds the NNX twin of a torch U-Net, and re-exports the
converter's functions for the U-Net's users (`carry_over`, the parity tests).
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from examples.common.convert import (
    convert_array,
    convert_array_back,
    nnx_path,
    nnx_twin,
    torch_to_nnx,
)
from examples.segmentation import model_jax

__all__ = [
    "convert_array",
    "convert_array_back",
    "nnx_from_torch",
    "nnx_path",
    "torch_to_nnx",
]


def nnx_from_torch(
    source: torch.nn.Module,
    *,
    dtype: model_jax.Dtype = None,
    param_dtype: model_jax.Dtype = jnp.float32,
) -> model_jax.UNet:
    """A new NNX U-Net with the architecture and the weights of a torch U-Net.

    Built abstractly (``nnx.eval_shape``, no random initialisation) and filled
    by `torch_to_nnx`, which checks that every NNX variable is set exactly
    once, with matching shapes.

    Args:
      source: a ``model_torch.UNet``.
      dtype: compute dtype of the NNX model (None: the input's).
      param_dtype: storage dtype of its parameters and batch statistics.

    Returns:
      A ``model_jax.UNet`` with the same in_channels, num_classes, width, depth.

    Example:
        >>> import numpy as np
        >>> from examples.segmentation import model_torch
        >>> _ = torch.manual_seed(0)
        >>> tm = model_torch.UNet(width=4).eval()
        >>> jm = nnx_from_torch(tm, dtype=jnp.bfloat16)
        >>> jm.head.kernel[...].dtype, jm.head.kernel[...].shape
        (dtype('float32'), (1, 1, 4, 6))
    """
    return nnx_twin(model_jax.UNet, source, dtype=dtype, param_dtype=param_dtype)
