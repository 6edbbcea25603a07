"""Shared pytest configuration: tolerances by dtype (stated once, here) and
GPU detection. Tests ask for the `tol` fixture instead of writing numbers."""

from __future__ import annotations

import os

import numpy as np
import pytest

# Keep CPU runs deterministic and quiet; on a GPU use full-precision matmuls so
# that parity is tight (TF32 is also disabled on the torch side in `gpu_setup`).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Tolerances for comparing two float32 computations whose *inputs* were in the
# given dtype. Both sides upcast the same low-precision values to float32, so
# forward values agree to float32 rounding; gradients are returned in the input
# dtype, so they carry one rounding of that dtype (bf16: 8 bits of mantissa,
# relative step 2**-8 = 3.9e-3; fp16: 11 bits, 2**-11 = 4.9e-4).
TOLERANCES: dict[str, dict[str, float]] = {
    "float64": {"rtol": 1e-10, "atol": 1e-12},
    "float32": {"rtol": 2e-5, "atol": 2e-6},
    "bfloat16": {"rtol": 1.6e-2, "atol": 1e-2},
    "float16": {"rtol": 2e-3, "atol": 1e-3},
    # Parameters after tens of float32 optimizer steps taken independently in
    # two frameworks: each step's last-bit rounding differences are carried
    # forward, and Adam's m/sqrt(v) turns a relative difference in a tiny
    # gradient component into a difference in an O(lr) update. Measured on
    # CPU over 44 Adam steps at lr 1e-2: up to 0.97 of the float32 class, so
    # this class leaves 4x room rather than sitting at the edge.
    "float32_trajectory": {"rtol": 8e-5, "atol": 8e-6},
}


def tolerance(dtype) -> dict[str, float]:
    """rtol/atol for results computed from inputs of `dtype` (name or dtype)."""
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype).removeprefix("torch.")
    else:
        name = np.dtype(dtype).name
    if name not in TOLERANCES:
        raise KeyError(f"no tolerance for dtype {name!r}; known: {sorted(TOLERANCES)}")
    return dict(TOLERANCES[name])


@pytest.fixture
def tol():
    """`tol("bfloat16") -> {"rtol": ..., "atol": ...}`."""
    return tolerance


def has_conditional(lowered) -> bool:
    """Whether a `jax.jit(...).lower(...)` result branches on device.

    Checks the program JAX emitted (`stablehlo.case`/`stablehlo.if`, what a
    `lax.cond` or `lax.switch` lowers to) as well as the compiled HLO
    (`conditional(`). The compiled text alone is not enough: XLA's GPU
    pipeline turns small conditionals into selects (seen on an H100 with a
    3-element `lax.cond`), so only the lowered text says what the code asked for.
    """
    import re

    if re.search(r"stablehlo\.(case|if)\b", lowered.as_text()):
        return True
    # An HLO instruction `... conditional(...)`; metadata may hold the word.
    return re.search(r"\sconditional\(", lowered.compile().as_text()) is not None


def torch_device() -> str:
    """The device torch parity tests run on: CUDA when torch sees one, else CPU.

    JAX tests run on JAX's default device (the GPU when there is one), so on
    a GPU machine both sides of a parity test compute on the GPU.
    """
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# JAX's persistent compilation cache, for one test session: a program that
# several tests compile alike (the same train step from another closure: the
# harness builds fresh ones for every run) is compiled once and read back.
# One folder per session, made by the first process (the xdist controller,
# or the only process of a serial run) and handed to the workers through the
# environment; a positive size limit puts a file lock around every read and
# write (jax's LRUCache), so two workers never see half a file. Programs
# that compile in under 0.5 s are not written: writing all of them too (the
# hundreds of one-op programs of `diagnostics.locate`) took the example
# tests' system time from 16 s to 65 s. The session's first process
# removes the folder.
_JIT_CACHE_ENV = "JAXSTABLE_TEST_JIT_CACHE"
_JIT_CACHE_OWNED: list[str] = []


def _share_compiled_programs() -> None:
    import tempfile

    import jax

    path = os.environ.get(_JIT_CACHE_ENV)
    if path is None:
        path = tempfile.mkdtemp(prefix="jaxstable-test-jit-")
        os.environ[_JIT_CACHE_ENV] = path
        _JIT_CACHE_OWNED.append(path)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_compilation_cache_max_size", 4 * 2**30)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


_share_compiled_programs()


def pytest_sessionfinish(session, exitstatus):
    import shutil

    for path in _JIT_CACHE_OWNED:
        shutil.rmtree(path, ignore_errors=True)


def _has_gpu() -> bool:
    try:
        import jax

        return any(d.platform == "gpu" for d in jax.devices())
    except Exception:
        return False


HAS_GPU = _has_gpu()

if HAS_GPU:  # tight parity on a GPU: no TF32 / bf16-pass matmuls on either side
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    except ImportError:
        pass


@pytest.fixture(scope="module")
def fewer_xla_optimizations():
    """Compile this module's JAX programs with XLA's backend optimisations off.

    For the end-to-end tests that check what a run does (which step goes
    non-finite, where `locate` finds it, what the report says), not how fast
    it runs: their few steps of tiny models spend most of their time in XLA's
    compiler. ``jax_disable_most_optimizations`` (LLVM at -O0, its expensive
    passes skipped; the HLO passes still run) took `examples/compare.py ocr
    --quick` from 77 s to 50 s of CPU; with XLA's older elemental IR
    emitters for CPU fusions instead of its MLIR fusion emitters
    (``xla_cpu_use_fusion_emitters``) as well, to 29 s. Results may move in
    their last bits (the OCR float16 stable loss after 6 steps: 7.609 ->
    7.600, the same with both settings as with the first): every module
    that asks for it was checked to assert the same steps and causes, on the
    same values, with and without it. Subprocesses inherit it through
    ``JAX_DISABLE_MOST_OPTIMIZATIONS`` and ``XLA_FLAGS`` (this process
    parsed its ``XLA_FLAGS`` when its backend started, at import). Use with
    ``pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")``.

    The setting is not part of JAX's in-memory cache keys, so the caches are
    cleared on the way in and out: no program compiled one way runs where
    the other was asked for (an eager op compiled at -O2 before would
    otherwise meet its -O0 twin in a subprocess of a bitwise comparison).
    The session's persistent cache keys hold the compile options.
    """
    import jax
    from jax._src import compiler  # where jax builds every compile's options

    name, flag = "jax_disable_most_optimizations", "xla_cpu_use_fusion_emitters"
    build = compiler.get_compile_options

    def without_fusion_emitters(*args, env_options_overrides=None, **kwargs):
        overrides = {**(env_options_overrides or {}), flag: False}
        return build(*args, env_options_overrides=overrides, **kwargs)

    before = jax.config.read(name)
    jax.clear_caches()
    jax.config.update(name, True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiler, "get_compile_options", without_fusion_emitters)
        patch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
        patch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} --{flag}=false")
        yield
    jax.clear_caches()
    jax.config.update(name, before)


def pytest_configure(config):
    # `make test` hands whole files to its xdist workers (--dist loadfile);
    # by default xdist queues the files with the most tests first, which puts
    # the few-test end-to-end files (a minute of CPU each) last, where one of
    # them leaves the other worker idle. The order of the collection (below:
    # long files first) is kept instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    # Longest first: the files holding a `slow` test (in collection order),
    # then the others by their number of tests, most first (xdist's default).
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def cost(tests):
        return (not any("slow" in t.keywords for t in tests), -len(tests))

    items[:] = [t for tests in sorted(files.values(), key=cost) for t in tests]
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU; none is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
