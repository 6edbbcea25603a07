"""DBNet's differentiable binarisation and its total loss (balanced BCE +
masked L1 + dice), in at least float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxstable._src.losses._checks import (
    Array,
    as_arrays,
    check_eps,
    check_float,
    check_positive,
    compute_dtype,
)
from jaxstable._src.losses.binary import balanced_binary_cross_entropy, dice_loss
from jaxstable._src.losses.regression import masked_l1_loss


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
    prob, thresh = as_arrays(prob=prob, thresh=thresh)
    check_float("prob", prob)
    check_positive("k", k, finite=True)
    try:
        jnp.broadcast_shapes(prob.shape, thresh.shape)
    except ValueError:
        raise ValueError(
            f"prob.shape={prob.shape} and thresh.shape={thresh.shape} do not broadcast"
        ) from None
    ct = compute_dtype(prob, thresh)
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
    check_positive("k", k, finite=True)
    check_eps("eps", eps)
    for name, weight in (("bce_weight", bce_weight), ("l1_weight", l1_weight),
                         ("dice_weight", dice_weight)):  # fmt: skip
        check_positive(name, weight, allow_zero=True, finite=True)
    bce = balanced_binary_cross_entropy(
        shrink_logits, gt, mask, negative_ratio=negative_ratio, eps=eps
    )
    l1 = masked_l1_loss(thresh, thresh_map, thresh_mask)
    (shrink_logits,) = as_arrays(shrink_logits=shrink_logits)
    prob = jax.nn.sigmoid(shrink_logits.astype(compute_dtype(shrink_logits)))
    binary = db_step(prob, thresh, k=k)
    dice = dice_loss(binary, gt, mask, eps=eps)
    total = bce_weight * bce + l1_weight * l1 + dice_weight * dice
    if return_terms:
        return total, {"bce": bce, "l1": l1, "dice": dice}
    return total
