"""The relay between the controller and host agents (wire/relay.py, the
controller's side in wire/transport.py, the agent's in wire/hostrelay.py).

* the envelope's headers: every header packed is unpacked to the same
  entries; any bytes are entries or a ProtocolError, nothing else
  (hypothesis);
* the controller's I/O loop over real ZeroMQ sockets, with an agent's
  DEALER: a call to several ranks of the agent is one message; a batch is
  delivered message by message, each verified as its rank's; a batch naming
  a rank that is not the agent's, a malformed header, or a forged message
  in a batch is dropped and counted, and the others in it still arrive;
* the agent's relay with real links to two "ranks" (socket pairs): a
  fan-out reaches exactly the ranks it names, and what they send goes up
  as one batch.

The whole path with real ranks, agents and hosts is in tests/test_agents.py
and tests/test_netns_hosts.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from monarch_nb.errors import ProtocolError
from monarch_nb.wire import link as links
from monarch_nb.wire.hostrelay import Relay
from monarch_nb.wire.link import Link
from monarch_nb.wire.protocol import Codec, Kind, Message, new_key
from monarch_nb.wire.relay import (
    MAX_ENTRIES,
    pack_batch,
    pack_fanout,
    unpack_batch,
    unpack_fanout,
)
from monarch_nb.wire.routes import Routes
from monarch_nb.wire.transport import IOLoop

from .conftest import wait_for

idents = st.binary(min_size=1, max_size=255)


# -- the envelope ---------------------------------------------------------------------------
@given(st.lists(idents, min_size=1, max_size=40))
def test_a_fanout_header_round_trips(names: list[bytes]) -> None:
    assert unpack_fanout(pack_fanout(names)) == names


@given(st.lists(st.tuples(idents, st.integers(1, 0xFFFF)), min_size=1, max_size=40))
def test_a_batch_header_round_trips(entries: list[tuple[bytes, int]]) -> None:
    total = sum(n for _, n in entries)
    assert unpack_batch(pack_batch(entries), total) == entries
    with pytest.raises(ProtocolError):  # the frames that came must be the ones it counts
        unpack_batch(pack_batch(entries), total + 1)


@settings(max_examples=300)
@given(st.binary(max_size=300) | st.builds(lambda m, b: m + b, st.sampled_from([b"MNF1", b"MNB1"]),
                                           st.binary(max_size=300)),
       st.integers(0, 100))
def test_any_bytes_are_entries_or_a_protocol_error(data: bytes, frames: int) -> None:
    for parse in (unpack_fanout, lambda d: unpack_batch(d, frames)):
        try:
            out = parse(data)
        except ProtocolError as exc:
            assert exc.reason == "relay-malformed"
        else:
            assert 0 < len(out) <= MAX_ENTRIES


def test_packing_refuses_what_cannot_be_unpacked() -> None:
    for bad in ([], [b""], [b"x" * 256]):
        with pytest.raises(ValueError):
            pack_fanout(bad)
    for bad_entries in ([], [(b"r", 0)], [(b"", 1)], [(b"r", 0x10000)]):
        with pytest.raises(ValueError):
            pack_batch(bad_entries)


def test_routes_plan_one_fanout_per_agent_and_follow_every_change() -> None:
    routes = Routes()
    assert not routes and routes.plan([b"a", b"b"]) == ([], [b"a", b"b"])
    routes.attach(b"r0", b"A")
    routes.attach(b"r1", b"B")
    routes.attach(b"r2", b"A")
    fanouts, rest = routes.plan([b"r0", b"r1", b"local", b"r2"])
    assert [(agent, unpack_fanout(h)) for agent, h in fanouts] == [
        (b"A", [b"r0", b"r2"]), (b"B", [b"r1"])] and rest == [b"local"]
    routes.attach(b"r1", b"A")  # its host moved (a spare host): the next plan says so
    assert [(a, unpack_fanout(h)) for a, h in routes.plan([b"r0", b"r1"])[0]] == [
        (b"A", [b"r0", b"r1"])]
    assert routes.own(b"A", [b"r0", b"r1"]) == [b"r0", b"r1"]
    with pytest.raises(ProtocolError, match="relay-foreign"):  # its old host's agent lost it
        routes.own(b"B", [b"r1"])
    routes.detach(b"r1")  # its process is gone: nobody speaks for it
    assert routes.plan([b"r0", b"r1"])[1] == [b"r1"]
    # its agent's late word for it is a straggler, left out; another agent's rank is not
    assert routes.own(b"A", [b"r0", b"r1"]) == [b"r0"] and routes.counts["stale"] == 1
    routes.attach(b"r3", b"B")
    with pytest.raises(ProtocolError, match="relay-foreign"):
        routes.own(b"A", [b"r0", b"r3"])
    assert set(routes) == {b"r0", b"r2", b"r3"} and routes.agents == {b"A", b"B"}


# -- the controller's side, real sockets ----------------------------------------------------
class Loop:
    """An IOLoop with r0, r1 (main; r0 also control) routed through agent A
    and r2 (main and control) through agent B, agent A's DEALER, and what
    reached the loop: rank messages, folds and BEATS (tests/test_fold.py)."""

    def __init__(self, key: bytes | None = None) -> None:
        self.key = key if key is not None else new_key()
        self.codec = Codec(self.key, "controller")
        self.got: list[tuple[bytes, Message]] = []
        self.folds: list[tuple[list[bytes], Message]] = []
        self.beats: list[dict[bytes, dict[str, Any]]] = []
        self.io = IOLoop(self.codec, lambda ident, msg: self.got.append((ident, msg)),
                         on_fold=lambda members, msg: self.folds.append((members, msg)),
                         on_beats=self.beats.append)
        self.io.start()
        for rank, agent in ((b"r0.main", b"agentA"), (b"r1.main", b"agentA"),
                            (b"r2.main", b"agentB"), (b"r0.ctl", b"agentA"),
                            (b"r2.ctl", b"agentB")):
            self.io.attach_relay(rank, agent)
        self.ctx = zmq.Context()
        self.agent = self.ctx.socket(zmq.DEALER)
        self.agent.setsockopt(zmq.IDENTITY, b"agentA")
        self.agent.connect(self.io.endpoint)
        self.ranks = {name: Codec(self.key, name) for name in ("r0.main", "r1.main", "r2.main")}

    def close(self) -> None:
        self.agent.close(linger=0)
        self.ctx.term()
        self.io.stop()

    def batch(self, parts: list[tuple[bytes, list[Any]]], header: bytes | None = None) -> None:
        head = header if header is not None else pack_batch([(i, len(f)) for i, f in parts])
        self.agent.send_multipart([head, *[bytes(x) for _, f in parts for x in f]])


@pytest.fixture
def loop() -> Iterator[Loop]:
    lp = Loop()
    try:
        yield lp
    finally:
        lp.close()


def test_a_call_to_ranks_of_one_agent_is_one_message_naming_them(loop: Loop) -> None:
    frames = loop.codec.sign(Kind.PING)
    # the DEALER must have said hello before the ROUTER can route to it
    loop.batch([(b"r0.main", loop.ranks["r0.main"].sign(Kind.READY))])
    wait_for(lambda: len(loop.got) == 1, what="the first batch")
    done = threading.Event()

    def send() -> None:
        loop.io.send_many([b"r0.main", b"r1.main"], frames)
        done.set()

    loop.io.call_soon(send)
    wait_for(done.is_set, what="the send")
    assert loop.agent.poll(5000)
    got = loop.agent.recv_multipart()
    assert unpack_fanout(got[0]) == [b"r0.main", b"r1.main"]
    assert got[1:] == [bytes(f) for f in frames]
    assert not loop.agent.poll(100), "one message for the two ranks"
    assert loop.io.relayed["fan-outs"] == 1


def test_a_batch_is_verified_message_by_message(loop: Loop) -> None:
    r0, r1, r2 = (loop.ranks[n] for n in ("r0.main", "r1.main", "r2.main"))
    forged = Codec(new_key(), "r1.main").sign(Kind.READY)  # not the mesh's key
    loop.batch([(b"r0.main", r0.sign(Kind.READY)),
                (b"r2.main", r2.sign(Kind.READY)),  # agent B's rank: not A's to relay
                (b"r1.main", forged),
                (b"r1.main", r0.sign(Kind.READY)),  # r0's message said to be r1's
                (b"r1.main", r1.sign(Kind.READY))])
    wait_for(lambda: len(loop.got) == 2, what="the two good messages")
    assert [(ident, msg.sender) for ident, msg in loop.got] == [(b"r0.main", "r0.main"),
                                                              (b"r1.main", "r1.main")]
    wait_for(lambda: sum(loop.io.dropped.values()) == 3, what="three dropped")
    assert loop.io.dropped["relay-foreign"] == 1, loop.io.dropped
    assert loop.io.relayed["messages"] == 5


def test_a_malformed_batch_is_dropped_whole_and_the_next_one_arrives(loop: Loop) -> None:
    r0 = loop.ranks["r0.main"]
    loop.batch([(b"r0.main", r0.sign(Kind.READY))], header=b"MNB1\x02\x00\x01x\x01\x00")
    loop.batch([(b"r0.main", r0.sign(Kind.READY))], header=b"garbage")
    loop.batch([(b"r0.main", r0.sign(Kind.READY))])
    wait_for(lambda: len(loop.got) == 1, what="the good batch")
    wait_for(lambda: loop.io.dropped["relay-malformed"] == 2, what="two malformed batches")


# -- the agent's side, real links -----------------------------------------------------------
def test_the_agents_relay_fans_out_and_batches_up() -> None:
    key = new_key()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    relay = Relay("agentX", f"tcp://127.0.0.1:{port}", None, 1 << 20)
    ranks = {}
    try:
        for name in ("r0.main", "r1.main"):
            ours, theirs = links.pair()
            relay.add(name, ours)
            ranks[name] = Link(theirs, 1 << 20, blocking=True)
        # up: both ranks speak; the controller gets them (as one batch once the relay is busy)
        signed = {n: Codec(key, n).sign(Kind.READY, [b"x" * 100_000]) for n in ranks}
        for name, link in ranks.items():
            link.send_blocking(signed[name])
        got: dict[bytes, list[bytes]] = {}
        while len(got) < 2:
            assert router.poll(5000), "nothing came up"
            frames = router.recv_multipart()
            assert frames[0] == b"agentX"
            at = 2
            for ident, n in unpack_batch(frames[1], len(frames) - 2):
                got[ident] = frames[at:at + n]
                at += n
        assert got == {n.encode(): [bytes(f) for f in signed[n]] for n in ranks}
        # down: a fan-out to r1 only reaches r1; a malformed one is dropped
        call = Codec(key, "controller").sign(Kind.PING)
        router.send_multipart([b"agentX", b"MNF1\xff\xff"] + [bytes(f) for f in call])
        router.send_multipart([b"agentX", pack_fanout([b"r1.main", b"r9.main"]),
                               *[bytes(f) for f in call]])
        assert ranks["r1.main"].poll(5000)
        assert ranks["r1.main"].recv() == [bytes(f) for f in call]
        assert not ranks["r0.main"].poll(200)
        wait_for(lambda: relay.dropped["relay-malformed"] == 1, what="the malformed fan-out")
    finally:
        relay.close()
        for link in ranks.values():
            link.close()
        router.close(linger=0)
        ctx.term()
