"""The contract between a task and the harness: `Task`, `JaxParts`, `TorchParts`.

A task is a folder ``examples/<name>/`` whose ``task.py`` defines ``TASK``, a
:class:`Task`. The harness reads nothing else from it: it draws the data and
the initial weights through ``TASK``, asks ``TASK.jax_parts`` /
``TASK.torch_parts`` for the model and losses of each run (a
:class:`JaxParts` / :class:`TorchParts`), and builds everything else itself:
the optimizer, the naive and the stable step, the loops (`fit`), the
diagnostics of the first non-finite step and the outputs. Adding a task adds
a folder and one line in ``compare.py``'s ``TASKS``, no harness code.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from examples.harness.config import BaseConfig, make_config

Batch = dict[str, np.ndarray]


class _OwnPart:
    """A task's function imported at its first call; a module-level class so
    that a `Task` pickles (the `--devices` torch ranks are spawned with it)."""

    def __init__(self, package: str, module: str, function: str) -> None:
        self.package, self.module, self.__name__ = package, module, function

    def __call__(self, *args: Any) -> Any:
        imported = importlib.import_module(f"{self.package}.{self.module}")
        return getattr(imported, self.__name__)(*args)


def own_part(package: str, name: str) -> Callable[..., Any]:
    """``package.MODULE.FUNCTION`` (``name`` = ``"MODULE.FUNCTION"``), imported
    at its first call: a task names its framework parts without importing jax
    or torch (`compare.py --help` starts neither). ``package`` is the task's
    own (``__package__``), so a task can only reach its own modules.

    Example:
        >>> import pickle
        >>> f = own_part("examples.lm", "parts_torch.initial_weights")
        >>> f.__name__, pickle.loads(pickle.dumps(f)).__name__
        ('initial_weights', 'initial_weights')
    """
    module, function = name.rsplit(".", 1)
    return _OwnPart(package, module, function)


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of ``compare.py``: what the harness needs to know about it.

    Attributes:
      name: the CLI name (``"segmentation"``, ``"ocr"``).
      help: one line for ``compare.py --help``.
      metrics: the held-out metric keys the parts' ``evaluate`` returns, in
        summary order; the first is the headline number of the table and
        plot (segmentation ``("miou",)``, OCR ``("hmean", "precision_det",
        "recall_det")``). Each run of ``summary.json`` carries every one.
      config_class: the task's config, a frozen dataclass subclassing
        `BaseConfig` with the task's own fields (values only: its
        ``config.py``).
      quick: the config overrides of ``--quick`` (tiny sizes: a smoke run
        in seconds).
      stable_loss: a few words on the stable run's loss for the report,
        e.g. ``"float32 cross-entropy"``.
      describe: ``describe(config) -> str``, the "Setup:" sentence of
        ``report.md`` (data, model, sizes).
      train_batches: ``train_batches(config) -> list[Batch]``, the
        ``config.steps`` train batches, numpy, NHWC images (float32): every
        run of a comparison reads these very arrays.
      heldout_set: ``heldout_set(config) -> Any``, what the parts'
        ``evaluate`` reads (drawn once per comparison).
      initial_weights: ``initial_weights(config) -> dict[str, torch.Tensor]``,
        the torch model's seeded initial ``state_dict``; both frameworks
        start from it.
      jax_parts: ``jax_parts(config, weights) -> JaxParts``, the JAX model
        and losses of the run ``config`` describes (``config.mode`` and
        ``config.precision``).
      torch_parts: ``torch_parts(config, weights) -> TorchParts``, the same
        for torch.
      check_config: optional, ``check_config(config)`` raises ValueError
        for values of the task's own fields that its data or model cannot
        take (the common fields are checked by `BaseConfig`).
      multi_device: the task runs with ``--devices N``: its torch loss is a
        mean over the GLOBAL batch under DDP (`examples.harness.ddp.global_mean`
        where it averages over a count that varies between ranks); batch
        norms are made global by the harness.
      precision: the default of ``--precision`` (the low precision its users
        train in: ``"float16"``, or ``"bfloat16"`` for the language model).
      heldout_unit: what ``config.eval_images`` counts, for the report
        (``"images"``, ``"windows"``).
      curves: ``(record key, title)`` of `fit` record entries (``aux[...]``
        check points) that ``curves.png`` plots too, one panel each.
      gradient_threshold: optional, the relative gradient difference that
        counts as a split in ``--gradient-agreement`` in place of
        `agreement.GRADIENT_THRESHOLD` (1e-4), for a task with a gradient
        whose float32 value is itself further than that from float64 (say
        so where it is set, with the measurement).
      diagnose: optional, ``diagnose(runs) -> {"text": markdown, ...}``: the
        task's reading of its runs' records (a failure that is not a
        non-finite step, e.g. the language model's attention-logit growth);
        ``summary.json`` holds it as ``diagnosis``, ``report.md`` its text.
      report_sections: optional, ``report_sections(out) -> markdown``: what
        the task adds at the end of ``report.md`` from result files of its
        own in the output folder ``out`` (the lm task's low-precision run
        set, ``low_precision.json``), ``""`` when there are none. The text
        goes between section markers (`sections.put_section` replaces it
        in place when the task's own CLI writes new results).

    Example:
        >>> from examples.segmentation.task import TASK
        >>> TASK.name, TASK.metrics, TASK.get_config(steps=3).steps
        ('segmentation', ('miou',), 3)
    """

    name: str
    help: str
    metrics: tuple[str, ...]
    config_class: type[BaseConfig]
    quick: Mapping[str, Any]
    stable_loss: str
    describe: Callable[[Any], str]
    train_batches: Callable[[Any], list[Batch]]
    heldout_set: Callable[[Any], Any]
    initial_weights: Callable[[Any], dict[str, Any]]
    jax_parts: Callable[[Any, Any], JaxParts]
    torch_parts: Callable[[Any, Any], TorchParts]
    check_config: Callable[[Any], None] | None = None
    multi_device: bool = False
    precision: str = "float16"
    heldout_unit: str = "images"
    curves: tuple[tuple[str, str], ...] = ()
    gradient_threshold: float | None = None
    diagnose: Callable[[list[Any]], dict[str, Any]] | None = None
    report_sections: Callable[[str], str] | None = None

    def __post_init__(self):
        if not (isinstance(self.name, str) and self.name.isidentifier()):
            raise ValueError(f"Task.name must be an identifier, got {self.name!r}")
        metrics = self.metrics
        if not (isinstance(metrics, tuple) and metrics and
                all(isinstance(m, str) for m in metrics)):  # fmt: skip
            raise ValueError(
                f"Task.metrics must be a non-empty tuple of str, got {metrics!r}"
            )
        if not (isinstance(self.config_class, type)
                and issubclass(self.config_class, BaseConfig)):  # fmt: skip
            raise ValueError(
                f"Task.config_class must subclass BaseConfig, got {self.config_class!r}"
            )
        for field in ("describe", "train_batches", "heldout_set", "initial_weights",
                      "jax_parts", "torch_parts"):  # fmt: skip
            if not callable(getattr(self, field)):
                raise ValueError(f"Task.{field} must be callable")
        self.get_config(**self.quick)  # --quick names fields that exist

    def get_config(self, **overrides: Any) -> BaseConfig:
        """The task's default (float32, stable) config with `overrides`, checked.

        Raises:
          ValueError: an unknown field (the message lists the valid ones) or
            a bad value (common checks, then ``check_config``).
        """
        return self.check(make_config(self.config_class, **overrides))

    def check(self, config: BaseConfig) -> BaseConfig:
        """`config` itself once it passes ``check_config``; the harness's
        entry points call it on the configs they are given.

        Raises:
          TypeError: `config` is not this task's ``config_class``.
          ValueError: ``check_config`` refused it.
        """
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"task {self.name!r} takes a {self.config_class.__name__}, got "
                f"{type(config).__name__}"
            )
        if self.check_config is not None:
            self.check_config(config)
        return config


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
        `jax_runner.jax_optimizer` of the config (a task's own recipe: parameter
        groups, schedules); the stable run wraps it in `stable_optimizer`
        (whose skip keeps its state, schedule counts included, on a skipped
        step), the naive run uses it as is.
      eval_params: optional, ``eval_params(params, opt_state) -> params``:
        what the run is evaluated with, e.g. a weight EMA that ``optimizer``
        keeps in its state (detection); None: the params themselves.
      spike_guard: optional, stable runs: ``spike_guard(tx) -> tx`` wraps
        the `stable_optimizer` outermost, e.g. ``functools.partial(
        jaxstable.transforms.skip_spikes, window=64)`` (outermost, it sees
        the pre-clip norm and the train step passes it the loss).
    """

    params: Any
    model_state: Any
    loss_fn: Callable[[Any, Any, Any], tuple[Any, Any]]
    evaluate: Callable[[Any, Any, Any], dict[str, float]]
    probe: Callable[[Any, Any, Any], str] | None = None
    has_aux: bool = False
    optimizer: Any = None
    eval_params: Callable[[Any, Any], Any] | None = None
    spike_guard: Callable[[Any], Any] | None = None


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
        scheduler or None)`` in place of `torch_runner.torch_optimizer` of the
        config (the twin of `JaxParts.optimizer`); the harness calls
        ``scheduler.step()`` after every step that was applied (a skipped
        step leaves the schedule where it was, as on the JAX side).
      spike_guard: optional, stable runs: ``spike_guard(optimizer) ->
        optimizer`` wraps the plain optimizer before `TrainStep` gets it,
        e.g. ``functools.partial(torchref.transforms.skip_spikes,
        window=64)`` (the twin of `JaxParts.spike_guard`).
      ddp: set by the harness on a DDP rank (`examples.harness.ddp`), never
        by a task: the `DistributedDataParallel` wrapper of ``model``. The
        stable `torchref.train.TrainStep` drives it, so that it gets the
        library's data-parallel step (``loss / N`` summed: one device's
        float16 headroom, the global loss in the records).
    """

    model: Any
    loss_fn: Callable[[Any, Any], Any]
    to_torch: Callable[[Mapping[str, np.ndarray]], Any]
    evaluate: Callable[[Any, Any], dict[str, float]]
    probe: Callable[[Any, Any], str] | None = None
    optimizer: Callable[[Any], tuple[Any, Any]] | None = None
    spike_guard: Callable[[Any], Any] | None = None
    ddp: Any = None
