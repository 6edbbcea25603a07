"""Every public function's docstring example runs and prints what it says."""

import doctest
import importlib
import inspect
import pkgutil

import pytest

# eager doctests: hundreds of one-op programs, most of their time in XLA's
# compiler; compiled with fewer XLA optimisations (conftest.py) and, at
# about 30 s of CPU still, queued first
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fewer_xla_optimizations")]

MODULES = [
    "losses",
    "loss_scale",
    "transforms",
    "precision",
    "diagnostics",
    "train",
    "distributed",
]
# The public module `train` is implemented in nine: the step and its five
# helper modules, checkpoints (two), fit; `loss_scale` in two (the arithmetic
# apart); `transforms` in nine (clipping, the update check, the guarded step,
# the guard, stable_optimizer, accumulation, the spike guard, the guard
# states, the low-precision AdamW); `diagnostics` in two (the check points
# apart).
SRC_MODULES = {
    "loss_scale": ["loss_scale", "loss_scale_math"],
    "train": [
        "step",
        "step_state",
        "step_checks",
        "step_loss",
        "step_records",
        "microbatches",
        "checkpoint",
        "checkpoint_manager",
        "fit",
    ],
    "transforms": [
        "clipping",
        "update_check",
        "guard_step",
        "guard",
        "stable_optimizer",
        "accumulate",
        "spikes",
        "guard_state",
        "low_precision",
    ],
    "diagnostics": ["diagnostics", "check_points"],
}


def _with_submodules(module):
    """`module` and, for a package (`_src/losses/`), every module in it."""
    yield module
    prefix = f"{module.__name__}."
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), prefix):
        yield importlib.import_module(info.name)


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
    attempted = 0
    for name in SRC_MODULES.get(module, [module]):
        top = importlib.import_module(f"{package}._src.{name}")
        for impl in _with_submodules(top):
            result = doctest.testmod(
                impl, optionflags=flags, verbose=False, report=True
            )
            failed = f"{result.failed} doctest(s) failed in {impl.__name__}"
            assert result.failed == 0, failed
            attempted += result.attempted
    assert attempted, f"no doctest found in {package}._src for {module}"


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
