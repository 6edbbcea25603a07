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
import time
from collections.abc import Callable, Iterable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import serialization

from jaxstable._src.diagnostics import (
    format_location,
    format_report,
    locate,
    non_finite_report,
)
from jaxstable._src.loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    scaled_value_and_grad,
)
from jaxstable._src.precision import get_policy
from jaxstable._src.transforms import SkipNonFiniteState, global_norm

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

NAN_POLICIES = ("skip", "stop", "rollback")


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


_INJECT_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _outer_skip_state(opt_state: Any) -> SkipNonFiniteState | None:
    """``tx``'s OUTERMOST `SkipNonFiniteState`, or None.

    Only an outermost skip transform sees (and zeroes) the whole update. A
    skip nested inside a chain zeroes its own part only: in
    ``chain(skip_non_finite(sgd), add_decayed_weights(0.5))`` the decay would
    still move the params on a NaN step. `optax.inject_hyperparams` around the
    skip is accepted too (its step count still advances on a skipped step, as
    a torch LR scheduler stepped every iteration does).
    """
    if isinstance(opt_state, SkipNonFiniteState):
        return opt_state
    if isinstance(opt_state, _INJECT_STATES) and isinstance(
        opt_state.inner_state, SkipNonFiniteState
    ):
        return opt_state.inner_state
    return None


class TrainStep:
    """What `make_train_step` returns: ``step(state, batch) -> (state, metrics)``.

    Attributes:
      raw: the pure, un-jitted step function.
      grads: ``grads(state, batch) -> unscaled gradients`` (jitted), used by
        `fit` to report which gradient leaves went non-finite.
      jit: whether calls are jitted.
      donate: whether a jitted call donates its input state.
      loss_fn, policy, has_state, has_aux: what `make_train_step` was given
        (``policy`` parsed to a `jmp.Policy` or None), read by
        `jaxstable.diagnostics.locate`.

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
        self.jit = bool(jit)
        self.donate = bool(donate)
        self.grads = jax.jit(grads) if jit else grads
        self._fn = jax.jit(raw, donate_argnums=(0,) if donate else ()) if jit else raw

    def __call__(
        self, state: TrainState, batch: Any
    ) -> tuple[TrainState, dict[str, Any]]:
        return self._fn(state, batch)

    def lower(self, state: TrainState, batch: Any):
        """`jax.jit(...).lower(state, batch)` of the step (for HLO inspection).

        With ``jit=False`` the raw step is jitted for the occasion (with the
        same donation), so the HLO is that of the jitted step.
        """
        fn = self._fn
        if not self.jit:
            fn = jax.jit(self.raw, donate_argnums=(0,) if self.donate else ())
        return fn.lower(state, batch)


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
        params = params + updates     # tx skips (zero update) unless applied
        loss_scale = ls.adjust(finite)

    The invariant: no step writes a non-finite value into the parameters,
    the optimizer state or the model state. A step is *applied* only when
    its gradients are finite AND the update, the new parameters and the new
    optimizer state are finite (float16 Adam state can turn finite gradients
    into ``m / 0``); otherwise it is skipped and counted in ``skipped_total``.
    ``finite`` (the gradient flag) is reduced once and reused by the skip
    transform and the loss scale, which reacts to the gradients only, as
    GradScaler does: a non-finite update is no overflow of the scaled loss.
    When ``tx``'s OUTERMOST state is a `SkipNonFiniteState` (as with
    `stable_optimizer`, possibly inside `optax.inject_hyperparams`) the skip
    transform makes both checks (``check_update=False`` there leaves the
    second out); otherwise the step itself checks the new params and
    optimizer state and keeps the old ones: a skip nested inside a chain
    would zero only its own part of the update. The model state (batch
    stats) is kept unchanged on a skipped step, and also when it is itself
    non-finite.

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
      for this step), ``finite`` (bool: the step was applied, see the
      invariant above), ``grads_finite`` (bool: the gradients alone),
      ``skipped_total`` (int32), and ``aux`` with ``has_aux``.

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
            # Same text as torchref.train.TrainStep.
            raise ValueError(
                f"loss_fn must return a scalar (0-d) loss, got shape {loss.shape}; "
                "reduce it, e.g. with .mean()"
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
        skip = _outer_skip_state(opt_state)
        if skip is not None:
            # The skip transform checked gradients, update, new params and
            # new optimizer state (unless built with check_update=False).
            applied = skip.last_finite
        else:
            # No skip transform around the whole of tx: guard here, with the
            # same two checks (the gradient flag is reused).
            applied = jnp.logical_and(finite, all_finite((params, opt_state)))
            params = _select(applied, params, state.params)
            opt_state = _select(applied, opt_state, state.opt_state)
        if state.model_state is not None:
            keep = jnp.logical_and(applied, all_finite(new_model_state))
            new_model_state = _select(keep, new_model_state, state.model_state)
        skipped_total = (state.skipped_total + jnp.logical_not(applied)).astype(
            jnp.int32
        )
        new_state = state.replace(
            step=(state.step + 1).astype(jnp.int32),
            params=params,
            opt_state=opt_state,
            # The scale reacts to the gradients only, as GradScaler's does: a
            # non-finite update is no overflow of the scaled loss.
            loss_scale=ls.adjust(finite),
            model_state=new_model_state,
            skipped_total=skipped_total,
        )
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "loss_scale": jnp.asarray(ls.loss_scale, jnp.float32),
            "finite": applied,
            "grads_finite": finite,
            "skipped_total": skipped_total,
        }
        if has_aux:
            metrics["aux"] = aux
        return new_state, metrics

    def grads(state: TrainState, batch: Any):
        _, g, _ = grad_fn(state.loss_scale, state.params, state.model_state, batch)
        return g

    out = TrainStep(step, grads, jit=jit, donate=donate)
    # What `diagnostics.locate` needs to re-run the loss op by op, off the
    # hot path (the jitted step does not read these).
    out.loss_fn, out.policy, out.has_state, out.has_aux = (
        loss_fn,
        pol,
        has_state,
        has_aux,
    )
    return out


class NonFiniteError(FloatingPointError):
    """Raised by `fit` after too many non-finite steps in a row.

    With ``nan_policy="stop"`` at the first such run; with ``"rollback"``
    once ``max_rollbacks`` rollbacks have been used.

    Attributes:
      step: 0-based index (within the `fit` call) of the step that hit the
        limit, as in `torchref.train.NonFiniteError`.
      state: the `TrainState` produced by that step (its update was skipped;
        no later batch was applied).
      report: `non_finite_report` of that step's gradients, recomputed at the
        loss scale that step used.
      history: the per-step records, ending with that step.
      location: `jaxstable.diagnostics.locate` of that step (a
        `NonFiniteLocation`), None when the op-by-op re-run found it finite.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        state: Any,
        report: list,
        history: list,
        location: Any = None,
    ):
        super().__init__(message)
        self.step = step
        self.state = state
        self.report = report
        self.history = history
        self.location = location


# Top-level key of the file (not a TrainState field) naming the optimizer
# state's types: two optimizers can share a state layout (adam's and
# adabelief's are both (count, mu, nu)) but not their type names.
_TYPES_KEY = "_types"
# Mismatch lines listed in one error; the rest are counted.
_MAX_MISMATCH_LINES = 12


def save_checkpoint(path: str | os.PathLike, state: Any) -> None:
    """Writes `state` (every pytree field, loss-scale fields included) as flax msgpack.

    For a `TrainState` the file also names the types of the optimizer state
    (e.g. ``(ScaleByAdamState, EmptyState)``), so that `load_checkpoint` can
    refuse a checkpoint of another optimizer by name.

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
    tree = serialization.to_state_dict(jax.device_get(state))
    if isinstance(state, TrainState):
        tree[_TYPES_KEY] = {"opt_state": _state_types(state.opt_state)}
    data = serialization.msgpack_serialize(tree)
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # atomic: a crash never leaves half a checkpoint


def load_checkpoint(path: str | os.PathLike, target: Any) -> Any:
    """Reads a checkpoint written by `save_checkpoint` into the structure of `target`.

    Nothing is restored unless the checkpoint matches `target` exactly: the
    same loss-scale type, the same optimizer state types, and the same leaf
    paths with the same shapes and dtypes (params, optimizer state, model
    state, counters). flax alone would load a (2, 3) array into a (3, 3)
    target, or a float16 one into a float32 target, without a word.

    Args:
      path: file to read.
      target: a state of the same structure (supplies ``tx`` and types).

    Returns:
      The restored state.

    Raises:
      ValueError: naming the file and the mismatch: the checkpoint's loss
        scale is of another type than ``target.loss_scale`` (e.g. saved
        `DynamicLossScale`, target `NoOpLossScale`: restoring would drop or
        invent fields); its optimizer state types differ from those of
        ``target.tx`` (e.g. adam's into sgd's); or leaves are missing, extra,
        or of another shape or dtype (each listed with its path, saved vs
        expected).

    Example:
      >>> import os, tempfile, jax.numpy as jnp, optax
      >>> from jaxstable import train
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.msgpack")
      >>> s = train.TrainState.create(params=jnp.full(2, 3.0), optimizer=optax.sgd(0.1))
      >>> train.save_checkpoint(path, s)
      >>> blank = s.replace(params=jnp.zeros(2))
      >>> train.load_checkpoint(path, blank).params.tolist()
      [3.0, 3.0]
      >>> try:
      ...     train.load_checkpoint(path, s.replace(params=jnp.zeros(3)))
      ... except ValueError as e:
      ...     print(str(e).splitlines()[1])
        params: checkpoint (2,) float32, target (3,) float32
    """
    with open(path, "rb") as f:
        raw = serialization.msgpack_restore(f.read())
    saved_types = raw.pop(_TYPES_KEY, None) if isinstance(raw, dict) else None
    _check_loss_scale_type(path, raw, target)
    _check_optimizer_types(path, saved_types, target)
    _check_same_structure(
        path, _leaf_specs(raw), _leaf_specs(serialization.to_state_dict(target))
    )
    return serialization.from_state_dict(target, raw)


def _state_types(tree: Any) -> str:
    """The optimizer state's type names, e.g. ``(ScaleByAdamState, EmptyState)``.

    Arrays and containers of arrays (moments shaped like the params) give "".
    """
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # an optax state
        name = type(tree).__name__
        inner = [s for s in map(_state_types, tree) if s]
        return f"{name}({', '.join(inner)})" if inner else name
    if isinstance(tree, tuple | list):
        return "(" + ", ".join(map(_state_types, tree)) + ")"
    if isinstance(tree, dict):
        inner = [f"{k}: {s}" for k, v in tree.items() if (s := _state_types(v))]
        return "{" + ", ".join(inner) + "}" if inner else ""
    return ""


def _check_optimizer_types(path: Any, saved_types: Any, target: Any) -> None:
    opt_state = getattr(target, "opt_state", None)
    saved = saved_types.get("opt_state") if isinstance(saved_types, dict) else None
    if saved is None or opt_state is None:
        return  # an older file or a plain pytree: the leaf check still runs
    expected = _state_types(opt_state)
    if saved != expected:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} was saved with optimizer state "
            f"{saved} but target.tx's state is {expected}: build the target "
            "with the optimizer the checkpoint was saved with"
        )


def _leaf_specs(tree: Any, prefix: str = "") -> dict[str, tuple[tuple, str]]:
    """``{path: (shape, dtype)}`` of every leaf of a nested state dict.

    Paths join the keys with "/" (``params/w1``). A Python number is
    ``((), "int")`` etc.; None and empty containers hold no leaf.
    """
    if tree is None:
        return {}
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_leaf_specs(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    key = prefix or "<root>"  # a checkpoint of a single array
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return {key: (tuple(tree.shape), str(tree.dtype))}
    return {key: ((), type(tree).__name__)}


def _check_same_structure(
    path: Any, saved: dict[str, tuple], expected: dict[str, tuple]
) -> None:
    """Raises ValueError listing every leaf that differs (saved vs expected).

    ``saved`` and ``expected`` map a leaf path to ``(shape, dtype)`` (see
    `_leaf_specs`): the check does not depend on the file format.
    """
    _raise_mismatches(path, _structure_mismatches(saved, expected))


def _structure_mismatches(saved: dict[str, tuple], expected: dict[str, tuple]):
    """One line per leaf missing, extra, or of another shape or dtype."""
    lines = []
    # The target's order (params before opt_state), then the checkpoint's extras.
    for key in [*expected, *(k for k in saved if k not in expected)]:
        s, e = saved.get(key), expected.get(key)
        if s is None:
            lines.append(f"  {key}: missing from the checkpoint (target {_spec(e)})")
        elif e is None:
            lines.append(f"  {key}: in the checkpoint ({_spec(s)}), not in the target")
        elif s != e:
            lines.append(f"  {key}: checkpoint {_spec(s)}, target {_spec(e)}")
    return lines


def _raise_mismatches(path: Any, lines: list[str]) -> None:
    # Same text as torchref.train.load_checkpoint.
    if not lines:
        return
    more = len(lines) - _MAX_MISMATCH_LINES
    shown = lines[:_MAX_MISMATCH_LINES] + (
        [f"  ... and {more} more"] if more > 0 else []
    )
    raise ValueError(
        f"checkpoint {os.fspath(path)!r} does not match the target "
        f"({len(lines)} leaf/leaves differ):\n" + "\n".join(shown) + "\nbuild the "
        "target with the model, optimizer and dtypes the checkpoint was saved with"
    )


def _spec(spec: tuple) -> str:
    shape, dtype = spec
    return f"{shape} {dtype}"


def _loss_scale_kind(fields: dict) -> str:
    known = {
        frozenset(serialization.to_state_dict(cls())): cls.__name__
        for cls in (NoOpLossScale, StaticLossScale, DynamicLossScale)
    }
    return known.get(
        frozenset(fields), f"an unknown loss scale with fields {sorted(fields)}"
    )


def _check_loss_scale_type(path: Any, raw: Any, target: Any) -> None:
    ls = getattr(target, "loss_scale", None)
    if ls is None or not isinstance(raw, dict) or "loss_scale" not in raw:
        return
    expected = serialization.to_state_dict(ls)
    saved = raw["loss_scale"]
    if not (isinstance(expected, dict) and isinstance(saved, dict)):
        return  # a loss scale flax does not serialise field by field (jmp's)
    if set(saved) != set(expected):
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} holds a {_loss_scale_kind(saved)} "
            f"but target.loss_scale is a {type(ls).__name__}: build the target "
            "with the loss-scale type the checkpoint was saved with"
        )


def _add_skip_reason(rec: dict[str, Any], grads_finite: Any) -> None:
    # Only a guarded step reports grads_finite (a plain step that does not
    # skip has no reason to give); then its record tells why it skipped.
    if grads_finite is None:
        return
    # Same keys as torchref.train.fit: a skipped step says why.
    rec["grads_finite"] = bool(grads_finite)
    if not rec["finite"]:
        rec["skip_reason"] = (
            "non-finite update" if rec["grads_finite"] else "non-finite gradients"
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
    _add_skip_reason(rec, m.get("grads_finite"))
    aux = m.get("aux")
    if aux is not None:
        for path, leaf in jax.tree_util.tree_flatten_with_path(aux)[0]:
            if getattr(leaf, "size", 1) == 1:
                rec["aux" + jax.tree_util.keystr(path)] = float(leaf)
    return rec


def _may_donate(train_step: Callable) -> bool:
    # An unknown callable may donate its input (e.g. jax.jit(step.raw,
    # donate_argnums=0)); a TrainStep says whether it does.
    if isinstance(train_step, TrainStep):
        return train_step.jit and train_step.donate
    return True


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
    rollback_every: int = 100,
    max_rollbacks: int = 3,
    locate_first: int = 1,
    time_steps: bool = False,
    eval_fn: Callable[[Any], Any] | None = None,
    eval_every: int | None = None,
    on_step: Callable[[dict[str, Any], Any], Any] | None = None,
    stop_after_nonfinite: int | None = None,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Runs ``train_step`` over ``batches`` with logging and a NaN policy.

    The records, the JSONL log, the checkpoints and `NonFiniteError` are
    those of `torchref.train.fit`: step indices are 0-based, the log is
    overwritten at the start of each call, checkpoints are named
    ``step_{n:08d}.msgpack`` with n the number of steps done.

    Pipelining: the metrics of step k are read to the host only after step
    k+1 has been dispatched, so the device is never idle waiting for the
    host (the step itself never syncs). With ``nan_policy="stop"`` this
    lookahead is kept only when the step does not donate its input (a
    `TrainStep` made with ``donate=False``): the state produced by the
    failing step must still exist when its metrics are read. With a donating
    step (or a callable that is not a `TrainStep`) "stop" reads each step's
    metrics before dispatching the next (one host sync per step). Either way
    the error carries the failing step's own state and nothing after it is
    applied, logged or checkpointed. "rollback" follows the same rule; when
    the lookahead is kept and a rollback happens, the step already queued on
    the discarded state is dropped and its batch re-run on the snapshot.

    Rollback (``nan_policy="rollback"``): fit keeps an on-device copy of the
    last state known good (``jax.tree.map(jnp.copy, state)``: no host
    transfer, and a donating step cannot invalidate it), taken before the
    first step and after every step n (n steps done in this call) with
    ``n % rollback_every == 0`` whose result was finite; each snapshot step
    is read before the next is queued. When ``max_consecutive_nonfinite``
    non-finite steps happen in a row, a copy of the snapshot replaces the
    state (params, optimizer state, loss scale, model state and the
    ``step``/``skipped_total`` counters: all of the `TrainState`), the run
    counter restarts, that step's record gets ``"rolled_back": True`` (the
    only record with that key) and training goes on with the NEXT batch
    (the bad ones are not retried). The trigger after ``max_rollbacks``
    rollbacks raises `NonFiniteError` as "stop" does. It costs one more
    copy of the state in device memory.

    Args:
      state: the initial `TrainState`.
      train_step: ``train_step(state, batch) -> (state, metrics)``, usually
        from `make_train_step`.
      batches: an iterable of batches.
      steps: stop after this many steps (None: until ``batches`` ends).
      nan_policy: ``"skip"`` (non-finite steps are skipped, training goes on),
        ``"stop"`` (raise `NonFiniteError` after
        ``max_consecutive_nonfinite`` non-finite steps in a row) or
        ``"rollback"`` (restore the last good snapshot instead, see above).
      max_consecutive_nonfinite: the limit for ``"stop"`` and
        ``"rollback"``, >= 1.
      log_path: JSONL file, overwritten at the start of the call: one line
        per step (keys ``step, loss, grad_norm, loss_scale, finite,
        skipped_total`` and ``aux[...]`` scalars; with a step that reports
        ``grads_finite``, as `make_train_step`'s does, that key too, and a
        skipped step has ``skip_reason``: ``"non-finite gradients"`` or
        ``"non-finite update"``).
      progress: show a tqdm progress bar with loss, grad_norm, loss_scale,
        skipped.
      checkpoint_dir: where to write ``step_{n:08d}.msgpack`` checkpoints; a
        final one is always written when the loop ends (not when it raises).
      checkpoint_every: also write one every this many steps (needs
        ``checkpoint_dir``). Without it, only the final checkpoint.
      rollback_every: snapshot period in steps for ``"rollback"``, int >= 1
        (accepted, unused, with the other policies).
      max_rollbacks: rollbacks allowed in this call for ``"rollback"``,
        int >= 1 (accepted, unused, with the other policies).
      locate_first: the first this many non-finite steps of the call (int
        >= 0) get ``"location"``: `jaxstable.diagnostics.locate` of the step
        (at the loss scale it used) as a dict of `NonFiniteLocation` fields,
        or None when the op-by-op re-run is finite; the step that makes
        "stop" raise or "rollback" roll back always gets it (and the error
        its ``location``). Costs one op-by-op re-run per located step, only
        on non-finite steps. With "skip" and a step that donates its input
        (``donate=True``) the input is gone when the step is read: such
        steps are not located.
      time_steps: add ``"time_s"`` to each record: the wall time from the
        call of ``train_step`` until its new state and metrics are ready
        (`jax.block_until_ready`). Off by default: it waits for every step,
        so the lookahead described above is dropped.
      eval_fn: ``eval_fn(state) -> {name: scalar}``, e.g. a held-out
        evaluation; called after every ``eval_every``-th step (n steps done
        in this call, ``n % eval_every == 0``) on that step's state, its
        scalars added to that step's record as ``eval[...]`` keys (named as
        ``aux``'s). Needs ``eval_every``.
      eval_every: int >= 1, the period of ``eval_fn`` (needs ``eval_fn``).
      on_step: ``on_step(record, state)``, called once per step with the
        step's record (after it is logged) and the state that step produced;
        if it returns True, fit stops after that step and returns normally.
      stop_after_nonfinite: None, or an int >= 0: fit returns normally
        (nothing raised) this many steps after the first step of the call
        whose record has ``finite == False`` (0: stop at that step). For runs
        that are meant to fail (a naive low-precision baseline): a few steps
        show what follows, then nothing more is learned from NaN weights.

    Any ``train_step`` with the contract above works, a pure function over a
    plain dict (or any pytree) state included; the metrics must hold
    ``loss``, ``grad_norm``, ``loss_scale``, ``finite`` and
    ``skipped_total`` (and optionally ``aux``). Only a `TrainStep` gives the
    error report its gradient table (it has ``grads``).

    Returns:
      ``(state, history)``: the final state and a list of per-step metric
      dicts (Python numbers, the same records as the JSON lines; a rollback
      step's record also has ``"rolled_back": True``). When fit stops early
      (``stop_after_nonfinite``, ``on_step``), the state is that of the last
      recorded step: a step queued after it is dropped.

    Raises:
      NonFiniteError: with ``nan_policy="stop"``, or ``"rollback"`` once the
        rollbacks are used up (the message says so); the message names the step,
        the loss scale it used, and lists the non-finite gradient leaves
        (recomputed at that scale) and batch inputs.
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
      >>> try:
      ...     train.fit(state, step, data[1:], nan_policy="stop",
      ...               max_consecutive_nonfinite=1, progress=False)
      ... except train.NonFiniteError as e:
      ...     print(e.step, "|", str(e).split(";")[0])
      0 | 1 non-finite step(s) in a row, the last at step 0
      >>> data = [jnp.ones(2), jnp.ones(2), jnp.array([jnp.nan, 1.0]), jnp.ones(2)]
      >>> before = int(state.step)
      >>> state, hist = train.fit(state, step, data, nan_policy="rollback",
      ...                         max_consecutive_nonfinite=1, rollback_every=2,
      ...                         progress=False)
      >>> # 4 steps, but the rollback undid the NaN one (back to the snapshot at 2)
      >>> [h.get("rolled_back", False) for h in hist], int(state.step) - before
      ([False, False, True, False], 3)
      >>> data = [jnp.ones(2), jnp.array([jnp.nan, 1.0])] + [jnp.ones(2)] * 5
      >>> state, hist = train.fit(state, step, data, progress=False, time_steps=True,
      ...                         eval_fn=lambda s: {"p0": s.params[0]}, eval_every=2,
      ...                         stop_after_nonfinite=2)
      >>> len(hist), [k for k in hist[1] if k not in hist[0]]  # stopped 2 after step 1
      (4, ['skip_reason', "eval['p0']", 'location'])
      >>> hist[3]["eval['p0']"] == float(state.params[0]), hist[0]["time_s"] > 0
      (True, True)
    """
    _check_fit_extras(time_steps, eval_fn, eval_every, on_step, stop_after_nonfinite)
    if nan_policy not in NAN_POLICIES:
        raise ValueError(
            f"nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}"
        )
    if (
        isinstance(max_consecutive_nonfinite, bool)
        or not isinstance(max_consecutive_nonfinite, int)
        or max_consecutive_nonfinite < 1
    ):
        raise ValueError(
            "max_consecutive_nonfinite must be an int >= 1, "
            f"got {max_consecutive_nonfinite!r}"
        )
    for name, value in (
        ("rollback_every", rollback_every),
        ("max_rollbacks", max_rollbacks),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if steps is not None and (
        isinstance(steps, bool) or not isinstance(steps, int) or steps < 0
    ):
        raise ValueError(f"steps must be None or an int >= 0, got {steps!r}")
    if (
        isinstance(locate_first, bool)
        or not isinstance(locate_first, int)
        or locate_first < 0
    ):
        raise ValueError(f"locate_first must be an int >= 0, got {locate_first!r}")
    if checkpoint_every is not None:
        if (
            isinstance(checkpoint_every, bool)
            or not isinstance(checkpoint_every, int)
            or checkpoint_every < 1
        ):
            raise ValueError(
                f"checkpoint_every must be an int >= 1, got {checkpoint_every!r}"
            )
        if checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir")
    if checkpoint_dir is not None:
        os.makedirs(checkpoint_dir, exist_ok=True)

    from tqdm.auto import tqdm  # imported here: only fit needs it

    total = steps
    if total is None and hasattr(batches, "__len__"):
        total = len(batches)
    it = iter(batches) if steps is None else itertools.islice(batches, steps)
    # The lookahead needs each step's output state to outlive the next
    # dispatch whenever fit reads it (policy, callback, eval, early stop):
    # only a step that does not donate its input keeps it.
    reads_state = nan_policy != "skip" or on_step is not None
    reads_state = reads_state or eval_fn is not None
    reads_state = reads_state or stop_after_nonfinite is not None
    pipeline = not time_steps and (not reads_state or not _may_donate(train_step))
    history: list[dict[str, Any]] = []
    bar = tqdm(total=total, disable=not progress, desc="train")
    log = open(log_path, "w", encoding="utf-8") if log_path is not None else None
    consecutive = 0
    rollback = nan_policy == "rollback"
    rollbacks = 0
    located = 0
    # A device copy: the step may donate `state`, never the snapshot.
    snapshot = jax.tree.map(jnp.copy, state) if rollback else None
    first_bad = None

    def consume(pending) -> str | None:
        """Logs one step, applies the policy: "rollback", "stop" or None."""
        nonlocal consecutive, rollbacks, snapshot, located, first_bad
        index, metrics, batch, state_out, seconds = pending
        rec = _host_record(index, metrics)
        if seconds is not None:
            rec["time_s"] = seconds
        if eval_fn is not None and (index + 1) % eval_every == 0:
            rec.update(_scalar_record("eval", eval_fn(state_out)))
        consecutive = 0 if rec["finite"] else consecutive + 1
        triggered = nan_policy != "skip" and consecutive >= max_consecutive_nonfinite
        rolls = triggered and rollback and rollbacks < max_rollbacks
        if rolls:
            rec["rolled_back"] = True
        location = None
        if not rec["finite"] and (triggered or located < locate_first):
            location = _locate_failed(train_step, state_out, metrics, batch, pipeline)
            if location is not False:
                located += 1
                rec["location"] = None if location is None else location._asdict()
        history.append(rec)
        if log is not None:
            log.write(json.dumps(rec) + "\n")
            log.flush()
        bar.set_postfix(
            loss=f"{rec['loss']:.4g}",
            grad_norm=f"{rec['grad_norm']:.3g}",
            loss_scale=f"{rec['loss_scale']:.3g}",
            skipped=rec["skipped_total"],
            refresh=False,
        )
        bar.update(1)
        wants_stop = on_step is not None and on_step(rec, state_out) is True
        if rolls:
            rollbacks += 1
            consecutive = 0
            return "rollback"
        if triggered:
            _raise_non_finite(
                train_step,
                rec,
                consecutive,
                batch,
                state_out,
                metrics,
                history,
                nan_policy,
                max_rollbacks,
                location or None,
            )
        if rollback and rec["finite"] and (index + 1) % rollback_every == 0:
            # Read before the next step is queued (see snapshot_due), so a
            # donating step has not consumed state_out yet.
            snapshot = jax.tree.map(jnp.copy, state_out)
        if first_bad is None and not rec["finite"]:
            first_bad = index
        if stop_after_nonfinite is not None and first_bad is not None:
            wants_stop = wants_stop or index - first_bad >= stop_after_nonfinite
        return "stop" if wants_stop else None

    def restored():
        # A copy again: a donating step must leave the snapshot intact for
        # the next rollback.
        return jax.tree.map(jnp.copy, snapshot)

    def save(st, n):
        path = os.path.join(checkpoint_dir, f"step_{n:08d}.msgpack")
        save_checkpoint(path, st)

    pending = None
    done = 0  # steps dispatched so far
    saved_at = None
    try:
        for batch in it:
            start = time.perf_counter()
            new_state, metrics = train_step(state, batch)
            seconds = None
            if time_steps:
                jax.block_until_ready((new_state, metrics))
                seconds = time.perf_counter() - start
            # Step done-1, read after step done is queued. If it rolled back,
            # the step just queued ran on a discarded state: re-run its batch
            # on the snapshot (it is the next batch, not a bad one retried).
            # If it stopped the run, the step just queued is dropped.
            action = None if pending is None else consume(pending)
            if action == "stop":
                state, pending = pending[3], None
                break
            if action == "rollback":
                new_state, metrics = train_step(restored(), batch)
            pending = (done, metrics, batch, new_state, seconds)
            done += 1
            state = new_state
            due = checkpoint_every is not None and done % checkpoint_every == 0
            snapshot_due = rollback and done % rollback_every == 0
            if not pipeline or due or snapshot_due:
                # A checkpoint is written only after its step passed the check.
                action = consume(pending)
                pending = None
                if action == "rollback":
                    state = restored()
                elif action == "stop":
                    break
            if due:
                save(state, done)
                saved_at = done
        if pending is not None and consume(pending) == "rollback":
            state = restored()
        if checkpoint_dir is not None and saved_at != done:
            save(state, done)  # the final checkpoint
    finally:
        bar.close()
        if log is not None:
            log.close()
    return state, history


# Same text in jaxstable.train and torchref.train.
_UPDATE_NOTE = (
    "its gradients were finite: the update it computed (new parameters or "
    "optimizer state) was non-finite, e.g. float16 Adam state whose second "
    "moment underflowed to 0 while eps is 0 in float16"
)


def _check_fit_extras(time_steps, eval_fn, eval_every, on_step, stop_after):
    # Same checks and texts as torchref.train.fit.
    if not isinstance(time_steps, bool):
        raise TypeError(f"time_steps must be True or False, got {time_steps!r}")
    for name, fn in (("eval_fn", eval_fn), ("on_step", on_step)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be None or a callable, got {fn!r}")
    if (eval_fn is None) != (eval_every is None):
        raise ValueError(
            "eval_fn and eval_every go together: pass both or neither, got "
            f"eval_fn={eval_fn!r}, eval_every={eval_every!r}"
        )
    if eval_every is not None and (
        isinstance(eval_every, bool)
        or not isinstance(eval_every, int)
        or eval_every < 1
    ):
        raise ValueError(f"eval_every must be None or an int >= 1, got {eval_every!r}")
    if stop_after is not None and (
        isinstance(stop_after, bool)
        or not isinstance(stop_after, int)
        or stop_after < 0
    ):
        raise ValueError(
            f"stop_after_nonfinite must be None or an int >= 0, got {stop_after!r}"
        )


def _scalar_record(prefix: str, tree: Any) -> dict[str, float]:
    # prefix + keystr of every scalar leaf: the aux[...] naming of records.
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]:
        if getattr(leaf, "size", 1) == 1:
            out[prefix + jax.tree_util.keystr(path)] = float(leaf)
    return out


def _policy_note(nan_policy: str, max_rollbacks: int) -> str:
    # Same text as torchref.train.fit.
    if nan_policy == "rollback":
        return (
            "nan_policy='rollback': rollbacks exhausted "
            f"(max_rollbacks={max_rollbacks})"
        )
    return f"nan_policy={nan_policy!r}"


def _raise_non_finite(
    train_step,
    rec,
    consecutive,
    batch,
    state_out,
    metrics,
    history,
    nan_policy="stop",
    max_rollbacks=0,
    location=None,
):
    # state_out is the failing step's own output: a non-finite step leaves
    # params, opt_state and model_state as they were, but its loss scale has
    # already backed off. Recompute at the scale the step USED, or an
    # overflow of the scaled loss (not NaN data) would look all finite.
    used = StaticLossScale(metrics["loss_scale"])
    grads_fn = getattr(train_step, "grads", None)
    report = (
        non_finite_report(grads_fn(state_out.replace(loss_scale=used), batch))
        if grads_fn is not None
        else []
    )
    scale = f"{rec['loss_scale']:.6g}"
    parts = [
        f"{consecutive} non-finite step(s) in a row, the last at step "
        f"{rec['step']}; loss={rec['loss']:.6g}, grad_norm={rec['grad_norm']:.6g}, "
        f"loss_scale={scale} (the scale that step used); its update was skipped "
        f"({_policy_note(nan_policy, max_rollbacks)}).",
        f"non-finite gradients at loss_scale={scale}:\n" + format_report(report),
    ]
    if rec.get("skip_reason") == "non-finite update":
        parts.insert(1, _UPDATE_NOTE)
    batch_report = non_finite_report(batch)
    if batch_report:
        parts.append("non-finite batch inputs:\n" + format_report(batch_report))
    # A plain pytree state (a pure step over a dict) has no .params.
    param_report = non_finite_report(getattr(state_out, "params", state_out))
    if param_report:
        parts.append("non-finite parameters:\n" + format_report(param_report))
    if "location" in rec:
        parts.append("where (diagnostics.locate):\n" + format_location(location))
    raise NonFiniteError(
        "\n".join(parts),
        step=rec["step"],
        state=state_out,
        report=report,
        history=history,
        location=location,
    )


def _locate_failed(train_step, state_out, metrics, batch, pipeline):
    """`locate` of a non-finite step from its output state (params, optimizer
    and model state unchanged by a skipped step) at the loss scale it used.
    False when it cannot be located: not a `TrainStep`, or its input state
    donated to the step already queued after it."""
    if not isinstance(train_step, TrainStep) or not hasattr(train_step, "loss_fn"):
        return False
    leaves = jax.tree_util.tree_leaves(state_out)
    if pipeline and any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
        return False
    used = StaticLossScale(metrics["loss_scale"])
    return locate(train_step, state_out.replace(loss_scale=used), batch)
