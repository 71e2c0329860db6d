"""Routes to the ranks behind host agents: which agent relays for which
rank id, what a call to a set of ranks becomes (one fan-out per agent), and
the check that an agent speaks only for its own ranks. The controller's
side of relay.py, without the sockets.

Written by any thread (:meth:`Routes.attach` and :meth:`Routes.detach`:
single dict stores, and the fan-out cache replaced whole, never changed in
place), read by whoever leads the I/O loop (transport.IOLoop), which sends
and receives by it.

Non-goals: sockets (transport.py), the envelope's layout (relay.py), folds
and BEATS (fold.py).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence

from ..errors import ProtocolError
from .relay import pack_fanout

# a set of ranks' fan-outs: (agent, fan-out header) each, and the ranks behind none
Plan = tuple[list[tuple[bytes, bytes]], list[bytes]]
MAX_PLANS = 64  # sets of ranks whose fan-outs are kept (a mesh calls the same few)


class Routes:
    """The controller's routes through host agents."""

    def __init__(self) -> None:
        self._agent_of: dict[bytes, bytes] = {}  # a rank's main or control id -> its agent's
        # the same, the other way: an agent's ranks' ids (a fold's members are
        # checked in one set operation, not one lookup each)
        self._members: dict[bytes, set[bytes]] = {}
        # the agents that ever relayed (an agent's messages are batches,
        # anyone else's are a rank's own)
        self.agents: set[bytes] = set()
        # the fan-outs of a set of ranks (a call's), kept while the routes hold
        self._plans: dict[tuple[bytes, ...], Plan] = {}
        # messages sent to agents ("fan-outs"), batches from them, messages in
        # those, the folds among them (fold.py), the results they carried, the
        # heartbeats that came in BEATS, and earlier incarnations' stragglers
        self.counts: collections.Counter[str] = collections.Counter()

    def __bool__(self) -> bool:
        return bool(self._agent_of)

    def __iter__(self) -> Iterator[bytes]:
        """The rank ids routed through an agent."""
        return iter(list(self._agent_of))

    def attach(self, ident: bytes, agent: bytes) -> None:
        """From now on ``ident`` (a remote rank's main or control id) is
        reached through ``agent`` (its host agent's routing id), which may
        relay what ``ident`` signs."""
        old = self._agent_of.get(ident)
        if old == agent:
            return
        if old is not None:
            self._members[old].discard(ident)
        self._agent_of[ident] = agent
        self._members.setdefault(agent, set()).add(ident)
        self._plans = {}
        self.agents.add(agent)

    def detach(self, ident: bytes) -> None:
        """``ident``'s process is gone: no agent speaks for it any more."""
        agent = self._agent_of.pop(ident, None)
        if agent is not None:
            self._members[agent].discard(ident)
            self._plans = {}

    def plan(self, idents: Sequence[bytes]) -> Plan:
        """Each agent's fan-out header for a message to ``idents``, and
        those of them that are behind no agent (kept per set of ranks)."""
        plans, key = self._plans, tuple(idents)
        plan = plans.get(key)
        if plan is None:
            by_agent: dict[bytes, list[bytes]] = {}
            rest = []
            agent_of = self._agent_of
            for ident in key:
                agent = agent_of.get(ident)
                if agent is None:
                    rest.append(ident)
                else:
                    by_agent.setdefault(agent, []).append(ident)
            plan = [(agent, pack_fanout(members)) for agent, members in by_agent.items()], rest
            if len(plans) >= MAX_PLANS:
                plans.clear()
            plans[key] = plan
        return plan

    def owns(self, agent: bytes, ident: bytes) -> bool:
        """Whether ``agent`` relays for ``ident``; ProtocolError
        ("relay-foreign") if another agent does. An id that no agent relays
        any more (an earlier incarnation's: forgotten when its rank got a new
        process) is False, counted as "stale": a straggler the agent sent
        before it knew, not a forgery."""
        relay = self._agent_of.get(ident)
        if relay == agent:
            return True
        if relay is None:
            self.counts["stale"] += 1
            return False
        raise ProtocolError("relay-foreign", f"{ident[:64]!r} is not a rank of this agent")

    def own(self, agent: bytes, idents: Sequence[bytes]) -> list[bytes]:
        """Those of ``idents`` that ``agent`` relays for (``owns``, each;
        all of them, the usual case, in one set operation)."""
        members = self._members.get(agent)
        if members is not None and members.issuperset(idents):
            return list(idents)
        return [ident for ident in idents if self.owns(agent, ident)]


__all__ = ["MAX_PLANS", "Plan", "Routes"]
