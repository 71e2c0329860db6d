"""The rank table: one record per rank, the socket identities of its
current process, the group's generation, and the only way to change them.

A record (:class:`RankInfo`) says what the controller knows of a rank's
current process. :meth:`RankTable.move` (and :meth:`RankTable.move_many`,
the same for many ranks) is the one place its state changes,
checked against the transition table (rankstates.py); a rank's incarnation
and host change with its respawn (:meth:`RankTable.respawning`), the
generation with a re-formation (:meth:`RankTable.reformed`): each only
forward. The restart policy reads the table to decide; recovery carries its
moves out through these methods. Messages are matched
to a rank by the socket identity of its current process
(:meth:`RankTable.bind` gives each new process fresh ones, so an old
incarnation's stragglers match nothing).

Non-goals: what a death means (policy.py, recovery.py), calls (calltable.py).
"""

from __future__ import annotations

import errno
import secrets
import signal as signal_mod
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...errors import no_free_port
from .events import Event, EventKind
from .rankstates import GONE, LIVE, TRANSITIONS, WAIT_FOR, RankState, check


@dataclass
class RankInfo:
    rank: int
    incarnation: int = 0
    token: str = ""  # random part of the socket identities of this incarnation
    state: RankState = RankState.STARTING  # changed only by RankTable.move
    pid: int | None = None
    device: str = ""
    host: str = ""  # where it runs: its HELLO's; a respawn elsewhere sets it
    last_heartbeat: float = 0.0
    exitcode: int | None = None
    silent_for: float | None = None  # killed by us for missing heartbeats
    frozen: str = ""  # what the OS said when we killed it ("stopped by a signal")
    busy_silent: bool = False  # silent but running (holding the GIL): liveness.py
    start_error: str = ""
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    # this process answered one of the user's calls: it was working, and its
    # death is no crash loop (policy.py's backoff). Set by the controller as
    # the answer arrives, cleared for each new process.
    answered: bool = False
    health: dict[str, Any] = field(default_factory=dict)  # latest HEARTBEAT's (health.py)
    # its main thread runs an mnb.elastic loop (its latest HEARTBEAT's "el"):
    # a peer's death leaves it in place where a script's group restarts (policy.py)
    elastic_loop: bool = False
    main_id: bytes = b""  # socket identities of the current process
    ctl_id: bytes = b""

    @property
    def identity(self) -> str:
        return f"r{self.rank}.{self.incarnation}.{self.token}"


class RankTable:
    """Every rank's record, indexed by rank and by socket identity."""

    def __init__(self, world_size: int) -> None:
        self._ranks = [RankInfo(r) for r in range(world_size)]
        self._by_ident: dict[bytes, RankInfo] = {}
        self.events: list[Event] = []
        self._generation = 0  # of the torch.distributed group: RankTable.reformed
        # the mesh ranks in the group, in the order of their torch ranks: all
        # of them unless the group went on without some (the policy's Shrink)
        self._group = tuple(range(world_size))

    @property
    def generation(self) -> int:
        """The group's generation (0: the first group; each re-formation +1)."""
        return self._generation

    @property
    def group(self) -> tuple[int, ...]:
        """The mesh's rank numbers that form the torch.distributed group now,
        in the order of their torch ranks (``group[i]`` is torch rank ``i``):
        every rank, unless the group was shrunk (min_ranks)."""
        return self._group

    def reformed(self, generation: int, group: tuple[int, ...] | None = None) -> None:
        """The policy's Reform: the group's next generation, of ``group``
        when it says (a shrink, or ranks back in it), else of the same ranks."""
        if generation <= self._generation:
            raise ValueError(f"generation {generation} after {self._generation}")
        if group is not None:
            if not group or list(group) != sorted(set(group)) or group[-1] >= len(self._ranks):
                raise ValueError(f"group {group}: mesh ranks in order, each once")
            self._group = tuple(group)
        self._generation = generation

    def torch_rank(self, rank: int) -> int | None:
        """Mesh rank ``rank``'s rank in the torch.distributed group now
        (dense: 0..len(group)-1), or None when the group went on without it."""
        group = self._group
        if len(group) == len(self._ranks):
            return rank
        try:
            return group.index(rank)
        except ValueError:
            return None

    def shed(self, rank: int) -> bool:
        """The group went on without ``rank`` and nothing brings it back by
        itself: a call to the mesh leaves it out (its entry says it is lost)."""
        return rank not in self._group and self.gone_for_good(rank)

    def __getitem__(self, rank: int) -> RankInfo:
        return self._ranks[rank]

    def __iter__(self) -> Iterator[RankInfo]:
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)

    def move(self, rank: int, to: RankState) -> None:
        """Change ``rank``'s state (the only place that does; see rankstates.py)."""
        info = self._ranks[rank]
        if info.state is not to:
            check(rank, info.state, to)
            info.state = to

    def move_many(self, ranks: Iterable[int], to: RankState, *,
                  only_from: RankState | None = None) -> None:
        """:meth:`move` for each of ``ranks`` (a call's, sent or answered:
        one loop, where a thousand ranks made a thousand calls). With
        ``only_from``, the ranks in another state stay as they are (a call's
        answered ranks go back to READY only if they were BUSY: one that
        is dying meanwhile stays dying)."""
        table, allowed = self._ranks, TRANSITIONS
        for rank in ranks:
            info = table[rank]
            frm = info.state
            if frm is not to and (only_from is None or frm is only_from):
                if to not in allowed[frm]:
                    check(rank, frm, to)  # raises
                info.state = to

    # -- the one answer to "is it coming back?" --------------------------------------
    def coming_back(self, rank: int) -> bool:
        """Will ``rank`` have a process that takes calls without anyone
        asking? Its process is on its way (STARTING, RESPAWNING), on its way
        out at our request (DYING: it is respawned), or its respawn is
        scheduled (WAITING). Not: live, stopped, failed, lost, or dead."""
        return self._ranks[rank].state in WAIT_FOR

    def reform_pending(self) -> bool:
        """A rank waits out its backoff (WAITING): the group is about to be
        re-formed, so a call sent to its members now would run on the old group."""
        return any(info.state is RankState.WAITING for info in self._ranks)

    def must_wait(self, ranks: tuple[int, ...]) -> bool:
        """A call to ``ranks`` must not be sent now: one of them is coming
        back, or the group is about to be re-formed (any rank WAITING).
        One plain pass over the table (this runs for every call): the
        call's ranks are looked at only in the rare states that matter."""
        waiting = RankState.WAITING
        for info in self._ranks:
            state = info.state
            if state in WAIT_FOR and (state is waiting or info.rank in ranks):
                return True
        return False

    def gone_for_good(self, rank: int) -> bool:
        """No process, and none coming unless the user restarts it."""
        return self._ranks[rank].state in GONE and not self.coming_back(rank)

    def respawning(self, rank: int, incarnation: int, host: str = "") -> None:
        """The policy's Respawn or ReplaceStuck: ``rank`` gets a new process,
        ``incarnation`` (on ``host``; "": where it was), started at the
        re-formation that follows (ReplaceStuck: at once)."""
        info = self._ranks[rank]
        if incarnation <= info.incarnation:
            raise ValueError(f"rank {rank}: incarnation {incarnation} after {info.incarnation}")
        self.move(rank, RankState.RESPAWNING)
        info.incarnation = incarnation
        if host:
            info.host = host

    def bind(self, rank: int, incarnation: int) -> RankInfo:
        """A new process for ``rank``: fresh socket identities (the old
        ones' stragglers are ignored from now on) and a clean record.
        ``incarnation`` is the table's (0, or the one its :meth:`respawning`
        set): said again so that a mix-up is loud."""
        info = self._ranks[rank]
        if incarnation != info.incarnation:
            raise ValueError(f"rank {rank}: a process of incarnation {incarnation}, "
                             f"the table says {info.incarnation}")
        self._by_ident.pop(info.main_id, None)
        self._by_ident.pop(info.ctl_id, None)
        info.token = secrets.token_hex(8)
        info.main_id = f"{info.identity}.main".encode()
        info.ctl_id = f"{info.identity}.ctl".encode()
        self._by_ident[info.main_id] = info
        self._by_ident[info.ctl_id] = info
        info.silent_for = None
        info.frozen = ""
        info.busy_silent = False
        info.exitcode = None
        info.health = {}
        info.elastic_loop = False
        info.start_error = ""
        info.answered = False
        info.started_at = info.last_heartbeat = time.monotonic()
        return info

    def lookup(self, ident: bytes) -> RankInfo | None:
        return self._by_ident.get(ident)

    def lookup_many(self, idents: Iterable[bytes]) -> list[RankInfo]:
        """The records of those of ``idents`` that are a current process's
        (a host's folded answer names its ranks: one C-level pass)."""
        return [info for info in map(self._by_ident.get, idents) if info is not None]

    def sendable(self, ranks: tuple[int, ...]) -> list[bytes] | None:
        """The main socket ids of ``ranks`` if every one of them can take a
        call now, else None (also for no ranks). One plain loop: this runs
        for every call."""
        idents = []
        for r in ranks:
            info = self._ranks[r]
            if info.state not in LIVE:
                return None
            idents.append(info.main_id)
        return idents or None

    def adopt(self, rank: int, incarnation: int, token: str) -> RankInfo:
        """A kept mesh's running process, found at attach (controller/keep.py):
        its incarnation and socket identities are the ones it was started
        with (it keeps its sockets; only the controller is new)."""
        info = self._ranks[rank]
        if incarnation < info.incarnation:
            raise ValueError(f"rank {rank}: incarnation {incarnation} after {info.incarnation}")
        info.incarnation = incarnation
        self.bind(rank, incarnation)
        self._by_ident.pop(info.main_id, None)
        self._by_ident.pop(info.ctl_id, None)
        info.token = token
        info.main_id = f"{info.identity}.main".encode()
        info.ctl_id = f"{info.identity}.ctl".encode()
        self._by_ident[info.main_id] = info
        self._by_ident[info.ctl_id] = info
        return info

    def restore_events(self, events: list[dict[str, Any]]) -> None:
        """The events a kept mesh's earlier controllers recorded (attach)."""
        restored = []
        for e in events:
            try:
                restored.append(Event(float(e["time"]), int(e["rank"]), int(e["incarnation"]),
                                      EventKind(e["kind"]), str(e.get("detail", ""))))
            except (KeyError, ValueError, TypeError):
                continue
        self.events[:0] = restored

    def record(self, rank: int, kind: EventKind, detail: str = "") -> None:
        inc = self._ranks[rank].incarnation if rank >= 0 else 0
        self.events.append(Event(time.time(), rank, inc, kind, detail))


def free_port() -> int:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", 0))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise no_free_port("the group's rendezvous (MASTER_PORT)") from None
            raise
        return int(s.getsockname()[1])


def signal_name(code: int | None) -> str | None:
    if code is None or code >= 0:
        return None
    try:
        return signal_mod.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    name = signal_name(code)
    return f"killed by {name}" if name else f"exited with code {code}"
