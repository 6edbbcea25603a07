"""What `torchref.train.TrainStep` refuses, and its arguments made usable:
the model, optimizer and loss it is built over, the scaler (a torchref loss
scale made into a GradScaler; a GradScaler torch disabled gets a warning),
the autocast dtype or policy (its params dtype checked against the model's),
the micro-batch count, and a loss that is no scalar tensor.

The messages are those of `jaxstable.train.make_train_step` where the two
sides share a check.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from _stablecore.checks import check_microbatches as _core_check_microbatches
from torchref._src.guard import SkipNonFinite, check_optimizer, needs_closure
from torchref._src.loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
)
from torchref._src.precision import get_policy
from torchref._src.spikes import SkipSpikes

__all__ = [
    "autocast_dtype",
    "check_loss",
    "check_microbatches",
    "check_param_dtypes",
    "check_step_parts",
    "make_scaler",
    "warn_if_disabled_scaler",
]

_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)


def make_scaler(scaler: Any, device_type: str) -> torch.amp.GradScaler | None:
    if scaler is None or isinstance(scaler, torch.amp.GradScaler):
        return scaler
    if isinstance(scaler, NoOpLossScale | StaticLossScale | DynamicLossScale):
        return scaler.make_scaler(device_type)
    raise TypeError(
        "scaler must be None, a torch.amp.GradScaler or a torchref.loss_scale "
        f"NoOpLossScale/StaticLossScale/DynamicLossScale, got {type(scaler).__name__}"
    )


def warn_if_disabled_scaler(scaler: Any, device_type: str) -> None:
    """Warns when `scaler` is a GradScaler torch disabled for want of CUDA.

    ``torch.amp.GradScaler("cuda")`` on a machine without CUDA warns once, in
    torch's words, and turns itself off: every step then runs at loss scale
    1, unscaled, while the code reads as dynamic loss scaling (issue 35). A
    user's ``GradScaler("cuda", enabled=False)`` looks the same; it gets the
    warning too, whose last fix (``scaler=None``) silences it.
    """
    if (
        not isinstance(scaler, torch.amp.GradScaler)
        or scaler.is_enabled()
        or getattr(scaler, "_device", None) != "cuda"
        or torch.cuda.is_available()
    ):
        return
    warnings.warn(
        "scaler is a disabled torch.amp.GradScaler('cuda'): CUDA is not "
        "available here, so torch turned it off and TrainStep trains at loss "
        f"scale 1, without loss scaling. The model is on {device_type!r}: pass "
        f"torch.amp.GradScaler({device_type!r}) (or GradScaler(device) with "
        "device = next(model.parameters()).device.type, or "
        "torchref.loss_scale.DynamicLossScale(), which makes the GradScaler "
        "for the model's device); pass scaler=None to train unscaled without "
        "this warning",
        UserWarning,
        stacklevel=3,
    )


_MIXED_NAMES = ("mixed_float16", "mixed_bfloat16")


def autocast_dtype(dtype: Any, model: torch.nn.Module) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        policy = get_policy(dtype)
        spec = dtype.strip().lower()
        # A bare dtype name is the autocast dtype (the argument's meaning);
        # a policy that states the params' dtype must match the model's, as
        # jaxstable.train.make_train_step(policy=...) requires.
        if "=" in spec or spec in _MIXED_NAMES:
            check_param_dtypes(model, policy, dtype)
        dtype = policy.compute_dtype
    if dtype not in _AUTOCAST_DTYPES:
        raise ValueError(
            "autocast_dtype must be None, torch.float16 or torch.bfloat16, "
            f"got {dtype!r}"
        )
    return dtype


def check_microbatches(microbatches: Any) -> int | None:
    return _core_check_microbatches(microbatches)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_param_dtypes(model: torch.nn.Module, policy: Any, spec: str) -> None:
    want = _dtype_name(policy.param_dtype)
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != policy.param_dtype:
            have, compute = _dtype_name(p.dtype), _dtype_name(policy.compute_dtype)
            mixed = f" or 'mixed_{compute}'" if have == "float32" else ""
            # Same text as jaxstable.train.make_train_step (leaf named its way).
            raise ValueError(
                f"policy {spec!r} stores params in {want}, but params "
                f"leaf {name} is {have} "
                "(a single dtype name such as 'bf16' sets params, compute and "
                f"output). For {have} params computed in {compute} say "
                f"'params={have},compute={compute},output=float32'{mixed}; for "
                f"{want} params, cast them first. Policy grammar: one dtype "
                "name for params, compute and output (bf16, f16, f32, ...), "
                "mixed_float16 or mixed_bfloat16 (float32 params and output), or "
                "comma-separated key=dtype pairs with keys params|p, compute|c, "
                "output|o"
            )


def check_step_parts(
    model: Any, optimizer: Any, loss_fn: Any
) -> tuple[SkipSpikes | None, torch.optim.Optimizer]:
    """``(spikes, optimizer)``: the `skip_spikes` guard around the plain
    optimizer (None without one) and that optimizer, checked to drive one
    forward and backward per step and to own every trainable parameter of
    ``model`` (TypeError or ValueError naming the fix)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    spikes = None
    if isinstance(optimizer, SkipSpikes):
        if not optimizer.plain:
            raise TypeError(
                "TrainStep takes skip_spikes(plain_optimizer) (it checks, clips "
                "and skips itself), not skip_spikes around a torchref wrapper"
            )
        spikes, optimizer = optimizer, optimizer.optimizer.optimizer
    if isinstance(optimizer, SkipNonFinite):
        raise TypeError(
            "pass the plain torch optimizer (TrainStep skips non-finite steps "
            "itself), not a torchref.transforms wrapper: use wrapper.optimizer"
        )
    check_optimizer(optimizer, "TrainStep")
    if not callable(loss_fn):
        raise TypeError("loss_fn must be callable as loss_fn(model, batch)")
    if needs_closure(optimizer):
        name = type(optimizer).__name__
        raise TypeError(
            f"TrainStep cannot drive {name}: its step() re-evaluates the loss "
            "through a closure, and TrainStep takes one forward and backward "
            "per step (torch.amp's recipe; GradScaler.step refuses closures "
            f"too). Guard it with torchref.transforms.skip_non_finite({name}"
            "(...)) and call .step(closure) yourself"
        )
    _check_owns_params(model, optimizer)
    return spikes, optimizer


def _check_owns_params(model: torch.nn.Module, optimizer: Any) -> None:
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [
        n for n, p in model.named_parameters() if p.requires_grad and id(p) not in owned
    ]
    if missing:
        raise ValueError(
            "optimizer does not own these trainable parameters of the model "
            f"(GradScaler would leave their grads scaled): {', '.join(missing)}"
        )


def check_loss(out: Any) -> tuple[torch.Tensor, Any]:
    """``(loss, aux)`` of what ``loss_fn`` returned: ``loss`` or ``(loss,
    aux)``, the loss a 0-d tensor (ValueError otherwise)."""
    loss, aux = out if isinstance(out, tuple) else (out, None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            "loss_fn must return a scalar (0-d) loss tensor (or (loss, aux)), "
            f"got {type(loss).__name__}"
        )
    if loss.ndim != 0:
        # Same text as jaxstable.train.make_train_step.
        raise ValueError(
            "loss_fn must return a scalar (0-d) loss, got shape "
            f"{tuple(loss.shape)}; reduce it, e.g. with .mean()"
        )
    return loss, aux
