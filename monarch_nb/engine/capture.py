"""Rank-side output capture: ``sys.stdout``/``sys.stderr`` replacements that
keep a copy in the rank's log and queue the text for the controller.

The main thread writes (user code prints); the control thread takes queued
text and sends it as OUTPUT chunks while the call runs; at the end of a call
the main thread takes the rest and ships it inside the RESULT, together with
how many chunks went out before, so the controller can print everything in
order before it resolves the call.

Non-goals: sockets (loop.py owns them), formatting (the controller labels
and folds lines).
"""

from __future__ import annotations

import io
import threading
from typing import Any, TextIO

# Per call and stream, text beyond this is not forwarded to the notebook (the
# rank's log file still has all of it): a runaway print loop must not flood
# the browser or the kernel's memory.
FORWARD_LIMIT = 8 * 1024 * 1024


class OutputBuffer:
    """Text waiting to be forwarded, attributed to the running call."""

    def __init__(self, limit: int = FORWARD_LIMIT) -> None:
        self._lock = threading.Lock()
        # [stream, [texts]]: a list of pieces, joined when taken — appending to
        # one growing string would be quadratic for chatty ranks.
        self._items: list[list[Any]] = []
        self._pending = 0
        self.call = 0
        self.chunks = 0  # OUTPUT chunks taken for the current call
        self._forwarded = 0
        self._dropped = 0
        self._tail = ""  # the unfinished stdout line already taken by take_chunk
        self.limit = limit

    def begin(self, call: int) -> list[list[str]]:
        """Start attributing output to ``call``; returns what was left over
        from outside any call (background threads)."""
        with self._lock:
            self.call, self.chunks, self._forwarded, self._dropped = call, 0, 0, 0
            self._tail = ""
            items = self._items
            if not items:  # the usual case: nothing printed between calls
                return []
            self._items, self._pending = [], 0
            return _joined(items)

    def write(self, stream: str, text: str) -> None:
        with self._lock:
            if self._forwarded >= self.limit:
                self._dropped += len(text)
                return
            self._forwarded += len(text)
            items = self._items
            if items and items[-1][0] == stream:
                items[-1][1].append(text)
            else:
                items.append([stream, [text]])
            self._pending += len(text)

    @property
    def pending(self) -> int:
        return self._pending

    def take_chunk(self) -> tuple[int, int, list[list[str]]] | None:
        """(call, chunk number, items) for the control thread, or None."""
        with self._lock:
            if not self._items:
                return None
            items, self._items, self._pending = self._items, [], 0
            n = self.chunks
            self.chunks += 1
            joined = _joined(items)
            for stream, text in joined:  # the unfinished stdout line that goes out now
                if stream == "stdout":
                    cut = text.rfind("\n") + 1
                    self._tail = text[cut:] if cut else self._tail + text
            return self.call, n, joined

    def take_partial(self, stream: str = "stdout") -> str:
        """Remove and return the unfinished last line of ``stdout`` (a
        debugger's ``(Pdb) `` prompt, which the notebook shows in its input
        box instead of as output). The control thread may have sent its
        beginning already (it sends on its own clock, between the write and
        the read): that part is remembered (``_tail``) and put in front."""
        with self._lock:
            tail, self._tail = self._tail, ""
            items = self._items
            if not items:
                return tail  # all of it went out already
            if items[-1][0] != stream:
                return ""
            text = "".join(items[-1][1])
            cut = text.rfind("\n") + 1
            partial = text[cut:]
            self._pending -= len(partial)
            if cut:
                items[-1][1] = [text[:cut]]
                return partial
            items.pop()
            if any("\n" in t for s, texts in items if s == stream for t in texts):
                return partial  # the line began after a newline not sent yet
            return tail + partial  # the line began in a chunk already sent

    def finish(self) -> tuple[int, list[list[str]]]:
        """End the call: (chunks already taken, remaining items)."""
        with self._lock:
            items = self._items
            if items:
                items, self._items, self._pending = _joined(items), [], 0
            if self._dropped:
                items.append(
                    ["stderr", f"[monarch_nb: {self._dropped} more characters of output not "
                               "shown; see %monarch logs]\n"]
                )
            n = self.chunks
            self.call, self.chunks, self._forwarded, self._dropped = 0, 0, 0, 0
            self._tail = ""
            return n, items


def _joined(items: list[list[Any]]) -> list[list[str]]:
    return [[stream, "".join(pieces)] for stream, pieces in items]


class RankStream(io.TextIOBase):
    """A text stream that tees into the log (the process's real fd) and into
    an :class:`OutputBuffer`."""

    def __init__(self, name: str, buffer: OutputBuffer, log: TextIO | None) -> None:
        self.name = name
        self._buffer = buffer
        self._log = log

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if not text:
            return 0
        self._buffer.write(self.name, text)
        if self._log is not None:
            try:
                self._log.write(text)
            except (OSError, ValueError):
                pass
        return len(text)

    def flush(self) -> None:
        if self._log is not None:
            try:
                self._log.flush()
            except (OSError, ValueError):
                pass

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"
