"""Cross-entropy of a linear head without the [tokens, vocab] logits.

``linear_cross_entropy(hidden, kernel, labels)`` equals
``softmax_cross_entropy(hidden @ kernel, labels)`` but computes the logits
one vocabulary block at a time (a `lax.fori_loop` over column blocks of the
kernel), keeping per token only a running max, a running sum of
exponentials and (for smoothing) the logits' sum; the label's logit is
gathered once. Its gradient is written by hand (`jax.custom_vjp`): the
float32 logits of a block exist only inside one loop iteration.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from _stablecore.losses import check_reduction as _check_reduction
from jaxstable._src.losses._checks import as_arrays, check_float, is_concrete
from jaxstable._src.losses.cross_entropy import bad_label_message, check_z_loss

__all__ = ["linear_cross_entropy"]

_F32 = jnp.float32
# Elements of one float32 block of logits [tokens, block]: 2**19 = 2 MiB,
# small next to [tokens, vocab] (4096 tokens x 128k vocab x 4 bytes = 2 GiB).
# Measured on XLA:CPU, 1024 tokens x 256 features, fwd+bwd: blocks of 512 /
# 1024 columns hold 3.5 / 6 MiB of temporaries in float32 (naive: 141 MiB at
# 32k vocab) and 21 / 24 MiB in bfloat16 (naive 238; 16 of them the [D, V]
# gradient, see `_bits`), at about the same speed at 32k and 128k (within
# the noise of the 2-core machine at a load of 5 to 7).
_BLOCK_ELEMENTS = 2**19
# A floor for many tokens: a block keeps at least this many columns so that
# its matmul stays wide (a choice, not a measured optimum).
_MIN_BLOCK = 128


def _block_size(n_tokens: int, vocab: int) -> int:
    """Columns per block: about `_BLOCK_ELEMENTS` / tokens, at least
    `_MIN_BLOCK` (or the whole vocabulary), preferring a divisor of the
    vocabulary within a factor 2 (no tail block to compile separately)."""
    target = min(max(_MIN_BLOCK, _BLOCK_ELEMENTS // max(n_tokens, 1)), vocab)
    for size in range(target, max(target // 2, 1) - 1, -1):
        if vocab % size == 0:
            return size
    return target


def _bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array as its uint16 bits (others as they are).

    XLA:CPU computes in float32 what it has no bf16/fp16 kernel for: it
    converts the operand of a 16-bit dot or dynamic-update-slice to float32
    WHOLE. In the block loops that meant a float32 copy of the kernel hoisted
    out of the loop (128 MiB for 256 x 128k) and a float32 round trip of the
    whole [D, V] gradient in every iteration (its time grows as V^2). Sliced
    and updated as uint16 (a move, bit for bit), only one block at a time is
    ever converted.
    """
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def _unbits(x: jax.Array, dtype) -> jax.Array:
    """Inverse of `_bits` for an array of `dtype`."""
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def _for_blocks(fn, kernel, block, carry):
    """``carry = fn(start, kernel[:, start:start + width], carry)`` over the
    vocabulary's blocks: a fori_loop over the full ones, then the tail."""
    vocab = kernel.shape[1]
    n_full = vocab // block
    bits = _bits(kernel)  # sliced as bits: see `_bits`

    def body(j, c):
        start = j * block
        cols = jax.lax.dynamic_slice_in_dim(bits, start, block, 1)
        return fn(start, _unbits(cols, kernel.dtype), c)

    carry = jax.lax.fori_loop(0, n_full, body, carry)
    if vocab % block:
        start = n_full * block
        carry = fn(start, kernel[:, start:], carry)
    return carry


def _stats(hidden, kernel, labels, block, smoothing):
    """Per token, float32: logsumexp, the label's logit, the logits' sum."""
    n = hidden.shape[0]

    def fn(start, cols, c):
        m, s, x_sum = c
        logits = jnp.dot(hidden, cols, preferred_element_type=_F32)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        # exp(-inf - -inf) is NaN: while every logit so far is -inf, s stays 0
        rescale = jnp.where(m == m_new, 1.0, jnp.exp(m - m_new))
        s = s * rescale + jnp.sum(jnp.exp(logits - m_new[:, None]), axis=-1)
        if smoothing:
            x_sum = x_sum + jnp.sum(logits, axis=-1)
        return m_new, s, x_sum

    zeros = jnp.zeros((n,), _F32)
    init = (jnp.full((n,), -jnp.inf, _F32), zeros, zeros)
    m, s, x_sum = _for_blocks(fn, kernel, block, init)
    return m + jnp.log(s), _label_logits(hidden, kernel, labels), x_sum


def _label_logits(hidden, kernel, labels):
    """``hidden[n] @ kernel[:, labels[n]]`` in float32 (products of the
    inputs, exact for 16-bit floats, summed in float32 as the dot does), 0
    for a label outside [0, V) (masked later). Gathered once rather than
    picked out of every block: the pick materialised a second [N, block]
    float32 buffer in each iteration (4 MiB of the temporaries)."""
    vocab = kernel.shape[1]
    ok = (labels >= 0) & (labels < vocab)
    cols = jnp.take(_bits(kernel), jnp.where(ok, labels, 0), axis=1)
    cols = _unbits(cols, kernel.dtype).astype(_F32)  # [D, N]
    x_y = jnp.sum(hidden.astype(_F32) * cols.T, axis=-1)
    return jnp.where(ok, x_y, 0.0)


def _masks(labels, vocab, ignore_index):
    """(valid, bad): bad = not ignored and outside [0, vocab)."""
    ignored = (
        jnp.zeros(labels.shape, bool)
        if ignore_index is None
        else labels == ignore_index
    )
    in_range = (labels >= 0) & (labels < vocab)
    return in_range & ~ignored, ~in_range & ~ignored


def _token_losses(lse, x_y, x_sum, vocab, valid, bad, smoothing, z_loss):
    # softmax_cross_entropy's per-element loss without class weights:
    # (1 - s)(lse - x_y) + (s / V) sum_c (lse - x_c) + z lse**2
    loss = (1.0 - smoothing) * (lse - x_y)
    if smoothing:
        loss = loss + smoothing * (lse - x_sum / vocab)
    if z_loss:
        loss = loss + z_loss * jnp.square(lse)
    loss = jnp.where(valid, loss, 0.0)
    # An out-of-range label under jit: NaN, never a finite wrong loss.
    return jnp.where(bad, jnp.nan, loss)


def _grads(hidden, kernel, labels, valid, bad, lse, g, block, smoothing, z_loss):
    """``(d hidden, d kernel)`` of ``sum_n g_n loss_n``, block by block
    (``d kernel`` as `_bits`)."""
    n, d = hidden.shape
    vocab = kernel.shape[1]
    g = jnp.where(bad, jnp.nan, jnp.where(valid, g, 0.0))
    coef = g * (1.0 + 2.0 * z_loss * lse) if z_loss else g

    def fn(start, cols, c):
        d_hidden, d_kernel = c
        logits = jnp.dot(hidden, cols, preferred_element_type=_F32)
        ids = start + jnp.arange(cols.shape[1])
        # d loss_n / d x_c = p_c (1 + 2 z lse) - (1 - s) [c == y] - s / V
        d_logits = jnp.exp(logits - lse[:, None]) * coef[:, None]
        hit = ids[None, :] == labels[:, None]
        d_logits = d_logits - jnp.where(hit, ((1.0 - smoothing) * g)[:, None], 0.0)
        if smoothing:
            d_logits = d_logits - (smoothing / vocab) * g[:, None]
        d_hidden = d_hidden + jnp.dot(
            d_logits.astype(cols.dtype), cols.T, preferred_element_type=_F32
        )
        d_cols = jnp.dot(
            hidden.T, d_logits.astype(hidden.dtype), preferred_element_type=_F32
        )
        # written as bits (see `_bits`): in place, one block converted
        d_kernel = jax.lax.dynamic_update_slice_in_dim(
            d_kernel, _bits(d_cols.astype(kernel.dtype)), start, axis=1
        )
        return d_hidden, d_kernel

    init = (jnp.zeros((n, d), _F32), _bits(jnp.zeros(kernel.shape, kernel.dtype)))
    d_hidden, d_kernel = _for_blocks(fn, kernel, block, init)
    return d_hidden.astype(hidden.dtype), d_kernel  # d_kernel as `_bits`


def _rows_impl(hidden, kernel, labels, ignore_index, smoothing, z_loss, block):
    vocab = kernel.shape[1]
    valid, bad = _masks(labels, vocab, ignore_index)
    lse, x_y, x_sum = _stats(hidden, kernel, labels, block, smoothing)
    losses = _token_losses(lse, x_y, x_sum, vocab, valid, bad, smoothing, z_loss)
    return losses, lse


def _no_label_grad(labels):
    return np.zeros(labels.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _rows(hidden, kernel, labels, ignore_index, smoothing, z_loss, block):
    """Per-token losses; the backward pass recomputes the logits by block."""
    return _rows_impl(hidden, kernel, labels, ignore_index, smoothing, z_loss, block)[0]


def _rows_fwd(hidden, kernel, labels, ignore_index, smoothing, z_loss, block):
    losses, lse = _rows_impl(
        hidden, kernel, labels, ignore_index, smoothing, z_loss, block
    )
    return losses, (hidden, kernel, labels, lse)


def _rows_bwd(ignore_index, smoothing, z_loss, block, res, g):
    hidden, kernel, labels, lse = res
    valid, bad = _masks(labels, kernel.shape[1], ignore_index)
    d_hidden, d_kernel = _grads(
        hidden, kernel, labels, valid, bad, lse, g.astype(_F32), block,
        smoothing, z_loss,
    )  # fmt: skip
    return d_hidden, _unbits(d_kernel, kernel.dtype), _no_label_grad(labels)


_rows.defvjp(_rows_fwd, _rows_bwd)


def _check_inputs(hidden, kernel, labels, label_smoothing, block_size):
    check_float("hidden", hidden)
    check_float("kernel", kernel)
    if hidden.ndim < 1:
        raise ValueError("hidden must have a feature axis (last), got a scalar")
    if kernel.ndim != 2 or kernel.shape[0] != hidden.shape[-1]:
        raise ValueError(
            f"kernel must have shape (features, vocab) = ({hidden.shape[-1]}, V) "
            f"like a flax Dense kernel (hidden @ kernel), got {kernel.shape}"
            + (
                " (a torch nn.Linear weight is (V, D): pass its .T)"
                if kernel.ndim == 2
                else ""
            )
        )
    if kernel.shape[1] == 0:
        raise ValueError("kernel has a vocabulary of 0 classes")
    if hidden.dtype != kernel.dtype:
        raise TypeError(
            f"hidden ({hidden.dtype}) and kernel ({kernel.dtype}) must have the "
            "same dtype (the products accumulate in float32 either way): cast one"
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            "labels must be an integer array of class indices, got dtype "
            f"{labels.dtype}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels.shape={labels.shape} must equal hidden.shape={hidden.shape} "
            f"without its feature axis, i.e. {hidden.shape[:-1]}"
        )
    smoothing = float(label_smoothing)
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if block_size is not None and (
        isinstance(block_size, bool)
        or not isinstance(block_size, int | np.integer)
        or block_size < 1
    ):
        raise ValueError(f"block_size must be None or an int >= 1, got {block_size!r}")
    return smoothing


def linear_cross_entropy(
    hidden: Any,
    kernel: Any,
    labels: Any,
    *,
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    block_size: int | None = None,
) -> jax.Array:
    r"""``softmax_cross_entropy(hidden @ kernel, labels)`` without the logits.

    For the output layer of a language model: with ``N`` tokens and a
    vocabulary of ``V`` the float32 logits ``[N, V]`` (and their gradient)
    are the largest buffers of a training step (4096 tokens x 128k vocab:
    2 GiB each). Here they are computed ``block_size`` vocabulary columns at
    a time, twice: a first pass keeps per token a running max and sum of
    exponentials (the logsumexp) and, with smoothing, the logits' sum (the
    label's logit is gathered once); the backward recomputes each block's
    logits and adds its share of both gradients (``d hidden += d_logits @
    kernel_block.T``, ``d kernel_block = hidden.T @ d_logits``), scaled by
    the cotangent as it goes; a call that is not differentiated runs the
    first pass only. Products accumulate in float32
    (``preferred_element_type``) from bf16/fp16 inputs; gradients are
    returned in the inputs' dtypes.

    Per token ``n`` with label ``y``, ``lse = logsumexp(x)``, ``x = h_n @
    kernel``: ``l_n = (1 - s)(lse - x_y) + (s / V) sum_c (lse - x_c) + z
    lse**2``, the definition of `softmax_cross_entropy` (no class weights);
    ignored tokens add 0; "mean" divides by the number of counted tokens
    (0.0 with a zero gradient when there is none, as
    `softmax_cross_entropy`).

    Args:
      hidden: floating array ``(..., D)``, the last hidden states.
      kernel: ``(D, V)``, a flax ``Dense`` kernel's layout (``hidden @
        kernel``); a torch ``nn.Linear.weight`` is ``(V, D)``: pass its
        transpose. Same dtype as ``hidden``.
      labels: integer array ``hidden.shape[:-1]``.
      ignore_index: label value that contributes nothing (e.g. -100).
      label_smoothing: ``s`` in [0, 1] (static).
      z_loss: PaLM's ``z`` (static, finite, >= 0).
      reduction: "mean", "sum" or "none" (per-token losses ``hidden.shape[:-1]``).
      block_size: vocabulary columns per block (int >= 1); None picks about
        ``2**19 / N`` (a 2 MiB float32 block), at least 128.

    Returns:
      float32 scalar, or per-token float32 losses for "none". A label
      outside [0, V) that is not ``ignore_index`` raises ValueError when the
      labels are concrete; under ``jit`` its loss (and the mean) is NaN.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxstable import losses
      >>> h = jax.random.normal(jax.random.key(0), (6, 8), jnp.bfloat16)
      >>> k = jax.random.normal(jax.random.key(1), (8, 1000), jnp.bfloat16)
      >>> y = jnp.array([0, 5, 999, -100, 3, 7])
      >>> lean = losses.linear_cross_entropy(h, k, y, ignore_index=-100)
      >>> naive = losses.softmax_cross_entropy(
      ...     jnp.dot(h, k, preferred_element_type=jnp.float32), y, ignore_index=-100)
      >>> lean.dtype, bool(jnp.allclose(lean, naive, rtol=1e-5))
      (dtype('float32'), True)
    """
    _check_reduction(reduction)
    z = check_z_loss(z_loss)
    if isinstance(labels, np.ndarray | np.generic | int | list | tuple):
        labels = np.asarray(labels)
    labels_given = labels
    hidden, kernel, labels = as_arrays(hidden=hidden, kernel=kernel, labels=labels)
    smoothing = _check_inputs(hidden, kernel, labels, label_smoothing, block_size)
    vocab = kernel.shape[1]
    if is_concrete(labels) and labels.size:
        lab = np.asarray(labels_given)
        bad = (lab < 0) | (lab >= vocab)
        if ignore_index is not None:
            bad &= lab != ignore_index
        if bad.any():
            raise ValueError(bad_label_message(lab[bad], vocab, ignore_index))
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    lab = labels.reshape(-1).astype(jnp.int32)
    block = min(block_size or _block_size(h.shape[0], vocab), vocab)
    args = (ignore_index, smoothing, z, int(block))
    if reduction == "none":
        return _rows(h, kernel, lab, *args).reshape(lead)
    # the sum's cotangent reaches _rows' backward per token: one gradient
    # pass, scaled as it goes (no [D, V] gradient kept to rescale)
    total = jnp.sum(_rows(h, kernel, lab, *args))
    if reduction == "sum":
        return total
    count = jnp.sum(_masks(lab, vocab, ignore_index)[0], dtype=_F32)
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)
