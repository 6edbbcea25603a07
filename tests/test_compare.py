"""`examples/compare.py segmentation --quick`: the six runs and their outputs."""

import contextlib
import dataclasses
import importlib.metadata
import io
import json
import math
import os
import platform
import shutil
import subprocess
import sys

import pytest

from examples import compare, harness
from examples.harness import environment
from examples.segmentation.task import TASK

# end-to-end runs: queued first, compiled with fewer XLA optimisations
# (conftest.py); the runs fail at the same steps from the same causes
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fewer_xla_optimizations")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_KEYS = {
    "framework", "precision", "mode", "steps", "first_nonfinite_step",
    "final_loss", "skipped_total", "miou", "steps_per_s", "location",
}  # fmt: skip
LOCATION_KEYS = {"step", "phase", "path", "op", "detail"}
LINE_KEYS = {
    "framework", "precision", "mode", "step", "loss", "grad_norm",
    "loss_scale", "finite", "skipped_total", "time_s",
}  # fmt: skip


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """The output folder of one quick comparison and what it printed."""
    path = tmp_path_factory.mktemp("compare")
    argv = ["segmentation", "--quick", "--no-progress", "--out", str(path)]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert compare.main(argv) == 0
    return path, printed.getvalue()


@pytest.fixture(scope="module")
def out(quick_run):
    return quick_run[0]


def test_summary_has_six_well_formed_runs(out):
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert len(runs) == 6 and all(set(r) == RUN_KEYS for r in runs)
    plan = {(r["framework"], r["precision"], r["mode"]) for r in runs}
    assert plan == {
        (fw, p, m)
        for fw in ("jax", "torch")
        for p, m in (("float32", "stable"), ("float16", "naive"), ("float16", "stable"))
    }
    for r in runs:
        if r["mode"] == "naive":  # a real failure: Adam's state in float16
            assert r["first_nonfinite_step"] == 0 and r["final_loss"] is None
            # diagnostics.locate of that step: finite gradients, m / 0 in Adam
            loc = r["location"]
            assert set(loc) == LOCATION_KEYS and loc["step"] == 0, loc
            assert loc["phase"] == "update" and "eps is 0 in float16" in loc["detail"]
        else:
            assert r["first_nonfinite_step"] is None
            assert r["location"] is None or set(r["location"]) == LOCATION_KEYS
            assert r["steps"] == TASK.quick["steps"]
            assert 0.0 <= r["miou"] <= 1.0 and r["final_loss"] > 0
    # both frameworks name the same phase and the same parameter
    naive = [r["location"] for r in runs if r["mode"] == "naive"]
    assert len({(loc["phase"], loc["path"]) for loc in naive}) == 1, naive
    assert 0.0 <= summary["fp32_agreement"] <= harness.FP32_AGREEMENT_LIMIT
    assert summary["task"] == "segmentation" and summary["metrics"] == ["miou"]


def test_summary_records_the_installed_versions_and_the_machine(quick_run):
    """The versions are the installed ones (not a copy of a string), the
    devices the ones this process ran on; report.md and the printout show
    the record's line once each."""
    import jax

    out, printed = quick_run
    env = json.loads((out / "summary.json").read_text())["environment"]
    assert set(env["packages"]) == set(environment.PACKAGES)
    for name, version in env["packages"].items():
        assert version == importlib.metadata.version(name), name  # all installed
    assert env["python"] == platform.python_version()
    assert env["jax_backend"] == jax.default_backend()
    assert env["jax_device_count"] == jax.device_count()
    assert env["jax_device_kind"] == jax.devices()[0].device_kind
    assert env["torch_device"] == "cpu" and env["cpu_count"] == os.cpu_count()
    assert env["cpu"] == environment.cpu_name()
    if shutil.which("git") is not None:
        head = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        assert env["git_commit"] == (head or None)
        assert isinstance(env["git_dirty"], bool) or env["git_commit"] is None
    line = environment.describe(env)
    assert f"jax {importlib.metadata.version('jax')}, " in line
    assert f"torch {importlib.metadata.version('torch')}, " in line
    report = (out / "report.md").read_text()
    assert report.count("Environment: ") == 1 and f"Environment: {line}." in report
    assert printed.count("environment: ") == 1 and f"environment: {line}\n" in printed


def test_metrics_jsonl_has_one_line_per_run_step(out):
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # strict JSON: no NaN
    # fit's guarded steps also say whether their gradients were finite, and
    # a skipped step why and (the first one) where, and whether it
    # reproduced on locate's re-run; the naive steps do not.
    optional = {"grads_finite", "skip_reason", "location", "reproduced"}
    assert all(LINE_KEYS <= set(r) <= LINE_KEYS | optional for r in records)
    assert all(("grads_finite" in r) == (r["mode"] == "stable") for r in records)
    assert all(r["time_s"] > 0 for r in records)  # fit's time_steps
    summary = json.loads((out / "summary.json").read_text())
    assert len(records) == sum(r["steps"] for r in summary["runs"])
    naive = [r for r in records if r["mode"] == "naive" and r["framework"] == "jax"]
    assert naive[0]["finite"] is False and naive[0]["loss"] is not None
    assert naive[1]["loss"] is None  # NaN weights -> NaN loss, written as null


def test_report_and_plot_are_written(out):
    report = (out / "report.md").read_text()
    assert "| framework | precision | mode |" in report
    assert "![curves](curves.png)" in report
    assert "nu == 0 for" in report  # the observed mechanism, with numbers
    for fw in ("jax", "torch"):  # where locate says it started, above the table
        section = report.split(f"first non-finite step: {fw} float16 naive")[1]
        where = section.index("non-finite value first in phase 'update' at ")
        assert section.index("```text") < where < section.index("non-finite after")
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_cli_rejects_unknown_precision():
    proc = subprocess.run(
        [sys.executable, "examples/compare.py", "segmentation", "--precision", "fp8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and "invalid choice: 'fp8'" in proc.stderr


def test_fp32_agreement_is_undefined_not_zero_for_broken_runs():
    """A NaN or zero loss, or a run that stopped early, must never read as
    agreement (max(0.0, nan) is 0.0 in Python)."""
    cfg = TASK.get_config(steps=3)

    def run(framework, losses):
        return harness.RunResult(
            framework, cfg, [{"loss": x} for x in losses], None, losses[-1], 0,
            {"miou": 0.5}, 1.0,
        )  # fmt: skip

    good = run("torch", [1.0, 0.5, 0.25])
    assert harness.fp32_agreement([run("jax", [1.0, 0.5, 0.25]), good]) == 0.0
    for bad in ([1.0, float("nan"), 0.25], [1.0, float("inf"), 0.25], [1.0, 0.5]):
        assert math.isnan(harness.fp32_agreement([run("jax", bad), good])), bad
    zero = run("torch", [1.0, 0.0, 0.25])
    assert math.isnan(harness.fp32_agreement([run("jax", [1.0, 0.0, 0.25]), zero]))


def test_gradient_agreement_flag_compares_gradients_at_the_same_weights(capsys):
    argv = ["segmentation", "--quick", "--gradient-agreement"]
    assert compare.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["task"] == "segmentation" and out["split"] is None
    assert out["steps"] == min(harness.AGREEMENT_STEPS, TASK.quick["steps"])
    assert 0 < out["max_relative_difference"] < 1e-4


def test_gradient_agreement_finds_a_real_difference():
    # torch's loss weighted 1.01x: the gradients at the same weights differ
    # by 1e-2 on the first step, and the split names it
    def heavier_parts(config, weights):
        parts = TASK.torch_parts(config, weights)
        loss_fn = parts.loss_fn

        def heavier(model, batch):
            loss = loss_fn(model, batch)
            if isinstance(loss, tuple):
                return (1.01 * loss[0], *loss[1:])
            return 1.01 * loss

        parts.loss_fn = heavier
        return parts

    heavier_task = dataclasses.replace(TASK, torch_parts=heavier_parts)
    cfg = TASK.get_config(**TASK.quick)
    out = harness.gradient_agreement(heavier_task, cfg, 2)
    assert out["steps"] == 1 and out["split"]["step"] == 0
    assert out["split"]["relative_difference"] == pytest.approx(1 / 101, rel=1e-3)


def test_gradient_agreement_refuses_low_precision_and_several_devices():
    cfg = TASK.get_config(**TASK.quick).replace(precision="float16")
    with pytest.raises(ValueError, match="float32 stable"):
        harness.gradient_agreement(TASK, cfg, 2)
    with pytest.raises(SystemExit):
        compare.main(["segmentation", "--gradient-agreement", "--devices", "2"])
