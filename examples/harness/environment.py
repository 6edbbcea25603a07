"""The software and machine a run came from: ``summary.json``'s ``environment``.

pyproject.toml gives ranges, not pins, so a committed result made before a
reinstall of jax or torch reads like a code change unless the run says which
versions made it. :func:`record` says so: the versions of the packages the
runs use (from the installed metadata: a package not installed is None, and
nothing is imported that the run has not imported already), where JAX and
torch ran, the CPU, the git commit of the checkout and the UTC time.
:func:`describe` is its one line in ``report.md`` and ``compare.py``'s
printout. Framework-free: `benchmarks/_device.py` re-exports :func:`cpu_name`.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The distributions whose versions change a run's numbers, as pip names them.
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "numpy")
ROOT = Path(__file__).resolve().parents[2]  # the checkout holding examples/
# Outputs, not code: re-generating the committed runs one task after another
# would otherwise call every run after the first dirty by the first's outputs.
_NOT_CODE = ":(exclude,glob)**/results/**"
_GIT_TIMEOUT_S = 10.0  # a hung git (network file system) must not hang a run


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """The installed version of each distribution, None where it is missing.

    Read from the package metadata (`importlib.metadata`), never by
    importing the package: a JAX-only run does not import torch for this.

    Example:
        >>> v = package_versions(("numpy", "no-such-package"))
        >>> v["numpy"] == importlib.metadata.version("numpy"), v["no-such-package"]
        (True, None)
    """
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (or what `platform` knows).

    Example:
        >>> isinstance(cpu_name(), str) and cpu_name() != ""
        True
    """
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def git_state(root: Path = ROOT) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout at `root`; (None, None) without git.

    ``dirty``: a tracked file differs from the commit, outputs under a
    ``results/`` folder and untracked files not counted. git missing, not a
    repository or not answering within 10 s gives (None, None): the record
    never fails a run.

    Example:
        >>> commit, dirty = git_state(Path("/"))  # not a repository
        >>> commit, dirty
        (None, None)
    """

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True, text=True, check=True, timeout=_GIT_TIMEOUT_S,
        ).stdout.strip()  # fmt: skip

    try:
        commit = git("rev-parse", "HEAD")
        changes = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                      _NOT_CODE)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, bool(changes)


def _jax_devices() -> tuple[str | None, str | None, int | None]:
    """(backend, device kind, device count) if this process imported JAX."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None, None, None
    try:
        devs = jax.devices()
        return jax.default_backend(), devs[0].device_kind, len(devs)
    except RuntimeError:  # no backend could start: the run would say so itself
        return None, None, None


def _torch_device() -> str | None:
    """torch's default device if this process imported torch."""
    torch = sys.modules.get("torch")
    return None if torch is None else str(torch.get_default_device())


def record() -> dict[str, Any]:
    """The ``environment`` of ``summary.json``, taken as a run finishes.

    Keys: ``python``; ``packages`` (:data:`PACKAGES` -> version or None);
    ``jax_backend``, ``jax_device_kind``, ``jax_device_count`` and
    ``torch_device`` (None where the process did not import that framework);
    ``cpu`` (:func:`cpu_name`), ``cpu_count`` (`os.cpu_count`);
    ``git_commit``, ``git_dirty`` (:func:`git_state`); ``utc_time``.

    Example:
        >>> env = record()
        >>> sorted(env["packages"]) == sorted(PACKAGES)
        True
        >>> env["python"] == platform.python_version(), env["utc_time"][-1]
        (True, 'Z')
    """
    backend, kind, count = _jax_devices()
    commit, dirty = git_state()
    return {
        "python": platform.python_version(),
        "packages": package_versions(PACKAGES),
        "jax_backend": backend,
        "jax_device_kind": kind,
        "jax_device_count": count,
        "torch_device": _torch_device(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "git_commit": commit,
        "git_dirty": dirty,
        "utc_time": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def describe(env: Mapping[str, Any] | None) -> str:
    """One line of an ``environment`` record (None: a run made before it).

    Example:
        >>> env = {"python": "3.11.9", "packages": {"jax": "0.10.2",
        ...        "torch": None}, "jax_backend": "cpu", "jax_device_kind": "cpu",
        ...        "jax_device_count": 2, "torch_device": None, "cpu": "EPYC",
        ...        "cpu_count": 2, "git_commit": "1756e5f0ab", "git_dirty": True,
        ...        "utc_time": "2026-11-24T23:00:00Z"}
        >>> print(describe(env))
        python 3.11.9, jax 0.10.2, torch not installed; JAX cpu (2 x cpu); EPYC, 2 CPUs; commit 1756e5f0 with uncommitted changes; 2026-11-24T23:00:00Z
        >>> print(describe(None))
        not recorded (a run made before the harness wrote its environment)
    """  # noqa: E501
    if env is None:
        return "not recorded (a run made before the harness wrote its environment)"
    software = [f"python {env['python']}"] + [
        f"{name} {version or 'not installed'}"
        for name, version in env["packages"].items()
    ]
    where = []
    if env["jax_backend"] is not None:
        where.append(
            f"JAX {env['jax_backend']} ({env['jax_device_count']} x "
            f"{env['jax_device_kind']})"
        )
    if env["torch_device"] is not None:
        where.append(f"torch on {env['torch_device']}")
    machine = f"{env['cpu']}, {env['cpu_count']} CPUs"
    if env["git_commit"] is None:
        commit = "git commit unknown"
    else:
        changes = " with uncommitted changes" if env["git_dirty"] else ""
        commit = f"commit {env['git_commit'][:8]}{changes}"
    parts = [", ".join(software), *(["; ".join(where)] if where else []), machine]
    return "; ".join([*parts, commit, env["utc_time"]])
