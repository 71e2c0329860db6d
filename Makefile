# monarch_nb developer tasks. GNU make.
#
#   make demo    run notebooks/01_quickstart.ipynb headless on a local CPU mesh
#   make lab     JupyterLab on notebooks/ (with the mesh status bar and panel)
#   make extension  rebuild the JupyterLab extension (extension/) after edits
#   make test    run the test suite and the example notebooks (nbval)
#   make docs    build the documentation site (docs/ -> docs/_build/html)
#   make wheel-check  build the sdist and wheel and try the wheel in a fresh venv
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
# TORCH_SPEC (pip arguments: a CPU / CUDA / ROCm wheel file, or `torch` with the
# --index-url of PyTorch's own wheel index for your build) overrides it; with
# neither, `torch` comes from pip's configured index (one line says so). A torch
# the venv can already import is never replaced. No registry host is named here.
PYTAG := $(shell $(PYTHON) -c 'import sys; print("cp%d%d" % sys.version_info[:2])' 2>/dev/null)
TORCH_WHEEL ?= $(firstword $(wildcard /opt/wheels/torch-*+cpu-$(PYTAG)-*.whl) \
                           $(wildcard /opt/wheels/torch-*-$(PYTAG)-*.whl))
ifneq ($(TORCH_WHEEL),)
TORCH_SPEC ?= $(TORCH_WHEEL)
endif
TORCH_STAMP := $(VENV)/.monarch-nb-torch.stamp
DEMO_STAMP  := $(VENV)/.monarch-nb-demo.stamp
DOCS_STAMP  := $(VENV)/.monarch-nb-docs.stamp

.PHONY: help venv test demo notebooks bench lint clean distclean lab extension gpu-check docs wheel-check

help:
	@sed -n 's/^#   //p' $(firstword $(MAKEFILE_LIST))

venv: $(STAMP)

# The venv and its torch, shared by every target below.
$(TORCH_STAMP):
	@test -x $(PY) || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	$(PIP) install --quiet --upgrade pip
	@if $(PY) -c 'import torch' 2>/dev/null; then \
		echo "torch $$($(PY) -c 'import torch; print(torch.__version__)') already in $(VENV); keeping it"; \
	elif [ -n "$(TORCH_SPEC)" ]; then \
		echo "installing torch: $(TORCH_SPEC)"; \
		$(PIP) install $(TORCH_SPEC); \
	else \
		echo "no local torch wheel: installing torch from pip's configured index (pip install torch;" \
			"on Linux that is a CUDA build). For another build pass TORCH_SPEC, e.g." \
			"make venv TORCH_SPEC='torch --index-url <PyTorch's CPU/CUDA/ROCm wheel index>'"; \
		$(PIP) install torch; \
	fi
	@touch $@

# An editable install of the package with the extra $(1). Without build isolation
# when the venv has the build requirements (an isolated build installs jupyterlab
# into a throwaway venv first, ~20 s); $(2) = reqs installs them first (the dev
# extra has them anyway). scripts/build_requires.py reads them from pyproject.toml.
# The venv's bin/ leads PATH: the extension's npm build runs `jupyter labextension`.
define install_editable
	@if [ "$(2)" = reqs ]; then \
		reqs="$$($(PY) scripts/build_requires.py)"; \
		[ -z "$$reqs" ] || $(PIP) install --quiet $$reqs; \
		reqs="$$($(PY) scripts/build_requires.py --editable)"; \
		[ -z "$$reqs" ] || $(PIP) install --quiet $$reqs; \
	fi; \
	if $(PY) scripts/build_requires.py --editable --missing >/dev/null; then \
		PATH="$(abspath $(VENV))/bin:$$PATH" $(PIP) install --quiet --no-build-isolation -e '.[$(1)]'; \
	else \
		$(PIP) install --quiet -e '.[$(1)]'; \
	fi
	@touch $@
endef

# The dev venv: re-run only when pyproject.toml changes (or the venv is new).
$(STAMP): pyproject.toml $(TORCH_STAMP)
	$(call install_editable,dev,reqs)

# The demo needs only the package and a notebook runner (the `demo` extra).
$(DEMO_STAMP): pyproject.toml $(TORCH_STAMP)
	$(call install_editable,demo)

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

demo: $(DEMO_STAMP)
	$(PY) scripts/run_notebook.py $(NOTEBOOK)

# The documentation site (docs/, Sphinx): warnings are errors, as in CI;
# `make docs` also checks every internal link and reference.
$(DOCS_STAMP): pyproject.toml $(TORCH_STAMP)
	$(call install_editable,docs)

docs: $(DOCS_STAMP)
	$(PY) -m sphinx -b html -W --keep-going docs docs/_build/html
	$(PY) scripts/check_doc_links.py

# The package as users get it: sdist + wheel, twine check, the wheel in a fresh
# venv with torch and no dev extras (scripts/check_wheel.sh says what it checks).
wheel-check: venv
	PYTHON=$(PYTHON) TORCH_SPEC="$(TORCH_SPEC)" BUILD_PY=$(PY) scripts/check_wheel.sh

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
	$(call install_editable,bench)

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
	rm -rf build dist out docs/_build docs/api/generated docs/_generated *.egg-info .pytest_cache .mypy_cache .ruff_cache \
		notebooks/.ipynb_checkpoints extension/lib extension/tsconfig.tsbuildinfo
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print0 | xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV) extension/node_modules monarch_nb/labextension
