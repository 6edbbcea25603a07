"""A task's own sections of report.md, between markers that rewriting
the report keeps (`put_section`)."""

from __future__ import annotations


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
