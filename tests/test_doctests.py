"""Every public function's docstring example runs and prints what it says."""

import doctest
import importlib
import inspect

import pytest

MODULES = [
    "losses",
    "loss_scale",
    "transforms",
    "precision",
    "diagnostics",
    "train",
    "distributed",
]
# The public module `train` is implemented in three: the step, checkpoints, fit.
SRC_MODULES = {"train": ["step", "checkpoint", "fit"]}


def _public_callables(public):
    for name in dir(public):
        if name.startswith("_"):
            continue
        obj = getattr(public, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            yield name, obj


@pytest.mark.parametrize("package", ["jaxstable", "torchref"])
@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(package, module):
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    for name in SRC_MODULES.get(module, [module]):
        impl = importlib.import_module(f"{package}._src.{name}")
        result = doctest.testmod(impl, optionflags=flags, verbose=False, report=True)
        assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"


@pytest.mark.parametrize("package", ["jaxstable", "torchref"])
@pytest.mark.parametrize("module", MODULES)
def test_every_public_function_has_an_example(package, module):
    public = importlib.import_module(f"{package}.{module}")
    missing = [
        name
        for name, obj in _public_callables(public)
        if not obj.__doc__ or ">>>" not in obj.__doc__
    ]
    # NamedTuple states and exceptions document fields, not usage; a class
    # re-exported from a dependency (jmp.Policy) is documented there.
    missing = [
        n
        for n in missing
        if not issubclass_safe(getattr(public, n), (tuple, Exception))
        and getattr(public, n).__module__.startswith(package)
    ]
    assert not missing, f"{package}.{module}: no runnable example in {missing}"


def issubclass_safe(obj, types):
    return inspect.isclass(obj) and issubclass(obj, types)
