"""Softmax cross-entropy with integer labels, in at least float32.

bf16/fp16 logits are read as they are: the cast is fused into the
reductions and the custom VJP writes the gradient in the logits' dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from _stablecore.losses import check_reduction as _check_reduction
from jaxstable._src._ce_kernel import (
    ce_kernel_applies,
    softmax_cross_entropy_last_axis,
)
from jaxstable._src.losses._checks import (
    Array,
    as_arrays,
    check_float,
    compute_dtype,
    is_concrete,
    masked_mean,
    nan_if,
)


def bad_label_message(bad_values: np.ndarray, n_classes: int, ignore_index) -> str:
    uniq = np.unique(bad_values)
    shown = ", ".join(str(int(v)) for v in uniq[:10])
    more = f" (+{uniq.size - 10} more)" if uniq.size > 10 else ""
    ign = "" if ignore_index is None else f" and not ignore_index={ignore_index}"
    return (
        f"labels must be in [0, {n_classes}){ign}; found {bad_values.size} "
        f"element(s) with values [{shown}]{more}"
    )


def _label_masks(labels, n_classes: int, ignore_index):
    """(valid, bad, safe_labels): bad = not ignored and outside [0, C)."""
    ignored = (
        jnp.zeros(labels.shape, bool)
        if ignore_index is None
        else labels == ignore_index
    )
    in_range = (labels >= 0) & (labels < n_classes)
    valid = in_range & ~ignored
    bad = ~in_range & ~ignored
    safe = jnp.where(valid, labels, 0).astype(jnp.int32)
    return valid, bad, safe


# How the reductions are written is a memory decision, checked by
# jaxstable/tests/test_losses.py::test_ce_compiled_temp_memory (XLA:CPU 0.10):
# - XLA:CPU hands single-output add/max reductions whose reducer is exactly
#   `p0 + p1` / `max(p0, p1)` to its YNNPACK library fusion, which does not
#   absorb the broadcast of the row max and so stores a float32 `x - m` array
#   (2x the bf16 logits);
# - it splits single-output reductions over rows longer than 32 into a
#   reduce-window fed by a stored float32 copy of the input.
# Multi-output (variadic) reductions and integer max-reductions of the raw bits
# are neither, so the cast stays fused and nothing logits-sized is stored.
# GPU backends fuse any of these forms.
def _ordered_bits_max(a, b):
    """max of two floats given as signed-int bit patterns (IEEE order)."""
    shift = jnp.array(8 * a.dtype.itemsize - 1, a.dtype)
    magnitude = jnp.array(np.iinfo(a.dtype).max, a.dtype)
    # flipping the magnitude bits of negatives makes int order == float order
    key_a = a ^ ((a >> shift) & magnitude)
    key_b = b ^ ((b >> shift) & magnitude)
    return jnp.where(key_a >= key_b, a, b)


def _sum_reducer(a, b):
    # `a - (-b)`, not `a + b`: not the library-fusion pattern (see above)
    return tuple(x - (-y) for x, y in zip(a, b, strict=True))


def _select_max(a, b):
    # a compare-and-select, not `max`: not the library-fusion pattern
    return jnp.where(a >= b, a, b)


# Long rows (classification, C = 1000) take a two-stage path: the one-stage
# reductions above run serially along the whole row, which made fwd+bwd of
# 4096x1000 bf16 3.4x slower than the naive optax path (30 ms vs 9 ms; now
# below optax's time, benchmarks/results/bench_losses_cpu.md). Measured on
# XLA:CPU 0.10, 2 cores, reductions timed alone:
# - row max: a plain `jnp.max` over chunks of the row in the logits' own
#   dtype is a vectorised library reduction (0.5 ms vs 8 ms for the
#   bit-pattern max); the few chunk maxima are then combined by a select
#   reducer, which the library fusion does not take, so the library output
#   stops there instead of swallowing the broadcast of the row max;
# - sum: the variadic `a - (-b)` reduce into n lane sums, then over the
#   lanes; see `_sum_pieces`.
# Rows of <= 32 classes (segmentation, C = 19) keep the one-stage forms,
# fastest there (8.1 ms fwd+bwd for 8x128x128x19; two-stage forms 13-16 ms).
_LONG_ROW = 32
_SUM_CHUNK = 20
_SUM_LANES = 8


def _sum_pieces(n_classes: int) -> list[tuple[int, int]]:
    """[(k, n), ...]: a long row's sum takes pieces of k * n classes one
    after the other along the row, then the few classes left over (< 8).

    Class j * n + i of a piece adds to lane sum i (a reduce over the k axis
    of the piece seen as (k, n)), then the n lane sums are added. XLA:CPU
    (0.10, LLVM IR of the fusion) vectorises such a reduce across its n
    outputs, <8 x float> loads of 8 neighbouring classes, only when LLVM
    unrolls the k-loop (k <= 20; 25 or more stay a scalar loop, 4096x1000:
    21 ms instead of 2) and n is a multiple of 8 (n = 7, 9, 10 or 15 ran as
    scalar code: C = 150 in n = 7 chunks of 20 took 14 ms of the 17 ms
    fwd+bwd; 8 lanes of 18 take ~2). So n is the smallest multiple of 8
    with k <= 20; what is left (< n) makes a second piece of 8 lanes
    (C = 1000: 17 x 56, then 6 x 8: a left-over of 48 summed in one scalar
    loop took 1.6 ms of ~7). Lanes of neighbouring classes, not chunks of
    them: 4096x1000 fwd+bwd 5.1 ms instead of 6.2 (contiguous loads).
    Only where the lane sums (up to 3 float32 outputs, 96 bytes a row at
    n = 8) stay within 3/8 of a float32 copy of the row (C >= 64); shorter
    rows take n = C // 20 lanes of 20 (1..3, scalar).
    """
    if n_classes < 8 * _SUM_LANES:
        return [(_SUM_CHUNK, n_classes // _SUM_CHUNK)]
    lanes = _SUM_LANES * -(-n_classes // (_SUM_LANES * _SUM_CHUNK))
    pieces = [(n_classes // lanes, lanes)]
    rest = n_classes % lanes
    if rest >= _SUM_LANES:
        pieces.append((rest // _SUM_LANES, _SUM_LANES))
    return pieces


def _split_last(x, chunk: int):
    """(head reshaped to (..., n, chunk), tail of the last C % chunk entries)."""
    n_full = x.shape[-1] // chunk * chunk
    head = x[..., :n_full].reshape(*x.shape[:-1], n_full // chunk, chunk)
    return head, x[..., n_full:]


def _max_chunk(n_classes: int) -> int | None:
    """Chunk length for the library max: C / n for the fewest n >= 2 chunks
    that tile the row exactly (a sliced row feeds the library fusion through
    a stored float32 copy, seen at C = 1009); None if no n <= 64 does."""
    for n_chunks in range(2, 65):
        if n_classes % n_chunks == 0:
            return n_classes // n_chunks
    return None


def _row_max(logits, ct):
    """Exact row max over the last axis, as `ct` (a max never rounds).

    Short rows: XLA:CPU splits a float max over rows > 32 into a
    reduce-window that it runs in float32 after storing a float32 copy of
    the input, and hands a plain max to the library fusion (see above), so
    the raw bit patterns are reduced as integers (a free bitcast) instead.
    Long rows: two stages, see `_LONG_ROW`. A NaN logit is not always
    propagated here; the sum of exp(x - max) turns it into a NaN loss.
    """
    n_classes = logits.shape[-1]
    last = logits.ndim - 1
    if n_classes > _LONG_ROW:
        lowest = jnp.array(-jnp.inf, logits.dtype)
        chunk = _max_chunk(n_classes)
        if chunk is not None:
            # `jnp.max` over the chunks: the library reduction, vectorised
            partial = jnp.max(_split_last(logits, chunk)[0], axis=-1)
        else:  # no exact tiling (a prime C): select reducer over chunks of 20
            head, tail = _split_last(logits, _SUM_CHUNK)
            partial = jax.lax.reduce(head, lowest, _select_max, (last + 1,))
            partial = jnp.concatenate([partial, tail], axis=-1)
        return jax.lax.reduce(partial, lowest, _select_max, (last,)).astype(ct)
    int_dtype = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[logits.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(logits, int_dtype)
    lowest = jax.lax.bitcast_convert_type(jnp.array(-jnp.inf, logits.dtype), int_dtype)
    m_bits = jax.lax.reduce(bits, lowest, _ordered_bits_max, (last,))
    return jax.lax.bitcast_convert_type(m_bits, logits.dtype).astype(ct)


def _row_sums(summands, logits, weights):
    """Sums over the last axis of `summands(x, classes, w)`: arrays in the
    compute dtype made from logits `x`, their class indices and class weights
    `w` (compute dtype or None), as one variadic reduce (two stages for long
    rows, see `_LONG_ROW`)."""
    n_classes = logits.shape[-1]
    last = logits.ndim - 1
    classes = jnp.arange(n_classes)
    if n_classes <= _LONG_ROW:
        operands = summands(logits, classes, weights)
        inits = (jnp.zeros((), operands[0].dtype),) * len(operands)
        return jax.lax.reduce(operands, inits, _sum_reducer, (last,))

    # Each piece's summands are built from a slice of the logits, not sliced
    # from whole-row summands: XLA stores a summand read by two fusions (a
    # float32 copy of the logits, seen at C = 1009). Padding the row to whole
    # pieces instead also stored one (C = 1009) and ran 2.5x slower.
    def piece_sums(start, stop, shape):
        sliced = (v if v is None else v[..., start:stop] for v in vs)
        ops = summands(
            *(v if v is None else v.reshape(*v.shape[:-1], *shape) for v in sliced)
        )
        inits = (jnp.zeros((), ops[0].dtype),) * len(ops)
        for _ in shape:  # the k axis into lane sums, then the lanes
            ops = jax.lax.reduce(ops, inits, _sum_reducer, (last,))
        return ops

    vs = (logits, classes, weights)
    sums, start = None, 0
    for k, lanes in _sum_pieces(n_classes):
        piece = piece_sums(start, start + k * lanes, (k, lanes))
        sums = piece if sums is None else tuple(map(jnp.add, sums, piece))
        start += k * lanes
    if start < n_classes:  # the few classes left over, one stage
        rest = piece_sums(start, n_classes, (n_classes - start,))
        sums = tuple(map(jnp.add, sums, rest))
    return sums


def _ce_stats(logits, safe_labels, weights):
    """Row max m, log-sum-exp minus m, sum_c w_c (m - x_c), m - x_y, in the
    compute dtype (float32, or float64 for float64 logits).

    Two passes over the low-precision logits with the cast to float32 fused
    into each: a max, then one variadic sum of (exp(x - m), [c == y](m - x_c),
    w_c (m - x_c)). Every summand is >= 0 (no cancellation) and exp only sees
    numbers <= 0 (fp16 exp overflows above 11.09).
    """
    ct = compute_dtype(logits)
    m = _row_max(logits, ct)

    def summands(x, classes, w):
        # x: logits (*lead, *classes.shape); m and labels broadcast over the
        # class dims (one for a whole row, two for a row split in chunks).
        per_row = (Ellipsis,) + (None,) * classes.ndim
        gap = m[per_row] - x.astype(ct)  # >= 0
        is_label = classes == safe_labels[per_row]
        gap_w = gap if w is None else gap * w
        return (jnp.exp(-gap), jnp.where(is_label, gap, 0.0), gap_w)

    w = None if weights is None else weights.astype(ct)
    sum_exp, gap_y, gap_w = _row_sums(summands, logits, w)
    return m, jnp.log(sum_exp), gap_w, gap_y


def check_z_loss(z_loss) -> float:
    """A finite Python number >= 0 (static: it selects the compiled terms)."""
    # Same text as torchref.losses.
    if isinstance(z_loss, bool) or not isinstance(z_loss, int | float | np.floating):
        raise TypeError(
            "z_loss must be a finite Python number >= 0 (static, e.g. 1e-4), "
            f"got {type(z_loss).__name__}"
        )
    if not (np.isfinite(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss}")
    return float(z_loss)


def _to_bfloat16(x):
    """`x.astype(bfloat16)` for float32 `x`, bit for bit, as integer ops.

    XLA:CPU (0.10) converts a vector of float32 to bfloat16 but then stores
    the bfloat16 lanes one by one (LLVM IR of the backward fusion: 8
    `extractelement` + scalar `store bfloat` per vector); as uint16 the
    store is one vector, which took the exp + convert of 4096x1000 from
    3.7 ms to 2.3 ms. Round to nearest even: add 0x7FFF plus the lowest kept
    bit, keep the top 16 bits (a carry out of the mantissa rounds up to the
    next exponent, and past the largest finite value to +-inf, as
    IEEE rounding does). NaN becomes XLA's quiet NaN of the same sign
    (0x7FC0 / 0xFFC0). Equal to XLA's convert on 16.8 M random bit patterns,
    every rounding boundary and the specials, subnormals included
    (jaxstable/tests/test_losses.py::test_ce_bfloat16_rounding_is_xla_convert).
    """
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    quiet_nan = ((bits >> 16) & 0x8000) | 0x7FC0
    out = jnp.where(jnp.isnan(x), quiet_nan, rounded).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(out, jnp.bfloat16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ce_rows(logits, labels, weights, ignore_index, smoothing, z_loss):
    """Per-element cross-entropy, class axis last, in the compute dtype."""
    return _ce_rows_fwd(logits, labels, weights, ignore_index, smoothing, z_loss)[0]


def _ce_rows_fwd(logits, labels, weights, ignore_index, smoothing, z_loss):
    n_classes = logits.shape[-1]
    ct = compute_dtype(logits)
    valid, bad, safe = _label_masks(labels, n_classes, ignore_index)
    m, lse_m, gap_w, gap_y = _ce_stats(logits, safe, weights)
    # lse - x_y = (lse - m) + (m - x_y): two non-negative terms, no cancellation.
    nll = lse_m + gap_y
    if weights is not None:
        nll = nll * weights.astype(ct)[safe]
    loss = (1.0 - smoothing) * nll
    if smoothing:
        # sum_c w_c (lse - x_c) = (lse - m) sum(w) + sum_c w_c (m - x_c) >= 0
        w_sum = n_classes if weights is None else jnp.sum(weights.astype(ct))
        loss = loss + (smoothing / n_classes) * (lse_m * w_sum + gap_w)
    if z_loss:
        lse = m + lse_m
        w_y = 1.0 if weights is None else weights.astype(ct)[safe]
        loss = loss + z_loss * w_y * jnp.square(lse)
    loss = jnp.where(valid, loss, 0.0)
    # An out-of-range label under jit: NaN, never a finite wrong loss.
    loss = jnp.where(bad, jnp.nan, loss)
    return loss, (logits, labels, weights, m, lse_m, gap_y)


def _ce_rows_bwd(ignore_index, smoothing, z_loss, res, g):
    logits, labels, weights, m, lse_m, gap_y = res
    n_classes = logits.shape[-1]
    ct = compute_dtype(logits)
    valid, bad, safe = _label_masks(labels, n_classes, ignore_index)
    g = jnp.where(bad, jnp.nan, jnp.where(valid, g.astype(ct), 0.0))
    if weights is None:
        w_y = jnp.ones_like(g)
        w_sum = float(n_classes)
    else:
        w = weights.astype(ct)
        w_y = w[safe]
        w_sum = jnp.sum(w)
    # d loss / d x_c = p_c ((1-s) w_y + s W / C) - (1-s) w_y [c == y] - s w_c / C
    z = logits.astype(ct) - m[..., None]
    p = jnp.exp(z - lse_m[..., None])  # softmax, recomputed in float32 (or 64)
    coef = g * ((1.0 - smoothing) * w_y + smoothing * w_sum / n_classes)
    if z_loss:
        # d (z w_y lse**2) / d x_c = 2 z w_y lse p_c: every column, as p's.
        coef = coef + g * (2.0 * z_loss) * w_y * (m + lse_m)
    onehot = jnp.arange(n_classes) == safe[..., None]
    # The label column from the saved m - x_y (same value as p there). Using
    # this residual also keeps the forward's sum a multi-output reduction,
    # which XLA:CPU neither hands to YNNPACK nor splits through a float32 copy.
    p_y = jnp.exp(-gap_y - lse_m)
    label_grad = p_y * coef - g * (1.0 - smoothing) * w_y
    grad = jnp.where(onehot, label_grad[..., None], p * coef[..., None])
    if smoothing:
        per_class = 1.0 if weights is None else w
        grad = grad - (g * (smoothing / n_classes))[..., None] * per_class
    if logits.dtype == jnp.bfloat16 and grad.dtype == jnp.float32:
        grad = _to_bfloat16(grad)
    else:
        grad = grad.astype(logits.dtype)

    d_weights = None
    if weights is not None:
        # d loss / d w_k = (1-s) [k == y] (lse - x_y) + s/C (lse - x_k); XLA
        # drops this entirely when nobody asks for the weights' gradient.
        nll_raw = (
            lse_m
            + m
            - jnp.take_along_axis(logits, safe[..., None], -1)[..., 0].astype(ct)
        )
        per_label = (1.0 - smoothing) * nll_raw
        if z_loss:
            per_label = per_label + z_loss * jnp.square(m + lse_m)
        gz = jnp.where(valid, g, 0.0) * per_label
        d_w = jnp.zeros((n_classes,), ct).at[safe.ravel()].add(gz.ravel())
        if smoothing:
            lse_minus_x = lse_m[..., None] - z
            d_w = d_w + (smoothing / n_classes) * jnp.sum(
                (g[..., None] * lse_minus_x).reshape(-1, n_classes), axis=0
            )
        d_weights = d_w.astype(weights.dtype)
    return grad, None, d_weights


_ce_rows.defvjp(_ce_rows_fwd, _ce_rows_bwd)


def _weighted_mean(total, count, weight_sum):
    """F.cross_entropy's weighted mean total / weight_sum, a negative
    weight_sum included (torch's value); 0.0 (zero gradient) when no element
    counts (count == 0); NaN, gradient included, when elements count but
    their weights sum to 0 (torch: +-inf or NaN, x / 0)."""
    counted = count > 0
    mean = total / jnp.where(counted, weight_sum, 1.0)
    nan_if_zero = nan_if(counted & (weight_sum == 0), mean.dtype)
    return jnp.where(counted, mean * nan_if_zero, 0.0)


def softmax_cross_entropy(
    logits: Array,
    labels: Array,
    *,
    axis: int = -1,
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    weights: Array | None = None,
    reduction: str = "mean",
    z_loss: float = 0.0,
) -> jax.Array:
    r"""Cross-entropy with integer labels, computed in at least float32.

    Same result as ``torch.nn.functional.cross_entropy`` (class weights, label
    smoothing, ``ignore_index``). For an element ``n`` with label ``y``, ``C``
    classes, weights ``w`` (ones by default) and smoothing ``s``::

        lse   = log sum_c exp(x_c)
        l_n   = (1 - s) w_y (lse - x_y) + (s / C) sum_c w_c (lse - x_c)
        mean  = sum_n l_n / sum_n w_{y_n}     (ignored elements excluded)

    With ``z_loss = z > 0`` (PaLM's auxiliary loss, which keeps the
    log-partition ``lse`` near 0 and so the output logits from drifting):
    ``l_n += z w_{y_n} lse_n**2``, from the float32 ``lse`` the loss already
    computes; it is reduced with the loss (ignored elements add nothing,
    "mean" divides by the same ``sum_n w_{y_n}``), so the mean is the CE
    mean plus ``z`` times the (weighted) mean of ``lse**2``. Its gradient
    ``2 z w_y lse softmax(x)`` joins the custom backward (no second pass).

    Deviation from torch (documented, tested): a mean over zero valid
    elements (every label ignored, or an empty batch) is 0.0 with a zero
    gradient; torch returns NaN (0/0). Class weights may be negative: a
    negative ``sum_n w_{y_n}`` gives torch's value; a zero one, with valid
    elements, gives NaN (torch: +-inf or NaN, a division by 0), never 0.0.

    bf16/fp16 logits are read as they are: max and log-sum-exp are taken in
    float32 inside the reductions, the backward pass recomputes the softmax in
    float32 and writes the gradient in the logits' dtype (custom VJP), so no
    float32 copy of the logits is materialised (fp16 ``exp`` overflows above
    11.09; float32 after max-subtraction never does).

    With ``JAXSTABLE_CE_KERNEL=1`` (read when the loss is traced), on a GPU
    backend, for float16/bfloat16/float32 logits with up to 2**18 classes
    and no ``z_loss``, the forward and backward run as one Pallas (Triton)
    kernel each that reads the logits once (the same formulas). By default
    (``auto``, or ``0``) the XLA path: on an H200 the kernel was slower than
    it on 8 of 10 benchmark rows (benchmarks/results/bench_gpu_gpu_ce.md).
    The kernel has no partitioning rule: ask for it with several devices
    only inside `jax.shard_map`.

    Precision: float32; float64 for float64 ``logits`` (x64 on; the module
    docstring's rule). All-equal logits have the gradient ``1/C - [c == y]``
    (the analytic softmax, as ``F.cross_entropy``).

    Args:
      logits: floating array with the class axis at ``axis`` (NHWC: -1).
      labels: integer array, ``logits.shape`` without the class axis.
      axis: class axis of ``logits``.
      ignore_index: label value that contributes nothing (e.g. 255).
      label_smoothing: ``s`` in [0, 1] (a Python number, static).
      weights: optional per-class weights, shape ``(C,)``.
      reduction: "mean", "sum" or "none" (per-element losses).
      z_loss: coefficient ``z`` of ``lse**2``, a finite Python number >= 0
        (static; 1e-4 in PaLM). 0 adds nothing.

    Returns:
      float32 scalar (or per-element array for reduction="none"); float64
      for float64 logits. A label
      outside [0, C) that is not ``ignore_index`` raises ``ValueError`` naming
      the bad values when ``labels`` are concrete; under ``jit`` that
      element's loss (and so the mean) is NaN, so finiteness guards see it.
      Labels are checked as given: an int64 numpy label beyond the int32
      range raises here even with x64 off. Under ``jit`` JAX has already
      converted such an argument to int32 before this function sees it
      (2**32 + 1 arrives as 1, silently): check int64 labels before jitting.

      Non-finite logits, as in torch: NaN or +inf in a counted element's row
      gives NaN; -inf gives +inf on the label (with smoothing: on any class)
      and is an exact zero probability on another class (finite loss); a row
      of -inf gives NaN. On an ignored element any of them leaves the loss
      finite but makes that row's gradient NaN (0 * NaN in the softmax), in
      both frameworks: a finiteness guard on the gradients catches it.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import losses
      >>> logits = jnp.array([[3000.0, 0.0], [0.0, 1.0]], jnp.float16)
      >>> loss = losses.softmax_cross_entropy(logits, jnp.array([1, 255]),
      ...                                     ignore_index=255)
      >>> print(loss.dtype, float(loss))
      float32 3000.0
      >>> # z-loss: + z * logsumexp(x)**2 = 1e-4 * (2 + log 2)**2 here
      >>> z = losses.softmax_cross_entropy(jnp.full((1, 2), 2.0), jnp.array([0]),
      ...                                  z_loss=1e-4)
      >>> round(float(z) - float(jnp.log(2.0)), 6)
      0.000725
    """
    _check_reduction(reduction)
    z_loss = check_z_loss(z_loss)
    if isinstance(labels, (np.ndarray, np.generic, int, list, tuple)):
        # Keep numpy/Python labels as given for the range check below: with
        # x64 off, jnp.asarray wraps an int64 2**32 + 1 to 1, a valid class.
        labels = np.asarray(labels)
    labels_given = labels
    logits, labels = as_arrays(logits=logits, labels=labels)
    _check_logits_and_labels(logits, labels, axis)
    n_classes = logits.shape[axis]
    smoothing = float(label_smoothing)
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if weights is not None:
        (weights,) = as_arrays(weights=weights)
        _check_class_weights(weights, n_classes)
    if is_concrete(labels) and labels.size:
        _check_label_range(np.asarray(labels_given), n_classes, ignore_index)

    x = jnp.moveaxis(logits, axis, -1)
    # On a GPU the Pallas kernel; it has no z-loss term, so z_loss > 0 takes XLA's.
    if ce_kernel_applies(x, weights=weights) and not z_loss:
        per_elem = softmax_cross_entropy_last_axis(
            x, labels, weights, ignore_index, smoothing
        )
    else:
        per_elem = _ce_rows(x, labels, weights, ignore_index, smoothing, z_loss)
    if reduction == "none":
        return per_elem
    total = jnp.sum(per_elem)
    if reduction == "sum":
        return total
    valid, _, safe = _label_masks(labels, n_classes, ignore_index)
    ct = per_elem.dtype
    if weights is None:
        return masked_mean(total, jnp.sum(valid, dtype=ct))
    w_y = jnp.where(valid, weights.astype(ct)[safe], 0.0)
    return _weighted_mean(total, jnp.sum(valid), jnp.sum(w_y))


def _check_logits_and_labels(logits, labels, axis: int) -> None:
    """Float logits with a class axis at `axis`, integer labels of the
    logits' shape without it, at least one class."""
    check_float("logits", logits)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"labels must be an integer array of class indices, got dtype "
            f"{labels.dtype} (probability targets are not supported)"
        )
    if logits.ndim == 0:
        raise ValueError("logits must have a class axis, got a scalar")
    if not -logits.ndim <= axis < logits.ndim:
        raise ValueError(
            f"axis={axis} is out of range for logits with {logits.ndim} dims"
        )
    expected = (
        logits.shape[: axis % logits.ndim] + logits.shape[axis % logits.ndim + 1 :]
    )
    if labels.shape != expected:
        raise ValueError(
            f"labels.shape={labels.shape} must equal logits.shape={logits.shape} "
            f"without the class axis {axis}, i.e. {expected}"
        )
    if logits.shape[axis] == 0:
        raise ValueError(f"logits have 0 classes along axis {axis}")


def _check_class_weights(weights, n_classes: int) -> None:
    check_float("weights", weights)
    if weights.shape != (n_classes,):
        raise ValueError(
            f"weights must have shape ({n_classes},) (one per class), got "
            f"{weights.shape}"
        )


def _check_label_range(lab: np.ndarray, n_classes: int, ignore_index) -> None:
    """Concrete labels (as given, not wrapped to int32) are classes or
    `ignore_index`."""
    bad = (lab < 0) | (lab >= n_classes)
    if ignore_index is not None:
        bad &= lab != ignore_index
    if bad.any():
        raise ValueError(bad_label_message(lab[bad], n_classes, ignore_index))
