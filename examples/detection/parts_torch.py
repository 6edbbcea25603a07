"""The torch side of a detection run: the detector, its loss and evaluation.

`torch_parts(config, weights)` hands the harness what is specific to
detection (see `examples.harness.parts.TorchParts`). The two modes:

* ``naive``: a typical first implementation in mixed precision without any
  guard: float32 parameters and optimizer state, the forward under
  ``torch.autocast``, the focal and CIoU losses written from the papers with
  no eps, in the compute dtype (`loss_torch.naive_loss`); no loss scale, no
  clip, no skip.
* ``stable``: the library's float32 `sigmoid_focal_loss` and
  `box_iou_loss(kind="ciou")` (finite on degenerate boxes;
  `loss_torch.stable_loss`) and the harness's guards (dynamic loss scale for
  float16, clip, skip).

With ``optimizer="sgd"`` (the default) both train with the YOLO recipe
(`recipe.for_config`, `recipe_torch`) and are evaluated with its weight EMA.

Under ``compare.py --devices N`` (DDP) both losses are computed on the
GLOBAL batch on every rank (`examples.harness.collective.gather_rows`): the sum of
the focal and box terms over the whole batch divided by its number of
boxes, as on one device (a rank's own mean would divide by its own count).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from examples.detection import data, loss_torch, metric, model_torch, recipe_torch
from examples.detection.config import Config
from examples.detection.probe import cause_note
from examples.detection.recipe import for_config, settings
from examples.harness import ddp
from examples.harness.config import torch_dtype
from examples.harness.parts import TorchParts


def build_model(config: Config, state_dict=None):
    """A float32 ``model_torch.Detector`` of the config's size (weights if given).

    Example:
        >>> build_model(Config(width=4)).architecture()["width"]
        4
    """
    model = model_torch.Detector(
        in_channels=3, num_classes=data.NUM_CLASSES, width=config.width
    )
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def initial_weights(config: Config) -> dict[str, Any]:
    """torch's seeded default init of the detector; both frameworks start from it.

    Example:
        >>> sd = initial_weights(Config(width=4))
        >>> round(float(sd["cls.bias"][0]), 6)  # RetinaNet's prior, p = 0.01
        -4.59512
    """
    torch.manual_seed(config.seed)
    return copy.deepcopy(build_model(config).state_dict())


def to_torch(batch: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """A numpy batch as torch tensors (NCHW images, the box targets)."""
    out = {key: torch.from_numpy(np.asarray(batch[key])) for key in data.BOX_KEYS}
    out["image"] = torch.from_numpy(data.to_nchw(batch["image"]))
    return out


def scores(cls_logits, box_raw, heldout) -> dict[str, float]:
    """The held-out mAP@0.5 of the raw outputs (`metric.evaluate`)."""
    return metric.evaluate(cls_logits, box_raw, heldout)


def _global(out, batch):
    """The model's outputs and the box targets of the whole batch under DDP
    (`ddp.gather_rows`): the loss divides by the global box count."""
    return ddp.gather_rows((out, {key: batch[key] for key in data.BOX_KEYS}))


def _evaluate(model, heldout, config) -> dict[str, float]:
    param_dtype = next(model.parameters()).dtype
    cls, box = [], []
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        x = data.to_nchw(heldout["image"][start : start + config.eval_batch_size])
        out = model(torch.from_numpy(x).to(param_dtype))
        cls.append(out["cls"].float().permute(0, 2, 3, 1).numpy())
        box.append(out["box"].float().permute(0, 2, 3, 1).numpy())
    return scores(np.concatenate(cls), np.concatenate(box), heldout)


def torch_parts(config: Config, weights) -> TorchParts:
    """The torch detector of a run, its loss and its evaluation.

    Example:
        >>> cfg = Config(width=4, mode="naive", precision="float16")
        >>> parts = torch_parts(cfg, initial_weights(cfg))
        >>> next(parts.model.parameters()).dtype  # float32 master weights
        torch.float32
    """
    model = build_model(config, weights).train()
    dtype = torch_dtype(config.precision)

    def forward(m, batch):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = m(batch["image"])
        # the loss in the compute dtype, outside autocast (whose float32 op
        # lists would otherwise decide the dtype of exp and log)
        return {key: out[key].to(dtype) for key in ("cls", "box")}

    if config.mode == "stable":

        def loss_fn(m, batch):
            return loss_torch.stable_loss(*_global(m(batch["image"]), batch))[0]

    else:

        def loss_fn(m, batch):
            return loss_torch.naive_loss(*_global(forward(m, batch), batch))[0]

    def probe(m, batch):
        out = forward(m.train(), batch)
        out = {key: v.detach() for key, v in out.items()}
        pred = loss_torch.gather_boxes(out, batch).requires_grad_(True)
        box = loss_torch.naive_ciou(pred, batch["boxes"])
        box.sum().backward()
        grad_ok = torch.isfinite(pred.grad).all(-1)
        logits = out["cls"].permute(0, 2, 3, 1)
        focal = loss_torch.naive_focal(logits, batch["heatmap"].to(logits.dtype))
        return cause_note(
            box.detach().float().numpy(),
            grad_ok.numpy(),
            focal.float().numpy(),
            torch.sigmoid(logits).float().numpy(),
            {k: batch[k].float().numpy() for k in ("boxes", "classes")}
            | {"box_mask": batch["box_mask"].numpy()},
            config.precision,
        )

    recipe, ema = for_config(config), None
    if config.optimizer == "sgd" and config.ema_decay > 0:
        ema = recipe_torch.WeightEma(
            model, recipe.steps, decay=config.ema_decay, tau=config.ema_tau
        )

    def optimizer(m):
        opt, scheduler = recipe_torch.yolo_optimizer(
            m, recipe.steps, **settings(recipe)
        )
        return opt, scheduler if ema is None else recipe_torch.StepHooks(
            scheduler, ema, m
        )

    def evaluate(m, heldout):
        return _evaluate(m if ema is None else ema.averaged(m), heldout, config)

    return TorchParts(
        model=model,
        loss_fn=loss_fn,
        to_torch=to_torch,
        evaluate=evaluate,
        probe=probe if config.mode == "naive" else None,
        optimizer=optimizer if config.optimizer == "sgd" else None,
    )
