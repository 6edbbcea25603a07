"""`examples.harness.environment`: what ``summary.json`` says about a run's
software and machine (the full record of a real run: tests/test_compare.py)."""

import importlib.metadata
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from examples.harness import environment

ROOT = pathlib.Path(__file__).resolve().parents[1]


class _RefuseTorch:
    """A meta path finder that fails the test if anything imports torch."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise AssertionError(f"the record imported {name}")
        return None


def test_a_missing_package_is_null_and_torch_is_not_imported(monkeypatch):
    """A JAX-only process: torch's version comes from its metadata, its
    device is null, and torch stays unimported; a package not installed
    is null, not an error."""
    monkeypatch.setattr(environment, "PACKAGES", ("torch", "numpy", "no-such-dist"))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_RefuseTorch(), *sys.meta_path])
    env = environment.record()
    assert env["packages"] == {
        "torch": importlib.metadata.version("torch"),
        "numpy": importlib.metadata.version("numpy"),
        "no-such-dist": None,
    }
    assert env["torch_device"] is None and "torch" not in sys.modules
    line = environment.describe(env)
    assert "no-such-dist not installed" in line and "torch on" not in line
    json.dumps(env, allow_nan=False)  # strict JSON, as summary.json is written


def test_no_git_gives_null_not_a_failure(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no git
    assert environment.git_state() == (None, None)
    env = environment.record()
    assert env["git_commit"] is None and env["git_dirty"] is None
    assert "git commit unknown" in environment.describe(env)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_dirty_means_changed_code_not_results_or_untracked_files(tmp_path):
    def git(*args):
        subprocess.run(
            ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t",
             *args], check=True, capture_output=True,
        )  # fmt: skip

    (tmp_path / "results").mkdir()
    for name in ("code.py", "results/summary.json"):
        (tmp_path / name).write_text("1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    commit, dirty = environment.git_state(tmp_path)
    assert len(commit) == 40 and dirty is False
    (tmp_path / "results" / "summary.json").write_text("2\n")  # a new run's output
    (tmp_path / "scratch.py").write_text("")  # untracked
    assert environment.git_state(tmp_path) == (commit, False)
    (tmp_path / "code.py").write_text("2\n")
    assert environment.git_state(tmp_path) == (commit, True)


def test_committed_summaries_are_readable_with_or_without_the_record():
    """Runs committed before the record existed have no ``environment``:
    their line says so instead of failing."""
    summaries = sorted(ROOT.glob("examples/*/results/summary.json"))
    assert summaries
    for path in summaries:
        env = json.loads(path.read_text()).get("environment")
        line = environment.describe(env)
        assert ("not recorded" in line) == (env is None), path
