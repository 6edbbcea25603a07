"""Every example module's docstring examples run and print what they say.

`tests/test_doctests.py` does this for the two packages; the examples are
read by people porting a recipe, so their examples must not rot either.
"""

import doctest
import importlib
import pathlib

import pytest

# eager docstring examples (models, losses, conversions): most of their time
# in XLA's compiler; compiled with fewer XLA optimisations (conftest.py) and,
# at about 30 s of CPU still, queued first
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fewer_xla_optimizations")]

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in (ROOT / "examples").rglob("*.py")
    if path.name != "__init__.py"
)


def test_the_examples_are_found():
    assert "examples.harness.run" in MODULES and "examples.detection.task" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, report=True)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
