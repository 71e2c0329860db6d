"""Supervisor: starts rank processes, notices their exit, stops them.

Ranks are forked from this host's warm process (procs/warm.py,
engine/warm.py: one ``python -m monarch_nb.worker`` that imported torch and
never touched a device), or, with ``fork=False``, fresh interpreters
(``python -m monarch_nb.worker``) started with ``subprocess.Popen``; never a
``fork`` of the kernel, which may have initialised CUDA. Either way a rank is
our child, in its own session, with the same environment. The key travels
in the child's environment (never argv).
Each rank writes stdout/stderr to its own log file in a private (0700)
directory: ``RankDied`` quotes its last lines and ``%monarch logs`` reads it.

Every fork goes through the mesh's spawner thread (spawner.py): Linux
delivers a child's parent-death signal when the *thread* that forked it
exits, and that thread lives exactly as long as the mesh.

Exit detection: each child's pidfd is watched by the I/O thread's poller, so a
death is seen as soon as it happens; where pidfds do not exist the controller's
tick polls instead.

A rank's whole process tree goes with it: every local rank (and spare) is
started in its own session (``start_new_session``), so it leads a process
group holding everything it forks (DataLoader workers, ``subprocess``
children). When a rank's exit is reaped, or when we kill it, the group is
sent SIGKILL at once (``kill_tree``): orphaned workers would otherwise hold
its gloo sockets open until their own parent check (5 s for a DataLoader)
and keep the survivors from noticing. The group id stays allocated while
any member lives, so the signal cannot reach a stranger. A host agent
supervising ranks elsewhere reuses ``kill_tree`` the same way.

Non-goals: what to do about a death (controller now, policy.py later).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from .. import config, flight
from ..backends import BackendInfo, pin_env
from ..wire import link as links
from . import deathcause, logdirs, spares
from . import warm as warms
from .agents import AgentLauncher, RemoteRank
from .launchers import Handle, Launcher, LocalLauncher
from .spawner import Spawner

log = logging.getLogger("monarch_nb")


@dataclass
class RankProcess:
    rank: int
    incarnation: int
    popen: Handle  # a subprocess.Popen, or a RemoteRank behind its host's agent
    log_path: str
    pidfd: int | None = None  # readable once it ended (a RemoteRank: its exit_fd)
    reaped: bool = False
    from_spare: bool = False  # a spare process became this rank (torch already imported)
    forked: bool = False  # forked from the warm process (torch already imported)
    announced: bool = False  # its STARTED event is recorded (a remote one's once its pid came)
    link: socket.socket | None = None  # our end of its link, until the I/O loop takes it
    sent: list[int] = field(default_factory=list)  # signals we sent it (a death's cause: deathcause.py)
    # what its persisted flight records said when it was reaped (call identity, records)
    flight: tuple[dict[str, Any], list[Any]] = ({}, [])

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass
class Supervisor:
    """Owns the rank processes of one mesh."""

    world_size: int
    backend: BackendInfo
    controller_endpoint: str
    key: bytes
    mesh_id: str
    master_port: int
    generation: int = 0
    # the mesh ranks of the group new processes join, in the order of their
    # torch ranks (RANK, WORLD_SIZE); empty: every rank (recovery's reform)
    group: tuple[int, ...] = ()
    controller_timeout: float = 10.0
    max_message_bytes: int = 4 << 30
    # local ranks: to the controller (wire/shm.py); remote ranks: to their agent (wire/link.py SHM)
    shm_threshold: int | None = None
    gpu_ipc: bool = False  # local ranks only (wire/gpuipc.py)
    local_links: bool = True  # local ranks' main channel is a link (wire/link.py)
    kept_epoch: int | None = None  # a kept mesh: its controller's epoch (engine/kept.py)
    restart_budget: int = config.MeshConfig.restart_budget  # torchrun's TORCHELASTIC_MAX_RESTARTS
    extra_env: dict[str, str] = field(default_factory=dict)
    launcher: Launcher = field(default_factory=LocalLauncher)
    spawner: Spawner = field(default_factory=Spawner)  # forks every process
    log_dir: str = field(default_factory=logdirs.make)  # marked as ours; swept if we die
    procs: dict[int, RankProcess] = field(default_factory=dict)
    history: list[RankProcess] = field(default_factory=list)
    spare: Handle | None = None  # torch imported, waiting (spares.py): a Popen, or forked
    spare_log: str = ""
    spare_link: tuple[socket.socket, int] | None = None  # our end of the spare's, its fd there
    _spares: int = 0
    # Local ranks forked from a warm process (procs/warm.py); off: fresh
    # interpreters. ``fork_off`` says why forking stopped, when it did.
    fork: bool = False
    preload: tuple[str, ...] = ()
    warm: warms.WarmProcess | None = None
    fork_off: str = ""
    _warms: int = 0
    # Set by terminate_all: a process a respawn or keep_spare forks after
    # that (the I/O thread racing a stop) is killed at once, not kept.
    closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        os.chmod(self.log_dir, 0o700)

    def reform(self, generation: int, master_port: int,
               group: tuple[int, ...] | None = None) -> None:
        """The group that processes started from now on join: its
        generation, its store's port and, when it changes, its mesh ranks
        (the controller's recovery decides them; only this method changes
        them)."""
        self.generation, self.master_port = generation, master_port
        if group is not None:
            self.group = () if group == tuple(range(self.world_size)) else tuple(group)

    def torch_rank(self, rank: int) -> tuple[int, int]:
        """``rank``'s rank in the group new processes join, and its size
        (dense while the group goes on without lost ranks)."""
        if not self.group or rank not in self.group:
            return rank, self.world_size
        return self.group.index(rank), len(self.group)

    def env_for(self, rank: int, incarnation: int, identity: str) -> dict[str, str]:
        env = dict(os.environ)
        for var in (config.ENV_KEY_FILE,):
            env.pop(var, None)
        place = self.launcher.placement(rank, self.world_size)
        # RANK, WORLD_SIZE (and torchrun's ROLE_*) are the torch group's;
        # placement and the mesh's own numbers stay the mesh's
        group_rank, group_size = self.torch_rank(rank)
        # torchrun's environment (torch/distributed/elastic/agent/server/
        # local_elastic_agent.py), so that code written for it runs as is and
        # dist.is_torchelastic_launched() is True. The role is the whole mesh;
        # a restart is this rank's respawn; there is no agent store (the group
        # already exists when user code starts: rank 0 hosted its store).
        # What the launcher was told (--role, --rdzv-id, --max-restarts)
        # comes in extra_env and wins.
        env.update({
            "ROLE_NAME": "default",
            "ROLE_RANK": str(group_rank),
            "ROLE_WORLD_SIZE": str(group_size),
            "GROUP_WORLD_SIZE": str(-(-self.world_size // max(1, place.local_world_size))),
            "TORCHELASTIC_RESTART_COUNT": str(incarnation),
            "TORCHELASTIC_MAX_RESTARTS": str(self.restart_budget),
            "TORCHELASTIC_RUN_ID": self.mesh_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_ERROR_FILE": os.path.join(self.log_dir,
                                                    f"rank{rank}.{incarnation}.error.json"),
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        })
        env.update(self.extra_env)
        self._thread_defaults(env, place.local_world_size)
        env.update({
            "RANK": str(group_rank),
            "LOCAL_RANK": str(place.local_rank),
            "WORLD_SIZE": str(group_size),
            "LOCAL_WORLD_SIZE": str(place.local_world_size),
            "GROUP_RANK": str(place.node),
            "MASTER_ADDR": self.master_addr(),
            "MASTER_PORT": str(self.master_port),
            config.ENV_CONTROLLER: self.controller_endpoint,
            config.ENV_KEY: self.key.hex(),
            config.ENV_MESH_ID: self.mesh_id,
            config.ENV_INCARNATION: str(incarnation),
            config.ENV_BACKEND: self.backend.name,
            config.ENV_PARENT_PID: str(os.getpid()),
            config.ENV_CONTROLLER_TIMEOUT: str(self.controller_timeout),
            config.ENV_IDENTITY: identity,
            config.ENV_GENERATION: str(self.generation),
            config.ENV_MESH_RANK: str(rank),
            config.ENV_MESH_SIZE: str(self.world_size),
            config.ENV_MAX_MESSAGE: str(self.max_message_bytes),
            "PYTHONUNBUFFERED": "1",
        })
        env.pop(config.ENV_SHM, None)
        env.pop(config.ENV_LINK_SHM, None)
        env.pop(config.ENV_GPU_IPC, None)  # never inherited from the kernel's environment
        env.pop(config.ENV_LINK_FD, None)  # set by spawn for the rank's own link
        if self.kept_epoch is not None:  # a kept mesh: its parent is the agent, not us
            env[config.ENV_KEPT_EPOCH] = str(self.kept_epoch)
            env[config.ENV_CONTROLLER_PID] = str(os.getpid())
        if self.launcher.remote:
            env.pop(config.ENV_PARENT_PID, None)  # its parent is ssh/srun's, not us
            if self.shm_threshold is not None:  # behind an agent: big frames to it by shared memory
                env[config.ENV_LINK_SHM] = str(self.shm_threshold)
        else:
            if self.shm_threshold is not None:  # same host: big frames by shared memory
                env[config.ENV_SHM] = str(self.shm_threshold)
            if self.gpu_ipc:  # same host: CUDA tensors by IPC handle (wire/gpuipc.py)
                env[config.ENV_GPU_IPC] = "1"
            # Local ranks talk over loopback only (gloo would otherwise pick the
            # interface the host name resolves to).
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        pin_env(self.backend, place.local_rank, env)
        if env.get("MONARCH_NB_VIRTUAL_LOCAL_RANK") == "1":
            env["LOCAL_RANK"] = "0"  # torchrun's --virtual-local-rank: its one GPU is cuda:0
        return env

    @staticmethod
    def _thread_defaults(env: dict[str, str], local_world_size: int) -> None:
        """torchrun's default for several ranks on one machine (it prints the
        notice once, as launch.py and %monarch start do); never over the
        user's. A spare gets it too: torch reads it at import (spare.py)."""
        if local_world_size > 1:
            env.setdefault("OMP_NUM_THREADS", "1")

    def start_spare(self) -> None:
        """Start a spare process for the next respawn (see spares.py). Local
        ranks only: a remote rank's interpreter starts on its node."""
        if self.closed or self.launcher.remote or isinstance(self.launcher, AgentLauncher) or (
                self.spare is not None and self.spare.poll() is None):
            return
        env = dict(os.environ)
        env.pop(config.ENV_KEY_FILE, None)
        env.pop(config.ENV_KEY, None)
        env.pop(config.ENV_LINK_FD, None)  # its own comes with the assignment
        env.update(self.extra_env)  # what torch reads at import is the rank's
        self._thread_defaults(env, self.launcher.placement(0, self.world_size).local_world_size)
        env.update({config.ENV_PARENT_PID: str(os.getpid()), "PYTHONUNBUFFERED": "1"})
        self._spares += 1
        self.spare_log = os.path.join(self.log_dir, f"spare{self._spares}.log")
        ours, theirs = links.pair() if self.links_on else (None, None)
        theirs_fd = -1 if theirs is None else theirs.fileno()  # its number there too
        try:
            if self.forks:
                made = self._fork_spare(env, theirs)
                if made is None:
                    if ours is not None:
                        ours.close()
                    return
                popen, theirs_fd = made
            else:
                popen = self.spawner.call(spares.start, env, self.spare_log,
                                          () if theirs is None else (theirs_fd,))
        except BaseException:
            if ours is not None:
                ours.close()
            raise
        finally:
            if theirs is not None:
                theirs.close()  # the spare holds it now
        with self._lock:
            if not self.closed:
                self.spare = popen
                if ours is not None:
                    self.spare_link = (ours, theirs_fd)
                return
        spares.discard(popen)  # the mesh stopped while it started
        if ours is not None:
            ours.close()

    @property
    def links_on(self) -> bool:
        """Local ranks get a link (wire/link.py) as their main channel."""
        return self.local_links and getattr(self.launcher, "links", False) is True

    def forget_dead_spare(self) -> None:
        """A spare that died (out of memory?) is no spare: forget it and
        close our end of its link."""
        with self._lock:
            if self.spare is None or self.spare.poll() is None:
                return
            self.spare = None
            spare_link, self.spare_link = self.spare_link, None
        if spare_link is not None:
            spare_link[0].close()

    def spare_ready(self) -> bool:
        """A spare is waiting with torch imported (the next respawn is fast)."""
        return (self.spare is not None and self.spare.poll() is None
                and spares.is_waiting(self.spare_log))

    @property
    def forks(self) -> bool:
        """Ranks are forked from the warm process: asked for (``fork``), on
        this machine's own launcher, where Linux allows, and not turned off
        by a failure (``fork_off``)."""
        return (self.fork and not self.fork_off and type(self.launcher) is LocalLauncher
                and warms.available())

    @property
    def forks_now(self) -> bool:
        """A rank or spare started now is forked from a warm process that is
        ready: it costs milliseconds, not an interpreter's imports."""
        warm = self.warm
        return self.forks and warm is not None and warm.ready and warm.popen.poll() is None

    def start_warm(self) -> None:
        """Start the warm process now (it imports torch while the rest of
        the start goes on); a no-op unless ranks are forked."""
        if self.closed or not self.forks or (
                self.warm is not None and self.warm.popen.poll() is None):
            return
        env = dict(os.environ)
        for var in (config.ENV_KEY_FILE, config.ENV_KEY, config.ENV_LINK_FD, config.ENV_SPARE):
            env.pop(var, None)
        env.update(self.extra_env)  # what torch reads at import is the ranks'
        self._thread_defaults(env, self.launcher.placement(0, self.world_size).local_world_size)
        self._warms += 1
        path = os.path.join(self.log_dir, f"warm{self._warms}.log")
        started = self.spawner.call(warms.WarmProcess.start, env, path, self.preload)
        with self._lock:
            if not self.closed:
                self.warm = started
                return
        started.stop()  # the mesh stopped while it started

    def _fork_rank(self, env: dict[str, str],
                   log_path: str) -> tuple[Handle, socket.socket | None] | None:
        """``env``'s rank forked from the warm process, and our end of its
        link; None when forking is off or stops now (a fresh interpreter
        then; ``fork_off`` says why). A preload that failed is the user's
        to fix: UsageError."""
        if not self.forks:
            return None
        if self.warm is None or self.warm.popen.poll() is not None:
            self.start_warm()
        warm = self.warm
        if warm is None:
            return None
        ours, theirs = links.pair() if self.links_on else (None, None)
        fds = {} if theirs is None else {config.ENV_LINK_FD: theirs.fileno()}
        try:
            warm.wait_ready()  # here, not on the spawner thread: torch's import takes seconds
            child = self.spawner.call(warm.fork, env, log_path, fds)
        except warms.WarmError as exc:
            if ours is not None:
                ours.close()
            if str(exc).startswith("preload "):
                from ..errors import UsageError

                raise UsageError(f"{exc}; fix the module or leave it out of preload "
                                 f"(Mesh.start(preload=...), %monarch start --preload)") from None
            self.fork_off = str(exc)
            log.warning("monarch_nb: ranks start as fresh interpreters from now on: the warm "
                        "process cannot fork (%s)", exc)
            self.stop_warm()
            return None
        finally:
            if theirs is not None:
                theirs.close()  # the warm process sent it on; the rank holds it now
        return child, ours

    def _fork_spare(self, env: dict[str, str],
                    link: socket.socket | None) -> tuple[Handle, int] | None:
        """A spare forked from the warm process (its assignment comes on a
        pipe, as a fresh spare's does), and its link end's number there;
        None while the warm process is not ready (it is never waited for
        here: this runs on the I/O thread) or when forking stops now."""
        warm = self.warm
        if warm is None or warm.popen.poll() is not None:
            self.start_warm()  # it died (out of memory?): another one, for the next spare
            return None
        if not warm.ready:
            return None
        fds = {} if link is None else {config.ENV_LINK_FD: link.fileno()}
        r, w = os.pipe()
        try:
            child = self.spawner.call(warm.fork, {**env, config.ENV_SPARE: "1"}, self.spare_log,
                                      fds, None, r)
        except warms.WarmError as exc:
            os.close(w)
            self.fork_off = str(exc)
            log.warning("monarch_nb: ranks start as fresh interpreters from now on: the warm "
                        "process cannot fork (%s)", exc)
            self.stop_warm()
            return None
        finally:
            os.close(r)
        child.stdin = os.fdopen(w, "wb", buffering=0)
        return child, child.fds.get(config.ENV_LINK_FD, -1)

    def stop_warm(self) -> None:
        with self._lock:
            warm, self.warm = self.warm, None
        if warm is not None:
            warm.stop()

    def spawn(self, rank: int, incarnation: int, identity: str) -> RankProcess:
        log_path = os.path.join(self.log_dir, f"rank{rank}.{incarnation}.log")
        if self.closed:  # stopping: the process is killed at once (below), its log is gone
            log_path = os.devnull
        env = self.env_for(rank, incarnation, identity)
        env[flight.PERSIST_ENV] = "" if self.closed else flight.persist_path(log_path)
        popen: Handle | None = None
        ours: socket.socket | None = None
        if self.spare is not None:  # a waiting spare becomes this rank at once
            candidate, self.spare = self.spare, None
            spare_link, self.spare_link = self.spare_link, None
            if spare_link is not None:
                ours = spare_link[0]
                env[config.ENV_LINK_FD] = str(spare_link[1])
            if spares.assign(candidate, env, log_path):
                popen = candidate
            else:
                spares.discard(candidate)
                if ours is not None:
                    ours.close()
                    ours = None
                env.pop(config.ENV_LINK_FD, None)
        from_spare = popen is not None
        forked = False
        if popen is None and (made := self._fork_rank(env, log_path)) is not None:
            (popen, ours), forked = made, True
        if popen is None:
            popen, ours = self._start_rank(rank, env, log_path)
        forked = forked or isinstance(popen, warms.Forked)  # a forked spare's too
        proc = RankProcess(rank, incarnation, popen, log_path, from_spare=from_spare, link=ours,
                           forked=forked)
        from ..wire.transport import pidfd_open

        proc.pidfd = popen.exit_fd if isinstance(popen, RemoteRank) else pidfd_open(popen.pid)
        with self._lock:
            self.procs[rank] = proc
            self.history.append(proc)
            if not self.closed:
                return proc
        self.kill_proc(proc)  # the mesh stopped while it started
        return proc

    def adopt(self, rank: int, incarnation: int, handle: RemoteRank, log_path: str) -> RankProcess:
        """A kept mesh's process its agent already runs (controller/keep.py)."""
        proc = RankProcess(rank, incarnation, handle, log_path, pidfd=handle.exit_fd)
        with self._lock:
            self.procs[rank] = proc
            self.history.append(proc)
        return proc

    def _start_rank(self, rank: int, env: dict[str, str],
                    log_path: str) -> tuple[Handle, socket.socket | None]:
        """A fresh process for ``rank`` through the launcher, and our end of
        its link (a local launcher's) or None."""
        ours, theirs = links.pair() if self.links_on else (None, None)
        if theirs is not None:
            env[config.ENV_LINK_FD] = str(theirs.fileno())
        log = open(log_path, "ab", buffering=0, opener=config.private)
        try:
            if theirs is None:
                popen = self.spawner.call(self.launcher.start, rank, env, log)
            else:
                fds = (theirs.fileno(),)
                popen = self.spawner.call(
                    lambda: self.launcher.start(rank, env, log, pass_fds=fds))  # type: ignore[call-arg]
        except BaseException:
            if ours is not None:
                ours.close()
            raise
        finally:
            log.close()
            if theirs is not None:
                theirs.close()  # the child holds it now
        return popen, ours

    def reap(self, rank: int, proc: RankProcess | None = None) -> int | None:
        """The exit status of ``proc`` (default: ``rank``'s current process)
        if it ended (and reap it), else None. Negative values are signals."""
        proc = proc or self.procs.get(rank)
        if proc is None:
            return None
        code = proc.popen.poll()
        if code is not None and not proc.reaped:
            proc.reaped = True
            if not self.launcher.remote and not isinstance(proc.popen, RemoteRank):
                # its DataLoader workers and other children (an agent's rank,
                # a kept mesh's on this machine: its agent does that, having
                # seen it end; what we hear is not always its end)
                kill_tree(proc.pid)
            if proc.log_path != os.devnull:  # its records outlive it: read once, removed
                proc.flight = flight.read_persisted(flight.persist_path(proc.log_path))
            if proc.pidfd is not None:
                try:
                    os.close(proc.pidfd)
                except OSError:
                    pass
                proc.pidfd = None
        return code

    def signal(self, rank: int, sig: int) -> None:
        proc = self.procs.get(rank)
        if proc is None or proc.popen.poll() is not None:
            return
        proc.sent.append(sig)
        if isinstance(proc.popen, RemoteRank):
            proc.popen.send_signal(sig)  # its agent sends it there
            return
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass

    def master_addr(self) -> str:
        """MASTER_ADDR of the group now: its torch rank 0's host's (rank 0's
        host's when a spare took its place; the first rank left's when the
        group went on without rank 0)."""
        first = self.group[0] if self.group else 0
        if first and self.launcher.remote:
            address_of = getattr(getattr(self.launcher, "inner", self.launcher), "address_of", None)
            host = self.launcher.placement(first, self.world_size).host
            if address_of is not None and host:
                return str(address_of(host))
        return self.launcher.master_addr(self.world_size)

    def host_silent(self, rank: int, after: float = 1.0) -> bool:
        """``rank`` runs on another host whose agent has said nothing for
        ``after`` s (it ticks every 0.2 s): a silence of the rank then is
        its host's, for the host timeout to judge (agents.py), not a frozen
        rank to kill through an agent that cannot hear us."""
        proc = self.procs.get(rank)
        if proc is None or not isinstance(proc.popen, RemoteRank):
            return False
        return time.monotonic() - proc.popen.agent.heard > after

    def process_state(self, rank: int, fresh: float = 1.0) -> str | None:
        """``rank``'s process state letter (liveness.py): read here for a
        local rank, its agent's last report (within ``fresh`` s) for a remote
        one; None when unknown (a remote rank without an agent)."""
        from .liveness import os_state

        proc = self.procs.get(rank)
        if proc is None:
            return None
        if isinstance(proc.popen, RemoteRank):
            return proc.popen.process_state(fresh)
        return None if self.launcher.remote else os_state(proc.pid)

    def lost_host(self, rank: int) -> str:
        """The host ``rank``'s current process was lost with, or ran on when
        that host was lost after it had ended ("" if neither)."""
        proc = self.procs.get(rank)
        if (proc is not None and isinstance(proc.popen, RemoteRank)
                and (proc.popen.lost or proc.popen.agent.lost)):
            return proc.popen.agent.host
        return ""

    def lost_with(self, host: str) -> list[int]:
        """The ranks whose current process was lost with ``host``."""
        return [r for r, p in self.procs.items() if isinstance(p.popen, RemoteRank)
                and p.popen.lost and p.popen.agent.host == host]

    def placed_on(self, host: str) -> list[int]:
        """The ranks whose current process, running or ended, was started on
        ``host`` (through its agent)."""
        return [r for r, p in self.procs.items() if isinstance(p.popen, RemoteRank)
                and p.popen.agent.host == host]

    def host_for(self, lost: str) -> str | None:
        """Where the ranks lost with host ``lost`` start now: ``lost`` itself
        when it was given back (``mesh.add_hosts``: a node that returns),
        else a spare host, if the launcher has one."""
        if not isinstance(self.launcher, AgentLauncher):
            return None
        if not self.launcher.host_lost(lost) and lost in self.launcher.hosts():
            return lost
        return self.launcher.replace_host(lost)

    def relay_counts(self) -> dict[str, int]:
        """What the host agents' relays took by shared memory from their
        ranks (AgentLauncher.relay_counts); {} without agents."""
        if not isinstance(self.launcher, AgentLauncher):
            return {}
        return self.launcher.relay_counts()

    def replacement_host(self, lost: str) -> str | None:
        """The spare host that takes ``lost``'s ranks, if the launcher has one."""
        if not isinstance(self.launcher, AgentLauncher):
            return None
        return self.launcher.replace_host(lost)

    def signal_all(self, sig: int) -> list[int]:
        """Send ``sig`` to every live rank (a launcher forwarding SIGTERM,
        SIGUSR1...): a local rank's whole process group, as torchrun does
        (killpg), so a ``--no-python`` program or a DataLoader worker gets it
        too; a remote rank's ssh/srun (srun passes it on). The ranks sent to."""
        sent = []
        for rank, proc in list(self.procs.items()):
            if proc.popen.poll() is not None:
                continue
            proc.sent.append(sig)
            if isinstance(proc.popen, RemoteRank):
                proc.popen.send_signal(sig, tree=True)
            elif self.launcher.remote:
                try:
                    os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass
            else:
                kill_tree(proc.pid, sig)
            sent.append(rank)
        return sent

    def tail(self, rank: int, lines: int = 10, incarnation: int | None = None) -> list[str]:
        """Last ``lines`` lines of a rank's log (its current incarnation by default)."""
        procs = [p for p in self.history if p.rank == rank
                 and (incarnation is None or p.incarnation == incarnation)]
        if not procs:
            return []
        path = procs[-1].log_path
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - max(64 * 1024, 256 * lines)))
                data = f.read().decode("utf-8", "replace")
        except OSError:
            return []
        return data.splitlines()[-lines:]

    def death_hint(self, rank: int, health: dict[str, Any]) -> str:
        """Why ``rank``'s current process died, when its log and last health
        tell (deathcause.py); "" otherwise."""
        proc = self.procs.get(rank)
        if proc is None:
            return ""
        if isinstance(proc.popen, RemoteRank) and proc.popen.lost:
            return proc.popen.lost  # "host X lost (why)": not the rank's doing
        code = proc.popen.poll()
        rss, limit, used = health.get("rss"), health.get("mem_limit"), health.get("mem_used")
        try:
            total: float | None = psutil.virtual_memory().total
        except Exception:
            total = None
        return deathcause.explain(code, self._death_tail(rank, code), sent=proc.sent,
                                  flight=proc.flight, peers=self.peer_records(rank),
                                  last_rss=rss if isinstance(rss, (int, float)) else None,
                                  mem_total=None if self.launcher.remote else total,
                                  mem_limit=limit if isinstance(limit, (int, float)) else None,
                                  mem_used=used if isinstance(used, (int, float)) else None)

    def peer_records(self, rank: int) -> dict[int, list[flight.OpRecord]]:
        """The other ranks' persisted records (read in place; a reaped
        one's as it left them): their side of the collective ``rank`` died in."""
        if self.launcher.remote:
            return {}
        return {r: p.flight[1] if p.reaped else flight.read_persisted(
                    flight.persist_path(p.log_path), remove=False)[1]
                for r, p in self.procs.items() if r != rank and p.log_path != os.devnull}

    def crash_stack(self, rank: int) -> tuple[str, ...]:
        """The crashing thread's Python and native stack when ``rank``'s
        current process died of a crash signal; () otherwise."""
        proc = self.procs.get(rank)
        code = None if proc is None else proc.popen.poll()
        if code is None or not deathcause.is_crash(code):
            return ()
        return tuple(deathcause.crash_stack(self._death_tail(rank, code)))

    def _death_tail(self, rank: int, code: int | None) -> list[str]:
        # a crash's dump starts with every thread's native stack, the
        # crashing thread's among the first: read far enough back for it
        return self.tail(rank, 2000 if code is not None and deathcause.is_crash(code) else 300)

    def logs(self, rank: int, lines: int = 100) -> list[str]:
        """The last ``lines`` lines ``rank`` wrote across all its incarnations,
        oldest first, each incarnation under a header saying how it ended."""
        procs = [p for p in self.history if p.rank == rank]
        chunks: list[list[str]] = []
        left = lines
        for proc in reversed(procs):
            if left <= 0:
                break
            body = self.tail(rank, left, proc.incarnation)
            left -= len(body)
            code = proc.popen.poll()
            if code is None:
                end = "running"
            elif code < 0:
                try:
                    end = f"killed by {signal.Signals(-code).name}"
                except ValueError:
                    end = f"killed by signal {-code}"
            else:
                end = f"exited with code {code}"
            head = f"--- rank {rank}, incarnation {proc.incarnation} (pid {proc.pid}, {end}) ---"
            chunks.append([head, *body] if len(procs) > 1 else body)
        return [line for chunk in reversed(chunks) for line in chunk]

    def kill_proc(self, proc: RankProcess) -> None:
        if proc.link is not None:  # never handed to the I/O loop
            proc.link.close()
            proc.link = None
        _close_stdin(proc)  # a remote rank's cue that its handle is gone
        if proc.popen.poll() is None:
            proc.sent.append(signal.SIGKILL)
            if isinstance(proc.popen, RemoteRank):
                proc.popen.kill()
                return
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not self.launcher.remote and not isinstance(proc.popen, RemoteRank):
            kill_tree(proc.pid)

    def terminate_all(self, grace: float = 3.0) -> None:
        """SIGTERM-free stop: ranks were asked to STOP over the socket by the
        controller; whoever is still alive after ``grace`` gets SIGKILL —
        including any child processes the user's code started."""
        with self._lock:
            self.closed = True
        # the logs go first: a kernel killed during the grace below (Jupyter
        # kills one that takes over 5 s to shut down) must not leave them
        # behind; ranks still writing keep their open files until they exit
        self.cleanup_logs()
        for proc in self.history:
            _close_stdin(proc)  # remote ranks and join sentinels: leave now
        alive = []
        with self._lock:
            spare, self.spare = self.spare, None
            spare_link, self.spare_link = self.spare_link, None
        if spare_link is not None:
            spare_link[0].close()
        if spare is not None:
            spares.discard(spare)
        self.stop_warm()  # forks nothing more; its ranks are ours, stopped below
        if isinstance(self.launcher, AgentLauncher):  # host agents stop their ranks, with the grace
            self.launcher.close(grace)
        for proc in [p for p in self.history if p.popen.poll() is None
                     and not isinstance(p.popen, RemoteRank)]:
            try:
                p = psutil.Process(proc.pid)
                alive.append(p)
                alive.extend(p.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        _, still = psutil.wait_procs(alive, timeout=grace)
        for p in still:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(still, timeout=5)
        for rank in list(self.procs):
            self.reap(rank)
        self.spawner.stop()  # after the children: its end is their parent-death signal

    def kill_now(self) -> None:
        """The controller is being killed (a kernel manager's SIGTERM after its
        shutdown wait): the logs and every local rank, spare and their
        children go now, without a grace. Safe from a signal handler: it
        takes no lock the interrupted code may hold."""
        self.closed = True
        self.cleanup_logs()
        leaders = [p.pid for p in self.history
                   if p.popen.poll() is None and not isinstance(p.popen, RemoteRank)]
        spare = self.spare
        if spare is not None and spare.poll() is None:
            leaders.append(spare.pid)
        warm = self.warm
        if warm is not None:
            leaders.append(warm.pid)
        for pid in leaders:
            kill_tree(pid)

    def cleanup_logs(self) -> None:
        import shutil

        shutil.rmtree(self.log_dir, ignore_errors=True)


def kill_tree(leader: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group ``leader`` started (a rank or a
    spare: each leads its own session), i.e. to everything it forked that
    did not leave the group; nothing if the group is empty."""
    if leader <= 0:  # not started (a remote handle's pid 0): never our own group
        return
    try:
        os.killpg(leader, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _close_stdin(proc: RankProcess) -> None:
    if proc.popen.stdin is not None and not proc.popen.stdin.closed:
        try:
            proc.popen.stdin.close()
        except OSError:
            pass
