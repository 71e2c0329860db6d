"""Where rank output goes: the cell (or terminal) that issued the call.

:class:`CallOutput` is created on the thread that issues a call and captures
*where* that is: inside an IPython kernel, the parent header of the running
cell, so output of a ``--no-block`` call keeps landing in the cell that
started it, not whichever cell runs later; elsewhere, the ``sys.stdout`` and
``sys.stderr`` of that moment. The controller's I/O thread feeds it text.

Lines are labelled with the rank (``[3] loss 0.1``). Identical lines that
several ranks print at about the same time (within ``FOLD_S``) are folded into
one line naming the ranks (``[0-3] epoch 1``), keeping each rank's own order.

Non-goals: widgets (dashboard), deciding what a call is (controller).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Collection
from typing import Any

from ...selection import format_ranks
from ...wire import payloads

FOLD_S = 0.05  # how long complete lines wait for identical lines from peers
PARTIAL_S = 0.5  # how long a line without newline waits for the rest

Emit = Callable[[str, str], None]  # (stream name, text)


def _kernel_emitter() -> Emit | None:
    """An emitter bound to the current cell, or None outside a kernel."""
    ipython_mod = sys.modules.get("IPython")
    if ipython_mod is None:
        return None
    shell = ipython_mod.get_ipython()
    kernel = getattr(shell, "kernel", None)
    if kernel is None or getattr(kernel, "session", None) is None:
        return None
    try:
        parent = kernel.get_parent("shell")
    except TypeError:  # ipykernel < 6.?
        parent = kernel.get_parent()
    session, iopub = kernel.session, kernel.iopub_socket

    def emit(stream: str, text: str) -> None:
        # iopub_socket is ipykernel's BackgroundSocket: sends are handed to its
        # own I/O thread, so this is safe from our I/O thread.
        session.send(iopub, "stream", {"name": stream, "text": text}, parent=parent,
                     ident=f"stream.{stream}".encode())

    return emit


def _stream_emitter() -> Emit:
    out, err = sys.stdout, sys.stderr

    def emit(stream: str, text: str) -> None:
        target = err if stream == "stderr" else out
        try:
            target.write(text)
            target.flush()
        except (OSError, ValueError):
            pass

    return emit


def current_emitter() -> Emit:
    return _kernel_emitter() or _stream_emitter()


class CallOutput:
    """Labels, folds and emits one call's rank output. Fed on the I/O thread."""

    def __init__(self, emit: Emit | None = None, *, fold: bool = True) -> None:
        self.emit = emit or current_emitter()
        self.fold = fold
        # stream -> rank -> complete lines not yet emitted
        self._lines: dict[str, dict[int, list[str]]] = {}
        self._partial: dict[tuple[str, int], str] = {}
        self._partial_since: dict[tuple[str, int], float] = {}
        self._oldest: float | None = None

    def feed(self, rank: int, stream: str, text: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        key = (stream, rank)
        text = self._partial.pop(key, "") + text
        *complete, rest = text.split("\n")
        if complete:
            self._lines.setdefault(stream, {}).setdefault(rank, []).extend(complete)
            if self._oldest is None:
                self._oldest = now
            self._partial_since.pop(key, None)  # a new partial starts its own clock
        if rest:
            self._partial[key] = rest
            self._partial_since.setdefault(key, now)
        else:
            self._partial_since.pop(key, None)
        if not self.fold:
            self.flush(force=False, now=float("inf"))

    def note(self, text: str, stream: str = "stderr") -> None:
        """A line of its own (events, warnings), after pending rank output.
        An unfinished line younger than ``FOLD_S`` is not cut by it: its rest
        usually follows within milliseconds (print() writes in pieces)."""
        self.flush(force=True, partial_age=FOLD_S)
        self.emit(stream, text if text.endswith("\n") else text + "\n")

    @property
    def pending(self) -> bool:
        return self._oldest is not None or bool(self._partial)

    def take_partial(self, rank: int, stream: str = "stdout") -> str:
        """Remove and return ``rank``'s unfinished line (a prompt that will be
        shown in the input box instead)."""
        self._partial_since.pop((stream, rank), None)
        return self._partial.pop((stream, rank), "")

    def flush(self, force: bool = False, now: float | None = None,
              partial_age: float = 0.0, ranks: Collection[int] | None = None) -> None:
        """Emit what is due. ``force``: all complete lines, and unfinished
        ones at least ``partial_age`` old; otherwise those wait ``PARTIAL_S``.
        ``ranks``: force out only these ranks' unfinished lines (a call that
        ended on them; an output shared with other calls, as script mode's,
        keeps the others' half-written lines until their rest comes)."""
        now = time.monotonic() if now is None else now
        if self._oldest is not None and (force or now - self._oldest >= FOLD_S):
            lines, self._lines, self._oldest = self._lines, {}, None
            for stream, by_rank in lines.items():
                self.emit(stream, render(by_rank))
        if not self._partial:
            return
        due = [k for k, since in self._partial_since.items()
               if now - since >= (partial_age if force and (ranks is None or k[1] in ranks)
                                  else PARTIAL_S)]
        if due and self._oldest is not None:
            # a rank's partial line must never overtake its earlier complete lines
            lines, self._lines, self._oldest = self._lines, {}, None
            for stream, by_rank in lines.items():
                self.emit(stream, render(by_rank))
        for key in sorted(due, key=lambda k: k[1]):
            stream, rank = key
            text = self._partial.pop(key)
            del self._partial_since[key]
            self.emit(stream, f"[{rank}] {text}\n")


def render(by_rank: dict[int, list[str]]) -> str:
    """Fold lines position by position: line i of every rank that printed the
    same text at position i is shown once, labelled with all those ranks."""
    out: list[str] = []
    depth = max((len(v) for v in by_rank.values()), default=0)
    ranks = sorted(by_rank)
    for i in range(depth):
        groups: dict[str, list[int]] = {}
        for r in ranks:
            seq = by_rank[r]
            if i < len(seq):
                groups.setdefault(seq[i], []).append(r)
        for text, who in groups.items():
            out.append(f"[{format_ranks(who)}] {text}\n")
    return "".join(out)


def describe_where(where: dict[int, Any]) -> str:
    return "; ".join(f"rank {r}: {w}" for r, w in sorted(where.items()))


def decode_items(frame: Any) -> list[tuple[str, str]]:
    """Output text of a verified message: JSON ``[[stream, text], ...]``
    (JSON, not pickle: output is data, never code)."""
    try:
        return payloads.decode_output(frame)
    except payloads.PayloadError:
        return [("stderr", "[monarch_nb: unreadable output chunk dropped]\n")]
