"""The controller: rank table, answers from the ranks, result gathering, futures.

Lives in the notebook kernel (or the launching process). Everything that
changes rank or call state runs on the I/O thread (message handlers, pidfd
callbacks, ticks), so that state needs no locks; other threads only read
snapshots or go through ``io.call_soon``.

Rank states::

    STARTING --READY--> READY <--> BUSY
        |                 |         |
        +----- exit ------+---------+--> policy: RESPAWNING --READY--> READY
                                             or DEAD (respawn off) or FAILED (budget)
    (any) --stop--> STOPPED

A death goes to the restart policy (policy.py); recovery.py (a mixin of this
class) carries out its actions: respawn keeps the rank number and device, every member joins a new
torch.distributed group (new generation, new port: never a store a dead
member may still hold), ``--setup`` cells are replayed on the new process
before any other call reaches it, and calls for a respawning rank wait.

A call (issued by calls.py, a mixin of this class) is sent to the ``main``
socket of each target rank, signed once, and completes when every target
answered or died. A rank's RESULT is held back
until all OUTPUT chunks it announced have arrived (they travel on the other
socket), so a cell shows all of a rank's output before its result.

Non-goals: the user-facing API (mesh.py), process handling (supervisor.py).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import signal as signal_mod
import threading
import time
from collections.abc import Callable
from typing import Any

from ..backends import BackendInfo
from ..config import LOOPBACK, MeshConfig
from ..errors import MonarchError, RankDied, RankErrors, RemoteError
from ..results import RankResults
from ..stacks import RankStacks
from ..wire import serialize
from ..wire.metricframes import decode as decode_metrics
from ..wire.protocol import Codec, Kind, Message, new_key
from ..wire.transport import CurveKeys, IOLoop
from .calls import Calls
from .inspector import Inspector
from .launchers import Launcher, LocalLauncher
from .metricstore import MetricsStore
from .output import CallOutput, decode_items
from .policy import (
    Died,
    Ready,
    RestartPolicy,
    Timer,
)
from .rankstate import (
    Event,
    PendingCall,
    RankInfo,
    RankState,
    _free_port,
    signal_name,
)
from .recovery import Recovery
from .supervisor import Supervisor

log = logging.getLogger(__name__)



class Controller(Calls, Inspector, Recovery):
    """Runs the I/O thread, the supervisor and the bookkeeping of one mesh."""

    def __init__(self, cfg: MeshConfig, backend: BackendInfo, world_size: int,
                 launcher: Launcher | None = None) -> None:
        self.cfg = cfg
        self.backend = backend
        self.world_size = world_size
        self.key = new_key()
        self.mesh_id = secrets.token_hex(4)
        self.codec = Codec(self.key, "controller", max_bytes=cfg.max_message_bytes)
        # Non-loopback: CurveZMQ with this mesh's keys (transport.CurveKeys).
        self.curve = CurveKeys.generate() if cfg.encrypted else None
        if cfg.bind not in LOOPBACK and not cfg.encrypted:
            log.warning("monarch_nb: INSECURE: encryption is off on non-loopback bind %r; "
                        "anyone on the network can read every message", cfg.bind)
        self.io = IOLoop(self.codec, self._on_message, bind=cfg.bind, on_tick=self._on_tick,
                         max_message_bytes=cfg.max_message_bytes, curve=self.curve)
        self.supervisor = Supervisor(
            world_size=world_size, backend=backend, controller_endpoint=self.io.endpoint,
            key=self.key, mesh_id=self.mesh_id, master_port=_free_port(),
            controller_timeout=cfg.controller_timeout,
            extra_env={**dict(cfg.extra_env), **(self.curve.rank_env() if self.curve else {})},
            max_message_bytes=cfg.max_message_bytes, launcher=launcher or LocalLauncher(),
        )
        self.ranks = [RankInfo(r) for r in range(world_size)]
        self.events: list[Event] = []
        self.metrics = MetricsStore(world_size)  # mnb.log series (metricstore.py)
        self.calls: dict[int, PendingCall] = {}
        self.interrupt_where: dict[int, dict[int, str]] = {}
        self._call_ids = itertools.count(1)
        self._by_ident: dict[bytes, RankInfo] = {}
        self._state_changed = threading.Condition()
        self.default_output: CallOutput | None = None  # for output outside calls
        self.policy = RestartPolicy(world_size, mode=cfg.respawn, budget=cfg.restart_budget,
                                    window=cfg.restart_window)
        self.generation = 0
        self.setup_cells: list[dict[str, Any]] = []  # --setup cells, replayed on respawn
        self.deferred: list[Callable[[], None]] = []  # calls waiting for respawning ranks
        self.awaiting_reform: dict[int, float] = {}  # survivor -> deadline to answer REFORM
        self.reform_probes: dict[int, float] = {}  # survivor -> when to ask where it is
        self.started = False
        self.stopped = False
        self.announce: Callable[[str], None] | None = None
        self.settled_at = time.monotonic()  # last start, death or respawn
        self._init_inspector()

    # -- life cycle -------------------------------------------------------------
    def start(self, progress: Callable[[list[RankInfo]], None] | None = None) -> None:
        """Spawn every rank (in parallel) and wait until all are READY."""
        self.io.start()
        spawned = threading.Event()

        def spawn_all() -> None:
            try:
                for info in self.ranks:
                    self._spawn(info)
            finally:
                spawned.set()

        self.io.call_soon(spawn_all)
        spawned.wait(30)
        deadline = time.monotonic() + self.cfg.start_timeout
        last_ready = -1
        with self._state_changed:
            while True:
                ready = sum(1 for r in self.ranks if r.state == RankState.READY)
                failed = [r for r in self.ranks if r.state == RankState.DEAD]
                if ready != last_ready and progress is not None:
                    progress(list(self.ranks))
                    last_ready = ready
                if failed:
                    raise self._start_failure(failed)
                if ready == self.world_size:
                    self.started = True
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    slow = [r.rank for r in self.ranks if r.state != RankState.READY]
                    raise MonarchError(
                        f"ranks {slow} were not ready within {self.cfg.start_timeout:g} s; "
                        "see their logs with %monarch logs RANK"
                    )
                self._state_changed.wait(min(left, 0.25))

    def _start_failure(self, failed: list[RankInfo]) -> MonarchError:
        info = failed[0]
        lines = self.supervisor.tail(info.rank, 15)
        why = info.start_error or f"exited with code {info.exitcode}"
        tail = "\n".join("    " + line for line in lines)
        return MonarchError(f"rank {info.rank} failed to start: {why}\n{tail}")

    def _spawn(self, info: RankInfo) -> None:
        self._by_ident.pop(info.main_id, None)  # the old incarnation's stragglers are ignored
        self._by_ident.pop(info.ctl_id, None)
        info.token = secrets.token_hex(8)
        info.silent_for = None
        info.exitcode = None
        info.health = {}
        proc = self.supervisor.spawn(info.rank, info.incarnation, info.identity)
        info.pid = proc.pid
        info.state = RankState.STARTING
        info.started_at = time.monotonic()
        # a new process owes no answer to a REFORM sent to the one it replaces
        # (probed anyway, it would be "stuck" in its first collective)
        self.awaiting_reform.pop(info.rank, None)
        self.reform_probes.pop(info.rank, None)
        info.last_heartbeat = info.started_at
        self._by_ident[info.main_id] = info
        self._by_ident[info.ctl_id] = info
        self._event(info, "started", f"pid {proc.pid}" + (", from a spare" if proc.from_spare else ""))
        if proc.pidfd is not None:
            self.io.watch_fd(proc.pidfd, lambda: self._on_exit(info.rank, proc))

    def stop(self, grace: float = 3.0) -> None:
        """Ask every rank to leave, kill what does not, stop the I/O thread."""
        if self.stopped:
            return
        self.stopped = True
        if self.io.thread.is_alive():
            done = threading.Event()

            def send_stop() -> None:
                frames = self.codec.sign(Kind.STOP)
                for info in self.ranks:
                    if info.state != RankState.DEAD:
                        self.io.send(info.ctl_id, frames)
                        self.io.send(info.main_id, frames)
                done.set()

            self.io.call_soon(send_stop)
            done.wait(2)
        self.supervisor.terminate_all(grace)
        self.io.call_soon(self._fail_all_calls)
        self.io.stop()
        for info in self.ranks:
            if info.state != RankState.DEAD:
                info.state = RankState.STOPPED
        self.supervisor.cleanup_logs()

    def _fail_all_calls(self) -> None:
        for call in list(self.calls.values()):
            for rank in list(call.remaining):
                call.errors[rank] = MonarchError(f"rank {rank}: the mesh was stopped during the call")
                call.remaining.discard(rank)
            self._maybe_finish(call)

    # -- I/O thread: messages -----------------------------------------------------------
    def _on_message(self, ident: bytes, msg: Message) -> None:
        info = self._by_ident.get(ident)
        if info is None:
            return  # an old incarnation's straggler
        info.last_heartbeat = time.monotonic()
        kind = msg.kind
        if kind is Kind.RESULT:
            self._on_result(info, msg)
        elif kind == Kind.OUTPUT:
            self._on_output(info, msg)
        elif kind == Kind.HEARTBEAT:
            info.health = msg.meta.get("h") or info.health
        elif kind == Kind.METRICS:
            self._on_metrics(info, msg)
        elif kind == Kind.INTERRUPTED:
            # Kept even after the call finished: the answer travels on the
            # control socket and may overtake or trail the RESULT.
            where = self.interrupt_where.get(msg.call)
            if where is not None:
                where[info.rank] = str(msg.meta.get("where", ""))
        elif kind == Kind.HELLO:
            info.host = str(msg.meta.get("host", ""))
        elif kind == Kind.READY:
            info.state = RankState.READY
            info.device = str(msg.meta.get("device", ""))
            info.ready_at = time.monotonic()
            self.settled_at = info.ready_at
            self._event(info, "ready", info.device)
            if self.started:  # a respawned rank
                self.policy.handle(Ready(info.rank, info.ready_at))
                self._replay_setup(info)
                self._reissue(info)
                self._announce(f"monarch_nb: rank {info.rank} is back (incarnation "
                               f"{info.incarnation}, generation {self.generation})")
                self._run_deferred()
            self._notify()
        elif kind == Kind.PROMPT:
            self._on_prompt(info, msg)
        elif kind == Kind.STACKS_REPLY:
            if not self._on_stacks_reply(info, msg) and info.rank in self.awaiting_reform:
                st = RankStacks(info.rank, "ok", list(msg.meta.get("threads") or []))
                if st.collective():  # stuck in the old group's collective
                    self._replace_stuck(info.rank)
        elif kind == Kind.REFORMED:
            self.awaiting_reform.pop(info.rank, None)
            error = None if msg.meta.get("joining") else msg.meta.get("error")
            if error:
                self._event(info, "reform_failed", str(error))
                self._announce(f"monarch_nb: rank {info.rank} could not join generation "
                               f"{msg.meta.get('generation')}: {error}")
        elif kind == Kind.FAILED_START:
            info.start_error = str(msg.meta.get("error", ""))

    def _on_output(self, info: RankInfo, msg: Message) -> None:
        call = self.calls.get(msg.call)
        items = decode_items(msg.payload[0]) if msg.payload else []
        target = call.output if call is not None else self.default_output
        if call is not None:
            call.progress_at = time.monotonic()
        if target is not None:
            for stream, text in items:
                target.feed(info.rank, str(stream), str(text))
        self._count_chunk(call, info, msg)

    def _on_metrics(self, info: RankInfo, msg: Message) -> None:
        call = self.calls.get(msg.call)
        if call is not None:
            call.progress_at = time.monotonic()  # a metric is progress (hang watchdog)
        if msg.payload:
            self.metrics.add(info.rank, info.incarnation, decode_metrics(msg.payload[0]))
        self._count_chunk(call, info, msg)

    def _count_chunk(self, call: PendingCall | None, info: RankInfo, msg: Message) -> None:
        """OUTPUT chunks and METRICS batches sent on the control socket
        during a call are counted; the RESULT waits for all of them."""
        if call is not None and int(msg.meta.get("n", -1)) >= 0:
            call.chunks_seen[info.rank] = call.chunks_seen.get(info.rank, 0) + 1
            held = call.held.get(info.rank)
            if held is not None and call.chunks_seen[info.rank] >= _announced(held):
                del call.held[info.rank]
                self._complete_rank(call, info, held)

    def _on_result(self, info: RankInfo, msg: Message) -> None:
        call = self.calls.get(msg.call)
        if call is None or info.rank not in call.remaining:
            return
        if not msg.meta:  # a plain success: no output, no chunks to wait for, no error
            payload = msg.payload
            try:
                call.results[info.rank] = serialize.loads(payload) if payload else None
            except serialize.SerializationError as exc:
                call.errors[info.rank] = _unloadable(info.rank, exc)
            self._rank_done(call, info)
            return
        if call.chunks_seen.get(info.rank, 0) < _announced(msg):
            call.held[info.rank] = msg  # output chunks still on their way
            return
        self._complete_rank(call, info, msg)

    def _complete_rank(self, call: PendingCall, info: RankInfo, msg: Message) -> None:
        payload, meta = msg.payload, msg.meta
        if meta.get("o") and payload:
            for stream, text in decode_items(payload[0]):
                call.output.feed(info.rank, stream, text)
            payload = payload[1:]
        if meta.get("ok", True):
            try:
                call.results[info.rank] = serialize.loads(payload) if payload else None
            except serialize.SerializationError as exc:
                call.errors[info.rank] = _unloadable(info.rank, exc)
        else:
            err = msg.meta.get("error") or {}
            call.errors[info.rank] = RemoteError(
                info.rank, str(err.get("type", "Exception")), str(err.get("msg", "")),
                str(err.get("tb", "")))
        self._rank_done(call, info)

    def _rank_done(self, call: PendingCall, info: RankInfo) -> None:
        call.remaining.discard(info.rank)
        call.progress_at = time.monotonic()
        if self.prompts or self.debug_focus:
            self._release_focus(call.call_id, info.rank)
        calls = self.calls
        if info.state == RankState.BUSY and (len(calls) == 1 or not any(
            info.rank in c.remaining for c in calls.values()
        )):
            info.state = RankState.READY
        if not call.remaining and not call.held:
            self._maybe_finish(call)

    def _maybe_finish(self, call: PendingCall) -> None:
        if call.remaining or call.held:
            return
        self.calls.pop(call.call_id, None)
        if self.prompts or self.debug_focus:
            self._release_focus(call.call_id, -1)  # forget its debugger prompts
        call.output.flush(force=True)
        future = call.future
        if future.done():  # cancelled by the user
            return
        if call.setup is not None and not call.errors:
            self.setup_cells.append(call.setup)
        if call.errors:
            self._classify_membership(call)
            future.set_exception(RankErrors(dict(call.errors), dict(call.results), len(call.ranks)))
        else:
            future.set_result(RankResults(call.results))

    # -- I/O thread: deaths and ticks --------------------------------------------------
    def _on_exit(self, rank: int, proc: Any = None) -> None:
        info = self.ranks[rank]
        code = self.supervisor.reap(rank, proc)
        if proc is not None and proc is not self.supervisor.procs.get(rank):
            return  # an incarnation that was already replaced
        if code is None or info.state in (RankState.DEAD, RankState.FAILED, RankState.STOPPED):
            return
        info.exitcode = code
        self.settled_at = time.monotonic()
        was_starting = info.state == RankState.STARTING and not self.started
        info.state = RankState.DEAD
        detail = self.describe_exit(code)
        if info.silent_for is not None:
            detail = f"no heartbeat for {info.silent_for:.1f} s, killed"
        self._event(info, "failed_start" if was_starting else "died", detail)
        died = self._died(info)
        for call in list(self.calls.values()):
            if rank in call.remaining:
                self._release_focus(call.call_id, rank)
                call.held.pop(rank, None)
                call.chunks_seen.pop(rank, None)
                if call.elastic and not self.stopped:
                    call.reissue.add(rank)  # runs again on the new process
                    continue
                call.remaining.discard(rank)
                call.errors[rank] = died
                self._maybe_finish(call)
        if not self.stopped and not was_starting:
            self._announce(f"monarch_nb: {str(died).splitlines()[0]}")
            cause = signal_name(code) or f"exit code {code}"
            if info.silent_for is not None:
                cause = "missed heartbeats"
            self._apply(self.policy.handle(Died(rank, time.monotonic(), cause, info.incarnation)))
            self._keep_spare(time.monotonic())  # a backoff started: use the wait
        self._notify()

    def _announce(self, line: str) -> None:
        # once per cell: a re-issued elastic call shares its cell's output
        for output in {id(c.output): c.output for c in self.calls.values()}.values():
            output.note(line)
        if self.announce is not None:
            self.announce(line)

    def _died(self, info: RankInfo) -> RankDied:
        return RankDied(info.rank, info.exitcode if (info.exitcode or 0) >= 0 else None,
                        signal_name(info.exitcode), tuple(self.supervisor.tail(info.rank, 8)),
                        info.incarnation, info.silent_for)

    def _on_tick(self, now: float) -> float:
        if self.stopped:
            return 0.5
        for info in self.ranks:
            proc = self.supervisor.procs.get(info.rank)
            if proc is None or info.state in (RankState.DEAD, RankState.FAILED, RankState.STOPPED):
                continue
            if proc.pidfd is None and proc.popen.poll() is not None:  # no pidfd: poll
                self._on_exit(info.rank)
                continue
            silent = now - info.last_heartbeat
            if (info.state not in (RankState.STARTING, RankState.RESPAWNING)
                    and info.silent_for is None
                    and silent > self.cfg.heartbeat_timeout):
                # Frozen: its control thread would answer even if user code
                # were stuck. Kill it so its exit is reported like any death
                # (and so survivors blocked in a collective with it get
                # an error instead of waiting for the group timeout).
                info.silent_for = silent
                self.supervisor.signal(info.rank, signal_mod.SIGKILL)
        self._inspector_tick(now)
        self._keep_spare(now)
        deadline = self.policy.next_deadline()
        if deadline is not None and deadline <= now:
            self._apply(self.policy.handle(Timer(now)))
        self._check_reforms(now)
        if now - getattr(self, "_last_ping", 0.0) >= self.cfg.heartbeat_interval:
            self._last_ping = now
            frames = self.codec.sign(Kind.PING)
            for info in self.ranks:
                if info.state in (RankState.READY, RankState.BUSY, RankState.STARTING,
                                  RankState.RESPAWNING):
                    self.io.send(info.ctl_id, frames)
        pending = False
        for call in self.calls.values():
            call.output.flush(now=now)
            pending = pending or call.output.pending
        if self.default_output is not None:
            self.default_output.flush(now=now)
            pending = pending or self.default_output.pending
        return 0.03 if pending else min(0.25, self.cfg.heartbeat_interval)

    # -- helpers ---------------------------------------------------------------------------
    def _event(self, info: RankInfo, kind: str, detail: str = "") -> None:
        self.events.append(Event(time.time(), info.rank, info.incarnation, kind, detail))

    def _notify(self) -> None:
        with self._state_changed:
            self._state_changed.notify_all()

    @staticmethod
    def describe_exit(code: int | None) -> str:
        if code is None:
            return "still running"
        name = signal_name(code)
        return f"killed by {name}" if name else f"exited with code {code}"


def _unloadable(rank: int, exc: Exception) -> RemoteError:
    return RemoteError(rank, "SerializationError",
                       f"the result arrived but cannot be rebuilt in the kernel: {exc}", "")


def _announced(result: Message) -> int:
    """Control-socket messages a RESULT says preceded it: output chunks
    (``n_out``) and mnb.log batches (``n_m``)."""
    return int(result.meta.get("n_out", 0)) + int(result.meta.get("n_m", 0))
