"""What ``mesh.events`` lists: things that happened to ranks and to the mesh.

:class:`EventKind` names every kind once; the dashboard (ui/static), the
JupyterLab extension and the script launcher read the same values.

Non-goals: when they happen (core.py, recovery.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EventKind(str, enum.Enum):
    STARTED = "started"  # a process was started for the rank (detail: pid, from a spare)
    READY = "ready"  # it joined the group (detail: device)
    FAILED_START = "failed_start"  # it died before its first READY
    DIED = "died"  # it exited (detail: how)
    RESPAWNED = "respawned"  # a new process joins a new generation
    REPLACED = "replaced"  # a live process was replaced (stuck after a group change)
    GAVE_UP = "gave_up"  # restart budget spent
    BUSY_SILENT = "busy_silent"  # no heartbeat, but running: holding the GIL (not killed)
    REFORMED = "reformed"  # the mesh formed a new group (rank -1)
    REFORM_FAILED = "reform_failed"  # a member could not join it
    SHRUNK = "shrunk"  # the group went on without ranks gone for good (rank -1; min_ranks)
    GROWN = "grown"  # ranks back in a shrunk group (rank -1; detail: the world size now)
    REJOINED = "rejoined"  # a rank back took the elastic call its group runs (a grow)
    SETUP_FAILED = "setup_failed"  # replaying a --setup cell failed on a new process
    STOPPED = "stopped"  # the mesh was stopped (rank -1)
    ATTACHED = "attached"  # a controller attached to the kept mesh (rank -1; detail: its pid)


@dataclass
class Event:
    """One entry of ``mesh.events``: something that happened to a rank
    (rank -1: to the whole mesh)."""

    time: float
    rank: int
    incarnation: int
    kind: EventKind
    detail: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"time": self.time, "rank": self.rank, "incarnation": self.incarnation,
                "kind": self.kind.value, "detail": self.detail}
