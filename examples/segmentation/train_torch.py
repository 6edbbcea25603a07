"""Segmentation training loop in PyTorch, on `torchref.train.TrainStep`.

Two modes (see `config.Config.mode`):

* ``stable``: float32 model and optimizer, ``torch.autocast("cpu", dtype)``
  for bfloat16/float16 compute, `torchref.losses.softmax_cross_entropy`
  (float32, ``ignore_index=255``), dynamic loss scaling (the real
  ``GradScaler`` via `torchref.loss_scale.DynamicLossScale`) for float16
  only (bfloat16 has float32's exponent range: nothing underflows that
  scaling would save), ``clip_grad_norm_`` and a skipped update on
  non-finite gradients: all done by `torchref.train.TrainStep`.
* ``naive``: what people run when they ``model.half()`` a model: the
  model, hence the optimizer state, in float16/bfloat16, ``F.cross_entropy``
  on the low-precision logits, a plain zero_grad/backward/step loop with no
  guard at all.

``train_and_evaluate(config)`` returns a `config.RunResult` with the same
fields as `train_jax.train_and_evaluate`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from examples.segmentation import config as config_lib
from examples.segmentation import data, model_torch
from torchref import diagnostics, losses, train
from torchref.loss_scale import DynamicLossScale, all_finite
from torchref.transforms import global_norm

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def initial_state_dict(config: config_lib.Config) -> dict[str, torch.Tensor]:
    """The initial U-Net weights of a run: torch's default init, seeded.

    Both frameworks start from these (the JAX loop converts them).

    Example:
        >>> sd = initial_state_dict(config_lib.get_config(width=4))
        >>> tuple(sd["head.weight"].shape)
        (6, 4, 1, 1)
    """
    torch.manual_seed(config.seed)
    model = build_model(config)
    return copy.deepcopy(model.state_dict())


def build_model(
    config: config_lib.Config, state_dict: Mapping[str, torch.Tensor] | None = None
) -> model_torch.UNet:
    """A float32 ``model_torch.UNet`` of the config's size (weights loaded if given).

    Example:
        >>> build_model(config_lib.get_config(width=4)).architecture()["width"]
        4
    """
    model = model_torch.UNet(
        in_channels=3,
        num_classes=config.num_classes,
        width=config.width,
        depth=config.depth,
    )
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def make_optimizer(config: config_lib.Config, params: Any) -> torch.optim.Optimizer:
    """The plain torch optimizer of the config (twin of `train_jax.make_optimizer`).

    Example:
        >>> m = torch.nn.Linear(2, 1)
        >>> opt = make_optimizer(config_lib.get_config(optimizer="sgd"), m.parameters())
        >>> type(opt).__name__, opt.defaults["momentum"]
        ('SGD', 0.9)
    """
    betas = (config.b1, config.b2)
    if config.optimizer == "adam":
        return torch.optim.Adam(
            params, lr=config.learning_rate, betas=betas, eps=config.eps
        )
    if config.optimizer == "adamw":
        return torch.optim.AdamW(
            params,
            lr=config.learning_rate,
            betas=betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    return torch.optim.SGD(params, lr=config.learning_rate, momentum=0.9)


def _to_torch(batch: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.from_numpy(data.to_nchw(batch["image"]))
    y = torch.from_numpy(np.asarray(batch["label"], np.int64))
    return x, y


def evaluate(
    model: torch.nn.Module,
    config: config_lib.Config,
    heldout: Mapping[str, np.ndarray],
) -> float:
    """Held-out mIoU in eval mode, in the run's compute precision.

    Stable runs evaluate their float32 model under autocast; naive runs their
    low-precision model. Returns nan when any logit is non-finite.

    Example:
        >>> cfg = config_lib.get_config(image_size=16, width=4, eval_images=2)
        >>> m = evaluate(build_model(cfg), cfg, config_lib.heldout_set(cfg))
        >>> 0.0 <= m <= 1.0
        True
    """
    model.eval()
    dtype = DTYPES[config.precision]
    param_dtype = next(model.parameters()).dtype
    preds, finite = [], True
    with torch.no_grad():
        for start in range(0, len(heldout["image"]), config.eval_batch_size):
            x = torch.from_numpy(
                data.to_nchw(heldout["image"][start : start + config.eval_batch_size])
            ).to(param_dtype)
            if config.mode == "stable" and dtype != torch.float32:
                with torch.autocast("cpu", dtype=dtype):
                    logits = model(x)
            else:
                logits = model(x)
            logits = logits.float()
            finite = finite and bool(torch.isfinite(logits).all())
            preds.append(logits.argmax(dim=1).numpy())
    model.train()
    if not finite:
        return float("nan")
    miou, _ = data.mean_iou(
        np.concatenate(preds), heldout["label"], config.num_classes, 255
    )
    return miou


def _params_finite(model: torch.nn.Module) -> bool:
    tensors = list(model.parameters()) + list(model.buffers())
    return all_finite([t for t in tensors if t.is_floating_point()])


def _stable(config, model):
    def loss_fn(m, batch):
        x, y = batch
        return losses.softmax_cross_entropy(
            m(x), y, dim=1, ignore_index=config_lib.IGNORE_INDEX
        )

    optimizer = make_optimizer(config, model.parameters())
    step = train.TrainStep(
        model,
        optimizer,
        loss_fn,
        max_grad_norm=config.max_grad_norm,
        # float16 only: its smallest subnormal is 6e-8, small gradients of a
        # mean over ~7k pixels vanish there; bfloat16 reaches 1e-38 like f32
        scaler=DynamicLossScale() if config.precision == "float16" else None,
        autocast_dtype=None
        if config.precision == "float32"
        else DTYPES[config.precision],
    )
    last = {}

    def step_fn(batch):
        metrics = step(_to_torch(batch))
        last["grads"] = {
            n: p.grad.detach().clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        # A step the guards skipped leaves the model as it was: only
        # non-finite params or buffers (batch statistics) are "broken".
        broken = not _params_finite(model)
        record = {k: metrics[k] for k in config_lib.METRIC_KEYS}
        return record, broken

    def report_fn():
        return "non-finite after the step:\n" + _report_text(
            {"grads": last.get("grads", {}), "params": dict(model.named_parameters())}
        )

    return step_fn, report_fn


def _naive(config, model):
    dtype = DTYPES[config.precision]
    model.to(dtype)  # the `.half()` recipe: weights, BN and optimizer state too
    optimizer = make_optimizer(config, model.parameters())
    named = dict(model.named_parameters())
    last: dict[str, Any] = {}

    def step_fn(batch):
        x, y = _to_torch(batch)
        old = {n: p.detach().clone() for n, p in named.items()}
        optimizer.zero_grad(set_to_none=True)
        logits = model(x.to(dtype))
        loss = F.cross_entropy(logits, y, ignore_index=config_lib.IGNORE_INDEX)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in named.items()}
        optimizer.step()
        new = {n: p.detach() for n, p in named.items()}
        last.update(grads=grads, old=old, new=new)
        finite = all_finite(list(grads.values())) and all_finite(list(new.values()))
        record = {
            "loss": float(loss.detach().float()),
            "grad_norm": float(global_norm(list(grads.values()))),
            "loss_scale": 1.0,
            "finite": bool(finite),
            "skipped_total": 0,
        }
        broken = not finite or not np.isfinite(record["loss"])
        return record, broken

    def report_fn():
        grads, old, new = last["grads"], last["old"], last["new"]
        updates = {n: new[n].float() - old[n].float() for n in new}
        text = "non-finite after the step:\n" + _report_text(
            {"grads": grads, "updates": updates, "params": new}
        )
        if config.optimizer in ("adam", "adamw"):
            nus = [
                optimizer.state[p]["exp_avg_sq"].float().numpy() for p in named.values()
            ]
            g = [grads[n].float().numpy() for n in named]
            text += "\n" + config_lib.adam_underflow_note(
                g, nus, config.precision, config.eps
            )
        return text

    return step_fn, report_fn


def _report_text(tree: Mapping[str, Any]) -> str:
    parts = []
    for name, sub in tree.items():
        report = diagnostics.non_finite_report(sub)
        total = sum(t.numel() for t in sub.values())
        bad = sum(r.nan_count + r.inf_count for r in report)
        parts.append(f"{name}: {bad} of {total} entries non-finite")
        if report:
            parts.append(diagnostics.format_report(report))
    return "\n".join(parts)


def train_and_evaluate(
    config: config_lib.Config,
    *,
    init_state_dict: Mapping[str, torch.Tensor] | None = None,
    batches: list[dict[str, np.ndarray]] | None = None,
    heldout: Mapping[str, np.ndarray] | None = None,
    log: Callable[[dict[str, Any]], None] | None = None,
    progress: bool = True,
) -> config_lib.RunResult:
    """Trains a torch U-Net as `config` says and scores it on the held-out split.

    Args:
      config: a `config.Config` (precision, mode, optimizer, sizes, steps).
      init_state_dict: initial weights (a ``model_torch.UNet`` state_dict);
        None: `initial_state_dict(config)`.
      batches: the train batches (NHWC numpy); None: `config.train_batches`.
      heldout: the evaluation set; None: `config.heldout_set`.
      log: called with each step's record (``step, loss, grad_norm,
        loss_scale, finite, skipped_total``).
      progress: show a tqdm progress bar.

    Returns:
      A `config.RunResult` (``framework="torch"``).

    Example:
        >>> cfg = config_lib.get_config(image_size=16, width=4, steps=2,
        ...                             eval_images=2)
        >>> r = train_and_evaluate(cfg, progress=False)
        >>> len(r.metrics), r.first_nonfinite_step, r.skipped_total
        (2, None, 0)
    """
    torch.set_num_threads(config.torch_threads)
    if init_state_dict is None:
        init_state_dict = initial_state_dict(config)
    if batches is None:
        batches = config_lib.train_batches(config)
    if heldout is None:
        heldout = config_lib.heldout_set(config)
    model = build_model(config, init_state_dict).train()
    make = _stable if config.mode == "stable" else _naive
    step_fn, report_fn = make(config, model)
    out = config_lib.run_steps(
        config,
        batches,
        step_fn,
        report_fn,
        desc=f"torch {config.label}",
        log=log,
        progress=progress,
    )
    return config_lib.run_result("torch", config, out, evaluate(model, config, heldout))
