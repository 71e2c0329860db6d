"""``%monarch`` and ``%%monarch``: parse, call the Python API, display.

A thin front end: every subcommand maps onto a :class:`~monarch_nb.Mesh`
method, so anything done here can be done from a script. Parsing uses
IPython's ``magic_arguments`` (one parser per subcommand). Errors from the
mesh are shown as the error tree renders them (grouped rank tracebacks for
``RankErrors``, one line for mistakes), and the mesh stays usable.

Non-goals: sockets, waiting policy (mesh.py), formatting rank output (output.py).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..config import MeshConfig
from ..errors import MeshNotRunning, UsageError
from ..futures import MeshFuture
from ..mesh import Mesh, RankResults
from . import labdebug
from .status import format_status

HELP = """\
%monarch start [-n N] [--backend auto|cuda|rocm|cpu] [--respawn rank|all|off]
               [--launcher local|ssh|slurm] [--hosts H1,H2] [--spare-hosts H3] [--no-dashboard]
               [--hang-timeout SECONDS] [--name NAME --keep-alive DURATION] [--min-ranks M]
               [--max-restarts N] [--preload MOD[,MOD]]
%monarch stop [--signal TERM] [--grace S] | status | dashboard | help
%monarch attach NAME [--force]                  take over a kept mesh (it outlives its kernel)
%monarch detach                                 let a kept mesh go on without this kernel
%monarch push NAME [NAME ...] [--ranks SPEC]    send kernel variables to the ranks
%monarch pull NAME [--ranks SPEC]               fetch a variable from the ranks
%monarch kill RANK [--signal KILL|TERM|STOP|INT] fault injection
%monarch restart RANK|all                       replace ranks with fresh processes
%monarch stacks [--ranks SPEC] [--native]      where every thread of every rank is, grouped
%monarch collectives [--ranks SPEC]            the ranks' collectives side by side: mismatches, who is missing
%monarch stragglers [--ranks SPEC]             compute vs wait per rank; flags a consistently slow rank
%monarch trace PATH                             write a Chrome/Perfetto trace of the recent past
%monarch debug RANK                             post-mortem pdb on the rank's last error
%monarch debugger [--ranks SPEC | --off]        JupyterLab's debugger on these ranks (default 0)
%monarch logs RANK [--tail N]                   a rank's recent output (all incarnations)
%monarch wait [NAME]                            wait for --no-block cells
%%monarch [--ranks SPEC] [--setup] [--elastic] [--no-block] [-o NAME] [--timeout SECONDS]
          [--hang-timeout SECONDS] [--check-collectives]
    run the cell on the ranks; SPEC is 3, 0,2, 1-3, ::2 or all.
    --check-collectives: the ranks compare each collective first; a mismatch fails at once.
    breakpoint() in a cell opens pdb here, one rank at a time (c goes to the next).
    Defined in every rank's namespace (also after a respawn): mnb, torch, dist
    (torch.distributed), rank, world_size, local_rank, device (cuda:0 or cpu).
"""


class _Parsers:
    """Holders of the magic_arguments parsers, one per subcommand."""

    @magic_arguments()
    @argument("-n", type=int, default=None, help="number of ranks (default: GPUs, else min(4, cores))")
    @argument("--backend", default="auto", choices=["auto", "cuda", "rocm", "cpu"])
    @argument("--respawn", default="rank", choices=["rank", "all", "off"])
    @argument("--launcher", default="local", choices=["local", "ssh", "slurm"])
    @argument("--hosts", default="", help="comma-separated hosts (ssh launcher)")
    @argument("--spare-hosts", default="",
              help="comma-separated hosts kept free for the ranks of a lost host (ssh, slurm)")
    @argument("--host-timeout", type=float, default=5.0,
              help="a host whose agent is silent this many seconds is lost")
    @argument("--no-dashboard", action="store_true", help="do not show the live dashboard")
    @argument("--hang-timeout", type=float, default=60.0,
              help="print where the ranks are after SECONDS without progress (0: never)")
    @argument("--name", default=None,
              help="keep the mesh under this name: it outlives the kernel (%%monarch attach NAME)")
    @argument("--keep-alive", default=None,
              help="how long a kept mesh waits for a kernel to attach: 90s, 30m, 2h "
                   "(default 30m)")
    @argument("--preload", default="", metavar="MODS",
              help="modules the host's warm process imports besides torch (comma-separated), "
                   "so every rank starts with them imported (docs/warm-process.md)")
    @argument("--min-ranks", type=int, default=None, metavar="M",
              help="elastic world size: when ranks are gone for good (restart budget spent, "
                   "host lost with no spare) and at least M are left, the group re-forms "
                   "among them (torch ranks 0..k-1; mesh rank numbers stay) and --elastic "
                   "cells carry on (default: the group keeps every rank)")
    @argument("--max-restarts", type=int, default=None, metavar="N",
              help="respawns of one rank within 10 minutes before it is given up "
                   "(default 5; torchrun's flag; 0: a dead rank stays dead)")
    def start(self, line: str) -> None: ...

    @magic_arguments()
    @argument("name", help="the kept mesh's name (%%monarch start --name NAME)")
    @argument("--force", action="store_true",
              help="take it over from the controller that holds it")
    def attach(self, line: str) -> None: ...

    @magic_arguments()
    @argument("--ranks", default="all")
    @argument("--native", action="store_true", help="add native frames (needs py-spy)")
    def stacks(self, line: str) -> None: ...

    @magic_arguments()
    @argument("rank", type=int)
    def debug(self, line: str) -> None: ...

    @magic_arguments()
    @argument("--ranks", default=None,
              help="ranks JupyterLab's debugger debugs in %%%%monarch cells (default: 0; "
                   "the panel shows one stopped thread at a time)")
    @argument("--off", action="store_true", help="debug no rank (stopped ranks run on)")
    def debugger(self, line: str) -> None: ...

    @magic_arguments()
    @argument("--ranks", default="all")
    def collectives(self, line: str) -> None: ...

    @magic_arguments()
    @argument("--ranks", default="all")
    def stragglers(self, line: str) -> None: ...

    @magic_arguments()
    @argument("path", help="where to write the trace (JSON)")
    def trace(self, line: str) -> None: ...

    @magic_arguments()
    @argument("names", nargs="+", help="kernel variables to send")
    @argument("--ranks", default="all")
    def push(self, line: str) -> None: ...

    @magic_arguments()
    @argument("name", help="variable to fetch from the ranks")
    @argument("--ranks", default="all")
    def pull(self, line: str) -> None: ...

    @magic_arguments()
    @argument("rank", type=int)
    @argument("--signal", default="KILL", help="KILL, TERM, STOP, CONT or INT")
    def kill(self, line: str) -> None: ...

    @magic_arguments()
    @argument("--signal", default=None, help="first send it to every rank (TERM: their "
                                              "checkpoint handlers run), then stop")
    @argument("--grace", type=float, default=None,
              help="with --signal: seconds the running cells may take to end (default 30)")
    def stop(self, line: str) -> None: ...

    @magic_arguments()
    @argument("rank", type=int)
    @argument("--tail", type=int, default=100)
    def logs(self, line: str) -> None: ...

    @magic_arguments()
    @argument("rank", help="a rank, a rank spec, or all")
    def restart(self, line: str) -> None: ...

    @magic_arguments()
    @argument("name", nargs="?", default=None)
    def wait(self, line: str) -> None: ...

    @magic_arguments()
    @argument("--ranks", default="all", help="ranks to run on: 3, 0,2, 1-3, ::2, all")
    @argument("--setup", action="store_true", help="a setup cell (replayed on respawned ranks)")
    @argument("--elastic", action="store_true", help="survive membership changes")
    @argument("--no-block", action="store_true", help="return a handle at once")
    @argument("-o", dest="output", default=None, help="store per-rank results in this variable")
    @argument("--timeout", type=float, default=None, help="interrupt the ranks after SECONDS")
    @argument("--hang-timeout", type=float, default=None,
              help="print where the ranks are after SECONDS without progress")
    @argument("--check-collectives", action="store_true",
              help="compare every collective across ranks first; fail at once on a mismatch")
    def cell(self, line: str) -> None: ...


_P = _Parsers()


def _parse(fn: Any, line: str) -> Any:
    # (a UsageError of ours, shown as one line: "UsageError: argument -n: ...")
    try:
        return parse_argstring(fn, line)
    except SystemExit:  # argparse already printed the message
        raise UsageError(f"could not parse {line!r}; see %monarch help") from None
    except Exception as exc:  # magic_arguments' UsageError
        raise UsageError(f"{exc}; see %monarch help") from None


def _unsendable(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be pushed, naming the variable; None if it can."""
    import cloudpickle

    try:
        cloudpickle.dumps(value)
        return None
    except Exception as exc:
        kind = type(value)
        where = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
        return (f"cannot push {name!r}: a {where}{kind.__qualname__} cannot be pickled "
                f"({type(exc).__name__}: {exc}); create it on the ranks in a %%monarch cell "
                "instead")


def _omp_notice(per_node: int) -> None:
    """torchrun's notice, when ranks on one machine get OMP_NUM_THREADS=1
    (supervisor.py sets it unless the user did)."""
    import os
    import sys

    if per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        print("monarch_nb: setting OMP_NUM_THREADS=1 for each rank (several ranks share this "
              "machine); set OMP_NUM_THREADS yourself to tune it", file=sys.stderr)


@magics_class
class MonarchMagics(Magics):
    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.mesh: Mesh | None = None
        self.pending: dict[str, MeshFuture] = {}
        self._anon = 0

    @property
    def _shell(self) -> Any:
        """The IPython shell (set once the extension is loaded into one)."""
        return self.shell

    # -- entry point ----------------------------------------------------------
    @line_cell_magic
    def monarch(self, line: str, cell: str | None = None) -> Any:
        if cell is not None:
            return self._cell(line, cell)
        words = line.strip().split(None, 1)
        if not words:
            print(HELP)
            return None
        cmd, rest = words[0], (words[1] if len(words) > 1 else "")
        handler = getattr(self, f"_cmd_{cmd}", None)
        if handler is None:
            raise UsageError(f"unknown %monarch command {cmd!r}; see %monarch help")
        return handler(rest)

    # -- subcommands ----------------------------------------------------------------
    def _cmd_help(self, rest: str) -> None:
        print(HELP)

    def _cmd_start(self, rest: str) -> None:
        args = _parse(_P.start, rest)
        if self.mesh is not None and self.mesh.running:
            raise UsageError(f"a mesh is already running ({self.mesh!r}); %monarch stop it first")
        if args.max_restarts is not None and args.max_restarts < 0:
            raise UsageError(f"--max-restarts must be 0 or more, not {args.max_restarts}")
        budget: dict[str, Any] = ({} if args.max_restarts is None
                                  else {"restart_budget": args.max_restarts})
        if args.max_restarts == 0:  # what a dead rank's line says instead of a spent budget
            budget["no_restarts_hint"] = ("--max-restarts 0; start the mesh with --max-restarts N "
                                          "to respawn dead ranks")
        # refuse bad options before saying anything is starting
        MeshConfig(n=args.n, backend=args.backend, respawn=args.respawn, launcher=args.launcher,
                   hosts=tuple(h for h in args.hosts.split(",") if h),
                   hang_timeout=args.hang_timeout, spare_hosts=args.spare_hosts,
                   host_timeout=args.host_timeout, name=args.name, keep_alive=args.keep_alive,
                   min_ranks=args.min_ranks, preload=args.preload, **budget)
        from IPython.display import display

        handle = display(_Text("monarch_nb: starting ranks..."), display_id=True)
        t0 = time.monotonic()

        def progress(infos: list[Any]) -> None:
            ready = sum(1 for i in infos if i.state.value == "ready")
            text = f"monarch_nb: starting {len(infos)} ranks... {ready}/{len(infos)} ready"
            if handle is not None:
                handle.update(_Text(text))

        self.mesh = Mesh.start(n=args.n, backend=args.backend, respawn=args.respawn,
                               launcher=args.launcher, hosts=args.hosts, progress=progress,
                               hang_timeout=args.hang_timeout, spare_hosts=args.spare_hosts,
                               host_timeout=args.host_timeout, name=args.name,
                               keep_alive=args.keep_alive, min_ranks=args.min_ranks,
                               preload=args.preload, **budget)
        mesh = self.mesh
        if args.launcher == "local":
            _omp_notice(mesh.world_size)
        devices = sorted({row["device"] for row in mesh.status()})
        text = (f"monarch_nb: {mesh.world_size} ranks ready on {mesh.backend} "
                f"({', '.join(devices)}) in {time.monotonic() - t0:.1f} s")
        if handle is not None:
            handle.update(_Text(text))
        else:
            print(text)
        if mesh.config.name is not None:
            print(f"monarch_nb: kept mesh {mesh.config.name!r}: it outlives this kernel for "
                  f"{mesh.config.keep_alive:g} s; %monarch attach {mesh.config.name} takes it "
                  "back")
        if not args.no_dashboard:
            display(mesh.dashboard())

    def _cmd_attach(self, rest: str) -> None:
        args = _parse(_P.attach, rest)
        if self.mesh is not None and self.mesh.running and self.mesh.config.name != args.name:
            raise UsageError(f"a mesh is already running here ({self.mesh!r}); %monarch stop or "
                             "%monarch detach it first")
        t0 = time.monotonic()
        mesh = self.mesh = Mesh.attach(args.name, force=args.force)
        pids = ", ".join(str(row["pid"]) for row in mesh.status())
        print(f"monarch_nb: attached to kept mesh {args.name!r} in {time.monotonic() - t0:.2f} s: "
              f"{mesh.world_size} ranks (pids {pids})")
        for fut in mesh.pending():
            what = mesh.pending_info(fut)
            self.pending[f"_attached{fut.call_id}"] = fut
            print(f"monarch_nb: from the last kernel: {what}; %monarch wait shows its output "
                  "and result")

    def _cmd_detach(self, rest: str) -> None:
        mesh = self._mesh()
        mesh.detach()
        self.mesh = None
        self.pending.clear()
        print(f"monarch_nb: detached from kept mesh {mesh.config.name!r}; its ranks go on for "
              f"{mesh.config.keep_alive:g} s unless a kernel attaches "
              f"(%monarch attach {mesh.config.name})")

    def _cmd_stop(self, rest: str) -> None:
        args = _parse(_P.stop, rest)
        mesh = self._mesh()
        n = mesh.world_size
        mesh.stop(grace=args.grace, signal=args.signal)
        self.mesh = None
        self.pending.clear()
        print(f"monarch_nb: stopped {n} ranks")

    def _cmd_status(self, rest: str) -> None:
        mesh = self._mesh()
        print(format_status(mesh))

    def _cmd_push(self, rest: str) -> None:
        args = _parse(_P.push, rest)
        mesh = self._mesh()
        ns = self._shell.user_ns
        missing = [n for n in args.names if n not in ns]
        if missing:
            raise UsageError(f"not defined in the kernel: {', '.join(missing)}")
        try:
            mesh.ranks(args.ranks).push(**{n: ns[n] for n in args.names})
        except UsageError:
            for n in args.names:  # say which variable, and why
                why = _unsendable(n, ns[n])
                if why:
                    raise UsageError(why) from None
            raise

    def _cmd_pull(self, rest: str) -> RankResults:
        args = _parse(_P.pull, rest)
        return self._mesh().ranks(args.ranks).pull(args.name)

    def _cmd_kill(self, rest: str) -> None:
        args = _parse(_P.kill, rest)
        self._mesh().kill(args.rank, signal=args.signal)

    def _cmd_logs(self, rest: str) -> None:
        args = _parse(_P.logs, rest)
        lines = self._mesh().logs(args.rank, args.tail)
        print("\n".join(lines) if lines else f"(rank {args.rank} has written nothing)")

    def _cmd_wait(self, rest: str) -> Any:
        args = _parse(_P.wait, rest)
        mesh = self._mesh()
        if args.name is not None:
            fut = self.pending.get(args.name)
            if fut is None:
                raise UsageError(f"no --no-block cell named {args.name!r} is pending "
                                 f"(pending: {', '.join(self.pending) or 'none'})")
            names = [args.name]
        else:
            names = list(self.pending)
        result = None
        for name in names:
            fut = self.pending[name]
            if name.startswith("_attached"):  # a call of the last kernel: what it printed
                result = self._wait_adopted(mesh, fut)
                self.pending.pop(name, None)
                continue
            result = mesh.wait(fut)  # raises RankErrors like a blocking cell
            self.pending.pop(name, None)
            if not name.startswith("_"):
                self._shell.user_ns[name] = result
        return result if args.name is not None else None

    @staticmethod
    def _wait_adopted(mesh: Mesh, fut: MeshFuture) -> Any:
        """Wait for a call the last kernel began (mesh.pending()) and show
        what it printed, then its result (as the cell would have)."""
        try:
            result = mesh.wait(fut)
        finally:
            for stream, text in mesh.pending_output(fut):
                (sys.stderr if stream == "stderr" else sys.stdout).write(text)
        from IPython.display import display

        display(result)
        return result

    def _cmd_restart(self, rest: str) -> None:
        args = _parse(_P.restart, rest)
        mesh = self._mesh()
        mesh.restart(args.rank)
        print(f"monarch_nb: restarting rank {args.rank}; calls to it wait until it is back")

    def _cmd_dashboard(self, rest: str) -> None:
        from IPython.display import display

        display(self._mesh().dashboard())

    def _cmd_stacks(self, rest: str) -> None:
        args = _parse(_P.stacks, rest)
        print(self._mesh().stacks(args.ranks, native=args.native).render())

    def _cmd_collectives(self, rest: str) -> None:
        args = _parse(_P.collectives, rest)
        print(self._mesh().collectives(args.ranks).render())

    def _cmd_stragglers(self, rest: str) -> None:
        args = _parse(_P.stragglers, rest)
        print(self._mesh().stragglers(args.ranks).render())

    def _cmd_trace(self, rest: str) -> None:
        args = _parse(_P.trace, rest)
        path = self._mesh().trace(args.path)
        print(f"monarch_nb: trace written to {path} (open it in https://ui.perfetto.dev)")

    def _cmd_debug(self, rest: str) -> None:
        args = _parse(_P.debug, rest)
        self._mesh().debug(args.rank)

    def _cmd_debugger(self, rest: str) -> None:
        args = _parse(_P.debugger, rest)
        if args.off and args.ranks is not None:
            raise UsageError("--ranks and --off do not go together; see %monarch help")
        mesh = self._mesh()
        handle = (mesh.debugger(off=True) if args.off else
                  mesh.debugger() if args.ranks is None else mesh.debugger(args.ranks))
        lab = labdebug.of(self._shell)
        if lab is not None:
            lab.connect(None if args.off else handle)
        if args.off:
            print("monarch_nb: JupyterLab's debugger debugs no rank now")
        else:
            who = ", ".join(str(r) for r in handle.selected)
            where = "" if lab is not None else " (this kernel has no debugger: use mesh.debugger())"
            print(f"monarch_nb: JupyterLab's debugger debugs %%monarch cells on rank"
                  f"{'s' if len(handle.selected) > 1 else ''} {who}{where}; the other ranks run "
                  "on and wait in their collectives as for a slow rank")

    # -- the cell magic --------------------------------------------------------------
    def _cell(self, line: str, cell: str) -> Any:
        args = _parse(_P.cell, line)
        if args.output is not None and not args.output.isidentifier():
            raise UsageError(f"-o needs a variable name, not {args.output!r}")
        mesh = self._mesh()
        sub = mesh.ranks(args.ranks)
        name = f"<mnb-cell-{self._shell.execution_count}>"
        lab = labdebug.of(self._shell)
        if lab is not None:  # JupyterLab's debugger: the cell's path, its breakpoints first
            lab.before_cell(name, cell)
        if args.no_block:
            fut = sub.exec(cell, setup=args.setup, name=name, block=False, elastic=args.elastic,
                           hang_timeout=args.hang_timeout,
                           check_collectives=args.check_collectives)
            key = args.output or f"_mnb{self._anon}"
            self._anon += 1
            self.pending[key] = fut
            if args.output:
                self._shell.user_ns[args.output] = fut
            return fut
        results = sub.exec(cell, setup=args.setup, name=name, timeout=args.timeout,
                           elastic=args.elastic, hang_timeout=args.hang_timeout,
                           check_collectives=args.check_collectives)
        if args.output:
            self._shell.user_ns[args.output] = results
        if all(v is None for v in results.values()):
            return None
        return results

    def _mesh(self) -> Mesh:
        if self.mesh is None or not self.mesh.running:
            raise MeshNotRunning()
        return self.mesh


class _Text:
    """Plain text for display handles (so updates replace, not append)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


_loaded: dict[int, MonarchMagics] = {}


def load(ipython: Any) -> None:
    magics = MonarchMagics(ipython)
    ipython.register_magics(magics)
    _loaded[id(ipython)] = magics
    labdebug.install(ipython)  # JupyterLab's debugger reaches the ranks (no-op outside ipykernel)
    from .labcomm import attach  # the JupyterLab extension's feed (no-op outside ipykernel)

    attach(ipython, lambda: _shown_mesh(magics))


def _shown_mesh(magics: MonarchMagics) -> Mesh | None:
    """What the extension shows: the mesh %monarch started, else one started
    with the Python API in this kernel (the newest running)."""
    if magics.mesh is not None and magics.mesh.running:
        return magics.mesh
    try:
        return Mesh.current()
    except MeshNotRunning:
        return None


def unload(ipython: Any) -> None:
    magics = _loaded.pop(id(ipython), None)
    from .labcomm import detach

    detach(ipython)
    labdebug.uninstall(ipython)
    if magics is not None and magics.mesh is not None:
        magics.mesh.stop()


__all__ = ["MonarchMagics", "load", "unload", "format_status"]
