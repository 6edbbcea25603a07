"""The segmentation task in PyTorch: model, losses and evaluation.

`torch_parts(config, weights)` hands the harness (`examples/harness/`)
what is specific to segmentation; the harness builds the steps and runs them
on `torchref.train.fit`. Two modes (see `examples.harness.BaseConfig.mode`):

* ``stable``: float32 model, `torchref.losses.softmax_cross_entropy`
  (float32, ``ignore_index=255``); the harness runs it in
  `torchref.train.TrainStep` with ``torch.autocast`` for bfloat16/float16,
  the real ``GradScaler`` (float16 only), ``clip_grad_norm_`` and a skipped
  update on non-finite gradients.
* ``naive``: what people run when they ``model.half()`` a model: the model,
  hence the optimizer state, in float16/bfloat16, ``F.cross_entropy`` on the
  low-precision logits; the harness adds a plain zero_grad/backward/step
  loop (a step callable run by `fit`) with no guard at all.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from examples import harness
from examples.harness import ddp
from examples.segmentation import config as config_lib
from examples.segmentation import data, metric, model_torch
from torchref import losses


def initial_state_dict(config: config_lib.Config) -> dict[str, torch.Tensor]:
    """The initial U-Net weights of a run: torch's default init, seeded.

    Both frameworks start from these (the JAX side converts them).

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
    model: torch.nn.Module,
    config: config_lib.Config,
    heldout: Mapping[str, np.ndarray],
) -> float:
    """Held-out mIoU of the model as it is called (the harness sets eval mode,
    no_grad and, for a low-precision stable run, autocast).

    Images are fed in the parameters' dtype (float16 for a naive float16
    model). Returns nan when any logit is non-finite.

    Example:
        >>> cfg = config_lib.get_config(image_size=16, width=4, eval_images=2)
        >>> with torch.no_grad():
        ...     m = evaluate(build_model(cfg).eval(), cfg, config_lib.heldout_set(cfg))
        >>> 0.0 <= m <= 1.0
        True
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
        np.concatenate(preds), heldout["label"], config.num_classes, 255
    )
    return miou


def _labelled(y: torch.Tensor) -> torch.Tensor:
    # Under DDP (`compare.py --devices N`) the ranks' slices hold different
    # numbers of labelled pixels: `examples.ddp.global_mean` turns each rank's
    # mean into its share of the global batch's mean (one process: as is).
    return (y != config_lib.IGNORE_INDEX).sum()


def _stable_loss(model, batch):
    x, y = batch
    loss = losses.softmax_cross_entropy(
        model(x), y, dim=1, ignore_index=config_lib.IGNORE_INDEX
    )
    return ddp.global_mean(loss, _labelled(y))


def _naive_loss(model, batch):
    x, y = batch
    loss = F.cross_entropy(model(x), y, ignore_index=config_lib.IGNORE_INDEX)
    return ddp.global_mean(loss, _labelled(y))


def torch_parts(
    config: config_lib.Config, weights: Mapping[str, torch.Tensor]
) -> harness.TorchParts:
    """The torch U-Net of a run (naive: ``.to(dtype)``), its loss and evaluation.

    Example:
        >>> cfg = config_lib.get_config(width=4, mode="naive", precision="float16")
        >>> parts = torch_parts(cfg, initial_state_dict(cfg))
        >>> next(parts.model.parameters()).dtype
        torch.float16
    """
    model = build_model(config, weights).train()
    naive = config.mode == "naive"
    if naive:
        model.to(harness.torch_dtype(config.precision))  # weights, BN, opt state
    return harness.TorchParts(
        model=model,
        loss_fn=_naive_loss if naive else _stable_loss,
        to_torch=to_torch,
        evaluate=lambda m, heldout: {"miou": evaluate(m, config, heldout)},
    )


def train_and_evaluate(
    config: config_lib.Config,
    *,
    init_state_dict: Mapping[str, torch.Tensor] | None = None,
    batches: list[dict[str, np.ndarray]] | None = None,
    heldout: Mapping[str, np.ndarray] | None = None,
    log: Callable[[dict[str, Any]], None] | None = None,
    progress: bool = True,
) -> harness.RunResult:
    """One torch segmentation run (`harness.train_and_evaluate` of this task).

    Example:
        >>> cfg = config_lib.get_config(image_size=16, width=4, steps=2,
        ...                             eval_images=2)
        >>> r = train_and_evaluate(cfg, progress=False)
        >>> len(r.metrics), r.first_nonfinite_step, r.skipped_total
        (2, None, 0)
    """
    from examples.segmentation.task import TASK

    return harness.train_and_evaluate(
        TASK, "torch", config, weights=init_state_dict, batches=batches,
        heldout=heldout, log=log, progress=progress,
    )  # fmt: skip
