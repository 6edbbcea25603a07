"""One wheel, two camps: each installs and imports without the other's framework.

The wheel is built once from a copy of this checkout (setuptools, no build
isolation, no network). Each camp gets a bare virtual environment (no system
site-packages, no pip) with the wheel installed without dependencies; then
only the distributions that the camp's extra asks for, and the ones those
ask for, are made importable: a folder of links into this venv's
site-packages, named by a .pth file. Nothing is downloaded.
"""

import email
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import _stablecore

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxstable", "torchref", "_stablecore")
JAX_STACK = {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "jmp"}
TORCH_STACK = {"torch"}
# What each camp must not be able to import, by import name.
JAX_IMPORTS = ("jax", "jaxlib", "flax", "optax", "orbax", "chex", "jmp")


def _pip(*args, python=None):
    cmd = [sys.executable, "-m", "pip"]
    if python is not None:  # pip runs in that interpreter (which has none)
        cmd += ["--python", str(python)]
    cmd += ["--disable-pip-version-check", "-q", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy (a build writes build/ and *.egg-info)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "tests", "*.egg-info")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=skip)
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp, src)
    (whl,) = tmp.glob("jaxstable-*.whl")
    return whl


def _metadata(whl: Path) -> email.message.Message:
    with zipfile.ZipFile(whl) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(z.read(name))


def _requires(whl: Path, extra: str = "") -> set[str]:
    """The distributions the wheel asks for with `extra` (base only: "")."""
    names = set()
    for line in _metadata(whl).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            names.add(canonicalize_name(req.name))
    return names


def _closure(names: set[str]) -> set[importlib.metadata.Distribution]:
    """The installed distributions `names` need, and theirs, with extras."""
    todo = [(n, frozenset()) for n in names]
    seen, found = set(), {}
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional dependency this venv leaves out
        found[canonicalize_name(dist.metadata["Name"])] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            wanted = req.marker is None or any(
                req.marker.evaluate({"extra": e}) for e in {"", *extras}
            )
            if wanted:
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return set(found.values())


def _link(dists, folder: Path) -> None:
    """Links in `folder` to each distribution's top-level files and metadata."""
    folder.mkdir()
    for dist in dists:
        site = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or []}
        for top in sorted(tops - {"..", "__pycache__"}):
            if (site / top).exists() and not (folder / top).exists():
                (folder / top).symlink_to(site / top)


@pytest.fixture(scope="module")
def bare(tmp_path_factory, wheel):
    """A bare venv with the wheel alone in it; `bare(camp)` names its Python
    with only that camp's distributions importable (None: the wheel's base)."""
    tmp = tmp_path_factory.mktemp("venv")
    venv = tmp / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", venv],
        check=True,
        capture_output=True,
    )
    python = venv / "bin" / "python"
    _pip("install", "--no-deps", "--no-index", wheel, python=python)
    site = subprocess.run(
        [python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    pth = Path(site) / "camp.pth"

    def camp(extra):
        pth.unlink(missing_ok=True)
        folder = tmp / f"links-{extra}"
        if not folder.exists():
            _link(_closure(_requires(wheel, extra or "")), folder)
        pth.write_text(f"{folder}\n")
        return python

    return camp


def _run(python, code: str) -> dict:
    """Runs `code` after PROBE, isolated (no PYTHONPATH, no user site, not
    from the checkout), and returns the JSON it prints last."""
    out = subprocess.run(
        [python, "-I", "-c", PROBE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=python.parents[2],
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


# What each run prints: where the packages came from, and what cannot be
# imported (a package's import error, or None when it imports).
PROBE = f"""
import importlib, importlib.util, json, sys
import _stablecore
JAX_IMPORTS = {sorted(JAX_IMPORTS)!r}
def error(name):
    try:
        importlib.import_module(name)
    except ImportError as err:
        return str(err)
def missing(names):
    return sorted(n for n in names if importlib.util.find_spec(n) is None)
"""


def test_the_wheel_asks_for_each_camp_apart(wheel):
    base = _requires(wheel)
    assert base == {"numpy", "tqdm"}
    assert _requires(wheel, "jax") - base == JAX_STACK
    assert _requires(wheel, "torch") - base == TORCH_STACK
    # ... and not through their dependencies either.
    torch_camp = {
        canonicalize_name(d.metadata["Name"])
        for d in _closure(_requires(wheel, "torch"))
    }
    jax_camp = {
        canonicalize_name(d.metadata["Name"]) for d in _closure(_requires(wheel, "jax"))
    }
    assert "torch" in torch_camp and not torch_camp & JAX_STACK
    assert JAX_STACK <= jax_camp and "torch" not in jax_camp


def test_the_wheel_has_one_version_and_the_type_markers(wheel):
    assert _metadata(wheel)["Version"] == _stablecore.__version__
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for package in PACKAGES:
        assert f"{package}/py.typed" in names
    assert not any("/tests/" in n for n in names)


def test_torch_camp_imports_torchref_without_jax(bare):
    python = bare("torch")
    got = _run(
        python,
        """
        import torch, torchref
        from torchref import losses, train, transforms, diagnostics, distributed
        loss = losses.softmax_cross_entropy(torch.zeros(2, 3), torch.tensor([0, 2]))
        print(json.dumps({
            "from": [torchref.__file__, _stablecore.__file__],
            "version": torchref.__version__,
            "loss": round(float(loss), 4),
            "missing": missing(JAX_IMPORTS),
            "jaxstable": error("jaxstable"),
        }))
        """,
    )
    assert all(f.startswith(str(python.parents[1])) for f in got["from"]), got
    assert got["version"] == _stablecore.__version__
    assert got["loss"] == 1.0986  # log(3)
    assert got["missing"] == sorted(JAX_IMPORTS)
    assert 'pip install "jaxstable[jax]"' in got["jaxstable"]


def test_jax_camp_imports_jaxstable_without_torch(bare):
    python = bare("jax")
    got = _run(
        python,
        """
        import jax.numpy as jnp, jaxstable
        from jaxstable import losses, train, transforms, diagnostics, distributed
        loss = losses.softmax_cross_entropy(jnp.zeros((2, 3)), jnp.array([0, 2]))
        print(json.dumps({
            "from": [jaxstable.__file__, _stablecore.__file__],
            "version": jaxstable.__version__,
            "loss": round(float(loss), 4),
            "missing": missing(["torch"]),
            "torchref": error("torchref"),
        }))
        """,
    )
    assert all(f.startswith(str(python.parents[1])) for f in got["from"]), got
    assert got["version"] == _stablecore.__version__
    assert got["loss"] == 1.0986
    assert got["missing"] == ["torch"]
    assert 'pip install "jaxstable[torch]"' in got["torchref"]


def test_without_an_extra_each_package_names_its_extra(bare):
    got = _run(
        bare(None),
        """
        print(json.dumps({
            "jaxstable": error("jaxstable"),
            "torchref": error("torchref"),
            "missing": missing(["jax", "torch"]),
        }))
        """,
    )
    assert got["missing"] == ["jax", "torch"]
    assert 'pip install "jaxstable[jax]"' in got["jaxstable"]
    assert 'pip install "jaxstable[torch]"' in got["torchref"]
