"""The call table: every call in flight, and the one place its fate changes.

A call is *issued* (recorded, waiting or sent), each target rank then
*completes* it (a result or its own error) or is *lost* to it (its process
died or was replaced: :meth:`CallTable.fail`); an ``--elastic`` call keeps a
lost rank and is *re-issued* on its new process instead, unless the rank is
not coming back. When no rank is left the call *finishes*: its future gets
a :class:`RankResults` or a :class:`RankErrors`, exactly once. Stopping the
mesh ends every call, sent or still waiting, with :class:`MeshNotRunning`.

Pure bookkeeping: no sockets, no processes, no clock of its own beyond
stamping progress; the controller sends what :meth:`issue` and
:meth:`reissue` return. Tested with scripted sequences (tests/test_calltable.py).
Runs on the thread that leads the I/O loop, like every handler.

Non-goals: sending (core.py, caller.py), deciding about deaths (policy.py).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from ...errors import (
    MembershipChanged,
    MeshNotRunning,
    RankErrors,
    RemoteError,
    is_peer_loss,
    quote_first_line,
)
from ...futures import MeshFuture
from ...results import RankResults
from ...wire.protocol import Message
from .output import CallOutput


@dataclass(slots=True)  # made for every call: slots make that and each access cheaper
class PendingCall:
    """One call in flight. Other modules read its fields and change them
    only through the methods below; the call table (this module) owns the
    rest of its life. tests/test_calltable.py checks that no other module
    assigns to, deletes or mutates a field of a call."""

    call_id: int
    ranks: tuple[int, ...]
    output: CallOutput
    future: MeshFuture
    remaining: set[int]
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)
    chunks_seen: dict[int, int] = field(default_factory=dict)
    held: dict[int, Message] = field(default_factory=dict)  # RESULT waiting for chunks
    setup: dict[str, Any] | None = None  # a --setup cell: recorded once it succeeded
    elastic: bool = False  # survive deaths: re-issued on the respawned rank
    frames: list[Any] = field(default_factory=list)  # kept for re-issue and deferral
    reissue: set[int] = field(default_factory=set)  # ranks waiting for their new process
    # an elastic call the group grows back during (a Grow): the ranks back,
    # which it takes once its members re-formed inside it (they wait for them
    # there); they do not hold it up: it may finish without them
    growing: set[int] = field(default_factory=set)
    regrouped: dict[int, int] = field(default_factory=dict)  # member -> generation it re-formed into, inside it
    hang_timeout: float | None = None  # print stacks after this long without progress
    hang_reported: bool = False  # ...once per call
    progress_at: float = field(default_factory=time.monotonic)  # output, result, prompt
    sent: bool = False  # False while it waits for ranks (or a re-formation)
    internal: bool = False  # a setup replay: not the user's call
    # begun by an earlier controller of a kept mesh (controller/keep.py): its
    # ranks' chunk counts include what went to that controller, so its
    # results are never held for chunks
    adopted: bool = False

    # -- what other parts may change ---------------------------------------------------
    def progressed(self, now: float) -> None:
        """Progress at ``now`` (output, a metric, a prompt, recovery): the
        hang watchdog counts from here."""
        self.progress_at = now

    def hang_seen(self) -> None:
        """Its hang was reported (once per call)."""
        self.hang_reported = True

    def chunk_seen(self, rank: int) -> int:
        """One more OUTPUT chunk or METRICS batch of ``rank`` arrived; how
        many so far."""
        seen = self.chunks_seen.get(rank, 0) + 1
        self.chunks_seen[rank] = seen
        return seen

    def hold(self, rank: int, result: Message) -> None:
        """Hold ``rank``'s RESULT until the chunks it announced arrived (the
        call cannot finish meanwhile)."""
        self.held[rank] = result

    def unhold(self, rank: int) -> Message | None:
        """``rank``'s held RESULT, no longer held."""
        return self.held.pop(rank, None)


class CallTable:
    """Calls in flight by id, the calls waiting to be sent, and the
    recorded ``--setup`` cells."""

    def __init__(self, first_id: int = 1) -> None:
        self._calls: dict[int, PendingCall] = {}
        # a kept mesh's controller numbers its calls after its epoch, above
        # every earlier controller's (controller/keep.py)
        self._ids = itertools.count(first_id)
        self._last_id = first_id - 1  # (written after each id: at most one behind, which is safe)
        self.finished_ids: collections.deque[int] = collections.deque(maxlen=64)
        self.waiting: list[PendingCall] = []  # issued, not sent yet (in issue order)
        self.setup_cells: list[dict[str, Any]] = []  # replayed on every new process
        # hooks, set by the controller: ranks are done with a call (their
        # debugger sessions are over, they may be idle now); a call finished
        self.on_ranks_done: Callable[[PendingCall, Sequence[int]], None] = lambda call, ranks: None
        self.on_finished: Callable[[PendingCall], None] = lambda call: None

    # -- reading ---------------------------------------------------------------
    def __contains__(self, call_id: int) -> bool:
        return call_id in self._calls

    def __len__(self) -> int:
        return len(self._calls)

    def __iter__(self) -> Iterator[PendingCall]:
        return iter(list(self._calls.values()))

    def get(self, call_id: int) -> PendingCall | None:
        return self._calls.get(call_id)

    def next_id(self) -> int:
        call_id = self._last_id = next(self._ids)
        return call_id

    def busy(self, rank: int) -> bool:
        """``rank`` still owes an answer to some sent call."""
        return any(rank in c.remaining for c in self._calls.values() if c.sent)

    # -- issuing ---------------------------------------------------------------
    def new(self, call_id: int, ranks: tuple[int, ...], output: CallOutput,
            future: MeshFuture, *, frames: list[Any], elastic: bool = False,
            setup: dict[str, Any] | None = None, hang_timeout: float | None = None,
            internal: bool = False, adopted: bool = False) -> PendingCall:
        return PendingCall(call_id, ranks, output, future, set(ranks), setup=setup,
                           elastic=elastic, frames=frames, hang_timeout=hang_timeout,
                           internal=internal, adopted=adopted)

    def low(self) -> int:
        """The oldest call still in flight, else the next id (a kept mesh's
        ranks let go of the results below it: engine/kept.py)."""
        if self._calls:
            return min(self._calls)
        return self._last_id + 1

    def sent(self, call: PendingCall) -> None:
        """``call`` went out to its ranks: answers are matched to it now."""
        call.sent = True
        call.progress_at = time.monotonic()
        self._calls[call.call_id] = call

    def wait(self, call: PendingCall) -> None:
        """``call`` cannot be sent yet (a target is on its way back, or the
        group is about to be re-formed); :meth:`take_waiting` hands it back."""
        self.waiting.append(call)
        self._calls[call.call_id] = call

    def take_waiting(self) -> list[PendingCall]:
        waiting, self.waiting = self.waiting, []
        return waiting

    # -- answers ----------------------------------------------------------------
    def complete(self, call: PendingCall, rank: int, value: Any = None,
                 error: BaseException | None = None) -> None:
        """``rank`` answered ``call``: a value, or its own error."""
        if rank not in call.remaining:
            return
        if error is None:
            call.results[rank] = value
        else:
            call.errors[rank] = error
        self._rank_done(call, rank)

    def complete_many(self, call: PendingCall, ranks: list[int], value: Any) -> None:
        """Each of ``ranks`` answered ``call`` with ``value`` (a host's
        folded result: wire/fold.py); the call finishes at most once."""
        remaining = call.remaining
        done = [rank for rank in ranks if rank in remaining]
        if not done:
            return
        call.results.update(dict.fromkeys(done, value))
        remaining.difference_update(done)
        call.progress_at = time.monotonic()
        self.on_ranks_done(call, done)
        self.finish_if_done(call)

    def fail(self, rank: int, error: BaseException, *, coming_back: bool) -> None:
        """``rank``'s process is gone (died, killed, replaced): every call
        that still waits for it loses it. An elastic call keeps it, to be
        re-issued on the new process, if the rank is ``coming_back``.
        Internal calls (a setup replay) end first: what they announce
        reaches the user's calls before those end too."""
        for call in sorted(self._calls.values(), key=lambda c: not c.internal):
            if not call.sent or (rank not in call.remaining and rank not in call.reissue):
                continue  # (a call still waiting waits for the rank's next process)
            call.held.pop(rank, None)
            call.chunks_seen.pop(rank, None)
            if call.elastic and coming_back:
                call.reissue.add(rank)
                continue
            call.reissue.discard(rank)
            call.errors.setdefault(rank, error)
            self._rank_done(call, rank)

    def reissue(self, rank: int) -> list[PendingCall]:
        """The elastic calls that lost ``rank``, to be sent to its new process."""
        out = []
        for call in list(self._calls.values()):
            if rank in call.reissue:
                call.reissue.discard(rank)
                call.remaining.add(rank)
                out.append(call)
        return out

    def abandon(self, call: PendingCall, ranks: set[int], error_for: Callable[[int], BaseException]) -> None:
        """End ``call`` for ``ranks`` (which may still run it): the call
        cannot finish, e.g. an elastic call whose lost member is not coming
        back. Their late answers are ignored."""
        for rank in sorted(ranks):
            if rank in call.remaining or rank in call.reissue:
                call.reissue.discard(rank)
                call.held.pop(rank, None)
                call.errors.setdefault(rank, error_for(rank))
                self._rank_done(call, rank)

    def shed(self, call: PendingCall, ranks: set[int], lost_for: Callable[[int], Any]) -> None:
        """The group went on without ``ranks`` (an elastic world size): an
        elastic ``call`` that had them carries on without them, each one's
        entry ``lost_for(rank)`` (a Lost, not an error)."""
        for rank in sorted(ranks):
            call.growing.discard(rank)  # back, then gone again before it joined
            if rank in call.remaining or rank in call.reissue:
                call.reissue.discard(rank)
                call.held.pop(rank, None)
                call.results[rank] = lost_for(rank)
                self._rank_done(call, rank)

    def grow(self, call: PendingCall, ranks: set[int]) -> None:
        """The group takes ``ranks`` back while the elastic ``call`` runs
        without them (each one's entry a Lost): :meth:`take_back` may give
        it to them once its members re-formed inside it."""
        call.growing.update(r for r in ranks if r in call.results and r not in call.remaining)

    def regrouped_in(self, call: PendingCall, rank: int, generation: int) -> None:
        """``rank`` re-formed into ``generation`` inside ``call`` (mnb.elastic, at a commit)."""
        if rank in call.remaining:
            call.regrouped[rank] = generation

    def take_back(self, call: PendingCall, rank: int, generation: int) -> bool:
        """``rank`` joins the running ``call`` again (a grow), a member of
        ``generation``: its Lost entry goes, it owes an answer. False if the
        call is over for its members."""
        if rank not in call.growing or call.call_id not in self._calls or not call.remaining:
            return False
        call.growing.discard(rank)
        call.regrouped[rank] = generation
        call.results.pop(rank, None)
        call.remaining.add(rank)
        call.progress_at = time.monotonic()
        return True

    def stop(self, why: str) -> None:
        """The mesh stops: every call ends, sent or waiting, with MeshNotRunning."""
        self.waiting = []
        for call in list(self._calls.values()):
            call.remaining.clear()
            call.reissue.clear()
            call.held.clear()
            self._calls.pop(call.call_id, None)
            self.on_finished(call)
            if not call.future.done():
                with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                    call.future.set_exception(MeshNotRunning(why))

    # -- finishing ----------------------------------------------------------------
    def _rank_done(self, call: PendingCall, rank: int) -> None:
        call.remaining.discard(rank)
        call.progress_at = time.monotonic()
        self.on_ranks_done(call, (rank,))
        self.finish_if_done(call)

    def finish_if_done(self, call: PendingCall) -> None:
        if call.remaining or call.held or call.reissue:
            return
        if self._calls.pop(call.call_id, None) is None:
            return  # finished already
        self.finished_ids.append(call.call_id)
        if call in self.waiting:
            self.waiting.remove(call)
        self.on_finished(call)
        future = call.future
        if future.done():  # cancelled by the user
            return
        if call.setup is not None and not call.errors:
            self.setup_cells.append(call.setup)
        if call.errors:
            classify_membership(call.errors)
        # The user may cancel from their thread between done() above and here.
        with contextlib.suppress(InvalidStateError):
            if call.errors:
                future.set_exception(RankErrors(dict(call.errors), dict(call.results), len(call.ranks)))
            else:
                future.set_result(RankResults(call.results))


def classify_membership(errors: dict[int, BaseException]) -> None:
    """Survivors cut short in a collective by a death get MembershipChanged
    instead of a raw gloo/nccl error, naming the ranks that died (their
    process ended: RankDied, or the policy's words for a rank given up)."""
    dead = sorted(r for r, e in errors.items()
                  if not isinstance(e, (RemoteError, MembershipChanged)))
    if not dead:
        return
    for rank, err in list(errors.items()):
        if isinstance(err, RemoteError) and is_peer_loss(f"{err.type_name} {err.message}"):
            errors[rank] = MembershipChanged(rank, dead, quote_first_line(err.message))
