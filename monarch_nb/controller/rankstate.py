"""The controller's bookkeeping types: rank states, rank records, events,
calls in flight. Plain data, shared by controller.py and recovery.py.

Non-goals: behaviour (controller.py, recovery.py).
"""

from __future__ import annotations

import enum
import signal as signal_mod
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from ..futures import MeshFuture
from ..wire.protocol import Message
from .output import CallOutput


class RankState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    RESPAWNING = "respawning"  # a new process is on its way (calls to it wait)
    DEAD = "dead"  # respawn off: stays dead
    FAILED = "failed"  # restart budget spent
    STOPPED = "stopped"


@dataclass
class RankInfo:
    rank: int
    incarnation: int = 0
    token: str = ""  # random part of the socket identities of this incarnation
    state: RankState = RankState.STARTING
    pid: int | None = None
    device: str = ""
    host: str = ""
    last_heartbeat: float = 0.0
    exitcode: int | None = None
    silent_for: float | None = None  # killed by us for missing heartbeats
    start_error: str = ""
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    health: dict[str, Any] = field(default_factory=dict)  # latest HEARTBEAT's (health.py)

    # (incarnation, token, main id, ctl id): the ids are read for every call
    _ids: tuple[int, str, bytes, bytes] = field(default=(-1, "", b"", b""), repr=False,
                                                compare=False)

    @property
    def identity(self) -> str:
        return f"r{self.rank}.{self.incarnation}.{self.token}"

    def _socket_ids(self) -> tuple[int, str, bytes, bytes]:
        ids = self._ids
        if ids[0] != self.incarnation or ids[1] != self.token:  # a new process
            ident = self.identity
            ids = self._ids = (self.incarnation, self.token, f"{ident}.main".encode(),
                               f"{ident}.ctl".encode())
        return ids

    @property
    def main_id(self) -> bytes:
        return self._socket_ids()[2]

    @property
    def ctl_id(self) -> bytes:
        return self._socket_ids()[3]


@dataclass
class Event:
    """One entry of ``mesh.events``: something that happened to a rank."""

    time: float
    rank: int
    incarnation: int
    kind: str  # started | ready | died | stopped | failed_start
    detail: str = ""


@dataclass(slots=True)  # made for every call: slots make that and each access cheaper
class PendingCall:
    call_id: int
    ranks: tuple[int, ...]
    output: CallOutput
    future: MeshFuture
    remaining: set[int]
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)
    chunks_seen: dict[int, int] = field(default_factory=dict)
    held: dict[int, Message] = field(default_factory=dict)  # RESULT waiting for chunks
    setup: dict[str, Any] | None = None  # a --setup cell: recorded once it succeeded
    elastic: bool = False  # survive deaths: re-issued on the respawned rank
    frames: list[Any] = field(default_factory=list)  # kept for re-issue (elastic only)
    reissue: set[int] = field(default_factory=set)  # ranks waiting for their new process
    hang_timeout: float | None = None  # print stacks after this long without progress
    hang_reported: bool = False  # ...once per call
    progress_at: float = field(default_factory=time.monotonic)  # output, result, prompt


REFORM_GRACE_S = 3.0  # an elastic survivor must answer a re-formation within this
# ...but one still inside a collective of the old group this long after the
# REFORM is stuck there (a peer that failed out of the collective left it
# waiting; the ones next to the dead rank fail out within ~0.2 s): its
# stacks are asked for then, and it is replaced at once if so
REFORM_PROBE_S = 0.75


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def signal_name(code: int | None) -> str | None:
    if code is None or code >= 0:
        return None
    try:
        return signal_mod.Signals(-code).name
    except ValueError:
        return f"signal {-code}"
