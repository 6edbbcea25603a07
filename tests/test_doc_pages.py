"""The runnable blocks of docs/nnx.md, docs/accumulation.md and
docs/first_hour.md run as written and print what their comments say.

The same ``<!-- test: run -->`` convention as tests/test_readme.py; once
that file runs the blocks of every docs/ page itself, this one steps aside
(skips) so that no block runs twice.
"""

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("docs/nnx.md", "docs/accumulation.md", "docs/first_hour.md")
BLOCK = re.compile(r"<!-- test: run -->\n```python\n(.*?)\n```", re.S)
_COVERED = "docs" in (ROOT / "tests" / "test_readme.py").read_text()


def _outputs(code: str) -> list[str]:
    """Per ``print(`` line: its inline ``  # `` comment, or the ``# `` lines after."""
    lines, out = code.splitlines(), []
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("print("):
            continue
        if "  # " in line:
            out.append(line.split("  # ", 1)[1])
            continue
        after = []
        for nxt in lines[i + 1 :]:
            if not nxt.startswith("# "):
                break
            after.append(nxt[2:])
        if after:
            out.append("\n".join(after))
    return out


@pytest.mark.skipif(_COVERED, reason="tests/test_readme.py runs the docs/ blocks")
@pytest.mark.parametrize("page", PAGES)
def test_page_blocks_run_and_print_what_they_say(page):
    blocks = BLOCK.findall((ROOT / page).read_text())
    assert blocks, f"{page} has no runnable block"
    for i, code in enumerate(blocks):
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            exec(compile(code, f"{page} block {i}", "exec"), {})
        printed = "\n".join(x.rstrip() for x in stdout.getvalue().splitlines())
        rest = "\n" + printed
        for chunk in _outputs(code):
            at = rest.find("\n" + chunk)
            assert at >= 0, (page, i, printed, chunk)
            rest = rest[at + len(chunk) + 1 :]
