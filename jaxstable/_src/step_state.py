"""The train state and what a skipped step keeps of it.

`TrainState` (the pytree a step reads and writes) and `nnx_loss` (a Flax NNX
model's loss over that state); on a skipped step the model state's
statistics are kept and its random-number streams advance
(`keep_model_state`), and the hyperparameters of an `optax.inject_hyperparams`
around the skip are kept unless finite (`keep_hyperparams`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxstable._src.guard import check_optimizer
from jaxstable._src.guard_state import INJECT_STATES, SkipSpikesState
from jaxstable._src.loss_scale import NoOpLossScale
from jaxstable._src.loss_scale_math import all_finite

__all__ = ["TrainState", "nnx_loss"]


@flax.struct.dataclass
class TrainState:
    """Everything a guarded train step reads and writes (a pytree).

    Attributes:
      step: int32, number of train steps taken (skipped ones included).
      params: the trainable parameters (float32 under a mixed policy).
      opt_state: the optimizer state of ``tx``.
      loss_scale: a `jaxstable.loss_scale` (or jmp) loss scale.
      model_state: non-trainable collections (e.g. ``{"batch_stats": ...}``),
        None if the model has none. Kept unchanged on a non-finite step.
      skipped_total: int32, number of steps whose gradients were non-finite
        (their update was not applied).
      tx: the optax transformation (static, not a pytree leaf).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import loss_scale, train, transforms
      >>> tx = transforms.stable_optimizer(optax.sgd(0.1), max_grad_norm=1.0)
      >>> state = train.TrainState.create(
      ...     params={"w": jnp.ones(3)}, optimizer=tx,
      ...     loss_scale=loss_scale.DynamicLossScale())
      >>> int(state.step), int(state.skipped_total), float(state.loss_scale.loss_scale)
      (0, 0, 65536.0)
    """

    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: Any
    model_state: Any
    skipped_total: jax.Array
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)

    @classmethod
    def create(
        cls,
        *,
        params: Any,
        optimizer: optax.GradientTransformation,
        loss_scale: Any = None,
        model_state: Any = None,
    ) -> TrainState:
        """Builds the initial state: ``opt_state = optimizer.init(params)``.

        Args:
          params: the parameter pytree.
          optimizer: an optax transformation, typically
            `jaxstable.transforms.stable_optimizer(...)`.
          loss_scale: a loss scale; None means `NoOpLossScale()`.
          model_state: non-trainable collections or None.

        Returns:
          A `TrainState` with ``step = skipped_total = 0``.

        Example:
          >>> import jax.numpy as jnp, optax
          >>> from jaxstable import train
          >>> tx = optax.sgd(0.1)
          >>> s = train.TrainState.create(params={"w": jnp.zeros(2)}, optimizer=tx)
          >>> int(s.step), type(s.loss_scale).__name__
          (0, 'NoOpLossScale')
        """
        check_optimizer(optimizer, "TrainState.create")
        return cls(
            step=jnp.zeros([], jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            loss_scale=NoOpLossScale() if loss_scale is None else loss_scale,
            model_state=model_state,
            skipped_total=jnp.zeros([], jnp.int32),
            tx=optimizer,
        )

    @classmethod
    def from_nnx(
        cls,
        model: Any,
        optimizer: optax.GradientTransformation,
        *,
        loss_scale: Any = None,
        wrt: Any = None,
    ) -> TrainState:
        """The state of a Flax NNX model: its ``wrt`` variables as params,
        everything else (batch statistics, ``nnx.Rngs`` streams) as
        ``model_state``.

        ``params, model_state = nnx.split(model, wrt, ...)[1:]``; pair it with
        ``make_train_step(nnx_loss(model, loss), has_state=True)``. Write the
        trained values back with ``nnx.update(model, state.params,
        state.model_state)``.

        Args:
          model: an `nnx.Module`.
          optimizer: an optax transformation (e.g. `stable_optimizer(...)`).
          loss_scale: a loss scale; None means `NoOpLossScale()`.
          wrt: the trainable variables, an NNX filter (default `nnx.Param`);
            give `nnx_loss` the same.

        Returns:
          A `TrainState` whose ``params`` and ``model_state`` are `nnx.State`.

        Example:
          >>> import optax
          >>> from flax import nnx
          >>> from jaxstable import train
          >>> model = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
          >>> state = train.TrainState.from_nnx(model, optax.sgd(0.1))
          >>> sorted(state.params), sorted(state.model_state)
          (['bias', 'scale'], ['mean', 'var'])
        """
        from flax import nnx

        _check_nnx_module(model, "TrainState.from_nnx")
        _, params, model_state = nnx.split(
            model, nnx.Param if wrt is None else wrt, ...
        )
        return cls.create(
            params=params,
            optimizer=optimizer,
            loss_scale=loss_scale,
            model_state=model_state,
        )


def _check_nnx_module(model: Any, where: str) -> None:
    from flax import nnx

    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"{where} needs a flax.nnx.Module, got {type(model).__name__} (for "
            "a linen model or a params pytree use TrainState.create)"
        )


def nnx_loss(model: Any, loss: Callable, *, wrt: Any = None) -> Callable:
    """A ``make_train_step(..., has_state=True)`` loss for a Flax NNX model.

    ``loss(model, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``) is
    written as for eager NNX code; this returns ``loss_fn(params,
    model_state, batch) -> (out, new_model_state)`` that rebuilds the model
    from the traced state (fresh variables inside the traced function, so
    batch norm and dropout can update their state under `jax.grad`: merging
    the outer variables raises "Cannot mutate BatchStat from a different
    trace level"), calls ``loss`` and returns the updated batch statistics
    and RNG streams. On a skipped step the train step keeps the statistics
    and advances the RNG streams (see `make_train_step`).

    The model's mode is the one it has now: call ``model.train()`` before
    (``model.eval()`` for an evaluation loss).

    Args:
      model: the `nnx.Module` (its graph structure and mode are captured).
      loss: ``loss(model, batch)``.
      wrt: the trainable variables (default `nnx.Param`), as given to
        `TrainState.from_nnx`.

    Returns:
      ``loss_fn(params, model_state, batch)``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> from jaxstable import train, transforms
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.fc = nnx.Linear(3, 2, rngs=rngs)
      ...         self.bn = nnx.BatchNorm(2, rngs=rngs)
      ...         self.drop = nnx.Dropout(0.5, rngs=rngs)
      ...     def __call__(self, x):
      ...         return self.drop(self.bn(self.fc(x)))
      >>> model = Net(nnx.Rngs(0))
      >>> state = train.TrainState.from_nnx(model, transforms.stable_optimizer(
      ...     optax.adam(1e-2)))
      >>> step = train.make_train_step(
      ...     train.nnx_loss(model, lambda m, b: jnp.mean(m(b) ** 2)), has_state=True)
      >>> state, m = step(state, jnp.ones((4, 3)))
      >>> bool(m["finite"]), int(state.model_state["drop"]["rngs"]["count"][...])
      (True, 1)
      >>> nnx.update(model, state.params, state.model_state)  # back into the model
    """
    from flax import nnx

    _check_nnx_module(model, "nnx_loss")
    if not callable(loss):
        raise TypeError("loss must be callable as loss(model, batch)")
    graphdef = nnx.graphdef(model)
    wrt = nnx.Param if wrt is None else wrt

    def loss_fn(params, model_state, batch):
        # copy=True: fresh Variables at this trace level, which the forward
        # may then update (batch statistics, RNG counts).
        m = nnx.merge(graphdef, params, model_state, copy=True)
        out = loss(m, batch)
        return out, nnx.split(m, wrt, ...)[2]

    return loss_fn


def _select(pred: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), new, old)


def _is_rng(x: Any) -> bool:
    """A random-number stream of a model state: a typed PRNG key array
    (`jax.random.key`) or an NNX `RngState` variable (``nnx.Rngs`` keys and
    counts). A raw uint32 key (`jax.random.PRNGKey`) cannot be told from
    other integers and is treated as any other leaf."""
    nnx = sys.modules.get("flax.nnx")  # loaded whenever the state holds NNX types
    if nnx is not None and isinstance(x, nnx.RngState):
        return True
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def keep_model_state(keep: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``keep``, else ``old`` — but random-number streams are
    always advanced (``new``), as torch's generator is by a skipped step: a
    NaN that depends on a dropout mask is then skipped once, not on every
    later step with the same mask. Statistics (batch norm) stay ``old``."""
    try:
        same = jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(old)
    except TypeError:  # pragma: no cover - structures that cannot compare
        same = False
    if not same:
        raise ValueError(
            "loss_fn returned a model state whose structure differs from the "
            "state it was given (it must return the same collections, e.g. "
            f"the whole state, not a part):\n  given:    "
            f"{jax.tree_util.tree_structure(old)}\n  returned: "
            f"{jax.tree_util.tree_structure(new)}"
        )

    def pick(n: Any, o: Any) -> Any:
        if _is_rng(n):
            return n
        return jax.tree_util.tree_map(lambda a, b: jnp.where(keep, a, b), n, o)

    return jax.tree_util.tree_map(pick, new, old, is_leaf=_is_rng)


def keep_hyperparams(applied: jax.Array, new: Any, old: Any) -> Any:
    """``new`` with the hyperparameters of an `optax.inject_hyperparams`
    around the skip (outermost, or inside an outermost `skip_spikes`) taken
    from ``old`` unless the step was applied and they are finite.

    Its count advances on a skipped step (a torch scheduler stepped every
    iteration does), but hyperparameters of a skipped step (a schedule that
    gave NaN) are not kept in the state nor checkpointed. Inside
    ``skip_spikes(inject_hyperparams(...))`` they were: the NaN stayed in
    the optimizer state.
    """
    if isinstance(new, SkipSpikesState):
        inner = keep_hyperparams(applied, new.inner_state, old.inner_state)
        return new._replace(inner_state=inner)
    if isinstance(new, INJECT_STATES):
        hyper = new.hyperparams
        keep = jnp.logical_and(applied, all_finite(hyper))
        return new._replace(hyperparams=_select(keep, hyper, old.hyperparams))
    return new
