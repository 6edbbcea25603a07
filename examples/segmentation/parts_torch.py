"""The torch side of a segmentation run: the U-Net, its loss and evaluation.

`torch_parts(config, weights)` hands the harness what is specific to
segmentation; the harness builds the steps and runs them on
`torchref.train.fit`. Two modes (`examples.harness.config.BaseConfig.mode`):

* ``stable``: float32 model, `loss_torch.stable_loss`; the harness runs it
  in `torchref.train.TrainStep` with ``torch.autocast`` for
  bfloat16/float16, the real ``GradScaler`` (float16 only),
  ``clip_grad_norm_`` and a skipped update on non-finite gradients.
* ``naive``: what people run when they ``model.half()`` a model: the model,
  hence the optimizer state, in float16/bfloat16, `loss_torch.naive_loss`;
  the harness adds a plain zero_grad/backward/step loop with no guard.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
import torch

from examples.harness.config import torch_dtype
from examples.harness.parts import TorchParts
from examples.segmentation import data, loss_torch, metric, model_torch
from examples.segmentation.config import Config


def build_model(
    config: Config, state_dict: Mapping[str, torch.Tensor] | None = None
) -> model_torch.UNet:
    """A float32 ``model_torch.UNet`` of the config's size (weights loaded if given).

    Example:
        >>> build_model(Config(width=4)).architecture()["width"]
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


def initial_weights(config: Config) -> dict[str, torch.Tensor]:
    """The initial U-Net weights of a run: torch's default init, seeded.

    Both frameworks start from these (the JAX side converts them).

    Example:
        >>> sd = initial_weights(Config(width=4))
        >>> tuple(sd["head.weight"].shape)
        (6, 4, 1, 1)
    """
    torch.manual_seed(config.seed)
    return copy.deepcopy(build_model(config).state_dict())


def to_torch(batch: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """A numpy batch as ``(NCHW float32 images, int64 labels)``.

    Example:
        >>> b = {"image": np.zeros((2, 8, 8, 3), np.float32),
        ...      "label": np.zeros((2, 8, 8), np.int32)}
        >>> [tuple(t.shape) for t in to_torch(b)]
        [(2, 3, 8, 8), (2, 8, 8)]
    """
    x = torch.from_numpy(data.to_nchw(batch["image"]))
    y = torch.from_numpy(np.asarray(batch["label"], np.int64))
    return x, y


def evaluate(
    model: torch.nn.Module, config: Config, heldout: Mapping[str, np.ndarray]
) -> float:
    """Held-out mIoU of the model as it is called (the harness sets eval mode,
    no_grad and, for a low-precision stable run, autocast).

    Images are fed in the parameters' dtype (float16 for a naive float16
    model). Returns nan when any logit is non-finite.
    """
    param_dtype = next(model.parameters()).dtype
    preds, finite = [], True
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        x = torch.from_numpy(
            data.to_nchw(heldout["image"][start : start + config.eval_batch_size])
        ).to(param_dtype)
        logits = model(x).float()
        finite = finite and bool(torch.isfinite(logits).all())
        preds.append(logits.argmax(dim=1).numpy())
    if not finite:
        return float("nan")
    miou, _ = metric.mean_iou(
        np.concatenate(preds), heldout["label"], config.num_classes, data.IGNORE_INDEX
    )
    return miou


def _stable_loss(model, batch):
    x, y = batch
    return loss_torch.stable_loss(model(x), y)


def _naive_loss(model, batch):
    x, y = batch
    return loss_torch.naive_loss(model(x), y)


def torch_parts(config: Config, weights: Mapping[str, torch.Tensor]) -> TorchParts:
    """The torch U-Net of a run (naive: ``.to(dtype)``), its loss and evaluation.

    Example:
        >>> cfg = Config(width=4, mode="naive", precision="float16")
        >>> parts = torch_parts(cfg, initial_weights(cfg))
        >>> next(parts.model.parameters()).dtype
        torch.float16
    """
    model = build_model(config, weights).train()
    naive = config.mode == "naive"
    if naive:
        model.to(torch_dtype(config.precision))  # weights, BN, opt state
    return TorchParts(
        model=model,
        loss_fn=_naive_loss if naive else _stable_loss,
        to_torch=to_torch,
        evaluate=lambda m, heldout: {"miou": evaluate(m, config, heldout)},
    )
