"""The settings every task shares: `BaseConfig` and its validators.

A task's ``config.py`` subclasses :class:`BaseConfig` with its own fields
(values only); :func:`make_config` builds one and refuses unknown fields. The
checks here are the common ones; a task's own (sizes its model needs, say)
are its ``Task.check_config`` (`examples.harness.parts.Task`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

PRECISIONS = ("float32", "bfloat16", "float16")
MODES = ("naive", "stable")
OPTIMIZERS = ("adam", "adamw", "sgd")


def check_choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    """Raises ValueError unless `value` is one of `valid` (listed in the message).

    Example:
        >>> check_choice("mode", "naive", MODES)
    """
    if value not in valid:
        raise ValueError(f"{name} must be one of {list(valid)}, got {value!r}")


def check_int(name: str, value: Any, minimum: int) -> None:
    """Raises ValueError unless `value` is an int (not a bool) >= `minimum`.

    Example:
        >>> check_int("steps", 3, 0)
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_positive(name: str, value: Any) -> None:
    """Raises ValueError unless `value` is a finite number > 0.

    Example:
        >>> check_positive("learning_rate", 1e-3)
    """
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class BaseConfig:
    """The settings every task has (tasks subclass it and add their own).

    Attributes:
      image_size: square image side in pixels.
      batch_size: images per train step.
      width: model width (channels of the first level).
      steps: optimizer steps.
      learning_rate: optimizer step size.
      optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"`` (momentum 0.9).
      b1, b2, eps: Adam's moments and epsilon (torch's and optax's defaults).
      weight_decay: AdamW's decoupled weight decay (ignored by adam and sgd).
      seed: seeds the initial weights (torch's init) and the data.
      precision: compute dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
      mode: ``"stable"`` (float32 params, low-precision compute, the task's
        float32 loss, dynamic loss scaling for float16, clipping, skip
        non-finite) or ``"naive"`` (params, optimizer state, compute and loss
        in the low-precision dtype, no guards).
      max_grad_norm: global-norm clip of the stable mode (None: no clip).
      eval_images: held-out images.
      eval_batch_size: images per evaluation forward pass.
      stop_after_nonfinite: once the model has become non-finite, run this
        many more steps and stop (nothing more is learned from NaN weights).
      torch_threads: ``torch.set_num_threads`` for the torch runs (1 was
        4-8x faster than 2 on the shared 2-core box,
        examples/segmentation/TIMINGS.md).
      eval_every: None, or evaluate on the held-out set every this many
        steps as well (`fit`'s ``eval_fn``/``eval_every``): the records and
        ``metrics.jsonl`` then carry ``eval['<metric>']`` at those steps.
      devices: data-parallel width (``--devices``): JAX runs on a mesh of
        this many devices, torch in this many DDP processes; each gets
        ``batch_size / devices`` rows of the same global batch (see
        `examples.harness.devices.force_host_devices`).

    Example:
        >>> BaseConfig(optimizer="rmsprop")
        Traceback (most recent call last):
        ...
        ValueError: optimizer must be one of ['adam', 'adamw', 'sgd'], got 'rmsprop'
    """

    image_size: int = 32
    batch_size: int = 8
    width: int = 8
    steps: int = 400
    learning_rate: float = 2e-3
    optimizer: str = "adam"
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-4
    seed: int = 0
    precision: str = "float32"
    mode: str = "stable"
    max_grad_norm: float | None = 1.0
    eval_images: int = 64
    eval_batch_size: int = 32
    stop_after_nonfinite: int = 5
    torch_threads: int = 1
    eval_every: int | None = None
    devices: int = 1

    def __post_init__(self):
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("mode", self.mode, MODES)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        for name, minimum in (
            ("image_size", 8),
            ("batch_size", 1),
            ("width", 1),
            ("steps", 0),
            ("seed", 0),
            ("eval_images", 1),
            ("eval_batch_size", 1),
            ("stop_after_nonfinite", 0),
            ("torch_threads", 1),
            ("devices", 1),
        ):
            check_int(name, getattr(self, name), minimum)
        if self.batch_size % self.devices:
            raise ValueError(
                f"batch_size must be a multiple of devices (each device gets "
                f"batch_size / devices rows), got {self.batch_size} and {self.devices}"
            )
        if self.eval_every is not None:
            check_int("eval_every", self.eval_every, 1)
        check_positive("learning_rate", self.learning_rate)
        check_positive("eps", self.eps)
        if self.max_grad_norm is not None:
            check_positive("max_grad_norm", self.max_grad_norm)
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")

    @property
    def policy(self) -> str:
        """The jmp policy string of the stable mode.

        Example:
            >>> BaseConfig(precision="bfloat16").policy
            'params=float32,compute=bfloat16,output=float32'
        """
        return f"params=float32,compute={self.precision},output=float32"

    @property
    def label(self) -> str:
        """``"<precision> <mode>"``, e.g. for progress bars.

        Example:
            >>> BaseConfig(precision="float16", mode="naive").label
            'float16 naive'
        """
        return f"{self.precision} {self.mode}"

    def replace(self, **changes: Any) -> BaseConfig:
        """A validated copy with `changes` (`make_config` rules).

        Example:
            >>> BaseConfig().replace(mode="naive").mode
            'naive'
        """
        return make_config(type(self), **{**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, Any]:
        """Every field by name (for ``summary.json``).

        Example:
            >>> BaseConfig().as_dict()["steps"]
            400
        """
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def make_config(cls: type, **overrides: Any) -> Any:
    """``cls(**overrides)``, refusing unknown fields with the list of valid ones.

    Example:
        >>> make_config(BaseConfig, steps=3).steps
        3
        >>> make_config(BaseConfig, lr=0.1)
        Traceback (most recent call last):
        ...
        ValueError: unknown config field(s) ['lr']; valid fields: ['image_size', ...
    """
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown}; valid fields: {fields}")
    return cls(**overrides)


def jax_dtype(precision: str):
    """The jnp dtype of a precision name.

    Example:
        >>> jax_dtype("bfloat16").__name__
        'bfloat16'
    """
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}.get(
        precision, jnp.float16
    )


def torch_dtype(precision: str):
    """The torch dtype of a precision name.

    Example:
        >>> str(torch_dtype("float16"))
        'torch.float16'
    """
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        precision, torch.float16
    )
