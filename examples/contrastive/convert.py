"""Load the weights of a torch `model_torch.CLIP` into a Flax NNX `model_jax.CLIP`.

Name for name: ``Conv2d.weight`` (O, I, kh, kw) -> ``Conv.kernel`` (kh, kw,
I, O) (the segmentation converter's `convert_array`), ``Linear.weight``
(out, in) -> ``Linear.kernel`` (in, out), ``Embedding.weight`` ->
``Embed.embedding``, biases and ``logit_scale`` as they are. Every NNX
parameter must be set exactly once, with the shape it has.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from flax import nnx

from examples.contrastive import model_jax
from examples.segmentation.convert import convert_array

__all__ = ["nnx_from_torch"]


def _target(module: nnx.Module, name: str, key: str) -> str:
    if isinstance(module, nnx.Embed) and name == "weight":
        return "embedding"
    if isinstance(module, nnx.Conv | nnx.Linear) and name in ("weight", "bias"):
        return "kernel" if name == "weight" else "bias"
    if isinstance(module, model_jax.CLIP) and name == "logit_scale":
        return name
    raise KeyError(f"torch key {key!r}: no NNX counterpart on {type(module).__name__}")


def _array(module: nnx.Module, name: str, value: torch.Tensor):
    if isinstance(module, nnx.Linear) and name == "weight":
        return value.detach().float().numpy().T.copy()
    return convert_array(module, name, value)  # conv layout; a copy otherwise


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
    model = nnx.eval_shape(
        lambda: model_jax.CLIP(
            **source.architecture(), param_dtype=param_dtype, rngs=nnx.Rngs(0)
        )
    )
    expected = {p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    seen = set()
    for key, value in source.state_dict().items():
        *parts, name = key.split(".")
        module = model
        for p in parts:
            module = getattr(module, p)
        attr = _target(module, name, key)
        variable = getattr(module, attr)
        current = variable.get_value()
        array = _array(module, name, value)
        if array.shape != tuple(current.shape):
            raise ValueError(
                f"torch key {key!r}: shape {tuple(value.shape)} converts to "
                f"{array.shape}, but the NNX variable has {tuple(current.shape)}"
            )
        variable.set_value(jnp.asarray(array, dtype=current.dtype))
        seen.add((*parts, attr))
    missing = expected - seen
    if missing:
        names = sorted(".".join(map(str, p)) for p in missing)
        raise KeyError(f"NNX variables not set by the torch state_dict: {names}")
    return model
