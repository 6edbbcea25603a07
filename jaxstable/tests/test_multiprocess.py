"""`fit` across processes with `jax.distributed` (issue 26, "past one machine").

Two processes with two forced CPU devices each (CPU collectives through
gloo, the coordinator on 127.0.0.1) train an MLP with FSDP on a global mesh
of 4 devices, each process loading only its own rows of every batch
(``shard_batch(..., process_local=True)``), and must equal ONE process with
4 devices. Batch 3 holds NaN in process 1's rows only, batch 10 an inf in
process 0's rows only: both processes must skip both steps. The runs:

* ``kill``: 2 processes, checkpoints every 4 steps (orbax, written by both
  processes together); process 1 SIGKILLs itself after step 7, while
  process 0 gathers the step-8 checkpoint. Process 0 must exit with status
  1 and fit's error naming process 1 and the step (not jax's SIGABRT after
  the heartbeat timeout).
* ``single``: 1 process x 4 devices, the reference (checkpoints every 4
  steps); then the same call resumed from the kill run's step-4
  checkpoint (2 processes -> 1).
* ``resume``: the same call with ``resume=True`` finishes the run from the
  step-4 checkpoint; its params, skip decisions, loss scales and log (one
  file, process 0's) must equal the reference; then the same call resumed
  from the single run's step-4 checkpoint (1 process -> 2), and
  cross-process checks (different initial states are refused;
  replicas_identical sees them). Last, in the same processes, a second run
  whose loader raises on process 1 at step 2: process 0 must exit promptly
  (status 1) with an error naming process 1, the step and the exception.
* ``coordinator``: process 0 SIGKILLs itself in fit; process 1 must end at
  once (jax's own abort: process 0 held the coordination service).

Every process is started by this module with a hard timeout and killed on
every path (`_launch`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

# processes launched and killed: queued first, compiled with fewer XLA
# optimisations (conftest.py; the workers inherit it)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fewer_xla_optimizations")]

STEPS = 12
ROWS = 8  # global batch: 2 rows per device
IN, HIDDEN, OUT = 4, 8, 3
POISON = {3: (slice(4, 8), 0), 10: (1, 2)}  # step -> x index (NaN, then inf)
# Process 1 dies after step 7 (its step 8 done, on both): process 0's next
# collective is the gather of the step-8 checkpoint (jax may report its
# failure as a ValueError, not a JaxRuntimeError). The run resumes from 4.
KILL_AFTER = 7
RESUME_AT = 4
RAISE_AT = 2
# Not reached on any path (each ends sooner); a survivor must end before it
# would (fit waits 2 s for the other processes' answers).
HEARTBEAT_S = 10
TIMEOUT_S = 60


def problem():
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(0, 0.5, (IN, HIDDEN)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.normal(0, 0.5, (HIDDEN, OUT)).astype(np.float32),
        "b2": np.zeros(OUT, np.float32),
    }
    batches = []
    for i in range(STEPS):
        x = rng.normal(size=(ROWS, IN)).astype(np.float32)
        y = rng.normal(size=(ROWS, OUT)).astype(np.float32)
        if i in POISON:
            x[POISON[i]] = np.nan if i == 3 else np.inf
        batches.append((x, y))
    return params, batches


def _refusals(state, step, batches, load, mesh, out, pid, result) -> None:
    """The "resume" worker's checks of what fit and shard_state refuse."""
    import jax

    from jaxstable import distributed, train

    # The torch idiom, checkpoints from process 0 only: refused on every
    # process before any step (it aborted both with a collective mismatch).
    try:
        train.fit(
            state,
            step,
            batches,
            log=None,
            checkpoint=os.path.join(out, "ckpt2") if pid == 0 else None,
        )
        result["process_0_only"] = None
    except ValueError as e:
        result["process_0_only"] = str(e)
    # nan_policy="stop": every process raises at the same step (the
    # report gathered from the FSDP shards), none is ended by another.
    try:
        train.fit(
            state,
            step,
            batches,
            log=None,
            nan_policy=train.NanPolicy.stop(max_consecutive=1),
            batch_transform=load,
        )
        result["stop"] = None
    except train.NonFiniteError as e:
        result["stop"] = [e.step, str(e)]
    # Processes that start from different states: shard_state refuses,
    # and replicas_identical (which compares across processes) says so.
    differ = {"w": np.full((4, 2), float(pid), np.float32)}
    try:
        distributed.shard_state(differ, mesh, "data_parallel")
        result["refused"] = None
    except ValueError as e:
        result["refused"] = str(e)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    w = jax.make_array_from_callback((4, 2), sharding, lambda i: differ["w"][i])
    result["differ_identical"] = distributed.replicas_identical({"w": w})


def _worker(mode: str, out: str, pid: int = 0, port: int = 0) -> None:
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    if mode != "single":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            f"127.0.0.1:{port}",
            num_processes=2,
            process_id=pid,
            initialization_timeout=30,
            heartbeat_timeout_seconds=HEARTBEAT_S,
            shutdown_timeout_seconds=5,
        )
    import jax.numpy as jnp
    import optax
    from jax.experimental import multihost_utils

    def host(x):
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    from jaxstable import distributed, train, transforms
    from jaxstable import loss_scale as jls

    def loss(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    params, batches = problem()
    tx = transforms.stable_optimizer(optax.adam(1e-2), max_grad_norm=1.0)
    state = train.TrainState.create(
        params={k: jnp.asarray(v) for k, v in params.items()},
        optimizer=tx,
        loss_scale=jls.DynamicLossScale(loss_scale=2.0**10, period=4),
    )
    mesh = distributed.make_mesh()
    assert mesh.devices.size == 4, jax.devices()
    state = distributed.shard_state(state, mesh, "fsdp")
    step = train.make_train_step(loss)
    nproc = jax.process_count()
    lo, hi = pid * ROWS // nproc, (pid + 1) * ROWS // nproc
    calls = []
    failing = False

    def load(batch):  # this process's rows only
        calls.append(1)
        if failing and pid == 1 and len(calls) == RAISE_AT + 1:
            raise ValueError(f"process 1 cannot read batch {RAISE_AT}")
        mine = jax.tree.map(lambda a: a[lo:hi], batch)
        return distributed.shard_batch(mine, mesh, process_local=nproc > 1)

    def on_step(rec, _):
        if mode == "kill" and pid == 1 and rec["step"] == KILL_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)

    if mode == "coordinator":
        # Process 0 dies loading its first batch: both are in fit (past its
        # all-gather of the settings), process 1 loading or compiling step 0
        # (not waiting for the compile keeps this launch short).
        def die_first(batch):
            if pid == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            return load(batch)

        train.fit(state, step, batches, log=None, batch_transform=die_first)
        return

    def run(state, directory, **kw):
        manager = train.CheckpointManager(directory, async_save=False)
        state, hist = train.fit(
            state, step, batches, steps=STEPS, checkpoint_dir=manager,
            checkpoint_every=4, batch_transform=load, **kw,
        )  # fmt: skip
        return state, {
            "params": {k: host(v).tolist() for k, v in state.params.items()},
            "final_scale": float(host(state.loss_scale.loss_scale)),
            "steps": [r["step"] for r in hist],
            "finite": [r["finite"] for r in hist],
            "loss_scale": [r["loss_scale"] for r in hist],
            "loss": [r["loss"] for r in hist],
            "replicas_identical": distributed.replicas_identical(state),
        }

    state, result = run(
        state,
        os.path.join(out, "ckpt_single" if mode == "single" else "ckpt"),
        progress=mode != "single",
        log_path=os.path.join(
            out, f"log_{'single' if mode == 'single' else 'run'}_{pid}.jsonl"
        ),
        resume=mode == "resume",
        on_step=on_step,
    )
    if mode != "kill":
        # Across process counts: the same call resumed from the step-4
        # checkpoint of the other layout (written by 2 processes, restored
        # by 1 process with 4 devices, and the reverse).
        theirs = "ckpt_from2" if mode == "single" else "ckpt_from1"
        result["across"] = run(state, os.path.join(out, theirs), resume=True)[1]
    if mode == "resume":
        _refusals(state, step, batches, load, mesh, out, pid, result)
    with open(os.path.join(out, f"{mode}_{pid}.json"), "w") as f:
        json.dump(result, f)
    if mode == "resume":
        # The loader of process 1 raises at step RAISE_AT of a new run.
        calls.clear()
        failing = True
        train.fit(state, step, batches, log=None, batch_transform=load)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, out, nproc: int, timeout: float = TIMEOUT_S):
    """Runs ``nproc`` worker processes; ``[(returncode, stderr, seconds)]``.
    Every process is killed when the timeout passes or anything raises."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={4 // nproc}"
    )
    env["PJRT_NPROC"] = "8"  # as test_distributed: no all-reduce deadlock
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    port = _free_port()
    procs, logs = [], []
    start = time.monotonic()
    try:
        for pid in range(nproc):
            log = open(os.path.join(out, f"{mode}_{pid}.err"), "w+")
            logs.append(log)
            args = [sys.executable, "-m", "jaxstable.tests.test_multiprocess"]
            procs.append(
                subprocess.Popen(
                    [*args, mode, str(out), str(pid), str(port)],
                    env=env,
                    cwd=root,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            )
        ends = [None] * nproc
        while None in ends and time.monotonic() - start < timeout:
            for i, p in enumerate(procs):
                if ends[i] is None and p.poll() is not None:
                    ends[i] = time.monotonic() - start
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    results = []
    for p, log, end in zip(procs, logs, ends, strict=True):
        log.seek(0)
        results.append((p.returncode, log.read(), end))
        log.close()
    return results


def _read(out, name):
    with open(os.path.join(out, name)) as f:
        return json.load(f)


def _copy_until(out, source, target, step):
    """A copy of checkpoint directory `source` up to global step `step`
    (without its lock: another run's)."""

    def left_out(_, names):
        later = [n for n in names if n[5:].isdigit() and int(n[5:]) > step]
        return [*later, ".fit.lock"]

    src, dst = os.path.join(out, source), os.path.join(out, target)
    shutil.copytree(src, dst, ignore=left_out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiprocess")
    got = {}
    for mode, nproc in (("kill", 2), ("single", 1), ("resume", 2), ("coordinator", 2)):
        if mode == "single":  # its second run resumes the 2-process checkpoint
            _copy_until(out, "ckpt", "ckpt_from2", RESUME_AT)
        if mode == "resume":  # its second run resumes the 1-process checkpoint
            _copy_until(out, "ckpt_single", "ckpt_from1", RESUME_AT)
        got[mode] = _launch(mode, out, nproc)
        got[mode + "/out"] = out
        if mode == "kill":
            ckpt = os.path.join(out, "ckpt")
            got["kill/ckpt"] = sorted(n for n in os.listdir(ckpt) if n[:5] == "step_")
    return got


def _ok(run):
    for rc, err, _ in run:
        assert rc == 0, err[-3000:]


def test_two_processes_resumed_after_a_kill_equal_one_process(runs):
    _ok(runs["single"])
    for rc, err, _ in runs["resume"]:  # its json written (before the raise)
        assert rc == 1, err[-3000:]
    out = runs["resume/out"]
    one = _read(out, "single_0.json")
    # Not vacuous: both poisoned steps were skipped by the reference.
    assert [i for i, f in enumerate(one["finite"]) if not f] == sorted(POISON)
    for pid in (0, 1):
        two = _read(out, f"resume_{pid}.json")
        assert two["steps"] == list(range(RESUME_AT, STEPS))  # its checkpoint
        assert two["finite"] == one["finite"][RESUME_AT:]
        assert two["loss_scale"] == one["loss_scale"][RESUME_AT:]
        np.testing.assert_allclose(two["loss"], one["loss"][RESUME_AT:], rtol=1e-6)
        for k, v in one["params"].items():
            np.testing.assert_allclose(two["params"][k], v, rtol=0, atol=1e-6)
        assert two["replicas_identical"] is True
    # Process 0 alone wrote the log: the whole run, 4 lines kept + 8 resumed.
    assert not os.path.exists(os.path.join(out, "log_run_1.jsonl"))
    with open(os.path.join(out, "log_run_0.jsonl")) as f:
        log = [json.loads(line) for line in f]
    assert [r["step"] for r in log] == list(range(STEPS))
    assert [r["finite"] for r in log] == one["finite"]


def test_a_two_process_checkpoint_restores_on_one_device(runs):
    # Written by both processes from an FSDP state split over them; restored
    # here, in the test process, onto a 1-device state (placements differ).
    import jax.numpy as jnp
    import optax

    from jaxstable import loss_scale as jls
    from jaxstable import train, transforms

    params, _ = problem()
    target = train.TrainState.create(
        params={k: jnp.asarray(v) for k, v in params.items()},
        optimizer=transforms.stable_optimizer(optax.adam(1e-2), max_grad_norm=1.0),
        loss_scale=jls.DynamicLossScale(loss_scale=2.0**10, period=4),
    )
    out = runs["resume/out"]
    with train.CheckpointManager(os.path.join(out, "ckpt")) as mgr:
        assert mgr.latest_step() == STEPS
        state, info = mgr.restore(target)
    assert info["data_position"] == STEPS
    one = _read(out, "single_0.json")
    for k, v in one["params"].items():
        np.testing.assert_allclose(np.asarray(state.params[k]), v, rtol=0, atol=1e-6)
    assert float(state.loss_scale.loss_scale) == one["final_scale"]
    assert int(state.skipped_total) == len(POISON)


def test_every_process_takes_the_same_decisions_and_locates(runs):
    out = runs["resume/out"]
    a, b = (_read(out, f"resume_{pid}.json") for pid in (0, 1))
    assert a["finite"] == b["finite"] and a["loss_scale"] == b["loss_scale"]
    assert a["loss"] == b["loss"] and a["params"] == b["params"]
    # The first non-finite step (3) was located before the kill, on process
    # 0's log (the step whose NaN rows live on process 1's devices).
    with open(os.path.join(out, "log_run_0.jsonl")) as f:
        log = [json.loads(line) for line in f]
    assert "location" in log[3] and log[3]["location"]["phase"] == "input"


def test_a_killed_process_ends_the_other_with_an_error_naming_it(runs):
    (rc0, err0, t0), (rc1, _, _) = runs["kill"]
    assert rc1 == -signal.SIGKILL
    # Status 1, not jax's SIGABRT after the heartbeat timeout: fit's error
    # names the step, the failed collective and the process that is gone,
    # and the process skips jax's shutdown barrier (it cannot complete).
    assert rc0 == 1 and t0 is not None, err0[-3000:]
    # The gather of the step-8 checkpoint failed: a JaxRuntimeError or a
    # ValueError from jax (seen both), named by process 1's silence.
    assert f"RuntimeError: fit: process 0 at step {KILL_AFTER + 1}: " in err0
    assert "Gloo AllGather failed" in err0, err0[-3000:]
    assert "process(es) 1 did not answer within 2 s" in err0, err0[-3000:]
    assert "Terminating process" not in err0, err0[-3000:]
    # The checkpoint at step 4 was written by both processes before the
    # kill, the one at step 8 not at all (its gather failed).
    assert runs["kill/ckpt"] == ["step_00000004"]


def test_a_killed_coordinator_ends_the_other_process(runs):
    # Process 0 holds jax's coordination service: when it dies, jaxlib ends
    # process 1 at once with its own fatal error (SIGABRT; no Python runs),
    # within the launch's timeout, not after the heartbeat timeout's wait.
    (rc0, _, _), (rc1, err1, t1) = runs["coordinator"]
    assert rc0 == -signal.SIGKILL
    assert rc1 == -signal.SIGABRT and t1 is not None, err1[-3000:]
    assert "JAX distributed service detected fatal errors" in err1, err1[-3000:]
    assert "stopped sending heartbeats" not in err1, err1[-3000:]


def test_checkpoints_restore_across_process_counts(runs):
    # 2 processes x 2 devices -> 1 process x 4 devices, and the reverse:
    # resumed at step 4 from the other layout's checkpoint, both finish on
    # the uninterrupted run's trajectory.
    out = runs["resume/out"]
    one = _read(out, "single_0.json")
    done = [("single", 0)] + [("resume", pid) for pid in (0, 1)]
    for mode, pid in done:
        got = _read(out, f"{mode}_{pid}.json")["across"]
        assert got["steps"] == list(range(RESUME_AT, STEPS))
        assert got["finite"] == one["finite"][RESUME_AT:]
        assert got["loss_scale"] == one["loss_scale"][RESUME_AT:]
        assert got["final_scale"] == one["final_scale"]
        np.testing.assert_allclose(got["loss"], one["loss"][RESUME_AT:], rtol=1e-6)
        for k, v in one["params"].items():
            np.testing.assert_allclose(got["params"][k], v, rtol=0, atol=1e-6)
        assert got["replicas_identical"] is True


def test_a_raising_process_stops_the_other_with_its_error(runs):
    (rc0, err0, t0), (rc1, err1, t1) = runs["resume"]
    # Both status 1: process 1 with its traceback (it skips jax's shutdown
    # barrier, which process 0 can no longer join), process 0 with its error.
    assert rc1 == 1 and t1 is not None, err1[-3000:]
    assert "ValueError: process 1 cannot read batch 2" in err1
    assert rc0 == 1 and t0 is not None, err0[-2000:]
    assert f"process 1 raised at step {RAISE_AT}" in err0
    assert "ValueError: process 1 cannot read batch 2" in err0


def test_nan_policy_stop_raises_on_every_process(runs):
    out = runs["resume/out"]
    for pid in (0, 1):
        step, message = _read(out, f"resume_{pid}.json")["stop"]
        assert step == 3
        # The gradient report and the batch report are of the global values
        # (process 1's rows hold the NaN, w1 is split over the processes).
        assert "non-finite gradients at loss_scale=" in message
        assert "['w1']" in message and "non-finite batch inputs" in message


def test_processes_with_different_states_or_settings_are_refused(runs):
    out = runs["resume/out"]
    for pid in (0, 1):
        got = _read(out, f"resume_{pid}.json")
        assert (
            "every process must pass the same checkpoint_dir" in (got["process_0_only"])
        )
        assert "the processes passed different states" in got["refused"]
        assert "['w']" in got["refused"]
        assert got["differ_identical"] is False


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:5]))
