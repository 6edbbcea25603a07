"""The OCR task's losses in JAX: the stable `db_loss` and the naive recipe.

* :func:`stable_loss`: `jaxstable.losses.db_loss` on the model's shrink
  logits and threshold map, in float32 (5 x balanced BCE with 3:1 hard
  negative mining + 10 x masked L1 on the threshold map + 1 x dice on
  ``db_step(P, T, k=50)``).
* :func:`naive_loss`: what the DBNet report's team ran, as DBNet's reference
  writes it, in the compute dtype (float16) with no guard: ``P =
  sigmoid(logits)``; the step as ``reciprocal(1 + exp(-k (P - T)))``;
  ``binary_cross_entropy(P, gt)`` (log clamped at -100 as torch's is) with
  OHEM 3:1; masked L1; dice on the binary map. See ``README.md`` for how it
  fails.

Both take the model's output dict and a batch dict with the DBNet maps
(``gt, mask, thresh_map, thresh_mask``, (B, H, W)) and return ``(loss,
terms)`` with float32 scalar terms ``bce, l1, dice``.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jaxstable import losses

__all__ = ["naive_loss", "naive_step", "stable_loss"]


def stable_loss(
    outputs: Mapping[str, jax.Array], batch: Mapping[str, jax.Array], *, k: float = 50.0
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`jaxstable.losses.db_loss` (float32) of a DBNet output on a batch.

    Example:
        >>> gt = jnp.zeros((1, 8, 8)).at[:, 2:6, 2:6].set(1.0)
        >>> ones = jnp.ones((1, 8, 8))
        >>> out = {"logits": 6.0 * (2 * gt - 1), "thresh": 0.3 * ones}
        >>> batch = dict(gt=gt, mask=ones, thresh_map=0.3 * ones, thresh_mask=ones)
        >>> loss, terms = stable_loss(out, batch)
        >>> print(round(float(loss), 4), loss.dtype, sorted(terms))
        0.0124 float32 ['bce', 'dice', 'l1']
    """
    return losses.db_loss(
        outputs["logits"],
        outputs["thresh"],
        batch["gt"],
        batch["mask"],
        batch["thresh_map"],
        batch["thresh_mask"],
        k=k,
        return_terms=True,
    )


def naive_step(prob: jax.Array, thresh: jax.Array, k: float = 50.0) -> jax.Array:
    """DBNet's reference step ``reciprocal(1 + exp(-k (P - T)))`` in the input dtype.

    In float16 ``exp(-k (P - T))`` is inf once ``P - T < -log(65504) / k``
    (-0.2218 at k=50); the value is still right (1 / inf = 0) but the
    backward multiplies the upstream 0 by exp's inf: NaN.

    Example:
        >>> p = jnp.array([0.1, 0.5], jnp.float16)
        >>> t = jnp.array([0.5, 0.3], jnp.float16)
        >>> [round(float(v), 4) for v in naive_step(p, t)]
        [0.0, 1.0]
        >>> g = jax.grad(lambda p: naive_step(p, t).sum())(p)
        >>> bool(jnp.isnan(g[0])), bool(jnp.isfinite(g[1]))
        (True, True)
    """
    return jnp.reciprocal(1 + jnp.exp(-k * (prob - thresh)))


def _ohem_bce(prob, gt, mask, ratio=3.0, eps=1e-6):
    """DBNet's BalanceCrossEntropyLoss on probabilities, in their dtype."""
    dtype = prob.dtype
    positive = (gt * mask).astype(dtype)
    negative = ((1 - gt) * mask).astype(dtype)
    n_pos = positive.sum()
    n_neg = jnp.minimum(negative.sum(), jnp.floor(n_pos * ratio))
    # torch's binary_cross_entropy clamps each log at -100
    log_p = jnp.maximum(jnp.log(prob), -100.0)
    log_1p = jnp.maximum(jnp.log(1 - prob), -100.0)
    loss = -(gt * log_p + (1 - gt) * log_1p).astype(dtype)
    neg_loss = (loss * negative).ravel()
    ranked = -jnp.sort(-neg_loss)  # top-k with a traced k: sort and mask
    top = jnp.where(jnp.arange(ranked.size) < n_neg, ranked, 0).sum()
    return ((loss * positive).sum() + top) / (n_pos + n_neg + jnp.asarray(eps, dtype))


def naive_loss(
    outputs: Mapping[str, jax.Array], batch: Mapping[str, jax.Array], *, k: float = 50.0
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DBNet loss as the report's team computed it: compute dtype, no guard.

    The maps are cast to the dtype of ``outputs["logits"]`` and every sum,
    log and division happens in it.

    Example:
        >>> gt = jnp.zeros((1, 8, 8)).at[:, 2:6, 2:6].set(1.0)
        >>> ones = jnp.ones((1, 8, 8))
        >>> out = {"logits": (6.0 * (2 * gt - 1)).astype(jnp.float16),
        ...        "thresh": (0.3 * ones).astype(jnp.float16)}
        >>> batch = dict(gt=gt, mask=ones, thresh_map=0.3 * ones, thresh_mask=ones)
        >>> loss, terms = naive_loss(out, batch)
        >>> print(round(float(loss), 2), loss.dtype)
        0.01 float16
    """
    dtype = outputs["logits"].dtype
    gt, mask, tmap, tmask = (
        jnp.asarray(batch[key]).astype(dtype)
        for key in ("gt", "mask", "thresh_map", "thresh_mask")
    )
    prob = jax.nn.sigmoid(outputs["logits"])
    thresh = outputs["thresh"].astype(dtype)
    bce = _ohem_bce(prob, gt, mask)
    mask_sum = tmask.sum()
    # DBNet's MaskL1Loss returns the zero mask sum instead of dividing by it;
    # the inner where keeps 0/0 out of the gradient (where's unused branch
    # would still send 0 * inf = NaN back), so this is the reference's value
    # and gradient, not a guard the reference lacks
    has_mask = mask_sum > 0
    l1_sum = (jnp.abs(thresh - tmap) * tmask).sum()
    l1 = jnp.where(has_mask, l1_sum / jnp.where(has_mask, mask_sum, 1), mask_sum)
    binary = naive_step(prob, thresh, k)
    inter = (binary * gt * mask).sum()
    union = (binary * mask).sum() + (gt * mask).sum() + jnp.asarray(1e-6, dtype)
    dice = 1 - 2 * inter / union
    total = (5 * bce + 10 * l1 + dice).astype(dtype)
    terms = {"bce": bce, "l1": l1, "dice": dice}
    return total, {name: v.astype(jnp.float32) for name, v in terms.items()}
