"""Looking into running ranks from the controller: stack requests, the hang
watchdog and the debugger relay.

A part of the controller with its own state (stack requests, queued
prompts, debugger focus); it reads the rank and call tables. Its handlers
run on the thread that leads the I/O loop, like every handler; the public
entry points (:meth:`request_stacks_blocking`, :meth:`serve_prompt`) are
called from the user's thread.

* Stacks: a STACKS request goes to each rank's control thread, which answers
  even while the main thread is stuck. Replies are collected under a request
  id; ranks that do not answer within the timeout are reported as such.
* Hang watchdog: a call with a ``hang_timeout`` that shows no progress (no
  output, metric, result or debugger prompt) for that long gets the grouped
  stacks of its unfinished ranks printed into its cell, once, with a hint.
* Debugger relay: a rank's debugger (``breakpoint()``, post-mortem) waits
  for a line and sends a PROMPT. Prompts queue here; the thread waiting on the
  call asks the user (the kernel's input box) and sends the answer as INPUT.
  One rank is *in focus* at a time: after ``n`` or ``s`` the next prompt of the
  same rank is awaited before another rank's; ``c`` or ``q`` moves on to the
  next rank that stopped, and those waiting are named so the user knows.

Non-goals: grouping and wording (stacks.py), the rank side (debug.py).
"""

from __future__ import annotations

import builtins
import collections
import functools
import itertools
import signal as signal_mod
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import flight
from ..procs import deathcause
from ..procs.supervisor import Supervisor
from ..selection import format_ranks
from ..stacks import RankStacks, Stacks, hang_report
from ..wire import payloads
from ..wire.metas import meta_of
from ..wire.protocol import Codec, Kind, Message
from ..wire.transport import IOLoop
from .analysis import collectives
from .calls.calltable import CallTable, PendingCall
from .calls.output import CallOutput
from .life.events import EventKind
from .life.rankstates import LIVE
from .life.ranktable import RankInfo, RankTable

STACKS_TIMEOUT_S = 2.0
# Flight-recorder records each rank adds to its stacks (the summary printed
# first); mesh.collectives() asks for the whole ring.
FLIGHT_TAIL = 400
# Debugger commands after which the rank runs on (another rank may be served).
_RELEASING = {"c", "cont", "continue", "q", "quit", "exit", "\x04", "run", "restart"}
_REQUEST_IDS = itertools.count(1 << 48)  # apart from call ids


@dataclass
class _StackRequest:
    ranks: tuple[int, ...]
    deadline: float
    on_done: Callable[[Stacks], None]
    result: Stacks = field(default_factory=Stacks)


@dataclass
class Prompt:
    call_id: int
    rank: int
    text: str


class Inspector:
    """Stack requests, the hang watchdog and the debugger relay of one mesh."""

    def __init__(self, ranks: RankTable, calls: CallTable, io: IOLoop, codec: Codec,
                 notify: Callable[[], None], recovering: Callable[[int], bool],
                 supervisor: Supervisor | None = None,
                 in_debugger: Callable[[int], bool] = lambda call_id: False) -> None:
        self.ranks = ranks
        self.calls = calls
        # its reaped processes keep their persisted flight records (flight.py)
        self.supervisor = supervisor
        self.last_call: int | None = None  # the newest user call that finished
        self.io = io
        self.codec = codec
        self._notify = notify
        self._recovering = recovering  # is this rank being brought back?
        self._in_debugger = in_debugger  # a rank of this call stands in JupyterLab's debugger
        self.stack_requests: dict[int, _StackRequest] = {}
        self.prompts: collections.deque[Prompt] = collections.deque()
        self.debug_focus: dict[int, int | None] = {}  # call -> rank being debugged
        self.ask: Callable[[str], str] | None = None  # default: builtins.input at the time

    # -- stacks --------------------------------------------------------------------
    def request_stacks(self, ranks: tuple[int, ...], on_done: Callable[[Stacks], None],
                       timeout: float = STACKS_TIMEOUT_S, flight: int = FLIGHT_TAIL) -> None:
        """I/O thread: ask ``ranks`` for their stacks (and the newest
        ``flight`` records of their flight recorders); ``on_done(stacks)``
        when all answered or the timeout passed."""
        req_id = next(_REQUEST_IDS)
        req = _StackRequest(tuple(ranks), time.monotonic() + timeout, on_done)
        frames = self.codec.sign(Kind.STACKS, call=req_id, meta={"flight": flight} if flight else None)
        for r in ranks:
            info = self.ranks[r]
            if info.state in LIVE:
                self.io.send(info.ctl_id, frames)
            else:
                req.result[r] = RankStacks(r, status=info.state.value)
        self.stack_requests[req_id] = req
        self._maybe_finish_stacks(req_id)

    def request_stacks_blocking(self, ranks: tuple[int, ...], timeout: float = STACKS_TIMEOUT_S,
                                native: bool = False, flight: int = FLIGHT_TAIL) -> Stacks:
        """Any thread: the stacks of ``ranks``. The main thread leads the
        I/O loop meanwhile; another thread (the dashboard's) leaves the
        request to whoever leads: the main thread may be blocked in a cell,
        leading the loop until the cell ends, and the request must be
        answered while the ranks are stuck, not after."""
        box: list[Stacks] = []
        done = threading.Event()

        def finished(stacks: Stacks) -> None:
            box.append(stacks)
            done.set()

        self.io.call_soon(lambda: self.request_stacks(ranks, finished, timeout, flight))
        deadline = time.monotonic() + timeout + 5.0
        if threading.current_thread() is threading.main_thread():
            with self.io.leadership():
                while not done.is_set() and not self.io.stopping and time.monotonic() < deadline:
                    self.io.run_once(0.05)
        else:
            while not done.wait(0.1) and not self.io.stopping and time.monotonic() < deadline:
                pass
        stacks = box[0] if box else Stacks({r: RankStacks(r, status="no answer") for r in ranks})
        if native:
            for r, st in stacks.items():
                st.native = native_stack(self.ranks[r].pid)
        return stacks

    def on_stacks_reply(self, info: RankInfo, msg: Message) -> bool:
        """True if the reply belonged to a request of ours."""
        req = self.stack_requests.get(msg.call)
        if req is None or info.rank not in req.ranks:
            return False
        flight = None
        if msg.payload:  # the flight recorder's tail (JSON: data, never pickle)
            try:
                flight = payloads.decode_flight(msg.payload[0])
            except payloads.PayloadError:
                flight = None
        req.result[info.rank] = RankStacks(
            info.rank, "ok", list(meta_of(msg, Kind.STACKS_REPLY).get("threads") or []),
            int(meta_of(msg, Kind.STACKS_REPLY).get("busy") or 0),
            flight=flight)
        self._maybe_finish_stacks(msg.call)
        return True

    def _maybe_finish_stacks(self, req_id: int, now: float | None = None) -> None:
        req = self.stack_requests.get(req_id)
        if req is None:
            return
        late = now is not None and now >= req.deadline
        if not late and len(req.result) < len(req.ranks):
            return
        del self.stack_requests[req_id]
        for r in req.ranks:
            req.result.setdefault(r, RankStacks(r, status="no answer"))
        stacks = Stacks(sorted(req.result.items()))
        stacks.dead = self.dead_tails(req.ranks)
        stacks.collectives = collective_summary(stacks)
        req.on_done(stacks)

    # -- dead incarnations ------------------------------------------------------------
    def call_over(self, call: PendingCall) -> None:
        """I/O thread: ``call`` finished; a user's call is "the last call"
        whose dead the analysis shows (until the next one finishes)."""
        if not call.internal:
            self.last_call = call.call_id

    def dead_tails(self, ranks: tuple[int, ...],
                   every: bool = False) -> list[collectives.RankTail]:
        """The persisted flight records of ``ranks``' ended incarnations,
        oldest first, as recorder tails (``RankTail.dead`` set): those that
        died in a call still running or in the last call that finished
        (what ``mesh.collectives()`` and the hang watchdog add to the live
        ranks' records), or, with ``every``, all of them (``mesh.trace()``:
        a rank's whole history, not only since its rebirth)."""
        sup = self.supervisor
        if sup is None:
            return []
        calls = {c.call_id for c in self.calls} | {self.last_call}
        chosen = set(ranks)
        out = []
        for proc in list(sup.history):
            if proc.rank not in chosen or not proc.reaped:
                continue
            call, records = proc.flight
            if not records and not call:
                continue  # nothing persisted (a remote rank, or none made)
            if not every and call.get("call") not in calls:
                continue  # it died between calls, or in an earlier one
            died_at = next((e.time for e in reversed(self.ranks.events)
                            if e.rank == proc.rank and e.incarnation == proc.incarnation
                            and e.kind in (EventKind.DIED, EventKind.FAILED_START)), None)
            out.append(collectives.RankTail.from_wire(
                proc.rank, flight.dead_tail(call, list(records), proc.incarnation, died_at)))
        return out

    # -- hang watchdog ----------------------------------------------------------------
    def tick(self, now: float) -> None:
        for req_id in list(self.stack_requests):
            self._maybe_finish_stacks(req_id, now)
        for call in self.calls:
            limit = call.hang_timeout
            if not limit or call.hang_reported or not call.remaining:
                continue
            if self.debug_focus.get(call.call_id) is not None or any(
                    p.call_id == call.call_id for p in self.prompts) or self._in_debugger(call.call_id):
                continue  # the user is in a debugger: not a hang
            if any(self._recovering(r) for r in call.ranks) or call.reissue:
                call.progressed(now)  # recovery is under way: not a hang
                continue
            if now - call.progress_at >= limit:
                call.hang_seen()
                # every rank of the call: the stacks shown are the unfinished
                # ones', but a finished rank's recorder is half the story
                # (a collective it never entered, an extra one it made)
                self.request_stacks(tuple(sorted(set(call.ranks) | call.remaining)),
                                    functools.partial(_report_hang, call.output, limit,
                                                      frozenset(call.remaining)))

    # -- debugger relay -----------------------------------------------------------------
    def on_prompt(self, info: RankInfo, msg: Message) -> None:
        call = self.calls.get(msg.call)
        if call is None:
            return
        call.progressed(time.monotonic())
        # The prompt is the rank's unfinished line, sent with the request
        # (engine/capture.py). If the rank's control thread sent it, or its
        # beginning, as output first (between pdb's write and its read), it
        # is also here as an unfinished line: taken before the flush below
        # would print it as output too.
        text = str(meta_of(msg, Kind.PROMPT).get("prompt") or "")
        held = call.output.take_partial(info.rank)
        if held and text and not text.startswith(held):
            call.output.feed(info.rank, "stdout", held)  # not the prompt's: put it back
        text = text or held or "? "
        call.output.flush(force=True)
        waiting = {p.rank for p in self.prompts if p.call_id == call.call_id}
        focus = self.debug_focus.get(call.call_id)
        if info.rank not in waiting and focus not in (None, info.rank) and info.rank != focus:
            call.output.note(f"monarch_nb: rank {info.rank} stopped in the debugger too; "
                             f"it is next after rank {focus}")
        self.prompts.append(Prompt(call.call_id, info.rank, text))
        self._notify()

    def release_focus(self, call_id: int, rank: int) -> None:
        """I/O thread: ``rank`` finished or died: its debugger session is over."""
        if self.debug_focus.get(call_id) == rank:
            self.debug_focus[call_id] = None
        kept = [p for p in self.prompts if not (p.call_id == call_id and p.rank == rank)]
        if len(kept) != len(self.prompts):
            self.prompts = collections.deque(kept)
        if call_id not in self.calls:
            self.debug_focus.pop(call_id, None)
            self.prompts = collections.deque(p for p in self.prompts if p.call_id != call_id)

    def prompt_ready(self, call_id: int) -> bool:
        """A prompt of ``call_id`` can be shown now (focus rules above)."""
        focus = self.debug_focus.get(call_id)
        return any(p.call_id == call_id and (focus is None or p.rank == focus)
                   for p in self.prompts)

    def serve_prompt(self, call_id: int) -> None:
        """User's thread, not leading the loop: ask for one line and send it."""
        focus = self.debug_focus.get(call_id)
        prompt = next((p for p in self.prompts if p.call_id == call_id
                       and (focus is None or p.rank == focus)), None)
        if prompt is None:
            return
        self.prompts.remove(prompt)
        others = sorted({p.rank for p in self.prompts if p.call_id == call_id} - {prompt.rank})
        if focus is None and others:
            call = self.calls.get(call_id)
            if call is not None:
                who = (f"rank {others[0]} also stopped and comes next" if len(others) == 1
                       else f"ranks {format_ranks(others)} also stopped and come next")
                call.output.note(f"monarch_nb: rank {prompt.rank} is in the debugger; {who} "
                                 "(c continues to the next one)")
        self.debug_focus[call_id] = prompt.rank
        answer = self._ask_user(prompt)
        if answer.strip() in _RELEASING:
            self.debug_focus[call_id] = None
        call = self.calls.get(call_id)
        if call is not None:
            call.progressed(time.monotonic())
        frames = self.codec.sign(Kind.INPUT, meta={"text": answer})
        ctl_id = self.ranks[prompt.rank].ctl_id
        self.io.call_soon(lambda: self.io.send(ctl_id, frames))

    def _ask_user(self, prompt: Prompt) -> str:
        label = f"[rank {prompt.rank}] {prompt.text}"
        ask = self.ask or builtins.input  # looked up now: ipykernel swaps it per cell
        try:
            return str(ask(label))
        except EOFError:
            return "\x04"
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # e.g. a front end without an input box
            fallback = "c" if "pdb" in prompt.text.lower() else "\x04"
            print(f"monarch_nb: cannot ask for input here ({type(exc).__name__}: {exc}); "
                  f"rank {prompt.rank} was sent {'c (continue)' if fallback == 'c' else 'end of input'}")
            return fallback


def collective_report(stacks: Stacks) -> collectives.CollectiveReport:
    """What the ranks' flight recorders (sent with their stacks) say, with
    the persisted records of the incarnations that died in the call
    (``stacks.dead``, :meth:`Inspector.dead_tails`)."""
    tails = {r: collectives.RankTail.from_wire(r, st.flight) for r, st in stacks.items()
             if st.flight is not None}
    silent = {r: st.status for r, st in stacks.items() if st.status != "ok"}
    return collectives.analyze(tails, stacks, silent, stacks.dead)


def collective_summary(stacks: Stacks) -> list[str]:
    """The findings printed first, when the recorders found something
    beyond silent ranks (the stacks show those already)."""
    if not any(st.flight for st in stacks.values()) and not stacks.dead:
        return []
    report = collective_report(stacks)
    return [f.text for f in report.findings if f.kind != "silent"]


def _report_hang(output: CallOutput, seconds: float, unfinished: frozenset[int],
                 stacks: Stacks) -> None:
    shown = Stacks((r, st) for r, st in stacks.items() if r in unfinished)
    shown.collectives = stacks.collectives
    output.note(hang_report(shown, seconds))


DEATH_OUTPUT_LINES = 12  # last output lines a death report shows
DEATH_RECORDS = 8  # last collectives a death report shows
_DUMP_STARTS = ("Fatal Python error", "Current thread", "Thread 0x", "Stack (most recent")


def death_report(supervisor: Supervisor, rank: int) -> str:
    """What ``%monarch debug RANK`` shows when ``rank``'s newest ended
    incarnation was killed by a signal and pdb has no interpreter left:
    its last Python and native stacks (where its log has faulthandler's and
    c10's dump), its last output lines and its last collectives (its
    persisted flight records). "" when no incarnation of it ended by a
    signal (the caller tries pdb on the running one first)."""
    procs = [p for p in supervisor.history if p.rank == rank]
    dead = next((p for p in reversed(procs) if p.reaped), None)
    code = None if dead is None else dead.popen.poll()
    if dead is None or code is None or code >= 0:
        return ""
    try:
        how = f"killed by {signal_mod.Signals(-code).name}"
    except ValueError:
        how = f"killed by signal {-code}"
    log = supervisor.tail(rank, 2000, dead.incarnation)
    lines = [f"rank {rank} (incarnation {dead.incarnation}, pid {dead.pid}) was {how}: no "
             "interpreter is left for pdb; what it left behind:"]
    stack = deathcause.crash_stack(log)
    if stack:
        lines.append("last stacks (from its log):")
        lines.extend(f"  {line}" for line in stack)
    else:
        why = "SIGKILL leaves none" if -code == signal_mod.SIGKILL else "no faulthandler dump"
        lines.append(f"last stacks: none in its log ({why})")
    cut = next((i for i, line in enumerate(log)
                if line.startswith(_DUMP_STARTS) or deathcause.is_native_dump(line)), len(log))
    output = log[:cut][-DEATH_OUTPUT_LINES:]
    lines.append("last output lines:" if output else "last output lines: none")
    lines.extend(f"  {line}" for line in output)
    call, records = dead.flight
    if call.get("name"):
        lines.append(f"last call: {call['name']}")
    recs = list(records)[-DEATH_RECORDS:]
    lines.append("last collectives (its flight records, oldest first):" if recs
                 else "last collectives: none recorded")
    for rec in recs:
        lines.append(f"  #{rec.seq} {rec.describe()} from {rec.where()}: {rec.state}"
                     + ("" if rec.group == flight.DEFAULT_GROUP else f" ({flight.group_label(rec.group)})"))
    return "\n".join(lines)


def native_stack(pid: int | None) -> str:
    """py-spy's dump of a process with native frames, where py-spy is
    installed and allowed to attach; otherwise a line saying why not."""
    import shutil
    import subprocess

    if pid is None:
        return "(no process)"
    import os
    import sys

    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")  # a venv's bin/
    exe = shutil.which("py-spy") or (beside if os.access(beside, os.X_OK) else None)
    if exe is None:
        return "(native frames need py-spy: pip install py-spy)"
    try:
        out = subprocess.run([exe, "dump", "--native", "--pid", str(pid)], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(py-spy failed: {exc})"
    return out.stdout if out.returncode == 0 else f"(py-spy failed: {out.stderr.strip()[:300]})"

