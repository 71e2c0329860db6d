"""Simulated kept hosts: a kept mesh across many hosts in a few processes.

For measuring a kept mesh's attach at 1,024 ranks on 128 hosts
(benchmarks/kept.py ``--agents``) on a machine with two cores, through the
product's real attach path: ``Controller.attach`` / ``resume``, the home
agent (a real kept agent daemon on this machine), ``AgentLauncher.open_all``
and ``HostAgent``'s handshake through each host's door, the routes through
each host's relay, the wait for every rank's HELLO, ``Keep.adopt``.

What is simulated is what benchmarks/simranks.py simulates (the hosts'
processes, their ranks and relays), plus what a kept host's agent does for
them (procs/keptagent.py, procs/hostagent.py):

* :class:`SimKeptHosts` is the inner launcher of a real
  :class:`~monarch_nb.procs.agents.AgentLauncher` (as ssh's is): ``A``
  simulated hosts of ``per_agent`` ranks, served by a few host processes
  started up front (the hosts exist before the mesh, as machines do). Its
  ``agent_command`` is each host's door: a small C program
  (benchmarks/doorpump.c) that joins stdin and stdout to the simulated
  agent's Unix socket, standing for the ssh client a real door costs on
  the controller's machine (not for the door's interpreter, which runs on
  the remote host);
* each simulated agent (:class:`SimAgent`) speaks the kept agent's door
  protocol with the real code's pieces (agentwire lines, a ``challenge``
  answered with keptagent.attach_mac under the mesh key, one controller at
  a time, ``taken`` on a takeover): the first door line of a new mesh
  brings the key (as a new daemon gets it), ``spawn`` starts a simulated
  rank behind the agent's relay (one DEALER, the routing id the controller
  chose), ``attached`` answers with its ranks' processes (sid, rank, inc,
  pid, ident, code None) and the relay's id; it ticks every 0.2 s as a real
  agent, and keeps its ranks when the controller goes (its door closes: no
  exit);
* each simulated rank keeps the RESULT of each call until a PING's
  ``low`` / ``done`` lets it go (engine/kept.py), answers a PING of a new
  epoch (or with ``hi``) with HELLO carrying ``running``, ``kept`` and
  ``what`` (engine/loop.py ``_kept_ping``), and on ``resend`` sends what
  it kept, on its control channel through its agent.

Non-goals: the lease (the benchmark ends the host processes), respawn,
signals to ranks, logs, spare processes, the door's interpreter start and
ssh's handshake on a real host (a real attach waits for them too: see
benchmarks/README.md).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if __name__ == "__main__" and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.simranks import SWEEP_S, Host, SimRank, _set_parent_death_signal  # noqa: E402
from monarch_nb import config  # noqa: E402
from monarch_nb.procs import agentwire  # noqa: E402
from monarch_nb.procs.keptagent import attach_mac  # noqa: E402
from monarch_nb.procs.launchers import Placement  # noqa: E402
from monarch_nb.wire.protocol import Kind  # noqa: E402

TICK_S = 0.2  # as hostagent.py: states and heartbeat to the controller
DOOR_MS = "SIMKEPT_DOOR_MS"  # SimKeptHosts.door_ms, to the host processes
MAX_RESULTS = 32  # as engine/kept.py


def door_client(folder: str) -> list[str]:
    """The door command's program: benchmarks/doorpump.c compiled into
    ``folder`` (a C compiler is needed: an interpreter per door would
    spend the two cores this measurement needs on 128 start-ups)."""
    exe = os.path.join(folder, "doorpump")
    if not os.path.exists(exe):
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("benchmarks/simkept.py needs a C compiler (cc) for its doors")
        subprocess.run([cc, "-O2", "-o", exe, str(HERE / "doorpump.c")], check=True)
    return [exe]


# -- controller side: the inner launcher ---------------------------------------------------------
@dataclass
class SimKeptHosts:
    """``agents`` simulated hosts (``sim0`` ...) of ``per_agent`` ranks, in
    ``processes`` host processes started by :meth:`start_hosts`. Wrap it in
    an AgentLauncher: ``AgentLauncher(SimKeptHosts(...), spare=False)``."""

    agents: int
    per_agent: int = 8
    processes: int = 4
    # what a real door waits for before its agent's challenge, simulated:
    # ssh's connection and the door interpreter's start on the host
    door_ms: float = 0.0
    name: str = "simkept"
    remote: bool = True
    kept: tuple[str, float] | None = None  # set by the controller (a kept mesh)
    nodes: list[str] = field(default_factory=list)
    folder: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _door: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.nodes = self.nodes or [f"sim{i}" for i in range(self.agents)]

    @property
    def per_node(self) -> int:
        return self.per_agent

    def placement(self, rank: int, world_size: int) -> Placement:
        node = rank // self.per_agent
        return Placement(self.nodes[node], node, rank % self.per_agent,
                         min(self.per_agent, world_size - node * self.per_agent))

    def master_addr(self, world_size: int) -> str:
        return "127.0.0.1"

    def socket_path(self, host: str) -> str:
        return os.path.join(self.folder, f"{host}.sock")

    def agent_command(self, host: str, controller_timeout: float) -> list[str]:
        return [*self._door, self.socket_path(host)]

    def start_hosts(self) -> None:
        """The host processes, each serving every ``processes``-th agent;
        returns once every agent's door listens."""
        self.folder = tempfile.mkdtemp(prefix="simkept-")
        self._door = door_client(self.folder)
        env = {**os.environ, DOOR_MS: f"{self.door_ms:g}", "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        for i in range(min(self.processes, self.agents)):
            names = self.nodes[i::self.processes]
            self.procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "simkept.py"), self.folder, *names], env=env,
                stdin=subprocess.PIPE, start_new_session=True))
        deadline = time.monotonic() + 60
        while not all(os.path.exists(self.socket_path(h)) for h in self.nodes):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError("the simulated kept hosts did not come up")
            time.sleep(0.05)

    def host_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        """End the host processes (their stdin closes) and their folder."""
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


# -- host side: simulated kept agents --------------------------------------------------------------
@dataclass
class Conn:
    """A connection to an agent's door: the door line, then the challenge,
    then (attached) the controller's orders."""

    sock: socket.socket
    agent: SimAgent
    phase: str = "door"  # door -> challenge -> attached
    nonce: str = ""
    buf: bytes = b""


@dataclass
class SimAgent:
    """One simulated host's kept agent: its door, its ranks, its relay."""

    name: str
    listener: socket.socket
    key: bytes | None = None  # the mesh key (the first door line of a new mesh brings it)
    conn: Conn | None = None  # the attached controller's
    relay: str = ""  # its relay's routing id (the first spawn names it)
    children: dict[int, dict[str, Any]] = field(default_factory=dict)  # by rank
    state: dict[str, Any] = field(default_factory=dict)  # what a controller asked to keep
    stopped: bool = False


@dataclass
class Kept:
    """A simulated rank's kept results (engine/kept.py's Keeper, call ids only)."""

    epoch: int | None
    results: dict[int, None] = field(default_factory=dict)
    resent_epoch: int = -1


class KeptHost(Host):
    """A host process of simulated kept agents (see the module docstring):
    simranks' Host with a door per agent, whose ranks come by ``spawn``
    lines. Exits when its stdin (the benchmark's) closes or every agent was
    stopped; a controller that goes is nothing to it."""

    def __init__(self, folder: str, names: list[str]) -> None:
        super().__init__()
        self.timeout = float("inf")  # no rank yet: no controller to miss
        self.doors: dict[int, SimAgent] = {}  # listener fd -> agent
        self.conns: dict[int, Conn] = {}  # connection fd -> its state
        self.kept: dict[SimRank, Kept] = {}
        self.next_tick = time.monotonic()
        self.door_s = float(os.environ.get(DOOR_MS) or 0) / 1e3
        self.challenges: list[tuple[float, Conn]] = []  # (when, to whom): a door's latency
        for name in names:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            path = os.path.join(folder, f"{name}.sock")
            old = os.umask(0o177)
            try:
                sock.bind(path + ".new")
            finally:
                os.umask(old)
            sock.listen(16)
            os.rename(path + ".new", path)  # whole, or not there
            sock.setblocking(False)
            self.doors[sock.fileno()] = SimAgent(name, sock)
            self.epoll.register(sock.fileno(), select.EPOLLIN)

    # -- the doors -----------------------------------------------------------------------
    def accept(self, agent: SimAgent) -> None:
        while True:
            try:
                sock, _ = agent.listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            self.conns[sock.fileno()] = Conn(sock, agent)
            self.epoll.register(sock.fileno(), select.EPOLLIN)

    def read(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.drop(conn)
            return
        conn.buf += data
        *lines, conn.buf = conn.buf.split(b"\n")
        for line in lines:
            if line.strip() and conn.sock.fileno() in self.conns:
                self.on_line(conn, line)

    def send(self, conn: Conn, op: str, **fields: Any) -> None:
        try:
            conn.sock.setblocking(True)
            conn.sock.sendall(agentwire.encode(op, **fields))
            conn.sock.setblocking(False)
        except OSError:
            self.drop(conn)

    def drop(self, conn: Conn) -> None:
        fd = conn.sock.fileno()
        if self.conns.pop(fd, None) is None:
            return
        self.epoll.unregister(fd)
        conn.sock.close()
        if conn.agent.conn is conn:  # the controller let go: the ranks go on (the lease)
            conn.agent.conn = None

    def on_line(self, conn: Conn, line: bytes) -> None:
        agent = conn.agent
        try:
            msg = agentwire.decode(line, agentwire.TO_AGENT)
        except ValueError:
            self.dropped["agentwire"] += 1
            return
        op = msg["op"]
        if conn.phase == "door":  # the door process's first line (keptagent.door_main)
            if op != "door":
                self.drop(conn)
            elif agent.key is None and not msg["start"]:
                self.send(conn, "refused", text=f"kept mesh agent {agent.name} is gone")
                self.drop(conn)
            else:
                if agent.key is None:  # a new mesh: as a new daemon gets its key
                    agent.key = bytes.fromhex(msg["key"])
                conn.phase, conn.nonce = "challenge", secrets.token_hex(16)
                if self.door_s > 0:
                    self.challenges.append((time.monotonic() + self.door_s, conn))
                else:
                    self.send(conn, "challenge", nonce=conn.nonce)
            return
        if conn.phase == "challenge":  # as keptagent.Door._admit
            assert agent.key is not None
            if op != "attach" or not hmac.compare_digest(
                    str(msg["mac"]), attach_mac(agent.key, conn.nonce)):
                self.send(conn, "refused", text="not signed with this mesh's key")
                self.drop(conn)
                return
            old = agent.conn
            if old is not None and not msg["force"]:
                self.send(conn, "refused", text=f"{agent.name} is attached")
                self.drop(conn)
                return
            if old is not None:
                self.send(old, "taken", text=f"taken over by pid {msg['pid']}")
                self.drop(old)
            agent.conn, conn.phase = conn, "attached"
            self.send(conn, "attached", children=list(agent.children.values()),
                      state=agent.state, relay=agent.relay)
            return
        if agent.conn is not conn:
            return
        if op == "spawn":
            self.spawn(agent, msg)
        elif op == "keep":
            agent.state = msg["state"]
        elif op == "detach":
            self.drop(conn)
        elif op == "stop":
            agent.stopped = True
            for rank in self.ranks:
                if any(c["ident"] == rank.env.identity for c in agent.children.values()):
                    rank.stopped = True
            self.drop(conn)
            self.epoll.unregister(agent.listener.fileno())
            self.doors.pop(agent.listener.fileno(), None)
            agent.listener.close()

    def spawn(self, agent: SimAgent, msg: dict[str, Any]) -> None:
        env = agentwire.string_map(msg["env"])
        agent.relay = agent.relay or msg["relay"]
        self.add(json.dumps({"env": env, "agent": agent.relay, "model": "host"}).encode())
        rank = self.ranks[-1]
        self.kept[rank] = Kept(rank.env.kept_epoch)
        ident = env.get(config.ENV_IDENTITY) or f"r{msg['rank']}.{msg['inc']}"
        agent.children[msg["rank"]] = {"sid": msg["sid"], "rank": msg["rank"], "inc": msg["inc"],
                                       "pid": os.getpid(), "ident": ident, "code": None}
        assert agent.conn is not None
        self.send(agent.conn, "started", sid=msg["sid"], pid=os.getpid(), spare=False)

    def tick(self) -> None:
        for agent in self.doors.values():
            if agent.conn is not None:
                self.send(agent.conn, "tick",
                          states={str(c["sid"]): "S" for c in agent.children.values()})

    # -- the ranks: what a kept rank keeps and says ------------------------------------------
    def answered(self, ranks: list[SimRank], call: int) -> None:
        for rank in ranks:
            kept = self.kept.get(rank)
            if kept is not None:
                kept.results[call] = None
                if len(kept.results) > MAX_RESULTS:
                    del kept.results[next(iter(kept.results))]

    def handle(self, rank: SimRank, msg: Any) -> None:
        kept = self.kept.get(rank)
        if msg.kind is not Kind.PING or kept is None or not msg.meta:
            super().handle(rank, msg)
            return
        self.last_ping = time.monotonic()
        meta = msg.meta  # as engine/loop.py _kept_ping
        epoch = int(meta.get("ep", kept.epoch or 0))
        if epoch != kept.epoch or meta.get("hi"):
            kept.epoch = epoch
            rank.send_ctl(Kind.HELLO, meta={
                "pid": os.getpid(), "incarnation": rank.env.incarnation,
                "host": os.uname().nodename, "running": 0, "kept": list(kept.results),
                "what": {}})
        if "low" in meta:
            low, done = int(meta["low"]), set(meta.get("done") or ())
            for call in [c for c in kept.results if c < low or c in done]:
                del kept.results[call]
        if meta.get("resend") and kept.resent_epoch != epoch:
            kept.resent_epoch = epoch
            for call in kept.results:
                rank.send_ctl(Kind.RESULT, call=call)

    # -- the loop ----------------------------------------------------------------------------
    def serve(self) -> None:
        next_sweep = time.monotonic() + SWEEP_S
        while True:
            due = min([next_sweep, *(when for when, _ in self.challenges)])
            timeout = max(0.0, due - time.monotonic())
            for fd, _ in self.epoll.poll(timeout + 0.001):
                if fd == self.stdin:
                    if not self.read_specs():
                        return  # the benchmark is done with us
                    continue
                agent = self.doors.get(fd)
                if agent is not None:
                    self.accept(agent)
                    continue
                conn = self.conns.get(fd)
                if conn is not None:
                    self.read(conn)
                    continue
                name = self.agent_fds.get(fd)
                if name is not None:
                    self.drain_agent(name)
                    continue
                found = self.by_fd.get(fd)
                if found is not None:
                    self.drain(*found)
            self.flush()
            if not self.doors:
                return  # every agent was stopped
            now = time.monotonic()
            if self.challenges:
                for when, conn in [c for c in self.challenges if c[0] <= now]:
                    self.challenges.remove((when, conn))
                    if conn.sock.fileno() in self.conns:
                        self.send(conn, "challenge", nonce=conn.nonce)
            if now >= next_sweep:
                next_sweep = now + SWEEP_S
                self.sweep(now)
            if now >= self.next_tick:
                self.next_tick = now + TICK_S
                self.tick()


def main() -> None:
    _set_parent_death_signal()  # the benchmark's: gone with it
    host = KeptHost(sys.argv[1], sys.argv[2:])
    try:
        host.serve()
    finally:
        if host.dropped:
            print(f"simkept host {os.getpid()}: dropped {dict(host.dropped)}", file=sys.stderr,
                  flush=True)
        host.close()
    os._exit(0)


if __name__ == "__main__":
    main()
