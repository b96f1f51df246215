# Two commands do everything on a fresh machine: `make demo` and `make test`
# (`make lint` checks the code: ruff and mypy, configured in pyproject.toml;
# `make docs` builds the manual into site/).
# Each creates or reuses .venv and installs the project with every pip call held
# to constraints.txt (torch==2.13.0: an unpinned torch pulls gigabytes of CUDA wheels).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1
PYTEST_ARGS ?=
# e.g. DEMO_ARGS="--scheduler tcp://10.0.0.5:8786": the demo on a Dask cluster you already run
DEMO_ARGS ?=

.PHONY: install docs demo lint test test-all test-fast slurm-test bench chaos clean

# The code the package installs (adapters/ installs as cerebro_automl.adapters).
LINT_PATHS := cerebro_automl adapters

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[all]"
	touch $@

# The manual: mkdocs --strict fails on a broken link, a missing API reference or a warning.
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[all,docs]"
	touch $@

demo: install
	$(PY) examples/optuna_mnist1d.py $(DEMO_ARGS)

# Lint (pyflakes, pycodestyle, bugbear, ...), the format check, and the type check.
lint: install
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m mypy $(LINT_PATHS)

# The default suite: everything but the tests marked slow (the fault campaign and
# 2000 tiny models), which `make test-all` adds.
test: install
	$(PY) -m pytest -ra -m "not slow" --durations=15 $(PYTEST_ARGS)

test-all: install
	$(PY) -m pytest -ra $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -ra -m "not slow and not cluster" $(PYTEST_ARGS)

# A search on a real SLURM: slurm-wlm and munge from apt (root), one node on this
# machine (scripts/slurm/start.sh), the driver's job cancelled, resubmitted and resumed
# (tests/test_slurm.py); SLURM is stopped and its state removed whatever the outcome.
slurm-test: $(VENV)/.slurm-installed
	scripts/slurm/install.sh
	scripts/slurm/start.sh
	. scripts/slurm/env.sh && CEREBRO_SLURM_TEST=1 $(PY) -m pytest -ra -s -m slurm tests/test_slurm.py \
		$(PYTEST_ARGS); rc=$$?; scripts/slurm/stop.sh; exit $$rc

$(VENV)/.slurm-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[all,slurm]"
	touch $@

bench: install
	$(PY) benchmarks/bench_engine.py $(BENCH_ARGS)
	$(PY) benchmarks/bench_optuna.py $(BENCH_ARGS)
	$(PY) benchmarks/bench_hyperband.py $(BENCH_ARGS)
	$(PY) benchmarks/bench_lightning.py $(BENCH_ARGS)
	$(PY) benchmarks/bench_strategies.py $(BENCH_ARGS)
	$(PY) benchmarks/bench_simulate.py $(BENCH_ARGS)
	$(PY) benchmarks/bench_disk_cache.py $(BENCH_ARGS)
	$(PY) benchmarks/bench_replicas.py $(BENCH_ARGS)
	$(PY) benchmarks/bench_transfer.py
	$(PY) benchmarks/bench_reproducible.py
	$(PY) benchmarks/bench_search_sim.py
	$(PY) benchmarks/bench_tail.py
	$(PY) benchmarks/bench_tail_real.py
	$(PY) benchmarks/bench_fusion.py
	$(PY) benchmarks/bench_fusion.py --arch mlp
	$(PY) benchmarks/bench_partitioning.py
	$(PY) benchmarks/bench_finetune.py --big-base
	$(PY) benchmarks/bench_cpu_kernels.py
	$(PY) benchmarks/bench_files.py
	$(PY) benchmarks/bench_files_search.py
	$(PY) benchmarks/bench_fusion_ceiling.py
	$(PY) benchmarks/bench_fusion_models.py
	$(PY) benchmarks/bench_unit_reports.py

# The fault campaign: random worker kills on a CLI cluster with memory limits and bad configs.
chaos: install
	$(PY) benchmarks/bench_chaos.py $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache dask-worker-space dask-scratch-space
