"""Where is the NaN? Host-side reports on tensors, models and gradients,
mirroring `jaxstable.diagnostics`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = [
    "PHASES",
    "LeafReport",
    "NonFiniteLocation",
    "check_params",
    "format_location",
    "format_report",
    "locate",
    "non_finite_grad_report",
    "non_finite_report",
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
    if not report:
        return "all finite"
    head = ("path", "nan", "inf", "max|finite|", "shape", "dtype")
    rows = [
        (
            r.path,
            str(r.nan_count),
            str(r.inf_count),
            f"{r.max_abs_finite:.6g}",
            str(tuple(r.shape)),
            r.dtype,
        )
        for r in report
    ]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    right = {1, 2, 3}  # numbers right-aligned

    def line(row: tuple[str, ...]) -> str:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return "\n".join([line(head), *map(line, rows)])


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


def _check_message(report: list[LeafReport], n_leaves: int) -> str:
    # "1 of 2 leaves is not finite: w" + the table; same text as jaxstable.
    noun = "leaf" if n_leaves == 1 else "leaves"
    verb = "is" if len(report) == 1 else "are"
    names = ", ".join(r.path for r in report)
    return (
        f"{len(report)} of {n_leaves} {noun} {verb} not finite: {names}\n"
        f"{format_report(report)}"
    )


# ------------------------------------------------------------------ locate
# The phases of a step in the order `locate` tries them (NonFiniteLocation.phase).
PHASES = ("input", "params", "forward", "loss", "backward", "loss_scale", "update")


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
        outermost module; ``named_modules()`` names) for forward; parameter
        or buffer name (``state_dict`` names) for params,
        backward, loss_scale and update; batch key for input; None where
        nothing applies (a plain loss function, a bare-array batch).
      op: the operation whose output was first non-finite from finite inputs
        (``"exp"``, ``"log"``, ``"div"``, ``"matmul"``, ``"conv"``, ...), or None.
      source: ``file:line in function`` of the user's code that issued it.
      detail: the cause in one line, in terms of the dtype's limits.
      shape, dtype, nan_count, inf_count, max_abs: the offending value
        (``max_abs`` over its finite elements, nan when none).
      input_shapes, input_dtypes, input_max_abs: those of the op's inputs.

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


def _max_finite(m: float) -> str:
    # nan: the value holds no finite element at all.
    return "none (no finite value)" if m != m else f"{m:.3g}"


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
    if loc is None:
        return "all finite"
    head = f"non-finite value first in phase {loc.phase!r}"
    if loc.path is not None:
        head += f" at {loc.path or '(the outermost module)'}"
    if loc.op is not None:
        head += f", op {loc.op}"
    if loc.source is not None:
        head += f" at {loc.source}"
    lines = [head, f"  cause: {loc.detail}"]
    if loc.shape is not None:
        lines.append(
            f"  value: {loc.dtype}{tuple(loc.shape)} {loc.nan_count} NaN "
            f"{loc.inf_count} Inf, max |finite| {_max_finite(loc.max_abs)}"
        )
    if loc.input_shapes:
        ins = "; ".join(
            f"{d}{tuple(s)} max |finite| {_max_finite(m)}"
            for s, d, m in zip(
                loc.input_shapes, loc.input_dtypes, loc.input_max_abs, strict=True
            )
        )
        lines.append(f"  inputs: {ins}")
    return "\n".join(lines)


def locate(
    step: Any, batch: Any, *, loss_scale: float | None = None
) -> NonFiniteLocation | None:
    """Re-runs one train step op by op and says where its first NaN/Inf arose.

    Off the hot path and without side effects: the forward and backward run
    on the step's model (its parameters, buffers and gradients are put back
    afterwards; the update runs on a deep copy of model and optimizer
    together) under a `TorchDispatchMode` that sees every aten op
    after autocast's casts; forward hooks give the ``named_modules()`` path,
    autograd's anomaly-mode tracebacks the source line of a backward op. The
    model, optimizer, GradScaler and the RNG state are left as they were.
    Phases are tried in order: the batch, the parameters and buffers, the
    loss (forward pass, then loss code), the gradients at the scaler's
    current scale (and at scale 1 to tell a benign loss-scale overflow),
    then the optimizer update (with the step's clipping). A NaN made by an
    op and absorbed later (``1 / (1 + exp(50))`` is 0 in float16 although
    ``exp(50)`` is inf) counts only where it reaches the loss or a gradient.
    The same phases, paths and texts as `jaxstable.diagnostics.locate`.

    Args:
        step: a `torchref.train.TrainStep`, in the state the failing step
            started from (``fit`` calls it on the state after the step,
            which a non-finite step leaves unchanged but for the scaler's
            backed-off scale).
        batch: the step's batch.
        loss_scale: the loss scale to re-run at; None: the scaler's current
            one (`fit` passes the scale the failing step used, as the
            scaler has backed off since).

    Returns:
        None when every value of the step is finite, else a
        `NonFiniteLocation` (render it with `format_location`).

    Raises:
        TypeError: ``step`` is not a `torchref.train.TrainStep`.

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
    from torchref._src import _locate  # the engine, imported when used

    return _locate.locate(step, batch, NonFiniteLocation, loss_scale)
