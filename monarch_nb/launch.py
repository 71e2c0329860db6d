"""Script mode: ``python -m monarch_nb.launch [options] script.py [args ...]``.

The launching process is the single controller (what the notebook kernel is
in notebook mode): it starts the mesh with the chosen launcher, runs the
script on every rank (``monarch_nb.script.run_script``: ``__main__``,
``sys.argv`` set, the torch.distributed environment set and the group
already formed) and supervises it as a notebook would, with torchrun's restarts: a dead rank
is respawned (``--respawn rank``) and every rank runs the script again in a
new process (the policy's group restart: the new
``TORCHELASTIC_RESTART_COUNT``, nothing of the earlier run left), except a
rank in an ``mnb.elastic`` loop, which carries on in place (the new
processes take its state). With ``--min-ranks`` / ``--nnodes MIN:MAX``
the run goes on without ranks gone for good (they are *lost*, not failed)
and ends, exit 1, when fewer are left.

Terminal: a live status line per rank (state, incarnation, loss once
``mnb.log`` reports one) drawn by rich when stderr is a terminal, rank output
labelled ``[rank]`` on stdout, events (deaths, respawns) as lines on stderr,
then a summary. Exit status: 0 when every rank finished, else the first
failure's (the script's ``sys.exit`` code, 1 for an exception, 128+N for a
rank killed by signal N), 130 on Ctrl-C (which stops every rank at once).

Signals, as torchrun passes them on: SIGTERM (a batch system's or
Kubernetes' stop; also SIGHUP, SIGQUIT and whatever --signals-to-handle
names) goes to every rank's process group, so the script's own handler runs
(a checkpoint on preemption); the run stops once every rank's script ended,
or after --shutdown-timeout (30 s), killed ranks are not respawned, and the
status is 128+N (143 for SIGTERM). A second one stops at once. SIGUSR1 and
SIGUSR2 (SLURM's ``--signal``) are passed on and the run goes on.

Options go before the script; after it, the launcher's own options
(``--nodes=8 --gpus-per-node=8``, the announced form) up to a ``--`` are the
launcher's, everything else belongs to the script. torchrun's flags are
accepted too (launchopts.py). A rank's failure is retried by fact: a run that
ended, however, after the group changed under it (a peer died) runs again,
always in a new process; one that failed on its own does not.

Only the public API of :class:`~monarch_nb.Mesh` is used (submit, output,
wait_any, events, status, generation, logs).

Non-goals: the command line (launchopts.py), spawning processes (launchers.py /
supervisor.py), the rank side (script.py), restart decisions (policy.py).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from .errors import MembershipChanged, MonarchError, RankDied, RemoteError, UsageError
from .launchopts import (
    Plan,
    build_parser,
    line_prefix,
    logged,
    mesh_options,
    parse,
    plan,
    shown,
)
from .rankspans import format_ranks

EXIT_INTERRUPTED = 130
FAIL_GRACE_S = 5.0  # after a final failure, how long the other ranks may finish
MAX_RERUNS = 20  # per rank: survivors re-run after peer loss (deaths are capped by the policy)
REFRESH_S = 0.25
PEER_LOSS_WAIT_S = 2.0  # how long a failure waits for a peer's death report before it counts
OMP_NOTICE = ("*****************************************\n"
              "Setting OMP_NUM_THREADS environment variable for each process to be 1 in "
              "default, to avoid your system being overloaded, please further tune the "
              "variable for optimal performance in your application as needed. \n"
              "*****************************************")  # torchrun's words
DEATH_EVENTS = ("died", "replaced", "failed_start")
GONE_FOR_GOOD = ("failed", "lost", "dead", "stopped")  # mesh.status() states: no process coming
_OWN_FRAMES = tuple(f"in {name}" for name in ("run_script", "_run_file", "run_path",
                                              "_run_module_code", "_run_code", "run_module"))


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


def retryable(err: BaseException, respawn: str, group_changed: bool) -> bool:
    """Does this failure mean the rank runs the script again (respawn on)?
    Decided by fact, not by the error's text: the rank's own death, or any
    ending (an exception, ``sys.exit(n)`` of a ``main()`` that turns every
    error into an exit code) of a run during which the group changed under
    it (a peer died). A run that failed on its own, the group intact, is not."""
    if respawn == "off":
        return False
    if isinstance(err, (RankDied, MembershipChanged)):
        return True
    return group_changed


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
    """Runs one script on every rank of ``mesh`` and supervises it, through
    the mesh's public API only."""

    def __init__(self, mesh: Any, script: str, args: list[str], term: Terminal,
                 how: Plan | None = None, port: int | None = None) -> None:
        self.mesh = mesh
        self.how = how or Plan(mesh={})
        self.script = script  # as typed (sys.argv[0]); found from cwd on the rank
        self.args = list(args)
        self.term = term
        self.port = port
        self.cwd = os.getcwd()
        self.futures: dict[int, Any] = {}
        self.done: set[int] = set()
        self.failed: dict[int, BaseException] = {}
        # the ranks the group went on without (min_ranks): not failures
        self.lost: dict[int, BaseException] = {}
        self.incarnation_at_submit: dict[int, int] = {}
        # ranks restarted by us (their run ended, their process was left):
        # the incarnation they had; the script goes to the new process
        self.restarting: dict[int, int] = {}
        self.reruns: dict[int, int] = {}
        self.deaths_at_submit: dict[int, int] = {}
        self.undecided: dict[int, float] = {}  # rank -> since when it waits for a death report
        self.first_failure: int | None = None
        self.failed_at: float | None = None
        self.seen_events = len(mesh.events)
        self.dup_files: dict[str, TextIO] = {}
        # signals the launcher received, passed on from the loop (the
        # handler only queues them: it may run in the middle of the I/O loop)
        self.signals: list[int] = []
        self.stopping: int | None = None  # the signal that stops the run
        self.stop_by = 0.0
        self.stop_now = False
        # One output for every rank, so identical lines fold ("[0-3] epoch 1").
        # Announcements are shown from the event log instead (no duplicates).
        # Filters (-r, --local-ranks-filter, duplicate filters) need to know
        # the rank of a line: one output per rank then.
        h = self.how
        per_rank = (h.console is not None or bool(h.hidden) or h.line_prefix is not None
                    or any(h.dup_filters.get(s) for s in ("stdout", "stderr")))
        self.outputs: dict[int, Any] = {}
        if per_rank:
            for r in range(mesh.world_size):
                self.outputs[r] = mesh.output(self._emitter(r), notes=False)
        else:
            shared = mesh.output(term.emit, notes=False)
            self.outputs = dict.fromkeys(range(mesh.world_size), shared)
        self.generation = mesh.generation

    def _emitter(self, rank: int) -> Callable[[str, str], None]:
        local = rank % max(1, self.how.per_node)
        prefix = line_prefix(self.how, rank, local)
        label = f"[{rank}] "

        def emit(stream: str, text: str) -> None:
            if prefix is not None:  # torchrun's template instead of the [rank] label
                text = "".join(prefix + (ln[len(label):] if ln.startswith(label) else ln)
                               for ln in text.splitlines(True))
            words = self.how.dup_filters.get(stream)
            if words:
                self._duplicate(stream, text, words)
            if shown(self.how, local, stream):
                self.term.emit(stream, text)

        return emit

    def _duplicate(self, stream: str, text: str, words: list[str]) -> None:
        """torchrun's --duplicate-std*-filters: matching lines also go to
        LOG_DIR/RUN_ID/filtered_std*.log."""
        lines = [ln for ln in text.splitlines(True) if any(w in ln for w in words)]
        if not lines or self.how.log_dir is None:
            return
        f = self.dup_files.get(stream)
        if f is None:
            folder = os.path.join(self.how.log_dir, self.how.run_id)
            os.makedirs(folder, exist_ok=True)
            f = self.dup_files[stream] = open(os.path.join(folder, f"filtered_{stream}.log"),
                                              "a", encoding="utf-8")
        f.writelines(lines)
        f.flush()

    def submit(self, rank: int) -> None:
        from .engine import script as script_mod

        self.deaths_at_submit[rank] = self._deaths()
        self.incarnation_at_submit[rank] = self.mesh.status()[rank]["incarnation"]
        # the generation the run started in: a rank that joins a later one
        # came in mid-run and takes its elastic state from a peer
        self.futures[rank] = self.mesh.ranks([rank]).submit(
            script_mod.run_script, (self.script, self.args, self.cwd, self.how.mode, self.port),
            output=self.outputs[rank], generation=self.generation)

    def run(self) -> int:
        ranks = range(self.mesh.world_size)
        for r in ranks:
            self.submit(r)
        while True:
            self._pass_on_signals()
            self._show_events()
            self._collect()
            self.term.update(self.mesh.status(), self.done)
            open_ranks = [r for r in self.futures
                          if r not in self.done and r not in self.failed and r not in self.lost]
            if not open_ranks or self.stop_now:
                break
            if self.stopping is not None and time.monotonic() > self.stop_by:
                self.term.line(f"monarch_nb: {_name(self.stopping)}: rank(s) "
                               f"{', '.join(map(str, open_ranks))} still running after "
                               f"{self.how.shutdown_timeout:g} s (--shutdown-timeout); stopping them")
                break
            if self.failed_at is not None and time.monotonic() - self.failed_at > FAIL_GRACE_S:
                break
            # leads the I/O loop meanwhile; with nothing pending, only
            # failures waiting for a death report
            self.mesh.wait_any([self.futures[r] for r in open_ranks
                                if not self.futures[r].done() and r not in self.restarting],
                               REFRESH_S)
        self._show_events()
        for f in self.dup_files.values():
            f.close()
        return self._summary()

    def _pass_on_signals(self) -> None:
        """Pass each signal the launcher got on to every rank (its handlers
        run there: a checkpoint on preemption). A stopping one (SIGTERM,
        --signals-to-handle) ends the run once every rank's script ended or
        after --shutdown-timeout; a second one stops at once; a rank it ends
        is not respawned. SIGUSR1/2 (SLURM's --signal) are only passed on."""
        while self.signals:
            sig = self.signals.pop(0)
            stops = sig in self.how.stop_signals
            if stops and self.stopping is not None:
                self.term.line(f"monarch_nb: {_name(sig)} again: stopping every rank now")
                self.stop_now = True
                return
            if stops:
                self.stopping = sig
                self.stop_by = time.monotonic() + self.how.shutdown_timeout
                self.term.line(f"monarch_nb: {_name(sig)}: passed on to every rank; stopping "
                               f"when their scripts end, at most {self.how.shutdown_timeout:g} s "
                               "(--shutdown-timeout)")
            else:
                self.term.line(f"monarch_nb: {_name(sig)}: passed on to every rank")
            try:
                self.mesh.signal_all(sig, stopping=stops)
            except MonarchError as exc:
                self.term.line(f"monarch_nb: could not pass {_name(sig)} on: {exc}")

    def _deaths(self) -> int:
        return sum(1 for ev in self.mesh.events if ev["kind"] in DEATH_EVENTS)

    def _collect(self) -> None:
        """Each rank's run that ended: done, run again (always in a new
        process, as torchrun restarts its workers), lost with the group
        going on without it, or failed."""
        now = time.monotonic()
        rows = self.mesh.status()
        going_on = self.failed_at is None and self.stopping is None
        for rank, inc in list(self.restarting.items()):
            if rows[rank]["incarnation"] > inc:  # its new process is on its way: the script too
                del self.restarting[rank]
                self.submit(rank)
        for rank in sorted(self.done):
            # a rank that had finished, restarted with the group (torchrun
            # restarts every worker): it runs the script again
            if going_on and rows[rank]["incarnation"] > self.incarnation_at_submit[rank]:
                self.done.discard(rank)
                self.term.line(f"monarch_nb: rank {rank} runs the script again in a new "
                               "process (restarted with the group)")
                self.submit(rank)
        for rank, fut in list(self.futures.items()):
            if (rank in self.done or rank in self.failed or rank in self.lost
                    or rank in self.restarting or not fut.done()):
                continue
            exc = fut.exception()
            if exc is None:
                self.done.add(rank)
                continue
            err = getattr(exc, "errors", {}).get(rank, exc)
            row = rows[rank]
            state = row["state"]
            # Did the group change under this run (a peer died since it was
            # submitted)? A survivor's failure can reach us a moment before
            # the death that caused it: a failure with no death yet waits
            # for one, briefly, before it counts as the script's own.
            changed = self._deaths() > self.deaths_at_submit.get(rank, 0)
            respawn = self.mesh.config.respawn
            if (respawn != "off" and not changed and isinstance(err, RemoteError)
                    and going_on):
                since = self.undecided.setdefault(rank, now)
                if now - since < PEER_LOSS_WAIT_S:
                    continue
            if state == "dying":
                continue  # killed on purpose: its death says what comes next
            self.undecided.pop(rank, None)
            if rank not in self.mesh.group and state in GONE_FOR_GOOD:
                self.lost[rank] = err  # the group went on without it (min_ranks)
                continue
            may = (retryable(err, respawn, changed) and going_on
                   and self.reruns.get(rank, 0) < MAX_RERUNS)
            # its process replaced, or on its way back: the script goes to the new one
            coming = (row["incarnation"] > self.incarnation_at_submit[rank]
                      or state in ("waiting", "respawning", "starting"))
            if may and coming:
                self.reruns[rank] = self.reruns.get(rank, 0) + 1
                self.term.line(f"monarch_nb: rank {rank} runs the script again in a new "
                               f"process ({describe_failure(err)})")
                self.submit(rank)  # waits for the respawned process
                continue
            if may and state in ("ready", "busy") and self._group_whole(rows):
                # the group changed under it but its process was left (it was
                # in an mnb.elastic loop then): a re-run is a new process too
                self.reruns[rank] = self.reruns.get(rank, 0) + 1
                self.term.line(f"monarch_nb: rank {rank} runs the script again in a new "
                               f"process ({describe_failure(err)}); restarting it")
                self.restarting[rank] = row["incarnation"]
                self.mesh.restart(rank)
                continue
            self.failed[rank] = err
            if self.first_failure is None:
                self.first_failure = rank
                self.failed_at = time.monotonic()

    def _group_whole(self, rows: list[dict[str, Any]]) -> bool:
        """No member of the group is gone for good (else the run cannot go on)."""
        return all(rows[r]["state"] not in GONE_FOR_GOOD for r in self.mesh.group)

    def _show_events(self) -> None:
        events = self.mesh.events
        for ev in events[self.seen_events:]:
            if ev["kind"] in ("started", "ready") and ev.get("incarnation", 0) == 0:
                continue  # start-up is shown by the progress line
            self.term.line(format_event(ev))
        self.seen_events = len(events)

    def save_logs(self) -> str | None:
        """--log-dir: every rank's output (all incarnations) under LOG_DIR/RUN_ID/."""
        if self.how.log_dir is None:
            return None
        folder = os.path.join(self.how.log_dir, self.how.run_id)
        os.makedirs(folder, exist_ok=True)
        for r in range(self.mesh.world_size):
            if not logged(self.how, r % max(1, self.how.per_node)):
                continue  # -r/-t name other local ranks (torchrun writes files for those only)
            with open(os.path.join(folder, f"rank{r}.log"), "w", encoding="utf-8") as f:
                f.writelines(line + "\n" for line in self.mesh.logs(r, 10**9))
        return folder

    def _summary(self) -> int:
        world = self.mesh.world_size
        if self.stopping is not None:
            # the run was stopped: the status says so (143 for SIGTERM, what a
            # batch system or a shell expects), whatever the ranks did with it
            ended = sorted(self.failed)
            self.term.line(f"monarch_nb: stopped by {_name(self.stopping)}: {len(self.done)} of "
                           f"{world} rank(s) finished"
                           + (f"; rank(s) {', '.join(map(str, ended))} ended by it" if ended
                              else ""))
            for rank in ended:
                self.term.line(f"  rank {rank}: {describe_failure(self.failed[rank])}")
            return 128 + self.stopping
        lost = sorted(self.lost)
        if not self.failed and len(self.done) + len(lost) == world:
            if not lost:
                self.term.line(f"monarch_nb: all {world} rank(s) finished")
                return 0
            self.term.line(f"monarch_nb: all {len(self.done)} rank(s) of the group finished, at "
                           f"world size {len(self.done)} of {world}; rank "
                           f"{format_ranks(lost)} lost: {describe_failure(self.lost[lost[0]])}")
            return 0
        lines = [f"monarch_nb: {len(self.done)} of {world} rank(s) finished; "
                 f"{len(self.failed)} failed" + (f", rank {format_ranks(lost)} lost" if lost
                                                  else "")]
        rows = self.mesh.status()
        left = [r for r in self.mesh.group if rows[r]["state"] not in GONE_FOR_GOOD]
        min_ranks = self.mesh.config.min_ranks
        below = min_ranks is not None and len(left) < min_ranks
        if below:
            # below the elastic world size: what ended the run (torchrun's
            # run ends too when fewer than its MIN nodes are left, exit 1)
            lines.append(f"  the group cannot go on: {len(left)} rank(s) left, fewer than "
                         f"--min-ranks {min_ranks}")
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
        if below:
            return 1  # no rank's own status: the capacity ended it (torchrun exits 1)
        return exit_code_of(self.failed[self.first_failure]) or 1


def _name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


class Stopped(BaseException):
    """A stopping signal before the script started: nothing to pass on."""

    def __init__(self, sig: int) -> None:
        super().__init__(_name(sig))
        self.sig = sig


def _free_port(addr: str) -> int:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind((addr if addr not in ("", "*") else "127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_script(parser: Any, script: str, mode: str) -> None:
    if mode == "module":
        return  # found on the ranks (in their working directory), as `python -m` would
    if mode == "exec":
        import shutil

        if shutil.which(script) is None and not (os.path.isfile(script)
                                                 and os.access(script, os.X_OK)):
            parser.error(f"program {script!r} not found (or not executable)")
        return
    if not os.path.isfile(script):
        parser.error(f"script {script!r} not found")


def run(argv: Sequence[str] | None = None, prog: str = "python -m monarch_nb.launch") -> int:
    """Entry point: parse, start the mesh, run the script; the exit status."""
    parser = build_parser(prog)
    ns = parse(parser, list(sys.argv[1:] if argv is None else argv))
    if ns.taken:
        sys.stderr.write(f"monarch_nb: taking {' '.join(ns.taken)} after the script as launcher "
                         "options; put them after `--` to pass them to the script\n")
    try:  # refused before anything starts
        how = plan(ns)
    except UsageError as exc:
        sys.stderr.write(f"monarch_nb: {exc}\n")
        return 2
    _check_script(parser, ns.script, how.mode)
    for note in how.notes:
        sys.stderr.write(note + "\n")
    opts = how.mesh
    if how.per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        sys.stderr.write(OMP_NOTICE + "\n")  # the ranks get OMP_NUM_THREADS=1 (supervisor.py)
    from .mesh import Mesh

    live = not ns.no_status and sys.stderr.isatty()
    term = Terminal(live)
    mesh = None
    script_run: ScriptRun | None = None

    # SIGTERM (a batch system's or Kubernetes' stop), SIGUSR1/2 (SLURM's
    # --signal) and --signals-to-handle: passed on to every rank by the run
    # (ScriptRun._pass_on_signals). Before the script runs, a stopping one
    # stops at once. A signal ignored when we started (nohup: SIGHUP) stays so.
    def on_signal(signum: int, frame: Any) -> None:
        if script_run is not None:
            script_run.signals.append(signum)
        elif signum in how.stop_signals:
            raise Stopped(signum)

    saved: dict[int, Any] = {}
    for sig in sorted(how.forward_signals - {signal.SIGINT}):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            saved[sig] = signal.signal(sig, on_signal)
    # Python leaves SIGINT ignored when it starts ignored, as it does for a
    # shell's background job (`launch ... &` in a script, a CI runner): a
    # `kill -INT` would then leave the whole mesh running. Like torchrun, the
    # launcher takes SIGINT itself whatever it inherited. Ctrl-C stops every
    # rank at once (their calls get KeyboardInterrupt).
    saved[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        def progress(infos: list[Any]) -> None:
            ready = sum(1 for i in infos if i.state.value == "ready")
            term.line(f"monarch_nb: {ready}/{len(infos)} ranks ready")

        with term:
            mesh = Mesh.start(progress=progress, **opts)
            port = _free_port(opts.get("master_addr") or "127.0.0.1") \
                if how.mode == "exec" else None
            term.line(f"monarch_nb: running {ns.script} on {mesh.world_size} rank(s) "
                      f"({mesh.backend}, {opts['launcher']} launcher, respawn {ns.respawn})")
            script_run = ScriptRun(mesh, ns.script, ns.args, term, how, port)
            code = script_run.run()
    except KeyboardInterrupt:
        term.line("monarch_nb: interrupted; stopping every rank")
        code = EXIT_INTERRUPTED
    except Stopped as exc:
        term.line(f"monarch_nb: {exc} before the script started; stopping every rank")
        code = 128 + exc.sig
    except MonarchError as exc:
        term.line(f"monarch_nb: {exc}")
        code = 2 if isinstance(exc, UsageError) else 1
    finally:
        try:
            if mesh is not None:
                # a second Ctrl-C must not leave ranks behind: stop is not interruptible
                for sig in saved:
                    signal.signal(sig, signal.SIG_IGN)
                if script_run is not None:
                    try:
                        folder = script_run.save_logs()
                        if folder:
                            term.line(f"monarch_nb: rank logs in {folder}")
                    except (OSError, MonarchError) as exc:
                        term.line(f"monarch_nb: could not save the rank logs: {exc}")
                mesh.stop()
        finally:
            for sig, old in saved.items():
                signal.signal(sig, old)
    return code


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()


__all__ = ["ScriptRun", "Terminal", "build_parser", "exit_code_of", "main", "mesh_options",
           "metrics_of", "parse", "plan", "retryable", "run", "user_traceback"]
