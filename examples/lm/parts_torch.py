"""The torch side of a language-model run: the decoder, its loss and evaluation.

`torch_parts(config, weights)` hands the harness what is specific to the
task (see `examples.harness.parts.TorchParts`). The two modes:

* ``naive``: the usual first bf16 attempt at a high learning rate: float32
  master weights and AdamW state, the forward in the compute dtype
  (`model_torch.GPT`'s ``dtype``, flax's casting), no QK-norm, no z-loss, no
  clip, no skip (`loss_torch.naive_loss`).
* ``stable``: the same model with QK-norm (``config.qk_norm``), the float32
  `losses.softmax_cross_entropy` plus ``config.z_loss`` (`loss_torch.stable_loss`)
  and the harness's guards: clip at ``max_grad_norm``, skip non-finite steps,
  a loss scale for float16; and, with ``config.spike_guard``, the spike
  guard `torchref.transforms.skip_spikes` (:func:`spike_guard_options`).

Both modes use the same optimizer: AdamW (decay only on the >= 2-d
weights) with the warm-up and cosine of `schedule.lr_at`. The losses
return the check points of `probe.CHECKS` as ``aux``: `fit` logs them.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import torch

from examples.harness.config import torch_dtype
from examples.harness.parts import TorchParts
from examples.lm import loss_torch, metric, model_torch, probe, schedule
from examples.lm.config import Config
from torchref import diagnostics, transforms


def uses_qk_norm(config: Config) -> bool:
    """The run normalises q and k: the stable runs when ``config.qk_norm``.

    Example:
        >>> uses_qk_norm(Config(mode="naive")), uses_qk_norm(Config())
        (False, True)
    """
    return config.mode == "stable" and config.qk_norm


def spike_guard_options(config: Config) -> dict[str, Any] | None:
    """The ``skip_spikes`` options of the run (both frameworks), or None: the
    stable runs when ``config.spike_guard``; the naive run never has it.

    Example:
        >>> spike_guard_options(Config())
        {'window': 64, 'min_history': 8, 'threshold': 6.0}
        >>> spike_guard_options(Config(mode="naive")) is None
        True
    """
    if config.mode != "stable" or not config.spike_guard:
        return None
    return {
        "window": config.spike_window,
        "min_history": config.spike_min_history,
        "threshold": config.spike_threshold,
    }


def build_model(config: Config, state_dict=None, *, qk_norm=None, dtype=None):
    """A ``model_torch.GPT`` of the config's size, float32 weights.

    ``state_dict`` may hold more than the model needs (the QK-norm scales of
    `initial_weights`, for a naive model without them); every entry the
    model has must be there (KeyError otherwise).

    Example:
        >>> m = build_model(Config(width=16, n_heads=2, mode="naive"))
        >>> m.architecture()["d_model"], m.architecture()["qk_norm"]
        (16, False)
    """
    model = model_torch.GPT(
        d_model=config.width,
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        max_len=config.seq_len,
        qk_norm=uses_qk_norm(config) if qk_norm is None else qk_norm,
        dtype=torch_dtype(config.precision) if dtype is None else dtype,
    )
    if state_dict is not None:
        own = model.state_dict()
        missing = sorted(set(own) - set(state_dict))
        if missing:
            raise KeyError(f"weights lack {missing}")
        model.load_state_dict({k: state_dict[k] for k in own})
    return model


def initial_weights(config: Config) -> dict[str, Any]:
    """torch's seeded init, with the QK-norm scales (ones): a naive model
    takes the rest; the draws are the same with and without QK-norm.

    Example:
        >>> sd = initial_weights(Config(width=16, n_heads=2))
        >>> float(sd["blocks.0.attn.q_norm.scale"].sum())
        8.0
    """
    torch.manual_seed(config.seed)
    model = build_model(config, qk_norm=True, dtype=torch.float32)
    return copy.deepcopy(model.state_dict())


def to_torch(batch) -> dict[str, torch.Tensor]:
    """A numpy batch as int64 tensors."""
    return {k: torch.from_numpy(np.asarray(v, np.int64)) for k, v in batch.items()}


def optimizer(config: Config):
    """``optimizer(model) -> (AdamW, LambdaLR)``: the run's own recipe.

    Example:
        >>> opt, sched = optimizer(Config(width=16, n_heads=2))(
        ...     build_model(Config(width=16, n_heads=2)))
        >>> round(opt.param_groups[0]["lr"], 6), len(opt.param_groups)
        (0.003333, 2)
    """

    def make(model):
        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay},
             {"params": rest, "weight_decay": 0.0}],
            lr=config.learning_rate, betas=(config.b1, config.b2), eps=config.eps,
        )  # fmt: skip
        lam = lambda n: schedule.lr_at(config, n) / config.learning_rate  # noqa: E731
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lam)

    return make


def _evaluate(model, heldout, config) -> dict[str, float]:
    total = 0.0
    for start in range(0, len(heldout["inputs"]), config.eval_batch_size):
        part = {
            k: v[start : start + config.eval_batch_size] for k, v in heldout.items()
        }
        b = to_torch(part)
        logits, _ = model(b["inputs"])
        total += loss_torch.nll_sum(logits, b["targets"])
    return metric.scores(total, heldout["targets"].size)


def torch_parts(config: Config, weights) -> TorchParts:
    """The torch decoder of a run, its loss and its evaluation.

    Example:
        >>> cfg = Config(width=16, n_heads=2, mode="naive", precision="bfloat16")
        >>> parts = torch_parts(cfg, initial_weights(cfg))
        >>> next(parts.model.parameters()).dtype, parts.model.dtype
        (torch.float32, torch.bfloat16)
    """
    model = build_model(config, weights).train()
    diagnostics.check_params(model)  # pre-flight: the weights are finite
    if config.mode == "stable":

        def loss_fn(m, batch):
            logits, stats = m(batch["inputs"])
            # the loss outside autocast: float32 by itself
            with torch.autocast("cpu", enabled=False):
                return loss_torch.stable_loss(
                    logits, batch["targets"], stats, config.z_loss
                )

    else:

        def loss_fn(m, batch):
            logits, stats = m(batch["inputs"])
            return loss_torch.naive_loss(logits, batch["targets"], stats)

    def probe_fn(m, batch):
        with torch.no_grad():
            logits, stats = m(batch["inputs"])
            _, aux = loss_torch.naive_loss(logits, batch["targets"], stats)
        return probe.cause_note({k: float(v) for k, v in aux.items()}, config)

    spikes = spike_guard_options(config)
    return TorchParts(
        model=model,
        loss_fn=loss_fn,
        to_torch=to_torch,
        evaluate=lambda m, heldout: _evaluate(m, heldout, config),
        probe=probe_fn if config.mode == "naive" else None,
        optimizer=optimizer(config),
        spike_guard=None
        if spikes is None
        else functools.partial(transforms.skip_spikes, **spikes),
    )
