"""The rank's side of JupyterLab's visual debugger: breakpoints, stepping and
inspection of the rank's main thread, asked for by the controller
(DEBUGGER requests on the control channel, DEBUGGER_EVENT answers and events).

No debugpy in the rank: a :class:`bdb.Bdb` tracer on the main thread. It is
*armed* only while this rank is debugged and has breakpoints (or a pause was
asked for): then each call runs under ``sys.settrace``, and a breakpoint's
line stops the main thread in :meth:`RankDebugger.user_line`, which waits
there for the controller's next request. Unarmed, a call costs one attribute
check (engine/loop.py).

Threads. The control thread receives every request (:meth:`handle`):

* ``configure`` (which files and lines break, whether this rank is debugged)
  and ``pause`` are done at once (a pause is a SIGINT to the main thread,
  whose handler starts stepping, :meth:`pause_in`);
* requests about the stopped main thread (``thread: live``: stackTrace,
  scopes, variables, evaluate, continue, next, stepIn, stepOut) are queued
  for it: it waits in ``user_line`` and answers itself (an evaluation runs
  where the frame is, as in pdb);
* requests about the last failure (``thread: pm``, post-mortem) are answered
  on the control thread: those frames are finished, nothing runs them.

Answers and events go into :attr:`RankDebugger.outbox`, which the control
thread sends (as it sends the debugger's prompts). Frame and variable ids
are this rank's own, valid until it runs on; the kernel (ui/dapmap.py)
makes them DAP's.

Non-goals: cell paths and DAP's ids (the kernel), sockets (loop.py), text
debugging with pdb (debug.py).
"""

from __future__ import annotations

import bdb
import collections
import itertools
import queue
import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from .debug import _is_machinery

RESUME = frozenset({"continue", "next", "stepIn", "stepOut"})
INSPECT = frozenset({"stackTrace", "scopes", "variables", "evaluate"})
REPR_MAX = 1000  # characters of a value shown in the panel
PAGE_MAX = 1000  # variables in one answer when the client asks for all of them
_SKIP = ("monarch_nb", "monarch_nb.")  # modules a step never stops in
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None))

Answer = tuple[int, str, bool, dict[str, Any], int]  # seq, cmd, ok, body, call


class DebuggerError(Exception):
    """A request that cannot be served (its message goes to the client)."""


class Frames:
    """The frames of one stop (or of one failure), numbered from 1 for the
    client, innermost first, and the values shown, numbered by reference as
    they are listed. Valid until the rank runs on (or the next failure)."""

    def __init__(self, frames: list[tuple[FrameType, int]]) -> None:
        self.frames = frames
        self.refs: dict[int, Any] = {}
        self._next_ref = itertools.count(1)

    def serve(self, cmd: str, args: dict[str, Any]) -> dict[str, Any]:
        if cmd == "stackTrace":
            return self.stack_trace(args)
        if cmd == "scopes":
            return self.scopes(args)
        if cmd == "variables":
            return self.variables(args)
        if cmd == "evaluate":
            return self.evaluate(args)
        raise DebuggerError(f"unknown request {cmd!r}")

    def _frame(self, frame_id: Any) -> FrameType:
        if not isinstance(frame_id, int) or not 1 <= frame_id <= len(self.frames):
            raise DebuggerError(f"no frame {frame_id!r} (it ran on)")
        return self.frames[frame_id - 1][0]

    def stack_trace(self, args: dict[str, Any]) -> dict[str, Any]:
        start = int(args.get("startFrame") or 0)
        levels = int(args.get("levels") or 0) or len(self.frames)
        out = []
        for i, (frame, line) in enumerate(self.frames[start:start + levels], start + 1):
            out.append({"id": i, "name": frame.f_code.co_name, "line": line, "column": 1,
                        "file": frame.f_code.co_filename})
        return {"stackFrames": out, "totalFrames": len(self.frames)}

    def scopes(self, args: dict[str, Any]) -> dict[str, Any]:
        frame = self._frame(args.get("frameId"))
        scopes = []
        if frame.f_locals is not frame.f_globals:  # a function's frame
            scopes.append(("Locals", _Scope(frame.f_locals, module=False)))
        scopes.append(("Globals", _Scope(frame.f_globals, module=True)))
        return {"scopes": [{"name": name, "variablesReference": self._ref(scope),
                            "namedVariables": len(scope.mapping), "expensive": False}
                           for name, scope in scopes]}

    def variables(self, args: dict[str, Any]) -> dict[str, Any]:
        ref = args.get("variablesReference")
        if ref not in self.refs:
            raise DebuggerError(f"no variables {ref!r} (the rank ran on)")
        children = _children(self.refs[ref])
        start = max(0, int(args.get("start") or 0))
        count = int(args.get("count") or 0) or PAGE_MAX
        return {"variables": [self._variable(name, value, expr)
                              for name, value, expr in children[start:start + count]]}

    def evaluate(self, args: dict[str, Any]) -> dict[str, Any]:
        expression = str(args.get("expression", ""))
        frame = self._frame(args.get("frameId") or 1)
        try:
            code = compile(expression, "<debugger>", "eval")
        except SyntaxError:
            if args.get("context") != "repl":
                raise
            # a statement typed into the console: run it, as pdb's "!" does
            exec(compile(expression, "<debugger>", "exec"), frame.f_globals, frame.f_locals)
            return {"result": "", "variablesReference": 0}
        value = eval(code, frame.f_globals, frame.f_locals)
        var = self._variable(expression, value, expression)
        return {"result": var["value"], "type": var["type"],
                "variablesReference": var["variablesReference"]}

    def _variable(self, name: str, value: Any, expr: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"name": name, "value": _repr(value),
                               "type": type(value).__name__,
                               "variablesReference": self._ref(value) if _has_children(value) else 0}
        if expr is not None:
            out["evaluateName"] = expr
        if isinstance(value, (list, tuple)):
            out["indexedVariables"] = len(value)
        return out

    def _ref(self, value: Any) -> int:
        ref = next(self._next_ref)
        self.refs[ref] = value
        return ref


class _Scope:
    """A frame's locals or its module's globals, as the panel lists them."""

    def __init__(self, mapping: Any, module: bool) -> None:
        self.mapping = mapping
        self.module = module


def _repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # a user's __repr__ may fail: say so, never fail the answer
        return f"<repr failed: {type(exc).__name__}: {exc}>"
    return text if len(text) <= REPR_MAX else text[:REPR_MAX] + "..."


def _tensor_like(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "device")


def _has_children(value: Any) -> bool:
    if isinstance(value, _Scope):
        return True
    if isinstance(value, _LEAVES) or callable(value) or isinstance(value, type(sys)):
        return False
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        return len(value) > 0
    if _tensor_like(value):
        return True
    return bool(getattr(value, "__dict__", None))


def _children(value: Any) -> list[tuple[str, Any, str | None]]:
    """(name, value, expression) of what ``value`` holds, in the panel's order."""
    if isinstance(value, _Scope):
        items = list(value.mapping.items())
        if value.module:  # the module's machinery is not the user's state
            items = [(k, v) for k, v in items if not (k.startswith("__") and k.endswith("__"))]
        return [(str(k), v, str(k)) for k, v in items]
    if isinstance(value, dict):
        return [(_repr(k), v, None) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [(str(i), v, None) for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return [(str(i), v, None) for i, v in enumerate(value)]
    if _tensor_like(value):
        return [(k, getattr(value, k), None) for k in ("shape", "dtype", "device")
                if hasattr(value, k)]
    attrs = getattr(value, "__dict__", None) or {}
    return [(str(k), v, None) for k, v in attrs.items()]


def _user_frames(frame: FrameType | None, bottom: FrameType | None) -> list[tuple[FrameType, int]]:
    """Innermost first, from ``frame`` up to (not including) ``bottom``,
    the rank's machinery left out."""
    out = []
    while frame is not None and frame is not bottom:
        if not _is_machinery(frame.f_code.co_filename):
            out.append((frame, frame.f_lineno or 0))
        frame = frame.f_back
    return out


def _failure_frames(exc: BaseException) -> list[tuple[FrameType, int]]:
    """The frames of ``exc``'s traceback, innermost first, machinery left out."""
    out = []
    tb = exc.__traceback__
    while tb is not None:
        if not _is_machinery(tb.tb_frame.f_code.co_filename):
            out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    out.reverse()
    return out


class RankDebugger(bdb.Bdb):
    """This rank's debugger (see the module's docstring).

    ``running()`` is the call the main thread runs (0: idle);
    ``signal_main()`` interrupts the main thread (its SIGINT handler calls
    :meth:`pause_in` while :attr:`pausing`); ``bottom`` is the code of the
    worker's frame that runs each call: frames from there out are not the
    user's."""

    def __init__(self, running: Callable[[], int], signal_main: Callable[[], None],
                 bottom: CodeType) -> None:
        super().__init__()
        self._running = running
        self._signal_main = signal_main
        self._bottom = bottom
        self.armed = False  # read by the worker before each call
        self.tracing = False  # sys.settrace is set on the main thread
        self.pausing = False  # a pause was asked: the SIGINT handler starts stepping
        self.on = False  # this rank is debugged
        self.bps: dict[str, frozenset[int]] = {}
        self.outbox: collections.deque[Answer] = collections.deque()
        self.live: Frames | None = None  # the stopped main thread's frames
        self.pm: Frames | None = None  # the last failure's frames
        self._pm_of: BaseException | None = None
        self._inbox: queue.Queue[tuple[int, str, dict[str, Any]]] = queue.Queue()
        self._lock = threading.Lock()  # live and the inbox change together
        self._reason = "step"
        self._module_skip: dict[str, bool] = {}
        self._stop_at(None, None)

    # -- control thread ------------------------------------------------------------
    def handle(self, seq: int, cmd: str, thread: str, args: dict[str, Any]) -> None:
        """A request from the controller; its answer goes to the outbox
        (now, or from the main thread once it served it)."""
        try:
            if cmd == "configure":
                self.configure(args)
                self._answer(seq, cmd, True, {"armed": self.armed})
            elif cmd == "pause":
                if not self._running():
                    raise DebuggerError("the rank runs no call")
                self.pausing = True
                self._signal_main()
                self._answer(seq, cmd, True, {})
            elif thread == "pm":
                self._answer(seq, cmd, True, self._post_mortem(cmd, args))
            elif cmd in RESUME or cmd in INSPECT:
                with self._lock:
                    if self.live is None:
                        raise DebuggerError("the rank is not stopped")
                    self._inbox.put((seq, cmd, args))
            else:
                raise DebuggerError(f"unknown request {cmd!r}")
        except Exception as exc:
            self._answer(seq, cmd, False, {"message": _message(exc)})

    def configure(self, args: dict[str, Any]) -> None:
        """Which lines break (``breakpoints``: file -> lines, replacing all)
        and whether this rank is debugged (``on``)."""
        self.on = bool(args.get("on"))
        raw = args.get("breakpoints") or {}
        bps = {str(f): frozenset(int(n) for n in lines) for f, lines in raw.items()
               if isinstance(lines, list) and lines} if self.on else {}
        self.bps = bps  # one assignment: the main thread sees the old or the new set
        self.armed = bool(bps)

    def _post_mortem(self, cmd: str, args: dict[str, Any]) -> dict[str, Any]:
        exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if exc is None:
            raise DebuggerError("the rank has no failed call")
        if self.pm is None or self._pm_of is not exc:
            self.pm, self._pm_of = Frames(_failure_frames(exc)), exc
        if cmd == "postmortem":
            return {"error": f"{type(exc).__name__}: {exc}", "frames": len(self.pm.frames)}
        if cmd == "end":
            self.pm = self._pm_of = None
            return {}
        return self.pm.serve(cmd, args)

    def _answer(self, seq: int, cmd: str, ok: bool, body: dict[str, Any], call: int = 0) -> None:
        self.outbox.append((seq, cmd, ok, body, call))

    # -- main thread: a call under the tracer ---------------------------------------------
    def begin(self, frame: FrameType) -> None:
        """A call starts in ``frame`` (the worker's): trace it, stopping only
        at breakpoints. (Not bdb's reset(): it stats every file linecache holds.)"""
        self.botframe = frame
        self._stop_at(frame, None, -1)
        self.tracing = True
        sys.settrace(self.trace_dispatch)

    def end(self) -> None:
        """The call is over."""
        sys.settrace(None)
        self.tracing = False
        self.botframe = None

    def pause_in(self, frame: FrameType | None) -> None:
        """SIGINT handler, main thread: stop at the next line of user code."""
        self.pausing = False
        bottom = frame
        while bottom is not None and bottom.f_code is not self._bottom:
            bottom = bottom.f_back
        f = frame
        while f is not None and f is not bottom:
            f.f_trace = self.trace_dispatch
            f = f.f_back
        self.botframe = bottom
        self._reason = "pause"
        self._stop_at(None, None)
        self.tracing = True
        sys.settrace(self.trace_dispatch)

    def _stop_at(self, stopframe: FrameType | None, returnframe: FrameType | None,
                 lineno: int = 0) -> None:
        """bdb's stop information (its ``_set_stopinfo``, which is private):
        stop in ``stopframe`` at a line >= ``lineno`` (-1: never), or
        anywhere when it is None."""
        self.stopframe, self.returnframe = stopframe, returnframe
        self.quitting = False
        self.stoplineno = lineno

    def trace_dispatch(self, frame: FrameType, event: str, arg: Any) -> Any:
        # Running on to the next breakpoint (the usual state of an armed
        # call): a function in a file without one is not traced at all,
        # decided here without bdb's chain of calls (a quarter of the cost
        # per Python call under the tracer; benchmarks/debugger.py).
        if (event == "call" and self.stoplineno == -1 and self.stopframe is self.botframe
                and frame.f_code.co_filename not in self.bps):
            return None
        return super().trace_dispatch(frame, event, arg)

    # bdb's hooks: where to stop
    def stop_here(self, frame: FrameType) -> bool:
        if frame is self.stopframe:
            if self.stoplineno == -1:
                return False
            return frame.f_lineno >= self.stoplineno and not self._skipped(frame)
        return not self.stopframe and not self._skipped(frame)

    def _skipped(self, frame: FrameType) -> bool:
        name = frame.f_globals.get("__name__") or ""
        skip = self._module_skip.get(name)
        if skip is None:
            skip = self._module_skip[name] = name == _SKIP[0] or name.startswith(_SKIP[1])
        return skip

    def break_here(self, frame: FrameType) -> bool:
        lines = self.bps.get(frame.f_code.co_filename)
        return lines is not None and frame.f_lineno in lines

    def break_anywhere(self, frame: FrameType) -> bool:
        return frame.f_code.co_filename in self.bps

    def user_line(self, frame: FrameType) -> None:
        reason = "breakpoint" if self.break_here(frame) else self._reason
        self._interaction(frame, reason)

    def user_return(self, frame: FrameType, value: Any) -> None:
        # stepOut: stop in the caller, on the line that called (as debugpy
        # does), not on its next line
        caller = frame.f_back
        if frame is self.returnframe and caller is not None and caller is not self.botframe:
            if caller.f_trace is None:
                caller.f_trace = self.trace_dispatch
            self._interaction(caller, "step")

    def _interaction(self, frame: FrameType, reason: str) -> None:
        """The main thread stops here: serve the controller's requests until
        one resumes it (an interrupt ends the wait, and the call)."""
        frames = _user_frames(frame, self.botframe)
        if not frames:
            return
        call = self._running()
        session = Frames(frames)
        with self._lock:
            self.live = session
        top = frames[0]
        self._answer(0, "stopped", True, {"reason": reason, "file": top[0].f_code.co_filename,
                                          "line": top[1]}, call)
        resumed = False
        try:
            while not resumed:
                try:
                    seq, cmd, args = self._inbox.get(timeout=0.2)
                except queue.Empty:
                    continue
                if cmd in RESUME:
                    self._resume(cmd, frame)
                    self._answer(seq, cmd, True, {})
                    resumed = True
                    continue
                try:
                    self._answer(seq, cmd, True, session.serve(cmd, args))
                except KeyboardInterrupt:
                    raise
                except BaseException as exc:  # the user's expression failed: say why
                    self._answer(seq, cmd, False, {"message": _message(exc)})
        finally:
            with self._lock:
                self.live = None
                while not self._inbox.empty():
                    seq, cmd, _ = self._inbox.get_nowait()
                    self._answer(seq, cmd, False, {"message": "the rank ran on"})
            self._answer(0, "continued", True, {}, call)

    def _resume(self, cmd: str, frame: FrameType) -> None:
        self._reason = "step"
        if cmd == "next":
            self.set_next(frame)
        elif cmd == "stepIn":
            self.set_step()
        elif cmd == "stepOut":
            self.set_return(frame)
        else:  # continue: stop only at breakpoints (bdb's set_continue reads its own table)
            self._stop_at(self.botframe, None, -1)
            if not self.bps:
                sys.settrace(None)
                f: FrameType | None = frame
                while f is not None and f is not self.botframe:
                    f.f_trace = None
                    f = f.f_back


def _message(exc: BaseException) -> str:
    if isinstance(exc, DebuggerError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
