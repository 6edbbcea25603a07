"""The library's import graph has no circle: arrows point one way.

Read from the source (ast, nothing imported) over `jaxstable`, `torchref` and
`_stablecore`, their `_src` trees and public modules alike; an import inside a
function counts (it runs when the function does), so a circle cannot hide
behind a lazy import.
"""

from __future__ import annotations

import pytest

from tests import import_graph

PACKAGES = ("jaxstable", "torchref", "_stablecore")


def _sources():
    for package in PACKAGES:
        for path in (import_graph.ROOT / package).rglob("*.py"):
            if "tests" not in path.relative_to(import_graph.ROOT).parts:
                yield path


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph.graph(_sources())


def test_the_graph_is_found(graph):
    assert "jaxstable._src.update_check" in graph["jaxstable._src.step"]
    assert "torchref._src.guard_step" in graph["torchref._src.step"]
    assert "_stablecore.checks" in graph["torchref._src.spikes"]


def test_the_import_graph_has_no_circle(graph):
    found = import_graph.cycle(graph)
    assert found is None, " -> ".join(found)


def test_a_lazy_import_counts(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from . import a\n")
    monkeypatch.setattr(import_graph, "ROOT", tmp_path)
    lazy = import_graph.graph((tmp_path / "pkg").glob("*.py"))
    assert import_graph.cycle(lazy) == ["pkg.a", "pkg.b", "pkg.a"]
