"""Launchers: how a rank process is started, and where.

The supervisor decides *when* a rank starts; a launcher decides *how*:

* :class:`LocalLauncher` — ``python -m monarch_nb.worker`` as a child of the
  controller, its environment carrying the keys (the notebook default);
* :class:`SshLauncher` — ``ssh HOST 'cd CWD; exec PYTHON -m monarch_nb.cli
  worker --key-file -'`` per rank (``--hosts a,b``);
* :class:`SlurmLauncher` — ``srun --nodes=1 --ntasks=1 --nodelist=NODE ...``
  per node (its agent), inside an allocation (``salloc``/``sbatch``);
  ``--nodes`` and ``--gpus-per-node`` map onto the allocation's nodes; a
  node given later that is not in the allocation (a failed node SLURM took
  out of the job, back) gets a one-node job of its own;
* :class:`JoinLauncher` — starts nothing: writes each rank's spec to a 0600
  file and waits for ``monarch-nb worker --join tcp://HOST:PORT --key-file
  FILE`` to be run by hand, or by Kubernetes, or anything else. Its local
  handle is a sentinel process: a rank whose heartbeats stop is declared dead
  by killing the sentinel, and its respawn rewrites the file (new
  incarnation) for the next process started with it.

Remote ranks get their environment (rank, world, keys) as one JSON line on the
stdin of ssh/srun (:func:`rank_spec`), never on a command line; they read it,
then keep watching stdin: when the ssh/srun process on the controller's side
goes, the rank exits (no orphans on other hosts). The ssh/srun process is the
rank's local handle: its pidfd tells the controller the rank ended, and
heartbeats catch a rank that hangs.

Placement: rank ``r`` runs on node ``r // per_node`` with local rank
``r % per_node`` (its device index).

Non-goals: when to start or restart (supervisor, policy), the remote side
(join.py).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import IO, Protocol

from .. import config
from ..backends import BackendInfo, resolve, torch_build
from ..errors import UsageError

# Variables a remote rank needs from the controller's side (besides the
# MONARCH_NB_* ones): never the controller's whole environment.
SHIPPED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
           "MASTER_PORT", "PYTHONPATH", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES",
           "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME",
           "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS",
           # torchrun's own (supervisor.py): remote ranks see what local ones do
           "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE",
           "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
           "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE")
NOT_SHIPPED = (config.ENV_PARENT_PID, config.ENV_KEY_FILE, config.ENV_SHM)
# A SLURM node given back outside the allocation: how long its one-node job
# may wait for the node (a node another job holds fails the start instead)
SLURM_IMMEDIATE_S = 30
# node states (scontrol's State=, split at "+") that no job can start on
NODE_NOT_UP = {"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING",
               "POWERED_DOWN", "POWER_DOWN", "POWERING_DOWN", "FUTURE"}


@dataclass(frozen=True)
class Placement:
    host: str  # "" for this machine
    node: int
    local_rank: int
    local_world_size: int


class Handle(Protocol):
    """A started rank as its supervisor sees it: a ``subprocess.Popen``, or
    a rank on another host behind its agent (agents.RemoteRank)."""

    @property
    def pid(self) -> int: ...

    @property
    def stdin(self) -> IO[bytes] | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    """Starts rank processes. Optional attributes the controller reads:
    ``links = True`` (a local launcher whose ranks inherit a link's end,
    wire/link.py) and ``relays = True`` (its ranks' main channels go through
    an agent per host: the controller sets ``route``, called with a rank's
    main id and its agent's id before the rank starts; procs/agents.py)."""

    @property
    def name(self) -> str: ...

    @property
    def remote(self) -> bool: ...

    def placement(self, rank: int, world_size: int) -> Placement: ...

    def master_addr(self, world_size: int) -> str: ...

    def start(self, rank: int, env: dict[str, str], log: IO[bytes]) -> Handle: ...


def _popen(argv: list[str], env: dict[str, str], log: IO[bytes],
           stdin: int, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv, env=env, stdin=stdin, stdout=log, stderr=subprocess.STDOUT,
        # Own session: the terminal's / Jupyter's SIGINT to the controller's
        # process group must not hit ranks directly; interrupts go through
        # the controller, to the call they are meant for.
        start_new_session=True, close_fds=True, pass_fds=pass_fds,
    )


@dataclass
class LocalLauncher:
    """Ranks as children of this process (one machine)."""

    name: str = "local"
    remote: bool = False
    links: bool = True  # its children can inherit a link's end (wire/link.py)

    def placement(self, rank: int, world_size: int) -> Placement:
        return Placement("", 0, rank, world_size)

    def master_addr(self, world_size: int) -> str:
        return "127.0.0.1"

    def start(self, rank: int, env: dict[str, str], log: IO[bytes],
              pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
        return _popen([sys.executable, "-m", "monarch_nb.worker"], env, log, subprocess.DEVNULL,
                      pass_fds)


def rank_spec(env: dict[str, str]) -> bytes:
    """The JSON line a remote rank reads on stdin: its environment."""
    shipped = {k: v for k, v in env.items()
               if (k in SHIPPED or k.startswith("MONARCH_NB_")) and k not in NOT_SHIPPED}
    return json.dumps({"env": shipped}).encode() + b"\n"


def _local_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of the local ssh/srun process: no secrets in it."""
    return {k: v for k, v in env.items() if k not in config.SECRET_ENV}


@dataclass
class _RemoteLauncher:
    nodes: list[str]
    per_node: int
    master: str
    python: str = field(default_factory=lambda: sys.executable)
    cwd: str = field(default_factory=os.getcwd)
    remote: bool = True
    # the node MASTER_ADDR is the address of, when it was not given: the
    # first node's, which moves with it when a spare host takes its place
    master_node: str = ""
    # a kept mesh (procs/keptagent.py): (its name, keep_alive); each host's
    # agent is then reached through its door, and outlives the controller
    kept: tuple[str, float] | None = None

    def placement(self, rank: int, world_size: int) -> Placement:
        node = rank // self.per_node
        return Placement(self.nodes[node], node, rank % self.per_node,
                         min(self.per_node, world_size - node * self.per_node))

    def master_addr(self, world_size: int) -> str:
        if self.master_node and self.nodes[0] != self.master_node:  # rank 0's host was replaced
            self.master_node = self.nodes[0]
            self.master = self.address_of(self.master_node)
        return self.master

    def address_of(self, node: str) -> str:
        return resolve_address(node.rsplit("@", 1)[-1])  # user@host

    def worker_argv(self) -> list[str]:
        return [self.python, "-m", "monarch_nb.cli", "worker", "--key-file", "-"]

    def agent_argv(self, controller_timeout: float, host: str = "") -> list[str]:
        argv = [self.python, "-m", "monarch_nb.agent", "--controller-timeout",
                f"{controller_timeout:g}"]
        if self.kept is not None:  # the door to the host's kept agent (named per host)
            argv += ["--kept", f"{self.kept[0]}@{host}", "--keep-alive", f"{self.kept[1]:g}"]
        return argv

    def command(self, placement: Placement) -> list[str]:
        raise NotImplementedError

    def agent_command(self, host: str, controller_timeout: float) -> list[str]:
        """The command that starts ``host``'s agent (agents.py)."""
        raise NotImplementedError

    def start(self, rank: int, env: dict[str, str], log: IO[bytes]) -> subprocess.Popen[bytes]:
        place = self.placement(rank, config.mesh_size(env, rank))
        popen = _popen(self.command(place), _local_env(env), log, subprocess.PIPE)
        assert popen.stdin is not None
        try:
            popen.stdin.write(rank_spec(env))
            popen.stdin.flush()
        except OSError:
            pass  # it died at once; its exit is reported like any death
        # stdin stays open: its end is the rank's signal that we are gone
        return popen


@dataclass
class SshLauncher(_RemoteLauncher):
    """Hosts reached over ``ssh`` (one session per host, for its agent:
    agents.py). The remote command template comes from
    ``MONARCH_NB_SSH`` (default ``ssh -T -o BatchMode=yes {host}``); the
    agent's command is appended as one shell string, so any remote shell
    prefix works (``ip netns exec {host} sh -c`` runs ranks in network
    namespaces: that is how the tests simulate hosts)."""

    template: list[str] = field(default_factory=lambda: config.ssh_template())
    name: str = "ssh"

    def command(self, placement: Placement) -> list[str]:
        remote = (f"cd {shlex.quote(self.cwd)} 2>/dev/null; exec "
                  + " ".join(shlex.quote(a) for a in self.worker_argv()))
        return [a.replace("{host}", placement.host) for a in self.template] + [remote]

    def agent_command(self, host: str, controller_timeout: float) -> list[str]:
        remote = (f"cd {shlex.quote(self.cwd)} 2>/dev/null; exec "
                  + " ".join(shlex.quote(a) for a in self.agent_argv(controller_timeout, host)))
        return [a.replace("{host}", host) for a in self.template] + [remote]


@dataclass
class SlurmLauncher(_RemoteLauncher):
    """One ``srun`` job step per node (its agent), inside the current
    allocation. ``--overlap`` lets a replacement start while the old step is
    still being cleaned up.

    A node given later (``mesh.add_hosts``) that is not in the allocation
    (any more) runs its agent in a one-node job of its own: SLURM takes a
    failed node out of a ``--no-kill`` job for good, so a step there is
    refused ("Requested node configuration is not available") even once the
    node is back; :meth:`admit` decides, and says what is wrong with a node
    that cannot be given."""

    name: str = "slurm"
    # nodes given by add_hosts outside the allocation: a job of their own each
    outside: set[str] = field(default_factory=set)

    def address_of(self, node: str) -> str:
        return slurm_node_address(node)

    def _srun(self, host: str) -> list[str]:
        if host not in self.outside:
            return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap"]
        # without the job's id srun asks for an allocation of its own; it
        # ends with the agent (the mesh's close, the host lost). --immediate:
        # a node another job took meanwhile fails the start (the host is
        # then lost again, its agent log says why) rather than queueing
        argv = ["env", "-u", "SLURM_JOB_ID", "-u", "SLURM_JOBID", "srun", "--nodes=1",
                "--ntasks=1", f"--nodelist={host}", f"--immediate={SLURM_IMMEDIATE_S}",
                f"--job-name=monarch-nb-{host}"]
        for var, flag in (("SLURM_JOB_PARTITION", "--partition"),
                          ("SLURM_JOB_ACCOUNT", "--account")):
            if os.environ.get(var):
                argv.append(f"{flag}={os.environ[var]}")
        return argv

    def command(self, placement: Placement) -> list[str]:
        return [*self._srun(placement.host), "--kill-on-bad-exit=1", "--quiet",
                *self.worker_argv()]

    def agent_command(self, host: str, controller_timeout: float) -> list[str]:
        # one step per node for its agent; the ranks are the agent's children
        # within that step (a rank respawned on the node needs no new step)
        return [*self._srun(host), "--quiet", f"--chdir={self.cwd}",
                *self.agent_argv(controller_timeout, host)]

    def admit(self, hosts: list[str]) -> None:
        """Hosts given by ``mesh.add_hosts``: each must be a node of the
        cluster that SLURM has up (UsageError saying what to do otherwise);
        one outside the allocation now gets a job of its own."""
        inside = set(slurm_job_nodes())
        for host in hosts:
            state = slurm_node_state(host)
            bad = sorted(set(state.split("+")) & NODE_NOT_UP)
            if bad:
                raise UsageError(
                    f"SLURM node {host} is not up (State={state}): resume it (scontrol update "
                    f"nodename={host} state=resume) or wait until sinfo shows it idle, then "
                    f"give it again")
        for host in hosts:
            if host in inside:
                self.outside.discard(host)
            else:
                self.outside.add(host)


@dataclass
class JoinLauncher:
    """Ranks started by someone else with ``monarch-nb worker --join``."""

    folder: str
    per_node: int = 1
    master: str = "127.0.0.1"
    name: str = "join"
    remote: bool = True

    def placement(self, rank: int, world_size: int) -> Placement:
        return Placement("", rank, 0, 1)  # one rank per joining process / pod

    def master_addr(self, world_size: int) -> str:
        return self.master

    def spec_path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank{rank}.json")

    def start(self, rank: int, env: dict[str, str], log: IO[bytes]) -> subprocess.Popen[bytes]:
        path = self.spec_path(rank)
        config.write_secret_file(path, rank_spec(env))
        sys.stderr.write(f"monarch_nb: rank {rank} (incarnation "
                         f"{env.get(config.ENV_INCARNATION, '0')}) waits for: monarch-nb worker "
                         f"--join {env[config.ENV_CONTROLLER]} --key-file {path}\n")
        # The sentinel: alive while the rank counts as alive; it exits when
        # its stdin closes (the mesh stops) and is killed when the rank dies.
        return _popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                      _local_env(env), log, subprocess.PIPE)


# -- building one from a MeshConfig -------------------------------------------------------------
def world_and_per_node(n: int | None, nodes: int, gpus_per_node: int | None) -> tuple[int, int]:
    """(world size, ranks per node) for ``nodes`` nodes."""
    if gpus_per_node is not None:
        world = n if n is not None else nodes * gpus_per_node
        if world > nodes * gpus_per_node:
            raise UsageError(f"-n {world} does not fit on {nodes} node(s) x {gpus_per_node} "
                             f"rank(s); raise --nodes or --gpus-per-node")
        return world, gpus_per_node
    world = n if n is not None else nodes
    return world, max(1, math.ceil(world / nodes))


def resolve_address(host: str) -> str:
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return host


def slurm_nodes() -> list[str]:
    """The node names of the current allocation (in order)."""
    if not os.environ.get("SLURM_JOB_ID"):
        raise UsageError("--launcher slurm runs inside a SLURM allocation: start the launch "
                         "from salloc or an sbatch script (no SLURM_JOB_ID here)")
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    if shutil.which("scontrol") is None:
        raise UsageError("--launcher slurm needs scontrol and srun on PATH")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                         text=True, timeout=30)
    nodes = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not nodes:
        raise UsageError(f"cannot list the allocation's nodes ({nodelist!r}): {out.stderr.strip()}")
    return nodes


def slurm_job_nodes() -> list[str]:
    """The nodes of the current job now: without the ones SLURM took out of
    it (a failed node of a ``--no-kill`` job), unlike SLURM_JOB_NODELIST."""
    job = os.environ.get("SLURM_JOB_ID", "")
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                         text=True, timeout=30)
    listed = next((item.split("=", 1)[1] for item in out.stdout.split()
                   if item.startswith("NodeList=")), "")
    if out.returncode != 0 or not listed or listed == "(null)":
        return []
    names = subprocess.run(["scontrol", "show", "hostnames", listed], capture_output=True,
                           text=True, timeout=30)
    return [line.strip() for line in names.stdout.splitlines() if line.strip()]


def slurm_node_state(node: str) -> str:
    """``node``'s state as scontrol says it (``IDLE``, ``DOWN+NOT_RESPONDING``,
    ...); UsageError for a name that is not a node of this cluster."""
    out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True,
                         text=True, timeout=30)
    state = next((item.split("=", 1)[1] for item in out.stdout.split()
                  if item.startswith("State=")), "")
    if out.returncode != 0 or not state:
        why = (out.stderr or out.stdout).strip() or "no such node"
        raise UsageError(f"{node!r} is not a node of this SLURM cluster ({why}); give a node "
                         f"name as sinfo -N lists it")
    return state


def slurm_node_address(node: str) -> str:
    """The address slurm knows a node by (``NodeAddr``), else its name resolved."""
    out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True,
                         text=True, timeout=30)
    for item in out.stdout.split():
        if item.startswith("NodeAddr="):
            return resolve_address(item.split("=", 1)[1])
    return resolve_address(node)


def from_config(cfg: config.MeshConfig, n: int | None) -> tuple[Launcher, int]:
    """The launcher for ``cfg`` and the world size it gives."""
    if cfg.launcher == "local":
        if cfg.nodes not in (None, 1):
            raise UsageError(f"--nodes {cfg.nodes} needs --launcher slurm or ssh; the local "
                             "launcher runs on this machine only")
        world = n if n is not None else cfg.gpus_per_node
        return LocalLauncher(), world or 0
    if cfg.launcher == "join":
        folder = cfg.join_dir or tempfile.mkdtemp(prefix="monarch-nb-join-")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
        world = n if n is not None else (cfg.nodes or 1) * (cfg.gpus_per_node or 1)
        return JoinLauncher(folder, master=cfg.master_addr or "127.0.0.1"), world
    if cfg.launcher == "ssh":
        hosts = list(cfg.hosts)
        nodes = cfg.nodes or len(hosts)
        if nodes > len(hosts):
            raise UsageError(f"--nodes {nodes} but only {len(hosts)} host(s) in --hosts")
        world, per_node = world_and_per_node(n, nodes, cfg.gpus_per_node)
        launcher = SshLauncher(hosts[:nodes], per_node, cfg.master_addr or "",
                               master_node="" if cfg.master_addr else hosts[0])
        if not cfg.master_addr:
            launcher.master = launcher.address_of(hosts[0])
        return launcher, world
    all_nodes = slurm_nodes()
    env_nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", len(all_nodes)))
    nodes = cfg.nodes or min(env_nodes, len(all_nodes))
    if nodes > len(all_nodes):
        raise UsageError(f"--nodes {nodes} but the allocation has {len(all_nodes)} node(s)")
    wanted: int | None = cfg.gpus_per_node
    tasks = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if wanted is None and n is None and tasks.isdigit():
        wanted = int(tasks)
    world, per = world_and_per_node(n, nodes, wanted)
    master = cfg.master_addr or slurm_node_address(all_nodes[0])
    return SlurmLauncher(all_nodes[:nodes], per, master,
                         master_node="" if cfg.master_addr else all_nodes[0]), world


def remote_backend(requested: str, launcher: Launcher) -> BackendInfo:
    """The backend of ranks on other nodes: their GPUs are not visible from
    here, so the node's devices are assumed to be 0..per_node-1 (each rank
    pins ``local_rank``); a CPU build of torch here means CPU ranks."""
    build = torch_build()
    flavour = "rocm" if build["hip"] else ("cuda" if build["cuda"] else "cpu")
    if requested == "cpu" or (requested == "auto" and flavour == "cpu"):
        return resolve("cpu")
    if requested in ("cuda", "rocm") and flavour not in (requested, "cpu"):
        raise UsageError(f"--backend {requested} but torch here is a {flavour} build")
    name = flavour if requested == "auto" else requested
    per_node = int(getattr(launcher, "per_node", 1))
    return BackendInfo(name, "nccl", build["version"], tuple(str(i) for i in range(per_node)))


__all__ = ["Handle", "JoinLauncher", "Launcher", "LocalLauncher", "Placement", "SlurmLauncher", "SshLauncher",
           "from_config", "rank_spec"]
