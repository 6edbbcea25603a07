"""Where is the NaN? Host-side reports on tensors, models and gradients,
mirroring `jaxstable.diagnostics`; and `CheckPoints` / `check_points`: named
checks a loss function computes in the step, read only when `fit` logs it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from _stablecore.diagnostics import FIRST_NON_FINITE_CHECK as FIRST_NON_FINITE_CHECK
from _stablecore.diagnostics import NON_FINITE_CHECKS as NON_FINITE_CHECKS
from _stablecore.diagnostics import PHASES as PHASES
from _stablecore.diagnostics import check_message as _check_message
from _stablecore.diagnostics import format_location as _format_location
from _stablecore.diagnostics import format_table as _format_table
from torchref._src.check_points import CheckPoints as CheckPoints
from torchref._src.check_points import check_points as check_points
from torchref._src.check_points import check_record as check_record
from torchref._src.check_points import format_checks as format_checks

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
    "non_finite_grad_report",
    "non_finite_report",
    "rng_snapshot",
]


class LeafReport(NamedTuple):
    """One tensor that holds a NaN or an Inf.

    Attributes:
        path: its name ("layer.0.weight" for a module, "/"-joined keys for
            nested mappings/sequences).
        nan_count: number of NaNs.
        inf_count: number of +-Infs.
        max_abs_finite: largest |x| over its finite elements; nan when no
            element is finite (the same in `jaxstable.diagnostics`).
        shape: tuple of ints.
        dtype: the dtype's name without the "torch." prefix ("float32").
    """

    path: str
    nan_count: int
    inf_count: int
    max_abs_finite: float
    shape: tuple[int, ...]
    dtype: str


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        return [(prefix, tree)]
    if isinstance(tree, torch.nn.Module):
        # state_dict: parameters AND buffers (batch-norm running stats).
        return [(f"{prefix}{k}", v) for k, v in tree.state_dict(keep_vars=True).items()]
    sep = "/" if prefix else ""
    if isinstance(tree, Mapping):
        return [
            leaf for k, v in tree.items() for leaf in _leaves(v, f"{prefix}{sep}{k}")
        ]
    if isinstance(tree, list | tuple):
        return [
            leaf for i, v in enumerate(tree) for leaf in _leaves(v, f"{prefix}{sep}{i}")
        ]
    return []  # ints, floats, None...: not tensors


def non_finite_report(tree: Any) -> list[LeafReport]:
    """A `LeafReport` for every tensor that holds a NaN or an Inf.

    Args:
        tree: a tensor, an `nn.Module` (parameters and buffers, by their
            `state_dict` names), a mapping (e.g. a `state_dict`, an optimizer
            `state_dict`) or a (nested) list/tuple of tensors. Non-tensor
            leaves are ignored. Integer tensors are never non-finite.

    Returns:
        List in traversal order; ``[]`` when everything is finite.

    Example:
        >>> import torch
        >>> tree = {"a": torch.ones(2), "b": torch.tensor([1.0, -3.0, float("inf")])}
        >>> r = non_finite_report(tree)
        >>> [(x.path, x.nan_count, x.inf_count, x.max_abs_finite) for x in r]
        [('b', 0, 1, 3.0)]
    """
    out = []
    for path, t in _leaves(tree):
        t = t.detach()
        if not t.is_floating_point() and not t.is_complex():
            continue
        finite = torch.isfinite(t)
        if bool(finite.all()):
            continue
        nan = int(torch.isnan(t).sum())
        fin = t[finite]
        max_abs = float(fin.abs().max().double()) if fin.numel() else float("nan")
        out.append(
            LeafReport(
                path=path,
                nan_count=nan,
                inf_count=int((~finite).sum()) - nan,
                max_abs_finite=max_abs,
                shape=tuple(t.shape),
                dtype=str(t.dtype).removeprefix("torch."),
            )
        )
    return out


def non_finite_grad_report(model: torch.nn.Module) -> list[LeafReport]:
    """`non_finite_report` of a model's gradients, by parameter name.

    Parameters without a gradient are skipped. Call it after `backward()`
    (and after `GradScaler.unscale_`) but before `zero_grad`.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(2, 1)
        >>> m(torch.tensor([[float("nan"), 1.0]])).sum().backward()
        >>> [r.path for r in non_finite_grad_report(m)]
        ['weight']
    """
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return non_finite_report(grads)


def format_report(report: list[LeafReport]) -> str:
    """A readable fixed-width table of a report.

    The layout is the same as `jaxstable.diagnostics.format_report`: a header
    ``path nan inf max|finite| shape dtype`` and one row per tensor, columns
    two spaces apart, numbers right-aligned, ``max|finite|`` with 6
    significant digits (``nan`` when no element is finite).

    Returns:
        A multi-line string, or ``"all finite"`` for an empty report.

    Example:
        >>> import torch
        >>> report = non_finite_report({"w": torch.tensor([float("nan"), 2.0])})
        >>> print(format_report(report))
        path  nan  inf  max|finite|  shape  dtype
        w       1    0            2  (2,)   float32
        >>> print(format_report([]))
        all finite
    """
    return _format_table(report)


def check_params(tree: Any) -> None:
    """Pre-flight check: raises if any parameter/buffer is NaN or Inf.

    Args:
        tree: anything `non_finite_report` accepts (usually the model).

    Raises:
        FloatingPointError: ``"k of n leaves is/are not finite: <names>"``
            and the `format_report` table (same text layout as
            `jaxstable.diagnostics.check_params`; n counts every tensor).

    Example:
        >>> import torch
        >>> check_params(torch.nn.Linear(2, 2))  # finite: returns None
        >>> check_params({"w": torch.tensor([float("nan")]), "b": torch.ones(1)})
        Traceback (most recent call last):
        ...
        FloatingPointError: 1 of 2 leaves is not finite: w
        path  nan  inf  max|finite|  shape  dtype
        w       1    0          nan  (1,)   float32
    """
    report = non_finite_report(tree)
    if report:
        raise FloatingPointError(_check_message(report, len(_leaves(tree))))


# ------------------------------------------------------------------ locate


class NonFiniteLocation(NamedTuple):
    """Where the first non-finite value of a train step appeared, and why.

    The same class, fields and texts as `jaxstable.diagnostics.NonFiniteLocation`.

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
        outermost module; ``named_modules()`` names, without the
        ``_orig_mod`` of `torch.compile`) for forward; parameter or buffer
        name for params, backward, loss_scale and update (a parameter the
        optimizer holds beyond the model: its ``param_names`` entry, else
        ``param_groups.G.params.I``); batch key for input; None where
        nothing applies (a plain loss function, a bare-array batch).
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
      >>> from torchref import diagnostics
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
    """Renders a `locate` result for people (same text as jaxstable's).

    Args:
      loc: a `NonFiniteLocation`, or None (a finite step).

    Returns:
      A few lines: phase, path, op and source; the cause; the offending
      value and the op's inputs. ``"all finite"`` for None.

    Example:
      >>> from torchref import diagnostics
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
    step: Any,
    batch: Any,
    *,
    loss_scale: float | None = None,
    rng_state: dict[str, Any] | None = None,
) -> NonFiniteLocation | None:
    """Re-runs one train step op by op and says where its first NaN/Inf arose.

    Off the hot path and without side effects: the forward and backward run
    on the step's own model under a `TorchDispatchMode` that sees every aten
    op after autocast's casts, then the update runs one parameter at a time
    on a copy of it and of its optimizer state (exact for per-parameter
    optimizers: every `torch.optim` one but LBFGS). Everything the step can
    touch is put back: a parameter an op writes to is copied first and
    restored, buffers (non-persistent ones too) are copied and restored,
    gradients are put back, and the global CPU/CUDA RNG and every
    `torch.Generator` a module holds are restored. The optimizer and
    GradScaler are not touched. Parameters the optimizer holds beyond the
    model (a loss-side temperature) are located too. A `torch.compile`d
    model runs eagerly here.

    Names: the path of the attribute a module was called through
    (``self.dec(x)`` is ``dec`` even when ``dec`` is ``enc``), else its
    ``named_modules()`` name; public methods of the user's own module
    classes count as calls (``model.encode(x)``). A backward op gets the
    forward line that made its autograd node (or the line of a user's
    ``autograd.Function.backward``) and that node's module: only nodes
    created during a module's call are its, so a ``sqrt`` in the loss code
    before the model call stays "in the loss". Origins are tracked per
    element, as in `jaxstable.diagnostics.locate`: a ``-inf`` written on
    purpose (``masked_fill``, a ``-inf`` buffer) never hides a new overflow
    in the same tensor; a softmax over a fully masked row (a
    ``MultiheadAttention`` whose ``key_padding_mask`` is all True) and a
    LayerNorm with ``eps=0`` on a constant row say so; an overflow is told
    from a division by zero by recomputing the op in float64 (an in-place
    op through its functional twin).

    Phases, in order: the batch, the parameters and buffers, the loss
    (forward pass, then loss code), the gradients at the scaler's current
    scale (and at scale 1 to tell a benign loss-scale overflow), then the
    optimizer update (with the step's clipping). A NaN made by an op and
    absorbed later (``1 / (1 + exp(50))`` is 0 in float16 although
    ``exp(50)`` is inf) counts only where it reaches the loss or a
    gradient. The same phases, paths and texts as
    `jaxstable.diagnostics.locate`.

    Re-runs: a finding is checked by running the step op by op once more
    from the same state and batch at the same loss scale (and a gradient
    overflow twice at scale 1 before it is called benign); when a re-run
    gives another result, the step is not deterministic (a flaky kernel,
    torch's own non-determinism, hardware) and ``detail`` says "did not
    reproduce on re-run: suspect non-determinism or hardware" instead of
    naming a cause
    (`NonFiniteLocation.reproduced`, ``reruns``, ``reproduced_count``).

    Cost, measured (``benchmarks/results/bench_locate_cpu.md``: a 64-layer
    MLP and a 12-layer transformer, Adam, on a loaded 2-core CPU): a
    forward overflow is located before the backward (0.2-0.3x a step there,
    whose float16 matmuls are slow on a CPU); a full re-run (a finite step,
    or a failure in the update) takes 1.5-3x a step. Memory: the re-run's
    activations and gradients, and copies of the buffers, of any parameter
    an op writes to and of the largest parameter with its optimizer state
    (1.1-1.3x the parameters on the MLP, whose step takes 1.6-1.8x). The
    times are of one run (measured before the re-runs): a non-finite step's
    re-run adds as much again (a benign overflow's, three times).

    Args:
        step: a `torchref.train.TrainStep`, in the state the failing step
            started from (``fit`` calls it on the state after the step,
            which a non-finite step leaves unchanged but for the scaler's
            backed-off scale).
        batch: the step's batch.
        loss_scale: the loss scale to re-run at; None: the scaler's current
            one (`fit` passes the scale the failing step used, as the
            scaler has backed off since).
        rng_state: what `rng_snapshot` returned just before the step, so
            that it is re-run with the dropout masks it drew (`fit` does
            so); None: the generators as they are now.

    Returns:
        None when every value of the step is finite, else a
        `NonFiniteLocation` (render it with `format_location`).

    Raises:
        TypeError: ``step`` is not a `torchref.train.TrainStep`, or
            ``rng_state`` is not what `rng_snapshot` returns.

    Example:
        >>> import torch
        >>> from torchref import diagnostics, train
        >>> class Probs(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.full((3,), 0.5))
        ...     def forward(self, b):
        ...         return torch.where(b > 0, self.w, 0.0)   # a zero probability
        >>> model = Probs()
        >>> step = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                        lambda m, b: -torch.log(m(b)).sum())
        >>> loc = diagnostics.locate(step, torch.tensor([1.0, 0.0, 1.0]))
        >>> loc.phase, loc.op, loc.detail
        ('loss', 'log', 'log of 0 in the loss')
        >>> diagnostics.locate(step, torch.ones(3)) is None
        True
    """
    from torchref._src import _locate, locate_sharded  # imported when used
    from torchref._src.locate_shards import distributed_kind

    _locate.check_locate_args(step, rng_state)
    if distributed_kind(step) is not None:  # DDP, FSDP2: every rank at once
        scale = _locate.scale_of(step) if loss_scale is None else float(loss_scale)
        return locate_sharded.locate_sharded(
            step, batch, NonFiniteLocation, scale, rng_state
        )
    return _locate.locate(step, batch, NonFiniteLocation, loss_scale, rng_state)


def rng_snapshot(step: Any) -> dict[str, Any]:
    """The random state a step starts from, for `locate` to re-run it with.

    A dropout mask is drawn from hidden generators: the global CPU one, each
    initialised CUDA device's, and any `torch.Generator` a module holds as an
    attribute. `locate` runs after the step, when they have moved on, so a
    NaN that depends on the mask (``log`` of a dropped activation) may not
    come back: take a snapshot before the step and pass it as ``rng_state``
    (`fit` does so for every step it may locate). Cost: a copy of the CPU
    generator's 5 kB state and 16 bytes per CUDA device or Philox
    generator; no device sync.

    Args:
        step: a `torchref.train.TrainStep` (or an `nn.Module`).

    Returns:
        ``{"cpu": ByteTensor, "cuda": list or None, "generators": [(generator,
        state), ...]}``; `locate` restores every generator afterwards.

    Example:
        >>> import torch
        >>> from torchref import diagnostics, train
        >>> class Drop(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.ones(4))
        ...         self.drop = torch.nn.Dropout(0.5)
        ...     def forward(self, x):
        ...         return torch.log(self.drop(self.w * x))   # log(0) where dropped
        >>> model = Drop()
        >>> step = train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                        lambda m, b: m(b).sum())
        >>> _ = torch.manual_seed(3)
        >>> snap = diagnostics.rng_snapshot(step)
        >>> step(torch.ones(4))["finite"]
        False
        >>> loc = diagnostics.locate(step, torch.ones(4), rng_state=snap)
        >>> loc.phase, loc.path, loc.detail
        ('forward', '', 'log of 0 in the outermost module')
    """
    from torchref._src import _locate  # the engine, imported when used

    return _locate.rng_snapshot(step)
