"""Loss scales with jmp's interface whose pytrees keep every field.

A loss scale multiplies the loss before differentiation so that small float16
gradients do not flush to zero (fp16's smallest subnormal is 2**-24 = 6e-8),
then divides the gradients by the same factor. The three classes here share
jmp's interface (`loss_scale`, `scale`, `unscale`, `adjust`) so they can be
used wherever a `jmp` loss scale is expected.

Why not subclass `jmp.DynamicLossScale`: in jmp 0.0.4 its `tree_flatten`
returns only `(loss_scale, counter)` as children and `(period, factor)` as
aux data, and `tree_unflatten` rebuilds the object with the default
`min_loss_scale`. Any `jax.jit` boundary, `jax.tree.map` or checkpoint restore
therefore silently resets `min_loss_scale` to 1.0. Here every field is either
a child (arrays) or aux data (Python numbers), and the flax serialisation
registered below writes and restores all of them.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from _stablecore.checks import check_count as _core_check_count
from _stablecore.loss_scale import resolve_factors as _core_resolve_factors
from jaxstable._src.loss_scale_math import (
    HUGE,
    TINY,
    all_finite,
    as_f32,
    as_i32,
    float64_limbs,
    is_concrete,
    mul_f64,
    scale_leaf,
    unscale_tree,
)

T = TypeVar("T")

__all__ = [
    "DynamicLossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "all_finite",
    "scaled_value_and_grad",
]


def _check_positive_scalar(value: Any, name: str) -> None:
    """A finite float32 normal number > 0; warns when it is an integer.

    Same messages as `torchref.loss_scale` (parity_tests checks both).
    """
    if not is_concrete(value):
        return
    arr = np.asarray(value)
    if arr.shape != ():
        raise ValueError(f"{name} must be a scalar, got shape {arr.shape}")
    if arr.dtype == np.bool_ or not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    v = arr.item()
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    _check_float32_normal(name, float(v), v)
    if np.issubdtype(arr.dtype, np.integer):
        _warn_integer(name, int(v))


def _check_float32_normal(name: str, value: float, shown: Any) -> None:
    v32 = float(np.float32(value)) if value <= HUGE else math.inf
    if not TINY <= v32 <= HUGE:
        raise ValueError(
            f"{name} must be a float32 normal number, between 2**-126 "
            f"(1.1754944e-38; XLA flushes smaller values to 0) and 3.4028235e+38, "
            f"got {shown!r}"
        )


def _warn_integer(name: str, value: int) -> None:
    # jmp warns too: a jmp loss scale keeps an integer dtype and divides in
    # integers. Here it is converted; the warning says to what.
    warnings.warn(
        f"{name}={value} is an integer; it is used as the float32 "
        f"{float(np.float32(value))!r}: pass a float to silence this warning",
        UserWarning,
        stacklevel=5,  # the caller of DynamicLossScale(...)/StaticLossScale(...)
    )


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """A loss scale that does nothing (scale 1.0); jmp-compatible.

    ``scale`` and ``unscale`` return their input unchanged and ``adjust``
    returns ``self``. It has no fields, so its pytree has no leaves.

    Example:
      >>> from jaxstable import loss_scale
      >>> ls = loss_scale.NoOpLossScale()
      >>> float(ls.loss_scale), ls.scale(3.0), ls.adjust(False) is ls
      (1.0, 3.0, True)
    """

    @property
    def loss_scale(self) -> jax.Array:
        """The scale, a float32 scalar equal to 1.0."""
        return jnp.ones([], jnp.float32)

    def scale(self, tree: T) -> T:
        """Returns `tree` unchanged."""
        return tree

    def unscale(self, tree: T) -> T:
        """Returns `tree` unchanged."""
        return tree

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        """Returns ``self`` (nothing to adjust)."""
        del grads_finite
        return self


# eq=False (Static and Dynamic): their fields are arrays, so the generated
# __eq__ would compare arrays (ambiguous truth value; an error on tracers) and
# __hash__ would hash an unhashable jax.Array. Equality is identity and the
# hash is id-based, like any object; compare `.loss_scale` values instead.
@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale:
    """Scales by a fixed constant; jmp-compatible.

    ``scale(tree) = tree * loss_scale``; ``unscale(tree) = tree * (1/loss_scale)``
    (multiplication by the reciprocal, as `torch.amp.GradScaler` unscales).
    Leaves keep their dtype; the product is taken in float32.

    Equality is identity and `hash` is id-based (the field is an array).

    Args:
      loss_scale: the constant, a float32 normal number (2**-126 to 3.4e38;
        stored as float32; an integer is converted with a warning).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import loss_scale
      >>> ls = loss_scale.StaticLossScale(128.0)
      >>> float(ls.scale(jnp.float32(0.5))), float(ls.unscale(jnp.float32(64.0)))
      (64.0, 0.5)
    """

    loss_scale: Any = 2.0**15

    def __post_init__(self) -> None:
        _check_positive_scalar(self.loss_scale, "loss_scale")
        object.__setattr__(self, "loss_scale", as_f32(self.loss_scale))

    def scale(self, tree: T) -> T:
        """Multiplies every inexact leaf of `tree` by the scale."""
        return jax.tree_util.tree_map(lambda x: scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: T) -> T:
        """Multiplies every inexact leaf of `tree` by ``1/loss_scale``."""
        return unscale_tree(tree, self.loss_scale)

    def adjust(self, grads_finite: Any) -> StaticLossScale:
        """Returns ``self`` (the scale is static)."""
        del grads_finite
        return self


@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale:
    """Dynamic loss scale: `torch.amp.GradScaler`'s rule, bit for bit, with a floor.

    Per step, with ``finite`` the all-finite flag of the unscaled gradients::

        if finite:
            non_finite_counter = 0
            counter += 1
            if counter == period:
                counter = 0
                if isfinite(float32(loss_scale * growth_factor)):
                    loss_scale = float32(loss_scale * growth_factor)
        else:
            counter = 0
            non_finite_counter += 1
            if non_finite_counter >= hysteresis:
                loss_scale = max(float32(loss_scale * backoff_factor), min_loss_scale)

    With ``hysteresis=1`` and ``min_loss_scale`` never reached this is
    GradScaler's ``_amp_update_scale_`` (``growth_interval=period``, the same
    ``growth_factor`` and ``backoff_factor``), and the scale values are equal
    bit for bit for ANY factors: torch multiplies its float32 scale by the
    Python-float (float64) factor, rounds the product to float64 and then to
    float32; `mul_f64` forms the same product exactly in integer arithmetic
    (JAX has no float64 on the device by default), so 65536 x (1/1.1) is
    59578.184 here as in torch, where a float32 product gives 59578.18.
    GradScaler has no floor; here the scale never goes below
    ``min_loss_scale``.

    ``factor`` is jmp's spelling (grow by ``factor``, back off by dividing
    by it): ``factor=f`` alone means ``growth_factor=f, backoff_factor=1/f``
    (1/f taken in float64, as GradScaler would be given it).
    ``growth_factor``/``backoff_factor`` are GradScaler's two factors
    (defaults 2.0 and 0.5); ``factor``, when read, is the growth factor.

    ``hysteresis=N`` (as in Megatron-LM) backs off only after N non-finite
    steps in a row; unlike Megatron, whose tracker refills only when the scale
    grows, the count here restarts at every finite step.

    Every field survives `jax.jit`, `jax.tree.map`, pickle and flax
    serialisation: the arrays (``loss_scale``, ``counter``,
    ``min_loss_scale``, ``non_finite_counter``) are pytree children; the
    Python numbers ``period``, ``hysteresis``, ``factor``, ``growth_factor``
    and ``backoff_factor`` are aux data (static: a new value compiles a new
    step, as a new period does) and are also written by
    `flax.serialization.to_state_dict`. The factors stay Python floats so
    that no float64 digit is lost.

    Concrete (non-traced) arguments are validated like
    `torchref.loss_scale.DynamicLossScale`, with the same messages; fields
    that are tracers (construction inside `jax.jit`) are not, except the
    factors, which must be concrete. An integer ``loss_scale`` or
    ``min_loss_scale`` is converted to float32 with a warning (as jmp warns).
    Equality is identity and `hash` is id-based (the fields are arrays).

    Args:
      loss_scale: initial scale (GradScaler's ``init_scale``), a float32
        normal number >= ``min_loss_scale``.
      counter: consecutive finite steps since the last change (int32),
        ``0 <= counter < period``.
      period: finite steps in a row before growing (``growth_interval``),
        ``1 <= period < 2**31`` (the counter is an int32).
      factor: jmp's single factor, > 1, or None (see above).
      min_loss_scale: floor of the scale, a float32 normal number (>=
        2**-126: XLA flushes smaller ones to 0, and a scale of 0 would skip
        every step forever).
      hysteresis: non-finite steps in a row before backing off,
        ``1 <= hysteresis < 2**31``.
      non_finite_counter: current run of non-finite steps (int32).
      growth_factor: finite number > 1 (GradScaler's; default 2.0).
      backoff_factor: number with ``0 < backoff_factor < 1`` (GradScaler's;
        default 0.5, or ``1/factor`` when ``factor`` is given).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import loss_scale
      >>> ls = loss_scale.DynamicLossScale(loss_scale=2.0**10, period=2)
      >>> for finite in [True, True, False, True]:
      ...     ls = ls.adjust(jnp.asarray(finite))
      ...     print(float(ls.loss_scale), int(ls.counter))
      1024.0 1
      2048.0 0
      1024.0 0
      1024.0 1
      >>> ls = loss_scale.DynamicLossScale(growth_factor=2.0, backoff_factor=0.25)
      >>> float(ls.adjust(jnp.asarray(False)).loss_scale)
      16384.0
      >>> ls = loss_scale.DynamicLossScale(factor=1.1)  # as GradScaler(1.1, 1/1.1)
      >>> float(ls.adjust(jnp.asarray(False)).loss_scale)
      59578.18359375
    """

    loss_scale: Any = 2.0**16
    counter: Any = 0
    period: int = 2000
    factor: Any = None
    min_loss_scale: Any = 1.0
    hysteresis: int = 1
    non_finite_counter: Any = 0
    growth_factor: Any = dataclasses.field(default=None, kw_only=True)
    backoff_factor: Any = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        _check_positive_scalar(self.loss_scale, "loss_scale")
        _check_positive_scalar(self.min_loss_scale, "min_loss_scale")
        _check_count("period", self.period)
        _check_count("hysteresis", self.hysteresis)
        growth, backoff = _resolve_factors(
            self.factor, self.growth_factor, self.backoff_factor
        )
        if is_concrete(self.counter):
            c = np.asarray(self.counter)
            value = c.item() if c.shape == () else self.counter
            if not (
                np.issubdtype(c.dtype, np.integer)
                and c.shape == ()
                and 0 <= value < self.period
            ):
                raise ValueError(
                    "counter must be an int with 0 <= counter < "
                    f"period={int(self.period)}, got {value!r}"
                )
        if is_concrete(self.loss_scale) and is_concrete(self.min_loss_scale):
            # A scale below its floor would be RAISED by the next backoff
            # (max(scale * backoff, floor) > scale).
            scale = float(np.float32(np.asarray(self.loss_scale)))
            floor = float(np.float32(np.asarray(self.min_loss_scale)))
            if floor > scale:
                raise ValueError(
                    f"min_loss_scale={floor!r} must be <= loss_scale={scale!r}"
                )
        set_ = object.__setattr__
        set_(self, "period", int(self.period))
        set_(self, "hysteresis", int(self.hysteresis))
        set_(self, "factor", growth)
        set_(self, "growth_factor", growth)
        set_(self, "backoff_factor", backoff)
        set_(self, "loss_scale", as_f32(self.loss_scale))
        set_(self, "min_loss_scale", as_f32(self.min_loss_scale))
        set_(self, "counter", as_i32(self.counter))
        set_(self, "non_finite_counter", as_i32(self.non_finite_counter))

    # -- pytree -------------------------------------------------------------
    _CHILDREN = ("loss_scale", "counter", "min_loss_scale", "non_finite_counter")
    _AUX = ("period", "hysteresis", "factor", "growth_factor", "backoff_factor")

    def tree_flatten(self):
        children = tuple(getattr(self, k) for k in self._CHILDREN)
        aux = tuple(getattr(self, k) for k in self._AUX)
        return children, aux

    @classmethod
    def tree_unflatten(cls, aux, children) -> DynamicLossScale:
        # Bypass __init__: JAX unflattens with placeholders (object(), tracers)
        # that must not be validated or converted.
        obj = object.__new__(cls)
        for k, v in zip(cls._CHILDREN, children, strict=True):
            object.__setattr__(obj, k, v)
        for k, v in zip(cls._AUX, aux, strict=True):
            object.__setattr__(obj, k, v)
        return obj

    # -- jmp interface ------------------------------------------------------
    def scale(self, tree: T) -> T:
        """Multiplies every inexact leaf of `tree` by the current scale."""
        return jax.tree_util.tree_map(lambda x: scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: T) -> T:
        """Multiplies every inexact leaf of `tree` by ``1/loss_scale``.

        GradScaler also multiplies by the reciprocal (computed in float64 and
        rounded to float32); see `loss_scale_math.unscale_tree` for scales
        above 2**126.
        """
        return unscale_tree(tree, self.loss_scale)

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """Returns the next loss scale given this step's all-finite flag.

        Only `lax.select`/`jnp.where`, so it is jit-safe and compiles without
        a ``conditional``.
        """
        finite = jnp.asarray(grads_finite, jnp.bool_)
        if finite.ndim != 0:
            raise ValueError(
                f"grads_finite must be a boolean scalar, got shape {finite.shape}"
            )
        scale = self.loss_scale

        successful = self.counter + 1
        grow = successful >= self.period
        grown = mul_f64(scale, *float64_limbs(self.growth_factor))
        # GradScaler keeps the scale when growing would overflow float32 to inf.
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        finite_scale = jnp.where(grow, grown, scale)
        finite_counter = jnp.where(grow, 0, successful).astype(jnp.int32)

        bad_run = self.non_finite_counter + 1
        shrunk = mul_f64(scale, *float64_limbs(self.backoff_factor))
        backed_off = jnp.maximum(shrunk, self.min_loss_scale)
        bad_scale = jnp.where(bad_run >= self.hysteresis, backed_off, scale)

        return self._replace(
            loss_scale=jnp.where(finite, finite_scale, bad_scale).astype(jnp.float32),
            counter=jnp.where(finite, finite_counter, 0).astype(jnp.int32),
            non_finite_counter=jnp.where(finite, 0, bad_run).astype(jnp.int32),
        )

    def _replace(self, **changes: Any) -> DynamicLossScale:
        children, aux = self.tree_flatten()
        new = type(self).tree_unflatten(aux, children)
        for k, v in changes.items():
            object.__setattr__(new, k, v)
        return new


def _check_count(name: str, value: Any) -> None:
    """An int with 1 <= value < 2**31 (the counters are int32)."""
    return _core_check_count(name, value, int | np.integer)


def _factor_value(name: str, value: Any, valid: str) -> float:
    """A concrete real number, as a Python float (no float64 digit lost)."""
    if isinstance(value, jax.core.Tracer) or type(value) is object:
        raise ValueError(
            f"{name} must be a concrete number (it is static data of the "
            f"pytree, like period), got {value!r}"
        )
    arr = np.asarray(value)
    if (
        arr.shape != ()
        or arr.dtype == np.bool_
        or not (
            np.issubdtype(arr.dtype, np.integer)
            or np.issubdtype(arr.dtype, np.floating)
        )
    ):
        raise ValueError(f"{name} must be {valid}, got {value!r}")
    return float(arr.item())


def _resolve_factors(factor: Any, growth: Any, backoff: Any) -> tuple[float, float]:
    """(growth_factor, backoff_factor) from jmp's ``factor`` and/or
    GradScaler's two (the rules and messages of both frameworks)."""
    return _core_resolve_factors(factor, growth, backoff, _factor_value)


jax.tree_util.register_pytree_node(
    NoOpLossScale, lambda x: ((), None), lambda aux, children: NoOpLossScale()
)
jax.tree_util.register_pytree_node(
    StaticLossScale,
    lambda x: ((x.loss_scale,), None),
    lambda aux, children: _unflatten_static(children),
)
jax.tree_util.register_pytree_node_class(DynamicLossScale)


def _unflatten_static(children) -> StaticLossScale:
    obj = object.__new__(StaticLossScale)
    object.__setattr__(obj, "loss_scale", children[0])
    return obj


# -- flax serialisation: write and restore every field -----------------------


def _dynamic_to_state_dict(ls: DynamicLossScale) -> dict[str, Any]:
    return {
        "loss_scale": serialization.to_state_dict(ls.loss_scale),
        "counter": serialization.to_state_dict(ls.counter),
        "period": ls.period,
        "growth_factor": ls.growth_factor,
        "backoff_factor": ls.backoff_factor,
        "min_loss_scale": serialization.to_state_dict(ls.min_loss_scale),
        "hysteresis": ls.hysteresis,
        "non_finite_counter": serialization.to_state_dict(ls.non_finite_counter),
    }


def _dynamic_from_state_dict(target: DynamicLossScale, state: dict[str, Any]):
    def get(name):
        return state[name] if name in state else getattr(target, name)

    def py_number(v):
        return np.asarray(v).item()

    if "growth_factor" not in state and "factor" in state:
        # Written before the two factors: jmp's single factor (float32).
        factors = dict(factor=float(py_number(state["factor"])))
    else:
        factors = dict(
            growth_factor=float(py_number(get("growth_factor"))),
            backoff_factor=float(py_number(get("backoff_factor"))),
        )
    return DynamicLossScale(
        loss_scale=get("loss_scale"),
        counter=get("counter"),
        period=int(py_number(get("period"))),
        min_loss_scale=get("min_loss_scale"),
        hysteresis=int(py_number(get("hysteresis"))),
        non_finite_counter=get("non_finite_counter"),
        **factors,
    )


serialization.register_serialization_state(
    DynamicLossScale, _dynamic_to_state_dict, _dynamic_from_state_dict
)
serialization.register_serialization_state(
    StaticLossScale,
    lambda ls: {"loss_scale": serialization.to_state_dict(ls.loss_scale)},
    lambda target, state: StaticLossScale(state.get("loss_scale", target.loss_scale)),
)
serialization.register_serialization_state(
    NoOpLossScale, lambda ls: {}, lambda target, state: NoOpLossScale()
)


def scaled_value_and_grad(fun, has_aux: bool = False):
    """`jax.value_and_grad` through a loss scale, plus one all-finite flag.

    Differentiates ``loss_scale.scale(fun(*args))`` with respect to the first
    argument, unscales the gradients, and tests them once with `all_finite`::

        value, grads = value_and_grad(lambda *a: scale(fun(*a)))(*args)
        grads = unscale(grads); grads_finite = all_finite(grads)

    The returned value is ``fun``'s own (unscaled) value, not a rescaled one.

    Args:
      fun: ``fun(params, *rest) -> loss`` (a scalar; float32 is advised: a
        float16 loss times 2**16 overflows fp16's max 65504), or
        ``-> (loss, aux)`` with ``has_aux=True``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      ``g(loss_scale, *args)`` returning ``(value, grads, grads_finite)``, or
      ``((value, aux), grads, grads_finite)`` with ``has_aux``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import loss_scale
      >>> g = loss_scale.scaled_value_and_grad(lambda w, x: jnp.sum(w * x))
      >>> ls = loss_scale.DynamicLossScale()
      >>> value, grads, ok = g(ls, jnp.ones(2), jnp.array([3.0, 4.0]))
      >>> float(value), grads.tolist(), bool(ok)
      (7.0, [3.0, 4.0], True)
    """

    def scaled_fun(ls, *args):
        out = fun(*args)
        loss, aux = out if has_aux else (out, None)
        return ls.scale(loss), (loss, aux)

    grad_fn = jax.value_and_grad(scaled_fun, argnums=1, has_aux=True)

    def wrapped(ls, *args):
        if not args:
            raise TypeError("scaled_value_and_grad: call as g(loss_scale, params, ...)")
        (_, (loss, aux)), grads = grad_fn(ls, *args)
        grads = ls.unscale(grads)
        grads_finite = all_finite(grads)
        value = (loss, aux) if has_aux else loss
        return value, grads, grads_finite

    return wrapped
