# monarch_nb developer tasks. GNU make.
#
#   make demo    run notebooks/01_quickstart.ipynb headless on a local CPU mesh
#   make lab     JupyterLab on notebooks/ (with the mesh status bar and panel)
#   make extension  rebuild the JupyterLab extension (extension/) after edits
#   make test    run the test suite and the example notebooks (nbval)
#   make notebooks  re-create and re-execute notebooks/ (scripts/notebook_sources.py)
#   make lint    ruff + mypy + import-linter (the contracts in pyproject.toml) + no import cycle
#   make bench   benchmarks (installs the `bench` extra first)
#   make gpu-check  the GPU checks on a CUDA or ROCm machine (skipped cleanly without a GPU)
#   make clean   caches and build output (`make distclean` also drops .venv)
#
# Everything runs from .venv, created on first use. torch is installed only when
# the venv cannot import it, so a CUDA / ROCm build you put there yourself is kept.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.monarch-nb-dev.stamp
BENCH_STAMP := $(VENV)/.monarch-nb-bench.stamp
NOTEBOOK ?= notebooks/01_quickstart.ipynb
# nbval: run every notebook in a kernel that is the venv's own interpreter (not
# whatever `python3` kernelspec the machine has), compare only the cells marked
# `# NBVAL_CHECK_OUTPUT`, with pids, timings and hex ids sanitised.
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg

# Which torch to install into a venv that has none. A local CPU wheel (in
# /opt/wheels, for this Python, a +cpu build first) wins when one is on disk;
# otherwise pass TORCH_SPEC: pip arguments naming the build you want, e.g. a CPU
# or CUDA wheel file, or `torch` with the --index-url of PyTorch's own CPU or
# CUDA wheel index (plain `torch` from the default index pulls a multi-GB CUDA
# build). No registry host is named here.
PYTAG := $(shell $(PYTHON) -c 'import sys; print("cp%d%d" % sys.version_info[:2])' 2>/dev/null)
TORCH_WHEEL := $(firstword $(wildcard /opt/wheels/torch-*+cpu-$(PYTAG)-*.whl) \
                           $(wildcard /opt/wheels/torch-*-$(PYTAG)-*.whl))
ifneq ($(TORCH_WHEEL),)
TORCH_SPEC ?= $(TORCH_WHEEL)
endif

.PHONY: help venv test demo notebooks bench lint clean distclean lab extension gpu-check

help:
	@sed -n 's/^#   //p' $(firstword $(MAKEFILE_LIST))

venv: $(STAMP)

# Re-run only when pyproject.toml changes (or the venv is new).
$(STAMP): pyproject.toml
	@test -x $(PY) || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	$(PIP) install --quiet --upgrade pip
	@if $(PY) -c 'import torch' 2>/dev/null; then \
		echo "torch $$($(PY) -c 'import torch; print(torch.__version__)') already in $(VENV); keeping it"; \
	else \
		test -n "$(TORCH_SPEC)" || { echo "no torch in $(VENV) and no local wheel in /opt/wheels:" \
			"pass TORCH_SPEC, pip arguments for the torch build you want (see the Makefile)"; exit 2; }; \
		echo "installing torch: $(TORCH_SPEC)"; \
		$(PIP) install $(TORCH_SPEC); \
	fi
	$(PIP) install --quiet -e '.[dev]'
	@touch $@

# Two pytest-xdist workers, a test file at a time each: the tests mostly wait
# on rank processes, so a second worker uses the other core (tests/conftest.py).
# The soak (20 kills in one training run) then runs alone: beside the other
# worker's rank start-ups its respawns can outlast their join deadlines and
# spend the restart budget it uses to the last respawn.
# TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
# pytest exits 5 when it collects nothing; a suite that ran no test is a failure.
test: venv
	@$(PY) -m pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m "not soak" tests notebooks $(NBVAL); rc=$$?; \
	if [ $$rc -eq 5 ]; then \
		echo "make test: pytest collected no tests (exit 5) - treating as failure" >&2; exit 1; \
	fi; \
	$(PY) -m pytest -q -m soak tests; rc2=$$?; \
	if [ $$rc2 -eq 5 ]; then \
		echo "make test: no soak test collected (exit 5) - treating as failure" >&2; exit 1; \
	fi; \
	[ $$rc -eq 0 ] && exit $$rc2; exit $$rc

demo: venv
	$(PY) scripts/run_notebook.py $(NOTEBOOK)

notebooks: venv
	$(PY) scripts/build_notebooks.py

# The JupyterLab extension. `make venv` builds it already (the package build
# runs npm in extension/ and installs the result into the venv); this rebuilds
# it after edits and refreshes the venv's copy, so a page reload shows them. (A
# copy, not a link: pip's uninstall would delete the build through a link.)
EXT_SRC   := $(wildcard extension/src/*.ts extension/style/*) extension/package.json extension/package-lock.json
EXT_BUILD := monarch_nb/labextension/package.json
EXT_COPY  := $(VENV)/share/jupyter/labextensions/monarch-nb-lab

extension: $(EXT_BUILD)
	@rm -rf $(EXT_COPY) && mkdir -p $(dir $(EXT_COPY)) && cp -r monarch_nb/labextension $(EXT_COPY) \
		&& cp extension/install.json $(EXT_COPY)/

$(EXT_BUILD): $(EXT_SRC) | $(STAMP)
	cd extension && npm install --no-audit --no-fund && PATH="$(abspath $(VENV))/bin:$$PATH" npm run build

lab: extension
	$(PY) -m jupyter lab notebooks/

$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(PIP) install --quiet -e '.[bench]'
	@touch $@

bench: $(BENCH_STAMP)
	$(PY) benchmarks/run.py
	$(PY) benchmarks/respawn.py
	$(PY) benchmarks/metrics.py

# One rank per GPU: pinning, NCCL/RCCL collectives, health figures, a GPU rank
# killed and back, a DDP step; a table, exit 0 (or "skipped: no GPU").
gpu-check: venv
	$(PY) scripts/gpu_check.py

lint: venv
	$(PY) -m ruff check monarch_nb tests benchmarks scripts
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	$(PY) scripts/check_cycles.py

clean:
	rm -rf build dist out *.egg-info .pytest_cache .mypy_cache .ruff_cache \
		notebooks/.ipynb_checkpoints extension/lib extension/tsconfig.tsbuildinfo
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print0 | xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV) extension/node_modules monarch_nb/labextension
