# terascale: every target sets itself up (a .venv beside this file) before it runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.terascale-installed
BENCH_STAMP := $(VENV)/.terascale-bench-installed
AIRFLOW_VENV ?= .venv-airflow
AIRFLOW_STAMP := $(AIRFLOW_VENV)/.terascale-airflow-installed
export PYTHONHASHSEED := 0
export PYSPARK_PYTHON := $(abspath $(PY))
export PYSPARK_DRIVER_PYTHON := $(abspath $(PY))

.PHONY: demo test test-spark35 test-cluster test-multihost bench bench-scale bench-scale-curve bench-scale-peers dist lint screenshot docs clean device-wheels device-check

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

# the suite includes tests/cluster: a standalone cluster run with the dist/ artifacts, and
# tests/multihost: the same over several hosts made of network namespaces (needs root and
# `ip netns`; skipped with the reason otherwise; the killed-host run only in test-multihost).
# Then the Airflow tests (test-airflow, below), after the suite: its numba kernels are cached by
# then, and the DAG's spark-submit jobs load them instead of compiling them (a failing suite
# still runs them; make fails when either fails).
test: $(STAMP) $(AIRFLOW_STAMP) dist
	TERASCALE_DIST=$(abspath dist) $(PY) -m pytest -q --durations=30 tests; rc=$$?; \
	$(MAKE) --no-print-directory test-airflow || rc=1; exit $$rc

# Spark lines (docs/pages/how-to/spark-versions.md): `make test` runs on the newest pyspark that
# pyproject.toml allows (.venv); test-spark35 runs, in .venv-spark35 with the newest pyspark 3.5.x,
# the Spark-using tests of the modules that call a Spark API whose behaviour differs between the
# lines (SPARK35_TESTS, their spark and cluster markers): tests/test_spark_lines.py (the whole
# pipeline on both lines, bit for bit, .venv as the reference), the adapter, the PySpark API,
# featurize of files and tables (mapInArrow, Arrow schemas, the commit), the barrier stage in
# local mode and local-cluster, and the Airflow DAG's spark-submit on dist/spark3.5. The jobs'
# other tests (train options, MLflow, recalibration, ...) use no further Spark API, and the
# standalone cluster (3 min) and speculation drills (status tracker and speculation settings, as
# on 4.x) cost more than they add here: they run in `make test` only, which keeps .ci/run within
# its time.
SPARK35_TESTS ?= tests/test_spark_lines.py tests/test_spark_compat.py tests/test_ml_api.py \
	tests/test_ml_featurize.py tests/test_featurize_table.py tests/test_featurize_spark.py \
	tests/test_spark_settle.py tests/test_table_serving.py tests/test_time_split.py \
	tests/test_barrier_spark.py tests/test_parquet_rows.py
SPARK35_VENV ?= .venv-spark35
SPARK35_PY := $(SPARK35_VENV)/bin/python
SPARK35_STAMP := $(SPARK35_VENV)/.terascale-installed

$(SPARK35_STAMP): pyproject.toml
	test -x $(SPARK35_PY) || $(PYTHON) -m venv $(SPARK35_VENV)
	$(SPARK35_PY) -m pip install --quiet --upgrade pip
	$(SPARK35_PY) -m pip install --quiet -e ".[dev]" "pyspark==3.5.*"
	touch $(SPARK35_STAMP)

test-spark35: $(STAMP) $(SPARK35_STAMP) $(AIRFLOW_STAMP)
	$(MAKE) --no-print-directory dist SPARK=3.5
	PYSPARK_PYTHON=$(abspath $(SPARK35_PY)) PYSPARK_DRIVER_PYTHON=$(abspath $(SPARK35_PY)) \
	TERASCALE_DIST=$(abspath dist/spark3.5) TERASCALE_REFERENCE_PYTHON=$(abspath $(PY)) \
		$(SPARK35_PY) -m pytest -q --durations=15 -m "spark or cluster" $(SPARK35_TESTS); rc=$$?; \
	TERASCALE_PYTHON=$(abspath $(SPARK35_PY)) TERASCALE_DIST=$(abspath dist/spark3.5) \
		$(AIRFLOW_VENV)/bin/python -m pytest -q tests/test_airflow_dag_run.py || rc=1; exit $$rc

test-cluster: $(STAMP) dist
	TERASCALE_DIST=$(abspath dist) $(PY) -m pytest -q -m cluster tests

test-multihost: $(STAMP) dist
	TERASCALE_DIST=$(abspath dist) TERASCALE_MULTIHOST=full $(PY) -m pytest -q -rs -m multihost tests

bench: $(BENCH_STAMP)
	$(PY) -m tests.benchmarks

# the whole pipeline at ROWS rows, every stage measured (tests/benchmarks/bench_scale.py):
# bench-results/scale.json; at the default 100M rows it needs about 42 GB of disk and hours
ROWS ?= 100000000
bench-scale: $(STAMP)
	$(PY) -m tests.benchmarks scale --rows $(ROWS)

# the scale curve (issue 32): every N into bench-results/scale.json, then docs/pages/explanation/scale.png
CURVE ?= 1000000 3000000 10000000 30000000 100000000
bench-scale-curve: $(STAMP)
	for n in $(CURVE); do $(PY) -m tests.benchmarks scale --rows $$n || exit 1; done
	$(PY) -m tests.benchmarks.scale_plot --table

# peers at scale (issue 32 item 6, tests/benchmarks/bench_scale_peers.py): Spark MLlib at 2M and
# 10M rows and Vowpal Wabbit at 30M, side by side in one run: bench-results/scale_peers.json
bench-scale-peers: $(BENCH_STAMP)
	$(PY) -m tests.benchmarks scale_peers

# the documentation site (docs/mkdocs.yml: the pages in docs/pages, the reference generated from
# the code by docs/reference_hook.py) into site/; --strict: a warning or a broken link fails it
export NO_MKDOCS_2_WARNING := 1
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet -f docs/mkdocs.yml

# look at a training report and the docs site as a person would: headless Chromium (Debian's
# chromium package), all into site-shots/: the report (skipped when there is none: `make demo`
# writes one; never beside it, where a file terascale did not write would make the model directory
# foreign to the next run), the site's home page, tutorial and configuration reference.
REPORT ?= demo-output/model/report.html
SHOT := chromium --headless --no-sandbox --disable-gpu --hide-scrollbars
screenshot: docs
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	mkdir -p site-shots
	if [ -f $(REPORT) ]; then $(SHOT) --window-size=1280,4200 --screenshot=site-shots/report.png \
		file://$(abspath $(REPORT)); else echo "no $(REPORT): run make demo for the report's screenshot"; fi
	$(SHOT) --window-size=1280,1600 --screenshot=site-shots/home.png file://$(abspath site/index.html)
	$(SHOT) --window-size=1280,3000 --screenshot=site-shots/tutorial.png file://$(abspath site/tutorial.html)
	$(SHOT) --window-size=1280,3000 --screenshot=site-shots/configuration.png \
		file://$(abspath site/reference/configuration.html)

lint: $(STAMP)
	$(VENV)/bin/ruff check pipeline allreduce solvers jobs tests conf/airflow docs

# Airflow (conf/airflow/terascale_daily.py): its tests run in a venv of their own, because the
# Spark provider requires pyspark-client, which would overwrite terascale's pyspark in .venv.
# tests/test_airflow_dag.py loads the DAG and renders its arguments (about 20 s);
# tests/test_airflow_dag_run.py lets Airflow run it for two days with the real spark-submit of
# .venv and the dist/ artifacts (about 2 minutes). The venv takes about 2 minutes and 670 MB once.
AIRFLOW_TESTS := tests/test_airflow_dag.py tests/test_airflow_dag_run.py
.PHONY: test-airflow

$(AIRFLOW_STAMP): conf/airflow/requirements.txt
	test -x $(AIRFLOW_VENV)/bin/python || $(PYTHON) -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(AIRFLOW_VENV)/bin/python -m pip install --quiet -r conf/airflow/requirements.txt "pytest>=9"
	touch $(AIRFLOW_STAMP)

test-airflow: $(STAMP) $(AIRFLOW_STAMP) dist
	TERASCALE_PYTHON=$(abspath $(PY)) TERASCALE_DIST=$(abspath dist) $(AIRFLOW_VENV)/bin/python -m pytest -q $(AIRFLOW_TESTS)

# dist/: what a cluster needs (docs/pages/how-to/cluster.md).
#   terascale-$(VERSION)-py3-none-any.whl  pip-installable package (edge node, own images)
#   terascale-pyfiles.zip                  the pure-Python packages, for --py-files
#   env.tar.gz                             packed venv with terascale's dependencies (numba,
#                                          pyarrow, numpy, ...; not pyspark: the cluster's Spark
#                                          provides it), for --archives dist/env.tar.gz#env.
#                                          It changes only when pyproject.toml does; the code
#                                          travels in the zip (or the wheel).
#   jobs/*.py                              the spark-submit entry points
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
# SPARK=3.5 (make dist SPARK=3.5): the same into dist/spark3.5, its env for a Spark 3.5 cluster
# (plus pandas<3, which pyspark 3.5 checks for before an Arrow stage: pipeline/spark_compat.py)
SPARK ?=
DIST := dist$(if $(SPARK),/spark$(SPARK))
SPARK35_EXTRA := "pandas>=2.2,<3"
DIST_EXTRA := $(if $(filter 3.5,$(SPARK)),$(SPARK35_EXTRA))
DIST_ENV := $(DIST)/.env-build
DIST_ENTRIES := $(shell grep -l '^if __name__ == "__main__":' jobs/submit/*.py)

# the wheel's files less its .dist-info, with a directory entry per folder: zipimport finds the
# namespace package terascale (it has no __init__.py) only by its directory entry
define PYFILES_ZIP
import sys, zipfile
src = zipfile.ZipFile(sys.argv[1])
dst = zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED)
names = [i.filename for i in src.infolist() if ".dist-info/" not in i.filename]
dirs = {"/".join(n.split("/")[:k]) + "/" for n in names for k in range(1, n.count("/") + 1)}
[dst.writestr(d, b"") for d in sorted(dirs)]
[dst.writestr(n, src.read(n)) for n in names]
dst.close()
endef
export PYFILES_ZIP

dist: $(DIST)/env.tar.gz $(DIST)/terascale-$(VERSION)-py3-none-any.whl
	@ls -l $(DIST) $(DIST)/jobs

$(DIST)/terascale-$(VERSION)-py3-none-any.whl: $(STAMP) pyproject.toml $(wildcard pipeline/*.py allreduce/*.py solvers/*.py solvers/*/*.py jobs/*.py jobs/*/*.py)
	rm -rf $(DIST)/*.whl $(DIST)/terascale-pyfiles.zip $(DIST)/jobs build
	mkdir -p $(DIST)/jobs
	$(PY) -m pip wheel --quiet --no-deps -w $(DIST) .
	$(PY) -c "$$PYFILES_ZIP" $@ $(DIST)/terascale-pyfiles.zip
	cp $(DIST_ENTRIES) $(DIST)/jobs/
	rm -rf build

$(DIST)/env.tar.gz: $(STAMP) pyproject.toml
	rm -rf $(DIST_ENV) $(DIST)/env.tar.gz
	$(PYTHON) -m venv $(DIST_ENV)
	$(DIST_ENV)/bin/python -m pip install --quiet --upgrade pip
	$(DIST_ENV)/bin/python -m pip install --quiet $$($(PY) -c 'import tomllib; print(" ".join(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if not d.startswith("pyspark")))') $(DIST_EXTRA)
	$(VENV)/bin/venv-pack --quiet --prefix $(DIST_ENV) --format tar.gz --output $(DIST)/env.tar.gz.tmp
	chmod 644 $(DIST)/env.tar.gz.tmp && mv $(DIST)/env.tar.gz.tmp $(DIST)/env.tar.gz
	rm -rf $(DIST_ENV)

# The hardware check (issue 31; tests/device): `make device-wheels` here puts into .whl/ the wheels
# the GPU machine lacks (tests/device/wheels.py: pinned to this venv's versions, CPython 3.12,
# manylinux x86-64) and terascale's own; `make device-check` runs there, in the repository root
# (no venv, no network: its python3 has numpy, numba-cuda, CuPy, pytest, ...), carrying .whl.
# Its rehearsal (tiny sizes, numba's CUDA simulator) is part of `make test`.
DEVICE_WHEELS ?= .whl
DEVICE_PYTHON ?= python3
DEVICE_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
	manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_34_x86_64

device-wheels: dist/terascale-$(VERSION)-py3-none-any.whl
	rm -rf $(DEVICE_WHEELS) && mkdir -p $(DEVICE_WHEELS)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(addprefix --platform ,$(DEVICE_PLATFORMS)) -d $(DEVICE_WHEELS) \
		$$($(PY) -m tests.device.wheels)
	cp $< $(DEVICE_WHEELS)/
	@du -sh $(DEVICE_WHEELS) && ls $(DEVICE_WHEELS)

device-check:
	$(DEVICE_PYTHON) -m tests.device.check --wheels $(DEVICE_WHEELS)

clean:
	rm -rf demo-output bench-results .pytest_cache dist build site site-shots
