# The two commands of the README: `make demo` and `make test`.
# Everything is installed from nothing into .venv in this folder.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is pinned to the CPU build that lies on these machines' disk; a plain
# `torch` pulls a multi-GB CUDA build. Override: `make venv TORCH=torch`.
TORCH  ?= torch==2.13.0
# No torchvision wheel loads beside torch 2.13.0+cpu (PyPI's 0.28.0 needs libtorch_cuda), so timm, smp and open_clip are out: the real-model tier uses in-repo ResNet-18 shapes.
STAMP  := $(VENV)/.installed

.PHONY: venv test demo docs bench gpu-check gpu-wheels lint format clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[jax,torch,examples,dev,models]"
	touch $(STAMP)

# pytest-xdist workers (one per core here); a file's tests stay on one worker
# (--dist loadfile), so each module-scoped fixture is built once. 0: serial.
# Measured timings and how to measure them: CONTRIBUTING.md, "Test timings".
TEST_WORKERS ?= 2

# mypy: the public modules' types (pyproject's [tool.mypy]), then the suite.
test: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

demo: venv
	$(PY) examples/compare.py demo

# The documentation site (MkDocs, Material theme, mkdocstrings: guides in
# docs/, the API reference from both packages' docstrings) into the
# git-ignored site/. Strict: a broken link, anchor or reference fails it
# (tests/test_docs.py builds it the same way). NO_MKDOCS_2_WARNING silences
# the theme's banner about its end of life (May 2027).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

bench: venv
	$(PY) benchmarks/bench_losses.py
	$(PY) benchmarks/bench_step.py
	$(PY) benchmarks/bench_models.py

# On a GPU machine (no venv: the machine's own python, see the script).
gpu-check:
	bash benchmarks/gpu_check.sh

# Here, with a network: the wheels gpu-check installs there (python 3.12,
# x86-64), into the git-ignored .whl/.
GPU_WHEELS ?= jmp==0.0.4 pyclipper shapely
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

format: venv
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache site
