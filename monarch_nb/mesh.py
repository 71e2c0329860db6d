"""The public Python API: :class:`Mesh`, sub-meshes and :class:`RankResults`.

Everything the magics do goes through here, so a script can do it too::

    with Mesh.start(n=4) as mesh:
        mesh.run(fn, x)              # RankResults {rank: value}, or raises RankErrors
        mesh[1:3].exec("y = x * 2")  # sub-mesh, same methods

Waiting policy lives here: a blocking call waits on its future; Ctrl-C (the
notebook's interrupt button) interrupts the ranks running it and waits a
moment for them to come back, so they stay usable; ``timeout=`` interrupts the
ranks and raises :class:`CallTimeout` naming where each one was.

Non-goals: sockets and rank bookkeeping (controller/core.py), parsing (magics.py).
"""

from __future__ import annotations

import ast
import atexit
import concurrent.futures
import itertools
import json
import os
import signal as signal_mod
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from . import backends, notices
from .config import MeshConfig, check_hang_timeout, parse_preload
from .controller.analysis import timeline
from .controller.analysis.collectives import (
    STRAGGLER_FACTOR,
    WINDOW_STEPS,
    CollectiveReport,
    RankTail,
    StragglerReport,
)
from .controller.analysis.collectives import stragglers as find_stragglers
from .controller.calls.output import CallOutput
from .controller.core import Controller, Event, RankInfo, RankState
from .controller.inspector import STACKS_TIMEOUT_S, collective_report, death_report
from .controller.metricstore import MetricsStore, health_fields
from .controller.rankdebug import DEFAULT_RANKS, RankDebugger
from .engine.debug import post_mortem as _post_mortem
from .errors import (
    CallTimeout,
    MeshNotRunning,
    MonarchError,
    RankDied,
    RankErrors,
    RemoteError,
    UsageError,
    collective_hint,
)
from .flight import RING_SIZE
from .futures import MeshFuture
from .procs import agents, keptfiles, launchers, limits
from .results import RankResults
from .selection import format_ranks, parse_ranks
from .stacks import Stacks
from .wire import gpuipc, serialize
from .wire.protocol import Kind

Output = CallOutput  # what Mesh.output() returns: a destination for ranks' output
INTERRUPT_GRACE_S = 5.0  # how long an interrupted call may take to come back
# A kernel's manager sends SIGINT, then at once the shutdown request ("Restart
# Kernel"): a kept mesh's call waits this long after an interrupt to tell them apart
SHUTDOWN_GRACE_S = 2.0  # (the manager sends SIGTERM 2.5 s after the interrupt)
_cell_counter = itertools.count(1)


class _RankSet:
    """Methods shared by a mesh and its sub-meshes; ``self._sel`` are the ranks."""

    _mesh: Mesh
    _sel: tuple[int, ...]

    # -- calls ------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            elastic: bool = False, hang_timeout: float | None = None,
            check_collectives: bool = False, **kwargs: Any) -> RankResults:
        """Run ``fn(*args, **kwargs)`` on every selected rank and wait.
        ``elastic=True``: a rank that dies is respawned and the call re-issued
        on it; the survivors carry on (inside ``mnb.elastic.run``).
        ``hang_timeout``: print where the ranks are after that many seconds
        without progress (default: the mesh's, 60 s).
        ``check_collectives=True``: before each collective the ranks compare
        op, dtypes and shapes; a difference fails the call at once on every
        rank (``CollectiveMismatch``) instead of hanging (slower: a store
        round trip per collective)."""
        meta: dict[str, Any] | None = {"elastic": True} if elastic else None
        if check_collectives:
            meta = {**(meta or {}), "check": 1}
        return self._mesh._call(Kind.CALL, self._sel, self._payload(fn, args, kwargs), meta,
                                timeout, hang_timeout)

    def run_async(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> MeshFuture:
        """Start ``fn`` on the selected ranks; returns a :class:`MeshFuture`."""
        payload = self._payload(fn, args, kwargs)
        return self._mesh._live().submit(Kind.CALL, self._sel, payload, None, CallOutput())

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...] = (),
               kwargs: dict[str, Any] | None = None, *, output: Output | None = None,
               generation: int | None = None) -> MeshFuture:
        """Start ``fn(*args, **kwargs)`` on the selected ranks without waiting
        (what ``run_async`` does, for programs that drive a mesh themselves,
        such as the script launcher). ``output``: where the ranks' output
        goes (:meth:`Mesh.output`; default: this thread's cell or terminal).
        ``generation``: the group generation the work started in; a rank that
        joins a later one came in mid-run and takes its ``mnb.elastic`` state
        from a peer (default: none, an ordinary call)."""
        payload = self._payload(fn, args, kwargs or {})
        meta = None if generation is None else {"generation": int(generation)}
        return self._mesh._live().submit(Kind.CALL, self._sel, payload, meta,
                                         output if output is not None else CallOutput())

    def _payload(self, fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> list[Any]:
        """The call's frames. With gpu_ipc, CUDA tensors are shared by IPC
        handle for these ranks' GPUs (wire/gpuipc.py); the shares become the
        call's when it is sent (controller/calls/dataplane.py)."""
        devices = self._mesh._ctl.gpu_ipc_devices
        if devices is None:
            return _call_payload(fn, args, kwargs)
        gpuipc.release_pending()  # shares of a payload this thread made but never sent
        try:
            with gpuipc.sending([devices[r] for r in self._sel]):
                return _call_payload(fn, args, kwargs)
        except BaseException:
            gpuipc.release_pending()
            raise

    def exec(self, code: str, setup: bool = False, *, timeout: float | None = None,
             name: str | None = None, block: bool = True, elastic: bool = False,
             hang_timeout: float | None = None, check_collectives: bool = False) -> Any:
        """Run cell ``code`` on the selected ranks; RankResults of each rank's
        last expression. The code is syntax-checked here first, so a typo
        costs no round trip and shows the line. ``check_collectives``: as
        for :meth:`run`."""
        check_hang_timeout(hang_timeout)
        meta = _exec_meta(code, setup, name)
        if elastic:
            meta["elastic"] = True
        if check_collectives:
            meta["check"] = 1
        if not block:
            return self._mesh._live().submit(Kind.EXEC, self._sel, [], meta, CallOutput(),
                                             hang_timeout)
        return self._mesh._call(Kind.EXEC, self._sel, [], meta, timeout, hang_timeout)

    def exec_async(self, code: str, setup: bool = False, name: str | None = None,
                   elastic: bool = False) -> MeshFuture:
        """Start cell ``code`` on the selected ranks; returns a :class:`MeshFuture`."""
        return self.exec(code, setup, name=name, block=False, elastic=elastic)

    def push(self, **values: Any) -> None:
        """Set names in every selected rank's namespace."""
        if not values:
            raise UsageError("push() needs name=value pairs, e.g. mesh.push(lr=0.1)")
        bad = [k for k in values if not k.isidentifier()]
        if bad:
            raise UsageError(f"cannot push {bad}: not valid Python names")
        self.run(_push, values)

    def pull(self, name: str) -> RankResults:
        """The value of ``name`` in every selected rank's namespace."""
        if not isinstance(name, str) or not name.isidentifier():
            raise UsageError(f"pull() needs a variable name, got {name!r}")
        return self.run(_pull, name)

    # -- looking inside ---------------------------------------------------------
    def stacks(self, ranks: Any = None, *, native: bool = False,
               timeout: float = STACKS_TIMEOUT_S) -> Stacks:
        """The Python stack of every thread of the selected ranks, taken by
        each rank's control thread (so it works while user code is stuck in
        a collective, a C call or a loop). Printed grouped: ranks standing
        in the same place are shown once. ``native=True`` adds py-spy's
        native frames where py-spy is installed."""
        sel = self._sel if ranks is None else self.ranks(ranks).rank_ids
        return self._mesh._live().request_stacks_blocking(sel, timeout, native)

    def collectives(self, ranks: Any = None, *, timeout: float = STACKS_TIMEOUT_S,
                    records: int = RING_SIZE) -> CollectiveReport:
        """What the ranks' collective flight recorders say, side by side:
        per group, the last collective each rank reached; the first one
        where they called different collectives (op, dtypes, shapes) or the
        same one from different lines; a collective some ranks wait in that
        others never entered, and where those are. A rank that died in the
        last call (or one still running) counts too: its persisted records
        say where it died, and are lined up with the others' records of its
        generation (``before rank 2 died: ...``). Asked of each rank's
        control thread, so it works while the ranks are stuck. (Calls that
        skip ``torch.distributed``'s functions, such as DDP's, are not seen.)
        ``records``: how many of each rank's newest records to read (the
        dashboard reads fewer, often)."""
        stacks = self._flight(ranks, timeout, records)
        return collective_report(stacks)

    def stragglers(self, ranks: Any = None, *, window_steps: int = WINDOW_STEPS,
                   factor: float = STRAGGLER_FACTOR,
                   timeout: float = STACKS_TIMEOUT_S,
                   report: CollectiveReport | None = None) -> StragglerReport:
        """Per rank, the time spent computing (between collectives) and
        waiting (inside them) over the last ``window_steps`` steps (as
        ``mnb.log`` counts them; else that many collectives); a rank whose
        computing time is ``factor`` x the others' median is flagged
        (``.slow``): the others wait for it in every collective.
        ``report``: a :meth:`collectives` report to read the records from,
        instead of asking the ranks again."""
        if report is not None:
            tails = dict(report.tails)
        else:
            stacks = self._flight(ranks, timeout)
            tails = {r: RankTail.from_wire(r, st.flight) for r, st in stacks.items()
                     if st.flight is not None}
        now = time.monotonic()
        rates = {r: self._mesh._ctl.metrics.steps_per_s(r, now) for r in tails}
        return find_stragglers(tails, rates, window_steps, factor)

    def trace(self, path: str, ranks: Any = None, *, timeout: float = STACKS_TIMEOUT_S) -> str:
        """Write a Chrome / Perfetto trace (JSON ``traceEvents``) of the
        recent past: per rank a track with its calls (cells, ``mesh.run``)
        and collectives, its ``mnb.log`` steps, and the mesh's deaths,
        respawns and re-formations; a respawned rank's earlier incarnations
        (the call each died in, its last collectives) on the same track, so
        its history does not start at its rebirth. Open it in https://ui.perfetto.dev or
        chrome://tracing. Returns ``path``."""
        stacks = self._flight(ranks, timeout)
        tails = {r: RankTail.from_wire(r, st.flight) for r, st in stacks.items()
                 if st.flight is not None}
        ctl = self._mesh._ctl
        steps = {r: ctl.metrics.step_marks(r) for r in tails}
        doc = timeline.chrome_trace(tails, self._mesh.events, steps,
                                    title=f"monarch_nb mesh of {self._mesh.world_size}",
                                    earlier=ctl.inspector.dead_tails(tuple(stacks), every=True))
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        return path

    def _flight(self, ranks: Any, timeout: float, records: int = RING_SIZE) -> Stacks:
        sel = self._sel if ranks is None else self.ranks(ranks).rank_ids
        return self._mesh._live().request_stacks_blocking(sel, timeout,
                                                          flight=max(1, int(records)))

    # -- selection ----------------------------------------------------------
    def ranks(self, spec: Any) -> SubMesh:
        """A sub-mesh: ``mesh.ranks("1-3")``, ``mesh.ranks([0, 2])``."""
        world = self._mesh.world_size
        chosen = parse_ranks(spec, world)
        outside = [r for r in chosen if r not in self._sel]
        if outside:
            raise UsageError(f"rank {format_ranks(outside)} is not in this sub-mesh "
                             f"(ranks {format_ranks(self._sel)})")
        return SubMesh(self._mesh, chosen)

    def __getitem__(self, key: int | slice) -> SubMesh:
        if isinstance(key, int):
            if not -len(self._sel) <= key < len(self._sel):
                raise UsageError(f"rank index {key} is out of range for ranks {format_ranks(self._sel)}")
            return SubMesh(self._mesh, (self._sel[key],))
        if isinstance(key, slice):
            chosen = self._sel[key]
            if not chosen:
                raise UsageError(f"slice {key} selects no rank of {format_ranks(self._sel)}")
            return SubMesh(self._mesh, tuple(chosen))
        return self.ranks(key)

    def __len__(self) -> int:
        return len(self._sel)

    @property
    def rank_ids(self) -> tuple[int, ...]:
        return self._sel


class SubMesh(_RankSet):
    """Some ranks of a mesh, with the same methods."""

    def __init__(self, mesh: Mesh, ranks: Iterable[int]) -> None:
        self._mesh = mesh
        self._sel = tuple(ranks)

    def __repr__(self) -> str:
        return f"<SubMesh ranks {format_ranks(self._sel)} of {self._mesh!r}>"


class Mesh(_RankSet):
    """A running mesh of rank processes driven from this process."""

    def __init__(self, controller: Controller) -> None:
        self._mesh = self
        self._ctl = controller
        self._sel = tuple(range(controller.world_size))
        self.config = controller.cfg
        self._told = 0.0  # events up to this time were said (notices.py)

    # -- life cycle ------------------------------------------------------------
    @classmethod
    def start(cls, n: int | None = None, backend: str = "auto", respawn: str = "rank",
              launcher: str | launchers.Launcher = "local", hosts: Iterable[str] | str = (), *,
              progress: Callable[[list[RankInfo]], None] | None = None,
              name: str | None = None, keep_alive: float | str | None = None,
              min_ranks: int | None = None, fork: bool | None = None,
              preload: Iterable[str] | str = (), **options: Any) -> Mesh:
        """Start ``n`` ranks and wait until they joined their torch.distributed
        group. ``n`` defaults to the visible GPUs, else min(4, CPU cores).
        ``min_ranks``: an elastic world size. When ranks are gone for good
        (a restart budget spent, a host lost with no spare host) and at
        least ``min_ranks`` are left, the group re-forms among them (world
        size k, torch ranks 0..k-1) and ``mnb.elastic.run`` loops carry on;
        calls leave the lost ranks out, their entries
        :class:`~monarch_nb.results.Lost`. Mesh
        rank numbers stay as they are. ``None`` (default): the group keeps
        every rank, and a rank gone for good ends the elastic calls.
        ``fork``: this machine's ranks are forked from one warm process that
        imported torch once (docs/warm-process.md); ``False`` starts each
        as a fresh interpreter; ``None`` (default): on, unless
        ``MONARCH_NB_FORK=0`` is set. ``preload``: modules the warm process
        imports too (``["transformers"]``), so every rank starts with them.
        ``name``, ``keep_alive``: a *kept* mesh, which outlives this process
        (a kernel restarted, shut down or killed) for ``keep_alive`` seconds
        (``"30m"``, ``"2h"``; default 30 min) and which :meth:`attach` takes
        over from any process of yours on this machine
        (docs/kept-meshes.md).
        ``launcher``: a name, or a :class:`~monarch_nb.procs.launchers.Launcher`
        object that starts the ranks its own way (benchmarks/simranks.py
        hosts many simulated ranks in a few processes); with an object,
        ``n`` is required and the controller binds to loopback unless
        ``bind=`` says otherwise."""
        if isinstance(hosts, str):
            hosts = tuple(h for h in hosts.split(",") if h)
        custom = None if isinstance(launcher, str) else launcher
        if custom is not None and n is None:
            raise UsageError("Mesh.start with a Launcher object needs n (the number of ranks)")
        if fork is not None:
            options["fork"] = fork
        cfg = MeshConfig(n=n, backend=backend, respawn=respawn,  # type: ignore[arg-type]
                         launcher="local" if custom is not None else launcher,  # type: ignore[arg-type]
                         hosts=tuple(hosts), name=name, min_ranks=min_ranks,
                         keep_alive=keep_alive,  # type: ignore[arg-type]
                         preload=parse_preload(preload), **options)
        if custom is not None:
            spawner, world = custom, cfg.n or 0
        else:
            spawner, world = agents.from_config(cfg, cfg.n)
        if spawner.remote:  # GPUs are counted on the nodes, not here
            info = launchers.remote_backend(cfg.backend, spawner)
        else:
            info = backends.resolve(cfg.backend)
        world = world or info.default_ranks()
        if not spawner.remote and info.devices and world > len(info.devices):
            raise UsageError(f"-n {world} asks for more ranks than the {len(info.devices)} visible "
                             f"GPU(s); use -n {len(info.devices)} or --backend cpu")
        if cfg.min_ranks is not None and cfg.min_ranks > world:
            raise UsageError(f"min_ranks={cfg.min_ranks} is more than the mesh's {world} ranks")
        limits.ensure_open_files(world)  # before the first socket: ranks inherit it
        if cfg.kept:
            _refuse_taken_name(cfg.name)
        ctl = Controller(cfg, info, world, spawner)
        for notice in (limits.log_space_notice(ctl.supervisor.log_dir), ctl.gpu_ipc_notice):
            if notice:
                print(notice, file=sys.stderr)
        try:
            ctl.start(progress)
            if cfg.kept:
                ctl.write_record()
        except BaseException:
            ctl.stop(grace=1.0)
            raise
        return cls._keep(ctl)

    @classmethod
    def _keep(cls, ctl: Controller) -> Mesh:
        mesh = cls(ctl)
        if not _live_meshes and not _atexit_registered:
            _register_stop_at_exit()
        _live_meshes[mesh] = None
        return mesh

    # -- kept meshes (docs/kept-meshes.md) ----------------------------------------------------
    @classmethod
    def attach(cls, name: str, force: bool = False, *,
               launcher: agents.AgentLauncher | None = None) -> Mesh:
        """Take over kept mesh ``name`` (started with ``name=`` and
        ``keep_alive=`` by any process of yours on this machine): the same
        rank processes, with their variables and group; supervision resumes
        at once. Calls that ran while nobody was attached come back as
        :meth:`pending` futures. Refused while another controller is
        attached, naming it; ``force=True`` takes over (that controller's
        next call says so). ``launcher``: for a mesh started with a
        Launcher object, an :class:`~monarch_nb.procs.agents.AgentLauncher`
        of the same kind over the same hosts (its record names no launcher
        to rebuild)."""
        if not isinstance(name, str):
            raise UsageError(f"attach() needs the kept mesh's name, got {name!r}")
        for mesh in list(_live_meshes):
            if mesh.running and mesh.config.name == name:
                return mesh  # this process holds it already
        return cls._keep(Controller.attach(name, force=force, launcher=launcher))

    def detach(self) -> None:
        """Let this kept mesh go without stopping it: its ranks and the calls
        they run go on under their host agent; its ``keep_alive`` lease starts.
        ``Mesh.attach(name)`` takes it back."""
        if self._ctl.keep is None:
            raise UsageError("only a kept mesh can be detached (start it with name= and "
                             "keep_alive=); this one would stop with its controller")
        self._ctl.detach()
        _live_meshes.pop(self, None)

    def pending(self) -> list[MeshFuture]:
        """The calls begun before this controller attached (they ran, or
        still run, while none was attached), as futures, oldest first. Empty
        for a mesh this process started."""
        return [] if self._ctl.keep is None else self._ctl.keep.pending()

    def pending_output(self, future: MeshFuture) -> list[tuple[str, str]]:
        """What a :meth:`pending` call printed since the last time asked:
        ``(stream, text)`` pairs, each line labelled with its rank (the cell
        that ran it is gone, so its output is kept here)."""
        keep = self._ctl.keep
        return [] if keep is None else keep.take_output(future.call_id)

    def pending_info(self, future: MeshFuture) -> str:
        """Where a :meth:`pending` call stood at attach: ``running on ranks
        0,1`` or ``finished on ranks 0,1``."""
        keep = self._ctl.keep
        return "" if keep is None else keep.adopted_what.get(future.call_id, "")

    @classmethod
    def current(cls) -> Mesh:
        """The most recently started mesh that is still running: the one
        ``%monarch start`` made, for the Python API in a notebook cell."""
        for mesh in reversed(list(_live_meshes)):
            if mesh.running:
                return mesh
        raise MeshNotRunning("no mesh is running; start one with %monarch start or Mesh.start()")

    def stop(self, grace: float | None = None, signal: str | int | None = None) -> None:
        """Stop every rank (killing stuck ones after a short grace).

        ``signal="TERM"`` first sends that signal to every rank (their own
        handlers run: a checkpoint on preemption) and waits up to ``grace``
        seconds (default 30, torchrun's) for the calls in flight to end
        before stopping; a rank it kills is not respawned."""
        if signal is not None and self.running:
            self.signal_all(signal, stopping=True)
            deadline = time.monotonic() + (30.0 if grace is None else grace)
            ctl = self._ctl
            while len(ctl.calls) and time.monotonic() < deadline:
                ctl.pump(min(0.1, max(0.0, deadline - time.monotonic())))
        self._ctl.stop()
        _live_meshes.pop(self, None)

    def signal_all(self, signal: str | int = "TERM", *, stopping: bool = False) -> list[int]:
        """Send a signal to every live rank's process group, as torchrun
        passes its own on (SLURM's ``--signal USR1``, a preemption's TERM):
        the ranks' handlers run. ``stopping=True``: the mesh stops next, so a
        rank the signal ends is not respawned and its calls fail at once.
        The ranks it was sent to."""
        sig = _signal(signal)
        ctl = self._live()
        done = threading.Event()
        sent: list[int] = []

        def send() -> None:  # on the thread that leads the I/O loop, like kill
            try:
                if stopping:
                    ctl.recovery.stopped = True
                sent.extend(ctl.supervisor.signal_all(sig))
            finally:
                done.set()

        ctl.io.call_soon(send)
        while not done.is_set():
            ctl.pump(0.05)
        return sent

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return not self._ctl.stopped

    @property
    def world_size(self) -> int:
        """The mesh's number of ranks: stable (rank numbers 0..world_size-1),
        even while its torch group goes on with fewer (:attr:`group`)."""
        return self._ctl.world_size

    @property
    def group(self) -> tuple[int, ...]:
        """The mesh ranks in the torch.distributed group now, in the order of
        their torch ranks: every rank, or fewer after the group went on
        without lost ones (``min_ranks``); ``len(mesh.group)`` is the world
        size the ranks see (``mnb.world_size()``)."""
        return self._ctl.ranks.group

    @property
    def backend(self) -> str:
        return self._ctl.backend.name

    @property
    def generation(self) -> int:
        """The torch.distributed group's generation: 0 at start, +1 each time
        the group is re-formed (a respawn, a restart)."""
        return self._ctl.generation

    @property
    def metrics(self) -> MetricsStore:
        """Every rank's ``mnb.log`` series (read it; the controller writes it)."""
        return self._ctl.metrics

    def output(self, emit: Callable[[str, str], None] | None = None, *,
               notes: bool = True) -> Output:
        """A destination for ranks' output to pass to :meth:`submit`: every
        line goes to ``emit(stream, text)`` labelled with its rank, identical
        lines of several ranks folded into one (default: this thread's cell or
        terminal). ``notes=False`` leaves out the controller's own notes (a
        front end that shows :attr:`events` itself)."""
        out = CallOutput(emit)
        if not notes:
            out.note = lambda text, stream="stderr": None  # type: ignore[method-assign]
        return out

    def wait_any(self, futures: Iterable[MeshFuture], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until one of ``futures`` is done
        (leading the I/O loop meanwhile, so ranks' output, deaths and
        respawns are handled on this thread). With no futures, just serve
        the mesh for that long. True if one is done."""
        ctl = self._live()
        pending = list(futures)
        if not pending:
            ctl.pump(timeout)
            return False
        if any(f.done() for f in pending):
            return True
        ctl.wait(pending[0], timeout)
        return any(f.done() for f in pending)

    # -- control ----------------------------------------------------------------
    def kill(self, rank: int, signal: str | int = "KILL") -> None:
        """Send a signal to a rank's process (fault injection). For KILL,
        returns once the controller has seen the death, so the next call
        already knows (it waits for the respawn, or is refused)."""
        (r,) = parse_ranks(rank, self.world_size) if isinstance(rank, (int, str)) else (rank,)
        sig = _signal(signal)
        ctl = self._live()
        info = ctl.ranks[r]
        if info.state in (RankState.DEAD, RankState.WAITING, RankState.FAILED, RankState.LOST):
            raise UsageError(f"rank {r} is already dead")
        proc = ctl.supervisor.procs.get(r)
        ctl.kill(r, sig)  # KILL/TERM: DYING at once, the next call waits for it
        if sig == signal_mod.SIGKILL and proc is not None:
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and ctl.supervisor.procs.get(r) is proc \
                    and info.state not in (RankState.DEAD, RankState.WAITING, RankState.FAILED,
                                           RankState.LOST, RankState.RESPAWNING):
                ctl.pump(0.05)

    def add_hosts(self, hosts: Iterable[str] | str) -> None:
        """Give the mesh hosts (ssh, slurm). Ranks already lost with their
        host start on the first one now, keeping their numbers (a lost host
        given again, as a SLURM node that returns, takes its own ranks back);
        the group grows back with them, and a running ``mnb.elastic`` loop
        (``%%monarch --elastic``) takes them at its next ``state.commit()``,
        else they join at the next call. Hosts left over are spare hosts: a
        lost host's ranks start on the first one at the next loss. Returns
        at once; ``mesh.status()`` and ``mesh.events`` show them coming."""
        if isinstance(hosts, str):
            hosts = [h for h in hosts.split(",") if h]
        launcher = self._ctl.supervisor.launcher
        if not isinstance(launcher, agents.AgentLauncher):
            raise UsageError("add_hosts needs a mesh on several hosts (--launcher ssh or "
                             "slurm); this one runs on this machine")
        busy = sorted(set(hosts) & set(launcher.busy_hosts()))
        if busy:
            raise UsageError(f"host(s) {', '.join(busy)} already run ranks of this mesh")
        launcher.add_hosts(list(hosts))
        self._live().hosts_added()

    def restart(self, rank: int | str = "all") -> None:
        """Replace a rank (or ``"all"``) with a fresh process: same rank
        number and device, a new torch.distributed generation, ``--setup``
        cells replayed. Returns at once; calls to it wait until it is back."""
        ranks = parse_ranks(rank, self.world_size)
        self._live().restart(ranks)

    def status(self) -> list[dict[str, Any]]:
        """One dict per rank: state, pid, incarnation, device, heartbeat age,
        exit, restarts, host, lost_host (the host a ``lost`` rank was lost
        with, else ""), torch_rank (its rank in the torch group now; None
        when the group went on without it: see :attr:`group`), health (cpu %, rss bytes; GPU memory used /
        total / peak bytes, util %, temp °C, power W: None = n/a), steps/s,
        the last ``mnb.log`` step and the last value of each metric."""
        now = time.monotonic()
        rows = []
        store = self._ctl.metrics
        supervisor = self._ctl.supervisor
        table = self._ctl.ranks
        for info in table:
            lost = supervisor.lost_host(info.rank) if info.state == RankState.LOST else ""
            rows.append({
                "rank": info.rank, "state": info.state.value, "pid": info.pid,
                "incarnation": info.incarnation, "device": info.device,
                "heartbeat_age": round(now - info.last_heartbeat, 2) if info.last_heartbeat else None,
                "exit": self._ctl.describe_exit(info.exitcode)
                if info.state in (RankState.DEAD, RankState.WAITING, RankState.FAILED) else
                (f"its host {lost} was lost" if lost else ""),
                "restarts": info.incarnation, "host": info.host, "lost_host": lost,
                "torch_rank": table.torch_rank(info.rank),
                **health_fields(info.health),
                "steps_per_s": store.steps_per_s(info.rank, now), "step": store.last_step(info.rank),
                "last": store.last(info.rank),
                # silent but running: holding the GIL or in native code (not killed)
                "note": "no heartbeat: busy holding the GIL or in native code"
                if info.busy_silent else "",
            })
        return rows

    def dashboard(self) -> Any:
        """The live dashboard widget (one per mesh; display it in a cell).
        Plain-text front ends show the status table instead."""
        # The widget sits below the facade (it never imports mesh, it is handed
        # one); imported here so that a mesh without a dashboard loads no widget.
        from .ui.dashboard import dashboard_for

        return dashboard_for(self)

    @property
    def events(self) -> list[dict[str, Any]]:
        return [e.as_dict() for e in list(self._ctl.events)]

    @property
    def dropped(self) -> dict[str, int]:
        """Inbound messages dropped by reason (bad-signature, replay, ...)."""
        return dict(self._ctl.io.dropped)

    @property
    def dataplane(self) -> dict[str, int]:
        """What went through shared memory with the local ranks (counts):
        ``segments`` (calls whose big arguments, pushes included, went by
        shared memory) and their ``bytes``, ``mapped`` (big results and
        pulls taken from the ranks' segments), ``open`` (segments of calls
        still in flight), ``fallbacks`` (sent by socket: no shared memory
        could be made), ``refused`` (descriptors refused). Ranks on other
        hosts, through their host agents (as of the agents' last tick):
        ``agent_shm`` (messages whose big frames a rank passed to its agent
        in shared memory) and their ``agent_shm_bytes``, ``agent_shm_refused``
        (passed files an agent refused: their messages dropped)."""
        relay = self._ctl.supervisor.relay_counts()
        return {**self._ctl.dataplane.stats(),
                **{f"agent_{k}": relay.get(k, 0) for k in ("shm", "shm_bytes", "shm_refused")}}

    def logs(self, rank: int, tail: int = 100) -> list[str]:
        """The last ``tail`` lines a rank wrote, earlier incarnations of a
        respawned rank included (each under a header saying how it ended)."""
        (r,) = parse_ranks(rank, self.world_size)
        if isinstance(tail, bool) or not isinstance(tail, int) or tail < 1:
            raise UsageError(f"tail must be a positive number of lines, not {tail!r}")
        return self._ctl.supervisor.logs(r, tail)

    def debug(self, rank: int) -> None:
        """Post-mortem pdb on ``rank``'s last failed call, driven from here:
        each debugger prompt is asked with ``input()`` (the notebook's input
        box). ``q`` or ``c`` leaves; the rank stays usable. A rank that
        died of a signal since its last failed call (no interpreter left for
        pdb) gets its death report instead (inspector.death_report)."""
        (r,) = parse_ranks(rank, self.world_size)
        try:
            self._call(Kind.CALL, (r,), _call_payload(_post_mortem, (), {}), None, None)
        except (RankErrors, UsageError) as exc:
            err = exc.errors.get(r) if isinstance(exc, RankErrors) else exc
            report = death_report(self._ctl.supervisor, r)
            if report and (isinstance(err, (UsageError, RankDied)) or (
                    isinstance(err, RemoteError) and err.type_name == "LookupError")):
                print(report)
                return
            if isinstance(err, RemoteError) and err.type_name == "LookupError":
                raise UsageError(err.message) from None
            raise

    def debugger(self, ranks: Any = DEFAULT_RANKS, *, off: bool = False,
                 timeout: float = 10.0) -> RankDebugger:
        """JupyterLab's visual debugger on ``ranks`` (default: rank 0; see
        docs/debugging.md), or on none with ``off=True`` (stopped ranks run
        on). Returns the handle a front end drives: breakpoints in the
        ranks' terms, requests to a rank's debugger, its events (ui/labdebug.py
        connects it to the kernel's debugger). Waits until every live rank
        took the selection."""
        ctl = self._live()
        sel = () if off else parse_ranks(ranks, self.world_size)
        done = ctl.debugging.select(tuple(sel))
        try:
            done.result(timeout)
        except concurrent.futures.TimeoutError:
            raise MonarchError(f"the ranks did not take the debugger's selection within "
                               f"{timeout:g} s; see %monarch status") from None
        return ctl.debugging

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<Mesh {self.world_size} ranks, {self.backend}, {state}>"

    # -- internals -------------------------------------------------------------
    def _live(self) -> Controller:
        keep = self._ctl.keep
        if keep is not None and keep.taken:
            name = self.config.name
            raise MeshNotRunning(f"kept mesh {name!r} was {keep.taken}; Mesh.attach({name!r}, "
                                 f"force=True) (%monarch attach {name} --force) takes it back")
        if self._ctl.stopped:
            raise MeshNotRunning("this mesh was stopped; start a new one with Mesh.start() "
                                 "or %monarch start")
        return self._ctl

    def _call(self, kind: Kind, ranks: tuple[int, ...], payload: list[Any],
              meta: dict[str, Any] | None, timeout: float | None,
              hang_timeout: float | None = None) -> RankResults:
        """A blocking call: send, wait (leading the I/O loop), and apply the
        waiting policy: timeout -> interrupt + CallTimeout; Ctrl-C ->
        interrupt the ranks, let them settle, re-raise."""
        ctl = self._live()
        self._tell_respawns(ctl)
        issued: list[MeshFuture] = []
        try:
            fut = ctl.call(kind, ranks, payload, meta, None, timeout,
                           on_future=issued.append, hang_timeout=hang_timeout)
            if not fut.done():
                where = self._interrupt_and_settle(fut)
                raise CallTimeout(timeout or 0.0, where)
            return fut.result()
        except KeyboardInterrupt:
            if ctl.keep is not None and _kernel_shutting_down(SHUTDOWN_GRACE_S):
                # "Restart Kernel" interrupts the kernel before it asks it to
                # shut down: a kept mesh's cell goes on on the ranks, and what
                # it returns is the next controller's (nobody here reads it)
                ctl.keep.leaving = True
                raise
            if issued:  # interrupt this call, never some other one
                where = self._interrupt_and_settle(issued[0])
                _warn_collective(where)
                raise notices.CellInterrupted(where) from None
            raise
        finally:  # what happened meanwhile was announced to this call
            self._told = max([self._told, *(e.time for e in list(ctl.events)[-1:])])

    def _tell_respawns(self, ctl: Controller) -> None:
        """First line of a call's output: ranks respawned since the last
        call (their namespaces are new), from the event log."""
        # only the events after the cursor: the log grows with the mesh's life
        # (two per rank at start), and this runs before every call
        newer = []
        for event in reversed(list(ctl.events)):
            if event.time <= self._told:
                break
            newer.append(event)
        lines = notices.respawn_notices([e.as_dict() for e in reversed(newer)], self._told,
                                        (str(c.get("name", "")) for c in ctl.calls.setup_cells))
        if newer:
            self._told = max(self._told, newer[0].time)
        for line in lines:
            print(line, file=sys.stderr)

    def wait(self, future: MeshFuture, timeout: float | None = None) -> RankResults:
        """Wait for a future from ``run_async``/``exec_async`` (leading the
        I/O loop, so no thread hand-off) and return its result."""
        try:
            if not self._ctl.wait(future, timeout):
                raise concurrent.futures.TimeoutError(f"call still running after {timeout} s")
        except KeyboardInterrupt:
            if self._ctl.keep is not None and _kernel_shutting_down(SHUTDOWN_GRACE_S):
                self._ctl.keep.leaving = True
                raise  # a kernel restart, not the user's interrupt (see _call)
            where = self._interrupt_and_settle(future)
            _warn_collective(where)
            raise notices.CellInterrupted(where) from None
        return future.result()

    def _interrupt_and_settle(self, fut: MeshFuture) -> dict[int, str]:
        """Interrupt the ranks still in ``fut``'s call and give them a moment
        to come back; returns where each of them was."""
        ctl = self._ctl
        call = ctl.calls.get(fut.call_id)
        if call is None:
            return {}
        targets = set(call.remaining)  # snapshot: these are the ranks interrupted
        ctl.interrupt(fut.call_id)
        ctl.wait(fut, INTERRUPT_GRACE_S)
        answers = ctl.interrupt_where.get(fut.call_id, {})
        # The answers travel apart from the results: give late ones a moment.
        late = time.monotonic() + 1.0
        while not targets <= set(answers) and time.monotonic() < late:
            ctl.pump(0.05)
        where = {}
        for r in sorted(targets):
            w = answers.get(r)
            if w is None:
                w = "unknown (did not answer the interrupt)"
            elif not w:
                w = "finished before the interrupt arrived"
            where[r] = w
        ctl.interrupt_where.pop(fut.call_id, None)
        return where


    # (last in the class: the name would hide the builtin in annotations below it)
    @staticmethod
    def list() -> list[dict[str, Any]]:
        """The kept meshes of this user on this machine: one dict each with
        ``name``, ``ranks``, ``hosts``, ``started`` (seconds since 1970),
        ``attached`` (``"pid P on H since T"``, or ``""``) and ``lease_left``
        (seconds before a detached mesh ends; None while attached)."""
        return keptfiles.list_meshes()

_live_meshes: dict[Mesh, None] = {}  # insertion-ordered: the newest last
_atexit_registered = False


def _register_stop_at_exit() -> None:
    """Kernel shutdown and restart end the interpreter normally: stop ranks
    then. Registered when the first mesh is made (the package root no longer
    imports this module; a SIGKILLed kernel is covered by the ranks'
    parent-death signal)."""
    global _atexit_registered
    atexit.register(stop_all)
    _atexit_registered = True
    _stop_on_sigterm()


def _stop_on_sigterm() -> None:
    """In a kernel: a manager whose shutdown request is not done in its wait
    (2.5 s, easily spent stopping a busy mesh on a loaded machine) sends
    SIGTERM, which ends Python without atexit. Kill the ranks and remove
    the logs first, then die of the SIGTERM as before. Only where nobody
    handles SIGTERM already (a script's or the launcher's own handler stays)."""
    ipython = sys.modules.get("IPython")
    if (ipython is None or "ipykernel" not in sys.modules or ipython.get_ipython() is None
            or threading.current_thread() is not threading.main_thread()
            or signal_mod.getsignal(signal_mod.SIGTERM) is not signal_mod.SIG_DFL):
        return

    def on_sigterm(signum: int, _frame: object) -> None:
        for mesh in list(_live_meshes):
            if mesh._ctl.keep is None:  # a kept mesh's agent outlives us by design
                mesh._ctl.supervisor.kill_now()
        signal_mod.signal(signum, signal_mod.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal_mod.signal(signal_mod.SIGTERM, on_sigterm)


def _kernel_shutting_down(wait: float) -> bool:
    """This process is an IPython kernel asked to shut down (or restart)
    within ``wait`` s: ipykernel's shutdown_request, handled on its control
    thread, sets the shell's ``exit_now``."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return False
    deadline = time.monotonic() + wait
    while not getattr(shell, "exit_now", False):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _warn_collective(where: dict[int, str]) -> None:
    hint = collective_hint(where)
    if hint:
        print(f"monarch_nb: {hint}", file=sys.stderr)


def _call_payload(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    if not callable(fn):
        raise UsageError(f"run() needs a function, got {type(fn).__name__}")
    try:
        return serialize.dumps_call(fn, args, kwargs)
    except serialize.SerializationError as exc:
        raise UsageError(str(exc)) from None


def _exec_meta(code: str, setup: bool, name: str | None) -> dict[str, Any]:
    if not isinstance(code, str):
        raise UsageError(f"exec() needs a string of code, got {type(code).__name__}")
    # not <mnb-cell-N>: that is the magics' name for notebook cell N (its
    # execution count), and two cells of one name share the ranks'
    # linecache entry (tracebacks, debugger listings, recorder callers)
    name = name or f"<mnb-cell-exec-{next(_cell_counter)}>"
    try:
        ast.parse(code, filename=name)
    except SyntaxError as exc:
        raise _syntax_error(exc, code) from None
    return {"code": code, "name": name, "setup": bool(setup)}


def _push(values: dict[str, Any]) -> None:
    import __main__

    vars(__main__).update(values)


def _pull(name: str) -> Any:
    import __main__

    ns = vars(__main__)
    if name not in ns:
        raise NameError(f"name {name!r} is not defined on this rank")
    return ns[name]


def _signal(sig: str | int) -> int:
    if isinstance(sig, int):
        return sig
    name = sig.upper()
    name = name if name.startswith("SIG") else "SIG" + name
    try:
        return int(getattr(signal_mod, name))
    except AttributeError:
        raise UsageError(f"unknown signal {sig!r}; use KILL, TERM, STOP, CONT or INT") from None


def _syntax_error(exc: SyntaxError, code: str) -> MonarchError:
    line = (exc.text or "").rstrip("\n")
    caret = " " * max(0, (exc.offset or 1) - 1) + "^"
    return UsageError(f"syntax error in the cell, line {exc.lineno}: {exc.msg}\n    {line}\n    {caret}\n"
                      "nothing was sent to the ranks")


def stop_all() -> None:
    """At exit: every mesh stops, but a kept one is let go (it outlives us)."""
    for mesh in list(_live_meshes):
        if mesh._ctl.keep is not None:
            mesh._ctl.detach()
            _live_meshes.pop(mesh, None)
        else:
            mesh.stop()


def _refuse_taken_name(name: str | None) -> None:
    if name is not None and any(m["name"] == name for m in keptfiles.list_meshes()):
        raise UsageError(f"a kept mesh named {name!r} runs already; attach to it "
                         f"(Mesh.attach({name!r}), %monarch attach {name}) or stop it "
                         f"(monarch-nb stop {name}) first")


__all__ = ["Mesh", "RankResults", "SubMesh", "Event", "RankErrors", "stop_all"]
