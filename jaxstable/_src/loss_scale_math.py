"""The loss scales' arithmetic, written once: GradScaler's products bit for bit.

The float32 division rounded to nearest on every backend (`_div_rn`), the
float32-times-float64 product torch's scale update takes (`mul_f64`), the
unscale by the reciprocal (`unscale_tree`), and the one reduction that both tests
every gradient for finiteness (`all_finite`) and carries the overflow-safe
norm (`sums_of_squares`, read by `jaxstable._src.clipping`). No class here:
`jaxstable._src.loss_scale` holds the loss scales built on it.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["all_finite"]


def is_concrete(x: Any) -> bool:
    """True when `x` holds a value that may be read on the host: not a tracer
    (under `jax.jit`, `jax.vmap`, `jax.grad`) and not the bare ``object()``
    placeholder JAX unflattens a pytree with (`jax.tree_util` structure
    probes). The one test for the loss scales' and the losses' host checks."""
    return not isinstance(x, jax.core.Tracer) and type(x) is not object


def as_f32(x: Any) -> Any:
    if isinstance(x, jax.core.Tracer):
        return x.astype(jnp.float32)
    return jnp.asarray(x, jnp.float32)


def as_i32(x: Any) -> Any:
    if isinstance(x, jax.core.Tracer):
        return x.astype(jnp.int32)
    return jnp.asarray(x, jnp.int32)


# float32's smallest normal and largest finite numbers. XLA flushes subnormal
# float32 values to 0 on CPU and GPU (a scale of 1e-40 became 0.0, 0 * 2 = 0,
# and every later step was skipped), so a scale lives in [TINY, HUGE].
TINY = float(np.finfo(np.float32).tiny)  # 2**-126 = 1.1754944e-38
HUGE = float(np.finfo(np.float32).max)  # 3.4028235e+38


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


def float64_limbs(value: float) -> tuple[tuple[int, int, int, int], int]:
    """``value == m * 2**e`` with ``2**52 <= m < 2**53``: m's four 16-bit limbs
    (least significant first) and e, for a positive normal Python float."""
    fraction, exponent = math.frexp(value)  # value = fraction * 2**exponent
    m = int(fraction * 2**53)
    return tuple((m >> (16 * k)) & 0xFFFF for k in range(4)), exponent - 53


def mul_f64(x: Any, limbs: Any, exponent: Any) -> jax.Array:
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


def scale_leaf(x: Any, *factors: jax.Array) -> Any:
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


def unscale_tree(tree: Any, scale: Any) -> Any:
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
    # Once per step: fused, the division ran again for every element.
    inv, after = computed_once((inv, after))
    return jax.tree_util.tree_map(lambda x: scale_leaf(x, inv, after), tree)


# A float32 sum of squares of finite values overflows once their norm passes
# 2**64 = 1.8e19. With every element first multiplied by this power of two
# (exact: only the exponent changes) a square is at most
# (3.4e38 * 2**-90)**2 = 7.6e22, and a sum of fewer than 2**52 of them stays
# below float32's max 3.4e38: that scaled sum is finite exactly when every
# element is. It is both the gradients' finiteness test (`all_finite`) and
# the norm's overflow fallback (`transforms.global_norm`): one reduction.
NORM_SCALE = 2.0**-90


def opaque(x: Any) -> Any:
    """`x` as a value XLA cannot fold into a neighbouring constant.

    XLA rewrites ``(g * c1) * c2`` into ``g * (c1 * c2)`` and ``(g * c)**2``
    into ``g**2 * c**2`` when the factors are known: with ``c = 2**-90`` the
    folded factor is subnormal and flushed to 0 (seen under `jax.jit`: a
    clipped gradient of 2.5e38 came out 0 instead of 1).
    """
    return jax.lax.optimization_barrier(x)


def computed_once(x: Any) -> Any:
    """The float32 scalars of `x`, each computed once per step, not per element.

    XLA fuses a scalar made of cheap operations (compares, selects, shifts)
    into every elementwise kernel that reads it, and XLA:CPU evaluates it
    again for each element: the unscale factor's 24-step division ran
    inside every gradient, Adam moment and parameter kernel (the small GPT-2
    benchmark's embedding norm kernel took 7x its time).
    An integer division by a divisor XLA cannot prove constant is expensive
    in its cost model, so it is never duplicated into several consumers: it
    runs once and its result is read. ``bits // ((bits >> 31) | 1)`` is
    ``bits // 1``, the same bits for every value (NaN and inf included).
    """

    def once(v: Any) -> Any:
        bits = jax.lax.bitcast_convert_type(jnp.asarray(v, jnp.float32), jnp.uint32)
        one = (bits >> 31) | jnp.uint32(1)
        return jax.lax.bitcast_convert_type(bits // one, jnp.float32)

    return jax.tree_util.tree_map(once, x)


def _add_pairs(a: Any, b: Any) -> tuple[jax.Array, jax.Array]:
    return a[0] + b[0], a[1] + b[1]


def leading_rows(values: tuple, reducer: Any) -> tuple:
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
    (`jaxstable.distributed`), so the rows stay local and `row_total`
    finishes with one-operand sums. A 1-D value is returned as it is (its
    elements are the rows), a 0-D one as a row of one.
    """
    if values[0].ndim <= 1:
        return tuple(v.reshape(-1) for v in values)
    zeros = tuple(jnp.zeros([], v.dtype) for v in values)
    return jax.lax.reduce(values, zeros, reducer, tuple(range(1, values[0].ndim)))


def row_total(rows: list[jax.Array]) -> jax.Array:
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
    factor = opaque(jnp.asarray(NORM_SCALE, parts[0].dtype))
    plain = jnp.square(parts[0])
    scaled = jnp.square(parts[0] * factor)
    for part in parts[1:]:
        plain = plain + jnp.square(part)
        scaled = scaled + jnp.square(part * factor)
    return plain, scaled


def sums_of_squares(leaves: list[Any]) -> tuple[jax.Array, jax.Array]:
    """``(sum |x|**2, sum |x * 2**-90|**2)`` over all of ``leaves`` (inexact
    arrays, at least one), reading each leaf once (`leading_rows`).
    `all_finite`, `transforms.global_norm` and the clip all build this same
    computation on the gradients, so XLA keeps one."""
    rows = [leading_rows(_squares(x), _add_pairs) for x in leaves]
    return row_total([p for p, _ in rows]), row_total([q for _, q in rows])


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
        plain, scaled = sums_of_squares(narrow)
        # `plain >= 0` holds whenever `scaled` is finite (a sum of squares);
        # it uses both sums, so XLA keeps the two-sum reduction whole and
        # merges it with the norm's. Unused, the plain sum would be dropped,
        # leaving a one-sum reduction that reads the leaves a second time.
        flags.append(jnp.logical_and(jnp.isfinite(scaled), plain >= 0))
    if not flags:
        return jnp.asarray(True)
    return jnp.all(jnp.stack(flags))
