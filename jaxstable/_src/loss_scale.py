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
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

T = TypeVar("T")

__all__ = [
    "DynamicLossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "all_finite",
    "scaled_value_and_grad",
]


def _is_concrete(x: Any) -> bool:
    """True when `x` holds a value we may inspect on the host (not a tracer)."""
    return not isinstance(x, jax.core.Tracer) and type(x) is not object


def _as_f32(x: Any) -> Any:
    if isinstance(x, jax.core.Tracer):
        return x.astype(jnp.float32)
    return jnp.asarray(x, jnp.float32)


def _as_i32(x: Any) -> Any:
    if isinstance(x, jax.core.Tracer):
        return x.astype(jnp.int32)
    return jnp.asarray(x, jnp.int32)


def _check_positive_scalar(value: Any, name: str) -> None:
    if not _is_concrete(value):
        return
    arr = np.asarray(value)
    if arr.shape != ():
        raise ValueError(f"{name} must be a scalar, got shape {arr.shape}")
    v = float(arr)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number > 0, got {v}")


def _div_rn(a: Any, b: Any) -> jax.Array:
    """``float32(a) / float32(b)`` rounded to nearest even on every backend.

    XLA's GPU backend divides float32 with PTX ``div.full`` (up to 2 ulp off),
    so on an H100 ``1 / 1000.3`` and ``1000.3 / 3`` came out one ulp away from
    the correctly rounded values GradScaler gets (it takes reciprocals in
    float64). The loss scale is one scalar per step, so this divides the two
    24-bit significands exactly in integer arithmetic (24 steps of long
    division, then round half to even) and gives the same bits on CPU and GPU.
    Zero, subnormal, infinite or NaN operands and results that would not be a
    normal float32 fall back to the plain division.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    ia = jax.lax.bitcast_convert_type(a, jnp.uint32)
    ib = jax.lax.bitcast_convert_type(b, jnp.uint32)
    ea = ((ia >> 23) & 0xFF).astype(jnp.int32)
    eb = ((ib >> 23) & 0xFF).astype(jnp.int32)
    implicit = jnp.uint32(1 << 23)
    ma = (ia & 0x7FFFFF) | implicit
    mb = (ib & 0x7FFFFF) | implicit
    # Normalise so that 1 <= ma / mb < 2 (ma < 2**25 after the shift).
    shifted = ma < mb
    r = jnp.where(shifted, ma << 1, ma)
    exponent = ea - eb + 127 - shifted.astype(jnp.int32)
    q = jnp.uint32(0)
    for _ in range(24):
        bit = r >= mb
        r = jnp.where(bit, r - mb, r) << 1
        q = (q << 1) | bit.astype(jnp.uint32)
    # The fraction left over is r / (2 mb): above one half rounds up, exactly
    # one half rounds to the even significand.
    up = (r > mb) | ((r == mb) & ((q & 1) == 1))
    q = q + up.astype(jnp.uint32)
    carry = q == jnp.uint32(1 << 24)
    q = jnp.where(carry, q >> 1, q)
    exponent = exponent + carry.astype(jnp.int32)
    sign = (ia ^ ib) & jnp.uint32(0x80000000)
    bits = sign | (exponent.astype(jnp.uint32) << 23) | (q & 0x7FFFFF)
    quotient = jax.lax.bitcast_convert_type(bits, jnp.float32)
    normal = (ea > 0) & (ea < 255) & (eb > 0) & (eb < 255)
    normal = normal & (exponent > 0) & (exponent < 255)
    return jnp.where(normal, quotient, a / b)


def _scale_leaf(x: Any, factor: jax.Array) -> Any:
    # Multiply in float32 (at least) and cast back: a float16 leaf times a
    # float32 scale would otherwise be promoted to float32 by jnp's rules and
    # change the dtype of the user's tree. Non-float leaves are left alone.
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        return x
    dtype = jnp.result_type(x)
    compute = jnp.promote_types(dtype, jnp.float32)
    return (jnp.asarray(x, compute) * factor.astype(compute)).astype(dtype)


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every floating leaf of `tree` is finite.

    Computes ``all(isfinite(x))`` per leaf and ANDs the results: a test on each
    element, never a sum of values (a sum of finite float16 values can overflow
    to inf and give a false alarm). Integer and boolean leaves are always
    finite. Works under `jax.jit`; returns a device scalar (no host sync).

    Args:
      tree: a pytree of arrays.

    Returns:
      A boolean scalar array; ``True`` for an empty tree.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import loss_scale
      >>> tree = {"a": jnp.ones(3), "b": jnp.array([1.0, jnp.nan])}
      >>> bool(loss_scale.all_finite(tree))
      False
      >>> bool(loss_scale.all_finite({"a": jnp.full(3, 6e4, jnp.float16)}))
      True
    """
    flags = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    if not flags:
        return jnp.asarray(True)
    return jnp.all(jnp.stack(flags))


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
      loss_scale: the constant, a finite number > 0 (stored as float32).

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
        object.__setattr__(self, "loss_scale", _as_f32(self.loss_scale))

    def scale(self, tree: T) -> T:
        """Multiplies every floating leaf of `tree` by the scale."""
        return jax.tree_util.tree_map(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: T) -> T:
        """Multiplies every floating leaf of `tree` by ``1/loss_scale``."""
        inv = _div_rn(1.0, self.loss_scale)
        return jax.tree_util.tree_map(lambda x: _scale_leaf(x, inv), tree)

    def adjust(self, grads_finite: Any) -> StaticLossScale:
        """Returns ``self`` (the scale is static)."""
        del grads_finite
        return self


@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale:
    """Dynamic loss scale with `torch.amp.GradScaler`'s defaults and arithmetic.

    Per step, with ``finite`` the all-finite flag of the unscaled gradients::

        if finite:
            non_finite_counter = 0
            counter += 1
            if counter == period:
                counter = 0
                if isfinite(float32(loss_scale * factor)):
                    loss_scale = float32(loss_scale * factor)
        else:
            counter = 0
            non_finite_counter += 1
            if non_finite_counter >= hysteresis:
                loss_scale = max(float32(loss_scale / factor), min_loss_scale)

    With ``hysteresis=1`` and ``min_loss_scale`` never reached this is exactly
    GradScaler's ``_amp_update_scale_`` (growth_interval=period,
    growth_factor=factor, backoff_factor=1/factor): the scale values are equal
    bit for bit (tested against the real GradScaler over thousands of steps
    for factors 2, 3, 1.5 and 7). GradScaler multiplies by the float64
    ``backoff_factor = 1/factor``; a float32 division by ``factor`` rounds to
    the same float32 whenever ``factor`` is exact in float32 and a ratio of
    small integers (s/f is then never within 2**-53 of a float32 rounding
    midpoint), and is exact for powers of two. GradScaler has no floor; here
    the scale never goes below ``min_loss_scale``.

    ``hysteresis=N`` (as in Megatron-LM) backs off only after N non-finite
    steps in a row; unlike Megatron, whose tracker refills only when the scale
    grows, the count here restarts at every finite step.

    Every field survives `jax.jit`, `jax.tree.map`, pickle and flax
    serialisation: the arrays (``loss_scale``, ``counter``, ``factor``,
    ``min_loss_scale``, ``non_finite_counter``) are pytree children; the
    Python ints ``period`` and ``hysteresis`` are aux data and are also
    written by `flax.serialization.to_state_dict`.

    Concrete (non-traced) arguments are validated like
    `torchref.loss_scale.DynamicLossScale`, with the same messages; fields
    that are tracers (construction inside `jax.jit`) are not. Equality is
    identity and `hash` is id-based (the fields are arrays).

    Args:
      loss_scale: initial scale, > 0 (float32). GradScaler's ``init_scale``;
        must be >= ``min_loss_scale``.
      counter: consecutive finite steps since the last change (int32),
        ``0 <= counter < period``.
      period: finite steps in a row before growing, >= 1 (``growth_interval``).
      factor: growth factor, > 1 (float32); the backoff is ``1/factor``.
      min_loss_scale: floor of the scale, > 0 (float32).
      hysteresis: non-finite steps in a row before backing off, >= 1.
      non_finite_counter: current run of non-finite steps (int32).

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
    """

    loss_scale: Any = 2.0**16
    counter: Any = 0
    period: int = 2000
    factor: float = 2
    min_loss_scale: Any = 1.0
    hysteresis: int = 1
    non_finite_counter: Any = 0

    def __post_init__(self) -> None:
        _check_positive_scalar(self.loss_scale, "loss_scale")
        _check_positive_scalar(self.min_loss_scale, "min_loss_scale")
        if isinstance(self.period, bool) or not isinstance(
            self.period, int | np.integer
        ):
            raise ValueError(f"period must be an int >= 1, got {self.period!r}")
        if self.period < 1:
            raise ValueError(f"period must be an int >= 1, got {self.period}")
        if isinstance(self.hysteresis, bool) or not isinstance(
            self.hysteresis, int | np.integer
        ):
            raise ValueError(f"hysteresis must be an int >= 1, got {self.hysteresis!r}")
        if self.hysteresis < 1:
            raise ValueError(f"hysteresis must be an int >= 1, got {self.hysteresis}")
        if _is_concrete(self.factor):
            f = np.asarray(self.factor)
            if f.shape != () or not (np.isfinite(f) and f > 1):
                raise ValueError(
                    f"factor must be a finite number > 1, got {self.factor!r}"
                )
        if _is_concrete(self.counter):
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
        if _is_concrete(self.loss_scale) and _is_concrete(self.min_loss_scale):
            # A scale below its floor would be RAISED by the next backoff
            # (max(scale / factor, floor) > scale).
            scale = float(np.asarray(self.loss_scale))
            floor = float(np.asarray(self.min_loss_scale))
            if floor > scale:
                raise ValueError(
                    f"min_loss_scale={floor!r} must be <= loss_scale={scale!r}"
                )
        set_ = object.__setattr__
        set_(self, "period", int(self.period))
        set_(self, "hysteresis", int(self.hysteresis))
        set_(self, "factor", _as_f32(self.factor))
        set_(self, "loss_scale", _as_f32(self.loss_scale))
        set_(self, "min_loss_scale", _as_f32(self.min_loss_scale))
        set_(self, "counter", _as_i32(self.counter))
        set_(self, "non_finite_counter", _as_i32(self.non_finite_counter))

    # -- pytree -------------------------------------------------------------
    # `factor` is a child (a float32 array), not aux data: XLA rewrites a
    # division by a compile-time constant into a multiplication by its rounded
    # reciprocal (x / 1.5 -> x * 0.666666687), one ulp away from GradScaler's
    # float64 backoff for factor 1.5. A run-time value goes through `_div_rn`,
    # which rounds like GradScaler on CPU and GPU alike (XLA:GPU's own float32
    # division does not round correctly).
    _CHILDREN = (
        "loss_scale",
        "counter",
        "factor",
        "min_loss_scale",
        "non_finite_counter",
    )
    _AUX = ("period", "hysteresis")

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
        """Multiplies every floating leaf of `tree` by the current scale."""
        return jax.tree_util.tree_map(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: T) -> T:
        """Multiplies every floating leaf of `tree` by ``1/loss_scale``.

        GradScaler also multiplies by the reciprocal (computed in float64 and
        rounded to float32; for the powers of two a factor-2 scale takes, both
        reciprocals are exact).
        """
        inv = _div_rn(1.0, self.loss_scale)
        return jax.tree_util.tree_map(lambda x: _scale_leaf(x, inv), tree)

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
        factor = self.factor

        successful = self.counter + 1
        grow = successful >= self.period
        grown = scale * factor
        # GradScaler keeps the scale when growing would overflow float32 to inf.
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        finite_scale = jnp.where(grow, grown, scale)
        finite_counter = jnp.where(grow, 0, successful).astype(jnp.int32)

        bad_run = self.non_finite_counter + 1
        backed_off = jnp.maximum(_div_rn(scale, factor), self.min_loss_scale)
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
        "factor": serialization.to_state_dict(ls.factor),
        "min_loss_scale": serialization.to_state_dict(ls.min_loss_scale),
        "hysteresis": ls.hysteresis,
        "non_finite_counter": serialization.to_state_dict(ls.non_finite_counter),
    }


def _dynamic_from_state_dict(target: DynamicLossScale, state: dict[str, Any]):
    def get(name):
        return state[name] if name in state else getattr(target, name)

    def py_number(v):
        return np.asarray(v).item()

    return DynamicLossScale(
        loss_scale=get("loss_scale"),
        counter=get("counter"),
        period=int(py_number(get("period"))),
        factor=get("factor"),
        min_loss_scale=get("min_loss_scale"),
        hysteresis=int(py_number(get("hysteresis"))),
        non_finite_counter=get("non_finite_counter"),
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
