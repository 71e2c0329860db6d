"""What the dashboard sends: messages built from controller state, throttled.

:class:`Feed` turns a :class:`~monarch_nb.metricstore.MetricsStore`, the
mesh's status rows and its event list into the dashboard's custom
messages; it keeps cursors so that each message carries only what changed:

* ``{"t": "snapshot", ...}``: everything (thinned series, every tile, the
  recent events), sent when a view asks (a fresh page) or fell behind;
* ``{"t": "delta", ...}``: new points (grouped per rank and metric), series
  cuts (a respawned rank that resumed from an earlier step), tiles whose
  figures changed, new events, the metric names when a new one appeared,
  ``flight`` when what the flight recorders say changed, and ``lost`` when
  the hosts lost with ranks on them changed.

``lost`` (:func:`~monarch_nb.ui.status.lost_hosts`): ``[{"host", "ranks",
"hint"}]``, the lines ``%monarch status`` prints, so the page words them
the same way and builds no text of its own. ``group``
(:func:`~monarch_nb.ui.status.group_line`): the torch group's size now when
it went on without lost ranks (``min_ranks``), else ""; each tile has its
``torch_rank`` (None: out of the group).

``flight`` (:func:`flight_view`) is the collectives badge and the straggler
marks: ``{"findings": [text, ...], "slow": {rank: ratio}}``, the texts those
of ``mesh.collectives()``. Left out: a rank that did not answer (its tile
shows it down already), and a collective that some ranks have waited in for
less than ``BADGE_WAIT_S``: while a rank is merely slower, the others
wait for it in every collective, a fraction of a second each time, and a
badge that blinked for each would be noise. The dashboard's watcher thread fills it in
(:class:`FlightWatch` says when it is due); the feed only sends it.

:class:`Throttle` spaces messages at least ``1 / max_hz`` apart. Both are
pure (no threads, no widgets, clock passed in) and tested without processes.

Non-goals: the widget and its thread (dashboard.py), the series (metricstore.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..controller.analysis.collectives import CollectiveReport, Finding, StragglerReport
from ..controller.metricstore import MetricsStore
from .status import group_line, lost_hosts

MAX_HZ = 10.0
SNAPSHOT_POINTS = 2000  # per series in a snapshot (the newest point always exact)
MAX_EVENTS = 200
# startup noise: a first incarnation starting and becoming ready is not news
_QUIET = {"started", "ready"}
# tile states that already show a rank down
_DOWN = {"dead", "waiting", "respawning", "failed", "lost", "stopped"}


class Throttle:
    def __init__(self, max_hz: float = MAX_HZ) -> None:
        self.interval = 1.0 / max_hz
        self.last = -math.inf

    def wait(self, now: float) -> float:
        """Seconds until the next message may go (0: now)."""
        return max(0.0, self.last + self.interval - now)

    def take(self, now: float) -> bool:
        """True (and the slot is used) if a message may go now."""
        if now - self.last < self.interval:
            return False
        self.last = now
        return True


def _num(value: Any) -> Any:
    """JSON-safe number: non-finite floats become None (a gap in the chart)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def fmt_value(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def tile(row: dict[str, Any]) -> dict[str, Any]:
    """A status row (``mesh.status()``) as the dashboard's tile: numbers
    (None = n/a), heartbeat age rounded so idle tiles do not change."""
    age = row.get("heartbeat_age")
    out = {k: _num(v) for k, v in row.items() if k not in ("heartbeat_age", "last", "steps_per_s")}
    out["hb"] = None if age is None else (0 if age < 1.5 else round(age))
    sps = row.get("steps_per_s")
    out["sps"] = None if sps is None else round(sps, 1)
    out["last"] = {k: fmt_value(v) for k, v in (row.get("last") or {}).items()}
    return out


def _event(e: dict[str, Any]) -> dict[str, Any]:
    return {"time": e["time"], "rank": e["rank"], "inc": e["incarnation"], "kind": e["kind"],
            "detail": e.get("detail", "")}


NO_FLIGHT: dict[str, Any] = {"findings": [], "slow": {}}
FLIGHT_EVERY_S = 2.0  # between two looks at the recorders while a call runs
FLIGHT_RECORDS = 400  # newest records read per rank each time (mesh.collectives reads all)
BADGE_WAIT_S = 5.0  # a collective waited in this long is shown (mismatches at once)
_WAITS = {"missing", "waiting", "p2p"}  # findings about a collective still in flight


def flight_view(report: CollectiveReport, pace: StragglerReport | None) -> dict[str, Any]:
    """What the badge and the tiles show of the recorders (see the module
    docstring); JSON-ready, rank keys as strings."""
    stuck = {f.group for f in report.findings
             if f.kind in _WAITS and _waited(report, f.group, f.seq, f.kind == "p2p") >= BADGE_WAIT_S}

    def shown(f: Finding) -> bool:
        if f.kind == "silent":
            return False
        if f.kind in _WAITS or f.kind == "diverged":  # (diverged comes with a wait)
            return f.group in stuck
        return True  # a mismatch: at once

    findings = [f.text for f in report.findings if shown(f)]
    slow = {} if pace is None else {str(r): round(pace.ranks[r].ratio, 1) for r in pace.slow}
    return {"findings": findings, "slow": slow}


def _waited(report: CollectiveReport, group: str, seq: int | None, p2p: bool) -> float:
    """How long ago the first rank to reach collective ``seq`` of ``group``
    called it (by its own clock when it answered): in it still, or past it
    with the op enqueued (NCCL, RCCL). Records of an earlier generation
    (numbers start again at each re-formation) and finished p2p ops
    (numbered per peer) are not that collective."""
    waited = 0.0
    for tail in report.tails.values():
        for rec in tail.ops:
            if rec.group == group and rec.seq == seq and rec.p2p == p2p \
                    and rec.generation == tail.generation and (rec.t1 is None or not p2p):
                waited = max(waited, tail.now - rec.t0)
    return waited


class FlightWatch:
    """When the dashboard looks at the recorders again: every
    ``FLIGHT_EVERY_S`` while a call runs on some rank, and once more after
    the last call ended (its final state stays on the badge: a finished
    desync, a straggler). Idle meshes are not asked. Pure (clock passed in)."""

    def __init__(self, every: float = FLIGHT_EVERY_S) -> None:
        self.every = every
        self.last = -math.inf
        self.pending = False  # a call ran since the last look

    def due(self, now: float, busy: bool) -> bool:
        if busy:
            self.pending = True
        if not self.pending or now - self.last < self.every:
            return False
        self.last = now
        self.pending = busy
        return True


def _news(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_event(e) for e in events if not (e["kind"] in _QUIET and e["incarnation"] == 0)]


class Feed:
    def __init__(self, store: MetricsStore, rows: Callable[[], list[dict[str, Any]]],
                 events: Callable[[], list[dict[str, Any]]]) -> None:
        self.store = store
        self.rows = rows
        self.events = events
        self.cursor = 0
        self.want_snapshot = True
        self._tiles: dict[int, dict[str, Any]] = {}
        self._events_seen = 0
        self._names = 0
        self.state = "running"
        self.flight: dict[str, Any] = NO_FLIGHT  # set by the dashboard's watcher thread
        self._flight_sent: dict[str, Any] = NO_FLIGHT
        self._lost_sent: list[dict[str, str]] = []
        self._group_sent = ""

    def _tiles_now(self) -> list[dict[str, Any]]:
        tiles = [tile(r) for r in self.rows()]
        if self.state == "stopped":  # ranks stopped with the mesh are not deaths
            for t in tiles:
                t["state"] = "stopped"
        return tiles

    def next(self) -> dict[str, Any] | None:
        """The next message, or None when nothing changed."""
        if self.want_snapshot:
            return self.snapshot()
        got = self.store.since(self.cursor)
        if got is None:  # fell behind the store's change log
            return self.snapshot()
        self.cursor, changes = got
        msg: dict[str, Any] = {"t": "delta"}
        if changes:
            series: dict[tuple[int, str], list[list[Any]]] = {}
            cuts = []
            for rank, name, step, value, cut in changes:
                if cut:
                    cuts.append([rank, name, step])
                    continue
                entry = series.get((rank, name))
                if entry is None:
                    entry = series[(rank, name)] = [[], []]
                entry[0].append(step)
                entry[1].append(_num(value))
            msg["series"] = [[r, n, s, v] for (r, n), (s, v) in series.items()]
            if cuts:
                msg["cuts"] = cuts
        events = self.events()
        news = []
        if len(events) > self._events_seen:
            news = _news(events[self._events_seen:])
            self._events_seen = len(events)
            if news:
                msg["events"] = news
        # A rank that died and came back between two messages (a spare
        # takes over within milliseconds) would never show red: this message
        # shows it dead, the next one shows it as it is now.
        died = {e["rank"] for e in news if e["kind"] in ("died", "replaced")}
        tiles = []
        for t in self._tiles_now():
            rank = t["rank"]
            if rank in died and t["state"] not in _DOWN:
                sent = self._tiles.get(rank)
                if sent is None or sent["state"] not in _DOWN:
                    t = {**t, "state": "dead"}
            if self._tiles.get(rank) != t:
                self._tiles[rank] = t
                tiles.append(t)
        if tiles:
            msg["tiles"] = tiles
        names = list(self.store.names)
        if len(names) != self._names:
            self._names = len(names)
            msg["names"] = names
        flight = self.flight
        if flight != self._flight_sent:
            self._flight_sent = flight
            msg["flight"] = flight
        lost = lost_hosts(list(self._tiles.values()))
        if lost != self._lost_sent:
            self._lost_sent = msg["lost"] = lost
        group = group_line(list(self._tiles.values()))
        if group != self._group_sent:
            self._group_sent = msg["group"] = group
        return msg if len(msg) > 1 else None

    def snapshot(self) -> dict[str, Any]:
        self.want_snapshot = False
        self.cursor, everything = self.store.snapshot(SNAPSHOT_POINTS)
        rows = self._tiles_now()
        self._tiles = {t["rank"]: t for t in rows}
        events = self.events()
        self._events_seen = len(events)
        names = list(self.store.names)
        self._names = len(names)
        self._flight_sent = flight = self.flight
        self._lost_sent = lost = lost_hosts(rows)
        self._group_sent = group = group_line(rows)
        return {
            "t": "snapshot", "world": self.store.world_size, "state": self.state,
            "series": [[r, n, s, [_num(x) for x in v]] for (r, n), (s, v) in everything.items()],
            "tiles": rows, "events": _news(events)[-MAX_EVENTS:], "names": names,
            "flight": flight, "lost": lost, "group": group,
        }


def count_points(msg: dict[str, Any]) -> int:
    """Points carried by a message (benchmarks, tests)."""
    return sum(len(s) for _r, _n, s, _v in msg.get("series", ()))


__all__ = ["Feed", "Throttle", "FlightWatch", "flight_view", "tile", "fmt_value", "count_points",
           "MAX_HZ"]
