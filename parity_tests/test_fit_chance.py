"""Issue 36, items 1 and 2, in both `fit`s with the same records: a
non-finite step that does not reproduce (chance) told from one that does
(cause), and the bad-batch list kept beside the checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.experimental import io_callback

from jaxstable import train as jtrain
from parity_tests import bad_data_worker as worker
from torchref import train as ttrain

# End to end, with a killed process: queued first, compiled with fewer XLA
# optimisations (conftest.py; the killed worker inherits the setting, so its
# checkpoint and this process's runs compile alike and compare bitwise).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fewer_xla_optimizations")]

FRAMEWORKS = ("jax", "torch")
NOT_REPRODUCED = "did not reproduce on re-run: suspect non-determinism or hardware"


def _data(n=8, nan_at=()):
    rows = [np.full(3, 0.5 + 0.25 * i, np.float32) for i in range(n)]
    for i in nan_at:
        rows[i] = np.array([np.nan, 1.0, 1.0], np.float32)
    return rows


class _Flaky(torch.nn.Module):
    """``sqrt(w * f) * x``, ``f = 0`` on the listed forward calls, else 1: a
    kernel that misbehaves on some calls only (the loss is finite, the
    gradient 0/0 = NaN), as in the locate tests."""

    def __init__(self, bad_calls):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.calls, self.bad_calls = 0, bad_calls

    def forward(self, x):
        self.calls += 1
        f = 0.0 if self.calls in self.bad_calls else 1.0
        return torch.sqrt(self.w * f) * x


def _torch_step(bad_calls=()):
    model = _Flaky(set(bad_calls))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ttrain.TrainStep(model, opt, lambda m, x: m(x).sum())


def _jax_step(bad_calls=()):
    """The JAX twin: the factor from a host callback, one call per run of the
    step (the compiled step, each of locate's op-by-op runs)."""
    calls = [0]

    def factor():
        calls[0] += 1
        return np.float32(0.0 if calls[0] in bad_calls else 1.0)

    def loss_fn(p, x):
        f = io_callback(factor, jax.ShapeDtypeStruct((), jnp.float32))
        return jnp.sum(jnp.sqrt(p["w"] * f) * x)

    state = jtrain.TrainState.create(
        params={"w": jnp.ones(3)}, optimizer=optax.sgd(0.1)
    )
    # donate=True: with on_step, fit then reads each step before the next.
    return state, jtrain.make_train_step(loss_fn, donate=True)


def _fit(framework, data, bad_calls=(), **kwargs):
    """``(params as numpy, history)``; every step is read before the next
    runs (on_step), so the callback's calls are the steps' in order."""
    kwargs.setdefault("log", None)
    kwargs.setdefault("on_step", lambda rec, state: None)
    if framework == "jax":
        state, step = _jax_step(bad_calls)
        batches = [jnp.asarray(b) for b in data]
        state, hist = jtrain.fit(state, step, batches, **kwargs)
        return np.asarray(state.params["w"]), hist
    step = _torch_step(bad_calls)
    hist = ttrain.fit(step, [torch.from_numpy(b) for b in data], **kwargs)
    return step.model.w.detach().numpy().copy(), hist


def _fit_raises(framework, data, bad_calls=(), **kwargs):
    error = (jtrain if framework == "jax" else ttrain).NonFiniteError
    with pytest.raises(error) as info:
        _fit(framework, data, bad_calls, **kwargs)
    return info.value


def _kept(rec):
    """The keys both frameworks write alike (the location's value fields
    aside: float32 maxima print alike, but keep the test to what it checks)."""
    keys = ("step", "finite", "reproduced", "bad_batches_listed", "bad_batches_skipped")
    out = {k: rec[k] for k in keys if k in rec}
    loc = rec.get("location")
    if loc is not None:
        out["location"] = {
            k: loc[k]
            for k in ("phase", "path", "reproduced", "reruns", "reproduced_count")
        }
        out["cause"] = NOT_REPRODUCED not in loc["detail"]
    return out


# -- 1. chance or cause -------------------------------------------------------

# Steps 0, 1 are calls 1, 2; step 2 (call 3) and locate's first op-by-op run
# of it (call 4) go non-finite, locate's re-run (call 5) is finite: chance.
CHANCE_CALLS = (3, 4)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_chance_nan_counts_by_default(framework):
    policy = ttrain.NanPolicy.stop(max_consecutive=1)
    err = _fit_raises(framework, _data(5), CHANCE_CALLS, nan_policy=policy)
    assert err.step == 2
    assert err.history[-1]["reproduced"] is False


def test_chance_is_skipped_and_cause_stops_with_on_chance_ignore(tmp_path):
    policy = ttrain.NanPolicy.stop(max_consecutive=1, on_chance="ignore")
    records = {}
    for framework in FRAMEWORKS:
        folder = tmp_path / framework
        _, hist = _fit(
            framework, _data(5), CHANCE_CALLS, nan_policy=policy, checkpoint=folder
        )
        assert [r["finite"] for r in hist] == [True, True, False, True, True]
        chance = hist[2]
        assert chance["reproduced"] is False
        assert chance["location"]["reproduced"] is False
        assert NOT_REPRODUCED in chance["location"]["detail"]
        assert "bad_batches_listed" not in chance  # chance is not bad data
        assert not (folder / "bad_batches.json").exists()
        # The same policy on a NaN in the data: it reproduces, fit stops.
        data = _data(5, nan_at=[2])
        err = _fit_raises(framework, data, nan_policy=policy, checkpoint=folder / "c")
        cause = err.history[-1]
        assert (err.step, cause["reproduced"]) == (2, True)
        assert cause["location"]["phase"] == "input"
        assert cause["bad_batches_listed"] == [2]
        records[framework] = [_kept(r) for r in (*hist, cause)]
    assert records["jax"] == records["torch"]
    assert records["jax"][2]["location"] == {
        "phase": "backward", "path": "w", "reproduced": False, "reruns": 1,
        "reproduced_count": 0,
    }  # fmt: skip


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_fault_that_reproduces_is_a_cause(framework):
    policy = ttrain.NanPolicy.stop(max_consecutive=1, on_chance="ignore")
    err = _fit_raises(framework, _data(5), range(3, 10), nan_policy=policy)
    rec = err.history[-1]
    assert (err.step, rec["reproduced"], rec["location"]["phase"]) == (
        2, True, "backward",
    )  # fmt: skip


# -- 2. the bad-batch list ----------------------------------------------------


def test_a_restarted_fit_skips_the_batch_that_stopped_it(tmp_path):
    """PaLM's restart: a run stopped by a NaN in its data (no checkpoint
    after it, as after a crash) is started again with the very same call; it
    resumes from the checkpoint before the NaN and skips that batch without
    running it, bit for bit the run that never saw it."""
    data = _data(8, nan_at=[3])
    policy = ttrain.NanPolicy.stop(max_consecutive=1)
    records = {}
    for framework in FRAMEWORKS:
        folder = tmp_path / framework
        ckpt = ttrain.Checkpointing(folder, every=2, resume=True)
        err = _fit_raises(framework, data, nan_policy=policy, checkpoint=ckpt)
        assert err.step == 3 and err.history[-1]["bad_batches_listed"] == [3]
        listed = json.loads((folder / "bad_batches.json").read_text())
        assert listed["batches"] == [
            {"position": 3, "reason": "reproduced", "phase": "input", "path": None}
        ]
        # Without skip_listed a resumed run is the uninterrupted one: it runs
        # batch 3 again (and stops there again, with the same record).
        again = _fit_raises(framework, data, nan_policy=policy, checkpoint=ckpt)
        assert json.dumps(again.history[-1]) == json.dumps(err.history[-1])
        ckpt = ttrain.Checkpointing(folder, every=2, resume=True, skip_listed=True)
        w, hist = _fit(framework, data, nan_policy=policy, checkpoint=ckpt)
        assert [r["step"] for r in hist] == [2, 4, 5, 6, 7]
        assert hist[1]["bad_batches_skipped"] == [3]
        never, _ = _fit(framework, data[:3] + data[4:])
        np.testing.assert_array_equal(w, never)  # bitwise
        records[framework] = [_kept(r) for r in hist]
    assert records["jax"] == records["torch"]


def test_given_and_hand_written_bad_batches_are_skipped_without_running(tmp_path):
    data = _data(8)
    records = {}
    for framework in FRAMEWORKS:
        folder = tmp_path / framework
        folder.mkdir()
        (folder / "bad_batches.json").write_text("[5]")  # a user's list
        ckpt = ttrain.Checkpointing(folder, skip_listed=True, skip_batches=[2, 1])
        w, hist = _fit(framework, data, checkpoint=ckpt)
        assert [r["step"] for r in hist] == [0, 3, 4, 6, 7]
        assert [r.get("bad_batches_skipped") for r in hist] == [
            None, [1, 2], None, [5], None,
        ]  # fmt: skip
        never, _ = _fit(framework, [data[i] for i in (0, 3, 4, 6, 7)])
        np.testing.assert_array_equal(w, never)
        records[framework] = [_kept(r) for r in hist]
    assert records["jax"] == records["torch"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_without_a_checkpoint_directory_no_list_is_kept(framework):
    err = _fit_raises(
        framework, _data(5, nan_at=[2]),
        nan_policy=ttrain.NanPolicy.stop(max_consecutive=1),
    )  # fmt: skip
    assert err.history[-1]["reproduced"] is True
    assert "bad_batches_listed" not in err.history[-1]


def test_a_rewind_lists_the_batches_it_threw_away(tmp_path):
    data = _data(10, nan_at=[3, 4])
    policy = ttrain.NanPolicy.rewind(after=2, window=4, skip=1, every=2)
    lists = {}
    for framework in FRAMEWORKS:
        folder = tmp_path / framework
        _, hist = _fit(framework, data, nan_policy=policy, checkpoint=folder)
        assert hist[3]["bad_batches_listed"] == [3]  # located: reproduced
        trigger = hist[4]
        assert (trigger["rewind_to"], trigger["batches_skipped"]) == (2, 4)
        # trained since the snapshot at 2: 2, 3, 4; dropped after: 5
        assert trigger["bad_batches_listed"] == [2, 3, 4, 5]
        assert [r["step"] for r in hist] == [0, 1, 2, 3, 4, 6, 7, 8, 9]
        lists[framework] = json.loads((folder / "bad_batches.json").read_text())
        assert [(e["position"], e["reason"]) for e in lists[framework]["batches"]] == [
            (2, "rewound"), (3, "reproduced"), (4, "rewound"), (5, "rewound"),
        ]  # fmt: skip
    assert lists["jax"] == lists["torch"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_killed_run_resumed_skips_the_batch_it_listed(framework, tmp_path):
    """SIGKILLed after the NaN of batch 4 was listed, before the checkpoint
    after it: the resumed run (from checkpoint 3, or 0 if the kill beat its
    background save) skips batch 4 and equals the run that never saw it."""
    root = Path(__file__).resolve().parents[1]
    args = [sys.executable, "-m", "parity_tests.bad_data_worker", framework]
    proc = subprocess.run(
        [*args, str(tmp_path)],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    listed = json.loads((tmp_path / "bad_batches.json").read_text())["batches"]
    assert [(e["position"], e["reason"]) for e in listed] == [(4, "reproduced")]
    data = _data(worker.N, nan_at=[worker.BAD])
    ckpt = ttrain.Checkpointing(
        tmp_path, every=worker.EVERY, resume=True, skip_listed=True
    )
    w, hist = _fit(framework, data, checkpoint=ckpt)
    assert hist[0]["step"] in (0, 3) and hist[-1]["step"] == worker.N - 1
    after = [r for r in hist if r["step"] == worker.BAD + 1]
    assert after[0]["bad_batches_skipped"] == [worker.BAD]
    assert all(r["finite"] for r in hist)  # batch 4 never ran
    never, _ = _fit(framework, data[: worker.BAD] + data[worker.BAD + 1 :])
    np.testing.assert_array_equal(w, never)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_on_chance_ignore_says_when_it_cannot_act(framework):
    # A plain step callable cannot be located: chance cannot be told from
    # cause, so on_chance="ignore" says it has no effect (once) and the NaN
    # counts as any other.
    policy = ttrain.NanPolicy.stop(max_consecutive=1, on_chance="ignore")
    data = _data(3, nan_at=(1,))
    error = (jtrain if framework == "jax" else ttrain).NonFiniteError
    with pytest.warns(UserWarning, match='on_chance="ignore" has no effect') as got:
        with pytest.raises(error) as info:
            if framework == "jax":
                state, step = _jax_step()
                jtrain.fit(
                    state, lambda s, b: step(s, b), [jnp.asarray(b) for b in data],
                    log=None, nan_policy=policy,
                )  # fmt: skip
            else:
                inner = _torch_step()
                ttrain.fit(
                    lambda b: inner(b), [torch.from_numpy(b) for b in data],
                    log=None, nan_policy=policy,
                )  # fmt: skip
    assert info.value.step == 1
    assert "reproduced" not in info.value.history[-1]
    assert sum("on_chance" in str(w.message) for w in got) == 1
