"""Backends: choose cuda / rocm / cpu, count devices, pin a rank's device,
and join the torch.distributed group.

Controller side (:func:`resolve`) reads torch's build flavour from
``torch/version.py`` without importing torch when the build is CPU-only, so
starting a CPU mesh does not cost the kernel a two-second ``import torch``.
For GPU builds it asks ``torch.cuda.device_count()``, which reads NVML/the HIP
runtime without creating a CUDA context in the kernel.

Rank side: :func:`pin_env` is applied to the rank's environment *before* the
rank interpreter starts, so torch only ever sees its one device (it appears as
``cuda:0``). :func:`init_group` joins nccl (RCCL on ROCm, same name) or gloo.

Non-goals: health probes (dashboard issue), process spawning (supervisor).
"""

from __future__ import annotations

import errno
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import default_cpu_ranks
from .errors import UsageError


@dataclass(frozen=True)
class BackendInfo:
    """What a mesh runs on. ``devices`` are the physical ids (as the parent
    environment names them) that ranks are pinned to, one per rank."""

    name: str  # cuda | rocm | cpu
    dist_backend: str  # nccl | gloo
    torch_version: str
    devices: tuple[str, ...] = ()

    def default_ranks(self) -> int:
        return len(self.devices) if self.devices else default_cpu_ranks()


def torch_build() -> dict[str, Any]:
    """``{"version", "cuda", "hip"}`` of the installed torch, read from its
    version.py without importing torch. Raises UsageError if torch is missing."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("torch is not installed in this environment: pip install torch")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "version.py")
    ns: dict[str, Any] = {}
    try:
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), ns)  # torch's own tiny constants file
    except OSError:
        import torch

        return {"version": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip}
    return {"version": ns.get("__version__", "?"), "cuda": ns.get("cuda"), "hip": ns.get("hip")}


def _visible(var_names: tuple[str, ...], count: int) -> tuple[str, ...]:
    for var in var_names:
        value = os.environ.get(var)
        if value is not None:
            ids = tuple(v.strip() for v in value.split(",") if v.strip())
            return ids[:count] if count else ids
    return tuple(str(i) for i in range(count))


def _gpu_count() -> int:
    import torch

    try:
        return int(torch.cuda.device_count())
    except Exception:
        return 0


def resolve(requested: str = "auto") -> BackendInfo:
    """Pick the backend for ``requested`` (auto|cuda|rocm|cpu)."""
    build = torch_build()
    flavour = "rocm" if build["hip"] else ("cuda" if build["cuda"] else "cpu")
    if requested == "cpu" or (requested == "auto" and flavour == "cpu"):
        return BackendInfo("cpu", "gloo", build["version"])
    if requested in ("cuda", "rocm") and flavour != requested:
        have = "a CPU-only" if flavour == "cpu" else f"a {flavour.upper()}"
        raise UsageError(
            f"--backend {requested} needs a {requested.upper()} build of torch, but this is "
            f"{have} build (torch {build['version']}); use --backend auto or install a "
            f"{requested.upper()} torch"
        )
    count = _gpu_count()
    if count == 0:
        if requested == "auto":
            return BackendInfo("cpu", "gloo", build["version"])
        raise UsageError(f"--backend {requested}: torch sees no GPU here; use --backend cpu")
    names = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") if flavour == "rocm" else ("CUDA_VISIBLE_DEVICES",)
    return BackendInfo(flavour, "nccl", build["version"], _visible(names, count))


def pin_env(info: BackendInfo, local_rank: int, env: dict[str, str]) -> None:
    """Restrict a rank's environment to its one device, before it starts."""
    if info.name == "cpu":
        # A CPU mesh must not grab GPUs that happen to be present either.
        env["CUDA_VISIBLE_DEVICES"] = ""
        return
    if local_rank >= len(info.devices):
        raise UsageError(
            f"rank {local_rank} has no GPU: {len(info.devices)} visible; "
            f"start with -n {len(info.devices)} or fewer, or --backend cpu"
        )
    device = info.devices[local_rank]
    if info.name == "rocm":
        # HIP also honours CUDA_VISIBLE_DEVICES and ROCR filters before HIP:
        # setting several would filter twice. One variable, the HIP one.
        for var in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
            env.pop(var, None)
        env["HIP_VISIBLE_DEVICES"] = device
    else:
        env["CUDA_VISIBLE_DEVICES"] = device


class JoinAborted(RuntimeError):
    """A re-formation was given up because a newer one superseded it."""


class JoinFailed(RuntimeError):
    """A re-formation failed (a member vanished while the group formed);
    the controller re-forms again once that member is replaced."""


_JOINED = "monarch_nb/joined"
_ATTEMPT_S = 1.0  # one connection attempt to rank 0's store, between abort checks


def make_store(rank: int, world_size: int, addr: str, port: int, timeout_s: float = 300.0,
               abort: Callable[[], bool] | None = None) -> Any:
    """The rendezvous TCPStore. Rank 0 hosts it on a socket bound to
    ``addr`` only: torch's own TCPStore server listens on every interface,
    an unauthenticated key-value store open to the network.

    Every member's wait for the others (connecting, then a counter reaching
    ``world_size``) checks ``abort()`` between short steps and raises
    :class:`JoinAborted` when it says so: a member that died
    while the group formed never arrives, and torch's own wait would only
    end at the timeout, while the next generation's members wait for us."""
    import datetime
    import socket

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    if abort is None:
        abort = _never
    if rank != 0:
        _await_listening(addr, port, abort, deadline)
        while True:
            try:
                store = dist.TCPStore(addr, port, world_size, False,
                                      timeout=datetime.timedelta(seconds=_ATTEMPT_S))
                break
            except (RuntimeError, OSError):  # DistNetworkError / DistStoreError included
                if abort():
                    raise JoinAborted("a newer generation superseded this one") from None
                if time.monotonic() > deadline:
                    raise
        store.set_timeout(timeout)
        _await_members(store, world_size, abort, deadline)
        return store
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    _bind(sock, addr, port)
    sock.listen(max(16, 2 * world_size))
    # The store owns the fd from here on (it closes it when the group is
    # destroyed): detach, or Python would close it a second time later — by
    # then possibly the next generation's socket under the same number.
    # wait_for_workers=False: the members are counted in _await_members,
    # where the wait can be abandoned
    store = dist.TCPStore(addr, port, world_size, True, timeout=timeout,
                          master_listen_fd=sock.detach(), wait_for_workers=False)
    _await_members(store, world_size, abort, deadline)
    return store


def _never() -> bool:
    return False


def _bind(sock: Any, addr: str, port: int, patience_s: float = 2.0) -> None:
    """Bind the store's port, trying again for a moment while it is in use.

    The port is in the ephemeral range (the controller took a free one), so
    a local connection's source port can hold it for an instant: a member's
    probe of this very port can even connect to itself (TCP's simultaneous
    open) before we listen. Such a holder lets go within milliseconds; a port
    really taken stays taken and fails as before."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            sock.bind((addr, port))
            return
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
        time.sleep(0.005)


def _await_listening(addr: str, port: int, abort: Callable[[], bool], deadline: float) -> None:
    """Wait until rank 0's store listens, in steps of a few milliseconds.

    A member usually gets here first: rank 0 leaves its old group before it
    opens the new store. torch's TCPStore client, refused, backs off 0.3 to
    0.5 s before it tries again, which was most of a respawn's time (a forked
    rank is ready in 0.1 s once the store is there). The probe's connection
    is closed at once; the store drops it like any client that left. Any
    error but a refusal (an unreachable host, a slow network) is left to
    TCPStore, which reports it as before."""
    import socket

    pause = 0.001
    while True:
        try:
            with socket.create_connection((addr, port), timeout=_ATTEMPT_S) as probe:
                if probe.getsockname() != probe.getpeername():
                    return
                # connected to itself (its source port was the store's port,
                # nobody listening yet): not the store
        except ConnectionRefusedError:
            pass
        except OSError:
            return
        if abort():
            raise JoinAborted("a newer generation superseded this one")
        if time.monotonic() > deadline:
            return  # TCPStore's own attempt says why
        time.sleep(pause)
        pause = min(0.01, pause * 2)


def _await_members(store: Any, world_size: int, abort: Callable[[], bool],
                   deadline: float) -> None:
    """Count in, then wait until all ``world_size`` members have, checking
    ``abort`` meanwhile. (Each generation has its own store and port.)"""
    store.add(_JOINED, 1)
    pause = 0.001
    while store.add(_JOINED, 0) < world_size:
        if abort():
            raise JoinAborted("a newer generation superseded this one")
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {store.add(_JOINED, 0)} of {world_size} members "
                               "joined the new group")
        time.sleep(pause)
        pause = min(0.02, pause * 2)


def native_crash_stacks() -> bool:
    """Turn on torch's own fatal-signal handler (c10's): on SIGSEGV, SIGBUS,
    SIGILL, SIGFPE or SIGABRT it writes every thread's native stack to fd 2,
    then hands the signal to the handler before it (faulthandler's Python
    dump). Python's faulthandler gains C stacks only in 3.14; this gives
    them on every Python torch supports. A private torch API: False where
    this build lacks it, and the crash dump stays Python only. Install it
    after faulthandler and before any Python-level SIGINT handler (which
    then replaces c10's for SIGINT: an interrupt is not a crash)."""
    import torch

    turn_on = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
    if turn_on is None:
        return False
    try:
        turn_on(True)
    except Exception:  # a build without the handlers raises
        return False
    return True


def init_group(backend: str, rank: int, world_size: int, addr: str = "127.0.0.1",
               port: int = 0, timeout_s: float | None = None,
               abort: Callable[[], bool] | None = None) -> str:
    """Join the torch.distributed group; returns a short description of the
    device, e.g. ``cuda:0 (NVIDIA H200)`` or ``cpu``. ``abort``: see
    :func:`make_store` (re-formations)."""
    import datetime

    import torch
    import torch.distributed as dist

    store = make_store(rank, world_size, addr, port, abort=abort)
    kwargs: dict[str, Any] = {"rank": rank, "world_size": world_size, "store": store}
    if timeout_s:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if backend in ("cuda", "rocm"):
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
        dist.init_process_group("nccl", device_id=dev, **kwargs)
        return f"cuda:0 ({torch.cuda.get_device_name(0)})"
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = interface_towards(addr)
        if iface:  # several hosts: the interface that reaches rank 0's host
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    before = _tcp_links(store.port)
    dist.init_process_group("gloo", **kwargs)
    # gloo connects every pair while the group forms: the connections that
    # appeared meanwhile are the group's own (see leave_group)
    _group_links[:] = [(fd, ends) for fd, ends in _tcp_links(store.port).items()
                       if before.get(fd) != ends]
    return "cpu"


def leave_group() -> None:
    """Destroy this rank's torch.distributed group, if any, so that it is
    freed: gloo closes a group's connections only when the group object goes
    away, and until then a peer waiting in a collective on this rank stays
    stuck there (one that fails out of a collective after a member died
    releases the others like this, each in turn).

    The group's connections are shut down first. gloo's group object, when
    freed, waits for the collectives its threads run, and gloo has no abort:
    two survivors each waiting in a collective for the other, each in its
    own group's destructor, would wait for the group's timeout (30 min).
    With the connections shut, those collectives fail at once ("Connection
    closed by peer") here and on the peers."""
    import torch.distributed as dist

    _cut_links()
    if not dist.is_initialized():
        return
    held = [dist.distributed_c10d._get_default_group()]
    dist.destroy_process_group()
    _forget_group(held[0])
    _free_group(held)


def _free_group(held: list[Any]) -> None:
    """Drop the old group's reference (its last one, unless the user's code
    keeps another). gloo's destructor runs here and waits for the
    collectives its threads still run; should one of them never end (gloo's
    event loop can spin on a connection a dead peer left behind, and then
    no error reaches the waiting collective), this frame is where the rank
    stays: the controller, probing a member that has not re-formed, reads it
    as a collective (stacks.py) and replaces the process."""
    held.clear()


# The default gloo group's connections to its peers: (fd, (local, remote)).
_group_links: list[tuple[int, tuple[tuple[str, int], tuple[str, int]]]] = []
# Remote (ip, port) never taken for the group's links: the controller's.
_kept: set[tuple[str, int]] = set()


def keep_links_to(endpoint: str) -> None:
    """Connections to ``endpoint`` (``tcp://host:port``: the controller's
    ROUTER) are never counted as the group's. The group's links are the
    connections that appear while it forms; ZeroMQ connects (and
    reconnects) in its own thread, and a rank's link to its controller
    that came up meanwhile was shut down with the group at the next
    re-formation, dropping the REFORM sent to it while ZeroMQ reconnected
    (a survivor then waited its whole reform timeout)."""
    import socket
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(endpoint)
        host, port = parts.hostname, parts.port
    except ValueError:
        return
    if parts.scheme != "tcp" or not host or port is None:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return
    for info in infos:
        ip = str(info[4][0])
        _kept.add((ip, port))
        if ":" not in ip:  # as a dual-stack socket reports it
            _kept.add((f"::ffff:{ip}", port))


def _tcp_links(store_port: int) -> dict[int, tuple[tuple[str, int], tuple[str, int]]]:
    """This process's established TCP connections, but the store's and the
    controller's (fd -> (local, remote) address)."""
    import psutil

    links = {}
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.fd < 0 or not c.raddr or c.status != psutil.CONN_ESTABLISHED:
            continue
        if store_port in (c.laddr.port, c.raddr.port) or (c.raddr.ip, c.raddr.port) in _kept:
            continue
        links[c.fd] = ((c.laddr.ip, c.laddr.port), (c.raddr.ip, c.raddr.port))
    return links


def _cut_links() -> None:
    """Shut down the group's connections (noted when it formed). Each fd is
    duplicated and checked to be the same connection first: one gloo closed
    already may have been reused since."""
    import socket

    links, _group_links[:] = list(_group_links), []
    for fd, (local, remote) in links:
        family = socket.AF_INET6 if ":" in local[0] else socket.AF_INET
        try:
            sock = socket.fromfd(fd, family, socket.SOCK_STREAM)
        except OSError:  # closed already
            continue
        try:
            if (tuple(sock.getsockname()[:2]) == local
                    and tuple(sock.getpeername()[:2]) == remote):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()  # the duplicate; gloo closes its own


def _forget_group(group: Any) -> None:
    """torch.distributed.nn.functional binds ``group=group.WORLD`` when it is
    imported, which the first ``backward()`` does, after the group formed:
    its functions' defaults would keep the destroyed group alive (and aim
    those functions at it after a re-formation). They get ``None``, the
    current default group, instead."""
    module = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(module).values() if module is not None else ():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(d is group for d in defaults):
            fn.__defaults__ = tuple(None if d is group else d for d in defaults)


def interface_towards(addr: str) -> str | None:
    """The name of the network interface this host uses to reach ``addr``
    (gloo otherwise picks the one its host name resolves to, often
    loopback). No packet is sent: a UDP connect only asks the routing table."""
    import socket

    import psutil

    try:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            local = s.getsockname()[0]
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addrs):
            return name
    return None
