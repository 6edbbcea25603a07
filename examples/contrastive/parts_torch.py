"""The torch side of a contrastive run: the dual encoder, its loss and evaluation.

`torch_parts(config, weights)` hands the harness what is specific to the
task (see `examples.harness.parts.TorchParts`). The two modes:

* ``naive``: what the contrastive report's team ran first: float32
  parameters and Adam state, the forward under ``torch.autocast``, the
  caption pooled as ``sum / count``, ``x / ||x||`` without eps,
  ``exp(logit_scale)`` unclamped, the logits and the cross-entropy in the
  compute dtype (`loss_torch.naive_loss`); no guard.
* ``stable``: the pooling divides by ``max(count, 1)``, the float32
  `info_nce` (eps-safe normalisation, logit scale clamped at 100;
  `loss_torch.stable_loss`), and the harness's guards (clip, skip
  non-finite; a loss scale for float16).

Both losses return the check points of `probe.CHECKS` and the logit scale as
``aux``: `fit` logs them in every record. Before training, ``check_params``
runs on the initial weights (and every train batch is checked:
`task.check_batch`).

Under ``compare.py --devices N`` (DDP) the embeddings of every rank are
gathered before the loss (`examples.harness.collective.gather_rows`, open_clip's
``gather_with_grad`` with ``local_loss=False``): each rank's InfoNCE is the
whole batch's, every other caption a negative, as on one device.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from examples.contrastive import data, loss_torch, model_torch
from examples.contrastive.config import Config
from examples.contrastive.metric import recall_at_1
from examples.contrastive.probe import empty_captions, note
from examples.harness import ddp
from examples.harness.config import torch_dtype
from examples.harness.parts import TorchParts
from torchref import diagnostics


def build_model(config: Config, state_dict=None):
    """A float32 ``model_torch.CLIP`` of the config's size (weights if given).

    Example:
        >>> build_model(Config(width=4)).architecture()["width"]
        4
    """
    model = model_torch.CLIP(
        width=config.width,
        image_size=config.image_size,
        vocab_size=len(data.VOCAB),
        embed_dim=config.embed_dim,
        token_dim=config.token_dim,
    )
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def initial_weights(config: Config) -> dict[str, Any]:
    """torch's seeded default init; both frameworks start from it.

    Example:
        >>> sd = initial_weights(Config(width=4))
        >>> round(float(sd["logit_scale"]), 4)
        2.6593
    """
    torch.manual_seed(config.seed)
    return copy.deepcopy(build_model(config).state_dict())


def to_torch(batch) -> dict[str, Any]:
    """A numpy batch as torch tensors (NCHW images, int64 tokens)."""
    return {
        "image": torch.from_numpy(data.to_nchw(np.asarray(batch["image"]))),
        "tokens": torch.from_numpy(np.asarray(batch["tokens"], np.int64)),
    }


def _global(img, txt, image):
    """The embeddings (and images, for the check points) of the whole batch
    under DDP (`ddp.gather_rows`), as they are in one process."""
    return ddp.gather_rows((img, txt, image))


def _scale(m):
    # the logit scale parameter, also through the DDP wrapper (`module`)
    return getattr(m, "module", m).logit_scale


def _evaluate(model, heldout, config) -> dict[str, float]:
    safe = config.mode == "stable"
    imgs, txts = [], []
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        part = {k: heldout[k][start : start + config.eval_batch_size] for k in heldout}
        b = to_torch(part)
        img, txt = model(b["image"], b["tokens"], safe=safe)
        imgs.append(img.float().numpy())
        txts.append(txt.float().numpy())
    return recall_at_1(np.concatenate(imgs), np.concatenate(txts))


def torch_parts(config: Config, weights) -> TorchParts:
    """The torch dual encoder of a run, its loss and its evaluation.

    Example:
        >>> cfg = Config(width=4, mode="naive", precision="bfloat16")
        >>> parts = torch_parts(cfg, initial_weights(cfg))
        >>> next(parts.model.parameters()).dtype  # float32 master weights
        torch.float32
    """
    model = build_model(config, weights).train()
    diagnostics.check_params(model)  # pre-flight: the weights are finite
    dtype = torch_dtype(config.precision)
    if config.mode == "stable":

        def loss_fn(m, batch):
            img, txt = m(batch["image"], batch["tokens"], safe=True)
            img, txt, image = _global(img, txt, batch["image"])
            # the loss outside autocast: its matmuls would otherwise run in
            # the compute dtype (autocast lists matmul), info_nce is float32
            with torch.autocast("cpu", enabled=False):
                return loss_torch.stable_loss(img, txt, _scale(m), image)

    else:

        def loss_fn(m, batch):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                img, txt = m(batch["image"], batch["tokens"], safe=False)
            # the first attempt's loss on the compute-dtype embeddings, outside
            # autocast (whose float32 op lists would decide its dtypes)
            img, txt = img.to(dtype), txt.to(dtype)
            img, txt, image = _global(img, txt, batch["image"])
            return loss_torch.naive_loss(img, txt, _scale(m), image)

    def probe(m, batch):
        with torch.no_grad():
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                img, txt = m(batch["image"], batch["tokens"], safe=False)
            img, txt = img.to(dtype), txt.to(dtype)
            _, aux = loss_torch.naive_loss(img, txt, m.logit_scale, batch["image"])
        bad = int((~torch.isfinite(txt.float())).any(dim=1).sum())
        empty = empty_captions(batch["tokens"].numpy())
        return note(diagnostics, aux["checks"], bad, empty, len(batch["tokens"]))

    return TorchParts(
        model=model,
        loss_fn=loss_fn,
        to_torch=to_torch,
        evaluate=lambda m, heldout: _evaluate(m, heldout, config),
        probe=probe if config.mode == "naive" else None,
    )
