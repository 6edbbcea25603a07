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
import functools
import math
import operator
import warnings
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from _stablecore.checks import check_count as _core_check_count
from _stablecore.loss_scale import resolve_factors as _core_resolve_factors

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


# float32's smallest normal and largest finite numbers. XLA flushes subnormal
# float32 values to 0 on CPU and GPU (a scale of 1e-40 became 0.0, 0 * 2 = 0,
# and every later step was skipped), so a scale lives in [_TINY, _HUGE].
_TINY = float(np.finfo(np.float32).tiny)  # 2**-126 = 1.1754944e-38
_HUGE = float(np.finfo(np.float32).max)  # 3.4028235e+38


def _check_positive_scalar(value: Any, name: str) -> None:
    """A finite float32 normal number > 0; warns when it is an integer.

    Same messages as `torchref.loss_scale` (parity_tests checks both).
    """
    if not _is_concrete(value):
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
    v32 = float(np.float32(value)) if value <= _HUGE else math.inf
    if not _TINY <= v32 <= _HUGE:
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


def _float64_limbs(value: float) -> tuple[tuple[int, int, int, int], int]:
    """``value == m * 2**e`` with ``2**52 <= m < 2**53``: m's four 16-bit limbs
    (least significant first) and e, for a positive normal Python float."""
    fraction, exponent = math.frexp(value)  # value = fraction * 2**exponent
    m = int(fraction * 2**53)
    return tuple((m >> (16 * k)) & 0xFFFF for k in range(4)), exponent - 53


def _mul_f64(x: Any, limbs: Any, exponent: Any) -> jax.Array:
    """``float32(float64(x) * g)`` for ``g = m * 2**exponent`` (m in `limbs`).

    What `torch._amp_update_scale_` computes: its float32 scale times the
    Python-float (float64) growth or backoff factor, the product rounded to
    float64 and then to float32 (CPU and CUDA kernels alike; checked on
    40,000 random pairs). A float32 product with the factor rounded to float32
    differs: 65536 * (1/1.1) is 59578.184 in torch, 59578.18 in float32.
    Without float64 on the device (JAX's default), the product is formed
    exactly in integers: x's 24-bit significand times g's 53-bit one (2
    x 4 limbs of 16 bits, 77 bits in all), rounded half-to-even to 53 bits
    and then to 24 bits, as the two roundings do. Integer arithmetic gives
    the same bits on every backend. Results above float32's max are inf;
    results below its smallest normal are 0 (the loss scale's floor, a
    normal number, takes over). ``x`` must be a positive normal float32.
    """
    u32 = jnp.uint32
    bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), u32)
    biased = ((bits >> 23) & 0xFF).astype(jnp.int32)
    significand = (bits & 0x7FFFFF) | u32(1 << 23)
    a = (significand & 0xFFFF, significand >> 16)
    b = [jnp.asarray(v, u32) for v in limbs]
    # Column sums of the 16x16-bit partial products (each < 2**32), split
    # into 16-bit halves so that no column overflows 32 bits.
    p = [u32(0)] * 6
    for i, ai in enumerate(a):
        for j, bj in enumerate(b):
            prod = ai * bj
            p[i + j] = p[i + j] + (prod & 0xFFFF)
            p[i + j + 1] = p[i + j + 1] + (prod >> 16)
    carry = u32(0)
    for k in range(6):
        total = p[k] + carry
        p[k], carry = total & 0xFFFF, total >> 16
    # 2**75 <= product < 2**77: shift by one when bit 76 is clear, so that
    # the leading bit is bit 76 in both cases.
    top = (p[4] >> 12) & 1
    shifted = [(p[0] << 1) & 0xFFFF] + [
        ((p[k] << 1) & 0xFFFF) | (p[k - 1] >> 15) for k in range(1, 5)
    ]
    p = [jnp.where(top == 1, p[k], shifted[k]) for k in range(5)]
    exp32 = biased + jnp.asarray(exponent, jnp.int32) + 53 - (1 - top).astype(jnp.int32)
    # Bits 76..53: the float32 significand; 52: its rounding bit; 51..24:
    # the rest of the float64 significand; 23: float64's rounding bit;
    # 22..0: float64's sticky bits.
    sig = (p[4] << 11) | (p[3] >> 5)
    half32 = (p[3] >> 4) & 1
    rest = ((p[3] & 0xF) << 24) | (p[2] << 8) | (p[1] >> 8)
    half64 = (p[1] >> 7) & 1
    sticky64 = ((p[1] & 0x7F) | p[0]) != 0
    # Round to float64 (53 bits: sig, half32, rest), half to even.
    up = (half64 == 1) & (sticky64 | ((rest & 1) == 1))
    rest = rest + up.astype(u32)
    half32 = half32 + (rest >> 28)
    rest = rest & 0xFFFFFFF
    sig = sig + (half32 >> 1)
    half32 = half32 & 1
    # Then to float32 (24 bits), half to even.
    up = (half32 == 1) & ((rest != 0) | ((sig & 1) == 1))
    sig = sig + up.astype(u32)
    carried = sig >= u32(1 << 24)
    sig = jnp.where(carried, sig >> 1, sig)
    exp32 = exp32 + carried.astype(jnp.int32)
    out = jax.lax.bitcast_convert_type(
        (jnp.clip(exp32, 1, 254).astype(u32) << 23) | (sig & 0x7FFFFF), jnp.float32
    )
    out = jnp.where(exp32 >= 255, jnp.float32(jnp.inf), out)
    return jnp.where(exp32 <= 0, jnp.float32(0.0), out)


def _scale_leaf(x: Any, *factors: jax.Array) -> Any:
    # Multiply in float32 (at least) and cast back: a float16 leaf times a
    # float32 scale would otherwise be promoted to float32 by jnp's rules and
    # change the dtype of the user's tree. Complex leaves keep their imaginary
    # part (complex64 times a float32 factor); integer leaves are left alone.
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return x
    dtype = jnp.result_type(x)
    compute = jnp.promote_types(dtype, jnp.float32)
    out = jnp.asarray(x, compute)
    for factor in factors:
        out = out * factor.astype(compute)
    return out.astype(dtype)


# Above this scale, GradScaler's float32 reciprocal is subnormal.
_BIG_SCALE = 2.0**126


def _unscale(tree: Any, scale: Any) -> Any:
    """Every inexact leaf of `tree` times ``1/scale``, as GradScaler unscales.

    GradScaler multiplies by ``float32(1 / float64(scale))``. Above 2**126
    that reciprocal is a float32 subnormal, which XLA flushes to 0 on CPU and
    GPU: at a scale of 2**127 (GradScaler grows to it when gradients stay
    small) every gradient would become 0. There the product is taken as
    ``(x * (2**64 / scale)) * 2**-64``, the same exact product for the powers
    of two a factor-2 scale takes; below 2**126 the second factor is 1 and
    the result is ``x * (1/scale)``, bit for bit.
    """
    scale = jnp.asarray(scale, jnp.float32)
    big = scale > _BIG_SCALE
    inv = _div_rn(1.0, jnp.where(big, scale * jnp.float32(2.0**-64), scale))
    after = jnp.where(big, jnp.float32(2.0**-64), jnp.float32(1.0))
    # A compile-time scale would let XLA fold (x * inv) * after into
    # x * (inv * after), that is x times the subnormal 2**-127 = 0 (seen with
    # jax.jit(loss_scale.unscale)); the barrier keeps the two products.
    inv, after = jax.lax.optimization_barrier((inv, after))
    return jax.tree_util.tree_map(lambda x: _scale_leaf(x, inv, after), tree)


# A float32 sum of squares of finite values overflows once their norm passes
# 2**64 = 1.8e19. With every element first multiplied by this power of two
# (exact: only the exponent changes) a square is at most
# (3.4e38 * 2**-90)**2 = 7.6e22, and a sum of fewer than 2**52 of them stays
# below float32's max 3.4e38: that scaled sum is finite exactly when every
# element is. It is both the gradients' finiteness test (`all_finite`) and
# the norm's overflow fallback (`transforms.global_norm`): one reduction.
_NORM_SCALE = 2.0**-90


def _opaque(x: Any) -> Any:
    """`x` as a value XLA cannot fold into a neighbouring constant.

    XLA rewrites ``(g * c1) * c2`` into ``g * (c1 * c2)`` and ``(g * c)**2``
    into ``g**2 * c**2`` when the factors are known: with ``c = 2**-90`` the
    folded factor is subnormal and flushed to 0 (seen under `jax.jit`: a
    clipped gradient of 2.5e38 came out 0 instead of 1).
    """
    return jax.lax.optimization_barrier(x)


def _add_pairs(a: Any, b: Any) -> tuple[jax.Array, jax.Array]:
    return a[0] + b[0], a[1] + b[1]


def _leading_rows(values: tuple, reducer: Any) -> tuple:
    """``values`` (arrays of one shape) reduced over every axis but the first.

    ONE `lax.reduce` with as many operands as ``values``: XLA:CPU emits it as
    a single loop that computes the operands on the fly (a one-operand float
    sum goes to YNNPACK instead, which takes every scalar constant fused into
    it as a materialised array of the operand's shape, and two sums read the
    inputs twice). The first axis is kept because a multi-operand reduce
    over a sharded axis is partitioned with an all-gather of the partial
    results, where a plain sum gets an all-reduce (reduced whole, the 4-device
    FSDP step of `jaxstable/tests/test_distributed.py` had 33 all-gathers
    instead of the plain step's 3). FSDP shards the leading axis
    (`jaxstable.distributed`), so the rows stay local and `_row_total`
    finishes with one-operand sums. A 1-D value is returned as it is (its
    elements are the rows), a 0-D one as a row of one.
    """
    if values[0].ndim <= 1:
        return tuple(v.reshape(-1) for v in values)
    zeros = tuple(jnp.zeros([], v.dtype) for v in values)
    return jax.lax.reduce(values, zeros, reducer, tuple(range(1, values[0].ndim)))


def _row_total(rows: list[jax.Array]) -> jax.Array:
    """The sum of every element of ``rows`` (1-D arrays): rows of one length
    are added first, then each length is summed once."""
    by_length: dict[int, list[jax.Array]] = {}
    for row in rows:
        by_length.setdefault(row.shape[0], []).append(row)
    totals = [jnp.sum(functools.reduce(operator.add, r)) for r in by_length.values()]
    return functools.reduce(operator.add, totals)


def _squares(x: Any) -> tuple[jax.Array, jax.Array]:
    """``(|x|**2, |x * 2**-90|**2)`` elementwise, in float32 at least (a
    float16 square of 300 is 9e4, above fp16's max 65504); a complex leaf
    gives ``re**2 + im**2``."""
    x = jnp.asarray(x, jnp.promote_types(jnp.result_type(x), jnp.float32))
    parts = (jnp.real(x), jnp.imag(x)) if jnp.iscomplexobj(x) else (x,)
    factor = _opaque(jnp.asarray(_NORM_SCALE, parts[0].dtype))
    plain = jnp.square(parts[0])
    scaled = jnp.square(parts[0] * factor)
    for part in parts[1:]:
        plain = plain + jnp.square(part)
        scaled = scaled + jnp.square(part * factor)
    return plain, scaled


def _sums_of_squares(leaves: list[Any]) -> tuple[jax.Array, jax.Array]:
    """``(sum |x|**2, sum |x * 2**-90|**2)`` over all of ``leaves`` (inexact
    arrays, at least one), reading each leaf once (`_leading_rows`).
    `all_finite`, `transforms.global_norm` and the clip all build this same
    computation on the gradients, so XLA keeps one."""
    rows = [_leading_rows(_squares(x), _add_pairs) for x in leaves]
    return _row_total([p for p, _ in rows]), _row_total([q for _, q in rows])


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every floating or complex leaf of `tree` is finite.

    Never a plain sum of values (a sum of finite float16 values can overflow
    to inf and give a false alarm): the float32 sum of ``|x * 2**-90|**2``
    over every element of every leaf, which cannot overflow while the
    elements are finite (each square is at most 7.6e22, and float32 holds
    2**52 of them) and is inf or NaN as soon as one is not. It is the same
    computation as the overflow-safe norm of
    `jaxstable.transforms.global_norm`, so a train step that needs both reads
    the gradients once. float64 leaves are tested element by element.
    Integer and boolean leaves are always finite. Works under `jax.jit`;
    returns a device scalar (no host sync).

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
      >>> bool(loss_scale.all_finite(jnp.array([3.4e38, -3.4e38], jnp.float32)))
      True
    """
    leaves = [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    wide = [x for x in leaves if jnp.finfo(jnp.result_type(x)).bits > 32]
    narrow = [x for x in leaves if jnp.finfo(jnp.result_type(x)).bits <= 32]
    # float64: a square of 1e200 times 2**-180 still overflows float64's
    # 1.8e308, so its scaled sum could call a finite leaf non-finite.
    flags = [jnp.all(jnp.isfinite(x)) for x in wide]
    if narrow:
        plain, scaled = _sums_of_squares(narrow)
        # `plain >= 0` holds whenever `scaled` is finite (a sum of squares);
        # it uses both sums, so XLA keeps the two-sum reduction whole and
        # merges it with the norm's. Unused, the plain sum would be dropped,
        # leaving a one-sum reduction that reads the leaves a second time.
        flags.append(jnp.logical_and(jnp.isfinite(scaled), plain >= 0))
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
        object.__setattr__(self, "loss_scale", _as_f32(self.loss_scale))

    def scale(self, tree: T) -> T:
        """Multiplies every inexact leaf of `tree` by the scale."""
        return jax.tree_util.tree_map(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: T) -> T:
        """Multiplies every inexact leaf of `tree` by ``1/loss_scale``."""
        return _unscale(tree, self.loss_scale)

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
    float32; `_mul_f64` forms the same product exactly in integer arithmetic
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
        set_(self, "loss_scale", _as_f32(self.loss_scale))
        set_(self, "min_loss_scale", _as_f32(self.min_loss_scale))
        set_(self, "counter", _as_i32(self.counter))
        set_(self, "non_finite_counter", _as_i32(self.non_finite_counter))

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
        return jax.tree_util.tree_map(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: T) -> T:
        """Multiplies every inexact leaf of `tree` by ``1/loss_scale``.

        GradScaler also multiplies by the reciprocal (computed in float64 and
        rounded to float32); see `_unscale` for scales above 2**126.
        """
        return _unscale(tree, self.loss_scale)

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
        grown = _mul_f64(scale, *_float64_limbs(self.growth_factor))
        # GradScaler keeps the scale when growing would overflow float32 to inf.
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        finite_scale = jnp.where(grow, grown, scale)
        finite_counter = jnp.where(grow, 0, successful).astype(jnp.int32)

        bad_run = self.non_finite_counter + 1
        shrunk = _mul_f64(scale, *_float64_limbs(self.backoff_factor))
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
