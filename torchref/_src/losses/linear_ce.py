"""Cross-entropy of a linear head without the [tokens, vocab] logits (torch).

The twin of `jaxstable.losses.linear_cross_entropy`: the logits are
computed one block of vocabulary rows of the ``nn.Linear`` weight at a time,
inside a `torch.autograd.Function` whose backward recomputes them.
"""

from __future__ import annotations

from typing import Any

import torch

from _stablecore.losses import check_reduction as _check_reduction
from torchref._src.losses._checks import as_tensors, check_float
from torchref._src.losses.cross_entropy import bad_label_message, check_z_loss

__all__ = ["linear_cross_entropy"]

# As in jaxstable: about 2**19 float32 logits (2 MiB) per block, at least
# 128 vocabulary rows (thinner matmuls run well below speed).
_BLOCK_ELEMENTS = 2**19
_MIN_BLOCK = 128


def _block_size(n_tokens: int, vocab: int) -> int:
    """Same choice as jaxstable's `_block_size`."""
    target = min(max(_MIN_BLOCK, _BLOCK_ELEMENTS // max(n_tokens, 1)), vocab)
    for size in range(target, max(target // 2, 1) - 1, -1):
        if vocab % size == 0:
            return size
    return target


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _blocks(vocab: int, block: int):
    return [(start, min(start + block, vocab)) for start in range(0, vocab, block)]


def _logits(h32: torch.Tensor, weight: torch.Tensor, start: int, stop: int):
    # float32 products from bf16/fp16 inputs: the block of the weight is
    # upcast (a bf16 matmul would round each logit to 8 bits).
    return h32 @ weight[start:stop].to(h32.dtype).T


def _stats(h32, weight, labels, block, smoothing):
    n = h32.shape[0]
    kw = {"device": h32.device, "dtype": h32.dtype}
    m = torch.full((n,), float("-inf"), **kw)
    s, x_sum = torch.zeros(n, **kw), torch.zeros(n, **kw)
    for start, stop in _blocks(weight.shape[0], block):
        logits = _logits(h32, weight, start, stop)
        if smoothing:
            x_sum = x_sum + logits.sum(dim=1)
        m_new = torch.maximum(m, logits.amax(dim=1))
        # exp(-inf - -inf) is NaN: while every logit so far is -inf, s stays 0
        rescale = torch.where(m == m_new, 1.0, torch.exp(m - m_new))
        # in place: one [N, block] float32 buffer per block, no more
        s = s * rescale + logits.sub_(m_new[:, None]).exp_().sum(dim=1)
        m = m_new
    return m + torch.log(s), _label_logits(h32, weight, labels), x_sum


def _label_logits(h32, weight, labels):
    """``h32[n] @ weight[labels[n]]`` (float32 products, summed in float32),
    0 for a label outside [0, V): gathered once instead of picked out of
    every block (as jaxstable's `_label_logits`)."""
    ok = (labels >= 0) & (labels < weight.shape[0])
    rows = weight[torch.where(ok, labels, 0)].to(h32.dtype)
    return torch.where(ok, (h32 * rows).sum(dim=1), 0.0)


def _masks(labels, vocab, ignore_index):
    """(valid, bad): bad = not ignored and outside [0, vocab)."""
    ignored = (
        torch.zeros_like(labels, dtype=torch.bool)
        if ignore_index is None
        else labels == ignore_index
    )
    in_range = (labels >= 0) & (labels < vocab)
    return in_range & ~ignored, ~in_range & ~ignored


def _token_losses(lse, x_y, x_sum, vocab, valid, bad, smoothing, z_loss):
    loss = (1.0 - smoothing) * (lse - x_y)
    if smoothing:
        loss = loss + smoothing * (lse - x_sum / vocab)
    if z_loss:
        loss = loss + z_loss * lse.square()
    loss = torch.where(valid, loss, 0.0)
    return torch.where(bad, float("nan"), loss)


def _grads(hidden, h32, weight, labels, valid, bad, lse, g, block, smoothing, z_loss):
    """``(d hidden, d weight)`` of ``sum_n g_n loss_n``, block by block; one
    [N, block] float32 buffer live at a time (the ops on it are in place)."""
    vocab = weight.shape[0]
    g = torch.where(bad, float("nan"), torch.where(valid, g, 0.0))
    coef = g * (1.0 + 2.0 * z_loss * lse) if z_loss else g
    # the label's term, added by scatter (x + -v is x - v bit for bit; rows
    # whose label is in another block add -0.0, which changes nothing)
    minus = -((1.0 - smoothing) * g)
    d_hidden = torch.zeros_like(h32)
    d_weight = torch.empty_like(weight)
    for start, stop in _blocks(vocab, block):
        # d loss_n / d x_c = p_c (1 + 2 z lse) - (1 - s) [c == y] - s / V
        d_logits = _logits(h32, weight, start, stop)
        d_logits.sub_(lse[:, None]).exp_().mul_(coef[:, None])
        inside = (labels >= start) & (labels < stop)
        col = torch.where(inside, labels - start, 0)[:, None]
        d_logits.scatter_add_(1, col, torch.where(inside, minus, -0.0)[:, None])
        if smoothing:
            d_logits.sub_((smoothing / vocab) * g[:, None])
        d_hidden += d_logits @ weight[start:stop].to(h32.dtype)
        d_weight[start:stop] = (d_logits.T @ h32).to(weight.dtype)
    return d_hidden.to(hidden.dtype), d_weight


class _Rows(torch.autograd.Function):
    """Per-token losses; the backward recomputes the logits by block."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, smoothing, z_loss, block):
        # matmul is on autocast's lower-precision list: inside
        # torch.autocast(bfloat16) every block would be a bf16 matmul (loss
        # 2.6e-3 off float64 instead of 4e-7) and the backward would subtract
        # that log-sum-exp from float32 logits (softmax rows summing to
        # 0.96-1.05). Both passes run with autocast off, as outside it.
        with torch.autocast(hidden.device.type, enabled=False):
            h32 = hidden.to(_acc(hidden))
            valid, bad = _masks(labels, weight.shape[0], ignore_index)
            lse, x_y, x_sum = _stats(h32, weight, labels, block, smoothing)
            ctx.save_for_backward(hidden, weight, labels, lse)
            ctx.args = (ignore_index, smoothing, z_loss, block)
            vocab = weight.shape[0]
            return _token_losses(lse, x_y, x_sum, vocab, valid, bad, smoothing, z_loss)

    @staticmethod
    def backward(ctx, g):
        hidden, weight, labels, lse = ctx.saved_tensors
        ignore_index, smoothing, z_loss, block = ctx.args
        # a backward run inside torch.autocast would cast its matmuls too
        with torch.autocast(hidden.device.type, enabled=False):
            valid, bad = _masks(labels, weight.shape[0], ignore_index)
            dh, dw = _grads(
                hidden, hidden.to(_acc(hidden)), weight, labels, valid, bad, lse,
                g.to(lse.dtype), block, smoothing, z_loss,
            )  # fmt: skip
        return dh, dw, None, None, None, None, None


def _check_inputs(hidden, weight, labels, label_smoothing, block_size):
    # Same checks and texts as jaxstable.losses.linear_cross_entropy, in
    # torch's layout.
    check_float("hidden", hidden)
    check_float("weight", weight)
    if hidden.ndim < 1:
        raise ValueError("hidden must have a feature dim (last), got a scalar")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        hint = (
            " (a flax Dense kernel is (D, V): pass its .T)" if weight.ndim == 2 else ""
        )
        raise ValueError(
            f"weight must have shape (vocab, features) = (V, {hidden.shape[-1]}) "
            f"like nn.Linear.weight (hidden @ weight.T), got {tuple(weight.shape)}"
            + hint
        )
    if weight.shape[0] == 0:
        raise ValueError("weight has a vocabulary of 0 classes")
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the "
            "same dtype (the products accumulate in float32 either way): cast one"
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(
            "labels must be an integer tensor of class indices, got dtype "
            f"{labels.dtype}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels.shape={tuple(labels.shape)} must equal hidden.shape="
            f"{tuple(hidden.shape)} without its feature dim, i.e. "
            f"{tuple(hidden.shape[:-1])}"
        )
    smoothing = float(label_smoothing)
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if block_size is not None and (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 1
    ):
        raise ValueError(f"block_size must be None or an int >= 1, got {block_size!r}")
    return smoothing


def linear_cross_entropy(
    hidden: Any,
    weight: Any,
    labels: Any,
    *,
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    block_size: int | None = None,
) -> torch.Tensor:
    r"""``softmax_cross_entropy(hidden @ weight.T, labels, dim=-1)`` without the logits.

    The twin of `jaxstable.losses.linear_cross_entropy` (see there for the
    two passes and the maths), with ``weight`` in ``nn.Linear``'s layout
    ``(V, D)``: the logits are computed ``block_size`` vocabulary rows at a
    time, in float32 from bf16/fp16 inputs (each block of the weight is
    upcast; ``hidden`` once, a ``[N, D]`` copy), never ``[N, V]`` at once.
    The gradients are computed in the backward, for every reduction (the
    cotangent scales each block as it goes: no saved gradient to rescale).
    Ignored tokens add 0; "mean" divides by the number of counted tokens
    (0.0 with a zero gradient when there is none).

    Args:
        hidden: floating tensor ``(..., D)``.
        weight: ``(V, D)``, an ``nn.Linear(D, V, bias=False).weight``; same
            dtype as ``hidden``.
        labels: integer tensor ``hidden.shape[:-1]``.
        ignore_index: label value that contributes nothing (e.g. -100).
        label_smoothing: ``s`` in [0, 1].
        z_loss: PaLM's ``z`` (finite, >= 0).
        reduction: "mean", "sum" or "none" (per-token losses).
        block_size: vocabulary rows per block (int >= 1); None picks about
            ``2**19 / N``, at least 128.

    Returns:
        float32 scalar, or per-token float32 losses for "none" (float64 for
        float64 inputs). Labels outside [0, V) that are not ``ignore_index``
        raise ValueError naming them (one host sync).

    Example:
        >>> import torch
        >>> from torchref import losses
        >>> g = torch.Generator().manual_seed(0)
        >>> h = torch.randn(6, 8, generator=g).bfloat16()
        >>> head = torch.nn.Linear(8, 1000, bias=False).bfloat16()
        >>> y = torch.tensor([0, 5, 999, -100, 3, 7])
        >>> lean = losses.linear_cross_entropy(h, head.weight, y, ignore_index=-100)
        >>> naive = losses.softmax_cross_entropy(
        ...     h.float() @ head.weight.float().T, y, ignore_index=-100)
        >>> lean.dtype, torch.allclose(lean, naive, rtol=1e-5)
        (torch.float32, True)
    """
    _check_reduction(reduction)
    z = check_z_loss(z_loss)
    hidden, weight, labels = as_tensors(hidden=hidden, weight=weight, labels=labels)
    smoothing = _check_inputs(hidden, weight, labels, label_smoothing, block_size)
    vocab = weight.shape[0]
    lab = labels.reshape(-1).long()
    bad = (lab < 0) | (lab >= vocab)
    if ignore_index is not None:
        bad &= lab != ignore_index
    if bool(bad.any()):
        raise ValueError(bad_label_message(lab[bad], vocab, ignore_index))
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    block = min(block_size or _block_size(h.shape[0], vocab), vocab)
    args = (ignore_index, smoothing, z, int(block))
    if reduction == "none":
        return _Rows.apply(h, weight, lab, *args).reshape(lead)
    # the sum's cotangent reaches _Rows' backward as one value per token:
    # the gradient pass runs once, scaled as it goes (no saved [V, D]
    # gradient to rescale afterwards)
    total = _Rows.apply(h, weight, lab, *args).sum()
    if reduction == "sum":
        return total
    count = _masks(lab, vocab, ignore_index)[0].sum().to(total.dtype)
    return torch.where(count > 0, total / count.clamp(min=1.0), 0.0)
