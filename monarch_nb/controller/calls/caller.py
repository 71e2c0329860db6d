"""Issuing calls and waiting for them (the caller's side of the controller).

One job: check the target ranks, sign the call once for all of them, send
it (or let it wait while ranks come back or the group is about to be
re-formed: :meth:`Recovery.must_wait`), record it in the call table, and,
for a blocking call, lead the I/O loop on the caller's thread until it is
answered (see ``IOLoop.leadership``). Owns the interrupt answers
(where each interrupted rank was).

Non-goals: answers (core.py), a call's fate (calltable.py), recovery.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ...config import MeshConfig
from ...errors import MonarchError, lost_host_hint
from ...futures import MeshFuture
from ...results import Lost
from ...wire import chunks
from ...wire.protocol import Codec, Kind, exec_parts
from ...wire.transport import IOLoop
from ..inspector import Inspector
from ..life.rankstates import GONE, RankState
from ..life.ranktable import RankTable, describe_exit
from ..life.recovery import Recovery
from .calltable import CallTable, PendingCall
from .dataplane import DataPlane
from .output import CallOutput


class Caller:
    """Sends calls and waits for them; every thread may use it."""

    def __init__(self, cfg: MeshConfig, ranks: RankTable, calls: CallTable, io: IOLoop,
                 codec: Codec, recovery: Recovery, inspector: Inspector,
                 dataplane: DataPlane | None = None) -> None:
        self.cfg = cfg
        self.ranks = ranks
        self.calls = calls
        self.io = io
        self.codec = codec
        self.recovery = recovery
        self.inspector = inspector
        self.dataplane = dataplane or DataPlane("", None, cfg.max_message_bytes)
        self.interrupt_where: dict[int, dict[int, str]] = {}  # call -> rank -> where it was

    def submit(self, kind: Kind, ranks: tuple[int, ...], payload: list[Any],
               meta: dict[str, Any] | None, output: CallOutput,
               hang_timeout: float | None = None) -> MeshFuture:
        """Start a call on ``ranks`` without waiting. Thread-safe."""
        self.refuse_dead(ranks)
        call_id = self.calls.next_id()
        frames, elastic = self._sign_call(kind, payload, call_id, meta)
        try:
            call = self._new_call(call_id, kind, ranks, meta, output, hang_timeout, frames, elastic)
        except BaseException:
            self.dataplane.release(call_id)
            raise
        self.io.call_soon(lambda: self.dispatch(call))
        return call.future

    def call(self, kind: Kind, ranks: tuple[int, ...], payload: list[Any],
             meta: dict[str, Any] | None, output: CallOutput | None = None,
             timeout: float | None = None,
             on_future: Callable[[MeshFuture], None] | None = None,
             hang_timeout: float | None = None) -> MeshFuture:
        """Start a call and wait up to ``timeout`` for it, leading the I/O
        loop meanwhile (see IOLoop.leadership). Returns the future, done
        unless the timeout expired. ``on_future`` receives the future before
        any waiting, so a Ctrl-C during the wait knows which call it hit.

        The frames leave before the call's bookkeeping is made (future,
        record, output), so the ranks start on it meanwhile: on two cores
        that is a measurable part of a no-op call. No answer can be read
        before this thread, which leads the loop, reads it."""
        call_id = self.calls.next_id()
        frames, elastic = self._sign_call(kind, payload, call_id, meta)
        deadline = None if timeout is None else time.monotonic() + timeout
        io = self.io
        try:
            io.lead()
        except BaseException:
            self.dataplane.release(call_id)
            raise
        try:
            io.run_commands()  # earlier requests (restart, interrupt) go first
            idents = self.ranks.sendable(ranks)  # (after those: they may change a state)
            if idents is not None and self.recovery.must_wait(ranks):
                idents = None
            if idents is not None:
                io.send_many(idents, frames)
            else:
                self.refuse_dead(ranks)  # a rank gone for good: a usage error
            call = self._new_call(call_id, kind, ranks, meta, output or CallOutput(),
                                  hang_timeout, frames, elastic)
            if idents is not None:
                self._sent(call, ranks)
            else:
                self.dispatch(call)  # sent once the ranks are back / the group re-formed
            future = call.future
            if on_future is not None:
                on_future(future)
            self._lead_until(future, deadline)
        except BaseException:
            if call_id not in self.calls:  # never recorded (refused): nobody maps it
                self.dataplane.release(call_id)
            raise
        finally:
            io.unlead()
        if not future.done() and not io.stopping and self.inspector.prompt_ready(call_id):
            asked = time.monotonic()
            self.inspector.serve_prompt(call_id)  # typing time does not count
            self._wait_serving(future, None if deadline is None else deadline - asked)
        return future

    def wait(self, future: MeshFuture, timeout: float | None = None) -> bool:
        """Wait for ``future`` (leading the loop); True if it is done."""
        self._wait_serving(future, timeout)
        return future.done()

    def _wait_serving(self, future: MeshFuture, timeout: float | None) -> None:
        """Lead the loop until ``future`` is done or the timeout passed;
        debugger prompts of the call are answered on the way, with the loop
        handed back meanwhile (heartbeats and pings go on while the user
        types, and typing time does not count against the timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        io, inspector = self.io, self.inspector
        while True:
            with io.leadership():
                self._lead_until(future, deadline)
            if future.done() or io.stopping or not inspector.prompt_ready(future.call_id):
                return
            asked = time.monotonic()
            inspector.serve_prompt(future.call_id)
            if deadline is not None:
                deadline += time.monotonic() - asked

    def pump(self, seconds: float) -> None:
        """Run the I/O loop on this thread for up to ``seconds``."""
        with self.io.leadership():
            self.io.run_once(seconds)

    def _lead_until(self, future: MeshFuture, deadline: float | None) -> None:
        io, calls, call_id, inspector = self.io, self.calls, future.call_id, self.inspector

        def answered() -> bool:  # after each message: a dict lookup, mostly
            return call_id not in calls and future.done()

        # ``call_id in calls`` first: a dict lookup, where done() takes a lock
        while (call_id in calls or not future.done()) and not io.stopping:
            if inspector.prompts and inspector.prompt_ready(call_id):
                return  # the caller asks the user, without holding the loop
            if deadline is None:
                io.run_once(0.1, answered)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return
            io.run_once(left if left < 0.1 else 0.1, answered)

    def refuse_dead(self, ranks: tuple[int, ...]) -> None:
        """A call to a rank that is gone for good is a usage error (raised
        on the caller's thread), unless the group went on without it (an
        elastic world size): then the call runs on the others and its entry
        says it is lost (:meth:`dispatch`). Whether a dead rank comes back
        is the rank table's answer."""
        for r in ranks:
            info = self.ranks[r]
            state = info.state
            if self.ranks.gone_for_good(r) and not self.ranks.shed(r):
                why = ("its restart budget is spent" if state == RankState.FAILED
                       else "the mesh was stopped" if state == RankState.STOPPED
                       else "its host was lost" if state == RankState.LOST
                       else describe_exit(info.exitcode))
                back = (lost_host_hint([r]) if state == RankState.LOST else
                        f"bring it back with %monarch restart {r} (mesh.restart({r}))")
                raise MonarchError(
                    f"rank {r} is dead ({why}); select the live ranks with --ranks, or {back}")

    def _sign_call(self, kind: Kind, payload: list[Any], call_id: int,
                   meta: dict[str, Any] | None) -> tuple[list[Any], bool]:
        """The call's frames, signed once whatever the number of ranks (the
        same frames go to each), and whether the call is elastic. Big
        frames go into one shared-memory segment for all the ranks (its
        descriptor is in the signed meta): dataplane.py; on an encrypted link,
        those still big go in pieces (wire/chunks.py)."""
        if kind is Kind.EXEC and meta:
            payload, meta = exec_parts(meta)  # the code as a frame (a cell may be long)
        elif payload and kind is Kind.CALL:
            payload, desc = self.dataplane.pack_call(call_id, payload)
            if desc is not None:
                meta = {**(meta or {}), "shm": desc}
            if self.io.curve is not None:  # encrypted: big frames go in pieces
                payload, parts = chunks.split(payload)
                if parts is not None:
                    meta = {**(meta or {}), "parts": parts}
        try:
            return self._sign(kind, payload, call_id, meta)
        except BaseException:
            self.dataplane.release(call_id)
            raise

    def _sign(self, kind: Kind, payload: list[Any], call_id: int,
              meta: dict[str, Any] | None) -> tuple[list[Any], bool]:
        if not (meta and meta.get("elastic")):
            return self.codec.sign(kind, payload, call=call_id, meta=meta), False
        if self.cfg.respawn == "off":
            raise MonarchError("elastic calls need respawn: start the mesh with "
                               "--respawn rank (the default) or all")
        # the generation the call starts in: a rank that joined a later
        # one came in mid-call and must take its state from a peer
        meta = {**meta, "generation": self.recovery.generation}
        return self.codec.sign(kind, payload, call=call_id, meta=meta), True

    def _new_call(self, call_id: int, kind: Kind, ranks: tuple[int, ...],
                  meta: dict[str, Any] | None, output: CallOutput,
                  hang_timeout: float | None, frames: list[Any], elastic: bool) -> PendingCall:
        setup = None
        if meta and kind == Kind.EXEC and meta.get("setup"):
            setup = {"code": meta["code"], "name": meta.get("name", "<setup>"), "setup": True}
        return self.calls.new(
            call_id, ranks, output, MeshFuture(call_id, ranks, self.interrupt), frames=frames,
            elastic=elastic, setup=setup,
            hang_timeout=self.cfg.hang_timeout if hang_timeout is None else hang_timeout)

    def dispatch(self, call: PendingCall) -> None:
        """Send ``call`` (only while leading), or let it wait until its
        ranks are back and the group is re-formed; a rank that is gone for
        good answers with its death."""
        if call.future.done():
            self.dataplane.release(call.call_id)
            return  # cancelled, or the mesh stopped, while it waited
        if self.recovery.must_wait(call.ranks):
            self.calls.wait(call)
            return
        live = [r for r in call.ranks if self.ranks[r].state not in GONE]
        if live:
            self.io.send_many([self.ranks[r].main_id for r in live], call.frames)
        self._sent(call, tuple(live))
        for r in call.ranks:
            if r not in live:
                if self.ranks.shed(r):  # the group went on without it: no error
                    self.calls.complete(call, r, Lost(r, self.lost_reason(r)))
                else:
                    self.calls.complete(call, r, error=self.recovery.died_error(self.ranks[r]))
        self.calls.finish_if_done(call)

    def lost_reason(self, rank: int) -> str:
        """Why the group went on without ``rank``: its entry in a call's results."""
        info = self.ranks[rank]
        why = ("not respawned: restart_budget=0" if info.state == RankState.FAILED
               and self.cfg.restart_budget == 0
               else "its restart budget is spent" if info.state == RankState.FAILED
               else "its host was lost" if info.state == RankState.LOST
               else describe_exit(info.exitcode))
        back = (lost_host_hint([rank]) if info.state == RankState.LOST else
                f"%monarch restart {rank} brings it back")
        return f"the group went on without it ({why}); {back}"

    def _sent(self, call: PendingCall, ranks: tuple[int, ...]) -> None:
        self.calls.sent(call)
        self.ranks.move_many(ranks, RankState.BUSY)

    def interrupt(self, call_id: int) -> None:
        """Interrupt the ranks still running ``call_id`` (thread-safe); their
        answers (where each one was) collect in ``interrupt_where[call_id]``."""

        def go() -> None:
            call = self.calls.get(call_id)
            if call is None:
                return
            self.interrupt_where.setdefault(call_id, {})
            while len(self.interrupt_where) > 64:
                self.interrupt_where.pop(next(iter(self.interrupt_where)))
            frames = self.codec.sign(Kind.INTERRUPT, call=call_id)
            for r in call.remaining:
                self.io.send(self.ranks[r].ctl_id, frames)

        self.io.call_soon(go)
