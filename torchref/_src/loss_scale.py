"""Loss scales for PyTorch, mirroring `jaxstable.loss_scale`, built on the REAL
`torch.amp.GradScaler`.

Each loss-scale object is a frozen dataclass with the same constructor
arguments as its JAX twin and a `make_scaler(device)` method that returns a
`torch.amp.GradScaler` configured to behave the same way. The growth/backoff
arithmetic is always GradScaler's own (`torch._amp_update_scale_`); the two
small subclasses here only add what GradScaler lacks:

* `StaticGradScaler`: GradScaler refuses `growth_factor <= 1` and
  `backoff_factor >= 1` (it raises AssertionError), so a constant scale cannot
  be expressed through its constructor. The subclass keeps GradScaler's
  unscale/skip machinery and, in `update()`, re-sets the constant through the
  public `update(new_scale=...)`.
* `DynamicGradScaler`: adds `min_loss_scale` (GradScaler lets the scale fall
  below 1, see its `update()` docstring) and Megatron-style `hysteresis`.
  Both are applied after GradScaler's own update, in place on GradScaler's
  private `_scale` tensor, so no CPU-GPU sync is added per step.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch

from _stablecore.checks import check_count as _check_count
from _stablecore.loss_scale import resolve_factors as _core_resolve_factors
from torchref._src.loss_scale_math import HUGE, TINY, f32

__all__ = [
    "DynamicGradScaler",
    "DynamicLossScale",
    "NoOpLossScale",
    "StaticGradScaler",
    "StaticLossScale",
]


def _check_scale(name: str, value: Any) -> float:
    """A finite float32 normal number > 0, as a float; warns on an integer.

    Same messages as `jaxstable.loss_scale` (parity_tests checks both).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    v32 = (
        torch.tensor(float(value), dtype=torch.float32).item()
        if value <= HUGE
        else math.inf
    )
    if not TINY <= v32 <= HUGE:
        raise ValueError(
            f"{name} must be a float32 normal number, between 2**-126 "
            f"(1.1754944e-38; XLA flushes smaller values to 0) and 3.4028235e+38, "
            f"got {value!r}"
        )
    if isinstance(value, int):
        # jmp warns too; GradScaler would take the int as a float silently.
        warnings.warn(
            f"{name}={value} is an integer; it is used as the float32 {v32!r}: "
            "pass a float to silence this warning",
            UserWarning,
            stacklevel=4,
        )
    return float(value)


def _factor_value(name: str, value: Any, valid: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be {valid}, got {value!r}")
    return float(value)


def _resolve_factors(factor: Any, growth: Any, backoff: Any) -> tuple[float, float]:
    """(growth_factor, backoff_factor) from jmp's ``factor`` and/or
    GradScaler's two (the rules and messages of both frameworks)."""
    return _core_resolve_factors(factor, growth, backoff, _factor_value)


class StaticGradScaler(torch.amp.GradScaler):
    """A `torch.amp.GradScaler` whose scale never changes.

    Everything but `update()` is GradScaler's: `scale`, `unscale_` and
    `step` (which still skips `optimizer.step()` when the unscaled gradients
    hold an Inf/NaN). `update()` consumes the iteration like GradScaler's and
    then writes the constant back with the public ``update(new_scale=...)``,
    because GradScaler's constructor refuses growth_factor <= 1 and
    backoff_factor >= 1.

    Args:
        device: device type of the scale tensor ("cpu" or "cuda").
        loss_scale: the constant scale (> 0).

    Example:
        >>> s = StaticGradScaler("cpu", loss_scale=128.0)
        >>> s.get_scale()
        128.0
    """

    def __init__(self, device: str = "cpu", loss_scale: float = 2.0**15) -> None:
        _check_scale("loss_scale", loss_scale)
        # growth_interval is irrelevant: update() overrides the new scale.
        super().__init__(device, init_scale=float(loss_scale))
        self._static_scale = float(loss_scale)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Ends the iteration; the scale stays at its constant value."""
        if not self._enabled:
            return
        super().update(new_scale)
        # Second call with an explicit value: it only fills the scale tensor
        # (the growth tracker is left at its value, which never matters here).
        super().update(self._static_scale)


class DynamicGradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` plus a floor (`min_loss_scale`) and hysteresis.

    GradScaler's own update runs first, unchanged (growth x `growth_factor`
    after `growth_interval` finite steps in a row, backoff x `backoff_factor`
    on a non-finite one, growth tracker reset to 0 on a non-finite step).
    Then, in place on GradScaler's private float32 `_scale` tensor (so that no
    CPU-GPU sync is added):

    * hysteresis N > 1 (Megatron): a non-finite step only backs off when it is
      at least the N-th non-finite step in a row; earlier ones keep the old
      scale (the growth tracker is still reset to 0, as GradScaler does).
      Any finite step resets the run of non-finite steps.
    * the scale is clamped to >= `min_loss_scale` (compared in float32).

    Like GradScaler, `unscale_` tests the SCALED gradients and then multiplies
    them by 1/scale: with a scale below 1 (a `min_loss_scale` below 1) that
    multiply can overflow after the test. `torchref.train.TrainStep` tests the
    unscaled gradients too in that case and marks the step non-finite, as the
    JAX step does; a hand-written loop must do the same.

    Args:
        device: device type ("cpu" or "cuda").
        init_scale, growth_factor, backoff_factor, growth_interval: as
            `torch.amp.GradScaler`.
        min_loss_scale: floor of the scale (> 0).
        hysteresis: back off on the N-th non-finite step in a row (>= 1).
        counter: initial growth tracker (finite steps already counted).

    Example:
        >>> s = DynamicGradScaler("cpu", init_scale=4.0, min_loss_scale=2.0)
        >>> s.get_scale(), s.min_loss_scale
        (4.0, 2.0)
    """

    def __init__(
        self,
        device: str = "cpu",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        min_loss_scale: float = 1.0,
        hysteresis: int = 1,
        counter: int = 0,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )
        self.min_loss_scale = float(min_loss_scale)
        self.hysteresis = int(hysteresis)
        # GradScaler's constructor has no argument for the initial growth
        # tracker; it reads this (private) attribute when it lazily creates
        # the tracker tensor, as load_state_dict's "_growth_tracker" does.
        self._init_growth_tracker = int(counter)
        # Non-finite steps in a row so far: a device tensor created lazily on
        # the scale's device (like GradScaler's own), from this int.
        self._init_nonfinite_run = 0
        self._nonfinite_run: torch.Tensor | None = None

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """GradScaler's update, then hysteresis and the `min_loss_scale` floor."""
        if not self._enabled:
            return
        if new_scale is not None:
            super().update(new_scale)
            return
        scale, _ = self._check_scale_growth_tracker("update")
        found = [
            f.to(scale.device)
            for st in self._per_optimizer_states.values()
            for f in st["found_inf_per_device"].values()
        ]
        old = scale.clone()
        super().update()  # raises GradScaler's own error if no inf check ran
        found_any = torch.stack(found).sum() > 0
        if self._nonfinite_run is None:
            self._nonfinite_run = torch.full(
                (), self._init_nonfinite_run, dtype=torch.int32, device=scale.device
            )
        run = torch.where(found_any, self._nonfinite_run + 1, 0).to(torch.int32)
        self._nonfinite_run = run
        if self.hysteresis > 1:
            hold = found_any & (run < self.hysteresis)
            scale.copy_(torch.where(hold, old, scale))
        # The floor, in float32 like the scale itself (GradScaler warns that
        # it does not keep the scale >= 1; the JAX twin uses jnp.maximum).
        scale.clamp_(min=self.min_loss_scale)

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's state plus `min_loss_scale`, `hysteresis` and the run."""
        state = super().state_dict()
        if state:
            run = self._nonfinite_run
            state["min_loss_scale"] = self.min_loss_scale
            state["hysteresis"] = self.hysteresis
            state["_nonfinite_run"] = (
                self._init_nonfinite_run if run is None else int(run)
            )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of `state_dict` (also accepts a plain GradScaler state)."""
        if not self._enabled:
            return
        state = dict(state_dict)
        self.min_loss_scale = float(state.pop("min_loss_scale", self.min_loss_scale))
        self.hysteresis = int(state.pop("hysteresis", self.hysteresis))
        self._init_nonfinite_run = int(state.pop("_nonfinite_run", 0))
        super().load_state_dict(state)
        self._nonfinite_run = None  # recreated from the int on the next update


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """No loss scaling: scale 1, a disabled `torch.amp.GradScaler`.

    Maths: ``scaled = loss * 1``; `adjust` never changes anything.

    Example:
        >>> ls = NoOpLossScale()
        >>> ls.loss_scale, ls.make_scaler("cpu").is_enabled()
        (1.0, False)
    """

    @property
    def loss_scale(self) -> float:
        """The scale, 1.0."""
        return 1.0

    def make_scaler(self, device: str = "cpu") -> torch.amp.GradScaler:
        """A `torch.amp.GradScaler(device, enabled=False)`: `step` just steps."""
        return torch.amp.GradScaler(device, enabled=False)


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """A constant loss scale (`StaticGradScaler`).

    Maths: ``scaled = loss * loss_scale`` every step; non-finite steps are
    still skipped by GradScaler's `step`, but the scale never changes.

    Args:
        loss_scale: the constant scale, a float32 normal number (2**-126 to
            3.4e38; default 2**15, as `jaxstable.loss_scale.StaticLossScale`;
            an integer is taken as a float with a warning).

    Example:
        >>> s = StaticLossScale(128.0).make_scaler("cpu")
        >>> s.get_scale(), StaticLossScale().loss_scale
        (128.0, 32768.0)
    """

    loss_scale: float = 2.0**15

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "loss_scale", _check_scale("loss_scale", self.loss_scale)
        )

    def make_scaler(self, device: str = "cpu") -> StaticGradScaler:
        """A `StaticGradScaler` holding `loss_scale`."""
        return StaticGradScaler(device, loss_scale=float(self.loss_scale))


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling, `torch.amp.GradScaler`'s rule with a floor.

    Maths (per step, after GradScaler): finite -> ``counter += 1`` and when
    ``counter == period``: ``scale *= growth_factor`` (only if the result is
    finite) and ``counter = 0``; non-finite -> ``scale *= backoff_factor``
    and ``counter = 0`` (with `hysteresis` N: only on the N-th non-finite
    step in a row); finally ``scale = max(scale, min_loss_scale)``. The
    products are GradScaler's own (float32 scale times the float64 factor,
    rounded to float32). The defaults are GradScaler's (2**16, x2 after 2000
    finite steps, x0.5 on a bad one).

    ``factor`` is jmp's spelling: ``factor=f`` alone means
    ``growth_factor=f, backoff_factor=1/f``; when read, it is the growth
    factor. Arguments are checked with the same messages as
    `jaxstable.loss_scale.DynamicLossScale`; an integer ``loss_scale`` or
    ``min_loss_scale`` is taken as a float with a warning (as jmp warns).

    Args:
        loss_scale: initial scale, a float32 normal number (2**-126 to
            3.4e38), >= `min_loss_scale`.
        counter: finite steps already counted toward growth (0 <= counter < period).
        period: finite steps in a row before growth, ``1 <= period < 2**31``
            (GradScaler's growth tracker is an int32).
        factor: jmp's single factor (> 1) or None.
        min_loss_scale: floor of the scale, a float32 normal number.
        hysteresis: back off only on the N-th non-finite step in a row,
            ``1 <= hysteresis < 2**31``.
        growth_factor: GradScaler's growth factor, > 1 (default 2.0).
        backoff_factor: GradScaler's backoff factor, in (0, 1) (default 0.5,
            or ``1/factor`` when `factor` is given).

    Example:
        >>> ls = DynamicLossScale(loss_scale=1024.0, period=10)
        >>> s = ls.make_scaler("cpu")
        >>> s.get_scale(), s.get_growth_interval(), s.get_backoff_factor()
        (1024.0, 10, 0.5)
        >>> s = DynamicLossScale(growth_factor=2.0, backoff_factor=0.25).make_scaler()
        >>> s.get_growth_factor(), s.get_backoff_factor()
        (2.0, 0.25)
        >>> DynamicLossScale(factor=1)
        Traceback (most recent call last):
        ...
        ValueError: factor must be a finite number > 1, got 1
    """

    loss_scale: float = 2.0**16
    counter: int = 0
    period: int = 2000
    factor: float | None = None
    min_loss_scale: float = 1.0
    hysteresis: int = 1
    growth_factor: float | None = dataclasses.field(default=None, kw_only=True)
    backoff_factor: float | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        scale = _check_scale("loss_scale", self.loss_scale)
        floor = _check_scale("min_loss_scale", self.min_loss_scale)
        _check_count("period", self.period)
        _check_count("hysteresis", self.hysteresis)
        growth, backoff = _resolve_factors(
            self.factor, self.growth_factor, self.backoff_factor
        )
        if not isinstance(self.counter, int) or not 0 <= self.counter < self.period:
            raise ValueError(
                f"counter must be an int with 0 <= counter < period={self.period}, "
                f"got {self.counter!r}"
            )
        if f32(floor) > f32(scale):
            # Same text as jaxstable's: a scale below its floor would be
            # RAISED by the next backoff.
            raise ValueError(
                f"min_loss_scale={f32(floor)!r} must be <= loss_scale={f32(scale)!r}"
            )
        set_ = object.__setattr__
        set_(self, "loss_scale", scale)
        set_(self, "min_loss_scale", floor)
        set_(self, "factor", growth)
        set_(self, "growth_factor", growth)
        set_(self, "backoff_factor", backoff)

    def make_scaler(self, device: str = "cpu") -> DynamicGradScaler:
        """The matching `DynamicGradScaler` (a real `torch.amp.GradScaler`).

        ``GradScaler(device, init_scale=loss_scale, growth_factor=
        growth_factor, backoff_factor=backoff_factor, growth_interval=period)``
        with the growth tracker starting at `counter`.
        """
        return DynamicGradScaler(
            device,
            init_scale=self.loss_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.period,
            min_loss_scale=self.min_loss_scale,
            hysteresis=self.hysteresis,
            counter=self.counter,
        )
