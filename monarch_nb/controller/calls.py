"""Issuing calls and waiting for them (the caller's side of the controller).

A mixin of :class:`~monarch_nb.controller.Controller`, split out because it
is one job: check the target ranks, sign the call once for all of them, send
it (or keep it until ranks that are being respawned are back), record it so
answers can be matched, and, for a blocking call, lead the I/O loop on the
caller's thread until it is answered (see ``IOLoop.leadership``). The
answers themselves are handled in controller.py.

Non-goals: message handling (controller.py), recovery (recovery.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import MonarchError
from ..futures import MeshFuture
from ..wire.protocol import Kind
from .output import CallOutput
from .rankstate import PendingCall, RankInfo, RankState

if TYPE_CHECKING:
    from .core import Controller

    _Base = Controller
else:
    _Base = object

_SENDABLE = (RankState.READY, RankState.BUSY)
_READY, _BUSY = RankState.READY, RankState.BUSY
_GONE = (RankState.DEAD, RankState.FAILED, RankState.STOPPED)


def _sendable(infos: list[RankInfo]) -> list[bytes] | None:
    """The main socket ids of ``infos`` if every one of them can take a call
    now, else None (also for no ranks). One plain loop: this runs for every
    call, and a generator in all() costs about a microsecond more."""
    idents = []
    for info in infos:
        state = info.state
        if state is not _READY and state is not _BUSY:
            return None
        idents.append(info.main_id)
    return idents or None


class Calls(_Base):
    def submit(self, kind: Kind, ranks: tuple[int, ...], payload: list[Any],
               meta: dict[str, Any] | None, output: CallOutput,
               hang_timeout: float | None = None) -> MeshFuture:
        """Start a call on ``ranks`` without waiting. Thread-safe."""
        self._refuse_dead(ranks)
        call_id = next(self._call_ids)
        frames, elastic = self._sign_call(kind, payload, call_id, meta)
        call = self._new_call(call_id, kind, ranks, meta, output, hang_timeout, frames, elastic)
        self.io.call_soon(lambda: self._dispatch(call))
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
        ``output``: where the ranks' output goes (default: a CallOutput for
        the calling cell or terminal).

        The frames leave before the call's bookkeeping is made (future,
        record, output), so the ranks start on it meanwhile: on two cores
        that is a measurable part of a no-op call. No answer can be read
        before this thread, which leads the loop, reads it."""
        call_id = next(self._call_ids)
        frames, elastic = self._sign_call(kind, payload, call_id, meta)
        deadline = None if timeout is None else time.monotonic() + timeout
        io = self.io
        io.lead()
        try:
            io.run_commands()  # earlier requests (restart, interrupt) go first
            infos = [self.ranks[r] for r in ranks]
            idents = _sendable(infos)  # (after those: they may change a rank's state)
            if idents is not None:
                io.send_many(idents, frames)
            else:
                self._refuse_dead(ranks)  # a rank gone for good: a usage error
            call = self._new_call(call_id, kind, ranks, meta, output or CallOutput(),
                                  hang_timeout, frames, elastic)
            if idents is not None:
                self._track(call, infos)
            else:
                self._dispatch(call)  # sent once the respawning ranks are back
            future = call.future
            if on_future is not None:
                on_future(future)
            self._lead_until(future, deadline)
        finally:
            io.unlead()
        if not future.done() and not io.stopping and self.prompt_ready(call_id):
            asked = time.monotonic()
            self.serve_prompt(call_id)  # typing time does not count against the timeout
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
        io = self.io
        while True:
            with io.leadership():
                self._lead_until(future, deadline)
            if future.done() or self.io.stopping or not self.prompt_ready(future.call_id):
                return
            asked = time.monotonic()
            self.serve_prompt(future.call_id)
            if deadline is not None:
                deadline += time.monotonic() - asked

    def pump(self, seconds: float) -> None:
        """Run the I/O loop on this thread for up to ``seconds``."""
        with self.io.leadership():
            self.io.run_once(seconds)

    def _lead_until(self, future: MeshFuture, deadline: float | None) -> None:
        io, calls, call_id = self.io, self.calls, future.call_id

        def answered() -> bool:  # after each message: a dict lookup, mostly
            return call_id not in calls and future.done()

        # ``call_id in calls`` first: a dict lookup, where done() takes a lock
        while (call_id in calls or not future.done()) and not io.stopping:
            if self.prompts and self.prompt_ready(call_id):
                return  # the caller asks the user, without holding the loop
            if deadline is None:
                io.run_once(0.1, answered)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return
            io.run_once(left if left < 0.1 else 0.1, answered)

    def _refuse_dead(self, ranks: tuple[int, ...]) -> None:
        """A call to a rank that is gone for good is a usage error (raised
        on the caller's thread)."""
        # DEAD is final only without respawn; otherwise it is the instant
        # between a death and its respawn
        final = (RankState.FAILED, RankState.STOPPED) + (
            (RankState.DEAD,) if self.cfg.respawn == "off" else ())
        dead = [r for r in ranks if self.ranks[r].state in final]
        if dead:
            info = self.ranks[dead[0]]
            why = ("its restart budget is spent" if info.state == RankState.FAILED
                   else self.describe_exit(info.exitcode))
            raise MonarchError(
                f"rank {info.rank} is dead ({why}); select the live ranks with --ranks, "
                f"or bring it back with %monarch restart {info.rank} (mesh.restart({info.rank}))"
            )

    def _sign_call(self, kind: Kind, payload: list[Any], call_id: int,
                   meta: dict[str, Any] | None) -> tuple[list[Any], bool]:
        """The call's frames, signed once whatever the number of ranks (the
        same frames go to each), and whether the call is elastic."""
        if not (meta and meta.get("elastic")):
            return self.codec.sign(kind, payload, call=call_id, meta=meta), False
        if self.cfg.respawn == "off":
            raise MonarchError("elastic calls need respawn: start the mesh with "
                               "--respawn rank (the default) or all")
        # the generation the call starts in: a rank that joined a later
        # one came in mid-call and must take its state from a peer
        meta = {**meta, "generation": self.generation}
        return self.codec.sign(kind, payload, call=call_id, meta=meta), True

    def _new_call(self, call_id: int, kind: Kind, ranks: tuple[int, ...],
                  meta: dict[str, Any] | None, output: CallOutput,
                  hang_timeout: float | None, frames: list[Any], elastic: bool) -> PendingCall:
        setup = None
        if meta and kind == Kind.EXEC and meta.get("setup"):
            setup = {"code": meta["code"], "name": meta.get("name", "<setup>"), "setup": True}
        return PendingCall(
            call_id, ranks, output, MeshFuture(call_id, ranks, self.interrupt), set(ranks),
            setup=setup, elastic=elastic, frames=frames,
            hang_timeout=self.cfg.hang_timeout if hang_timeout is None else hang_timeout)

    def _dispatch(self, call: PendingCall) -> None:
        """Send ``call`` (only while leading), or keep it until the ranks it
        waits for are back; a rank that is gone answers with its death."""
        infos = [self.ranks[r] for r in call.ranks]
        if self.started and not all(i.state in _SENDABLE for i in infos):
            waiting = (RankState.RESPAWNING, RankState.STARTING) + (
                (RankState.DEAD,) if self.cfg.respawn != "off" else ())
            if any(i.state in waiting for i in infos):
                self.deferred.append(lambda: self._dispatch(call))  # once the process is ready
                return
        live = [i for i in infos if i.state not in _GONE]
        self.io.send_many([i.main_id for i in live], call.frames)
        self._track(call, live)
        if len(live) < len(infos) or not live:
            for info in infos:
                if info.state in _GONE:
                    call.errors[info.rank] = self._died(info)
                    call.remaining.discard(info.rank)
            self._maybe_finish(call)

    def _track(self, call: PendingCall, sent_to: list[RankInfo]) -> None:
        """``call`` was sent to ``sent_to``: answers are matched to it now."""
        self.calls[call.call_id] = call
        call.progress_at = time.monotonic()
        for info in sent_to:
            info.state = RankState.BUSY

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
