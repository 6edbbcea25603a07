"""Torch weights into their Flax NNX twin, name by name: one converter for every task.

Each task's torch model and NNX model name their submodules alike, so a torch
state_dict key maps to an NNX path by name (``encoders.0.bn1.running_var``
-> ``encoders[0].bn1.var``); only the array layouts differ:

==================  ============================  ===========================
layer               torch                         Flax NNX
==================  ============================  ===========================
Conv2d weight       (out, in, kh, kw)  OIHW       (kh, kw, in, out)  HWIO
ConvTranspose2d     (in, out, kh, kw)             (kh, kw, in, out), spatially
  weight                                          flipped (see below)
Linear weight       (out, in)                     (in, out)
Embedding weight    (num, dim)                    ``embedding`` (num, dim)
biases, bare        as they are                   as they are
  parameters
BatchNorm2d         weight, bias, running_mean,   scale, bias, mean, var
                    running_var                   (``num_batches_tracked``
                                                  is only used by torch when
                                                  momentum=None: dropped)
==================  ============================  ===========================

Transposed convolution: torch computes ``out[s*i + k] += x[i] * w[k]`` (the
gradient of a convolution). ``nnx.ConvTranspose`` (``transpose_kernel=False``,
padding "VALID") dilates the input and *correlates* it with the kernel, which
is ``out[s*i + k] += x[i] * w[K-1-k]``: the kernel must be flipped in both
spatial axes. (With ``transpose_kernel=True`` flax would flip and swap in/out
itself.) `parity_tests/test_unet_conversion.py` checks this numerically.

Batch norm: the NNX models use `examples.common.layers_jax.BatchNorm`, with
torch's semantics (momentum 0.9 in flax's convention = torch's 0.1, eps 1e-5,
running variance updated with the unbiased batch variance), so the running
statistics stay equal in train mode too.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from examples.common.layers_jax import BatchNorm

_BN_NAMES = {
    "weight": "scale",
    "bias": "bias",
    "running_mean": "mean",
    "running_var": "var",
}
# torch-only buffer: the number of train-mode forwards, used for the running
# averages only when BatchNorm2d(momentum=None) (cumulative average)
_DROPPED = ("num_batches_tracked",)
# torch's `weight` is NNX's `kernel` on these
_KERNEL_LAYERS = (nnx.Conv, nnx.ConvTranspose, nnx.Linear)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    # bfloat16 has no numpy dtype; float32 holds every bf16/fp16 value exactly.
    # A copy: `.numpy()` of a float32 CPU tensor shares its memory, and
    # `jnp.asarray` of that may too (zero-copy on CPU), so torch's in-place
    # updates (batch-norm running stats in train mode) would change the JAX
    # arrays under it, depending on when XLA's asynchronous dispatch reads
    # them (seen: converted running stats off by 0.03-0.17 after one torch
    # train-mode forward).
    return t.detach().cpu().to(torch.float32).numpy().copy()


def convert_array(module: nnx.Module, name: str, value: torch.Tensor) -> np.ndarray:
    """One torch tensor -> the layout of the matching NNX variable (float32).

    Args:
      module: the NNX module that owns the variable (``nnx.Conv``,
        ``nnx.ConvTranspose``, ``nnx.Linear``, `BatchNorm`, ...).
      name: the torch attribute name (``weight``, ``bias``, ``running_mean``...).
      value: the torch tensor.

    Returns:
      A float32 numpy array in the NNX layout.

    Example:
        >>> conv = nnx.eval_shape(lambda: nnx.Conv(3, 8, (3, 3), rngs=nnx.Rngs(0)))
        >>> convert_array(conv, "weight", torch.zeros(8, 3, 3, 3)).shape
        (3, 3, 3, 8)
    """
    a = _to_numpy(value)
    if isinstance(module, nnx.Linear) and name == "weight":
        return np.ascontiguousarray(a.T)  # (out, in) -> (in, out)
    if isinstance(module, nnx.ConvTranspose) and name == "weight":
        # (in, out, kh, kw) -> (kh, kw, in, out), flipped in kh and kw
        return np.ascontiguousarray(a.transpose(2, 3, 0, 1)[::-1, ::-1])
    if isinstance(module, nnx.Conv) and name == "weight":
        return np.ascontiguousarray(a.transpose(2, 3, 1, 0))  # OIHW -> HWIO
    return a


def convert_array_back(module: nnx.Module, name: str, value: Any) -> np.ndarray:
    """Inverse of :func:`convert_array`: an NNX array -> torch's layout (float32).

    Args:
      module: the NNX module that owns the variable.
      name: the torch attribute name (``weight``, ``bias``, ``running_mean``...).
      value: the array in the NNX layout.

    Returns:
      A float32 numpy array in the torch layout.

    Example:
        >>> make = lambda: nnx.ConvTranspose(8, 4, (2, 2), rngs=nnx.Rngs(0))
        >>> up = nnx.eval_shape(make)
        >>> w = torch.randn(8, 4, 2, 2)
        >>> back = convert_array_back(up, "weight", convert_array(up, "weight", w))
        >>> bool(np.array_equal(back, w.numpy()))
        True
    """
    a = np.asarray(value, np.float32)
    if isinstance(module, nnx.Linear) and name == "weight":
        return np.ascontiguousarray(a.T)  # (in, out) -> (out, in)
    if isinstance(module, nnx.ConvTranspose) and name == "weight":
        # un-flip kh, kw; (kh, kw, in, out) -> (in, out, kh, kw)
        return np.ascontiguousarray(a[::-1, ::-1].transpose(2, 3, 0, 1))
    if isinstance(module, nnx.Conv) and name == "weight":
        return np.ascontiguousarray(a.transpose(3, 2, 0, 1))  # HWIO -> OIHW
    return a.copy()


def nnx_path(model: nnx.Module, key: str) -> tuple[nnx.Module, tuple] | None:
    """Where a torch state_dict key lives in its NNX twin.

    Args:
      model: the NNX model (abstract, from ``nnx.eval_shape``, is enough).
      key: a key of the torch model's ``state_dict()``.

    Returns:
      ``(module, path)``: the NNX module owning the variable and the
      variable's path in ``nnx.state(model)`` (``("down", "bn", "var")``);
      None for a torch-only buffer (``num_batches_tracked``).

    Raises:
      KeyError: no NNX counterpart (the message names the key).

    Example:
        >>> from examples.common.layers_jax import Stage
        >>> m = nnx.eval_shape(lambda: Stage(3, 4, rngs=nnx.Rngs(0)))
        >>> nnx_path(m, "down.bn.running_var")[1]
        ('down', 'bn', 'var')
    """
    *parts, name = key.split(".")
    if name in _DROPPED:
        return None
    module = _submodule(model, parts, key)
    attr = _nnx_name(module, name, key)
    return module, (*(int(p) if p.isdigit() else p for p in parts), attr)


def _nnx_name(module: nnx.Module, name: str, key: str) -> str:
    if isinstance(module, BatchNorm) and name in _BN_NAMES:
        return _BN_NAMES[name]
    if isinstance(module, _KERNEL_LAYERS) and name in ("weight", "bias"):
        return "kernel" if name == "weight" else "bias"
    if isinstance(module, nnx.Embed) and name == "weight":
        return "embedding"
    if isinstance(getattr(module, name, None), nnx.Param):
        return name  # a bare parameter of the model (CLIP's logit_scale)
    raise KeyError(
        f"torch key {key!r}: no NNX counterpart for {name!r} on {type(module).__name__}"
    )


def _submodule(model: nnx.Module, parts: list[str], key: str) -> nnx.Module:
    module = model
    for p in parts:
        try:
            module = module[int(p)] if p.isdigit() else getattr(module, p)
        except (AttributeError, IndexError, TypeError) as err:
            raise KeyError(
                f"torch key {key!r}: the NNX model has no submodule {p!r} "
                "(are the two models built with the same width/depth?)"
            ) from err
    return module


def torch_to_nnx(
    source: torch.nn.Module | Mapping[str, torch.Tensor], model: nnx.Module
) -> nnx.Module:
    """Copies torch weights and batch statistics into their NNX twin, in place.

    Every NNX parameter and batch statistic must be set by exactly one torch
    entry and every torch entry (but ``num_batches_tracked``) must be used;
    shapes must match: otherwise a ``KeyError`` / ``ValueError`` names the key.
    Values are cast to each NNX variable's dtype (its ``param_dtype``).

    Args:
      source: a torch model or its ``state_dict()``.
      model: its NNX twin, built with the same sizes (submodules named
        alike).

    Returns:
      `model`, updated.

    Example:
        >>> from examples.common import layers_jax, layers_torch
        >>> _ = torch.manual_seed(0)
        >>> tm = layers_torch.Stage(3, 4).eval()
        >>> twin = nnx.eval_shape(lambda: layers_jax.Stage(3, 4, rngs=nnx.Rngs(0)))
        >>> jm = torch_to_nnx(tm, twin)  # fills the abstract twin
        >>> x = np.random.default_rng(0).normal(size=(1, 8, 8, 3)).astype(np.float32)
        >>> y_jax = np.asarray(nnx.jit(lambda m, x: m(x, train=False))(jm, x))
        >>> y_torch = tm(torch.from_numpy(x).permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        >>> bool(np.allclose(y_jax, y_torch.detach().numpy(), atol=1e-5))
        True
    """
    state_dict = source.state_dict() if isinstance(source, torch.nn.Module) else source
    expected = {
        path
        for state in nnx.state(model, nnx.Param, nnx.BatchStat)
        for path, _ in nnx.to_flat_state(state)
    }
    seen = set()
    for key, value in state_dict.items():
        found = nnx_path(model, key)
        if found is None:
            continue
        (module, path), name = found, key.rsplit(".", 1)[-1]
        variable = getattr(module, path[-1])
        current = variable.get_value()  # an array, or a ShapeDtypeStruct
        array = convert_array(module, name, value)
        if array.shape != current.shape:
            raise ValueError(
                f"torch key {key!r}: shape {tuple(value.shape)} converts to "
                f"{array.shape}, but the NNX variable has {current.shape}"
            )
        variable.set_value(jnp.asarray(array, dtype=current.dtype))
        seen.add(path)
    missing = expected - seen
    if missing:
        names = sorted(".".join(map(str, p)) for p in missing)
        raise KeyError(f"NNX variables not set by the torch state_dict: {names}")
    return model


def nnx_twin(model_class: type, source: torch.nn.Module, **kwargs: Any) -> Any:
    """A new NNX `model_class` with the architecture and weights of `source`.

    The NNX model is built abstractly (``nnx.eval_shape``: no random
    initialisation, which on CPU compiles one initialiser per weight shape
    and takes seconds) from ``source.architecture()`` and `kwargs` (``dtype``,
    ``param_dtype``), then filled by :func:`torch_to_nnx`. The abstract model
    of an architecture is traced once and copied for every later twin
    (`gradient_agreement` converts two state dicts per step).

    Example:
        >>> from examples.common import layers_jax, layers_torch
        >>> class Torch(layers_torch.ConvBN):
        ...     def architecture(self):
        ...         return {"cin": 3, "cout": 4}
        >>> jm = nnx_twin(layers_jax.ConvBN, Torch(3, 4), param_dtype=jnp.float16)
        >>> jm.conv.kernel[...].dtype, jm.conv.kernel[...].shape
        (dtype('float16'), (3, 3, 3, 4))
    """
    arch = tuple(sorted(source.architecture().items()))
    graphdef, state = _abstract_model(model_class, arch, tuple(sorted(kwargs.items())))
    return torch_to_nnx(source, nnx.merge(graphdef, state, copy=True))


@functools.lru_cache(maxsize=32)
def _abstract_model(model_class: type, arch: tuple, kwargs: tuple) -> tuple:
    """``nnx.split`` of the abstract `model_class` (`nnx_twin`; items of
    the architecture and the keyword arguments, sorted)."""
    build = lambda: model_class(**dict(arch), **dict(kwargs), rngs=nnx.Rngs(0))  # noqa: E731
    return nnx.split(nnx.eval_shape(build))
