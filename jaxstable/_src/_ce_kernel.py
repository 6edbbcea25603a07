"""A Pallas (Triton-style) kernel for softmax cross-entropy over the class axis.

Issue 24: on a GPU the XLA cross-entropy reaches 0.04-0.44 of the copy
bandwidth floor; a kernel that reads each row of logits once in the forward
(max, log-sum-exp, the label's logit, the smoothing sums) and once in the
backward (writes ``softmax - target``) is at that floor by construction.

Design: ``pl.pallas_call`` over a 1-D grid of row blocks (`BlockSpec`
``(block_rows, block_classes)``, the whole class axis in one block, rounded
up to a power of two as Triton requires; the columns past ``C`` are masked
with ``iota < C`` inside the kernel, so no padded copy of the logits is ever
made). The kernel works on rows of a 2-D ``(N, C)`` array: the caller moves
the class axis last and flattens. Per row it computes in float32, whatever
the logits' dtype:

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
dimension; its 16384-class blocks exceed shared memory). The kernels use no
``slice`` (``x[:, 0]``), which the Triton lowering does not implement. Both
were found without a GPU: ``jax.export`` for platform ``"cuda"`` runs the
GPU lowering in Python down to the Triton IR that XLA:GPU compiles
(`parity_tests/test_ce_kernel.py::test_kernel_lowers_for_a_cuda_gpu`).
NOT yet run on a GPU: XLA:GPU's compile of that IR and the kernel's speed
are unchecked (no GPU lent to the sessions that wrote it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = [
    "ce_kernel_applies",
    "softmax_cross_entropy_last_axis",
    "softmax_cross_entropy_rows",
]

# Rows per program. 8 rows of up to 4096 float32 classes keep a block's
# working set (x, exp, w) well inside a GPU SM's registers + shared memory.
_BLOCK_ROWS = 8
# Above this many classes one block per row no longer fits (Triton's block
# limit is 2**20 elements; 32k vocabularies would need a class loop).
_MAX_CLASSES = 16384
_KERNEL_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


def ce_kernel_applies(
    logits: jax.Array,
    *,
    axis: int = -1,
    weights: jax.Array | None = None,
    interpret: bool = False,
) -> bool:
    """Whether the Pallas kernel handles this call (else use the XLA path).

    True on a GPU backend (or with `interpret`) for float16/bfloat16/float32
    logits with at least one class and at most 16,384 classes (the whole
    class axis in one block), any number of rows (0 included), with or
    without class weights of shape ``(C,)``.

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
    if not (interpret or jax.default_backend() == "gpu"):
        return False
    if logits.ndim < 1 or jnp.dtype(logits.dtype) not in map(jnp.dtype, _KERNEL_DTYPES):
        return False
    classes = logits.shape[axis]
    if not 1 <= classes <= _MAX_CLASSES:
        return False
    return weights is None or tuple(weights.shape) == (classes,)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _row_stats(x_ref, y_ref, w_ref, classes, ignore_index):
    """Per-row float32 quantities shared by the forward and backward.

    Row quantities are ``(R,)`` vectors, brought to ``(R, 1)`` with
    ``[:, None]`` where they meet a block: no ``slice`` (``[:, 0]``,
    ``[0]``), which Pallas' Triton lowering does not implement.
    """
    x = x_ref[...].astype(jnp.float32)
    cols = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    valid_col = cols < classes
    x = jnp.where(valid_col, x, -jnp.inf)
    w_cols = jax.lax.broadcasted_iota(jnp.int32, w_ref.shape, 0) < classes
    w = jnp.where(w_cols, w_ref[...].astype(jnp.float32), 0.0)[None, :]
    y = y_ref[...].astype(jnp.int32)
    m = jnp.max(x, axis=1)
    # A row of all -inf would give m = -inf and nan; torch gives nan too.
    e = jnp.exp(x - m[:, None])
    lse = m + jnp.log(jnp.sum(e, axis=1))
    onehot = cols == y[:, None]
    keep = y != ignore_index
    return x, w, lse, onehot, keep, valid_col


def _forward_kernel(
    x_ref, y_ref, w_ref, loss_ref, lse_ref, *, classes, ignore_index, eps
):
    x, w, lse, onehot, keep, valid_col = _row_stats(
        x_ref, y_ref, w_ref, classes, ignore_index
    )
    x_y = jnp.sum(jnp.where(onehot, x, 0.0), axis=1)
    w_y = jnp.sum(jnp.where(onehot, w, 0.0), axis=1)
    loss = (1.0 - eps) * w_y * (lse - x_y)
    if eps:
        wx = jnp.sum(jnp.where(valid_col, w * x, 0.0), axis=1)
        smooth = (lse * jnp.sum(w) - wx) / classes
        loss = loss + eps * smooth
    loss_ref[...] = jnp.where(keep, loss, 0.0)
    lse_ref[...] = lse


def _backward_kernel(
    x_ref, y_ref, w_ref, lse_ref, g_ref, dx_ref, *, classes, ignore_index, eps
):
    x, w, _, onehot, keep, valid_col = _row_stats(
        x_ref, y_ref, w_ref, classes, ignore_index
    )
    p = jnp.exp(x - lse_ref[...][:, None])
    w_y = jnp.sum(jnp.where(onehot, w, 0.0), axis=1)
    d = (1.0 - eps) * w_y[:, None] * (p - onehot.astype(jnp.float32))
    if eps:
        d = d + eps / classes * (p * jnp.sum(w) - w)
    g = jnp.where(keep, g_ref[...], 0.0)
    dx_ref[...] = jnp.where(valid_col, g[:, None] * d, 0.0).astype(dx_ref.dtype)


def _specs(n_rows: int, classes: int):
    bc = _pow2(classes)
    rows = pl.BlockSpec((_BLOCK_ROWS, bc), lambda i: (i, 0))
    vec = pl.BlockSpec((_BLOCK_ROWS,), lambda i: (i,))
    cls = pl.BlockSpec((bc,), lambda i: (0,))
    grid = (pl.cdiv(n_rows, _BLOCK_ROWS),)
    return rows, vec, cls, grid


def _forward(x, y, w, ignore_index, eps, interpret):
    n, c = x.shape
    rows, vec, cls, grid = _specs(n, c)
    kernel = functools.partial(
        _forward_kernel, classes=c, ignore_index=ignore_index, eps=eps
    )
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((n,), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.float32),
        ),
        grid=grid,
        in_specs=[rows, vec, cls],
        out_specs=(vec, vec),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(),
    )(x, y, w)


def _backward(x, y, w, lse, g, ignore_index, eps, interpret):
    n, c = x.shape
    rows, vec, cls, grid = _specs(n, c)
    kernel = functools.partial(
        _backward_kernel, classes=c, ignore_index=ignore_index, eps=eps
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, c), x.dtype),
        grid=grid,
        in_specs=[rows, vec, cls, vec, vec],
        out_specs=rows,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(),
    )(x, y, w, lse, g)


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
