"""JupyterLab's visual debugger on the mesh's ranks: the kernel's side.

JupyterLab speaks the Jupyter debugger protocol to the kernel (DAP requests
in ``debug_request`` on the control channel, ``debug_event`` on IOPub), and
the kernel's debugpy sees only the kernel. :func:`install` (``%load_ext
monarch_nb``) puts a multiplexer in front of ipykernel's handler
(``Kernel.do_debug_request``): requests about ``%%monarch`` cells and the
ranks' threads go to the mesh's ranks (``Mesh.debugger()``'s handle,
connected by ``%monarch debugger``), everything else to the kernel's own
debugger, unchanged. With no mesh debugged, only ``dumpCell``,
``setBreakpoints`` and ``debugInfo`` are looked at on their way through.

* Sources: ``dumpCell`` of a ``%%monarch`` cell marks its path as a mesh
  cell's; when the cell runs, its path and its name on the ranks
  (``<mnb-cell-N>``) are paired (:func:`before_cell`, called by the magic)
  and the breakpoints JupyterLab set on that path go to the debugged ranks,
  before the cell does. Breakpoints in other real files (a library) go to
  the kernel's debugger and to the ranks.
* Threads: each debugged rank is a thread (``rank 1``); after a call failed
  on a debugged rank, ``rank 1 (post-mortem)``; after one died of a signal,
  ``rank 1 (dead)`` (its last Python stack from its log, no locals). A
  stop is a ``stopped`` event, its end ``continued``; when one rank
  continues and another still stands stopped, that one is shown again
  (JupyterLab shows the last stopped thread). A step naming a thread of
  the kernel that the kernel's debugger has not stopped acts on the rank's
  thread shown: JupyterLab's *continue* names thread 1
  (:meth:`LabDebugger._shown_instead`).
* Ids: dapmap.py makes the ranks' numbers the kernel's.

Requests are answered on the kernel's control thread (an asyncio loop): a
rank's answer is awaited there, never on the thread running the cell, which
leads the mesh's I/O meanwhile. Events come from the thread leading the
mesh's I/O.

Non-goals: the rank side (engine/dap_rank.py), the translation tables
(dapmap.py), the selection and requests (controller/rankdebug.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .dapmap import Ids, SourceMap, frames_to_client, header_lines, is_mesh_cell, refs_to_client

if TYPE_CHECKING:
    from ..mesh import RankDebugger  # what Mesh.debugger() returns

STEP_COMMANDS = ("continue", "next", "stepIn", "stepOut")
MAX_UNMAPPED = 2000  # %%monarch cells kept for pairing with their paths later
BREAKPOINTS_WAIT_S = 10.0  # for the ranks to take new breakpoints


class LabDebugger:
    """The multiplexer of one kernel (see the module's docstring)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._inner: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] = kernel.do_debug_request
        self.handle: RankDebugger | None = None
        self.sources = SourceMap()
        self.ids = Ids()
        self.mesh_paths: set[str] = set()  # dumpCell said: a %%monarch cell
        self.breakpoints: dict[str, list[dict[str, Any]]] = {}  # path -> as JupyterLab set them
        self.shown: dict[int, dict[str, Any]] = {}  # a rank's thread shown stopped -> what it is
        self.current: int | None = None  # the rank's thread last announced stopped, until it continues
        self.raw_cell = ""  # the text of the cell running now (pre_run_cell)
        self._cells: list[tuple[str, str, str]] = []  # (name, raw, body), not paired yet
        self._lock = threading.Lock()  # ids and shown: the control thread and the I/O leader
        self._seq = itertools.count(1)

    # -- the magics' side ------------------------------------------------------------
    def connect(self, handle: RankDebugger | None) -> None:
        """Debug with ``handle`` (a mesh's, from ``Mesh.debugger()``), or
        stop (None): its ranks get the breakpoints set so far."""
        if self.handle is not None and self.handle is not handle:
            if self._on_event in self.handle.listeners:
                self.handle.listeners.remove(self._on_event)
        self.handle = handle
        if handle is None:
            return
        if self._on_event not in handle.listeners:
            handle.listeners.append(self._on_event)
        self._pair()
        for path in list(self.breakpoints):
            self._push(path)

    def _pre_run_cell(self, info: Any) -> None:
        self.raw_cell = str(getattr(info, "raw_cell", "") or "")

    def before_cell(self, name: str, body: str) -> None:
        """A ``%%monarch`` cell is about to run as ``name``: pair it with its
        notebook path; if its ranks are debugged, they get its breakpoints
        first, and the threads of the last failures are dismissed."""
        self._cells.append((name, self.raw_cell, body))
        del self._cells[:-MAX_UNMAPPED]
        handle = self.handle
        if handle is None or not handle.selected:
            return
        for cell in self._pair():
            if cell.name == name and cell.path in self.breakpoints:
                waits = [handle.set_breakpoints(n, lines)
                         for n, lines in self.sources.to_ranks(cell.path, self._lines(cell.path))
                         if n == name]
                for w in waits:
                    w.result(BREAKPOINTS_WAIT_S)  # before the cell: a breakpoint on its first lines counts
        with self._lock:
            shown = list(self.shown.items())
            self.shown.clear()
        for tid, what in shown:
            self.ids.forget(what["rank"], what["kind"])
            self._publish("continued", {"threadId": tid, "allThreadsContinued": False})

    def _pair(self) -> list[Any]:
        """Give the cells run so far their notebook paths (hashing a cell's
        text is deferred to here: only a debugged mesh pays for it)."""
        from ipykernel.compiler import get_file_name

        cells, self._cells = self._cells, []
        out = []
        for name, raw, body in cells:
            if not raw or not is_mesh_cell(raw):
                continue
            path = get_file_name(raw)
            out.append(self.sources.add(name, path, header_lines(raw, body)))
            self.mesh_paths.add(path)
            _write_source(path, raw)
        return out

    # -- DAP requests (the kernel's control thread) ---------------------------------------
    async def process(self, msg: dict[str, Any]) -> dict[str, Any]:
        cmd = str(msg.get("command", ""))
        args = msg.get("arguments") or {}
        try:
            handler = self._route(cmd, args)
            if handler is None:
                return await self._inner(msg)
            return await handler(msg, args)
        except Exception as exc:
            return _reply(msg, False, message=f"{type(exc).__name__}: {exc}")

    def _route(self, cmd: str, args: dict[str, Any]) -> Any:
        """The handler of a request that is (partly) the mesh's, else None."""
        if cmd in ("dumpCell", "setBreakpoints", "debugInfo", "disconnect"):
            return getattr(self, "_" + cmd)
        if cmd == "threads" and (self.handle is not None or self.shown):
            return self._threads
        if cmd in ("stackTrace", *STEP_COMMANDS) and self.ids.thread_of(args.get("threadId")):
            return getattr(self, "_rank_" + cmd) if cmd == "stackTrace" else self._rank_step
        if cmd in STEP_COMMANDS and self._shown_instead(args.get("threadId")) is not None:
            return self._step_shown
        if cmd == "pause" and self.handle is not None and (
                self.ids.thread_of(args.get("threadId")) or self._busy_ranks()):
            return self._pause
        if cmd in ("scopes", "evaluate", "richInspectVariables") and args.get("frameId") in self.ids.frames:
            return getattr(self, "_rank_" + cmd)
        if cmd == "variables" and args.get("variablesReference") in self.ids.refs:
            return self._rank_variables
        if cmd in ("copyToGlobals", "setVariable", "setExpression") and (
                args.get("srcFrameId", args.get("frameId")) in self.ids.frames
                or args.get("variablesReference") in self.ids.refs):
            return self._unsupported
        return None

    async def _dumpCell(self, msg: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        reply = await self._inner(msg)
        path = ((reply or {}).get("body") or {}).get("sourcePath")
        if path and is_mesh_cell(str(args.get("code", ""))):
            self.mesh_paths.add(path)
        return reply

    async def _setBreakpoints(self, msg: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        path = str((args.get("source") or {}).get("path", ""))
        bps = [b for b in args.get("breakpoints") or [] if isinstance(b.get("line"), int)]
        self.breakpoints[path] = bps
        if path in self.mesh_paths:  # a %%monarch cell: the ranks' alone
            await _taken(self._push(path))
            return _reply(msg, True, breakpoints=[{"verified": True, "line": b["line"],
                                                   "source": {"path": path}} for b in bps])
        reply = await self._inner(msg)
        if not _is_cell_file(path):  # a library's file: the ranks break there too
            await _taken(self._push(path))
        return reply

    def _lines(self, path: str) -> list[int]:
        return [int(b["line"]) for b in self.breakpoints.get(path, [])]

    def _push(self, path: str) -> list[concurrent.futures.Future[dict[str, Any]]]:
        """Send ``path``'s breakpoints to the debugged ranks; done when they took them."""
        handle = self.handle
        if handle is None:
            return []
        if path in self.mesh_paths:
            return [handle.set_breakpoints(name, lines)
                    for name, lines in self.sources.to_ranks(path, self._lines(path))]
        if not _is_cell_file(path):
            return [handle.set_breakpoints(path, self._lines(path))]
        return []

    async def _debugInfo(self, msg: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        reply = await self._inner(msg)
        body = reply.setdefault("body", {})
        listed = {b.get("source") for b in body.get("breakpoints") or []}
        body["breakpoints"] = [*(body.get("breakpoints") or []), *(
            {"source": p, "breakpoints": bps} for p, bps in self.breakpoints.items()
            if p in self.mesh_paths and p not in listed and bps)]
        body["stoppedThreads"] = [*(body.get("stoppedThreads") or []), *self._stopped_threads()]
        return reply

    async def _disconnect(self, msg: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        reply = await self._inner(msg)
        # JupyterLab's debugger is off: no rank stops any more
        self.breakpoints.clear()
        handle = self.handle
        if handle is not None:
            for name in list(handle.breakpoints):
                handle.set_breakpoints(name, [])
            for rank in list(handle.stopped):
                handle.request(rank, "continue")
        with self._lock:
            self.shown.clear()
            self.current = None
        return reply

    async def _threads(self, msg: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        reply = await self._inner(msg)
        threads = list(((reply or {}).get("body") or {}).get("threads") or [])
        handle = self.handle
        ranks = sorted(set(handle.selected) | set(handle.stopped)) if handle is not None else []
        threads += [{"id": Ids.thread(r, "live"), "name": Ids.label(r, "live")} for r in ranks]
        with self._lock:
            threads += [{"id": tid, "name": Ids.label(w["rank"], w["kind"])}
                        for tid, w in self.shown.items()]
        return _reply(msg, True, threads=threads)

    async def _rank_stackTrace(self, msg: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        rank, kind = _thread(args.get("threadId"))
        if kind == "dead":
            with self._lock:
                what = self.shown.get(int(args["threadId"]), {})
            frames = [{"id": i, "name": f[2], "line": f[1], "file": f[0]}
                      for i, f in enumerate(what.get("frames") or [], 1)]
            body = {"stackFrames": frames, "totalFrames": len(frames)}
        else:
            body = await self._ask(rank, kind, "stackTrace", args)
        with self._lock:
            return _reply(msg, True, **frames_to_client(self.ids, self.sources, rank, kind, body))

    async def _rank_scopes(self, msg: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        rank, kind, local = self.ids.frames[args["frameId"]]
        if kind == "dead":  # its process is gone: the stack is all there is
            return _reply(msg, True, scopes=[])
        body = await self._ask(rank, kind, "scopes", {**args, "frameId": local})
        with self._lock:
            return _reply(msg, True, scopes=refs_to_client(self.ids, rank, kind, body.get("scopes") or []))

    async def _rank_variables(self, msg: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        rank, kind, local = self.ids.refs[args["variablesReference"]]
        body = await self._ask(rank, kind, "variables", {**args, "variablesReference": local})
        with self._lock:
            return _reply(msg, True, variables=refs_to_client(self.ids, rank, kind,
                                                              body.get("variables") or []))

    async def _rank_evaluate(self, msg: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        rank, kind, local = self.ids.frames[args["frameId"]]
        if kind == "dead":
            return _reply(msg, False, message=f"rank {rank} is dead: nothing can be evaluated")
        body = await self._ask(rank, kind, "evaluate", {**args, "frameId": local})
        with self._lock:
            body["variablesReference"] = self.ids.ref(rank, kind, int(body.get("variablesReference") or 0))
        return _reply(msg, True, **body)

    async def _rank_richInspectVariables(self, msg: dict[str, Any],
                                         args: dict[str, Any]) -> dict[str, Any]:
        rank, kind, local = self.ids.frames[args["frameId"]]
        name = str(args.get("variableName", ""))
        if kind == "dead" or not name.isidentifier():
            return _reply(msg, True, data={}, metadata={})
        body = await self._ask(rank, kind, "evaluate", {"expression": name, "frameId": local})
        return _reply(msg, True, data={"text/plain": body.get("result", "")}, metadata={})

    async def _rank_step(self, msg: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        tid = int(args["threadId"])
        rank, kind = _thread(tid)
        cmd = str(msg.get("command"))
        if kind != "live":  # a failure or a death: nothing runs; continuing dismisses it
            with self._lock:
                self.shown.pop(tid, None)
                self.ids.forget(rank, kind)
            if kind == "pm" and self.handle is not None:
                self.handle.request(rank, "end", thread="pm")
            self._publish("continued", {"threadId": tid, "allThreadsContinued": False})
            return _reply(msg, True, allThreadsContinued=False)
        await self._ask(rank, kind, cmd, {})
        return _reply(msg, True, allThreadsContinued=False)

    def _shown_instead(self, thread_id: Any) -> int | None:
        """The rank's thread a step naming a thread of the kernel means: the
        one JupyterLab shows stopped, when the kernel's debugger has not
        stopped ``thread_id``. JupyterLab 4's *continue* drops the thread it
        shows from its model before it sends the request, which then names
        the first thread left, else thread 1 (the kernel's main thread);
        debugpy answers a continue only once a thread resumes, so forwarded,
        it would hold the kernel's control channel for good."""
        if self.current is None or thread_id in _kernel_stopped(self.kernel):
            return None
        return self.current

    async def _step_shown(self, msg: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        tid = self._shown_instead(args.get("threadId"))
        if tid is None:  # it ran on meanwhile: the kernel's request after all
            return await self._inner(msg)
        args = {**args, "threadId": tid}
        return await self._rank_step({**msg, "arguments": args}, args)

    async def _pause(self, msg: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        which = self.ids.thread_of(args.get("threadId"))
        # a thread of the kernel while the debugged ranks run the cell: the
        # user means the ranks (the kernel only waits for them)
        ranks = [which[0]] if which else self._busy_ranks()
        for rank in ranks:
            await self._ask(rank, "live", "pause", {})
        return _reply(msg, True)

    async def _unsupported(self, msg: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        return _reply(msg, False, message=f"{msg.get('command')} is not supported on a rank")

    async def _ask(self, rank: int, kind: str, cmd: str, args: dict[str, Any]) -> dict[str, Any]:
        handle = self.handle
        if handle is None:
            raise RuntimeError("no mesh is debugged; run %monarch debugger")
        return await asyncio.wrap_future(handle.request(rank, cmd, args, thread=kind))

    def _busy_ranks(self) -> list[int]:
        handle = self.handle
        if handle is None:
            return []
        return [r for r in handle.selected if r not in handle.stopped and handle.busy(r)]

    def _stopped_threads(self) -> list[int]:
        handle = self.handle
        live = [Ids.thread(r, "live") for r in handle.stopped] if handle is not None else []
        with self._lock:
            return live + list(self.shown)

    # -- events (the thread leading the mesh's I/O) ------------------------------------------
    def _on_event(self, event: dict[str, Any]) -> None:
        rank, what = int(event["rank"]), event["event"]
        if what == "stopped":
            with self._lock:
                self.ids.forget(rank, "live")
            self._publish("stopped", {"reason": event.get("reason", "breakpoint"),
                                      "threadId": Ids.thread(rank, "live"),
                                      "description": f"rank {rank}: {event.get('reason')}",
                                      "allThreadsStopped": False, "preserveFocusHint": False})
        elif what == "continued":
            with self._lock:
                self.ids.forget(rank, "live")
            self._publish("continued", {"threadId": Ids.thread(rank, "live"),
                                        "allThreadsContinued": False})
            handle = self.handle
            others = [e for r, e in (handle.stopped.items() if handle else []) if r != rank]
            if others:  # JupyterLab shows the last thread it was told stopped
                nxt = others[-1]
                self._publish("stopped", {"reason": nxt.get("reason", "breakpoint"),
                                          "threadId": Ids.thread(int(nxt["rank"]), "live"),
                                          "allThreadsStopped": False})
        elif what in ("failed", "died"):
            kind = "pm" if what == "failed" else "dead"
            tid = Ids.thread(rank, kind)
            text = str(event.get("error") or event.get("how") or "")
            with self._lock:
                self.ids.forget(rank, kind)
                self.shown[tid] = {"rank": rank, "kind": kind, "frames": event.get("frames")}
            self._publish("stopped", {"reason": "exception", "threadId": tid,
                                      "description": f"{Ids.label(rank, kind)}: {text}",
                                      "text": text, "allThreadsStopped": False})

    def _publish(self, event: str, body: dict[str, Any]) -> None:
        with self._lock:
            if event == "stopped":
                self.current = body["threadId"]
            elif event == "continued" and body["threadId"] == self.current:
                self.current = None
        self.kernel._publish_debug_event({"seq": next(self._seq), "type": "event",
                                          "event": event, "body": body})


def _reply(msg: dict[str, Any], ok: bool, message: str | None = None, **body: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "response", "request_seq": msg.get("seq"), "success": ok,
                           "command": msg.get("command"), "body": body}
    if message is not None:
        out["message"] = message
    return out


def _thread(thread_id: Any) -> tuple[int, str]:
    which = Ids.thread_of(thread_id)
    if which is None:
        raise ValueError(f"thread {thread_id!r} is not a rank's")
    return which


def _kernel_stopped(kernel: Any) -> set[int]:
    """The threads the kernel's own debugger (ipykernel's, over debugpy) has stopped."""
    return set(getattr(getattr(kernel, "debugger", None), "stopped_threads", None) or ())


async def _taken(waits: list[concurrent.futures.Future[dict[str, Any]]]) -> None:
    """Until the ranks took new breakpoints (at most BREAKPOINTS_WAIT_S): the
    reply must not overtake them, or a cell run right after the click (its
    call goes to the ranks on another socket) would run past a breakpoint
    an earlier cell's function holds. A rank that does not answer in time
    gets them later; the panel is not held for it."""
    if waits:
        done, _ = await asyncio.wait([asyncio.wrap_future(w) for w in waits],
                                     timeout=BREAKPOINTS_WAIT_S)
        for f in done:
            f.exception()  # (a rank that is gone: told elsewhere, not an error of the click)


def _is_cell_file(path: str) -> bool:
    """A notebook cell's file (the kernel's own cells live in its temp dir)."""
    from ipykernel.compiler import get_tmp_directory

    return path.startswith(get_tmp_directory() + os.sep) or path.startswith("<")


def _write_source(path: str, text: str) -> None:
    """The cell's file, as dumpCell writes it, for ``source`` requests."""
    if os.path.exists(path):
        return
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        pass


_installed: dict[int, LabDebugger] = {}


def install(ipython: Any) -> LabDebugger | None:
    """Put the multiplexer in front of this kernel's debugger (no-op outside
    an ipykernel with a debugger); idempotent."""
    kernel = getattr(ipython, "kernel", None)
    if kernel is None or getattr(kernel, "debugger", None) is None:
        return None
    lab = _installed.get(id(ipython))
    if lab is None:
        _no_subprocesses()
        lab = _installed[id(ipython)] = LabDebugger(kernel)
        kernel.do_debug_request = lab.process
        ipython.events.register("pre_run_cell", lab._pre_run_cell)
    return lab


def _no_subprocesses() -> None:
    """The kernel's debugpy must not follow the processes the kernel starts:
    by default it injects itself into every Python child started after it
    listens, which would put the mesh's new ranks and spares under the
    kernel's debugger (the ranks have their own). Effective when JupyterLab's
    debugger starts after ``%load_ext monarch_nb``."""
    try:
        import debugpy

        debugpy.configure(subProcess=False)
    except Exception:  # no debugpy (no kernel debugger), or one too old to say
        pass


def uninstall(ipython: Any) -> None:
    lab = _installed.pop(id(ipython), None)
    if lab is None:
        return
    lab.connect(None)
    try:
        del lab.kernel.do_debug_request  # the class's own again
    except AttributeError:
        lab.kernel.do_debug_request = lab._inner
    try:
        ipython.events.unregister("pre_run_cell", lab._pre_run_cell)
    except ValueError:
        pass


def of(ipython: Any) -> LabDebugger | None:
    """This kernel's multiplexer, if installed."""
    return _installed.get(id(ipython))
