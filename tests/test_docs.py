"""The documentation site builds in strict mode and documents every public name.

The site is built once per module, in this process (no subprocess), as
`make docs` builds it: MkDocs in strict mode, where a broken link, a broken
anchor or a cross-reference to no documented object is a warning and a
warning fails the build.
"""

import ast
import logging
import os
import re
from pathlib import Path

import pytest
from mkdocs import config as mkdocs_config
from mkdocs.commands.build import build
from mkdocs.exceptions import Abort

ROOT = Path(__file__).resolve().parents[1]
MODULES = (
    "losses",
    "loss_scale",
    "transforms",
    "precision",
    "diagnostics",
    "train",
    "distributed",
)


def _build(site_dir: Path, **overrides) -> None:
    # The Material theme prints a banner about its end of life otherwise.
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")
    cfg = mkdocs_config.load_config(
        str(ROOT / "mkdocs.yml"), site_dir=str(site_dir), strict=True, **overrides
    )
    cwd = os.getcwd()
    os.chdir(ROOT)  # mkdocstrings' `paths: [.]` and the griffe extension's path
    try:
        build(cfg)
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site_dir = tmp_path_factory.mktemp("site")
    _build(site_dir)  # raises Abort on any warning
    return site_dir


def _public(package: str, module: str) -> set[str]:
    """The names a public module binds without a leading underscore.

    tests/test_layout.py's definition, read from the source so that no torch
    is imported here (the public modules only re-export with `import x as x`).
    """
    tree = ast.parse((ROOT / package / f"{module}.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom | ast.Import):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return {n for n in names if not n.startswith("_") and n != "annotations"}


def test_site_builds_in_strict_mode(site):
    assert (site / "index.html").is_file()
    assert (site / "api" / "torchref" / "train" / "index.html").is_file()


@pytest.mark.parametrize("package", ["jaxstable", "torchref"])
def test_api_reference_documents_every_public_name(site, package):
    missing = []
    for module in MODULES:
        page = (site / "api" / package / module / "index.html").read_text()
        ids = set(re.findall(r'id="([\w.]+)"', page))
        missing += [
            f"{package}.{module}.{name}"
            for name in sorted(_public(package, module))
            if f"{package}.{module}.{name}" not in ids
        ]
    assert not missing, f"public names without an API entry: {missing}"


def test_docstring_examples_render_as_code(site):
    # griffe reads only "Examples:"; docs/griffe_docstrings.py maps the
    # docstrings' "Example:" to it, else Markdown reads each ">>>" as three
    # nested block quotes.
    api = site / "api"
    quoted = [
        str(page.relative_to(site))
        for page in api.glob("*/*/index.html")
        if re.search(r"(<blockquote>\s*){3}", page.read_text())
    ]
    assert not quoted, f"doctests rendered as block quotes in {quoted}"
    page = (api / "jaxstable" / "transforms" / "index.html").read_text()
    assert 'class="gp"' in page  # the >>> prompt of a console block


def test_free_text_in_args_is_kept(site):
    # torchref.train.fit's Args end with a sentence that is no `name: text`
    # item; griffe would drop it with a warning.
    page = (site / "api" / "torchref" / "train" / "index.html").read_text()
    text = "The same records and options as <code>jaxstable.train.fit</code>."
    assert f"<p>{text}</p>" in page  # its own paragraph


def test_strict_build_fails_on_broken_link_anchor_and_reference(tmp_path, caplog):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(
        "# Home\n\n## Here\n\n[gone](missing.md), [no anchor](#nowhere),\n"
        "[no object][jaxstable.losses.no_such_loss], [fine](#here)\n"
    )
    with caplog.at_level(logging.WARNING), pytest.raises(Abort):
        _build(tmp_path / "site", docs_dir=str(docs), nav=[{"Home": "index.md"}])
    warnings = "\n".join(r.getMessage() for r in caplog.records)
    assert "missing.md" in warnings
    assert "#nowhere" in warnings
    assert "jaxstable.losses.no_such_loss" in warnings
    assert "#here" not in warnings


def test_no_page_points_to_the_shared_folder():
    pages = [ROOT / "README.md", ROOT / "mkdocs.yml", *(ROOT / "docs").glob("**/*.md")]
    bad = [
        str(p.relative_to(ROOT))
        for p in pages
        if re.search(r"(\.\./|/work/)shared\b", p.read_text())
    ]
    assert not bad, bad
