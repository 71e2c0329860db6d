"""The one error tree of monarch_nb.

Every exception a user can see derives from :class:`MonarchError`, and every
message says what to do next. Remote failures travel as *text* (type name,
message, formatted traceback), never as pickled exception objects: a rank's
exception class may not exist in the kernel, and unpickling foreign objects is
how a controller gets hurt.

Non-goals: no logging, no I/O. ``RankErrors`` knows how to render itself for
IPython (``_render_traceback_``) and for plain ``str()``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .rankspans import format_ranks
from .results import RankResults


class MonarchError(Exception):
    """Base class of every monarch_nb error."""

    def _render_traceback_(self) -> list[str]:
        # IPython hook: a user mistake is one clear line, not our stack.
        return [f"{type(self).__name__}: {self}"]


class MeshNotRunning(MonarchError):
    """No mesh is running (never started, stopped, or its controller died)."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            or "no mesh is running: start one with `%monarch start -n 4` "
            "(or `Mesh.start(n=4)` from Python)"
        )


class UsageError(MonarchError, ValueError):
    """The user asked for something that cannot be done as written (bad rank
    spec, unknown option, ...). The mesh is untouched."""


class ProtocolError(MonarchError):
    """A message failed verification (signature, replay, framing, size).

    Raised inside the protocol layer only; the transport catches it, counts the
    message as dropped and never lets it reach user code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass(frozen=True)
class RemoteError(MonarchError):
    """One rank's exception, as text.

    ``type_name`` is the qualified name of the remote exception class,
    ``traceback_text`` the remote ``traceback.format_exception`` output (cell
    frames include the cell's own source lines)."""

    rank: int
    type_name: str
    message: str
    traceback_text: str = ""

    def __post_init__(self) -> None:
        Exception.__init__(self, self.rank, self.type_name, self.message)

    @property
    def signature(self) -> tuple[str, str, str]:
        """What makes two failures 'the same' for grouping: type, message and
        traceback with the rank-specific bits (none today) left in."""
        return (self.type_name, self.message, self.traceback_text)

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type_name}: {self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemoteError, (self.rank, self.type_name, self.message, self.traceback_text))


@dataclass(frozen=True)
class RankDied(MonarchError):
    """A rank's process ended while a call was waiting on it."""

    rank: int
    exitcode: int | None = None
    signal_name: str | None = None
    last_lines: tuple[str, ...] = ()
    incarnation: int = 0
    silent_for: float | None = None  # set when killed for missing heartbeats
    frozen: str = ""  # what the OS said of it then ("stopped by a signal")
    cause_hint: str = ""  # why, when the controller could tell (procs/deathcause.py)
    # a crash (SIGSEGV, SIGABRT...): the crashing thread's Python frames, then
    # its native ones, one line each (replaces the last output, the same dump)
    crash_stack: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        Exception.__init__(self, self.rank, self.exitcode, self.signal_name)

    @property
    def cause(self) -> str:
        if self.silent_for is not None:
            why = self.frozen or "frozen or hung host"
            return f"no heartbeat for {self.silent_for:.1f} s ({why}); the controller killed it"
        if self.signal_name:
            return f"killed by {self.signal_name}"
        if self.exitcode is not None:
            return f"exited with code {self.exitcode}"
        return "stopped answering"

    def __reduce__(self) -> tuple[Any, ...]:
        return (RankDied, (self.rank, self.exitcode, self.signal_name, self.last_lines,
                           self.incarnation, self.silent_for, self.frozen, self.cause_hint,
                           self.crash_stack))

    @property
    def headline(self) -> str:
        """One line: who died, how, and why when known."""
        text = f"rank {self.rank} died ({self.cause})"
        return f"{text}: {self.cause_hint}" if self.cause_hint else text

    def __str__(self) -> str:
        text = self.headline
        if self.crash_stack:
            stack = "\n".join("    " + line for line in self.crash_stack)
            text += f"; the crashing thread:\n{stack}"
        elif self.last_lines:
            tail = "\n".join("    " + line for line in self.last_lines)
            text += f"; its last output:\n{tail}"
        return text


class MembershipChanged(MonarchError):
    """A collective was cut short because a member of the group died."""

    def __init__(self, rank: int, dead: Iterable[int], detail: str = "") -> None:
        self.rank = rank
        self.dead = tuple(sorted(dead))
        self.detail = detail
        msg = f"rank {rank}: the group changed under a collective"
        if self.dead:  # (none: this rank's own process was replaced)
            msg += f" (rank {format_ranks(self.dead)} died)"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)

    def __reduce__(self) -> tuple[Any, ...]:
        return (MembershipChanged, (self.rank, self.dead, self.detail))


# Where an interrupted rank stood, as the worker reports it (file paths of
# the innermost frames): inside torch.distributed or a DDP backward, the
# collective it left is still pending in the backend, and the next one would
# pair with it, so the group is out of step until it is formed anew.
_COLLECTIVE_PATHS = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")


def collective_hint(where: Mapping[int, str]) -> str:
    """What to do when interrupted ranks were inside a collective ("" if none was)."""
    ranks = [r for r, w in where.items() if any(p in w.replace("\\", "/") for p in _COLLECTIVE_PATHS)]
    if not ranks:
        return ""
    return (f"rank(s) {format_ranks(ranks)} were interrupted inside a torch.distributed "
            "collective: the group is out of step and the next collective may hang. Re-form it "
            "with %monarch restart all (mesh.restart('all'); variables on the ranks are lost, "
            "--setup cells are replayed).")


def lost_host_hint(ranks: Iterable[int]) -> str:
    """What to do for ranks whose host was lost and no spare took them: the
    one wording of the call error, the policy's report, ``%monarch status``
    and the dashboard."""
    return (f"mesh.add_hosts('HOST') gives the mesh a host for rank {format_ranks(ranks)}: "
            "they start there")


def no_free_port(what: str) -> UsageError:
    """Binding ``what`` to a port the kernel picks failed: every port of the
    local port range is in use (or the range is tiny)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = f.read().split()
        span = f"the local port range ({lo}-{hi}, net.ipv4.ip_local_port_range)"
    except (OSError, ValueError):
        span = "the local port range"
    return UsageError(f"no free port for {what}: every port of {span} is in use; close what "
                      "holds them, or widen the range (sysctl -w "
                      "net.ipv4.ip_local_port_range=\"32768 60999\")")


class CollectiveMismatch(MonarchError, RuntimeError):
    """Raised on the ranks, in strict mode (``check_collectives=True``), when
    the members of a group are about to call different collectives (op,
    dtypes, shapes or root differ). Every rank raises the same text."""


class CallTimeout(MonarchError):
    """A call did not finish within its timeout; the ranks still running were
    interrupted. ``where`` maps each of them to where its main thread was."""

    def __init__(self, timeout: float, where: Mapping[int, str]) -> None:
        self.timeout = timeout
        self.where = dict(where)
        hint = collective_hint(self.where)
        lines = [f"call did not finish within {timeout:g} s; interrupted rank(s) "
                 f"{format_ranks(self.where)}" + ("" if hint else " (they stay usable)")]
        for rank in sorted(self.where):
            lines.append(f"  rank {rank} was at {self.where[rank]}")
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[Any, ...]:
        return (CallTimeout, (self.timeout, self.where))


@dataclass
class RankErrors(MonarchError):
    """Raised by ``Mesh.run`` / ``Mesh.exec`` when at least one rank failed.

    ``errors`` maps rank -> the failure (``RemoteError``, ``RankDied``,
    ``MembershipChanged`` ...); ``results`` holds the values of the ranks that
    succeeded, so nothing computed is lost."""

    errors: dict[int, BaseException]
    results: dict[int, object] = field(default_factory=dict)
    total: int = 0

    def __post_init__(self) -> None:
        if type(self.results) is dict:
            self.results = RankResults(self.results)
        Exception.__init__(self, self._headline())

    def _headline(self) -> str:
        total = self.total or (len(self.errors) + len(self.results))
        return f"{len(self.errors)} of {total} rank(s) failed"

    def groups(self) -> list[tuple[tuple[int, ...], BaseException]]:
        """Ranks grouped by identical failure, largest group first."""
        by_key: dict[object, list[int]] = {}
        sample: dict[object, BaseException] = {}
        for rank in sorted(self.errors):
            err = self.errors[rank]
            if isinstance(err, RemoteError):
                key: object = err.signature
            elif isinstance(err, MembershipChanged):  # the gloo detail differs per peer
                key = (MembershipChanged, err.dead)
            else:
                key = (type(err), _strip_rank(err))
            by_key.setdefault(key, []).append(rank)
            sample.setdefault(key, err)
        out = [(tuple(ranks), sample[key]) for key, ranks in by_key.items()]
        out.sort(key=lambda item: (-len(item[0]), item[0]))
        return out

    def render_lines(self) -> list[str]:
        lines = [f"RankErrors: {self._headline()}"]
        if self.results:  # what the others computed is kept in .results: say so
            lines.append(f"--- {_succeeded(self.results)} (kept in .results)")
        for ranks, err in self.groups():
            who = f"rank {format_ranks(ranks)}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
            if isinstance(err, RemoteError):
                lines.append(f"--- {who}: {err.type_name}: {err.message}")
                if err.traceback_text:
                    lines.extend(err.traceback_text.rstrip("\n").splitlines())
            else:
                text = str(err)
                if isinstance(err, (RankDied, MembershipChanged)) and len(ranks) > 1:
                    text = f"{type(err).__name__} ({len(ranks)} ranks alike): {text}"
                else:
                    text = f"{type(err).__name__}: {text}"
                lines.append(f"--- {who}: {text}")
        return lines

    def _render_traceback_(self) -> list[str]:  # IPython hook
        return self.render_lines()

    def __str__(self) -> str:
        # without the "RankErrors: " of the IPython rendering: a client that
        # prints f"{type(e).__name__}: {e}" would show it twice
        lines = self.render_lines()
        return "\n".join([lines[0].removeprefix("RankErrors: "), *lines[1:]])

    def __reduce__(self) -> tuple[Any, ...]:  # keep picklable (multiprocessing, xdist)
        return (RankErrors, (self.errors, self.results, self.total))


def _succeeded(results: Mapping[int, object], width: int = 400) -> str:
    """``rank 2 returned 7`` / ``ranks 0,3 returned: rank 0: 1; rank 3: 2``,
    equal values once (RankResults' repr), long reprs cut."""
    ranks = sorted(results)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
    try:
        text = repr(results[ranks[0]]) if len(ranks) == 1 else repr(results)
    except Exception as exc:  # a user's __repr__ that fails must not hide the errors
        text = f"<repr failed: {type(exc).__name__}>"
    if text.startswith("RankResults(") and text.endswith(")"):
        text = text[len("RankResults("):-1]
    if len(text) > width:
        text = text[:width] + "..."
    return f"{who} succeeded: {text}"


def quote_first_line(text: str, limit: int = 200) -> str:
    """A backend's message (gloo, nccl) quoted in ours: its first line;
    one longer than ``limit`` is cut after the last sentence that fits,
    never mid-word, else kept whole (no sentence end: cutting it would
    lose the point)."""
    line = text.strip().splitlines()[0].strip() if text.strip() else ""
    if len(line) <= limit:
        return line
    ends = [m.end() for m in re.finditer(r"[.!?;](?=\s)", line[:limit + 1])]
    return line[:ends[-1]] + " ..." if ends else line


_PEER_LOSS = ("connection closed by peer", "connection reset", "broken pipe",
              "nccl communicator was aborted", "socket closed", "remote process exited")


def is_peer_loss(text: str) -> bool:
    """Does this collective error text mean a member of the group is gone?
    (gloo: 'Connection closed by peer' within ~0.2 s of a SIGKILL.)"""
    low = text.lower()
    return any(s in low for s in _PEER_LOSS)


def _strip_rank(err: BaseException) -> str:
    text = str(err)
    rank = getattr(err, "rank", None)
    if rank is not None:
        text = re.sub(rf"\brank {rank}\b", "rank ?", text)
    return text
