"""The contrastive task of `examples/compare.py` at tiny sizes.

The naive failure is observed, not injected: the train data holds an empty
(all-padding) caption, and the naive bfloat16 runs must break at the step
that reads it, with the check points naming the text embedding first and
`diagnostics.locate` naming the division of the masked mean. The stable
runs read the same batch and stay finite.
"""

import json
import math

import numpy as np
import pytest
import torch

from examples import compare, harness
from examples.contrastive import data, probe
from examples.contrastive import task as task_lib
from examples.contrastive.task import TASK
from examples.harness import jax_runner

# end-to-end runs: queued first, compiled with fewer XLA optimisations
# (conftest.py); the runs fail at the same steps from the same causes
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fewer_xla_optimizations")]

QUICK = TASK.get_config(**TASK.quick)


def _first_empty_step(batches) -> int:
    empty = [int(((b["tokens"] != data.PAD).sum(axis=1) == 0).sum()) for b in batches]
    return next(i for i, n in enumerate(empty) if n)


@pytest.fixture(scope="module")
def inputs():
    return (
        TASK.initial_weights(QUICK),
        TASK.train_batches(QUICK),
        TASK.heldout_set(QUICK),
    )


@pytest.fixture(scope="module")
def runs(inputs):
    """The torch bfloat16 runs (naive, stable) at --quick sizes, through the
    harness. The JAX runs of the harness are left to the committed default
    run (examples/contrastive/results): each costs 16-32 s of CPU at these
    sizes (XLA compiles the step's backward, and `locate` re-runs the naive
    step op by op), past this file's time budget; the JAX losses and check
    points are tested below on the same batches."""
    weights, batches, heldout = inputs
    out = {}
    for fw in ("torch",):
        for mode in ("naive", "stable"):
            cfg = QUICK.replace(precision="bfloat16", mode=mode)
            out[fw, mode] = harness.train_and_evaluate(
                TASK, fw, cfg, weights=weights, batches=batches, heldout=heldout,
                progress=False,
            )  # fmt: skip
    return out


def test_data_has_the_edge_cases_of_caption_data():
    cfg = data.ContrastiveData(image_size=16, train_pairs=44)
    batches = data.train_batches(cfg, 8, 12)
    sizes = [len(b["tokens"]) for b in batches]
    assert sizes == [8, 8, 8, 8, 8, 4] * 2  # a partial last batch per epoch
    tokens = np.concatenate([b["tokens"] for b in batches[:6]])
    lengths = (tokens != data.PAD).sum(axis=1)
    assert lengths.min() == 0 and (lengths == 1).any()  # empty and one-word captions
    # one epoch holds every pair once
    pool = data.make_pairs(cfg, "train", 44)
    assert sorted(map(tuple, tokens)) == sorted(map(tuple, pool["tokens"]))
    # duplicate captions inside a batch ("red" twice), at the default sizes
    big = data.train_batches(data.ContrastiveData(train_pairs=640), 32, 20)
    dup = [len({tuple(t) for t in b["tokens"]}) < len(b["tokens"]) for b in big]
    assert sum(dup) >= 3, dup
    held = data.make_pairs(cfg, "heldout", 16)
    assert ((held["tokens"] != data.PAD).sum(axis=1) == 5).all()
    assert len({tuple(a) for a in held["attributes"]}) == 16  # one right answer
    again = data.make_pairs(cfg, "heldout", 16)
    assert (again["image"] == held["image"]).all()
    with pytest.raises(ValueError, match="384 distinct attribute combinations"):
        data.make_pairs(cfg, "heldout", 385)


def test_float32_parity_of_the_converted_model(tol, inputs):
    """The converted NNX model computes torch's embeddings and stable loss."""
    import jax
    import jax.numpy as jnp

    from examples.contrastive import convert, loss_jax, loss_torch, model_jax
    from examples.contrastive.parts_torch import build_model

    weights, batches, _ = inputs
    batch = batches[_first_empty_step(batches)]  # the empty caption included
    tm = build_model(QUICK, weights)
    graphdef, params = model_jax.split(convert.nnx_from_torch(tm))

    @jax.jit
    def forward(p, image, tokens):
        img, txt, s = model_jax.apply(graphdef, p, image, tokens, safe=True)
        return img, txt, loss_jax.stable_loss(img, txt, s, image)

    img_j, txt_j, (loss_j, aux_j) = forward(
        params, jnp.asarray(batch["image"]), jnp.asarray(batch["tokens"])
    )
    tb = {"image": torch.from_numpy(data.to_nchw(batch["image"])),
          "tokens": torch.from_numpy(batch["tokens"].astype(np.int64))}  # fmt: skip
    with torch.no_grad():
        img_t, txt_t = tm(tb["image"], tb["tokens"], safe=True)
        loss_t, aux_t = loss_torch.stable_loss(
            img_t, txt_t, tm.logit_scale, tb["image"]
        )
    for a, b in ((img_j, img_t), (txt_j, txt_t), (loss_j, loss_t)):
        np.testing.assert_allclose(np.asarray(a), b.numpy(), **tol("float32"))
    for name in probe.CHECKS:
        for key in ("finite", "max_abs"):
            np.testing.assert_allclose(
                float(aux_j["checks"][name][key]), float(aux_t["checks"][name][key]),
                err_msg=f"{name} {key}", **tol("float32"),
            )  # fmt: skip


def test_jax_check_points_inside_the_jitted_steps(inputs):
    """The harness's jitted naive JAX step, run by `jaxstable.train.fit`,
    carries the loss's check points to the records: finite until the batch
    with the empty caption, where the text embedding is the first
    non-finite point. The stable loss on that batch is finite at every
    point. (The whole JAX harness runs cost ~50-90 s of CPU at --quick
    sizes, past this file's budget; this is their naive step and fit.)"""
    import jax

    from jaxstable import train

    weights, batches, _ = inputs
    at = _first_empty_step(batches)
    naive = QUICK.replace(precision="bfloat16", mode="naive")
    step, state = jax_runner.naive_step(naive, TASK.jax_parts(naive, weights))
    data_ = [jax.tree.map(np.asarray, b) for b in batches[: at + 1]]
    _, hist = train.fit(state, step, data_, log=None)
    assert [r["finite"] for r in hist] == [True] * at + [False]
    assert [r["first_non_finite_check"] for r in hist] == [None] * at + ["text_emb"]
    assert hist[at]["non_finite_checks"] == ["text_emb", "logits", "loss"]
    names = [k for k in hist[at] if k.startswith("checks[")]
    assert names == [f"checks[{n!r}][{f!r}]" for n in probe.CHECKS
                     for f in ("finite", "max_abs")]  # fmt: skip
    stable = QUICK.replace(precision="bfloat16", mode="stable")
    parts = TASK.jax_parts(stable, weights)
    batch = jax.tree.map(np.asarray, batches[at])
    (loss, aux), _ = jax.jit(parts.loss_fn)(parts.params, None, batch)
    assert aux["checks"].non_finite() == [] and np.isfinite(float(loss))


def test_naive_bfloat16_breaks_at_the_empty_caption(runs, inputs):
    step = _first_empty_step(inputs[1])
    for fw in ("torch",):
        r = runs[fw, "naive"]
        assert r.first_nonfinite_step == step, (fw, r.first_nonfinite_step)
        assert all(m["finite"] for m in r.metrics[:step])
        # the check points of that step, logged by fit: text_emb is the first
        rec = r.metrics[step]
        assert rec["first_non_finite_check"] == "text_emb", (fw, rec)
        assert rec["non_finite_checks"] == ["text_emb", "logits", "loss"]
        assert rec["checks['inputs']['finite']"] is True
        assert rec["checks['image_emb']['finite']"] is True
        assert math.isnan(r.scores["recall_at_1"])
        # diagnostics.locate: the division of the masked mean, in the forward
        loc = r.location
        assert (loc["phase"], loc["op"], loc["path"]) == ("forward", "div", "text")
        assert "masked_mean" in loc["source"], loc
        assert "first non-finite: text_emb" in r.non_finite_report
        assert "1 caption(s) of the batch have no token" in r.non_finite_report


def test_stable_bfloat16_stays_finite_and_logs_checks_and_logit_scale(runs, inputs):
    step = _first_empty_step(inputs[1])
    for fw in ("torch",):
        r = runs[fw, "stable"]
        assert r.first_nonfinite_step is None and r.skipped_total == 0, fw
        assert len(r.metrics) == QUICK.steps and r.location is None
        for rec in r.metrics:
            assert rec["non_finite_checks"] == [], rec
            assert rec["aux['logit_scale']"] == pytest.approx(1 / 0.07, rel=0.05)
        assert r.metrics[step]["finite"]  # the empty caption's step
        assert 0.0 <= r.scores["recall_at_1"] <= 1.0


def test_outputs_carry_the_check_points_and_the_report_names_them(runs, tmp_path):
    results = [runs[k] for k in sorted(runs)]
    lines = [json.loads(x) for r in results for x in harness.metric_lines(r)]
    assert all("checks['text_emb']['finite']" in x for x in lines)
    assert [x["first_non_finite_check"] for x in lines if not x["finite"]][:1] == [
        "text_emb"
    ]
    summary = {"task": "contrastive", "precision": "bfloat16", "wall_time_s": 1.0}
    text = open(
        harness.write_report(TASK, str(tmp_path), results, summary, "cmd")
    ).read()
    assert (
        "| held-out recall_at_1 | held-out recall_i2t | held-out recall_t2i |" in text
    )
    for fw in ("torch",):
        section = text.split(f"first non-finite step: {fw} bfloat16 naive")[1]
        assert "op div at examples/contrastive/model_" in section
        assert (
            "text_emb NON-FINITE" in section and "first non-finite: text_emb" in section
        )
    broken = [r.summary()["recall_at_1"] is None for r in results]
    assert broken == [True, False]  # naive, stable


def test_fit_stop_policy_and_preflight_checks(inputs):
    """fit's early stop on the naive torch step, and the pre-flight checks."""
    from torchref import train

    weights, batches, _ = inputs
    step_at = _first_empty_step(batches)
    cfg = QUICK.replace(precision="bfloat16", mode="naive")
    parts = TASK.torch_parts(cfg, weights)
    opt = harness.torch_optimizer(cfg, parts.model.parameters())
    step = train.TrainStep(parts.model, opt, parts.loss_fn, scaler=None)
    data_ = [parts.to_torch(b) for b in batches]
    with pytest.raises(train.NonFiniteError) as err:
        train.fit(
            step, data_, nan_policy=train.NanPolicy.stop(max_consecutive=1), log=None
        )
    # TrainStep skipped the empty caption's step (the model is intact) and
    # "stop" raised there, with where it went non-finite
    assert err.value.step == step_at
    assert (err.value.location.op, err.value.location.path) == ("div", "text")
    assert all(torch.isfinite(p).all() for p in parts.model.parameters())
    bad = {k: v.clone() for k, v in weights.items()}
    bad["text.proj.bias"][0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"text\.proj\.bias"):
        TASK.torch_parts(cfg, bad)
    with pytest.raises(FloatingPointError, match="1 of 12 leaves is not finite"):
        TASK.jax_parts(cfg, bad)
    nan_batch = {**batches[0], "image": batches[0]["image"].copy()}
    nan_batch["image"][0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="batch 3: 1 image entries are not finite"):
        task_lib.check_batch(nan_batch, 3)


def test_cli_knows_the_task():
    a = compare.parse_args(["contrastive", "--precision", "bfloat16", "--quick"])
    assert a.name == "contrastive" and a.precision == "bfloat16"
    assert harness.base_config(a).train_pairs == TASK.quick["train_pairs"]
