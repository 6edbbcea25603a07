"""The import graph of a set of source trees, read with ast (nothing imported).

Shared by the layout tests of the library (`tests/test_import_graph.py`) and of
`examples/` (`tests/test_examples_layout.py`): an import anywhere in a file
counts, a function's lazy import included (it runs when the function does).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(paths) -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(paths)}


def imports(path: pathlib.Path, name: str, modules) -> set[str]:
    """The modules of `modules` that `path` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` up
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def graph(paths) -> dict[str, set[str]]:
    """Module -> the modules among `paths` it imports."""
    found = modules(paths)
    return {name: imports(path, name, found) for name, path in found.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a closed path (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None
