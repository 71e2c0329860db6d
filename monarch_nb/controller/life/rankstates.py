"""The state machine of one rank, as the controller sees it: states, the
table of allowed moves, and the diagram that the table makes true.

::

                 READY msg            call sent
    STARTING -------------> READY <-------------> BUSY
       |                  ^  |   all calls answered  |
       |   READY msg      |  |                       |
       |   (a new process)|  +-------+-------+-------+
       v                  |          | exit  | replaced / restarted
    RESPAWNING -----------+          v       v
       ^  \\--exit--> DEAD <-------------- RESPAWNING
       |                |
       +--Respawn-------+--GiveUp--> FAILED --restart--> RESPAWNING
    (any) --stop--> STOPPED  (final)
    READY/BUSY/RESPAWNING --kill requested by us--> DYING --exit--> DEAD
    DEAD/FAILED --Scheduled--> same state, ``comes_back`` set (the next move clears it)

``DYING``: we sent a KILL or TERM (``mesh.kill``, ``%monarch kill``, chaos)
and have not seen the exit yet; calls to it wait, as for a rank on its way
back, and run on the group re-formed after its respawn.

``STARTING`` is a rank's first process; ``RESPAWNING`` any later one, on
its way until it says READY (calls to it wait). ``DEAD`` is the moment
between an exit and the policy's answer, a rank waiting out its respawn
backoff (the policy's :class:`~.policy.Scheduled`, recorded on the record
as ``comes_back``), or final with respawn off. Whether a rank is coming
back, and whether a call must wait for it, is answered in one place:
:meth:`RankTable.coming_back` / :meth:`RankTable.must_wait` (ranktable.py).
``FAILED``: the restart budget is spent; only a user's restart revives it.

Only :meth:`RankTable.move` changes a state, and it refuses a move that is
not in :data:`TRANSITIONS` (:class:`IllegalTransition`): a bug, not a user
error, and loud at once instead of a rank stuck in a state nobody leaves.

Non-goals: the records (ranktable.py), deciding about deaths (policy.py).
"""

from __future__ import annotations

import enum


class RankState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    RESPAWNING = "respawning"  # a new process is on its way (calls to it wait)
    DYING = "dying"  # we asked it to die, its exit not seen yet (calls to it wait)
    DEAD = "dead"  # exited; the policy decides (or respawn off: stays dead)
    FAILED = "failed"  # restart budget spent
    STOPPED = "stopped"


S = RankState
TRANSITIONS: dict[RankState, frozenset[RankState]] = {
    S.STARTING: frozenset({S.READY, S.DEAD, S.RESPAWNING, S.STOPPED}),
    S.READY: frozenset({S.BUSY, S.DEAD, S.RESPAWNING, S.DYING, S.STOPPED}),
    S.BUSY: frozenset({S.READY, S.DEAD, S.RESPAWNING, S.DYING, S.STOPPED}),
    S.RESPAWNING: frozenset({S.READY, S.DEAD, S.RESPAWNING, S.DYING, S.STOPPED}),
    S.DYING: frozenset({S.DEAD, S.RESPAWNING, S.STOPPED}),
    S.DEAD: frozenset({S.RESPAWNING, S.FAILED, S.STOPPED}),
    S.FAILED: frozenset({S.RESPAWNING, S.STOPPED}),
    S.STOPPED: frozenset(),
}
del S

LIVE = frozenset({RankState.READY, RankState.BUSY})  # a process that takes calls now
GONE = frozenset({RankState.DEAD, RankState.FAILED, RankState.STOPPED})  # no process
ON_ITS_WAY = frozenset({RankState.STARTING, RankState.RESPAWNING})  # a process, not ready yet
# calls to these wait (their process is on its way, or on its way out at our request)
WAIT_FOR = frozenset({RankState.STARTING, RankState.RESPAWNING, RankState.DYING})


class IllegalTransition(RuntimeError):
    """A move that the diagram does not allow: a controller bug."""

    def __init__(self, rank: int, frm: RankState, to: RankState) -> None:
        super().__init__(f"rank {rank}: {frm.value} -> {to.value} is not a legal move")
        self.rank, self.frm, self.to = rank, frm, to


def check(rank: int, frm: RankState, to: RankState) -> None:
    if to not in TRANSITIONS[frm]:
        raise IllegalTransition(rank, frm, to)
