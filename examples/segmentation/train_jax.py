"""Segmentation training loop in JAX / Flax NNX, on `jaxstable.train`.

Two modes (see `config.Config.mode`):

* ``stable``: float32 parameters and optimizer state, low-precision compute
  through the jmp policy ``params=float32,compute=<precision>,output=float32``
  (`jaxstable.train.make_train_step` with the U-Net's batch statistics as
  ``model_state``), `jaxstable.losses.softmax_cross_entropy` (float32,
  ``ignore_index=255``), `jaxstable.loss_scale.DynamicLossScale` for float16
  only (bfloat16 has float32's exponent range, so `NoOpLossScale`, as
  torch.amp does not scale bf16 either), and
  ``stable_optimizer(opt, max_grad_norm=...)`` (clip + skip non-finite).
* ``naive``: what users ran before the fix: parameters, batch statistics,
  optimizer state and compute in the low-precision dtype,
  ``optax.softmax_cross_entropy_with_integer_labels`` on the low-precision
  logits with a masked mean for label 255 in that dtype, plain optax
  optimizer, a plain ``jax.jit`` step: no loss scale, no clip, no skip.

Both start from the torch initial weights (converted by
`convert.nnx_from_torch`), so the two frameworks train the same network.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples.segmentation import config as config_lib
from examples.segmentation import convert, data, model_jax, train_torch
from jaxstable import diagnostics, losses, train, transforms
from jaxstable.loss_scale import DynamicLossScale, NoOpLossScale, all_finite

DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


def make_optimizer(config: config_lib.Config) -> optax.GradientTransformation:
    """The plain optax optimizer of the config (twin of torch's).

    Same hyperparameters as `train_torch.make_optimizer`: Adam(W) with the
    config's b1, b2, eps (optax adds eps outside the square root, as torch
    does); SGD with momentum 0.9 (``t = g + 0.9 t``, torch's buffer).

    Example:
        >>> import jax.numpy as jnp
        >>> tx = make_optimizer(config_lib.get_config(optimizer="sgd"))
        >>> u, _ = tx.update(jnp.ones(2), tx.init(jnp.zeros(2)))
        >>> [round(float(x), 6) for x in u]
        [-0.002, -0.002]
    """
    c = config
    if c.optimizer == "adam":
        return optax.adam(c.learning_rate, b1=c.b1, b2=c.b2, eps=c.eps)
    if c.optimizer == "adamw":
        return optax.adamw(
            c.learning_rate, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay
        )
    return optax.sgd(c.learning_rate, momentum=0.9)


def _to_jax(batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    return {"image": jnp.asarray(batch["image"]), "label": jnp.asarray(batch["label"])}


@functools.partial(jax.jit, static_argnames=("graphdef", "dtype"))
def _predict(graphdef, params, batch_stats, images, dtype):
    params = jax.tree_util.tree_map(lambda p: p.astype(dtype), params)
    logits, _ = model_jax.apply(
        graphdef, params, batch_stats, images.astype(dtype), train=False
    )
    logits = logits.astype(jnp.float32)
    return jnp.argmax(logits, axis=-1), jnp.all(jnp.isfinite(logits))


def evaluate(
    graphdef: Any,
    params: Any,
    batch_stats: Any,
    config: config_lib.Config,
    heldout: Mapping[str, np.ndarray],
) -> float:
    """Held-out mIoU in eval mode (running batch statistics), in the run's precision.

    Parameters are cast to the compute dtype (a no-op for naive runs, whose
    parameters are already in it). Returns nan when any logit is non-finite.

    Example:
        >>> from flax import nnx
        >>> cfg = config_lib.get_config(image_size=16, width=4, eval_images=2)
        >>> g, p, s = model_jax.split(model_jax.UNet(width=4, rngs=nnx.Rngs(0)))
        >>> 0.0 <= evaluate(g, p, s, cfg, config_lib.heldout_set(cfg)) <= 1.0
        True
    """
    dtype = DTYPES[config.precision]
    preds, finite = [], True
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        images = jnp.asarray(heldout["image"][start : start + config.eval_batch_size])
        pred, ok = _predict(graphdef, params, batch_stats, images, dtype)
        preds.append(np.asarray(pred))
        finite = finite and bool(ok)
    if not finite:
        return float("nan")
    miou, _ = data.mean_iou(
        np.concatenate(preds), heldout["label"], config.num_classes, 255
    )
    return miou


def _host(metrics: Mapping[str, Any]) -> dict[str, Any]:
    m = jax.device_get(metrics)
    return {
        "loss": float(m["loss"]),
        "grad_norm": float(m["grad_norm"]),
        "loss_scale": float(m["loss_scale"]),
        "finite": bool(m["finite"]),
        "skipped_total": int(m["skipped_total"]),
    }


def _report_text(tree: Mapping[str, Any]) -> str:
    parts = []
    for name, sub in tree.items():
        report = diagnostics.non_finite_report(sub)
        total = sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(sub))
        bad = sum(r.nan_count + r.inf_count for r in report)
        parts.append(f"{name}: {bad} of {total} entries non-finite")
        if report:
            parts.append(diagnostics.format_report(report))
    return "\n".join(parts)


def _stable(config, torch_model):
    model = convert.nnx_from_torch(torch_model)  # float32 params and stats
    graphdef, params, batch_stats = model_jax.split(model)
    tx = transforms.stable_optimizer(
        make_optimizer(config), max_grad_norm=config.max_grad_norm
    )
    # float16 only: its smallest subnormal is 6e-8, where small gradients of a
    # mean over ~7k pixels vanish; bfloat16 reaches 1e-38 like float32
    scale = DynamicLossScale() if config.precision == "float16" else NoOpLossScale()
    state = train.TrainState.create(
        params=params, optimizer=tx, loss_scale=scale, model_state=batch_stats
    )

    def loss_fn(p, stats, batch):
        logits, new_stats = model_jax.apply(
            graphdef, p, stats, batch["image"], train=True
        )
        loss = losses.softmax_cross_entropy(
            logits, batch["label"], ignore_index=config_lib.IGNORE_INDEX
        )
        return loss, new_stats

    step = train.make_train_step(loss_fn, has_state=True, policy=config.policy)
    params_finite = jax.jit(all_finite)
    box = {"state": state}

    def step_fn(batch):
        jb = _to_jax(batch)
        box["batch"] = jb
        box["state"], metrics = step(box["state"], jb)
        record = _host(metrics)
        # A step the guards skipped (non-finite loss or grads) leaves the model
        # as it was: only non-finite params or batch statistics are "broken".
        st = box["state"]
        broken = not bool(params_finite((st.params, st.model_state)))
        return record, broken

    def report_fn():
        st = box["state"]
        grads = step.grads(st, box["batch"])
        return "non-finite after the step:\n" + _report_text(
            {"grads (next step)": grads, "params": st.params}
        )

    def final():
        st = box["state"]
        return graphdef, st.params, st.model_state

    return step_fn, report_fn, final


def _naive(config, torch_model):
    dtype = DTYPES[config.precision]
    # the `.half()` recipe in flax: param_dtype = dtype, so the batch
    # statistics and the optimizer state (optax follows the params) are too
    model = convert.nnx_from_torch(torch_model, dtype=dtype, param_dtype=dtype)
    graphdef, params, batch_stats = model_jax.split(model)
    tx = make_optimizer(config)

    @jax.jit
    def naive_step(params, opt_state, stats, batch):
        image = batch["image"].astype(dtype)
        label = batch["label"]

        def loss_fn(p):
            logits, new_stats = model_jax.apply(graphdef, p, stats, image, train=True)
            valid = label != config_lib.IGNORE_INDEX
            ce = optax.softmax_cross_entropy_with_integer_labels(
                logits, jnp.where(valid, label, 0)
            )
            mask = valid.astype(ce.dtype)
            return jnp.sum(ce * mask) / jnp.sum(mask), new_stats

        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        metrics = {
            "loss": loss.astype(jnp.float32),
            "grad_norm": transforms.global_norm(grads),
            "loss_scale": jnp.ones([], jnp.float32),
            "finite": all_finite((grads, new_params)),
            "skipped_total": jnp.zeros([], jnp.int32),
        }
        return new_params, opt_state, new_stats, metrics, (grads, updates)

    box = {"params": params, "opt": tx.init(params), "stats": batch_stats}

    def step_fn(batch):
        out = naive_step(box["params"], box["opt"], box["stats"], _to_jax(batch))
        box["params"], box["opt"], box["stats"], metrics, box["last"] = out
        record = _host(metrics)
        broken = not record["finite"] or not np.isfinite(record["loss"])
        return record, broken

    def report_fn():
        grads, updates = box["last"]
        text = "non-finite after the step:\n" + _report_text(
            {"grads": grads, "updates": updates, "params": box["params"]}
        )
        adam = [
            s
            for s in jax.tree_util.tree_leaves(
                box["opt"], is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
            )
            if isinstance(s, optax.ScaleByAdamState)
        ]
        if adam:
            as_np = functools.partial(np.asarray, dtype=np.float32)
            g = [as_np(x) for x in jax.tree_util.tree_leaves(grads)]
            nu = [as_np(x) for x in jax.tree_util.tree_leaves(adam[0].nu)]
            text += "\n" + config_lib.adam_underflow_note(
                g, nu, config.precision, config.eps
            )
        return text

    def final():
        return graphdef, box["params"], box["stats"]

    return step_fn, report_fn, final


def train_and_evaluate(
    config: config_lib.Config,
    *,
    init_state_dict: Mapping[str, Any] | None = None,
    batches: list[dict[str, np.ndarray]] | None = None,
    heldout: Mapping[str, np.ndarray] | None = None,
    log: Callable[[dict[str, Any]], None] | None = None,
    progress: bool = True,
) -> config_lib.RunResult:
    """Trains the NNX U-Net as `config` says and scores it on the held-out split.

    Args:
      config: a `config.Config` (precision, mode, optimizer, sizes, steps).
      init_state_dict: torch initial weights (a ``model_torch.UNet``
        state_dict), converted with `convert.nnx_from_torch`; None:
        `train_torch.initial_state_dict(config)` (torch's seeded init).
      batches: the train batches (NHWC numpy); None: `config.train_batches`.
      heldout: the evaluation set; None: `config.heldout_set`.
      log: called with each step's record (``step, loss, grad_norm,
        loss_scale, finite, skipped_total``).
      progress: show a tqdm progress bar.

    Returns:
      A `config.RunResult` (``framework="jax"``).

    Example:
        >>> cfg = config_lib.get_config(image_size=16, width=4, steps=2,
        ...                             eval_images=2)
        >>> r = train_and_evaluate(cfg, progress=False)
        >>> len(r.metrics), r.first_nonfinite_step, r.skipped_total
        (2, None, 0)
    """
    if init_state_dict is None:
        init_state_dict = train_torch.initial_state_dict(config)
    if batches is None:
        batches = config_lib.train_batches(config)
    if heldout is None:
        heldout = config_lib.heldout_set(config)
    torch_model = train_torch.build_model(config, init_state_dict)
    make = _stable if config.mode == "stable" else _naive
    step_fn, report_fn, final = make(config, torch_model)
    out = config_lib.run_steps(
        config,
        batches,
        step_fn,
        report_fn,
        desc=f"jax {config.label}",
        log=log,
        progress=progress,
    )
    miou = evaluate(*final(), config, heldout)
    return config_lib.run_result("jax", config, out, miou)
