"""Adam(W) for the JAX runs with the bias corrections `torch.optim.Adam` uses.

Why: ``optax.adam`` computes its bias corrections ``1 - b**t`` on the device
in float32, with ``b`` rounded to float32 first (0.999 becomes
0.99900001287): ``1 - b2**t`` comes out 1.3e-5 (t = 1) to 2.0e-5 (t = 100)
too small, so every JAX update is about 1e-5 smaller than torch's, which
computes ``1 - b**t`` in Python float64. That is a hundred times float32's
rounding (1e-7), in the same direction at every step, and this task's
training amplifies it: the float32 JAX and torch losses parted from step 21
(3e-5, then 1.05e-2 by step 48), with optax.adam. With these corrections
they agree to 1.8e-7 over 100 steps at the default sizes; Adam eps 1e-6
(`config.py`) keeps them so at other sizes (`examples/contrastive/README.md`,
`agreement_probe.py`).

Here ``1 - b**t = -expm1(t * log(b))``, with ``log(b)`` taken on the host in
float64: about 1e-7 from the exact value in float32. The state is optax's
`optax.ScaleByAdamState`, so whatever reads Adam's state (the naive run's
report, `jaxstable.diagnostics.locate`) reads this one too.

Example:
    >>> import jax.numpy as jnp, optax
    >>> g = jnp.array([0.5, -2.0])
    >>> tx = adam(1e-3)
    >>> u, state = tx.update(g, tx.init(g))
    >>> [round(x, 9) for x in u.tolist()], type(state[0]).__name__
    ([-0.001, 0.001], 'ScaleByAdamState')
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

__all__ = ["adam", "bias_correction", "scale_by_adam"]


def bias_correction(decay: float, count: jax.Array) -> jax.Array:
    """``1 - decay**count`` in float32, accurate to about 1e-7 (relative).

    Example:
        >>> exact = 1 - 0.999**100  # float64: 0.0952078529
        >>> got = float(bias_correction(0.999, jnp.asarray(100)))
        >>> optax_way = float(1 - jnp.float32(0.999) ** 100)  # optax's float32
        >>> f"{abs(got / exact - 1):.0e} vs {abs(optax_way / exact - 1):.0e}"
        '1e-07 vs 2e-05'
    """
    if not 0 < decay < 1:
        raise ValueError(f"decay must be in (0, 1), got {decay!r}")
    log_decay = math.log(decay)  # host float64: no float32 rounding of decay
    return -jnp.expm1(jnp.asarray(count, jnp.float32) * log_decay)


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> optax.GradientTransformation:
    """Adam's ``m_hat / (sqrt(v_hat) + eps)`` with `bias_correction`.

    The moments are updated as in optax and torch
    (``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``).

    Example:
        >>> tx = scale_by_adam()
        >>> u, _ = tx.update(jnp.array([3.0]), tx.init(jnp.zeros(1)))
        >>> round(float(u[0]), 6)
        1.0
    """
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0 <= value < 1:
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32), mu=zeros, nu=jax.tree.map(jnp.copy, zeros)
        )

    def update(grads, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
        count = optax.safe_int32_increment(state.count)
        c1 = bias_correction(b1, count) if b1 > 0 else 1.0
        c2 = bias_correction(b2, count) if b2 > 0 else 1.0
        updates = jax.tree.map(
            lambda m, v: ((m / c1) / (jnp.sqrt(v / c2) + eps)).astype(m.dtype), mu, nu
        )
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def adam(
    learning_rate: float,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """``torch.optim.Adam`` (``weight_decay=0``) or ``AdamW`` (decoupled decay).

    ``update = -lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * param)``,
    as ``optax.adam`` / ``optax.adamw`` but with `bias_correction`.

    Example:
        >>> tx = adam(0.1, weight_decay=0.5)
        >>> p = jnp.array([2.0])
        >>> u, _ = tx.update(jnp.array([1.0]), tx.init(p), p)
        >>> round(float(u[0]), 6)  # -0.1 * (1 + 0.5 * 2)
        -0.2
    """
    parts = [scale_by_adam(b1, b2, eps)]
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)


def for_config(config) -> optax.GradientTransformation | None:
    """The optimizer of a run (`JaxParts.optimizer`): `adam` for ``"adam"`` and
    ``"adamw"`` with the config's settings, None for ``"sgd"`` (the harness's
    own, which has no bias correction).

    Example:
        >>> from examples.contrastive.config import Config
        >>> for_config(Config(optimizer="sgd")) is None
        True
    """
    if config.optimizer == "sgd":
        return None
    decay = config.weight_decay if config.optimizer == "adamw" else 0.0
    return adam(
        config.learning_rate,
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=decay,
    )
