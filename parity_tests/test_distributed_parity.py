"""Multi-process JAX (`jax.distributed`, gloo on CPU) against torch DDP.

The problem of `jaxstable/tests/test_distributed.py` and `torchref/tests/
test_distributed.py` (the same MLP weights, 56 global batches, NaN/inf
inputs, one of them in a single rank's rows) is trained

* by JAX in 2 processes of 1 CPU device each, started here with
  ``jax.distributed.initialize`` on 127.0.0.1 (the worker is this file run
  as ``python -m parity_tests.test_distributed_parity PID PORT OUT``), data
  parallel and FSDP on the 2-device global mesh;
* by torch in 2 DDP processes (gloo), and in one process;
* by JAX on one device.

All four agree after every step: params to the float32 trajectory
tolerance, ``loss_scale``, ``skipped_total``, ``finite`` exactly. Every
process is bounded by a timeout and killed in a ``finally``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

WORLD = 2
TIMEOUT_S = 120
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALARS = ("loss_scale", "skipped_total", "finite", "grads_finite")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jax_worker(pid: int, port: int, out: str) -> None:
    import jax

    # Before any JAX backend starts (conftest, imported by the test module
    # below, lists the devices).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}",
        num_processes=WORLD,
        process_id=pid,
        initialization_timeout=TIMEOUT_S // 2,
        shutdown_timeout_seconds=30,
    )
    from jax.experimental import multihost_utils

    from jaxstable import distributed, train
    from jaxstable.tests.test_distributed import initial_state, mlp_loss, problem

    assert jax.process_count() == WORLD and jax.device_count() == WORLD
    params, batches = problem()
    mesh = distributed.make_mesh()
    results = {}
    for strategy in distributed.STRATEGIES:
        state = distributed.shard_state(initial_state(params), mesh, strategy)
        step = train.make_train_step(mlp_loss)
        rec = {k: [] for k in ("params", *SCALARS)}
        for batch in batches:
            state, m = step(state, distributed.shard_batch(batch, mesh))
            # A collective: gathers FSDP's shards from both processes.
            full = multihost_utils.process_allgather(state.params, tiled=True)
            rec["params"].append(
                np.concatenate([np.ravel(full[k]) for k in ("w1", "b1", "w2", "b2")])
            )
            # Replicated scalars: this process's copy.
            local = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), m)
            rec["loss_scale"].append(_scale(state))
            for key in ("skipped_total", "finite", "grads_finite"):
                rec[key].append(local[key])
        results.update({f"{strategy}/{k}": np.asarray(v) for k, v in rec.items()})
    np.savez(out, **results)
    jax.distributed.shutdown()


def _scale(state) -> float:
    return float(state.loss_scale.loss_scale.addressable_data(0))


def _launch_jax(tmp_path) -> list[dict]:
    port = _free_port()
    # Keep the caller's PYTHONPATH after ROOT: on the GPU machine jmp and the
    # other carried wheels are found only through it.
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    outs = [tmp_path / f"jax{pid}.npz" for pid in range(WORLD)]
    procs = []
    try:
        for pid in range(WORLD):
            cmd = [sys.executable, "-m", "parity_tests.test_distributed_parity"]
            procs.append(
                subprocess.Popen(
                    [*cmd, str(pid), str(port), str(outs[pid])],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
        for pid, (p, log) in enumerate(zip(procs, logs, strict=True)):
            assert p.returncode == 0, f"JAX process {pid} failed:\n{log[-3000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    runs = []
    for out in outs:
        with np.load(out) as f:
            runs.append({k: f[k] for k in f.files})
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from jaxstable import distributed as jdist
    from jaxstable.tests import test_distributed as jtest
    from torchref.tests import test_distributed as ttest

    params, batches = jtest.problem()
    tparams, tbatches = ttest.problem()
    # The two test modules state the same problem.
    for k in params:
        np.testing.assert_array_equal(params[k], tparams[k])
    for b, tb in zip(batches, tbatches, strict=True):
        np.testing.assert_array_equal(b[0], tb[0])
        np.testing.assert_array_equal(b[1], tb[1])
    jax_one, *_ = jtest.run_trajectory(None, None, params, batches)
    jax_multi = _launch_jax(tmp_path_factory.mktemp("jaxdist"))
    torch_ddp = ttest.launch(
        ttest.run_trajectory, WORLD, "data_parallel", params, batches
    )
    out = {
        "jax 1 device": jax_one,
        "torch 1 process": ttest.run_trajectory(None, params, batches),
    }
    for pid, run in enumerate(jax_multi):
        for s in jdist.STRATEGIES:
            out[f"jax.distributed {s} process {pid}"] = {
                k.split("/", 1)[1]: v for k, v in run.items() if k.startswith(s)
            }
    for rank, run in enumerate(torch_ddp):
        out[f"torch DDP rank {rank}"] = run
    return out


def test_every_run_agrees_with_every_other(runs):
    from conftest import tolerance

    ref = runs["jax 1 device"]
    assert (~ref["finite"]).sum() == 4  # the 4 poisoned batches are skipped
    assert len(runs) == 2 + 2 * 2 + 2
    for name, got in runs.items():
        for key in SCALARS:
            np.testing.assert_array_equal(got[key], ref[key], err_msg=f"{name} {key}")
        np.testing.assert_allclose(
            got["params"],
            ref["params"],
            **tolerance("float32_trajectory"),
            err_msg=name,
        )


def test_jax_processes_hold_identical_state(runs):
    for s in ("data_parallel", "fsdp"):
        a, b = (runs[f"jax.distributed {s} process {p}"] for p in range(WORLD))
        for key in ("params", *SCALARS):
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{s} {key}")


if __name__ == "__main__":
    _jax_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
