"""A guarded train step (loss scale, clip, skip) and a minimal fit loop.

The step does, in this order (torch.amp's order):
scaled loss -> grad -> unscale -> ONE all-finite reduction -> clip ->
optimizer update unless non-finite -> loss-scale adjust.
It is pure and jitted, contains no `lax.cond` and moves nothing to the host.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import serialization

from jaxstable._src.diagnostics import format_report, non_finite_report
from jaxstable._src.loss_scale import NoOpLossScale, scaled_value_and_grad
from jaxstable._src.precision import get_policy
from jaxstable._src.transforms import find_skip_state, global_norm

__all__ = [
    "NAN_POLICIES",
    "NonFiniteError",
    "TrainState",
    "TrainStep",
    "fit",
    "load_checkpoint",
    "make_train_step",
    "save_checkpoint",
]

NAN_POLICIES = ("skip", "stop")


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
        return cls(
            step=jnp.zeros([], jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            loss_scale=NoOpLossScale() if loss_scale is None else loss_scale,
            model_state=model_state,
            skipped_total=jnp.zeros([], jnp.int32),
            tx=optimizer,
        )


def _select(pred: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), new, old)


class TrainStep:
    """What `make_train_step` returns: ``step(state, batch) -> (state, metrics)``.

    Attributes:
      raw: the pure, un-jitted step function.
      grads: ``grads(state, batch) -> unscaled gradients`` (jitted), used by
        `fit` to report which gradient leaves went non-finite.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import train
      >>> step = train.make_train_step(lambda p, b: jnp.sum((p["w"] * b) ** 2))
      >>> state = train.TrainState.create(params={"w": jnp.ones(2)},
      ...                                 optimizer=optax.sgd(0.1))
      >>> state, metrics = step(state, jnp.array([1.0, jnp.nan]))
      >>> bool(metrics["finite"]), int(metrics["skipped_total"])
      (False, 1)
      >>> state.params["w"].tolist()  # the NaN step was not applied
      [1.0, 1.0]
    """

    def __init__(self, raw: Callable, grads: Callable, jit: bool, donate: bool):
        self.raw = raw
        self.grads = jax.jit(grads) if jit else grads
        self._fn = jax.jit(raw, donate_argnums=(0,) if donate else ()) if jit else raw

    def __call__(
        self, state: TrainState, batch: Any
    ) -> tuple[TrainState, dict[str, Any]]:
        return self._fn(state, batch)

    def lower(self, state: TrainState, batch: Any):
        """`jax.jit(...).lower(state, batch)` of the step (for HLO inspection)."""
        return self._fn.lower(state, batch)


def make_train_step(
    loss_fn: Callable,
    *,
    has_aux: bool = False,
    has_state: bool = False,
    policy: Any = None,
    jit: bool = True,
    donate: bool = False,
) -> TrainStep:
    """Builds the guarded train step ``step(state, batch) -> (state, metrics)``.

    Per step, with ``ls = state.loss_scale``::

        value, grads, finite = scaled_value_and_grad(loss)(ls, params, ...)
        updates, opt_state = tx.update(grads, opt_state, params, grads_finite=finite)
        params = params + updates          # tx skips (zero update) when not finite
        loss_scale = ls.adjust(finite)

    ``finite`` is reduced once and reused by the skip transform and the loss
    scale. If ``tx`` holds no `skip_non_finite`, the step itself keeps the old
    params and optimizer state on a non-finite step; the model state (batch
    stats) is always kept unchanged on a non-finite step.

    Contracts of ``loss_fn``:
      - ``has_state=False``: ``loss_fn(params, batch) -> loss`` or, with
        ``has_aux``, ``-> (loss, aux)``.
      - ``has_state=True``: ``loss_fn(params, model_state, batch) ->
        (loss, new_model_state)`` or, with ``has_aux``,
        ``((loss, aux), new_model_state)``. With flax linen BatchNorm:
        ``model.apply({"params": p, **model_state}, x, mutable=["batch_stats"])``
        returns ``(out, new_model_state)``.
      The loss is cast to float32 before scaling (a float16 loss times 2**16
      overflows fp16's max 65504).

    Args:
      loss_fn: the loss function (see above).
      has_aux: ``loss_fn`` also returns ``aux``; it is put in ``metrics["aux"]``.
      has_state: ``loss_fn`` takes and returns a model state.
      policy: None, a `jmp.Policy` or a policy string
        (``"params=float32,compute=float16,output=float32"``): params and
        the floating leaves of the batch are cast to the compute dtype inside
        the differentiated function, so gradients come back in the params'
        dtype. The model state is passed uncast.
      jit: jit the step.
      donate: donate the input state's buffers to the output (saves memory;
        the input state must not be used after the call).

    Returns:
      A `TrainStep`; calling it returns ``(new_state, metrics)`` where metrics
      holds device scalars: ``loss`` (unscaled, float32), ``grad_norm``
      (pre-clip, unscaled, float32), ``loss_scale`` (float32, the scale used
      for this step), ``finite`` (bool), ``skipped_total`` (int32), and
      ``aux`` with ``has_aux``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import loss_scale, train, transforms
      >>> tx = transforms.stable_optimizer(optax.sgd(0.1), max_grad_norm=1.0)
      >>> state = train.TrainState.create(params=jnp.zeros(2), optimizer=tx,
      ...                                 loss_scale=loss_scale.DynamicLossScale())
      >>> step = train.make_train_step(lambda p, b: jnp.sum((p - b) ** 2))
      >>> state, m = step(state, jnp.array([1.0, 2.0]))
      >>> round(float(m["loss"]), 3), bool(m["finite"]), float(m["loss_scale"])
      (5.0, True, 65536.0)
      >>> state, m = step(state, jnp.array([jnp.nan, 2.0]))
      >>> bool(m["finite"]), int(m["skipped_total"]), float(state.loss_scale.loss_scale)
      (False, 1, 32768.0)
    """
    for name, flag in (("has_aux", has_aux), ("has_state", has_state)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    pol = None if policy is None else get_policy(policy)

    def compute_loss(params, model_state, batch):
        if pol is not None:
            params = pol.cast_to_compute(params)
            batch = pol.cast_to_compute(batch)
        if has_state:
            out, new_model_state = loss_fn(params, model_state, batch)
        else:
            out, new_model_state = loss_fn(params, batch), model_state
        loss, aux = out if has_aux else (out, None)
        loss = jnp.asarray(loss, jnp.float32)
        if loss.shape != ():
            raise ValueError(
                f"loss_fn must return a scalar loss, got shape {loss.shape}"
            )
        return loss, (aux, new_model_state)

    grad_fn = scaled_value_and_grad(compute_loss, has_aux=True)

    def step(state: TrainState, batch: Any):
        ls = state.loss_scale
        (loss, (aux, new_model_state)), grads, finite = grad_fn(
            ls, state.params, state.model_state, batch
        )
        grad_norm = global_norm(grads)
        tx = state.tx
        if isinstance(tx, optax.GradientTransformationExtraArgs):
            updates, opt_state = tx.update(
                grads, state.opt_state, state.params, grads_finite=finite
            )
        else:
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if find_skip_state(state.opt_state) is None:
            # No skip transform in tx: guard here (the same single flag).
            params = _select(finite, params, state.params)
            opt_state = _select(finite, opt_state, state.opt_state)
        if state.model_state is not None:
            new_model_state = _select(finite, new_model_state, state.model_state)
        skipped_total = (state.skipped_total + jnp.logical_not(finite)).astype(
            jnp.int32
        )
        new_state = state.replace(
            step=(state.step + 1).astype(jnp.int32),
            params=params,
            opt_state=opt_state,
            loss_scale=ls.adjust(finite),
            model_state=new_model_state,
            skipped_total=skipped_total,
        )
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "loss_scale": jnp.asarray(ls.loss_scale, jnp.float32),
            "finite": finite,
            "skipped_total": skipped_total,
        }
        if has_aux:
            metrics["aux"] = aux
        return new_state, metrics

    def grads(state: TrainState, batch: Any):
        _, g, _ = grad_fn(state.loss_scale, state.params, state.model_state, batch)
        return g

    return TrainStep(step, grads, jit=jit, donate=donate)


class NonFiniteError(FloatingPointError):
    """Raised by `fit(nan_policy="stop")` after too many non-finite steps in a row.

    Attributes:
      step: 1-based index (within the `fit` call) of the step that hit the
        limit.
      state: the latest `TrainState` (skipped steps left params unchanged).
      report: `non_finite_report` of that step's gradients.
      history: the per-step metrics recorded so far.
    """

    def __init__(
        self, message: str, *, step: int, state: Any, report: list, history: list
    ):
        super().__init__(message)
        self.step = step
        self.state = state
        self.report = report
        self.history = history


def save_checkpoint(path: str | os.PathLike, state: Any) -> None:
    """Writes `state` (every pytree field, loss-scale fields included) as flax msgpack.

    Args:
      path: file to write.
      state: a `TrainState` or any flax-serialisable pytree.

    Example:
      >>> import os, tempfile, jax.numpy as jnp, optax
      >>> from jaxstable import loss_scale, train
      >>> s = train.TrainState.create(params=jnp.ones(2), optimizer=optax.sgd(0.1),
      ...                             loss_scale=loss_scale.DynamicLossScale(period=7))
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.msgpack")
      >>> train.save_checkpoint(path, s)
      >>> blank = train.TrainState.create(params=jnp.zeros(2), optimizer=optax.sgd(0.1),
      ...                                 loss_scale=loss_scale.DynamicLossScale())
      >>> r = train.load_checkpoint(path, blank)
      >>> r.params.tolist(), r.loss_scale.period
      ([1.0, 1.0], 7)
    """
    data = serialization.msgpack_serialize(
        serialization.to_state_dict(jax.device_get(state))
    )
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # atomic: a crash never leaves half a checkpoint


def load_checkpoint(path: str | os.PathLike, target: Any) -> Any:
    """Reads a checkpoint written by `save_checkpoint` into the structure of `target`.

    Args:
      path: file to read.
      target: a state of the same structure (supplies ``tx`` and types).

    Returns:
      The restored state.

    Example:
      >>> import os, tempfile, jax.numpy as jnp, optax
      >>> from jaxstable import train
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.msgpack")
      >>> s = train.TrainState.create(params=jnp.full(2, 3.0), optimizer=optax.sgd(0.1))
      >>> train.save_checkpoint(path, s)
      >>> blank = s.replace(params=jnp.zeros(2))
      >>> train.load_checkpoint(path, blank).params.tolist()
      [3.0, 3.0]
    """
    with open(path, "rb") as f:
        return serialization.from_state_dict(
            target, serialization.msgpack_restore(f.read())
        )


def _host_record(index: int, metrics: dict[str, Any]) -> dict[str, Any]:
    m = jax.device_get(metrics)
    rec = {
        "step": index,
        "loss": float(m["loss"]),
        "grad_norm": float(m["grad_norm"]),
        "loss_scale": float(m["loss_scale"]),
        "finite": bool(m["finite"]),
        "skipped_total": int(m["skipped_total"]),
    }
    aux = m.get("aux")
    if aux is not None:
        for path, leaf in jax.tree_util.tree_flatten_with_path(aux)[0]:
            if getattr(leaf, "size", 1) == 1:
                rec["aux" + jax.tree_util.keystr(path)] = float(leaf)
    return rec


def fit(
    state: TrainState,
    train_step: Callable,
    batches: Iterable[Any],
    *,
    steps: int | None = None,
    nan_policy: str = "skip",
    max_consecutive_nonfinite: int = 5,
    log_path: str | os.PathLike | None = None,
    progress: bool = True,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Runs ``train_step`` over ``batches`` with logging and a NaN policy.

    Metrics of step k are read to the host only after step k+1 has been
    dispatched, so the device is never idle waiting for the host. The step
    itself never syncs.

    Args:
      state: the initial `TrainState`.
      train_step: ``train_step(state, batch) -> (state, metrics)``, usually
        from `make_train_step`.
      batches: an iterable of batches.
      steps: stop after this many steps (None: until ``batches`` ends).
      nan_policy: ``"skip"`` (non-finite steps are skipped, training goes on)
        or ``"stop"`` (raise `NonFiniteError` after
        ``max_consecutive_nonfinite`` non-finite steps in a row).
      max_consecutive_nonfinite: the limit for ``"stop"``, >= 1.
      log_path: append one JSON line per step (keys ``step, loss, grad_norm,
        loss_scale, finite, skipped_total`` and ``aux[...]`` scalars).
      progress: show a tqdm progress bar with loss, grad_norm, loss_scale,
        skipped.
      checkpoint_dir: where to write ``step_<n>.msgpack`` checkpoints.
      checkpoint_every: write one every this many steps (needs
        ``checkpoint_dir``), and one at the end.

    Returns:
      ``(state, history)``: the final state and a list of per-step metric
      dicts (Python numbers, the same records as the JSON lines).

    Raises:
      NonFiniteError: with ``nan_policy="stop"``; the message names the step
        and lists the non-finite gradient leaves and batch inputs.
      ValueError: bad ``nan_policy`` (lists the valid values) or limits.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import train, transforms
      >>> tx = transforms.stable_optimizer(optax.sgd(0.1))
      >>> state = train.TrainState.create(params=jnp.zeros(2), optimizer=tx)
      >>> step = train.make_train_step(lambda p, b: jnp.sum((p - b) ** 2))
      >>> data = [jnp.ones(2), jnp.array([jnp.nan, 1.0]), jnp.ones(2)]
      >>> state, hist = train.fit(state, step, data, progress=False)
      >>> [h["finite"] for h in hist], hist[-1]["skipped_total"]
      ([True, False, True], 1)
    """
    if nan_policy not in NAN_POLICIES:
        raise ValueError(
            f"nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}"
        )
    if not isinstance(max_consecutive_nonfinite, int) or max_consecutive_nonfinite < 1:
        raise ValueError(
            "max_consecutive_nonfinite must be an int >= 1, "
            f"got {max_consecutive_nonfinite!r}"
        )
    if steps is not None and (not isinstance(steps, int) or steps < 0):
        raise ValueError(f"steps must be None or an int >= 0, got {steps!r}")
    if checkpoint_every is not None:
        if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ValueError(
                f"checkpoint_every must be an int >= 1, got {checkpoint_every!r}"
            )
        if checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir")
    if checkpoint_dir is not None:
        os.makedirs(checkpoint_dir, exist_ok=True)

    from tqdm.auto import tqdm  # imported here: only fit needs it

    it = iter(batches) if steps is None else itertools.islice(batches, steps)
    history: list[dict[str, Any]] = []
    bar = tqdm(total=steps, disable=not progress, desc="train")
    log = open(log_path, "a") if log_path is not None else None
    consecutive = 0

    def consume(pending, latest_state):
        nonlocal consecutive
        index, metrics, batch, state_out = pending
        rec = _host_record(index, metrics)
        history.append(rec)
        if log is not None:
            log.write(json.dumps(rec) + "\n")
        bar.set_postfix(
            loss=f"{rec['loss']:.4g}",
            grad_norm=f"{rec['grad_norm']:.3g}",
            loss_scale=f"{rec['loss_scale']:.3g}",
            skipped=rec["skipped_total"],
            refresh=False,
        )
        bar.update(1)
        consecutive = 0 if rec["finite"] else consecutive + 1
        if nan_policy == "stop" and consecutive >= max_consecutive_nonfinite:
            _raise_non_finite(
                train_step, index, consecutive, batch, state_out, latest_state, history
            )

    def save(st, index):
        if checkpoint_dir is not None:
            save_checkpoint(os.path.join(checkpoint_dir, f"step_{index}.msgpack"), st)

    pending = None
    index = 0
    try:
        for batch in it:
            index += 1
            new_state, metrics = train_step(state, batch)
            if pending is not None:
                consume(pending, new_state)
            pending = (index, metrics, batch, new_state)
            state = new_state
            if checkpoint_every is not None and index % checkpoint_every == 0:
                save(state, index)
        if pending is not None:
            consume(pending, state)
        if checkpoint_dir is not None and (
            checkpoint_every is None or index % checkpoint_every
        ):
            save(state, index)
    finally:
        bar.close()
        if log is not None:
            log.close()
    return state, history


def _raise_non_finite(
    train_step, index, consecutive, batch, state_out, latest, history
):
    grads_fn = getattr(train_step, "grads", None)
    report: list = []
    if grads_fn is not None:
        for candidate in (state_out, latest):
            try:
                report = non_finite_report(grads_fn(candidate, batch))
                break
            except RuntimeError:  # buffers donated to the next step: try the latest
                continue
    parts = [
        f"step {index}: {consecutive} non-finite steps in a row "
        f"(nan_policy='stop'); the updates were skipped.",
        "non-finite gradients:\n" + format_report(report),
    ]
    batch_report = non_finite_report(batch)
    if batch_report:
        parts.append("non-finite batch inputs:\n" + format_report(batch_report))
    param_report = non_finite_report(latest.params)
    if param_report:
        parts.append("non-finite parameters:\n" + format_report(param_report))
    raise NonFiniteError(
        "\n".join(parts), step=index, state=latest, report=report, history=history
    )
