"""`skip_non_finite`: an optimizer wrapper whose non-finite steps never land.

Skipping wraps any `torch.optim.Optimizer` so that a non-finite step leaves
the parameters AND the optimizer state (Adam moments, step count) untouched,
as `torch.amp.GradScaler.step` does. Finite gradients can still give a
non-finite step, and torch cannot tell before `optimizer.step()` has written
it: with ``check_update`` the wrappers check what the step wrote and select
the values before it back when it is non-finite (`update_check`). Only
parameters with a gradient and their state are copied or checked; where the
update is proved finite (`UpdateBound`) nothing is. On the device path every
decision is a device tensor (issue 24); the host path reads the flag once
and skips ``optimizer.step()`` as GradScaler does (`GuardedStep`). The
counters read the flags when they are read (`DeferredRecords`). An
optimizer that needs a closure (LBFGS) decides on the host (`StepUndo`).
Here also `OptimizerView`, what every wrapper passes through, and the
argument checks the wrappers share.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from _stablecore.checks import check_bool as _core_check_bool
from torchref._src.clipping import (
    finite_norms,
    home_device,
    norm_inputs,
    norm_read_on_host,
    to_host,
)
from torchref._src.guard_state import SkipNonFiniteState, find_state
from torchref._src.guard_step import GuardedStep
from torchref._src.loss_scale_math import all_finite
from torchref._src.update_check import StepUndo

__all__ = ["SkipNonFinite", "SkipNonFiniteState", "find_skip_state", "skip_non_finite"]


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` must be given a closure (LBFGS's must)."""
    try:
        param = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


# A bool option; ValueError, as this module always raised (fit: TypeError).
check_bool = functools.partial(_core_check_bool, error=ValueError)


def check_optimizer(optimizer: Any, where: str) -> None:
    """Refuses what is not a `torch.optim.Optimizer`, naming the fix.

    The common slip is the class itself (``torch.optim.Adam`` for
    ``torch.optim.Adam(model.parameters(), lr=1e-3)``), the twin of passing
    ``optax.adam`` for ``optax.adam(1e-3)`` in JAX. A torchref wrapper is
    an Optimizer to torch (for its LR schedulers) but not here: where this
    check stands, a plain optimizer is wanted.
    """
    if isinstance(optimizer, OptimizerView):
        raise TypeError(
            f"{where} needs a plain optimizer (a torch.optim.Optimizer such as "
            "torch.optim.Adam(model.parameters(), lr=1e-3)), got the torchref "
            f"wrapper {type(optimizer).__name__}"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        return
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        name = f"{optimizer.__module__.split('.')[0]}.optim.{optimizer.__name__}"
        if not optimizer.__module__.startswith("torch.optim"):
            name = optimizer.__name__
        raise TypeError(
            f"{where} needs an optimizer (a torch.optim.Optimizer), got the class "
            f"{optimizer.__name__}: construct it: {name}(model.parameters(), "
            "lr=1e-3)"
        )
    raise TypeError(
        f"{where} needs an optimizer (a torch.optim.Optimizer such as "
        "torch.optim.Adam(model.parameters(), lr=1e-3)), got "
        f"{type(optimizer).__name__}"
    )


def check_max_consecutive(max_consecutive: Any) -> int | None:
    if max_consecutive is None:
        return None
    if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int):
        raise ValueError(
            f"max_consecutive must be None or an int >= 0, got {max_consecutive!r}"
        )
    if max_consecutive < 0:
        raise ValueError(
            f"max_consecutive must be None or an int >= 0, got {max_consecutive!r}"
        )
    return max_consecutive


def scalar_flag(flag: Any, device: torch.device) -> torch.Tensor:
    """``grads_finite=`` as a 0-d bool tensor on `device`; another shape is
    refused: a flag of shape (n,) was applied element by element by the
    select (parameters partly stepped, the step counted as applied)."""
    flag = torch.as_tensor(flag, device=device).to(torch.bool)
    if flag.dim() != 0:
        # Same text as jaxstable.transforms.skip_non_finite.
        raise ValueError(
            "grads_finite must be a boolean scalar (one flag for the whole "
            f"step), got shape {tuple(flag.shape)}"
        )
    return flag


# Pending steps kept on the device at most: a loop that never reads
# skip_state records them every 4096 steps (one transfer) instead of holding
# two 0-d device tensors per step for ever (a 512-byte CUDA block each).
_MAX_PENDING = 4096


class OptimizerView(torch.optim.Optimizer):
    """What a wrapper passes through from ``self.optimizer`` (the wrapped
    optimizer), so that LR schedulers and user code treat the wrapper as
    the optimizer: its parameter groups, state and `defaults` (CyclicLR
    and OneCycleLR read ``defaults``), `zero_grad`, `add_param_group` and
    the hook registrations.

    A `torch.optim.Optimizer` subclass because ``torch.optim.lr_scheduler``
    refuses anything else (``StepLR(skip_non_finite(sgd))`` raised "is not
    an Optimizer"), as accelerate's ``AcceleratedOptimizer`` is one.
    ``Optimizer.__init__`` is not called: the wrapped optimizer holds the
    groups and state (a second copy would drift), and it would patch
    `step` for the profiler's hooks, which the wrapped one runs itself.

    A scheduler tracks the wrapper's `step` (its "``lr_scheduler.step()``
    before ``optimizer.step()``" warning): a call of the wrapper's `step`
    counts as the optimizer's step whether the guard applied or skipped
    it, so a skipped first step gives no false warning (GradScaler, which
    skips by not calling ``optimizer.step()``, gives one). The scheduler
    advances on every ``scheduler.step()`` either way.
    """

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's default options (``lr``, ``momentum``...)."""
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's `zero_grad`."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The wrapped optimizer's `add_param_group`."""
        self.optimizer.add_param_group(param_group)

    def register_step_pre_hook(self, hook: Any) -> Any:
        """Registers `hook` on the wrapped optimizer: it runs on applied steps."""
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> Any:
        """Registers `hook` on the wrapped optimizer: it runs on applied steps."""
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        """Registers `hook` on the wrapped optimizer's `state_dict`."""
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        """Registers `hook` on the wrapped optimizer's `state_dict`."""
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(
        self, hook: Any, prepend: bool = False
    ) -> Any:
        """Registers `hook` on the wrapped optimizer's `load_state_dict`."""
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(
        self, hook: Any, prepend: bool = False
    ) -> Any:
        """Registers `hook` on the wrapped optimizer's `load_state_dict`."""
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def __getstate__(self) -> dict[str, Any]:
        # Every attribute (Optimizer's keeps three), less what a scheduler
        # attached, as Optimizer's drops it: its patched `step` is a closure
        # over this object.
        return {
            k: v for k, v in self.__dict__.items() if k not in ("step", "_opt_called")
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


class DeferredRecords:
    """`skip_state` whose per-step records wait on the device.

    A guarded step leaves ``(applied, grads_finite)`` as 0-d bool tensors in
    ``_pending`` instead of reading them (a host sync per step); reading
    `skip_state` moves every pending pair to the host in ONE transfer and
    records them in order, as does every 4096th pending step (`_push`).
    `TrainStep.step` returns its python metrics through the same single
    transfer.
    """

    _skip_state: SkipNonFiniteState
    _pending: list[tuple[Any, Any]]
    max_consecutive: int | None

    @property
    def skip_state(self) -> SkipNonFiniteState:
        """The counters, with every pending step recorded (one transfer)."""
        if self._pending:
            self._record(to_host([t for pair in self._pending for t in pair]))
        return self._skip_state

    @skip_state.setter
    def skip_state(self, state: SkipNonFiniteState) -> None:
        self._pending = []
        self._skip_state = state
        self._skipped_dev: torch.Tensor | None = None  # TrainStep's count

    def _push(self, applied: torch.Tensor, grads_finite: torch.Tensor) -> None:
        """Leaves one step's flags pending (recorded once `_MAX_PENDING` wait)."""
        self._pending.append((applied, grads_finite))
        if len(self._pending) >= _MAX_PENDING:
            _ = self.skip_state

    def _record(self, flags: list[Any]) -> None:
        """Records the pending pairs from their host values (in order)."""
        pending, self._pending = self._pending, []
        for i in range(len(pending)):
            self._skip_state.record(
                bool(flags[2 * i]),
                self.max_consecutive,
                grads_finite=bool(flags[2 * i + 1]),
            )


class SkipNonFinite(OptimizerView, DeferredRecords):
    """An optimizer wrapper whose `step()` is skipped on non-finite grads.

    Made by `skip_non_finite`. `param_groups`, `state`, `zero_grad`,
    `state_dict` and `load_state_dict` are the wrapped optimizer's;
    `skip_state` holds the counters (`SkipNonFiniteState`).

    Example:
        >>> import torch
        >>> from torchref import transforms
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = transforms.skip_non_finite(torch.optim.SGD([w], lr=0.1))
        >>> w.grad = torch.tensor([1.0, float("inf")])
        >>> opt.step()
        >>> w.tolist(), opt.skip_state.skipped_total
        ([1.0, 1.0], 1)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_consecutive: int | None,
        check_update: bool = True,
        decide_on: str = "auto",
    ):
        check_optimizer(optimizer, type(self).__name__)
        self.optimizer = optimizer
        self.max_consecutive = check_max_consecutive(max_consecutive)
        self.check_update = check_bool("check_update", check_update)
        self.skip_state = SkipNonFiniteState()
        self._undo = StepUndo()  # the closure path (LBFGS) decides on the host
        self._guarded = GuardedStep()
        self._guarded.decide_on = decide_on
        self._needs_closure = needs_closure(optimizer)
        self._norm: Any = None  # the last check's gradient norm (a bound)

    @property
    def decide_on(self) -> str:
        """Where a step's skip is decided: ``"auto"``, ``"device"`` or
        ``"host"`` (see `skip_non_finite`); settable."""
        return self._guarded.decide_on

    @decide_on.setter
    def decide_on(self, value: str) -> None:
        self._guarded.decide_on = value

    def grads(self) -> list[torch.Tensor]:
        """The gradients of every parameter that has one."""
        return [
            p.grad
            for g in self.optimizer.param_groups
            for p in g["params"]
            if p.grad is not None
        ]

    def _guards(self) -> bool:
        """Whether steps are checked and skipped (StableOptimizer may not)."""
        return True

    def _check(self, grads_finite: Any) -> torch.Tensor:
        """The gradients' flag (0-d bool tensor, no host sync): the
        caller's when given (a bool or a tensor), else `all_finite` on the
        device; StableOptimizer also clips here."""
        grads = self.grads()
        home = home_device(grads)
        # skip_spikes hands its flag with the norm it computed.
        self._norm = getattr(self, "_norm_hint", None)
        if not self._guards():
            return torch.ones((), dtype=torch.bool, device=home)
        if grads_finite is not None:
            return scalar_flag(grads_finite, home)
        read = self._read_on_host(grads, None, None)
        if read is not None:
            return read[0]
        ts = norm_inputs(grads)
        if not ts:
            return torch.ones((), dtype=torch.bool, device=home)
        finite, self._norm = finite_norms(ts)
        return finite

    def _read_on_host(self, grads: list, given: Any, clip: Any):
        """The host path's check (`norm_read_on_host`): ``(flag as a CPU
        tensor, norm)``, the norm's host value kept for the proof; None on
        the device path or where the float32 norm is not finite (then the
        exact check runs)."""
        if not self._guarded.on_host(self.optimizer):
            return None
        read = norm_read_on_host(grads, [True if given is None else given], clip)
        if read is None:
            return None
        self._norm = read[1]
        return torch.tensor(bool(read[2][0])), read[0]

    def _prepare(self, finite: bool) -> None:
        """Runs between the check and a closure step (StableOptimizer records
        `grad_norm` here)."""

    def _apply(self, grads_ok: torch.Tensor) -> torch.Tensor:
        """``optimizer.step()`` where `grads_ok`, selected back where it
        wrote a non-finite value (with `check_update`); whether the step
        was applied, as a 0-d bool tensor (see `GuardedStep`)."""
        if not self._guards():
            self.optimizer.step()
            return grads_ok
        clip = getattr(self, "clip", None)
        return ~self._guarded.run(
            self.optimizer,
            ~grads_ok,
            self.check_update,
            None if clip is None else clip.max_norm,
            self._norm,
        )

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grads_finite: bool | None = None,
    ):
        """Steps the wrapped optimizer unless the step would be non-finite.

        Args:
            closure: forwarded to the wrapped `step` (evaluated before the
                check, so its backward produces the grads that are checked).
                Required by an optimizer whose `step` needs one
                (`torch.optim.LBFGS`): every evaluation it makes is checked,
                and the whole step is undone when one of them had non-finite
                gradients or loss, or when it wrote a non-finite value (with
                `check_update`; the copy is taken even without it, since the
                optimizer acts on its evaluations before any check can).
            grads_finite: a finiteness flag already computed by the caller
                (a bool or a 0-d bool tensor); REUSED when given (no second
                check), else `all_finite(grads)` on the device.

        Returns:
            The closure's loss (or None), a skipped step's as well.
        """
        if self._needs_closure:
            return self._closure_step(closure, grads_finite)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        finite = self._check(grads_finite)
        applied = self._apply(finite)
        self._push(applied, finite)  # read when skip_state is
        return loss

    def _closure_step(self, closure: Callable[[], Any] | None, grads_finite: Any):
        """A step of an optimizer that evaluates `closure` itself (LBFGS)."""
        name = type(self.optimizer).__name__
        if closure is None:
            raise TypeError(
                f"{name}.step() re-evaluates the loss, so it needs a closure: call "
                "step(closure) with a closure that zeroes the grads, computes the "
                "loss, calls backward() and returns the loss"
            )
        if grads_finite is not None:
            raise ValueError(
                f"grads_finite cannot be given to a {name} step: its closure runs "
                "several times per step and every evaluation is checked"
            )
        flags: list[bool] = []

        def guarded():
            with torch.enable_grad():
                loss = closure()
            ok = not self._guards() or all_finite([loss, *self.grads()])
            flags.append(ok)
            self._prepare(ok)
            return loss

        if not self._guards():
            return self.optimizer.step(guarded)
        self._undo.take(self.optimizer)
        loss = self.optimizer.step(guarded)
        grads_ok = all(flags)
        applied = grads_ok and (not self.check_update or self._undo.written_finite())
        if not applied:
            self._undo.restore()
        self.skip_state.record(applied, self.max_consecutive, grads_finite=grads_ok)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus the skip counters."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "skip_state": dataclasses.asdict(self.skip_state),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of `state_dict`."""
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.skip_state = SkipNonFiniteState(**state_dict["skip_state"])


def skip_non_finite(
    optimizer: torch.optim.Optimizer,
    *,
    max_consecutive: int | None = None,
    check_update: bool = True,
    decide_on: str = "auto",
) -> SkipNonFinite:
    """Wraps an optimizer so that a non-finite step is never applied.

    Maths: ``if all_finite(grads): optimizer.step() else: nothing`` — the
    parameters and the optimizer state (Adam's moments and step count) are
    left exactly as they were, as `torch.amp.GradScaler.step` does; the
    counters in `skip_state` are updated either way. With `check_update`,
    a step whose gradients were finite but which wrote a non-finite
    parameter or state value (float16 Adam: ``(1 - b2) * g**2`` underflows
    to 0 and ``eps = 1e-8`` is 0 in float16, so ``m / 0``) is undone and
    counted the same way (``skip_state.non_finite_updates``).

    What a step costs (`decide_on`): only the parameters with a gradient
    and their state are ever copied or checked. On the device path (no
    host sync, issue 24; the default for a fused optimizer)
    the flag stays a device tensor; a fused optimizer (``fused=True``
    Adam/AdamW/SGD) gets it as GradScaler's ``found_inf`` and skips
    itself, with no copy where its update is proved finite (float32
    SGD/Adam/AdamW under a clip, see `StableOptimizer`); any other one
    steps on ONE copy of its parameters and state taken just before,
    which a `torch.where` selects back (so `check_update=False` saves the
    check, not the copy, unless the optimizer is fused). On the host path
    (``decide_on="host"``, the default for a non-fused optimizer,
    GradScaler's own one sync) the flag and the gradients'
    norm are read in one transfer and a bad step does not call
    ``optimizer.step()``; a copy is taken only where the update is not
    proved finite (then its check is read too). The step that creates the
    optimizer state (the first) decides on the host once on the device
    path, a fused one included (its skipped first step would keep
    uninitialised momentum buffers). An
    optimizer with step pre/post hooks (``register_step_post_hook``, an
    EMA) is not stepped on non-finite gradients, as under GradScaler: that
    flag is read on the host (one sync per step); a step undone by
    `check_update` did run, so its post hooks saw what it wrote. `skip_state` is brought
    up to date when read, in one transfer for all steps since (and every
    4096 steps when it is never read).

    Args:
        optimizer: any `torch.optim.Optimizer`.
        max_consecutive: when more than this many steps in a row are skipped,
            ``skip_state.exceeded`` becomes True (the train loop acts on it;
            the wrapper still never applies a bad step). None: never.
        check_update: also undo a step that wrote a non-finite parameter or
            optimizer-state value (default True).
        decide_on: ``"auto"`` (default), ``"device"`` (no host sync) or
            ``"host"`` (one sync, no copy where the update is proved
            finite); ``"auto"`` is ``"device"`` for an optimizer that
            takes ``found_inf`` (fused) off the CPU, else ``"host"`` (on
            the CPU a read is no transfer). Also an attribute
            (``opt.decide_on``).

    Returns:
        A `SkipNonFinite` wrapper.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = skip_non_finite(torch.optim.Adam([w], lr=0.1))
        >>> w.grad = torch.tensor([1.0, float("nan")])
        >>> opt.step()
        >>> w.tolist(), opt.state == {}, opt.skip_state.skipped_total
        ([1.0, 1.0], True, 1)
        >>> # finite gradients, non-finite update: Adam with eps=0 divides 0 by 0
        >>> opt = skip_non_finite(torch.optim.Adam([w], lr=0.1, eps=0.0))
        >>> w.grad = torch.tensor([1.0, 0.0])
        >>> opt.step()
        >>> w.tolist(), opt.state == {}, opt.skip_state.non_finite_updates
        ([1.0, 1.0], True, 1)
    """
    return SkipNonFinite(optimizer, max_consecutive, check_update, decide_on)


def find_skip_state(obj: Any) -> SkipNonFiniteState | None:
    """The `SkipNonFiniteState` inside a wrapper or a `TrainStep`, or None.

    Args:
        obj: a `SkipNonFinite`/`StableOptimizer`, a `torchref.train.TrainStep`
            (anything with a `skip_state` attribute), or an iterable of them.

    Returns:
        The first skip state found; None when there is none (e.g. a plain
        optimizer or ``stable_optimizer(..., skip_non_finite=False)``).

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(1))
        >>> find_skip_state(skip_non_finite(torch.optim.SGD([w], lr=0.1))).skipped_total
        0
        >>> find_skip_state(torch.optim.SGD([w], lr=0.1)) is None
        True
    """
    return find_state(
        obj,
        SkipNonFiniteState,
        "skip_state",
        # A StableOptimizer built with skip_non_finite=False guards nothing.
        skip=lambda x: isinstance(x, SkipNonFinite) and not x._guards(),
    )
