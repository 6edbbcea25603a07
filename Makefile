# The two commands of the README: `make demo` and `make test`.
# Everything is installed from nothing into .venv in this folder.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is pinned to the CPU build that lies on these machines' disk; a plain
# `torch` pulls a multi-GB CUDA build. Override: `make venv TORCH=torch`.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: venv test demo bench lint format clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[torch,examples,dev]"
	touch $(STAMP)

test: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -p no:cacheprovider

demo: venv
	$(PY) examples/compare.py demo

bench: venv
	$(PY) benchmarks/bench_losses.py
	$(PY) benchmarks/bench_step.py

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: venv
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
