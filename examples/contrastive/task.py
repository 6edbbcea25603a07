"""The contrastive task of `examples/compare.py`: CLIP-style image-text InfoNCE.

Paired shape images and attribute captions (`data.py`), a small dual
encoder in Flax NNX and torch (`model_jax.py`, `model_torch.py`,
`convert.py`), the InfoNCE losses with their check points (`loss_jax.py`,
`loss_torch.py`) and held-out recall@1 (`metric.py`). See
`examples/harness/` for the interface this module implements.

The two modes, as the harness runs them:

* ``naive``: what the contrastive report's team ran first: float32
  parameters and Adam state, the forward in the compute dtype (a cast of
  the parameters in JAX, ``torch.autocast`` in torch), the caption pooled as
  ``sum / count``, ``x / ||x||`` without eps, ``exp(logit_scale)``
  unclamped, the logits and the cross-entropy in the compute dtype; no
  guard.
* ``stable``: the pooling divides by ``max(count, 1)``, the float32
  `info_nce` (eps-safe normalisation, logit scale clamped at 100), and the
  harness's guards (clip, skip non-finite; a loss scale for float16).

Both losses return the check points of `config.CHECKS` (inputs,
embeddings, logits, loss; a ``diagnostics.CheckPoints`` of the library)
and the logit scale as ``aux``: `fit` logs them in every record
(``checks['text_emb']['finite']``, ..., ``non_finite_checks``,
``first_non_finite_check``), with the step's ``grad_norm`` and ``finite``
(gradients, parameters): the report's six checks. Before training, both
frameworks' ``check_params`` run on the initial weights and every train
batch is checked (`config.check_batch`).

Example:
    >>> TASK.name, TASK.metrics
    ('contrastive', ('recall_at_1', 'recall_i2t', 'recall_t2i'))
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np

from examples import harness
from examples.contrastive import config as config_lib
from examples.contrastive import data
from examples.contrastive.metric import METRICS, recall_at_1
from examples.harness.parts import Task


def _describe(c: config_lib.Config) -> str:
    return (
        f"{c.train_pairs} train pairs of {c.image_size}x{c.image_size} shape images "
        f"and captions naming 1-5 of their 5 attributes (up to {c.max_tokens} "
        f"tokens; {c.empty_rate:g} of them empty, short and duplicate captions, a "
        f"partial last batch per epoch); CNN image tower (width {c.width}) and "
        f"masked-mean text tower, {c.embed_dim}-d embeddings, logit scale "
        f"initialised to 1/0.07; recall@1 among {c.eval_images} held-out pairs "
        "captioned with all 5 attributes"
    )


def cause_note(checks_line: str, first: str | None, bad_rows, empty, batch) -> str:
    """The check points of a naive run's first non-finite step, in one line.

    Args:
      checks_line: the framework's ``diagnostics.format_checks`` of the
        step's ``aux["checks"]`` (the same text in both).
      first: the first non-finite point (``aux["checks"].non_finite()[0]``),
        or None.
      bad_rows: caption embeddings of the batch with a non-finite entry.
      empty: captions of the batch with no token.
      batch: pairs in the batch.

    Example:
        >>> line = ("inputs finite (max|x| 1), image_emb finite (max|x| 1), "
        ...         "text_emb NON-FINITE, logits NON-FINITE, loss NON-FINITE; "
        ...         "first non-finite: text_emb")
        >>> print(cause_note(line, "text_emb", 1, 1, 32))
        ... # doctest: +NORMALIZE_WHITESPACE
        Cause observed: check points of the step, in order: inputs finite
        (max|x| 1), image_emb finite (max|x| 1), text_emb NON-FINITE, logits
        NON-FINITE, loss NON-FINITE; first non-finite: text_emb (1 of 32 caption
        embeddings; 1 caption(s) of the batch have no token: the masked mean is
        0 / 0).
    """
    text = "Cause observed: check points of the step, in order: " + checks_line
    if first is None:
        return text + " in the loss: the gradients or the update broke."
    if first == "text_emb":
        text += (
            f" ({bad_rows} of {batch} caption embeddings; {empty} caption(s) of the "
            "batch have no token: the masked mean is 0 / 0)"
        )
    return text + "."


def _note(diagnostics, checks, bad_rows: int, empty: int, batch: int) -> str:
    # `cause_note` of a CheckPoints, with its framework's diagnostics module
    bad = checks.non_finite()
    line = diagnostics.format_checks(checks)
    return cause_note(line, bad[0] if bad else None, bad_rows, empty, batch)


def _empty(tokens) -> int:
    return int((np.asarray(tokens) != data.PAD).sum(axis=1).__eq__(0).sum())


# --------------------------------------------------------------------------
# torch


def build_model(config: config_lib.Config, state_dict=None):
    """A float32 ``model_torch.CLIP`` of the config's size (weights if given).

    Example:
        >>> build_model(config_lib.get_config(width=4)).architecture()["width"]
        4
    """
    from examples.contrastive import model_torch

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


def initial_weights(config: config_lib.Config) -> dict[str, Any]:
    """torch's seeded default init; both frameworks start from it.

    Example:
        >>> sd = initial_weights(config_lib.get_config(width=4))
        >>> round(float(sd["logit_scale"]), 4)
        2.6593
    """
    import torch

    torch.manual_seed(config.seed)
    return copy.deepcopy(build_model(config).state_dict())


def _to_torch(batch) -> dict[str, Any]:
    import torch

    return {
        "image": torch.from_numpy(data.to_nchw(np.asarray(batch["image"]))),
        "tokens": torch.from_numpy(np.asarray(batch["tokens"], np.int64)),
    }


def _torch_evaluate(model, heldout, config) -> dict[str, float]:
    safe = config.mode == "stable"
    imgs, txts = [], []
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        part = {k: heldout[k][start : start + config.eval_batch_size] for k in heldout}
        b = _to_torch(part)
        img, txt = model(b["image"], b["tokens"], safe=safe)
        imgs.append(img.float().numpy())
        txts.append(txt.float().numpy())
    return recall_at_1(np.concatenate(imgs), np.concatenate(txts))


def torch_parts(config: config_lib.Config, weights) -> harness.TorchParts:
    """The torch dual encoder of a run, its loss and its evaluation.

    Example:
        >>> cfg = config_lib.get_config(width=4, mode="naive", precision="bfloat16")
        >>> parts = torch_parts(cfg, initial_weights(cfg))
        >>> next(parts.model.parameters()).dtype  # float32 master weights
        torch.float32
    """
    import torch

    from examples.contrastive import loss_torch
    from torchref import diagnostics

    model = build_model(config, weights).train()
    diagnostics.check_params(model)  # pre-flight: the weights are finite
    dtype = harness.torch_dtype(config.precision)
    if config.mode == "stable":

        def loss_fn(m, batch):
            img, txt = m(batch["image"], batch["tokens"], safe=True)
            # the loss outside autocast: its matmuls would otherwise run in
            # the compute dtype (autocast lists matmul), info_nce is float32
            with torch.autocast("cpu", enabled=False):
                return loss_torch.stable_loss(img, txt, m.logit_scale, batch["image"])

    else:

        def loss_fn(m, batch):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                img, txt = m(batch["image"], batch["tokens"], safe=False)
            # the first attempt's loss on the compute-dtype embeddings, outside
            # autocast (whose float32 op lists would decide its dtypes)
            img, txt = img.to(dtype), txt.to(dtype)
            return loss_torch.naive_loss(img, txt, m.logit_scale, batch["image"])

    def probe(m, batch):
        with torch.no_grad():
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                img, txt = m(batch["image"], batch["tokens"], safe=False)
            img, txt = img.to(dtype), txt.to(dtype)
            _, aux = loss_torch.naive_loss(img, txt, m.logit_scale, batch["image"])
        bad = int((~torch.isfinite(txt.float())).any(dim=1).sum())
        empty = _empty(batch["tokens"].numpy())
        return _note(diagnostics, aux["checks"], bad, empty, len(batch["tokens"]))

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
def _jax_embed():
    import jax

    from examples.contrastive import model_jax

    @functools.partial(jax.jit, static_argnames=("graphdef", "safe"))
    def embed(graphdef, params, images, tokens, safe):
        dtype = jax.tree_util.tree_leaves(params)[0].dtype
        img, txt, _ = model_jax.apply(
            graphdef, params, images.astype(dtype), tokens, safe=safe
        )
        return img.astype("float32"), txt.astype("float32")

    return embed


def _jax_evaluate(graphdef, params, heldout, config) -> dict[str, float]:
    embed = _jax_embed()
    imgs, txts = [], []
    for start in range(0, len(heldout["image"]), config.eval_batch_size):
        sl = slice(start, start + config.eval_batch_size)
        img, txt = embed(
            graphdef, params, heldout["image"][sl], heldout["tokens"][sl],
            config.mode == "stable",
        )  # fmt: skip
        imgs.append(np.asarray(img))
        txts.append(np.asarray(txt))
    return recall_at_1(np.concatenate(imgs), np.concatenate(txts))


def jax_parts(config: config_lib.Config, weights) -> harness.JaxParts:
    """The NNX dual encoder of a run (from the torch weights), loss, evaluation.

    Example:
        >>> cfg = config_lib.get_config(width=4, mode="naive", precision="bfloat16")
        >>> parts = jax_parts(cfg, initial_weights(cfg))
        >>> import jax; jax.tree_util.tree_leaves(parts.params)[0].dtype
        dtype('float32')
    """
    import jax

    from examples.contrastive import convert, loss_jax, model_jax, optim_jax
    from jaxstable import diagnostics

    graphdef, params = model_jax.split(
        convert.nnx_from_torch(build_model(config, weights))
    )
    diagnostics.check_params(params)  # pre-flight: the weights are finite
    dtype = harness.jax_dtype(config.precision)
    if config.mode == "stable":

        def loss_fn(p, s, batch):
            img, txt, log_scale = model_jax.apply(
                graphdef, p, batch["image"], batch["tokens"], safe=True
            )
            return loss_jax.stable_loss(img, txt, log_scale, batch["image"]), s

    else:

        def loss_fn(p, s, batch):
            # float32 master weights cast for the forward (what the jmp policy
            # of the stable run does)
            p = jax.tree.map(lambda x: x.astype(dtype), p)
            img, txt, log_scale = model_jax.apply(
                graphdef, p, batch["image"], batch["tokens"], safe=False
            )
            out = loss_jax.naive_loss(
                img.astype(dtype), txt.astype(dtype), log_scale, batch["image"]
            )
            return out, s

    def probe(p, s, batch):
        # one eager forward (off the hot path): the caption embeddings and
        # the check points of the naive loss on them
        q = jax.tree.map(lambda x: x.astype(dtype), p)
        img, txt, log_scale = model_jax.apply(
            graphdef, q, batch["image"], batch["tokens"], safe=False
        )
        img, txt = img.astype(dtype), txt.astype(dtype)
        _, aux = loss_jax.naive_loss(img, txt, log_scale, batch["image"])
        bad = int((~np.isfinite(np.asarray(txt, np.float32))).any(axis=1).sum())
        empty = _empty(batch["tokens"])
        return _note(diagnostics, aux["checks"], bad, empty, len(batch["tokens"]))

    return harness.JaxParts(
        params=params,
        model_state=None,
        loss_fn=loss_fn,
        evaluate=lambda p, s, heldout: _jax_evaluate(graphdef, p, heldout, config),
        probe=probe if config.mode == "naive" else None,
        has_aux=True,
        optimizer=optim_jax.for_config(config),  # torch's Adam bias corrections
    )


TASK = Task(
    name="contrastive",
    help="image-text retrieval (CLIP-style InfoNCE on shape captions; recall@1)",
    metrics=METRICS,
    # a smoke run: 16x16 images, width 4, 6 steps of 8 over 48 pairs (one
    # epoch: every pair, the empty caption included, is seen; no partial
    # batch, whose new shape would cost each JAX run a second compile)
    quick=dict(
        image_size=16,
        batch_size=8,
        width=4,
        steps=6,
        train_pairs=48,
        eval_images=16,
        eval_batch_size=16,
    ),
    config_class=config_lib.Config,
    train_batches=config_lib.train_batches,
    heldout_set=config_lib.heldout_set,
    initial_weights=initial_weights,
    describe=_describe,
    stable_loss="float32 info_nce (eps-safe, logit scale clamped at 100), "
    "max(count, 1) caption pooling",
    jax_parts=jax_parts,
    torch_parts=torch_parts,
)
