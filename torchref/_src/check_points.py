"""Check points: named finiteness flags and magnitudes of a loss's values.

`CheckPoints` and its helpers, apart from `torchref._src.diagnostics` so
that the train step imports them without the diagnostics engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from _stablecore.diagnostics import PointsView
from _stablecore.diagnostics import check_name as _check_name
from _stablecore.diagnostics import format_points as _format_points
from _stablecore.diagnostics import record_entries as _record_entries
from _stablecore.diagnostics import record_points as _record_points

__all__ = ["CheckPoints", "check_points", "check_record", "format_checks"]


class CheckPoints(PointsView):
    """Named check points of a loss function, computed without a host sync.

    A check point is a value the loss marks (inputs, embeddings, logits, the
    loss, ...): for each one, one finite flag (``isfinite(x).all()``) and the
    largest |x| over its finite entries (nan when it has none), as two 0-d
    tensors on ``x``'s device, of the detached value: nothing is read with
    ``.item()`` and no gradient flows through a check. Return the collector
    in the loss's ``aux`` (``loss_fn(model, batch) -> (loss, aux)``) and
    `fit` reads it when it logs the step: each record then has
    ``checks['<name>']['finite']`` and ``checks['<name>']['max_abs']``,
    ``non_finite_checks`` (the non-finite points, in the order they were
    added: the first is where the step first went non-finite) and
    ``first_non_finite_check`` (None when all are finite): the keys of
    `jaxstable.diagnostics.CheckPoints`. A loss that marks nothing costs
    nothing.

    Functional, as the JAX twin: `add` returns a new collector
    (``checks = checks.add(...)``); the points keep the order of the calls.

    Attributes:
        names: the point names, in order.
        finite: one boolean 0-d tensor per point.
        max_abs: one float32 0-d tensor per point.

    Example:
        >>> import torch
        >>> from torchref import diagnostics
        >>> x = torch.tensor([1.0, 0.0, 2.0])
        >>> checks = diagnostics.CheckPoints().add("x", x)
        >>> y = x.log()
        >>> checks = checks.add("log", y).add("sum", y.sum())
        >>> checks.names, checks.non_finite()
        (('x', 'log', 'sum'), ['log', 'sum'])
        >>> print(diagnostics.format_checks(checks))
        x finite (max|x| 2), log NON-FINITE, sum NON-FINITE; first non-finite: log
        >>> float(checks["x"]["max_abs"]), "log" in checks, len(checks)
        (2.0, True, 3)
    """

    __slots__ = ("finite", "max_abs", "names")

    def __init__(self, names=(), finite=(), max_abs=()):
        self.names = tuple(names)
        self.finite = tuple(finite)
        self.max_abs = tuple(max_abs)

    def add(self, name: str, x: Any) -> CheckPoints:
        """A new collector: these points, then ``name`` checked on ``x``.

        Args:
            name: a non-empty string, not already used by a point here.
            x: a numeric tensor or Python number (floating, complex or
                integer; any shape, empty included: finite, max_abs nan).

        Raises:
            ValueError: an empty or already used name.
            TypeError: a name that is not a string, or ``x`` boolean or not
                numeric.

        Example:
            >>> import torch
            >>> from torchref import diagnostics
            >>> w = torch.tensor([-3.0, float("inf")])
            >>> c = diagnostics.CheckPoints().add("w", w)
            >>> bool(c.finite[0]), float(c.max_abs[0])
            (False, 3.0)
        """
        _check_name(name, self.names)
        x = torch.as_tensor(x).detach()
        if x.dtype == torch.bool:
            raise TypeError(
                f"check point {name!r} must be a numeric array (floating, complex "
                f"or integer), got dtype {str(x.dtype).removeprefix('torch.')}"
            )
        ok = torch.isfinite(x)
        if x.numel() == 0:  # amax of nothing is an error: no finite entry
            big = torch.full((), float("nan"), device=x.device)
        else:
            mag = x.abs().float()
            big = torch.where(ok, mag, torch.full_like(mag, -math.inf)).amax()
            # -inf: no finite entry -> nan, as LeafReport.max_abs_finite
            big = torch.where(big == -math.inf, torch.full_like(big, math.nan), big)
        return CheckPoints(
            (*self.names, name), (*self.finite, ok.all()), (*self.max_abs, big)
        )

    def non_finite(self) -> list[str]:
        """The names of the non-finite points, in order (reads to the host).

        Example:
            >>> import torch
            >>> from torchref import diagnostics
            >>> diagnostics.check_points(a=torch.ones(2), b=float("nan")).non_finite()
            ['b']
        """
        flags = _host_list(self.finite)
        return [n for n, ok in zip(self.names, flags, strict=True) if not ok]


def _host_list(values: tuple[torch.Tensor, ...]) -> list[float]:
    # Stacked where they are, then one device-to-host copy for all the
    # points (not one .item() or .cpu() each: a sync per point on a GPU).
    if not values:
        return []
    device = values[0].device
    return torch.stack([v.float().to(device) for v in values]).tolist()


def check_points(**values: Any) -> CheckPoints:
    """A `CheckPoints` of the keyword values, in the order they are given.

    ``check_points(a=x, b=y)`` is ``CheckPoints().add("a", x).add("b", y)``.

    Example:
        >>> import torch
        >>> from torchref import diagnostics
        >>> c = diagnostics.check_points(logits=torch.tensor([2.0, -5.0]), loss=1.5)
        >>> c.names, [float(m) for m in c.max_abs]
        (('logits', 'loss'), [5.0, 1.5])
    """
    checks = CheckPoints()
    for name, x in values.items():
        checks = checks.add(name, x)
    return checks


def _find_checks(tree: Any) -> list[CheckPoints]:
    # In jax.tree_util's leaf order: mappings by sorted key, then sequences.
    if isinstance(tree, CheckPoints):
        return [tree]
    if isinstance(tree, Mapping):
        return [c for k in sorted(tree) for c in _find_checks(tree[k])]
    if isinstance(tree, list | tuple):
        return [c for v in tree for c in _find_checks(v)]
    return []


def check_record(aux: Any) -> dict[str, Any]:
    """The record entries of the check points in ``aux`` (host values).

    What `fit` adds to each step's record: for every `CheckPoints` found in
    ``aux`` (``aux`` itself, or inside its dicts, lists and tuples; several
    are joined in `jax.tree_util` leaf order: dict keys sorted),
    ``checks['<name>']['finite']`` (bool) and ``checks['<name>']['max_abs']``
    (float, nan when no entry is finite) per point in order, then
    ``non_finite_checks`` (list of names, in order) and
    ``first_non_finite_check`` (its first name, or None). Empty when ``aux``
    holds no `CheckPoints`. The same entries as
    `jaxstable.diagnostics.check_record`. Reads each collector to the host
    in one copy.

    Raises:
        ValueError: two collectors in ``aux`` use the same point name.

    Example:
        >>> import torch
        >>> from torchref import diagnostics
        >>> aux = {"checks": diagnostics.check_points(emb=torch.ones(2),
        ...                                           loss=float("nan"))}
        >>> diagnostics.check_record(aux)  # doctest: +NORMALIZE_WHITESPACE
        {"checks['emb']['finite']": True, "checks['emb']['max_abs']": 1.0,
         "checks['loss']['finite']": False, "checks['loss']['max_abs']": nan,
         'non_finite_checks': ['loss'], 'first_non_finite_check': 'loss'}
    """
    found = _find_checks(aux)
    if not found:
        return {}
    names, finite, max_abs = [], [], []
    for c in found:
        for name in c.names:
            _check_name(name, tuple(names))
            names.append(name)
        values = _host_list(c.finite + c.max_abs)
        finite += [bool(f) for f in values[: len(c)]]
        max_abs += [float(m) for m in values[len(c) :]]
    return _record_entries(names, finite, max_abs)


def format_checks(checks: CheckPoints | dict[str, Any]) -> str:
    """One line: each check point in order, finite (with max|x|) or NON-FINITE.

    Args:
        checks: a `CheckPoints` (read to the host) or a `fit` record (its
            ``checks[...]`` keys; a JSON line read back works too).

    Returns:
        ``"a finite (max|x| 2), b NON-FINITE; first non-finite: b"``, or
        ``"...; all finite"``; ``"no check points"`` when there are none. The
        same text as `jaxstable.diagnostics.format_checks`.

    Example:
        >>> import torch
        >>> from torchref import diagnostics
        >>> rec = diagnostics.check_record(diagnostics.check_points(a=torch.ones(3)))
        >>> diagnostics.format_checks(rec)
        'a finite (max|x| 1); all finite'
    """
    if isinstance(checks, CheckPoints):
        checks = check_record(checks)
    return _format_points(_record_points(checks))
