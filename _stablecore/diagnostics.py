"""The framework-free parts of `diagnostics`: the texts of reports, check
points and locations (the same text in `jaxstable.diagnostics` and
`torchref.diagnostics`, which keep the public functions and their examples)."""

from __future__ import annotations

import ast
from typing import Any

# The phases of a step in the order `locate` tries them (NonFiniteLocation.phase).
PHASES = ("input", "params", "forward", "loss", "backward", "loss_scale", "update")
# Names of the record keys `fit` writes for the check points of a step:
# checks['<name>']['finite'|'max_abs'], then these two.
NON_FINITE_CHECKS = "non_finite_checks"
FIRST_NON_FINITE_CHECK = "first_non_finite_check"


def format_table(report: list) -> str:
    """`format_report`'s table of a report (a list of `LeafReport`)."""
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


def check_message(report: list, n_leaves: int) -> str:
    # "1 of 2 leaves is not finite: ['w']" + the table.
    noun = "leaf" if n_leaves == 1 else "leaves"
    verb = "is" if len(report) == 1 else "are"
    names = ", ".join(r.path for r in report)
    return (
        f"{len(report)} of {n_leaves} {noun} {verb} not finite: {names}\n"
        f"{format_table(report)}"
    )


def max_finite(m: float) -> str:
    # nan: the value holds no finite element at all.
    return "none (no finite value)" if m != m else f"{m:.3g}"


def format_location(loc: Any) -> str:
    """`format_location`'s text of a `NonFiniteLocation` (or None)."""
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
            f"{loc.inf_count} Inf, max |finite| {max_finite(loc.max_abs)}"
        )
    if loc.input_shapes:
        ins = "; ".join(
            f"{d}{tuple(s)} max |finite| {max_finite(m)}"
            for s, d, m in zip(
                loc.input_shapes, loc.input_dtypes, loc.input_max_abs, strict=True
            )
        )
        lines.append(f"  inputs: {ins}")
    return "\n".join(lines)


def check_name(name: Any, used: tuple[str, ...]) -> None:
    if not isinstance(name, str):
        raise TypeError(f"a check point name must be a string, got {name!r}")
    if not name:
        raise ValueError("a check point name must be a non-empty string")
    if name in used:
        raise ValueError(
            f"check point name {name!r} is already used; names so far, in order: "
            f"{list(used)}"
        )


def record_entries(names, finite, max_abs) -> dict[str, Any]:
    # Per point, then the summary keys.
    rec: dict[str, Any] = {}
    for name, ok, big in zip(names, finite, max_abs, strict=True):
        rec[f"checks[{name!r}]['finite']"] = ok
        rec[f"checks[{name!r}]['max_abs']"] = big
    bad = [n for n, ok in zip(names, finite, strict=True) if not ok]
    rec[NON_FINITE_CHECKS] = bad
    rec[FIRST_NON_FINITE_CHECK] = bad[0] if bad else None
    return rec


def record_points(record: dict[str, Any]) -> list[tuple[str, bool, float]]:
    # (name, finite, max_abs) of the checks['...'] keys of a record, in order.
    out = []
    for key, value in record.items():
        if key.startswith("checks[") and key.endswith("]['finite']"):
            name = ast.literal_eval(key[len("checks[") : -len("]['finite']")])
            big = record.get(f"checks[{name!r}]['max_abs']")
            out.append((name, bool(value), float("nan") if big is None else big))
    return out


def format_points(points: list[tuple[str, bool, float]]) -> str:
    if not points:
        return "no check points"
    parts = [
        f"{n} finite (max|x| {m:.3g})" if ok else f"{n} NON-FINITE"
        for n, ok, m in points
    ]
    bad = [n for n, ok, _ in points if not ok]
    tail = f"first non-finite: {bad[0]}" if bad else "all finite"
    return ", ".join(parts) + "; " + tail


class PointsView:
    """Lookup by name over a check-point collector's parallel ``names``,
    ``finite`` and ``max_abs`` (both frameworks' ``CheckPoints``).

    Example:
        >>> class Points(PointsView):
        ...     names, finite, max_abs = ("x", "loss"), (True, False), (2.0, 0.0)
        >>> p = Points()
        >>> p["loss"], "x" in p, len(p)
        ({'finite': False, 'max_abs': 0.0}, True, 2)
    """

    names: tuple[str, ...]
    finite: Any
    max_abs: Any

    def __getitem__(self, name: str) -> dict[str, Any]:
        """``{"finite": flag, "max_abs": value}`` of the point ``name``.

        Raises:
          KeyError: no point has that name (the message lists the names).
        """
        if name not in self.names:
            raise KeyError(
                f"no check point {name!r}; the points are {list(self.names)}"
            )
        i = self.names.index(name)
        return {"finite": self.finite[i], "max_abs": self.max_abs[i]}

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"CheckPoints(names={self.names!r})"
