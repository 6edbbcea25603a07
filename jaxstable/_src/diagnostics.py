"""Where did the NaN come from: per-leaf reports of non-finite values.

These are host-side tools (they read arrays back to the host); call them
outside `jax.jit`, e.g. when a training loop has stopped on a non-finite step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["LeafReport", "check_params", "format_report", "non_finite_report"]


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
    if not report:
        return "all finite"
    header = ("path", "nan", "inf", "max|finite|", "shape", "dtype")
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
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    right = {1, 2, 3}  # numbers right-aligned

    def fmt(cells):
        out = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return "\n".join([fmt(header), *(fmt(r) for r in rows)])


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


def _check_message(report: list[LeafReport], n_leaves: int) -> str:
    # "1 of 2 leaves is not finite: ['w']" + the table; same text as torchref.
    noun = "leaf" if n_leaves == 1 else "leaves"
    verb = "is" if len(report) == 1 else "are"
    names = ", ".join(r.path for r in report)
    return (
        f"{len(report)} of {n_leaves} {noun} {verb} not finite: {names}\n"
        f"{format_report(report)}"
    )
