"""Check points: named finiteness flags and magnitudes of a loss's values.

`CheckPoints` and its helpers, apart from `jaxstable._src.diagnostics` so
that the train step imports them without the diagnostics engine.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from _stablecore.diagnostics import PointsView
from _stablecore.diagnostics import check_name as _check_name
from _stablecore.diagnostics import format_points as _format_points
from _stablecore.diagnostics import record_entries as _record_entries
from _stablecore.diagnostics import record_points as _record_points

__all__ = ["CheckPoints", "check_points", "check_record", "format_checks"]


@jax.tree_util.register_pytree_node_class
class CheckPoints(PointsView):
    """Named check points of a loss function, computed inside the jitted step.

    A check point is a value the loss marks (inputs, embeddings, logits, the
    loss, ...): for each one, one finite flag (``all(isfinite(x))``) and the
    largest |x| over its finite entries (nan when it has none), as two
    device scalars. Nothing is read on the host and nothing branches: the
    collector is a pytree that leaves the loss through its ``aux`` (use
    ``make_train_step(..., has_aux=True)``), and `fit` reads it only when it
    logs the step: each record then has ``checks['<name>']['finite']`` and
    ``checks['<name>']['max_abs']``, ``non_finite_checks`` (the non-finite
    points, in the order they were added: the first is where the step first
    went non-finite) and ``first_non_finite_check`` (None when all are
    finite). A loss that marks nothing costs nothing.

    Functional: `add` returns a new collector (``checks = checks.add(...)``),
    as in `torchref.diagnostics.CheckPoints`. The order of the points is the
    order of the `add` calls, kept through `jax.jit` (the names are the
    pytree's static data, so a new set of names is a new trace).

    Attributes:
      names: the point names, in order.
      finite: one boolean scalar per point.
      max_abs: one float32 scalar per point.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxstable import diagnostics
      >>> @jax.jit
      ... def f(x):
      ...     checks = diagnostics.CheckPoints().add("x", x)
      ...     y = jnp.log(x)
      ...     return checks.add("log", y).add("sum", jnp.sum(y))
      >>> checks = f(jnp.array([1.0, 0.0, 2.0]))
      >>> checks.names, checks.non_finite()
      (('x', 'log', 'sum'), ['log', 'sum'])
      >>> print(diagnostics.format_checks(checks))
      x finite (max|x| 2), log NON-FINITE, sum NON-FINITE; first non-finite: log
      >>> float(checks["x"]["max_abs"]), "log" in checks, len(checks)
      (2.0, True, 3)
    """

    __slots__ = ("finite", "max_abs", "names")

    def __init__(self, names=(), finite=(), max_abs=()):
        # No checks here: jax rebuilds the pytree with placeholder leaves.
        self.names = tuple(names)
        self.finite = tuple(finite)
        self.max_abs = tuple(max_abs)

    def add(self, name: str, x: Any) -> CheckPoints:
        """A new collector: these points, then ``name`` checked on ``x``.

        Args:
          name: a non-empty string, not already used by a point here.
          x: a numeric array (floating, complex or integer; any shape, empty
            included: finite, max_abs nan). Only its value is read
            (`jax.lax.stop_gradient`): no gradient flows through a check.

        Raises:
          ValueError: an empty or already used name.
          TypeError: a name that is not a string, or ``x`` boolean or not
            numeric.

        Example:
          >>> import jax.numpy as jnp
          >>> from jaxstable import diagnostics
          >>> c = diagnostics.CheckPoints().add("w", jnp.array([-3.0, jnp.inf]))
          >>> bool(c.finite[0]), float(c.max_abs[0])
          (False, 3.0)
        """
        _check_name(name, self.names)
        x = jax.lax.stop_gradient(jnp.asarray(x))
        if x.dtype == jnp.bool_ or not jnp.issubdtype(x.dtype, jnp.number):
            raise TypeError(
                f"check point {name!r} must be a numeric array (floating, complex "
                f"or integer), got dtype {x.dtype}"
            )
        ok = jnp.isfinite(x)
        # max over the finite entries; -inf (none finite, or empty) -> nan
        big = jnp.max(jnp.where(ok, jnp.abs(x), -jnp.inf), initial=-jnp.inf)
        big = big.astype(jnp.float32)
        big = jnp.where(big == -jnp.inf, jnp.nan, big)
        return CheckPoints(
            (*self.names, name), (*self.finite, jnp.all(ok)), (*self.max_abs, big)
        )

    def non_finite(self) -> list[str]:
        """The names of the non-finite points, in order (reads to the host).

        Example:
          >>> import jax.numpy as jnp
          >>> from jaxstable import diagnostics
          >>> diagnostics.check_points(a=jnp.ones(2), b=jnp.nan).non_finite()
          ['b']
        """
        flags = jax.device_get(self.finite)
        return [n for n, ok in zip(self.names, flags, strict=True) if not bool(ok)]

    def tree_flatten(self):
        return (self.finite, self.max_abs), self.names

    @classmethod
    def tree_unflatten(cls, names, children):
        return cls(names, *children)


def check_points(**values: Any) -> CheckPoints:
    """A `CheckPoints` of the keyword values, in the order they are given.

    ``check_points(a=x, b=y)`` is ``CheckPoints().add("a", x).add("b", y)``.
    Call it inside the loss (a traced Python call keeps the keyword order);
    ``jax.jit(check_points)(**values)`` would get them as a dict, whose
    pytree order is sorted.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import diagnostics
      >>> c = diagnostics.check_points(logits=jnp.array([2.0, -5.0]), loss=1.5)
      >>> c.names, [float(m) for m in c.max_abs]
      (('logits', 'loss'), [5.0, 1.5])
    """
    checks = CheckPoints()
    for name, x in values.items():
        checks = checks.add(name, x)
    return checks


def check_record(aux: Any) -> dict[str, Any]:
    """The record entries of the check points in ``aux`` (host values).

    What `fit` adds to each step's record: for every `CheckPoints` found in
    ``aux`` (``aux`` itself, or any leaf of it; several are joined in
    `jax.tree_util` leaf order), ``checks['<name>']['finite']`` (bool) and
    ``checks['<name>']['max_abs']`` (float, nan when no entry is finite) per
    point in order, then ``non_finite_checks`` (list of names, in order) and
    ``first_non_finite_check`` (its first name, or None). Empty when ``aux``
    holds no `CheckPoints`. The same entries as
    `torchref.diagnostics.check_record`.

    Raises:
      ValueError: two collectors in ``aux`` use the same point name.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import diagnostics
      >>> aux = {"checks": diagnostics.check_points(emb=jnp.ones(2), loss=jnp.nan)}
      >>> diagnostics.check_record(aux)  # doctest: +NORMALIZE_WHITESPACE
      {"checks['emb']['finite']": True, "checks['emb']['max_abs']": 1.0,
       "checks['loss']['finite']": False, "checks['loss']['max_abs']": nan,
       'non_finite_checks': ['loss'], 'first_non_finite_check': 'loss'}
    """
    found = [
        leaf
        for leaf in jax.tree_util.tree_leaves(aux, is_leaf=_is_checks)
        if _is_checks(leaf)
    ]
    if not found:
        return {}
    names, finite, max_abs = [], [], []
    for c in jax.device_get(found):
        for name in c.names:
            _check_name(name, tuple(names))
            names.append(name)
        finite += [bool(f) for f in c.finite]
        max_abs += [float(m) for m in c.max_abs]
    return _record_entries(names, finite, max_abs)


def _is_checks(x: Any) -> bool:
    return isinstance(x, CheckPoints)


def format_checks(checks: CheckPoints | dict[str, Any]) -> str:
    """One line: each check point in order, finite (with max|x|) or NON-FINITE.

    Args:
      checks: a `CheckPoints` (read to the host) or a `fit` record (its
        ``checks[...]`` keys; a JSON line read back works too).

    Returns:
      ``"a finite (max|x| 2), b NON-FINITE; first non-finite: b"``, or
      ``"...; all finite"``; ``"no check points"`` when there are none. The
      same text as `torchref.diagnostics.format_checks`.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import diagnostics
      >>> rec = diagnostics.check_record(diagnostics.check_points(a=jnp.ones(3)))
      >>> diagnostics.format_checks(rec)
      'a finite (max|x| 1); all finite'
    """
    if isinstance(checks, CheckPoints):
        checks = check_record(checks)
    return _format_points(_record_points(checks))
