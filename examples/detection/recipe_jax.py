"""The YOLO recipe as an optax transformation (the twin of `recipe_torch`).

``yolo_optimizer`` = ``multi_transform`` over the three parameter groups of
`examples.detection.recipe`, each group an ``inject_hyperparams``-wrapped SGD
whose learning rate and momentum follow `Recipe.hyperparameters` step by
step (a float32 table read at the group's count). Per group::

    g <- g + weight_decay * p            (decay group only, torch's SGD order)
    buf <- momentum * buf + g            (optax.trace; torch: buf = g at step 1)
    p <- p - lr * (g + momentum * buf)   (Nesterov)

which is ``torch.optim.SGD(nesterov=True)`` exactly. The guards go around
it, torch's order (clip the raw gradients, then step; skip non-finite)::

    tx = transforms.stable_optimizer(yolo_optimizer(steps), max_grad_norm=10.0)

A skipped step keeps the whole inner state, counts included, so the schedule
does not advance on it (the torch loop skips ``scheduler.step()`` likewise).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from examples.detection.recipe import GROUPS, Recipe, ema_decays


def param_group(path: tuple, leaf: Any = None) -> str:
    """Ultralytics' group of one parameter from its pytree path.

    A leaf named ``bias`` -> "bias" (batch norm's bias included, as
    Ultralytics tests the name first); ``scale`` (flax's name for a
    normalisation weight: BatchNorm, LayerNorm, GroupNorm) -> "no_decay";
    anything else (``kernel``, ``embedding``) -> "decay". NNX state paths end
    in the variable's name, a ``.value`` key after it is skipped.

    Example:
      >>> from jax.tree_util import DictKey
      >>> names = ("bias", "scale", "kernel")
      >>> [param_group((DictKey("bn"), DictKey(n))) for n in names]
      ['bias', 'no_decay', 'decay']
    """
    del leaf
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    names = [n for n in names if n not in ("value", "raw_value")]
    name = names[-1] if names else ""
    if name == "bias":
        return "bias"
    return "no_decay" if name == "scale" else "decay"


def param_labels(params: Any) -> Any:
    """The `param_group` label of every leaf of `params` (same structure).

    Example:
      >>> import jax.numpy as jnp
      >>> param_labels({"fc": {"kernel": jnp.ones(2), "bias": jnp.ones(1)}})
      {'fc': {'bias': 'bias', 'kernel': 'decay'}}
    """
    return jax.tree_util.tree_map_with_path(param_group, params)


def _sgd_group(learning_rate, momentum, weight_decay):
    """torch's SGD(nesterov=True, weight_decay) as an optax chain."""
    return optax.chain(
        optax.add_decayed_weights(weight_decay),
        optax.trace(decay=momentum, nesterov=True),
        optax.scale_by_learning_rate(learning_rate),
    )


def yolo_optimizer(
    steps: int,
    *,
    labels: Callable[[Any], Any] | Any = param_labels,
    **settings: Any,
) -> optax.GradientTransformation:
    """SGD with Nesterov momentum, three groups, warmup and decay (YOLO).

    Args:
      steps: optimizer steps of the run (`Recipe.steps`).
      labels: a pytree of group names ("bias", "decay", "no_decay") matching
        the params, or a function params -> that pytree (default:
        `param_labels`, by leaf name).
      **settings: the other `Recipe` fields (``warmup_steps``, ``lr``,
        ``final_lr_fraction``, ``momentum``, ``warmup_momentum``,
        ``warmup_bias_lr``, ``weight_decay``, ``decay``), Ultralytics'
        defaults when left out.

    Returns:
      An ``optax.GradientTransformation``; wrap it in
      ``jaxstable.transforms.stable_optimizer(..., max_grad_norm=10.0)``
      for the recipe's clip and skip. Each group's state holds its current
      ``hyperparams`` (``learning_rate``, ``momentum``): `group_hyperparams`
      reads them.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> params = {"fc": {"kernel": jnp.ones(2), "bias": jnp.zeros(1)}}
      >>> tx = yolo_optimizer(300, warmup_steps=100)
      >>> state = tx.init(params)
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> updates, state = tx.update(grads, state, params)
      >>> # step 0: bias LR 0.1, Nesterov g + 0.8 buf; the others' LR is 0
      >>> [round(v, 4) for v in updates["fc"]["bias"].tolist()]
      [-0.18]
      >>> updates["fc"]["kernel"].tolist()
      [-0.0, -0.0]
    """
    recipe = Recipe(steps=steps, **settings)
    table = recipe.table()  # float32, the numbers torch steps with too

    def column(j):
        values = jnp.asarray(table[:, j])
        return lambda count: values[jnp.minimum(count, recipe.steps)]

    momentum = column(3)
    groups = {
        name: optax.inject_hyperparams(_sgd_group)(
            learning_rate=column(j),
            momentum=momentum,
            weight_decay=recipe.weight_decay if name == "decay" else 0.0,
        )
        for j, name in enumerate(GROUPS)
    }
    return optax.multi_transform(groups, labels)


def group_hyperparams(opt_state: Any) -> dict[str, dict[str, float]]:
    """``{group: {"learning_rate", "momentum", "weight_decay"}}`` of the
    latest step the state took (``inject_hyperparams`` stores the values it
    used; before any step: step 0's), found anywhere inside `opt_state` (e.g.
    under `stable_optimizer`'s skip and clip states).

    Example:
      >>> import jax.numpy as jnp
      >>> tx = yolo_optimizer(300, warmup_steps=100)
      >>> hp = group_hyperparams(tx.init({"b": {"bias": jnp.zeros(1)}}))
      >>> round(hp["bias"]["learning_rate"], 3), round(hp["decay"]["momentum"], 3)
      (0.1, 0.8)
    """
    found = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, optax.MultiTransformState)
    )
    multi = next(x for x in found if isinstance(x, optax.MultiTransformState))
    out = {}
    for name, masked in multi.inner_states.items():
        hp = masked.inner_state.hyperparams
        out[name] = {k: float(v) for k, v in hp.items()}
    return out


class EmaState(NamedTuple):
    """`with_ema`'s state: the inner optimizer's, the update count, the EMA."""

    inner: Any
    count: jax.Array
    ema: Any


def with_ema(
    tx: optax.GradientTransformation, steps: int, *, decay: float, tau: float
) -> optax.GradientTransformation:
    """`tx` that also keeps Ultralytics' weight EMA in its state (`ema_weights`).

    After each update the EMA moves towards the new params (``params +
    updates``) by ``1 - d(count)`` (`recipe.ema_decays`); the updates are
    `tx`'s, unchanged. Under ``stable_optimizer`` a skipped step keeps the
    whole state, so the EMA and its count skip it too (the torch twin,
    `recipe_torch.WeightEma`, is updated after applied steps only).

    Example:
      >>> import jax.numpy as jnp
      >>> tx = with_ema(optax.sgd(1.0), 10, decay=0.5, tau=1e-9)
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": -jnp.ones(2)}, state, params)
      >>> ema_weights(state)["w"].tolist()  # 0.5 * 0 + 0.5 * (0 + 1)
      [0.5, 0.5]
    """
    table = jnp.asarray(ema_decays(steps, decay, tau))

    def init(params):
        ema = jax.tree.map(jnp.asarray, params)
        return EmaState(tx.init(params), jnp.zeros([], jnp.int32), ema)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("with_ema needs params: call tx.update(g, state, params)")
        updates, inner = tx.update(updates, state.inner, params)
        count = optax.safe_int32_increment(state.count)
        d = table[jnp.minimum(count, steps)]
        new = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: d * e + (1 - d) * p, state.ema, new)
        return updates, EmaState(inner, count, ema)

    return optax.GradientTransformation(init, update)


def ema_weights(opt_state: Any) -> Any:
    """The weight EMA held anywhere inside `opt_state` (see `with_ema`).

    Example:
      >>> import jax.numpy as jnp
      >>> tx = with_ema(optax.sgd(0.1), 5, decay=0.9, tau=2.0)
      >>> ema_weights((tx.init({"w": jnp.ones(1)}),))["w"].tolist()
      [1.0]
    """
    found = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, EmaState)
    )
    return next(x for x in found if isinstance(x, EmaState)).ema
