"""Script mode: ``python -m monarch_nb.launch [options] script.py [args ...]``.

The launching process is the single controller (what the notebook kernel is
in notebook mode): it starts the mesh with the chosen launcher, runs the
script on every rank (``monarch_nb.script.run_script``: ``__main__``,
``sys.argv`` set, the torch.distributed environment set and the group
already formed) and supervises it exactly as a notebook would: a dead rank
is respawned (``--respawn rank``) and runs the script again (with
``mnb.incarnation() > 0``; ``mnb.elastic`` restores its training state from a
live peer), survivors cut short in a collective by the death run it again too.

Terminal: a live status line per rank (state, incarnation, loss once
``mnb.log`` reports one) drawn by rich when stderr is a terminal, rank output
labelled ``[rank]`` on stdout, events (deaths, respawns) as lines on stderr,
then a summary. Exit status: 0 when every rank finished, else the first
failure's (the script's ``sys.exit`` code, 1 for an exception, 128+N for a
rank killed by signal N), 130 on Ctrl-C (which stops every rank).

Options go before the script; everything after it belongs to the script.

Non-goals: spawning processes (launchers.py / supervisor.py), the rank side
(script.py), restart decisions (policy.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from .config import BACKENDS, LAUNCHERS, RESPAWN_MODES
from .errors import MembershipChanged, MonarchError, RankDied, RemoteError, UsageError, is_peer_loss

EXIT_INTERRUPTED = 130
FAIL_GRACE_S = 5.0  # after a final failure, how long the other ranks may finish
MAX_RERUNS = 20  # per rank: survivors re-run after peer loss (deaths are capped by the policy)
REFRESH_S = 0.25
PEER_LOSS_WAIT_S = 3.0  # how long a survivor's peer-loss error waits for the death report
DEATH_EVENTS = ("died", "replaced", "failed_start")
_OWN_FRAMES = tuple(f"in {name}" for name in ("run_script", "run_path", "_run_module_code",
                                              "_run_code"))


def build_parser(prog: str = "python -m monarch_nb.launch") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run SCRIPT on every rank of a mesh controlled by this process "
                    "(supervised: dead ranks are respawned and run the script again).",
        epilog="Options go before SCRIPT; everything after SCRIPT is passed to it.",
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
    p.add_argument("--launcher", default="local", choices=LAUNCHERS)
    p.add_argument("--hosts", default="", help="comma-separated hosts (ssh launcher)")
    p.add_argument("--bind", default=None,
                   help="controller address (default: loopback for local, this host's "
                        "address for ssh/slurm; non-loopback turns on CurveZMQ)")
    p.add_argument("--master-addr", default=None,
                   help="rank 0's host address for torch.distributed (default: 127.0.0.1 "
                        "locally, the first host / slurm node otherwise)")
    p.add_argument("--insecure-no-encryption", action="store_true",
                   help="DANGEROUS: no CurveZMQ on a non-loopback bind (messages stay signed "
                        "but anyone on the network can read them)")
    p.add_argument("--no-status", action="store_true",
                   help="no live status display (also off when stderr is not a terminal)")
    p.add_argument("script", help="the Python file every rank runs as __main__")
    p.add_argument("args", nargs="*", help="arguments for the script")
    return p


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse the launcher's options; the script's arguments are everything
    after the script, verbatim (argparse would eat a leading ``--``)."""
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
        i += 2 if tok in takes_value else 1
    ns = parser.parse_args(argv[: i + 1])
    ns.args = argv[i + 1:]
    return ns


def mesh_options(ns: argparse.Namespace) -> dict[str, Any]:
    """``Mesh.start`` keyword arguments for parsed command-line options."""
    if ns.nodes is not None and ns.nodes < 1:
        raise UsageError(f"--nodes must be at least 1, not {ns.nodes}")
    if ns.gpus_per_node is not None and ns.gpus_per_node < 1:
        raise UsageError(f"--gpus-per-node must be at least 1, not {ns.gpus_per_node}")
    n = ns.n
    if n is None and ns.gpus_per_node is not None:
        n = (ns.nodes or 1) * ns.gpus_per_node
    opts: dict[str, Any] = {"n": n, "backend": ns.backend, "respawn": ns.respawn,
                            "launcher": ns.launcher, "hosts": ns.hosts}
    if ns.nodes is not None:
        opts["nodes"] = ns.nodes
    if ns.gpus_per_node is not None:
        opts["gpus_per_node"] = ns.gpus_per_node
    if ns.bind is not None:
        opts["bind"] = ns.bind
    if ns.master_addr is not None:
        opts["master_addr"] = ns.master_addr
    if ns.insecure_no_encryption:
        opts["insecure_no_encryption"] = True
    return opts


# -- outcome -------------------------------------------------------------------------
def exit_code_of(err: BaseException) -> int:
    """The process exit status a rank's failure stands for."""
    if isinstance(err, RemoteError):
        if err.type_name.endswith("ScriptExit"):
            head = err.message.split(":", 1)[0].strip()
            return int(head) if head.lstrip("-").isdigit() else 1
        return 1
    if isinstance(err, RankDied):
        if err.exitcode:
            return err.exitcode
        if err.signal_name:
            num = getattr(signal, err.signal_name, None)
            return 128 + int(num) if num is not None else 1
        return 1
    return 1


def describe_failure(err: BaseException) -> str:
    if isinstance(err, RemoteError):
        if err.type_name.endswith("ScriptExit"):
            return f"sys.exit({err.message})"
        last = err.traceback_text.rstrip().splitlines()[-1:] or [f"{err.type_name}: {err.message}"]
        return _clip(last[0])
    if isinstance(err, RankDied):
        return err.cause
    return _clip(str(err).splitlines()[0])


def _clip(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def user_traceback(text: str) -> list[str]:
    """A rank's traceback without the frames of runpy and script.py: the
    user wants their script's lines."""
    out: list[str] = []
    skip = False
    for line in text.rstrip().splitlines():
        if line.startswith("  File "):
            skip = "<frozen runpy>" in line or line.endswith(_OWN_FRAMES)
        elif not line.startswith("    "):
            skip = False
        if not skip:
            out.append(line)
    return out


def retryable(err: BaseException, respawn: str) -> bool:
    """Does this failure mean the rank runs the script again (respawn on)?
    Deaths and collectives cut short by a death, not the script's own errors."""
    if respawn == "off":
        return False
    if isinstance(err, (RankDied, MembershipChanged)):
        return True
    return isinstance(err, RemoteError) and is_peer_loss(f"{err.type_name} {err.message}")


# -- the terminal ----------------------------------------------------------------------
MetricsOf = Callable[[dict[str, Any]], dict[str, Any]]


def metrics_of(row: dict[str, Any]) -> dict[str, Any]:
    """The ``mnb.log`` figures of a ``mesh.status()`` row: the last value of
    each metric (``"last"``) and the last step; empty until a rank logs."""
    last = row.get("last")
    out = dict(last) if isinstance(last, dict) else {}
    if row.get("step") is not None:
        out["step"] = row["step"]
    return out


class Terminal:
    """Rank output, events and the live status, on stdout/stderr. With a
    terminal, rich draws the status table under the scrolling lines."""

    def __init__(self, live: bool, metrics: MetricsOf = metrics_of,
                 out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.metrics = metrics
        self._live: Any = None
        self._console: Any = None
        if live:
            from rich.console import Console
            from rich.live import Live

            self._console = Console(file=self.err)
            self._live = Live(console=self._console, refresh_per_second=4, transient=True,
                              redirect_stdout=True, redirect_stderr=True)

    def __enter__(self) -> Terminal:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.stop()

    def emit(self, stream: str, text: str) -> None:
        """Rank output (called from the controller's I/O loop)."""
        # sys.stdout at the time of writing: rich redirects it while live
        target = sys.stderr if stream == "stderr" else sys.stdout
        if self._live is None:
            target = self.err if stream == "stderr" else self.out
        try:
            target.write(text)
            target.flush()
        except (OSError, ValueError):
            pass

    def line(self, text: str) -> None:
        """An event or message of the launcher."""
        if self._console is not None and self._live is not None:
            self._console.print(text, markup=False, highlight=False)
            return
        self.err.write(text + "\n")
        self.err.flush()

    def update(self, rows: list[dict[str, Any]], done: set[int]) -> None:
        if self._live is None:
            return
        from rich.table import Table

        table = Table(box=None, padding=(0, 1), show_header=True, header_style="bold")
        for col in ("rank", "state", "inc", "heartbeat", "loss", "step"):
            table.add_column(col)
        for row in rows:
            m = self.metrics(row)
            loss = m.get("loss")
            state = "finished" if row["rank"] in done else str(row["state"])
            age = row.get("heartbeat_age")
            table.add_row(str(row["rank"]), state, str(row.get("incarnation", 0)),
                          f"{age:.1f}s" if isinstance(age, (int, float)) else "-",
                          f"{loss:.4g}" if isinstance(loss, (int, float)) else "-",
                          str(m.get("step", "-")))
        self._live.update(table)


def format_event(ev: dict[str, Any]) -> str:
    who = "mesh" if ev.get("rank", -1) < 0 else f"rank {ev['rank']}"
    detail = f": {ev['detail']}" if ev.get("detail") else ""
    return f"monarch_nb: {who} {ev['kind']}{detail}"


# -- the run ----------------------------------------------------------------------------
class ScriptRun:
    """Runs one script on every rank of ``mesh`` and supervises it."""

    def __init__(self, mesh: Any, script: str, args: list[str], term: Terminal) -> None:
        self.mesh = mesh
        self.script = os.path.abspath(script)
        self.args = list(args)
        self.term = term
        self.cwd = os.getcwd()
        self.futures: dict[int, Any] = {}
        self.done: set[int] = set()
        self.failed: dict[int, BaseException] = {}
        self.reruns: dict[int, int] = {}
        self.deaths_at_submit: dict[int, int] = {}
        self.undecided: dict[int, float] = {}  # rank -> since when its peer loss waits
        self.first_failure: int | None = None
        self.failed_at: float | None = None
        self.seen_events = len(mesh.events)
        # One output for every rank, so identical lines fold ("[0-3] epoch 1").
        # Announcements are shown from the event log instead (no duplicates).
        self.output = mesh.output(term.emit, notes=False)
        self.generation = mesh.generation

    def submit(self, rank: int) -> None:
        from .engine import script as script_mod

        self.deaths_at_submit[rank] = self._deaths()
        # the generation the run started in: a rank that joins a later one
        # came in mid-run and takes its elastic state from a peer
        self.futures[rank] = self.mesh.ranks([rank]).submit(
            script_mod.run_script, (self.script, self.args, self.cwd), output=self.output,
            generation=self.generation)

    def run(self) -> int:
        ranks = range(self.mesh.world_size)
        for r in ranks:
            self.submit(r)
        while True:
            self._show_events()
            self._collect()
            self.term.update(self.mesh.status(), self.done)
            open_ranks = [r for r in self.futures if r not in self.done and r not in self.failed]
            if not open_ranks:
                break
            if self.failed_at is not None and time.monotonic() - self.failed_at > FAIL_GRACE_S:
                break
            # leads the I/O loop meanwhile; with nothing pending, only peer
            # losses wait for their death report
            self.mesh.wait_any([self.futures[r] for r in open_ranks if not self.futures[r].done()],
                               REFRESH_S)
        self._show_events()
        return self._summary()

    def _deaths(self) -> int:
        return sum(1 for ev in self.mesh.events if ev["kind"] in DEATH_EVENTS)

    def _collect(self) -> None:
        now = time.monotonic()
        for rank, fut in list(self.futures.items()):
            if rank in self.done or rank in self.failed or not fut.done():
                continue
            exc = fut.exception()
            if exc is None:
                self.done.add(rank)
                continue
            err = getattr(exc, "errors", {}).get(rank, exc)
            state = self.mesh.status()[rank]["state"]
            again = (retryable(err, self.mesh.config.respawn) and state != "failed"
                     and self.failed_at is None and self.reruns.get(rank, 0) < MAX_RERUNS)
            if again and isinstance(err, RemoteError):
                # A survivor's collective failed: a re-run only makes sense
                # after a death since this run started (its report may trail
                # the survivor's error by a moment: wait for it, briefly).
                if self._deaths() <= self.deaths_at_submit.get(rank, 0):
                    since = self.undecided.setdefault(rank, now)
                    if now - since < PEER_LOSS_WAIT_S:
                        continue
                    again = False
            self.undecided.pop(rank, None)
            if again:
                self.reruns[rank] = self.reruns.get(rank, 0) + 1
                self.term.line(f"monarch_nb: rank {rank} runs the script again "
                               f"({describe_failure(err)})")
                self.submit(rank)  # waits for the respawned process if there is one
                continue
            self.failed[rank] = err
            if self.first_failure is None:
                self.first_failure = rank
                self.failed_at = time.monotonic()

    def _show_events(self) -> None:
        events = self.mesh.events
        for ev in events[self.seen_events:]:
            if ev["kind"] in ("started", "ready") and ev.get("incarnation", 0) == 0:
                continue  # start-up is shown by the progress line
            self.term.line(format_event(ev))
        self.seen_events = len(events)

    def _summary(self) -> int:
        world = self.mesh.world_size
        if not self.failed and len(self.done) == world:
            self.term.line(f"monarch_nb: all {world} rank(s) finished")
            return 0
        lines = [f"monarch_nb: {len(self.done)} of {world} rank(s) finished; "
                 f"{len(self.failed)} failed"]
        for rank in sorted(self.failed):
            err = self.failed[rank]
            lines.append(f"  rank {rank}: {describe_failure(err)} (exit {exit_code_of(err)})")
            if isinstance(err, RemoteError) and err.traceback_text \
                    and not err.type_name.endswith("ScriptExit"):
                lines.extend("    " + t for t in user_traceback(err.traceback_text)[-12:])
            elif isinstance(err, RankDied) and err.last_lines:
                lines.extend("    " + t for t in err.last_lines[-4:])
        unfinished = sorted(set(range(world)) - self.done - set(self.failed))
        if unfinished:
            lines.append(f"  rank(s) {', '.join(map(str, unfinished))}: still running, stopped")
        for line in lines:
            self.term.line(line)
        assert self.first_failure is not None
        return exit_code_of(self.failed[self.first_failure]) or 1


def run(argv: Sequence[str] | None = None, prog: str = "python -m monarch_nb.launch") -> int:
    """Entry point: parse, start the mesh, run the script; the exit status."""
    parser = build_parser(prog)
    ns = parse(parser, list(sys.argv[1:] if argv is None else argv))
    if not os.path.isfile(ns.script):
        parser.error(f"script {ns.script!r} not found")
    from .mesh import Mesh

    # SIGTERM (a batch system's stop) is handled like Ctrl-C: stop every rank.
    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    # Python leaves SIGINT ignored when it starts ignored, as it does for a
    # shell's background job (`launch ... &` in a script, a CI runner): a
    # `kill -INT` would then leave the whole mesh running. Like torchrun, the
    # launcher takes SIGINT itself whatever it inherited.
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    live = not ns.no_status and sys.stderr.isatty()
    term = Terminal(live)
    mesh = None
    try:
        opts = mesh_options(ns)

        def progress(infos: list[Any]) -> None:
            ready = sum(1 for i in infos if i.state.value == "ready")
            term.line(f"monarch_nb: {ready}/{len(infos)} ranks ready")

        with term:
            mesh = Mesh.start(progress=progress, **opts)
            term.line(f"monarch_nb: running {ns.script} on {mesh.world_size} rank(s) "
                      f"({mesh.backend}, {ns.launcher} launcher, respawn {ns.respawn})")
            code = ScriptRun(mesh, ns.script, ns.args, term).run()
    except KeyboardInterrupt:
        term.line("monarch_nb: interrupted; stopping every rank")
        code = EXIT_INTERRUPTED
    except MonarchError as exc:
        term.line(f"monarch_nb: {exc}")
        code = 2 if isinstance(exc, UsageError) else 1
    finally:
        try:
            if mesh is not None:
                # a second Ctrl-C must not leave ranks behind: stop is not interruptible
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                mesh.stop()
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
    return code


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
