"""The controller's side of host agents: one ssh / srun session per host,
never one per rank.

:class:`AgentLauncher` wraps the ssh or SLURM launcher's placement: the
first rank placed on a host starts that host's agent (hostagent.py) through
the launcher's remote command; every rank on the host is then one
``spawn`` line to it. For the supervisor a remote rank is a
:class:`RemoteRank`, a handle shaped like ``subprocess.Popen`` (``pid``,
``poll``, ``wait``, ``send_signal``) whose ``exit_fd`` becomes readable when
the agent reports the exit, so the I/O loop watches it like a local rank's
pidfd. Its log arrives from the agent and is written to the rank's log
file here, its flight records with its exit: ``%monarch logs``, RankDied's
last lines and the collective it died in read them as for a local rank.

The ranks' channels (main and control) go through their agent's relay
(wire/hostrelay.py): one connection per host to the controller, one
message per host for a call to its ranks. :attr:`AgentLauncher.route` is
how the controller learns, before each rank starts, which agent speaks for
it (transport.IOLoop.attach_relay).

A lost host: an agent that says nothing for ``host_timeout`` seconds (it
ticks every 0.2 s), or whose session ends, or that cannot be started, is
lost. Each of its ranks then ends with ``lost`` set to the host's name and
the reason; the controller's policy treats that as ``HostLost``, not as a
crash to retry. With spare hosts (``spare_hosts=``) the lost host's place
in the placement goes to a spare (:meth:`AgentLauncher.replace_host`), so
its ranks come back there with their rank numbers.

Non-goals: when to respawn (policy), the agent itself (hostagent.py), the
channel's message shapes (agentwire.py).
"""

from __future__ import annotations

import base64
import itertools
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from .. import config, flight
from ..errors import UsageError
from . import agentwire, launchers
from . import warm as warms
from .launchers import Launcher, Placement, SlurmLauncher, SshLauncher, _local_env, rank_spec

LOST_CODE = 255  # what a rank of a lost host "exited" with (ssh's own code for a lost link)
PING_S = 0.5  # the controller's line to each agent (its controller_timeout counts these)
ATTACH_TIMEOUT_S = 30.0  # an agent (a kept one's door) that does not answer an attach this long is lost
# an agent answers a spawn once the process runs: at once, or once its warm
# process imported torch (it waits for that at most warms.READY_TIMEOUT_S, then
# starts fresh); one that has not answered after this is lost. Nothing here
# waits for the answer: the pid and the STARTED event come with it
# (RemoteRank.when_started), so the controller's I/O thread goes on meanwhile.
SPAWN_ANSWER_S = warms.READY_TIMEOUT_S + 30.0
# doors opened at once at attach (AgentLauncher.open_all): each waits mostly for
# its host (ssh's connection, the door's interpreter there), so a host more is
# a thread more here, not a round more: with 32, 128 hosts took four rounds of
# a door's latency (300 ms doors: 1.9 s of a 1,024-rank attach; benchmarks/kept.py)
OPEN_AT_ONCE = 256


class RemoteRank:
    """A rank process on another host, as the supervisor sees it."""

    def __init__(self, agent: HostAgent, sid: int, rank: int, inc: int, log_path: str) -> None:
        self.agent, self.sid, self.rank, self.inc, self.log_path = agent, sid, rank, inc, log_path
        self.args = f"rank {rank} on {agent.host}"
        self.pid = 0  # its pid on its host, once the agent said
        self.stdin = None
        self.returncode: int | None = None
        self.from_spare = False
        self.state: str | None = None  # its process state, as the agent last saw it
        self.state_at = 0.0
        self.lost = ""  # "host X lost (why)" when it ended with its host
        self.started = threading.Event()  # its pid is known (or it ended before it ran)
        self.asked = time.monotonic()  # when the agent was asked to start it
        self._on_started: list[Callable[[], None]] = []
        self._started_lock = threading.Lock()
        self._done = threading.Event()
        self.exit_fd, self._exit_w = os.pipe()  # readable once it ended (the I/O loop's watch)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int, tree: bool = False) -> None:
        if self.returncode is None:
            self.agent.send("signal", sid=self.sid, sig=int(sig), tree=tree)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL, tree=True)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def process_state(self, fresh: float) -> str | None:
        """Its state letter if the agent reported it within ``fresh`` s."""
        return self.state if time.monotonic() - self.state_at <= fresh else None

    def when_started(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the agent said it runs (its pid), on the agent's
        reader thread, or here if it did already. Not called for a process
        that ended before it ran (its host lost meanwhile: ``pid`` is 0)."""
        with self._started_lock:
            if not self.started.is_set():
                self._on_started.append(fn)
                return
        if self.pid:
            fn()

    def mark_started(self, pid: int, from_spare: bool) -> None:
        with self._started_lock:
            if self.started.is_set():
                return
            self.pid, self.from_spare = pid, from_spare
            self.started.set()
            waiting, self._on_started = self._on_started, []
        for fn in waiting:
            fn()

    def ended(self, code: int, lost: str = "") -> None:
        if self._done.is_set():
            return
        if self.returncode is None:  # (already set by mark for a lost host's ranks)
            self.lost, self.returncode = lost, code
        self._done.set()
        with self._started_lock:  # no pid will come: nothing waits for one
            self.started.set()
            self._on_started = []
        try:
            os.write(self._exit_w, b"x")
            os.close(self._exit_w)
        except OSError:
            pass

    def write_log(self, data: str) -> None:
        try:
            with open(self.log_path, "ab", buffering=0, opener=config.private) as f:
                f.write(data.encode("utf-8", "surrogateescape"))
        except OSError:
            pass


class HostAgent:
    """One host's agent: its session, and the ranks it runs for us."""

    def __init__(self, host: str, argv: list[str], env: dict[str, str], log_path: str,
                 host_timeout: float, route: Route | None = None,
                 door: KeptDoor | None = None) -> None:
        self.host, self.host_timeout = host, host_timeout
        # the routing id of its relay (unguessable, as a rank's), when routed
        self.route = route
        self.relay_id = f"agent.{host}.{secrets.token_hex(8)}" if route is not None else ""
        self.processes: dict[int, RemoteRank] = {}  # by spawn number, until each one's exit
        self._sids = itertools.count(1)
        self.lost = ""
        self.dropped = 0  # malformed lines
        self.relay_counts: dict[str, int] = {}  # its relay's, as of its last tick (Relay.counts)
        self.heard = time.monotonic()
        self._lock = threading.Lock()
        self.popen: subprocess.Popen[bytes] | None = None
        # a kept mesh's agent (keptagent.py): what it said when we attached,
        # and who took it over from us ("" while we hold it)
        self.door = door
        self.attached: dict[str, Any] = {}
        self.taken = ""
        try:
            if door is not None and door.local:  # this machine's kept agent: its socket, in-process
                from .keptagent import open_local

                self.popen = open_local(door.name, door.key, door.start,  # type: ignore[assignment]
                                        door.tail)
            else:
                with open(log_path, "ab", buffering=0, opener=config.private) as log:
                    self.popen = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE,
                                                  stdout=subprocess.PIPE, stderr=log,
                                                  start_new_session=True, close_fds=True)
        except OSError as exc:  # no ssh / srun here: a launch that fails loses the host at once
            self.lost = f"host {host} lost (its agent could not start: {exc})"
            return
        if door is not None:
            try:
                self._attach(door)  # before the reader: its answer is ours to read
            except UsageError as exc:
                if door.local:
                    raise  # this machine's: the refusal is the user's answer
                # another host's kept agent is gone (its lease, the host itself):
                # that host is lost, which the policy handles as any lost host
                self.lost = f"host {host} lost ({exc})"
                return
        threading.Thread(target=self._read, name=f"monarch-nb-agent-{host}", daemon=True).start()

    def _attach(self, door: KeptDoor) -> None:
        """Through a kept agent's door: answer its challenge with the mesh
        key, and read what it has (its ranks, the kept state). UsageError
        (the popen ended) when refused."""
        from .keptagent import attach_mac

        assert self.popen is not None and self.popen.stdout is not None
        if not door.local:  # a door process: its first line (a local session is the agent's)
            self.send("door", key=door.key.hex(), start=door.start)
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.popen.stdout.readline(agentwire.MAX_LINE + 1)
            if not line:
                break
            try:
                msg = agentwire.decode(line, agentwire.FROM_AGENT)
            except ValueError:
                self.dropped += 1
                continue
            if msg["op"] == "challenge":
                self.send("attach", mac=attach_mac(door.key, msg["nonce"]), pid=os.getpid(),
                          host=socket.gethostname(), force=door.force)
            elif msg["op"] == "attached":
                self.attached = {"children": msg["children"], "state": msg["state"]}
                relay = msg.get("relay")
                if self.route is not None and isinstance(relay, str) and relay:
                    self.relay_id = relay  # its relay's connection outlived the last controller
                self.heard = time.monotonic()
                return
            elif msg["op"] == "refused":
                self._end_door()
                raise UsageError(msg["text"])
        self._end_door()
        tail = ""
        if door.local:  # its log is here: say what it said
            try:
                with open(os.path.join(door.log_hint, "agent.log"), "rb") as f:
                    tail = f.read()[-600:].decode("utf-8", "replace").strip()
            except OSError:
                pass
        raise UsageError(f"the agent of kept mesh {door.name!r} did not answer "
                         f"(see its log in {door.log_hint})" + (f":\n{tail}" if tail else ""))

    def _end_door(self) -> None:
        assert self.popen is not None
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except OSError:  # it is gone already (a host that cannot be reached)
                pass
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        if self.popen.pid <= 0:  # a local session: its socket goes too
            self.popen.kill()

    def adopt(self, child: dict[str, Any], log_path: str) -> RemoteRank:
        """A handle on a process a kept mesh's agent already runs (attach)."""
        handle = RemoteRank(self, int(child["sid"]), int(child["rank"]), int(child["inc"]),
                            log_path)
        handle.mark_started(int(child["pid"]), False)
        with self._lock:
            self.processes[handle.sid] = handle
            top = max(self.processes)
            if next(self._sids) <= top:  # new spawns are numbered after the agent's
                self._sids = itertools.count(top + 1)
        if child.get("code") is not None:  # it died while nobody was attached
            self._keep_flight(handle, child.get("flight"))  # (the call it died in)
            handle.ended(int(child["code"]))
            self.processes.pop(handle.sid, None)
        return handle

    @staticmethod
    def _keep_flight(handle: RemoteRank, encoded: Any) -> None:
        """A dead rank's flight records where the supervisor reads them when
        it reaps the rank (as for a rank on this machine)."""
        if not encoded or not isinstance(encoded, str):
            return
        try:
            data = base64.b64decode(encoded, validate=True)
            with open(flight.persist_path(handle.log_path), "wb", opener=config.private) as f:
                f.write(data)
        except (ValueError, OSError):
            pass

    def detach(self) -> None:
        """Let a kept agent go: it keeps the ranks (the lease starts)."""
        data = agentwire.encode("detach")
        with self._lock:
            if self.lost:
                return
            # 'detached' before the agent hears it: its answer is to close
            # the door, and the reader thread that sees the door close must
            # not take it for a lost host (its ranks' ends: a reap of the
            # live ranks; seen under load as both ranks SIGKILLed)
            self.lost = "detached"  # (nothing more is said to it)
            stdin = None if self.popen is None else self.popen.stdin
            if stdin is not None and not stdin.closed:
                try:
                    stdin.write(data)
                    stdin.flush()
                    stdin.close()
                except (OSError, ValueError):
                    pass

    def send(self, op: str, **fields: Any) -> None:
        data = agentwire.encode(op, **fields)
        with self._lock:
            stdin = None if self.popen is None else self.popen.stdin
            if self.lost or stdin is None or stdin.closed:
                return
            try:
                stdin.write(data)
                stdin.flush()
            except (OSError, ValueError):
                pass  # its reader sees the end and declares the host lost

    def spawn(self, rank: int, env: dict[str, str], log_path: str, spare: bool,
              fork: bool = False, preload: tuple[str, ...] = ()) -> RemoteRank:
        inc = int(env.get(config.ENV_INCARNATION, "0"))
        with self._lock:
            # a process it replaces ends when the agent reports its exit (the
            # agent kills it): by then the supervisor holds the new one
            handle = RemoteRank(self, next(self._sids), rank, inc, log_path)
            self.processes[handle.sid] = handle
        if self.lost:
            handle.ended(LOST_CODE, self.lost)
            return handle
        if self.route is not None:  # before it starts: its first message is expected
            ident = env.get(config.ENV_IDENTITY) or f"r{rank}.{inc}"
            for channel in ("main", "ctl"):
                self.route(f"{ident}.{channel}".encode(), self.relay_id.encode())
        shipped = _shipped(env)
        if self.door is not None and config.ENV_SHM in env:  # this machine: shared memory
            shipped[config.ENV_SHM] = env[config.ENV_SHM]
        self.send("spawn", sid=handle.sid, rank=rank, inc=inc, env=shipped, spare=spare,
                  relay=self.relay_id, fork=fork, preload=list(preload))
        return handle  # its pid comes with the agent's "started" (check() bounds the wait)

    def warm(self, fork: bool, preload: tuple[str, ...], env: dict[str, str]) -> None:
        """Have the agent start its warm process now (hostagent.py)."""
        if not self.lost:
            self.send("warm", fork=fork, preload=list(preload),
                      env={k: env[k] for k in agentwire.IMPORT_ENV if k in env})

    def check(self, now: float) -> None:
        if self.lost:
            return
        if now - self.heard > self.host_timeout:
            self.lose(f"its agent was silent for {now - self.heard:.1f} s")
            return
        unanswered = [h for h in list(self.processes.values())  # (a copy: the reader pops)
                      if not h.started.is_set() and now - h.asked > SPAWN_ANSWER_S]
        if unanswered:
            self.lose(f"no answer to starting rank {unanswered[0].rank} in "
                      f"{SPAWN_ANSWER_S:.0f} s")

    def lose(self, why: str) -> None:
        """The host is gone: its ranks end with it, the session is killed."""
        with self._lock:
            if self.lost:
                return
            self.lost = f"host {self.host} lost ({why})"
            ranks = list(self.processes.values())
        for handle in ranks:  # all of them first: the controller decides for all at once
            if handle.returncode is None:
                handle.lost, handle.returncode = self.lost, LOST_CODE
        for handle in ranks:
            handle.ended(LOST_CODE, self.lost)
        if self.popen is not None and self.popen.pid > 0:  # (a local kept session has none)
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        elif self.popen is not None:
            self.popen.kill()

    def close(self, grace: float) -> None:
        """Stop the agent: its ranks get ``grace`` s, then SIGKILL (there)."""
        self.send("stop", grace=grace)
        with self._lock:
            if self.popen is not None and self.popen.stdin is not None:
                try:
                    self.popen.stdin.close()
                except OSError:
                    pass

    def wait_closed(self, timeout: float) -> None:
        if self.popen is not None:
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                if self.popen.pid > 0:
                    try:
                        os.killpg(self.popen.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                else:
                    self.popen.kill()
                self.popen.wait(timeout=5)
        with self._lock:
            ranks = list(self.processes.values())
        for handle in ranks:
            handle.ended(-signal.SIGKILL)

    # -- its reader thread --------------------------------------------------------------------
    def _read(self) -> None:
        assert self.popen is not None and self.popen.stdout is not None
        stream = self.popen.stdout
        for line in iter(lambda: stream.readline(agentwire.MAX_LINE + 1), b""):
            self.heard = time.monotonic()
            try:
                msg = agentwire.decode(line, agentwire.FROM_AGENT)
            except ValueError:
                self.dropped += 1
                continue
            self._on(msg)
        code = self.popen.wait()
        if self.taken:  # a kept mesh another controller took over: its ranks live on
            self.lost = self.lost or self.taken
            return
        self.lose(f"its session ended (exit code {code})")

    def _on(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "tick":
            self.relay_counts = {k: v for k, v in msg["relay"].items()
                                 if isinstance(k, str) and type(v) is int}
            now = time.monotonic()
            for sid, state in msg["states"].items():
                handle = self.processes.get(int(sid)) if str(sid).isdigit() else None
                if handle is not None and isinstance(state, str):
                    handle.state, handle.state_at = state, now
            return
        if op == "error":
            sys.stderr.write(f"monarch_nb: agent on {self.host}: {msg['text']}\n")
            return
        if op == "hello":
            return
        if op == "taken":  # another controller holds the kept mesh now
            self.taken = msg["text"]
            if self.door is not None and self.door.on_taken is not None:
                self.door.on_taken(msg["text"])
            return
        handle = self.processes.get(msg["sid"])
        if handle is None:
            return  # not one we started
        if op == "started":
            handle.mark_started(msg["pid"], msg["spare"])
        elif op == "log":
            handle.write_log(msg["data"])
        elif op == "exit":
            self._keep_flight(handle, msg["flight"])
            handle.ended(msg["code"])
            self.processes.pop(handle.sid, None)


def _shipped(env: dict[str, str]) -> dict[str, str]:
    import json

    spec = json.loads(rank_spec(env))
    return dict(spec["env"])


Route = Callable[[bytes, bytes], None]  # (a rank's main id, its agent's relay id)


@dataclass
class KeptDoor:
    """How a controller reaches a kept mesh's agent (keptagent.py): the mesh
    key that answers its challenge, whether the door may start the agent
    (a new mesh) and take the mesh over from another controller."""

    name: str
    key: bytes
    start: bool = False
    force: bool = False
    on_taken: Callable[[str], None] | None = None
    log_hint: str = ""
    local: bool = False  # on this machine: its socket in-process, no door process
    tail: list[str] = field(default_factory=list)  # a new agent's options (--keep-alive ...)


@dataclass
class HomeLauncher:
    """A kept mesh's ranks on this machine, behind this machine's agent
    (keptagent.py), which outlives the controller. Placement as the local
    launcher's; the agent runs on "localhost" through its door."""

    name: str  # the kept mesh's
    keep_alive: float
    nodes: list[str] = field(default_factory=lambda: ["localhost"])
    remote: bool = False  # same machine: shared memory, loopback

    @property
    def per_node(self) -> int:
        return 1 << 30

    def placement(self, rank: int, world_size: int) -> Placement:
        return Placement("localhost", 0, rank, world_size)

    def master_addr(self, world_size: int) -> str:
        return "127.0.0.1"

    def agent_command(self, host: str, controller_timeout: float) -> list[str]:
        return [sys.executable, "-m", "monarch_nb.agent", "--kept", self.name,
                "--keep-alive", f"{self.keep_alive:g}",
                "--controller-timeout", f"{controller_timeout:g}"]


@dataclass
class AgentLauncher:
    """Remote ranks through one agent per host (ssh or SLURM underneath).
    ``route``: set by the controller (its I/O loop's attach_relay) to carry
    the ranks' main channels through the agents; None: each rank connects
    its own DEALER."""

    inner: SshLauncher | SlurmLauncher | HomeLauncher
    spare_hosts: list[str] = field(default_factory=list)
    host_timeout: float = 5.0
    spare: bool = True
    controller_timeout: float = 10.0
    agents: dict[str, HostAgent] = field(default_factory=dict)
    lost_hosts: list[str] = field(default_factory=list)
    _replaced: list[tuple[str, str]] = field(default_factory=list)  # (lost, its spare)
    remote: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _watch: threading.Thread | None = None
    _closed: bool = False
    relays: bool = True  # its ranks' main channels can go through the agents (``route``)
    route: Route | None = None
    door: KeptDoor | None = None  # a kept mesh's: its agent is reached by its door
    # the mesh's ``fork`` and ``preload`` (set by the controller from its
    # MeshConfig): each agent forks its ranks from its own warm process
    fork: bool = field(default_factory=config.fork_default)
    preload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.inner, HomeLauncher):
            # this machine: the ranks' own DEALERs to the controller (no
            # relay hop), shared memory with it
            self.remote = self.relays = False

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def per_node(self) -> int:
        return self.inner.per_node

    def placement(self, rank: int, world_size: int) -> Placement:
        return self.inner.placement(rank, world_size)

    def master_addr(self, world_size: int) -> str:
        return self.inner.master_addr(world_size)

    def hosts(self) -> list[str]:
        return list(self.inner.nodes)

    def start(self, rank: int, env: dict[str, str], log: IO[bytes]) -> RemoteRank:
        world = config.mesh_size(env, rank)
        host = self.placement(rank, world).host
        if self.host_lost(host):  # a restart after a lost host: onto a spare if one is left
            host = self.replace_host(host) or host
        agent = self._agent(host, env, log.name)
        return agent.spawn(rank, env, log.name, self.spare, self.fork, self.preload)

    def _agent(self, host: str, env: dict[str, str], log_name: str) -> HostAgent:
        with self._lock:
            agent = self.agents.get(host)
            if agent is None or (agent.lost and host not in self.lost_hosts):
                argv = self.inner.agent_command(host, self.controller_timeout)
                log_path = os.path.join(os.path.dirname(log_name), f"agent-{host}.log")
                agent = HostAgent(host, argv, _local_env(env), log_path, self.host_timeout,
                                  self.route, self.door)
                self.agents[host] = agent
            if self._watch is None:
                self._watch = threading.Thread(target=self._watcher, daemon=True,
                                               name="monarch-nb-agents")
                self._watch.start()
            return agent

    def start_warm(self, world_size: int, log_dir: str,
                   env_for: Callable[[int], dict[str, str]]) -> None:
        """At the mesh's start: every host of the placement gets its agent
        now, and its warm process starts importing torch, side by side
        (the controller's first spawn to each host would otherwise wait for
        one host's import after another's). ``env_for(rank)``: a rank's
        environment. A kept mesh's agents (their doors) start theirs with
        the first spawn."""
        if not self.fork or self.door is not None:
            return
        first: dict[str, int] = {}
        for rank in range(world_size):
            first.setdefault(self.placement(rank, world_size).host, rank)
        for host, rank in first.items():
            env = env_for(rank)
            self._agent(host, env, os.path.join(log_dir, "start")).warm(
                self.fork, self.preload, env)

    def open(self, host: str, log_dir: str, lost_ok: bool = False) -> HostAgent:
        """``host``'s agent, reached now (a kept mesh's, at attach: it runs
        already). UsageError when its door refuses us, unless ``lost_ok``
        (another host: it is then a lost host)."""
        agent = self._agent(host, dict(os.environ), os.path.join(log_dir, f"agent-{host}.log"))
        if agent.lost and not agent.attached and not lost_ok:
            with self._lock:
                self.agents.pop(host, None)
            raise UsageError(agent.lost)
        return agent

    def open_all(self, hosts: list[str], log_dir: str) -> list[HostAgent]:
        """:meth:`open` for every host at once (each door is an ssh session
        and an interpreter's start: side by side, an attach waits for the
        slowest, not for their sum); a host that cannot be reached is lost."""
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(max(1, min(OPEN_AT_ONCE, len(hosts)))) as pool:
            made = list(pool.map(lambda h: HostAgent(
                h, self.inner.agent_command(h, self.controller_timeout),
                _local_env(dict(os.environ)), os.path.join(log_dir, f"agent-{h}.log"),
                self.host_timeout, self.route, self.door), hosts))
        with self._lock:
            for host, agent in zip(hosts, made, strict=True):
                self.agents[host] = agent
            if self._watch is None:
                self._watch = threading.Thread(target=self._watcher, daemon=True,
                                               name="monarch-nb-agents")
                self._watch.start()
        return made

    def _watcher(self) -> None:
        """Ping every agent; declare the silent ones lost."""
        while not self._closed:
            now = time.monotonic()
            for agent in list(self.agents.values()):
                if not agent.lost:
                    agent.send("ping")
                    agent.check(now)
            time.sleep(PING_S / 2)

    def host_lost(self, host: str) -> bool:
        agent = self.agents.get(host)
        return agent is not None and bool(agent.lost)

    def replace_host(self, lost: str) -> str | None:
        """Give ``lost``'s place in the placement to a spare host, if one is
        left; the spare's name (also when ``lost`` was already replaced)."""
        with self._lock:
            if lost not in self.inner.nodes:
                return next((new for old, new in self._replaced if old == lost), None)
            if not self.spare_hosts:
                return None
            spare = self.spare_hosts.pop(0)
            self.inner.nodes[self.inner.nodes.index(lost)] = spare
            self._replaced.append((lost, spare))
            self.lost_hosts.append(lost)
            return spare

    def add_hosts(self, hosts: list[str]) -> None:
        """More hosts (``mesh.add_hosts``): a host of the placement that was
        lost is back (a SLURM node that returns: its lost agent is forgotten,
        the next start there makes a new one); any other is a spare host.
        A SLURM node must be up; one outside the allocation gets a job of
        its own (launchers.SlurmLauncher.admit)."""
        if isinstance(self.inner, SlurmLauncher):
            self.inner.admit(hosts)
        with self._lock:
            for host in hosts:
                agent = self.agents.get(host)
                if host in self.inner.nodes and agent is not None and agent.lost:
                    del self.agents[host]
                elif host not in self.spare_hosts:
                    self.spare_hosts.append(host)

    def busy_hosts(self) -> list[str]:
        """The hosts of the placement not lost: ones that run ranks now."""
        return [h for h in self.inner.nodes if not self.host_lost(h)]

    def relay_counts(self) -> dict[str, int]:
        """The agents' relays' counts summed (hostrelay.Relay.counts, as of
        each one's last tick)."""
        total: dict[str, int] = {}
        for agent in list(self.agents.values()):
            for key, value in agent.relay_counts.items():
                total[key] = total.get(key, 0) + value
        return total

    def detach(self) -> None:
        """A kept mesh's controller lets go: its agent keeps the ranks."""
        self._closed = True
        for agent in list(self.agents.values()):
            agent.detach()
            if agent.popen is not None:
                try:
                    agent.popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    agent.popen.kill()

    def close(self, grace: float) -> None:
        self._closed = True
        agents = list(self.agents.values())
        for agent in agents:
            agent.close(grace)
        for agent in agents:
            agent.wait_closed(grace + 5.0)


def from_config(cfg: config.MeshConfig, n: int | None) -> tuple[Launcher, int]:
    """launchers.from_config, with ssh and SLURM ranks behind one agent per
    host. Spare hosts: ``cfg.spare_hosts``; under SLURM, by default, the
    allocation's nodes beyond the ones placed (``--nodes``)."""
    launcher, world = launchers.from_config(cfg, n)
    if not isinstance(launcher, (SshLauncher, SlurmLauncher)):
        return launcher, world
    spare = list(cfg.spare_hosts)
    if isinstance(launcher, SlurmLauncher) and not spare:
        spare = [h for h in launchers.slurm_nodes() if h not in launcher.nodes]
    clash = sorted(set(spare) & set(launcher.nodes))
    if clash:
        raise UsageError(f"spare host(s) {', '.join(clash)} already run ranks; a spare host "
                         "must be free")
    return AgentLauncher(launcher, spare, cfg.host_timeout, cfg.spare,
                         cfg.controller_timeout), world


__all__ = ["AgentLauncher", "HomeLauncher", "HostAgent", "KeptDoor", "LOST_CODE", "RemoteRank",
           "from_config"]
