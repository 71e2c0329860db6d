"""A rank's membership of its torch.distributed group across re-formations.

When a member dies and is replaced, the controller sends the survivors a
REFORM (a new generation, a new store port). :class:`Membership` leaves the
old group and joins the new one, on the main thread, between calls or
inside a call that waits for it (``mnb.elastic``: :meth:`await_reform`).
It owns the messages of the main channel read ahead meanwhile
(:attr:`pending`), which the worker serves first, in order, once the call
is over.

The group may be smaller than the mesh (an elastic world size: the
controller's Shrink, ``min_ranks``): a REFORM names its members, the mesh's
rank numbers in the order of their torch ranks, and this rank joins as its
place among them (dense torch ranks 0..k-1, ``RANK`` and ``WORLD_SIZE`` to
match); ``mnb.mesh_rank()`` keeps the mesh's number.

The group may grow back too (ranks started again: a host given for lost
ranks): survivors inside an ``mnb.elastic`` loop take the REFORM at their
next ``state.commit()`` (:meth:`reform_waiting`, asked by mnb.elastic), and
say in REFORMED which call they re-formed inside, so the controller gives
that call to the ranks back only when the survivors wait for them in it.

A join can be overtaken: a member that dies while the group forms makes
the controller send a newer REFORM, and the join in progress is abandoned
for it (backends.JoinAborted). A call that failed because a peer left
leaves the group at once (:meth:`release_peers`), so the peers still
waiting on this rank fail out too, each in turn.

Non-goals: running calls (loop.py), deciding re-formations
(controller/life/recovery.py), the store and the group (backends.py).
"""

from __future__ import annotations

import collections
import gc
import os
import time
import traceback
from collections.abc import Callable

from ..backends import JoinAborted, JoinFailed, init_group, leave_group
from ..config import RankEnv
from ..errors import is_peer_loss
from ..wire.channels import MainChannel
from ..wire.metas import meta_of
from ..wire.protocol import Codec, Kind, Message
from . import context as _context

SUPERSEDE_GRACE_S = 1.0  # after a failed join, how long a newer REFORM may take to arrive


class Membership:
    """Joins and leaves for one rank; reads its main channel only while it
    waits for a REFORM (the worker reads it otherwise)."""

    def __init__(self, env: RankEnv, channel: MainChannel, codec: Codec,
                 dropped: collections.Counter[str], send: Callable[..., None],
                 running_call: Callable[[], int] = lambda: 0) -> None:
        self.env = env
        self.running_call = running_call  # the call on the main thread now (0: none)
        self.channel = channel
        self.codec = codec
        self.dropped = dropped
        self.send = send  # the worker's main-socket send (REFORMED)
        self.pending: collections.deque[Message] = collections.deque()

    def release_peers(self, exc: BaseException, error: dict[str, str], *,
                      leave: bool = False) -> None:
        """A call failed because a peer left (or with a REFORM already
        waiting, or ``leave``: the controller interrupted it because a
        member is gone for good and no REFORM will come): leave the group
        now, not when a REFORM is served. gloo then closes this rank's
        connections, so a peer still waiting on it in a collective fails out
        too, instead of staying stuck until the controller replaces its
        process (what mnb.elastic does as well). A survivor interrupted
        between two collectives would otherwise keep the broken group, and a
        peer already inside the next one would wait on it for gloo's 30 min.

        The group is freed only when nothing refers to it any more, and the
        failed collective's frames (kept in the traceback, and in
        sys.last_traceback for %monarch debug) hold it in their locals: they
        are cleared first. (Post-mortem of a collective cut short by a
        peer's death loses those locals; the traceback text stays.)"""
        generation = int(_context._state.get("generation", 0))
        if leave or is_peer_loss(f"{error['type']} {error['msg']}") or self.newer_reform(generation):
            for link in _chain(exc):
                traceback.clear_frames(link.__traceback__)
            leave_group()
            gc.collect()  # a group caught in a reference cycle goes now, not later

    def await_reform(self, timeout: float = 300.0) -> int:
        """For mnb.elastic, on the main thread inside a call: wait for the
        controller's REFORM, join the new group, return its generation.
        Other messages that arrive meanwhile are kept, in order.

        The old group is left at once, not when the REFORM comes: gloo then
        closes its connections, so a peer still waiting in a collective on
        this rank fails out of it too (and re-forms) instead of staying stuck
        until the controller replaces its process. Survivors of a ring
        release one another like this, each in turn."""
        leave_group()
        deadline = time.monotonic() + timeout
        newest = self.take_reforms()  # it may already be here
        if newest is not None:
            return self.reform(newest)
        while time.monotonic() < deadline:
            if not self.channel.poll(100):
                continue
            msg = self.channel.recv(self.codec, self.dropped)
            if msg is None:
                continue
            if msg.kind == Kind.REFORM:
                return self.reform(msg)
            self.pending.append(msg)
        raise TimeoutError(f"no new group within {timeout:g} s after a member died")

    def reform(self, msg: Message) -> int:
        """Leave the old torch.distributed group and join the new generation
        (a member died and was replaced). Runs between calls, on the main
        thread, like everything that touches torch.distributed. A member
        that dies while the group forms makes the controller send a newer
        REFORM: the join in progress is abandoned for that one."""
        while True:
            try:
                return self.join(msg)
            except JoinAborted:
                newest = self.take_reforms()
                if newest is None:  # a STOP is waiting: serve() reaches it next
                    raise RuntimeError("the mesh is stopping") from None
                msg = newest

    def newer_reform(self, generation: int) -> bool:
        """Anything on the main channel is kept in order; True if a REFORM
        newer than ``generation`` or a STOP is among it."""
        while self.channel.poll(0):
            got = self.channel.recv(self.codec, self.dropped)
            if got is not None:
                self.pending.append(got)
        return any(m.kind == Kind.STOP or (m.kind == Kind.REFORM and
                                           int(meta_of(m, Kind.REFORM).get("generation", 0)) > generation)
                   for m in self.pending)

    def reform_waiting(self) -> bool:
        """For mnb.elastic at a commit: has a REFORM newer than this rank's
        group arrived (the group grows back: the controller does not break
        the running group for it)? Reads ahead what is on the main channel,
        kept in order; never waits."""
        generation = int(_context._state.get("generation", 0))
        while self.channel.poll(0):
            got = self.channel.recv(self.codec, self.dropped)
            if got is not None:
                self.pending.append(got)
        return any(m.kind == Kind.REFORM and
                   int(meta_of(m, Kind.REFORM).get("generation", 0)) > generation
                   for m in self.pending)

    def superseded(self, generation: int, grace: float = SUPERSEDE_GRACE_S) -> bool:
        """After a failed join: does a newer REFORM (or a STOP) come? The
        controller replaces a member that was still starting (its store host
        included) and sends the newer REFORM in the same turn, so a join
        broken by that sees the message within moments; a join broken by a
        fresh death gets its REFORM only after the backoff, and fails."""
        deadline = time.monotonic() + grace
        while not self.newer_reform(generation):
            left = deadline - time.monotonic()
            if left <= 0 or not self.channel.poll(max(1, int(left * 1000))):
                return self.newer_reform(generation)
        return True

    def take_reforms(self) -> Message | None:
        """Remove the pending REFORMs; return the newest."""
        reforms = [m for m in self.pending if m.kind == Kind.REFORM]
        for m in reforms:
            self.pending.remove(m)
        return max(reforms, key=lambda m: int(meta_of(m, Kind.REFORM).get("generation", 0)), default=None)

    def join(self, msg: Message) -> int:
        meta = meta_of(msg, Kind.REFORM)
        generation, port = int(meta["generation"]), int(meta["port"])
        addr = str(meta.get("addr") or self.env.master_addr)
        rank, world = self.place(meta.get("members"))
        # "out of the old collective, joining": the controller stops waiting
        # for this survivor before the (slower) join completes
        self.send(Kind.REFORMED, meta={"generation": generation, "joining": True,
                                       "call": self.running_call()})
        error = ""
        try:
            leave_group()
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
            os.environ["MONARCH_NB_GENERATION"] = str(generation)
            # torchrun's names for the group's numbers, as a process started
            # into this group gets them (procs/supervisor.py)
            os.environ["RANK"] = os.environ["ROLE_RANK"] = str(rank)
            os.environ["WORLD_SIZE"] = os.environ["ROLE_WORLD_SIZE"] = str(world)
            init_group(self.env.backend, rank, world, addr, port,
                       abort=lambda: self.newer_reform(generation))
            _context._set(generation=generation, rank=rank, world_size=world)
        except JoinAborted:
            raise
        except Exception as exc:  # reported; the controller decides
            if self.superseded(generation):
                raise JoinAborted(f"generation {generation} was superseded") from None
            error = f"{type(exc).__name__}: {exc}"
        self.send(Kind.REFORMED, meta={"generation": generation, "error": error})
        if error:
            raise JoinFailed(f"could not join generation {generation}: {error}")
        return generation

    def place(self, members: object) -> tuple[int, int]:
        """This rank's torch rank and the group's size in a REFORM naming
        ``members`` (mesh ranks, in torch rank order); none named: the mesh's."""
        mine = self.env.mesh_rank
        if not isinstance(members, list) or not members:
            return mine, self.env.mesh_size
        if mine not in members:  # the controller tells only members: a bug if seen
            raise JoinFailed(f"rank {mine} is not a member of the new group {members}")
        return members.index(mine), len(members)



def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during."""
    seen: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in seen:
        seen.append(link)
        link = link.__cause__ or link.__context__
    return seen
