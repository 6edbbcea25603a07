"""`benchmarks/bench_models.py --quick` runs and writes its table (torch rows
only: one XLA compile of a guarded step costs more than this suite allows a
test; the JAX rows run in the benchmark itself). Its numbers mean nothing at
these sizes."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_models_quick_writes_torch_ratios_and_peak_memory(tmp_path):
    cmd = [sys.executable, "benchmarks/bench_models.py", "--quick", "--only", "torch"]
    cmd += ["--models", "vit_small", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, timeout=300, cwd=ROOT, capture_output=True)
    payload = json.loads((tmp_path / "bench_models_cpu_quick.json").read_text())
    assert payload["device"]["git_commit"] and payload["device"]["cpu"]
    (row,) = payload["rows"]
    params = payload["models"]["vit_small"]["params"]
    for variant in ("recipe", "trainstep"):
        v = row["torch"][f"torch/adamw_foreach/{variant}"]
        assert v["median_ms"] > 0
        # The profiler saw the variant's own allocations: at least its float32
        # parameters, their gradients and AdamW's two moments.
        assert v["peak_bytes"] >= 4 * 4 * params
    assert row["ratios"]["torch"]["adamw_foreach"]["time"] > 0
    md = (tmp_path / "bench_models_cpu_quick.md").read_text()
    assert "one machine" in md and "| vit_small | 2 | adamw_foreach |" in md
