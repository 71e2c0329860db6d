"""The state machine of one rank, as the controller sees it: states, the
table of allowed moves, and the diagram that the table makes true. It is
the only one: the restart policy (policy.py) reads a rank's state from the
rank table and answers with typed moves; it keeps no phase of its own.

::

    STARTING   --READY msg------------------> READY <--call sent / answered--> BUSY
    RESPAWNING --READY msg------------------> READY
    READY, BUSY, RESPAWNING --our KILL/TERM-> DYING
    (a process) --exit (Died): Move DEAD----> DEAD
    DEAD    --Move WAITING (backoff)--------> WAITING --Respawn (due)--> RESPAWNING
    DEAD    --Move FAILED (budget spent)----> FAILED  --restart--------> WAITING
    (a process), WAITING --host lost: Move LOST--> LOST --Respawn(host=spare)--> RESPAWNING
                                 (a spare host, or one given later: HostAdded)
                                                   LOST --restart--> WAITING
    READY, BUSY --ReplaceStuck (stuck in a collective)--> RESPAWNING
    (any) --stop--> STOPPED  (final)

"(a process)": STARTING, READY, BUSY, RESPAWNING, DYING. A user's restart
of a rank with a process is Kill, ``Move DEAD``, ``Move WAITING``.

Who moves what. Facts are recorded where they are seen: a READY message
(READY), a call sent or answered (BUSY, READY), our own kill signal
(DYING), the mesh stopped (STOPPED), a first start that failed (DEAD).
Every *decision* is the policy's typed action, carried out by recovery:
``Move(rank, DEAD)`` for a death it was told of or a survivor it kills,
``Move(rank, WAITING)`` (respawn scheduled after a backoff),
``Move(rank, FAILED)`` (restart budget spent), ``Move(rank, LOST)`` (its
host is gone: no budget spent), ``Respawn`` (RESPAWNING, a new
incarnation, maybe on another host) and ``ReplaceStuck`` (RESPAWNING, a
new incarnation in the current generation).

``STARTING`` is a rank's first process; ``RESPAWNING`` any later one, on
its way until it says READY (calls to it wait). ``DYING``: we sent a KILL
or TERM (``mesh.kill``, ``%monarch kill``, chaos) and have not seen the
exit yet; calls to it wait, as for a rank on its way back, and run on the
group re-formed after its respawn. ``DEAD``: exited and not coming back by
itself (respawn off, a first start that failed, or a killed survivor
between its kill and its scheduled respawn). ``WAITING``: dead, its
respawn scheduled (the first one at once, later ones after a backoff);
calls to it, and to every other rank, wait: the group is about to be
re-formed. ``FAILED``: the restart budget is spent; only a user's restart
revives it. ``LOST``: its host is gone; it is respawned on a spare host
when there is one, else when a host is given for it (``mesh.add_hosts``)
or a user restarts it.

Whether a rank is coming back, and whether a call must wait for it, is
answered in one place: :meth:`RankTable.coming_back` /
:meth:`RankTable.must_wait` (ranktable.py).

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
    DEAD = "dead"  # exited, not coming back by itself
    WAITING = "waiting"  # dead, its respawn scheduled (calls wait: a re-formation is due)
    FAILED = "failed"  # restart budget spent (or 0: respawns off)
    LOST = "lost"  # its host is gone (no budget spent)
    STOPPED = "stopped"


S = RankState
_EXITS = frozenset({S.DEAD, S.LOST, S.STOPPED})  # from any state with a process
TRANSITIONS: dict[RankState, frozenset[RankState]] = {
    S.STARTING: _EXITS | {S.READY},
    S.READY: _EXITS | {S.BUSY, S.DYING, S.RESPAWNING},
    S.BUSY: _EXITS | {S.READY, S.DYING, S.RESPAWNING},
    S.RESPAWNING: _EXITS | {S.READY, S.DYING},
    S.DYING: _EXITS,
    S.DEAD: frozenset({S.WAITING, S.FAILED, S.STOPPED}),
    S.WAITING: frozenset({S.RESPAWNING, S.LOST, S.STOPPED}),
    S.FAILED: frozenset({S.WAITING, S.STOPPED}),
    S.LOST: frozenset({S.RESPAWNING, S.WAITING, S.STOPPED}),
    S.STOPPED: frozenset(),
}
del S

LIVE = frozenset({RankState.READY, RankState.BUSY})  # a process that takes calls now
# no process
GONE = frozenset({RankState.DEAD, RankState.WAITING, RankState.FAILED, RankState.LOST,
                  RankState.STOPPED})
ON_ITS_WAY = frozenset({RankState.STARTING, RankState.RESPAWNING})  # a process, not ready yet
# calls to these wait (their process is on its way, on its way out at our
# request, or their respawn is scheduled)
WAIT_FOR = frozenset({RankState.STARTING, RankState.RESPAWNING, RankState.DYING,
                      RankState.WAITING})


class IllegalTransition(RuntimeError):
    """A move that the diagram does not allow: a controller bug."""

    def __init__(self, rank: int, frm: RankState, to: RankState) -> None:
        super().__init__(f"rank {rank}: {frm.value} -> {to.value} is not a legal move")
        self.rank, self.frm, self.to = rank, frm, to


def check(rank: int, frm: RankState, to: RankState) -> None:
    if to not in TRANSITIONS[frm]:
        raise IllegalTransition(rank, frm, to)
