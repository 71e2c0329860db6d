"""``.. monarch-magics::``: the magics reference, generated from the parsers.

Imports the ``magic_arguments`` parsers behind ``%monarch`` / ``%%monarch``
(``monarch_nb.ui.magics._Parsers``, one method per subcommand) and writes each
parser's own ``--help`` text, so the reference cannot drift from the code: no
text here is copied by hand. ``%monarch help``'s summary (``HELP``) comes first.
"""

from __future__ import annotations

import importlib
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

MODULE = "monarch_nb.ui.magics"


def _parsers() -> tuple[str, list[tuple[str, Any]]]:
    mod = importlib.import_module(MODULE)
    holder = mod._Parsers
    found = []
    for name, fn in vars(holder).items():
        parser = getattr(fn, "parser", None)
        if parser is None:
            continue
        parser.prog = "%%monarch" if name == "cell" else f"%monarch {name}"
        found.append((name, parser))
    return mod.HELP, found


class MagicsReference(SphinxDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        help_text, parsers = _parsers()
        out: list[nodes.Node] = []
        summary = nodes.section(ids=["magics-summary"])
        summary += nodes.title(text="What %monarch help prints")
        summary += nodes.literal_block(help_text, help_text)
        out.append(summary)
        for name, parser in parsers:
            title = parser.prog
            sec = nodes.section(ids=[f"magic-{name}"])
            sec += nodes.title(text=title)
            text = parser.format_help().rstrip()
            sec += nodes.literal_block(text, text)
            out.append(sec)
        return out


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("monarch-magics", MagicsReference)
    setup_launch(app)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


class LaunchHelp(SphinxDirective):
    """``.. monarch-launch-help::``: ``python -m monarch_nb.launch --help``."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        mod = importlib.import_module("monarch_nb.launchopts")
        text = mod.build_parser().format_help().rstrip()
        return [nodes.literal_block(text, text)]


def setup_launch(app: Sphinx) -> None:
    app.add_directive("monarch-launch-help", LaunchHelp)
