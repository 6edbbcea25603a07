"""The README's self-contained code blocks run as written.

A block marked ``<!-- test: run -->`` on the line before its opening fence
is executed; when it prints, what it prints must equal the ``# `` comment
lines that follow the print call, or its inline comment (its documented output).
"""

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"<!-- test: run -->\n```python\n(.*?)\n```", re.S)


def _blocks():
    return BLOCK.findall(README.read_text())


def _documented_output(code: str) -> str:
    """The comment on the first `print(` line, or the `# ` lines after it."""
    lines = code.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("print("):
            if "  # " in line:
                return line.split("  # ", 1)[1]
            out = []
            for nxt in lines[i + 1 :]:
                if not nxt.startswith("# "):
                    break
                out.append(nxt[2:])
            return "\n".join(out)
    return ""


def test_readme_has_runnable_blocks():
    assert len(_blocks()) >= 3


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_block_runs(index):
    code = _blocks()[index]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(code, f"README.md block {index}", "exec"), {})
    expected = _documented_output(code)
    if expected:
        printed = "\n".join(line.rstrip() for line in stdout.getvalue().splitlines())
        assert printed.startswith(expected), (printed, expected)
