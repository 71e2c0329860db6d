"""Carrying out the restart policy's actions (policy.py decides, this does).

A mixin of :class:`~monarch_nb.controller.Controller`, split out because it is
one job: respawn a dead rank with the same rank number and device, form a new
torch.distributed group (new generation, new store port, never one a dead
member may still hold), replay ``--setup`` cells on the new process before any
other call reaches it, re-issue ``--elastic`` calls on it, send the calls that
waited for it, and replace survivors left stuck in a collective (gloo does not
fail a rank that waits on a peer that gave up). Runs on the thread that leads
the I/O loop, like every handler.

Non-goals: deciding (policy.py), messages and calls (controller.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..errors import MembershipChanged, RankDied, RemoteError, is_peer_loss
from ..futures import MeshFuture
from ..wire.protocol import Kind
from .output import CallOutput
from .policy import GiveUp, Kill, Reform, Report, Respawn, RestartRequested
from .rankstate import (
    REFORM_GRACE_S,
    REFORM_PROBE_S,
    Event,
    PendingCall,
    RankInfo,
    RankState,
    _free_port,
)

if TYPE_CHECKING:
    from .core import Controller

    _Base = Controller
else:
    _Base = object


SPARE_DELAY_S = 2.0  # settled this long before a spare process is started


class Recovery(_Base):
    def restart(self, ranks: tuple[int, ...]) -> None:
        """Replace ``ranks`` with new processes (thread-safe; user request)."""
        self.io.call_soon(lambda: self._apply(self.policy.handle(
            RestartRequested(ranks, time.monotonic()))))

    def _apply(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, Report):
                self._announce(f"monarch_nb: {action.message}")
                self._fail_reissues(self.ranks[action.rank])
            elif isinstance(action, GiveUp):
                info = self.ranks[action.rank]
                info.state = RankState.FAILED
                self._event(info, "gave_up", action.reason)
                self._announce(f"monarch_nb: {action.reason}")
                self._fail_reissues(info)
                self._run_deferred()  # calls waiting for it now fail with RankDied
            elif isinstance(action, Kill):
                proc = self.supervisor.procs.get(action.rank)
                info = self.ranks[action.rank]
                if proc is not None:
                    self.supervisor.kill_proc(proc)
                    # its exit is old news: fail its calls now, the pidfd event is ignored
                    info.exitcode = -9
                    died = self._died(info)
                    for call in list(self.calls.values()):
                        if action.rank in call.remaining:
                            call.remaining.discard(action.rank)
                            call.held.pop(action.rank, None)
                            call.errors[action.rank] = died
                            self._maybe_finish(call)
            elif isinstance(action, Respawn):
                info = self.ranks[action.rank]
                info.incarnation = action.incarnation
                info.state = RankState.RESPAWNING
            elif isinstance(action, Reform):
                self._reform(action)

    def _reform(self, action: Reform) -> None:
        """New generation: fresh store port; respawning members start with
        it, live members are told to leave their group and join it."""
        self.generation = action.generation
        port = _free_port()
        self.supervisor.master_port = port
        self.supervisor.generation = action.generation
        frames = self.codec.sign(Kind.REFORM, meta={"generation": action.generation, "port": port})
        for rank in action.ranks:
            info = self.ranks[rank]
            if info.state == RankState.RESPAWNING:
                old = self.supervisor.procs.get(rank)
                if old is not None and old.popen.poll() is None:
                    self.supervisor.kill_proc(old)  # never two processes for one rank
                self._spawn(info)
                info.state = RankState.RESPAWNING
                self._event(info, "respawned", f"generation {action.generation}")
            elif info.state in (RankState.READY, RankState.BUSY):
                # queued behind the rank's current call: a survivor stuck in a
                # collective with the dead rank fails out of it first (gloo
                # errors within ~0.2 s), then re-forms
                self.io.send(info.main_id, frames)
                if info.state == RankState.BUSY:
                    now = time.monotonic()
                    self.awaiting_reform[rank] = now + REFORM_GRACE_S
                    self.reform_probes[rank] = now + REFORM_PROBE_S
        self.events.append(Event(time.time(), -1, 0, "reformed",
                                 f"generation {action.generation}, ranks {list(action.ranks)}"))

    def _replay_setup(self, info: RankInfo) -> None:
        """Send the recorded --setup cells to a respawned rank, in order,
        ahead of any deferred call (its main socket is first in, first out)."""
        for cell in self.setup_cells:
            call_id = next(self._call_ids)
            future = MeshFuture(call_id, (info.rank,), self.interrupt)
            out = self.default_output or CallOutput()
            call = PendingCall(call_id, (info.rank,), out, future, {info.rank})
            self.calls[call_id] = call

            def report(fut: MeshFuture, rank: int = info.rank, name: str = cell["name"]) -> None:
                if fut.exception() is not None:
                    self._event(self.ranks[rank], "setup_failed", f"{name}: {fut.exception()}")
                    self._announce(f"monarch_nb: replaying setup cell {name} on rank {rank} "
                                   f"failed: {str(fut.exception()).splitlines()[-1]}")

            future.add_done_callback(report)
            self.io.send(info.main_id, self.codec.sign(Kind.EXEC, call=call_id, meta=cell))

    def _check_reforms(self, now: float) -> None:
        """Members told to re-form that did not answer in time."""
        for rank, probe_at in list(self.reform_probes.items()):
            if rank not in self.awaiting_reform:
                del self.reform_probes[rank]
            elif now > probe_at:
                # where is it? the STACKS_REPLY replaces it if in a collective
                del self.reform_probes[rank]
                self.io.send(self.ranks[rank].ctl_id, self.codec.sign(Kind.STACKS))
        for rank, answer_by in list(self.awaiting_reform.items()):
            if now > answer_by:
                info = self.ranks[rank]
                if any(c.elastic and rank in c.remaining for c in self.calls.values()):
                    self._replace_stuck(rank)  # its state comes back from a peer
                else:
                    # Only a rank stuck *in a collective* is replaced (its state
                    # is lost, the alternative is a hang until the group
                    # timeout); one that is busy computing is left alone.
                    self.awaiting_reform[rank] = now + REFORM_GRACE_S
                    self.io.send(info.ctl_id, self.codec.sign(Kind.STACKS))

    def _replace_stuck(self, rank: int) -> None:
        """An elastic survivor that did not answer the re-formation is stuck
        in a collective with a peer that left (gloo does not always fail it).
        Replace its process in the current generation; like a respawned rank
        it takes the state from a live peer, so nothing is lost."""
        self.awaiting_reform.pop(rank, None)
        info = self.ranks[rank]
        old = self.supervisor.procs.get(rank)
        if old is None or info.state not in (RankState.READY, RankState.BUSY):
            return
        self.supervisor.kill_proc(old)
        for call in self.calls.values():
            if rank in call.remaining:
                call.held.pop(rank, None)
                call.chunks_seen.pop(rank, None)
                if call.elastic:
                    call.reissue.add(rank)
                else:
                    call.remaining.discard(rank)
                    call.errors[rank] = MembershipChanged(rank, (), "replaced: stuck in a "
                                                         "collective after a member died")
        info.incarnation = self.policy.replace(rank)
        info.state = RankState.RESPAWNING
        self._spawn(info)
        info.state = RankState.RESPAWNING
        self._event(info, "replaced", f"stuck in a collective; joins generation {self.generation}")
        self._announce(f"monarch_nb: rank {rank} was stuck in a collective after the group "
                       f"changed; replaced it (incarnation {info.incarnation})")
        for call in list(self.calls.values()):
            self._maybe_finish(call)

    def _reissue(self, info: RankInfo) -> None:
        """Elastic calls that lost this rank run again on its new process
        (after the setup replay: the main socket is first in, first out)."""
        for call in list(self.calls.values()):
            if info.rank in call.reissue:
                call.reissue.discard(info.rank)
                info.state = RankState.BUSY
                self.io.send(info.main_id, call.frames)

    def _fail_reissues(self, info: RankInfo) -> None:
        for call in list(self.calls.values()):
            if info.rank in call.reissue:
                call.reissue.discard(info.rank)
                call.remaining.discard(info.rank)
                call.errors[info.rank] = self._died(info)
                self._maybe_finish(call)

    def _run_deferred(self) -> None:
        pending, self.deferred = self.deferred, []
        for go in pending:
            go()  # re-defers itself if a target is still respawning

    def _keep_spare(self, now: float) -> None:
        """Start a spare process once the mesh has been settled for a while
        (not during start-up or a recovery, whose CPU it would slow), or at
        once while a dead rank waits out its respawn backoff: that wait is
        idle time, and the spare, however far it got, becomes that rank."""
        sup = self.supervisor
        if sup.spare is not None and sup.spare.poll() is not None:
            sup.spare = None  # it died (out of memory?); another one later
        if not (self.cfg.spare and self.started and sup.spare is None):
            return
        if self.policy.next_deadline() is not None or (
                now - self.settled_at >= SPARE_DELAY_S
                and all(r.state in (RankState.READY, RankState.BUSY) for r in self.ranks)):
            sup.start_spare()

    def _classify_membership(self, call: PendingCall) -> None:
        """Survivors cut short in a collective by a death get MembershipChanged
        instead of a raw gloo/nccl error."""
        dead = [r for r, e in call.errors.items() if isinstance(e, RankDied)]
        if not dead:
            return
        for rank, err in list(call.errors.items()):
            if isinstance(err, RemoteError) and is_peer_loss(f"{err.type_name} {err.message}"):
                call.errors[rank] = MembershipChanged(rank, dead, err.message.splitlines()[0][:200])
