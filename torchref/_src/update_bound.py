"""Proving on the host that an `optimizer.step()` cannot write a non-finite value.

`UpdateBound` proves, where it can, that the guards need no undo copy
(`update_check`) for this step: the update rules of SGD, Adam and AdamW
(`update_bound_rules`) under a bound on the gradients, with bounds on the
optimizer state kept from step to step.
"""

from __future__ import annotations

import math
import operator
import weakref
from itertools import repeat
from typing import Any, NamedTuple

import torch

from torchref._src.clipping import to_host
from torchref._src.update_bound_rules import PROVABLE
from torchref._src.update_bound_rules import rule as group_rule

__all__ = ["UpdateBound"]


_MOMENTS = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class UpdateBound:
    """Proves on the host, per step, that an undo copy cannot be needed.

    The step takes no copy (and makes no update check) where ALL of these
    hold; anywhere else it copies and checks as before:

    - the optimizer is exactly `torch.optim.SGD`, `Adam` or `AdamW` (a
      subclass may change `step`); every parameter with a gradient, the
      gradient and every tensor of its state are dense float32 or float64;
      the hyper-parameters are python numbers (a tensor lr is not read),
      finite, ``differentiable`` and ``capturable`` off;
    - every gradient entry is at most ``m``: the clip's ``max_norm`` (a
      clipped gradient's norm is at most it; a non-finite gradient skips
      the step anyway), or on the host path ``min(norm, max_norm)`` with
      the norm read in the same transfer as the flag;
    - SGD: ``weight_decay == 0`` (an L2 term ``wd * p`` is as large as the
      parameter, which is not read), momentum >= 0: the buffer's bound
      grows as ``a' = momentum * a + (1 + |dampening|) * m`` (the first
      buffer is the gradient) and the step is at most ``lr * (m + a')``
      (Nesterov's ``g + momentum * buf`` included);
    - Adam/AdamW: ``eps > 0``, betas in [0, 1), ``m <= 2**50`` (``g**2`` and
      the second moment stay far below float32's max), weight decay 0 or
      decoupled with ``0 <= lr * wd <= 1`` (``p * (1 - lr * wd)`` does not
      grow): the moments are convex blends, ``|m1| <= max(a1, m)``, ``v <=
      max(a2, m**2)``; the step ``lr / (1 - b1**t) * m1 / (sqrt(v_hat) +
      eps)`` is at most ``lr * a1 / ((1 - b1) * eps)`` and ``v_hat <= a2 /
      (1 - b2)``. float16/bfloat16 state is never proved: there ``eps =
      1e-8`` is 0 and ``(1 - b2) * g**2`` underflows, the ``m / 0`` case;
    - every bound, the step and each intermediate stay below 2**100: then
      ``p + step`` rounds to at most float32's max (a step below half an
      ulp of 3.4e38 cannot carry a finite parameter past it), so a finite
      parameter stays finite.

    The bounds ``(a1, a2)`` of each parameter's state are kept from the
    step that created it, with its tensors' version counters: a state
    written by anything else (``load_state_dict``, user code) is read once
    (its largest magnitudes, one transfer) and bounded from there.
    """

    def __init__(self) -> None:
        # id(p) -> (its state's tensors as `_versions` recorded them, a1, a2)
        self._known: dict[int, tuple[tuple, float, float]] = {}
        self._pre: dict[int, tuple[tuple[float, float], Any]] = {}
        # The last step's parameters, all proved, as one `_Flat` record (in
        # place of their `_known` entries): checked in bulk the next step.
        self._flat: _Flat | None = None

    def proven(self, optimizer, params: list, m: float | None) -> bool:
        """Whether this step cannot write a non-finite value (see above).

        Nothing is cached from a step to the next but the state's bounds,
        kept with its tensors' identities and version counters: every
        dtype (``p.data = ...`` changes one in place), every rule and
        every state's tensors are looked at again, in one pass."""
        self._pre = {}
        kind = PROVABLE.get(type(optimizer))
        if kind is None or m is None or not 0.0 <= m <= 2.0**50:
            self._unflatten()
            return False
        rule_of: dict[int, Any] = {}
        for g in optimizer.param_groups:
            rule_of.update(dict.fromkeys(map(id, g["params"]), group_rule(kind, g, m)))
        fast = self._proven_flat(optimizer.state, params, rule_of)
        if fast is not None:
            return fast
        self._unflatten()
        found = _scan(optimizer.state, params, self._known)
        if found is None:  # a tensor that is not dense float32/float64
            return False
        # Only a state a rule could prove is worth a read.
        learned = self._learn(
            optimizer,
            [p for p, a in found if a is None and rule_of[id(p)] is not None],
        )
        ok, fits = True, {}
        for p, a in found:
            rule = rule_of[id(p)]
            a = learned.get(id(p)) if a is None else a
            if rule is None or a is None:
                ok = False
                continue
            self._pre[id(p)] = (a, rule[0])
            if ok:  # each distinct (rule, bounds) is evaluated once
                key = (id(rule), a)
                if key not in fits:
                    fits[key] = rule[1](*a)
                ok = fits[key]
        return ok

    def record(self, optimizer, params: list) -> None:
        """After the step `proven` looked at: each state's bounds grown by
        it (an upper bound whether it was applied or selected back), or
        forgotten where nothing was proved."""
        old, self._flat = self._flat, _Flat.of(optimizer.state, params, self._pre)
        if old is not None and (self._flat is None or self._flat.ids != old.ids):
            self._known.update(old.entries())  # kept for those not stepped now
        if self._flat is not None:
            self._pre = {}
            return
        states, known, grown = optimizer.state, self._known, {}
        for p in params:
            pre, state = self._pre.get(id(p)), states.get(p)
            if pre is None or not state:
                known.pop(id(p), None)
                continue
            a, grow = pre
            key = (id(grow), a)
            if key not in grown:
                grown[key] = grow(*a)
            known[id(p)] = (_versions(state), *grown[key])
        self._pre = {}

    def _proven_flat(self, states, params: list, rule_of: dict) -> bool | None:
        """`proven` in bulk where the state holds what the last step's
        `_Flat` record says and every parameter has a rule; None (look
        one by one) anywhere else."""
        flat = self._flat
        tensors = None if flat is None else flat.same(states, params)
        if tensors is None:
            return None
        rules = list(map(rule_of.__getitem__, flat.ids))
        if None in rules:
            return None
        grads = list(map(_GRAD, params))
        tensors += params + grads
        if not set(map(_DTYPE, tensors)) <= _WIDE_SET or any(map(_SPARSE, tensors)):
            self._flat = None  # forgotten, as `record` forgets them
            return False
        grows = zip(flat.bounds, map(_FIRST, rules), strict=True)
        self._pre = dict(zip(flat.ids, grows, strict=True))
        # Each distinct (rule, bounds) once: a group's parameters share them
        # (the very same objects: keyed by id, no tuple of floats hashed).
        pairs = list(zip(rules, flat.bounds, strict=True))
        keys = zip(map(id, rules), map(id, flat.bounds), strict=True)
        distinct = dict(zip(keys, pairs, strict=True))
        return all(rule[1](*a) for rule, a in distinct.values())

    def _unflatten(self) -> None:
        """The `_Flat` record as `_known` entries, one per parameter."""
        if self._flat is not None:
            self._known.update(self._flat.entries())
            self._flat = None

    def _learn(self, optimizer, unknown: list) -> dict[int, tuple[float, float]]:
        """State written outside this guard: its largest magnitudes, read
        in one transfer, become its bounds (inf for a non-finite one)."""
        if not unknown:
            return {}
        found = [
            (p, k, optimizer.state[p][k])
            for p in unknown
            for k in _MOMENTS
            if isinstance(optimizer.state[p].get(k), torch.Tensor)
        ]
        values = to_host([t.detach().abs().amax().double() for _, _, t in found])
        bounds = {id(p): [0.0, 0.0] for p in unknown}
        for (p, k, _), v in zip(found, values, strict=True):
            i = 1 if k.endswith("sq") else 0
            v = v if math.isfinite(v) else math.inf
            bounds[id(p)][i] = max(bounds[id(p)][i], v * 1.001)
        for p in unknown:
            self._known[id(p)] = (_versions(optimizer.state[p]), *bounds[id(p)])
        return {i: (a1, a2) for i, (a1, a2) in bounds.items()}


_WIDE = (torch.float32, torch.float64)
_WIDE_SET = frozenset(_WIDE)
_NO_STATE = (0.0, 0.0)
_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_SPARSE = operator.attrgetter("is_sparse")
_VERSION = operator.attrgetter("_version")
_FIRST = operator.itemgetter(0)
_DEREF = weakref.ref.__call__


class _Flat(NamedTuple):
    """Every stepped parameter's state after a step in which all of them
    were proved, in lists (compared in bulk, not one by one): the same
    identities, versions and bounds as their `_known` entries."""

    ids: list[int]  # id of each parameter, in order
    keys: list[tuple]  # each state's keys
    refs: list[Any]  # weak references to every state tensor, in order
    versions: list[int]  # their version counters
    bounds: list[tuple[float, float]]  # each state's (a1, a2)

    @classmethod
    def of(cls, states, params: list, pre: dict) -> _Flat | None:
        """The record of `params` after the step (bounds grown by it); None
        where one was not proved, has no state or holds a non-tensor."""
        ids = list(map(id, params))
        entries = list(map(pre.get, ids))
        if None in entries:
            return None
        try:
            found = list(map(states.get, params))  # no [p]: a defaultdict
            keys = list(map(tuple, found))
            values = [v for state in found for v in state.values()]
            versions = list(map(_VERSION, values))  # a non-tensor has none
            refs = list(map(weakref.ref, values))
        except (TypeError, AttributeError):  # no state, a non-tensor value
            return None
        if not all(keys) or not all(map(isinstance, values, repeat(torch.Tensor))):
            return None
        grown = {(a, grow): grow(*a) for a, grow in set(entries)}
        return cls(ids, keys, refs, versions, list(map(grown.__getitem__, entries)))

    def same(self, states, params: list) -> list | None:
        """The state tensors of `params` where they are the very ones
        recorded, under the same keys, unwritten since; else None."""
        if list(map(id, params)) != self.ids:
            return None
        found = list(map(states.get, params))
        try:
            if list(map(tuple, found)) != self.keys:
                return None
        except TypeError:  # a parameter without state
            return None
        values = [v for state in found for v in state.values()]
        if len(values) != len(self.refs) or not all(
            map(operator.is_, values, map(_DEREF, self.refs))
        ):
            return None
        return values if list(map(_VERSION, values)) == self.versions else None

    def entries(self):
        """``(id(p), (_versions(state), a1, a2))`` of each parameter."""
        at = 0
        for pid, keys, bounds in zip(self.ids, self.keys, self.bounds, strict=True):
            n = len(keys)
            tensors = zip(
                keys, self.refs[at : at + n], self.versions[at : at + n], strict=True
            )
            yield pid, (tuple(tensors), *bounds)
            at += n


def _scan(states: dict, params: list, known: dict) -> list | None:
    """``[(p, bounds)]``: ``(0, 0)`` for no state, the recorded bounds of a
    state that holds the very tensors recorded, unwritten since, else None;
    None for all where a parameter, gradient or state tensor is not dense
    float32/float64."""
    out = []
    for p in params:
        g = p.grad
        if p.dtype not in _WIDE or g.dtype not in _WIDE or p.is_sparse or g.is_sparse:
            return None
        state = states.get(p)
        if not state:
            out.append((p, _NO_STATE))
            continue
        rec = known.get(id(p))
        same = _check_state(state, None if rec is None else rec[0])
        if same is None:
            return None
        out.append((p, rec[1:] if same else None))
    return out


def _check_state(state: dict[str, Any], recorded: tuple | None) -> bool | None:
    """Whether `state` holds the very tensors `_versions` recorded (False
    for no record), in order and unwritten since; None where one is not
    dense float32/float64."""
    same, i = recorded is not None, 0
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            continue
        if v.dtype not in _WIDE or v.is_sparse:
            return None
        if same and i < len(recorded):  # type: ignore[arg-type]
            rk, ref, version = recorded[i]  # type: ignore[index]
            same = k == rk and ref() is v and v._version == version
        else:
            same = False
        i += 1
    return same and i == len(recorded)  # type: ignore[arg-type]


def _versions(state: dict[str, Any]) -> tuple:
    """Which tensors a state holds (weak references: a tensor loaded in
    place of a freed one may reuse its id) and how often each was written."""
    return tuple(
        (k, weakref.ref(v), v._version)
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    )
