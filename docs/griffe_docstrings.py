"""A griffe extension for the API pages: three habits of this project's docstrings.

griffe's Google-style parser reads what the docstrings of both packages
write in three ways of their own; this rewrites the text griffe parses (the
code's docstrings are not touched). Loaded by ``mkdocs.yml``.

- The doctests are headed ``Example:``; griffe knows only ``Examples:`` and
  would render the ``>>>`` lines as a Markdown block quote.
- A sentence about all the arguments, written as the last line of ``Args:``
  at the items' indentation, is no ``name: description`` item: griffe warns
  and drops it. It is moved after the section, as a paragraph.
- A paragraph ending in reStructuredText's ``::`` introduces an indented
  literal block, which Markdown renders as code by itself: the ``::``
  becomes ``:``.
"""

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)
_LITERAL = re.compile(r"(\S)::[ \t]*$", re.M)
_ARGS = re.compile(r"^(\s*)(Args|Arguments|Parameters):\s*$")
# "name: ...", "name (type): ...", "*args: ...", "a, b: ...".
_ITEM = re.compile(r"^\s*\**[\w.]+(,\s*\**[\w.]+)*\s*(\(.*\))?:(\s|$)")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _move_free_text_out_of_args(text: str) -> str:
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        out.append(lines[i])
        heading = _ARGS.match(lines[i])
        i += 1
        if not heading:
            continue
        moved, item_indent = [], None
        # The section ends at the first non-empty line at or left of its heading.
        while i < len(lines) and (
            not lines[i].strip() or _indent(lines[i]) > len(heading.group(1))
        ):
            line = lines[i]
            i += 1
            if line.strip() and item_indent is None:
                item_indent = _indent(line)
            if line.strip() and _indent(line) == item_indent and not _ITEM.match(line):
                moved.append(heading.group(1) + line.strip())
            else:
                out.append(line)
        if moved:
            out += ["", *moved, ""]
    return "\n".join(out)


class DocstringHabits(griffe.Extension):
    """Rewrites a docstring's text before griffe parses it (see the module)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        del kwargs
        if obj.docstring is not None:
            text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            text = _LITERAL.sub(r"\1:", text)
            obj.docstring.value = _move_free_text_out_of_args(text)
