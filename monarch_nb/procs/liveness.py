"""Is a silent rank dead, stopped, or only busy? Liveness that does not
need the rank's GIL.

A rank's heartbeat is sent by a Python thread (engine/loop.py's control
thread), so code that holds the GIL without pause (a C extension that does
not release it, pickling a 1 GiB result, a long regular expression) silences
it as surely as a frozen process. Killing on silence alone cost healthy ranks
their state. For a rank on this host the kernel knows better than the
heartbeat: ``/proc/<pid>/stat`` says whether the process is stopped
(SIGSTOP: frozen, detected within ``STOP_GRACE_S``), or running or sleeping
(busy: reported, never killed for silence). A rank on another host has only
its heartbeat: silence past the timeout still means frozen or a hung host.

Pure policy: :func:`judge` decides from figures; the controller reads them
(:func:`os_state`) and acts. Non-goals: acting (controller/core.py), the
heartbeat itself (engine/loop.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# SIGSTOP seen this long (two ticks at least) means frozen. Short enough to
# beat the heartbeat timeout; long enough that a signal-stop on its way to
# a continue (a job-control stop and resume) is not taken for one.
STOP_GRACE_S = 0.5
# A rank heard from this recently is not asked about (see Liveness.wants_state).
# Below a liveness tick (0.25 s), so a stop is seen as soon as before: half a
# heartbeat interval made benchmarks/respawn.py's SIGSTOP, sent right after a
# call, take 1.0 s to detect instead of 0.74. Above a call's round trip at
# 1,024 ranks (tens of ms), so during calls no rank is read.
LOOK_AFTER_S = 0.1


class Verdict(enum.Enum):
    ALIVE = "alive"  # heartbeats arrive (or a stop too short to count)
    BUSY = "busy"  # silent but running on this host: holding the GIL, in native code
    FROZEN = "frozen"  # stopped, or silent past the timeout where only heartbeats tell


@dataclass
class Liveness:
    """Per-rank memory of what was seen (when a stop or a silence began)."""

    heartbeat_timeout: float
    stop_grace: float = STOP_GRACE_S
    look_after: float = LOOK_AFTER_S  # below heartbeat_timeout: a silence past it is always looked at
    stopped_since: dict[int, float] = field(default_factory=dict)
    busy_since: dict[int, float] = field(default_factory=dict)

    def wants_state(self, rank: int, silent: float) -> bool:
        """Is the process state worth reading now? Reading it is a syscall
        per rank per tick: at 1,024 ranks that was the biggest part of the
        controller's CPU, idle or not (benchmarks/scale.py). A rank whose
        last message is younger than ``look_after`` was running then, so
        the read is skipped (:meth:`judge` gets ``None`` and says ALIVE);
        during calls every rank keeps talking and no read is made (idle,
        heartbeats come every 0.5 s: most ranks are still read). The price:
        a SIGSTOP right after a message may be seen up to ``look_after``
        later (measured: no change, ticks are 0.25 s apart). A rank already
        seen stopped or busy is always read, so its grace and its busy time
        keep counting."""
        return silent >= self.look_after or rank in self.stopped_since or rank in self.busy_since

    def judge(self, rank: int, silent: float, state: str | None, now: float) -> Verdict:
        """``silent``: seconds since the rank's last message; ``state``: its
        process's state letter from /proc (``None`` when not on this host)."""
        if state == "T":  # stopped by a signal (SIGSTOP, SIGTSTP)
            since = self.stopped_since.setdefault(rank, now)
            self.busy_since.pop(rank, None)
            return Verdict.FROZEN if now - since >= self.stop_grace else Verdict.ALIVE
        self.stopped_since.pop(rank, None)
        if silent <= self.heartbeat_timeout:
            self.busy_since.pop(rank, None)
            return Verdict.ALIVE
        if state is None or state == "t":
            # another host, or held by a debugger (ptrace): only the
            # heartbeat tells, as before
            self.busy_since.pop(rank, None)
            return Verdict.FROZEN
        if state in ("Z", "X"):
            return Verdict.ALIVE  # exiting: its exit is reported on its own
        self.busy_since.setdefault(rank, now - silent)
        return Verdict.BUSY

    def busy_for(self, rank: int, now: float) -> float | None:
        """Seconds ``rank`` has been silent but running (None when it is not)."""
        since = self.busy_since.get(rank)
        return None if since is None else now - since

    def forget(self, rank: int) -> None:
        """A new process for ``rank``: nothing seen of the old one counts."""
        self.stopped_since.pop(rank, None)
        self.busy_since.pop(rank, None)


def os_state(pid: int | None) -> str | None:
    """The state letter of process ``pid`` (``R``, ``S``, ``D``, ``T``, ``t``,
    ``Z``...) from ``/proc/<pid>/stat``; None where it cannot be read."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) S ...": comm may hold spaces and parentheses: the last ")"
    end = stat.rfind(b")")
    if end < 0 or end + 2 >= len(stat):
        return None
    return chr(stat[end + 2])
