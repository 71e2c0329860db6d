"""The host agent of a kept mesh: owned by no controller, reached by a door.

A kept mesh's ranks must outlive the controller (a kernel restarted,
killed, out of memory), so they are not the kernel's children: this
machine's host agent starts them (hostagent.py, as for a remote host), and
the agent runs as a daemon of its own session (``--serve-kept``), started
by the first controller and adopted by init. It listens on a Unix socket in
the user's private runtime folder (keptfiles.py), and each controller talks
to it through a *door*: ``python -m monarch_nb.agent --kept NAME``, a small
process whose stdin and stdout are the agent's JSON-lines channel
(agentwire.py), exactly as an ssh session is for a remote agent; so the
controller's side (agents.HostAgent) is the same for both.

Admission: the agent sends a fresh ``challenge`` nonce; the controller
answers ``attach`` with the HMAC-SHA256 of the nonce under the mesh key
(which only the 0600 record holds). A wrong answer is dropped, counted and
said in the agent's log; nothing else is read from that connection. One
controller at a time: an attach while another is attached is refused with
who holds it, unless ``force``, which tells the old one ``taken`` and closes
its connection.

The lease: while no controller is attached (its door closed: the kernel is
gone; or silent for ``controller_timeout``), the agent keeps the ranks for
``keep_alive`` seconds; then everything ends (the agent's usual shutdown)
and the runtime files go (the logs stay).

Non-goals: the agent's supervision (hostagent.py), the files (keptfiles.py),
what a controller does at attach (controller/keep.py).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import queue
import secrets
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from . import agentwire, keptfiles

HANDSHAKE_S = 30.0  # an attach must answer its challenge within this (a loaded machine)
DOOR_WAIT_S = 15.0  # the door waits this long for a new agent's socket


def attach_mac(key: bytes, nonce: str) -> str:
    """The answer to a challenge: only a holder of the mesh key can make it."""
    return hmac.new(key, b"monarch-nb attach " + nonce.encode(), hashlib.sha256).hexdigest()


class Door:
    """The agent's Unix socket: admits one controller at a time, feeds its
    lines to the agent (``lines``) and writes the agent's to it."""

    def __init__(self, name: str, key: bytes, keep_alive: float,
                 lines: queue.Queue[bytes | None], on_attach: Callable[[], dict[str, Any]],
                 agent_pid: int) -> None:
        self.name, self.key, self.keep_alive = name, key, keep_alive
        self._lines, self._on_attach, self.agent_pid = lines, on_attach, agent_pid
        self.state: dict[str, Any] = {}  # what the controller asked to keep ("keep")
        self.forged = 0  # attaches with a wrong answer
        self.current: socket.socket | None = None
        self.holder: dict[str, Any] = {}
        self.detached_since: float | None = time.monotonic()  # the lease runs from here
        self._lock = threading.Lock()
        self._status_lock = threading.Lock()
        self._closed = False
        path = keptfiles.socket_path(name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # 0600 from the first moment
        try:
            self.sock.bind(path)
        finally:
            os.umask(old)
        self.sock.listen(8)
        self._status()
        threading.Thread(target=self._accept, name="monarch-nb-kept-door", daemon=True).start()

    # -- for the agent --------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        with self._lock:
            conn = self.current
        if conn is None:
            return  # nobody attached: the agent's reports go nowhere (they are kept in state)
        try:
            conn.sendall(data)
        except OSError:
            self._drop(conn)

    def expired(self, now: float) -> bool:
        since = self.detached_since
        return since is not None and now - since > self.keep_alive

    def let_go(self) -> None:
        """The controller detached, or went silent: the lease starts."""
        with self._lock:
            conn = self.current
        if conn is not None:
            self._drop(conn)

    def close(self) -> None:
        """The mesh ends: no more attaches, the runtime files go."""
        self._closed = True
        keptfiles.remove(self.name)  # first: a controller that saw us go finds nothing
        try:
            self.sock.close()
        except OSError:
            pass
        with self._lock:
            conn, self.current = self.current, None
        if conn is not None:
            conn.close()

    # -- connections ----------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(conn,), daemon=True,
                             name="monarch-nb-kept-admit").start()

    def _admit(self, conn: socket.socket) -> None:
        nonce = secrets.token_hex(16)
        reader = conn.makefile("rb")
        try:
            conn.sendall(agentwire.encode("challenge", nonce=nonce))
            conn.settimeout(HANDSHAKE_S)
            line = reader.readline(agentwire.MAX_LINE + 1)
            conn.settimeout(None)
            msg = agentwire.decode(line, agentwire.TO_AGENT)
            if msg["op"] != "attach":
                raise ValueError(f"{msg['op']} before attach")
        except (OSError, ValueError) as exc:
            sys.stderr.write(f"monarch_nb agent: dropped a connection that did not attach: {exc}\n")
            conn.close()
            return
        if not hmac.compare_digest(str(msg["mac"]), attach_mac(self.key, nonce)):
            self.forged += 1
            sys.stderr.write(f"monarch_nb agent: dropped a forged attach "
                             f"({self.forged} so far): not signed with the mesh key\n")
            _send_quietly(conn, agentwire.encode("refused", text="not signed with this "
                                                 "mesh's key"))
            conn.close()
            return
        with self._lock:
            old, holder = self.current, dict(self.holder)
            if old is not None and not msg["force"]:
                _send_quietly(conn, agentwire.encode("refused", text=_held_by(self.name, holder)))
                conn.close()
                return
            self.current = conn
            self.holder = {"pid": msg["pid"], "host": msg["host"], "since": time.time()}
            self.detached_since = None
        if old is not None:  # a takeover: the old controller hears it, then its door closes
            _send_quietly(old, agentwire.encode(
                "taken", text=f"taken over by pid {msg['pid']} on {msg['host']}"))
            _close_quietly(old)
        self._status()
        reply = self._on_attach()
        try:
            conn.sendall(agentwire.encode("attached", **reply))
        except OSError:
            self._drop(conn)
            return
        try:
            for line in iter(lambda: reader.readline(agentwire.MAX_LINE + 1), b""):
                with self._lock:
                    if self.current is not conn:
                        break
                self._lines.put(line)
        except (OSError, ValueError):
            pass
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        with self._lock:
            if self.current is not conn:
                return
            self.current, self.holder = None, {}
            self.detached_since = time.monotonic()
        _close_quietly(conn)
        if not self._closed:
            self._status()

    def _status(self) -> None:
        # one writer at a time: the admitting thread and the agent's (a
        # detach) write it at the same moment, and the newest must land last
        with self._status_lock:
            with self._lock:
                attached = dict(self.holder)
            keptfiles.write_status(self.name, {
                "agent_pid": self.agent_pid, "attached": attached,
                "detached_since": None if attached else time.time()})


def _held_by(name: str, holder: dict[str, Any]) -> str:
    since = time.strftime("%H:%M:%S", time.localtime(float(holder.get("since", 0))))
    return (f"kept mesh {name!r} is attached to pid {holder.get('pid')} on "
            f"{holder.get('host')} since {since}; attach with force=True (%monarch attach "
            f"{name} --force) to take it over")


def _send_quietly(conn: socket.socket, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:
        pass


def _close_quietly(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


# -- the door process: the controller's end -----------------------------------------------
def door_main(name: str, argv_tail: list[str]) -> int:
    """``python -m monarch_nb.agent --kept NAME``: connect stdin/stdout to
    NAME's agent, starting the agent first if the first line says so
    (``{"op": "door", "key": ..., "start": true}``; the key goes to a new
    agent on its stdin, never on a command line)."""
    first = _first_line(0)
    try:
        msg = agentwire.decode(first, agentwire.TO_AGENT)
        if msg["op"] != "door":
            raise ValueError("expected door")
    except ValueError as exc:
        sys.stdout.buffer.write(agentwire.encode("refused", text=f"bad door line: {exc}"))
        return 2
    path = keptfiles.socket_path(name)
    conn = _connect(path)
    if conn is None:
        if not msg["start"]:
            sys.stdout.buffer.write(agentwire.encode(
                "refused", text=f"kept mesh {name!r} is gone: its agent is not running "
                                "(its lease ran out, or it was stopped)"))
            sys.stdout.buffer.flush()
            return 1
        try:
            conn = start_daemon(name, bytes.fromhex(msg["key"]), argv_tail)
        except OSError as exc:
            sys.stdout.buffer.write(agentwire.encode("refused", text=str(exc)))
            sys.stdout.buffer.flush()
            return 1
    _pump(conn)
    return 0


def start_daemon(name: str, key: bytes, argv_tail: list[str]) -> socket.socket:
    """Start kept mesh ``name``'s agent, detached (a shell forks it and
    exits at once: init adopts it, nobody has to reap it, and the caller's
    death is nothing to it), and connect to it. The key reaches it through a
    pipe it inherits, never on a command line. OSError if it does not come up."""
    log_path = os.path.join(keptfiles.log_dir(name), "agent.log")
    read_end, write_end = os.pipe()
    try:
        shell = subprocess.Popen(
            ["sh", "-c", '"$@" </dev/null >>"$LOG" 2>&1 &', "sh", sys.executable, "-m",
             "monarch_nb.agent", "--serve-kept", name, "--key-fd", str(read_end), *argv_tail],
            env={**os.environ, "LOG": log_path}, pass_fds=(read_end,),
            start_new_session=True, stdin=subprocess.DEVNULL)
        os.close(read_end)
        read_end = -1
        os.write(write_end, key.hex().encode() + b"\n")
    finally:
        os.close(write_end)
        if read_end >= 0:
            os.close(read_end)
    shell.wait()
    path = keptfiles.socket_path(name)
    deadline = time.monotonic() + DOOR_WAIT_S
    while time.monotonic() < deadline:
        conn = _connect(path)
        if conn is not None:
            return conn
        time.sleep(0.02)
    raise OSError(f"the agent of kept mesh {name!r} did not start (see {log_path})")


class _Writer:
    """The controller's side of a local session: what HostAgent writes to."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.closed = False

    def write(self, data: bytes) -> int:
        self._sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._sock.shutdown(socket.SHUT_WR)  # the agent reads its end: we let go
            except OSError:
                pass


class LocalSession:
    """A kept agent on this machine, reached in-process through its socket:
    what a door process's ``Popen`` offers HostAgent (``stdin``, ``stdout``,
    ``wait``, ``poll``, ``kill``), without a process to start (an attach on
    this machine costs no interpreter start-up)."""

    pid = 0  # no process of ours: nothing to signal

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.stdin = _Writer(sock)
        self.stdout = sock.makefile("rb")
        self.args = "kept agent"
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The session ends when the agent closes it (its reader saw the end)."""
        if self.returncode is None:
            ready, _, _ = select.select([self._sock], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            try:
                if self._sock.recv(1, socket.MSG_PEEK):
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            except OSError:
                pass
            self.returncode = 0
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9 if self.returncode is None else self.returncode
        _close_quietly(self._sock)


def open_local(name: str, key: bytes, start: bool, argv_tail: list[str]) -> LocalSession:
    """A session with kept mesh ``name``'s agent on this machine, starting it if
    ``start``; OSError if it is not running (and may not be started)."""
    conn = _connect(keptfiles.socket_path(name))
    if conn is None:
        if not start:
            raise OSError(f"kept mesh {name!r} is gone: its agent is not running (its lease "
                          "ran out, or it was stopped)")
        conn = start_daemon(name, key, argv_tail)
    return LocalSession(conn)


def _first_line(fd: int) -> bytes:
    """One line of ``fd``, read a byte at a time: what follows it is the
    agent's, and a buffered reader would swallow it."""
    data = bytearray()
    while len(data) < agentwire.MAX_LINE:
        byte = os.read(fd, 1)
        if not byte:
            break
        data += byte
        if byte == b"\n":
            break
    return bytes(data)


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def _pump(conn: socket.socket) -> None:
    """stdin -> the agent, the agent -> stdout, until either side ends."""
    fin, fout = sys.stdin.buffer.fileno(), sys.stdout.buffer.fileno()
    cfd = conn.fileno()
    while True:
        ready, _, _ = select.select([fin, cfd], [], [])
        if fin in ready:
            data = os.read(fin, 1 << 16)
            if not data:
                break  # the controller is gone: the agent's lease starts
            conn.sendall(data)
        if cfd in ready:
            try:
                data = conn.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            try:
                _write_all(fout, data)
            except OSError:
                break
    _close_quietly(conn)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_daemon_key(fd: int) -> bytes:
    """A new kept agent's key: the one line written on the pipe ``fd``."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    os.close(fd)
    return bytes.fromhex(data.decode().strip())


__all__ = ["Door", "LocalSession", "attach_mac", "door_main", "open_local", "read_daemon_key",
           "start_daemon"]
