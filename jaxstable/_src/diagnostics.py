"""Where did the NaN come from: per-leaf reports of non-finite values.

These are host-side tools (they read arrays back to the host); call them
outside `jax.jit`, e.g. when a training loop has stopped on a non-finite step.
The exception is `CheckPoints` / `check_points`: named checks a loss function
computes inside the jitted step, read on the host only when `fit` logs it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from _stablecore.diagnostics import FIRST_NON_FINITE_CHECK as FIRST_NON_FINITE_CHECK
from _stablecore.diagnostics import NON_FINITE_CHECKS as NON_FINITE_CHECKS
from _stablecore.diagnostics import PHASES as PHASES
from _stablecore.diagnostics import check_message as _check_message
from _stablecore.diagnostics import format_location as _format_location
from _stablecore.diagnostics import format_table as _format_table
from jaxstable._src.check_points import CheckPoints as CheckPoints
from jaxstable._src.check_points import check_points as check_points
from jaxstable._src.check_points import check_record as check_record
from jaxstable._src.check_points import format_checks as format_checks

__all__ = [
    "PHASES",
    "CheckPoints",
    "LeafReport",
    "NonFiniteLocation",
    "check_params",
    "check_points",
    "check_record",
    "format_checks",
    "format_location",
    "format_report",
    "locate",
    "non_finite_report",
]


class LeafReport(NamedTuple):
    """Non-finite statistics of one pytree leaf.

    Attributes:
      path: the leaf's path, as `jax.tree_util.keystr` writes it (``['w']``).
      nan_count: number of NaN elements.
      inf_count: number of +-Inf elements.
      max_abs_finite: largest |x| among the finite elements; nan when no
        element is finite (the same in `torchref.diagnostics`).
      shape: the leaf's shape.
      dtype: the leaf's dtype name.
    """

    path: str
    nan_count: int
    inf_count: int
    max_abs_finite: float
    shape: tuple[int, ...]
    dtype: str


def non_finite_report(tree: Any) -> list[LeafReport]:
    """Lists every leaf of `tree` holding a NaN or an Inf, with counts.

    Reads every leaf to the host (not for use inside `jax.jit`). Every
    floating dtype is checked (float64/32/16, bfloat16 and the float8
    variants) and complex ones too; integer and boolean leaves are never
    reported.

    Args:
      tree: a pytree of arrays (params, gradients, a batch, ...).

    Returns:
      A list of `LeafReport`, in `jax.tree_util` leaf order; empty when all is
      finite.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import diagnostics
      >>> w = jnp.array([1.0, jnp.nan, jnp.inf, -3.0])
      >>> tree = {"dense": {"w": w}, "b": jnp.ones(2)}
      >>> for r in diagnostics.non_finite_report(tree):
      ...     print(r.path, r.nan_count, r.inf_count, r.max_abs_finite)
      ['dense']['w'] 1 1 3.0
    """
    report = []
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in leaves:
        arr = np.asarray(jax.device_get(leaf))
        # jnp.issubdtype knows the ml_dtypes types (bfloat16, float8_*), which
        # numpy's own np.inexact does not.
        if not jnp.issubdtype(arr.dtype, jnp.inexact):
            continue
        dtype = arr.dtype.name
        # ml_dtypes leaves (bfloat16, float8_*) are widened so numpy's ufuncs
        # apply; the widening is exact.
        wide = arr.astype(np.complex128 if np.iscomplexobj(arr) else np.float64)
        nan = np.isnan(wide)
        inf = np.isinf(wide)
        n_nan, n_inf = int(nan.sum()), int(inf.sum())
        if n_nan == 0 and n_inf == 0:
            continue
        finite = np.abs(wide[~(nan | inf)])
        max_abs = float(finite.max()) if finite.size else float("nan")
        report.append(
            LeafReport(
                path=jax.tree_util.keystr(path),
                nan_count=n_nan,
                inf_count=n_inf,
                max_abs_finite=max_abs,
                shape=tuple(arr.shape),
                dtype=dtype,
            )
        )
    return report


def format_report(report: list[LeafReport]) -> str:
    """Formats a `non_finite_report` as a readable table.

    The layout is the same as `torchref.diagnostics.format_report`: a header
    ``path nan inf max|finite| shape dtype`` and one row per leaf, columns
    two spaces apart, numbers right-aligned, ``max|finite|`` with 6
    significant digits (``nan`` when no element is finite).

    Args:
      report: the list returned by `non_finite_report`.

    Returns:
      A multi-line string, or ``"all finite"`` for an empty report.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import diagnostics
      >>> rep = diagnostics.non_finite_report({"w": jnp.array([jnp.nan, 2.0])})
      >>> print(diagnostics.format_report(rep))
      path   nan  inf  max|finite|  shape  dtype
      ['w']    1    0            2  (2,)   float32
      >>> diagnostics.format_report([])
      'all finite'
    """
    return _format_table(report)


def check_params(tree: Any) -> None:
    """Pre-flight check: raises if any leaf of `tree` holds a NaN or an Inf.

    Run it on freshly initialised or restored parameters before training: a
    NaN already in the weights is otherwise reported many steps later as a
    non-finite gradient.

    Args:
      tree: a pytree of arrays.

    Raises:
      FloatingPointError: ``"k of n leaves is/are not finite: <paths>"`` and
        the `format_report` table (same text layout as
        `torchref.diagnostics.check_params`).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import diagnostics
      >>> diagnostics.check_params({"w": jnp.ones(2)})
      >>> diagnostics.check_params({"w": jnp.array([jnp.inf, 1.0]), "b": jnp.ones(2)})
      Traceback (most recent call last):
      ...
      FloatingPointError: 1 of 2 leaves is not finite: ['w']
      path   nan  inf  max|finite|  shape  dtype
      ['w']    0    1            1  (2,)   float32
    """
    report = non_finite_report(tree)
    if report:
        raise FloatingPointError(
            _check_message(report, len(jax.tree_util.tree_leaves(tree)))
        )


# ------------------------------------------------------------------ locate


class NonFiniteLocation(NamedTuple):
    """Where the first non-finite value of a train step appeared, and why.

    The same class, fields and texts as `torchref.diagnostics.NonFiniteLocation`.

    Attributes:
      phase: one of ``PHASES``: ``"input"`` (the batch), ``"params"``
        (parameters or model state non-finite before the step), ``"forward"``
        (inside a module call, its inputs finite), ``"loss"`` (in the loss
        code outside any module), ``"backward"`` (a gradient, the loss
        finite), ``"loss_scale"`` (gradients non-finite at the step's loss
        scale but finite at scale 1: benign, the scale backs off),
        ``"update"`` (finite gradients, non-finite new parameters, optimizer
        state or model state).
      path: dotted module path (``"decoders.0.conv1"``; ``""`` is the
        outermost module) for forward; parameter or state path for params,
        backward, loss_scale and update (``"params"`` for parameters that
        are one bare array); batch key for input; None where nothing applies
        (a plain loss function, a bare-array batch).
      op: the operation whose output was first non-finite from finite inputs
        (``"exp"``, ``"log"``, ``"div"``, ``"matmul"``, ``"conv"``, ...), or None.
      source: ``file:line in function`` of the user's code that issued it.
      detail: the cause in one line, in terms of the dtype's limits.
      shape, dtype, nan_count, inf_count, max_abs: the offending value
        (``max_abs`` over its finite elements, nan when none).
      input_shapes, input_dtypes, input_max_abs: those of the op's inputs.
      reproduced: whether every re-run agreed with the run it repeated (the
        forward, backward and update are re-run from the same state and batch
        at the same loss scale: once, and once more at scale 1 before an
        overflow is called benign); None where nothing was re-run (phases
        ``"input"`` and ``"params"`` read values, they compute none). When
        False, ``detail`` says "did not reproduce on re-run: suspect
        non-determinism or hardware" and names no cause; phase, path, op and
        value are those of the first run that went non-finite.
      reruns: how many re-runs repeated an earlier run (0: none).
      reproduced_count: how many of them gave the result of the run they
        repeated (non-finite at the same phase and leaf, or finite again).

    Example:
      >>> from jaxstable import diagnostics
      >>> loc = diagnostics.NonFiniteLocation(
      ...     phase="input", path="image", op=None, source=None,
      ...     detail="NaN in batch['image'] (3 of 12288 values)")
      >>> loc.phase in diagnostics.PHASES, loc._asdict()["path"]  # a JSON record
      (True, 'image')
    """

    phase: str
    path: str | None
    op: str | None
    source: str | None
    detail: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    nan_count: int = 0
    inf_count: int = 0
    max_abs: float = float("nan")
    input_shapes: tuple[tuple[int, ...], ...] = ()
    input_dtypes: tuple[str, ...] = ()
    input_max_abs: tuple[float, ...] = ()
    reproduced: bool | None = None
    reruns: int = 0
    reproduced_count: int = 0


def format_location(loc: NonFiniteLocation | None) -> str:
    """Renders a `locate` result for people (same text as torchref's).

    Args:
      loc: a `NonFiniteLocation`, or None (a finite step).

    Returns:
      A few lines: phase, path, op and source; the cause; the offending
      value and the op's inputs. ``"all finite"`` for None.

    Example:
      >>> from jaxstable import diagnostics
      >>> loc = diagnostics.NonFiniteLocation(
      ...     phase="loss", path=None, op="log", source="train.py:12 in loss_fn",
      ...     detail="log of 0 in the loss", shape=(4,), dtype="float32",
      ...     inf_count=1, max_abs=2.3, input_shapes=((4,),),
      ...     input_dtypes=("float32",), input_max_abs=(0.9,))
      >>> print(diagnostics.format_location(loc))
      non-finite value first in phase 'loss', op log at train.py:12 in loss_fn
        cause: log of 0 in the loss
        value: float32(4,) 0 NaN 1 Inf, max |finite| 2.3
        inputs: float32(4,) max |finite| 0.9
      >>> diagnostics.format_location(None)
      'all finite'
    """
    return _format_location(loc)


def locate(
    step: Any, state: Any, batch: Any, *, finite: bool | None = None
) -> NonFiniteLocation | None:
    """Re-runs one train step op by op and says where its first NaN/Inf arose.

    It answers about the step that ran: the compiled step is run once more
    on ``(state, batch)`` (without donation; a ``jit=False`` step ran
    eagerly, as the re-run does), and when it was applied with a finite
    loss the answer is None, even where an eager re-run would meet a NaN
    that XLA's rewrites avoid (``x * mask`` with a boolean mask becomes a
    select). Otherwise, off the hot path, the loss is traced to a jaxpr and
    evaluated equation by equation, eagerly, keeping only live values; the
    jitted step and its compiled HLO are untouched.

    Names: each Flax module method call is named by the attribute path it
    went through, as torch's ``named_modules()`` (``self.dec(x)`` is ``dec``
    even when ``dec`` is ``enc``; ``m.head(m.backbone(x))`` written in the
    loss is ``head``; ``model.encode(x)`` is the model; modules inside
    ``nnx.remat`` and ``nnx.scan`` keep their names); the op inside a
    ``cond``, ``while`` or ``scan`` body is named, and a ``custom_vjp``
    backward at its own line. Origins are tracked per element: a ``-inf``
    written on purpose (an attention mask, a model state holding ``-inf``
    only) never hides a new overflow in the same array, and the NaN of a
    softmax over a fully masked row is named as such. An overflow is told
    from a division by zero by recomputing the op in float64 (float16,
    bfloat16 and float32 alike).

    Phases, in order: the batch, the parameters and model state, the loss
    (forward pass, then loss code; the backward is not run when the loss is
    non-finite), the gradients at the step's loss scale (and at scale 1 to
    tell a benign loss-scale overflow), then the optimizer update
    (``state.tx.update``, eagerly, with the selects of a non-finite guard
    such as `skip_non_finite` taking the new value: what the step would
    have written). A NaN made by an op and absorbed later (``1 / (1 +
    exp(50))`` is 0 in float16 although ``exp(50)`` is inf) counts only
    where it reaches the loss or a gradient.

    Re-runs: a finding is checked by running the step op by op once more
    from the same state and batch at the same loss scale (and a gradient
    overflow twice at scale 1 before it is called benign); when a re-run
    gives another result, the step is not deterministic (a flaky kernel or
    callback, hardware) and ``detail`` says "did not reproduce on re-run:
    suspect non-determinism or hardware" instead of naming a cause
    (`NonFiniteLocation.reproduced`, ``reruns``, ``reproduced_count``).

    Cost, measured (``benchmarks/results/bench_locate_cpu.md``: a 64-layer
    MLP and a 12-layer transformer, Adam, on a loaded 2-core CPU): about one
    step when the compiled step is finite; 1.4-4.3x a step for a forward
    overflow (the backward is not run); 6-15x for a failure in the update
    (forward, backward and update op by op: the most it does). The first
    call in a process also traces the step and compiles each distinct eager
    op once (5-26 s there); later calls on the same step reuse the trace.
    These are one op-by-op run (measured before the re-runs): a non-finite
    step's re-run adds as much again (a benign overflow's, three times).
    Memory: about what the compiled step allocates (0.7-1.3x its
    temporaries and outputs there), not a multiple of the parameters.

    Args:
      step: a `jaxstable.train.TrainStep` from `make_train_step` (it keeps
        the loss function, policy, has_state and has_aux).
      state: the `TrainState` the step was called with (for a step that
        came back non-finite: its input state, or its output state with the
        loss scale it used, as `fit` does).
      batch: the step's batch.
      finite: the step's ``metrics["finite"]`` when known (`fit` passes
        False: it locates skipped steps); None runs the compiled step to
        learn it; False also locates a step XLA computed finite.

    Returns:
      None when the step was applied with a finite loss (or every value of
      its eager re-run is finite), else a `NonFiniteLocation` (render it
      with `format_location`).

    Raises:
      TypeError: ``step`` is not a `TrainStep` made by `make_train_step`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable import diagnostics, train
      >>> def loss_fn(p, b):
      ...     probs = jnp.where(b > 0, p["w"], 0.0)   # a zero probability
      ...     return -jnp.sum(jnp.log(probs))
      >>> step = train.make_train_step(loss_fn)
      >>> state = train.TrainState.create(params={"w": jnp.full(3, 0.5)},
      ...                                 optimizer=optax.sgd(0.1))
      >>> loc = diagnostics.locate(step, state, jnp.array([1.0, 0.0, 1.0]))
      >>> loc.phase, loc.op, loc.detail
      ('loss', 'log', 'log of 0 in the loss')
      >>> diagnostics.locate(step, state, jnp.ones(3)) is None
      True
    """
    from jaxstable._src import _locate, locate_sharded  # imported when used
    from jaxstable._src.locate_shards import is_sharded

    if is_sharded((state, batch)):  # split over processes: nothing gathered
        return locate_sharded.locate_sharded(
            step, state, batch, NonFiniteLocation, finite
        )
    return _locate.locate(step, state, batch, NonFiniteLocation, finite)
