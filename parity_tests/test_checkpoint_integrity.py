"""Checkpoints of a run, both frameworks: a damaged latest checkpoint is
warned of by name and resume falls back to the one before it; fit resumes a
run from its global step (a sequence or an iterator of batches), appends to
its log, refuses to overwrite another run's checkpoints, rolls back to the
last checkpoint on disk; a plain step callable stops with NonFiniteError."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from jaxstable import loss_scale as jls
from jaxstable import train as jtrain
from jaxstable import transforms as jtransforms
from parity_tests.fit_forms import new_form
from torchref import loss_scale as tls
from torchref import train as ttrain

# 8 batches of a linear model; batch 3 is NaN (one skip, the scale backs off).
DATA = [np.full((4, 2), 0.1 * (i + 1), np.float32) for i in range(8)]
DATA[3] = np.full((4, 2), np.nan, np.float32)


# One step (and one optimizer) for every test: compiled once per session.
_JAX_TX = jtransforms.stable_optimizer(optax.adam(0.1))
_JAX_STEP = jtrain.make_train_step(lambda p, b: jnp.mean((b @ p["w"] - 1.0) ** 2))


def _jax_setup():
    state = jtrain.TrainState.create(
        params={"w": jnp.full((2,), 0.5)},
        optimizer=_JAX_TX,
        loss_scale=jls.DynamicLossScale(2.0**4, period=2),
    )
    return state, _JAX_STEP


def _torch_setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    step = ttrain.TrainStep(
        model,
        torch.optim.Adam(model.parameters(), lr=0.1),
        lambda m, b: ((m(b) - 1.0) ** 2).mean(),
        scaler=tls.DynamicLossScale(2.0**4, period=2),
    )
    return step


def _fit(framework, folder, data, **kw):
    """``(final params as numpy, history)`` of a fit into `folder`."""
    train = jtrain if framework == "jax" else ttrain
    kw = new_form(train, folder, kw)
    if framework == "jax":
        state, step = _jax_setup()
        batches = _convert(jnp.asarray, data)
        state, hist = jtrain.fit(state, step, batches, **kw)
        return np.asarray(state.params["w"]), hist
    step = _torch_setup()
    batches = _convert(torch.from_numpy, data)
    hist = ttrain.fit(step, batches, **kw)
    return step.model.weight.detach().numpy().copy(), hist


def _convert(fn, data):
    # A list stays a sequence (indexed on resume), an iterator an iterator.
    return [fn(b) for b in data] if isinstance(data, list) else map(fn, data)


def _damage(path: Path, how: str) -> None:
    """Truncates or flips one byte of the largest file of a checkpoint."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-len(data) // 3] ^= 0x10
    target.write_bytes(bytes(data))


def _ckpt(framework, folder, n):
    return folder / "ck" / (f"step_{n:08d}" + ("" if framework == "jax" else ".pt"))


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_resume_continues_the_run_and_appends_the_log(tmp_path, framework):
    full, hist = _fit(framework, tmp_path / "a", DATA, checkpoint_every=2)
    log = tmp_path / "b" / "log.jsonl"
    log.parent.mkdir()
    kw = {"checkpoint_every": 2, "log_path": log}
    _fit(framework, tmp_path / "b", DATA, steps=5, **kw)  # a "crash" after 5
    log.write_text(log.read_text() + '{"step": 5, "loss"')  # a torn last line
    with pytest.raises(ValueError, match="already holds checkpoints"):
        _fit(framework, tmp_path / "b", DATA, **kw)  # without resume
    # An iterator is advanced to the checkpoint's position (5 batches).
    params, rest = _fit(framework, tmp_path / "b", iter(DATA), resume=True, **kw)
    assert [r["step"] for r in rest] == [5, 6, 7]
    assert params.tobytes() == full.tobytes()
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(8))
    assert json.dumps(logged) == json.dumps(hist)
    names = sorted(p.name for p in (tmp_path / "b" / "ck").iterdir())
    # The last 3 kept, beside the bad-batch list (batch 3 is NaN).
    assert names[0] == "bad_batches.json"
    assert len(names) == 4 and names[-1].startswith("step_00000008")


@pytest.mark.parametrize("how", ["truncate", "flip"])
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_damaged_latest_checkpoint_warns_and_falls_back(tmp_path, framework, how):
    full, _ = _fit(framework, tmp_path / "a", DATA, checkpoint_every=2)
    _fit(framework, tmp_path / "b", DATA, steps=6, checkpoint_every=2)
    _damage(_ckpt(framework, tmp_path / "b", 6), how)
    with pytest.warns(RuntimeWarning, match="step_00000006") as rec:
        params, rest = _fit(
            framework, tmp_path / "b", DATA, checkpoint_every=2, resume=True
        )
    assert "trying the checkpoint before it" in str(rec[0].message)
    assert [r["step"] for r in rest] == [4, 5, 6, 7]  # from step 4's checkpoint
    assert params.tobytes() == full.tobytes()
    with pytest.raises(ValueError, match="step_00000004"):
        _damage(_ckpt(framework, tmp_path / "b", 4), how)
        load = jtrain.load_checkpoint if framework == "jax" else ttrain.load_checkpoint
        target = _jax_setup()[0] if framework == "jax" else _torch_setup()
        load(_ckpt(framework, tmp_path / "b", 4), target)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_rollback_to_disk_restores_the_last_checkpoint(tmp_path, framework):
    # Batch 3 is NaN: rolled back to the checkpoint at 2, the run goes on.
    params, hist = _fit(
        framework,
        tmp_path,
        DATA,
        checkpoint_every=2,
        nan_policy="rollback",
        max_consecutive_nonfinite=1,
        rollback_to="disk",
    )
    assert [r.get("rolled_back", False) for r in hist] == [i == 3 for i in range(8)]
    assert (
        hist[4]["skipped_total"] == 0 and hist[4]["loss_scale"] == hist[3]["loss_scale"]
    )
    assert np.isfinite(params).all()
    with pytest.raises(ValueError, match="rollback_to='disk' needs checkpoint_dir"):
        _fit(framework, tmp_path, DATA, checkpoint_dir=None, rollback_to="disk")


def test_orphan_temporaries_of_a_killed_save_are_removed(tmp_path):
    (tmp_path / "step_00000004.pt.tmp-123").write_bytes(b"half")
    (tmp_path / "keep.txt").write_text("not ours")
    ttrain.CheckpointManager(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"]


def _plain_metrics(finite):
    return {
        "loss": 1.0 if finite else float("nan"),
        "grad_norm": 0.0,
        "loss_scale": 1.0,
        "finite": finite,
        "skipped_total": 0 if finite else 1,
    }


def test_plain_step_callables_stop_with_non_finite_error():
    def jax_step(state, batch):  # a pure step over a dict state
        return state, _plain_metrics(bool(np.isfinite(batch).all()))

    with pytest.raises(jtrain.NonFiniteError) as info:
        jtrain.fit({"w": jnp.ones(2)}, jax_step, DATA[2:5], nan_policy="stop",
                   max_consecutive_nonfinite=1, progress=False)  # fmt: skip
    assert info.value.step == 1 and info.value.state == {"w": info.value.state["w"]}
    with pytest.raises(ttrain.NonFiniteError) as info:
        ttrain.fit(lambda b: _plain_metrics(bool(torch.isfinite(b).all())),
                   [torch.from_numpy(b) for b in DATA[2:5]], nan_policy="stop",
                   max_consecutive_nonfinite=1, progress=False)  # fmt: skip
    assert info.value.step == 1
    jax.block_until_ready(info.value.history)
