"""The language-model losses of the JAX runs, with their check points.

* `stable_loss`: the library's float32 `jaxstable.losses.softmax_cross_entropy`
  (it reads bf16 logits as they are and reduces in float32) with, when
  ``z_loss > 0``, its own z-loss term (PaLM's ``z_loss * mean(log^2 Z)``).
* `naive_loss`: what a first attempt writes: ``logsumexp - logit[target]``
  on the logits upcast to float32, no z-loss. The same arithmetic as the
  stable loss: the naive run's failure is in the attention, not here.

Both return ``(loss, aux)``: ``aux`` holds the check points of the task
(`probe.CHECKS`), computed inside the jitted step (`fit` logs them in every
record as ``aux[...]`` keys): the train cross-entropy, the mean and the max
|.| of log Z over the batch's positions, and, from the model's ``stats``, the
max attention logit and the lowest head's attention entropy over the layers.

Example:
    >>> import jax.numpy as jnp
    >>> logits = jnp.zeros((1, 2, 256), jnp.bfloat16)
    >>> stats = jnp.array([[0.5, 3.0], [4.0, 2.0]])
    >>> loss, aux = naive_loss(logits, jnp.array([[1, 2]]), stats)
    >>> round(float(loss), 4)
    5.5452
    >>> float(aux["attn_logit_max"]), float(aux["attn_entropy_min"])
    (3.0, 2.0)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxstable import losses


def _aux(lse, ce, stats) -> dict[str, jax.Array]:
    # the order of probe.CHECKS
    return {
        "ce": ce,
        "log_z": jnp.mean(lse),
        "log_z_abs_max": jnp.max(jnp.abs(lse)),
        "attn_logit_max": jnp.max(stats[0]),
        "attn_entropy_min": jnp.min(stats[1]),
    }


def _log_z(logits):
    return jax.lax.stop_gradient(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))


def naive_loss(logits, targets, stats):
    """Mean next-byte cross-entropy, written by hand on float32 logits.

    Args:
      logits: [B, T, 256] in the compute dtype.
      targets: int [B, T].
      stats: the model's [2, n_layers] attention statistics.

    Returns:
      ``(loss, aux)``, float32.
    """
    lf = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(lf, axis=-1)
    ce = jnp.mean(lse - jnp.take_along_axis(lf, targets[..., None], axis=-1)[..., 0])
    return ce, _aux(jax.lax.stop_gradient(lse), ce, stats)


def stable_loss(logits, targets, stats, z_loss: float = 0.0):
    """`losses.softmax_cross_entropy` (float32) with its ``z_loss`` term.

    Example:
        >>> logits = jnp.zeros((1, 2, 256), jnp.bfloat16)
        >>> stats = jnp.ones((2, 1))
        >>> loss, aux = stable_loss(logits, jnp.array([[1, 2]]), stats, 1e-4)
        >>> round(float(loss), 4), round(float(aux["ce"]), 4)
        (5.5483, 5.5452)
    """
    loss = losses.softmax_cross_entropy(logits, targets, z_loss=z_loss)
    lse = _log_z(logits)
    # the check point's ce: the loss without the library's z-loss term
    ce = loss - z_loss * jnp.mean(lse**2) if z_loss else loss
    return loss, _aux(lse, ce, stats)


def nll_sum(logits, targets):
    """Summed ``-log p(target)`` in float32 (the held-out metric's numerator).

    Example:
        >>> round(float(nll_sum(jnp.zeros((1, 2, 256)), jnp.array([[1, 2]]))), 4)
        11.0904
    """
    lf = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(lf, axis=-1)
    return jnp.sum(lse - jnp.take_along_axis(lf, targets[..., None], axis=-1)[..., 0])
