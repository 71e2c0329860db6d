"""Fault injection, as a product feature: the same helpers serve the tests,
the demos, and users checking that their own training code survives.

Rank side (inside ``%%monarch`` cells or functions run on the mesh)::

    from monarch_nb import chaos
    chaos.die("sigkill")                    # now: sigkill | exit | segfault | sigstop
    chaos.die_at(step, 25, rank=1)          # in a loop: rank 1 dies at step 25
    chaos.die_later(0.2, "sigkill")         # from a timer thread: lands mid-collective
                                            # or mid-message, wherever the main thread is
    chaos.fail_after_respawn()              # in a --setup cell: raises during replay
    chaos.Random(seed=0, rate=0.01).maybe_die(rank=mnb.rank())

Controller side: ``mesh.kill(rank, signal=...)`` / ``%monarch kill`` (idle or
mid-cell, from another cell with ``--no-block``).

Non-goals: deciding what happens after a fault (that is the supervisor's job).
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import threading

from .engine import context as _context

HOW = ("sigkill", "exit", "segfault", "sigstop")


def die(how: str = "sigkill", code: int = 13) -> None:
    """End (or freeze) this rank's process at once.

    ``sigkill``: SIGKILL to itself. ``exit``: ``os._exit(code)``, no cleanup.
    ``segfault``: a real invalid memory read in C. ``sigstop``: freeze, so
    only missing heartbeats can tell.
    """
    if how not in HOW:
        raise ValueError(f"unknown fault {how!r}; use one of {', '.join(HOW)}")
    for stream in ("stdout", "stderr"):  # let the last words reach the log
        try:
            getattr(__import__("sys"), stream).flush()
        except Exception:
            pass
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(code)
    elif how == "segfault":
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    else:
        os.kill(os.getpid(), signal.SIGSTOP)


def die_at(step: int, at: int, rank: int | None = None, how: str = "sigkill",
           incarnation: int | None = 0) -> None:
    """Die when ``step == at`` on ``rank`` (every rank if None) — only in
    incarnation ``incarnation`` (any if None), so that a loop that is run
    again from the start does not kill the respawned process at the same step.
    (Call it after ``state.commit()``: an elastic loop resumes *after* the
    committed step, so the same kill does not fire twice.)"""
    if step != at or (incarnation is not None and _context.incarnation() != incarnation):
        return
    if rank is not None and _context.rank() != rank:
        return
    die(how)


def die_later(seconds: float, how: str = "sigkill") -> threading.Timer:
    """Die ``seconds`` from now, whatever the main thread is doing then (in a
    collective, sending a result...)."""
    timer = threading.Timer(seconds, die, args=(how,))
    timer.daemon = True
    timer.start()
    return timer


def fail_after_respawn(message: str = "chaos: setup replay fails on a respawned rank") -> None:
    """Raise in a respawned process (incarnation > 0): put it in a ``--setup``
    cell to exercise a failing setup replay."""
    if _context.incarnation() > 0:
        raise RuntimeError(message)


class Random:
    """Faults at random points, reproducible from a seed."""

    def __init__(self, seed: int = 0, rate: float = 0.01, how: tuple[str, ...] = ("sigkill",)) -> None:
        self.rng = random.Random(seed)
        self.rate = rate
        self.how = how

    def maybe_die(self, rank: int | None = None) -> None:
        """Call once per step: dies with probability ``rate`` (only on
        ``rank`` if given; the draw happens on every rank so that every rank's
        sequence stays the same)."""
        hit = self.rng.random() < self.rate
        how = self.rng.choice(self.how)
        if hit and (rank is None or _context.rank() == rank):
            die(how)
