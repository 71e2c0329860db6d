"""The controller's copy of every rank's ``mnb.log`` series.

:class:`MetricsStore` keeps, per rank and metric, a bounded series ordered
by step, the last value of each metric, and the rate of steps per second.
Every accepted point (and every cut, see below) also goes to an append-only
*change log* with a sequence number, so a view asks for "what changed since
cursor N" and gets only the new points (the dashboard's delta updates).

Ordering rules, applied identically by the dashboard's JavaScript:

* a point whose step is above the series' last step is appended; an equal
  step replaces the value; a lower step is inserted in order;
* the first point of a new incarnation (a respawned rank) whose step is not
  above the series' last step *cuts* the series from that step on: training
  resumed from a checkpoint, and the old future is gone.

Bounds: a series past ``max_points`` drops every other point of its older
half (the curve keeps its shape, resolution thins with age); the change log
keeps the newest ``max_log`` entries, and a view whose cursor fell behind
gets a full snapshot instead.

Thread-safety: points are added on the controller's I/O thread (or the
thread leading it); views read from their own thread. One lock guards
everything; no work under it but list appends.

Non-goals: the wire format (metrics.py), display (dashboard.py).
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

MAX_POINTS = 4096  # per rank and metric
MAX_LOG = 500_000  # change-log entries kept for views that fall behind
RATE_WINDOW_S = 10.0  # steps/s is measured over this much recent time

# change-log entry: (rank, metric, step, value, cut)
Change = tuple[int, str, int, float, bool]


@dataclass
class Series:
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, step: int, value: float) -> None:
        steps = self.steps
        if not steps or step > steps[-1]:
            steps.append(step)
            self.values.append(value)
            return
        i = bisect.bisect_left(steps, step)
        if i < len(steps) and steps[i] == step:
            self.values[i] = value
        else:
            steps.insert(i, step)
            self.values.insert(i, value)

    def cut(self, step: int) -> None:
        i = bisect.bisect_left(self.steps, step)
        del self.steps[i:], self.values[i:]

    def thin(self, max_points: int) -> None:
        if len(self.steps) <= max_points:
            return
        half = len(self.steps) // 2
        self.steps[:half] = self.steps[:half:2]
        self.values[:half] = self.values[:half:2]


class MetricsStore:
    def __init__(self, world_size: int, max_points: int = MAX_POINTS,
                 max_log: int = MAX_LOG) -> None:
        self.world_size = world_size
        self.max_points = max_points
        self.max_log = max_log
        self._lock = threading.Lock()
        self._series: dict[tuple[int, str], Series] = {}
        self.names: dict[str, None] = {}  # metric names in order of appearance
        self._last: list[dict[str, float]] = [{} for _ in range(world_size)]
        self._last_step: list[int | None] = [None] * world_size
        self._incarnation: list[int] = [0] * world_size
        self._fresh: list[set[str]] = [set() for _ in range(world_size)]  # new incarnation, not yet seen
        self._rate: list[collections.deque[tuple[float, int]]] = [
            collections.deque(maxlen=256) for _ in range(world_size)]
        self._log: list[Change] = []
        self._log_start = 0  # sequence number of _log[0]
        self.points = 0  # accepted in total

    # -- writing (I/O thread) -------------------------------------------------------
    def add(self, rank: int, incarnation: int, points: list[tuple[int, float, dict[str, float]]],
            now: float | None = None) -> None:
        """Points from one METRICS batch of ``rank`` (in the order logged)."""
        if not points or not 0 <= rank < self.world_size:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            if incarnation > self._incarnation[rank]:
                self._incarnation[rank] = incarnation
                self._fresh[rank] = {name for (r, name) in self._series if r == rank}
                self._rate[rank].clear()
            elif incarnation < self._incarnation[rank]:
                return  # a straggler of a replaced process
            log, last, fresh = self._log, self._last[rank], self._fresh[rank]
            top = self._last_step[rank]
            for step, _t, metrics in points:
                for name, value in metrics.items():
                    key = (rank, name)
                    series = self._series.get(key)
                    if series is None:
                        series = self._series[key] = Series()
                        self.names.setdefault(name, None)
                    if fresh and name in fresh:
                        fresh.discard(name)
                        if series.steps and step <= series.steps[-1]:
                            series.cut(step)
                            log.append((rank, name, step, 0.0, True))
                    series.add(step, value)
                    if len(series.steps) > self.max_points:
                        series.thin(self.max_points)
                    last[name] = value
                    log.append((rank, name, step, value, False))
                    self.points += 1
                top = step if top is None else max(top, step)
            self._last_step[rank] = top
            if top is not None:
                self._rate[rank].append((now, top))
            if len(log) > 2 * self.max_log:
                drop = len(log) - self.max_log
                del log[:drop]
                self._log_start += drop

    # -- reading (any thread) ------------------------------------------------------------
    @property
    def cursor(self) -> int:
        """The sequence number after the newest change."""
        with self._lock:
            return self._log_start + len(self._log)

    def since(self, cursor: int) -> tuple[int, list[Change]] | None:
        """Changes after ``cursor`` and the new cursor; None if the cursor is
        older than the kept log (take a :meth:`snapshot` instead)."""
        with self._lock:
            end = self._log_start + len(self._log)
            if cursor < self._log_start:
                return None
            return end, self._log[cursor - self._log_start:]

    def snapshot(self, max_points: int | None = None) -> tuple[int, dict[tuple[int, str], tuple[list[int], list[float]]]]:
        """Every series (thinned to ``max_points``, newest points kept
        exactly) and the cursor they are current to."""
        with self._lock:
            out = {}
            for key, s in self._series.items():
                steps, values = s.steps, s.values
                if max_points and len(steps) > max_points:
                    stride = math.ceil(len(steps) / max_points)
                    keep = range((len(steps) - 1) % stride, len(steps), stride)  # ends on the newest
                    steps, values = [steps[i] for i in keep], [values[i] for i in keep]
                out[key] = (list(steps), list(values))
            return self._log_start + len(self._log), out

    def series(self, rank: int, name: str) -> tuple[list[int], list[float]]:
        with self._lock:
            s = self._series.get((rank, name))
            return (list(s.steps), list(s.values)) if s else ([], [])

    def last(self, rank: int) -> dict[str, float]:
        with self._lock:
            return dict(self._last[rank])

    def last_step(self, rank: int) -> int | None:
        """The highest step ``rank`` logged (None before its first point)."""
        with self._lock:
            return self._last_step[rank]

    def step_marks(self, rank: int) -> list[tuple[float, int]]:
        """(wall-clock time, newest step) of ``rank``'s recent METRICS batches
        (the last 256; a batch holds up to 0.2 s of steps): mesh.trace() marks them."""
        offset = time.time() - time.monotonic()
        with self._lock:
            return [(t + offset, s) for t, s in self._rate[rank]]

    def steps_per_s(self, rank: int, now: float | None = None) -> float | None:
        """Steps per second over the last ``RATE_WINDOW_S`` (None before two
        batches arrived; 0 once the rank stopped logging)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            rate = self._rate[rank]
            if not rate:
                return None
            if now - rate[-1][0] > RATE_WINDOW_S:
                return 0.0
            first = next((p for p in rate if now - p[0] <= RATE_WINDOW_S), rate[-1])
            t0, s0 = first
            t1, s1 = rate[-1]
            if t1 - t0 <= 0:
                return None
            return (s1 - s0) / (t1 - t0)


def health_fields(health: dict[str, Any]) -> dict[str, Any]:
    """A rank's heartbeat health as status-row fields (None = n/a)."""
    def get(key: str) -> Any:
        value = health.get(key)
        return value if isinstance(value, (int, float)) else None

    return {"cpu": get("cpu"), "rss": get("rss"), "gpu_mem": get("mem"),
            "gpu_mem_total": get("mem_total"), "gpu_mem_peak": get("mem_peak"),
            "gpu_util": get("util"), "gpu_temp": get("temp"), "gpu_power": get("power")}


__all__ = ["MetricsStore", "Series", "health_fields"]
