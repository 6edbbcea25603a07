"""The README's and the docs guides' self-contained code blocks run as written.

A block marked ``<!-- test: run -->`` on the line before its opening fence
is executed; every print call followed by its documented output (an inline
``# `` comment, or the ``# `` comment lines after the call) must print that,
in order. The README's relative links point at files that exist.
"""

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- test: run -->\n```python\n(.*?)\n```", re.S)
# [text](target): a Markdown link; the README's images use the same form.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


def _all_blocks() -> list[tuple[str, int]]:
    pages = [README, *sorted((ROOT / "docs").glob("**/*.md"))]
    return [
        (str(page.relative_to(ROOT)), i)
        for page in pages
        for i in range(len(_blocks(page)))
    ]


def _documented_outputs(code: str) -> list[str]:
    """Per `print(` line with one: its inline comment, or the `# ` lines after it."""
    lines = code.splitlines()
    outputs = []
    for i, line in enumerate(lines):
        if not line.startswith("print("):
            continue
        if "  # " in line:
            outputs.append(line.split("  # ", 1)[1])
            continue
        out = []
        for nxt in lines[i + 1 :]:
            if not nxt.startswith("# "):
                break
            out.append(nxt[2:])
        if out:
            outputs.append("\n".join(out))
    return outputs


def _printed_in_order(printed: str, expected: list[str]) -> bool:
    """Each expected chunk starts a printed line, after the previous chunk."""
    rest = printed
    for chunk in expected:
        at = ("\n" + rest).find("\n" + chunk)
        if at < 0:
            return False
        rest = rest[at + len(chunk) :]
    return True


def test_readme_has_runnable_blocks():
    assert len(_blocks(README)) >= 3


def test_documented_outputs_are_checked_in_order():
    code = 'print(1)  # 1\nx = 2\nprint("a\\nb")\n# a\n# b\nprint(3)'
    assert _documented_outputs(code) == ["1", "a\nb"]
    assert _printed_in_order("1\na\nb\n3", ["1", "a\nb"])
    assert not _printed_in_order("1\na\nc\n3", ["1", "a\nb"])
    assert not _printed_in_order("a\nb\n1", ["1", "a\nb"])  # order matters


def test_readme_links_point_at_files():
    missing = []
    for target in LINK.findall(README.read_text()):
        if "://" in target or target.startswith("#"):
            continue
        if not (ROOT / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"README.md links to missing files: {missing}"


@pytest.mark.parametrize(("page", "index"), _all_blocks())
def test_block_runs(page, index):
    code = _blocks(ROOT / page)[index]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(code, f"{page} block {index}", "exec"), {})
    printed = "\n".join(line.rstrip() for line in stdout.getvalue().splitlines())
    expected = _documented_outputs(code)
    assert _printed_in_order(printed, expected), (printed, expected)
