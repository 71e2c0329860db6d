"""The launcher's command line: its own options, torchrun's, and the
announced form.

Three ways to say the same launch, all accepted by ``python -m monarch_nb.launch``:

* its own options before the script: ``--backend rocm --nodes 8
  --gpus-per-node 8 train.py --lr 0.1``;
* the announced form (Monarch's ROCm announcement): the launcher's own
  options after the script are the launcher's, ``--`` ends them, everything
  else goes to the script: ``--backend=rocm train.py --nodes=8
  --gpus-per-node=8 --lr 0.1``. A line on stderr says which were taken;
* torchrun's flags, every one of ``torchrun --help`` (torch 2.13), in both
  spellings (``--nproc-per-node``/``--nproc_per_node``): honoured with
  torchrun's meaning where monarch_nb has one, accepted with a notice where
  it is moot here (the controller is the rendezvous, deaths are seen at
  once), refused with a message naming what to use where it would mean
  something monarch_nb does not do (a per-node agent, NUMA binding).
  ``--nnodes MIN:MAX`` counts hosts: MAX are started, MIN of them is the
  run's ``min_ranks`` (one machine is one node).

:func:`plan` turns the parsed options into ``Mesh.start`` keyword
arguments, the run's own settings (how to run the script, log files, which
ranks' output to show) and the notices to print. Pure: no process, no I/O
except counting this machine's GPUs for ``--nproc-per-node gpu|auto``.

Non-goals: running anything (launch.py), the ranks' environment (supervisor.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import uuid
from dataclasses import dataclass, field
from typing import Any

from .config import BACKENDS, LAUNCHERS, LOOPBACK, RESPAWN_MODES, MeshConfig
from .errors import UsageError

# The launcher's own options that the announced form takes after the script.
AFTER_SCRIPT = ("--backend", "--nodes", "--gpus-per-node", "--respawn", "--launcher", "--hosts",
                "--spare-hosts", "--host-timeout")
ENV_VIRTUAL_LOCAL_RANK = "MONARCH_NB_VIRTUAL_LOCAL_RANK"  # read by Supervisor.env_for
DEFAULT_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's
# torchrun's: ${role_name}, ${rank}, ${local_rank} (string.Template) before each line
ENV_LINE_PREFIX = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


def _both(name: str) -> list[str]:
    """torchrun's two spellings: ``--nproc-per-node`` and ``--nproc_per_node``."""
    under = name.replace("-", "_")
    return [f"--{name}", f"--{under}"] if under != name else [f"--{name}"]


def build_parser(prog: str = "python -m monarch_nb.launch") -> argparse.ArgumentParser:
    # allow_abbrev: torchrun's parser takes unambiguous prefixes (--redirect,
    # --max-restart, --standal); parse() resolves them the same way
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run SCRIPT on every rank of a mesh controlled by this process "
                    "(supervised: dead ranks are respawned and run the script again).",
        epilog="Options go before SCRIPT. After SCRIPT, the launcher's own options "
               f"({', '.join(AFTER_SCRIPT)}) are still the launcher's (the announced form: "
               "train.py --nodes=8 --gpus-per-node=8); `--` ends them and everything else "
               "is passed to the script. torchrun's flags are accepted too (README: "
               "'torchrun flags').",
    )
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--nodes", type=int, default=None, metavar="N",
                   help="number of nodes (slurm/ssh: nodes of the allocation or --hosts; local: 1)")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                   help="ranks per node (one per GPU; with --backend cpu, CPU ranks per node)")
    p.add_argument("-n", "--ranks", dest="n", type=int, default=None, metavar="N",
                   help="total ranks (default: nodes x gpus-per-node, else the visible GPUs, "
                        "else min(4, CPU cores))")
    p.add_argument("--respawn", default="rank", choices=RESPAWN_MODES)
    p.add_argument("--launcher", default=None, choices=LAUNCHERS,
                   help="local (default), ssh, slurm, or join (ranks started by hand)")
    p.add_argument("--hosts", default="", help="comma-separated hosts (ssh launcher)")
    p.add_argument("--spare-hosts", default="",
                   help="comma-separated hosts kept free for the ranks of a lost host (ssh, "
                        "slurm; under slurm: the allocation's nodes beyond --nodes by default)")
    p.add_argument("--min-ranks", type=int, default=None, metavar="M",
                   help="an elastic world size: the run goes on while at least M ranks are left "
                        "(default: MIN nodes' ranks of --nnodes MIN:MAX, else every rank)")
    p.add_argument("--host-timeout", type=float, default=5.0,
                   help="a host whose agent is silent this many seconds is lost (default 5)")
    p.add_argument("--bind", default=None,
                   help="controller address (default: loopback for local, this host's "
                        "address for ssh/slurm; non-loopback turns on CurveZMQ)")
    p.add_argument(*_both("master-addr"), dest="master_addr", default=None,
                   help="rank 0's host address for torch.distributed (default: 127.0.0.1 "
                        "locally, the first host / slurm node otherwise)")
    p.add_argument("--insecure-no-encryption", action="store_true",
                   help="DANGEROUS: no CurveZMQ on a non-loopback bind (messages stay signed "
                        "but anyone on the network can read them)")
    p.add_argument("--no-status", action="store_true",
                   help="no live status display (also off when stderr is not a terminal)")

    t = p.add_argument_group("torchrun's flags", "accepted as torchrun has them (README: "
                             "'torchrun flags' says what each does here)")
    t.add_argument("--nnodes", default=None,
                   help="N, or MIN:MAX: MAX nodes (hosts) are started and the run goes on "
                        "while MIN nodes' ranks are left (--min-ranks); one machine is one node")
    t.add_argument(*_both("nproc-per-node"), dest="nproc_per_node", default=None,
                   help="ranks per node: a number, gpu, cpu or auto")
    t.add_argument("--standalone", action="store_true", help="one node (the default here)")
    t.add_argument(*_both("node-rank"), dest="node_rank", type=int, default=None)
    t.add_argument(*_both("max-restarts"), dest="max_restarts", type=int, default=None,
                   help="respawns of one rank before it counts as failed")
    t.add_argument(*_both("rdzv-backend"), dest="rdzv_backend", default=None)
    t.add_argument(*_both("rdzv-endpoint"), dest="rdzv_endpoint", default=None)
    t.add_argument(*_both("rdzv-id"), dest="rdzv_id", default=None)
    t.add_argument(*_both("rdzv-conf"), dest="rdzv_conf", default=None)
    t.add_argument(*_both("master-port"), dest="master_port", type=int, default=None)
    t.add_argument(*_both("monitor-interval"), dest="monitor_interval", type=float, default=None)
    t.add_argument(*_both("start-method"), dest="start_method", default=None,
                   choices=["spawn", "fork", "forkserver"])
    t.add_argument(*_both("event-log-handler"), dest="event_log_handler", default=None)
    t.add_argument("--role", default="default")
    t.add_argument("-m", "--module", action="store_true",
                   help="SCRIPT is a module name, run as `python -m` would")
    t.add_argument(*_both("no-python"), dest="no_python", action="store_true",
                   help="SCRIPT is a program, run as a child of each rank")
    t.add_argument(*_both("run-path"), dest="run_path", action="store_true",
                   help="run SCRIPT with runpy.run_path in the rank (what is done anyway)")
    t.add_argument(*_both("log-dir"), dest="log_dir", default=None,
                   help="save every rank's output under LOG_DIR/RUN_ID/")
    t.add_argument("-r", "--redirects", default=None,
                   help="rank output to the log files only: 1 stdout, 2 stderr, 3 both; "
                        "or per local rank, 0:1,1:2")
    t.add_argument("-t", "--tee", default=None, help="rank output to the log files and the console")
    t.add_argument(*_both("local-ranks-filter"), dest="local_ranks_filter", default=None,
                   help="show only these local ranks' output on the console, e.g. 0,1")
    t.add_argument(*_both("duplicate-stdout-filters"), dest="dup_stdout", default=None)
    t.add_argument(*_both("duplicate-stderr-filters"), dest="dup_stderr", default=None)
    t.add_argument(*_both("local-addr"), dest="local_addr", default=None)
    t.add_argument(*_both("logs-specs"), dest="logs_specs", default=None)
    t.add_argument(*_both("numa-binding"), dest="numa_binding", default=None,
                   choices=["node", "socket", "exclusive", "core-complex"])
    t.add_argument(*_both("signals-to-handle"), dest="signals_to_handle", default=None)
    t.add_argument(*_both("shutdown-timeout"), dest="shutdown_timeout", type=float, default=None)
    t.add_argument(*_both("virtual-local-rank"), dest="virtual_local_rank", action="store_true")

    p.add_argument("script", help="the Python file every rank runs as __main__ (with -m a "
                                  "module, with --no-python a program)")
    p.add_argument("args", nargs="*", help="arguments for the script")
    for action in torchrun_actions(p):
        _env_default(p, action)
    return p


TORCHRUN_GROUP = "torchrun's flags"


def torchrun_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions of torchrun's flags (--master-addr too: torchrun has it)."""
    out = [a for g in parser._action_groups if g.title == TORCHRUN_GROUP
           for a in g._group_actions]
    return out + [a for a in parser._actions if a.dest == "master_addr"]


def pet_name(action: argparse.Action) -> str:
    """torchrun's environment variable for a flag (torch/distributed/
    argparse_util.py): PET_ and its dest, which argparse takes from the
    longest option string (--duplicate-stdout-filters: PET_DUPLICATE_STDOUT_FILTERS)."""
    longest = max(action.option_strings, key=len)
    return "PET_" + longest.lstrip("-").replace("-", "_").upper()


def _env_default(parser: argparse.ArgumentParser, action: argparse.Action) -> None:
    """torchrun reads every flag it is not given from PET_<FLAG> (its
    ``env`` / ``check_env`` actions): the flag's default becomes it."""
    value = os.environ.get(pet_name(action))
    if value is None:
        return
    if action.nargs == 0:  # a switch: check_env's int(), 1 on, 0 off
        try:
            action.default = bool(int(value))
        except ValueError:
            parser.error(f"{pet_name(action)}={value!r}: 1 turns "
                         f"{action.option_strings[-1]} on, 0 off")
        return
    action.default = value  # a string default goes through the flag's type


def _given_torchrun(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> list[str]:
    """The torchrun flags this launch uses (on the command line or as PET_
    variables), by name."""
    used = []
    for action in torchrun_actions(parser):
        if action.dest == "master_addr":
            continue  # the launcher's own option too: it says nothing of torchrun
        value = getattr(ns, action.dest, None)
        if pet_name(action) in os.environ or value not in (None, False, "default"):
            used.append(action.option_strings[0])
    return used


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Options, the script, and the script's arguments verbatim (argparse
    would eat a leading ``--`` or take the script's own options). After the
    script, the launcher's own options (AFTER_SCRIPT) are taken, up to a
    ``--``; ``ns.taken`` lists them."""
    takes_value = {opt for action in parser._actions if action.nargs != 0
                   for opt in action.option_strings}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            i += 1
            break
        if not tok.startswith("-") or tok == "-":
            break
        i += 2 if _resolve(parser, tok) in takes_value else 1  # (--opt=value, -n2: one token)
    options = [t for t in argv[:i] if t != "--"]
    if i >= len(argv):
        parser.parse_args(options)  # --help, or "the following arguments are required: script"
        parser.error("the following arguments are required: script")
    script, rest = argv[i], argv[i + 1:]
    taken: list[str] = []
    args: list[str] = []
    j = 0
    while j < len(rest):
        tok = rest[j]
        if tok == "--":
            args.extend(rest[j + 1:])
            break
        name, eq, _ = tok.partition("=")
        if name in AFTER_SCRIPT:
            step = 1 if eq or j + 1 >= len(rest) else 2
            taken.extend(rest[j:j + step])
            j += step
            continue
        args.append(tok)
        j += 1
    ns = parser.parse_args([*options, *taken, "--", script])
    ns.args = args
    ns.taken = taken
    ns.torchrun = _given_torchrun(parser, ns)
    return ns


def _resolve(parser: argparse.ArgumentParser, tok: str) -> str:
    """The option a token names: itself, or the one option an unambiguous
    prefix stands for (``--max-restart`` is ``--max-restarts``; argparse
    says so itself when a prefix is ambiguous)."""
    if tok in parser._option_string_actions or not tok.startswith("--") or "=" in tok:
        return tok
    actions = {id(a): opt for opt, a in parser._option_string_actions.items()
               if opt.startswith(tok)}
    return next(iter(actions.values())) if len(actions) == 1 else tok


# -- what the options mean ------------------------------------------------------------------
@dataclass
class Plan:
    """A launch, decided: ``mesh`` are ``Mesh.start`` keyword arguments."""

    mesh: dict[str, Any]
    mode: str = "path"  # path | module | exec (run_script's modes)
    run_id: str = ""
    per_node: int = 1
    log_dir: str | None = None
    console: dict[int, set[str]] | None = None  # local rank -> streams shown (None: all)
    hidden: dict[int, set[str]] = field(default_factory=dict)  # local rank -> streams not shown
    # local rank (-1: every one) -> streams -r/-t send to log files; None: all
    # ranks' output is saved (--log-dir alone)
    logged: dict[int, set[str]] | None = None
    role: str = "default"
    line_prefix: str | None = None  # TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE
    dup_filters: dict[str, list[str]] = field(default_factory=dict)  # stream -> words
    notes: list[str] = field(default_factory=list)
    # signals passed on to every rank that then stop the run after
    # shutdown_timeout s (torchrun's --signals-to-handle, SIGTERM always);
    # SIGUSR1/SIGUSR2 not among them are passed on and the run goes on
    stop_signals: frozenset[int] = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                              signal.SIGQUIT})
    shutdown_timeout: float = 30.0  # torchrun's default (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)

    @property
    def forward_signals(self) -> frozenset[int]:
        """Signals passed on to every rank: the stopping ones and SIGUSR1/2."""
        return self.stop_signals | {signal.SIGUSR1, signal.SIGUSR2}


def _nnodes(text: str | None) -> tuple[int, int] | None:
    """torchrun's ``--nnodes N`` or ``MIN:MAX``: (MIN, MAX)."""
    if text is None:
        return None
    low, sep, high = text.partition(":")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        raise UsageError(f"--nnodes {text!r}: give a number of nodes (--nnodes 2) or a range "
                         "MIN:MAX (--nnodes 1:2)") from None
    if lo < 1:
        raise UsageError(f"--nnodes {text}: a run needs at least 1 node, not {lo}")
    if lo > hi:
        raise UsageError(f"--nnodes {text}: MIN ({lo}) is more than MAX ({hi}); "
                         f"write --nnodes {hi}:{lo}")
    return lo, hi


def _several_hosts(ns: argparse.Namespace) -> bool:
    """Does this launch start nodes on other hosts (ssh, SLURM, join), or
    only this machine (one node)? As plan() picks the launcher."""
    if ns.launcher is not None:
        return bool(ns.launcher != "local")
    return bool(ns.hosts or os.environ.get("SLURM_JOB_ID")
                or (ns.rdzv_endpoint and not ns.standalone))


def _nproc(value: str | None, backend: str) -> tuple[int | None, str]:
    """(ranks per node, backend) for torchrun's --nproc-per-node."""
    if value is None:
        return None, backend
    if value.isdigit():
        return int(value), backend
    if value == "xpu":
        raise UsageError("--nproc-per-node xpu: monarch_nb runs on CUDA, ROCm or CPU ranks; "
                         "use a number, gpu, cpu or auto")
    if value not in ("gpu", "cpu", "auto"):
        raise UsageError(f"--nproc-per-node {value!r}: use a number, gpu, cpu or auto")
    if value == "cpu":
        return os.cpu_count() or 1, "cpu" if backend == "auto" else backend
    from .backends import resolve

    info = resolve("auto" if backend == "cpu" and value == "gpu" else backend)
    if info.devices:
        return len(info.devices), backend
    if value == "gpu":
        raise UsageError("--nproc-per-node gpu: torch sees no GPU here; use --nproc-per-node "
                         "cpu or a number (CPU ranks)")
    return os.cpu_count() or 1, "cpu" if backend == "auto" else backend  # auto without a GPU


def _streams(spec: str | None, flag: str) -> dict[int, set[str]]:
    """torchrun's -r/-t: ``3`` (every local rank) or ``0:1,1:2``; -1 = all ranks."""
    if spec is None:
        return {}
    names = {"0": set(), "1": {"stdout"}, "2": {"stderr"}, "3": {"stdout", "stderr"}}
    out: dict[int, set[str]] = {}
    for part in spec.split(","):
        rank, sep, code = part.strip().rpartition(":")
        if code not in names or (sep and not rank.isdigit()):
            raise UsageError(f"{flag} {spec!r}: use 0-3 (1 stdout, 2 stderr, 3 both) or "
                             "LOCAL_RANK:0-3 pairs, e.g. 0:1,1:2")
        out[int(rank) if sep else -1] = names[code]
    return out


def _filters(text: str | None) -> list[str]:
    if not text:
        return []
    return [w.replace("\0", ",") for w in text.replace(",,", "\0").split(",") if w]


def _signal_set(text: str) -> frozenset[int]:
    """torchrun's --signals-to-handle: ``SIGTERM,SIGUSR1``; SIGTERM always."""
    out = {signal.SIGTERM}
    for name in (w.strip() for w in text.split(",")):
        if not name:
            continue
        num = getattr(signal, name.upper() if name.upper().startswith("SIG")
                      else "SIG" + name.upper(), None)
        if not isinstance(num, signal.Signals) or num in (signal.SIGKILL, signal.SIGSTOP):
            raise UsageError(f"--signals-to-handle {text!r}: {name!r} is not a signal that can "
                             "be handled; give names such as SIGTERM,SIGUSR1")
        out.add(num)
    return frozenset(out)


def plan(ns: argparse.Namespace) -> Plan:
    """What the parsed options ask for (UsageError for what cannot be done)."""
    notes: list[str] = []

    def moot(flag: str, why: str) -> None:
        notes.append(f"monarch_nb: {flag} is not used: {why}")

    if ns.node_rank not in (None, 0):
        raise UsageError(f"--node-rank {ns.node_rank}: monarch_nb starts every node from one "
                         "controller; run the launch once, on node 0, with --nnodes N and "
                         "--hosts H1,H2 (ssh) or inside a SLURM allocation, or start the ranks "
                         "of other nodes with `monarch-nb worker --join` (--launcher join)")
    if ns.numa_binding:
        raise UsageError("--numa-binding is not supported: monarch_nb does not bind ranks to "
                         "CPUs; leave it out, or wrap the launch in numactl")
    if ns.logs_specs:
        raise UsageError("--logs-specs is not supported: monarch_nb writes rank logs itself; "
                         "use --log-dir DIR (with -r/-t and --local-ranks-filter)")
    if ns.module and ns.no_python:
        raise UsageError("Don't use both the '--no-python' flag and the '--module' flag at "
                         "the same time.")

    nodes = ns.nodes
    span = _nnodes(ns.nnodes)
    min_nodes = None  # --nnodes MIN:MAX with MIN < MAX: the run goes on with MIN nodes' ranks
    if span is not None:
        lo, hi = span
        nnodes = hi  # the controller starts every node: MAX of them
        if lo < hi:
            min_nodes = lo
            if not _several_hosts(ns):
                # one machine is one node: its ranks are the whole run (a
                # rank past its budget ends it, as on torchrun's one node)
                if lo > 1:
                    raise UsageError(
                        f"--nnodes {ns.nnodes}: this machine is one node, fewer than MIN={lo}; "
                        "a node is a host here: give --hosts H1,H2 (ssh), run inside a SLURM "
                        f"allocation, or use --nnodes 1:{hi} on one machine")
                nnodes = 1
                notes.append(f"monarch_nb: --nnodes {ns.nnodes} on one machine: one node "
                             "(this machine; a node is a host)")
        if nodes is not None and nodes != nnodes:
            raise UsageError(f"--nodes {nodes} and --nnodes {ns.nnodes} disagree; give one")
        nodes = nnodes
    per_node, backend = _nproc(ns.nproc_per_node, ns.backend)
    if per_node is not None:
        if ns.gpus_per_node is not None and ns.gpus_per_node != per_node:
            raise UsageError(f"--gpus-per-node {ns.gpus_per_node} and --nproc-per-node "
                             f"{ns.nproc_per_node} disagree; give one")
    else:
        per_node = ns.gpus_per_node
    if nodes is not None and nodes < 1:
        raise UsageError(f"--nodes must be at least 1, not {nodes}")
    if per_node is not None and per_node < 1:
        raise UsageError(f"--gpus-per-node must be at least 1, not {per_node}")
    if ns.standalone and (nodes or 1) > 1:
        raise UsageError(f"--standalone runs on one node, not {nodes}; leave out --standalone "
                         "for several nodes")

    launcher = ns.launcher
    bind, master = ns.bind, ns.master_addr
    endpoint = None if ns.standalone else ns.rdzv_endpoint
    if ns.standalone and ns.rdzv_endpoint:
        moot("--rdzv-endpoint", "--standalone chooses its own (as torchrun does)")
    if launcher is None:
        launcher = "local"
        if (nodes or 1) > 1:
            if ns.hosts:
                launcher = "ssh"
            elif os.environ.get("SLURM_JOB_ID"):
                launcher = "slurm"
            elif endpoint:
                launcher = "join"
            else:
                raise UsageError(f"--nnodes {nodes}: monarch_nb starts every node from this one "
                                 "controller: add --hosts H1,H2 (ssh), run inside a SLURM "
                                 "allocation, or give --rdzv-endpoint HOST:PORT to start the "
                                 "ranks by hand (monarch-nb worker --join)")
    if endpoint:
        host = endpoint.rsplit(":", 1)[0].strip("[]") if ":" in endpoint else endpoint
        if launcher == "join":
            bind = bind or (host if host not in LOOPBACK else None)
            master = master or host
            notes.append(f"monarch_nb: --rdzv-endpoint {endpoint}: this controller is the "
                         f"rendezvous, listening on {host} (its port is chosen freely); each "
                         "rank's `monarch-nb worker --join` command is printed below")
        elif launcher == "local":
            moot(f"--rdzv-endpoint {endpoint}", "one node: the ranks meet at this controller")
        else:
            master = master or (host if host not in LOOPBACK else None)
            notes.append(f"monarch_nb: --rdzv-endpoint {endpoint}: this controller is the "
                         f"rendezvous; the {launcher} launcher starts every node's ranks")
    if ns.rdzv_backend and ns.rdzv_backend not in ("c10d", "static"):
        moot(f"--rdzv-backend {ns.rdzv_backend}", "this controller is the rendezvous")

    opts: dict[str, Any] = {"backend": backend, "respawn": ns.respawn, "launcher": launcher,
                            "hosts": ns.hosts, "host_timeout": ns.host_timeout}
    if ns.spare_hosts:
        opts["spare_hosts"] = ns.spare_hosts
    # torchrun's flags in use: torchrun's defaults too (1 rank per node, no
    # restart), said once; with none, monarch_nb's own (min(4, cores) ranks,
    # MeshConfig.restart_budget respawns)
    torchrun = list(getattr(ns, "torchrun", []))
    max_restarts = ns.max_restarts
    restarts_flag = f"--max-restarts {max_restarts}"
    if torchrun:
        defaulted = []
        if per_node is None and ns.n is None:
            per_node = 1
            defaulted.append("--nproc-per-node 1")
        if max_restarts is None:
            max_restarts = 0
            restarts_flag = "--max-restarts 0 (torchrun's default with torchrun's flags)"
            defaulted.append("--max-restarts 0: a dead rank is not respawned")
        if defaulted:
            notes.append(f"monarch_nb: torchrun's flags in use ({', '.join(torchrun)}), so "
                         f"torchrun's defaults apply: {'; '.join(defaulted)}")
    n = ns.n
    if n is None and per_node is not None:
        n = (nodes or 1) * per_node
    opts["n"] = n
    # a script's re-runs are new processes (torchrun's restarts), except ranks
    # in an mnb.elastic loop, which carry on in place (policy.py)
    opts["restart_group"] = True
    min_ranks = ns.min_ranks
    if min_ranks is None and min_nodes is not None:
        per = per_node or (max(1, n // (nodes or 1)) if n is not None else None)
        if per is None:  # the default world size: known once the mesh starts
            raise UsageError(f"--nnodes {ns.nnodes}: say how many ranks a node has "
                             "(--nproc-per-node N) or give --min-ranks M")
        min_ranks = min_nodes * per
        notes.append(f"monarch_nb: --nnodes {ns.nnodes}: the run goes on while at least "
                     f"{min_ranks} rank(s) ({min_nodes} node(s) of {per}) are left "
                     "(--min-ranks)")
    if min_ranks is not None:
        if min_ranks < 1 or (n is not None and min_ranks > n):
            raise UsageError(f"--min-ranks {min_ranks}: give a number of ranks from 1 to the "
                             f"{n or 'started'} rank(s) of the launch")
        opts["min_ranks"] = min_ranks
    if nodes is not None:
        opts["nodes"] = nodes
    if per_node is not None:
        opts["gpus_per_node"] = per_node
    if bind is not None:
        opts["bind"] = bind
    if master is not None:
        opts["master_addr"] = master
    if ns.insecure_no_encryption:
        opts["insecure_no_encryption"] = True
    budget = MeshConfig.restart_budget
    if max_restarts is not None:
        if max_restarts < 0:
            raise UsageError(f"--max-restarts must be 0 or more, not {max_restarts}")
        budget = opts["restart_budget"] = max_restarts
        if max_restarts == 0:  # what a dead rank's line says instead of a spent budget
            opts["no_restarts_hint"] = f"{restarts_flag}; pass --max-restarts N"
    for item in (ns.rdzv_conf or "").split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if not key:
            continue
        if key == "join_timeout":
            try:
                opts["start_timeout"] = float(value)
            except ValueError:
                raise UsageError(f"--rdzv-conf join_timeout={value!r}: a number of seconds") \
                    from None
        else:
            moot(f"--rdzv-conf {key}", "this controller is the rendezvous (join_timeout is "
                                       "the one setting it takes: how long ranks may take to start)")

    if ns.master_port is not None:
        moot(f"--master-port {ns.master_port}", "the controller picks a free port for each "
                                                "generation of the group (it re-forms the group "
                                                "after a death); MASTER_PORT names it")
    if ns.monitor_interval is not None:
        moot("--monitor-interval", "a rank's death is seen at once (pidfd) and a hung one by "
                                   "its heartbeats")
    if ns.start_method in ("fork", "forkserver"):
        moot(f"--start-method {ns.start_method}", "a host's ranks are forked from its warm "
                                                  "process, which imported torch but never a "
                                                  "device (MONARCH_NB_FORK=0: fresh "
                                                  "interpreters; docs/warm-process.md)")
    if ns.event_log_handler:
        moot("--event-log-handler", "monarch_nb's events are shown here and in mesh.events")
    if ns.local_addr:
        moot("--local-addr", "the controller's address is --bind")
    stop_signals = _signal_set(ns.signals_to_handle or DEFAULT_SIGNALS_TO_HANDLE)
    grace = ns.shutdown_timeout
    if grace is None:
        text = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
        try:
            grace = float(text)
        except ValueError:
            raise UsageError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={text!r}: a number of seconds") \
                from None
    if grace < 0:
        raise UsageError(f"--shutdown-timeout must be 0 or more, not {grace:g}")

    run_id = (None if ns.standalone else ns.rdzv_id) or uuid.uuid4().hex
    env = {"ROLE_NAME": ns.role, "TORCHELASTIC_RUN_ID": run_id,
           "TORCHELASTIC_MAX_RESTARTS": str(budget)}
    if ns.virtual_local_rank:
        env[ENV_VIRTUAL_LOCAL_RANK] = "1"
    opts["extra_env"] = tuple(sorted(env.items()))

    redirects, tees = _streams(ns.redirects, "-r"), _streams(ns.tee, "-t")
    # torchrun: a tee'd stream goes to the file and the console, whatever -r
    # says of it; only the local ranks -r/-t name have log files
    hidden, logged = {}, None
    if redirects or tees:
        def of(table: dict[int, set[str]], rank: int) -> set[str]:
            return table.get(rank, table.get(-1, set()))

        keys = set(redirects) | set(tees)
        hidden = {k: of(redirects, k) - of(tees, k) for k in keys}
        logged = {k: of(redirects, k) | of(tees, k) for k in keys}
    log_dir = ns.log_dir
    if (redirects or tees or ns.dup_stdout or ns.dup_stderr) and log_dir is None:
        import tempfile

        log_dir = tempfile.mkdtemp(prefix="monarch-nb-logs-")
    console = None
    if ns.local_ranks_filter:
        try:
            shown = {int(r) for r in ns.local_ranks_filter.split(",") if r.strip()}
        except ValueError:
            raise UsageError(f"--local-ranks-filter {ns.local_ranks_filter!r}: local ranks, "
                             "e.g. 0,1") from None
        console = {r: {"stdout", "stderr"} for r in shown}
    mode = "module" if ns.module else ("exec" if ns.no_python else "path")
    return Plan(mesh=opts, mode=mode, run_id=run_id, per_node=per_node or n or 1,
                stop_signals=stop_signals, shutdown_timeout=grace,
                log_dir=log_dir, console=console, hidden=hidden, logged=logged,
                role=ns.role, line_prefix=os.environ.get(ENV_LINE_PREFIX) or None,
                dup_filters={"stdout": _filters(ns.dup_stdout),
                             "stderr": _filters(ns.dup_stderr)},
                notes=notes)


def mesh_options(ns: argparse.Namespace) -> dict[str, Any]:
    """``Mesh.start`` keyword arguments for parsed command-line options."""
    return plan(ns).mesh


def logged(p: Plan, local_rank: int) -> bool:
    """Is this local rank's output saved under --log-dir?"""
    if p.logged is None:
        return True
    return bool(p.logged.get(local_rank, p.logged.get(-1, set())))


def line_prefix(p: Plan, rank: int, local_rank: int) -> str | None:
    """torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE for one rank."""
    if p.line_prefix is None:
        return None
    from string import Template

    return Template(p.line_prefix).safe_substitute(role_name=p.role, rank=rank,
                                                   local_rank=local_rank)


def shown(p: Plan, local_rank: int, stream: str) -> bool:
    """Does this local rank's ``stream`` go to the console?"""
    if p.console is not None and stream not in p.console.get(local_rank, set()):
        return False
    hidden = p.hidden.get(local_rank, p.hidden.get(-1, set()))
    return stream not in hidden


__all__ = ["AFTER_SCRIPT", "Plan", "build_parser", "line_prefix", "logged", "mesh_options",
           "parse", "pet_name", "plan", "shown", "torchrun_actions"]
