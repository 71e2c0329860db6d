#!/usr/bin/env bash
# The package as users get it (`make wheel-check`; CI runs it):
#   1. build the sdist and the wheel (python -m build: the wheel is built from the sdist)
#   2. twine check both
#   3. a fresh venv with torch and the wheel, no dev extras (only jupyterlab, to list
#      extensions, and the `demo` extra's notebook runner), outside the checkout, and there:
#      - `jupyter labextension list` shows monarch-nb-lab enabled
#      - the quickstart notebook runs headless (scripts/run_notebook.py)
#      - `python -m monarch_nb.launch -n 2` runs a torchrun-style all_reduce script
# Environment: PYTHON (for the fresh venv, default python3), BUILD_PY (has build and
# twine, default .venv/bin/python), TORCH_SPEC (pip arguments for torch; default:
# `torch`, which pip's configured find-links / index resolve), ISOLATED=1 (build in
# isolated environments as pip would: minutes, since each installs jupyterlab; the
# default builds with BUILD_PY's environment, after checking that it has every
# package build-system.requires names). Everything goes under a temporary folder,
# removed at the end (KEEP=1 keeps it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD_PY=${BUILD_PY:-.venv/bin/python}
TORCH_SPEC=${TORCH_SPEC:-torch}
work=$(mktemp -d /tmp/mnb-wheel-check.XXXXXX)
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
t0=$(date +%s)
step() { echo "== [wheel-check] $1 ($(( $(date +%s) - t0 )) s)"; }

step "build sdist and wheel into $work/dist"
isolation=()
if [ "${ISOLATED:-0}" != 1 ]; then
  # build's own check: every build-system.requires entry installed in BUILD_PY's env
  "$BUILD_PY" scripts/build_requires.py --missing \
    || { echo "BUILD_PY lacks build requirements: pip install them or ISOLATED=1"; exit 1; }
  isolation=(--no-isolation)
  # as in an isolated build's environment, its bin/ leads the build's PATH (the
  # extension's npm build runs `jupyter labextension build`)
  build_path="$(cd "$(dirname "$BUILD_PY")" && pwd):$PATH"
else
  build_path=$PATH
fi
PATH="$build_path" "$BUILD_PY" -m build "${isolation[@]}" --outdir "$work/dist" . >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
ls -l "$work/dist"
wheel=$(ls "$work"/dist/monarch_nb-*.whl)
sdist=$(ls "$work"/dist/monarch_nb-*.tar.gz)
version=$("$BUILD_PY" -c 'import re,sys; print(re.search(r"^__version__ = \"([^\"]+)\"", open("monarch_nb/__init__.py").read(), re.M).group(1))')
case "$wheel" in *"monarch_nb-$version-"*) ;; *) echo "wheel $wheel is not version $version (monarch_nb/__init__.py)"; exit 1;; esac

step "twine check"
"$BUILD_PY" -m twine check --strict "$wheel" "$sdist"

step "fresh venv: torch ($TORCH_SPEC), the wheel with the demo extra, jupyterlab"
"$PYTHON" -m venv "$work/venv"
vpy="$work/venv/bin/python"
"$vpy" -m pip install --quiet --upgrade pip
# shellcheck disable=SC2086  # TORCH_SPEC is pip arguments
"$vpy" -m pip install --quiet $TORCH_SPEC
"$vpy" -m pip install --quiet "$wheel[demo]" jupyterlab
cd "$work"  # from here on, nothing of the checkout is importable
unset PYTHONPATH
"$vpy" -c 'import monarch_nb, sys; f = monarch_nb.__file__; print("monarch_nb", monarch_nb.__version__, "from", f); sys.exit(0 if "/venv/" in f else 1)'
"$vpy" -m pip list 2>/dev/null | grep -i -E '^(pytest|mypy|playwright|ruff) ' && { echo "dev tools in the user venv"; exit 1; }

step "jupyter labextension list"
"$work/venv/bin/jupyter" labextension list 2>&1 | tee "$work/ext.txt"
grep -E 'monarch-nb-lab .*enabled.*OK' "$work/ext.txt" >/dev/null \
  || { echo "monarch-nb-lab is not listed as enabled and OK"; exit 1; }

step "the quickstart notebook, headless"
cp "$OLDPWD/notebooks/01_quickstart.ipynb" "$work/quickstart.ipynb"
"$vpy" "$OLDPWD/scripts/run_notebook.py" "$work/quickstart.ipynb" > "$work/notebook.txt" 2>&1 \
  || { tail -60 "$work/notebook.txt"; exit 1; }
tail -1 "$work/notebook.txt"

step "python -m monarch_nb.launch -n 2: a torchrun-style all_reduce"
cat > "$work/allreduce.py" <<'PY'
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert (rank, world) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
x = torch.tensor([rank + 1.0])
dist.all_reduce(x)
print(f"allreduce rank {rank}/{world}: {x.item()}")
dist.destroy_process_group()
PY
timeout 300 "$vpy" -m monarch_nb.launch -n 2 allreduce.py > "$work/launch.txt" 2>&1 \
  || { cat "$work/launch.txt"; exit 1; }
cat "$work/launch.txt"
n=$(grep -c 'allreduce rank [01]/2: 3.0' "$work/launch.txt" || true)
[ "$n" = 2 ] || { echo "expected both ranks to print 3.0"; exit 1; }

step "ok: $(basename "$wheel") and $(basename "$sdist") work as users get them"
