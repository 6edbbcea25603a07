"""Whether `optimizer.step()` wrote only finite values, and undoing it.

torch cannot tell before a step has written it whether the step is finite
(Adam's float16 second moment underflowing to 0, ``eps=0``), so the guards
keep the values before it: `DeviceSelect` (one copy, selected back on the
device with `torch.where`), `StepUndo` (the closure path, decided on the
host). Where no copy can be needed is proved in `update_bound`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from torchref._src.clipping import by_device_dtype, is_dtensor
from torchref._src.loss_scale_math import all_finite

__all__ = ["DeviceSelect", "StepUndo"]


class StepUndo:
    """Undoes an `optimizer.step()` that wrote a non-finite value.

    ``take(optimizer)`` copies every parameter and every tensor of the
    optimizer state into buffers kept from step to step (allocated once);
    ``written_finite()`` checks the parameters and the state after the step
    (one `all_finite`, one host sync); ``restore()`` copies the saved values
    back and drops state the step created (Adam's first step creates it).
    Cost per step: one copy of parameters + state and one finiteness pass
    over them (`benchmarks/bench_step.py` measures it).
    """

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(id(t))
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty_like(t, memory_format=torch.preserve_format)
            self._buffers[id(t)] = buf
        return buf

    @torch.no_grad()
    def take(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        refuse_sharded_update_check(self.params)
        live, saved = [p.detach() for p in self.params], []
        self.state: dict[torch.Tensor, dict[str, Any] | None] = {}
        for p in self.params:
            st = optimizer.state.get(p)
            if not st:
                self.state[p] = None
                continue
            entry = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    entry[k] = self._copy(v)
                    live.append(v.detach())
                    saved.append(entry[k])
                else:  # a python step count, None momentum buffer, ...
                    entry[k] = copy.deepcopy(v)
            self.state[p] = entry
        self._live_params = live[: len(self.params)]
        # Keyed by the parameter itself (a `.detach()` is a new object).
        self._saved_params = [self._copy(p) for p in self.params]
        _foreach_copy_by_device(self._saved_params + saved, live)

    def written_finite(self) -> bool:
        # Every tensor: all_finite checks the floating AND complex ones (a
        # complex64 Adam moment that overflows is caught) and skips integers.
        state = [
            v
            for p in self.params
            for v in self.optimizer.state.get(p, {}).values()
            if isinstance(v, torch.Tensor)
        ]
        return all_finite(self._live_params + state)

    @torch.no_grad()
    def restore(self) -> None:
        _foreach_copy_by_device(self._live_params, self._saved_params)
        for p, saved in self.state.items():
            if saved is None:
                self.optimizer.state.pop(p, None)
                continue
            live = self.optimizer.state[p]
            for k in list(live):
                if k not in saved:
                    del live[k]
            for k, v in saved.items():
                old = live.get(k)
                if isinstance(v, torch.Tensor):
                    if isinstance(old, torch.Tensor) and old.shape == v.shape:
                        old.copy_(v)
                    else:
                        live[k] = v.clone()
                else:
                    live[k] = copy.deepcopy(v)


def refuse_sharded_update_check(params: list[torch.Tensor]) -> None:
    """The update check on sharded (DTensor / FSDP2) parameters is refused:
    each rank would check its own shard only and could decide differently
    from the others, and DTensor has no ``_foreach_copy_``."""
    if any(is_dtensor(p) for p in params):
        raise NotImplementedError(
            "check_update does not support sharded (DTensor / FSDP2) "
            "parameters: build the step with check_update=False (the "
            "gradient check stays global through GradScaler's found_inf)"
        )


class DeviceSelect:
    """Keeps a copy of some tensors and puts it back where a flag says.

    ``take(tensors)`` copies them into one flat buffer per (device, dtype),
    allocated once and kept from step to step (one `torch._foreach_copy_`
    each into views of it, made once too: the one extra copy).
    ``put_back(keep_old)`` sets ``t = keep_old ? saved : t`` with one
    in-place `torch.where` per tensor on a view of the flat buffer: no
    temporary, no host sync (`torch.where` selects, so a NaN the step wrote
    never mixes in; an arithmetic blend ``t*(1-k) + saved*k`` would keep
    it: NaN * 0 is NaN). ``restore()`` copies everything back (a host that
    already knows), one `torch._foreach_copy_` per group.
    """

    def __init__(self) -> None:
        self._flat: dict[Any, torch.Tensor] = {}
        self._groups: dict[Any, list[torch.Tensor]] = {}
        # Per group: the shapes the flat buffer is laid out for, and its
        # views in those shapes (a split costs more than the copy itself).
        self._views: dict[Any, tuple[list[torch.Size], list[torch.Tensor]]] = {}

    @torch.no_grad()
    def take(self, tensors: list[torch.Tensor]) -> None:
        self._groups = by_device_dtype(_detached(tensors))
        for key, group in self._groups.items():
            torch._foreach_copy_(self._laid_out(key, group), group)
        for key in [k for k in self._flat if k not in self._groups]:
            del self._flat[key]  # a group no longer stepped keeps no copy
            del self._views[key]

    def _laid_out(self, key: Any, group: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of the flat buffer of `key` in the shapes of `group`; the
        buffer is allocated again only when its size changes."""
        shapes = [t.shape for t in group]
        if key in self._views and self._views[key][0] == shapes:
            return self._views[key][1]
        n = sum(t.numel() for t in group)
        self._views.pop(key, None)  # the views hold the old buffer too
        old = self._flat.get(key)
        if old is None or old.numel() != n:
            old = self._flat.pop(key, None)
            del old  # freed first: never two copies at once
            self._flat[key] = torch.empty(n, dtype=key[1], device=key[0])
        parts = self._flat[key].split([t.numel() for t in group])
        self._views[key] = (
            shapes,
            [v.view(s) for v, s in zip(parts, shapes, strict=True)],
        )
        return self._views[key][1]

    def retarget(self, tensors: list[torch.Tensor]) -> bool:
        """Puts the copy back into `tensors` instead of the ones taken (a
        module that assigned new buffers); False (nothing changed) when
        their shapes or dtypes do not match those taken one for one."""
        groups = by_device_dtype(_detached(tensors))
        shapes = {k: [t.shape for t in g] for k, g in groups.items()}
        if shapes != {k: [t.shape for t in g] for k, g in self._groups.items()}:
            return False
        self._groups = groups
        return True

    def _saved(self, key: Any) -> list[torch.Tensor]:
        return self._views[key][1]

    @torch.no_grad()
    def put_back(self, keep_old: torch.Tensor) -> None:
        for key, group in self._groups.items():
            flag = keep_old.to(key[0])
            for t, old in zip(group, self._saved(key), strict=True):
                torch.where(flag, old, t, out=t)

    @torch.no_grad()
    def restore(self) -> None:
        for key, group in self._groups.items():
            torch._foreach_copy_(group, self._saved(key))

    @torch.no_grad()
    def new_non_finite(self) -> torch.Tensor | None:
        """Whether an element the copy held finite is non-finite now (0-d
        bool tensor; None for no floating tensor): an element that was
        already non-finite (an additive ``-inf`` mask) is no bad write."""
        flags = []
        for key, group in self._groups.items():
            if not (key[1].is_floating_point or key[1].is_complex):
                continue
            now = torch.cat([t.reshape(-1) for t in group])
            was = torch.isfinite(self._flat[key])
            # A group's tensors share its device: key[0] is their home.
            flags.append((was & ~torch.isfinite(now)).any().to(key[0]))
        return torch.stack(flags).any() if flags else None


def _detached(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors, detached where they require a gradient (a buffer needs
    no new tensor object a step)."""
    return [t.detach() if t.requires_grad else t for t in tensors]


def _foreach_copy_by_device(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """`torch._foreach_copy_` per device: one list mixing devices (Adam keeps
    its ``step`` tensors on the CPU beside CUDA moments) takes torch's
    per-tensor slow path, one launch per tensor."""
    groups: dict[Any, tuple[list, list]] = {}
    for d, s in zip(dst, src, strict=True):
        pair = groups.setdefault(d.device, ([], []))
        pair[0].append(d)
        pair[1].append(s)
    for d, s in groups.values():
        torch._foreach_copy_(d, s)
