"""Settings of the segmentation example, shared by the JAX and the torch loops.

Configs are plain functions returning settings, as in the flax examples:
:func:`get_config` returns the float32 default; a mixed-precision run is the
same config with ``precision`` (and ``mode``) overridden::

    cfg = get_config()                                   # float32 reference
    cfg = get_config(precision="float16", mode="naive")  # what users ran
    cfg = get_config(precision="float16")                # the stable recipe

The defaults are sized for a 2-core CPU (``examples/segmentation/TIMINGS.md``):
32x32 images, batch 8, a width-8 depth-2 U-Net, 400 Adam steps at lr 2e-3; torch's CPU
convolution in fp16/bf16 is ~8x (32x32) to 80x (64x64, width 16) slower than
in float32, which bounds the image size.

This module also holds what both loops share and that needs no framework: the
data-set settings derived from a config, the train batches and held-out set,
and the :class:`RunResult` both loops return.

Example:
    >>> cfg = get_config(precision="float16", mode="naive", steps=10)
    >>> cfg.precision, cfg.mode, cfg.steps, cfg.image_size
    ('float16', 'naive', 10, 32)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from examples.segmentation import data

PRECISIONS = ("float32", "bfloat16", "float16")
MODES = ("naive", "stable")
OPTIMIZERS = ("adam", "adamw", "sgd")
IGNORE_INDEX = 255
# The per-step metrics of both train steps (jaxstable.train / torchref.train).
METRIC_KEYS = ("loss", "grad_norm", "loss_scale", "finite", "skipped_total")


def _check_choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name} must be one of {list(valid)}, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_positive(name: str, value: Any) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Every setting of one training run (frozen; build with :func:`get_config`).

    Attributes:
      image_size: square image side in pixels (divisible by ``2**depth``).
      batch_size: images per train step.
      num_classes: classes including the background.
      boundary_width: ignored band (label 255) along object boundaries, px.
      ignore_fraction: target fraction of ignored pixels per image.
      width, depth: U-Net width (channels of level 0) and number of levels.
      steps: optimizer steps.
      learning_rate: optimizer step size.
      optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"`` (momentum 0.9).
      b1, b2, eps: Adam's moments and epsilon (torch's and optax's defaults).
      weight_decay: AdamW's decoupled weight decay (ignored by adam and sgd).
      seed: seeds the initial weights (torch's init) and the data.
      precision: compute dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
      mode: ``"stable"`` (float32 params, low-precision compute, float32
        cross-entropy, dynamic loss scaling for float16, clipping, skip
        non-finite) or ``"naive"`` (params, optimizer state, compute and loss
        in the low-precision dtype, no guards).
      max_grad_norm: global-norm clip of the stable mode (None: no clip).
      eval_images: held-out images for the mIoU.
      eval_batch_size: images per evaluation forward pass.
      stop_after_nonfinite: once the model has become non-finite, run this
        many more steps and stop (nothing more is learned from NaN weights).
      torch_threads: ``torch.set_num_threads`` for the torch loop (1 was
        4-8x faster than 2 on the shared 2-core box, see TIMINGS.md).

    Example:
        >>> Config(optimizer="rmsprop")
        Traceback (most recent call last):
        ...
        ValueError: optimizer must be one of ['adam', 'adamw', 'sgd'], got 'rmsprop'
    """

    image_size: int = 32
    batch_size: int = 8
    num_classes: int = 6
    boundary_width: int = 1
    ignore_fraction: float = 0.15
    width: int = 8
    depth: int = 2
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
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("mode", self.mode, MODES)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        for name, minimum in (
            ("image_size", 8),
            ("batch_size", 1),
            ("num_classes", 2),
            ("boundary_width", 0),
            ("width", 1),
            ("depth", 1),
            ("steps", 0),
            ("seed", 0),
            ("eval_images", 1),
            ("eval_batch_size", 1),
            ("stop_after_nonfinite", 0),
            ("torch_threads", 1),
        ):
            _check_int(name, getattr(self, name), minimum)
        if self.image_size % 2**self.depth:
            raise ValueError(
                f"image_size={self.image_size} must be divisible by "
                f"2**depth={2**self.depth}"
            )
        _check_positive("learning_rate", self.learning_rate)
        _check_positive("eps", self.eps)
        if self.max_grad_norm is not None:
            _check_positive("max_grad_norm", self.max_grad_norm)
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")

    @property
    def policy(self) -> str:
        """The jmp policy string of the stable mode.

        Example:
            >>> get_config(precision="bfloat16").policy
            'params=float32,compute=bfloat16,output=float32'
        """
        return f"params=float32,compute={self.precision},output=float32"

    @property
    def label(self) -> str:
        """``"<precision> <mode>"``, e.g. for progress bars.

        Example:
            >>> get_config(precision="float16", mode="naive").label
            'float16 naive'
        """
        return f"{self.precision} {self.mode}"


def get_config(**overrides: Any) -> Config:
    """The default (float32, stable) config with `overrides` applied.

    Args:
      **overrides: any :class:`Config` field, e.g. ``precision="float16"``.

    Returns:
      A validated, frozen :class:`Config`.

    Raises:
      ValueError: an unknown field (the message lists the valid ones) or a
        bad value.

    Example:
        >>> get_config(precision="float16").precision
        'float16'
        >>> get_config(lr=0.1)
        Traceback (most recent call last):
        ...
        ValueError: unknown config field(s) ['lr']; valid fields: ['image_size', ...
    """
    fields = [f.name for f in dataclasses.fields(Config)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown}; valid fields: {fields}")
    return Config(**overrides)


def data_config(config: Config) -> data.SegmentationConfig:
    """The synthetic data set of a run.

    Example:
        >>> d = data_config(get_config(image_size=16))
        >>> d.height, d.width, d.boundary_width
        (16, 16, 1)
    """
    return data.SegmentationConfig(
        height=config.image_size,
        width=config.image_size,
        num_classes=config.num_classes,
        boundary_width=config.boundary_width,
        ignore_fraction=config.ignore_fraction,
        ignore_index=IGNORE_INDEX,
    )


def train_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """The ``config.steps`` train batches (NHWC float32 images, int32 labels).

    Drawn once so that every run of a comparison reads the very same arrays.

    Example:
        >>> b = train_batches(get_config(image_size=16, batch_size=2, steps=3))
        >>> len(b), b[0]["image"].shape
        (3, (2, 16, 16, 3))
    """
    d = data_config(config)
    return list(data.batches(d, "train", config.batch_size, config.seed, config.steps))


def heldout_set(config: Config) -> dict[str, np.ndarray]:
    """The held-out evaluation images and labels (``config.eval_images``).

    Example:
        >>> heldout_set(get_config(image_size=16, eval_images=4))["label"].shape
        (4, 16, 16)
    """
    return data.make_dataset(
        data_config(config), "heldout", config.eval_images, config.seed
    )


@dataclasses.dataclass
class RunResult:
    """What one training run returns (both frameworks).

    Attributes:
      framework: ``"jax"`` or ``"torch"``.
      config: the run's :class:`Config`.
      metrics: one dict per step taken: ``step`` (0-based), ``loss``,
        ``grad_norm``, ``loss_scale``, ``finite``, ``skipped_total``
        (python numbers; non-finite floats stay float nan/inf).
      first_nonfinite_step: the first step after which the model was broken:
        its loss was non-finite or its parameters were after the update
        (None if never). A stable run's *skipped* steps (loss-scale
        overflow, caught before the update) do not count: they are in
        ``skipped_total``.
      final_loss: loss of the last step taken.
      skipped_total: steps whose update the guards skipped (0 for naive).
      miou: held-out mean IoU in eval mode; nan when the model's held-out
        logits are non-finite (there is no prediction to score).
      steps_per_s: train steps per second, from the second step on (the
        first includes JAX's compile).
      non_finite_report: text of the diagnostics report of the first broken
        step (gradients, updates, new parameters; and, with Adam, how many
        second-moment entries were 0 for a non-zero gradient); "" if none.
      stopped_early: the run stopped ``stop_after_nonfinite`` steps after
        ``first_nonfinite_step`` instead of running ``config.steps``.
    """

    framework: str
    config: Config
    metrics: list[dict[str, Any]]
    first_nonfinite_step: int | None
    final_loss: float
    skipped_total: int
    miou: float
    steps_per_s: float
    non_finite_report: str = ""
    stopped_early: bool = False

    def summary(self) -> dict[str, Any]:
        """The run's line of ``summary.json`` (non-finite floats as None).

        Example:
            >>> r = RunResult("jax", get_config(), [], None, float("nan"), 0, 0.5, 10.0)
            >>> r.summary()["final_loss"], r.summary()["mode"]
            (None, 'stable')
        """
        return {
            "framework": self.framework,
            "precision": self.config.precision,
            "mode": self.config.mode,
            "steps": len(self.metrics),
            "first_nonfinite_step": self.first_nonfinite_step,
            "final_loss": json_float(self.final_loss),
            "skipped_total": int(self.skipped_total),
            "miou": json_float(self.miou),
            "steps_per_s": json_float(self.steps_per_s),
        }


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


def run_steps(
    config: Config,
    batches: list[dict[str, np.ndarray]],
    step_fn: Any,
    report_fn: Any,
    *,
    desc: str,
    log: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The bookkeeping both loops share: timing, progress bar, early stop.

    Runs ``record, broken = step_fn(batch)`` for each batch (the record holds
    ``loss, grad_norm, loss_scale, finite, skipped_total`` as python numbers;
    `broken` says the model is non-finite after the step). At the first
    broken step, ``report_fn()`` is called at once (before the next step
    changes anything) and its text kept; ``config.stop_after_nonfinite``
    steps later the loop stops.

    Args:
      config: the run's config.
      batches: the train batches (at most ``config.steps`` are used).
      step_fn: ``step_fn(batch) -> (record, broken)``; must block until the
        step is done (its wall time is measured around the call).
      report_fn: ``report_fn() -> str``, the diagnostics of the broken step.
      desc: progress-bar label.
      log: None or a callable receiving each record (with ``step``).
      progress: show a tqdm bar.

    Returns:
      ``{"metrics", "first_nonfinite_step", "report", "times",
      "stopped_early"}``.

    Example:
        >>> cfg = get_config(steps=4, stop_after_nonfinite=1)
        >>> losses = iter([1.0, float("nan"), float("nan"), float("nan")])
        >>> def step(batch):
        ...     loss = next(losses)
        ...     rec = dict(loss=loss, grad_norm=1.0, loss_scale=1.0,
        ...                finite=loss == loss, skipped_total=0)
        ...     return rec, not rec["finite"]
        >>> out = run_steps(cfg, [{}] * 4, step, lambda: "bad",
        ...                 desc="demo", progress=False)
        >>> len(out["metrics"]), out["first_nonfinite_step"], out["report"]
        (3, 1, 'bad')
    """
    import time

    from tqdm.auto import tqdm

    metrics: list[dict[str, Any]] = []
    times: list[float] = []
    first_bad, report, stopped = None, "", False
    with tqdm(total=config.steps, desc=desc, disable=not progress) as bar:
        for i, batch in enumerate(batches[: config.steps]):
            t0 = time.perf_counter()
            record, broken = step_fn(batch)
            times.append(time.perf_counter() - t0)
            record = {"step": i, **record}
            metrics.append(record)
            if log is not None:
                log(record)
            bar.set_postfix(
                loss=f"{record['loss']:.4g}",
                scale=f"{record['loss_scale']:.3g}",
                skipped=record["skipped_total"],
                refresh=False,
            )
            bar.update(1)
            if broken and first_bad is None:
                first_bad, report = i, report_fn()
            if first_bad is not None and i - first_bad >= config.stop_after_nonfinite:
                stopped = i + 1 < config.steps
                break
    return {
        "metrics": metrics,
        "first_nonfinite_step": first_bad,
        "report": report,
        "times": times,
        "stopped_early": stopped,
    }


def run_result(
    framework: str, config: Config, out: dict[str, Any], miou: float
) -> RunResult:
    """The `RunResult` of a run from what `run_steps` returned (both frameworks).

    Example:
        >>> cfg = get_config(steps=2)
        >>> out = {"metrics": [{"loss": 1.0, "skipped_total": 0}] * 2,
        ...        "first_nonfinite_step": None, "report": "", "times": [0.1, 0.1],
        ...        "stopped_early": False}
        >>> r = run_result("jax", cfg, out, miou=0.5)
        >>> r.final_loss, r.skipped_total, r.miou
        (1.0, 0, 0.5)
    """
    metrics = out["metrics"]
    return RunResult(
        framework=framework,
        config=config,
        metrics=metrics,
        first_nonfinite_step=out["first_nonfinite_step"],
        final_loss=metrics[-1]["loss"] if metrics else float("nan"),
        skipped_total=metrics[-1]["skipped_total"] if metrics else 0,
        miou=miou,
        steps_per_s=step_rate(out["times"]),
        non_finite_report=out["report"],
        stopped_early=out["stopped_early"],
    )


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
      The sentence, or "" when no list is given.

    Example:
        >>> g = [np.array([1e-3, 0.5, 0.0])]
        >>> nu = [np.array([0.0, 2.5e-4, 0.0])]
        >>> note = adam_underflow_note(g, nu, "float16", 1e-8)
        >>> print(note[:73])
        Adam state (float16): nu == 0 for 1 of 2 entries with a non-zero gradient
        >>> "eps=1e-08 is 0 in float16" in note, note.endswith("m / 0 = inf.")
        (True, True)
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
    import ml_dtypes  # numpy dtypes of bfloat16; installed with jax and torch users

    eps_in = float(
        np.asarray(
            eps,
            ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.dtype(dtype_name),
        )
    )
    text = (
        f"Adam state ({dtype_name}): nu == 0 for {hit} of {total} entries with a "
        f"non-zero gradient"
    )
    if hit:
        text += (
            f" (the largest such |g| is {largest:.3g}: (1-b2)*g**2 underflowed to 0)"
        )
    text += f"; eps={eps:g} is {eps_in:g} in {dtype_name}"
    if eps_in == 0 and hit:
        text += ", so m / (sqrt(nu) + eps) = m / 0 = inf"
    return text + "."
