"""A task's own sections of report.md, between markers that rewriting
the report keeps (`put_section`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable


def marked(name: str, text: str) -> str:
    return f"<!-- section {name} -->\n{text.rstrip()}\n<!-- end section {name} -->\n"


def put_section(path: str, name: str, text: str) -> None:
    """Writes ``text`` into the report at ``path`` as its section ``name``:
    in place of the section of that name the report has (`write_report`
    marks a task's ``report_sections`` so), else at its end. A task's own
    CLI updates the committed report so without rerunning the comparison.

    Example:
        >>> import os
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "report.md")
        >>> with open(path, "w") as f:
        ...     _ = f.write("# title\\n")
        >>> put_section(path, "extra", "one")
        >>> put_section(path, "extra", "two")
        >>> print(open(path).read().strip())
        # title
        <BLANKLINE>
        <!-- section extra -->
        two
        <!-- end section extra -->
    """
    with open(path, encoding="utf-8") as f:
        old = f.read()
    start, end = f"<!-- section {name} -->", f"<!-- end section {name} -->\n"
    i = old.find(start)
    j = old.find(end, i) if i >= 0 else -1
    if i >= 0 and j >= 0:
        new = old[:i] + marked(name, text) + old[j + len(end) :]
    else:
        new = old.rstrip("\n") + "\n\n" + marked(name, text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)


def json_section(out: str, name: str, section: Callable[[dict], str]) -> str:
    """A task's `report_sections` from one result file: ``section`` of the
    JSON ``name`` in the folder ``out``, ``""`` when there is none.

    Example:
        >>> import tempfile
        >>> json_section(tempfile.mkdtemp(), "none.json", str)
        ''
    """
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return section(json.load(f))


def rerun_command(module: str, argv: list[str]) -> str:
    """The command that gives the same result: ``python -m module`` with
    `argv` less ``--out`` and ``--report`` (where results go, not what they
    are).

    Example:
        >>> rerun_command("examples.lm.low_precision",
        ...               ["--steps", "9", "--out", "x.json", "--report=r.md"])
        'python -m examples.lm.low_precision --steps 9'
    """
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out", "--report"):
            skip = True
        elif not arg.startswith(("--out=", "--report=")):
            kept.append(arg)
    return " ".join([f"python -m {module}", *kept])
