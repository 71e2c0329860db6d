#!/usr/bin/env python3
"""Write the example notebooks from scripts/notebook_sources.py and execute them.

The notebooks in ``notebooks/`` are committed *with* their outputs: nbval
(``make test``) re-runs them and compares the outputs of the cells marked
``# NBVAL_CHECK_OUTPUT`` with the stored ones. Edit a notebook here, then
re-create and re-execute it (each in a fresh kernel that is this very
interpreter, on a local 4-rank CPU mesh)::

    .venv/bin/python scripts/build_notebooks.py            # all of them
    .venv/bin/python scripts/build_notebooks.py 03          # names starting with 03

Outputs are stored as the kernel produced them, except that this checkout's
absolute path is replaced with ``.`` (tracebacks of unchecked cells would
otherwise carry the path of whoever built them) and the live dashboard keeps
only its text fallback (a stored widget view has no kernel to draw it).

Non-goals: checking outputs (nbval does, with notebooks/nbval_sanitize.cfg),
printing the run (scripts/run_notebook.py, ``make demo``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from notebook_sources import NOTEBOOKS  # noqa: E402
from run_notebook import _local_kernel  # noqa: E402


def build(cells: list[tuple[str, str, list[str]]]) -> Any:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, source, tags) in enumerate(cells):
        cell = (nbformat.v4.new_markdown_cell(source) if kind == "md"
                else nbformat.v4.new_code_cell(source))
        cell["id"] = f"cell-{i:02d}"  # stable ids: rebuilding changes only what changed
        if tags:
            cell.metadata["tags"] = list(tags)
        nb.cells.append(cell)
    return nb


def _scrub(nb: Any) -> None:
    root = str(ROOT)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = out["text"].replace(root, ".")
            if "traceback" in out:
                out["traceback"] = [t.replace(root, ".") for t in out["traceback"]]
            # The dashboard is a live widget: without its kernel a stored view shows
            # "model not found", so keep the text fallback (the status table).
            out.get("data", {}).pop("application/vnd.jupyter.widget-view+json", None)
            for key in ("text/plain", "text/html"):
                if key in out.get("data", {}):
                    out["data"][key] = out["data"][key].replace(root, ".")
    nb.metadata.pop("widgets", None)
    nbformat.validator.normalize(nb)


def execute(nb: Any, path: Path) -> float:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mnb-kernels-") as kernel_dir:
        client = NotebookClient(nb, km=_local_kernel(Path(kernel_dir)), timeout=300,
                                startup_timeout=120, record_timing=False,
                                resources={"metadata": {"path": str(path.parent)}})
        client.execute(cleanup_kc=True)
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="notebook name prefixes (default: all)")
    parser.add_argument("--no-execute", action="store_true", help="write them without outputs")
    args = parser.parse_args(argv)
    for name, cells in NOTEBOOKS.items():
        if args.only and not any(name.startswith(p) for p in args.only):
            continue
        path = ROOT / "notebooks" / f"{name}.ipynb"
        nb = build(cells)
        took = 0.0 if args.no_execute else execute(nb, path)
        _scrub(nb)
        nbformat.write(nb, path)
        print(f"{path.relative_to(ROOT)}: {len(nb.cells)} cells"
              + ("" if args.no_execute else f", executed in {took:.1f} s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
