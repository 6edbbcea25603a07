"""Carry a running U-Net job from torchref to jaxstable and back.

The generic part (optimizer moments, GradScaler -> `DynamicLossScale`, skip
counters, step) is `examples.common.carry_over`; this file adds the U-Net's
:func:`unet_layout` (torch keys -> NNX paths and array layouts, from
`convert.nnx_path`, `convert.convert_array` and `convert.convert_array_back`)
and the two one-call conversions of a live `torchref.train.TrainStep`.

Typical use (the test is `parity_tests/test_carry_over.py`)::

    # torch has run k steps in `step` (a torchref TrainStep of the U-Net)
    graphdef, params, stats = model_jax.split(convert.nnx_from_torch(step.model))
    target = TrainState.create(params=params, model_state=stats,
                               optimizer=stable_optimizer(optax.adam(lr), ...),
                               loss_scale=DynamicLossScale(period=...))
    state = torch_to_jax(step, target)     # then jaxstable trains on
    ...
    jax_to_torch(state, step)              # and back into the torch step
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flax import nnx

from examples.common import carry_over
from examples.segmentation import convert, model_jax, model_torch

__all__ = ["jax_to_torch", "torch_to_jax", "unet_layout"]


def unet_layout(model: model_torch.UNet) -> carry_over.Layout:
    """The `carry_over.Layout` of a torch U-Net and its NNX twin.

    Args:
      model: the torch ``model_torch.UNet`` (its architecture builds an
        abstract NNX twin: shapes only, nothing initialised).

    Returns:
      A layout whose paths are those of ``model_jax.split``'s params and
      batch stats (``encoders.0.bn1.running_var`` ->
      ``("encoders", 0, "bn1", "var")``); ``num_batches_tracked`` is not
      carried.

    Example:
      >>> layout = unet_layout(model_torch.UNet(width=4, depth=1))
      >>> layout.path("encoders.0.conv1.weight")
      ('encoders', 0, 'conv1', 'kernel')
      >>> layout.to_jax("encoders.0.conv1.weight", np.zeros((4, 3, 3, 3))).shape
      (3, 3, 3, 4)
      >>> layout.path("encoders.0.bn1.num_batches_tracked") is None
      True
    """
    twin = nnx.eval_shape(
        lambda: model_jax.UNet(**model.architecture(), rngs=nnx.Rngs(0))
    )

    def path(key: str) -> tuple | None:
        found = convert.nnx_path(twin, key)
        return None if found is None else found[1]

    def to_jax(key: str, array: np.ndarray) -> np.ndarray:
        module = convert.nnx_path(twin, key)[0]
        return convert.convert_array(module, _name(key), torch.from_numpy(array))

    def to_torch(key: str, array: np.ndarray) -> np.ndarray:
        module = convert.nnx_path(twin, key)[0]
        return convert.convert_array_back(module, _name(key), array)

    return carry_over.Layout(path=path, to_jax=to_jax, to_torch=to_torch)


def _name(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def torch_to_jax(step: Any, target: Any) -> Any:
    """The jaxstable `TrainState` that continues a torchref U-Net run.

    ``carry_over.train_state_from_torch(carry_over.torch_run_state(step),
    target, unet_layout(step.model))``.

    Args:
      step: a `torchref.train.TrainStep` of a ``model_torch.UNet``.
      target: a `TrainState` of the NNX twin (``model_jax.split``'s params
        and batch stats), with the optax optimizer and loss scale type the
        JAX run continues with.

    Returns:
      The `TrainState` holding the torch run's state.

    Example:
      >>> import jax, optax
      >>> from jaxstable import train, transforms
      >>> from torchref.train import TrainStep
      >>> tm = model_torch.UNet(num_classes=3, width=4, depth=1)
      >>> step = TrainStep(tm, torch.optim.SGD(tm.parameters(), lr=0.1),
      ...                  lambda m, b: m(b).mean())
      >>> _, params, stats = model_jax.split(convert.nnx_from_torch(tm))
      >>> target = train.TrainState.create(params=params, model_state=stats,
      ...     optimizer=transforms.stable_optimizer(optax.sgd(0.1)))
      >>> _ = step(torch.ones(2, 3, 8, 8))
      >>> state = torch_to_jax(step, target)
      >>> int(state.step), bool(jax.numpy.all(
      ...     state.params["head"]["bias"][...] == tm.head.bias.detach().numpy()))
      (1, True)
    """
    run = carry_over.torch_run_state(step)
    return carry_over.train_state_from_torch(run, target, unet_layout(step.model))


def jax_to_torch(state: Any, step: Any) -> None:
    """Loads a jaxstable U-Net run into a torchref `TrainStep`, in place.

    Args:
      state: the `TrainState` (params and batch stats of ``model_jax.split``).
      step: the `torchref.train.TrainStep` that continues (same
        architecture, optimizer kind and hyperparameters, loss scale kind).

    Example:
      >>> import optax
      >>> from jaxstable import train, transforms
      >>> from torchref.train import TrainStep
      >>> tm = model_torch.UNet(num_classes=3, width=4, depth=1)
      >>> _, params, stats = model_jax.split(convert.nnx_from_torch(tm))
      >>> state = train.TrainState.create(params=params, model_state=stats,
      ...     optimizer=transforms.stable_optimizer(optax.sgd(0.1)))
      >>> other = model_torch.UNet(num_classes=3, width=4, depth=1)
      >>> step = TrainStep(other, torch.optim.SGD(other.parameters(), lr=0.1),
      ...                  lambda m, b: m(b).mean())
      >>> jax_to_torch(state.replace(step=state.step + 5), step)
      >>> step.steps_done, bool(torch.equal(other.head.weight, tm.head.weight))
      (5, True)
    """
    like = carry_over.torch_run_state(step)
    run = carry_over.torch_run_from_train_state(state, unet_layout(step.model), like)
    carry_over.load_torch_run_state(step, run)
