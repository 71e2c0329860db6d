"""What a cell says of what happened: ranks respawned since the last call,
and where each rank stopped when the user interrupted it.

A rank that died and came back between cells has a new, empty namespace
(its setup cells replayed); without a word the user meets that later as a
NameError on one rank. :func:`respawn_notices` reads ``mesh.events`` (the
dicts of :class:`~monarch_nb.controller.life.events.Event`) after a cursor and
says it in one line per story, ranks that share it grouped:
``rank 1 was respawned at 12:03:04 (killed by SIGKILL); its namespace is
new: setup cells replayed``.

Non-goals: when to say it (mesh.py: before a blocking call, the cursor
moved past what a running call already announced), the events themselves.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .rankspans import format_ranks

# event kinds by value (controller/life/events.py): read as strings, so a kind
# renamed there only silences the line, never breaks a call
_GONE = ("died", "replaced")
_BACK = "ready"
_SETUP_FAILED = "setup_failed"


def respawn_notices(events: Sequence[Mapping[str, Any]], since: float,
                    setup_names: Iterable[str]) -> list[str]:
    """Lines for the ranks that went away after ``since`` (event time) and
    are back (READY of a later incarnation), grouped by identical story."""
    setups = list(setup_names)
    gone: dict[int, tuple[int, str]] = {}  # rank -> (incarnation, how)
    back: dict[int, float] = {}
    failed: dict[int, str] = {}
    for ev in events:
        if float(ev.get("time", 0.0)) <= since:
            continue
        rank, inc, kind = int(ev.get("rank", -1)), int(ev.get("incarnation", 0)), str(ev.get("kind"))
        if rank < 0:
            continue
        if kind in _GONE:
            how = str(ev.get("detail") or kind)
            if kind == "replaced":
                how = f"replaced: {how}" if ev.get("detail") else "replaced"
            gone[rank] = (inc, how)
            back.pop(rank, None)
            failed.pop(rank, None)
        elif kind == _BACK and rank in gone and inc > gone[rank][0]:
            back[rank] = float(ev["time"])
        elif kind == _SETUP_FAILED and rank in back:
            failed[rank] = str(ev.get("detail", ""))
    stories: dict[tuple[str, str, str], list[int]] = {}
    for rank in sorted(back):
        when = time.strftime("%H:%M:%S", time.localtime(back[rank]))
        how = _first_clause(gone[rank][1])
        if rank in failed:
            ns = f"replaying setup cell {failed[rank]}" if failed[rank] else "a setup cell failed"
        elif setups:
            ns = "setup cells replayed"
        else:
            ns = "no setup cells"
        stories.setdefault((when, how, ns), []).append(rank)
    lines = []
    for (when, how, ns), ranks in stories.items():
        who = (f"rank {ranks[0]} was" if len(ranks) == 1
               else f"ranks {format_ranks(ranks)} were")
        lines.append(f"{who} respawned at {when} ({how}); its namespace is new: {ns}"
                     if len(ranks) == 1 else
                     f"{who} respawned at {when} ({how}); their namespaces are new: {ns}")
    return lines


def _first_clause(detail: str) -> str:
    """The exit without the controller's longer hint (``killed by SIGKILL:
    the OOM killer ...`` keeps the hint: it is the story)."""
    return detail.splitlines()[0] if detail else "died"


class CellInterrupted(KeyboardInterrupt):
    """A blocking call interrupted by the user (Ctrl-C, the kernel's
    interrupt): still a ``KeyboardInterrupt`` for Python code, rendered by
    IPython as one line per group of ranks, where each one stopped (its
    innermost cell or user frame), not the controller's stack."""

    def __init__(self, where: Mapping[int, str]) -> None:
        self.where = dict(where)
        super().__init__(self.summary())

    def summary(self) -> str:
        return "\n".join(self.render_lines()[1:]) if self.where else ""

    def render_lines(self) -> list[str]:
        groups: dict[str, list[int]] = {}
        for rank in sorted(self.where):
            groups.setdefault(user_location(self.where[rank]), []).append(rank)
        if not groups:
            return ["KeyboardInterrupt"]
        lines = [f"KeyboardInterrupt: interrupted rank(s) {format_ranks(sorted(self.where))}"]
        for loc, ranks in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1])):
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
            lines.append(f"  {who}: {loc}")
        return lines

    def _render_traceback_(self) -> list[str]:  # IPython hook
        return self.render_lines()

    def __reduce__(self) -> tuple[Any, ...]:
        return (CellInterrupted, (self.where,))


_WHERE = re.compile(r"^(?P<file>.+?) line (?P<line>\d+) in (?P<fn>[^:]+?)(?:: (?P<src>.*))?$")


def user_location(where: str) -> str:
    """``<mnb-cell-3>:5 in f (time.sleep(9))`` from the worker's
    description (engine/loop.py describe_frame: the innermost frame, then
    the innermost cell frame after " <- "): the user's frame, not ours."""
    parts = where.split(" <- ")
    part = parts[-1]
    m = _WHERE.match(part)
    if m is None:
        return where
    text = f"stopped at {m['file']}:{m['line']} in {m['fn']}"
    return f"{text} ({m['src']})" if m["src"] else text


# The kernel's error reply names an exception by ``__name__`` (ename): front
# ends that recognise an interrupted cell by "KeyboardInterrupt" keep doing so.
CellInterrupted.__name__ = "KeyboardInterrupt"
