"""Float32-safe losses for low-precision (fp16/bf16) PyTorch training.

The PyTorch twin of `jaxstable.losses`: the same functions and semantics, built
on what a careful PyTorch user already calls (`F.cross_entropy`,
`F.binary_cross_entropy_with_logits`, `torch.sigmoid`) applied to float32
upcasts of the inputs. Inside `torch.autocast` these functions are on the
float32 list anyway, except the matmul of `info_nce`, which runs with autocast
turned off; the explicit `.float()` also covers models cast with `.half()` and
code outside autocast. Gradients flow back in the input dtype.

Every loss takes tensors or array-likes: a list or numpy array is converted
with `torch.as_tensor` onto the device of the tensor inputs (as jaxstable
converts with `jnp.asarray`); tensors on different devices raise ValueError
naming each input's device.

Precision, one rule for every loss (jaxstable's too): a loss computes in at
least float32. It computes and returns float32 for bf16, fp16 and float32
predictions, and float64 when its predictions are float64 (the input named in
its docstring's "Precision" line: `logits`, `probs`, `pred`, `prob`/`thresh`,
`a`/`b`, `boxes1`/`boxes2`); targets, masks and weights are cast to that
dtype (jaxstable holds float64 only with x64 on).

Gradients at kinks and ties are those of the PyTorch reference formulas
(`F.binary_cross_entropy_with_logits`: ``sigmoid(x) - t`` at x = 0; `abs`:
0 at 0; `clamp_min`: all of it at the tie; `maximum`/`minimum`: half each),
which jaxstable reproduces; among equal hard negatives the lowest index is
kept (a stable sort, in both twins: `torch.topk`'s choice among ties is
unspecified). Scalar options (eps, temperature, k, ratios, weights) must be
finite; an eps must also be at least float32's smallest normal number.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_REDUCTIONS = ("mean", "sum", "none")
# float32's smallest normal number 1.1754944e-38: the floor of every eps (as
# jaxstable, where XLA on CPU flushes a subnormal eps to 0) and of the focal
# loss' modulating base (see sigmoid_focal_loss)
_TINY = torch.finfo(torch.float32).tiny


# ---------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------


def _compute_dtype(*predictions) -> torch.dtype:
    """The dtype a loss computes in: float64 when a prediction is float64,
    float32 otherwise ("at least float32", jaxstable's `_compute_dtype`)."""
    wide = any(x is not None and x.dtype == torch.float64 for x in predictions)
    return torch.float64 if wide else torch.float32


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"unknown reduction {reduction!r}; valid values: {', '.join(_REDUCTIONS)}"
        )


def _check_float(name: str, x: torch.Tensor) -> None:
    if not torch.is_floating_point(x):
        raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")


def _check_same_shape(name_a: str, a, name_b: str, b) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} and {name_b} must have the same shape, got "
            f"{name_a}.shape={tuple(a.shape)} and {name_b}.shape={tuple(b.shape)}"
        )


def _shape_of(value) -> tuple:
    if hasattr(value, "shape"):  # tensor, numpy array
        return tuple(value.shape)
    return (len(value),) if isinstance(value, (list, tuple)) else ()


def _check_positive(
    name: str, value, *, allow_zero: bool = False, finite: bool = False
) -> None:
    """Raise ValueError for a non-scalar value, a value <= 0 (< 0 with
    allow_zero), NaN, or inf/NaN when `finite` (jaxstable's messages)."""
    if _shape_of(value) != ():
        raise ValueError(f"{name} must be a scalar, got shape {_shape_of(value)}")
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            return  # learnable: clamped, not checked (that would sync every step)
        v = float(value.detach().double())
    else:
        v = float(value)
    rule = ">= 0" if allow_zero else "> 0"
    if finite and not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number {rule}, got {value}")
    if (v < 0 if allow_zero else v <= 0) or math.isnan(v):
        raise ValueError(f"{name} must be {rule}, got {value}")


def _check_eps(name: str, value) -> None:
    """A finite eps >= float32's smallest normal number (see `_TINY`)."""
    _check_positive(name, value, finite=True)
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return
    if float(value) < _TINY:
        raise ValueError(
            f"{name} must be >= {_TINY:.8g} (float32's smallest normal number; "
            f"XLA on CPU flushes a smaller one to 0), got {value}"
        )


def _check_non_negative_values(name: str, x: torch.Tensor) -> None:
    """ValueError if `x` holds a negative value (reads it on the host: one
    device sync)."""
    negative = x < 0
    if bool(negative.any()):
        raise ValueError(
            f"{name} must be >= 0 everywhere (a weight per element); found "
            f"{int(negative.sum())} negative value(s), the lowest "
            f"{x[negative].min().item()}"
        )


def _as_tensors(**inputs):
    """The inputs, in order, as tensors on one device (one validator for
    every loss). None passes through; an array-like (list, numpy array,
    number) is converted with ``torch.as_tensor`` onto the tensors' device,
    as jaxstable converts with ``jnp.asarray``. Tensors on different devices
    raise ValueError naming each one's device (torch would compute a cpu @
    meta product, or fail deep inside)."""
    devices = {n: x.device for n, x in inputs.items() if isinstance(x, torch.Tensor)}
    if len(set(devices.values())) > 1:
        where = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all inputs must be on one device, got {where}")
    device = next(iter(devices.values()), None)
    out = []
    for name, x in inputs.items():
        if x is not None and not isinstance(x, torch.Tensor):
            try:
                x = torch.as_tensor(x, device=device)
            except (TypeError, ValueError, RuntimeError) as err:
                raise TypeError(
                    f"{name} must be a tensor or a numeric array-like (list, "
                    f"numpy array), got {type(x).__name__} ({err})"
                ) from None
        out.append(x)
    return out


def _nan_if(condition: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """1.0, or NaN where `condition`: a factor that makes a loss and its
    gradient NaN for an input that has no defined loss (no host sync)."""
    return torch.where(condition, math.nan, 1.0).to(dtype)


def _isnan(x: torch.Tensor) -> torch.Tensor:
    """isnan for any dtype (an integer or bool tensor is never NaN)."""
    if x.is_floating_point() or x.is_complex():
        return torch.isnan(x)
    return torch.zeros_like(x, dtype=torch.bool)


def _bad_label_message(bad_values: torch.Tensor, n_classes: int, ignore_index) -> str:
    uniq = torch.unique(bad_values)
    shown = ", ".join(str(int(v)) for v in uniq[:10])
    more = f" (+{uniq.numel() - 10} more)" if uniq.numel() > 10 else ""
    ign = "" if ignore_index is None else f" and not ignore_index={ignore_index}"
    return (
        f"labels must be in [0, {n_classes}){ign}; found {bad_values.numel()} "
        f"element(s) with values [{shown}]{more}"
    )


def _masked_mean(total: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """total / denominator, and 0.0 (zero gradient) where denominator is 0."""
    nonzero = denominator > 0
    safe = torch.where(nonzero, denominator, torch.ones_like(denominator))
    return torch.where(nonzero, total / safe, torch.zeros_like(total))


def _weighted_mean(total, count, weight_sum) -> torch.Tensor:
    """F.cross_entropy's weighted mean total / weight_sum, a negative
    weight_sum included (torch's value); 0.0 (zero gradient) when no element
    counts (count == 0); NaN, gradient included, when elements count but
    their weights sum to 0 (F.cross_entropy: +-inf or NaN, a division by 0)."""
    counted = count > 0
    safe = torch.where(counted, weight_sum, torch.ones_like(weight_sum))
    mean = total / safe * _nan_if(counted & (weight_sum == 0), total.dtype)
    return torch.where(counted, mean, torch.zeros_like(mean))


# ---------------------------------------------------------------------------
# softmax cross-entropy
# ---------------------------------------------------------------------------


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
    z_loss = _check_z_loss(z_loss)
    logits, labels, weights = _as_tensors(logits=logits, labels=labels, weights=weights)
    _check_float("logits", logits)
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
        _check_float("weights", weights)
        if tuple(weights.shape) != (n_classes,):
            raise ValueError(
                f"weights must have shape ({n_classes},) (one per class), got "
                f"{tuple(weights.shape)}"
            )
        weights = weights.to(_compute_dtype(logits))
    labels = labels.long()
    bad = (labels < 0) | (labels >= n_classes)
    if ignore_index is not None:
        bad &= labels != ignore_index
    if bool(bad.any()):  # torch's own message names one value, ours all of them
        raise ValueError(_bad_label_message(labels[bad], n_classes, ignore_index))

    x = logits.to(_compute_dtype(logits))
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
        return _masked_mean(out, valid.sum().to(out.dtype))
    w_y = weights[torch.where(valid, labels, 0)]
    w_sum = torch.where(valid, w_y, torch.zeros_like(w_y)).sum()
    return _weighted_mean(out, valid.sum(), w_sum)


def _check_z_loss(z_loss) -> float:
    """A finite Python number >= 0. Same text as jaxstable.losses."""
    if isinstance(z_loss, bool) or not isinstance(z_loss, int | float):
        raise TypeError(
            "z_loss must be a finite Python number >= 0 (static, e.g. 1e-4), "
            f"got {type(z_loss).__name__}"
        )
    if not (math.isfinite(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss}")
    return float(z_loss)


# ---------------------------------------------------------------------------
# binary losses
# ---------------------------------------------------------------------------


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
    logits, targets, weights = _as_tensors(
        logits=logits, targets=targets, weights=weights
    )
    _check_float("logits", logits)
    _check_same_shape("logits", logits, "targets", targets)
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
        weights = weights.to(_compute_dtype(logits))
    ct = _compute_dtype(logits)
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
    logits, targets, mask = _as_tensors(logits=logits, targets=targets, mask=mask)
    _check_float("logits", logits)
    _check_same_shape("logits", logits, "targets", targets)
    _check_same_shape("logits", logits, "mask", mask)
    _check_positive("negative_ratio", negative_ratio, finite=True)
    _check_eps("eps", eps)
    ct = _compute_dtype(logits)
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
    undefined = (_isnan(mask) | (_isnan(targets) & in_mask)).any()
    return (pos_sum + top_k) * _nan_if(undefined, ct) / (n_pos + k + eps)


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
    probs, targets, mask = _as_tensors(probs=probs, targets=targets, mask=mask)
    _check_float("probs", probs)
    _check_same_shape("probs", probs, "targets", targets)
    _check_eps("eps", eps)
    ct = _compute_dtype(probs)
    p, g = probs.to(ct), targets.to(ct)
    if mask is None:
        m = torch.ones((), dtype=ct, device=p.device)
    else:
        _check_same_shape("probs", probs, "mask", mask)
        m = mask.to(ct)
    intersection = (p * g * m).sum()
    union = (p * m).sum() + (g * m).sum() + eps
    return 1.0 - 2.0 * intersection / union


def masked_l1_loss(
    pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    r"""Masked mean absolute error: ``sum(|p - t| m) / sum(m)``.

    An empty mask gives 0.0 with a zero gradient (no division by zero,
    unlike the DBNet reference's ``if mask.sum().item() == 0``). A negative
    mask value raises ``ValueError`` (reads the mask on the host: one sync
    per call). A mask of subnormal floats (1e-40) is a tiny non-empty mask
    here; XLA on CPU flushes it to zero, so jaxstable returns 0.0 for it.
    Where ``p == t`` the gradient is torch's ``abs``' 0 (``sign(0)``), as in
    DBNet's reference and jaxstable.

    Precision: float32; float64 for float64 ``pred``.

    Args:
      pred: predictions (any float dtype).
      target: same shape.
      mask: non-negative mask/weights, same shape.

    Returns:
      float32 scalar (float64 for float64 pred).

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> p, t = torch.tensor([0.5, 0.2, 0.9]), torch.tensor([0.3, 0.2, 0.0])
      >>> print(round(float(losses.masked_l1_loss(p, t, torch.tensor([1, 1, 0]))), 3))
      0.1
      >>> print(float(losses.masked_l1_loss(p, t, torch.zeros(3))))
      0.0
    """
    pred, target, mask = _as_tensors(pred=pred, target=target, mask=mask)
    _check_float("pred", pred)
    _check_same_shape("pred", pred, "target", target)
    _check_same_shape("pred", pred, "mask", mask)
    _check_non_negative_values("mask", mask)
    ct = _compute_dtype(pred)
    m = mask.to(ct)
    total = ((pred.to(ct) - target.to(ct)).abs() * m).sum()
    return _masked_mean(total, m.sum())


def db_step(prob: torch.Tensor, thresh: torch.Tensor, *, k: float = 50.0):
    r"""DBNet's differentiable binarisation ``sigmoid(k (prob - thresh))``.

    Equal in value to the references' ``torch.reciprocal(1 + torch.exp(-k (x -
    y)))``, whose ``exp`` overflows fp16 once ``x - y < -0.222`` at k=50 (exp
    overflows fp16 above 11.09) and whose backward then yields NaN. At
    ``prob == thresh`` the gradient is ``k / 4``, as the reference's.

    Precision: float32; float64 when ``prob`` or ``thresh`` is float64.

    Args:
      prob: probability map (any float dtype).
      thresh: threshold map, broadcastable with ``prob``.
      k: a finite number > 0.

    Returns:
      float32 tensor (float64 when prob or thresh is float64).

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> out = losses.db_step(torch.tensor([0.0, 0.5, 1.0]).half(),
      ...                      torch.tensor([1.0, 0.5, 0.0]).half())
      >>> print(out.dtype, [round(float(v), 4) for v in out])
      torch.float32 [0.0, 0.5, 1.0]
    """
    prob, thresh = _as_tensors(prob=prob, thresh=thresh)
    _check_float("prob", prob)
    _check_positive("k", k, finite=True)
    try:
        torch.broadcast_shapes(prob.shape, thresh.shape)
    except RuntimeError:
        raise ValueError(
            f"prob.shape={tuple(prob.shape)} and thresh.shape="
            f"{tuple(thresh.shape)} do not broadcast"
        ) from None
    ct = _compute_dtype(prob, thresh)
    return torch.sigmoid(k * (prob.to(ct) - thresh.to(ct)))


def db_loss(
    shrink_logits: torch.Tensor,
    thresh: torch.Tensor,
    gt: torch.Tensor,
    mask: torch.Tensor,
    thresh_map: torch.Tensor,
    thresh_mask: torch.Tensor,
    *,
    k: float = 50.0,
    bce_weight: float = 5.0,
    l1_weight: float = 10.0,
    dice_weight: float = 1.0,
    negative_ratio: float = 3.0,
    eps: float = 1e-6,
    return_terms: bool = False,
):
    r"""DBNet's total loss in at least float32, on the shrink-map logits.

    ``bce_weight * balanced_bce(shrink_logits, gt, mask) + l1_weight *
    masked_l1(thresh, thresh_map, thresh_mask) + dice_weight *
    dice(db_step(sigmoid(shrink_logits), thresh, k), gt, mask)`` (5, 10, 1).

    Precision: each term follows its own loss (float64 for float64
    ``shrink_logits`` / ``thresh``), the total their promotion.

    Args:
      shrink_logits, thresh, gt, mask, thresh_map, thresh_mask: same shape.
      k, bce_weight, l1_weight, dice_weight, negative_ratio, eps: see
        ``jaxstable.losses.db_loss`` (the weights: finite numbers >= 0).
      return_terms: also return ``{"bce", "l1", "dice"}``.

    Returns:
      float32 scalar, or ``(total, terms)``.

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> gt = torch.zeros(1, 8, 8); gt[:, 2:6, 2:6] = 1.0
      >>> ones = torch.ones(1, 8, 8)
      >>> total, terms = losses.db_loss(6.0 * (2 * gt - 1), 0.3 * ones, gt, ones,
      ...                               0.3 * ones, ones, return_terms=True)
      >>> print(round(float(total), 4), sorted(terms))
      0.0124 ['bce', 'dice', 'l1']
    """
    shrink_logits, thresh, gt, mask, thresh_map, thresh_mask = _as_tensors(
        shrink_logits=shrink_logits, thresh=thresh, gt=gt, mask=mask,
        thresh_map=thresh_map, thresh_mask=thresh_mask,
    )  # fmt: skip
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
    prob = torch.sigmoid(shrink_logits.to(_compute_dtype(shrink_logits)))
    binary = db_step(prob, thresh, k=k)
    dice = dice_loss(binary, gt, mask, eps=eps)
    total = bce_weight * bce + l1_weight * l1 + dice_weight * dice
    if return_terms:
        return total, {"bce": bce, "l1": l1, "dice": dice}
    return total


# ---------------------------------------------------------------------------
# contrastive
# ---------------------------------------------------------------------------


def info_nce(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 0.07,
    min_temperature: float = 0.01,
    eps: float = 1e-8,
) -> torch.Tensor:
    r"""Symmetric InfoNCE (CLIP) loss with ``F.normalize(eps=eps)``.

    ``S = normalize(a) normalize(b)^T / max(temperature, min_temperature)``;
    ``loss = (CE(S, arange N) + CE(S^T, arange N)) / 2``. At the ties (a row
    of norm exactly ``eps``, a temperature exactly ``min_temperature``)
    ``clamp`` passes the whole gradient, as jaxstable.

    Precision: float32; float64 when ``a`` or ``b`` is float64.

    Args:
      a, b: embeddings (N, D), any float dtype.
      temperature: a finite number > 0, a scalar: a number or a
        (learnable) 0-d tensor, clamped from below. A value <= 0, inf or NaN
        raises, except for a tensor that requires grad: that one is clamped,
        not checked (a check would sync with the device). Any other shape
        raises (a vector would divide each column of the similarities by its
        own temperature).
      min_temperature: a finite number >= 0.
      eps: norm floor, finite and >= 1.2e-38 (float32's smallest normal).

    Returns:
      float32 scalar (float64 for float64 embeddings).

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> a = torch.eye(3).bfloat16()
      >>> print(round(float(losses.info_nce(a, a, temperature=0.1)), 4))
      0.0001
      >>> print(bool(torch.isfinite(losses.info_nce(a * 0, a))))
      True
    """
    # a tensor temperature joins the device check; a number stays a number
    tensor_t = temperature if isinstance(temperature, torch.Tensor) else None
    a, b, _ = _as_tensors(a=a, b=b, temperature=tensor_t)
    _check_float("a", a)
    _check_float("b", b)
    if a.ndim != 2:
        raise ValueError(f"a must have shape (N, D), got a.shape={tuple(a.shape)}")
    _check_same_shape("a", a, "b", b)
    if a.shape[0] == 0:
        raise ValueError("info_nce needs at least one pair, got N=0")
    _check_positive("temperature", temperature, finite=True)
    _check_positive("min_temperature", min_temperature, allow_zero=True, finite=True)
    _check_eps("eps", eps)
    ct = _compute_dtype(a, b)
    an = F.normalize(a.to(ct), dim=1, eps=eps)
    bn = F.normalize(b.to(ct), dim=1, eps=eps)
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(ct).clamp(min=min_temperature)
    else:
        t = max(float(temperature), min_temperature)
    # matmul is on autocast's lower-precision list: inside
    # torch.autocast(bfloat16) `an @ bn.T` would run in bf16 (38.2367 instead
    # of 38.2670 for one similarity x 1/t seen in the contrastive example).
    with torch.autocast(a.device.type, enabled=False):
        sim = an @ bn.T / t
    target = torch.arange(a.shape[0], device=a.device)
    return 0.5 * (F.cross_entropy(sim, target) + F.cross_entropy(sim.T, target))


# ---------------------------------------------------------------------------
# detection: box regression and dense classification
# ---------------------------------------------------------------------------

_BOX_KINDS = ("iou", "giou", "diou", "ciou")


def _check_kind(kind: str) -> None:
    if kind not in _BOX_KINDS:
        raise ValueError(
            f"unknown kind {kind!r}; valid values: {', '.join(_BOX_KINDS)}"
        )


def _check_boxes(name: str, boxes: torch.Tensor) -> None:
    """Floating (..., 4) boxes."""
    _check_float(name, boxes)
    if boxes.ndim == 0 or boxes.shape[-1] != 4:
        raise ValueError(
            f"{name} must have shape (..., 4) as (x1, y1, x2, y2), got shape "
            f"{tuple(boxes.shape)}"
        )


def _raise_inverted(name: str, boxes: torch.Tensor) -> None:
    """ValueError naming the boxes with x2 < x1 or y2 < y1 (reads them on the
    host: one sync)."""
    flat = boxes.detach().reshape(-1, 4).double()
    inverted = (flat[:, 2] < flat[:, 0]) | (flat[:, 3] < flat[:, 1])
    if bool(inverted.any()):  # a NaN is not inverted: it gives a NaN loss
        first = int(inverted.int().argmax())
        index = tuple(
            int(i) for i in torch.unravel_index(torch.tensor(first), boxes.shape[:-1])
        )
        raise ValueError(
            f"{name} must have x1 <= x2 and y1 <= y2 (x1, y1, x2, y2 format); "
            f"{int(inverted.sum())} box(es) do not, the first at index "
            f"{index}: {flat[first].tolist()}"
        )


def _aspect_angle(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """atan(w / h) in [0, pi/2] for w, h >= 0 with a finite gradient: the
    smaller side over the larger, a point box gets 0 (jaxstable's twin)."""
    tall = h >= w
    big = torch.where(tall, h, w)
    small = torch.where(tall, w, h)
    point = big == 0
    angle = torch.atan(small / torch.where(point, torch.ones_like(big), big))
    zero = torch.zeros_like(angle)
    return torch.where(point, zero, torch.where(tall, angle, math.pi / 2 - angle))


def _box_terms(b1, b2, kind: str, eps: float) -> torch.Tensor:
    """Per-box loss from coordinate tuples (compute dtype), torchvision's
    formulas."""
    x1, y1, x2, y2 = b1
    x1g, y1g, x2g, y2g = b2
    iw = torch.minimum(x2, x2g) - torch.maximum(x1, x1g)
    ih = torch.minimum(y2, y2g) - torch.maximum(y1, y1g)
    inter = torch.where((iw > 0) & (ih > 0), iw * ih, torch.zeros_like(iw))
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
    iou = inter / (union + eps)
    if kind == "iou":
        return 1.0 - iou
    cw = torch.maximum(x2, x2g) - torch.minimum(x1, x1g)  # enclosing box
    ch = torch.maximum(y2, y2g) - torch.minimum(y1, y1g)
    if kind == "giou":
        area_c = cw * ch
        return 1.0 - iou + (area_c - union) / (area_c + eps)
    dx = (x2 + x1) / 2 - (x1g + x2g) / 2
    dy = (y2 + y1) / 2 - (y1g + y2g) / 2
    loss = 1.0 - iou + (dx * dx + dy * dy) / (cw * cw + ch * ch + eps)
    if kind == "diou":
        return loss
    delta = _aspect_angle(x2g - x1g, y2g - y1g) - _aspect_angle(x2 - x1, y2 - y1)
    v = (4 / math.pi**2) * delta * delta
    alpha = (v / (1.0 - iou + v + eps)).detach()  # torchvision: under no_grad
    return loss + alpha * v


def _reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    """'none' as is; 'sum'; 'mean' with the mean of an empty tensor 0.0."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / max(loss.numel(), 1)


def box_iou_loss(
    boxes1: torch.Tensor,
    boxes2: torch.Tensor,
    *,
    kind: str = "giou",
    reduction: str = "none",
    eps: float = 1e-7,
) -> torch.Tensor:
    r"""IoU-family box loss in at least float32: torchvision's values, finite gradients.

    ``(..., 4)`` boxes as ``(x1, y1, x2, y2)``; ``kind`` "iou" (``1 - iou``),
    "giou", "diou" or "ciou" give the values of
    ``torchvision.ops.generalized_box_iou_loss``, ``distance_box_iou_loss``
    and ``complete_box_iou_loss`` (formulas: ``jaxstable.losses.box_iou_loss``),
    computed on float32 upcasts (fp16 areas of a 640-pixel image reach 4e5,
    above fp16's 65504); gradients flow back in the boxes' dtype.

    Deviations from torchvision (documented, tested, as jaxstable): CIoU's
    ``atan(w / h)`` is taken as the smaller side over the larger, so a box of
    zero height keeps the value pi/2 with a finite gradient (torchvision:
    NaN), and a point box gets the angle 0 and a finite loss (torchvision:
    NaN). A NaN or infinite coordinate makes that pair's loss and gradient
    NaN. A mean over zero boxes is 0.0 (as torchvision). Kept from torchvision: the GIoU
    gradient of two collinear zero-area boxes is of the order of the
    enclosing width / eps (2e7 for [0, 1, 4, 1] and [1, 1, 3, 1]), inf once
    cast back to fp16 boxes (the skip guard skips the step).

    Bad boxes (``x2 < x1`` or ``y2 < y1``), as jaxstable's concrete-vs-traced
    rule: when neither box tensor requires grad (an eager call on values, as
    a concrete JAX call) it raises ``ValueError`` naming the first such box
    (reads the boxes on the host: one sync); when either requires grad (a
    training step, as JAX's traced boxes under ``jit`` or ``jax.grad``) that
    pair's loss and gradient are NaN instead, with no host sync, so the
    step's finiteness guard skips the step instead of the run crashing.

    Ties have torchvision's gradients (its ``max``/``min``: half each at
    equal coordinates; a touching edge has a zero intersection gradient).

    Precision: float32; float64 when ``boxes1`` or ``boxes2`` is float64.

    Args:
      boxes1: predicted boxes, floating tensor ``(..., 4)``.
      boxes2: target boxes, same shape.
      kind: "iou", "giou", "diou" or "ciou".
      reduction: "none" (shape ``boxes1.shape[:-1]``), "mean" or "sum".
      eps: finite and >= 1.2e-38 (float32's smallest normal number).

    Returns:
      float32 tensor of shape ``boxes1.shape[:-1]``, or a float32 scalar
      (float64 for float64 boxes).

    Example:
      >>> import torch
      >>> from torchref import losses
      >>> pred = torch.tensor([[0.0, 0.0, 2.0, 2.0], [0.0, 0.0, 4.0, 0.0]]).half()
      >>> gt = torch.tensor([[1.0, 1.0, 3.0, 3.0], [1.0, 0.0, 3.0, 2.0]]).half()
      >>> loss = losses.box_iou_loss(pred.requires_grad_(), gt, kind="ciou")
      >>> print(loss.dtype, [round(v, 4) for v in loss.tolist()])
      torch.float32 [0.9683, 1.1]
      >>> loss.sum().backward()
      >>> bool(pred.grad.isfinite().all())  # zero height: torchvision NaN
      True
    """
    _check_kind(kind)
    _check_reduction(reduction)
    _check_eps("eps", eps)
    boxes1, boxes2 = _as_tensors(boxes1=boxes1, boxes2=boxes2)
    _check_boxes("boxes1", boxes1)
    _check_boxes("boxes2", boxes2)
    _check_same_shape("boxes1", boxes1, "boxes2", boxes2)
    if not (boxes1.requires_grad or boxes2.requires_grad):  # values: raise
        _raise_inverted("boxes1", boxes1)
        _raise_inverted("boxes2", boxes2)
    ct = _compute_dtype(boxes1, boxes2)
    b1 = tuple(c.to(ct) for c in boxes1.unbind(-1))
    b2 = tuple(c.to(ct) for c in boxes2.unbind(-1))
    loss = _box_terms(b1, b2, kind, float(eps))
    # In a training step a bad box could not raise: its pair is NaN instead.
    bad = torch.zeros_like(loss, dtype=torch.bool)
    for x1, y1, x2, y2 in (b1, b2):
        finite = x1.isfinite() & y1.isfinite() & x2.isfinite() & y2.isfinite()
        bad = bad | ~finite | (x2 < x1) | (y2 < y1)
    return _reduce(loss * _nan_if(bad, ct), reduction)


def _check_alpha(alpha) -> bool:
    """True when alpha weights the classes: a number in [0, 1]; None or -1
    (torchvision's 'ignore') turn the weighting off; anything else raises."""
    if alpha is None or (_shape_of(alpha) == () and float(alpha) == -1.0):
        return False
    if _shape_of(alpha) != () or not 0.0 <= float(alpha) <= 1.0:
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
    _check_positive("gamma", gamma, allow_zero=True, finite=True)
    logits, targets = _as_tensors(logits=logits, targets=targets)
    _check_float("logits", logits)
    _check_same_shape("logits", logits, "targets", targets)
    _check_unit_interval("targets", targets)
    ct = _compute_dtype(logits)
    x, t = logits.to(ct), targets.to(ct)
    q = torch.sigmoid(x) * (1.0 - t) + torch.sigmoid(-x) * t
    bce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
    loss = bce * torch.where(q > _TINY, q, _TINY) ** gamma
    if weighted:
        loss = (alpha * t + (1.0 - alpha) * (1.0 - t)) * loss
    return _reduce(loss, reduction)
