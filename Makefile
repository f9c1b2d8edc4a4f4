# terascale: every target sets itself up (a .venv beside this file) before it runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.terascale-installed
BENCH_STAMP := $(VENV)/.terascale-bench-installed
export PYTHONHASHSEED := 0
export PYSPARK_PYTHON := $(abspath $(PY))
export PYSPARK_DRIVER_PYTHON := $(abspath $(PY))

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	touch $(BENCH_STAMP)

demo: $(STAMP)
	$(VENV)/bin/terascale demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(BENCH_STAMP)
	$(PY) -m tests.benchmarks

lint: $(STAMP)
	$(VENV)/bin/ruff check pipeline allreduce solvers jobs tests

clean:
	rm -rf demo-output bench-results .pytest_cache
