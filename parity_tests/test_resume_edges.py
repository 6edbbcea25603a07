"""Resume edges, both frameworks alike (issue 22, items 8-11; issue 21, item 4).

A flipped data position is caught by the checksum; a run stopped after k
steps and resumed skips, stops and rolls back as the uninterrupted run (the
NaN policy's state and the rollback snapshot are checkpointed); torch keys
optimizer state by parameter name; a damaged log line or a deleted log is
warned of, a stray ``step_00000099`` entry is skipped and takes no retention
slot; a second fit on a directory is refused by its lock; and fit warns when
it runs fewer steps than asked. The in-process "kill" is ``fit(steps=k)``: it
writes the same checkpoint at k that a periodic save would (the subprocess
kills are in test_resume.py).
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from _stablecore import lock as core_lock
from jaxstable import train as jtrain
from parity_tests.fit_forms import new_form
from parity_tests.test_checkpoint_integrity import (
    DATA,
    _ckpt,
    _convert,
    _jax_setup,
    _torch_setup,
)
from torchref import train as ttrain

FRAMEWORKS = ["jax", "torch"]
# Two NaN batches in a row (3 and 4): max_consecutive_nonfinite=2 triggers.
TWO_BAD = list(DATA)
TWO_BAD[4] = DATA[3]
# A pid no process can have: above Linux's largest pid_max (2**22).
DEAD_PID = 2**22 + 1


def _run(framework, folder: Path, data, **kw):
    """``(summary, history)`` of a fit into ``folder/ck``: the summary holds
    the final params' bytes, step count, skipped total and loss scale."""
    train = jtrain if framework == "jax" else ttrain
    kw = new_form(train, folder, kw)
    if framework == "jax":
        state, step = _jax_setup()
        state, hist = jtrain.fit(state, step, _convert(jnp.asarray, data), **kw)
        summary = (
            np.asarray(state.params["w"]).tobytes(),
            int(state.step),
            int(state.skipped_total),
            float(state.loss_scale.loss_scale),
        )
        return summary, hist
    step = _torch_setup()
    hist = ttrain.fit(step, _convert(torch.from_numpy, data), **kw)
    summary = (
        step.model.weight.detach().numpy().tobytes(),
        step.steps_done,
        int(step.skip_state.skipped_total),
        float(step.scaler.get_scale()),
    )
    return summary, hist


def _error(framework):
    return jtrain.NonFiniteError if framework == "jax" else ttrain.NonFiniteError


def _same(a, b) -> bool:
    return json.dumps(a) == json.dumps(b)  # records hold NaN (NaN != NaN)


# -- 22.8: every field that decides the resumed run is under the checksum ------


def _edit_meta(framework, path: Path, edit) -> None:
    """Applies `edit` to the checkpoint's JSON (JAX's meta item, torch's
    header line) and writes it back, valid JSON, the sha256 left as it was."""
    if framework == "jax":
        file = path / "meta" / "metadata"
        meta = json.loads(file.read_text())
        edit(meta)
        file.write_text(json.dumps(meta))
        return
    header, payload = path.read_bytes().split(b"\n", 1)
    meta = json.loads(header)
    edit(meta)
    path.write_bytes(json.dumps(meta).encode() + b"\n" + payload)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_flipped_data_position_is_caught_like_a_damaged_checkpoint(
    tmp_path, framework
):
    full, _ = _run(framework, tmp_path / "a", DATA)
    _run(framework, tmp_path / "b", DATA, steps=6, checkpoint_every=2)
    # One bit: 6 -> 7 would resume after batch 6 and never apply it.
    _edit_meta(framework, _ckpt(framework, tmp_path / "b", 6), lambda m: m.update(
        data_position=m["data_position"] ^ 1))  # fmt: skip
    with pytest.warns(RuntimeWarning, match=r"step_00000006.*sha256") as rec:
        resumed, rest = _run(
            framework, tmp_path / "b", DATA, checkpoint_every=2, resume=True
        )
    assert "trying the checkpoint before it" in str(rec[0].message)
    assert [r["step"] for r in rest] == [4, 5, 6, 7]  # from step 4's checkpoint
    assert resumed == full


def _write_format_1(framework, path: Path, trained, n: int) -> None:
    """Checkpoint n as the previous format (1) wrote it: JAX's meta with the
    sha256 of the arrays alone, torch's header with that of the payload
    alone and positional optimizer state."""
    if framework == "jax":
        import orbax.checkpoint as ocp
        from flax import serialization

        from jaxstable._src.checkpoint_checks import state_types
        from jaxstable._src.checkpoint_format import _digest_v1

        tree = serialization.to_state_dict(jax.device_get(trained))
        meta = {"format": "jaxstable-checkpoint-1", "step": n, "data_position": n,
                "types": {"opt_state": state_types(trained.opt_state)},
                "sha256": _digest_v1(tree)}  # fmt: skip
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)
        )
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            ckptr.save(os.fspath(path), args=args)
        return
    import hashlib
    import io

    from torchref._src.checkpoint_checks import class_names
    from torchref._src.checkpoint_format import rng_states

    state = {**trained.state_dict(), "classes": class_names(trained),
             "rng": rng_states(), "data_position": n}  # fmt: skip
    buf = io.BytesIO()
    torch.save(state, buf)
    digest = hashlib.sha256(buf.getvalue()).hexdigest()
    # A flipped header position (outside format 1's sha256): the payload's,
    # which is under it, is the one used.
    header = {"format": "torchref-checkpoint-1", "step": n, "data_position": n + 1,
              "metrics": None, "sha256": digest}  # fmt: skip
    path.parent.mkdir(parents=True)
    path.write_bytes(json.dumps(header).encode() + b"\n" + buf.getvalue())


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_checkpoint_of_the_previous_format_still_resumes(tmp_path, framework):
    full, _ = _run(framework, tmp_path / "a", DATA)
    if framework == "jax":
        state, step = _jax_setup()
        trained, _ = jtrain.fit(state, step, _convert(jnp.asarray, DATA[:4]),
                                progress=False)  # fmt: skip
    else:
        trained = _torch_setup()
        ttrain.fit(trained, _convert(torch.from_numpy, DATA[:4]), progress=False)
    _write_format_1(framework, _ckpt(framework, tmp_path / "b", 4), trained, 4)
    resumed, rest = _run(framework, tmp_path / "b", DATA, resume=True)
    assert [r["step"] for r in rest] == [4, 5, 6, 7] and resumed == full


# -- 22.9: the NaN policy goes on as in the uninterrupted run -------------------


@pytest.mark.parametrize("policy", ["skip", "stop", "rollback"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_killed_between_two_bad_steps_the_policy_acts_as_uninterrupted(
    tmp_path, framework, policy
):
    # Batches 3 and 4 are NaN, the "kill" comes after step 3. rollback_every=3:
    # the snapshot (step 3) is not the checkpointed state (step 4), so the
    # checkpoint must carry it.
    base = {"nan_policy": policy, "max_consecutive_nonfinite": 2, "rollback_every": 3}
    kw = {}
    for folder in ("full", "killed"):
        (tmp_path / folder).mkdir()
        kw[folder] = {"log_path": tmp_path / folder / "log.jsonl", **base}
    if policy == "stop":
        with pytest.raises(_error(framework)) as full:
            _run(framework, tmp_path / "full", TWO_BAD, **kw["full"])
        _run(framework, tmp_path / "killed", TWO_BAD, steps=4, **kw["killed"])
        with pytest.raises(_error(framework)) as resumed:
            _run(framework, tmp_path / "killed", TWO_BAD, resume=True, **kw["killed"])
        assert resumed.value.step == full.value.step == 4
        assert _same(resumed.value.history[-1], full.value.history[-1])
    else:
        full, hist = _run(framework, tmp_path / "full", TWO_BAD, **kw["full"])
        _, first = _run(
            framework, tmp_path / "killed", TWO_BAD, steps=4, **kw["killed"]
        )
        resumed, rest = _run(
            framework, tmp_path / "killed", TWO_BAD, resume=True, **kw["killed"]
        )
        assert resumed == full  # params bitwise, step, skipped, loss scale
        assert _same(first + rest, hist)
        rolled = [r.get("rolled_back", False) for r in hist]
        assert rolled == [policy == "rollback" and i == 4 for i in range(8)]
    logs = [(tmp_path / f / "log.jsonl").read_text() for f in ("full", "killed")]
    assert logs[0] == logs[1]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_run_stop_after_nonfinite_ended_runs_no_more_on_resume(tmp_path, framework):
    kw = {"stop_after_nonfinite": 1}
    _, hist = _run(framework, tmp_path, DATA, **kw)
    assert [r["step"] for r in hist] == [0, 1, 2, 3, 4]  # batch 3 is NaN
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, rest = _run(framework, tmp_path, DATA, steps=8, resume=True, **kw)
    assert rest == []  # the same command re-run: that run is over, and
    assert not [w for w in caught if "fit ran" in str(w.message)]  # as asked


# -- 22.10: optimizer state by parameter name (and JAX's by path) ---------------


def _two_params(order):
    """A TrainStep whose Adam holds the parameters named in `order` (of a,
    b, c) in that order."""
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.linspace(-1, 1, 12).reshape(3, 4))
    model.b = torch.nn.Parameter(torch.linspace(1, 2, 12).reshape(4, 3))
    model.c = torch.nn.Parameter(torch.zeros(4, 3))
    params = [getattr(model, n) for n in order]
    for name, p in model.named_parameters():
        p.requires_grad_(name in order)  # frozen: outside the optimizer
    step = ttrain.TrainStep(
        model,
        torch.optim.Adam(params, lr=0.1),
        lambda m, x: (x @ m.a @ m.b).pow(2).mean() + m.a.sum(),
    )
    return step


def test_torch_optimizer_state_is_loaded_by_parameter_name(tmp_path):
    x = torch.ones(2, 3)
    src = _two_params("ab")
    for _ in range(2):
        src(x)
    ttrain.save_checkpoint(tmp_path / "ck.pt", src)
    dst = ttrain.load_checkpoint(tmp_path / "ck.pt", _two_params("ba"))
    for name in "ab":
        want = src.optimizer.state[getattr(src.model, name)]["exp_avg"]
        got = dst.optimizer.state[getattr(dst.model, name)]["exp_avg"]
        assert torch.equal(got, want), name
    src(x), dst(x)  # positionally, a's (3, 4) state would meet b's (4, 3) grads
    for name in "ab":
        assert torch.equal(getattr(src.model, name), getattr(dst.model, name))


def test_torch_refuses_optimizer_state_of_other_parameters(tmp_path):
    # The same model; its optimizer trains c where the checkpoint's trained b.
    ttrain.save_checkpoint(tmp_path / "ck.pt", _two_params("ab"))
    with pytest.raises(ValueError) as info:
        ttrain.load_checkpoint(tmp_path / "ck.pt", _two_params("ac"))
    msg = str(info.value)
    assert "optimizer/c: missing from the checkpoint (target (4, 3) float32)" in msg
    assert "optimizer/b: in the checkpoint ((4, 3) float32), not in the target" in msg


def test_jax_state_is_matched_by_path_not_position(tmp_path):
    a, b = jnp.linspace(-1, 1, 12).reshape(3, 4), jnp.ones((4, 3))
    tx = optax.adam(0.1)
    s = jtrain.TrainState.create(params={"a": a, "b": b}, optimizer=tx)
    s = s.replace(opt_state=jax.tree.map(lambda x: x + 1, s.opt_state))
    jtrain.save_checkpoint(tmp_path / "dict", s)
    blank = jtrain.TrainState.create(params={"b": b * 0, "a": a * 0}, optimizer=tx)
    back = jtrain.load_checkpoint(tmp_path / "dict", blank)
    jax.tree.map(np.testing.assert_array_equal, back.opt_state, s.opt_state)
    # A list is positional by nature: swapped shapes are refused by path.
    jtrain.save_checkpoint(tmp_path / "list", [a, b])
    with pytest.raises(ValueError, match=r"  0: checkpoint \(3, 4\) float32, tar"):
        jtrain.load_checkpoint(tmp_path / "list", [b, a])


# -- 22.11: logs, stray entries, one run per directory --------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_damaged_log_line_or_a_deleted_log_is_warned_of(tmp_path, framework):
    log = tmp_path / "log.jsonl"
    _, hist = _run(framework, tmp_path / "a", DATA, log_path=tmp_path / "full.jsonl")
    _run(framework, tmp_path, DATA, steps=6, checkpoint_every=2, log_path=log)
    lines = log.read_text().splitlines(keepends=True)
    lines[1] = lines[1][:20] + "\n"  # damaged in the middle, not the last line
    log.write_text("".join(lines) + '{"step": 6, "lo')  # and the crash's torn one
    with pytest.warns(RuntimeWarning, match=r"line\(s\) \[2\] are not JSON") as rec:
        _run(framework, tmp_path, DATA, checkpoint_every=2, log_path=log, resume=True)
    # The torn last line is the crash's own: not warned of.
    assert len([w for w in rec if "log_path" in str(w.message)]) == 1
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert _same(logged, hist[:1] + hist[2:])  # every valid record is kept
    log.unlink()
    with pytest.warns(RuntimeWarning, match="does not exist: the run resumes at"):
        _run(framework, tmp_path, DATA, checkpoint_every=2, log_path=log, resume=True)


@pytest.mark.parametrize("kind", ["file", "dir"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_stray_step_entry_is_skipped_and_takes_no_slot(tmp_path, framework, kind):
    full, _ = _run(framework, tmp_path / "a", DATA)
    _run(framework, tmp_path / "b", DATA, steps=6, checkpoint_every=2)
    stray = _ckpt(framework, tmp_path / "b", 99)
    if kind == "dir":
        stray.mkdir()
        (stray / "notes.txt").write_text("not a checkpoint")
    else:
        stray.write_bytes(b"not a checkpoint")
    with pytest.warns(RuntimeWarning, match="step_00000099"):
        resumed, rest = _run(
            framework, tmp_path / "b", DATA, checkpoint_every=2, resume=True
        )
    assert resumed == full and [r["step"] for r in rest] == [6, 7]
    entries = (tmp_path / "b" / "ck").iterdir()
    # (and the run's bad-batch list, bad_batches.json: its NaN batch)
    left = sorted(p.name.split(".")[0] for p in entries if p.name != "bad_batches.json")
    # The last 3 of the run kept (2 pruned), the stray entry left alone.
    assert left == ["step_00000004", "step_00000006", "step_00000008", "step_00000099"]
    assert stray.is_dir() == (kind == "dir")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_second_fit_on_a_directory_is_refused_by_its_lock(tmp_path, framework):
    refused = []

    def second_fit(record, _):
        if record["step"] == 2:  # the first run has checkpoints by now
            try:
                _run(framework, tmp_path, DATA, checkpoint_every=1, resume=True)
            except RuntimeError as e:
                refused.append(str(e))

    kw = {"checkpoint_every": 1, "on_step": second_fit}
    first, _ = _run(framework, tmp_path, DATA, **kw)
    assert len(refused) == 1, refused
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in refused[0]
    assert "is in use by another run" in refused[0]
    assert not (tmp_path / "ck" / ".fit.lock").exists()  # released at the end
    again, rest = _run(framework, tmp_path, DATA, resume=True)  # the lock is free
    assert again == first and rest == []


@pytest.mark.parametrize("flock", [True, False])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_dead_runs_lock_is_stale_and_a_live_ones_is_refused(
    tmp_path, monkeypatch, framework, flock
):
    lock = tmp_path / "ck" / ".fit.lock"
    lock.parent.mkdir()
    if not flock:  # a filesystem without flock: the lock's content decides
        monkeypatch.setattr(core_lock, "_flock", lambda fd: None)
    host = socket.gethostname()
    lock.write_text(json.dumps({"pid": DEAD_PID, "host": host, "start": None}))
    _run(framework, tmp_path, DATA[:2])  # taken over
    assert not lock.exists()
    if not flock:  # a live pid (no flock held: only its content tells)
        lock.write_text(json.dumps({"pid": os.getppid(), "host": host, "start": None}))
        with pytest.raises(RuntimeError, match=f"pid {os.getppid()} on host"):
            _run(framework, tmp_path, DATA[:2], resume=True)


def test_both_fits_take_the_one_lock():
    from jaxstable._src import checkpoint_manager as jckpt
    from jaxstable._src import fit as jfit
    from torchref._src import checkpoint_manager as tckpt
    from torchref._src import fit as tfit

    assert jfit.DirectoryLock is tfit.DirectoryLock is core_lock.DirectoryLock
    elsewhere = core_lock.locked_elsewhere
    assert jckpt.locked_elsewhere is tckpt.locked_elsewhere is elsewhere


# -- 21.4: fewer steps than asked ------------------------------------------------


def test_fit_warns_when_it_runs_fewer_steps_than_asked(tmp_path):
    messages = {}
    for framework in FRAMEWORKS:
        folder = tmp_path / framework
        with pytest.warns(UserWarning) as short:
            _run(framework, folder, DATA[:6], steps=8)
        with pytest.warns(UserWarning) as past:
            _run(framework, folder, DATA, steps=4, resume=True)
        ours = [str(w.message) for w in (*short, *past)]
        messages[framework] = [m for m in ours if m.startswith("fit ran")]
    assert messages["jax"] == messages["torch"]  # the same text
    assert messages["jax"] == [
        "fit ran 6 of the 8 step(s) asked (steps=8, from step 0): the batches "
        "ended at step 6",
        "fit ran no step: the checkpoint it resumed from is at step 6, past "
        "steps=4 (the state returned is that checkpoint's)",
    ]
