"""The requester's side of a host's warm process: start it, ask it for a
rank, stop it. Used by the controller's supervisor and by a host agent.

A warm process (engine/warm.py for its own side) is one ``python -m
monarch_nb.worker`` with ``MONARCH_NB_WARM=1`` that imported torch and
forks ranks on request. It is started like a rank (own session, log file,
parent-death signal from the thread that starts it), its stdin one end of a
``SOCK_SEQPACKET`` pair whose other end stays here.

A forked rank must be *our* child, as a fresh one is: we wait for it (its
exit status and pidfd), the rank's parent-death signal fires when we die,
and its parent check (``MONARCH_NB_PARENT_PID``) holds. The warm process
therefore double-forks, and while a request is answered this process is a
child subreaper (``PR_SET_CHILD_SUBREAPER``): the rank, orphaned when the
intermediate exits, is reparented to us, not to init. The attribute is set
only for the request (a few milliseconds), under one lock, and put back as
it was: a subreaper gets every orphan below it, and a kernel must not
collect its user's orphaned grandchildren as zombies nobody waits for. (An
orphan of one of our other descendants that happens to be made in those
milliseconds is still adopted; it stays a zombie until we exit.)

Reparenting gives the rank's real parent as our main thread (the kernel's
pick among our threads), so its parent-death signal follows the process
rather than the spawner thread; the warm process itself, like every
process we start, is forked by the spawner thread (spawner.py).

Non-goals: when to fork (supervisor.py, hostagent.py), becoming a rank
(engine/warm.py).
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO

from .. import config

PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
READY_TIMEOUT_S = 120.0  # import torch (and the user's modules) on a loaded machine
FORK_TIMEOUT_S = 10.0  # a double fork takes milliseconds
_subreaper_lock = threading.Lock()


class WarmError(RuntimeError):
    """The warm process cannot fork (it died, or a check refused): start a
    fresh interpreter instead. ``str()`` says why."""


def available() -> bool:
    """Forking from a warm process needs Linux's subreapers and pidfds."""
    return sys.platform.startswith("linux") and hasattr(socket, "send_fds")


@dataclass
class WarmProcess:
    """A started warm process and our end of its socket."""

    popen: subprocess.Popen[bytes]
    sock: socket.socket
    log_path: str
    ready: bool = False
    error: str = ""  # why it cannot fork (once known)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @classmethod
    def start(cls, env: dict[str, str], log_path: str,
              preload: tuple[str, ...] = ()) -> WarmProcess:
        """Start one (on the thread whose end is its parent-death signal's:
        the spawner thread). ``env``: what torch reads at import is the
        ranks' (``OMP_NUM_THREADS``...); no key in it."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**env, config.ENV_WARM: "1", config.ENV_PRELOAD: ",".join(preload),
               config.ENV_PARENT_PID: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        try:
            with open(log_path, "ab", buffering=0, opener=config.private) as log:
                popen = subprocess.Popen(
                    [sys.executable, "-m", "monarch_nb.worker"], env=env, stdin=theirs.fileno(),
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(popen, ours, log_path)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Block until it imported everything; WarmError if it cannot fork
        (``error`` says why: a preload that failed to import, a death)."""
        with self._lock:
            if self.ready:
                return
            if self.error:
                raise WarmError(self.error)
            reply = self._recv(timeout)
            if reply.get("ready") is True:
                self.ready = True
                return
            self.error = str(reply.get("error") or "it exited before it was ready")
            raise WarmError(self.error)

    def fork(self, env: dict[str, str], log_path: str, fds: dict[str, int] | None = None,
             cwd: str | None = None, stdin: int | None = None) -> Forked:
        """A new rank process with ``env`` (the fds named in it by ``fds``,
        env var -> our fd, become its own, their numbers set there: see
        ``Forked.fds``), its output appended to ``log_path``, its stdin
        ``stdin`` (a spare's pipe) or /dev/null: our child, as a ``Popen``
        one."""
        self.wait_ready()
        names = list(fds or {})
        passed = [(fds or {})[n] for n in names] + ([] if stdin is None else [stdin])
        request = {"env": env, "log": log_path, "cwd": cwd or os.getcwd(),
                   "parent": os.getpid(), "fd_env": {n: i for i, n in enumerate(names)},
                   "stdin": None if stdin is None else len(names)}
        data = json.dumps(request).encode()
        with self._lock, _subreaper_lock:
            was = _subreaper(None)
            _subreaper(True)
            try:
                try:
                    socket.send_fds(self.sock, [data], passed)
                except OSError as exc:
                    self.error = f"its socket failed ({exc})"
                    raise WarmError(self.error) from None
                reply = self._recv(FORK_TIMEOUT_S)
            finally:
                _subreaper(bool(was))
        pid, numbers = reply.get("pid"), reply.get("fds")
        if isinstance(pid, int):
            return Forked(pid, dict(numbers) if isinstance(numbers, dict) else {})
        self.error = str(reply.get("error") or "no answer")
        raise WarmError(self.error)

    def _recv(self, timeout: float) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return {"error": f"no answer within {timeout:g} s"}
            if self.popen.poll() is not None and not select.select([self.sock], [], [], 0)[0]:
                return {"error": f"it exited ({self.popen.returncode}); see {self.log_path}"}
            if not select.select([self.sock], [], [], min(left, 0.2))[0]:
                continue
            try:
                data = self.sock.recv(1 << 16)
            except OSError as exc:
                return {"error": f"its socket failed ({exc})"}
            if not data:
                self.popen.wait(5.0)
                return {"error": f"it exited ({self.popen.returncode}); see {self.log_path}"}
            reply = json.loads(data)
            return reply if isinstance(reply, dict) else {"error": "unreadable answer"}

    def stop(self) -> None:
        """End it: end of file on its socket, then SIGKILL to its group."""
        self.sock.close()
        try:
            self.popen.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            kill_group(self.popen.pid)
            self.popen.wait(timeout=5.0)

    def kill_now(self) -> None:
        """From a signal handler: no wait, no lock."""
        kill_group(self.popen.pid)


class Forked:
    """A forked rank as its supervisor sees it (launchers.Handle): the
    ``subprocess.Popen`` methods a rank's handle needs, for a child that
    ``Popen`` did not start (waited for by pid, as ``Popen`` does)."""

    def __init__(self, pid: int, fds: dict[str, int] | None = None) -> None:
        self.pid = pid
        self.fds = fds or {}  # env var -> the number of the fd it names, there
        self.stdin: IO[bytes] | None = None  # a spare's: the pipe its assignment goes on
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._wait(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            code = self._wait(0)
            assert code is not None
            return code
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.005)
        return code

    def _wait(self, flags: int) -> int | None:
        if self.returncode is not None:
            return self.returncode
        # Popen's rule: one waiter at a time; a blocking wait holds the lock
        # (a concurrent poll then says "running", which it still is)
        if not self._lock.acquire(blocking=flags == 0):
            return None
        try:
            if self.returncode is not None:
                return self.returncode
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:
                # reaped by someone else (psutil.wait_procs in a stop): its
                # status is lost; Popen says 0 then, and so do we
                self.returncode = 0
                return self.returncode
            if pid == 0:
                return None
            self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        finally:
            self._lock.release()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a signal to a pid that was reaped (reused)
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def kill_group(leader: int, sig: int = signal.SIGKILL) -> None:
    if leader > 0:
        try:
            os.killpg(leader, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _subreaper(on: bool | None) -> int:
    """Set (``on``) or read (``None``) this process's child-subreaper flag."""
    libc = ctypes.CDLL(None, use_errno=True)
    if on is None:
        value = ctypes.c_int(0)
        if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0) != 0:
            raise WarmError(f"prctl(PR_GET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
        return value.value
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise WarmError(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
    return int(on)
