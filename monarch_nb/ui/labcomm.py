"""The JupyterLab extension's feed: a comm that tells the front end about the mesh.

The ``monarch-nb-lab`` extension (extension/ in the repository) shows the
active kernel's mesh in the status bar ("mesh 4/4 ranks · cpu") and in a
side panel. It learns about the mesh only through the comm target
``monarch_nb.mesh``, never by running code in the kernel.

Who opens the comm. Both sides can, so that every order of events works:

* when ``%load_ext monarch_nb`` runs in an ipykernel, :func:`attach`
  registers the kernel-side target *and*, when the front end is a
  JupyterLab (or Notebook 7) page, opens a comm to the front end's target
  of the same name (the extension registers it on every kernel it sees).
  This reaches an already open page at once, even while the kernel stays
  busy in the rest of the cell. A headless client (nbclient, nbconvert,
  papermill) gets no such comm: it has no handler for the target and would
  log "No handler found for comm target" on every run. The kernel cannot
  ask the front end which targets it has; it goes by what JupyterLab's
  pages do: their kernel is started by a Jupyter server for a notebook
  (``JPY_SESSION_NAME`` in its environment) and their execute requests
  carry JupyterLab's metadata (``deletedCells``, ``recordTiming``);
* a page opened (or reloaded) later finds no comm, so the extension opens
  one to the kernel's target once per kernel connection. Before
  ``%load_ext`` the kernel has no such target and closes it (one line in
  the kernel's log); the kernel's own open at ``%load_ext`` then reaches
  the page. No retry loop, no polling.

A comm the kernel opened gets the summary whenever it changes, at once
(the page's answer, ``{"action": "hello"}``, is only read when the kernel is
idle, and a Run All may keep it busy for hours); the once-a-second refresh
of heartbeat ages goes only to comms that said hello. So a front end without
the extension (nbclient, VS Code) gets a message per change of the mesh and
nothing while it is steady.

What goes over it (kernel -> front end), JSON:

* ``{"t": "mesh", "mesh": None}`` (no mesh) or ``{"t": "mesh", "mesh":
  summary}`` with ``summary`` from :func:`summarize`: world size, backend,
  running or stopped, ranks up, dead count, and per rank its state,
  incarnation, restarts, pid and heartbeat age. Sent on change and, while a
  mesh runs, once a second (fresh heartbeat ages), at most ``MAX_HZ`` a
  second, from a daemon thread (like dashboard.py: the kernel's main thread
  may be blocked in a cell; iopub sends are thread-safe). A rank the last
  summary showed up that is up again in a new incarnation (it died or was
  replaced in between) is shown dead in the next one, then as it is: a
  respawn quicker than the refresh still shows red;
* ``{"t": "stacks", "text": ...}``, ``{"t": "ack", "text": ...}``,
  ``{"t": "error", "text": ...}``: answers to the front end's requests.

Front end -> kernel: ``{"action": "hello"}`` (send the summary now),
``{"action": "stacks"}`` (``mesh.stacks()``, grouped text),
``{"action": "restart", "rank": R}`` (``mesh.restart(R)``). These are
handled by the kernel's main thread when it is idle (comm messages arrive on
the shell channel), as a ``%monarch`` line would be.

Non-goals: the front end (extension/), the live charts (dashboard.py),
deciding what a rank's state is (controller).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from .dashfeed import Throttle

TARGET = "monarch_nb.mesh"
MAX_HZ = 4.0
REFRESH_S = 1.0  # while a mesh runs, resend at least this often (heartbeat ages)
UP = ("ready", "busy")
DOWN = ("dead", "waiting", "failed", "lost")


def summarize(rows: list[dict[str, Any]], world: int, backend: str, running: bool) -> dict[str, Any]:
    """The front end's view of a mesh, from ``mesh.status()`` rows (pure)."""
    ranks = [{
        "rank": r["rank"], "state": r["state"] if running else "stopped",
        "incarnation": r["incarnation"], "restarts": r["restarts"], "pid": r["pid"],
        "hb": None if r.get("heartbeat_age") is None else round(float(r["heartbeat_age"]), 1),
    } for r in rows]
    return {
        "world": world, "backend": backend, "state": "running" if running else "stopped",
        "up": sum(1 for r in ranks if r["state"] in UP),
        "dead": sum(1 for r in ranks if r["state"] in DOWN),
        "ranks": ranks,
    }


def _coarse(msg: dict[str, Any]) -> Any:
    """What counts as a change: everything but the heartbeat ages' decimals."""
    mesh = msg.get("mesh")
    if not mesh:
        return mesh
    return {**mesh, "ranks": [{**r, "hb": None if r["hb"] is None else int(r["hb"] >= 1.5)}
                              for r in mesh["ranks"]]}


class Hub:
    """The open comms of one kernel and the thread that feeds them."""

    def __init__(self, source: Callable[[], Any], max_hz: float = MAX_HZ,
                 background: bool = True) -> None:
        self.source = source  # -> the mesh to show (running or last stopped) or None
        self.background = background  # False: the caller ticks (tests)
        self.comms: list[Any] = []  # fed on change
        self.confirmed: list[Any] = []  # said hello: also fed the periodic refresh
        self.throttle = Throttle(max_hz)
        self.sent = 0  # summaries pushed (tests)
        self._last: Any = object()
        self._last_at = float("-inf")
        # A rank that died and came back between two summaries (a forked
        # rank is back in 0.2 s, the refresh is 1/4 s) has a new incarnation
        # where the last summary showed it up: it is shown dead once, then as
        # it is; otherwise the status bar would never go red for it.
        self._sent_of: Any = None  # the mesh of the last summary sent
        self._up_sent: dict[int, int] = {}  # rank -> incarnation, of those it showed up
        self._force = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # -- comms -------------------------------------------------------------------
    def add(self, comm: Any, confirmed: bool = True) -> None:
        """Feed ``comm``; an unconfirmed one (opened by us) gets only changes
        until the extension says hello on it."""
        comm.on_msg(lambda msg: self._on_msg(comm, msg))
        comm.on_close(lambda _msg: self._drop(comm))
        self._confirm(comm, confirmed)

    def _confirm(self, comm: Any, confirmed: bool = True) -> None:
        with self._lock:
            if comm not in self.comms:
                self.comms.append(comm)
            if confirmed and comm not in self.confirmed:
                self.confirmed.append(comm)
            self._force = True
            if self.background and self._thread is None:  # (cleared under the lock on exit)
                self._thread = threading.Thread(target=self._run, name="monarch-nb-labcomm",
                                                daemon=True)
                self._thread.start()
        self._wake.set()

    def _drop(self, comm: Any) -> None:
        with self._lock:
            for group in (self.comms, self.confirmed):
                if comm in group:
                    group.remove(comm)

    def _send(self, data: dict[str, Any], to: list[Any] | None = None) -> None:
        for comm in list(self.comms if to is None else to):
            try:
                comm.send(data)
            except Exception:  # a comm closing under us, a kernel shutting down
                self._drop(comm)

    # -- the summary -------------------------------------------------------------
    def message(self) -> dict[str, Any]:
        return self._message()[0]

    def _message(self) -> tuple[dict[str, Any], Any]:
        """The summary to send and its mesh."""
        mesh = self.source()
        if mesh is None:
            return {"t": "mesh", "mesh": None}, None
        running = mesh.running
        rows = mesh.status()
        if running and mesh is self._sent_of:  # (a new mesh's past is no news)
            up = self._up_sent
            rows = [{**r, "state": "dead"}
                    if r["state"] in UP and r["incarnation"] > up.get(r["rank"], r["incarnation"])
                    else r for r in rows]
        return {"t": "mesh", "mesh": summarize(rows, mesh.world_size, mesh.backend, running)}, mesh

    def tick(self, now: float | None = None) -> bool:
        """Send the summary if it changed (or is due, or was asked for) and
        the throttle allows; True if sent."""
        now = time.monotonic() if now is None else now
        msg, mesh = self._message()
        coarse = _coarse(msg)
        running = bool(msg["mesh"]) and msg["mesh"]["state"] == "running"
        changed = self._force or coarse != self._last
        due = running and now - self._last_at >= REFRESH_S and bool(self.confirmed)
        if not (changed or due):
            return False
        if not self.throttle.take(now):
            return False
        self._force = False
        self._last, self._last_at = coarse, now
        self._sent_of = mesh
        self._up_sent = {r["rank"]: r["incarnation"]
                         for r in (msg["mesh"] or {}).get("ranks", ()) if r["state"] in UP}
        self._send(msg, None if changed else self.confirmed)
        self.sent += 1
        return True

    def _run(self) -> None:
        while True:
            with self._lock:  # exit and a new comm's check cannot interleave
                if not self.comms:
                    self._thread = None
                    return
            try:
                self.tick()
            except Exception:  # a mesh stopping under us: try again next tick
                pass
            self._wake.wait(self.throttle.interval)
            self._wake.clear()

    # -- requests from the front end ---------------------------------------------
    def _on_msg(self, comm: Any, msg: Any) -> None:
        # Anything may arrive here (any page or client on the kernel can send
        # a comm message): a malformed one gets an error reply, never raises.
        content = msg.get("content") if isinstance(msg, dict) else None
        data = content.get("data") if isinstance(content, dict) else None
        if not isinstance(data, dict):
            self._send({"t": "error", "text": "malformed request: expected {\"action\": ...}"},
                       to=[comm])
            return
        action = data.get("action")
        reply: dict[str, Any]
        try:
            if action == "hello":
                self._confirm(comm)
                return
            mesh = self.source()
            if mesh is None or not mesh.running:
                reply = {"t": "error", "text": "no mesh is running; %monarch start one first"}
            elif action == "stacks":
                reply = {"t": "stacks", "text": mesh.stacks().render()}
            elif action == "restart":
                rank = data.get("rank")
                # the panel sends one rank number; anything else (no rank,
                # "all", a list) must not restart ranks by accident
                if isinstance(rank, bool) or not isinstance(rank, int):
                    raise ValueError(f"restart needs a rank number, not {rank!r}")
                mesh.restart(rank)
                reply = {"t": "ack", "text": f"restarting rank {rank}"}
                self._force = True
                self._wake.set()
            else:
                reply = {"t": "error", "text": f"unknown action {action!r}"}
        except Exception as exc:  # a UsageError (bad rank) and the like: tell the panel
            reply = {"t": "error", "text": str(exc)}
        self._send(reply, to=[comm])


_hubs: dict[int, Hub] = {}


def attach(ipython: Any, source: Callable[[], Any]) -> Hub | None:
    """Register the comm target in this kernel and open a comm to the front
    end (no-op outside an ipykernel, e.g. plain IPython); idempotent."""
    kernel = getattr(ipython, "kernel", None)
    if kernel is None:
        return None
    import comm as comm_pkg

    manager = getattr(kernel, "comm_manager", None) or comm_pkg.get_comm_manager()
    hub = _hubs.get(id(ipython))
    if hub is None:
        hub = _hubs[id(ipython)] = Hub(source)
    else:
        hub.source = source
    manager.register_target(TARGET, lambda c, _msg: hub.add(c))
    if not lab_front_end(kernel):
        return hub  # a page opened later opens its comm itself
    try:  # reach a JupyterLab that is already open (its target may not exist: fine)
        hub.add(comm_pkg.create_comm(target_name=TARGET, data={"t": "hello"}), confirmed=False)
    except Exception:
        pass
    return hub


LAB_METADATA = ("deletedCells", "recordTiming")  # what JupyterLab puts in execute requests


def lab_front_end(kernel: Any) -> bool:
    """Is this kernel driven by a JupyterLab / Notebook 7 page (which may
    have the extension's comm target), rather than a headless client?"""
    import os

    if os.environ.get("JPY_SESSION_NAME"):  # started by a Jupyter server for a notebook
        return True
    try:
        parent = kernel.get_parent("shell") or {}
    except Exception:
        return False
    metadata = parent.get("metadata") or {}
    return any(key in metadata for key in LAB_METADATA)


def detach(ipython: Any) -> None:
    hub = _hubs.pop(id(ipython), None)
    if hub is None:
        return
    for c in list(hub.comms):
        try:
            c.close()
        except Exception:
            pass
    hub.comms.clear()


__all__ = ["TARGET", "Hub", "attach", "detach", "summarize", "MAX_HZ"]
