"""The OCR task of `examples/compare.py`: DBNet text detection.

Synthetic documents with DBNet's labels (`data.py`), a small DBNet in Flax
NNX and torch (`model_jax.py`, `model_torch.py`, `convert.py`), its losses
(`loss_jax.py`, `loss_torch.py`) and DBNet's post-processing with the ICDAR
precision / recall / hmean (`metric.py`). See `examples/harness/` for the
interface this module implements.

The two modes, as the harness runs them:

* ``naive``: what the DBNet report's team ran, in mixed precision without
  any guard: float32 parameters and optimizer state, the forward in the
  compute dtype (a jmp-style cast in JAX, ``torch.autocast`` in torch), and
  the loss of `loss_jax.naive_loss` / `loss_torch.naive_loss` in the compute
  dtype with the step function written as ``reciprocal(1 + exp(-k (P -
  T)))``; no loss scale, no clip, no skip. Parameters are kept in float32 so
  that what breaks is the DBNet recipe, not Adam's float16 state (that is the
  segmentation task's story).
* ``stable``: `db_step` inside the model, the float32 `db_loss`, and the
  harness's guards (dynamic loss scale for float16, clip, skip).

Example:
    >>> TASK.name, TASK.metrics
    ('ocr', ('hmean', 'precision_det', 'recall_det'))
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from examples import harness
from examples.harness.parts import Task
from examples.ocr import config as config_lib

METRICS = ("hmean", "precision_det", "recall_det")


def _describe(c: config_lib.Config) -> str:
    return (
        f"synthetic documents, {c.image_size}x{c.image_size} images, up to "
        f"{c.max_words} words each (rotated quadrilaterals, don't-care words "
        f"excluded), DBNet labels (shrink r=0.4, threshold map in [0.3, 0.7]); "
        f"DBNet width {c.width}, k={c.k:g}; ICDAR matching at IoU 0.5, box "
        f"threshold {c.box_thresh}"
    )


def overflow_note(diff: np.ndarray, exp_inf: np.ndarray, k: float, dtype: str) -> str:
    """The observed cause of a naive run's NaN gradients, in one line.

    Args:
      diff: ``P - T`` per pixel, as the naive step function saw it.
      exp_inf: where ``exp(-k (P - T))`` was inf in the compute dtype.
      k: the step function's amplification.
      dtype: the compute dtype's name.

    Example:
        >>> d = np.array([-0.5, 0.1, 0.0])
        >>> print(overflow_note(d, np.array([True, False, False]), 50.0, "float16"))
        ... # doctest: +NORMALIZE_WHITESPACE
        Cause observed: on this step's batch, exp(-k (P - T)) of the step
        function reciprocal(1 + exp(-k (P - T))), k=50, was inf in float16 at 1 of
        3 pixels (P - T down to -0.500; float16's exp overflows above 11.09, i.e.
        once P - T < -0.2218): there its backward is 0 * inf = NaN.
    """
    limit = float(np.log(float(np.finfo(np.float16).max)))
    limit = limit if dtype == "float16" else 88.72
    n = int(np.sum(exp_inf))
    return (
        f"Cause observed: on this step's batch, exp(-k (P - T)) of the step function "
        f"reciprocal(1 + exp(-k (P - T))), k={k:g}, was inf in {dtype} at {n} of "
        f"{diff.size} pixels (P - T down to {float(np.min(diff)):.3f}; {dtype}'s exp "
        f"overflows above {limit:.2f}, i.e. once P - T < {-limit / k:.4f}): there "
        "its backward is 0 * inf = NaN."
    )


def _scores(probs: np.ndarray, config, heldout) -> dict[str, float]:
    from examples.ocr import metric

    return metric.evaluate(probs, heldout, box_thresh=config.box_thresh)


# --------------------------------------------------------------------------
# torch


def build_model(config: config_lib.Config, state_dict=None):
    """A float32 ``model_torch.DBNet`` of the config's size (weights if given).

    Example:
        >>> build_model(config_lib.get_config(width=4)).architecture()["width"]
        4
    """
    from examples.ocr import model_torch

    model = model_torch.DBNet(in_channels=3, width=config.width, k=config.k)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def initial_weights(config: config_lib.Config) -> dict[str, Any]:
    """torch's seeded default init of the DBNet; both frameworks start from it.

    Example:
        >>> sd = initial_weights(config_lib.get_config(width=4))
        >>> sorted(sd)[0]
        'backbone.stage1.conv.bn.bias'
    """
    import torch

    torch.manual_seed(config.seed)
    return copy.deepcopy(build_model(config).state_dict())


def _to_torch(batch: Mapping[str, np.ndarray]) -> dict[str, Any]:
    import torch

    from examples.ocr import data

    out = {key: torch.from_numpy(np.asarray(batch[key])) for key in data.MAP_KEYS}
    out["image"] = torch.from_numpy(data.to_nchw(batch["image"]))
    return out


def _torch_evaluate(model, heldout, config) -> dict[str, float]:
    import torch

    from examples.ocr import data

    param_dtype = next(model.parameters()).dtype
    probs = []
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        x = data.to_nchw(heldout["image"][start : start + config.eval_batch_size])
        logits = model(torch.from_numpy(x).to(param_dtype))["logits"]
        probs.append(torch.sigmoid(logits.float()).numpy())
    return _scores(np.concatenate(probs), config, heldout)


def torch_parts(config: config_lib.Config, weights) -> harness.TorchParts:
    """The torch DBNet of a run, its loss and its evaluation.

    Example:
        >>> cfg = config_lib.get_config(width=4, mode="naive", precision="float16")
        >>> parts = torch_parts(cfg, initial_weights(cfg))
        >>> next(parts.model.parameters()).dtype  # float32 master weights
        torch.float32
    """
    import torch

    from examples.ocr import loss_torch

    model = build_model(config, weights).train()
    if config.mode == "stable":

        def loss_fn(m, batch):
            return loss_torch.stable_loss(m(batch["image"]), batch, k=config.k)[0]

    else:
        dtype = harness.torch_dtype(config.precision)

        def loss_fn(m, batch):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                out = m(batch["image"])
            # the team's loss on the compute-dtype maps, outside autocast (whose
            # float32 op lists would otherwise decide the dtype of exp)
            out = {key: out[key].to(dtype) for key in ("logits", "thresh")}
            return loss_torch.naive_loss(out, batch, k=config.k)[0]

    def probe(m, batch):
        dtype = harness.torch_dtype(config.precision)
        with torch.no_grad():
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                out = m.train()(batch["image"])
            prob = torch.sigmoid(out["logits"].to(dtype))
            diff = prob - out["thresh"].to(dtype)
            inf = torch.isinf(torch.exp(-config.k * diff))
        return overflow_note(
            diff.float().numpy(), inf.numpy(), config.k, config.precision
        )

    return harness.TorchParts(
        model=model,
        loss_fn=loss_fn,
        to_torch=_to_torch,
        evaluate=lambda m, heldout: _torch_evaluate(m, heldout, config),
        probe=probe if config.mode == "naive" else None,
    )


# --------------------------------------------------------------------------
# JAX


@functools.cache
def _jax_predict():
    import jax

    from examples.ocr import model_jax

    @functools.partial(jax.jit, static_argnames=("graphdef",))
    def predict(graphdef, params, stats, images):
        dtype = jax.tree_util.tree_leaves(params)[0].dtype
        out, _ = model_jax.apply(
            graphdef, params, stats, images.astype(dtype), train=False
        )
        return jax.nn.sigmoid(out["logits"].astype("float32"))

    return predict


def _jax_evaluate(graphdef, params, stats, heldout, config) -> dict[str, float]:
    predict = _jax_predict()
    probs = []
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        images = heldout["image"][start : start + config.eval_batch_size]
        probs.append(np.asarray(predict(graphdef, params, stats, images)))
    return _scores(np.concatenate(probs), config, heldout)


def jax_parts(config: config_lib.Config, weights) -> harness.JaxParts:
    """The NNX DBNet of a run (from the torch weights), its loss and evaluation.

    Example:
        >>> cfg = config_lib.get_config(width=4, mode="naive", precision="float16")
        >>> parts = jax_parts(cfg, initial_weights(cfg))
        >>> import jax; jax.tree_util.tree_leaves(parts.params)[0].dtype
        dtype('float32')
    """
    import jax

    from examples.ocr import convert, loss_jax, model_jax

    graphdef, params, stats = model_jax.split(
        convert.nnx_from_torch(build_model(config, weights))
    )
    if config.mode == "stable":

        def loss_fn(p, s, batch):
            out, new_stats = model_jax.apply(graphdef, p, s, batch["image"], train=True)
            return loss_jax.stable_loss(out, batch, k=config.k)[0], new_stats

    else:
        dtype = harness.jax_dtype(config.precision)

        def loss_fn(p, s, batch):
            # float32 master weights cast for the forward (what the jmp policy
            # of the stable run does), batch statistics as they are
            p = jax.tree.map(lambda x: x.astype(dtype), p)
            out, new_stats = model_jax.apply(graphdef, p, s, batch["image"], train=True)
            out = {key: out[key].astype(dtype) for key in ("logits", "thresh")}
            return loss_jax.naive_loss(out, batch, k=config.k)[0], new_stats

    def probe(p, s, batch):
        dtype = harness.jax_dtype(config.precision)
        p = jax.tree.map(lambda x: x.astype(dtype), p)
        out, _ = model_jax.apply(graphdef, p, s, batch["image"], train=True)
        diff = jax.nn.sigmoid(out["logits"].astype(dtype)) - out["thresh"].astype(dtype)
        inf = jax.numpy.isinf(jax.numpy.exp(-config.k * diff))
        return overflow_note(
            np.asarray(diff, np.float32), np.asarray(inf), config.k, config.precision
        )

    return harness.JaxParts(
        params=params,
        model_state=stats,
        loss_fn=loss_fn,
        evaluate=lambda p, s, heldout: _jax_evaluate(graphdef, p, s, heldout, config),
        probe=probe if config.mode == "naive" else None,
    )


TASK = Task(
    name="ocr",
    help="text detection (DBNet on synthetic documents; hmean, precision, recall)",
    metrics=METRICS,
    # a smoke run (seconds): 16x16 documents, a width-4 DBNet, 6 steps
    quick=dict(
        image_size=16,
        batch_size=2,
        width=4,
        steps=6,
        eval_images=4,
        eval_batch_size=4,
    ),
    config_class=config_lib.Config,
    train_batches=config_lib.train_batches,
    heldout_set=config_lib.heldout_set,
    initial_weights=initial_weights,
    describe=_describe,
    stable_loss="float32 db_loss with db_step",
    jax_parts=jax_parts,
    torch_parts=torch_parts,
)
