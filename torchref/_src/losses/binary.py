"""Losses on binary targets, in at least float32: sigmoid BCE, DBNet's
balanced BCE with hard-negative mining, the dice loss and RetinaNet's
sigmoid focal loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from _stablecore.losses import check_reduction as _check_reduction
from torchref._src.losses._checks import (
    TINY,
    as_tensors,
    check_eps,
    check_float,
    check_positive,
    check_same_shape,
    compute_dtype,
    is_nan,
    nan_if,
    reduce,
    shape_of,
)


def sigmoid_binary_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    r"""``F.binary_cross_entropy_with_logits`` on float32 upcasts.

    ``l = w * (max(x, 0) - x t + log(1 + exp(-|x|)))``; "mean" divides by the
    number of elements (as torch); the mean of an empty tensor is 0.0 (torch:
    NaN). The gradient is torch's ``w (sigmoid(x) - t)``, ``x = 0`` included
    (jaxstable's too).

    Precision: float32; float64 for float64 ``logits``.

    Args:
      logits: floating tensor, any shape and float dtype.
      targets: same shape, values in [0, 1].
      weights: optional elementwise weights broadcastable to ``logits``.
      reduction: "mean", "sum" or "none".

    Returns:
      float32 scalar, or float32 tensor of ``logits.shape`` for "none"
      (float64 for float64 logits).

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> x = torch.tensor([-20000.0, 0.0, 20000.0]).half()
      >>> loss = losses.sigmoid_binary_cross_entropy(x, torch.tensor([0.0, 1.0, 1.0]))
      >>> print(loss.dtype, round(float(loss), 4))
      torch.float32 0.231
      >>> x = torch.zeros(4, requires_grad=True)  # (sigmoid(0) - t) / 4
      >>> t = torch.tensor([1.0, 0.0, 1.0, 0.0])
      >>> losses.sigmoid_binary_cross_entropy(x, t).backward()
      >>> print(x.grad)
      tensor([-0.1250,  0.1250, -0.1250,  0.1250])
    """
    _check_reduction(reduction)
    logits, targets, weights = as_tensors(
        logits=logits, targets=targets, weights=weights
    )
    check_float("logits", logits)
    check_same_shape("logits", logits, "targets", targets)
    if weights is not None:
        try:
            fits = torch.broadcast_shapes(weights.shape, logits.shape) == logits.shape
        except RuntimeError:
            fits = False
        if not fits:  # weights of a larger shape would silently change the mean
            raise ValueError(
                f"weights.shape={tuple(weights.shape)} does not broadcast to "
                f"logits.shape={tuple(logits.shape)}"
            )
        weights = weights.to(compute_dtype(logits))
    ct = compute_dtype(logits)
    out = F.binary_cross_entropy_with_logits(
        logits.to(ct),
        targets.to(ct),
        weight=weights,
        reduction="sum" if reduction == "mean" else reduction,
    )
    if reduction == "mean":
        return out / max(logits.numel(), 1)
    return out


def balanced_binary_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    *,
    negative_ratio: float = 3.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    r"""DBNet's balanced BCE with online hard negative mining, on logits.

    Positives are ``targets > 0.5`` inside ``mask > 0.5``; negatives the rest
    of the mask. ``k = min(#neg, floor(ratio * #pos))`` hardest negatives are
    kept (DBNet's reference takes them with ``torch.topk``)::

        loss = (sum positive BCE + sum of top-k negative BCE) / (#pos + k + eps)

    Ties: the k hardest come from a stable descending sort, so among equal
    negative losses at the k-th place the lowest (flat) index is kept, as in
    jaxstable. ``torch.topk`` (the reference) keeps some of the tied ones,
    which ones being unspecified (other indices on CPU and CUDA): the value
    is the same, but the pixels that get a gradient differ, e.g. when a
    zero-initialised head gives every negative the loss log 2.

    Precision: float32; float64 for float64 ``logits``.

    Args:
      logits: shrink-map logits, any shape and float dtype.
      targets: binary ground truth, same shape.
      mask: binary training mask, same shape.
      negative_ratio: a finite number > 0. ``ratio * #pos`` is taken in
        float32, as in jaxstable, so both pick the same ``k``; DBNet's
        reference uses float64 and can pick one fewer for a ratio not exact
        in binary (100 * 0.57: 57 here, 56 there). The default 3.0 is exact
        below 2**22 positives.
      eps: finite and >= 1.2e-38 (float32's smallest normal number); no
        positives and no negatives gives 0 / eps = 0.

    Returns:
      float32 scalar, float64 for float64 logits (reads the counts on the
      host, as the reference does).
      A NaN loss on a negative pixel ranks first in ``topk`` (NaN when
      ``k >= 1``, as jaxstable); a NaN in ``mask``, or in ``targets`` inside
      the mask, gives NaN; a NaN logit outside the mask leaves the loss
      finite and its gradient NaN (the guard catches it).

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> x = torch.tensor([2.0, -1.0, 3.0, -4.0, 0.0])
      >>> g = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])
      >>> loss = losses.balanced_binary_cross_entropy(x, g, torch.ones(5),
      ...                                            negative_ratio=2.0)
      >>> print(round(float(loss), 4))
      1.2896
    """
    logits, targets, mask = as_tensors(logits=logits, targets=targets, mask=mask)
    check_float("logits", logits)
    check_same_shape("logits", logits, "targets", targets)
    check_same_shape("logits", logits, "mask", mask)
    check_positive("negative_ratio", negative_ratio, finite=True)
    check_eps("eps", eps)
    ct = compute_dtype(logits)
    in_mask = mask > 0.5
    positive = (targets > 0.5) & in_mask
    negative = ~(targets > 0.5) & in_mask
    loss = F.binary_cross_entropy_with_logits(
        logits.to(ct), positive.to(ct), reduction="none"
    )
    n_pos = int(positive.sum())
    n_neg = int(negative.sum())
    # float32 product, as jaxstable computes it under jit (see the docstring)
    f32 = torch.float32
    ratio_p = torch.tensor(n_pos, dtype=f32) * torch.tensor(negative_ratio, dtype=f32)
    k = min(n_neg, math.floor(ratio_p.item()))
    neg_loss = torch.where(negative, loss, torch.zeros_like(loss)).reshape(-1)
    # topk's order among ties is unspecified: a stable sort keeps the lowest
    # index first (jaxstable's order); a NaN ranks first, as in topk
    hardest = torch.sort(neg_loss, descending=True, stable=True).values
    top_k = hardest[:k].sum()
    pos_sum = torch.where(positive, loss, torch.zeros_like(loss)).sum()
    # a NaN target or mask is neither positive nor negative (no host sync)
    undefined = (is_nan(mask) | (is_nan(targets) & in_mask)).any()
    return (pos_sum + top_k) * nan_if(undefined, ct) / (n_pos + k + eps)


def dice_loss(
    probs: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
) -> torch.Tensor:
    r"""Dice loss: ``1 - 2 sum(p g m) / (sum(p m) + sum(g m) + eps)``.

    An empty mask gives 1.0 with a finite gradient.

    Precision: float32; float64 for float64 ``probs``.

    Args:
      probs: predicted probabilities (any float dtype).
      targets: ground truth, same shape.
      mask: optional mask/weights, same shape.
      eps: finite and >= 1.2e-38 (float32's smallest normal number).

    Returns:
      float32 scalar (float64 for float64 probs).

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> p = torch.tensor([0.75, 0.25, 0.5]).bfloat16()
      >>> print(round(float(losses.dice_loss(p, torch.tensor([1.0, 0.0, 1.0]))), 3))
      0.286
    """
    probs, targets, mask = as_tensors(probs=probs, targets=targets, mask=mask)
    check_float("probs", probs)
    check_same_shape("probs", probs, "targets", targets)
    check_eps("eps", eps)
    ct = compute_dtype(probs)
    p, g = probs.to(ct), targets.to(ct)
    if mask is None:
        m = torch.ones((), dtype=ct, device=p.device)
    else:
        check_same_shape("probs", probs, "mask", mask)
        m = mask.to(ct)
    intersection = (p * g * m).sum()
    union = (p * m).sum() + (g * m).sum() + eps
    return 1.0 - 2.0 * intersection / union


def _check_alpha(alpha) -> bool:
    """True when alpha weights the classes: a number in [0, 1]; None or -1
    (torchvision's 'ignore') turn the weighting off; anything else raises."""
    if alpha is None or (shape_of(alpha) == () and float(alpha) == -1.0):
        return False
    if shape_of(alpha) != () or not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(
            f"alpha must be a number in [0, 1], or None / -1 for no class "
            f"weighting, got {alpha}"
        )
    return True


def _check_unit_interval(name: str, x: torch.Tensor) -> None:
    """ValueError if `x` holds a value outside [0, 1] (one host sync; a NaN
    passes: it gives a NaN loss)."""
    outside = (x < 0) | (x > 1)
    if bool(outside.any()):
        raise ValueError(
            f"{name} must be in [0, 1]; found {int(outside.sum())} value(s) "
            f"outside, e.g. {x[outside].flatten()[0].item()}"
        )


def sigmoid_focal_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    alpha: float | None = 0.25,
    gamma: float = 2.0,
    reduction: str = "none",
) -> torch.Tensor:
    r"""Sigmoid focal loss in at least float32: torchvision's focal loss values.

    ``l = alpha_t q^gamma bce_with_logits(x, t)`` with ``q = 1 - p_t =
    sigmoid(x) (1 - t) + sigmoid(-x) t`` (accurate where ``1 - p_t`` rounds
    to 0, ``|x| > 17``) floored at float32's smallest normal 1.2e-38, so the
    gradient stays finite for ``0 < gamma < 1`` (torchvision: NaN at a
    saturated logit). The mean of an empty tensor is 0.0 (torchvision: NaN).

    Precision: float32; float64 for float64 ``logits``.

    Args:
      logits: floating tensor, any shape and float dtype.
      targets: same shape, in [0, 1]; a value outside raises ``ValueError``
        (one host sync).
      alpha: positives' weight in [0, 1]; None or -1 for no weighting.
      gamma: a finite number >= 0.
      reduction: "none", "mean" or "sum".

    Returns:
      float32 tensor of ``logits.shape`` ("none"), or a float32 scalar
      (float64 for float64 logits).

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> x = torch.tensor([-3.0, 0.0, 3.0, 30.0]).bfloat16()
      >>> t = torch.tensor([0.0, 1.0, 1.0, 0.0])
      >>> loss = losses.sigmoid_focal_loss(x, t)
      >>> print(loss.dtype, [round(float(v), 4) for v in loss])
      torch.float32 [0.0001, 0.0433, 0.0, 22.5]
    """
    _check_reduction(reduction)
    weighted = _check_alpha(alpha)
    check_positive("gamma", gamma, allow_zero=True, finite=True)
    logits, targets = as_tensors(logits=logits, targets=targets)
    check_float("logits", logits)
    check_same_shape("logits", logits, "targets", targets)
    _check_unit_interval("targets", targets)
    ct = compute_dtype(logits)
    x, t = logits.to(ct), targets.to(ct)
    q = torch.sigmoid(x) * (1.0 - t) + torch.sigmoid(-x) * t
    bce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
    loss = bce * torch.where(q > TINY, q, TINY) ** gamma
    if weighted:
        loss = (alpha * t + (1.0 - alpha) * (1.0 - t)) * loss
    return reduce(loss, reduction)
