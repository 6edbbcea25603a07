"""The contrastive losses of the JAX runs, with their check points.

* `stable_loss`: the library's float32 `jaxstable.losses.info_nce` (eps-safe
  normalisation, the logit scale clamped at 100 through its temperature floor
  ``min_temperature = 1 / 100``, as CLIP and open_clip clamp it).
* `naive_loss`: what a first attempt writes, all in the compute dtype:
  ``x / ||x||`` without eps, ``exp(logit_scale)`` unclamped, the logits and
  the cross-entropy in bfloat16/float16.

Both return ``(loss, aux)``: ``aux["checks"]`` is a
`jaxstable.diagnostics.CheckPoints` of the points of `probe.CHECKS` (the
loss function's part of the contrastive report's six checks: per point a
finite flag and max |x| over the finite entries), computed inside the
jitted step: nothing is read on the host until `fit` logs the step, as the
record's ``checks[...]``, ``non_finite_checks`` and
``first_non_finite_check`` keys. ``aux["logit_scale"]`` is the scale the
logits used.

Example:
    >>> import jax.numpy as jnp
    >>> img = jnp.eye(4, 8); txt = jnp.eye(4, 8).at[3].set(jnp.nan)
    >>> loss, aux = naive_loss(img, txt, jnp.asarray(2.0), jnp.zeros((4, 2)))
    >>> aux["checks"].non_finite()
    ['text_emb', 'logits', 'loss']
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxstable import diagnostics, losses

MAX_LOGIT_SCALE = 100.0  # CLIP's clamp of exp(logit_scale)


def _checks(image, img, txt, logits, loss) -> diagnostics.CheckPoints:
    # the points of probe.CHECKS, in the order the step computes them
    return diagnostics.check_points(
        inputs=image, image_emb=img, text_emb=txt, logits=logits, loss=loss
    )


def _normalize_no_eps(x):
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))


def naive_loss(img, txt, log_scale, image):
    """Symmetric InfoNCE as a first attempt writes it, in the inputs' dtype.

    ``S = exp(log_scale) * (img / ||img||) (txt / ||txt||)^T``, then
    ``(CE(S, arange N) + CE(S^T, arange N)) / 2`` with a log-softmax in the
    same dtype; no eps, no clamp, no float32.
    """
    scale = jnp.exp(log_scale)
    logits = scale * (_normalize_no_eps(img) @ _normalize_no_eps(txt).T)
    labels = jnp.arange(logits.shape[0])

    def ce(s):
        logp = jax.nn.log_softmax(s, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))

    loss = 0.5 * (ce(logits) + ce(logits.T))
    checks = _checks(image, img, txt, logits, loss)
    return loss, {"checks": checks, "logit_scale": scale.astype(jnp.float32)}


def _normalize(x, eps):
    # the row normalisation info_nce does (max(||x||, eps)), for the logits check
    x = x.astype(jnp.float32)
    return x / jnp.sqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), eps * eps))


def stable_loss(img, txt, log_scale, image, *, eps: float = 1e-8, checks=True):
    """`jaxstable.losses.info_nce` in float32, the logit scale clamped at 100.

    The temperature ``exp(-log_scale)`` is floored at ``1 / 100`` by
    info_nce's ``min_temperature`` (zero gradient past the clamp, as CLIP's
    ``clamp``). The check point ``logits`` recomputes the float32
    similarities the loss uses (a (B, B) matrix: small next to the towers).
    ``checks=False``: no check points, ``aux`` holds only the logit scale
    (what `benchmarks/bench_checks.py` compares against).

    Example:
        >>> x = jnp.eye(3, 8, dtype=jnp.bfloat16)
        >>> loss, aux = stable_loss(x, x, jnp.asarray(9.0), jnp.zeros((3, 2)))
        >>> round(float(loss), 4), float(aux["logit_scale"])
        (0.0, 100.0)
    """
    floor = 1.0 / MAX_LOGIT_SCALE
    temperature = jnp.exp(-log_scale.astype(jnp.float32))
    loss = losses.info_nce(
        img, txt, temperature=temperature, min_temperature=floor, eps=eps
    )
    scale = 1.0 / jnp.maximum(temperature, floor)
    if not checks:
        return loss, {"logit_scale": scale}
    logits = scale * (_normalize(img, eps) @ _normalize(txt, eps).T)
    return loss, {
        "checks": _checks(image, img, txt, logits, loss),
        "logit_scale": scale,
    }
