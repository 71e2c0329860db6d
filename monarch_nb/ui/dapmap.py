"""What JupyterLab's debugger calls things, and what the ranks call them: the
pure translation tables of the kernel's debugger multiplexer (labdebug.py).

* :class:`SourceMap`: a ``%%monarch`` cell is, in the notebook, the file
  ``dumpCell`` named after the cell's whole text (``/tmp/ipykernel_P/H.py``,
  the ``%%monarch`` line its line 1) and, on the ranks, ``<mnb-cell-N>``,
  the cell's body from its line 1. Lines move by the header's length.
* :class:`Ids`: DAP numbers threads, frames and variable references for the
  whole kernel; the kernel's own debugpy numbers its own from 1 up. A
  rank's threads (its stop in a call, its last failure, its death) and the
  frames and references each rank numbers from 1 get numbers from
  :data:`BASE` up, so the two never meet and each request finds its owner.

Pure data: no kernel, no mesh, no I/O. Non-goals: routing requests
(labdebug.py), the ranks' side (engine/dap_rank.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

BASE = 1 << 30  # far above debugpy's own numbers, within JavaScript's safe integers
KINDS = ("live", "pm", "dead")  # a rank's threads: stopped in a call, post-mortem, dead
_LABELS = {"live": "rank {}", "pm": "rank {} (post-mortem)", "dead": "rank {} (dead)"}
CELL_MAGIC = "%%monarch"


def is_mesh_cell(code: str) -> bool:
    """Is ``code`` a ``%%monarch`` cell (its first line that is not blank)?"""
    for line in code.splitlines():
        if line.strip():
            word = line.split(None, 1)[0]
            return word == CELL_MAGIC
    return False


def header_lines(raw: str, body: str) -> int:
    """How many lines of the cell's text ``raw`` come before ``body``, the
    part the ranks run (the ``%%monarch`` line, and any blank lines above it)."""
    if raw.rstrip("\n").endswith(body.rstrip("\n")):
        head = raw[:len(raw.rstrip("\n")) - len(body.rstrip("\n"))]
        return head.count("\n") + (0 if head.endswith("\n") else 1)  # (an empty body)
    return 1


@dataclass(frozen=True)
class Cell:
    name: str  # on the ranks: <mnb-cell-N>
    path: str  # in the notebook: the file dumpCell names
    offset: int  # notebook line = rank line + offset


@dataclass
class SourceMap:
    """``%%monarch`` cells both ways. A cell run again with the same text
    keeps its path and gets one more name: the functions its earlier runs
    defined still run on the ranks under the earlier names."""

    by_path: dict[str, list[Cell]] = field(default_factory=dict)
    by_name: dict[str, Cell] = field(default_factory=dict)

    def add(self, name: str, path: str, offset: int) -> Cell:
        cell = Cell(name, path, offset)
        self.by_path.setdefault(path, []).append(cell)
        self.by_name[name] = cell
        return cell

    def to_ranks(self, path: str, lines: list[int]) -> list[tuple[str, list[int]]]:
        """A notebook file's lines as the ranks know them, under each name
        the cell ran as; [] for a cell not run yet."""
        return [(cell.name, [n - cell.offset for n in lines if n - cell.offset >= 1])
                for cell in self.by_path.get(path, [])]

    def to_notebook(self, file: str, line: int) -> tuple[str, int]:
        """A rank's file and line as the notebook shows them (other files as they are)."""
        cell = self.by_name.get(file)
        if cell is None:
            return file, line
        return cell.path, line + cell.offset


@dataclass
class Ids:
    """DAP's numbers for the ranks' threads, frames and variable references."""

    frames: dict[int, tuple[int, str, int]] = field(default_factory=dict)  # id -> rank, kind, rank's id
    refs: dict[int, tuple[int, str, int]] = field(default_factory=dict)
    _next: Any = field(default_factory=lambda: itertools.count(BASE))

    @staticmethod
    def thread(rank: int, kind: str) -> int:
        return BASE + rank * len(KINDS) + KINDS.index(kind)

    @staticmethod
    def thread_of(thread_id: Any) -> tuple[int, str] | None:
        """``(rank, kind)`` of a rank's thread id, else None (the kernel's own)."""
        if not isinstance(thread_id, int) or isinstance(thread_id, bool) or thread_id < BASE:
            return None
        rank, kind = divmod(thread_id - BASE, len(KINDS))
        return rank, KINDS[kind]

    @staticmethod
    def label(rank: int, kind: str) -> str:
        return _LABELS[kind].format(rank)

    def frame(self, rank: int, kind: str, local: int) -> int:
        n = next(self._next)
        self.frames[n] = (rank, kind, local)
        return n

    def ref(self, rank: int, kind: str, local: int) -> int:
        if not local:
            return 0  # nothing to expand
        n = next(self._next)
        self.refs[n] = (rank, kind, local)
        return n

    def forget(self, rank: int, kind: str) -> None:
        """The thread ran on (or was dismissed): its numbers mean nothing now."""
        for table in (self.frames, self.refs):
            for n in [n for n, (r, k, _) in table.items() if r == rank and k == kind]:
                del table[n]


def frames_to_client(ids: Ids, sources: SourceMap, rank: int, kind: str,
                     body: dict[str, Any]) -> dict[str, Any]:
    """A rank's stackTrace answer as DAP's: numbers made the kernel's, cells
    shown at their notebook file and line, other files at their path."""
    out = []
    for f in body.get("stackFrames") or []:
        path, line = sources.to_notebook(str(f.get("file", "")), int(f.get("line") or 0))
        source: dict[str, Any] = {"name": path.rsplit("/", 1)[-1]}
        if not path.startswith("<"):
            source["path"] = path
        out.append({"id": ids.frame(rank, kind, int(f.get("id") or 0)), "name": f.get("name", "?"),
                    "line": line, "column": int(f.get("column") or 1), "source": source})
    return {"stackFrames": out, "totalFrames": int(body.get("totalFrames") or len(out))}


def refs_to_client(ids: Ids, rank: int, kind: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Scopes or variables with their references made the kernel's."""
    return [{**item, "variablesReference": ids.ref(rank, kind, int(item.get("variablesReference") or 0))}
            for item in items]
