"""The segmentation losses of the JAX runs, on the U-Net's NHWC logits.

* `stable_loss`: the library's float32 `jaxstable.losses.softmax_cross_entropy`
  with ``ignore_index=255``.
* `naive_loss`: what users ran before the fix:
  ``optax.softmax_cross_entropy_with_integer_labels`` on the low-precision
  logits with a masked mean for label 255 in that dtype.

Example:
    >>> import jax.numpy as jnp
    >>> logits = jnp.zeros((1, 2, 2, 3), jnp.float16)
    >>> labels = jnp.array([[[0, 1], [2, 255]]])
    >>> stable_loss(logits, labels).dtype, naive_loss(logits, labels).dtype
    (dtype('float32'), dtype('float16'))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from examples.segmentation.data import IGNORE_INDEX
from jaxstable import losses


def stable_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Float32 cross-entropy over the pixels not labelled 255."""
    return losses.softmax_cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)


def naive_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """optax's cross-entropy in the logits' dtype, masked mean in that dtype."""
    valid = labels != IGNORE_INDEX
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.where(valid, labels, 0)
    )
    mask = valid.astype(ce.dtype)  # the masked mean in the compute dtype
    return jnp.sum(ce * mask) / jnp.sum(mask)
