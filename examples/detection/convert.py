"""Load a torch `model_torch.Detector` into a Flax NNX `model_jax.Detector`.

The two detectors name their submodules alike and use only layers the
common converter maps (``Conv2d``, ``BatchNorm2d``), so the
name-by-name copy is `examples.common.convert.torch_to_nnx`, reused as
is; this module only builds the NNX twin of a torch detector.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from examples.common.convert import nnx_twin, torch_to_nnx
from examples.detection import model_jax

__all__ = ["nnx_from_torch", "torch_to_nnx"]


def nnx_from_torch(
    source: torch.nn.Module,
    *,
    dtype: model_jax.Dtype = None,
    param_dtype: model_jax.Dtype = jnp.float32,
) -> model_jax.Detector:
    """A new NNX detector with the architecture and the weights of a torch one.

    Built abstractly (``nnx.eval_shape``, no random initialisation) and
    filled by `torch_to_nnx`, which checks that every NNX variable is set
    exactly once, with matching shapes.

    Example:
        >>> import numpy as np
        >>> from examples.detection import model_torch
        >>> _ = torch.manual_seed(0)
        >>> tm = model_torch.Detector(width=4).eval()
        >>> jm = nnx_from_torch(tm)
        >>> x = np.random.default_rng(0).normal(size=(1, 16, 16, 3)).astype(np.float32)
        >>> yj = np.asarray(jm(jnp.asarray(x), train=False)["box"])
        >>> yt = tm(torch.from_numpy(x).permute(0, 3, 1, 2))["box"]
        >>> bool(np.allclose(yj, yt.permute(0, 2, 3, 1).detach().numpy(), atol=1e-5))
        True
    """
    return nnx_twin(model_jax.Detector, source, dtype=dtype, param_dtype=param_dtype)
