"""Configuration: frozen dataclasses with documented defaults, and the one
place where environment variables are read.

Two sides:

* :class:`MeshConfig` — what the controller was asked for (``Mesh.start``
  arguments, ``%monarch start`` flags).
* :class:`RankEnv` — what a rank process learns from its environment when it
  starts. The controller writes these variables; nothing else reads them.

Non-goals: no I/O beyond ``os.environ`` and reading the key file.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import UsageError

Backend = Literal["auto", "cuda", "rocm", "cpu"]
Respawn = Literal["rank", "all", "off"]
Launcher = Literal["local", "ssh", "slurm", "join"]

BACKENDS: tuple[str, ...] = ("auto", "cuda", "rocm", "cpu")
RESPAWN_MODES: tuple[str, ...] = ("rank", "all", "off")
LAUNCHERS: tuple[str, ...] = ("local", "ssh", "slurm", "join")

# Environment variables written by the controller for each rank.
ENV_CONTROLLER = "MONARCH_NB_CONTROLLER"  # tcp://host:port of the controller ROUTER
ENV_KEY = "MONARCH_NB_KEY"  # hex HMAC key (environment, never argv)
ENV_KEY_FILE = "MONARCH_NB_KEY_FILE"  # or a 0600 file holding the hex key
ENV_MESH_ID = "MONARCH_NB_MESH_ID"
ENV_INCARNATION = "MONARCH_NB_INCARNATION"
ENV_BACKEND = "MONARCH_NB_BACKEND"  # resolved backend: cuda | rocm | cpu
ENV_PARENT_PID = "MONARCH_NB_PARENT_PID"  # exit if this process disappears
ENV_CONTROLLER_TIMEOUT = "MONARCH_NB_CONTROLLER_TIMEOUT"  # s without a ping -> exit
ENV_GENERATION = "MONARCH_NB_GENERATION"
# a rank's number in the mesh, and the mesh's size: stable, where RANK and
# WORLD_SIZE are the torch group's (fewer while it goes on without lost ranks)
ENV_MESH_RANK = "MONARCH_NB_MESH_RANK"
ENV_MESH_SIZE = "MONARCH_NB_MESH_SIZE"
ENV_IDENTITY = "MONARCH_NB_IDENTITY"  # socket identity prefix, with a random token
ENV_MAX_MESSAGE = "MONARCH_NB_MAX_MESSAGE"  # results larger than this are refused
ENV_SHM = "MONARCH_NB_SHM_THRESHOLD"  # local ranks: frames this big go by shared memory
ENV_GPU_IPC = "MONARCH_NB_GPU_IPC"  # "1": local ranks send CUDA tensors by IPC handle
ENV_LINK_FD = "MONARCH_NB_LINK_FD"  # local ranks: the fd of their end of the link (wire/link.py)
# ranks on another host: frames this big go to their host agent in a passed
# memory file (wire/link.py SHM; the agent's link is on the rank's host)
ENV_LINK_SHM = "MONARCH_NB_LINK_SHM_THRESHOLD"
# ranks behind a host agent: the fd of their end of the control link (wire/hostrelay.py)
ENV_CTL_LINK_FD = "MONARCH_NB_CTL_LINK_FD"
# a kept mesh's rank (engine/kept.py): the epoch of the controller that started it
ENV_KEPT_EPOCH = "MONARCH_NB_KEPT_EPOCH"
ENV_CONTROLLER_PID = "MONARCH_NB_CONTROLLER_PID"  # shared memory's peer, when not the parent
# CurveZMQ (non-loopback meshes): the controller's public key and this rank's
# client key pair, Z85 text. The secret travels like the HMAC key: environment
# or 0600 file, never argv.
ENV_CURVE_SERVER = "MONARCH_NB_CURVE_SERVER"
ENV_CURVE_PUBLIC = "MONARCH_NB_CURVE_PUBLIC"
ENV_CURVE_SECRET = "MONARCH_NB_CURVE_SECRET"
SECRET_ENV = (ENV_KEY, ENV_CURVE_SECRET)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# ssh launcher: the remote shell command, {host} replaced; the worker command
# is appended as one argument (e.g. "ip netns exec {host} sh -c").
ENV_SSH = "MONARCH_NB_SSH"
ENV_SPARE = "MONARCH_NB_SPARE"  # set in a spare's environment: wait for an assignment
SPARE_WAITING = "monarch_nb spare: torch imported, waiting for a rank"  # a spare writes this to its log
ENV_WARM = "MONARCH_NB_WARM"  # set in a warm process's environment: fork ranks on request
ENV_PRELOAD = "MONARCH_NB_PRELOAD"  # a warm process's: the user's modules to import, comma-separated
# "0": fresh interpreters for every rank (``fork=False``), for scripts and launchers
ENV_FORK = "MONARCH_NB_FORK"


def parse_preload(value: object) -> tuple[str, ...]:
    """``preload`` as module names: a list of names, or one comma-separated
    string (``--preload transformers,datasets``)."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (str, bytes)) and hasattr(names, "__iter__"):
        names = list(names)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UsageError(f"preload must be module names (a list, or one string separated by "
                         f"commas), not {value!r}")
    out = tuple(n.strip() for n in names if n.strip())
    bad = [n for n in out if not all(part.isidentifier() for part in n.split("."))]
    if bad:
        raise UsageError(f"preload: {', '.join(map(repr, bad))} is not a module name; "
                         "give importable names such as 'transformers' or 'torch.nn'")
    return out


def fork_default() -> bool:
    """``fork``'s default: on, unless ``MONARCH_NB_FORK=0`` (or ``false``,
    ``no``, ``off``) is in the environment."""
    return os.environ.get(ENV_FORK, "1").strip().lower() not in ("0", "false", "no", "off")
DEFAULT_SSH = "ssh -T -o BatchMode=yes {host}"


@dataclass(frozen=True)
class MeshConfig:
    """What a mesh is started with.

    n: number of ranks; ``None`` means one per visible GPU, else min(4, cores).
    backend: ``auto`` picks cuda (CUDA torch + GPU), rocm (ROCm torch + GPU),
        else cpu (gloo).
    respawn: ``rank`` replaces only a dead rank, ``all`` every rank, ``off``
        reports deaths and keeps the survivors.
    bind: controller address; loopback by default. Any other address (an IP
        of this host, a host name, or ``0.0.0.0``) turns on CurveZMQ
        encryption with client allow-listing, on top of the HMAC signatures.
    nodes, gpus_per_node: placement for the ssh / slurm launchers (ranks
        ``node * gpus_per_node + local_rank``).
    master_addr: address of rank 0's host for torch.distributed; default
        127.0.0.1 (local) or rank 0's host (ssh, slurm).
    insecure_no_encryption: turn CurveZMQ *off* on a non-loopback bind.
        Messages stay signed (no forgery), but anyone on the path reads
        every value, argument and result in clear text. For benchmarks and
        trusted, isolated networks only; a warning is printed.
    join_dir: ``launcher="join"``: where the 0600 rank spec files for
        ``monarch-nb worker --join ... --key-file FILE`` are written.
    heartbeat_interval: seconds between controller pings and rank heartbeats.
    heartbeat_timeout: a rank whose control thread stays silent this long is
        frozen (SIGSTOP, hung host): it is killed and reported dead. The control
        thread answers even while user code is stuck, so busy is not silent.
    controller_timeout: a rank that hears nothing from its controller for this
        long exits (the second line of defence after the parent-death signal).
    start_timeout: seconds for every rank to report ready.
    max_message_bytes: larger inbound messages are dropped unread.
    spare: keep one spare rank process with torch already imported, so a
        respawn skips the new interpreter's ``import torch`` (local launcher).
        It starts a few seconds after the mesh is settled and costs one idle
        process's memory.
    hang_timeout: a call that shows no progress (no output, metric or result)
        for this many seconds gets the grouped stacks of its ranks printed
        into its cell, once; ``None`` or 0 turns the watchdog off. Calls can set
        their own (``%%monarch --hang-timeout``).
    shm_threshold: payload frames (array and tensor buffers, mostly) of at
        least this many bytes travel between the controller and *local* ranks
        through shared memory (wire/shm.py): written once for all ranks, each
        rank gets its own copy-on-write view. ``None`` turns it off (every
        byte through the sockets). Ranks on other hosts always use the sockets.
    gpu_ipc: CUDA (and ROCm) tensors in call arguments, pushed values and
        results move between the controller and *local* ranks by CUDA IPC
        handle (wire/gpuipc.py, docs/gpu-dataplane.md) and arrive on the
        receiver's GPU, each an independent copy; off (the default), they are
        copied to the host and arrive on the CPU. Without a GPU backend, or
        with remote ranks, it prints a one-line notice and stays off. The
        ranks learn it from ``MONARCH_NB_GPU_IPC=1`` in their environment.
    spare_hosts: hosts kept free for the ranks of a lost host (ssh, slurm):
        when a host is lost its ranks start on the first spare, keeping their
        rank numbers. Under SLURM, nodes of the allocation beyond ``nodes``
        are spare hosts by default.
    host_timeout: a host whose agent says nothing this long (it ticks every
        0.2 s) is lost: its ranks end with "host X lost" and are not retried
        there; a launch that fails loses its host at once.
    local_link: a *local* rank's main channel (calls, cells and their
        results) is a Unix socket pair with the controller (wire/link.py)
        instead of a ZeroMQ socket: no ZeroMQ I/O thread on either side of
        the call path, about half the CPU of a no-op call. Messages on it are
        signed and verified all the same. ``False`` puts every rank on
        ZeroMQ (to compare, or to debug the transport).
    name, keep_alive: a *kept* mesh (docs/kept-meshes.md): its ranks belong to
        this machine's host agent and outlive the controller (a kernel
        restarted, shut down or killed) for ``keep_alive`` seconds (default
        1800 when only ``name`` is given; ``"30m"``-style strings are read
        by :func:`parse_duration`); ``Mesh.attach(name)`` from any process
        of the same user on this machine takes it over. Without a
        controller for that long every process of the mesh exits.
    restart_budget, restart_window: at most ``restart_budget`` respawns of
        one rank within ``restart_window`` seconds; past it the rank is
        FAILED until a user's restart. 0: no respawn at all (torchrun's
        ``--max-restarts 0``), and a dead rank's line says so and how to turn
        respawns on (``no_restarts_hint``). Backoff, for crash loops only: a
        rank whose process answered one of the user's calls was working and
        is respawned at once, however often it died; one whose process dies
        again before it answered anything waits before each respawn, 0.5 s
        doubling with each further death in a row (+/-25 %, at most 30 s).
    no_restarts_hint: with ``restart_budget=0``, what follows "not
        respawned: " in a dead rank's line: the setting as the user gave it,
        and how to turn respawns on. ``None``: the Python API's words
        (``restart_budget=0``); script mode names its ``--max-restarts``.
    min_ranks: an elastic world size. ``None`` (the default): the torch
        group always has every rank; a rank gone for good (its restart budget
        spent, ``restart_budget=0``, respawn off, its host lost with no spare
        host) ends the elastic calls it was in (``MembershipChanged``). A
        number M (1..n): as long as at least M ranks are left, the group goes
        on without the lost ones instead: the survivors re-form at world size
        k (dense torch ranks 0..k-1, in the order of their mesh ranks), an
        ``mnb.elastic.run`` loop carries on with the most advanced state, and
        calls leave the lost ranks out (their entry in the results is a
        :class:`~monarch_nb.results.Lost`). Mesh rank numbers never change
        (``--ranks``, ``mesh[i]``, results, status, logs); ``mnb.rank()``,
        ``dist.get_rank()`` and ``RANK`` are the group's (docs/elastic.md).
        A lost rank brought back (``%monarch restart``) rejoins the group.
    restart_group: script mode's restarts (``python -m monarch_nb.launch``
        sets it): a rank's death restarts every other rank too, as new
        processes, as torchrun restarts its worker group (new
        ``TORCHELASTIC_RESTART_COUNT``, nothing of the earlier run left),
        except ranks running an ``mnb.elastic`` loop, which carry on in
        place; when the group goes on without lost ranks (``min_ranks``) the
        others restart at the new size. Respawn ``rank`` only; ``all``
        restarts every rank anyway, ``off`` none.
    fork: start the ranks on this machine (and their spares) by forking
        one warm process that imported torch once (engine/warm.py,
        docs/warm-process.md): a cold start without one ``import torch``
        per rank, a respawn in milliseconds, torch's pages shared between
        the ranks. The warm process never initialises a GPU nor starts a
        thread, and checks both before each fork. ``False`` starts every
        rank as a fresh interpreter (builds where forking is unsafe); so
        does ``MONARCH_NB_FORK=0`` in the environment (the default's source).
    preload: modules the warm process imports besides torch (``fork``
        only), so that every rank starts with them imported and shares
        their memory: ``["transformers"]``, ``"transformers,datasets"``. A
        module that fails to import fails ``Mesh.start`` with its error.
    relay: a *remote* rank's channels go through its host's agent
        (wire/hostrelay.py): one connection per host, one message per host
        for a call to its ranks, batched results and heartbeats. Signed end
        to end all the same. ``False`` gives each remote rank its own two
        DEALERs (to compare).
    """

    n: int | None = None
    backend: Backend = "auto"
    respawn: Respawn = "rank"
    launcher: Launcher = "local"
    hosts: tuple[str, ...] = ()
    bind: str = None  # type: ignore[assignment]  # None: loopback (local), "*" (ssh, slurm)
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 3.0
    controller_timeout: float = 10.0
    start_timeout: float = 120.0
    max_message_bytes: int = 4 << 30
    hang_timeout: float | None = 60.0
    spare: bool = True
    restart_budget: int = 5  # respawns of one rank within restart_window s, then FAILED
    restart_window: float = 600.0
    no_restarts_hint: str | None = None
    extra_env: tuple[tuple[str, str], ...] = field(default=())
    nodes: int | None = None
    gpus_per_node: int | None = None
    master_addr: str | None = None
    insecure_no_encryption: bool = False
    join_dir: str | None = None
    shm_threshold: int | None = 1 << 20
    gpu_ipc: bool = False
    local_link: bool = True
    relay: bool = True
    spare_hosts: tuple[str, ...] = ()
    host_timeout: float = 5.0
    name: str | None = None
    keep_alive: float | None = None
    min_ranks: int | None = None
    restart_group: bool = False
    fork: bool = field(default_factory=fork_default)
    preload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.n is not None and (isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1):
            raise UsageError(f"n must be a positive number of ranks, not {self.n!r}")
        if self.backend not in BACKENDS:
            raise UsageError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.respawn not in RESPAWN_MODES:
            raise UsageError(f"respawn {self.respawn!r} is not one of {', '.join(RESPAWN_MODES)}")
        if (isinstance(self.restart_budget, bool) or not isinstance(self.restart_budget, int)
                or self.restart_budget < 0):
            raise UsageError(f"restart_budget must be a whole number of respawns (0 or more), "
                             f"not {self.restart_budget!r}")
        if (isinstance(self.restart_window, bool) or not isinstance(self.restart_window, (int, float))
                or not self.restart_window > 0):
            raise UsageError(f"restart_window must be a positive number of seconds, "
                             f"not {self.restart_window!r}")
        if self.no_restarts_hint is not None and not isinstance(self.no_restarts_hint, str):
            raise UsageError(f"no_restarts_hint must be text or None, "
                             f"not {self.no_restarts_hint!r}")
        if self.min_ranks is not None and (
                isinstance(self.min_ranks, bool) or not isinstance(self.min_ranks, int)
                or self.min_ranks < 1 or (self.n is not None and self.min_ranks > self.n)):
            raise UsageError(f"min_ranks must be a number of ranks from 1 to the mesh's "
                             f"{self.n or 'n'}, or None (the group keeps every rank), "
                             f"not {self.min_ranks!r}")
        if self.launcher not in LAUNCHERS:
            raise UsageError(f"launcher {self.launcher!r} is not one of {', '.join(LAUNCHERS)}")
        check_hang_timeout(self.hang_timeout)
        if self.bind is None:
            object.__setattr__(self, "bind", "127.0.0.1" if self.launcher == "local" else "*")
        if self.launcher == "ssh" and not self.hosts:
            raise UsageError("--launcher ssh needs --hosts H1,H2 (one or more hosts)")
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise UsageError(f"{name} must be a positive number, not {value!r}")
        if self.shm_threshold is not None and (
                isinstance(self.shm_threshold, bool) or not isinstance(self.shm_threshold, int)
                or self.shm_threshold < 1):
            raise UsageError(f"shm_threshold must be a positive number of bytes or None (off), "
                             f"not {self.shm_threshold!r}")
        if not isinstance(self.gpu_ipc, bool):
            raise UsageError(f"gpu_ipc must be True or False, not {self.gpu_ipc!r}")
        if not isinstance(self.local_link, bool):
            raise UsageError(f"local_link must be True or False, not {self.local_link!r}")
        if not isinstance(self.relay, bool):
            raise UsageError(f"relay must be True or False, not {self.relay!r}")
        if not isinstance(self.fork, bool):
            raise UsageError(f"fork must be True or False, not {self.fork!r}")
        object.__setattr__(self, "preload", parse_preload(self.preload))
        if isinstance(self.spare_hosts, str):
            object.__setattr__(self, "spare_hosts", tuple(h for h in self.spare_hosts.split(",") if h))
        if (isinstance(self.host_timeout, bool) or not isinstance(self.host_timeout, (int, float))
                or not self.host_timeout > 0):
            raise UsageError(f"host_timeout must be a positive number of seconds, "
                             f"not {self.host_timeout!r}")
        if self.spare_hosts and self.launcher not in ("ssh", "slurm"):
            raise UsageError("spare hosts need --launcher ssh or slurm (the local launcher runs "
                             "on this machine only)")
        if self.name is not None or self.keep_alive is not None:
            self._check_kept()
        if not _valid_bind(self.bind):
            raise UsageError(f"bind address {self.bind!r} is not a host name, an IP address "
                             "or * (every interface)")

    def _check_kept(self) -> None:
        if self.name is None:
            raise UsageError("keep_alive needs a name to attach by: Mesh.start(name=\"exp1\", "
                             "keep_alive=1800), or %monarch start --name exp1 --keep-alive 30m")
        if not isinstance(self.name, str) or not KEPT_NAME.fullmatch(self.name):
            raise UsageError(f"mesh name {self.name!r}: use letters, digits, '.', '_' or '-' "
                             "(up to 64, starting with a letter or digit)")
        if self.keep_alive is None:
            object.__setattr__(self, "keep_alive", DEFAULT_KEEP_ALIVE)
        elif isinstance(self.keep_alive, str):
            object.__setattr__(self, "keep_alive", parse_duration(self.keep_alive))
        value = self.keep_alive
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise UsageError(f"keep_alive must be a positive number of seconds (or a duration "
                             f"such as 90s, 30m, 2h), not {value!r}")
        if self.launcher not in ("local", "ssh"):
            raise UsageError("a kept mesh (name=, keep_alive=) runs with --launcher local or "
                             "ssh: a SLURM job step ends every process it started with it")

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values (a kept mesh's record: procs/keptfiles.py)."""
        import dataclasses

        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeshConfig:
        """:meth:`to_dict` read back (lists made tuples again); unknown keys
        (a record of another version) are left out."""
        import dataclasses

        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        for name in ("hosts", "spare_hosts"):
            if isinstance(values.get(name), list):
                values[name] = tuple(values[name])
        if isinstance(values.get("extra_env"), list):
            values["extra_env"] = tuple(tuple(pair) for pair in values["extra_env"])
        return cls(**values)

    @property
    def kept(self) -> bool:
        """The mesh outlives its controller (``name``, ``keep_alive``)."""
        return self.name is not None

    @property
    def encrypted(self) -> bool:
        """CurveZMQ on: any non-loopback bind, unless explicitly turned off."""
        return self.bind not in LOOPBACK and not self.insecure_no_encryption


def _valid_bind(bind: object) -> bool:
    import ipaddress
    import re

    if not isinstance(bind, str) or not bind:
        return False
    if bind == "*":
        return True
    try:
        ipaddress.ip_address(bind)
        return True
    except ValueError:
        return re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", bind) is not None


KEPT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DEFAULT_KEEP_ALIVE = 1800.0  # a kept mesh given only a name waits 30 min for a controller
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds in ``90``, ``90s``, ``30m``, ``2h``, ``1h30m`` or ``1.5h``;
    UsageError for anything else (the message shows the forms)."""
    raw = text.strip().lower() if isinstance(text, str) else ""
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhd]?)", raw)
    if (not raw or not parts or "".join(n + u for n, u in parts) != raw.replace(" ", "")
            or (len(parts) > 1 and not all(u for _, u in parts))):
        raise UsageError(f"{text!r} is not a duration: use seconds or a number with s, m, h "
                         "or d (90s, 30m, 2h, 1h30m)")
    seconds = sum(float(n) * _UNITS[u or "s"] for n, u in parts)
    if not seconds > 0:
        raise UsageError(f"{text!r}: a duration must be more than 0 seconds")
    return seconds


def mesh_size(env: dict[str, str], rank: int) -> int:
    """The mesh's number of ranks in a rank's environment (``WORLD_SIZE`` is
    its torch group's, fewer after a shrink); ``rank + 1`` if neither is set."""
    return int(env.get(ENV_MESH_SIZE) or env.get("WORLD_SIZE") or rank + 1)


def check_hang_timeout(value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise UsageError(f"hang_timeout must be a number of seconds (0 or None: off), "
                         f"not {value!r}")


@dataclass(frozen=True)
class RankEnv:
    """Everything a rank reads from its environment, read once at start."""

    rank: int  # in the torch group it starts in (RANK): see mesh_rank
    world_size: int  # of that group (WORLD_SIZE)
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    controller: str
    key: bytes
    mesh_id: str
    incarnation: int
    backend: str
    parent_pid: int | None
    controller_timeout: float
    generation: int
    identity: str
    max_message_bytes: int
    curve: tuple[bytes, bytes, bytes] | None = None  # server public, own public, own secret
    shm_threshold: int | None = None  # None: no shared memory (a remote or joined rank)
    gpu_ipc: bool = False  # CUDA tensors by IPC handle with the controller (a local GPU rank)
    link_fd: int | None = None  # a local rank's end of its link (wire/link.py), else a DEALER
    ctl_link_fd: int | None = None  # a rank behind a host agent: its control link, else a DEALER
    link_shm: int | None = None  # a rank behind a host agent: frames this big go in passed files
    kept_epoch: int | None = None  # a kept mesh's rank: its first controller's epoch
    controller_pid: int | None = None  # shared memory's peer when its parent is an agent
    mesh_rank: int = -1  # its number in the mesh, stable (-1: rank's, set from the environment)
    mesh_size: int = -1  # the mesh's ranks (-1: world_size's)

    def __post_init__(self) -> None:
        if self.mesh_rank < 0:
            object.__setattr__(self, "mesh_rank", self.rank)
        if self.mesh_size < 0:
            object.__setattr__(self, "mesh_size", self.world_size)

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> RankEnv:
        env = os.environ if environ is None else environ
        missing = [k for k in ("RANK", "WORLD_SIZE", ENV_CONTROLLER) if k not in env]
        if missing:
            raise UsageError(
                f"this process is not a monarch_nb rank (missing {', '.join(missing)}); "
                "ranks are started by Mesh.start / %monarch start"
            )
        parent = env.get(ENV_PARENT_PID)
        return cls(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "0")),
            controller=env[ENV_CONTROLLER],
            key=read_key(env),
            mesh_id=env.get(ENV_MESH_ID, ""),
            incarnation=int(env.get(ENV_INCARNATION, "0")),
            backend=env.get(ENV_BACKEND, "cpu"),
            parent_pid=int(parent) if parent else None,
            controller_timeout=float(env.get(ENV_CONTROLLER_TIMEOUT, "10")),
            generation=int(env.get(ENV_GENERATION, "0")),
            identity=env.get(ENV_IDENTITY) or f"r{env['RANK']}.{env.get(ENV_INCARNATION, '0')}",
            max_message_bytes=int(env.get(ENV_MAX_MESSAGE, str(4 << 30))),
            curve=curve_keys(env),
            shm_threshold=int(env[ENV_SHM]) if env.get(ENV_SHM, "").isdigit() else None,
            gpu_ipc=env.get(ENV_GPU_IPC, "") == "1",
            link_fd=int(env[ENV_LINK_FD]) if env.get(ENV_LINK_FD, "").isdigit() else None,
            link_shm=int(env[ENV_LINK_SHM]) if env.get(ENV_LINK_SHM, "").isdigit() else None,
            ctl_link_fd=(int(env[ENV_CTL_LINK_FD]) if env.get(ENV_CTL_LINK_FD, "").isdigit()
                         else None),
            kept_epoch=int(env[ENV_KEPT_EPOCH]) if env.get(ENV_KEPT_EPOCH, "").isdigit() else None,
            mesh_rank=int(env.get(ENV_MESH_RANK) or env["RANK"]),
            mesh_size=int(env.get(ENV_MESH_SIZE) or env["WORLD_SIZE"]),
            controller_pid=(int(env[ENV_CONTROLLER_PID])
                            if env.get(ENV_CONTROLLER_PID, "").isdigit() else None),
        )


def curve_keys(env: dict[str, str] | os._Environ[str]) -> tuple[bytes, bytes, bytes] | None:
    names = (ENV_CURVE_SERVER, ENV_CURVE_PUBLIC, ENV_CURVE_SECRET)
    values = [env.get(n, "") for n in names]
    if not any(values):
        return None
    if not all(values):
        raise UsageError(f"incomplete CurveZMQ keys: set all of {', '.join(names)}")
    return (values[0].encode("ascii"), values[1].encode("ascii"), values[2].encode("ascii"))


def read_key(env: dict[str, str] | os._Environ[str]) -> bytes:
    """The mesh key from ``MONARCH_NB_KEY`` or the 0600 file named by
    ``MONARCH_NB_KEY_FILE``. A key file readable by others is refused."""
    if env.get(ENV_KEY):
        return bytes.fromhex(env[ENV_KEY])
    path = env.get(ENV_KEY_FILE)
    if not path:
        raise UsageError(f"no mesh key: set {ENV_KEY} or {ENV_KEY_FILE}")
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(f"key file {path} is readable by others; chmod 600 it")
    with open(path, encoding="ascii") as f:
        return bytes.fromhex(f.read().strip())


def write_key_file(path: str, key: bytes) -> None:
    """Write ``key`` as hex to ``path`` atomically with mode 0600 from the
    first byte (never world-readable, not even briefly)."""
    write_secret_file(path, key.hex().encode("ascii"))


def write_secret_file(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a reader sees the old or the
    new content, never half) with mode 0600 from the first byte. Safe
    from several threads at once: each write has its own temporary file (a
    kept agent's threads write its status file at the same moment, and a
    shared name made one of them fail, which ended the agent)."""
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def ssh_template() -> list[str]:
    import shlex

    return shlex.split(os.environ.get(ENV_SSH) or DEFAULT_SSH)


def default_cpu_ranks() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def private(path: str, flags: int) -> int:
    """``open(..., opener=private)``: a new file is created 0600 (rank logs
    hold whatever the user's code prints)."""
    return os.open(path, flags, 0o600)
