"""A kept mesh's rank: what it holds for the next controller.

A kept mesh (``Mesh.start(name=..., keep_alive=...)``) outlives its
controller: its ranks belong to their host's agent, and a new controller
attaches later (controller/keep.py). While no controller listens, a rank
goes on with the call it runs; what it would have sent is kept here, bounded,
and handed to the controller that attaches:

* the RESULT of every call until the controller says it is done with it
  (each PING of a kept mesh carries ``low``, the oldest call it still
  waits for, and ``done``, the newer ones it has finished): the newest
  :data:`MAX_RESULTS` calls, at most :data:`MAX_RESULT_BYTES` in all (an
  older or larger result is let go, and the controller says so);
* while detached (no PING for :data:`DETACHED_AFTER_S`), the OUTPUT chunks
  it would have sent, the newest :data:`MAX_OUTBOX_BYTES`;
* every ``mnb.log`` point it sent, the newest :data:`MAX_POINTS`
  (engine/metrics.py keeps them), so the dashboard shows the whole curve.

A new controller has a new *epoch*; the first PING of a new epoch makes the
rank say HELLO with what it runs and what it kept; the controller adopts
those calls, then asks (``resend``) and the rank sends them on its control
channel, signed as always. Everything here is the control thread's but
:meth:`Keeper.keep`, which the main thread calls after a call (a dict
store under a lock).

Non-goals: sockets (loop.py), deciding what the controller adopts
(controller/keep.py).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any

DETACHED_AFTER_S = 2.0  # no PING this long (4 intervals): nobody listens
MAX_RESULTS = 32
MAX_RESULT_BYTES = 256 << 20
MAX_OUTBOX_BYTES = 16 << 20
MAX_POINTS = 200_000


def _size(payload: list[Any]) -> int:
    return sum(memoryview(p).nbytes for p in payload)


@dataclass
class Keeper:
    """One rank's kept results and detached outbox (see the module docstring)."""

    epoch: int  # the epoch of the controller that started this process
    results: collections.OrderedDict[int, tuple[dict[str, Any], list[Any]]] = field(
        default_factory=collections.OrderedDict)
    outbox: collections.deque[tuple[int, dict[str, Any], list[Any]]] = field(
        default_factory=collections.deque)
    outbox_bytes: int = 0
    resent_epoch: int = -1  # the epoch whose controller got what was kept
    running_what: str = ""  # the running call's cell name or function (for a new controller)
    _what: dict[int, str] = field(default_factory=dict)  # a kept result's call: the same
    _bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- the main thread -----------------------------------------------------------
    def keep(self, call: int, meta: dict[str, Any], payload: list[Any], what: str = "") -> None:
        """The RESULT of ``call`` as sent; kept until the controller is done with it."""
        size = _size(payload)
        if size > MAX_RESULT_BYTES:
            return  # too large to keep: a controller that attaches sees it as lost
        with self._lock:
            self.results[call] = (meta, payload)
            self._what[call] = what
            self._bytes += size
            while len(self.results) > MAX_RESULTS or self._bytes > MAX_RESULT_BYTES:
                gone, (_, old) = self.results.popitem(last=False)
                self._what.pop(gone, None)
                self._bytes -= _size(old)

    # -- the control thread --------------------------------------------------------------
    def done_with(self, low: int, done: list[Any]) -> None:
        """The controller finished every call below ``low`` and those in ``done``."""
        if not self.results:
            return
        gone = set(done)
        with self._lock:
            for call in [c for c in self.results if c < low or c in gone]:
                _, payload = self.results.pop(call)
                self._what.pop(call, None)
                self._bytes -= _size(payload)

    def kept_calls(self) -> list[int]:
        with self._lock:
            return list(self.results)

    def labels(self, running: int) -> dict[str, str]:
        """What each kept call (and the running one) was: a cell's name or a
        function's, by call id (JSON keys are strings)."""
        with self._lock:
            out = {str(c): w for c, w in self._what.items() if w}
        if running and self.running_what:
            out[str(running)] = self.running_what
        return out

    def take_results(self) -> list[tuple[int, dict[str, Any], list[Any]]]:
        """What was kept, to send again (left kept until the controller acks).
        The counts of chunks sent before are left out: some went to the
        controller that died, and the new one must not wait for them."""
        with self._lock:
            items = list(self.results.items())
        return [(call, {k: v for k, v in meta.items() if k not in ("n_out", "n_m")}, payload)
                for call, (meta, payload) in items]

    def hold_output(self, call: int, meta: dict[str, Any], payload: list[Any]) -> None:
        """An OUTPUT chunk while detached: kept (the newest ``MAX_OUTBOX_BYTES``)."""
        self.outbox.append((call, meta, payload))
        self.outbox_bytes += _size(payload)
        while self.outbox_bytes > MAX_OUTBOX_BYTES and self.outbox:
            _, _, old = self.outbox.popleft()
            self.outbox_bytes -= _size(old)

    def take_outbox(self) -> list[tuple[int, dict[str, Any], list[Any]]]:
        items = list(self.outbox)
        self.outbox.clear()
        self.outbox_bytes = 0
        return items


def detached(now: float, last_ping: float) -> bool:
    """No controller has pinged for a while: what would be sent is kept."""
    return now - last_ping > DETACHED_AFTER_S


__all__ = ["DETACHED_AFTER_S", "Keeper", "MAX_OUTBOX_BYTES", "MAX_POINTS", "MAX_RESULTS",
           "MAX_RESULT_BYTES", "detached"]
