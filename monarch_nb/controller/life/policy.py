"""Restart policy: a pure state machine, stimuli in (what happened to a rank), actions out.

No processes, sockets, clocks or randomness of its own: time arrives inside
stimuli and jitter comes from an injected ``random.Random``, so every decision
is reproducible in a unit test with a scripted event sequence (as torch
elastic tests its agent with scripted monitor results)::

    policy = RestartPolicy(world_size=4, mode="rank")
    policy.handle(Died(rank=1, now=10.0, cause="SIGKILL"))
    # -> [Scheduled(rank=1, at=10.0), Respawn(rank=1, incarnation=1),
    #     Reform(generation=1, ranks=(0, 1, 2, 3))]

Per rank::

    RUNNING --Died--> WAITING --(Timer >= at)--> RESPAWNING --Ready--> RUNNING
       |                 |                                  \\--Died--> WAITING
       |                 \\--(budget spent)--> FAILED (GiveUp; only restart() revives it)
       \\--Died, mode "off"--> DEAD (Report)
    (any but FAILED) --HostLost--> LOST (Report; no budget spent)
                                   \\--spare host given--> RESPAWNING (Respawn(host=spare))
    RUNNING --Probed(in_collective)--> RESPAWNING (ReplaceStuck: a new incarnation)
    FAILED / LOST / DEAD --RestartRequested--> WAITING

Mesh-wide: ``SpareCheck`` -> ``StartSpare`` while a rank waits out its
backoff, or once the mesh has been settled ``SPARE_DELAY_S`` with every rank
live.

Modes: ``rank`` replaces only the dead rank; ``all`` replaces every rank
(the survivors are restarted too, torchrun-style); ``off`` reports and keeps
the survivors. Backoff: the first respawn of a rank is immediate (a training
cell should not wait), then ``base * 2**(k-1)`` seconds with +/-25 % jitter,
capped at ``cap``. Budget: at most ``budget`` respawns of a rank within
``window`` seconds; past it the rank is FAILED with a message that says why
and what to do. A rank that stayed up for ``window`` seconds has a clean slate
again, since its old deaths fall out of the window.

Whether a rank is coming back is not asked of the policy: its actions
(``Scheduled``, ``Respawn``, ``GiveUp``, ``Report``) move the rank table,
which answers (:meth:`RankTable.coming_back`).

Not here: *doing* any of it (controller/supervisor execute the actions).
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

SPARE_DELAY_S = 2.0  # settled this long before a spare process is started


class RankPhase(str, enum.Enum):
    RUNNING = "running"
    WAITING = "waiting"  # dead, respawn scheduled
    RESPAWNING = "respawning"  # new process started, not ready yet
    DEAD = "dead"  # mode off: stays dead
    FAILED = "failed"  # restart budget spent
    LOST = "lost"  # its host is gone (not a failure of the rank: no budget spent)


# -- stimuli: what happened to a rank (not the event log of life/events.py) --


@dataclass(frozen=True)
class Died:
    """A rank's process ended. ``incarnation`` says which process: the death
    of one that was already replaced (we killed it to restart it) is old news."""

    rank: int
    now: float
    cause: str = ""
    incarnation: int | None = None


@dataclass(frozen=True)
class Ready:
    rank: int
    now: float


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
    ``spare`` host they are respawned there at once, else they stay LOST
    until a restart."""

    host: str
    ranks: tuple[int, ...]
    now: float
    spare: str | None = None


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
    takes calls. Sent only while spares are on and none is held."""

    now: float
    settled_for: float
    all_live: bool


Stimulus = Died | Ready | RestartRequested | Timer | HostLost | Probed | SpareCheck


# -- actions -----------------------------------------------------------------


@dataclass(frozen=True)
class Respawn:
    rank: int
    incarnation: int
    host: str = ""  # where ("": where it was)


@dataclass(frozen=True)
class Scheduled:
    """``rank`` is dead and coming back: its respawn is due ``at`` (a
    Respawn follows then). The rank table records it (calls wait for it)."""

    rank: int
    at: float


@dataclass(frozen=True)
class Kill:
    """Stop a live rank (mode ``all``: survivors are replaced too)."""

    rank: int


@dataclass(frozen=True)
class Reform:
    """Form a new torch.distributed group (new store, new port) of ``ranks``."""

    generation: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class GiveUp:
    rank: int
    reason: str


@dataclass(frozen=True)
class Report:
    rank: int
    message: str


@dataclass(frozen=True)
class ReplaceStuck:
    """Replace a live member stuck in the old group's collective: a new
    process (``incarnation``) in the current generation, not a failure."""

    rank: int
    incarnation: int


@dataclass(frozen=True)
class StartSpare:
    """Start a spare process (torch imported, waiting to become a rank)."""


Action = Scheduled | Respawn | Kill | Reform | GiveUp | Report | ReplaceStuck | StartSpare


@dataclass
class _Rank:
    phase: RankPhase = RankPhase.RUNNING
    incarnation: int = 0
    deaths: list[float] = field(default_factory=list)  # times of deaths in the window
    respawn_at: float | None = None


@dataclass
class RestartPolicy:
    world_size: int
    mode: str = "rank"
    budget: int = 5
    window: float = 600.0
    base: float = 0.5
    cap: float = 30.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    generation: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("rank", "all", "off"):
            raise ValueError(f"unknown respawn mode {self.mode!r}")
        self.ranks = [_Rank() for _ in range(self.world_size)]

    def phase(self, rank: int) -> RankPhase:
        return self.ranks[rank].phase

    def incarnation(self, rank: int) -> int:
        return self.ranks[rank].incarnation

    def handle(self, event: Stimulus) -> list[Action]:
        if isinstance(event, Died):
            return self._died(event)
        if isinstance(event, Ready):
            r = self.ranks[event.rank]
            if r.phase == RankPhase.RESPAWNING:
                r.phase = RankPhase.RUNNING
            return []
        if isinstance(event, RestartRequested):
            return self._restart(event)
        if isinstance(event, HostLost):
            return self._host_lost(event)
        if isinstance(event, Probed):
            r = self.ranks[event.rank]
            if not event.in_collective or r.phase != RankPhase.RUNNING:
                return []  # computing: looked at again later
            return [ReplaceStuck(event.rank, self.replace(event.rank))]
        if isinstance(event, SpareCheck):
            return [StartSpare()] if self._spare_due(event) else []
        return self._timer(event.now)

    # -- transitions -----------------------------------------------------------
    def _died(self, ev: Died) -> list[Action]:
        r = self.ranks[ev.rank]
        if ev.incarnation is not None and ev.incarnation < r.incarnation:
            return []  # a process we already replaced
        if r.phase in (RankPhase.DEAD, RankPhase.FAILED, RankPhase.WAITING, RankPhase.LOST):
            return []  # already handled (a second report of the same death)
        if self.mode == "off":
            r.phase = RankPhase.DEAD
            return [Report(ev.rank, f"rank {ev.rank} died ({ev.cause}); respawn is off, "
                                    "the survivors carry on")]
        r.deaths = [t for t in r.deaths if ev.now - t < self.window] + [ev.now]
        if len(r.deaths) > self.budget:
            r.phase = RankPhase.FAILED
            return [GiveUp(ev.rank, (
                f"rank {ev.rank} died {len(r.deaths)} times within {self.window:g} s "
                f"(last: {ev.cause}); not respawning it again. Fix the cause (see "
                f"%monarch logs {ev.rank}), then %monarch restart {ev.rank}"))]
        r.phase = RankPhase.WAITING
        r.respawn_at = at = ev.now + self._delay(len(r.deaths))
        actions: list[Action] = [Scheduled(ev.rank, at)]
        if self.mode == "all":
            for other, o in enumerate(self.ranks):
                if other != ev.rank and o.phase in (RankPhase.RUNNING, RankPhase.RESPAWNING):
                    o.phase = RankPhase.WAITING
                    o.respawn_at = at
                    actions += [Kill(other), Scheduled(other, at)]
        return actions + self._timer(ev.now)

    def _restart(self, ev: RestartRequested) -> list[Action]:
        actions: list[Action] = []
        for rank in ev.ranks:
            r = self.ranks[rank]
            if r.phase in (RankPhase.RUNNING, RankPhase.RESPAWNING):
                actions.append(Kill(rank))
            r.deaths = []  # a deliberate restart is not a failure
            r.phase = RankPhase.WAITING
            r.respawn_at = ev.now
            actions.append(Scheduled(rank, ev.now))
        return actions + self._timer(ev.now)

    def _host_lost(self, ev: HostLost) -> list[Action]:
        actions: list[Action] = []
        moved = []
        for rank in ev.ranks:
            r = self.ranks[rank]
            if r.phase in (RankPhase.FAILED, RankPhase.LOST):
                continue
            r.phase = RankPhase.LOST  # no death in the window: the host failed, not the rank
            r.respawn_at = None
            moved.append(rank)
            actions.append(Report(rank, f"rank {rank} lost: host {ev.host} lost"))
        if ev.spare is None or not moved:
            return actions
        for rank in moved:
            r = self.ranks[rank]
            r.phase = RankPhase.RESPAWNING
            r.incarnation += 1
            actions.append(Respawn(rank, r.incarnation, host=ev.spare))
        self.generation += 1
        actions.append(Reform(self.generation, self._members()))
        return actions

    def _members(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.ranks)
                     if r.phase in (RankPhase.RUNNING, RankPhase.RESPAWNING))

    def _timer(self, now: float) -> list[Action]:
        due = [i for i, r in enumerate(self.ranks)
               if r.phase == RankPhase.WAITING and r.respawn_at is not None and r.respawn_at <= now]
        if not due:
            return []
        actions: list[Action] = []
        for rank in due:
            r = self.ranks[rank]
            r.phase = RankPhase.RESPAWNING
            r.respawn_at = None
            r.incarnation += 1
            actions.append(Respawn(rank, r.incarnation))
        self.generation += 1
        actions.append(Reform(self.generation, self._members()))
        return actions

    def replace(self, rank: int) -> int:
        """The controller replaced a live rank's process itself (a survivor
        stuck in a collective with a peer that gave up): a new incarnation in
        the current generation, not a failure. Returns the incarnation."""
        r = self.ranks[rank]
        r.incarnation += 1
        r.phase = RankPhase.RESPAWNING
        return r.incarnation

    def next_deadline(self) -> float | None:
        """When the controller should send the next Timer, if ever."""
        times = [r.respawn_at for r in self.ranks
                 if r.phase == RankPhase.WAITING and r.respawn_at is not None]
        return min(times) if times else None

    def _spare_due(self, ev: SpareCheck) -> bool:
        # Not during start-up or a recovery, whose CPU it would slow; but at
        # once while a dead rank waits out its backoff: that wait is idle
        # time, and the spare, however far it got, becomes that rank.
        if self.next_deadline() is not None:
            return True
        return ev.settled_for >= SPARE_DELAY_S and ev.all_live

    def _delay(self, deaths_in_window: int) -> float:
        if deaths_in_window <= 1:
            return 0.0
        delay = min(self.cap, self.base * 2 ** (deaths_in_window - 2))
        return delay * (0.75 + 0.5 * self.rng.random())
