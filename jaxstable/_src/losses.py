"""Float32-safe losses for low-precision (fp16/bf16) JAX training.

Precision, one rule for every loss (and for torchref's twins): a loss computes
in at least float32. It computes and returns float32 for bf16, fp16 and
float32 predictions, and float64 when its predictions are float64 (the input
named in its docstring's "Precision" line: `logits`, `probs`, `pred`,
`prob`/`thresh`, `a`/`b`, `boxes1`/`boxes2`); targets, masks and weights are
cast to that dtype. With x64 off (JAX's default) no array is float64: `jnp.asarray`
has already made a float64 numpy input float32, so the loss is float32 there.
The cross-entropy reads bf16/fp16 logits directly: the cast to float32 is
fused into its reductions and its custom VJP writes the gradient in the
logits' dtype, so no float32 copy of the logits is ever materialised.

Gradients at kinks and ties are those of the PyTorch reference formula
(autograd's conventions, tested against torch): BCE-with-logits' gradient is
``sigmoid(x) - t`` at every logit, 0 included (as torch's
``binary_cross_entropy_with_logits``); ``|d|`` has gradient ``sign(d)``, 0 at
``d = 0`` (torch's ``abs``); a clamp passes the whole gradient at the tie
(torch's ``clamp_min``); ``maximum``/``minimum`` of two equal values give
each half (torch's too); among equal hard negatives the lowest index is kept
(a stable sort, in both twins: ``torch.topk``'s choice among ties is
unspecified).

No bad input gives a finite wrong number: it raises a ValueError/TypeError
naming the value and what is allowed when the inputs are concrete (eager
calls, numpy inputs), and makes the loss NaN when it can only be seen under
`jit` (traced values cannot raise), so a finiteness guard sees it. Scalar
options (eps, temperature, k, ratios, weights) must be finite; an eps must
also be at least float32's smallest normal number. What JAX does before a
loss sees its inputs is documented where it matters: int64 labels under
`jit` (softmax_cross_entropy), subnormal masks (masked_l1_loss).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = Any  # jax.Array or anything jnp.asarray accepts

_REDUCTIONS = ("mean", "sum", "none")
_F32 = jnp.float32
# float32's smallest normal number 1.1754944e-38: the floor of every eps (a
# subnormal one is flushed to 0 by XLA on CPU: 0 / (0 + eps) = NaN) and of
# the focal loss' modulating base (see sigmoid_focal_loss)
_TINY = float(np.finfo(np.float32).tiny)


# ---------------------------------------------------------------------------
# validation helpers (host side; they only look at static shapes/dtypes or at
# concrete values, never at tracers)
# ---------------------------------------------------------------------------


def _is_concrete(x) -> bool:
    """True when `x` holds values now (not a tracer under jit/vmap/grad)."""
    return not isinstance(x, jax.core.Tracer)


def _as_arrays(**inputs):
    """The inputs, in order, as jax arrays (None passes through); TypeError
    naming an input that is not array-like (torchref's `_as_tensors` twin)."""
    out = []
    for name, x in inputs.items():
        if x is not None:
            try:
                x = jnp.asarray(x)
            except TypeError:
                dtype = f" of dtype {x.dtype}" if hasattr(x, "dtype") else ""
                raise TypeError(
                    f"{name} must be a numeric array or array-like (list, "
                    f"numpy array), got {type(x).__name__}{dtype}"
                ) from None
        out.append(x)
    return out


def _compute_dtype(*predictions) -> Any:
    """The dtype a loss computes in: float64 when a prediction is float64
    (possible only with x64 on), float32 otherwise ("at least float32")."""
    wide = any(x is not None and x.dtype == jnp.float64 for x in predictions)
    return jnp.float64 if wide else _F32


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"unknown reduction {reduction!r}; valid values: {', '.join(_REDUCTIONS)}"
        )


def _check_float(name: str, x: Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating array, got dtype {x.dtype}")


def _check_same_shape(name_a: str, a: Array, name_b: str, b: Array) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} and {name_b} must have the same shape, got "
            f"{name_a}.shape={a.shape} and {name_b}.shape={b.shape}"
        )


def _check_positive(
    name: str, value, *, allow_zero: bool = False, finite: bool = False
) -> None:
    """Raise for a non-scalar `value` (traced or not), and ValueError for a
    concrete one <= 0 (< 0 with allow_zero), NaN, or inf when `finite`
    (torchref's `_check_positive` twin: the same messages)."""
    if np.ndim(value) != 0:  # static shape: checked for tracers too
        raise ValueError(f"{name} must be a scalar, got shape {np.shape(value)}")
    if not _is_concrete(value):
        return  # a traced (e.g. learnable) value cannot be checked here
    v = float(np.asarray(value, dtype=np.float64))
    rule = ">= 0" if allow_zero else "> 0"
    if finite and not np.isfinite(v):
        raise ValueError(f"{name} must be a finite number {rule}, got {value}")
    if (v < 0 if allow_zero else v <= 0) or np.isnan(v):
        raise ValueError(f"{name} must be {rule}, got {value}")


def _check_eps(name: str, value) -> None:
    """A finite eps >= float32's smallest normal number (see `_TINY`)."""
    _check_positive(name, value, finite=True)
    if _is_concrete(value) and float(np.asarray(value, np.float64)) < _TINY:
        raise ValueError(
            f"{name} must be >= {_TINY:.8g} (float32's smallest normal number; "
            f"XLA on CPU flushes a smaller one to 0), got {value}"
        )


def _check_non_negative_values(name: str, x) -> None:
    """ValueError if a concrete `x` holds a negative value (host check; a
    traced `x` is left to the caller, which turns the result into NaN)."""
    if not _is_concrete(x):
        return
    values = np.asarray(x)
    negative = values < 0
    if negative.any():
        raise ValueError(
            f"{name} must be >= 0 everywhere (a weight per element); found "
            f"{int(negative.sum())} negative value(s), the lowest "
            f"{values[negative].min()}"
        )


def _isnan(x):
    """isnan for any dtype (an integer or bool array is never NaN)."""
    return (
        jnp.isnan(x)
        if jnp.issubdtype(x.dtype, jnp.inexact)
        else jnp.zeros_like(x, bool)
    )


def _nan_if(condition, dtype=_F32):
    """1.0, or NaN where `condition`: a factor that makes a loss and its
    gradient NaN for an input that has no defined loss (under jit, where
    nothing can raise), so a finiteness guard sees it."""
    return jnp.where(condition, jnp.nan, 1.0).astype(dtype)


def _bad_label_message(bad_values: np.ndarray, n_classes: int, ignore_index) -> str:
    uniq = np.unique(bad_values)
    shown = ", ".join(str(int(v)) for v in uniq[:10])
    more = f" (+{uniq.size - 10} more)" if uniq.size > 10 else ""
    ign = "" if ignore_index is None else f" and not ignore_index={ignore_index}"
    return (
        f"labels must be in [0, {n_classes}){ign}; found {bad_values.size} "
        f"element(s) with values [{shown}]{more}"
    )


# ---------------------------------------------------------------------------
# softmax cross-entropy
# ---------------------------------------------------------------------------


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
# ~10 ms). Measured on XLA:CPU 0.10, 2 cores, reductions timed alone:
# - row max: a plain `jnp.max` over chunks of the row in the logits' own
#   dtype is a vectorised library reduction (0.5 ms vs 8 ms for the
#   bit-pattern max); the few chunk maxima are then combined by a select
#   reducer, which the library fusion does not take, so the library output
#   stops there instead of swallowing the broadcast of the row max;
# - sum: the variadic `a - (-b)` reduce over chunks of 20 classes, then over
#   the C / 20 partial sums, takes ~4.5 ms instead of ~17 ms (chunks of 4..20
#   are all fast; 25 or more are as slow as the whole row).
# A remainder that does not fill a chunk is sliced off and joins the second
# stage: padding to a multiple of the chunk instead made XLA store a float32
# copy of the logits (C = 1009) and ran 2.5x slower (C = 1000, chunks of 16).
# Rows of <= 32 classes (segmentation, C = 19) keep the one-stage forms,
# fastest there (8.1 ms fwd+bwd for 8x128x128x19; two-stage forms 13-16 ms).
_LONG_ROW = 32
_SUM_CHUNK = 20


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
    # The remainder's summands are built from a slice of the logits, not
    # sliced from whole-row summands: XLA stores a summand read by two
    # fusions (a float32 copy of the logits, seen at C = 1009).
    parts = [_split_last(v, _SUM_CHUNK) for v in (logits, classes)]
    w_parts = (None, None) if weights is None else _split_last(weights, _SUM_CHUNK)
    head_ops = summands(parts[0][0], parts[1][0], w_parts[0])
    inits = (jnp.zeros((), head_ops[0].dtype),) * len(head_ops)
    partial = jax.lax.reduce(head_ops, inits, _sum_reducer, (last + 1,))
    if parts[0][1].shape[-1]:
        tail_ops = summands(parts[0][1], parts[1][1], w_parts[1])
        partial = tuple(
            jnp.concatenate([p, t], axis=-1)
            for p, t in zip(partial, tail_ops, strict=True)
        )
    return jax.lax.reduce(partial, inits, _sum_reducer, (last,))


def _ce_stats(logits, safe_labels, weights):
    """Row max m, log-sum-exp minus m, sum_c w_c (m - x_c), m - x_y, in the
    compute dtype (float32, or float64 for float64 logits).

    Two passes over the low-precision logits with the cast to float32 fused
    into each: a max, then one variadic sum of (exp(x - m), [c == y](m - x_c),
    w_c (m - x_c)). Every summand is >= 0 (no cancellation) and exp only sees
    numbers <= 0 (fp16 exp overflows above 11.09).
    """
    ct = _compute_dtype(logits)
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


def _check_z_loss(z_loss) -> float:
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ce_rows(logits, labels, weights, ignore_index, smoothing, z_loss):
    """Per-element cross-entropy, class axis last, in the compute dtype."""
    return _ce_rows_fwd(logits, labels, weights, ignore_index, smoothing, z_loss)[0]


def _ce_rows_fwd(logits, labels, weights, ignore_index, smoothing, z_loss):
    n_classes = logits.shape[-1]
    ct = _compute_dtype(logits)
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
    ct = _compute_dtype(logits)
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


def _masked_mean(total, denominator):
    """total / denominator, and 0.0 (zero gradient) where denominator is 0."""
    nonzero = denominator > 0
    return jnp.where(nonzero, total / jnp.where(nonzero, denominator, 1.0), 0.0)


def _weighted_mean(total, count, weight_sum):
    """F.cross_entropy's weighted mean total / weight_sum, a negative
    weight_sum included (torch's value); 0.0 (zero gradient) when no element
    counts (count == 0); NaN, gradient included, when elements count but
    their weights sum to 0 (torch: +-inf or NaN, x / 0)."""
    counted = count > 0
    mean = total / jnp.where(counted, weight_sum, 1.0)
    nan_if_zero = _nan_if(counted & (weight_sum == 0), mean.dtype)
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
    z_loss = _check_z_loss(z_loss)
    if isinstance(labels, (np.ndarray, np.generic, int, list, tuple)):
        # Keep numpy/Python labels as given for the range check below: with
        # x64 off, jnp.asarray wraps an int64 2**32 + 1 to 1, a valid class.
        labels = np.asarray(labels)
    labels_given = labels
    logits, labels = _as_arrays(logits=logits, labels=labels)
    _check_float("logits", logits)
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
    n_classes = logits.shape[axis]
    if n_classes == 0:
        raise ValueError(f"logits have 0 classes along axis {axis}")
    smoothing = float(label_smoothing)
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if weights is not None:
        (weights,) = _as_arrays(weights=weights)
        _check_float("weights", weights)
        if weights.shape != (n_classes,):
            raise ValueError(
                f"weights must have shape ({n_classes},) (one per class), got "
                f"{weights.shape}"
            )
    if _is_concrete(labels) and labels.size:
        lab = np.asarray(labels_given)  # as given, not wrapped to int32
        bad = (lab < 0) | (lab >= n_classes)
        if ignore_index is not None:
            bad &= lab != ignore_index
        if bad.any():
            raise ValueError(_bad_label_message(lab[bad], n_classes, ignore_index))

    x = jnp.moveaxis(logits, axis, -1)
    per_elem = _ce_rows(x, labels, weights, ignore_index, smoothing, z_loss)
    if reduction == "none":
        return per_elem
    total = jnp.sum(per_elem)
    if reduction == "sum":
        return total
    valid, _, safe = _label_masks(labels, n_classes, ignore_index)
    ct = per_elem.dtype
    if weights is None:
        return _masked_mean(total, jnp.sum(valid, dtype=ct))
    w_y = jnp.where(valid, weights.astype(ct)[safe], 0.0)
    return _weighted_mean(total, jnp.sum(valid), jnp.sum(w_y))


# ---------------------------------------------------------------------------
# binary losses
# ---------------------------------------------------------------------------


@jax.custom_jvp
def _bce_with_logits(x, t):
    """max(x, 0) - x t + log(1 + exp(-|x|)): exp never sees a positive number.

    Its derivatives are torch's (``binary_cross_entropy_with_logits``'s
    backward): ``sigmoid(x) - t`` in x and ``-x`` in t, at every x. Autodiff
    of the formula would give ``-t`` at x = 0 (``jax.grad(abs)(0)`` is 1 and
    ``maximum`` gives the tie half): a zero-initialised head starts exactly
    there.
    """
    return jnp.maximum(x, 0.0) - x * t + jnp.log1p(jnp.exp(-jnp.abs(x)))


@functools.partial(_bce_with_logits.defjvp, symbolic_zeros=True)
def _bce_with_logits_jvp(primals, tangents):
    x, t = primals
    dx, dt = tangents
    out = _bce_with_logits(x, t)
    # a symbolic zero stays out of the sum: -x * 0 would be NaN at x = +-inf
    d_out = jnp.zeros_like(out)
    if not isinstance(dx, jax.custom_derivatives.SymbolicZero):
        d_out = d_out + (jax.nn.sigmoid(x) - t) * dx
    if not isinstance(dt, jax.custom_derivatives.SymbolicZero):
        d_out = d_out - x * dt
    return out, d_out


def _abs(d):
    """|d| with torch's gradient sign(d): 0 at d = 0 (jax.grad(abs)(0) is 1)."""
    return d * jnp.sign(d)


def sigmoid_binary_cross_entropy(
    logits: Array,
    targets: Array,
    *,
    weights: Array | None = None,
    reduction: str = "mean",
) -> jax.Array:
    r"""Binary cross-entropy on logits in float32 (as torch's BCE-with-logits).

    ``l = w * (max(x, 0) - x t + log(1 + exp(-|x|)))``; "mean" divides the sum
    by the number of elements (as torch does, not by the sum of weights); the
    mean of an empty array is 0.0 (torch: NaN). The gradient is torch's
    ``w (sigmoid(x) - t)`` at every logit, ``x = 0`` included.

    Precision: float32; float64 for float64 ``logits`` (x64 on).

    Args:
      logits: floating array of any shape (any float dtype).
      targets: same shape, values in [0, 1] (soft targets allowed).
      weights: optional elementwise weights, broadcastable to ``logits``.
      reduction: "mean", "sum" or "none".

    Returns:
      float32 scalar, or float32 array of ``logits.shape`` for "none"
      (float64 for float64 logits).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxstable import losses
      >>> x = jnp.array([-20000.0, 0.0, 20000.0], jnp.float16)
      >>> loss = losses.sigmoid_binary_cross_entropy(x, jnp.array([0.0, 1.0, 1.0]))
      >>> print(loss.dtype, round(float(loss), 4))
      float32 0.231
      >>> t = jnp.array([1.0, 0.0, 1.0, 0.0])  # at logit 0: (sigmoid(0) - t) / 4
      >>> print(jax.grad(losses.sigmoid_binary_cross_entropy)(jnp.zeros(4), t))
      [-0.125  0.125 -0.125  0.125]
    """
    _check_reduction(reduction)
    logits, targets, weights = _as_arrays(
        logits=logits, targets=targets, weights=weights
    )
    _check_float("logits", logits)
    _check_same_shape("logits", logits, "targets", targets)
    ct = _compute_dtype(logits)
    loss = _bce_with_logits(logits.astype(ct), targets.astype(ct))
    if weights is not None:
        try:
            fits = jnp.broadcast_shapes(weights.shape, logits.shape) == logits.shape
        except ValueError:
            fits = False
        if not fits:  # weights of a larger shape would silently change the mean
            raise ValueError(
                f"weights.shape={weights.shape} does not broadcast to "
                f"logits.shape={logits.shape}"
            )
        loss = loss * weights.astype(ct)
    if reduction == "none":
        return jnp.broadcast_to(loss, logits.shape)
    if reduction == "sum":
        return jnp.sum(loss)
    return jnp.sum(loss) / max(logits.size, 1)


def balanced_binary_cross_entropy(
    logits: Array,
    targets: Array,
    mask: Array,
    *,
    negative_ratio: float = 3.0,
    eps: float = 1e-6,
) -> jax.Array:
    r"""DBNet's balanced BCE with online hard negative mining, on logits.

    Positives are ``targets > 0.5`` inside ``mask > 0.5``; negatives the rest of
    the mask. With ``P`` positives and ``N`` negatives, ``k = min(N,
    floor(ratio * P))`` and::

        loss = (sum of positive BCE + sum of the k largest negative BCE) / (P + k + eps)

    Works under ``jit``: the hardest negatives come from a full sort with a
    mask ``rank < k`` instead of a top-k with a data-dependent ``k``.

    Ties: among equal negative losses at the k-th place the lowest (flat)
    index is kept, here (a stable sort) and in torchref (whose reference,
    DBNet's ``torch.topk``, picks some of the tied ones, which ones being
    unspecified and different on CPU and CUDA). This decides which pixels get
    a gradient when a zero-initialised head gives every negative the loss
    log 2. A pixel's BCE gradient is torch's ``sigmoid(x) - t``, ``x = 0``
    included.

    Precision: float32; float64 for float64 ``logits`` (x64 on). ``k`` is
    always taken in float32 (below).

    ``ratio * P`` is taken in float32 on both sides (jaxstable and torchref),
    so they pick the same ``k``. DBNet's reference takes it in float64; for a
    ratio that is not exact in binary (0.57, say) the two can differ by one
    (float32: 100 * 0.57 = 57.000002 -> 57; float64: 56.99999999999999 -> 56).
    The default ratio 3.0 is exact for any ``P`` below 2**22.

    Non-finite inputs, as torch's ``topk`` sees them: a NaN loss on a
    negative pixel counts as the hardest negative (the result is NaN when
    ``k >= 1``; a plain sort would put it last and drop it). A NaN in
    ``mask``, or in ``targets`` inside the mask, is neither a positive nor a
    negative: the result is NaN. A NaN logit outside the mask leaves the loss
    finite but its gradient NaN (0 * NaN), as in torch: a finiteness guard on
    the gradients catches it.

    Args:
      logits: shrink-map logits (any float dtype), any shape.
      targets: binary ground-truth map, same shape.
      mask: binary training mask, same shape.
      negative_ratio: negatives kept per positive, a finite number > 0 (a
        ratio at least #neg / #pos keeps every negative).
      eps: added to the count, finite and >= 1.2e-38 (float32's smallest
        normal number); an image without positives gives 0.0.

    Returns:
      float32 scalar (float64 for float64 logits).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import losses
      >>> x = jnp.array([2.0, -1.0, 3.0, -4.0, 0.0])
      >>> g = jnp.array([1.0, 0.0, 0.0, 0.0, 0.0])
      >>> loss = losses.balanced_binary_cross_entropy(x, g, jnp.ones(5),
      ...                                            negative_ratio=2.0)
      >>> print(round(float(loss), 4))
      1.2896
    """
    logits, targets, mask = _as_arrays(logits=logits, targets=targets, mask=mask)
    _check_float("logits", logits)
    _check_same_shape("logits", logits, "targets", targets)
    _check_same_shape("logits", logits, "mask", mask)
    _check_positive("negative_ratio", negative_ratio, finite=True)
    _check_eps("eps", eps)  # > 0: no positives and no negatives is 0 / eps
    ct = _compute_dtype(logits)
    in_mask = mask > 0.5
    positive = (targets > 0.5) & in_mask
    negative = ~(targets > 0.5) & in_mask
    loss = _bce_with_logits(logits.astype(ct), positive.astype(ct)).ravel()
    n_pos = jnp.sum(positive, dtype=jnp.int32)
    n_neg = jnp.sum(negative, dtype=jnp.int32)
    ratio_p = n_pos.astype(_F32) * jnp.float32(negative_ratio)  # float32 (see above)
    # A ratio_p beyond int32 (ratio 1e30) is never cast: XLA's float->int of
    # an out-of-range value is not defined. The int cast floors (ratio_p >= 0).
    enough = ratio_p >= n_neg.astype(_F32)
    floor_ratio_p = jnp.where(enough, 0.0, ratio_p).astype(jnp.int32)
    k = jnp.where(enough, n_neg, jnp.minimum(n_neg, floor_ratio_p))
    neg_loss = jnp.where(negative.ravel(), loss, 0.0)
    # descending; stable: equal losses keep their order (the lowest index
    # first), as torchref's stable sort does
    hardest = -jnp.sort(-neg_loss, stable=True)
    top_k = jnp.sum(jnp.where(jnp.arange(hardest.size) < k, hardest, 0.0))
    pos_sum = jnp.sum(jnp.where(positive.ravel(), loss, 0.0))
    # The sort puts NaN last, torch.topk first: a NaN negative loss is in
    # torch's top k whenever k >= 1, so it makes this loss NaN too. A NaN
    # target or mask is neither positive nor negative: NaN as well.
    undefined = ((k > 0) & jnp.any(negative.ravel() & jnp.isnan(loss))) | jnp.any(
        _isnan(mask) | (_isnan(targets) & in_mask)
    )
    total = (pos_sum + top_k) * _nan_if(undefined, ct)
    return total / ((n_pos + k).astype(ct) + eps)


def dice_loss(
    probs: Array,
    targets: Array,
    mask: Array | None = None,
    *,
    eps: float = 1e-6,
) -> jax.Array:
    r"""Dice loss: ``1 - 2 sum(p g m) / (sum(p m) + sum(g m) + eps)``.

    An empty mask (or empty prediction and target) gives 1.0 with a finite
    gradient: the denominator is at least ``eps``.

    Precision: float32; float64 for float64 ``probs`` (x64 on).

    Args:
      probs: predicted probabilities (any float dtype).
      targets: ground truth, same shape.
      mask: optional weights/mask, same shape (ones when None).
      eps: keeps the ratio finite: finite and >= 1.2e-38 (float32's
        smallest normal number).

    Returns:
      float32 scalar in [-inf, 1] (in [0, 1] for probabilities in [0, 1]);
      float64 for float64 probs.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import losses
      >>> p = jnp.array([0.75, 0.25, 0.5], jnp.bfloat16)
      >>> print(round(float(losses.dice_loss(p, jnp.array([1.0, 0.0, 1.0]))), 3))
      0.286
    """
    probs, targets, mask = _as_arrays(probs=probs, targets=targets, mask=mask)
    _check_float("probs", probs)
    _check_same_shape("probs", probs, "targets", targets)
    _check_eps("eps", eps)
    ct = _compute_dtype(probs)
    p, g = probs.astype(ct), targets.astype(ct)
    if mask is None:
        m = jnp.ones((), ct)
    else:
        _check_same_shape("probs", probs, "mask", mask)
        m = mask.astype(ct)
    intersection = jnp.sum(p * g * m)
    union = jnp.sum(p * m) + jnp.sum(g * m) + eps
    return 1.0 - 2.0 * intersection / union


def masked_l1_loss(pred: Array, target: Array, mask: Array) -> jax.Array:
    r"""Masked mean absolute error: ``sum(|p - t| m) / sum(m)``.

    An empty mask gives 0.0 with a zero (finite) gradient, as DBNet's
    reference returns the zero mask sum instead of dividing by it. Where
    ``p == t`` the gradient is 0, as torch's ``abs`` (``sign(0) = 0``) in
    DBNet's reference (``jax.grad(jnp.abs)(0.0)`` is 1).

    Precision: float32; float64 for float64 ``pred`` (x64 on).

    A negative mask value raises ``ValueError`` when ``mask`` is concrete;
    under ``jit`` it makes the loss and its gradient NaN (a sum of mixed-sign
    weights could be 0 or negative: no mean is defined).

    Cannot be changed (documented): XLA on CPU flushes subnormal float32
    values (below 1.18e-38) to zero, so a mask of 1e-40 everywhere is an
    empty mask here (0.0) while torch divides by its tiny sum (the mean).

    Args:
      pred: predictions (any float dtype), e.g. DBNet's threshold map.
      target: same shape.
      mask: non-negative weights/mask, same shape.

    Returns:
      float32 scalar (float64 for float64 pred).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import losses
      >>> p, t = jnp.array([0.5, 0.2, 0.9]), jnp.array([0.3, 0.2, 0.0])
      >>> print(round(float(losses.masked_l1_loss(p, t, jnp.array([1, 1, 0]))), 3))
      0.1
      >>> print(float(losses.masked_l1_loss(p, t, jnp.zeros(3))))
      0.0
    """
    pred, target, mask = _as_arrays(pred=pred, target=target, mask=mask)
    _check_float("pred", pred)
    _check_same_shape("pred", pred, "target", target)
    _check_same_shape("pred", pred, "mask", mask)
    _check_non_negative_values("mask", mask)
    ct = _compute_dtype(pred)
    m = mask.astype(ct)
    total = jnp.sum(_abs(pred.astype(ct) - target.astype(ct)) * m)
    mean = _masked_mean(total, jnp.sum(m))
    # A traced negative mask (a concrete one raised above): NaN value and
    # gradient. A NaN factor on `mean` would not do: for a mask sum <= 0 its
    # where() sends a zero gradient past the factor.
    negative = jnp.any(m < 0)
    return jnp.where(negative, total * _nan_if(negative, ct), mean)


def db_step(prob: Array, thresh: Array, *, k: float = 50.0) -> jax.Array:
    r"""DBNet's differentiable binarisation ``sigmoid(k (prob - thresh))``.

    Equal in value to the references' ``reciprocal(1 + exp(-k (x - y)))``,
    but that form overflows: with k=50, ``exp(-k (x - y))`` exceeds the fp16
    maximum once ``x - y < -0.222`` (exp overflows fp16 above 11.09) and its
    backward then multiplies inf by 0. ``jax.nn.sigmoid`` in float32 has a
    finite gradient for every input in [0, 1] (``k / 4`` at ``prob ==
    thresh``, as the reference's).

    Precision: float32; float64 when ``prob`` or ``thresh`` is float64 (x64
    on).

    Args:
      prob: probability map (any float dtype).
      thresh: threshold map, broadcastable with ``prob``.
      k: amplification factor, a finite number > 0.

    Returns:
      float32 array, the broadcast shape of ``prob`` and ``thresh`` (float64
      when either is float64).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import losses
      >>> out = losses.db_step(jnp.array([0.0, 0.5, 1.0], jnp.float16),
      ...                      jnp.array([1.0, 0.5, 0.0], jnp.float16))
      >>> print(out.dtype, [round(float(v), 4) for v in out])
      float32 [0.0, 0.5, 1.0]
    """
    prob, thresh = _as_arrays(prob=prob, thresh=thresh)
    _check_float("prob", prob)
    _check_positive("k", k, finite=True)
    try:
        jnp.broadcast_shapes(prob.shape, thresh.shape)
    except ValueError:
        raise ValueError(
            f"prob.shape={prob.shape} and thresh.shape={thresh.shape} do not broadcast"
        ) from None
    ct = _compute_dtype(prob, thresh)
    return jax.nn.sigmoid(k * (prob.astype(ct) - thresh.astype(ct)))


def db_loss(
    shrink_logits: Array,
    thresh: Array,
    gt: Array,
    mask: Array,
    thresh_map: Array,
    thresh_mask: Array,
    *,
    k: float = 50.0,
    bce_weight: float = 5.0,
    l1_weight: float = 10.0,
    dice_weight: float = 1.0,
    negative_ratio: float = 3.0,
    eps: float = 1e-6,
    return_terms: bool = False,
):
    r"""DBNet's total loss, in at least float32, on the shrink-map logits.

    ``bce_weight * balanced_bce(shrink_logits, gt, mask)
    + l1_weight * masked_l1(thresh, thresh_map, thresh_mask)
    + dice_weight * dice(db_step(sigmoid(shrink_logits), thresh, k), gt, mask)``
    with DBNet's weights 5, 10 and 1 by default.

    Precision: each term follows its own loss (float64 for float64
    ``shrink_logits`` / ``thresh``, x64 on), the total their promotion.

    Args:
      shrink_logits: logits of the shrink (probability) map, e.g. (B, H, W).
      thresh: predicted threshold map in [0, 1], same shape.
      gt: binary shrink-map ground truth, same shape.
      mask: training mask for the shrink map, same shape.
      thresh_map: threshold-map ground truth, same shape.
      thresh_mask: mask of the threshold map, same shape.
      k: step amplification for the approximate binary map (finite, > 0).
      bce_weight, l1_weight, dice_weight: weights of the three terms, finite
        numbers >= 0 (0 turns a term off).
      negative_ratio, eps: passed to the balanced BCE (eps also to the dice).
      return_terms: also return ``{"bce", "l1", "dice"}`` (unweighted terms).

    Returns:
      float32 scalar, or ``(total, terms)`` when ``return_terms`` (float64
      for float64 inputs, above).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import losses
      >>> gt = jnp.zeros((1, 8, 8)).at[:, 2:6, 2:6].set(1.0)
      >>> ones = jnp.ones((1, 8, 8))
      >>> total, terms = losses.db_loss(6.0 * (2 * gt - 1), 0.3 * ones, gt, ones,
      ...                               0.3 * ones, ones, return_terms=True)
      >>> print(round(float(total), 4), sorted(terms))
      0.0124 ['bce', 'dice', 'l1']
    """
    # the options first: a bad k or eps raises before any term is computed
    _check_positive("k", k, finite=True)
    _check_eps("eps", eps)
    for name, weight in (("bce_weight", bce_weight), ("l1_weight", l1_weight),
                         ("dice_weight", dice_weight)):  # fmt: skip
        _check_positive(name, weight, allow_zero=True, finite=True)
    bce = balanced_binary_cross_entropy(
        shrink_logits, gt, mask, negative_ratio=negative_ratio, eps=eps
    )
    l1 = masked_l1_loss(thresh, thresh_map, thresh_mask)
    (shrink_logits,) = _as_arrays(shrink_logits=shrink_logits)
    prob = jax.nn.sigmoid(shrink_logits.astype(_compute_dtype(shrink_logits)))
    binary = db_step(prob, thresh, k=k)
    dice = dice_loss(binary, gt, mask, eps=eps)
    total = bce_weight * bce + l1_weight * l1 + dice_weight * dice
    if return_terms:
        return total, {"bce": bce, "l1": l1, "dice": dice}
    return total


# ---------------------------------------------------------------------------
# contrastive
# ---------------------------------------------------------------------------


def _clamp_min(x, low):
    """max(x, low) with torch's ``clamp_min`` gradient: all of it to ``x`` at
    the tie ``x == low`` (``jnp.maximum`` would give it half)."""
    return jnp.where(x >= low, x, low)


def _safe_normalize(x, eps):
    """x / clamp_min(||x||, eps) along the last axis: ``F.normalize``'s
    formula and its gradients, also at ``||x|| == eps`` and at x = 0."""
    sq = jnp.sum(x * x, axis=-1, keepdims=True)
    nonzero = sq > 0
    # the norm's gradient at x = 0 is 0, as torch's vector_norm; sqrt's own
    # there would be inf * 0 = NaN, so sqrt never sees the 0
    norm = jnp.where(nonzero, jnp.sqrt(jnp.where(nonzero, sq, 1.0)), 0.0)
    return x / _clamp_min(norm, eps)


def info_nce(
    a: Array,
    b: Array,
    *,
    temperature: float | Array = 0.07,
    min_temperature: float = 0.01,
    eps: float = 1e-8,
) -> jax.Array:
    r"""Symmetric InfoNCE (CLIP) loss, with eps-safe normalisation.

    ``a_i`` and ``b_i`` are a positive pair. With ``â = a / max(||a||, eps)``
    (rows), ``t = max(temperature, min_temperature)`` and
    ``S = â b̂^T / t``::

        loss = (CE(S, arange(N)) + CE(S^T, arange(N))) / 2

    Finite for zero embeddings (they give a zero row of ``S``) and for bf16
    inputs with tiny temperatures: ``|S| <= 1 / t`` and the log-softmax is
    max-subtracted in float32.

    Gradients at the ties are torchref's (``F.normalize`` and ``clamp``): a
    row of norm exactly ``eps`` and a temperature exactly
    ``min_temperature`` get the whole gradient of the unclamped branch (a
    max would give half), a zero row ``upstream / eps``.

    Precision: float32; float64 when ``a`` or ``b`` is float64 (x64 on).

    Args:
      a, b: embeddings, shape (N, D), any float dtype.
      temperature: a finite number > 0, a scalar: a Python number or a
        (learnable) 0-d array, clamped from below by ``min_temperature``. A
        concrete value <= 0, inf or NaN raises; a traced one (being
        differentiated) is clamped, not checked. Any other shape raises,
        traced or not (a vector would divide each column of the similarities
        by its own temperature).
      min_temperature: a finite number >= 0.
      eps: norm floor, finite and >= 1.2e-38 (float32's smallest normal).

    Returns:
      float32 scalar (float64 for float64 embeddings).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import losses
      >>> a = jnp.eye(3, dtype=jnp.bfloat16)
      >>> print(round(float(losses.info_nce(a, a, temperature=0.1)), 4))
      0.0001
      >>> print(bool(jnp.isfinite(losses.info_nce(a * 0, a))))
      True
    """
    a, b = _as_arrays(a=a, b=b)
    _check_float("a", a)
    _check_float("b", b)
    if a.ndim != 2:
        raise ValueError(f"a must have shape (N, D), got a.shape={a.shape}")
    _check_same_shape("a", a, "b", b)
    if a.shape[0] == 0:
        raise ValueError("info_nce needs at least one pair, got N=0")
    _check_positive("temperature", temperature, finite=True)
    _check_positive("min_temperature", min_temperature, allow_zero=True, finite=True)
    _check_eps("eps", eps)
    ct = _compute_dtype(a, b)
    an = _safe_normalize(a.astype(ct), eps)
    bn = _safe_normalize(b.astype(ct), eps)
    t = _clamp_min(jnp.asarray(temperature, ct), min_temperature)
    sim = jnp.matmul(an, bn.T, precision=jax.lax.Precision.HIGHEST) / t
    diag = jnp.diagonal(sim)
    loss_ab = jnp.mean(jax.nn.logsumexp(sim, axis=1) - diag)
    loss_ba = jnp.mean(jax.nn.logsumexp(sim, axis=0) - diag)
    return 0.5 * (loss_ab + loss_ba)


# ---------------------------------------------------------------------------
# detection: box regression and dense classification
# ---------------------------------------------------------------------------

_BOX_KINDS = ("iou", "giou", "diou", "ciou")


def _check_kind(kind: str) -> None:
    if kind not in _BOX_KINDS:
        raise ValueError(
            f"unknown kind {kind!r}; valid values: {', '.join(_BOX_KINDS)}"
        )


def _check_boxes(name: str, boxes) -> None:
    """Floating (..., 4) boxes."""
    _check_float(name, boxes)
    if boxes.ndim == 0 or boxes.shape[-1] != 4:
        raise ValueError(
            f"{name} must have shape (..., 4) as (x1, y1, x2, y2), got shape "
            f"{boxes.shape}"
        )


def _raise_inverted(name: str, flat: np.ndarray, boxes) -> None:
    """ValueError naming the boxes with x2 < x1 or y2 < y1 (a NaN is not
    inverted: it gives a NaN loss instead)."""
    inverted = (flat[:, 2] < flat[:, 0]) | (flat[:, 3] < flat[:, 1])
    if inverted.any():
        first = int(np.argmax(inverted))
        index = np.unravel_index(first, boxes.shape[:-1]) if boxes.ndim > 1 else ()
        raise ValueError(
            f"{name} must have x1 <= x2 and y1 <= y2 (x1, y1, x2, y2 format); "
            f"{int(inverted.sum())} box(es) do not, the first at index "
            f"{tuple(int(i) for i in index)}: {flat[first].tolist()}"
        )


def _aspect_angle(w, h):
    """atan(w / h) in [0, pi/2] for w, h >= 0, with a finite gradient.

    torchvision's ``atan(w / h)`` divides by h = 0 (a box of zero height:
    the value pi/2 is right, the gradient 0 * inf = NaN) and is 0 / 0 = NaN
    for a point box. Here the smaller side is divided by the larger, so the
    ratio is in [0, 1]: the same angle (pi/2 - atan(h / w) when w > h), a
    gradient of about 1 / max(w, h), and a point box gets the angle 0 (as a
    zero-width box; ultralytics' ``atan(w / (h + eps))`` gives 0 too) with a
    zero gradient.
    """
    tall = h >= w
    big = jnp.where(tall, h, w)
    small = jnp.where(tall, w, h)
    point = big == 0
    angle = jnp.arctan(small / jnp.where(point, 1.0, big))
    return jnp.where(point, 0.0, jnp.where(tall, angle, jnp.pi / 2 - angle))


def _box_terms(b1, b2, kind: str, eps: float):
    """Per-box loss from coordinate tuples (compute dtype), torchvision's
    formulas."""
    x1, y1, x2, y2 = b1
    x1g, y1g, x2g, y2g = b2
    iw = jnp.minimum(x2, x2g) - jnp.maximum(x1, x1g)
    ih = jnp.minimum(y2, y2g) - jnp.maximum(y1, y1g)
    # torchvision's mask: no overlap (or a touching edge) is exactly 0 with a
    # zero gradient, not a product of negative sides
    inter = jnp.where((iw > 0) & (ih > 0), iw * ih, 0.0)
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
    iou = inter / (union + eps)
    if kind == "iou":
        return 1.0 - iou
    cw = jnp.maximum(x2, x2g) - jnp.minimum(x1, x1g)  # enclosing box
    ch = jnp.maximum(y2, y2g) - jnp.minimum(y1, y1g)
    if kind == "giou":
        area_c = cw * ch
        return 1.0 - iou + (area_c - union) / (area_c + eps)
    # DIoU: squared centre distance over the enclosing box's squared diagonal
    # (both halved centres: (x1 + x2) / 2, as torchvision)
    dx = (x2 + x1) / 2 - (x1g + x2g) / 2
    dy = (y2 + y1) / 2 - (y1g + y2g) / 2
    loss = 1.0 - iou + (dx * dx + dy * dy) / (cw * cw + ch * ch + eps)
    if kind == "diou":
        return loss
    delta = _aspect_angle(x2g - x1g, y2g - y1g) - _aspect_angle(x2 - x1, y2 - y1)
    v = (4 / jnp.pi**2) * delta * delta
    # torchvision computes alpha under no_grad: no gradient through it
    alpha = jax.lax.stop_gradient(v / (1.0 - iou + v + eps))
    return loss + alpha * v


def _reduce(loss, reduction: str):
    """'none' as is; 'sum'; 'mean' with the mean of an empty array 0.0."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return jnp.sum(loss)
    return jnp.sum(loss) / max(loss.size, 1)


def box_iou_loss(
    boxes1: Array,
    boxes2: Array,
    *,
    kind: str = "giou",
    reduction: str = "none",
    eps: float = 1e-7,
) -> jax.Array:
    r"""IoU-family box regression loss in at least float32: torchvision's values.

    Boxes are ``(..., 4)`` as ``(x1, y1, x2, y2)``; the loss of a pair, with
    ``iou = inter / (union + eps)`` and ``C`` the smallest enclosing box::

        iou:  1 - iou
        giou: 1 - iou + (area(C) - union) / (area(C) + eps)
        diou: 1 - iou + |centre1 - centre2|^2 / (diag(C)^2 + eps)
        ciou: diou + alpha v,  v = 4 / pi^2 (atan(w2 / h2) - atan(w1 / h1))^2,
              alpha = v / (1 - iou + v + eps), with no gradient (as torchvision)

    the values of ``torchvision.ops.generalized_box_iou_loss``,
    ``distance_box_iou_loss`` and ``complete_box_iou_loss`` (the loss is
    symmetric in the two boxes). The coordinates are upcast to float32 inside
    the computation, so fp16 boxes of a 640-pixel image do not overflow
    (their areas reach 4e5, fp16's maximum is 65504); the gradient comes back
    in the boxes' dtype.

    Deviations from torchvision (documented, tested): where its CIoU gradient
    is NaN, ours is finite: a box of zero height (``atan(w / 0)``: the value
    pi/2 is kept, its gradient is 0 * inf in torchvision). A point box (zero
    width and height) has a NaN CIoU in torchvision; here its aspect angle is
    0 (as a zero-width box), so the loss and gradient are finite. Coincident
    centres and zero-area unions are finite in both (the ``eps`` terms),
    except through CIoU's angle of a zero-height box (above).
    Kept from torchvision: the GIoU of two collinear zero-area boxes (an
    enclosing box of zero area) has a gradient of the order of the
    enclosing width / eps (2e7 for [0, 1, 4, 1] and [1, 1, 3, 1] at eps
    1e-7): finite in float32, but above fp16's 65504, so for fp16 boxes it
    comes back as inf (a skip guard skips the step).

    Bad boxes: ``x2 < x1`` or ``y2 < y1`` raises ``ValueError`` naming the
    first such box when both box arrays are concrete (an eager call on
    values). When either is traced (under ``jit``, or differentiated by an
    eager ``jax.grad``: a training step) that pair's loss and gradient are
    NaN instead, as is any pair with a NaN or infinite coordinate, so a
    finiteness guard skips the step. torchref mirrors this with autograd:
    it raises when neither box tensor requires grad and gives NaN when one
    does. A mean over zero boxes is 0.0 (as torchvision).

    Ties have torchvision's gradients: equal boxes and shared edges are the
    ties of its ``max``/``min`` (each side gets half, in JAX and torch
    alike), a touching edge (zero overlap) has a zero intersection gradient.

    Precision: float32; float64 when ``boxes1`` or ``boxes2`` is float64 (x64
    on).

    Args:
      boxes1: predicted boxes, floating array ``(..., 4)`` (any float dtype).
      boxes2: target boxes, same shape.
      kind: "iou", "giou", "diou" or "ciou".
      reduction: "none" (a loss per box, shape ``boxes1.shape[:-1]``),
        "mean" or "sum".
      eps: added to the union, the enclosing area and diagonal: finite and
        >= 1.2e-38 (float32's smallest normal number).

    Returns:
      float32 array of shape ``boxes1.shape[:-1]``, or a float32 scalar
      (float64 for float64 boxes).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxstable import losses
      >>> pred = jnp.array([[0.0, 0.0, 2.0, 2.0], [0.0, 0.0, 4.0, 0.0]], jnp.float16)
      >>> gt = jnp.array([[1.0, 1.0, 3.0, 3.0], [1.0, 0.0, 3.0, 2.0]], jnp.float16)
      >>> loss = losses.box_iou_loss(pred, gt, kind="ciou")
      >>> print(loss.dtype, [round(float(v), 4) for v in loss])
      float32 [0.9683, 1.1]
      >>> grad = jax.grad(lambda p: losses.box_iou_loss(p, gt, kind="ciou").sum())
      >>> bool(jnp.isfinite(grad(pred)).all())  # zero height: torchvision NaN
      True
    """
    _check_kind(kind)
    _check_reduction(reduction)
    _check_eps("eps", eps)
    boxes1, boxes2 = _as_arrays(boxes1=boxes1, boxes2=boxes2)
    _check_boxes("boxes1", boxes1)
    _check_boxes("boxes2", boxes2)
    _check_same_shape("boxes1", boxes1, "boxes2", boxes2)
    if _is_concrete(boxes1) and _is_concrete(boxes2):  # an eager call: raise
        for name, boxes in (("boxes1", boxes1), ("boxes2", boxes2)):
            _raise_inverted(name, np.asarray(boxes, np.float64).reshape(-1, 4), boxes)
    ct = _compute_dtype(boxes1, boxes2)
    b1 = tuple(boxes1[..., i].astype(ct) for i in range(4))
    b2 = tuple(boxes2[..., i].astype(ct) for i in range(4))
    loss = _box_terms(b1, b2, kind, float(eps))
    # A traced bad box could not raise: its pair's loss and gradient are NaN.
    bad = jnp.zeros(loss.shape, bool)
    for x1, y1, x2, y2 in (b1, b2):
        finite = jnp.isfinite(x1) & jnp.isfinite(y1) & jnp.isfinite(x2)
        bad = bad | ~(finite & jnp.isfinite(y2)) | (x2 < x1) | (y2 < y1)
    return _reduce(loss * _nan_if(bad, ct), reduction)


def _check_alpha(alpha) -> bool:
    """True when alpha weights the classes: a number in [0, 1]; None or -1
    (torchvision's 'ignore') turn the weighting off; anything else raises."""
    if alpha is None or (np.ndim(alpha) == 0 and float(alpha) == -1.0):
        return False
    if np.ndim(alpha) != 0 or not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(
            f"alpha must be a number in [0, 1], or None / -1 for no class "
            f"weighting, got {alpha}"
        )
    return True


def _check_unit_interval(name: str, x) -> None:
    """ValueError if a concrete `x` holds a value outside [0, 1] (NaN passes:
    it gives a NaN loss)."""
    if not _is_concrete(x):
        return
    values = np.asarray(x, np.float32)
    outside = (values < 0) | (values > 1)
    if outside.any():
        raise ValueError(
            f"{name} must be in [0, 1]; found {int(outside.sum())} value(s) "
            f"outside, e.g. {values[outside].flat[0]}"
        )


def sigmoid_focal_loss(
    logits: Array,
    targets: Array,
    *,
    alpha: float | None = 0.25,
    gamma: float = 2.0,
    reduction: str = "none",
) -> jax.Array:
    r"""Sigmoid focal loss (RetinaNet) in at least float32: torchvision's values.

    With ``p = sigmoid(x)`` and ``q = p (1 - t) + (1 - p) t`` (``1 - p_t``)::

        l = alpha_t * q^gamma * bce_with_logits(x, t),
        alpha_t = alpha t + (1 - alpha) (1 - t)

    as ``torchvision.ops.sigmoid_focal_loss``. ``q`` is formed from
    ``sigmoid(x)`` and ``sigmoid(-x)`` (both accurate) instead of ``1 - p_t``,
    which rounds to 0 in float32 once ``|x| > 17``, and is floored at
    float32's smallest normal number 1.2e-38: the gradient of ``q^gamma`` for
    ``0 < gamma < 1`` stays finite (torchvision: NaN at a saturated logit).
    The loss there is below 1e-38 either way. The BCE term is the stable
    ``max(x, 0) - x t + log1p(exp(-|x|))`` with torch's gradient
    ``sigmoid(x) - t`` at every logit, ``x = 0`` included (γ = 2, α = 0.25,
    t = 1: -0.0746 at x = 0, as torchvision).

    Precision: float32; float64 for float64 ``logits`` (x64 on).

    Deviation from torchvision: the mean of an empty array is 0.0 (theirs:
    NaN), as for every loss here.

    Args:
      logits: floating array of any shape (any float dtype).
      targets: same shape, in [0, 1] (0 or 1 for torchvision's definition).
        A concrete value outside raises ``ValueError``; under ``jit`` that
        element's loss and gradient are NaN.
      alpha: weight of the positives in [0, 1] (negatives get ``1 - alpha``);
        None or -1 (torchvision's "ignore") for no weighting.
      gamma: focusing exponent, a finite number >= 0 (0: alpha-weighted BCE).
      reduction: "none", "mean" or "sum".

    Returns:
      float32 array of ``logits.shape`` ("none"), or a float32 scalar
      (float64 for float64 logits).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import losses
      >>> x = jnp.array([-3.0, 0.0, 3.0, 30.0], jnp.bfloat16)
      >>> t = jnp.array([0.0, 1.0, 1.0, 0.0])
      >>> loss = losses.sigmoid_focal_loss(x, t)
      >>> print(loss.dtype, [round(float(v), 4) for v in loss])
      float32 [0.0001, 0.0433, 0.0, 22.5]
    """
    _check_reduction(reduction)
    weighted = _check_alpha(alpha)
    _check_positive("gamma", gamma, allow_zero=True, finite=True)
    logits, targets = _as_arrays(logits=logits, targets=targets)
    _check_float("logits", logits)
    _check_same_shape("logits", logits, "targets", targets)
    _check_unit_interval("targets", targets)
    ct = _compute_dtype(logits)
    x, t = logits.astype(ct), targets.astype(ct)
    q = jax.nn.sigmoid(x) * (1.0 - t) + jax.nn.sigmoid(-x) * t
    loss = _bce_with_logits(x, t) * jnp.where(q > _TINY, q, _TINY) ** gamma
    if weighted:
        loss = (alpha * t + (1.0 - alpha) * (1.0 - t)) * loss
    # a traced target outside [0, 1] could not raise: NaN, not a finite loss
    return _reduce(loss * _nan_if((t < 0) | (t > 1), ct), reduction)
