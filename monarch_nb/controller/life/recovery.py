"""Recovery: carries out the restart policy's decisions (policy.py decides).

Owns the life of rank processes after the first start: a death goes to the
policy, and its actions are done here. Respawn keeps the rank number and
device; every member joins a new torch.distributed group (new generation,
new store port, never one a dead member may still hold); ``--setup`` cells
are replayed on the new process before any other call reaches it;
``--elastic`` calls are re-issued on it; calls that waited are sent.

Calls never reach a group that is about to change: while a dead rank waits
out its backoff, new calls wait too (the re-run of a launched script would
otherwise start on the old group and fail), and go out once the REFORM is
queued ahead of them.

Survivors release one another: a rank whose call failed because a peer
left (or with a REFORM waiting) leaves its group at once, which fails its
peers out of their collectives too (engine/membership.py). A member still not
out of the old group's collective ``REFORM_GRACE_S`` after the REFORM is
probed (its stacks) and only then replaced; an elastic call takes its state
back from a peer, so nothing is lost.

A rank that no re-formation will bring back (the policy's NotComingBack:
budget spent, respawns off, its host lost with no spare host) ends the calls
that wait for it: an elastic call cannot finish without it, and its
survivors wait for exactly that re-formation (mnb.elastic, on the rank: 300
s before it gives up by itself). They are interrupted now, and the call
fails at once with the reason and what to do.

With ``min_ranks`` the group goes on without ranks gone for good instead
(the policy's Shrink): the elastic calls that had them record them lost
(:class:`~monarch_nb.results.Lost`, not an error) and carry on, their
survivors re-forming at the smaller size (the REFORM names the members, in
torch rank order); calls sent from then on leave them out (caller.py).

The group grows back when lost ranks get processes again (a host given for
them: :meth:`hosts_added`, ``mesh.add_hosts``; a user's restart): the
policy's Grow, then its Reform. Nothing is broken, so nothing is probed: a
member busy with a call joins the larger group when it is free, or, inside
an ``mnb.elastic`` loop, at its next ``state.commit()``, saying so in its
REFORMED; once every member of an elastic call that ran without the ranks
re-formed inside it and a rank back is READY, the call is given to it
(:meth:`_admit`): it takes the committed state from its peers and the call
finishes at the larger size. A call that ends first keeps their Lost
entries; they join at the next call.

Here facts are recorded as they are seen (a READY: READY; our own kill
signal: DYING; a first start that failed: DEAD) and the policy's actions
are carried out, its typed moves through the rank table's methods
(:meth:`apply`); nothing here decides where a rank goes next.

State owned here: the members awaiting a re-formation, the time the mesh
last settled. Not here: a rank's state, incarnation and host and the
group's generation (the rank table's, moved by the policy's actions;
:attr:`generation` reads it), the group new processes join (the
supervisor's, set by :meth:`Supervisor.reform`). Runs on the thread that leads the I/O loop.

Non-goals: deciding (policy.py), messages (core.py), calls (calltable.py).
"""

from __future__ import annotations

import functools
import signal as signal_mod
import time
from collections.abc import Callable
from typing import Any

from ...config import MeshConfig
from ...errors import MembershipChanged, MonarchError, RankDied, RankErrors
from ...futures import MeshFuture
from ...procs.supervisor import RankProcess, Supervisor
from ...rankspans import format_ranks
from ...results import Lost
from ...stacks import RankStacks
from ...wire.metas import meta_of
from ...wire.protocol import Codec, Kind, Message, exec_parts
from ...wire.transport import IOLoop
from ..calls.calltable import CallTable, PendingCall
from ..calls.output import CallOutput
from .events import EventKind
from .policy import (
    Action,
    Died,
    GiveUp,
    Grow,
    HostAdded,
    HostLost,
    Kill,
    Move,
    NotComingBack,
    Probed,
    Reform,
    ReplaceStuck,
    Report,
    Respawn,
    RestartPolicy,
    RestartRequested,
    Shrink,
    SpareCheck,
    StartSpare,
    Timer,
)
from .rankstates import GONE, LIVE, RankState
from .ranktable import RankInfo, RankTable, describe_exit, free_port, signal_name

REFORM_GRACE_S = 3.0  # a member still in the old group's collective this long after the REFORM is probed


class Recovery:
    """Starts, replaces and re-forms ranks; the policy's hands."""

    def __init__(self, cfg: MeshConfig, ranks: RankTable, calls: CallTable, supervisor: Supervisor,
                 io: IOLoop, codec: Codec, policy: RestartPolicy, *,
                 announce: Callable[[str], None], dispatch: Callable[[PendingCall], None],
                 default_output: Callable[[], CallOutput | None],
                 notify: Callable[[], None] = lambda: None) -> None:
        self.cfg = cfg
        self.ranks = ranks
        self.calls = calls
        self.supervisor = supervisor
        self.io = io
        self.codec = codec
        self.policy = policy
        self._announce = announce
        self._dispatch = dispatch
        self._default_output = default_output
        self._notify = notify  # a rank's state changed (Controller.start waits on it)
        self.started = False  # the first start is over (later READYs are respawns)
        self.stopped = False
        self.awaiting_reform: dict[int, float] = {}  # member -> when to look where it is
        # deaths in a call this controller does not know (a kept mesh's rank
        # that died while no controller was attached): rank -> (call id, its
        # name, the error); the attach's adoption takes them (controller/keep.py)
        self.unknown_call_deaths: dict[int, tuple[int, str, RankDied]] = {}
        self.reform_frames: list[Any] | None = None  # the current generation's REFORM
        self.lost: set[int] = set()  # the ranks whose new processes the last re-formation awaits
        self.requested: set[int] = set()  # restarted by the user: their return is no news
        self.settled_at = time.monotonic()  # last start, death or respawn
        self._grows = False  # the Reform at hand forms a larger group (a Grow came first)
        self._notes: list[str] = []  # said once the actions at hand are done (apply)

    @property
    def generation(self) -> int:
        """The group's generation (the rank table's; the policy decides each Reform)."""
        return self.ranks.generation

    # -- processes ----------------------------------------------------------------
    def start_process(self, rank: int, incarnation: int) -> None:
        """A process for ``rank`` (forked on the spawner thread)."""
        old = self.ranks[rank]
        old_ids = (old.main_id, old.ctl_id)
        info = self.ranks.bind(rank, incarnation)
        self.io.forget(*old_ids)  # the replaced process's windows and routes
        # a new process owes no answer to a REFORM sent to the one it replaces
        self.awaiting_reform.pop(rank, None)
        proc = self.supervisor.spawn(rank, incarnation, info.identity)
        if proc.link is not None:  # a local rank: its main channel is a link (wire/link.py)
            link, proc.link = proc.link, None
            self.io.attach_link(info.main_id, link)
        when_started = getattr(proc.popen, "when_started", None)
        if when_started is None:
            self._started(rank, proc)
        else:  # behind an agent: its pid comes when it runs (after its warm process's import)
            when_started(lambda: self.io.call_soon(lambda: self._started(rank, proc)))
        if proc.pidfd is not None:
            self.io.watch_fd(proc.pidfd, lambda: self._exit_seen(rank, proc))

    def _started(self, rank: int, proc: RankProcess) -> None:
        """Record that ``proc`` runs, once (its READY may come first: on_ready)."""
        info = self.ranks[rank]
        if proc.announced or info.incarnation != proc.incarnation:
            return
        proc.announced = True
        proc.from_spare = proc.from_spare or bool(getattr(proc.popen, "from_spare", False))
        info.pid = proc.pid
        self.ranks.record(rank, EventKind.STARTED,
                          f"pid {proc.pid}" + (", from a spare" if proc.from_spare
                                               else ", forked" if proc.forked else ""))

    def _exit_seen(self, rank: int, proc: RankProcess | None) -> None:
        self.on_exit(rank, proc)
        self._notify()

    def died_error(self, info: RankInfo) -> RankDied:
        return RankDied(info.rank, info.exitcode if (info.exitcode or 0) >= 0 else None,
                        signal_name(info.exitcode), tuple(self.supervisor.tail(info.rank, 8)),
                        info.incarnation, info.silent_for, info.frozen,
                        self.supervisor.death_hint(info.rank, info.health),
                        self.supervisor.crash_stack(info.rank))

    # -- events -------------------------------------------------------------------
    def on_exit(self, rank: int, proc: RankProcess | None = None) -> None:
        """A rank's process ended (pidfd, or the tick's poll)."""
        info = self.ranks[rank]
        code = self.supervisor.reap(rank, proc)
        if proc is not None and proc is not self.supervisor.procs.get(rank):
            return  # an incarnation that was already replaced
        if code is None or info.state in GONE:
            return
        host = self.supervisor.lost_host(rank)
        # A lost host ends all its ranks at once: one decision for all of
        # them (one respawn on the spare host, one re-formation), not one each.
        ranks = [rank] + [r for r in self.supervisor.lost_with(host)
                          if r != rank and self.ranks[r].state not in GONE
                          and self.supervisor.reap(r) is not None] if host else [rank]
        deaths = [(r, self.ranks[r].state == RankState.STARTING and not self.started)
                  for r in ranks]
        errors = {r: self._record_death(r, starting) for r, starting in deaths}
        for r in ranks:
            self._note_unknown_call(r, errors[r])
        if self.stopped or any(starting for _, starting in deaths):
            for r in ranks:
                self.ranks.move(r, RankState.DEAD)  # not the policy's: nothing comes back
                self.calls.fail(r, errors[r], coming_back=False)
            return
        cause = signal_name(info.exitcode) or f"exit code {info.exitcode}"
        if info.silent_for is not None:
            cause = "missed heartbeats"
        if host:  # its host is gone: not a crash to retry there (agents.py): LOST
            # and so are its ranks waiting out a backoff: their respawn was due
            # there (a call waiting for it would wait that long for nothing)
            waiting = [r for r in self.supervisor.placed_on(host)
                       if r not in ranks and self.ranks[r].state is RankState.WAITING]
            actions = self.policy.handle(HostLost(host, tuple(ranks + waiting), time.monotonic(),
                                                  self.supervisor.replacement_host(host)))
        else:  # the policy moves it DEAD, then WAITING / FAILED (or keeps it DEAD)
            actions = self.policy.handle(Died(rank, time.monotonic(), cause, info.incarnation,
                                              answered=info.answered))
        for r in ranks:
            self._announce(f"monarch_nb: {errors[r].headline}")
        self.apply(actions)  # first: a GiveUp ends the calls with its own reason
        for r in ranks:
            self.calls.fail(r, errors[r], coming_back=self.ranks.coming_back(r))
        self.keep_spare(time.monotonic())  # a backoff started: use the wait

    def _note_unknown_call(self, rank: int, error: RankDied) -> None:
        """``rank`` died in a call the call table does not have: kept for
        the attach that adopts the calls the ranks still run."""
        if self.cfg.keep_alive is None:
            return  # (only a kept mesh has calls that ran without this controller)
        proc = self.supervisor.procs.get(rank)
        call = {} if proc is None else proc.flight[0]
        call_id = call.get("call")
        if isinstance(call_id, int) and call_id > 0 and call_id not in self.calls:
            self.unknown_call_deaths[rank] = (call_id, str(call.get("name") or ""), error)

    def _record_death(self, rank: int, starting: bool) -> RankDied:
        """Note ``rank``'s death (its exit, the event with its cause) and
        the error its calls end with."""
        info = self.ranks[rank]
        proc = self.supervisor.procs.get(rank)
        code = None if proc is None else proc.popen.poll()
        info.exitcode = code
        self.requested.discard(rank)  # a death on the way back is news again
        self.settled_at = time.monotonic()
        detail = describe_exit(code)
        hint = self.supervisor.death_hint(rank, info.health)  # deathcause.py
        if hint:
            detail = f"{detail}: {hint}"
        if info.silent_for is not None:
            detail = f"no heartbeat for {info.silent_for:.1f} s, killed"
            if info.frozen:
                detail = f"{info.frozen}; {detail}"
        self.ranks.record(rank, EventKind.FAILED_START if starting else EventKind.DIED, detail)
        return self.died_error(info)

    def on_ready(self, info: RankInfo, msg: Message) -> None:
        if info.state == RankState.DYING:
            return  # we asked it to die: its exit is what counts now
        proc = self.supervisor.procs.get(info.rank)
        if proc is not None and proc.pid and not proc.announced:  # its agent's word is queued
            self._started(info.rank, proc)
        self.ranks.move(info.rank, RankState.READY)
        info.device = str(meta_of(msg, Kind.READY).get("device", ""))
        info.ready_at = time.monotonic()
        self.settled_at = info.ready_at
        self.ranks.record(info.rank, EventKind.READY, info.device)
        if not self.started:
            return
        self._replay_setup(info)
        for call in self.calls.reissue(info.rank):  # after the setup: first in, first out
            self.ranks.move(info.rank, RankState.BUSY)
            call.progressed(info.ready_at)
            self.io.send(info.main_id, call.frames)
        for call in self.calls:
            if info.rank in call.growing:
                self._admit(call)
        if info.rank in self.requested:
            self.requested.discard(info.rank)
        else:
            self._announce(f"monarch_nb: rank {info.rank} is back (incarnation "
                           f"{info.incarnation}, generation {self.generation})")
        self.send_waiting()

    def on_reformed(self, info: RankInfo, msg: Message) -> None:
        self.awaiting_reform.pop(info.rank, None)
        self._progress(info.rank)
        meta = meta_of(msg, Kind.REFORMED)
        call = self.calls.get(int(meta.get("call") or 0)) if meta.get("joining") else None
        if call is not None and call.growing:  # re-formed inside it (mnb.elastic): a grow
            self.calls.regrouped_in(call, info.rank, int(meta.get("generation", 0)))
            self._admit(call)
        error = None if meta.get("joining") else meta.get("error")
        if error:
            self.ranks.record(info.rank, EventKind.REFORM_FAILED, str(error))
            self._announce(f"monarch_nb: rank {info.rank} could not join generation "
                           f"{meta.get('generation')}: {error}")

    def on_probe(self, info: RankInfo, threads: list[Any]) -> None:
        """Where a member that has not answered its REFORM stands."""
        if info.rank not in self.awaiting_reform:
            return
        in_collective = RankStacks(info.rank, "ok", threads).collective()
        if in_collective and info.state in LIVE and self.supervisor.procs.get(info.rank):
            # the policy decides (a new incarnation); _replace_stuck carries it out
            self.apply(self.policy.handle(Probed(info.rank, True, time.monotonic())))
        else:  # busy computing: leave it, look again later
            self.awaiting_reform[info.rank] = time.monotonic() + REFORM_GRACE_S

    def kill(self, rank: int, sig: int) -> None:
        """Send ``sig`` to ``rank``'s process (fault injection: ``mesh.kill``).
        For a signal that ends it (KILL, TERM) the rank is DYING at once, so
        a call issued right after waits for its respawn and runs on the
        re-formed group instead of meeting the death half-way. Runs on the
        thread that leads the I/O loop."""
        info = self.ranks[rank]
        proc = self.supervisor.procs.get(rank)
        if (sig in (signal_mod.SIGKILL, signal_mod.SIGTERM) and self.started and not self.stopped
                and proc is not None and proc.popen.poll() is None
                and info.state in LIVE | {RankState.RESPAWNING}):
            self.ranks.move(rank, RankState.DYING)
        self.supervisor.signal(rank, sig)

    def restart(self, ranks: tuple[int, ...]) -> None:
        """Replace ``ranks`` with new processes (thread-safe; user request)."""
        def restart() -> None:
            self.requested.update(ranks)
            self.apply(self.policy.handle(RestartRequested(ranks, time.monotonic())))

        self.io.call_soon(restart)

    def hosts_added(self) -> None:
        """Hosts were given (``mesh.add_hosts``; thread-safe): the ranks lost
        with a host start on the host back, or on a spare now (the
        launcher's placement), and the group grows back with them."""
        def added() -> None:
            if self.stopped:
                return
            by_host: dict[str, list[int]] = {}
            for info in self.ranks:
                if info.state is RankState.LOST:
                    by_host.setdefault(self.supervisor.lost_host(info.rank), []).append(info.rank)
            for lost, ranks in by_host.items():
                host = self.supervisor.host_for(lost) if lost else None
                if host:
                    self.apply(self.policy.handle(HostAdded(host, tuple(ranks), time.monotonic())))

        self.io.call_soon(added)

    def tick(self, now: float) -> None:
        deadline = self.policy.next_deadline()
        if deadline is not None and deadline <= now:
            self.apply(self.policy.handle(Timer(now)))
        for rank, look_at in list(self.awaiting_reform.items()):
            if now > look_at:
                # where is it? on_probe replaces it if still in a collective
                self.awaiting_reform[rank] = now + REFORM_GRACE_S
                info = self.ranks[rank]
                if self.reform_frames is not None:
                    # and the REFORM again, the same signed frames: a member
                    # that got it drops this copy as a replay, one whose
                    # copy was lost (its link to us down while it was sent)
                    # gets it now instead of waiting out its reform timeout
                    self.io.send(info.main_id, self.reform_frames)
                self.io.send(info.ctl_id, self.codec.sign(Kind.STACKS))
        self.keep_spare(now)

    # -- calls ----------------------------------------------------------------------
    def must_wait(self, ranks: tuple[int, ...]) -> bool:
        """A call to ``ranks`` must not be sent now: one of them is on its way
        back, or the group is about to be re-formed."""
        return self.started and self.ranks.must_wait(ranks)

    def send_waiting(self) -> None:
        for call in self.calls.take_waiting():
            self._dispatch(call)  # waits again if it still must

    def _progress(self, rank: int) -> None:
        """Recovery is progress for the calls of ``rank`` (hang watchdog)."""
        now = time.monotonic()
        for call in self.calls:
            if rank in call.remaining or rank in call.reissue:
                call.progressed(now)

    # -- the policy's actions ---------------------------------------------------------
    def apply(self, actions: list[Action]) -> None:
        """Carry the policy's actions out, in order: its moves through the
        rank table's methods, the rest with processes, sockets and calls."""
        self._notes = []  # said after the ranks' own lines (a Shrink's)
        restarted: dict[str, list[int]] = {}  # why -> the ranks a group restart restarts
        for action in actions:
            if isinstance(action, Move):
                self.ranks.move(action.rank, action.to)
            elif isinstance(action, Report):
                self._announce(f"monarch_nb: {action.message}")
                info = self.ranks[action.rank]
                self.calls.fail(action.rank, self.died_error(info), coming_back=False)
            elif isinstance(action, GiveUp):
                self._give_up(action)
            elif isinstance(action, NotComingBack):
                self._not_coming_back(action)
            elif isinstance(action, Shrink):
                self._shrink(action)
            elif isinstance(action, Grow):
                self._grow(action)
            elif isinstance(action, Kill):
                self._kill(action.rank, action.reason)
                if action.reason:  # a script's group restart: one line for its ranks
                    restarted.setdefault(action.reason, []).append(action.rank)
            elif isinstance(action, Respawn):
                self.ranks.respawning(action.rank, action.incarnation, action.host)
            elif isinstance(action, Reform):
                self._reform(action)
            elif isinstance(action, ReplaceStuck):
                self._replace_stuck(action.rank, action.incarnation)
            elif isinstance(action, StartSpare):
                self.supervisor.start_spare()
        for why, ranks in restarted.items():
            self._announce(f"monarch_nb: {why}: restarting rank {format_ranks(ranks)} too "
                           "(every rank runs the script again in a new process, as torchrun "
                           "restarts its workers)")
        for note in self._notes:
            self._announce(note)

    def _kill(self, rank: int, reason: str = "") -> None:
        """Mode ``all``, a user's restart, or a script's group restart
        (``reason``: why): the process goes now (the policy's Move DEAD
        follows); its exit is old news (the pidfd event finds the rank
        without a process already)."""
        info = self.ranks[rank]
        proc = self.supervisor.procs.get(rank)
        if proc is None or info.state in GONE:
            return
        self.supervisor.kill_proc(proc)
        info.exitcode = -9
        # a group restart's call ends as the group changed, not as a crash of its own
        error: MonarchError = (MembershipChanged(rank, (), f"restarted in a new process ({reason})")
                               if reason else self.died_error(info))
        if reason:
            self.ranks.record(rank, EventKind.REPLACED,
                              f"restarted in a new process with the group ({reason})")
        self.calls.fail(rank, error, coming_back=False)

    def _give_up(self, action: GiveUp) -> None:
        rank = action.rank  # FAILED already: the policy's Move came first
        self.ranks.record(rank, EventKind.GAVE_UP, action.reason)
        self._announce(f"monarch_nb: {action.reason}")
        self.calls.fail(rank, MonarchError(action.reason), coming_back=False)
        # (the NotComingBack that follows ends its elastic calls)

    def _not_coming_back(self, action: NotComingBack) -> None:
        """The policy's NotComingBack: ``action.ranks`` lost their calls
        already (their Report or GiveUp came first). An elastic call that
        had them cannot finish: its survivors wait for a REFORM (or sit in a
        collective with them, or in a state sync), which will not come. The
        call ends now for all of them, and the survivors are interrupted so
        they are free for the next call; calls waiting to be sent go out, or
        fail for the ranks that are gone."""
        gone = set(action.ranks)
        for call in self.calls:
            if not call.elastic or not gone & (call.remaining | call.reissue | call.errors.keys()):
                continue
            # and told to leave the broken group: one interrupted between two
            # collectives would keep a peer inside the next one waiting on it
            frames = self.codec.sign(Kind.INTERRUPT, call=call.call_id, meta={"leave": True})
            for r in call.remaining:
                if self.ranks[r].state in LIVE:
                    self.io.send(self.ranks[r].ctl_id, frames)
            # (ranks in reissue are on their way back: the call is not re-issued to them)
            self.calls.abandon(call, call.remaining | call.reissue, lambda r: MembershipChanged(
                r, action.ranks, f"the elastic call was ended, no re-formation is coming: "
                f"{action.reason}"))
        self.send_waiting()

    def _shrink(self, action: Shrink) -> None:
        """The policy's Shrink: the group goes on without ``action.gone``
        (the Reform that forms it follows). An elastic call that had them
        records them lost, not failed, and carries on with the others,
        which wait for that REFORM (mnb.elastic); any other call loses them
        by their own Report / GiveUp, which follows."""
        gone, n = set(action.gone), len(action.ranks)
        why = f"the group went on without it ({action.reason})"
        for call in self.calls:
            if call.elastic and gone & (call.remaining | call.reissue):
                self.calls.shed(call, gone, lambda r: Lost(r, why))
        detail = (f"world size {n}: rank {format_ranks(action.ranks)} (without rank "
                  f"{format_ranks(action.gone)}: {action.reason})")
        self.ranks.record(-1, EventKind.SHRUNK, detail)
        # after the lost ranks' own lines (their Report / GiveUp follow), which say why
        self._notes.append(f"monarch_nb: the group goes on without rank "
                           f"{format_ranks(action.gone)}, at world size {n} of "
                           f"{len(self.ranks)} (min_ranks {self.cfg.min_ranks})")

    def _grow(self, action: Grow) -> None:
        """The policy's Grow: ``action.back`` are in the group again (the
        Reform that starts them follows). An elastic call that runs without
        them takes them back once its members re-formed inside it (at a
        commit: :meth:`_admit`); the survivors are not disturbed meanwhile."""
        back, n = set(action.back), len(action.ranks)
        running = False
        for call in self.calls:
            if call.elastic and call.sent and call.remaining:
                self.calls.grow(call, back)
                running = running or bool(call.growing)
        self._grows = True
        whole = " (whole again)" if n == len(self.ranks) else ""
        again = "; whole again" if n == len(self.ranks) else ""
        self.ranks.record(-1, EventKind.GROWN, f"world size {n}: rank {format_ranks(action.ranks)}"
                          f" (rank {format_ranks(action.back)} back{again})")
        self._notes.append(f"monarch_nb: rank {format_ranks(action.back)} back in the group, at "
                           f"world size {n} of {len(self.ranks)}{whole}"
                           + ("; the elastic loop takes them at its next state.commit()"
                              if running else ""))

    def _admit(self, call: PendingCall) -> None:
        """Give the elastic ``call`` to the ranks back (a grow) that are
        READY, once every member still in it re-formed into the group now
        inside it: they wait for them in their state sync there. Until then
        (or if it ends first) the call is not theirs."""
        members = set(call.remaining)
        if not members or any(call.regrouped.get(r) != self.generation for r in members):
            return
        for rank in sorted(call.growing):
            info = self.ranks[rank]
            if info.state is RankState.READY and self.calls.take_back(call, rank, self.generation):
                self.ranks.move(rank, RankState.BUSY)
                self.io.send(info.main_id, call.frames)
                self.ranks.record(rank, EventKind.REJOINED, f"call {call.call_id}, generation "
                                  f"{self.generation}")

    def _reform(self, action: Reform) -> None:
        """New generation: fresh store port; respawning members start with
        it, live members are told to leave their group and join it. The
        REFORM names the group's members (mesh ranks in torch rank order):
        fewer than the mesh's after a shrink."""
        self.ranks.reformed(action.generation, action.group)
        port = free_port()
        self.supervisor.reform(action.generation, port, self.ranks.group)
        # the store's address too: it moves with rank 0 when a spare host
        # took its host's place, or to the first rank left after a shrink
        addr = self.supervisor.master_addr()
        frames = self.codec.sign(Kind.REFORM, meta={"generation": action.generation,
                                                    "port": port, "addr": addr,
                                                    "members": list(self.ranks.group)})
        self.reform_frames = frames  # sent again to members slow to answer (tick)
        now = time.monotonic()
        grows, self._grows = self._grows, False
        self.lost = {r for r in action.ranks if self.ranks[r].state == RankState.RESPAWNING}
        for rank in action.ranks:
            info = self.ranks[rank]
            if info.state == RankState.RESPAWNING:
                old = self.supervisor.procs.get(rank)
                if old is not None and old.popen.poll() is None:
                    self.supervisor.kill_proc(old)  # never two processes for one rank
                self.start_process(rank, info.incarnation)
                self.ranks.record(rank, EventKind.RESPAWNED, f"generation {action.generation}")
            elif info.state in LIVE:
                # queued behind the rank's current call: a survivor in a
                # collective with the dead rank fails out of it first (and
                # leaves its group, releasing its peers), then re-forms
                self.io.send(info.main_id, frames)
                if grows and self.calls.busy(rank):
                    # its group is whole: it is not stuck, it joins when its
                    # call is over or at its next state.commit() (mnb.elastic)
                    continue
                # looked at after the grace unless it re-formed by then (an
                # idle member may hang leaving its old group, too)
                self.awaiting_reform[rank] = now + REFORM_GRACE_S
        self.ranks.record(-1, EventKind.REFORMED,
                          f"generation {action.generation}, ranks {list(action.ranks)}"
                          + (f", world size {len(action.group)}" if action.group else ""))
        self.send_waiting()  # behind the REFORM on every live member's socket

    def _replace_stuck(self, rank: int, incarnation: int) -> None:
        """The policy's ReplaceStuck: a member still inside the old group's
        collective after the grace gets a new process in the current
        generation. An elastic call is re-issued on the new one, which takes
        its state from a live peer."""
        self.awaiting_reform.pop(rank, None)
        info = self.ranks[rank]
        old = self.supervisor.procs.get(rank)
        if old is None or info.state not in LIVE:
            return  # it died meanwhile: its death is the news (the policy had a stale view)
        self.supervisor.kill_proc(old)
        self.calls.fail(rank, MembershipChanged(rank, sorted(self.lost), "its process was "
                                                "replaced: it was stuck in a collective after "
                                                "the group changed"),
                        coming_back=True)
        self.ranks.respawning(rank, incarnation)
        self.start_process(rank, incarnation)
        self.ranks.record(rank, EventKind.REPLACED,
                          f"stuck in a collective; joins generation {self.generation}")
        self._announce(f"monarch_nb: rank {rank} was stuck in a collective after the group "
                       f"changed; replaced it (incarnation {info.incarnation})")

    def _replay_setup(self, info: RankInfo) -> None:
        """Send the recorded --setup cells to a new process, in order, ahead
        of any other call (its main socket is first in, first out)."""
        for cell in self.calls.setup_cells:
            call_id = self.calls.next_id()
            future = MeshFuture(call_id, (info.rank,), lambda _id: None)
            code, meta = exec_parts(cell)
            frames = self.codec.sign(Kind.EXEC, code, call=call_id, meta=meta)
            call = self.calls.new(call_id, (info.rank,), self._default_output() or CallOutput(),
                                  future, frames=frames, internal=True)
            self.calls.sent(call)
            future.add_done_callback(functools.partial(self._replay_done, info.rank, str(cell["name"])))
            self.io.send(info.main_id, frames)

    def _replay_done(self, rank: int, name: str, fut: MeshFuture) -> None:
        exc = fut.exception()
        if exc is None:
            return
        err = exc.errors.get(rank, exc) if isinstance(exc, RankErrors) else exc
        # the first line says what happened (the rank's error, or how it
        # died); later ones are a traceback or output, possibly blank
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        reason = lines[0] if lines else type(err).__name__
        self.ranks.record(rank, EventKind.SETUP_FAILED, f"{name}: {reason}")
        self._announce(f"monarch_nb: replaying setup cell {name} on rank {rank} failed: {reason}")

    def keep_spare(self, now: float) -> None:
        """Hold a spare process when the policy says so (SpareCheck)."""
        sup = self.supervisor
        sup.forget_dead_spare()  # a spare that died (out of memory?): another one later
        if not (self.cfg.spare and self.started and not self.stopped and sup.spare is None):
            return
        self.apply(self.policy.handle(SpareCheck(now, now - self.settled_at,
                                                 all(r.state in LIVE for r in self.ranks),
                                                 cheap=sup.forks_now)))
