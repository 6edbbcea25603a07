"""Where did the NaN come from: per-leaf reports of non-finite values.

These are host-side tools (they read arrays back to the host); call them
outside `jax.jit`, e.g. when a training loop has stopped on a non-finite step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["LeafReport", "check_params", "format_report", "non_finite_report"]


class LeafReport(NamedTuple):
    """Non-finite statistics of one pytree leaf.

    Attributes:
      path: the leaf's path, as `jax.tree_util.keystr` writes it (``['w']``).
      nan_count: number of NaN elements.
      inf_count: number of +-Inf elements.
      max_abs_finite: largest |x| among the finite elements (nan if none is
        finite).
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

    Reads every leaf to the host (not for use inside `jax.jit`). Integer and
    boolean leaves are never reported.

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
        if not (np.issubdtype(arr.dtype, np.inexact) or arr.dtype.name == "bfloat16"):
            continue
        dtype = arr.dtype.name
        # bfloat16 (an ml_dtypes type) is widened so numpy's ufuncs apply.
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

    Args:
      report: the list returned by `non_finite_report`.

    Returns:
      A multi-line string: one header row and one row per leaf, or
      ``"all finite"`` for an empty report.

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
            f"{r.max_abs_finite:.4g}",
            str(r.shape),
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
      FloatingPointError: naming every non-finite leaf with its counts (the
        `format_report` table).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import diagnostics
      >>> diagnostics.check_params({"w": jnp.ones(2)})
      >>> try:
      ...     diagnostics.check_params({"w": jnp.array([jnp.inf, 1.0])})
      ... except FloatingPointError as e:
      ...     print(str(e).splitlines()[0])
      1 of 1 leaf is not finite: ['w']
    """
    report = non_finite_report(tree)
    if report:
        n = len(jax.tree_util.tree_leaves(tree))
        names = ", ".join(r.path for r in report)
        noun = "leaf is" if len(report) == 1 else "leaves are"
        raise FloatingPointError(
            f"{len(report)} of {n} {noun} not finite: {names}\n{format_report(report)}"
        )
