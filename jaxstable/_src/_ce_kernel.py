"""A Pallas (Triton) kernel for softmax cross-entropy over the class axis.

Issue 24: on a GPU the XLA cross-entropy reaches 0.04-0.44 of the copy
bandwidth floor; a kernel that reads each row of logits once in the forward
(max, log-sum-exp, the label's logit, the smoothing sums) and once in the
backward (writes ``softmax - target``) is at that floor by construction.

Design: ``pl.pallas_call`` over a 1-D grid of row blocks (8 to 128 rows per
program, fewer for more classes). A program loops over the class axis in
chunks of up to 1024 classes (a power of two, as Triton's tensors must be),
keeping per row a running max and sum of ``exp`` rescaled when the max grows
(an online log-sum-exp), the label's logit and weight, and the smoothing
sums: any vocabulary up to 2**18 classes reads each logit once, with a
working set of one (rows, chunk) tile. The kernels take whole arrays and
index them with ``pl.ds``; every load and store is masked by hand (rows past
``N``, columns past ``C``), because Pallas' Triton lowering derives a
block's addresses from the full array's strides and masks nothing: the
first version's ``(8, pow2(C))`` blocks would have read the next row's
logits and written over its gradient wherever ``C`` is not a power of two
(interpret mode pads blocks, so its tests could not see it). The kernel
works on rows of a 2-D ``(N, C)`` array: the caller moves the class axis
last and flattens. Per row it computes in float32, whatever the logits'
dtype:

    lse    = max + log(sum(exp(x - max)))
    nll    = w[y] * (lse - x[y])
    smooth = (lse * sum(w) - sum(w * x)) / C
    loss   = (1 - eps) * nll + eps * smooth        (0 for an ignored row)

and the backward, for an upstream gradient ``g`` per row:

    dx_c = g * ((1 - eps) * w[y] * (p_c - [c == y]) + eps / C * (p_c * sum(w) - w_c))

which is torch's ``F.cross_entropy`` per element (``reduction="none"``,
class ``weight``, ``label_smoothing``, ``ignore_index``). The reductions
(``mean`` divides by the sum of the targets' weights; 0 when every row is
ignored, jaxstable's documented deviation) are a few operations over N
numbers, done by the caller in XLA.

openxla/tokamax: its cross-entropy kernels are the *linear* softmax
cross-entropy (``hidden @ kernel`` fused with the loss, streamed over the
vocabulary, for Mosaic TPU), the design of `losses.linear_cross_entropy`
rather than of this one; it has no ignore_index / class weights / label
smoothing in the form torch defines them and no Triton GPU path for plain
logits. So it was not taken; its idea of keeping only the per-row
log-sum-exp between forward and backward is the one used here (the
backward recomputes ``p = exp(x - lse)`` instead of storing the softmax).

Integration: `jaxstable.losses.softmax_cross_entropy`, after its checks
and with the class axis moved last, calls `softmax_cross_entropy_last_axis`
when ``ce_kernel_applies(x, weights=weights)`` (a GPU backend), its XLA
``_ce_rows`` otherwise. On a CPU the kernel runs only in Pallas' interpret
mode (tests), never by default.

Backend: Triton, chosen with ``compiler_params=pltriton.CompilerParams()``.
Pallas' default GPU backend in the jax this was written against is Mosaic
GPU, whose TMA copies refuse this kernel's blocks (rows must be a multiple
of 16 bytes: 19 bfloat16 classes are 38; at most 256 elements per copied
dimension; 16384-class blocks exceed shared memory). The kernels use no
``slice`` (``x[:, 0]``), which the Triton lowering does not implement. Both
were found without a GPU: ``jax.export`` for platform ``"cuda"`` runs the
GPU lowering in Python down to the Triton IR that XLA:GPU compiles
(`parity_tests/test_ce_kernel.py::test_kernel_lowers_for_a_cuda_gpu`).
Measured on a GPU (an NVIDIA H200, 2026-11-28, `benchmarks/bench_gpu.py`,
results in benchmarks/results/bench_gpu_gpu_ce.md): XLA:GPU compiles it
and its value and gradient match the XLA path, but it is slower than the
XLA path on 8 of the 10 benchmark rows (1.03x to 1.95x the time; faster
only on the 4096 x 1000 classification rows, 0.85x and 0.91x). So the
XLA path is the default everywhere and the kernel runs only when asked
for (``JAXSTABLE_CE_KERNEL=1``), until it is faster.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = [
    "ce_kernel_applies",
    "softmax_cross_entropy_last_axis",
    "softmax_cross_entropy_rows",
]

# Classes per step of the kernels' loop over the class axis (a power of two:
# Triton's tensors must be). A program reads its rows' logits chunk by chunk,
# keeping running per-row sums (an online log-sum-exp), so any vocabulary
# fits with a bounded working set.
_CHUNK = 1024
# Elements of one (rows, chunk) tile: rows per program = _TILE // chunk,
# clamped to [8, 128] (few classes: many rows per program).
_TILE = 4096
# Largest class axis taken (language-model vocabularies up to 256k); beyond
# it, or past 2**31 elements, the XLA path.
_MAX_CLASSES = 2**18
_KERNEL_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


def ce_kernel_applies(
    logits: jax.Array,
    *,
    axis: int = -1,
    weights: jax.Array | None = None,
    interpret: bool = False,
) -> bool:
    """Whether the Pallas kernel handles this call (else use the XLA path).

    Only when asked for: the environment variable ``JAXSTABLE_CE_KERNEL``
    (read at each call, i.e. when the loss is traced) is ``1``, or
    `interpret` (tests). ``auto`` (the default) and ``0`` keep the XLA
    path: on an H200 the kernel was slower than XLA on 8 of 10 benchmark
    rows (module docstring). Asked for, True on a GPU backend for
    float16/bfloat16/float32 logits with at least one and at most 262,144
    classes and fewer than 2**31 elements, any number of rows (0
    included), with or without class weights of shape ``(C,)``. With
    several devices the caller takes the responsibility: a ``pallas_call``
    has no partitioning rule, so under `jax.jit` with sharded logits its
    operands would be gathered onto every device (inside `jax.shard_map`
    each call is one device's).

    Args:
        logits: the logits the loss is called with.
        axis: the class axis.
        weights: the class weights, or None.
        interpret: treat the kernel as available on any backend (Pallas
            interpret mode: tests only, slow).

    Returns:
        A python bool, decided from shapes, dtypes and the backend only.

    Example:
        >>> import jax.numpy as jnp
        >>> ce_kernel_applies(jnp.zeros((4, 19)), interpret=True)
        True
        >>> ce_kernel_applies(jnp.zeros((4, 19), jnp.int32), interpret=True)
        False
    """
    switch = os.environ.get("JAXSTABLE_CE_KERNEL", "auto")
    if switch not in ("auto", "0", "1"):
        raise ValueError(
            f"JAXSTABLE_CE_KERNEL must be 'auto', '0' or '1', got {switch!r}"
        )
    if switch == "0" or (switch == "auto" and not interpret):
        return False  # the XLA path unless the kernel is asked for
    if not (interpret or jax.default_backend() == "gpu"):
        return False
    if logits.ndim < 1 or jnp.dtype(logits.dtype) not in map(jnp.dtype, _KERNEL_DTYPES):
        return False
    classes = logits.shape[axis]
    if not 1 <= classes <= _MAX_CLASSES or logits.size >= 2**31:
        return False
    return weights is None or tuple(weights.shape) == (classes,)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tiling(classes: int) -> tuple[int, int, int]:
    """(rows per program, classes per chunk, chunks) for ``classes``."""
    chunk = min(_pow2(classes), _CHUNK)
    rows = max(8, min(128, _TILE // chunk))
    return rows, chunk, pl.cdiv(classes, chunk)


# Every load and store below is masked by hand: Pallas' Triton lowering
# computes a block's addresses from the full array's strides and masks
# nothing, so a row or column past the array's end would read the next
# row's logits and write over its gradient. The kernels take whole arrays
# (no BlockSpec) and index them with `pl.ds`; interpret mode pads masked
# out-of-bounds accesses, so the tests see what the GPU computes.


def _row_block(n_rows, rows):
    row0 = pl.program_id(0) * rows
    ok = row0 + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) < n_rows
    return pl.ds(row0, rows), ok


def _chunk(k, chunk, classes):
    """Chunk `k`'s class indices, its slice of the class axis and its mask."""
    start = k * chunk
    cols = start + jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    return cols, pl.ds(start, chunk), cols < classes


def _forward_kernel(
    x_ref, y_ref, w_ref, loss_ref, lse_ref, *, n_rows, classes, rows, chunk,
    n_chunks, ignore_index, eps,
):  # fmt: skip
    rs, row_ok = _row_block(n_rows, rows)
    y = pltriton.load(y_ref.at[rs], mask=row_ok, other=ignore_index)

    def step(k, carry):
        m, s, x_y, w_y, wx, sw = carry
        cols, cs, col_ok = _chunk(k, chunk, classes)
        mask = row_ok[:, None] & col_ok[None, :]
        x = pltriton.load(x_ref.at[rs, cs], mask=mask, other=-jnp.inf)
        x = x.astype(jnp.float32)
        w = pltriton.load(w_ref.at[cs], mask=col_ok, other=0.0)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        # A chunk of -inf logits (a masked vocabulary range) leaves m at
        # -inf: shift by 0 there (exp(-inf) = 0), never by -inf (nan). A row
        # of -inf only gives lse = -inf and a nan loss, as in torch.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        s = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(x - shift[:, None]), axis=1)
        hit = cols[None, :] == y[:, None]
        x_y = x_y + jnp.sum(jnp.where(hit, x, 0.0), axis=1)
        w_y = w_y + jnp.sum(jnp.where(hit, w[None, :], 0.0), axis=1)
        if eps:
            wx = wx + jnp.sum(jnp.where(mask, w[None, :] * x, 0.0), axis=1)
            sw = sw + jnp.sum(w)
        return m_new, s, x_y, w_y, wx, sw

    zeros = jnp.zeros((rows,), jnp.float32)
    init = (zeros - jnp.inf, zeros, zeros, zeros, zeros, jnp.zeros((), jnp.float32))
    m, s, x_y, w_y, wx, sw = jax.lax.fori_loop(0, n_chunks, step, init)
    lse = m + jnp.log(s)
    loss = (1.0 - eps) * w_y * (lse - x_y)
    if eps:
        loss = loss + eps * (lse * sw - wx) / classes
    pltriton.store(
        loss_ref.at[rs], jnp.where(y != ignore_index, loss, 0.0), mask=row_ok
    )
    pltriton.store(lse_ref.at[rs], lse, mask=row_ok)


def _backward_kernel(
    x_ref, y_ref, w_ref, lse_ref, g_ref, wy_ref, dx_ref, *, n_rows, classes, rows,
    chunk, n_chunks, ignore_index, eps,
):  # fmt: skip
    rs, row_ok = _row_block(n_rows, rows)
    y = pltriton.load(y_ref.at[rs], mask=row_ok, other=ignore_index)
    lse = pltriton.load(lse_ref.at[rs], mask=row_ok, other=0.0)
    g = pltriton.load(g_ref.at[rs], mask=row_ok, other=0.0)
    g = jnp.where(y != ignore_index, g, 0.0)
    w_y = pltriton.load(wy_ref.at[rs], mask=row_ok, other=0.0)
    sw = jnp.zeros((), jnp.float32)
    if eps:

        def add_weights(k, total):
            _, cs, col_ok = _chunk(k, chunk, classes)
            return total + jnp.sum(pltriton.load(w_ref.at[cs], mask=col_ok, other=0.0))

        sw = jax.lax.fori_loop(0, n_chunks, add_weights, sw)

    def step(k, carry):
        cols, cs, col_ok = _chunk(k, chunk, classes)
        mask = row_ok[:, None] & col_ok[None, :]
        x = pltriton.load(x_ref.at[rs, cs], mask=mask, other=0.0).astype(jnp.float32)
        p = jnp.exp(x - lse[:, None])
        hit = cols[None, :] == y[:, None]
        d = (1.0 - eps) * w_y[:, None] * (p - hit.astype(jnp.float32))
        if eps:
            w = pltriton.load(w_ref.at[cs], mask=col_ok, other=0.0)
            d = d + eps / classes * (p * sw - w[None, :])
        dx = (g[:, None] * d).astype(dx_ref.dtype)
        pltriton.store(dx_ref.at[rs, cs], dx, mask=mask)
        return carry

    jax.lax.fori_loop(0, n_chunks, step, 0)


def _kernel_args(x, ignore_index, eps):
    n, c = x.shape
    rows, chunk, n_chunks = _tiling(c)
    static = dict(
        n_rows=n, classes=c, rows=rows, chunk=chunk, n_chunks=n_chunks,
        ignore_index=ignore_index, eps=eps,
    )  # fmt: skip
    # Triton's default of 4 warps for small tiles, 8 for full 1024-class ones.
    params = pltriton.CompilerParams(num_warps=8 if chunk * rows >= 8192 else 4)
    return static, (pl.cdiv(n, rows),), params


def _forward(x, y, w, ignore_index, eps, interpret):
    n, _ = x.shape
    static, grid, params = _kernel_args(x, ignore_index, eps)
    return pl.pallas_call(
        functools.partial(_forward_kernel, **static),
        out_shape=(
            jax.ShapeDtypeStruct((n,), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.float32),
        ),
        grid=grid,
        interpret=interpret,
        compiler_params=params,
    )(x, y, w)


def _backward(x, y, w, lse, g, ignore_index, eps, interpret):
    static, grid, params = _kernel_args(x, ignore_index, eps)
    c = x.shape[1]
    valid = (y >= 0) & (y < c)
    w_y = jnp.where(valid, w[jnp.clip(y, 0, c - 1)], 0.0)  # w[y], N numbers
    return pl.pallas_call(
        functools.partial(_backward_kernel, **static),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=grid,
        interpret=interpret,
        compiler_params=params,
    )(x, y, w, lse, g, w_y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _rows(x, y, w, ignore_index, eps, interpret):
    return _forward(x, y, w, ignore_index, eps, interpret)[0]


def _rows_fwd(x, y, w, ignore_index, eps, interpret):
    loss, lse = _forward(x, y, w, ignore_index, eps, interpret)
    return loss, (x, y, w, lse)


def _rows_bwd(ignore_index, eps, interpret, res, g):
    x, y, w, lse = res
    dx = _backward(x, y, w, lse, g.astype(jnp.float32), ignore_index, eps, interpret)
    # Labels are integers (float0 cotangent); class weights are constants
    # of the loss (torch's `weight` takes no gradient either): zero.
    y_ct = jnp.zeros(y.shape, jax.dtypes.float0)
    return dx, y_ct, jnp.zeros_like(w)


_rows.defvjp(_rows_fwd, _rows_bwd)


def softmax_cross_entropy_rows(
    logits: jax.Array,
    labels: jax.Array,
    *,
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    weights: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Per-row softmax cross-entropy of ``(N, C)`` logits, by the Pallas kernel.

    torch's ``F.cross_entropy(..., reduction="none")`` per row, in float32:
    ``(1 - eps) * w[y] * (lse - x[y]) + eps * sum_c w_c (lse - x_c) / C``,
    0 where ``labels == ignore_index``; differentiable in `logits` (its own
    backward kernel, ``g * (softmax - target)``), the gradient in the
    logits' dtype. Labels must already be in ``[0, C)`` or ignored (the
    caller's checks, as in `jaxstable.losses.softmax_cross_entropy`).

    Args:
        logits: ``(N, C)`` float16/bfloat16/float32 logits (N may be 0).
        labels: ``(N,)`` integer labels.
        ignore_index: label value whose rows give 0 loss and 0 gradient.
        label_smoothing: eps in [0, 1].
        weights: ``(C,)`` class weights, or None (all 1).
        interpret: run in Pallas interpret mode (CPU tests).

    Returns:
        ``(N,)`` float32 losses.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
        >>> loss = softmax_cross_entropy_rows(x, jnp.array([0, 1]), interpret=True)
        >>> [round(float(v), 4) for v in loss]
        [0.1698, 1.0986]
    """
    n, c = logits.shape
    w = jnp.ones((c,), jnp.float32) if weights is None else weights.astype(jnp.float32)
    if n == 0:
        return jnp.zeros((0,), jnp.float32) + 0.0 * jnp.sum(logits)
    # ignore_index None: no label equals it (labels are >= 0, so -1 never
    # matches a valid row once the caller has checked them).
    ignore = -(2**31) if ignore_index is None else int(ignore_index)
    return _rows(
        logits, labels.astype(jnp.int32), w, ignore, float(label_smoothing), interpret
    )


def softmax_cross_entropy_last_axis(
    x: jax.Array,
    labels: jax.Array,
    weights: jax.Array | None,
    ignore_index: int | None,
    label_smoothing: float,
    *,
    interpret: bool = False,
) -> jax.Array:
    """The per-element loss of ``(..., C)`` logits by the kernel, with the
    XLA path's rule for a label outside ``[0, C)`` that is not ignored: NaN
    for that element (so the guards see it), never a finite wrong loss.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.zeros((2, 1, 3))
        >>> out = softmax_cross_entropy_last_axis(
        ...     x, jnp.array([[0], [7]]), None, None, 0.0, interpret=True)
        >>> [round(float(v), 4) for v in out.ravel()]
        [1.0986, nan]
    """
    c = x.shape[-1]
    rows = softmax_cross_entropy_rows(
        x.reshape(-1, c),
        labels.reshape(-1),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        weights=weights,
        interpret=interpret,
    ).reshape(labels.shape)
    bad = (labels < 0) | (labels >= c)
    if ignore_index is not None:
        bad &= labels != ignore_index
    return jnp.where(bad, jnp.nan, rows)
