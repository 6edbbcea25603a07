"""Losses on binary targets, in at least float32: sigmoid BCE, DBNet's
balanced BCE with hard-negative mining, the dice loss and RetinaNet's
sigmoid focal loss.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from _stablecore.losses import check_reduction as _check_reduction
from jaxstable._src.losses._checks import (
    F32,
    TINY,
    Array,
    as_arrays,
    check_eps,
    check_float,
    check_positive,
    check_same_shape,
    compute_dtype,
    is_concrete,
    is_nan,
    nan_if,
    reduce,
)


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
    logits, targets, weights = as_arrays(
        logits=logits, targets=targets, weights=weights
    )
    check_float("logits", logits)
    check_same_shape("logits", logits, "targets", targets)
    ct = compute_dtype(logits)
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
    logits, targets, mask = as_arrays(logits=logits, targets=targets, mask=mask)
    check_float("logits", logits)
    check_same_shape("logits", logits, "targets", targets)
    check_same_shape("logits", logits, "mask", mask)
    check_positive("negative_ratio", negative_ratio, finite=True)
    check_eps("eps", eps)  # > 0: no positives and no negatives is 0 / eps
    ct = compute_dtype(logits)
    in_mask = mask > 0.5
    positive = (targets > 0.5) & in_mask
    negative = ~(targets > 0.5) & in_mask
    loss = _bce_with_logits(logits.astype(ct), positive.astype(ct)).ravel()
    n_pos = jnp.sum(positive, dtype=jnp.int32)
    n_neg = jnp.sum(negative, dtype=jnp.int32)
    ratio_p = n_pos.astype(F32) * jnp.float32(negative_ratio)  # float32 (see above)
    # A ratio_p beyond int32 (ratio 1e30) is never cast: XLA's float->int of
    # an out-of-range value is not defined. The int cast floors (ratio_p >= 0).
    enough = ratio_p >= n_neg.astype(F32)
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
        is_nan(mask) | (is_nan(targets) & in_mask)
    )
    total = (pos_sum + top_k) * nan_if(undefined, ct)
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
    probs, targets, mask = as_arrays(probs=probs, targets=targets, mask=mask)
    check_float("probs", probs)
    check_same_shape("probs", probs, "targets", targets)
    check_eps("eps", eps)
    ct = compute_dtype(probs)
    p, g = probs.astype(ct), targets.astype(ct)
    if mask is None:
        m = jnp.ones((), ct)
    else:
        check_same_shape("probs", probs, "mask", mask)
        m = mask.astype(ct)
    intersection = jnp.sum(p * g * m)
    union = jnp.sum(p * m) + jnp.sum(g * m) + eps
    return 1.0 - 2.0 * intersection / union


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
    if not is_concrete(x):
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
    check_positive("gamma", gamma, allow_zero=True, finite=True)
    logits, targets = as_arrays(logits=logits, targets=targets)
    check_float("logits", logits)
    check_same_shape("logits", logits, "targets", targets)
    _check_unit_interval("targets", targets)
    ct = compute_dtype(logits)
    x, t = logits.astype(ct), targets.astype(ct)
    q = jax.nn.sigmoid(x) * (1.0 - t) + jax.nn.sigmoid(-x) * t
    loss = _bce_with_logits(x, t) * jnp.where(q > TINY, q, TINY) ** gamma
    if weighted:
        loss = (alpha * t + (1.0 - alpha) * (1.0 - t)) * loss
    # a traced target outside [0, 1] could not raise: NaN, not a finite loss
    return reduce(loss * nan_if((t < 0) | (t > 1), ct), reduction)
