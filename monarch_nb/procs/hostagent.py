"""The host agent: one process per host of a multi-host mesh, started by the
ssh or SLURM launcher (``python -m monarch_nb.agent``), that starts and
supervises its host's ranks as the controller does for local ones.

For each rank the controller asks for (agentwire ``spawn``) it forks one
from its host's warm process (procs/warm.py, engine/warm.py: torch imported
once per host; the agent is then the rank's parent, as the controller is of
a local rank), or hands the rank to its spare (torch already imported:
spares.py, engine/spare.py), or, with the mesh's ``fork=False`` or once the
warm process failed, starts a fresh ``python -m monarch_nb.worker``; each in
its own session so that its whole process tree goes with it (``kill_tree``).

The warm process starts when the controller says ``warm`` at the mesh's
start (every host's imports torch side by side), or with the first
``spawn`` (the mesh's ``fork`` and ``preload`` come in each, with the other
per-mesh settings), and is never waited for on the control loop: a start
asked for while it imports torch waits in ``pending`` (a thread wakes the
loop when it is ready) and is answered (``started``) once it runs; nothing
in the controller waits for that answer. A fresh interpreter started beside
the import would only import torch a second time on the same cores, so a
start waits as long as the import may take (``warm.READY_TIMEOUT_S``, as a
local rank does). A warm process that fails (a preload that does not
import, a death, a refused fork, no answer in that time) is logged once and
the agent starts fresh interpreters from then on, as the controller's
supervisor does. It watches every
rank's exit (a thread waiting on it) and reports it at once with the rank's
persisted flight records; it reports every rank's process state each tick
(the controller tells a stopped rank from a busy one exactly as for a local
rank: liveness.py), and streams each rank's log back, so ``%monarch logs``
and the death causes read it as they read a local rank's.

The agent runs no user code. Its relay (wire/hostrelay.py) carries both of
each rank's channels (main and control, two links) over its one connection
to the controller, one message per host each way; every message in it
keeps its end-to-end signature, so the relay cannot forge a call.

No orphans: end of file on stdin (the ssh / srun session is gone), a
``stop``, or no line from the controller for ``controller_timeout``
seconds (it pings every heartbeat) ends the agent, and with it every rank
and spare it started (SIGKILL to their process groups after the grace).
Each child also gets the parent-death signal (its parent pid is the
agent's: engine/loop.py).

Non-goals: deciding anything about a death (the controller's policy), the
ranks' calls (their own channel), starting the agent (launchers.py).
"""

from __future__ import annotations

import base64
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

from .. import config, flight
from ..errors import UsageError
from ..wire import link as links
from ..wire.hostrelay import Relay
from . import agentwire, keptagent, keptfiles, spares
from . import warm as warms
from .keptagent import Door
from .liveness import os_state
from .supervisor import kill_tree

TICK_S = 0.2  # states and heartbeat; a SIGSTOP is seen within a tick of the controller asking
LOG_CHUNK = 1 << 20  # at most this much of a rank's log per message
SPARE_AFTER_S = 1.0  # a spare starts this long after the last spawn (the ranks start first)
# what a spare (and the warm process) takes from a rank's spec before it knows its rank
SPARE_ENV = agentwire.IMPORT_ENV


@dataclass
class RankLinks:
    """A rank's two links to the agent's relay (wire/hostrelay.py): its main
    and control channels. Our ends stay here; its ends are passed to it
    (``fds``, named in its environment) and closed here once it has them."""

    ENV = (config.ENV_LINK_FD, config.ENV_CTL_LINK_FD)

    main: socket.socket
    ctl: socket.socket
    their_main: socket.socket | None
    their_ctl: socket.socket | None
    fds: tuple[int, int]

    @classmethod
    def make(cls) -> RankLinks:
        main, their_main = links.pair()
        ctl, their_ctl = links.pair()
        return cls(main, ctl, their_main, their_ctl, (their_main.fileno(), their_ctl.fileno()))

    def env(self) -> dict[str, str]:
        return {config.ENV_LINK_FD: str(self.fds[0]), config.ENV_CTL_LINK_FD: str(self.fds[1])}

    def handed_over(self) -> None:
        for sock in (self.their_main, self.their_ctl):
            if sock is not None:
                sock.close()
        self.their_main = self.their_ctl = None

    def close(self) -> None:
        self.handed_over()
        self.main.close()
        self.ctl.close()


@dataclass
class Child:
    sid: int
    rank: int
    inc: int
    popen: subprocess.Popen[bytes] | warms.Forked
    log_path: str
    log_sent: int = 0  # bytes of its log already sent
    ended: bool = False
    ident: str = ""  # its socket identity prefix (a kept mesh's new controller needs it)
    # its flight records (base64) once it ended: a kept mesh's next controller
    # learns from them the call it died in while nobody was attached
    flight: str = ""


@dataclass
class Pending:
    """A start asked for while the warm process was not ready yet; a signal
    the controller sent it meanwhile is sent once it runs."""

    sid: int
    rank: int
    inc: int
    spec: dict[str, str]
    keep_spare: bool
    signals: list[tuple[int, bool]] = field(default_factory=list)


class DoorOut:
    """A kept agent's channel out: whoever is attached through its door."""

    def __init__(self) -> None:
        self.door: Door | None = None

    def write(self, data: bytes) -> int:
        if self.door is not None:
            self.door.write(data)
        return len(data)

    def flush(self) -> None:
        pass


@dataclass
class Agent:
    out: IO[bytes]
    controller_timeout: float = 10.0
    # named with its pid: whoever kills an agent (a test losing a host) can tidy after it
    folder: str = field(default_factory=lambda: tempfile.mkdtemp(
        prefix=f"monarch-nb-agent-{os.getpid()}-"))
    children: dict[int, Child] = field(default_factory=dict)
    spare: subprocess.Popen[bytes] | warms.Forked | None = None
    spare_log: str = ""
    spare_env: dict[str, str] | None = None
    spare_due: float | None = None
    spare_links: RankLinks | None = None  # the spare's links to our relay (if we relay)
    spare_link_env: dict[str, str] = field(default_factory=dict)  # their numbers in the spare
    # the host's warm process (procs/warm.py): the mesh's ``fork`` and
    # ``preload`` as the last spawn gave them; ``fork_off``: why it stopped
    warm: warms.WarmProcess | None = None
    warm_settings: tuple[bool, tuple[str, ...]] = (False, ())
    warm_spec: dict[str, str] = field(default_factory=dict)  # the import's env, from the last spawn
    fork_off: str = ""
    pending: list[Pending] = field(default_factory=list)
    _warms: int = 0
    _wake: queue.Queue[bytes | None] | None = None  # the control loop's lines
    relay: Relay | None = None
    stopping: bool = False
    door: Door | None = None  # a kept mesh's agent: controllers come and go (keptagent.py)
    _heard: float = field(default_factory=time.monotonic)  # the controller's last line
    _out_lock: threading.Lock = field(default_factory=threading.Lock)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, op: str, **fields: Any) -> None:
        data = agentwire.encode(op, **fields)
        with self._out_lock:
            try:
                self.out.write(data)
                self.out.flush()
            except (OSError, ValueError):
                pass  # the controller is gone: stdin's end will stop us

    # -- the control loop (main thread: every fork happens here) -------------------------------
    def run(self, lines: queue.Queue[bytes | None]) -> int:
        os.chmod(self.folder, 0o700)
        self._wake = lines
        self.send("hello", host=socket.gethostname(), pid=os.getpid())
        threading.Thread(target=self._ticker, name="monarch-nb-agent-tick", daemon=True).start()
        grace = 3.0
        while True:
            try:
                line = lines.get(timeout=min(TICK_S, self.controller_timeout))
            except queue.Empty:
                line = b""
                if time.monotonic() - self._heard > self.controller_timeout:
                    if self.door is None:
                        sys.stderr.write(f"monarch_nb agent: controller silent for "
                                         f"{self.controller_timeout:.0f} s, stopping\n")
                        break
                    if self.door.current is not None:  # kept: the lease starts instead
                        sys.stderr.write(f"monarch_nb agent: controller silent for "
                                         f"{self.controller_timeout:.0f} s, letting it go\n")
                        self.door.let_go()
                    self._heard = time.monotonic()
            if self.door is not None and self.door.expired(time.monotonic()):
                sys.stderr.write(f"monarch_nb agent: no controller attached for "
                                 f"{self.door.keep_alive:g} s (keep_alive): the mesh ends\n")
                break
            if line is None:
                break  # end of file: the session is gone
            if line:
                self._heard = time.monotonic()
                try:
                    msg = agentwire.decode(line, agentwire.TO_AGENT)
                except ValueError as exc:
                    self.send("error", text=f"dropped a malformed line: {exc}")
                    continue
                if msg["op"] == "stop":
                    grace = float(msg["grace"])
                    break
                self._handle(msg)
            self._start_pending()
            self._keep_spare()
        self.shutdown(grace)
        return 0

    def _handle(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "spawn":
            try:
                env = agentwire.string_map(msg["env"])
            except ValueError as exc:
                self.send("error", text=str(exc))
                return
            if msg["relay"] and self.relay is None:  # the controller routes through us from now
                self.relay = Relay(msg["relay"], env[config.ENV_CONTROLLER],
                                   config.curve_keys(env), _max_bytes(env), _key(env))
            self._want_warm(bool(msg["fork"]), msg["preload"], env)
            if self.pending or self._warming():  # in order, after the ones waiting already
                self.pending.append(Pending(msg["sid"], msg["rank"], msg["inc"], env,
                                            bool(msg["spare"])))
                return
            self.spawn(msg["sid"], msg["rank"], msg["inc"], env, bool(msg["spare"]))
        elif op == "warm":
            try:
                env = agentwire.string_map(msg["env"])
            except ValueError as exc:
                self.send("error", text=str(exc))
                return
            self._want_warm(msg["fork"], msg["preload"], env)
        elif op == "keep" and self.door is not None:
            self.door.state = msg["state"]
        elif op == "detach" and self.door is not None:
            self.door.let_go()
        elif op == "signal":
            waiting = next((p for p in self.pending if p.sid == msg["sid"]), None)
            if waiting is not None and msg["sig"] in (signal.SIGKILL, signal.SIGTERM):
                # a start still waiting for the warm process is not made at
                # all: it "died" of the signal now, not once the import is done
                self.pending.remove(waiting)
                self.send("exit", sid=waiting.sid, code=-int(msg["sig"]), flight="")
                return
            if waiting is not None:
                waiting.signals.append((msg["sig"], msg["tree"]))
                return
            child = next((c for c in self.children.values() if c.sid == msg["sid"]), None)
            self._signal(child, msg["sig"], msg["tree"])

    @staticmethod
    def _signal(child: Child | None, sig: int, tree: bool) -> None:
        if child is None or child.ended:
            return
        try:
            if tree:
                kill_tree(child.popen.pid, sig)
            else:
                os.kill(child.popen.pid, sig)
        except (ProcessLookupError, ValueError, OSError):
            pass

    def spawn(self, sid: int, rank: int, inc: int, spec: dict[str, str],
              keep_spare: bool) -> Child:
        log_path = os.path.join(self.folder, f"rank{rank}.{inc}.{sid}.log")
        env = {**os.environ, **spec, config.ENV_PARENT_PID: str(os.getpid()),
               flight.PERSIST_ENV: flight.persist_path(log_path)}
        for name in RankLinks.ENV:
            env.pop(name, None)
        popen: subprocess.Popen[bytes] | warms.Forked | None = None
        pair: RankLinks | None = None
        if self.spare is not None and spares.is_waiting(self.spare_log):
            candidate, self.spare = self.spare, None
            pair, self.spare_links = self.spare_links, None
            if pair is not None:
                env.update(self.spare_link_env)  # their numbers there (a forked spare's differ)
            if spares.assign(candidate, env, log_path):
                popen = candidate
            else:
                spares.discard(candidate)
                if pair is not None:
                    pair.close()
                    pair = None
                for name in RankLinks.ENV:
                    env.pop(name, None)
        from_spare = popen is not None
        if popen is None:
            pair = RankLinks.make() if self.relay is not None else None
            if pair is not None:
                env.update(pair.env())
            try:
                popen = self._fork_rank(env, log_path, pair)
                if popen is None:  # fork=False, the warm process not ready or failed
                    with open(log_path, "ab", buffering=0, opener=config.private) as log:
                        popen = subprocess.Popen(
                            [sys.executable, "-m", "monarch_nb.worker"], env=env,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, close_fds=True,
                            pass_fds=() if pair is None else pair.fds)
            except BaseException:
                if pair is not None:
                    pair.close()
                raise
            finally:
                if pair is not None:
                    pair.handed_over()  # the rank holds its ends now
        if pair is not None and self.relay is not None:
            ident = spec.get(config.ENV_IDENTITY) or f"r{rank}.{inc}"
            self.relay.add(f"{ident}.main", pair.main)
            self.relay.add(f"{ident}.ctl", pair.ctl)
        child = Child(sid, rank, inc, popen, log_path,
                      ident=spec.get(config.ENV_IDENTITY) or f"r{rank}.{inc}")
        with self._lock:
            old = self.children.get(rank)
            self.children[rank] = child
        if old is not None and not old.ended:
            kill_tree(old.popen.pid)  # a rank has one process
        self.send("started", sid=sid, pid=popen.pid, spare=from_spare)
        threading.Thread(target=self._wait, args=(child,), name=f"monarch-nb-agent-wait-{rank}",
                         daemon=True).start()
        if keep_spare:
            self.spare_env = {**os.environ, **{k: v for k, v in spec.items() if k in SPARE_ENV},
                              config.ENV_PARENT_PID: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
            self.spare_due = time.monotonic() + SPARE_AFTER_S
        return child

    def _keep_spare(self) -> None:
        """Start the spare once the ranks had their start (main thread):
        forked from the warm process when ranks are, else fresh."""
        self._revive_warm()
        if self.spare is not None and self.spare.poll() is not None:
            self.spare = None  # it died (out of memory?): a new one
            self.spare_due = time.monotonic() + SPARE_AFTER_S
            if self.spare_links is not None:
                self.spare_links.close()
                self.spare_links = None
        if (self.spare is None and self.spare_env is not None and self.spare_due is not None
                and time.monotonic() >= self.spare_due and not self.stopping
                and not self._warming()):  # (a fresh one would import torch beside it)
            self.spare_log = os.path.join(self.folder, f"spare{time.monotonic_ns()}.log")
            pair = RankLinks.make() if self.relay is not None else None
            try:
                made = self._fork_spare(self.spare_env, pair)
                if made is None:
                    self.spare = spares.start(self.spare_env, self.spare_log,
                                              () if pair is None else pair.fds)
                    self.spare_link_env = {} if pair is None else pair.env()
                else:
                    self.spare, self.spare_link_env = made
            except BaseException:
                if pair is not None:
                    pair.close()
                raise
            if pair is not None:
                pair.handed_over()
            self.spare_links = pair  # named to it in its assignment

    # -- the warm process (procs/warm.py; main thread, never waited for here) ------------------
    def _want_warm(self, fork: bool, preload: list[Any], spec: dict[str, str]) -> None:
        """The mesh's ``fork`` and ``preload`` (every spawn carries them):
        start the warm process (not waiting for it), or another one for new
        settings (a kept mesh's next controller) or after a death, or none."""
        try:
            names = config.parse_preload(preload)
        except UsageError as exc:  # (the controller checked them: not one of ours)
            self.send("error", text=f"spawn: {exc}")
            fork, names = False, ()
        self.warm_spec = spec
        if (fork, names) != self.warm_settings:
            self.warm_settings = (fork, names)
            self._stop_warm()
            self.fork_off = ""  # new settings: a new try
        if not fork or self.fork_off or self.stopping or not warms.available():
            return
        if self.warm is not None:
            if self.warm.popen.poll() is None:
                return
            self._stop_warm()  # it died after it was ready (out of memory?): another one
        env = {**os.environ, **{k: v for k, v in spec.items() if k in SPARE_ENV}}
        for var in (config.ENV_LINK_FD, config.ENV_CTL_LINK_FD, config.ENV_SPARE):
            env.pop(var, None)
        self._warms += 1
        try:
            warm = warms.WarmProcess.start(env, os.path.join(self.folder, f"warm{self._warms}.log"),
                                           names)
        except OSError as exc:
            self._warm_failed(f"it could not start: {exc}")
            return
        self.warm = warm
        threading.Thread(target=self._watch_warm, args=(warm,), daemon=True,
                         name="monarch-nb-agent-warm").start()

    def _revive_warm(self) -> None:
        """A warm process that died after it was ready (the OOM killer, a
        stray kill) is replaced at once, before anything forks from it: a
        fork from a dead one would turn forking off for good."""
        warm = self.warm
        if warm is not None and warm.ready and warm.popen.poll() is not None:
            fork, names = self.warm_settings
            self._want_warm(fork, list(names), self.warm_spec)

    def _watch_warm(self, warm: warms.WarmProcess) -> None:
        """Wait for the warm process's import off the control loop, then
        wake the loop (its waiting starts go on, or fresh if it failed)."""
        try:
            warm.wait_ready()
        except Exception:  # its error is in ``warm.error``, which the loop reads
            if not warm.error:
                warm.error = "its socket failed"
        if self._wake is not None:
            self._wake.put(b"")

    def _warming(self) -> bool:
        """The warm process imports torch still: a start waits for it."""
        warm = self.warm
        return (warm is not None and not warm.ready and not warm.error and not self.fork_off
                and warm.popen.poll() is None)

    def _start_pending(self) -> None:
        """The starts that waited for the warm process: forked once it is
        ready, fresh once it failed (or gave no answer in its time)."""
        warm = self.warm
        if warm is not None and warm.error and not warm.ready:
            self._warm_failed(warm.error)
        while self.pending:
            first = self.pending[0]
            if self._warming():
                return
            self.pending.pop(0)
            child = self.spawn(first.sid, first.rank, first.inc, first.spec, first.keep_spare)
            for sig, tree in first.signals:
                self._signal(child, sig, tree)

    def _fork_rank(self, env: dict[str, str], log_path: str,
                   pair: RankLinks | None) -> warms.Forked | None:
        """``env``'s rank forked from the warm process (our child); None
        when it is not ready or fails now (a fresh interpreter then)."""
        warm = self.warm
        if warm is None or not warm.ready or self.fork_off:
            return None
        fds = {} if pair is None else dict(zip(RankLinks.ENV, pair.fds, strict=True))
        try:
            return warm.fork(env, log_path, fds)
        except (warms.WarmError, OSError, ValueError) as exc:
            self._warm_failed(str(exc))
            return None

    def _fork_spare(self, env: dict[str, str], pair: RankLinks | None
                    ) -> tuple[warms.Forked, dict[str, str]] | None:
        """A spare forked from the warm process, its assignment to come on a
        pipe as a fresh spare's, and the numbers its link ends have there."""
        warm = self.warm
        if warm is None or not warm.ready or self.fork_off:
            return None
        fds = {} if pair is None else dict(zip(RankLinks.ENV, pair.fds, strict=True))
        r, w = os.pipe()
        try:
            child = warm.fork({**env, config.ENV_SPARE: "1"}, self.spare_log, fds, None, r)
        except (warms.WarmError, OSError, ValueError) as exc:
            os.close(w)
            self._warm_failed(str(exc))
            return None
        finally:
            os.close(r)
        child.stdin = os.fdopen(w, "wb", buffering=0)
        return child, {name: str(child.fds[name]) for name in fds}

    def _warm_failed(self, why: str) -> None:
        """Fresh interpreters from now on, said once (here and to the controller)."""
        if self.fork_off:
            return
        self.fork_off = why
        text = (f"ranks start as fresh interpreters from now on: the warm process cannot fork "
                f"({why})")
        sys.stderr.write(f"monarch_nb agent: {text}\n")
        self.send("error", text=text)
        self._stop_warm()

    def _stop_warm(self) -> None:
        warm, self.warm = self.warm, None
        if warm is not None:
            try:
                warm.stop()
            except (OSError, subprocess.TimeoutExpired):
                warm.kill_now()

    def _wait(self, child: Child) -> None:
        code = child.popen.wait()
        kill_tree(child.popen.pid)  # its DataLoader workers and other children
        path = flight.persist_path(child.log_path)
        try:
            with open(path, "rb") as f:
                records = base64.b64encode(f.read()).decode()
            os.unlink(path)
        except OSError:
            records = ""
        with self._lock:
            self._send_log(child)
            child.ended = True
            child.flight = records
        self.send("exit", sid=child.sid, code=code, flight=records)

    def on_attach(self) -> dict[str, Any]:
        """A controller attached to this kept mesh (keptagent.Door): its
        ranks' processes and what the last controller asked to keep. Their
        logs are sent again from the start (the new controller has none)."""
        self._heard = time.monotonic()
        with self._lock:
            children = []
            for child in self.children.values():
                child.log_sent = 0
                children.append({"sid": child.sid, "rank": child.rank, "inc": child.inc,
                                 "pid": child.popen.pid, "ident": child.ident,
                                 "code": child.popen.returncode if child.ended else None,
                                 "flight": child.flight})
        assert self.door is not None
        return {"children": children, "state": self.door.state,
                "relay": self.relay.ident if self.relay is not None else ""}

    # -- the ticker: states, logs, heartbeat ---------------------------------------------------
    def _ticker(self) -> None:
        while not self.stopping:
            with self._lock:
                live = [c for c in self.children.values() if not c.ended]
                for child in live:
                    self._send_log(child)
            states = {str(c.sid): os_state(c.popen.pid) or "?" for c in live}
            relay = self.relay
            self.send("tick", states=states, relay={} if relay is None else relay.counts())
            time.sleep(TICK_S)

    def _send_log(self, child: Child) -> None:
        try:
            with open(child.log_path, "rb") as f:
                f.seek(child.log_sent)
                data = f.read(LOG_CHUNK)
        except OSError:
            return
        while data:
            child.log_sent += len(data)
            self.send("log", sid=child.sid, data=data.decode("utf-8", "surrogateescape"))
            if len(data) < LOG_CHUNK:
                return
            try:
                with open(child.log_path, "rb") as f:
                    f.seek(child.log_sent)
                    data = f.read(LOG_CHUNK)
            except OSError:
                return

    def shutdown(self, grace: float) -> None:
        """Every rank and the spare go: asked to stop by the controller over
        their own channel already, the ones alive after ``grace`` are killed."""
        self.stopping = True
        self.pending.clear()  # never started: the controller stops anyway
        self._stop_warm()  # forks nothing more; its ranks are ours, stopped below
        if self.spare is not None:
            spares.discard(self.spare)
        if self.spare_links is not None:
            self.spare_links.close()
        deadline = time.monotonic() + grace
        for child in list(self.children.values()):
            try:
                child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            kill_tree(child.popen.pid)
            try:
                child.popen.kill()
                child.popen.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.relay is not None:
            self.relay.close()
        if self.door is not None:
            self.door.close()  # a kept mesh's logs stay (keptfiles.py)
        else:
            shutil.rmtree(self.folder, ignore_errors=True)


def _key(env: dict[str, str]) -> bytes | None:
    """The mesh key the ranks get (the relay folds their equal results with
    it: wire/fold.py); None: no folding, every result goes up as it came."""
    try:
        return config.read_key(env)
    except (UsageError, OSError, ValueError):
        return None


def _max_bytes(env: dict[str, str]) -> int:
    value = env.get(config.ENV_MAX_MESSAGE, "")
    return int(value) if value.isdigit() else 4 << 30


def _read_lines(stream: IO[bytes], lines: queue.Queue[bytes | None]) -> None:
    try:
        for line in iter(lambda: stream.readline(agentwire.MAX_LINE + 1), b""):
            lines.put(line)
    except (OSError, ValueError):
        pass
    lines.put(None)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m monarch_nb.agent",
                                description="A monarch_nb host agent (started by the launcher; "
                                            "it reads its orders on stdin).")
    p.add_argument("--controller-timeout", type=float, default=10.0)
    p.add_argument("--kept", metavar="NAME", help="the door to kept mesh NAME's agent "
                   "(keptagent.py): stdin and stdout are its channel")
    p.add_argument("--serve-kept", metavar="NAME", help=argparse.SUPPRESS)
    p.add_argument("--keep-alive", type=float, default=1800.0)
    p.add_argument("--key-fd", type=int, default=-1, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    tail = ["--keep-alive", f"{ns.keep_alive:g}", "--controller-timeout",
            f"{ns.controller_timeout:g}"]
    if ns.kept:
        return keptagent.door_main(ns.kept, tail)
    if ns.serve_kept:
        return _serve_kept(ns.serve_kept, ns.keep_alive, ns.controller_timeout, ns.key_fd)
    # stdout is the channel: anything else printed goes to stderr (the agent's log)
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller stops us, not a stray ^C
    lines: queue.Queue[bytes | None] = queue.Queue()
    signal.signal(signal.SIGTERM, lambda *_: lines.put(None))  # srun's TERM: as end of file
    threading.Thread(target=_read_lines, args=(sys.stdin.buffer, lines), daemon=True,
                     name="monarch-nb-agent-stdin").start()
    return Agent(out, ns.controller_timeout).run(lines)


def _serve_kept(name: str, keep_alive: float, controller_timeout: float, key_fd: int) -> int:
    """A kept mesh's agent (keptagent.py): its own session, adopted by init,
    its channel the door's socket."""
    key = keptagent.read_daemon_key(key_fd)
    if os.getpgid(0) != os.getpid():  # a group of our own: no signal to the starter's reaches us
        os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    lines: queue.Queue[bytes | None] = queue.Queue()
    signal.signal(signal.SIGTERM, lambda *_: lines.put(None))  # `monarch-nb stop`, a shutdown
    out = DoorOut()
    agent = Agent(out, controller_timeout, folder=keptfiles.log_dir(name))  # type: ignore[arg-type]
    door = keptagent.Door(name, key, keep_alive, lines, agent.on_attach, os.getpid())
    out.door = agent.door = door
    return agent.run(lines)


__all__ = ["Agent", "main"]
