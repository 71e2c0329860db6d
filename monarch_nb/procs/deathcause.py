"""Why a rank died, when it can be told: the ``cause_hint`` of ``RankDied``
and of the DIED event. Pure: an exit status, the end of the rank's log and
its last health reading in, one line out ("" when nothing more is known
than the exit status already says).

* a crash (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL): ranks enable
  ``faulthandler`` (engine/loop.py), which writes every thread's Python
  stack into the log; the crashing thread is the one marked ``Current
  thread``. Its innermost frame and the innermost frame of the user's code
  are named: ``Segmentation fault in string_at (ctypes/__init__.py line
  519), called from <mnb-cell-3> line 2``. Ranks also turn on torch's own
  fatal-signal handler (c10's), which first writes every thread's native
  stack: the crashing thread's is the one that went through
  ``fatalSignalHandler``, and its innermost frames are named too
  (``native: libc.so.6+0x167ad8 <- _ctypes...so+0x8608``).
  :func:`crash_stack` gives that thread's whole Python and native stack
  for ``RankDied.crash_stack``;
* SIGKILL that monarch_nb did not send (``%monarch kill``, a frozen rank, a
  stuck survivor): nothing else on a machine sends SIGKILL as often as the
  kernel's OOM killer, so it is named, with the rank's last resident memory
  (from its heartbeats): "probably the OOM killer" when that was at least
  :data:`HIGH_RSS_FRACTION` of the machine's memory, or when its memory
  cgroup (a container's, a Slurm job's: the heartbeat reports it) was at
  :data:`NEAR_LIMIT_FRACTION` of its limit, else as a possibility;
* an exit with a Python traceback at the end of the log (an uncaught
  error, a MemoryError the rank could not survive): the last exception
  line, with "out of memory" said for MemoryError and torch's
  OutOfMemoryError (CUDA's or HIP's);
* a collective that timed out, whatever the exit looked like (NCCL's and
  RCCL's watchdog abort the process, gloo raises): the backend's line
  saying so, when the log has one ("a collective timed out: ...").

* what it was doing (:func:`flight_hint`), from the records it left in its
  persisted ring (engine/flightrec.py ``Persisted``, flight.read_persisted):
  the collective it died in (``in all_reduce #4 of float32[4] from
  <mnb-cell-7> line 3``), or the call it was running and its last
  collective; dying of a crash inside a collective, a line suggests strict
  mode, which names every rank's side of a disagreement before anything is
  sent;
* the other ranks' side of that collective (:func:`peers_hint`), from the
  rings the living ranks persist too (read in place, not removed): ``while
  ranks 0,1 called all_reduce #4 of float32[8]``. When their records show
  a desync (a different op, dtype, shape or root at the same sequence
  number), the strict-mode hint says so plainly instead of "if".

Non-goals: the exit status itself (RankDied.cause), reading the log
(supervisor.py).
"""

from __future__ import annotations

import re
import signal as signal_mod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import quote_first_line
from ..flight import DEFAULT_GROUP, IN_FLIGHT, OpRecord, label

HIGH_RSS_FRACTION = 0.25  # of the machine's memory: a SIGKILL then is probably the OOM killer
# of a cgroup's limit: heartbeats come every 0.5 s, and memory that grows
# fast passes the last reading by a lot before the kill
NEAR_LIMIT_FRACTION = 0.5
_CRASHES = {signal_mod.SIGSEGV, signal_mod.SIGBUS, signal_mod.SIGABRT, signal_mod.SIGFPE,
            signal_mod.SIGILL}
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
# c10's dump: "SIGSEGV(11), PID: 7, Thread 7: " then "frame #3: sym + 0x1f (0x7f.. in /lib/x.so)"
_NATIVE_HEAD = re.compile(r"^SIG[A-Z]+\(\d+\), PID: \d+, Thread \d+:")
_NATIVE_FRAME = re.compile(r"^\s*frame #\d+: (?P<sym>.+?) \+ (?P<off>0x[0-9a-f]+) "
                           r"\(0x[0-9a-f]+ in (?P<lib>[^)]+)\)")
NATIVE_IN_HINT = 3  # innermost native frames named in the one-line hint
_EXC = re.compile(r"^(?P<name>[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning))(:\s?(?P<msg>.*))?$")
_OOM_NAMES = ("MemoryError", "OutOfMemoryError")
# what NCCL/RCCL's watchdog and gloo write when a collective times out
_TIMEOUT = re.compile(r"collective operation timeout|before timing out|"
                      r"operations have failed or timed out|"
                      r"timed out waiting \S+ for (send|recv)", re.IGNORECASE)


def explain(code: int | None, log_tail: Sequence[str], *, last_rss: float | None = None,
            mem_total: float | None = None, sent: Iterable[int] = (),
            mem_limit: float | None = None, mem_used: float | None = None,
            flight: tuple[dict[str, Any], Sequence[OpRecord]] = ({}, ()),
            peers: Mapping[int, Sequence[OpRecord]] | None = None) -> str:
    """The cause hint for a rank that exited with ``code`` (negative: a
    signal). ``sent``: the signals monarch_nb itself sent the process;
    ``mem_limit``, ``mem_used``: its memory cgroup's limit and last usage,
    when it had a limit; ``flight``: the call identity and records its
    persisted ring kept (:func:`flight_hint`); ``peers``: the living
    ranks' persisted records, when they could be read (:func:`peers_hint`)."""
    if code is None:
        return ""
    doing = flight_hint(code, *flight, peers=peers)
    if code >= 0 and not doing.startswith("in "):
        # an exit says itself what it was doing (its traceback); but one in
        # the middle of a collective is named, however it ended: a mismatch
        # gloo does not catch overruns a buffer, and the corruption may end
        # the rank by an abort or by an exit (a control thread that failed)
        doing = ""
    why = _explain(code, log_tail, last_rss, mem_total, sent, mem_limit, mem_used)
    if not (doing and why):
        return doing or why
    # the collective it died in first (what the user looks for), else the
    # call it was running after the cause
    return f"{doing}; {why}" if doing.startswith("in ") else f"{why}; {doing}"


def flight_hint(code: int, call: dict[str, Any], records: Sequence[OpRecord],
                peers: Mapping[int, Sequence[OpRecord]] | None = None) -> str:
    """What a dead rank was doing, from its persisted records: the
    collective it was in (and the other ranks' side of it, from
    ``peers``' records), else the call it ran and its last collective;
    "" when they tell nothing."""
    last = records[-1] if records else None
    text = ""
    if last is not None and last.state == IN_FLIGHT:
        text = f"in {_what(last)} from {last.where()}"
        side, desync = peers_hint(last, peers or {})
        if side:
            text += f", {side}"
        if desync:
            text += f" ({STRICT_HINT})"
        elif not side and code < 0 and -code in {int(s) for s in _CRASHES}:
            text += (" (if the ranks called different collectives there, strict mode, "
                     "check_collectives=True, names each rank's call before anything is sent)")
        return text
    name = call.get("name")
    if isinstance(name, str) and name:
        text = f"during {name}"
        if isinstance(call.get("step"), int):
            text += f" (step {call['step']})"
    if last is not None:
        done = f"{last.op} #{last.seq} from {last.where()}"
        text = f"{text}, after {done}" if text else f"after {done}"
    return text


# said when the records show the ranks disagreed on a collective
STRICT_HINT = ("the ranks called different collectives: strict mode, check_collectives=True "
               "or %monarch start --check-collectives, names each rank's call before anything "
               "is sent")


def _what(rec: OpRecord) -> str:
    return f"{rec.op} #{rec.seq}" + (f" of {rec.tensors}" if rec.tensors else "")


def peers_hint(dead: OpRecord, peers: Mapping[int, Sequence[OpRecord]]) -> tuple[str, bool]:
    """The other ranks' side of the collective ``dead`` (a dead rank's
    in-flight record) and whether they disagreed: ``while ranks 0,1 called
    all_reduce #4 of float32[8]`` (a desync: True), ``with ranks 0,1 in it
    too``, ``rank 2 had not reached it``. Their record of the same group,
    generation and sequence number is their side; ("", False) when no
    peer's records tell."""
    same: list[int] = []
    behind: list[int] = []
    other: dict[tuple[str, str, str], list[int]] = {}
    for rank in sorted(peers):
        recs = [r for r in peers[rank] if r.group == dead.group and r.generation == dead.generation
                and r.peer is None]
        if not recs:  # none in this generation: not there yet (the default group has all)
            if dead.group == DEFAULT_GROUP:
                behind.append(rank)
            continue
        mine = next((r for r in reversed(recs) if r.seq == dead.seq), None)
        if mine is None:
            if recs[-1].seq < dead.seq:
                behind.append(rank)
            continue
        if mine.signature() == dead.signature():
            same.append(rank)
        else:
            where = "" if mine.where() == dead.where() else f" from {mine.where()}"
            other.setdefault((_what(mine), mine.describe(), where), []).append(rank)
    parts = [f"while {label(ranks)} called {what}{where}"
             if what != _what(dead) else f"while {label(ranks)} called {describe}{where}"
             for (what, describe, where), ranks in other.items()]
    if same:
        parts.append(f"with {label(same)} in it too")
    if behind:
        parts.append(f"{label(behind)} had not reached it")
    return ", ".join(parts), bool(other)


def _explain(code: int, log_tail: Sequence[str], last_rss: float | None,
             mem_total: float | None, sent: Iterable[int], mem_limit: float | None,
             mem_used: float | None) -> str:
    if code != 0:
        timed_out = timeout_hint(log_tail)
        if timed_out:
            return timed_out
    if code < 0:
        sig = -code
        if sig in {int(s) for s in _CRASHES}:
            return crash_hint(sig, log_tail)
        if sig == signal_mod.SIGKILL and sig not in set(sent):
            return oom_hint(last_rss, mem_total, mem_limit, mem_used)
        return ""
    if code != 0:
        return exception_hint(log_tail)
    return ""


def is_crash(code: int) -> bool:
    """Did an exit status ``code`` (negative: a signal) come from a crash?"""
    return code < 0 and -code in {int(s) for s in _CRASHES}


def crash_hint(sig: int, log_tail: Sequence[str]) -> str:
    """From faulthandler's dump: what crashed, where, called from where."""
    fatal = ""
    for line in log_tail:
        if line.startswith("Fatal Python error:"):
            fatal = line.split(":", 1)[1].strip()
    frames = _current_thread(log_tail)
    what = fatal or signal_mod.Signals(sig).name
    native = _native_frames(log_tail)
    where = "; native: " + " <- ".join(native[:NATIVE_IN_HINT]) if native else ""
    if not frames:
        if native:
            return f"{what}{where}"
        return f"{what} (no Python stack in its log)" if fatal else ""
    inner = frames[0]
    user = next((f for f in frames if _is_user(f[0])), None)
    text = f"{what} in {inner[2]} ({_short(inner[0])} line {inner[1]})"
    if user is not None and user is not inner:
        text += f", called from {_at(user)}"
    return text + where


def crash_stack(log_tail: Sequence[str]) -> list[str]:
    """The crashing thread's stack from a crashed rank's log, outermost
    call last like faulthandler's: its Python frames, then its native ones
    (c10's dump), each line ready to print; [] when the log has neither."""
    out: list[str] = []
    frames = _current_thread(log_tail)
    if frames:
        out.append("Python (most recent call first):")
        out.extend(f"  {_at(f)}" for f in frames)
    native = _native_frames(log_tail)
    if native:
        out.append("native (most recent call first):")
        out.extend(f"  {f}" for f in native)
    return out


def crash_frames(log_tail: Sequence[str]) -> list[tuple[str, int, str]]:
    """The crashing thread's Python frames from a crashed rank's log, as
    ``(file, line, function)``, innermost first (faulthandler's order; the
    files as the rank named them): what :func:`crash_stack` quotes."""
    return _current_thread(log_tail)


def is_native_dump(line: str) -> bool:
    """Does ``line`` start c10's dump of a thread's native stack?"""
    return bool(_NATIVE_HEAD.match(line.strip()))


def _native_frames(lines: Sequence[str]) -> list[str]:
    """The crashing thread's native frames, innermost first, without the
    signal handlers' own: c10 dumps every thread, and only the crashing one
    went through ``fatalSignalHandler`` (the others through
    ``stacktraceSignalHandler`` alone). The frame after the handler is the
    kernel's signal trampoline; the crash is the one after that."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in lines:
        text = line.strip()
        if _NATIVE_HEAD.match(text):
            current = []
            blocks.append(current)
        elif not text:
            current = None  # c10 ends each thread's dump with a blank line
        elif current is not None:
            current.append(text)
    crashing = next((b for b in blocks if any("fatalSignalHandler(" in f for f in b)), None)
    if crashing is None:
        return []
    at = max(i for i, f in enumerate(crashing) if "fatalSignalHandler(" in f)
    out: list[str] = []
    for raw in crashing[at + 2:]:
        if raw == "<omitting python frames>":
            out.append("(Python frames)")
            continue
        m = _NATIVE_FRAME.match(raw)
        if m is None:
            continue
        lib = m["lib"].rsplit("/", 1)[-1]
        out.append(f"{lib}+{m['off']}" if m["sym"] == "<unknown function>" else f"{m['sym']} ({lib})")
    return out


def _current_thread(lines: Sequence[str]) -> list[tuple[str, int, str]]:
    """The crashing thread's frames, innermost first (faulthandler's order)."""
    frames: list[tuple[str, int, str]] = []
    inside = False
    for line in lines:
        if line.startswith("Current thread") or line.startswith("Stack (most recent call first)"):
            inside, frames = True, []
            continue
        if inside:
            m = _FRAME.match(line)
            if m:
                frames.append((m["file"], int(m["line"]), m["func"]))
            elif line.strip():
                inside = False
            elif frames:
                inside = False
    return frames


def timeout_hint(log_tail: Sequence[str]) -> str:
    """The backend's own line about a collective that timed out, if any."""
    for line in reversed(log_tail):
        if _TIMEOUT.search(line):
            text = line.strip()
            return f"a collective timed out: {quote_first_line(text, 240)}"
    return ""


def oom_hint(last_rss: float | None, mem_total: float | None,
             mem_limit: float | None = None, mem_used: float | None = None) -> str:
    if mem_limit and mem_used is not None:
        used, cap = mem_used / 2**20, mem_limit / 2**20
        rss = "" if last_rss is None else f", last RSS seen {last_rss / 2**20:,.0f} MiB"
        if mem_used >= NEAR_LIMIT_FRACTION * mem_limit:
            return (f"probably the kernel's OOM killer: its memory cgroup was last seen at "
                    f"{used:,.0f} MiB of its {cap:,.0f} MiB limit{rss}")
        return (f"SIGKILL that monarch_nb did not send; its memory cgroup was last seen at "
                f"{used:,.0f} MiB of its {cap:,.0f} MiB limit{rss}: the kernel's OOM killer if "
                "memory grew fast (see dmesg), or another process")
    if last_rss is None:
        return ("SIGKILL that monarch_nb did not send: often the kernel's OOM killer "
                "(see dmesg)")
    mib = last_rss / 2**20
    of = f" of {mem_total / 2**20:,.0f} MiB" if mem_total else ""
    if mem_total and last_rss >= HIGH_RSS_FRACTION * mem_total:
        return f"probably the OOM killer, last RSS {mib:,.0f} MiB{of}"
    return (f"SIGKILL that monarch_nb did not send, last RSS {mib:,.0f} MiB{of}: the kernel's "
            "OOM killer if memory was short (see dmesg), or another process")


def exception_hint(log_tail: Sequence[str]) -> str:
    """The last exception line of a traceback at the end of the log."""
    seen_tb = False
    last = ""
    for line in log_tail:
        if line.startswith("Traceback (most recent call last)"):
            seen_tb = True
            continue
        if seen_tb:
            m = _EXC.match(line.strip()) if not line.startswith(" ") else None
            if m:
                last = line.strip()
    if not last:
        return ""
    name = last.split(":", 1)[0]
    if name.rsplit(".", 1)[-1] in _OOM_NAMES:
        return f"out of memory: its last exception was {last}"
    return f"its last exception was {last}"


def _is_user(filename: str) -> bool:
    if filename.startswith("<mnb-cell") or filename.startswith("<setup"):
        return True
    if filename.startswith("<"):
        return False
    return not any(p in filename for p in ("site-packages", "dist-packages", "/lib/python3",
                                           "/monarch_nb/"))


def _short(filename: str) -> str:
    for marker in ("site-packages/", "dist-packages/", "/lib/python3."):
        i = filename.find(marker)
        if i >= 0:
            rest = filename[i + len(marker):]
            return rest.split("/", 1)[1] if marker.startswith("/lib/") and "/" in rest else rest
    return filename


def _at(frame: tuple[str, int, str]) -> str:
    file, line, func = frame
    at = f"{_short(file)} line {line}"
    return at if func == "<module>" else f"{func} ({at})"


__all__ = ["explain", "crash_frames", "is_native_dump", "flight_hint", "peers_hint", "STRICT_HINT", "crash_hint", "crash_stack", "is_crash", "oom_hint", "exception_hint", "timeout_hint",
           "HIGH_RSS_FRACTION",
           "NEAR_LIMIT_FRACTION"]
