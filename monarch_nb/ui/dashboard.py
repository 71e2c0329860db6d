"""The live dashboard: an anywidget view of a mesh's controller state.

``mesh.dashboard()`` (and ``%monarch dashboard``, ``%monarch start``) give
the one :class:`Dashboard` widget of a mesh: a tile per rank coloured by
state with its health figures, a canvas chart of an ``mnb.log`` metric (one
line per rank; from 9 ranks the mean with a min-max band, and one rank on
click), a metric selector, and the event log (deaths, respawns,
re-formations). The JavaScript (``static/dashboard.js``) is plain ESM that
anywidget loads: no build step, JupyterLab 4, Notebook 7 and VS Code.

Updates come from a daemon thread, not the kernel's main thread: while a
blocking ``%%monarch`` cell runs, the main thread is inside ``mesh.exec``
(leading the controller's I/O loop), and comm messages sent from another
thread still go out (ipykernel's iopub socket is a thread-safe
``BackgroundSocket``). The thread sends at most ``MAX_HZ`` messages a second,
each carrying only what changed (dashfeed.py). Messages *from* the browser
(a fresh page asking for everything) are handled by the kernel when idle;
until then a new page shows what arrives from then on.

A second daemon thread watches the collective flight recorders while calls
run (dashfeed.FlightWatch): a badge above the tiles lists what
``mesh.collectives()`` finds (a mismatch, ranks missing from a collective
others wait in), and a rank ``mesh.stragglers()`` flags is marked "slow" on
its tile. It asks the ranks' control threads without leading the I/O loop
(the main thread leads it during a blocking cell), so the badge appears
while the ranks are stuck.

A front end without widgets shows the text/plain part of the mimebundle:
the same status table as ``%monarch status``.

Non-goals: deciding what changed (dashfeed.py), the series (metricstore.py).
"""

from __future__ import annotations

import pathlib
import secrets
import threading
import time
from typing import Any

import anywidget
import traitlets

from .dashfeed import FLIGHT_RECORDS, Feed, FlightWatch, Throttle, flight_view
from .status import format_status  # one table for %monarch status and this

_STATIC = pathlib.Path(__file__).parent / "static"


class Dashboard(anywidget.AnyWidget):
    _esm = _STATIC / "dashboard.js"
    world_size = traitlets.Int(0).tag(sync=True)
    uid = traitlets.Unicode("").tag(sync=True)  # keys the views' shared data in the browser

    def __init__(self, mesh: Any, max_hz: float | None = None) -> None:
        super().__init__(world_size=mesh.world_size, uid=secrets.token_hex(8))
        self.mesh = mesh
        self.feed = Feed(mesh.metrics, mesh.status, lambda: mesh.events)
        self.throttle = Throttle(max_hz) if max_hz else Throttle()
        self.sent = 0  # messages pushed (tests, benchmarks)
        self.sent_points = 0
        self.flight_looks = 0  # times the recorders were read (tests)
        self.on_msg(self._on_front_end)
        self._lock = threading.Lock()  # one pusher at a time: thread or an idle kernel
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monarch-nb-dashboard", daemon=True)
        self._thread.start()
        self._flight_thread = threading.Thread(target=self._watch_flight,
                                               name="monarch-nb-flight", daemon=True)
        self._flight_thread.start()

    # -- pushing ------------------------------------------------------------------
    def push(self, now: float | None = None) -> dict[str, Any] | None:
        """Send what changed, if the throttle allows it now; returns the message."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self.throttle.take(now):
                return None
            msg = self.feed.next()
            if msg is not None:
                self.send(msg)
                self.sent += 1
                self.sent_points += sum(len(s[2]) for s in msg.get("series", ()))
            return msg

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.comm is None:
                return  # the widget was closed
            if not self.mesh.running:
                self.feed.state = "stopped"
                self.throttle.last = float("-inf")
                self.push()  # the last changes, tiles marked stopped
                self.send({"t": "delta", "state": "stopped"})
                return
            self._stop.wait(max(self.throttle.wait(time.monotonic()), 0.02))
            try:
                self.push()
            except Exception:  # a kernel shutting down: stop quietly
                if self.comm is None:
                    return
                raise

    def _watch_flight(self) -> None:
        """The badge and the straggler marks (see the module docstring)."""
        watch = FlightWatch()
        while not self._stop.wait(0.25):
            mesh = self.mesh
            if self.comm is None or not mesh.running:
                return
            try:
                busy = any(row["state"] == "busy" for row in mesh.status())
                if not watch.due(time.monotonic(), busy):
                    continue
                report = mesh.collectives(timeout=1.0, records=FLIGHT_RECORDS)
                pace = mesh.stragglers(report=report)
            except Exception:  # the mesh stopping meanwhile: look again (or leave)
                continue
            self.feed.flight = flight_view(report, pace)
            self.flight_looks += 1

    def _on_front_end(self, widget: Any, content: Any, buffers: Any) -> None:
        if isinstance(content, dict) and content.get("t") == "hello":
            self.feed.want_snapshot = True
            if not self._thread.is_alive():  # mesh stopped: answer from here
                self.throttle.last = float("-inf")
                self.push()

    def close(self) -> None:
        self._stop.set()
        super().close()

    # -- text fallback ---------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = super()._repr_mimebundle_(**kwargs)
        text = self.text()
        if isinstance(bundle, tuple):
            bundle[0]["text/plain"] = text
        elif isinstance(bundle, dict):
            bundle["text/plain"] = text
        return bundle

    def text(self) -> str:
        return format_status(self.mesh)

    def __repr__(self) -> str:
        return self.text()


_dashboards: dict[int, Dashboard] = {}


def dashboard_for(mesh: Any) -> Dashboard:
    """The mesh's dashboard, created on first use (one per mesh: every
    display of it is a view of the same data)."""
    for key, old in list(_dashboards.items()):  # forget stopped meshes' boards
        if not old.mesh.running and old.mesh is not mesh:
            del _dashboards[key]
    board = _dashboards.get(id(mesh))
    if board is None or board.mesh is not mesh or board.comm is None:
        board = _dashboards[id(mesh)] = Dashboard(mesh)
    return board


__all__ = ["Dashboard", "dashboard_for"]
