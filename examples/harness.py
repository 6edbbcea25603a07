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
``multi_device: bool`` (optional, default False)
    the task runs with ``--devices N``: its torch loss is a mean over the
    GLOBAL batch under DDP (`examples.devices.global_mean` where it averages over a
    count that varies between ranks); batch norms are made global by the
    harness.

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
import copy
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
# `gradient_agreement`: the relative gradient difference that counts as a split
GRADIENT_THRESHOLD = 1e-4


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
      eval_every: None, or evaluate on the held-out set every this many
        steps as well (`fit`'s ``eval_fn``/``eval_every``): the records and
        ``metrics.jsonl`` then carry ``eval['<metric>']`` at those steps.
      devices: data-parallel width (``--devices``): JAX runs on a mesh of
        this many devices, torch in this many DDP processes; each gets
        ``batch_size / devices`` rows of the same global batch (see
        `examples.devices.force_host_devices`).

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


# --------------------------------------------------------------------------
# What a task hands the harness


@dataclasses.dataclass
class JaxParts:
    """The JAX side of one run, built by ``task.jax_parts(config, weights)``.

    Attributes:
      params: the parameter pytree: float32 for ``mode="stable"``; for
        ``mode="naive"`` what the task's users ran: in ``config.precision``
        for the ``.half()`` recipe (segmentation), or float32 master weights
        that ``loss_fn`` casts for the forward (OCR: mixed precision without
        any guard).
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
      probe: optional, naive runs: ``probe(params, model_state, batch) ->
        str``, one line starting with ``"Cause observed:"`` that measures
        the task's failure mechanism on the batch of the first non-finite
        step, from the state before that step (``batch`` cast to the compute
        dtype). It goes into the report.
      has_aux: ``loss_fn`` returns ``((loss, aux), new_model_state)``
        (`make_train_step`'s ``has_aux``): ``aux`` (e.g. check points, a
        logit scale) goes into every step's metrics, hence the `fit`
        records and ``metrics.jsonl`` as ``aux[...]`` keys.
      optimizer: optional, the run's optax transformation in place of
        :func:`jax_optimizer` of the config (a task's own recipe: parameter
        groups, schedules); the stable run wraps it in `stable_optimizer`
        (whose skip keeps its state, schedule counts included, on a skipped
        step), the naive run uses it as is.
    """

    params: Any
    model_state: Any
    loss_fn: Callable[[Any, Any, Any], tuple[Any, Any]]
    evaluate: Callable[[Any, Any, Any], dict[str, float]]
    probe: Callable[[Any, Any, Any], str] | None = None
    has_aux: bool = False
    optimizer: Any = None
    # optional: (params, opt_state) -> the params to evaluate, e.g. a weight
    # EMA that `optimizer` keeps in its state (detection); None: the params
    eval_params: Callable[[Any, Any], Any] | None = None


def _jax_eval_params(parts: JaxParts, params: Any, opt_state: Any) -> Any:
    """The params a JAX run is evaluated with (`JaxParts.eval_params`)."""
    return params if parts.eval_params is None else parts.eval_params(params, opt_state)


@dataclasses.dataclass
class TorchParts:
    """The torch side of one run, built by ``task.torch_parts(config, weights)``.

    Attributes:
      model: the ``nn.Module`` with the initial weights loaded, in train mode:
        float32 for ``mode="stable"``; for ``mode="naive"`` in
        ``config.precision`` (``model.to(dtype)``: weights, buffers, hence
        the optimizer state) or float32 with ``loss_fn`` running the forward
        under autocast, as the task's users did.
      loss_fn: ``loss_fn(model, batch) -> loss`` (0-d tensor) or ``(loss,
        aux)``, the `torchref.train.TrainStep` contract (``aux`` goes into
        the records as `JaxParts.has_aux` says); ``batch`` is
        ``to_torch(numpy batch)``. Stable: the task's float32 loss (the
        harness runs it under autocast). Naive: the loss the users ran.
      to_torch: numpy batch -> what ``loss_fn`` reads (NCHW tensors); the
        harness casts its floating tensors to the compute dtype for naive.
      evaluate: ``evaluate(model, heldout) -> {metric: float}``; the harness
        calls it in eval mode under ``torch.no_grad()`` and, for a
        low-precision run, ``torch.autocast``. nan when the outputs are
        non-finite.
      probe: optional, naive runs: ``probe(model, batch) -> str`` as
        `JaxParts.probe`; ``model`` is a copy holding the parameters from
        before the first non-finite step, ``batch`` what that step read.
      optimizer: optional, ``optimizer(model) -> (torch optimizer,
        scheduler or None)`` in place of :func:`torch_optimizer` of the
        config (the twin of `JaxParts.optimizer`); the harness calls
        ``scheduler.step()`` after every step that was applied (a skipped
        step leaves the schedule where it was, as on the JAX side).
    """

    model: Any
    loss_fn: Callable[[Any, Any], Any]
    to_torch: Callable[[Mapping[str, np.ndarray]], Any]
    evaluate: Callable[[Any, Any], dict[str, float]]
    probe: Callable[[Any, Any], str] | None = None
    optimizer: Callable[[Any], tuple[Any, Any]] | None = None


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
      location: what ``diagnostics.locate`` found for the run's first
        non-finite step (the fields of ``NonFiniteLocation`` as a dict;
        None when it found every value finite or nothing was located): for
        naive runs the first broken step, re-run as a ``TrainStep`` from
        the state before it; for stable runs the first step the guards
        skipped (`fit` records it).
      location_step: the step ``location`` is about; None if none was located.
      replicas: ``config.devices > 1`` only: ``{"devices", "replicas_identical",
        "ranks_agree"}`` (see `examples.devices.replica_check`); None on one device.

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
    location: dict[str, Any] | None = None
    location_step: int | None = None
    replicas: dict[str, Any] | None = None

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
            "location": self.location_summary(),
            # one device: no key, the summary of a plain run is unchanged
            **({} if self.replicas is None else {"replicas": self.replicas}),
        }

    def location_summary(self) -> dict[str, Any] | None:
        """``{"step", "phase", "path", "op", "detail"}`` of ``location``, or
        None when no step was located (a located step whose values all came
        out finite on the re-run has phase None).

        Example:
            >>> r = RunResult("jax", BaseConfig(), [], 0, 1.0, 0, {}, 1.0,
            ...               location=dict(phase="update", path="w", op=None,
            ...                             detail="m / 0"), location_step=0)
            >>> r.location_summary()["phase"], r.location_summary()["step"]
            ('update', 0)
        """
        if self.location_step is None:
            return None
        loc = self.location or {}
        return {
            "step": self.location_step,
            **{k: loc.get(k) for k in ("phase", "path", "op", "detail")},
        }


# --------------------------------------------------------------------------
# Diagnostics text (both frameworks)


def adam_underflow_note(
    grads: list[np.ndarray], nus: list[np.ndarray], dtype_name: str, eps: float
) -> str:
    """One line on Adam's second moment at a broken step (observed numbers).

    Counts the entries whose gradient is non-zero but whose second moment
    ``nu`` is exactly 0 (``(1 - b2) * g**2`` underflowed), the largest such
    |g|, and what ``eps`` becomes in the parameters' dtype.

    Args:
      grads, nus: the step's gradients and Adam's new second moments, as
        float32/float64 numpy arrays (same order).
      dtype_name: the dtype of the optimizer state.
      eps: Adam's eps.

    Returns:
      The sentence, or "" when it would say nothing: no list given, or no
      entry whose ``nu`` underflowed (a task whose failure is elsewhere,
      e.g. float32 Adam state, gets no "nu == 0 for 0 of 0 entries" line).

    Example:
        >>> g = [np.array([1e-3, 0.5, 0.0])]
        >>> nu = [np.array([0.0, 2.5e-4, 0.0])]
        >>> note = adam_underflow_note(g, nu, "float16", 1e-8)
        >>> print(note[:73])
        Adam state (float16): nu == 0 for 1 of 2 entries with a non-zero gradient
        >>> "eps=1e-08 is 0 in float16" in note, note.endswith("m / 0 = inf.")
        (True, True)
        >>> adam_underflow_note(g, [np.array([1e-6, 2.5e-4, 0.0])], "float32", 1e-8)
        ''
    """
    if not grads:
        return ""
    hit = total = 0
    largest = 0.0
    for g, nu in zip(grads, nus, strict=True):
        g = np.asarray(g, np.float64)
        nu = np.asarray(nu, np.float64)
        nonzero = (g != 0) & np.isfinite(g)
        under = nonzero & (nu == 0)
        hit += int(under.sum())
        total += int(nonzero.sum())
        if under.any():
            largest = max(largest, float(np.abs(g[under]).max()))
    if not hit:
        return ""
    import ml_dtypes  # numpy dtypes of bfloat16; installed with jax and torch users

    eps_in = float(
        np.asarray(
            eps,
            ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.dtype(dtype_name),
        )
    )
    text = (
        f"Adam state ({dtype_name}): nu == 0 for {hit} of {total} entries with a "
        f"non-zero gradient (the largest such |g| is {largest:.3g}: (1-b2)*g**2 "
        f"underflowed to 0); eps={eps:g} is {eps_in:g} in {dtype_name}"
    )
    if eps_in == 0:
        text += ", so m / (sqrt(nu) + eps) = m / 0 = inf"
    return text + "."


def _report_text(tree: Mapping[str, Any], diagnostics: Any, size: Callable) -> str:
    """Per part of `tree`: how many entries are non-finite, and the table.

    ``diagnostics`` is the framework's module (``jaxstable.diagnostics`` or
    ``torchref.diagnostics``), ``size(part)`` counts a part's entries.
    """
    parts = []
    for name, sub in tree.items():
        report = diagnostics.non_finite_report(sub)
        total = size(sub)
        bad = sum(r.nan_count + r.inf_count for r in report)
        parts.append(f"{name}: {bad} of {total} entries non-finite")
        if report:
            parts.append(diagnostics.format_report(report))
    return "non-finite after the step:\n" + "\n".join(parts)


def _first_location(history) -> tuple[int | None, dict[str, Any] | None]:
    """(step, location) of the first `fit` record that carries a location."""
    for rec in history:
        if "location" in rec:
            return rec["step"], rec["location"]
    return None, None


def _result(
    framework, config, history, first_bad, report, scores, located=None
) -> RunResult:
    """The RunResult of a run; ``located``: (step, location) of a naive run,
    else the first location `fit` recorded."""
    step, location = located if located is not None else _first_location(history)
    return RunResult(
        framework=framework,
        config=config,
        metrics=history,
        first_nonfinite_step=first_bad,
        final_loss=history[-1]["loss"] if history else float("nan"),
        skipped_total=history[-1]["skipped_total"] if history else 0,
        scores=scores,
        steps_per_s=step_rate([r["time_s"] for r in history]),
        non_finite_report=report,
        stopped_early=len(history) < config.steps,
        location=location,
        location_step=step,
    )


class _Watch:
    """`on_step` of the stable runs: notes the first step after which the
    model is non-finite, asks for its report at once, stops N steps later."""

    def __init__(self, config, broken: Callable, report: Callable, log=None):
        self.config, self.broken, self.report = config, broken, report
        self.first_bad, self.text, self.log = None, "", log

    def __call__(self, record, state) -> bool:
        if self.log is not None:
            self.log(record)
        if self.first_bad is None and self.broken(state):
            self.first_bad = record["step"]
            self.text = self.report(record, state)
        return (
            self.first_bad is not None
            and record["step"] - self.first_bad >= self.config.stop_after_nonfinite
        )


# --------------------------------------------------------------------------
# JAX runs


def jax_optimizer(config: BaseConfig):
    """The plain optax optimizer of the config (twin of `torch_optimizer`).

    Adam(W) with the config's b1, b2, eps (optax adds eps outside the square
    root, as torch does); SGD with momentum 0.9 (``t = g + 0.9 t``, torch's
    buffer).

    Example:
        >>> import jax.numpy as jnp
        >>> tx = jax_optimizer(BaseConfig(optimizer="sgd"))
        >>> u, _ = tx.update(jnp.ones(2), tx.init(jnp.zeros(2)))
        >>> [round(float(x), 6) for x in u]
        [-0.002, -0.002]
    """
    import optax

    c = config
    if c.optimizer == "adam":
        return optax.adam(c.learning_rate, b1=c.b1, b2=c.b2, eps=c.eps)
    if c.optimizer == "adamw":
        return optax.adamw(
            c.learning_rate, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay
        )
    return optax.sgd(c.learning_rate, momentum=0.9)


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


def _jax_cast_floats(tree, dtype):
    import jax
    import jax.numpy as jnp

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)


def _jax_report(tree) -> str:
    import jax

    from jaxstable import diagnostics

    return _report_text(
        tree,
        diagnostics,
        lambda sub: sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(sub)),
    )


def _jax_tx(config, parts):
    """The task's own optax optimizer if it has one, else the config's."""
    return parts.optimizer if parts.optimizer is not None else jax_optimizer(config)


def _jax_naive(config, parts):
    """The naive step: a pure ``(state, batch) -> (state, metrics)`` over a dict.

    The state also holds the step's gradients and updates (``"last"``) for
    the report of the first non-finite step: twice the parameters' memory,
    small next to a second compile of the whole step to recompute them.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from jaxstable import transforms
    from jaxstable.loss_scale import all_finite

    dtype = jax_dtype(config.precision)
    tx = _jax_tx(config, parts)

    def step(state, batch):
        batch = _jax_cast_floats(batch, dtype)

        def loss(p):
            out, new_ms = parts.loss_fn(p, state["model_state"], batch)
            value, aux = out if parts.has_aux else (out, None)
            return value, (aux, new_ms)

        (value, (aux, new_ms)), grads = jax.value_and_grad(loss, has_aux=True)(
            state["params"]
        )
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {
            "loss": value.astype(jnp.float32),
            "grad_norm": transforms.global_norm(grads),
            "loss_scale": jnp.ones([], jnp.float32),
            "finite": all_finite((value, grads, params)),
            "skipped_total": jnp.zeros([], jnp.int32),
        }
        if parts.has_aux:
            metrics["aux"] = aux
        new = {
            "params": params,
            "opt_state": opt_state,
            "model_state": new_ms,
            "last": {"grads": grads, "updates": updates},
        }
        return new, metrics

    zeros = jax.tree.map(jnp.zeros_like, parts.params)
    state = {
        "params": parts.params,
        "opt_state": tx.init(parts.params),
        "model_state": parts.model_state,
        "last": {"grads": zeros, "updates": zeros},
    }
    return jax.jit(step), state


def _jax_naive_report(config, after) -> str:
    import jax
    import optax

    grads, updates = after["last"]["grads"], after["last"]["updates"]
    text = _jax_report({"grads": grads, "updates": updates, "params": after["params"]})
    adam = [
        s
        for s in jax.tree_util.tree_leaves(
            after["opt_state"], is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
        )
        if isinstance(s, optax.ScaleByAdamState)
    ]
    if adam:
        as_np = functools.partial(np.asarray, dtype=np.float32)
        g = [as_np(x) for x in jax.tree_util.tree_leaves(grads)]
        nus = jax.tree_util.tree_leaves(adam[0].nu)
        nu = [as_np(x) for x in nus]
        note = adam_underflow_note(g, nu, str(nus[0].dtype), config.eps)
        text += "\n" + note if note else ""
    return text


def _jax_locate_naive(config, parts, before, batch) -> dict[str, Any] | None:
    """`jaxstable.diagnostics.locate` of a naive step, off the hot path.

    The naive step is a plain function, which `locate` does not take: the
    same step is rebuilt as an unguarded `TrainStep` (the task's naive loss,
    no policy, `NoOpLossScale`) over the state `before` the bad step, with
    the naive run's own optimizer state. ``batch``: cast as the step casts it.
    """
    from jaxstable import diagnostics, train

    step = train.make_train_step(
        parts.loss_fn, has_state=True, has_aux=parts.has_aux, jit=False
    )
    state = train.TrainState.create(
        params=before["params"],
        optimizer=_jax_tx(config, parts),
        model_state=before["model_state"],
    ).replace(opt_state=before["opt_state"])
    loc = diagnostics.locate(step, state, batch)
    return None if loc is None else loc._asdict()


def _jax_stable(config, parts):
    from jaxstable import train, transforms
    from jaxstable.loss_scale import DynamicLossScale, NoOpLossScale

    tx = transforms.stable_optimizer(
        _jax_tx(config, parts), max_grad_norm=config.max_grad_norm
    )
    # float16 only: its smallest subnormal is 6e-8, where small gradients of a
    # mean over thousands of pixels vanish; bfloat16 reaches 1e-38 like float32
    scale = DynamicLossScale() if config.precision == "float16" else NoOpLossScale()
    state = train.TrainState.create(
        params=parts.params,
        optimizer=tx,
        loss_scale=scale,
        model_state=parts.model_state,
    )
    step = train.make_train_step(
        parts.loss_fn, has_state=True, has_aux=parts.has_aux, policy=config.policy
    )
    return step, state


def run_jax(
    task, config, weights, batches, heldout, *, progress=True, log=None
) -> RunResult:
    """One JAX run of `task` as `config` says, on `jaxstable.train.fit`.

    ``log(record)``, if given, is called with each step's `fit` record.

    Returns:
      A :class:`RunResult` (``framework="jax"``).
    """
    import jax

    from examples import devices
    from jaxstable import train
    from jaxstable.loss_scale import all_finite

    parts = task.jax_parts(config, weights)
    batches = [jax.tree.map(np.asarray, b) for b in batches[: config.steps]]
    fit_args = dict(progress=progress, time_steps=True)
    dtype = jax_dtype(config.precision)
    if config.eval_every is not None:

        def eval_fn(state):
            params, model_state, opt_state = (
                (state["params"], state["model_state"], state["opt_state"])
                if isinstance(state, dict)
                else (state.params, state.model_state, state.opt_state)
            )
            params = _jax_eval_params(parts, params, opt_state)
            return parts.evaluate(_jax_cast_floats(params, dtype), model_state, heldout)

        fit_args.update(eval_fn=eval_fn, eval_every=config.eval_every)
    if config.mode == "naive":
        step, state = _jax_naive(config, parts)
        state, batches = devices.jax_distribute(config, state, batches)
        # `before`: the state the next step starts from (no copy: jax arrays
        # are immutable and the naive step donates nothing)
        box = {"first": None, "text": "", "before": state, "location": None}

        def on_step(record, after):
            if log is not None:
                log(record)
            if box["first"] is None and not record["finite"]:
                box["first"] = record["step"]
                box["text"] = _jax_naive_report(config, after)
                before = box["before"]
                batch = _jax_cast_floats(batches[record["step"]], dtype)
                if parts.probe is not None:
                    probe = parts.probe(before["params"], before["model_state"], batch)
                    box["text"] += "\n" + probe
                box["location"] = _jax_locate_naive(config, parts, before, batch)
            box["before"] = after

        state, history = train.fit(
            state,
            step,
            batches,
            on_step=on_step,
            stop_after_nonfinite=config.stop_after_nonfinite,
            **fit_args,
        )
        first_bad, text = box["first"], box["text"]
        located = (first_bad, box["location"])
        params, model_state = state["params"], state["model_state"]
        params = _jax_eval_params(parts, params, state["opt_state"])
    else:
        step, state = _jax_stable(config, parts)
        state, batches = devices.jax_distribute(config, state, batches)
        finite = jax.jit(all_finite)

        def report(record, st):
            grads = step.grads(st, batches[record["step"]])
            return _jax_report({"grads (next step)": grads, "params": st.params})

        watch = _Watch(
            config,
            lambda st: not bool(finite((st.params, st.model_state))),
            report,
            log,
        )
        state, history = train.fit(state, step, batches, on_step=watch, **fit_args)
        first_bad, text = watch.first_bad, watch.text
        located = None  # fit located the first skipped step (its record)
        params, model_state = state.params, state.model_state
        params = _jax_eval_params(parts, params, state.opt_state)
    scores = parts.evaluate(_jax_cast_floats(params, dtype), model_state, heldout)
    result = _result("jax", config, history, first_bad, text, scores, located)
    if config.devices > 1:
        from jaxstable import distributed

        identical = distributed.replicas_identical(state)
        result.replicas = devices.replica_check(config.devices, identical, [history])
    return result


# --------------------------------------------------------------------------
# torch runs


def torch_optimizer(config: BaseConfig, params: Any):
    """The plain torch optimizer of the config (twin of `jax_optimizer`).

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(2, 1)
        >>> opt = torch_optimizer(BaseConfig(optimizer="sgd"), m.parameters())
        >>> type(opt).__name__, opt.defaults["momentum"]
        ('SGD', 0.9)
    """
    import torch

    c = config
    betas = (c.b1, c.b2)
    if c.optimizer == "adam":
        return torch.optim.Adam(params, lr=c.learning_rate, betas=betas, eps=c.eps)
    if c.optimizer == "adamw":
        return torch.optim.AdamW(
            params,
            lr=c.learning_rate,
            betas=betas,
            eps=c.eps,
            weight_decay=c.weight_decay,
        )
    return torch.optim.SGD(params, lr=c.learning_rate, momentum=0.9)


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


def _torch_cast_floats(tree, dtype):
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, dict):
        return {k: _torch_cast_floats(v, dtype) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_torch_cast_floats(v, dtype) for v in tree)
    return tree


def _torch_report_text(tree) -> str:
    from torchref import diagnostics

    return _report_text(
        tree,
        diagnostics,
        lambda sub: sum(t.numel() for t in sub.values()),
    )


def _torch_opt(config, parts, model) -> tuple[Any, Any]:
    """(optimizer, scheduler or None): the task's own, else the config's."""
    if parts.optimizer is not None:
        return parts.optimizer(model)
    return torch_optimizer(config, model.parameters()), None


def _torch_naive(config, parts):
    """The naive step ``step(batch) -> metrics``: zero_grad, backward, step.

    Returns ``(step, report, locate)``: ``report()`` is the diagnostics text
    of the last step, ``locate()`` `torchref.diagnostics.locate` of it
    re-run from the model and optimizer state before it. For those, each
    step keeps a copy of that state (parameters, buffers, Adam's moments:
    3-4x the parameters' memory, a copy per step next to a whole forward
    and backward).
    """
    import torch

    from torchref.loss_scale import all_finite
    from torchref.transforms import global_norm

    dtype = torch_dtype(config.precision)
    model = parts.model
    optimizer, scheduler = _torch_opt(config, parts, model)
    named = dict(model.named_parameters())
    last: dict[str, Any] = {}

    def step(batch):
        batch = _torch_cast_floats(parts.to_torch(batch), dtype)
        last["batch"] = batch
        last["model_before"] = {
            k: v.detach().clone() for k, v in model.state_dict().items()
        }
        last["opt_before"] = copy.deepcopy(optimizer.state_dict())
        old = {n: last["model_before"][n] for n in named}
        optimizer.zero_grad(set_to_none=True)
        out = parts.loss_fn(model, batch)
        loss, aux = out if isinstance(out, tuple) else (out, None)
        loss.backward()
        grads = {
            n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for n, p in named.items()
        }
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        new = {n: p.detach() for n, p in named.items()}
        last.update(grads=grads, old=old, new=new)
        loss_value = float(loss.detach().float())
        finite = all_finite(list(grads.values()) + list(new.values()))
        metrics = {
            "loss": loss_value,
            "grad_norm": float(global_norm(list(grads.values()))),
            "loss_scale": 1.0,
            "finite": bool(finite) and math.isfinite(loss_value),
            "skipped_total": 0,
        }
        if aux is not None:
            metrics["aux"] = aux
        return metrics

    def report() -> str:
        grads, old, new = last["grads"], last["old"], last["new"]
        updates = {n: new[n].float() - old[n].float() for n in new}
        text = _torch_report_text({"grads": grads, "updates": updates, "params": new})
        if config.optimizer in ("adam", "adamw"):
            nus = [
                optimizer.state[p]["exp_avg_sq"].float().numpy() for p in named.values()
            ]
            g = [grads[n].float().numpy() for n in named]
            dtype = str(next(iter(named.values())).dtype).replace("torch.", "")
            note = adam_underflow_note(g, nus, dtype, config.eps)
            text += "\n" + note if note else ""
        if parts.probe is not None:
            text += "\n" + parts.probe(model_before(), last["batch"])
        return text

    def model_before():
        before = copy.deepcopy(model)
        before.load_state_dict(last["model_before"])
        return before

    def locate() -> dict[str, Any] | None:
        # The naive step is a plain function, which `locate` does not take:
        # the same step as an unguarded TrainStep (the task's naive loss, no
        # scaler, no autocast of its own) on copies of the state before it.
        from torchref import diagnostics, train

        before = model_before()
        opt, _ = _torch_opt(config, parts, before)
        opt.load_state_dict(last["opt_before"])
        step = train.TrainStep(
            before, opt, parts.loss_fn, scaler=None, check_update=False
        )
        loc = diagnostics.locate(step, last["batch"])
        return None if loc is None else loc._asdict()

    return step, report, locate


def _torch_stable(config, parts):
    from torchref import train
    from torchref.loss_scale import DynamicLossScale

    low = config.precision != "float32"
    model = parts.model
    optimizer, scheduler = _torch_opt(config, parts, model)
    step = train.TrainStep(
        model,
        optimizer,
        lambda m, batch: parts.loss_fn(m, batch),
        max_grad_norm=config.max_grad_norm,
        # float16 only: bfloat16 has float32's exponent range, nothing
        # underflows that scaling would save (torch.amp does not scale it)
        scaler=DynamicLossScale() if config.precision == "float16" else None,
        autocast_dtype=torch_dtype(config.precision) if low else None,
    )
    return step, scheduler


def _torch_finite_model(model) -> bool:
    from torchref.loss_scale import all_finite

    tensors = list(model.parameters()) + list(model.buffers())
    return all_finite([t for t in tensors if t.is_floating_point()])


def _torch_evaluate(config, parts, heldout) -> dict[str, float]:
    import contextlib

    import torch

    model = parts.model
    model.eval()
    ctx = contextlib.nullcontext()
    if config.precision != "float32":  # a .half() model is float16 anyway
        ctx = torch.autocast("cpu", dtype=torch_dtype(config.precision))
    try:
        with torch.no_grad(), ctx:
            return parts.evaluate(model, heldout)
    finally:
        model.train()


def run_torch(
    task, config, weights, batches, heldout, *, progress=True, log=None
) -> RunResult:
    """One torch run of `task` as `config` says, on `torchref.train.fit`.

    ``log(record)``, if given, is called with each step's `fit` record.

    Returns:
      A :class:`RunResult` (``framework="torch"``).
    """
    import torch

    if config.devices > 1:  # N DDP processes (this process waits for them)
        from examples import devices

        return devices.torch_multiprocess(
            task, config, weights, batches, heldout, progress, log
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(config.torch_threads)
    try:
        return _run_torch(task, config, weights, batches, heldout, progress, log)
    finally:
        torch.set_num_threads(threads)  # leave no global state behind


def _run_torch(
    task, config, weights, batches, heldout, progress, log, wrap=None
) -> RunResult:
    """One torch run in this process; ``wrap(parts) -> parts`` (a DDP rank of
    `examples.devices.torch_multiprocess`) rewires the task's parts first."""
    from torchref import train

    parts = task.torch_parts(config, weights)
    if wrap is not None:
        parts = wrap(parts)
    batches = batches[: config.steps]
    fit_args = dict(progress=progress, time_steps=True)
    if config.eval_every is not None:
        fit_args.update(
            eval_fn=lambda _step: _torch_evaluate(config, parts, heldout),
            eval_every=config.eval_every,
        )
    if config.mode == "naive":
        step, report, locate = _torch_naive(config, parts)
        box = {"first": None, "text": "", "location": None}

        def on_step(record, _step):
            if log is not None:
                log(record)
            if box["first"] is None and not record["finite"]:
                box["first"], box["text"] = record["step"], report()
                box["location"] = locate()

        history = train.fit(
            step,
            batches,
            on_step=on_step,
            stop_after_nonfinite=config.stop_after_nonfinite,
            **fit_args,
        )
        first_bad, text = box["first"], box["text"]
        located = (first_bad, box["location"])
    else:
        step, scheduler = _torch_stable(config, parts)
        model = parts.model

        def stable_report(record, _step):
            grads = {
                n: p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
            params = dict(model.named_parameters())
            return _torch_report_text({"grads": grads, "params": params})

        watch = _Watch(
            config, lambda s: not _torch_finite_model(s.model), stable_report, log
        )

        def on_step(record, st):
            if scheduler is not None and record["finite"]:
                scheduler.step()  # a skipped step keeps the schedule (as optax)
            return watch(record, st)

        to_torch = parts.to_torch
        history = train.fit(
            step, [to_torch(b) for b in batches], on_step=on_step, **fit_args
        )
        first_bad, text = watch.first_bad, watch.text
        located = None  # fit located the first skipped step (its record)
    scores = _torch_evaluate(config, parts, heldout)
    return _result("torch", config, history, first_bad, text, scores, located)


# --------------------------------------------------------------------------
# The comparison: plan, outputs


def run_plan(precision: str) -> list[tuple[str, str, str]]:
    """The (framework, precision, mode) of each run, in the order they run.

    Example:
        >>> for run in run_plan("float16")[:3]:
        ...     print(run)
        ('jax', 'float32', 'stable')
        ('jax', 'float16', 'naive')
        ('jax', 'float16', 'stable')
        >>> len(run_plan("float32"))
        4
    """
    plan = []
    for fw in ("jax", "torch"):
        if precision != "float32":
            plan.append((fw, "float32", "stable"))
        plan += [(fw, precision, "naive"), (fw, precision, "stable")]
    return plan


def fp32_agreement(runs: list[RunResult], steps: int = AGREEMENT_STEPS) -> float | None:
    """max |loss_jax - loss_torch| / |loss_torch| over the first `steps` float32 steps.

    Compares the two float32 stable runs (same init, batches, optimizer) over
    exactly ``min(steps, config.steps)`` steps. None when there is no such
    pair; NaN (null in JSON) when the number is undefined: a run stopped
    before those steps, or a loss there is non-finite or zero, so a diverged
    run can never pass for an agreeing one.

    Example:
        >>> cfg = BaseConfig()
        >>> mk = lambda fw, l: RunResult(
        ...     fw, cfg, [{"loss": x} for x in l], None, l[-1], 0, {}, 1.0)
        >>> torch_run = mk("torch", [1.0, 0.4])
        >>> round(fp32_agreement([mk("jax", [1.0, 0.5]), torch_run], 2), 6)
        0.25
        >>> fp32_agreement([mk("jax", [1.0, float("nan")]), torch_run], 2)
        nan
    """
    pick = {
        r.framework: r
        for r in runs
        if r.config.precision == "float32" and r.config.mode == "stable"
    }
    if set(pick) != {"jax", "torch"}:
        return None
    n = min(steps, pick["jax"].config.steps, pick["torch"].config.steps)
    a = [m["loss"] for m in pick["jax"].metrics[:n]]
    b = [m["loss"] for m in pick["torch"].metrics[:n]]
    if len(a) < n or len(b) < n:
        return math.nan
    if not all(math.isfinite(x) for x in a + b) or any(y == 0.0 for y in b):
        return math.nan
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def gradient_agreement(
    task: Any,
    config: BaseConfig,
    steps: int = AGREEMENT_STEPS,
    *,
    threshold: float = GRADIENT_THRESHOLD,
    on_split: Callable[[Any, Mapping[str, np.ndarray]], dict] | None = None,
    batches: list[dict[str, np.ndarray]] | None = None,
) -> dict[str, Any]:
    """Do JAX and torch compute the same gradient at the same weights?

    Where `fp32_agreement` compares two runs that may drift apart through
    the training dynamics, this separates the frameworks from the dynamics:
    it trains the float32 stable torch run of `config` step by step and,
    before each step, loads torch's current weights into the JAX model
    (``task.jax_parts``) and takes both frameworks' gradients of the loss on
    that step's batch; per parameter the relative difference
    ``|g_jax - g_torch| / |g_torch|`` (norms; 0 where both are 0). It stops
    at the first step where one exceeds `threshold`. The torch gradients are
    brought to the JAX layout by ``task.jax_parts`` too (a state dict with
    the gradients in the parameters' places), so the task's converter must
    be linear in the parameters (transposes and reshapes are).

    Args:
      task, config: the task and a float32 stable config (its schedule and
        batches; the first `steps` are compared).
      threshold: the relative difference that counts as a split.
      on_split: optional ``on_split(torch_model, numpy_batch) -> dict``,
        called at the split (weights before that step); its entries go into
        the split.
      batches: the run's first batches if the caller has them (else drawn
        with ``task.train_batches(config)``, all ``config.steps`` of them).

    Returns:
      ``{"steps": steps compared, "max_relative_difference": the largest
      before the split (over all steps if none), "split": None or {"step",
      "param" (the worst, JAX path), "relative_difference", ...}}``.

    Example:
        >>> from examples.detection.task import TASK
        >>> cfg = TASK.get_config(steps=3, eval_images=4)
        >>> out = gradient_agreement(TASK, cfg, 2)
        >>> out["steps"], out["split"], out["max_relative_difference"] < 1e-5
        (2, None, True)
    """
    import jax
    import jax.numpy as jnp

    if config.precision != "float32" or config.mode != "stable":
        raise ValueError(
            "gradient_agreement compares float32 stable runs; got precision="
            f"{config.precision!r}, mode={config.mode!r}"
        )
    check_int("steps", steps, 1)
    weights = task.initial_weights(config)
    batches = (task.train_batches(config) if batches is None else batches)[:steps]
    parts = task.torch_parts(config, weights)
    model = parts.model
    train_step, scheduler = _torch_stable(config, parts)
    first = task.jax_parts(config, weights)

    def loss_only(params, model_state, batch):
        out, _ = first.loss_fn(params, model_state, batch)
        return out[0] if first.has_aux else out

    grad_fn = jax.jit(jax.grad(loss_only))

    def relative(a, b):
        b_norm = jnp.linalg.norm(b)
        return float(jnp.linalg.norm(a - b) / jnp.where(b_norm > 0, b_norm, 1.0))

    largest = 0.0
    for step, batch in enumerate(batches):
        torch_batch = parts.to_torch(batch)
        model.zero_grad()
        loss = parts.loss_fn(model, torch_batch)
        (loss[0] if isinstance(loss, tuple) else loss).backward()
        state = model.state_dict()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        now = task.jax_parts(config, state)
        theirs = task.jax_parts(config, {**state, **grads}).params
        ours = grad_fn(now.params, now.model_state, jax.tree.map(jnp.asarray, batch))
        rel = jax.tree.map(relative, ours, theirs)
        path, worst = max(
            jax.tree_util.tree_leaves_with_path(rel), key=lambda kv: kv[1]
        )
        if worst > threshold:
            split = dict(
                step=step,
                param=jax.tree_util.keystr(path, simple=True, separator="."),
                relative_difference=worst,
            )
            if on_split is not None:
                split.update(on_split(model, batch))
            return dict(steps=step + 1, max_relative_difference=largest, split=split)
        largest = max(largest, worst)
        model.zero_grad()
        record = train_step(torch_batch)
        if scheduler is not None and record["finite"]:
            scheduler.step()
    return dict(steps=len(batches), max_relative_difference=largest, split=None)


def metric_lines(result: RunResult) -> list[str]:
    """The ``metrics.jsonl`` lines of one run (non-finite floats as null).

    Each line: framework, precision, mode, then the `fit` record (step, loss,
    grad_norm, loss_scale, finite, skipped_total, time_s).

    Example:
        >>> r = RunResult("jax", BaseConfig(), [dict(
        ...     step=0, loss=float("nan"), grad_norm=1.0, loss_scale=1.0,
        ...     finite=False, skipped_total=0, time_s=0.5)], 0, float("nan"), 0,
        ...     {}, 0.1)
        >>> line = json.loads(metric_lines(r)[0])
        >>> line["framework"], line["loss"], line["finite"], len(line)
        ('jax', None, False, 10)
    """
    c = result.config
    lines = []
    for m in result.metrics:
        rec = {"framework": result.framework, "precision": c.precision}
        rec["mode"] = c.mode
        for key, value in m.items():
            rec[key] = _jsonable(value)
        lines.append(json.dumps(rec, allow_nan=False))
    return lines


def _jsonable(value: Any) -> Any:
    # Strict JSON: nan/inf become null, nested records (fit's "location")
    # keep their shape, strings (fit's "skip_reason") and ints stay.
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return json_float(value)


def plot_curves(runs: list[RunResult], path: str) -> None:
    """Writes ``curves.png``: loss, loss scale and grad norm vs step, per run.

    Non-finite steps are marked with an x on the top edge of each panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import transforms as mtransforms

    colors = {
        ("jax", "float32"): "#9ecae1",
        ("jax", "low"): "#08519c",
        ("torch", "float32"): "#fdae6b",
        ("torch", "low"): "#a63603",
    }
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    panels = (("loss", "loss (train batch)"), ("loss_scale", "loss scale"))
    panels += (("grad_norm", "grad norm (pre-clip)"),)
    for ax, (key, title) in zip(axes, panels, strict=True):
        edge = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
        for r in runs:
            low = "float32" if r.config.precision == "float32" else "low"
            color = colors[(r.framework, low)]
            style = "--" if r.config.mode == "naive" else "-"
            steps = [m["step"] for m in r.metrics]
            ys = [m[key] if math.isfinite(m[key]) else math.nan for m in r.metrics]
            ax.plot(steps, ys, style, color=color, lw=1.4, label=r.name)
            bad = [m["step"] for m in r.metrics if not m["finite"]]
            if bad:
                ax.plot(
                    bad,
                    [0.97] * len(bad),
                    "x",
                    color=color,
                    ms=7,
                    transform=edge,
                    clip_on=False,
                )
        ax.set_yscale("log")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3, which="both")
    broken = [
        f"{r.name}: non-finite at step {r.first_nonfinite_step}, "
        f"stopped after step {len(r.metrics) - 1}"
        for r in runs
        if r.first_nonfinite_step is not None
    ]
    if broken:  # a few steps at the left edge are easy to miss: say it
        axes[0].text(
            0.98,
            0.55,
            "\n".join(broken),
            transform=axes[0].transAxes,
            ha="right",
            fontsize=8,
            bbox=dict(facecolor="white", alpha=0.8, edgecolor="0.7"),
        )
    axes[0].legend(fontsize=8, ncol=2)
    axes[0].set_title("x on the top edge: non-finite step (grads or new params)")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(x: Any, spec: str) -> str:
    """`x` formatted, "nan" for a non-finite float, "n/a" for None.

    Example:
        >>> fmt(0.12345, ".3f"), fmt(float("nan"), ".3f"), fmt(None, ".3f")
        ('0.123', 'nan', 'n/a')
    """
    if x is None:
        return "n/a"
    if isinstance(x, float) and not math.isfinite(x):
        return "nan"
    return format(x, spec)


def _table(runs: list[RunResult], metrics: tuple[str, ...]) -> str:
    head = (
        "| framework | precision | mode | steps | first non-finite step | "
        "final loss | skipped | "
        + " | ".join(f"held-out {m}" for m in metrics)
        + " | steps/s |\n"
        + "|---" * (8 + len(metrics))
        + "|\n"
    )
    rows = []
    for r in runs:
        s = r.summary()
        first = s["first_nonfinite_step"]
        scores = " | ".join(fmt(s[m], ".3f") for m in metrics)
        rows.append(
            f"| {s['framework']} | {s['precision']} | {s['mode']} | {s['steps']} | "
            f"{'-' if first is None else first} | {fmt(s['final_loss'], '.4f')} | "
            f"{s['skipped_total']} | {scores} | {fmt(s['steps_per_s'], '.1f')} |"
        )
    return head + "\n".join(rows) + "\n"


def _short_report(text: str, rows: int = 8) -> str:
    """The count lines of a diagnostics report and the first `rows` of each table."""
    out, kept = [], 0
    for line in text.splitlines():
        starts = ("Adam", "non-finite", "Cause observed")
        if "entries non-finite" in line or line.startswith(starts):
            out.append(line)
            kept = 0
        elif kept < rows + 2:  # header lines + rows
            out.append(line)
            kept += 1
        elif kept == rows + 2:
            out.append("  ...")
            kept += 1
    return "\n".join(out)


def location_text(r: RunResult) -> str:
    """``format_location`` of the run's located step ("" when none was located).

    Both frameworks render the same text; the run's own module does it.

    Example:
        >>> r = RunResult("torch", BaseConfig(), [], 0, 1.0, 0, {}, 1.0,
        ...               location=dict(phase="input", path="image", op=None,
        ...                             source=None, detail="NaN in batch['image']"),
        ...               location_step=0)
        >>> print(location_text(r))
        non-finite value first in phase 'input' at image
          cause: NaN in batch['image']
    """
    if r.location_step is None:
        return ""
    if r.framework == "jax":
        from jaxstable import diagnostics
    else:
        from torchref import diagnostics
    if r.location is None:
        return (
            "all finite: re-run op by op, the step gave no non-finite value "
            "(it did in the run)"
        )
    return diagnostics.format_location(diagnostics.NonFiniteLocation(**r.location))


def _location_block(r: RunResult) -> list[str]:
    """The report lines of what ``diagnostics.locate`` found for `r`."""
    if r.location_step is None:
        return []
    what = (
        "the first non-finite step"
        if r.config.mode == "naive"
        else "the first step the guards skipped"
    )
    return [
        f"Where ({what}, step {r.location_step}; `diagnostics.locate`):",
        "",
        "```text",
        location_text(r),
        "```",
        "",
    ]


def _next_loss(r: RunResult) -> str:
    i = r.first_nonfinite_step + 1
    return fmt(r.metrics[i]["loss"], ".4g") if i < len(r.metrics) else "n/a"


def explain(task: Any, runs: list[RunResult], agreement: float | None) -> str:
    """The "what happened" paragraphs of ``report.md``, from the observed numbers."""
    key = task.metrics[0]
    parts = []
    for r in runs:
        if r.config.mode != "naive":
            continue
        if r.first_nonfinite_step is None:
            parts.append(
                f"- **{r.name}** stayed finite for its {len(r.metrics)} steps "
                f"(final loss {fmt(r.final_loss, '.4f')}, {key} "
                f"{fmt(r.scores[key], '.3f')}): no failure observed at these settings."
            )
            continue
        lines = r.non_finite_report.splitlines()
        counts = "; ".join(ln for ln in lines if "entries non-finite" in ln)
        adam = next((ln for ln in lines if ln.startswith("Adam")), "")
        cause = next((ln for ln in lines if ln.startswith("Cause observed")), "")
        adam = f"{cause} {adam}".strip()
        m0 = r.metrics[r.first_nonfinite_step]
        where = location_text(r).split("\n")[0]
        where = f" `diagnostics.locate`: {where}." if where else ""
        parts.append(
            f"- **{r.name}** became non-finite at step "
            f"{r.first_nonfinite_step} (loss there {fmt(m0['loss'], '.4f')}, "
            f"loss of the next step {_next_loss(r)}): {counts}. {adam}{where} "
            f"The run stopped {r.config.stop_after_nonfinite} steps later: nothing "
            "more can be learned from NaN weights."
        )
    for r in runs:
        if r.config.mode != "naive" and r.first_nonfinite_step is not None:
            parts.append(
                f"- **{r.name}** became non-finite at step {r.first_nonfinite_step} "
                "despite the guards (see its report below)."
            )
    ref = {
        r.framework: r
        for r in runs
        if r.config.precision == "float32" and r.config.mode == "stable"
    }
    for r in runs:
        if r.config.mode != "stable" or r.config.precision == "float32":
            continue
        base = ref.get(r.framework)
        gap = ""
        if base is not None:
            gap = (
                f" vs {fmt(base.scores[key], '.3f')} for its float32 run "
                f"(difference {fmt(r.scores[key] - base.scores[key], '+.3f')})"
            )
        scale = (
            "dynamic loss scale"
            if r.config.precision == "float16"
            else "no loss scale (bfloat16 has float32's range)"
        )
        parts.append(
            f"- **{r.name}** (float32 params, {r.config.precision} compute, "
            f"{task.stable_loss}, {scale}, clip at {r.config.max_grad_norm}, "
            f"skip non-finite): "
            + ("finite throughout" if r.first_nonfinite_step is None else "BROKE")
            + f", {r.skipped_total} step(s) skipped, held-out {key} "
            f"{fmt(r.scores[key], '.3f')}{gap}."
        )
    if agreement is not None:
        parts.append(
            f"- float32 JAX vs torch from the same weights and batches: "
            f"max relative loss difference over the first "
            f"{min(AGREEMENT_STEPS, runs[0].config.steps)} steps = "
            + (
                f"{agreement:.2e}."
                if math.isfinite(agreement)
                else "undefined (a float32 run stopped early, or a loss there "
                "was non-finite or zero)."
            )
        )
    parts.append(
        "- Step rates are CPU numbers (`fit`'s per-step `time_s`). torch's CPU "
        "convolution in float16/bfloat16 (autocast or `.half()`) is 8x (32x32, "
        "width 8) to 80x (64x64, width 16) slower than in float32 on this CPU "
        "(examples/segmentation/TIMINGS.md): the torch low-precision rates are a "
        "CPU artefact, not a cost of the method; XLA's CPU convolution costs about "
        "the same in all three dtypes. JAX rates leave out the first step "
        "(compile). Naive runs that stopped early are timed over a few steps only."
    )
    return "\n".join(parts) + "\n"


def write_report(
    task: Any, out: str, runs: list[RunResult], summary: dict[str, Any], command: str
) -> str:
    """Writes ``report.md`` (table, plot, explanation, first bad step's report)."""
    from examples import devices

    agreement = fp32_agreement(runs)  # NaN (not null) when undefined: said so
    c = runs[0].config
    text = [
        f"# {summary['task']}: naive vs stable {summary['precision']}, JAX and PyTorch",
        "",
        f"Command: `{command}`  ",
        f"Wall time: {summary['wall_time_s']:.0f} s on this machine "
        f"({os.cpu_count()} CPU cores, shared).  ",
        f"Setup: {task.describe(c)}; batch {c.batch_size}; {c.optimizer} lr "
        f"{c.learning_rate:g} (b1 {c.b1}, b2 {c.b2}, eps {c.eps:g}); seed {c.seed}; "
        f"held-out {', '.join(task.metrics)} on {c.eval_images} images. Every run "
        "starts from the same torch-initialised weights and reads the same "
        "batches; every run is a `jaxstable.train.fit` / `torchref.train.fit`.",
        "",
        _table(runs, task.metrics),
        "![curves](curves.png)",
        "",
        "## What happened",
        "",
        explain(task, runs, agreement),
    ]
    text += devices.devices_report(summary)
    for r in runs:
        if r.non_finite_report:
            text += [
                f"### Diagnostics of the first non-finite step: {r.name} "
                f"(step {r.first_nonfinite_step})",
                "",
                *_location_block(r),
                "```",
                _short_report(r.non_finite_report),
                "```",
                "",
            ]
        elif r.location_step is not None:  # skipped steps, the model intact
            text += [f"### Where the first skipped step went non-finite: {r.name}", ""]
            text += _location_block(r)
    path = os.path.join(out, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(text))
    return path


def train_and_evaluate(
    task: Any,
    framework: str,
    config: BaseConfig,
    *,
    weights: Mapping[str, Any] | None = None,
    batches: list[dict[str, np.ndarray]] | None = None,
    heldout: Any = None,
    progress: bool = True,
    log: Callable[[dict[str, Any]], None] | None = None,
) -> RunResult:
    """One run of `task` in `framework` (``"jax"`` or ``"torch"``).

    What the task does not get passed (initial weights, batches, held-out
    set) is drawn from `config`; ``log`` is called with each `fit` record.
    """
    check_choice("framework", framework, ("jax", "torch"))
    weights = task.initial_weights(config) if weights is None else weights
    batches = task.train_batches(config) if batches is None else batches
    heldout = task.heldout_set(config) if heldout is None else heldout
    run = run_jax if framework == "jax" else run_torch
    return run(task, config, weights, batches, heldout, progress=progress, log=log)


def compare(task: Any, base: BaseConfig, precision: str, out: str, *,
            command: str = "", progress: bool = True,
            one_device_reference: bool = False) -> dict[str, Any]:  # fmt: skip
    """Runs the plan of `task`, writes the four outputs, returns the summary.

    Writes into `out`:

    * ``metrics.jsonl``: one line per run per step (framework, precision,
      mode and the `fit` record: step, loss, grad_norm, loss_scale, finite,
      skipped_total, time_s; null = non-finite);
    * ``summary.json``: ``{"task", "precision", "metrics", "runs": [...],
      "fp32_agreement", "config", "wall_time_s"}``, each run with the task's
      held-out metrics and ``location``: ``{"step", "phase", "path", "op",
      "detail"}`` of what ``diagnostics.locate`` found for its first
      non-finite step (naive) or first skipped step (stable), else None;
      with ``base.devices > 1`` each run also carries ``replicas``
      (`examples.devices.replica_check`), and with ``one_device_reference`` the plan
      runs again on one device and ``"one_device"`` holds
      `examples.devices.one_device_agreement`;
    * ``curves.png``: loss, loss scale and gradient norm per step;
    * ``report.md``: the table, the plot, what failed where and why, and for
      each run that went non-finite what ``diagnostics.locate`` found, above
      the diagnostics table of its first non-finite step.
    """
    from examples import devices

    t0 = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    batches = task.train_batches(base)
    heldout = task.heldout_set(base)
    weights = task.initial_weights(base)
    runs = []
    for fw, p, mode in run_plan(precision):
        cfg = base.replace(precision=p, mode=mode)
        runs.append(
            train_and_evaluate(
                task,
                fw,
                cfg,
                weights=weights,
                batches=batches,
                heldout=heldout,
                progress=progress,
            )
        )
    with open(os.path.join(out, "metrics.jsonl"), "w", encoding="utf-8") as f:
        for r in runs:
            f.writelines(line + "\n" for line in metric_lines(r))
    agreement = fp32_agreement(runs)
    summary = {
        "task": task.name,
        "precision": precision,
        "metrics": list(task.metrics),
        "runs": [r.summary() for r in runs],
        "fp32_agreement": None if agreement is None else json_float(agreement),
        "config": base.as_dict(),
    }
    if one_device_reference and base.devices > 1:
        refs = [
            train_and_evaluate(task, fw, base.replace(precision=p, mode=mode,
                               devices=1), weights=weights, batches=batches,
                               heldout=heldout, progress=progress)
            for fw, p, mode in run_plan(precision)
        ]  # fmt: skip
        summary["one_device"] = devices.one_device_agreement(runs, refs)
    plot_curves(runs, os.path.join(out, "curves.png"))
    summary["wall_time_s"] = time.perf_counter() - t0
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, allow_nan=False)
        f.write("\n")
    summary["report"] = write_report(task, out, runs, summary, command)
    return summary


# --------------------------------------------------------------------------
# Command line

# The options every task has: (flag, config field, type).
_OPTIONS = (
    ("--steps", "steps", int),
    ("--batch-size", "batch_size", int),
    ("--image-size", "image_size", int),
    ("--width", "width", int),
    ("--lr", "learning_rate", float),
    ("--seed", "seed", int),
)


def parse_args(
    tasks: Mapping[str, Any], argv: list[str] | None = None, demo: str | None = None
) -> argparse.Namespace:
    """``TASK [options]``; ``demo`` (if given) is that task with its defaults.

    Returns the namespace with ``task`` (the TASK object), ``name``,
    ``precision``, ``out``, ``quick``, ``no_progress``, ``devices``,
    ``one_device_reference``, ``gradient_agreement`` and the config fields
    of :data:`_OPTIONS` and ``optimizer``. ``--devices`` > 1 is refused
    (exit 2, naming the tasks that have it) for a task without
    ``multi_device = True``, and with ``--gradient-agreement``.
    """
    parser = argparse.ArgumentParser(
        prog="compare.py",
        description="Naive vs stable low-precision training in JAX and PyTorch, "
        "one task at a time (outputs: metrics.jsonl, summary.json, curves.png, "
        "report.md).",
    )
    sub = parser.add_subparsers(dest="name", required=True, metavar="TASK")
    entries = [(name, task, task.help) for name, task in tasks.items()]
    if demo is not None:
        entries.append(
            (
                "demo",
                tasks[demo],
                f"the {demo} comparison with the defaults (make demo)",
            )
        )
    for name, task, text in entries:
        p = sub.add_parser(name, help=text, description=text)
        defaults = task.get_config()
        p.add_argument(
            "--precision",
            choices=list(PRECISIONS),
            default="float16",
            help="low precision of the naive and stable runs (default float16)",
        )
        for flag, field, kind in _OPTIONS:
            p.add_argument(
                flag, dest=field, type=kind, default=getattr(defaults, field)
            )
        p.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer)
        p.add_argument(
            "--out",
            default=os.path.join("runs", name),
            help="output folder (created)",
        )
        quick = ", ".join(f"{k}={v}" for k, v in task.quick.items())
        p.add_argument("--quick", action="store_true", help=f"tiny smoke run: {quick}")
        p.add_argument(
            "--eval-every",
            type=int,
            default=None,
            metavar="K",
            help="also evaluate on the held-out set every K steps (metrics.jsonl)",
        )
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
        p.add_argument(
            "--gradient-agreement",
            action="store_true",
            help="instead of the comparison: JAX's and torch's gradients at the "
            f"same weights over the first {AGREEMENT_STEPS} steps of the float32 "
            "stable run, printed as JSON (gradient_agreement)",
        )
        _add_device_options(p)
        p.set_defaults(task=task)
    args = parser.parse_args(argv)
    if args.gradient_agreement and args.devices > 1:
        parser.error("--gradient-agreement runs on one device; drop --devices")
    if args.devices > 1 and not getattr(args.task, "multi_device", False):
        supported = [n for n, t in tasks.items() if getattr(t, "multi_device", False)]
        parser.error(
            f"--devices {args.devices}: task {args.name!r} runs on one device "
            f"only; --devices > 1 is supported for {supported}"
        )
    return args


def _add_device_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        metavar="N",
        help="data parallel over N devices: JAX on N devices (N forced host "
        "CPU devices on a CPU machine, the first N accelerators otherwise), "
        "torch in N DDP processes (gloo); the batch size must be a multiple "
        "of N",
    )
    p.add_argument(
        "--one-device-reference",
        action="store_true",
        help="with --devices N: run the plan on one device too and report "
        "the agreement of every run with it",
    )


def base_config(args: argparse.Namespace) -> BaseConfig:
    """The float32 stable config of the command line (``--quick`` shrinks it)."""
    settings = {field: getattr(args, field) for _, field, _ in _OPTIONS}
    settings["optimizer"] = args.optimizer
    settings["eval_every"] = args.eval_every
    settings["devices"] = args.devices
    if args.quick:
        settings.update(args.task.quick)
    return args.task.get_config(**settings)


def main(
    tasks: Mapping[str, Any], argv: list[str] | None = None, demo: str | None = None
) -> int:
    """Entry point of ``compare.py``; prints the table and where the report is."""
    import sys

    from examples import devices

    args = parse_args(tasks, argv, demo)
    command = "python examples/compare.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    task = args.task
    base = base_config(args)  # validated before JAX starts
    if args.gradient_agreement:
        steps = min(AGREEMENT_STEPS, base.steps)
        out = gradient_agreement(task, base, steps)
        print(json.dumps({"task": args.name, "threshold": GRADIENT_THRESHOLD, **out}))
        return 0
    devices.force_host_devices(base.devices)
    summary = compare(
        task,
        base,
        args.precision,
        args.out,
        command=command,
        progress=not args.no_progress,
        one_device_reference=args.one_device_reference,
    )
    print(f"\nwall time {summary['wall_time_s']:.0f} s")
    for r in summary["runs"]:
        scores = "  ".join(f"{m} {fmt(r[m], '.3f')}" for m in task.metrics)
        print(
            f"  {r['framework']:<5} {r['precision']:<8} {r['mode']:<6} "
            f"steps {r['steps']:>4}  first non-finite {r['first_nonfinite_step']}  "
            f"final loss {fmt(r['final_loss'], '.4f')}  {scores}"
        )
    print(f"fp32_agreement {summary['fp32_agreement']}")
    for a in summary.get("one_device", []):
        print(
            f"  vs 1 device: {a['run']:<22} max rel loss diff "
            f"{fmt(a['max_rel_loss_diff'], '.2e')}  same skips {a['same_decisions']}"
        )
    print(f"report: {summary['report']}")
    return 0
