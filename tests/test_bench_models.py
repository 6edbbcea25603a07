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


def test_a_run_of_one_framework_keeps_the_other_frameworks_rows(tmp_path):
    # The results are written after every row (a GPU lease may stop a
    # run): a model's batches not measured yet, and the other framework's
    # numbers of those measured, stay as the last run left them.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_models
    finally:
        sys.path.pop(0)

    def row(batch, fw):
        other = "torch" if fw == "jax" else "jax"
        return {
            "model": "resnet18",
            "batch": batch,
            fw: {"v": fw},
            other: {},
            "ratios": {fw: {"adamw": fw}, other: {}},
            "measured": {fw: "then"},
        }

    old = {
        "device": {"date": "then"},
        "models": {"resnet18": {"params": 1}},
        "rows": [row(2, "jax"), row(16, "jax")],
    }
    path = tmp_path / "bench_models_cpu.json"
    path.write_text(json.dumps(old))
    new = {
        "device": {},
        "models": {"resnet18": {"params": 1}},
        "rows": [row(2, "torch")],
    }
    bench_models.merge_previous(new, path, "torch")
    got = {r["batch"]: r for r in new["rows"]}
    assert sorted(got) == [2, 16]  # batch 16 not measured yet: kept
    assert got[2]["jax"] == {"v": "jax"} and got[2]["torch"] == {"v": "torch"}
    assert got[16]["jax"] == {"v": "jax"}
