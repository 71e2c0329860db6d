"""A kept mesh, the controller's side: what outlives this controller, and
what a new controller takes over at attach.

A kept mesh (``Mesh.start(name=..., keep_alive=...)``) has its ranks started
by this machine's host agent (procs/keptagent.py), which outlives the
kernel. This part owns the controller's end of that:

* the **epoch**: each controller of a kept mesh has its own (milliseconds
  since 1970 when it started, so later controllers have larger ones). It
  signs as ``controller.<epoch>`` (the ranks keep a replay window per
  sender: a new controller's numbers start again), its call ids start at
  ``epoch << 32`` (above every earlier controller's), and its PINGs carry
  it: a rank that sees a new epoch says HELLO with the call it runs and the
  results it kept (engine/kept.py);
* the **lease ledger** on every PING: ``low`` and ``done``, the calls this
  controller has finished, so ranks let go of their kept results;
* the **state** a new controller needs, sent to the agent whenever it
  changes (``keep``): the ``--setup`` cells, the events, the generation,
  the restart budgets (each rank's death times);
* at attach, the **adoption**: once every live rank said HELLO (or
  :data:`HELLO_WAIT_S` passed), each call a rank runs or kept a result of
  becomes a call of this controller (:meth:`adopt`), whose futures
  ``mesh.pending()`` returns; then the ranks are asked to ``resend``.

Runs on the thread that leads the I/O loop, like every handler, except
:meth:`wait_hellos` (the attaching thread waits there).

Non-goals: the agent (procs/keptagent.py), the files (procs/keptfiles.py),
the rank's side (engine/kept.py).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..futures import MeshFuture
from .calls.calltable import CallTable
from .calls.output import CallOutput
from .life.policy import RestartPolicy
from .life.rankstates import RankState
from .life.ranktable import RankTable

HELLO_WAIT_S = 3.0  # at attach: live ranks that have not said HELLO by then are left out
# at attach: a live rank not heard this long after a PING is asked again (its
# socket or its agent's relay reconnects within ZeroMQ's 0.1 s reconnect interval)
HELLO_AGAIN_S = 0.1
RESEND_PINGS = 3  # pings that ask for what was kept (a rank answers the first it reads)
STATE_EVERY_S = 0.4  # (checked at each PING: a change is with the agent within ~0.5 s)
MAX_EVENTS_KEPT = 2000  # the newest events handed to the next controller


def describe(label: str) -> str:
    """A call as the user knows it: ``<mnb-cell-12>`` is the cell In [12]."""
    if label.startswith("<mnb-cell-exec-"):
        return f"mesh.exec call {label[len('<mnb-cell-exec-'):].rstrip('>')}"
    if label.startswith("<mnb-cell-") and label[len("<mnb-cell-"):].rstrip(">").isdigit():
        return f"cell In [{label[len('<mnb-cell-'):].rstrip('>')}]"
    return f"{label}()" if label else "a call"


def new_epoch() -> int:
    return int(time.time() * 1000) & 0x7FFFFFFF


class Keep:
    """The kept mesh's part of one controller (see the module docstring)."""

    def __init__(self, name: str, epoch: int, calls: CallTable, ranks: RankTable,
                 interrupt: Callable[[int], None], policy: RestartPolicy) -> None:
        self.name, self.epoch = name, epoch
        self.policy = policy
        self.calls, self.ranks, self._interrupt = calls, ranks, interrupt
        self.expect: set[int] = set()  # live ranks whose HELLO the attach waits for
        self.hellos: dict[int, dict[str, Any]] = {}
        # expect less hellos, kept as each HELLO comes: one set operation per
        # HELLO (comparing the whole sets on each was O(N) per HELLO, O(N^2)
        # for an attach: 1,024 ranks said HELLO several times each)
        self._unheard: set[int] = set()
        self.adopted: list[MeshFuture] = []
        self.adopted_what: dict[int, str] = {}  # call id -> what the ranks said it is
        # what the adopted calls printed, kept for whoever waits for them
        # (%monarch wait shows it; the cell that was running is gone)
        self.outputs: dict[int, list[tuple[str, str]]] = {}
        self._resend = 0
        self._heard_all = threading.Event()
        self._state_sent: tuple[int, ...] | None = None
        self._state_at = 0.0
        self.taken = ""  # "taken over by pid P on H": another controller holds the mesh
        # this process is ending (a kernel restart): the ranks keep every result
        # from now on, whoever receives it here, for the next controller
        self.leaving = False

    @property
    def first_call_id(self) -> int:
        return self.epoch << 32

    @property
    def sender(self) -> str:
        return f"controller.{self.epoch}"

    # -- every PING -----------------------------------------------------------------
    def ping_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"ep": self.epoch, "cp": os.getpid()}
        if not self.expect and not self.leaving:  # (before the adoption, or while
            # this process ends, nothing may be let go: the next controller takes it)
            low = self.calls.low()
            meta["low"] = low
            done = [c for c in self.calls.finished_ids if c >= low]
            if done:
                meta["done"] = done
        if self._resend > 0:
            self._resend -= 1
            meta["resend"] = True
        return meta

    # -- what the next controller needs ---------------------------------------------------
    def state_due(self, now: float) -> dict[str, Any] | None:
        """The state to hand the agent, when it changed (at most once a second)."""
        if now - self._state_at < STATE_EVERY_S:
            return None
        self._state_at = now
        budgets = self.policy.budgets()
        key = (len(self.calls.setup_cells), len(self.ranks.events), self.ranks.generation,
               sum(len(d) for d in budgets["deaths"]), len(self.ranks.group))
        if key == self._state_sent:
            return None
        self._state_sent = key
        state = {"setup": list(self.calls.setup_cells),
                 "events": [e.as_dict() for e in self.ranks.events[-MAX_EVENTS_KEPT:]],
                 "generation": self.ranks.generation, "budgets": budgets,
                 "group": list(self.ranks.group)}
        return json.loads(json.dumps(state, default=str))  # plain JSON, as it travels

    def restore(self, state: dict[str, Any]) -> None:
        """What an earlier controller kept (attach)."""
        setup = state.get("setup")
        if isinstance(setup, list):
            self.calls.setup_cells[:] = [c for c in setup if isinstance(c, dict) and "code" in c]
        events = state.get("events")
        if isinstance(events, list):
            self.ranks.restore_events(events)
        budgets = state.get("budgets")
        if isinstance(budgets, dict):
            self.policy.restore_budgets(budgets)
        generation = state.get("generation")
        group = state.get("group")
        members = (tuple(r for r in group if isinstance(r, int) and 0 <= r < len(self.ranks))
                   if isinstance(group, list) else None)  # a shrunk mesh stays shrunk
        if isinstance(generation, int) and generation > self.ranks.generation:
            self.ranks.reformed(generation, members or None)

    # -- attach -----------------------------------------------------------------------------
    def expecting(self, rank: int) -> None:
        """``rank`` runs: the attach waits for its HELLO."""
        self.expect.add(rank)
        if rank not in self.hellos:
            self._unheard.add(rank)
            self._heard_all.clear()
        elif not self._unheard:
            self._heard_all.set()

    def on_hello(self, rank: int, meta: dict[str, Any]) -> None:
        self.hellos[rank] = dict(meta)
        self._unheard.discard(rank)
        if not self._unheard:
            self._heard_all.set()

    def unheard(self) -> set[int]:
        """The live ranks that have not said HELLO yet."""
        return set(self._unheard)

    def hello_meta(self) -> dict[str, Any]:
        """A PING that asks for HELLO again, for the ranks not heard yet
        (the first PING of an epoch asks every rank; one whose agent was not
        back yet missed it). Only to them: asking all of them again made
        every rank answer each round of the attach's wait."""
        return {"ep": self.epoch, "cp": os.getpid(), "hi": True}

    def wait_hellos(self, timeout: float = HELLO_WAIT_S) -> set[int]:
        """Wait until every live rank said HELLO; the ranks that did not."""
        if not self.expect:
            return set()
        self._heard_all.wait(timeout)
        return self.unheard()

    def adopt(self, deaths: Mapping[int, tuple[int, str, BaseException]] | None = None) -> None:
        """Each call a rank runs or kept a result of becomes this
        controller's; the ranks are then asked to send what they kept.
        ``deaths``: rank -> (call id, its name, the error) of the ranks that
        died in a call while no controller was attached (recovery.py): the
        call is theirs too, and ends for them with that error."""
        by_call: dict[int, set[int]] = {}
        running: dict[int, set[int]] = {}
        labels: dict[int, str] = {}
        died: dict[int, dict[int, BaseException]] = {}
        for rank, (call_id, label, error) in (deaths or {}).items():
            by_call.setdefault(call_id, set()).add(rank)
            died.setdefault(call_id, {})[rank] = error
            if label:
                labels.setdefault(call_id, label)
        for rank, hello in self.hellos.items():
            what = hello.get("what")
            for key, label in (what.items() if isinstance(what, dict) else ()):
                if str(key).isdigit() and isinstance(label, str):
                    labels.setdefault(int(key), label)
            ids = {int(c) for c in hello.get("kept") or [] if isinstance(c, int)}
            now_running = int(hello.get("running") or 0)
            if now_running:
                ids.add(now_running)
                running.setdefault(now_running, set()).add(rank)
            for call_id in ids:
                by_call.setdefault(call_id, set()).add(rank)
        for call_id in sorted(by_call):
            ranks = tuple(sorted(by_call[call_id]))
            future = MeshFuture(call_id, ranks, self._interrupt)
            output = CallOutput(self._keeper(call_id))
            call = self.calls.new(call_id, ranks, output, future, frames=[], adopted=True,
                                  hang_timeout=None)
            self.calls.sent(call)
            busy = sorted(running.get(call_id, ()))
            self.ranks.move_many(busy, RankState.BUSY, only_from=RankState.READY)
            self.adopted.append(future)
            lost = died.get(call_id, {})
            alive = [r for r in ranks if r not in lost]
            where = ("running on ranks " if busy else "finished on ranks ") + ",".join(map(str, alive))
            if not alive:
                where = ""
            if lost:
                dead = "rank" + ("s " if len(lost) > 1 else " ") + ",".join(map(str, sorted(lost)))
                where += ("; " if where else "") + f"{dead} died in it"
            self.adopted_what[call_id] = f"{describe(labels.get(call_id, ''))}, {where}"
            if lost:  # (last: the call may end here, every other rank done)
                self.calls.abandon(call, set(lost), lost.__getitem__)
        self.expect.clear()
        self._unheard.clear()
        self._resend = RESEND_PINGS

    def _keeper(self, call_id: int) -> Callable[[str, str], None]:
        kept = self.outputs.setdefault(call_id, [])

        def emit(stream: str, text: str) -> None:
            kept.append((stream, text))

        return emit

    def pending(self) -> list[MeshFuture]:
        return list(self.adopted)

    def take_output(self, call_id: int) -> list[tuple[str, str]]:
        """What adopted call ``call_id`` printed so far (stream, text), once."""
        kept = self.outputs.get(call_id, [])
        taken = list(kept)
        del kept[:len(taken)]
        return taken


__all__ = ["HELLO_AGAIN_S", "HELLO_WAIT_S", "Keep", "new_epoch"]
