"""Where is the NaN? Host-side reports on tensors, models and gradients,
mirroring `jaxstable.diagnostics`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = [
    "LeafReport",
    "check_params",
    "format_report",
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
