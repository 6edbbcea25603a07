"""What a run returns (`RunResult`) and the text both runners write about it.

`RunResult` is one training run of either framework; :func:`make_result`
builds it from `fit`'s records. The diagnostics text of a broken step
(:func:`report_text`, :func:`adam_underflow_note`) and the number formats
(:func:`json_float`, :func:`fmt`) are framework-free and shared by
`jax_runner`, `torch_runner` and `report`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from examples.harness.config import BaseConfig

# The per-step record keys both fits write (jaxstable/torchref.train.fit).
METRIC_KEYS = ("loss", "grad_norm", "loss_scale", "finite", "skipped_total")


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
      replicas: ``config.devices > 1`` only: ``{"devices",
        "replicas_identical", "ranks_agree"}`` (see
        `examples.harness.devices.replica_check`); None on one device.

    Example:
        >>> r = RunResult("jax", BaseConfig(), [], None, float("nan"), 0,
        ...               {"miou": 0.5}, 10.0)
        >>> r.summary()["final_loss"], r.summary()["miou"]
        (None, 0.5)
    """

    framework: str
    config: BaseConfig
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


def report_text(tree: Mapping[str, Any], diagnostics: Any, size: Callable) -> str:
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


def first_location(history) -> tuple[int | None, dict[str, Any] | None]:
    """(step, location) of the first `fit` record that carries a location."""
    for rec in history:
        if "location" in rec:
            return rec["step"], rec["location"]
    return None, None


def make_result(
    framework, config, history, first_bad, report, scores, located=None
) -> RunResult:
    """The RunResult of a run; ``located``: (step, location) of a naive run,
    else the first location `fit` recorded."""
    step, location = located if located is not None else first_location(history)
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


class Watch:
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
