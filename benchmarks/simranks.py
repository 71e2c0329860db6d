"""Simulated ranks: many protocol-speaking ranks in a few processes, no torch.

For measuring the controller alone at hundreds or thousands of ranks
(benchmarks/scale.py) on a machine with two cores: a real rank is an
interpreter with torch and a gloo group, so 1,024 of them cannot run here,
and their own CPU would hide the controller's.

:class:`SimLauncher` is a :class:`~monarch_nb.procs.launchers.Launcher`
(``Mesh.start(n=N, launcher=SimLauncher(hosts=K))``). It starts ``K`` *host*
processes (this file run as a script) and deals the ranks out round-robin.
Each rank's environment reaches its host as one JSON line on the host's
stdin (:func:`~monarch_nb.procs.launchers.rank_spec`: keys by pipe,
never on a command line), as the ssh and slurm launchers send theirs.

Each simulated rank speaks the real protocol on its own two DEALER sockets
(``<identity>.main``, ``<identity>.ctl``) with its own two codecs: HELLO and
READY, heartbeats every ``HEARTBEAT_S`` with health figures, the
controller's pings. Every message in is verified (signature, replay window,
sender) before it is read; every message out is signed. Answers:

* CALL: a RESULT with no value (what a real rank sends for a no-op that
  returns None); the call's pickled function is never unpickled;
* EXEC: a RESULT whose value is the rank number (so a test can see each
  rank answered as itself); the code is not run;
* INTERRUPT, STACKS, REFORM: minimal well-formed answers; STOP: the rank
  leaves, and the host exits when all its ranks left or its stdin closes.

Supervision sees real processes: every rank of a host reports the host's
pid, the supervisor opens a pidfd per rank (all on the host's pid, as it
would on N real pids), and liveness reads the host's ``/proc`` state
(sleeping or running: alive). A host that dies takes its ranks with it, and
each is reported dead.

Simulated host agents (``SimLauncher(agents=A)``, scale.py ``--agents``):
the ranks are dealt to ``A`` agents of ``per_agent`` ranks each, several
agents per host process. Each agent is one DEALER to the controller, as a
real host agent's relay (monarch_nb/wire/hostrelay.py): a call to its
ranks arrives once (a fan-out naming them), each rank verifies it with its
own codec and answers, and the answers of one turn go up as one batch,
the same plain result of several ranks folded into one message with the
real relay's code (monarch_nb/wire/fold.py). How a simulated host answers
a no-op call to its ranks is ``agent_model``: "host" (default) spends a
real host's wall time, not its CPU: its ranks would verify the call and
answer at the same moment on their own cores, so one verify stands for
them all and the answer is the relay's fold of their equal results;
"ranks" spends the CPU of every rank (each verifies and signs, the relay
verifies each answer and folds them), all in this one process, so on a
small machine the simulated hosts' CPU, not the controller, sets the
latency. The
controller routes through the agent as it does for real agents (the
launcher's ``route``). Both channels go through the agent (heartbeats and
pings too), so a host is one connection to the controller.

Non-goals: running user code, torch.distributed, respawn (a host is not
restarted; use ``respawn="off"``), shared memory, CurveZMQ.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if __name__ == "__main__" and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import zmq  # noqa: E402

from monarch_nb import config  # noqa: E402
from monarch_nb.config import RankEnv  # noqa: E402
from monarch_nb.procs.launchers import Placement, rank_spec  # noqa: E402
from monarch_nb.wire import serialize  # noqa: E402
from monarch_nb.wire.channels import dealer, recv_frames  # noqa: E402
from monarch_nb.wire.fold import Folder  # noqa: E402
from monarch_nb.wire.link import DROPPED, Link  # noqa: E402
from monarch_nb.wire.protocol import Codec, Kind  # noqa: E402
from monarch_nb.wire.relay import pack_batch, unpack_fanout  # noqa: E402
from monarch_nb.wire.transport import send_frames  # noqa: E402

HEARTBEAT_S = 0.5  # as engine/loop.py
SWEEP_S = 0.05  # how often a host looks for heartbeats due (and a silent controller)
# what a real rank's HEARTBEAT carries (engine/health.py on a CPU rank), so
# the controller decodes meta of the usual size
HEALTH = {"cpu": 0.0, "rss": 350_000_000}


# -- controller side: the launcher ---------------------------------------------------------------
@dataclass
class SimLauncher:
    """Starts ``hosts`` host processes on first use; rank ``r`` lives on
    host ``r % hosts``. Not remote: ranks are on this machine, so liveness
    reads the host's process state as it reads a local rank's."""

    hosts: int = 2
    name: str = "sim"
    remote: bool = False
    # Each rank's main channel is a link (monarch_nb/wire/link.py), as a
    # real local rank's: the supervisor makes the pair, and its end reaches
    # the rank's host through a Unix socket (SCM_RIGHTS), just ahead of the
    # rank's spec line. False (scale.py --zmq): DEALERs, as remote ranks.
    links: bool = True
    # > 0: simulated host agents of ``per_agent`` ranks each (dealt over the
    # host processes), their ranks' main channels relayed (see the module doc)
    agents: int = 0
    per_agent: int = 8
    # how a simulated host answers a call (see the module doc): "host" (a
    # real host's wall time: one verify, the relay's fold) or "ranks" (its
    # CPU: every rank's verify and answer, the relay folding them)
    agent_model: str = "host"
    route: Any = None  # set by the controller when ``relays`` (transport.IOLoop.attach_relay)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    fd_channels: dict[int, socket.socket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.agents:
            # ranks on other hosts, as behind real agents: no link, and
            # liveness does not read this machine's /proc per silent rank (a
            # real agent's ranks' states come in its reports: a dict lookup)
            self.links = False
            self.remote = True

    @property
    def relays(self) -> bool:
        return self.agents > 0

    def placement(self, rank: int, world_size: int) -> Placement:
        return Placement("", 0, rank, world_size)

    def master_addr(self, world_size: int) -> str:
        return "127.0.0.1"

    def start(self, rank: int, env: dict[str, str], log: IO[bytes],
              pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
        agent = ""
        if self.agents:
            number = min(rank // self.per_agent, self.agents - 1)
            host = number % self.hosts
            agent = f"agent.sim{number}"
            if self.route is not None:  # before its first message
                ident = env.get(config.ENV_IDENTITY) or f"r{rank}"
                for channel in ("main", "ctl"):
                    self.route(f"{ident}.{channel}".encode(), agent.encode())
        else:
            host = rank % self.hosts
        popen = self.procs.get(host)
        if popen is None or popen.poll() is not None:
            # The host's own environment holds no secrets (as ssh's does not):
            # each rank's key arrives in its spec line on stdin.
            local = {k: v for k, v in env.items()
                     if k not in config.SECRET_ENV and k != config.ENV_LINK_FD}
            local["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH"))
                                                  if p)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            local[FD_CHANNEL] = str(theirs.fileno())
            try:
                popen = subprocess.Popen(
                    [sys.executable, str(HERE / "simranks.py")], env=local, stdin=subprocess.PIPE,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                    pass_fds=(theirs.fileno(),))
            finally:
                theirs.close()
            self.procs[host] = popen
            old = self.fd_channels.pop(host, None)
            if old is not None:
                old.close()
            self.fd_channels[host] = ours
        assert popen.stdin is not None
        try:
            if pass_fds:  # the rank's end of its link, ahead of its spec
                socket.send_fds(self.fd_channels[host], [b"f"], list(pass_fds))
            spec = rank_spec(env)
            if agent:
                spec = json.dumps({**json.loads(spec), "agent": agent,
                                   "model": self.agent_model}).encode() + b"\n"
            popen.stdin.write(spec)
            popen.stdin.flush()
        except OSError:
            pass  # the host died: its exit is reported as each rank's death
        return popen

    def host_pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def close(self) -> None:
        for chan in self.fd_channels.values():
            chan.close()
        self.fd_channels.clear()


FD_CHANNEL = "SIMRANKS_FD_CHANNEL"  # a host's end of the socket its ranks' link ends come by


# -- host side: the simulated ranks -------------------------------------------------------------
class SimRank:
    """One simulated rank: two sockets, two codecs, what it answers."""

    __slots__ = ("rank", "env", "main", "ctl", "main_codec", "ctl_codec", "next_beat", "stopped",
                 "value", "link", "outbox", "main_id", "ctl_id")

    def __init__(self, ctx: zmq.Context, env: RankEnv, now: float,
                 link: Link | None = None,
                 outbox: list[tuple[bytes, list[Any]]] | None = None) -> None:
        self.rank = env.rank
        self.env = env
        self.main_codec = Codec(env.key, f"{env.identity}.main")
        self.ctl_codec = Codec(env.key, f"{env.identity}.ctl")
        self.link = link
        self.outbox = outbox  # its agent's batch going up (None: its own main channel)
        self.main_id = f"{env.identity}.main".encode()
        self.ctl_id = f"{env.identity}.ctl".encode()
        self.main = None if link is not None or outbox is not None else dealer(ctx, f"{env.identity}.main",
                                                         env.controller, env.curve)
        self.ctl = None if outbox is not None else dealer(ctx, f"{env.identity}.ctl",
                                                          env.controller, env.curve)
        for sock in (self.main, self.ctl):
            if sock is not None:
                sock.setsockopt(zmq.LINGER, 0)
        self.next_beat = now + HEARTBEAT_S
        self.stopped = False
        self.value = [bytes(f) for f in serialize.dumps(env.rank)]  # EXEC's answer

    def hello(self) -> None:
        pid = os.getpid()
        self.send_ctl(Kind.HELLO, meta={"pid": pid, "incarnation": self.env.incarnation,
                                        "host": os.uname().nodename})
        self.send_main(Kind.READY, meta={"device": "cpu", "pid": pid})

    def send_main(self, kind: Kind, payload: list[Any] | None = None, *, call: int = 0,
                  meta: dict[str, Any] | None = None) -> None:
        frames = self.main_codec.sign(kind, payload or [], call=call, meta=meta)
        if self.outbox is not None:
            self.outbox.append((self.main_id, frames))
            return
        if self.link is None:
            assert self.main is not None
            send_frames(self.main, frames)
            return
        if self.link.send(frames):  # the socket is full (rare: answers are small)
            while self.link.flush():
                select.select([], [self.link.fd], [], 1.0)

    def send_ctl(self, kind: Kind, payload: list[Any] | None = None, *, call: int = 0,
                 meta: dict[str, Any] | None = None) -> None:
        frames = self.ctl_codec.sign(kind, payload or [], call=call, meta=meta)
        if self.outbox is not None:
            self.outbox.append((self.ctl_id, frames))
        else:
            assert self.ctl is not None
            send_frames(self.ctl, frames)


class Host:
    """The host process: one thread, one epoll set over every rank's sockets
    and stdin (where rank specs arrive).

    epoll on each socket's ``ZMQ_FD``, not ``zmq.Poller``: a zmq poll walks
    every socket of the host on every wake-up (hundreds here), which made
    the simulated ranks cost more CPU than the controller they are there to
    load. ``ZMQ_FD`` only signals a change, so a socket that fires is read
    until ``zmq.Again``, and after sending on a socket outside that loop
    (heartbeats, the handshake) it is read again: a send may consume the
    signal of a message that arrived meanwhile."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        # two sockets per rank: libzmq's default of 1,023 sockets a context
        # would stop a host at 511 ranks
        self.ctx.set(zmq.MAX_SOCKETS, 65536)
        self.epoll = select.epoll()
        self.by_fd: dict[int, tuple[SimRank, bool]] = {}  # ZMQ_FD -> (rank, is main)
        self.ranks: list[SimRank] = []
        self.dropped: collections.Counter[str] = collections.Counter()
        self.stdin = sys.stdin.fileno()
        os.set_blocking(self.stdin, False)
        self.epoll.register(self.stdin, select.EPOLLIN)
        self.buffer = b""
        channel = os.environ.get(FD_CHANNEL)
        self.fd_channel = socket.socket(fileno=int(channel)) if channel else None
        self.last_ping = time.monotonic()
        self.timeout = 10.0
        # simulated agents: name -> (DEALER, its outbox), ZMQ_FD -> name, main id -> rank
        self.agents: dict[str, tuple[zmq.Socket, list[tuple[bytes, list[Any]]]]] = {}
        self.folders: dict[str, Folder] = {}  # name -> its folding of equal results (fold.py)
        self.per_host = True  # SimLauncher.agent_model == "host"
        self.agent_fds: dict[int, str] = {}
        self.by_main: dict[bytes, SimRank] = {}
        self.by_ctl: dict[bytes, SimRank] = {}

    def add(self, line: bytes) -> None:
        spec = json.loads(line)
        env = RankEnv.from_environ(spec["env"])
        self.timeout = env.controller_timeout
        link = None
        if env.link_fd is not None and self.fd_channel is not None:
            _, fds, _, _ = socket.recv_fds(self.fd_channel, 1, 1)  # sent just before the spec
            link = Link(socket.socket(fileno=fds[0]), env.max_message_bytes)
        outbox = None
        if spec.get("agent"):
            outbox = self.agent(spec["agent"], env)[1]
            self.per_host = spec.get("model", "host") == "host"
        rank = SimRank(self.ctx, env, time.monotonic(), link, outbox)
        self.by_main[rank.main_id] = rank
        self.by_ctl[rank.ctl_id] = rank
        self.ranks.append(rank)
        for sock, main in ((rank.main, True), (rank.ctl, False)):
            if sock is None:
                continue
            fd = int(sock.getsockopt(zmq.FD))  # (typed int | bytes: an int for FD)
            self.by_fd[fd] = (rank, main)
            self.epoll.register(fd, select.EPOLLIN)
        if link is not None:
            self.by_fd[link.fd] = (rank, True)
            self.epoll.register(link.fd, select.EPOLLIN)
        rank.hello()
        self.drain(rank, True)
        self.drain(rank, False)
        self.flush()

    def agent(self, name: str, env: RankEnv) -> tuple[zmq.Socket, list[tuple[bytes, list[Any]]]]:
        """The simulated agent ``name``'s DEALER (made on first use) and outbox."""
        found = self.agents.get(name)
        if found is None:
            sock = dealer(self.ctx, name, env.controller, env.curve)
            sock.setsockopt(zmq.LINGER, 0)
            found = self.agents[name] = (sock, [])
            self.folders[name] = Folder(env.key, name)
            fd = int(sock.getsockopt(zmq.FD))
            self.agent_fds[fd] = name
            self.epoll.register(fd, select.EPOLLIN)
        return found

    def drain_agent(self, name: str) -> None:
        """Fan-outs to an agent: each named rank verifies the message itself."""
        sock = self.agents[name][0]
        while True:
            try:
                frames = recv_frames(sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                idents = unpack_fanout(frames[0].bytes)
            except Exception as exc:  # ProtocolError: dropped whole, as the agent's relay does
                self.dropped[getattr(exc, "reason", "malformed")] += 1
                continue
            if self.per_host and self.answer_as_host(name, idents, frames[1:]):
                continue
            for ident in idents:
                rank = self.by_main.get(ident)
                codec = None if rank is None else rank.main_codec
                if rank is None:
                    rank = self.by_ctl.get(ident)
                    codec = None if rank is None else rank.ctl_codec
                if rank is None or codec is None:
                    continue
                try:
                    msg = codec.verify(frames[1:])
                except Exception as exc:
                    self.dropped[getattr(exc, "reason", "malformed")] += 1
                    continue
                self.handle(rank, msg)

    def answer_as_host(self, name: str, idents: list[bytes], frames: list[Any]) -> bool:
        """A call to several ranks of agent ``name`` answered with a real
        host's wall time, not its CPU: on a real host the ranks verify the
        same fan-out and answer at the same time, each on its own cores, so
        one verify stands for all of them here, and the answer is what the
        real relay sends up for their equal plain results: one fold signed
        by the agent (monarch_nb/wire/fold.py). False: not a no-op call to
        more than one rank (each rank then answers for itself)."""
        ranks = [self.by_main.get(ident) for ident in idents]
        if len(ranks) < 2 or any(r is None for r in ranks):
            return False
        first = ranks[0]
        assert first is not None
        try:
            msg = first.main_codec.verify(frames)
        except Exception as exc:  # ProtocolError: dropped, as each rank would
            self.dropped[getattr(exc, "reason", "malformed")] += 1
            return True
        if msg.kind is not Kind.CALL:
            for rank in ranks:
                assert rank is not None
                self.handle(rank, msg)
            return True
        outbox = self.agents[name][1]
        outbox.append(self.folders[name].make(idents, msg.call, None))
        self.answered(ranks, msg.call)  # type: ignore[arg-type]
        return True

    def answered(self, ranks: list[SimRank], call: int) -> None:
        """``ranks`` sent the RESULT of ``call`` (a kept mesh's ranks keep
        it: benchmarks/simkept.py)."""

    def flush(self) -> None:
        """Each agent's answers of this turn, up as one batch, its ranks'
        equal results folded and their heartbeats held as a real agent's
        relay does (its CPU is the simulated host's)."""
        now = time.monotonic()
        for name, (sock, outbox) in self.agents.items():
            folder = self.folders[name]
            if outbox or (folder.due is not None and now >= folder.due):
                up = folder.fold(outbox, now)  # heartbeats held as the relay holds them
                outbox.clear()
                if up:
                    frames = [f for _, fs in up for f in fs]
                    send_frames(sock, [pack_batch([(i, len(fs)) for i, fs in up]), *frames])

    def read_specs(self) -> bool:
        """New rank specs from stdin; False at its end (the mesh is gone)."""
        try:
            data = os.read(self.stdin, 1 << 20)
        except BlockingIOError:
            return True
        if not data:
            return False
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            if line.strip():
                self.add(line)
        return True

    def serve(self) -> None:
        next_sweep = time.monotonic() + SWEEP_S
        while True:
            timeout = max(0.0, next_sweep - time.monotonic())
            for fd, _ in self.epoll.poll(timeout + 0.001):
                if fd == self.stdin:
                    if not self.read_specs():
                        return
                    continue
                name = self.agent_fds.get(fd)
                if name is not None:
                    self.drain_agent(name)
                    continue
                rank, main = self.by_fd[fd]
                self.drain(rank, main)
            self.flush()
            if self.ranks and all(r.stopped for r in self.ranks):
                return
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + SWEEP_S
                self.sweep(now)

    def sweep(self, now: float) -> None:
        if now - self.last_ping > self.timeout:  # the controller is gone (as worker.py)
            print(f"simranks host {os.getpid()}: controller silent for {self.timeout:g} s, "
                  "exiting", file=sys.stderr, flush=True)
            os._exit(3)
        meta = {"busy": 0, "h": HEALTH}
        for rank in self.ranks:
            if now >= rank.next_beat and not rank.stopped:
                rank.next_beat = now + HEARTBEAT_S
                rank.send_ctl(Kind.HEARTBEAT, meta=meta)
                self.drain(rank, False)  # the send may have taken a ping's signal
        for name in self.agents:  # as for the ranks' sockets: a send may take a signal
            self.drain_agent(name)
        self.flush()

    def drain(self, rank: SimRank, main: bool) -> None:
        sock, codec = (rank.main, rank.main_codec) if main else (rank.ctl, rank.ctl_codec)
        link = rank.link if main else None
        while True:
            if link is not None:
                got = link.read()
                if got is None:
                    if link.closed:  # the controller is gone
                        rank.stopped = True
                        self.epoll.unregister(link.fd)
                        link.close()
                        rank.link = None
                    return
                if got is DROPPED:
                    self.dropped[link.refused] += 1
                    continue
                frames: list[Any] = got  # type: ignore[assignment]
            else:
                if sock is None:
                    return
                try:
                    frames = recv_frames(sock, zmq.NOBLOCK)
                except zmq.Again:
                    return
            try:
                msg = codec.verify(frames)  # signature, then replay, then parse
            except Exception as exc:  # ProtocolError: counted and dropped, as a rank does
                self.dropped[getattr(exc, "reason", "malformed")] += 1
                continue
            self.handle(rank, msg)

    def handle(self, rank: SimRank, msg: Any) -> None:
        """A verified message to ``rank``: what a real rank would answer."""
        kind = msg.kind
        if kind is Kind.CALL:
            # A real rank's RESULT for a no-op returning None: one frame, no meta.
            rank.send_main(Kind.RESULT, call=msg.call)
            self.answered([rank], msg.call)
        elif kind is Kind.EXEC:
            rank.send_main(Kind.RESULT, rank.value, call=msg.call)
        elif kind is Kind.PING:
            self.last_ping = time.monotonic()
        elif kind is Kind.STOP:
            rank.stopped = True
        elif kind is Kind.INTERRUPT:
            rank.send_ctl(Kind.INTERRUPTED, call=msg.call, meta={"where": ""})
        elif kind is Kind.STACKS:
            flight = msg.meta.get("flight")
            rank.send_ctl(Kind.STACKS_REPLY, [b"[]"] if flight else None, call=msg.call,
                          meta={"threads": [], "busy": 0})
        elif kind is Kind.REFORM:
            generation = int(msg.meta.get("generation", 0))
            rank.send_main(Kind.REFORMED, meta={"generation": generation, "error": ""})

    def close(self) -> None:
        self.epoll.close()
        # destroy, not term: a rank half made (its second socket refused)
        # has a socket no table holds, and term would wait for it forever
        self.ctx.destroy(linger=0)


# -- the floor: raw ZeroMQ, nothing of monarch_nb ------------------------------------------------
def echo_host(endpoint: str, first: int, count: int) -> None:
    """``count`` DEALERs (identities ``e<first>``...) that answer every
    message with ``b"ok"``: the ranks of :func:`floor` (no signing, no
    parsing). Exits when any of them receives ``b"stop"``."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 65536)
    poller = zmq.Poller()
    socks = []
    for i in range(first, first + count):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"e{i}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send(b"ready")
        poller.register(sock, zmq.POLLIN)
        socks.append(sock)
    try:
        while True:
            for sock, _ in poller.poll(1000):
                while True:
                    try:
                        frame = sock.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if frame.bytes == b"stop":
                        return
                    sock.send(b"ok")
    finally:
        ctx.destroy(linger=0)


def floor(n: int, hosts: int, calls: int) -> tuple[list[float], float]:
    """The raw ZeroMQ floor at ``n`` ranks: a ROUTER here sends a 100-byte
    frame to ``n`` DEALERs in ``hosts`` processes and waits for every
    answer, ``calls`` times. Returns (round trips in seconds, this
    process's CPU seconds per rank per round trip)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVHWM, 0)
    router.setsockopt(zmq.SNDHWM, 0)
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    per = -(-n // hosts)
    procs = [subprocess.Popen([sys.executable, str(HERE / "simranks.py"), "--echo", endpoint,
                               str(first), str(min(per, n - first))], env=env,
                              start_new_session=True)
             for first in range(0, n, per)]
    idents = [f"e{i}".encode() for i in range(n)]
    payload = b"x" * 100
    try:
        for _ in range(n):  # every DEALER said "ready"
            router.recv_multipart()

        def round_trip() -> None:
            for ident in idents:
                router.send(ident, zmq.SNDMORE)
                router.send(payload)
            for _ in range(n):
                router.recv()
                router.recv()

        for _ in range(10):
            round_trip()
        times = []
        c0 = time.process_time()
        for _ in range(calls):
            t = time.perf_counter()
            round_trip()
            times.append(time.perf_counter() - t)
        cpu = (time.process_time() - c0) / (calls * n)
        for first in range(0, n, per):
            router.send_multipart([idents[first], b"stop"])
        for p in procs:
            p.wait(10)
        return times, cpu
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        ctx.destroy(linger=0)


def _set_parent_death_signal() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main() -> None:
    # No orphans, as a real rank: killed with the forking thread's process,
    # and gone at once if that process died before the signal was armed.
    _set_parent_death_signal()
    if sys.argv[1:2] == ["--echo"]:
        echo_host(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        os._exit(0)
    parent = os.environ.get(config.ENV_PARENT_PID)
    if parent and os.getppid() != int(parent):
        os._exit(3)
    host = Host()
    try:
        host.serve()
    finally:
        if host.dropped:
            print(f"simranks host {os.getpid()}: dropped {dict(host.dropped)}", file=sys.stderr,
                  flush=True)
        host.close()
    os._exit(0)


if __name__ == "__main__":
    main()
