"""The train step's arguments checked into one frozen `StepSpec`, and what
the step refuses when it runs: a params dtype its policy does not store, a
non-scalar loss, an optimizer that accumulates itself.

Host-side checks only (shapes, dtypes, types and the optimizer state's
structure): none adds an operation to the compiled step. The messages are
those of `torchref.train.TrainStep` where the two sides share a check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _stablecore.checks import check_microbatch_drop
from _stablecore.checks import check_microbatches as _core_check_microbatches
from jaxstable._src.accumulate import AccumulateGradientsState
from jaxstable._src.precision import get_policy

__all__ = [
    "StepSpec",
    "check_loss",
    "check_microbatches",
    "check_no_accumulation",
    "check_param_dtypes",
    "step_spec",
]


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What `make_train_step` was given, checked: everything the step reads
    besides its state and batch.

    Attributes:
      loss_fn, has_aux, has_state, axis_name, microbatch_weight: as given.
      policy: the policy parsed to a `jmp.Policy`, or None.
      policy_spec: the policy as given (a string or a `jmp.Policy`), for
        messages.
      microbatches: None or the number of micro-batches, an int.
      drop_non_finite_microbatches: as given, checked to be a bool.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import train
      >>> step = train.make_train_step(lambda p, b: jnp.sum(p * b),
      ...                              microbatches=2)
      >>> step.spec.microbatches, step.spec.policy is None
      (2, True)
    """

    loss_fn: Callable
    has_aux: bool = False
    has_state: bool = False
    policy: Any = None
    policy_spec: Any = None
    axis_name: str | None = None
    microbatches: int | None = None
    drop_non_finite_microbatches: bool = False
    microbatch_weight: Callable | None = None


def step_spec(
    loss_fn: Callable,
    *,
    has_aux: Any,
    has_state: Any,
    policy: Any,
    axis_name: Any,
    microbatches: Any,
    drop_non_finite_microbatches: Any,
    microbatch_weight: Callable | None,
) -> StepSpec:
    """The arguments of `jaxstable.train.make_train_step`, checked (TypeError
    or ValueError naming the argument and the fix), as a `StepSpec`."""
    for name, flag in (("has_aux", has_aux), ("has_state", has_state)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    if axis_name is not None and not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be None or a str, got {axis_name!r}")
    k = check_microbatches(microbatches)
    drop = check_microbatch_drop(drop_non_finite_microbatches, microbatch_weight, k)
    if drop and axis_name is not None:
        raise ValueError(
            "drop_non_finite_microbatches=True is not supported with axis_name "
            f"({axis_name!r}) yet: run the step under plain jax.jit with "
            "shardings (jaxstable.distributed), where XLA makes the reductions "
            "global itself"
        )
    return StepSpec(
        loss_fn=loss_fn,
        has_aux=has_aux,
        has_state=has_state,
        policy=None if policy is None else get_policy(policy),
        policy_spec=policy,
        axis_name=axis_name,
        microbatches=k,
        drop_non_finite_microbatches=drop,
        microbatch_weight=microbatch_weight,
    )


def check_microbatches(microbatches: Any) -> int | None:
    """None, or the number of micro-batches as an int >= 1 (TypeError or
    ValueError otherwise, the texts of `torchref.train.TrainStep`)."""
    checked = _core_check_microbatches(microbatches, int | np.integer)
    return None if checked is None else int(checked)


def check_loss(loss: Any) -> jax.Array:
    """The loss as a float32 scalar; ValueError for any other shape."""
    loss = jnp.asarray(loss, jnp.float32)
    if loss.shape != ():
        # Same text as torchref.train.TrainStep.
        raise ValueError(
            f"loss_fn must return a scalar (0-d) loss, got shape {loss.shape}; "
            "reduce it, e.g. with .mean()"
        )
    return loss


def check_param_dtypes(params: Any, pol: Any, spec: Any) -> None:
    """Refuses a policy whose parameter dtype is not that of ``params``.

    The step casts params to the compute dtype and never to the policy's
    parameter dtype: a single-dtype policy such as ``"bf16"`` (params,
    compute AND output bfloat16) over float32 params would otherwise be
    taken silently as "float32 params computed in bfloat16".
    """
    want = jnp.dtype(pol.param_dtype)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = jnp.result_type(x)
        if jnp.issubdtype(dtype, jnp.floating) and dtype != want:
            have, compute = dtype.name, jnp.dtype(pol.compute_dtype).name
            mixed = f" or 'mixed_{compute}'" if have == "float32" else ""
            # Same text as torchref.train.TrainStep (leaf named its way).
            raise ValueError(
                f"policy {spec!r} stores params in {want.name}, but params "
                f"leaf {jax.tree_util.keystr(path) or '(the params)'} is {have} "
                "(a single dtype name such as 'bf16' sets params, compute and "
                f"output). For {have} params computed in {compute} say "
                f"'params={have},compute={compute},output=float32'{mixed}; for "
                f"{want.name} params, cast them first. Policy grammar: one dtype "
                "name for params, compute and output (bf16, f16, f32, ...), "
                "mixed_float16 or mixed_bfloat16 (float32 params and output), or "
                "comma-separated key=dtype pairs with keys params|p, compute|c, "
                "output|o"
            )


def _is_accumulation(x: Any) -> bool:
    return isinstance(x, optax.MultiStepsState | AccumulateGradientsState)


def check_no_accumulation(opt_state: Any) -> None:
    """ValueError when the optimizer state holds an `optax.MultiSteps` or
    `accumulate_gradients` state (see `_ACCUMULATION_IN_TX`)."""
    leaves = jax.tree_util.tree_leaves(opt_state, is_leaf=_is_accumulation)
    if any(_is_accumulation(node) for node in leaves):
        raise ValueError(_ACCUMULATION_IN_TX)


_ACCUMULATION_IN_TX = (
    "the optimizer accumulates gradients itself (optax.MultiSteps or "
    "transforms.accumulate_gradients): inside make_train_step each call would "
    "be one micro-batch, so the loss scale would move per micro-batch and a "
    "non-finite micro-batch would be dropped (its window stretched) instead of "
    "skipping the whole step; with MultiSteps around the skip a NaN stays in "
    "its accumulator for good. Give the step the plain optimizer and let it "
    "accumulate: make_train_step(loss_fn, microbatches=k) with each batch "
    "holding the k micro-batches along its leading axis (one check, one clip, "
    "one skip decision and one loss-scale update per optimizer step, as "
    "torch's GradScaler accumulation recipe)"
)
