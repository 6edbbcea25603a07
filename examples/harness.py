"""The example harness: one naive-vs-stable comparison for every task.

``python examples/compare.py TASK`` trains one task six times from the same
initial weights (torch's seeded init, converted to JAX) and the same batches:
JAX and torch, each ``naive`` and ``stable`` at the low precision, plus a
float32 ``stable`` run of each framework as the reference (with
``--precision float32`` the reference is the stable run itself: four runs).
Every run goes through the libraries' own loops, `jaxstable.train.fit` and
`torchref.train.fit`. The harness writes ``metrics.jsonl``, ``summary.json``,
``curves.png`` and ``report.md`` (see :func:`compare`).

Task interface
--------------
A task is a folder ``examples/<name>/`` whose ``task.py`` defines ``TASK``,
an object with these attributes (see `examples/segmentation/task.py`):

``name: str``
    the CLI name (``"segmentation"``, ``"ocr"``).
``help: str``
    one line for ``compare.py --help``.
``metrics: tuple[str, ...]``
    the held-out metric keys ``evaluate`` returns, in summary order; the
    first is the headline number of the table and plot (segmentation
    ``("miou",)``, OCR ``("hmean", "precision_det", "recall_det")``).
    Each run of ``summary.json`` carries every one of them.
``quick: dict``
    config overrides of ``--quick`` (tiny sizes: a smoke run in seconds).
``get_config(**overrides) -> config``
    a validated frozen dataclass that subclasses :class:`BaseConfig` (its
    common fields: sizes, optimizer, precision, mode, guards, threads) with
    the task's own fields added. Unknown fields raise ``ValueError``
    (:func:`make_config` does this).
``train_batches(config) -> list[dict[str, np.ndarray]]``
    the ``config.steps`` train batches, numpy, NHWC images (float32): every
    run reads these very arrays.
``heldout_set(config) -> Any``
    what the task's evaluate functions read (drawn once per comparison).
``initial_weights(config) -> dict[str, torch.Tensor]``
    the torch model's seeded initial ``state_dict``; both frameworks start
    from it.
``describe(config) -> str``
    the "Setup:" sentence of ``report.md`` (data, model, sizes).
``stable_loss: str``
    a few words on the stable run's loss for the report, e.g.
    ``"float32 cross-entropy"``.
``jax_parts(config, weights) -> JaxParts``
    the JAX model and losses of the run ``config`` describes (``config.mode``
    and ``config.precision``); see :class:`JaxParts`.
``torch_parts(config, weights) -> TorchParts``
    the same for torch; see :class:`TorchParts`.

The harness builds everything else: the optimizer (:func:`jax_optimizer`,
:func:`torch_optimizer`), the naive step (params, optimizer state and
compute in the low-precision dtype, the task's naive loss, no guard) and the
stable step (`jaxstable.train.make_train_step` / `torchref.train.TrainStep`:
float32 params, a jmp policy / autocast, dynamic loss scale for float16,
clip, skip), the loops (`fit`), the diagnostics of the first non-finite step
and the outputs. Adding a task adds a folder and one line in ``compare.py``'s
``TASKS``, no harness code.

A run is "broken" at the first step after which the model is non-finite:
for naive runs the first record with ``finite == False`` (non-finite loss,
gradients or new parameters); for stable runs the first step after which the
parameters or the model state are non-finite (a step the guards *skipped*
leaves the model as it was and is counted in ``skipped_total`` instead).
``config.stop_after_nonfinite`` steps later the run stops: nothing more is
learned from NaN weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

PRECISIONS = ("float32", "bfloat16", "float16")
MODES = ("naive", "stable")
OPTIMIZERS = ("adam", "adamw", "sgd")
# The per-step record keys both fits write (jaxstable/torchref.train.fit).
METRIC_KEYS = ("loss", "grad_norm", "loss_scale", "finite", "skipped_total")
# The bound on `fp32_agreement` (max relative loss difference of the
# two float32 runs over the first 50 steps). They start bit-identical; float32
# rounding differences of the two convolution / batch-norm implementations
# (~1e-7) are then amplified by training (segmentation, 50 steps at the
# defaults: 1.3e-4 at lr 1e-3, 9.1e-4 at 2e-3, 1.3e-3 at 3e-3).
FP32_AGREEMENT_LIMIT = 1e-3
AGREEMENT_STEPS = 50


# --------------------------------------------------------------------------
# Configs


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
        ):
            check_int(name, getattr(self, name), minimum)
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


# --------------------------------------------------------------------------
# What a task hands the harness


@dataclasses.dataclass
class JaxParts:
    """The JAX side of one run, built by ``task.jax_parts(config, weights)``.

    Attributes:
      params: the parameter pytree, float32 for ``mode="stable"`` and in
        ``config.precision`` for ``mode="naive"`` (the ``.half()`` recipe).
      model_state: non-trainable state (batch statistics), in the same dtype
        as the params; None if the model has none.
      loss_fn: ``loss_fn(params, model_state, batch) -> (loss,
        new_model_state)``, the ``has_state=True`` contract of
        `jaxstable.train.make_train_step` (``batch``: the numpy batch as jax
        arrays). Stable: the task's float32 loss (the harness casts params
        and floating batch leaves to the compute dtype with the jmp policy).
        Naive: the loss the users ran, in the compute dtype, no guard (the
        harness casts the floating batch leaves to the compute dtype).
      evaluate: ``evaluate(params, model_state, heldout) -> {metric: float}``
        in eval mode; the harness passes params cast to the compute dtype.
        A metric is nan when the model's outputs are non-finite.
    """

    params: Any
    model_state: Any
    loss_fn: Callable[[Any, Any, Any], tuple[Any, Any]]
    evaluate: Callable[[Any, Any, Any], dict[str, float]]


@dataclasses.dataclass
class TorchParts:
    """The torch side of one run, built by ``task.torch_parts(config, weights)``.

    Attributes:
      model: the ``nn.Module`` with the initial weights loaded, in train mode:
        float32 for ``mode="stable"``, in ``config.precision`` for
        ``mode="naive"`` (``model.to(dtype)``: weights, buffers, hence the
        optimizer state).
      loss_fn: ``loss_fn(model, batch) -> loss`` (0-d tensor), the
        `torchref.train.TrainStep` contract; ``batch`` is
        ``to_torch(numpy batch)``. Stable: the task's float32 loss (the
        harness runs it under autocast). Naive: the loss the users ran.
      to_torch: numpy batch -> what ``loss_fn`` reads (NCHW tensors); the
        harness casts its floating tensors to the compute dtype for naive.
      evaluate: ``evaluate(model, heldout) -> {metric: float}``; the harness
        calls it in eval mode under ``torch.no_grad()`` (and autocast for a
        low-precision stable run). nan when the outputs are non-finite.
    """

    model: Any
    loss_fn: Callable[[Any, Any], Any]
    to_torch: Callable[[Mapping[str, np.ndarray]], Any]
    evaluate: Callable[[Any, Any], dict[str, float]]


# --------------------------------------------------------------------------
# Results


def json_float(x: Any) -> float | None:
    """`x` as a float, or None when it is nan/inf (strict JSON has neither).

    Example:
        >>> json_float(1.5), json_float(float("inf"))
        (1.5, None)
    """
    x = float(x)
    return x if math.isfinite(x) else None


def step_rate(times: list[float]) -> float:
    """Steps per second from per-step wall times, leaving out the first step.

    The first step holds JAX's compile (seconds); with one step only, it is
    used anyway.

    Example:
        >>> step_rate([5.0, 0.1, 0.1])
        10.0
    """
    use = times[1:] if len(times) > 1 else times
    total = sum(use)
    return len(use) / total if total > 0 else float("nan")


@dataclasses.dataclass
class RunResult:
    """What one training run returns (both frameworks).

    Attributes:
      framework: ``"jax"`` or ``"torch"``.
      config: the run's config.
      metrics: the `fit` records, one per step taken: ``step`` (0-based),
        ``loss``, ``grad_norm``, ``loss_scale``, ``finite``,
        ``skipped_total``, ``time_s`` (python numbers; non-finite floats
        stay float nan/inf).
      first_nonfinite_step: the first step after which the model was broken
        (see the module docstring; None if never).
      final_loss: loss of the last step taken.
      skipped_total: steps whose update the guards skipped (0 for naive).
      scores: the held-out metrics of the task (``{"miou": ...}``); nan
        when the model's held-out outputs are non-finite.
      steps_per_s: train steps per second, from the second step on (the
        first includes JAX's compile).
      non_finite_report: text of the diagnostics report of the first broken
        step (gradients, updates, new parameters; and, with Adam, how many
        second-moment entries were 0 for a non-zero gradient); "" if none.
      stopped_early: the run stopped ``stop_after_nonfinite`` steps after
        ``first_nonfinite_step`` instead of running ``config.steps``.

    Example:
        >>> r = RunResult("jax", BaseConfig(), [], None, float("nan"), 0,
        ...               {"miou": 0.5}, 10.0)
        >>> r.summary()["final_loss"], r.summary()["miou"]
        (None, 0.5)
    """

    framework: str
    config: Any
    metrics: list[dict[str, Any]]
    first_nonfinite_step: int | None
    final_loss: float
    skipped_total: int
    scores: dict[str, float]
    steps_per_s: float
    non_finite_report: str = ""
    stopped_early: bool = False

    @property
    def name(self) -> str:
        """``"<framework> <precision> <mode>"``."""
        return f"{self.framework} {self.config.precision} {self.config.mode}"

    def summary(self) -> dict[str, Any]:
        """The run's line of ``summary.json`` (non-finite floats as None)."""
        return {
            "framework": self.framework,
            "precision": self.config.precision,
            "mode": self.config.mode,
            "steps": len(self.metrics),
            "first_nonfinite_step": self.first_nonfinite_step,
            "final_loss": json_float(self.final_loss),
            "skipped_total": int(self.skipped_total),
            **{k: json_float(v) for k, v in self.scores.items()},
            "steps_per_s": json_float(self.steps_per_s),
        }
