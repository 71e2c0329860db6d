"""The controller's side of the ranks' debuggers (engine/dap_rank.py): which
ranks are debugged, where they break, which of them stand stopped, and the
requests on their way to them.

A part of the controller with its own state. Its handlers run on the thread
that leads the I/O loop (:meth:`RankDebugger.on_event`, :meth:`on_ready`,
:meth:`call_finished`, :meth:`tick`); the public methods are called from any
thread (the kernel's control thread, where JupyterLab's requests arrive, or
the user's): they queue their sends with ``io.call_soon`` and hand back a
:class:`concurrent.futures.Future` of the rank's answer.

* Selection: ``select(ranks)`` makes those ranks the debugged ones; every
  rank is told (``configure``: the debugged ones get the breakpoints, the
  others none), and so is each new process of a rank (:meth:`on_ready`).
* Breakpoints are in the ranks' terms (``<mnb-cell-5>``, line 3 of the code
  the ranks ran); the kernel's front end translates notebook paths
  (ui/labdebug.py).
* Events: a rank stopped, ran on, failed a call (its post-mortem can be
  inspected), died of a signal (its last Python stack can be shown): each
  goes to the listener, on the leading thread, and it must return quickly.
* A stopped rank holds its call: the hang watchdog does not report it
  (:meth:`holds`), and liveness needs nothing (its control thread keeps
  answering while the main thread waits in the debugger).

Non-goals: the Jupyter debugger protocol and its ids (ui/labdebug.py,
ui/dapmap.py), the rank side (engine/dap_rank.py).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import RankDied, RemoteError, UsageError
from ..procs import deathcause
from ..procs.supervisor import Supervisor
from ..wire import payloads
from ..wire.metas import meta_of
from ..wire.protocol import Codec, Kind, Message
from ..wire.transport import IOLoop
from .calls.calltable import CallTable, PendingCall
from .life.rankstates import LIVE, RankState
from .life.ranktable import RankInfo, RankTable, signal_name

REQUEST_TIMEOUT_S = 10.0  # a rank's debugger answers at once (or from its stopped thread)
DEFAULT_RANKS = (0,)  # see docs/debugging.md: JupyterLab's panel shows one stopped thread

Listener = Callable[[dict[str, Any]], None]


@dataclass
class _Request:
    rank: int
    cmd: str
    future: concurrent.futures.Future[dict[str, Any]]
    deadline: float


class RankDebugger:
    """The debugged ranks, their breakpoints and stops: the handle
    ``Mesh.debugger()`` returns.

    Events given to the listeners (dicts): ``{"event": "stopped", "rank",
    "call", "reason", "file", "line"}``, ``{"event": "continued", "rank"}``,
    ``{"event": "failed", "rank", "error"}`` (a call failed on a debugged
    rank: ``request(rank, ..., thread="pm")`` inspects it),
    ``{"event": "died", "rank", "how", "frames"}`` (a debugged rank died of a
    signal; ``frames``: its last Python stack, innermost first, as
    ``[file, line, function]``, from its log)."""

    def __init__(self, ranks: RankTable, calls: CallTable, io: IOLoop, codec: Codec,
                 supervisor: Supervisor | None = None) -> None:
        self._ranks = ranks
        self._calls = calls
        self._io = io
        self._codec = codec
        self._supervisor = supervisor
        self.selected: tuple[int, ...] = ()
        self.breakpoints: dict[str, tuple[int, ...]] = {}
        self.stopped: dict[int, dict[str, Any]] = {}  # rank -> its "stopped" event
        self.listeners: list[Listener] = []
        self._requests: dict[int, _Request] = {}
        self._seq = itertools.count(1)

    @property
    def active(self) -> bool:
        """Some rank is debugged (the controller's hooks do nothing otherwise)."""
        return bool(self.selected) or bool(self.stopped)

    # -- any thread ---------------------------------------------------------------
    def select(self, ranks: tuple[int, ...]) -> concurrent.futures.Future[dict[str, Any]]:
        """Debug ``ranks`` (``()``: none, and the stopped ones run on);
        done once every live rank took its configuration."""
        world = len(self._ranks)
        bad = [r for r in ranks if not 0 <= r < world]
        if bad:
            raise UsageError(f"no rank {bad[0]} in a mesh of {world}")
        self.selected = tuple(sorted(set(ranks)))
        return self._configure_all()

    def set_breakpoints(self, file: str, lines: list[int]) -> concurrent.futures.Future[dict[str, Any]]:
        """The lines of ``file`` (a cell's name on the ranks, or a file's
        path) where the debugged ranks stop, replacing that file's earlier
        ones; done once every live rank took them."""
        table = dict(self.breakpoints)
        if lines:
            table[file] = tuple(sorted({int(n) for n in lines}))
        else:
            table.pop(file, None)
        self.breakpoints = table
        return self._configure_all()

    def request(self, rank: int, cmd: str, args: dict[str, Any] | None = None,
                thread: str = "live", timeout: float = REQUEST_TIMEOUT_S,
                ) -> concurrent.futures.Future[dict[str, Any]]:
        """Ask ``rank``'s debugger (``thread``: ``live``, its stopped main
        thread, or ``pm``, its last failure); the future's result is the
        answer's body, or a :class:`RuntimeError` saying why not."""
        fut: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        seq = next(self._seq)
        frames = self._codec.sign(Kind.DEBUGGER, [payloads.encode_debugger(args or {})],
                                  meta={"seq": seq, "cmd": cmd, "thread": thread})

        def send() -> None:
            info = self._ranks[rank]
            if info.state not in LIVE:
                fut.set_exception(RuntimeError(f"rank {rank} is {info.state.value}"))
                return
            self._requests[seq] = _Request(rank, cmd, fut, time.monotonic() + timeout)
            self._io.send(info.ctl_id, frames)

        self._io.call_soon(send)
        return fut

    def dead_frames(self, rank: int) -> tuple[str, list[list[Any]]]:
        """How ``rank``'s newest ended incarnation was killed, and its last
        Python stack from its log (innermost first, ``[file, line,
        function]``); ``("", [])`` when none was killed by a signal."""
        sup = self._supervisor
        if sup is None:
            return "", []
        dead = next((p for p in reversed(list(sup.history)) if p.rank == rank and p.reaped), None)
        code = None if dead is None else dead.popen.poll()
        if dead is None or code is None or code >= 0:
            return "", []
        log = sup.tail(rank, 2000, dead.incarnation)
        return f"killed by {signal_name(code)}", [list(f) for f in deathcause.crash_frames(log)]

    # -- the leading thread --------------------------------------------------------------
    def _configure_all(self) -> concurrent.futures.Future[dict[str, Any]]:
        done: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()

        def send() -> None:
            futures = [self._configure(info) for info in self._ranks if info.state in LIVE]
            if not self.selected:  # debugging ends: stopped ranks run on
                for rank in list(self.stopped):
                    futures.append(self.request(rank, "continue"))
            _all_of(futures, done)

        self._io.call_soon(send)
        return done

    def _configure(self, info: RankInfo) -> concurrent.futures.Future[dict[str, Any]]:
        on = info.rank in self.selected
        args = {"on": on, "breakpoints": {f: list(lines) for f, lines in self.breakpoints.items()}
                if on else {}}
        fut: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        seq = next(self._seq)
        self._requests[seq] = _Request(info.rank, "configure", fut,
                                       time.monotonic() + REQUEST_TIMEOUT_S)
        self._io.send(info.ctl_id, self._codec.sign(
            Kind.DEBUGGER, [payloads.encode_debugger(args)],
            meta={"seq": seq, "cmd": "configure", "thread": "live"}))
        return fut

    def on_event(self, info: RankInfo, msg: Message) -> None:
        """A DEBUGGER_EVENT: an answer, or an event of the rank's debugger."""
        meta = meta_of(msg, Kind.DEBUGGER_EVENT)
        try:
            body = payloads.decode_debugger(msg.payload[0]) if msg.payload else {}
        except payloads.PayloadError:
            return
        seq = int(meta.get("seq") or 0)
        if seq:
            req = self._requests.pop(seq, None)
            if req is None or req.rank != info.rank or req.future.done():
                return
            if meta.get("ok", False):
                req.future.set_result(body)
            else:
                req.future.set_exception(RuntimeError(str(body.get("message") or "failed")))
            return
        cmd = str(meta.get("cmd") or "")
        call = self._calls.get(msg.call)
        if call is not None:  # the hang watchdog counts from the stop, and from its end
            call.progressed(time.monotonic())
        if cmd == "stopped":
            event = {"event": "stopped", "rank": info.rank, "call": msg.call,
                     "reason": str(body.get("reason") or "breakpoint"),
                     "file": str(body.get("file") or ""), "line": int(body.get("line") or 0)}
            self.stopped[info.rank] = event
            self._tell(event)
        elif cmd == "continued" and self.stopped.pop(info.rank, None) is not None:
            self._tell({"event": "continued", "rank": info.rank})

    def on_ready(self, info: RankInfo) -> None:
        """A new process of ``info.rank`` is ready: it knows nothing yet."""
        if self.selected or self.breakpoints:
            self._configure(info)

    def on_gone(self, rank: int) -> None:
        """``rank``'s process ended: its stop and its requests with it."""
        for seq, req in list(self._requests.items()):
            if req.rank == rank:
                del self._requests[seq]
                if not req.future.done():
                    req.future.set_exception(RuntimeError(f"rank {rank} died"))
        if self.stopped.pop(rank, None) is not None:
            self._tell({"event": "continued", "rank": rank})

    def call_finished(self, call: PendingCall) -> None:
        """A call finished: its failures on debugged ranks can be inspected."""
        for rank, err in call.errors.items():
            if rank in self.stopped and self.stopped[rank].get("call") == call.call_id:
                self.on_gone(rank)
            if rank not in self.selected:
                continue
            if isinstance(err, RemoteError) and err.type_name not in ("KeyboardInterrupt",):
                self._tell({"event": "failed", "rank": rank,
                            "error": f"{err.type_name}: {err.message}"})
            elif isinstance(err, RankDied) and err.signal_name:
                how, frames = self.dead_frames(rank)
                if frames:
                    self._tell({"event": "died", "rank": rank, "how": how, "frames": frames})

    def busy(self, rank: int) -> bool:
        """``rank`` runs a call (a pause has something to stop)."""
        return self._ranks[rank].state == RankState.BUSY

    def holds(self, call_id: int) -> bool:
        """A rank of ``call_id`` stands stopped in the debugger (not a hang)."""
        return any(e.get("call") == call_id for e in self.stopped.values())

    def tick(self, now: float) -> None:
        for seq, req in list(self._requests.items()):
            if now >= req.deadline:
                del self._requests[seq]
                if not req.future.done():
                    req.future.set_exception(RuntimeError(
                        f"rank {req.rank}'s debugger did not answer {req.cmd}"))

    def _tell(self, event: dict[str, Any]) -> None:
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception:  # a front end's failure must not stop the I/O loop
                import logging

                logging.getLogger(__name__).exception("debugger listener failed")


def _all_of(futures: list[concurrent.futures.Future[dict[str, Any]]],
            done: concurrent.futures.Future[dict[str, Any]]) -> None:
    """``done`` gets ``{"answered": n, "failed": [messages]}`` once all of
    ``futures`` are done."""
    if not futures:
        done.set_result({"answered": 0, "failed": []})
        return
    left = [len(futures)]
    failed: list[str] = []

    def one(fut: concurrent.futures.Future[dict[str, Any]]) -> None:
        exc = fut.exception()
        if exc is not None:
            failed.append(str(exc))
        left[0] -= 1
        if left[0] == 0 and not done.done():
            done.set_result({"answered": len(futures) - len(failed), "failed": failed})

    for fut in futures:
        fut.add_done_callback(one)
