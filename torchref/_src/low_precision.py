"""AdamW with low-precision moments and parameters that keep their updates.

`LowPrecisionAdamW` (built by `low_precision_adamw`) stores Adam's moments in
a chosen dtype (float32, bfloat16, or float16 / float8 with a per-tensor
scale), computes the update in float32, and rounds it into the parameters'
own dtype by round-to-nearest, stochastic rounding (a generator seeded from
the optimizer's seed, the parameter's index and its step, all in the
state dict) or Kahan summation (a compensation buffer in the parameters'
dtype). Its state also says, per step, how much of the update rounding lost
(`RoundingStats`). `jaxstable.transforms.low_precision_adamw` computes the
same thing.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch

from _stablecore.low_precision import (
    DTYPE_LIMITS,
    SCALED_DTYPES,
    RoundingStats,
    StallMonitor,
    check_hyper,
    check_param_update,
    check_state_dtype,
    stochastic_dtype_error,
)

__all__ = [
    "LowPrecisionAdamW",
    "RoundingStats",
    "StallMonitor",
    "low_precision_adamw",
    "rounding_stats",
]

_F32 = torch.float32
# The per-parameter sums behind `RoundingStats`, in this order.
_SUMS = ("err", "u", "moving", "lost", "dec", "dlost", "under", "entries")


def _storage(dtype: str) -> torch.dtype:
    """What a moment of ``dtype`` is kept as: float8 as its uint8 bits
    (torch's foreach kernels, and so the guards' finiteness checks, refuse
    float8; the values are clipped to the finite range, so the bits hold
    nothing a check could miss that the update would not show)."""
    return torch.uint8 if dtype.startswith("float8") else getattr(torch, dtype)


def _load(q: torch.Tensor, scale: torch.Tensor | None, dtype: str) -> torch.Tensor:
    if q.dtype == torch.uint8:
        q = q.view(getattr(torch, dtype))
    return q.to(_F32) if scale is None else q.to(_F32) * scale


def _store(x: torch.Tensor, dtype: str, floor: bool):
    """``(stored, scale, underflowed)``, as jaxstable's `_store`: scaled per
    tensor for the narrow formats (``scale`` None for the others), clipped
    to the largest finite (torch saturates a float8_e4m3fn cast where JAX
    gives NaN), a positive entry below the smallest normal stored as that
    normal with ``floor``."""
    big, tiny = DTYPE_LIMITS[dtype]
    scale, y = None, x
    if dtype in SCALED_DTYPES:
        amax = x.abs().amax()
        one = torch.ones((), dtype=_F32, device=x.device)
        scale = torch.where(amax > 0, amax / big, one)
        y = x / scale
    y = y.clamp(-big, big)
    under = (y > 0) & (y < tiny)
    if floor:
        y = torch.where(under, torch.full_like(y, tiny), y)
    return y.to(getattr(torch, dtype)).view(_storage(dtype)), scale, under


def _round_stochastic(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """float32 -> bfloat16, up with probability (t - down) / ulp: a random
    16-bit integer added to the bits bfloat16 drops, then truncated (int32
    wraps like uint32 here). Non-finite values pass as they are."""
    noise = torch.randint(
        0, 1 << 16, t.shape, generator=generator, device=t.device, dtype=torch.int32
    )
    bits = (t.contiguous().view(torch.int32) + noise) & -65536
    out = torch.where(torch.isfinite(t), bits.view(_F32), t)
    return out.to(torch.bfloat16)


def _apply(mode, p, u, comp, generator):
    """``(new_p, new_comp, effective)`` as jaxstable's `_apply`."""
    p32 = p.to(_F32)
    t = p32 + u
    if mode == "kahan":
        y = comp.to(_F32) + u
        new = (p32 + y).to(p.dtype)
        moved = new.to(_F32) - p32
        new_comp = (y - moved).to(p.dtype)
        return new, new_comp, moved + (new_comp.to(_F32) - comp.to(_F32))
    if mode == "stochastic" and p.dtype == torch.bfloat16:
        return _round_stochastic(t, generator), comp, t - p32
    new = t.to(p.dtype)
    return new, comp, new.to(_F32) - p32


def _sums(u, decay, eff, under) -> torch.Tensor:
    lost = (u != 0) & (eff == 0)
    return torch.stack(
        [
            (eff - u).square().sum(),
            u.square().sum(),
            (u != 0).sum(dtype=_F32),
            lost.sum(dtype=_F32),
            decay.abs().sum(),
            torch.where(lost, decay.abs(), 0).sum(),
            under.sum(dtype=_F32),
            torch.tensor(float(u.numel()), dtype=_F32, device=u.device),
        ]
    )


def _seed(seed: int, index: int, step: int) -> int:
    # A fixed mix of the three, so each (parameter, step) draws its own
    # stream and a restored optimizer draws the same bits again.
    mixed = seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + step
    return mixed % (1 << 63)


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW with moments in a chosen dtype and a chosen parameter rounding.

    See `low_precision_adamw` for the maths and the options. Per-parameter
    state: ``step`` (a python int), ``b1_power`` / ``b2_power`` (float32
    running products of the bias correction), ``mu`` / ``nu`` (stored
    moments; float8 ones as their uint8 bits), ``mu_scale`` / ``nu_scale``
    (float32 per tensor, for float16 and float8 storage only),
    ``compensation`` (``param_update="kahan"``) and ``rounding`` (the sums
    behind `rounding_stats`). Every tensor keeps its dtype through
    ``load_state_dict`` (torch's own would cast them all to the parameter's).

    Example:
      >>> import torch
      >>> from torchref.transforms import LowPrecisionAdamW
      >>> w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
      >>> opt = LowPrecisionAdamW([w], lr=1e-3, nu_dtype="bfloat16")
      >>> w.grad = torch.ones_like(w)
      >>> opt.step()
      >>> opt.state[w]["nu"].dtype, w.dtype
      (torch.bfloat16, torch.bfloat16)
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-4,
        *,
        mu_dtype: Any = "float32",
        nu_dtype: Any = "float32",
        param_update: str = "nearest",
        seed: int = 0,
    ) -> None:
        check_hyper("lr", lr, 0.0, None)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (b1, b2), got {betas!r}")
        betas = (
            check_hyper("b1", betas[0], 0.0, 1.0),
            check_hyper("b2", betas[1], 0.0, 1.0),
        )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": check_hyper("eps", eps, 0.0, None),
            "weight_decay": check_hyper("weight_decay", weight_decay, 0.0, None),
            "mu_dtype": check_state_dtype("mu_dtype", mu_dtype),
            "nu_dtype": check_state_dtype("nu_dtype", nu_dtype),
            "param_update": check_param_update(param_update),
            "seed": seed,
        }
        super().__init__(params, defaults)
        for i, p in enumerate(self._params()):
            if defaults["param_update"] == "stochastic" and p.dtype not in (
                torch.bfloat16,
                _F32,
            ):
                raise ValueError(
                    stochastic_dtype_error(
                        f"parameter {i}", str(p.dtype).removeprefix("torch.")
                    )
                )
        self._generators: dict[torch.device, torch.Generator] = {}

    def _params(self) -> list[torch.Tensor]:
        return list(chain.from_iterable(g["params"] for g in self.param_groups))

    def _generator(self, device: torch.device, seed: int) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        gen.manual_seed(seed)
        return gen

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        st = self.state[p]
        one = torch.ones((), dtype=_F32, device=p.device)
        st["step"] = 0
        st["b1_power"], st["b2_power"] = one.clone(), one.clone()
        st["mu"] = torch.zeros(
            p.shape, dtype=_storage(group["mu_dtype"]), device=p.device
        )
        st["nu"] = torch.zeros(
            p.shape, dtype=_storage(group["nu_dtype"]), device=p.device
        )
        for name in ("mu", "nu"):
            if group[name + "_dtype"] in SCALED_DTYPES:
                st[name + "_scale"] = one.clone()
        if group["param_update"] == "kahan":
            st["compensation"] = torch.zeros_like(
                p, memory_format=torch.preserve_format
            )
        st["rounding"] = torch.zeros(len(_SUMS), dtype=_F32, device=p.device)
        return st

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step over every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                st = self.state[p] or self._init_state(p, group)
                self._update(p, st, group, b1, b2, index)
        return loss

    def _update(self, p, st, group, b1, b2, index) -> None:
        mode = group["param_update"]
        lr = torch.as_tensor(group["lr"], dtype=_F32, device=p.device)
        st["b1_power"] = st["b1_power"] * b1
        st["b2_power"] = st["b2_power"] * b2
        bc1, bc2 = 1.0 - st["b1_power"], 1.0 - st["b2_power"]
        g32 = p.grad.to(_F32)
        mu = _load(st["mu"], st.get("mu_scale"), group["mu_dtype"])
        nu = _load(st["nu"], st.get("nu_scale"), group["nu_dtype"])
        m = b1 * mu + (1.0 - b1) * g32
        v = b2 * nu + (1.0 - b2) * (g32 * g32)
        adam = (m / bc1) / (torch.sqrt(v / bc2) + group["eps"])
        # v == 0 with m != 0: g * g underflowed; m / (0 + eps) would be a
        # step of unknown scale.
        adam = torch.where(v > 0, adam, 0.0)
        decay = lr * group["weight_decay"] * p.to(_F32)
        u = -(lr * adam) - decay
        gen = None
        if mode == "stochastic":
            gen = self._generator(p.device, _seed(group["seed"], index, st["step"]))
        new_p, new_c, eff = _apply(mode, p, u, st.get("compensation"), gen)
        st["mu"], mu_scale, _ = _store(m, group["mu_dtype"], floor=False)
        st["nu"], nu_scale, under = _store(v, group["nu_dtype"], floor=True)
        for name, scale in (("mu_scale", mu_scale), ("nu_scale", nu_scale)):
            if scale is not None:
                st[name] = scale
        if mode == "kahan":
            st["compensation"].copy_(new_c)
        p.copy_(new_p)
        st["rounding"].copy_(_sums(u, decay, eff, under))
        st["step"] += 1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, then every state tensor back in its saved dtype (torch
        casts floating state to the parameter's dtype: a float32 moment of a
        bfloat16 parameter would come back rounded, and resume drift)."""
        saved = state_dict["state"]
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        super().load_state_dict(state_dict)
        for pid, p in zip(ids, self._params(), strict=True):
            for key, value in saved.get(pid, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)


def low_precision_adamw(
    params: Any,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    *,
    mu_dtype: Any = "float32",
    nu_dtype: Any = "float32",
    param_update: str = "nearest",
    seed: int = 0,
) -> LowPrecisionAdamW:
    """AdamW with moments in a chosen dtype and a chosen parameter rounding.

    The step, in float32 whatever the stored dtypes (``t`` = the
    parameter's steps so far, moments read back as ``stored * scale``)::

        m = b1 * m + (1 - b1) * g;      v = b2 * v + (1 - b2) * g * g
        u = -lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) - lr * wd * p

    (``u``'s Adam part is 0 where ``v`` is 0: ``g * g`` underflowed float32,
    and ``m / eps`` would be a step of unknown size), then ``m`` and ``v``
    are stored in ``mu_dtype`` / ``nu_dtype`` (float16
    and float8 with a per-tensor scale; a ``v`` entry that would underflow
    is stored as the smallest normal, never 0: read back as 0 it would make
    the next update ``m / eps``) and ``u`` is rounded into the parameter's
    dtype by ``param_update``:

    - ``"nearest"``: round-to-nearest-even, what ``p.add_(u)`` does. In
      bfloat16 an update below half an ulp (2**-9 of the weight) is lost;
      weight decay with ``lr * wd < 2**-9`` never shrinks a weight.
    - ``"stochastic"``: bfloat16 parameters round up with probability
      ``(p + u - down) / ulp`` (unbiased). The bits come from a
      ``torch.Generator`` seeded from (``seed``, the parameter's index, its
      step): a skipped step (undone) and a restored checkpoint draw the same
      bits again. float32 parameters take ``u`` as is.
    - ``"kahan"``: a compensation buffer per parameter (its dtype) carries
      what rounding dropped into the next step.

    The same arithmetic as `jaxstable.transforms.low_precision_adamw`, in the
    same order (the Kahan path agrees to the bit on CPU).

    Args:
      params: parameters or parameter groups, as for ``torch.optim.AdamW``.
      lr: learning rate (>= 0; schedulers change ``param_groups[i]["lr"]``).
      betas: ``(b1, b2)``, each in [0, 1).
      eps: added to ``sqrt(v_hat)`` (>= 0).
      weight_decay: decoupled decay (>= 0), as ``torch.optim.AdamW``'s.
      mu_dtype: storage of ``m``: ``"float32"``, ``"bfloat16"``,
        ``"float16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"`` or the torch
        dtype of that name.
      nu_dtype: storage of ``v``, the same choices.
      param_update: ``"nearest"``, ``"stochastic"`` or ``"kahan"``.
      seed: seed of the stochastic rounding (an int).

    Returns:
      A `LowPrecisionAdamW` (a ``torch.optim.Optimizer``: it goes inside
      `stable_optimizer`, `skip_spikes` and `TrainStep` like any other).

    Example:
      >>> import torch
      >>> from torchref.transforms import low_precision_adamw
      >>> w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
      >>> opt = low_precision_adamw([w], lr=1e-4, weight_decay=0.0,
      ...                           param_update="kahan", mu_dtype="bfloat16",
      ...                           nu_dtype="bfloat16")
      >>> for _ in range(3):
      ...     w.grad = torch.ones_like(w)
      ...     opt.step()
      >>> float(w.detach()[0])  # 1 - 3e-4: below half an ulp (2**-9)
      1.0
      >>> float(opt.state[w]["compensation"][0])  # kept for the next steps
      -0.000301361083984375
    """
    return LowPrecisionAdamW(
        params,
        lr,
        betas,
        eps,
        weight_decay,
        mu_dtype=mu_dtype,
        nu_dtype=nu_dtype,
        param_update=param_update,
        seed=seed,
    )


def _find(obj: Any) -> LowPrecisionAdamW | None:
    for _ in range(16):
        if isinstance(obj, LowPrecisionAdamW):
            return obj
        obj = getattr(obj, "optimizer", None)
        if obj is None:
            return None
    return None


def rounding_stats(obj: Any) -> RoundingStats | None:
    """The `RoundingStats` of a `LowPrecisionAdamW`, also inside a wrapper
    (`stable_optimizer`, `skip_spikes`, a `TrainStep`), or None when there
    is none: 0-d float32 tensors summed over the parameters' latest steps
    (no host sync). After a skipped step they are those of the latest
    applied one (the undo restores them with the rest of the state).

    Example:
      >>> import torch
      >>> from torchref.transforms import (low_precision_adamw, rounding_stats,
      ...                                  stable_optimizer)
      >>> w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
      >>> opt = stable_optimizer(low_precision_adamw([w], 1e-5, weight_decay=0.0))
      >>> w.grad = torch.ones_like(w)
      >>> opt.step()
      >>> float(rounding_stats(opt).lost_update)  # 1e-5 < half an ulp of 1
      1.0
    """
    opt = _find(obj)
    if opt is None:
        return None
    rows = [st["rounding"] for st in opt.state.values() if "rounding" in st]
    if not rows:
        return RoundingStats(
            *(torch.zeros((), dtype=_F32) for _ in RoundingStats._fields)
        )
    home = rows[0].device
    t = dict(zip(_SUMS, torch.stack([r.to(home) for r in rows]).sum(0), strict=True))

    def ratio(num, den):
        return torch.where(den > 0, num / torch.where(den > 0, den, 1), 0.0)

    return RoundingStats(
        lost_update=torch.sqrt(ratio(t["err"], t["u"])),
        lost_params=ratio(t["lost"], t["moving"]),
        lost_decay=ratio(t["dlost"], t["dec"]),
        nu_underflow=t["under"] / torch.clamp(t["entries"], min=1.0),
    )
