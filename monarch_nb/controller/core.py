"""The controller core: builds a mesh's parts, routes the ranks' messages to
them, and runs the mesh's life cycle (start, tick, stop).

Lives in the notebook kernel (or the launching process). Every handler runs
on the thread that leads the I/O loop (message handlers, pidfd callbacks,
ticks), so the parts' state needs no locks; other threads go through
``io.call_soon`` or take the lead themselves (``IOLoop.leadership``).

The parts, each owning its state (DESIGN.md, architecture rule 5)::

    RankTable   ranktable.py   one record per rank; states change only by move()
    CallTable   calltable.py   calls in flight: the one place a call's fate changes
    Assembler   assembler.py   a rank's RESULT, OUTPUT chunks and METRICS batches, its
                               pieces, shared memory and GPU shares: the call's answer
    Caller      caller.py       sends calls, waits for them, interrupts them
    Recovery    recovery.py    deaths, respawns, re-formations (the policy's hands)
    Inspector   inspector.py   stacks, hang watchdog, debugger relay
    RankDebugger rankdebug.py  JupyterLab's debugger on the ranks: selection,
                               breakpoints, stops, requests to the ranks' debuggers
    Supervisor  supervisor.py  rank processes, forked on the spawner thread
    DataPlane   dataplane.py   shared-memory segments of big payloads, GPU IPC shares
                               (local ranks)
    MetricsStore metricstore.py every rank's mnb.log series

The core only routes: each message kind to the part that handles it, and
the call table's hooks (a rank done with a call, a call finished) to the
rank table, the inspector, the data plane and the call's output.

Non-goals: the user-facing API (mesh.py), process handling (supervisor.py),
making a rank's answer (assembler.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal as signal_mod
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..backends import BackendInfo
from ..config import LOOPBACK, MeshConfig
from ..errors import MonarchError, UsageError
from ..futures import MeshFuture
from ..procs import keptfiles, liveness, logdirs
from ..procs.agents import AgentLauncher, HomeLauncher, HostAgent, KeptDoor
from ..procs.launchers import Launcher, LocalLauncher
from ..procs.supervisor import Supervisor
from ..wire import gpuipc
from ..wire.endpoints import CurveKeys
from ..wire.metas import meta_of
from ..wire.protocol import Codec, Kind, Message, new_key
from ..wire.transport import IOLoop
from .calls.assembler import Assembler
from .calls.caller import Caller
from .calls.calltable import CallTable, PendingCall
from .calls.dataplane import DataPlane
from .calls.output import CallOutput
from .inspector import Inspector
from .keep import HELLO_AGAIN_S, HELLO_WAIT_S, Keep, new_epoch
from .life.events import Event, EventKind
from .life.policy import RestartPolicy
from .life.rankstates import GONE, LIVE, ON_ITS_WAY, RankState
from .life.ranktable import RankInfo, RankTable, describe_exit, free_port
from .life.recovery import Recovery
from .metricstore import MetricsStore
from .rankdebug import RankDebugger

log = logging.getLogger(__name__)

__all__ = ["Controller", "Event", "EventKind", "RankInfo", "RankState"]


class Controller:
    """Builds and runs the parts of one mesh (see the module docstring)."""

    def __init__(self, cfg: MeshConfig, backend: BackendInfo, world_size: int,
                 launcher: Launcher | None = None, *,
                 record: keptfiles.Record | None = None, force: bool = False) -> None:
        """``record``: attach to that kept mesh (:meth:`attach`), taking it
        over from another controller with ``force``."""
        self.cfg = cfg
        self.backend = backend
        self.world_size = world_size
        self.key = bytes.fromhex(record.key) if record is not None else new_key()
        self.mesh_id = record.mesh_id if record is not None else secrets.token_hex(4)
        self.record = record
        # a kept mesh (controller/keep.py): this controller's epoch, its own signer
        epoch = new_epoch() if cfg.kept else None
        self.codec = Codec(self.key, "controller" if epoch is None else f"controller.{epoch}",
                           max_bytes=cfg.max_message_bytes)
        # Non-loopback: CurveZMQ with this mesh's keys (wire/endpoints.py).
        self.curve = CurveKeys.generate() if cfg.encrypted else None
        if record is not None and record.curve:  # a kept mesh's: its ranks and agents hold them
            self.curve = CurveKeys(**{k: str(v).encode() for k, v in record.curve.items()})
        if cfg.bind not in LOOPBACK and not cfg.encrypted:
            log.warning("monarch_nb: INSECURE: encryption is off on non-loopback bind %r; "
                        "anyone on the network can read every message", cfg.bind)
        self.io = IOLoop(self.codec, self._on_message, bind=cfg.bind, on_tick=self._on_tick,
                         max_message_bytes=cfg.max_message_bytes, curve=self.curve,
                         on_fold=self._on_fold, on_beats=self._on_beats,
                         port=record.port if record is not None else None)
        if cfg.kept and (launcher is None or isinstance(launcher, LocalLauncher)):
            # the ranks belong to this machine's agent, which outlives us
            assert cfg.name is not None and cfg.keep_alive is not None
            launcher = AgentLauncher(
                HomeLauncher(cfg.name, cfg.keep_alive), [], cfg.host_timeout, cfg.spare,
                cfg.controller_timeout,
                door=KeptDoor(cfg.name, self.key, start=record is None, force=force,
                              on_taken=self._taken, log_hint=keptfiles.log_dir(cfg.name),
                              local=True, tail=["--keep-alive", f"{cfg.keep_alive:g}",
                                                "--controller-timeout",
                                                f"{cfg.controller_timeout:g}"]))
        # A kept mesh across hosts: this machine's agent keeps no rank but holds
        # the mesh (who is attached, the lease, the state); each host's agent
        # is reached through its door and outlives us too (procs/keptagent.py).
        self.home_agent: HostAgent | None = None
        self._home_door: KeptDoor | None = None
        if cfg.kept and isinstance(launcher, AgentLauncher) and not isinstance(
                launcher.inner, HomeLauncher):
            assert cfg.name is not None and cfg.keep_alive is not None
            launcher.inner.kept = (cfg.name, cfg.keep_alive)
            # the home decided who holds the mesh: the hosts' agents follow it
            launcher.door = KeptDoor(cfg.name, self.key, start=record is None, force=True,
                                     log_hint=f"{keptfiles.log_dir(cfg.name)} on each host")
            self._home_door = KeptDoor(
                cfg.name, self.key, start=record is None, force=force, on_taken=self._taken,
                log_hint=keptfiles.log_dir(cfg.name), local=True,
                tail=["--keep-alive", f"{cfg.keep_alive:g}", "--controller-timeout",
                      f"{cfg.controller_timeout:g}"])
        logdirs.sweep()  # log directories left by controllers that were killed
        self.supervisor = Supervisor(
            world_size=world_size, backend=backend, controller_endpoint=self.io.endpoint,
            key=self.key, mesh_id=self.mesh_id, master_port=free_port(),
            # a kept mesh's rank outlives us: its agent ends it with the lease
            controller_timeout=(cfg.controller_timeout if cfg.keep_alive is None
                                else cfg.keep_alive + 60.0),
            kept_epoch=epoch,
            extra_env={**dict(cfg.extra_env), **(self.curve.rank_env() if self.curve else {})},
            max_message_bytes=cfg.max_message_bytes, launcher=launcher or LocalLauncher(),
            restart_budget=cfg.restart_budget,
            shm_threshold=cfg.shm_threshold,
            local_links=cfg.local_link,
            fork=cfg.fork, preload=cfg.preload,
        )
        # torch's import in the warm process overlaps the rest of the start
        self.supervisor.start_warm()
        launcher = self.supervisor.launcher
        if getattr(launcher, "relays", False) is True and cfg.relay:
            # a launcher whose ranks' main channels go through their host's
            # agent (procs/agents.py): one message per host (wire/hostrelay.py)
            launcher.route = self.io.attach_relay  # type: ignore[attr-defined]
        if isinstance(launcher, AgentLauncher):
            # each host's agent forks its ranks from its own warm process, as
            # the supervisor forks ours (procs/hostagent.py); every host's
            # starts now (after the route: its agent is made here)
            launcher.fork, launcher.preload = cfg.fork, cfg.preload
            sup = self.supervisor
            launcher.start_warm(world_size, sup.log_dir, lambda r: sup.env_for(r, 0, ""))
        # CUDA tensors by IPC handle (opt-in; wire/gpuipc.py): local ranks on
        # GPUs only. Rank r's GPU is this process's cuda:<its local rank>
        # (backends.pin_env gives it the local_rank-th of our visible GPUs).
        ipc_on, self.gpu_ipc_notice = gpuipc.effective(cfg.gpu_ipc, backend.name,
                                                       self.supervisor.launcher.remote)
        self.supervisor.gpu_ipc = ipc_on
        self.gpu_ipc_devices: dict[int, int] | None = None
        if ipc_on:
            place = self.supervisor.launcher.placement
            self.gpu_ipc_devices = {r: place(r, world_size).local_rank for r in range(world_size)}
        # Shared memory only with ranks on this host (the supervisor gives
        # remote ranks no threshold either, so they never send a descriptor).
        self.dataplane = DataPlane(self.mesh_id,
                                   None if self.supervisor.launcher.remote else cfg.shm_threshold,
                                   cfg.max_message_bytes, gpu_ipc=ipc_on)
        self.ranks = RankTable(world_size)
        # look_after: always below the timeout (a silence past it is looked at)
        self.liveness = liveness.Liveness(
            cfg.heartbeat_timeout,
            look_after=min(liveness.LOOK_AFTER_S, cfg.heartbeat_timeout / 2))
        self.calls = CallTable(first_id=1 if epoch is None else epoch << 32)
        self.metrics = MetricsStore(world_size)  # mnb.log series (metricstore.py)
        self.default_output: CallOutput | None = None  # for output outside calls
        self.announce: Callable[[str], None] | None = None  # also print notes here
        self.stopped = False
        self._state_changed = threading.Condition()
        self._last_ping = 0.0
        policy = RestartPolicy(self.ranks, mode=cfg.respawn, budget=cfg.restart_budget,
                               window=cfg.restart_window,
                               no_restarts=cfg.no_restarts_hint or RestartPolicy.no_restarts,
                               min_ranks=cfg.min_ranks, restart_group=cfg.restart_group)
        self.recovery = Recovery(cfg, self.ranks, self.calls, self.supervisor, self.io,
                                 self.codec, policy, announce=self._announce,
                                 dispatch=lambda call: self.caller.dispatch(call),
                                 default_output=lambda: self.default_output,
                                 notify=self._notify)
        self.debugging = RankDebugger(self.ranks, self.calls, self.io, self.codec, self.supervisor)
        self.inspector = Inspector(self.ranks, self.calls, self.io, self.codec, self._notify,
                                   recovering=self._recovering, supervisor=self.supervisor,
                                   in_debugger=self.debugging.holds)
        self.caller = Caller(cfg, self.ranks, self.calls, self.io, self.codec, self.recovery,
                             self.inspector, self.dataplane)
        self.assembler = Assembler(self.calls, self.dataplane, self.metrics, self.io.send,
                                   self.codec, self._pid_of,
                                   default_output=lambda: self.default_output)
        self.keep = (Keep(cfg.name, epoch, self.calls, self.ranks, self.caller.interrupt, policy)
                     if cfg.name is not None and epoch is not None else None)
        self._on_result = self.assembler.on_result  # bound once: every call's path
        self.calls.on_ranks_done = self._ranks_done
        self.calls.on_finished = self._call_finished

    # -- what the API reads ------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self.recovery.started

    @property
    def generation(self) -> int:
        return self.recovery.generation

    @property
    def events(self) -> list[Event]:
        return self.ranks.events

    @property
    def interrupt_where(self) -> dict[int, dict[int, str]]:
        return self.caller.interrupt_where

    @property
    def prompts(self) -> Any:
        return self.inspector.prompts

    @property
    def ask(self) -> Callable[[str], str] | None:
        """How a debugger prompt is asked (default: builtins.input at the time)."""
        return self.inspector.ask

    @ask.setter
    def ask(self, fn: Callable[[str], str] | None) -> None:
        self.inspector.ask = fn

    # the caller's side, for the API
    def submit(self, *args: Any, **kwargs: Any) -> MeshFuture:
        return self.caller.submit(*args, **kwargs)

    def call(self, *args: Any, **kwargs: Any) -> MeshFuture:
        return self.caller.call(*args, **kwargs)

    def wait(self, future: MeshFuture, timeout: float | None = None) -> bool:
        return self.caller.wait(future, timeout)

    def pump(self, seconds: float) -> None:
        self.caller.pump(seconds)

    def interrupt(self, call_id: int) -> None:
        self.caller.interrupt(call_id)

    def restart(self, ranks: tuple[int, ...]) -> None:
        self.recovery.restart(ranks)

    def hosts_added(self) -> None:
        """Hosts were given (mesh.add_hosts): lost ranks start there (thread-safe)."""
        self.recovery.hosts_added()

    def kill(self, rank: int, sig: int) -> None:
        """Send ``sig`` to ``rank`` (thread-safe; fault injection): KILL or
        TERM make it DYING before the next call is sent (recovery.py)."""
        self.io.call_soon(lambda: self.recovery.kill(rank, sig))

    def request_stacks_blocking(self, *args: Any, **kwargs: Any) -> Any:
        return self.inspector.request_stacks_blocking(*args, **kwargs)

    describe_exit = staticmethod(describe_exit)

    # -- life cycle -------------------------------------------------------------
    def start(self, progress: Callable[[list[RankInfo]], None] | None = None) -> None:
        """Spawn every rank (in parallel) and wait until all are READY."""
        self._open_home()
        self.io.start()
        spawned = threading.Event()
        spawn_errors: list[BaseException] = []

        def spawn_all() -> None:
            try:
                for info in self.ranks:
                    self.recovery.start_process(info.rank, 0)
            except Exception as exc:  # said here, not after start_timeout
                spawn_errors.append(exc)
            finally:
                spawned.set()

        self.io.call_soon(spawn_all)
        spawned.wait(30)
        if spawn_errors:
            raise spawn_errors[0]
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
                    self.recovery.started = True
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

    def stop(self, grace: float = 3.0) -> None:
        """End every call ("the mesh was stopped"), ask every rank to leave,
        kill what does not, stop the I/O thread."""
        if self.stopped:
            return
        self.stopped = True
        self.recovery.stopped = True
        self.io.give_back()  # a Ctrl-C that left the sockets with this thread
        if self.io.thread.is_alive():
            done = threading.Event()

            def send_stop() -> None:
                try:
                    # first: a rank that exits on STOP must not read as a death
                    self.calls.stop("the mesh was stopped while this call ran; "
                                    "start a new one with %monarch start or Mesh.start()")
                    frames = self.codec.sign(Kind.STOP)
                    for info in self.ranks:
                        if info.state not in GONE:
                            self.io.send(info.ctl_id, frames)
                            self.io.send(info.main_id, frames)
                finally:
                    done.set()

            self.io.call_soon(send_stop)
            done.wait(2)
        else:
            self.calls.stop("the mesh was stopped")
        self.supervisor.terminate_all(grace)
        if self.home_agent is not None:  # a kept mesh across hosts: the home goes too
            self.home_agent.close(grace)
            self.home_agent.wait_closed(grace + 5.0)
        self.io.call_soon(lambda: self.calls.stop("the mesh was stopped"))
        self.io.stop()
        for info in self.ranks:
            if info.state != RankState.STOPPED:
                self.ranks.move(info.rank, RankState.STOPPED)
        self.ranks.record(-1, EventKind.STOPPED)
        self.dataplane.close_all()
        self.supervisor.cleanup_logs()

    # -- I/O thread: messages -----------------------------------------------------------
    def _on_message(self, ident: bytes, msg: Message) -> None:
        info = self.ranks.lookup(ident)
        if info is None:
            return  # an old incarnation's straggler
        info.last_heartbeat = time.monotonic()
        kind = msg.kind
        if kind is Kind.RESULT:
            if not info.answered:  # (once per process: the call path stays as it was)
                self._answered(info, msg.call)
            self._on_result(info, msg)
        elif kind == Kind.OUTPUT:
            self.assembler.on_output(info, msg)
        elif kind == Kind.HEARTBEAT:
            beat = meta_of(msg, Kind.HEARTBEAT)
            info.health = beat.get("h") or info.health
            info.elastic_loop = bool(beat.get("el"))
        elif kind == Kind.METRICS:
            self.assembler.on_metrics(info, msg)
        elif kind == Kind.INTERRUPTED:
            # Kept even after the call finished: the answer travels on the
            # control socket and may overtake or trail the RESULT.
            where = self.caller.interrupt_where.get(msg.call)
            if where is not None:
                where[info.rank] = str(meta_of(msg, Kind.INTERRUPTED).get("where", ""))
        elif kind == Kind.HELLO:
            hello = meta_of(msg, Kind.HELLO)
            info.host = str(hello.get("host", ""))
            if self.keep is not None and "kept" in hello:  # a kept rank to us, attaching
                self.keep.on_hello(info.rank, dict(hello))
        elif kind == Kind.READY:
            if info.state in ON_ITS_WAY:
                self.recovery.on_ready(info, msg)
                self._notify()
                self.debugging.on_ready(info)
        elif kind == Kind.DEBUGGER_EVENT:
            self.debugging.on_event(info, msg)
        elif kind == Kind.PROMPT:
            self.inspector.on_prompt(info, msg)
        elif kind == Kind.STACKS_REPLY:
            if not self.inspector.on_stacks_reply(info, msg):
                self.recovery.on_probe(info, list(meta_of(msg, Kind.STACKS_REPLY).get("threads") or []))
        elif kind == Kind.REFORMED:
            self.recovery.on_reformed(info, msg)
        elif kind == Kind.FAILED_START:
            info.start_error = str(meta_of(msg, Kind.FAILED_START).get("error", ""))

    def _on_fold(self, idents: list[bytes], msg: Message) -> None:
        """The same plain result of several ranks of one host (wire/fold.py;
        the transport checked they are its agent's)."""
        infos = self.ranks.lookup_many(idents)
        now = time.monotonic()
        for info in infos:
            info.last_heartbeat = now
            if not info.answered:
                self._answered(info, msg.call)
        self.assembler.on_folded(infos, msg)

    def _on_beats(self, beats: dict[bytes, dict[str, Any]]) -> None:
        """Heartbeats of several ranks of one host (wire/fold.py; the
        transport checked they are its agent's), as each one's HEARTBEAT."""
        lookup, now = self.ranks.lookup, time.monotonic()
        for ident, meta in beats.items():
            info = lookup(ident)
            if info is not None:
                info.last_heartbeat = now
                info.health = meta.get("h") or info.health
                info.elastic_loop = bool(meta.get("el"))

    def _answered(self, info: RankInfo, call_id: int) -> None:
        """``info``'s process answered a call: working, unless the call was a
        replayed --setup cell (a process that dies in the user's call after
        each replay is still a crash loop: the policy's backoff)."""
        call = self.calls.get(call_id)
        info.answered = call is None or not call.internal

    # -- the call table's hooks ------------------------------------------------------
    def _ranks_done(self, call: PendingCall, ranks: Sequence[int]) -> None:
        inspector = self.inspector
        if inspector.prompts or inspector.debug_focus:
            for rank in ranks:
                inspector.release_focus(call.call_id, rank)
        self._idle_again(ranks, others=len(self.calls) > 1)  # (the call is still in the table)

    def _call_finished(self, call: PendingCall) -> None:
        self.dataplane.release(call.call_id)  # every rank answered: they mapped it
        inspector = self.inspector
        if inspector.prompts or inspector.debug_focus:
            inspector.release_focus(call.call_id, -1)  # forget its debugger prompts
        call.output.flush(force=True, ranks=call.ranks)
        inspector.call_over(call)  # its dead are the ones the analysis shows now
        if call.errors and self.debugging.active:
            self.debugging.call_finished(call)  # post-mortems, deaths: JupyterLab's panel
        self._idle_again(call.ranks, others=len(self.calls) > 0)  # (it has left the table)

    def _idle_again(self, ranks: Sequence[int], others: bool) -> None:
        """``ranks`` answered: the BUSY ones are READY again, unless another
        call waits for them (``others``: there is another call to ask)."""
        if others:
            busy = self.calls.busy
            ranks = [rank for rank in ranks if not busy(rank)]
        self.ranks.move_many(ranks, RankState.READY, only_from=RankState.BUSY)

    # -- I/O thread: ticks ---------------------------------------------------------------
    def _on_tick(self, now: float) -> float:
        if self.stopped:
            return 0.5
        for info in self.ranks:
            proc = self.supervisor.procs.get(info.rank)
            if proc is None or info.state in GONE:
                continue
            if proc.pidfd is None and proc.popen.poll() is not None:  # no pidfd: poll
                self.recovery.on_exit(info.rank)
                self._notify()
                continue
            if info.state in LIVE and info.silent_for is None:
                self._judge_liveness(info, proc.pid, now)
        self.inspector.tick(now)
        self.debugging.tick(now)
        self.recovery.tick(now)
        if now - self._last_ping >= self.cfg.heartbeat_interval:
            self._ping(now)
        pending = False
        for call in self.calls:
            call.output.flush(now=now)
            pending = pending or call.output.pending
        if self.default_output is not None:
            self.default_output.flush(now=now)
            pending = pending or self.default_output.pending
        return 0.03 if pending else min(0.25, self.cfg.heartbeat_interval)

    def _ping(self, now: float) -> None:
        self._last_ping = now
        keep = self.keep
        # one message per host behind agents (the same signed frames to each)
        self.io.send_many([info.ctl_id for info in self.ranks
                           if info.state in LIVE or info.state in ON_ITS_WAY],
                          self.codec.sign(Kind.PING) if keep is None else
                          self.codec.sign(Kind.PING, meta=keep.ping_meta()))
        if self.home_agent is not None:  # its lease counts our pings (the hosts' too)
            self.home_agent.send("ping")
        if keep is not None:
            state = keep.state_due(now)
            home = self._home()
            if state is not None and home is not None:
                home.send("keep", state=self._with_nodes(state))

    def _judge_liveness(self, info: RankInfo, pid: int, now: float) -> None:
        """Kill a frozen rank so its exit is reported like any death (and so
        survivors blocked in a collective with it get an error instead of
        waiting for the group timeout); note one that is only busy holding
        the GIL (liveness.py)."""
        silent = now - info.last_heartbeat
        if silent > self.liveness.look_after and self.supervisor.host_silent(info.rank):
            return  # its whole host is silent: the host timeout decides (agents.py)
        state = None
        if self.liveness.wants_state(info.rank, silent):
            # a local rank's /proc, a remote one's as its host agent last saw it
            state = self.supervisor.process_state(info.rank)
        verdict = self.liveness.judge(info.rank, silent, state, now)
        if verdict is liveness.Verdict.FROZEN:
            info.silent_for = silent
            info.frozen = "stopped by a signal" if state == "T" else ""
            self.supervisor.signal(info.rank, signal_mod.SIGKILL)
        elif verdict is liveness.Verdict.BUSY and not info.busy_silent:
            info.busy_silent = True
            self.ranks.record(info.rank, EventKind.BUSY_SILENT,
                              f"no heartbeat for {silent:.1f} s, but running: busy holding "
                              "the GIL or in native code (not killed)")
        elif verdict is liveness.Verdict.ALIVE and info.busy_silent:
            info.busy_silent = False

    # -- a kept mesh (controller/keep.py) -----------------------------------------------------
    @classmethod
    def attach(cls, name: str, force: bool = False,
               launcher: AgentLauncher | None = None) -> Controller:
        """A new controller for kept mesh ``name``: its ranks, its calls in
        flight, its state (see :meth:`resume`). ``launcher``: the hosts'
        agents of a mesh started with a Launcher object (its record names
        no launcher to rebuild): the same kind, over the same hosts
        (benchmarks/simkept.py attaches to simulated hosts this way)."""
        record = keptfiles.read_record(name)
        status = keptfiles.read_status(name)
        if not keptfiles.agent_alive(status):
            keptfiles.remove(name)
            raise UsageError(f"kept mesh {name!r} is gone: nobody attached within its "
                             "keep_alive, or it was stopped (its logs stay in "
                             f"{keptfiles.log_dir(name)}); start a new one")
        cfg = MeshConfig.from_dict(record.config)
        backend = BackendInfo(**{**record.backend,
                                 "devices": tuple(record.backend.get("devices", ()))})
        hosts: Launcher | None = launcher
        if hosts is None and cfg.launcher != "local":  # across hosts: the same hosts' agents
            from ..procs.agents import from_config

            hosts, _ = from_config(cfg, record.world_size)
        ctl = cls(cfg, backend, record.world_size, hosts, record=record, force=force)
        try:
            ctl.resume()
        except BaseException:
            ctl._let_go()
            raise
        return ctl

    def resume(self) -> None:
        """Take over the kept mesh's ranks where they are: same processes,
        same group; supervision resumes at once, then the calls they run or
        kept a result of become ours (Keep.adopt)."""
        keep, launcher = self.keep, self.supervisor.launcher
        assert keep is not None and isinstance(launcher, AgentLauncher)
        log_dir = self.supervisor.log_dir
        if self._home_door is not None:  # across hosts: the home first (it may refuse us)
            self._open_home()
            assert self.home_agent is not None
            state = self.home_agent.attached.get("state") or {}
            nodes = state.get("nodes")
            if isinstance(nodes, list) and len(nodes) == len(launcher.inner.nodes):
                launcher.inner.nodes[:] = [str(n) for n in nodes]  # spare hosts taken meanwhile
            agents = launcher.open_all(launcher.hosts(), log_dir)
        else:
            agents = [self.supervisor.spawner.call(launcher.open, "localhost", log_dir)]
            state = agents[0].attached.get("state") or {}
        for agent in agents:  # routed before the relays reconnect: their first batch is ours
            if agent.route is not None and agent.relay_id:
                for child in agent.attached.get("children") or []:
                    for channel in ("main", "ctl"):
                        agent.route(f"{child['ident']}.{channel}".encode(),
                                    agent.relay_id.encode())
        self.io.bind_kept()  # admitted: the port is ours now
        # no tick's PING before take() below: until adopted, the table's
        # identities are nobody's (at 1,024 ranks that PING cost 40-120 ms)
        self._last_ping = time.monotonic()
        self.io.start()
        keep.restore(state)
        # the group's port: new processes join through a re-formation anyway
        self.supervisor.reform(self.ranks.generation, free_port())
        children = {int(c["rank"]): (agent, c) for agent in agents
                    for c in agent.attached.get("children") or []
                    if 0 <= int(c["rank"]) < self.world_size}
        self.recovery.started = True  # a death from now on is a death, not a failed start
        done = threading.Event()

        def take() -> None:
            try:
                for rank in range(self.world_size):
                    found = children.get(rank)
                    if found is None:  # no agent runs it (its host lost): as any death
                        self.recovery.start_process(rank, self.ranks[rank].incarnation)
                        continue
                    self._adopt_process(*found)
                self._ping(time.monotonic())  # a new epoch: the ranks say HELLO now
            finally:
                done.set()

        self.io.call_soon(take)
        done.wait(30)
        # the ranks' sockets reconnect to our port within ~0.1 s: ping until
        # every live rank said HELLO (a ping before its socket is back is lost)
        # (and until their main sockets are back too: a call sent before is lost)
        deadline = time.monotonic() + HELLO_WAIT_S
        # ranks whose main socket is not back yet (a relayed rank's comes back
        # with its agent's connection, which its HELLO came through)
        unseen = set() if launcher.relays and self.cfg.relay else set(keep.expect)
        probe = self.codec.sign(Kind.PING)  # (a rank's main loop lets a PING pass)

        looked = threading.Event()

        def look() -> None:
            try:
                gone = set(self.io.unreachable([self.ranks[r].main_id for r in unseen], probe))
                unseen.intersection_update([r for r in unseen
                                            if self.ranks[r].main_id in gone])
                unheard = keep.unheard()
                if unheard:  # asked again, they alone (the others said HELLO already)
                    self.io.send_many([self.ranks[r].ctl_id for r in unheard],
                                      self.codec.sign(Kind.PING, meta=keep.hello_meta()))
            finally:
                looked.set()

        while True:
            # the epoch's PING (or the last ask) has had its answers' time
            # first: asking at once asked every rank twice
            missing = keep.wait_hellos(HELLO_AGAIN_S)
            if (not missing and not unseen) or time.monotonic() > deadline:
                break
            looked.clear()
            self.io.call_soon(look)
            looked.wait(1.0)
        missing |= unseen
        for rank in sorted(missing):
            log.warning("monarch_nb: rank %d did not answer the attach", rank)
        adopted = threading.Event()
        def adopt() -> None:
            try:
                deaths, self.recovery.unknown_call_deaths = self.recovery.unknown_call_deaths, {}
                keep.adopt(deaths)
                self._ping(time.monotonic())  # ...and send what they kept now
            finally:
                adopted.set()

        self.io.call_soon(adopt)
        adopted.wait(5)
        self.ranks.record(-1, EventKind.ATTACHED, f"pid {os.getpid()}, epoch {keep.epoch}")

    def _adopt_process(self, agent: HostAgent, child: dict[str, Any]) -> None:
        rank, inc = int(child["rank"]), int(child["inc"])
        token = str(child["ident"]).rsplit(".", 1)[-1]
        old = self.ranks[rank]
        self.io.forget(old.main_id, old.ctl_id)
        info = self.ranks.adopt(rank, inc, token)
        log_path = os.path.join(self.supervisor.log_dir, f"rank{rank}.{inc}.log")
        proc = self.supervisor.adopt(rank, inc, agent.adopt(child, log_path), log_path)
        info.pid = proc.pid
        info.ready_at = time.monotonic()
        self.ranks.move(rank, RankState.READY)
        if proc.popen.poll() is None:
            assert self.keep is not None
            self.keep.expecting(rank)
        if proc.pidfd is not None:
            def ended() -> None:
                self.recovery.on_exit(rank, proc)
                self._notify()

            self.io.watch_fd(proc.pidfd, ended)

    def _open_home(self) -> None:
        """A kept mesh across hosts: this machine's agent, which holds it."""
        door = self._home_door
        if door is None or self.home_agent is not None:
            return
        assert self.cfg.name is not None
        log_path = os.path.join(self.supervisor.log_dir, "agent-home.log")
        self.home_agent = self.supervisor.spawner.call(
            HostAgent, "localhost", [], dict(os.environ), log_path, self.cfg.host_timeout,
            None, door)
        if self.home_agent.lost:
            raise UsageError(self.home_agent.lost)

    def _with_nodes(self, state: dict[str, Any]) -> dict[str, Any]:
        """A kept mesh across hosts also keeps its hosts (a spare host may
        have taken a lost one's place)."""
        launcher = self.supervisor.launcher
        if self.home_agent is not None and isinstance(launcher, AgentLauncher):
            state["nodes"] = launcher.hosts()
        return state

    def _home(self) -> HostAgent | None:
        if self.home_agent is not None:
            return self.home_agent
        launcher = self.supervisor.launcher
        return launcher.agents.get("localhost") if isinstance(launcher, AgentLauncher) else None

    def detach(self) -> None:
        """Let the kept mesh go on purpose: its ranks go on (calls in flight
        included) under their agent, whose lease starts now."""
        if self.stopped:
            return
        name = self.cfg.name
        self._let_go(f"this controller detached from kept mesh {name!r}; its ranks go on: "
                     f"Mesh.attach({name!r}) (%monarch attach {name}) and mesh.pending() "
                     "give what they return", tell_agent=True)

    def _taken(self, text: str) -> None:
        """The agent says another controller took the mesh over (its reader thread)."""
        if self.keep is not None:
            self.keep.taken = text
        # at once, before the agent's session ends: its end must not read as
        # the ranks' deaths (they are the new controller's now)
        self.recovery.stopped = True
        name = self.cfg.name
        threading.Thread(target=self._let_go, name="monarch-nb-taken", daemon=True, args=(
            f"kept mesh {name!r} was {text}; attach again with Mesh.attach({name!r}, "
            "force=True) to take it back",)).start()

    def _let_go(self, why: str = "the attach failed", tell_agent: bool = False) -> None:
        """Stop being this kept mesh's controller without stopping its ranks."""
        if self.stopped:
            return
        self.stopped = True
        self.recovery.stopped = True
        self.io.give_back()
        if self.io.thread.is_alive():
            done = threading.Event()

            def end_calls() -> None:
                try:
                    if tell_agent:  # on purpose: the ranks let go of what we have
                        self._ping(time.monotonic())
                    self.calls.stop(why)
                finally:
                    done.set()

            self.io.call_soon(end_calls)
            done.wait(2)
        else:
            self.calls.stop(why)
        launcher = self.supervisor.launcher
        if isinstance(launcher, AgentLauncher):
            if tell_agent:
                launcher.detach()
            else:
                launcher._closed = True
        if self.home_agent is not None and tell_agent:
            self.home_agent.detach()
        self.io.stop()  # the port is free for the next controller
        self.supervisor.spawner.stop()
        self.dataplane.close_all()
        self.supervisor.cleanup_logs()
        self._notify()

    def write_record(self) -> None:
        """A new kept mesh's record, once its ranks are ready (keptfiles.py)."""
        cfg = self.cfg
        assert cfg.name is not None and cfg.keep_alive is not None
        port = int(self.io.endpoint.rsplit(":", 1)[1])
        curve = None if self.curve is None else {
            k: v.decode() for k, v in dataclasses.asdict(self.curve).items()}
        keptfiles.Record(cfg.name, self.key.hex(), self.mesh_id, self.world_size,
                         dataclasses.asdict(self.backend), port, cfg.keep_alive,
                         cfg.to_dict(), curve=curve).write()
        home, keep = self._home(), self.keep
        if home is not None and keep is not None:  # the start's events, now
            state = keep.state_due(time.monotonic() + 1.0)
            if state is not None:
                home.send("keep", state=self._with_nodes(state))

    # -- helpers ---------------------------------------------------------------------------
    def _pid_of(self, rank: int) -> int | None:
        proc = self.supervisor.procs.get(rank)
        return None if proc is None else proc.pid

    def _recovering(self, rank: int) -> bool:
        """``rank`` is being brought back (the hang watchdog waits meanwhile)."""
        # DEAD: respawn off or a first start that failed: its calls are failed anyway
        return (self.ranks.coming_back(rank) or self.ranks[rank].state == RankState.DEAD
                or rank in self.recovery.awaiting_reform or self.ranks.reform_pending())

    def _announce(self, line: str) -> None:
        # once per cell (a re-issued elastic call shares its cell's output),
        # to the calls running or waiting for the ranks
        for output in {id(c.output): c.output for c in self.calls if not c.internal}.values():
            output.note(line)
        if self.announce is not None:
            self.announce(line)

    def _notify(self) -> None:
        with self._state_changed:
            self._state_changed.notify_all()

