"""Kill-and-resume: a run SIGKILLed at random points (and once inside a
checkpoint write), re-run with the same command, ends bitwise equal to the
same run uninterrupted, in both frameworks, in float32 (rolling back on its
NaN batch to an older snapshot, which the checkpoints carry) and with float16
compute and a moving loss scale; its JSONL log has every step once.

The runs are `parity_tests.resume_worker` (a tiny MLP, 24 steps per config,
a checkpoint every 4); the uninterrupted reference runs in this process.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import serialization

from parity_tests import resume_worker as worker

# killed and resumed processes: queued first, compiled with fewer XLA
# optimisations (conftest.py; the workers inherit it, so the reference run
# of this process and theirs still compile alike and compare bitwise)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fewer_xla_optimizations")]

ROOT = Path(__file__).resolve().parents[1]
# The kills, in order: ("lines", seed) once the logs have a random number of
# lines more (a random point of the runs); ("save", None) inside the commit
# of the first checkpoint the process writes.
KILLS = [("lines", 0), ("save", None), ("lines", 1)]
TIMEOUT_S = 120  # per process; a run takes ~5 s (JAX start-up) on 2 cores


def _lines(folder: Path) -> int:
    """Lines in the logs of all configs (the ones of a finished step)."""
    logs = [folder / c / "log.jsonl" for c in worker.CONFIGS]
    return sum(p.read_bytes().count(b"\n") for p in logs if p.exists())


def _start(framework, folder, hang=False):
    args = [sys.executable, "-m", "parity_tests.resume_worker"]
    args += [framework, str(folder)] + (["--hang-in-save"] if hang else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def _kill_when(proc, ready) -> bool:
    """SIGKILLs `proc` once `ready()`; False if it ended first."""
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ready():
            if proc.poll() is not None:
                return False
            assert time.monotonic() < deadline, "worker hung"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        return True
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(TIMEOUT_S)


def _interrupted_run(framework, folder: Path) -> tuple[int, dict]:
    """Runs the worker to the end with the KILLS; returns how many landed and
    the paths of the killed commit (``src`` renamed onto ``dst``)."""
    marker = folder / "in_save"
    landed = 0
    for kind, seed in KILLS:
        if kind == "lines":
            target = _lines(folder) + random.Random(seed).randint(2, 10)
            proc = _start(framework, folder)
            landed += _kill_when(proc, lambda t=target: _lines(folder) >= t)
        else:
            marker.unlink(missing_ok=True)
            proc = _start(framework, folder, hang=True)
            landed += _kill_when(proc, marker.exists)
            # Killed mid-commit: the complete write lies under its temporary
            # name (orbax's directory, torch's file), the step is not there.
            killed = json.loads(marker.read_text())
            assert Path(killed["src"]).exists(), killed
            assert not Path(killed["dst"]).exists(), killed
    proc = _start(framework, folder)
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err.decode()[-3000:]
    return landed, killed


def _final(framework, folder: Path, template):
    """The final state of the worker's run, from its last checkpoint."""
    if framework == "jax":
        from jaxstable import train

        return train.load_checkpoint(
            folder / "ck" / f"step_{worker.STEPS:08d}", template
        )
    from torchref import train

    return train.load_checkpoint(
        folder / "ck" / f"step_{worker.STEPS:08d}.pt", template
    )


def _flat(framework, state) -> dict:
    if framework == "jax":
        tree = serialization.to_state_dict(jax.device_get(state))
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
    out = {}

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}/{k}")
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                walk(v, f"{path}/{i}")
        elif isinstance(x, torch.Tensor):
            out[path] = x.detach().numpy()
        else:
            out[path] = np.asarray(x)

    walk(state.state_dict(), "")
    return out


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_killed_runs_resume_bitwise(tmp_path, framework):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    references = worker.run_all(framework, str(ref_dir))
    run_dir.mkdir()
    landed, killed = _interrupted_run(framework, run_dir)
    assert landed == len(KILLS), "a kill came after the runs ended"
    # The resumed runs removed the killed write (they redid that step).
    assert not Path(killed["src"]).exists(), killed
    for config in worker.CONFIGS:
        _check_same_run(
            framework, config, references[config], ref_dir / config, run_dir / config
        )


def _check_same_run(framework, config, reference, ref_dir, run_dir):
    template = worker.build(framework, config)  # overwritten by the load
    resumed = _flat(framework, _final(framework, run_dir, template))
    expected = _flat(framework, reference)
    assert resumed.keys() == expected.keys()
    for key, value in expected.items():
        assert value.dtype == resumed[key].dtype, (config, key)
        assert value.tobytes() == resumed[key].tobytes(), (config, key)  # bitwise

    ref_log = (ref_dir / "log.jsonl").read_text().splitlines()
    run_log = (run_dir / "log.jsonl").read_text().splitlines()
    assert run_log == ref_log, config  # every step once, the same records
    scales = [float(line.split('"loss_scale": ')[1].split(",")[0]) for line in ref_log]
    moves = {np.sign(b - a) for a, b in itertools.pairwise(scales)}
    assert {-1.0, 1.0} <= moves  # the loss scale grew and backed off
    assert '"finite": false' in "".join(ref_log)  # and steps were skipped
    if worker.POLICY[config]:
        assert '"rolled_back": true' in "".join(ref_log)
    # No orphan temporary file or directory after the resumed run.
    assert not [p for p in (run_dir / "ck").iterdir() if "tmp" in p.name]
