"""Rank-side debugging: stack snapshots and the debugger's stdin relay.

Runs inside a rank process. Two jobs:

* :func:`snapshot` — every thread's Python stack as plain data (file, line,
  function, source text), taken by the control thread so it works while the
  main thread is stuck in a collective, a C call or a busy loop. The rank's own
  machinery (the serve loop, the control thread) is left out: the user wants
  their code, and an idle rank shows as ``idle``.
* :class:`RelayStdin` — ``sys.stdin`` of a rank. ``pdb`` (``breakpoint()``,
  ``pdb.set_trace()``, post-mortem) and ``input()`` read from it; each read
  becomes a PROMPT to the controller, which asks the user in the notebook (the
  kernel's input box) and sends the typed line back as INPUT. The control
  thread carries both messages; the main thread only waits on a queue, so an
  interrupt still reaches it.

Non-goals: sockets (loop.py sends and receives), grouping and rendering
stacks (stacks.py, in the controller), deciding who answers (controller).
"""

from __future__ import annotations

import io
import linecache
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

# Files whose frames are the rank's machinery, not the user's code.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MACHINERY = tuple(os.path.join(_PACKAGE, f) for f in (
    "worker.py", "engine/loop.py", "wire/serialize.py", "engine/debug.py", "wire/transport.py",
    "wire/link.py", "wire/channels.py",  # a rank waits for its next call there
    "engine/flightrec.py",  # the recorder's wrapper around each collective
    "engine/membership.py"))  # joins and leaves (mnb.elastic waits there)
CONTROL_THREAD = "monarch-nb-control"

Frame = list[Any]  # [filename, lineno, function, source line]


def _is_machinery(filename: str) -> bool:
    return filename.startswith(_MACHINERY) or filename.startswith("<frozen runpy")


def frames_of(frame: Any) -> list[Frame]:
    """Outermost first, machinery dropped."""
    out: list[Frame] = []
    while frame is not None:
        code = frame.f_code
        if not _is_machinery(code.co_filename):
            # f_lineno is None for a frame being torn down (seen while a
            # destructor runs inside one: gloo's group, freed on return)
            lineno = frame.f_lineno or 0
            line = linecache.getline(code.co_filename, lineno).strip() if lineno else ""
            out.append([code.co_filename, lineno, code.co_name, line])
        frame = frame.f_back
    out.reverse()
    return out


def snapshot(main_thread_id: int) -> list[dict[str, Any]]:
    """Every thread but the control thread: ``{"name", "main", "frames"}``,
    the main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    threads = []
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, f"thread-{ident}")
        if name == CONTROL_THREAD:
            continue
        threads.append({"name": name, "main": ident == main_thread_id,
                        "frames": frames_of(frame)})
    threads.sort(key=lambda t: not t["main"])
    return threads


class RelayStdin(io.TextIOBase):
    """``sys.stdin`` of a rank: a read asks the notebook for a line.

    ``ask(prompt)`` hands the prompt to the control thread (which sends it
    after any output written before it, so the notebook shows the debugger's
    listing above its input box); the answer arrives through :meth:`answer`.
    Only the main thread can ask: a read from another thread gets end of
    file, which a debugger there takes as "quit".
    """

    def __init__(self, ask: Callable[[str], None], take_prompt: Callable[[], str],
                 main_thread_id: int) -> None:
        self._ask = ask
        self._take_prompt = take_prompt
        self._main = main_thread_id
        self._answers: queue.Queue[str] = queue.Queue()
        self.answered = False  # an answer came since the last reset (checked per call)

    def readable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def answer(self, text: str) -> None:
        """Control thread: the line the user typed (``None`` ends input)."""
        self._answers.put(text)
        self.answered = True

    def reset(self) -> None:
        """A new call starts: answers meant for an earlier one are stale.
        (The worker skips this while ``answered`` is False.)"""
        self.answered = False
        while True:
            try:
                self._answers.get_nowait()
            except queue.Empty:
                return

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]  # a text stream
        if threading.get_ident() != self._main:
            return ""
        sys.stdout.flush()
        self._ask(self._take_prompt())
        while True:
            try:  # a short timeout keeps the wait interruptible (Ctrl-C, stop)
                text = self._answers.get(timeout=0.2)
            except queue.Empty:
                continue
            except KeyboardInterrupt:
                # The call was interrupted while its debugger waited: end of
                # input makes pdb quit (it would catch the interrupt and ask
                # again forever) and input() raise EOFError, so the call ends.
                return ""
            if text == "\x04":  # end of input (the user's Ctrl-D, or no front end)
                return ""
            return text if text.endswith("\n") else text + "\n"

    def read(self, size: int | None = -1) -> str:
        return self.readline()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


def breakpointhook(*args: Any, **kwargs: Any) -> None:
    """``breakpoint()`` on a rank: pdb in the caller's frame, without pdb's
    own SIGINT handler (the notebook's interrupt button must keep raising
    KeyboardInterrupt in the cell, not open the debugger)."""
    import pdb

    pdb.Pdb(nosigint=True).set_trace(sys._getframe(1))


def post_mortem() -> None:
    """Run pdb post-mortem on this rank's last failure (``%monarch debug``).

    The worker records each failed call in ``sys.last_exc`` like the
    interactive interpreter does; the rank's own frames are skipped so the
    debugger opens in user code."""
    import pdb

    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exc is None or exc.__traceback__ is None:
        from . import context as _context

        raise LookupError(
            f"rank {_context.rank()} has no failed call to debug; run the failing cell "
            "first, then %monarch debug RANK"
        )
    tb = exc.__traceback__
    while tb.tb_next is not None and _is_machinery(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    print(f"post-mortem of {type(exc).__name__}: {exc}  (type 'q' or 'c' to leave)")
    debugger = pdb.Pdb(nosigint=True)
    debugger.reset()
    debugger.interaction(None, tb)
