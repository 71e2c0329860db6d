"""The committed notebooks are what scripts/notebook_sources.py says (cell by
cell, tags included) and were executed: an edit made on only one side fails
here, before nbval runs a stale notebook. No processes."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from notebook_sources import NOTEBOOKS  # noqa: E402


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_matches_its_source_and_was_run(name: str) -> None:
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    stored = [(("md" if c.cell_type == "markdown" else "code"), c.source,
               list(c.metadata.get("tags", []))) for c in nb.cells]
    assert stored == [tuple(c) for c in NOTEBOOKS[name]], (
        f"notebooks/{name}.ipynb differs from scripts/notebook_sources.py: "
        "run `make notebooks` (or scripts/build_notebooks.py)")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "stored without running it"
    assert code[-1].source.strip() == "%monarch stop", "each notebook stops its own mesh"


def test_every_notebook_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in NOTEBOOKS:
        assert f"(notebooks/{name}.ipynb)" in readme, name
