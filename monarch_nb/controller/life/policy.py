"""Restart policy: pure, stimuli in (what happened to a rank), actions out.

No processes, sockets, clocks or randomness of its own: time arrives inside
stimuli and jitter comes from an injected ``random.Random``, so every decision
is reproducible in a unit test with a scripted event sequence (as torch
elastic tests its agent with scripted monitor results)::

    table = RankTable(4)
    policy = RestartPolicy(table, mode="rank")
    policy.handle(Died(rank=1, now=10.0, cause="SIGKILL"))
    # -> [Move(1, DEAD), Move(1, WAITING), Respawn(rank=1, incarnation=1),
    #     Reform(generation=1, ranks=(0, 1, 2, 3))]

A rank's state, incarnation and host, and the group's generation, are the
rank table's (ranktable.py; the one state machine and its diagram are in
rankstates.py). The policy reads them and answers with typed moves
(:class:`Move`, :class:`Respawn`, :class:`ReplaceStuck`, :class:`Reform`)
among its other actions; recovery carries them out through the table's
methods, so the policy's next stimulus finds the table moved. Within one
stimulus the policy decides on a private snapshot (its own moves so far),
thrown away when it returns. Of its own it keeps only what no one else
needs: each rank's deaths within the window (the restart budget) and the
time its scheduled respawn is due (the backoff).

Decisions::

    Died (a rank with a process)   -> Move DEAD, then
        mode "off"                 -> Report (it stays DEAD, the survivors carry on),
                                      NotComingBack
        budget spent (or 0)        -> Move FAILED, GiveUp (only a restart revives it),
                                      NotComingBack
        else                       -> Move WAITING, due after the backoff
                                      (mode "all": every other rank with a process too,
                                      Kill + Move DEAD + Move WAITING)
    Timer (due)                    -> Respawn (RESPAWNING, incarnation + 1), Reform
    RestartRequested               -> (Kill + Move DEAD if it has a process) Move WAITING,
                                      due now, deaths forgotten
    HostLost (a rank with a process, or WAITING)
                                   -> Move LOST (no budget spent); with a spare host:
                                      Respawn(host=spare) keeping the rank number, Reform;
                                      without: Report, NotComingBack.
                                      DEAD / FAILED / LOST / STOPPED: no change.
    HostAdded (a host for ranks lost with theirs: mesh.add_hosts, a node back)
                                   -> the LOST ones among them: Respawn(host=it), Grow, Reform
    (any of the NotComingBack cases above, with ``min_ranks`` and at least
    that many ranks left)          -> Shrink, the ranks' own Report / GiveUp,
                                      Reform(group=the ranks left) (none while a rank
                                      left waits out its backoff: the Timer's forms it)
    (restart_group: a Died respawned, a HostLost with a spare, a Shrink)
                                   -> also Kill + Move DEAD + Move WAITING of every
                                      other rank with a process not in an elastic loop
    Probed (READY/BUSY, in a collective)  -> ReplaceStuck (RESPAWNING, incarnation + 1)
    SpareCheck                     -> StartSpare while a rank waits out its backoff, at
                                      once when it is forked (cheap), or once the mesh
                                      has been settled ``SPARE_DELAY_S`` with every rank
                                      live

A Died of an incarnation the table has already replaced, or of a rank
without a process (DEAD, WAITING, FAILED, LOST, STOPPED), is old news: no
action.

Whoever waits for a re-formation that will not come is told at once: every
decision that leaves a rank without a process until a user acts (respawn
off, budget spent, host lost with no spare) ends with :class:`NotComingBack`
naming the ranks and why. An elastic call's survivors wait for exactly that
re-formation (mnb.elastic); their own timeout is the last resort, not the
mechanism.

Elastic world size (``min_ranks``). Without it the group always has every
rank: one gone for good ends the elastic calls (NotComingBack). With it,
and at least ``min_ranks`` ranks left (those not gone for good: not FAILED,
LOST, STOPPED nor DEAD for good), the group goes on without the lost ones
instead: :class:`Shrink` says so (before their own Report / GiveUp, so an
elastic call records them lost rather than failed) and the Reform that
follows names the new ``group``, in which mesh rank ``group[i]`` is torch
rank ``i``. Fewer left: NotComingBack, its reason saying how many remain.
A rank brought back (a host given for lost ranks: :class:`HostAdded`; a
user's restart) is in the group again at the Reform that starts it: every
Reform's group is the ranks not gone for good, and one larger than the
group now is announced by :class:`Grow` first (an elastic call that runs
takes the ranks back when its members re-form inside it, at their next
``state.commit()``).

Modes: ``rank`` replaces only the dead rank; ``all`` replaces every rank
(the survivors are restarted too, torchrun-style); ``off`` reports and keeps
the survivors.

A script's group restart (``restart_group``, what ``python -m
monarch_nb.launch`` asks for): every rank that runs the script again does so
in a new process, as torchrun restarts its whole worker group. A death (with
respawns on) restarts every other rank with a process too, at the dead
one's time, except those whose main thread runs an ``mnb.elastic`` loop
(``RankInfo.elastic_loop``, from their heartbeats): they carry on in place
and take the group's state over at the Reform. So does a lost host's spare
host, and so does a Shrink: the ranks left restart at the smaller size
(torchrun's new ``WORLD_SIZE``), but those in an elastic loop. A rank
restarted so spends no budget: only the one that died does.

Backoff, for crash loops only. A process that answered one of the user's
calls (``Died.answered``: a result or its own error; a replayed ``--setup``
cell is no answer) was working: it is respawned at once, however often its
rank died before (kills, an OOM, a lost GPU are not a loop). A process that
dies before it answered anything since it came back is in a crash loop,
backed off as such: the loop's first respawn at once (a training cell
should not wait), then ``base * 2**(k-1)`` seconds before the k-th after
it, with +/-25 % jitter, capped at ``cap``. A loop starts afresh at each
working process's death; deaths older than ``window`` drop out of it.

Budget: at most ``budget`` respawns of a rank within ``window`` seconds,
working or not; past it the rank is FAILED with a message that says why and
what to do. A rank that stayed up for ``window`` seconds has a clean slate
again, since its old deaths fall out of the window. A budget of 0 means no
respawn at all (torchrun's ``--max-restarts 0``): the message then says so,
and how to turn respawns on (``no_restarts``), not that a budget was spent.

Not here: *doing* any of it (recovery.py carries the actions out), the
states and their allowed moves (rankstates.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ...errors import lost_host_hint
from ...rankspans import format_ranks
from .rankstates import GONE, LIVE, RankState, check
from .ranktable import RankTable

SPARE_DELAY_S = 2.0  # settled this long before a spare process is started

S = RankState
_NO_PROCESS = GONE  # DEAD, WAITING, FAILED, LOST, STOPPED
# not coming back until a user acts (DEAD: within one stimulus a dead rank
# moves on to WAITING or FAILED, except with respawn off, where it stays)
_FOR_GOOD = frozenset({RankState.DEAD, RankState.FAILED, RankState.LOST, RankState.STOPPED})


# -- stimuli: what happened to a rank (not the event log of life/events.py) --


@dataclass(frozen=True)
class Died:
    """A rank's process ended. ``incarnation`` says which process: the death
    of one that was already replaced (we killed it to restart it) is old news.
    ``answered``: that process answered one of the user's calls (it was
    working: no backoff)."""

    rank: int
    now: float
    cause: str = ""
    incarnation: int | None = None
    answered: bool = False


@dataclass(frozen=True)
class RestartRequested:
    """The user asked (``%monarch restart RANK|all``): budget does not apply."""

    ranks: tuple[int, ...]
    now: float


@dataclass(frozen=True)
class Timer:
    now: float


@dataclass(frozen=True)
class HostLost:
    """A host is gone with ``ranks`` on it (the host agent's report). With a
    ``spare`` host they are respawned there at once (same rank numbers),
    else they stay LOST until a restart."""

    host: str
    ranks: tuple[int, ...]
    now: float
    spare: str | None = None


@dataclass(frozen=True)
class HostAdded:
    """``host`` takes ``ranks``, lost with their host (``mesh.add_hosts``:
    a spare host given later, or the lost host itself back, as a SLURM node
    that returns). Those still LOST are started there with their rank
    numbers; the others are no business of a host (a restart decides)."""

    host: str
    ranks: tuple[int, ...]
    now: float


@dataclass(frozen=True)
class Probed:
    """Where a member that has not answered its REFORM stands: still inside
    the old group's collective (``in_collective``), or computing."""

    rank: int
    in_collective: bool
    now: float


@dataclass(frozen=True)
class SpareCheck:
    """May a spare process be started now? The mesh has had no start,
    death or respawn for ``settled_for`` seconds; ``all_live``: every rank
    takes calls; ``cheap``: the spare would be forked from a ready warm
    process (milliseconds of CPU, its memory shared). Sent only while
    spares are on and none is held."""

    now: float
    settled_for: float
    all_live: bool
    cheap: bool = False


Stimulus = Died | RestartRequested | Timer | HostLost | HostAdded | Probed | SpareCheck


# -- actions -----------------------------------------------------------------


@dataclass(frozen=True)
class Move:
    """Move ``rank`` to ``to`` in the rank table (:meth:`RankTable.move`)."""

    rank: int
    to: RankState


@dataclass(frozen=True)
class Respawn:
    """``rank`` gets a new process, ``incarnation``, on ``host`` ("": where it
    was): RESPAWNING in the table; started at the Reform that follows."""

    rank: int
    incarnation: int
    host: str = ""


@dataclass(frozen=True)
class Kill:
    """Stop a rank's process (mode ``all``: survivors are replaced too; a
    user's restart; a script's group restart, ``reason`` saying why). A
    ``Move(rank, DEAD)`` follows."""

    rank: int
    reason: str = ""


@dataclass(frozen=True)
class Reform:
    """Form a new torch.distributed group (new store, new port): the table's
    next ``generation``; ``ranks``: its members with a process (started or
    told to join). ``group``: the mesh ranks of the new group, in the order
    of their torch ranks, when it changes (a shrink, a rank back in it);
    None: the same as the last."""

    generation: int
    ranks: tuple[int, ...]
    group: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Shrink:
    """The group goes on without ``gone`` (not coming back: budget spent,
    host lost with no spare, respawn off), ``reason`` saying why: its members
    are ``ranks`` now (at least ``min_ranks``). Calls that had ``gone`` record
    them lost; an elastic call carries on with the rest. The Reform that
    forms the smaller group follows (or, while a member waits out its
    backoff, the Timer's)."""

    ranks: tuple[int, ...]
    gone: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class Grow:
    """The group takes ``back`` again (ranks started anew: a host given for
    lost ranks, a user's restart of ranks gone for good): its members are
    ``ranks`` now. The Reform that forms it follows. An elastic call that
    runs without them takes them back once its members re-form inside it
    (at their next ``state.commit()``: mnb.elastic); else they join at the
    next call."""

    ranks: tuple[int, ...]
    back: tuple[int, ...]


@dataclass(frozen=True)
class GiveUp:
    """The restart budget of ``rank`` is spent (it was moved FAILED): tell
    the user ``reason`` and end the calls that wait for it."""

    rank: int
    reason: str


@dataclass(frozen=True)
class Report:
    rank: int
    message: str


@dataclass(frozen=True)
class NotComingBack:
    """No re-formation will bring ``ranks`` back until the user acts (respawn
    off, budget spent, host lost with no spare): whoever waits for one is
    told now, ``reason`` saying why and what to do. After the ranks' own
    Report or GiveUp, which end their calls."""

    ranks: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class ReplaceStuck:
    """Replace a live member stuck in the old group's collective: a new
    process (``incarnation``) in the current generation, not a failure."""

    rank: int
    incarnation: int


@dataclass(frozen=True)
class StartSpare:
    """Start a spare process (torch imported, waiting to become a rank)."""


Action = (Move | Respawn | Kill | Reform | Shrink | Grow | GiveUp | Report | NotComingBack
          | ReplaceStuck | StartSpare)


class _Snapshot:
    """The table as the policy's moves so far in one stimulus leave it: the
    policy checks each move against the transition table as it makes it."""

    def __init__(self, table: RankTable) -> None:
        self.table = table
        self.states: dict[int, RankState] = {}
        self.incarnations: dict[int, int] = {}
        self.actions: list[Action] = []

    def state(self, rank: int) -> RankState:
        return self.states.get(rank, self.table[rank].state)

    def incarnation(self, rank: int) -> int:
        return self.incarnations.get(rank, self.table[rank].incarnation)

    def move(self, rank: int, to: RankState) -> None:
        frm = self.state(rank)
        if frm is not to:
            check(rank, frm, to)
            self.states[rank] = to
            self.actions.append(Move(rank, to))

    def respawn(self, rank: int, host: str = "") -> None:
        self.move_only(rank, RankState.RESPAWNING)
        self.incarnations[rank] = inc = self.incarnation(rank) + 1
        self.actions.append(Respawn(rank, inc, host))

    def move_only(self, rank: int, to: RankState) -> None:
        """The state a typed move other than Move (Respawn, ReplaceStuck) makes."""
        check(rank, self.state(rank), to)
        self.states[rank] = to

    def members(self) -> tuple[int, ...]:
        return tuple(r for r in range(len(self.table)) if self.state(r) not in _NO_PROCESS)

    def left(self) -> tuple[int, ...]:
        """The ranks not gone for good: the group of an elastic world size."""
        return tuple(r for r in range(len(self.table)) if self.state(r) not in _FOR_GOOD)


@dataclass
class RestartPolicy:
    """Decides about deaths, restarts, lost hosts and stuck members of the
    ranks in ``table`` (read, never written: see the module docstring)."""

    table: RankTable
    mode: str = "rank"
    budget: int = 5
    window: float = 600.0
    base: float = 0.5
    cap: float = 30.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    # with budget 0, why a dead rank is not respawned and how to turn respawns
    # on, as the user would set it (script mode names its --max-restarts)
    no_restarts: str = ("restart_budget=0; start the mesh with restart_budget=N "
                        "(Mesh.start(..., restart_budget=N)) to respawn dead ranks")
    # elastic world size: the group goes on without ranks gone for good while
    # at least this many are left; None: it keeps every rank (see above)
    min_ranks: int | None = None
    # a script's group restart (see above): a death restarts the other ranks
    # too, but those in an mnb.elastic loop
    restart_group: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("rank", "all", "off"):
            raise ValueError(f"unknown respawn mode {self.mode!r}")
        n = len(self.table)
        if self.min_ranks is not None and not 1 <= self.min_ranks <= n:
            raise ValueError(f"min_ranks {self.min_ranks} outside 1..{n}")
        self.deaths: list[list[float]] = [[] for _ in range(n)]  # times of deaths in the window
        # times of the deaths of the crash loop a rank is in (the backoff): since,
        # and with, the death of its last process that answered a call
        self.loop: list[list[float]] = [[] for _ in range(n)]
        self._due: dict[int, float] = {}  # rank -> when its scheduled respawn is due

    def budgets(self) -> dict[str, list[list[float]]]:
        """What a kept mesh's next controller needs to go on counting (the
        death times are CLOCK_MONOTONIC, the same for every process of the
        machine)."""
        return {"deaths": [list(d) for d in self.deaths], "loop": [list(d) for d in self.loop]}

    def restore_budgets(self, data: dict[str, object]) -> None:
        """:meth:`budgets` of an earlier controller (attach); anything that
        does not fit this mesh is left out."""
        for name in ("deaths", "loop"):
            rows = data.get(name)
            if isinstance(rows, list) and len(rows) == len(self.deaths):
                setattr(self, name, [[float(t) for t in row if isinstance(t, (int, float))]
                                     if isinstance(row, list) else [] for row in rows])

    def handle(self, event: Stimulus) -> list[Action]:
        snap = _Snapshot(self.table)
        if isinstance(event, Died):
            self._died(snap, event)
        elif isinstance(event, RestartRequested):
            self._restart(snap, event)
        elif isinstance(event, HostLost):
            self._host_lost(snap, event)
        elif isinstance(event, HostAdded):
            self._host_added(snap, event)
        elif isinstance(event, Probed):
            if event.in_collective and snap.state(event.rank) in LIVE:
                snap.move_only(event.rank, RankState.RESPAWNING)
                snap.actions.append(ReplaceStuck(event.rank, snap.incarnation(event.rank) + 1))
            # else computing (looked at again later), or already being replaced
        elif isinstance(event, SpareCheck):
            if self._spare_due(event):
                snap.actions.append(StartSpare())
        else:
            self._timer(snap, event.now)
        return snap.actions

    # -- decisions -------------------------------------------------------------
    def _died(self, snap: _Snapshot, ev: Died) -> None:
        rank = ev.rank
        if ev.incarnation is not None and ev.incarnation < snap.incarnation(rank):
            return  # a process we already replaced
        if snap.state(rank) in _NO_PROCESS:
            return  # already handled (a second report of the same death)
        snap.move(rank, S.DEAD)
        if self.mode == "off":
            self._gone(snap, (rank,), [Report(rank, f"rank {rank} died ({ev.cause}); respawn is "
                                              "off, the survivors carry on")],
                       f"rank {rank} is not respawned (respawn is off)", ev.now)
            return
        deaths = self.deaths[rank] = [t for t in self.deaths[rank] if ev.now - t < self.window] + [ev.now]
        if len(deaths) > self.budget:
            snap.move(rank, S.FAILED)
            if self.budget == 0:  # respawns are off: no budget was spent
                reason = f"rank {rank} died ({ev.cause}); not respawned: {self.no_restarts}"
                why = f"rank {rank} is not respawned: {self.no_restarts}"
            else:
                reason = (f"rank {rank} died {len(deaths)} times within {self.window:g} s "
                          f"(last: {ev.cause}); not respawning it again. Fix the cause (see "
                          f"%monarch logs {rank}), then %monarch restart {rank}")
                why = (f"rank {rank} is not coming back (restart budget spent); "
                       f"%monarch restart {rank} brings it back")
            self._gone(snap, (rank,), [GiveUp(rank, reason)], why, ev.now)
            return
        # backoff for crash loops only: a working process's death starts one afresh
        if ev.answered:
            self.loop[rank] = [ev.now]
        else:
            self.loop[rank] = [t for t in self.loop[rank] if ev.now - t < self.window] + [ev.now]
        at = ev.now + self._delay(len(self.loop[rank]))
        self._wait(snap, rank, at)
        self._restart_others(snap, (rank,), at, f"rank {rank} died")
        self._timer(snap, ev.now)

    def _restart_others(self, snap: _Snapshot, but: tuple[int, ...], at: float,
                        why: str) -> None:
        """Mode ``all``: every other rank with a process is restarted too
        (due ``at``, with the dead one). A script's group restart: those
        not in an mnb.elastic loop, which carry on in place."""
        if self.mode == "off" or not (self.mode == "all" or self.restart_group):
            return
        for other in range(len(self.table)):
            if other in but or snap.state(other) in _NO_PROCESS:
                continue
            if self.mode != "all" and self.table[other].elastic_loop:
                continue
            snap.actions.append(Kill(other, "" if self.mode == "all" else why))
            snap.move(other, S.DEAD)
            self._wait(snap, other, at)

    def _wait(self, snap: _Snapshot, rank: int, at: float) -> None:
        snap.move(rank, S.WAITING)
        self._due[rank] = at

    def _restart(self, snap: _Snapshot, ev: RestartRequested) -> None:
        for rank in ev.ranks:
            state = snap.state(rank)
            if state is S.STOPPED:
                continue
            if state not in _NO_PROCESS:
                snap.actions.append(Kill(rank))
                snap.move(rank, S.DEAD)
            self.deaths[rank] = []  # a deliberate restart is not a failure
            self.loop[rank] = []
            self._wait(snap, rank, ev.now)
        self._timer(snap, ev.now)

    def _host_lost(self, snap: _Snapshot, ev: HostLost) -> None:
        lost = []
        for rank in ev.ranks:
            if snap.state(rank) in (S.DEAD, S.FAILED, S.LOST, S.STOPPED):
                continue  # gone already: the host adds nothing (a restart decides)
            # no death in the window: the host failed, not the rank
            snap.move(rank, S.LOST)
            self._due.pop(rank, None)  # a respawn due where it was: not there
            lost.append(rank)
        if not lost:
            return
        if ev.spare is None:
            # nothing brings them back: a Report ends their calls, and the
            # survivors of an elastic call are told no re-formation is coming
            # (or, with min_ranks, the group goes on without them)
            self._gone(snap, tuple(lost), [
                Report(rank, f"rank {rank} lost: host {ev.host} lost; " + lost_host_hint([rank]))
                for rank in lost], (f"host {ev.host} lost with rank {format_ranks(lost)}, and "
                                    "no spare host; " + lost_host_hint(lost)), ev.now)
            return
        for rank in lost:
            snap.respawn(rank, host=ev.spare)
        if self.restart_group:  # a script's: its other ranks run the script again too
            self._restart_others(snap, tuple(lost), ev.now, f"host {ev.host} lost")
        if not self._timer(snap, ev.now):
            self._reform(snap)

    def _host_added(self, snap: _Snapshot, ev: HostAdded) -> None:
        back = [r for r in ev.ranks if snap.state(r) is S.LOST]
        if not back:
            return  # restarted meanwhile, or stopped: nothing for the host to take
        for rank in back:
            # no budget spent: the host failed, not the rank
            self._due.pop(rank, None)
            snap.respawn(rank, host=ev.host)
        self._reform(snap)

    def _gone(self, snap: _Snapshot, gone: tuple[int, ...], own: list[Action],
              why: str, now: float) -> None:
        """``gone`` will not come back until the user acts; ``own``: their
        own Report or GiveUp (which end their calls), ``why``: the reason.
        With ``min_ranks`` and enough ranks left the group goes on without
        them (Shrink first: an elastic call then records them lost, not
        failed; a script's group restart restarts the others at the new
        size, but those in an mnb.elastic loop); else whoever waits for
        them is told (NotComingBack)."""
        left = snap.left()
        if self.min_ranks is None or len(left) < self.min_ranks:
            snap.actions.extend(own)
            if self.min_ranks is not None:
                why += (f"; {len(left)} rank(s) left, fewer than min_ranks={self.min_ranks}: "
                        "the group does not go on without them")
            snap.actions.append(NotComingBack(gone, why))
            return
        snap.actions.append(Shrink(left, gone, why))
        snap.actions.extend(own)
        if self.restart_group:  # a script's: the others run it again at the new size
            self._restart_others(snap, gone, now, f"the group goes on without rank "
                                                  f"{format_ranks(gone)}")
        if self._timer(snap, now):
            return  # (its Reform forms the smaller group)
        if not any(snap.state(r) is S.WAITING for r in left):
            self._reform(snap)  # (else the Timer's Reform, once the backoff is over)

    def _reform(self, snap: _Snapshot) -> None:
        """A new generation of the members; with ``min_ranks``, of the ranks
        not gone for good (a shrink, or a rank restarted back into it)."""
        group = None
        if self.min_ranks is not None and snap.left() != self.table.group:
            group = snap.left()
            back = tuple(r for r in group if r not in self.table.group)
            if back:  # (a shrink's group has none)
                snap.actions.append(Grow(group, back))
        snap.actions.append(Reform(self.table.generation + 1, snap.members(), group))

    def _timer(self, snap: _Snapshot, now: float) -> bool:
        """Respawn the ranks due by ``now`` and re-form; whether it did."""
        due = sorted(r for r, at in self._due.items()
                     if at <= now and snap.state(r) is S.WAITING)
        if not due:
            return False
        for rank in due:
            del self._due[rank]
            snap.respawn(rank)
        self._reform(snap)
        return True

    def next_deadline(self) -> float | None:
        """When the controller should send the next Timer, if ever."""
        times = [at for r, at in self._due.items() if self.table[r].state is S.WAITING]
        return min(times) if times else None

    def _spare_due(self, ev: SpareCheck) -> bool:
        # Not during start-up or a recovery, whose CPU it would slow; but at
        # once while a dead rank waits out its backoff: that wait is idle
        # time, and the spare, however far it got, becomes that rank.
        if self.next_deadline() is not None:
            return True
        # A forked spare slows nothing: at once, so that a second kill soon
        # after the first finds one too (a fresh one imports torch: seconds)
        if ev.cheap:
            return True
        return ev.settled_for >= SPARE_DELAY_S and ev.all_live

    def _delay(self, deaths_in_window: int) -> float:
        if deaths_in_window <= 1:
            return 0.0
        delay = min(self.cap, self.base * 2 ** (deaths_in_window - 2))
        return delay * (0.75 + 0.5 * self.rng.random())
