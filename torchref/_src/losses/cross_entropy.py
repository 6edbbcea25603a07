"""Softmax cross-entropy with integer labels, in at least float32.

`F.cross_entropy` on a float32 (at least) upcast, with jaxstable's mean.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from _stablecore.losses import check_reduction as _check_reduction
from torchref._src.losses._checks import (
    as_tensors,
    check_float,
    compute_dtype,
    masked_mean,
    nan_if,
)


def bad_label_message(bad_values: torch.Tensor, n_classes: int, ignore_index) -> str:
    uniq = torch.unique(bad_values)
    shown = ", ".join(str(int(v)) for v in uniq[:10])
    more = f" (+{uniq.numel() - 10} more)" if uniq.numel() > 10 else ""
    ign = "" if ignore_index is None else f" and not ignore_index={ignore_index}"
    return (
        f"labels must be in [0, {n_classes}){ign}; found {bad_values.numel()} "
        f"element(s) with values [{shown}]{more}"
    )


def _weighted_mean(total, count, weight_sum) -> torch.Tensor:
    """F.cross_entropy's weighted mean total / weight_sum, a negative
    weight_sum included (torch's value); 0.0 (zero gradient) when no element
    counts (count == 0); NaN, gradient included, when elements count but
    their weights sum to 0 (F.cross_entropy: +-inf or NaN, a division by 0)."""
    counted = count > 0
    safe = torch.where(counted, weight_sum, torch.ones_like(weight_sum))
    mean = total / safe * nan_if(counted & (weight_sum == 0), total.dtype)
    return torch.where(counted, mean, torch.zeros_like(mean))


def softmax_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    dim: int = 1,
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    weights: torch.Tensor | None = None,
    reduction: str = "mean",
    z_loss: float = 0.0,
) -> torch.Tensor:
    r"""``F.cross_entropy`` on a float32 (at least) upcast of the logits, any class dim.

    For an element with label ``y``, ``C`` classes, class weights ``w`` and
    smoothing ``s``: ``l = (1 - s) w_y (lse - x_y) + (s / C) sum_c w_c (lse -
    x_c)``; "mean" is ``sum l / sum w_y`` over non-ignored elements (exactly
    ``F.cross_entropy``'s definition). Deviation (documented, tested, same as
    jaxstable): a mean over zero valid elements (all ignored, or an empty
    batch) is 0.0 with a zero gradient, where ``F.cross_entropy`` gives NaN.
    Class weights may be negative: a negative ``sum w_y`` gives
    ``F.cross_entropy``'s value; a zero one, with valid elements, gives NaN
    (``F.cross_entropy``: +-inf or NaN, a division by 0), never 0.0.

    With ``z_loss = z > 0`` (PaLM): ``l += z w_y lse**2`` with ``lse =
    torch.logsumexp`` of the float32 upcast, reduced with the loss (ignored
    elements add nothing, "mean" divides by the same ``sum w_y``), as
    `jaxstable.losses.softmax_cross_entropy` does. ``F.cross_entropy`` does
    not return its ``lse``, so this costs one more pass over the logits.

    Precision: float32; float64 for float64 ``logits`` (the module
    docstring's rule).

    Args:
      logits: floating tensor with classes along ``dim`` (NCHW: 1).
      labels: integer class indices, ``logits.shape`` without ``dim``.
      dim: class dimension.
      ignore_index: label value that contributes nothing (e.g. 255).
      label_smoothing: ``s`` in [0, 1].
      weights: optional per-class weights, shape ``(C,)``.
      reduction: "mean", "sum" or "none".
      z_loss: coefficient ``z`` of ``lse**2``, a finite Python number >= 0
        (1e-4 in PaLM). 0 adds nothing.

    Returns:
      float32 scalar (per-element float32 tensor for "none"); float64 for
      float64 logits. Labels outside
      [0, C) that are not ``ignore_index`` raise ``ValueError`` naming them
      (this check reads the labels on the host: one sync per call), an
      int64 label beyond the int32 range included.

      Non-finite logits: NaN or +inf in a counted element's row gives NaN;
      -inf gives +inf on the label (with smoothing: on any class) and is an
      exact zero probability on another class; on an ignored element they
      leave the loss finite and make that row's gradient NaN (0 * NaN), as
      in jaxstable: a finiteness guard on the gradients catches it.

      Inputs may be tensors or array-likes (lists, numpy arrays: converted
      with ``torch.as_tensor`` onto the tensors' device, as every loss here
      does); tensors on different devices raise ``ValueError`` naming them.

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> logits = torch.tensor([[3000.0, 0.0], [0.0, 1.0]]).half()
      >>> loss = losses.softmax_cross_entropy(logits, torch.tensor([1, 255]),
      ...                                     ignore_index=255)
      >>> print(loss.dtype, float(loss))
      torch.float32 3000.0
      >>> # z-loss: + z * logsumexp(x)**2 = 1e-4 * (2 + log 2)**2 here
      >>> z = losses.softmax_cross_entropy(torch.full((1, 2), 2.0), torch.tensor([0]),
      ...                                  z_loss=1e-4)
      >>> round(float(z) - math.log(2.0), 6)
      0.000725
    """
    _check_reduction(reduction)
    z_loss = check_z_loss(z_loss)
    logits, labels, weights = as_tensors(logits=logits, labels=labels, weights=weights)
    check_float("logits", logits)
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(
            f"labels must be an integer tensor of class indices, got dtype "
            f"{labels.dtype} (probability targets are not supported)"
        )
    if logits.ndim == 0:
        raise ValueError("logits must have a class dim, got a scalar")
    if not -logits.ndim <= dim < logits.ndim:
        raise ValueError(
            f"dim={dim} is out of range for logits with {logits.ndim} dims"
        )
    dim = dim % logits.ndim
    expected = logits.shape[:dim] + logits.shape[dim + 1 :]
    if labels.shape != expected:
        raise ValueError(
            f"labels.shape={tuple(labels.shape)} must equal logits.shape="
            f"{tuple(logits.shape)} without the class dim {dim}, i.e. "
            f"{tuple(expected)}"
        )
    n_classes = logits.shape[dim]
    if n_classes == 0:
        raise ValueError(f"logits have 0 classes along dim {dim}")
    smoothing = float(label_smoothing)
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if weights is not None:
        check_float("weights", weights)
        if tuple(weights.shape) != (n_classes,):
            raise ValueError(
                f"weights must have shape ({n_classes},) (one per class), got "
                f"{tuple(weights.shape)}"
            )
        weights = weights.to(compute_dtype(logits))
    labels = labels.long()
    bad = (labels < 0) | (labels >= n_classes)
    if ignore_index is not None:
        bad &= labels != ignore_index
    if bool(bad.any()):  # torch's own message names one value, ours all of them
        raise ValueError(bad_label_message(labels[bad], n_classes, ignore_index))

    x = logits.to(compute_dtype(logits))
    if x.ndim > 1 and dim != 1:
        x = x.movedim(dim, 1)
    # ignore_index=None: pass torch's default; every label was checked above.
    ii = -100 if ignore_index is None else int(ignore_index)
    torch_red = "sum" if reduction == "mean" else reduction
    out = F.cross_entropy(
        x, labels, weight=weights, ignore_index=ii, label_smoothing=smoothing,
        reduction=torch_red,
    )  # fmt: skip
    valid = labels != ii
    if z_loss:
        lse = torch.logsumexp(x, dim=1 if x.ndim > 1 else 0)
        w_y = 1.0 if weights is None else weights[torch.where(valid, labels, 0)]
        z_term = torch.where(valid, z_loss * w_y * lse.square(), 0.0)
        out = out + (z_term if reduction == "none" else z_term.sum())
    if reduction != "mean":
        return out
    if weights is None:
        return masked_mean(out, valid.sum().to(out.dtype))
    w_y = weights[torch.where(valid, labels, 0)]
    w_sum = torch.where(valid, w_y, torch.zeros_like(w_y)).sum()
    return _weighted_mean(out, valid.sum(), w_sum)


def check_z_loss(z_loss) -> float:
    """A finite Python number >= 0. Same text as jaxstable.losses."""
    if isinstance(z_loss, bool) or not isinstance(z_loss, int | float):
        raise TypeError(
            "z_loss must be a finite Python number >= 0 (static, e.g. 1e-4), "
            f"got {type(z_loss).__name__}"
        )
    if not (math.isfinite(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss}")
    return float(z_loss)
