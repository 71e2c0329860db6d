"""The warm process's side: import torch once, then fork ranks on demand.

One warm process per host (started by the controller's supervisor, or by a
host agent: procs/warm.py) runs ``python -m monarch_nb.worker`` with
``MONARCH_NB_WARM=1``. It imports torch, ``torch.distributed``, the rank's
own modules and what the user named (``Mesh.start(preload=[...])``), freezes
the garbage collector's view of them (so that the ranks' collections do not
write to, and so unshare, every page of them), says it is ready, and serves
fork requests on its stdin, a Unix ``SOCK_SEQPACKET`` socket: one JSON
message each, with the fds the rank inherits (its link ends) attached.

Each request is answered by a double fork. The warm process forks an
intermediate that forks the rank and exits at once; the requester made
itself a child subreaper for the duration of the request (procs/warm.py),
so the rank is reparented to the requester, and is its child exactly as a
fresh ``Popen`` rank is: the requester waits for it, gets its pidfd, its
exit status, and its parent-death signal. The rank waits until it has been
reparented to the intended parent, then runs the same ``main()`` as a fresh
rank, which arms ``PR_SET_PDEATHSIG`` and checks that its parent is still
the intended one (``MONARCH_NB_PARENT_PID``).

Before it is handed to ``main()`` the child becomes what a fresh rank is
(``_become``): its own session and process group; no fd but stdin
(``/dev/null``), stdout and stderr (its log, appended) and the ones it was
sent; the signal handlers and mask the warm process had when its
interpreter started (a fresh interpreter's); the rank's environment,
working directory and ``sys.path`` (engine/spare.py's ``apply``, shared with
spares); fresh seeds for ``random`` and NumPy's global generator (torch's
default generator is untouched: a fresh process has the same fixed seed).
``/proc/<pid>/environ`` shows the rank's environment where the kernel
lets an unprivileged process say where it is (``_publish_environ``).
What a fork cannot give a fresh interpreter's way: the string hash seed
(every rank forked from one warm process has the warm process's; set
``PYTHONHASHSEED`` or ``fork=False`` if that matters).

Why this is safe on GPUs (DESIGN.md rule 4: never fork a process that has
initialised CUDA or ROCm): ``import torch`` does not initialise a device;
before each fork the warm process checks that torch has not
(``torch.cuda.is_initialized()``, which is HIP on ROCm builds) and that it
has exactly one thread (a device runtime starts threads; so would a
preloaded module that must not be forked). A check that fails answers the
request with the reason, and the supervisor starts fresh interpreters from
then on. The device pinning variables are read when the runtime initialises,
in the rank, after the fork.

Non-goals: deciding when to fork (supervisor, host agent), the requester's
side (procs/warm.py).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import random
import signal
import socket
import sys
import time
from typing import Any

from .. import config
from . import spare

# What the interpreter had set up when the warm process started: a fresh
# rank's signal handlers and mask (the warm process changes neither).
_STARTUP_HANDLERS: dict[int, Any] = {}
_STARTUP_MASK: set[int] = set()
_REPARENT_WAIT_S = 5.0
MAX_REQUEST = 1 << 20  # one request: an environment, a few paths


def record_startup() -> None:
    """Remember the interpreter's signal dispositions (call first thing)."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            _STARTUP_HANDLERS[sig] = signal.getsignal(sig)
        except (OSError, ValueError):
            pass
    _STARTUP_MASK.update(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))


def unsafe_to_fork() -> str:
    """Why this process must not fork now, or "" (see the module docstring)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch initialised a GPU (CUDA or ROCm) in the warm process"
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = 1
    if threads != 1:
        return (f"the warm process runs {threads} threads (a preloaded module started "
                "some); forking it could leave a lock held in the ranks")
    return ""


def serve(sock_fd: int = 0) -> None:
    """The warm process: prepare, then answer fork requests until end of
    file. Returns only in a forked rank (which then carries on in ``main``
    as a fresh rank does); the warm process itself exits here."""
    record_startup()
    sock = socket.socket(fileno=os.dup(sock_fd))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, sock_fd)  # the socket is ``sock`` now; fd 0 a harmless /dev/null
    os.close(null)
    error = _preload(os.environ.get(config.ENV_PRELOAD, ""))
    gc.collect()
    gc.freeze()  # the ranks' collections leave these objects (and their pages) alone
    _send(sock, {"ready": not error, "error": error, "pid": os.getpid()})
    if error:
        os._exit(0)
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_REQUEST, 16)
        except OSError:
            os._exit(0)
        if not data:
            os._exit(0)  # the supervisor closed its end, or died
        try:
            request = json.loads(data)
        except ValueError:
            _close(fds)
            _send(sock, {"error": "unreadable request"})
            continue
        why = unsafe_to_fork()
        if why:
            _close(fds)
            _send(sock, {"error": why})
            continue
        sys.stdout.flush()  # nothing of ours is written twice (the streams are the ranks' too)
        sys.stderr.flush()
        pid = _double_fork(sock, request, fds)
        if pid == 0:
            return  # the rank: main() goes on
        # the numbers the rank's fds have there are ours (a spare is told
        # them in its assignment later, as a fresh spare is its own)
        numbers = {name: fds[int(i)] for name, i in request.get("fd_env", {}).items()}
        _close(fds)
        _send(sock, {"pid": pid, "fds": numbers} if pid > 0 else {"error": "fork failed"})


def _preload(names: str) -> str:
    """Import torch, the rank's modules and ``names``; what failed, or ""."""
    import torch  # the point of a warm process
    import torch.distributed  # noqa: F401

    for mod in ("monarch_nb.elastic", "zmq", "cloudpickle"):  # (engine.loop: ours already)
        importlib.import_module(mod)
    for name in (n.strip() for n in names.split(",")):
        if not name:
            continue
        try:
            importlib.import_module(name)
        except BaseException as exc:  # an error in the user's module: reported, not ours
            return f"preload {name!r} failed: {type(exc).__name__}: {exc}"
    return ""


def _double_fork(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> int:
    """Fork the rank through an intermediate; its pid here, 0 in the rank,
    -1 if a fork failed."""
    r, w = os.pipe()
    try:
        middle = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return -1
    if middle == 0:  # the intermediate: fork the rank, say its pid, go
        os.close(r)
        try:
            pid = os.fork()
        except OSError:
            os._exit(1)
        if pid == 0:
            os.close(w)
            try:
                _become(sock, request, fds, os.getppid())
            except BaseException as exc:
                print(f"monarch_nb: a forked rank could not start: {exc!r}", file=sys.stderr)
                os._exit(3)
            return 0
        os.write(w, str(pid).encode())
        os._exit(0)  # the rank is reparented to the subreaper that asked
    os.close(w)
    data = b""
    while chunk := os.read(r, 32):
        data += chunk
    os.close(r)
    os.waitpid(middle, 0)  # after this, the rank's parent is the requester
    return int(data) if data.isdigit() else -1


def _become(sock: socket.socket, request: dict[str, Any], fds: list[int], middle: int) -> None:
    """Make this forked child what a fresh rank is (module docstring)."""
    os.setsid()
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(str(request["log"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(log, 1)  # first: what goes wrong from here on is in the rank's log
    os.dup2(log, 2)
    os.close(log)
    parent = int(request["parent"])
    deadline = time.monotonic() + _REPARENT_WAIT_S
    while True:  # the intermediate exits at once: then we are the parent's
        ppid = os.getppid()  # read once: it changes under us when the intermediate exits
        if ppid == parent:
            break
        if ppid != middle or time.monotonic() > deadline:
            # the intended parent died meanwhile (we went to init), or was
            # no subreaper when the intermediate exited
            print(f"monarch_nb: a forked rank was not handed to its controller (pid "
                  f"{parent}): its parent is pid {ppid} (the intermediate was "
                  f"{middle})", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(0.0002)
    sock.detach()  # its fd is closed below with the rest, not by the object later
    env: dict[str, str] = {str(k): str(v) for k, v in request["env"].items()}
    keep = set()
    for name, index in request.get("fd_env", {}).items():
        fd = fds[int(index)]
        os.set_inheritable(fd, True)  # as Popen's pass_fds leaves it
        env[str(name)] = str(fd)
        keep.add(fd)
    stdin = request.get("stdin")  # a spare's: the pipe its assignment comes on
    if stdin is not None:
        keep.add(fds[int(stdin)])
    _only_fds(keep)
    source = os.open(os.devnull, os.O_RDONLY) if stdin is None else fds[int(stdin)]
    os.dup2(source, 0)
    if source > 2:
        os.close(source)
    for sig, handler in _STARTUP_HANDLERS.items():
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError, TypeError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, _STARTUP_MASK)
    spare.apply({"env": env, "cwd": request.get("cwd")})
    if config.ENV_SPARE in env:  # (apply drops it: a spare's own assignment is to come)
        os.environ[config.ENV_SPARE] = env[config.ENV_SPARE]
    _publish_environ(env)
    random.seed()  # from os.urandom, as at a fresh interpreter's import
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    # The warm process's objects stay frozen: a full collection would write
    # to each one's header, and so unshare every page torch's modules hold.


class _MMMap(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "start_code", "end_code", "start_data", "end_data", "start_brk", "brk", "start_stack",
        "arg_start", "arg_end", "env_start", "env_end", "auxv")] + [
        ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]


_environ_block: ctypes.Array[ctypes.c_char] | None = None  # lives as long as the process


def _publish_environ(env: dict[str, str]) -> bool:
    """Make ``/proc/<pid>/environ`` (``ps e``, psutil's ``environ()``) show
    ``env``, the rank's, as a fresh rank's shows the environment it was
    started with, rather than the warm process's: the kernel is pointed at
    a copy of it (``PR_SET_MM_MAP``, which needs no privilege on kernels
    built with checkpoint/restore). False where it cannot be done: the old
    block then stays (os.environ, what the rank's code reads, is right
    either way)."""
    global _environ_block
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        # /proc/self/stat fields 26-28 and 45-51 (1-based; the split starts at field 3)
        start_code, end_code, start_stack = (int(fields[i - 3]) for i in (26, 27, 28))
        start_data, end_data, start_brk, arg_start, arg_end = (
            int(fields[i - 3]) for i in (45, 46, 47, 48, 49))
        block = b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()) or b"\0"
        buf = ctypes.create_string_buffer(block, len(block))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sbrk.restype = ctypes.c_void_p
        brk = libc.sbrk(0)
        addr = ctypes.addressof(buf)
        mm = _MMMap(start_code, end_code, start_data, end_data, start_brk, brk, start_stack,
                    arg_start, arg_end, addr, addr + len(block), 0, 0, 0xFFFFFFFF)
        # PR_SET_MM (35), PR_SET_MM_MAP (14)
        if libc.prctl(35, 14, ctypes.byref(mm), ctypes.sizeof(mm), 0) != 0:
            return False
    except (OSError, ValueError, IndexError, AttributeError):
        return False
    _environ_block = buf
    return True


def _only_fds(keep: set[int]) -> None:
    """Close every fd above 2 but ``keep`` (the warm process's socket, the
    pipes of this fork, whatever an import left open)."""
    try:
        open_fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        open_fds = list(range(3, 1024))
    for fd in open_fds:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    try:
        sock.sendall(json.dumps(message).encode())
    except OSError:
        os._exit(0)


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
