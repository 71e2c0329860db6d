"""The spawner: the one thread that starts every process of a mesh.

Linux delivers a child's parent-death signal (``PR_SET_PDEATHSIG``, which
every rank sets) when the *thread* that forked it exits, not the process.
Under ``IOLoop.leadership`` any thread that waits on a call runs the
controller's handlers, respawns included; a rank forked there would be
killed the moment that thread ends (a ``threading.Thread`` that called
``mesh.run``, say). So every fork (ranks, spares, ssh/srun launchers) is
handed to this thread, which lives exactly as long as the mesh.

Non-goals: what to start (supervisor.py), when (recovery.py).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

SPAWN_TIMEOUT_S = 60.0  # a fork+exec takes milliseconds; ssh/srun may take seconds


class Spawner:
    """Runs process-starting functions on one long-lived thread."""

    def __init__(self, name: str = "monarch-nb-spawner") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the spawner thread; its result (or exception) here."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        if not self._thread.is_alive():
            raise RuntimeError("the mesh's spawner thread has stopped")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((lambda: fn(*args), fut))
        return fut.result(SPAWN_TIMEOUT_S)

    def stop(self) -> None:
        """End the thread once the queued jobs ran (children it started are
        sent their parent-death signal then: call after they were stopped)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(SPAWN_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller
                fut.set_exception(exc)
