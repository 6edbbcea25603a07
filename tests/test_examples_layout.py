"""The house rules of `examples/`, read from the source (ast, nothing imported).

* the import graph has no cycle;
* no task imports another task; the harness and the shared parts
  (`examples.common`) import no task: arrows point from tasks to them;
* no file of `examples/harness/` is over 400 lines;
* every task has the same files, and its ``config.py`` holds values only;
* the committed reports name the command a user types, not a scratch folder.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from tests import import_graph

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TASKS = sorted(p.parent.name for p in EXAMPLES.glob("*/task.py"))
TASK_FILES = (
    "README.md", "config.py", "convert.py", "data.py", "loss_jax.py",
    "loss_torch.py", "metric.py", "model_jax.py", "model_torch.py",
    "parts_jax.py", "parts_torch.py", "task.py",
)  # fmt: skip
MAX_HARNESS_LINES = 400


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph.graph(EXAMPLES.rglob("*.py"))


_cycle = import_graph.cycle


def _owner(module: str) -> str | None:
    """The task a module belongs to, or None (harness, common, the CLI)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in TASKS else None


def test_the_tasks_and_the_graph_are_found(graph):
    assert TASKS == ["contrastive", "detection", "lm", "ocr", "segmentation"]
    assert "examples.harness.ddp" in graph["examples.harness.run"]
    assert "examples.common.convert" in graph["examples.ocr.convert"]


def test_the_import_graph_has_no_cycle(graph):
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_task_imports_another_and_the_shared_parts_import_none(graph):
    bad = []
    for module, targets in graph.items():
        owner = _owner(module)
        for target in targets:
            if _owner(target) is not None and _owner(target) != owner:
                bad.append(f"{module} imports {target}")
    assert not bad, bad


@pytest.mark.parametrize("path", sorted((EXAMPLES / "harness").glob("*.py")))
def test_no_harness_file_is_over_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_HARNESS_LINES, f"{path.name}: {lines} lines"


@pytest.mark.parametrize("task", TASKS)
def test_every_task_has_the_same_layout(task):
    missing = [f for f in TASK_FILES if not (EXAMPLES / task / f).is_file()]
    assert not missing, (task, missing)


@pytest.mark.parametrize("task", TASKS)
def test_a_task_config_holds_values_only(task):
    """Imports, one dataclass of annotated fields with defaults, nothing else:
    checks and data plumbing live in task.py (flax's configs are values)."""
    tree = ast.parse((EXAMPLES / task / "config.py").read_text())
    body = [n for n in tree.body if not isinstance(n, ast.Import | ast.ImportFrom)]
    if body and isinstance(body[0], ast.Expr):  # the module docstring
        body = body[1:]
    assert [type(n).__name__ for n in body] == ["ClassDef"], task
    fields = body[0].body[1:]  # after the class docstring
    for node in fields:
        assert isinstance(node, ast.AnnAssign) and node.value is not None, (
            task,
            ast.unparse(node)[:60],
        )


def test_committed_reports_name_the_command_a_user_types():
    reports = sorted(EXAMPLES.glob("*/results/report.md"))
    assert len(reports) == len(TASKS)
    for report in reports:
        line = next(
            x for x in report.read_text().splitlines() if x.startswith("Command:")
        )
        command = re.search(r"`([^`]*)`", line).group(1)
        assert command.startswith("python examples/compare.py "), (report, command)
        assert "--out" not in command and "--no-progress" not in command, command
