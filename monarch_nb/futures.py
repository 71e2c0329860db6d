"""The one future type: :class:`MeshFuture`.

A ``concurrent.futures.Future`` (so ``.result(timeout)``, ``.done()``,
``add_done_callback`` and ``asyncio.wrap_future`` all work) that also supports
``await`` directly and whose ``cancel()`` interrupts the ranks still running
the call. Futures are resolved by the controller's I/O thread.

Non-goals: waiting policy for timeouts (mesh.py decides what a timeout means).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator
from concurrent.futures import _base
from typing import Any

_DONE = (_base.CANCELLED, _base.CANCELLED_AND_NOTIFIED, _base.FINISHED)
_FINISHED = _base.FINISHED


class MeshFuture(concurrent.futures.Future):
    """Handle of a call running on some ranks.

    ``result(timeout)`` returns a :class:`~monarch_nb.mesh.RankResults` or
    raises :class:`~monarch_nb.errors.RankErrors`; it raises
    ``TimeoutError`` if the call is still running after ``timeout`` seconds
    (the call keeps running). ``cancel()`` interrupts the ranks; the future
    then ends cancelled.
    """

    def __init__(self, call_id: int, ranks: tuple[int, ...], interrupt: Callable[[int], None]) -> None:
        super().__init__()
        self.call_id = call_id
        self.ranks = ranks
        self._interrupt = interrupt

    def done(self) -> bool:
        # As Future.done, without taking the condition's lock: the state only
        # moves forward, and reading one attribute is atomic. The blocking
        # call path asks this several times per call.
        return self._state in _DONE

    def result(self, timeout: float | None = None) -> Any:
        # Lock-free once finished with a value, for the same reason as done();
        # everything else (waiting, errors, cancellation) is Future.result's.
        if self._state == _FINISHED and self._exception is None:
            return self._result
        return super().result(timeout)

    def cancel(self) -> bool:
        # Cancel first, interrupt after: the interrupted ranks answer fast, and
        # the I/O thread would otherwise finish the future with their
        # KeyboardInterrupt before this thread marks it cancelled.
        if not super().cancel():
            return False
        self._interrupt(self.call_id)
        return True

    def __await__(self) -> Generator[Any, None, Any]:
        return asyncio.wrap_future(self).__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<MeshFuture call {self.call_id} on ranks {list(self.ranks)}: {state}>"
