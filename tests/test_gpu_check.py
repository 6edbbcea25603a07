"""`make gpu-check` refuses cleanly without a GPU, and the GPU benchmark's code
paths run on a CPU at toy sizes (its numbers mean nothing there)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HAS_GPU

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_gpu_check_without_a_gpu_exits_non_zero_and_runs_nothing():
    results = ROOT / "benchmarks" / "results"
    before = sorted(p.name for p in results.iterdir())
    out = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "nothing was run" in out.stderr
    assert sorted(p.name for p in results.iterdir()) == before


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_bench_gpu_refuses_cuda_without_one(tmp_path):
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_gpu.py", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "nothing was run" in out.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_bench_gpu_code_paths_run_on_cpu_at_toy_sizes(tmp_path):
    cmd = [sys.executable, "benchmarks/bench_gpu.py", "--device", "cpu", "--tiny"]
    cmd += ["--reps", "1", "--no-compile", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, timeout=600, cwd=ROOT, env=env, capture_output=True)
    payload = json.loads((tmp_path / "bench_gpu_cpu_smoke.json").read_text())
    assert {r["dtype"] for r in payload["cross_entropy"]} == {"bfloat16", "float16"}
    for row in payload["cross_entropy"]:
        assert set(row["median_s"]) == {
            "ours",
            "ours_xla",
            "naive_optax",
            "torch_float",
        }
        assert all(v > 0 for v in row["median_s"].values())
    steps = {r["dtype"]: r for r in payload["train_step"]}
    assert set(steps) == {"float16", "bfloat16"}
    assert (
        "Guarded segmentation step" in (tmp_path / "bench_gpu_cpu_smoke.md").read_text()
    )
