"""Rank side of ``mnb.log(step=None, **metrics)``: a lock-free buffer that the
worker's control thread drains and ships as METRICS batches.

The caller's thread (the rank's main thread, running user code) only appends
one tuple to a deque: no lock, no I/O, no JSON (a few microseconds, see
benchmarks/metrics.py). The control thread takes what is queued every
~20 ms while a call runs and sends it (payload: one JSON frame
``[[step, t, {name: value}], ...]``: data, never pickle). At the end of a
call the main thread takes the rest itself and sends it before the RESULT,
and the RESULT counts the batches the control thread sent during the call,
so the controller holds the result until every point of the call is in.

Each point is stamped with the time its batch was taken (within 0.2 s of
the call): no clock read on the caller's thread.

Steps: ``step=None`` means "the previous step + 1" (0 for the first call of
this process); log every metric of one step in one call. Values must be real
numbers (a 0-d tensor is converted with ``float()`` at once, which waits for
the device on GPUs: pass ``loss.item()`` where you already sync).

Outside a rank (a launched script whose launcher did not start the control
thread, or plain Python), ``mnb.log`` never fails: points are kept in the
bounded buffer (the newest ``MAX_BUFFERED``) until something drains it.

Non-goals: sockets (loop.py), the frame format (wire/metricframes.py), the
controller's series (controller/metricstore.py).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from ..errors import UsageError
from ..wire.metricframes import Point

MAX_BUFFERED = 200_000  # points kept while nobody drains (oldest dropped)
# Points per batch (the control thread sends one every 0.2 s): a loop that logs
# faster than 5,000 steps a second per rank is thinned to every k-th step (the
# newest always kept, ``thinned`` counts the rest), so a runaway log loop cannot
# swamp the controller's I/O loop and starve heartbeats. No chart shows more.
MAX_BATCH = 1000



class MetricsBuffer:
    """Points waiting to be sent, attributed to the running call.

    ``log`` runs on any thread without a lock (deque appends are atomic);
    ``take``/``begin``/``finish`` share a small lock so that the number of
    batches sent for a call is exact when its RESULT is built.
    """

    def __init__(self, maxlen: int = MAX_BUFFERED) -> None:
        # (step, values): no clock read on the caller's thread (a cold clock
        # read is ~1 µs here); points are stamped when taken, within 0.2 s
        self._q: collections.deque[tuple[int, dict[str, float]]] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self._next_step = 0
        self.call = 0
        self.batches = 0  # batches the control thread took for ``call``
        self.thinned = 0  # points left out of over-full batches (see MAX_BATCH)
        # set by the first log(): until then a call skips begin/finish (the
        # worker's no-op path does not pay for a feature it does not use)
        self.used = False
        # a kept mesh's rank keeps every point it sent (the newest ``KEPT``),
        # for the controller that attaches next (engine/kept.py)
        self.history: collections.deque[Point] | None = None

    def log(self, step: int | None, metrics: dict[str, Any]) -> None:
        if step is None:
            step = self._next_step
        elif type(step) is not int:
            step = _as_step(step)
        self._next_step = step + 1
        for name, value in metrics.items():
            if type(value) is not float:
                metrics[name] = _as_float(name, value)
        self.used = True
        self._q.append((step, metrics))

    @property
    def pending(self) -> bool:
        return bool(self._q)

    def _drain(self) -> list[Point]:
        q = self._q
        # popleft, not list()+clear(): an append between the two would be lost
        raw = [q.popleft() for _ in range(len(q))]
        if len(raw) > MAX_BATCH:
            stride = -(-len(raw) // MAX_BATCH)
            kept = raw[(len(raw) - 1) % stride::stride]  # ends on the newest
            self.thinned += len(raw) - len(kept)
            raw = kept
        now = time.time()
        points = [(step, now, values) for step, values in raw]
        if self.history is not None:
            self.history.extend(points)
        return points

    def take(self) -> tuple[int, int, list[Point]] | None:
        """For the control thread: ``(call, batch number, points)``, or None.
        The batch number is -1 for points logged outside a call."""
        with self._lock:
            if not self._q:
                return None
            points = self._drain()
            n = -1
            if self.call:
                n, self.batches = self.batches, self.batches + 1
            return self.call, n, points

    def begin(self, call: int) -> list[Point]:
        """A call starts; returns points logged between calls (sent uncounted)."""
        with self._lock:
            self.call, self.batches = call, 0
            return self._drain() if self._q else []

    def finish(self) -> tuple[int, list[Point]]:
        """The call ended: ``(batches the control thread sent, the rest)``."""
        with self._lock:
            rest = self._drain() if self._q else []
            n, self.call, self.batches = self.batches, 0, 0
            return n, rest


def _as_step(step: Any) -> int:
    try:
        if isinstance(step, bool) or int(step) != step:
            raise ValueError
        return int(step)
    except (TypeError, ValueError):
        raise UsageError(f"mnb.log(step=...) needs a whole number, got {step!r}") from None


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise UsageError(f"mnb.log({name}=...) needs a number, got {value!r}")
    try:
        return float(value)  # ints, numpy scalars, 0-d tensors
    except (TypeError, ValueError):
        raise UsageError(f"mnb.log({name}=...) needs a number (or a one-element tensor), "
                         f"got {type(value).__name__}") from None


_buffer = MetricsBuffer()


def log(step: int | None = None, **metrics: Any) -> None:
    """Record metrics for the live dashboard: ``mnb.log(loss=0.3, lr=1e-3)``.

    Non-blocking (a deque append); sent several times a second and at the
    end of the call. ``step`` defaults to the previous step + 1.
    """
    # MetricsBuffer.log inlined: one Python frame less on the hot path
    if not metrics:
        raise UsageError("mnb.log() needs at least one metric, e.g. mnb.log(loss=0.3)")
    buf = _buffer
    if step is None:
        step = buf._next_step
    elif type(step) is not int:
        step = _as_step(step)
    buf._next_step = step + 1
    for name, value in metrics.items():
        if type(value) is not float:
            metrics[name] = _as_float(name, value)
    buf.used = True
    buf._q.append((step, metrics))


def buffer() -> MetricsBuffer:
    """The process's buffer (the worker drains it)."""
    return _buffer


__all__ = ["MetricsBuffer", "log", "buffer"]
