"""Sphinx configuration of the monarch_nb documentation site (``make docs``)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS / "_ext"))

import monarch_nb  # noqa: E402

project = "monarch_nb"
author = "monarch_nb developers"
copyright = "monarch_nb developers"
release = monarch_nb.__version__  # the one version source
version = release

extensions = [
    "myst_nb",  # Markdown (myst-parser) and notebooks with their stored outputs
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.viewcode",
    "magics_ref",  # docs/_ext/magics_ref.py: the magics reference from the parsers
]

# notebooks/ are shown as stored (nbval executes them in `make test`), copied
# here at build time so they sit under the source folder.
nb_execution_mode = "off"
NB_OUT = DOCS / "notebooks"
NB_OUT.mkdir(exist_ok=True)
for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
    target = NB_OUT / nb.name
    if not target.exists() or target.read_bytes() != nb.read_bytes():
        shutil.copyfile(nb, target)

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "monarch.md", "Thumbs.db", ".DS_Store", "**/.ipynb_checkpoints"]
suppress_warnings = ["mystnb.unknown_mime_type"]  # widget views have a text/plain fallback

autosummary_generate = True
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False  # concurrent.futures.Future's own docstrings are not reST-clean
templates_path = ["_templates"]  # classes: one autoclass page, no inherited-member tables

html_theme = "furo"
html_title = f"monarch_nb {release}"
html_static_path = ["_static"]

# Internal links: myst-parser warns on every Markdown link to a missing page or
# anchor (warnings are errors in `make docs` and CI); scripts/check_doc_links.py
# checks the README's relative links. `-b linkcheck` would need the internet,
# so it skips every external address here.
linkcheck_ignore = [r"https?://.*"]
