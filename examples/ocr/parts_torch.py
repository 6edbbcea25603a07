"""The torch side of an OCR run: the DBNet, its loss and its evaluation.

`torch_parts(config, weights)` hands the harness what is specific to OCR
(see `examples.harness.parts.TorchParts`). The two modes:

* ``naive``: what the DBNet report's team ran, in mixed precision without
  any guard: float32 parameters and optimizer state, the forward under
  ``torch.autocast``, and `loss_torch.naive_loss` in the compute dtype with
  the step function written as ``reciprocal(1 + exp(-k (P - T)))``; no loss
  scale, no clip, no skip. Parameters are kept in float32 so that what
  breaks is the DBNet recipe, not Adam's float16 state (that is the
  segmentation task's story).
* ``stable``: `db_step` inside the model, the float32 `db_loss`
  (`loss_torch.stable_loss`), and the harness's guards (dynamic loss scale
  for float16, clip, skip).

Under ``compare.py --devices N`` (DDP) both losses are computed on the
GLOBAL batch on every rank (`examples.harness.collective.gather_rows`): the
balanced BCE mines its hard negatives among the whole batch's pixels and
every masked mean divides by the whole batch's mask, as on one device.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from examples.harness import ddp
from examples.harness.config import torch_dtype
from examples.harness.parts import TorchParts
from examples.ocr import data, loss_torch, metric, model_torch
from examples.ocr.config import Config
from examples.ocr.probe import overflow_note


def scores(probs: np.ndarray, config: Config, heldout) -> dict[str, float]:
    """The held-out metrics of the probability maps (`metric.evaluate`)."""
    return metric.evaluate(probs, heldout, box_thresh=config.box_thresh)


def build_model(config: Config, state_dict=None):
    """A float32 ``model_torch.DBNet`` of the config's size (weights if given).

    Example:
        >>> build_model(Config(width=4)).architecture()["width"]
        4
    """
    model = model_torch.DBNet(in_channels=3, width=config.width, k=config.k)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def initial_weights(config: Config) -> dict[str, Any]:
    """torch's seeded default init of the DBNet; both frameworks start from it.

    Example:
        >>> sd = initial_weights(Config(width=4))
        >>> sorted(sd)[0]
        'backbone.stage1.conv.bn.bias'
    """
    torch.manual_seed(config.seed)
    return copy.deepcopy(build_model(config).state_dict())


def to_torch(batch: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """A numpy batch as torch tensors (NCHW images, DBNet's maps)."""
    out = {key: torch.from_numpy(np.asarray(batch[key])) for key in data.MAP_KEYS}
    out["image"] = torch.from_numpy(data.to_nchw(batch["image"]))
    return out


def _global(out, batch):
    """The model's output maps and DBNet's target maps of the whole batch
    under DDP (`ddp.gather_rows`), as they are in one process."""
    return ddp.gather_rows((out, {key: batch[key] for key in data.MAP_KEYS}))


def _evaluate(model, heldout, config) -> dict[str, float]:
    param_dtype = next(model.parameters()).dtype
    probs = []
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        x = data.to_nchw(heldout["image"][start : start + config.eval_batch_size])
        logits = model(torch.from_numpy(x).to(param_dtype))["logits"]
        probs.append(torch.sigmoid(logits.float()).numpy())
    return scores(np.concatenate(probs), config, heldout)


def torch_parts(config: Config, weights) -> TorchParts:
    """The torch DBNet of a run, its loss and its evaluation.

    Example:
        >>> cfg = Config(width=4, mode="naive", precision="float16")
        >>> parts = torch_parts(cfg, initial_weights(cfg))
        >>> next(parts.model.parameters()).dtype  # float32 master weights
        torch.float32
    """
    model = build_model(config, weights).train()
    if config.mode == "stable":

        def loss_fn(m, batch):
            out, maps = _global(m(batch["image"]), batch)
            return loss_torch.stable_loss(out, maps, k=config.k)[0]

    else:
        dtype = torch_dtype(config.precision)

        def loss_fn(m, batch):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                out = m(batch["image"])
            # the team's loss on the compute-dtype maps, outside autocast (whose
            # float32 op lists would otherwise decide the dtype of exp)
            out = {key: out[key].to(dtype) for key in ("logits", "thresh")}
            out, maps = _global(out, batch)
            return loss_torch.naive_loss(out, maps, k=config.k)[0]

    def probe(m, batch):
        dtype = torch_dtype(config.precision)
        with torch.no_grad():
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                out = m.train()(batch["image"])
            prob = torch.sigmoid(out["logits"].to(dtype))
            diff = prob - out["thresh"].to(dtype)
            inf = torch.isinf(torch.exp(-config.k * diff))
        return overflow_note(
            diff.float().numpy(), inf.numpy(), config.k, config.precision
        )

    return TorchParts(
        model=model,
        loss_fn=loss_fn,
        to_torch=to_torch,
        evaluate=lambda m, heldout: _evaluate(m, heldout, config),
        probe=probe if config.mode == "naive" else None,
    )
