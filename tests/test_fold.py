"""Folding a host's equal results into one message (wire/fold.py), and the
controller taking a fold (transport.IOLoop, controller/calls/assembler.py).

* the agent's side, pure: equal plain results of one call fold into one
  message naming their ranks, signed by the agent; a result with output or
  an error, a different value, a second message of the same channel, or a
  forged one is passed through as it came;
* for any batch (hypothesis), what the controller reads back from the
  folded batch is, channel by channel, exactly what the ranks sent, in the
  order they sent it;
* the controller's I/O loop over real ZeroMQ sockets: a fold from an agent
  is delivered with its ranks; a fold naming another agent's rank, one
  signed with another key, one claiming another agent as its sender, or any
  other kind sent as the agent's own is dropped and counted;
* the assembler over a real call table: a fold completes each of its ranks
  once, a mutable value is one object per rank;
* heartbeats: held by the agent, then one BEATS of each rank's newest (a
  forged one passed through); any BEATS payload is heartbeats or a
  ProtocolError (hypothesis); the controller takes a BEATS only for the
  agent's own ranks.

Real agents folding real ranks' results: tests/test_agents.py.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monarch_nb.errors import ProtocolError
from monarch_nb.wire import serialize
from monarch_nb.wire.fold import (
    MAX_MEMBERS,
    Entry,
    Folder,
    pack_members,
    unpack_beats,
    unpack_members,
)
from monarch_nb.wire.protocol import Codec, Kind, Message, new_key

from .conftest import wait_for
from .test_assembler import Story
from .test_relay import Loop

KEY = new_key()
AGENT = "agentA"
RANKS = [f"r{i}.main" for i in range(4)]
CODECS = {name: Codec(KEY, name) for name in [*RANKS, *(r.replace("main", "ctl") for r in RANKS)]}


def result(name: str, call: int, value: Any = None, meta: dict[str, Any] | None = None
           ) -> tuple[bytes, list[bytes]]:
    payload = [] if value is None else [bytes(f) for f in serialize.dumps(value)]
    return name.encode(), [bytes(f) for f in CODECS[name].sign(Kind.RESULT, payload, call=call,
                                                              meta=meta)]


def unfold(entries: list[tuple[bytes, Any]], controller: Codec) -> list[tuple[str, str, int, bytes]]:
    """What the controller reads from a batch: (sender, kind, call, payload) per rank message."""
    out = []
    for ident, frames in entries:
        if ident == AGENT.encode():
            msg = controller.verify(frames, expected_sender=AGENT)
            assert msg.kind is Kind.FOLD
            value = b"".join(bytes(p) for p in msg.payload[1:])
            out += [(m.decode(), "result", msg.call, value) for m in unpack_members(msg.payload[0])]
        else:
            msg = controller.verify(frames, expected_sender=ident.decode())
            out.append((msg.sender, msg.kind.value, msg.call,
                        b"".join(bytes(p) for p in msg.payload)))
    return out


# -- the agent's side ----------------------------------------------------------------------
def test_equal_plain_results_fold_into_one_message_in_the_first_ones_place() -> None:
    folder = Folder(KEY, AGENT)
    beat = (b"r2.ctl", CODECS["r2.ctl"].sign(Kind.HEARTBEAT, meta={"busy": 0}))
    batch: list[Entry] = [beat, result("r0.main", 5, 7), result("r1.main", 5),
                          result("r2.main", 5, 7), result("r3.main", 5, 7)]
    out = folder.fold(batch)
    assert len(out) == 3 and out[0] == beat and out[2] == batch[2], out  # None: its own
    ident, frames = out[1]
    msg = Codec(KEY, "controller").verify(frames, expected_sender=AGENT)
    assert ident == AGENT.encode() and msg.kind is Kind.FOLD and msg.call == 5
    assert unpack_members(msg.payload[0]) == [b"r0.main", b"r2.main", b"r3.main"]
    assert serialize.loads(msg.payload[1:]) == 7
    assert folder.folded == 3


def test_what_is_not_a_plain_equal_result_passes_through_as_it_came() -> None:
    folder = Folder(KEY, AGENT)
    forged = (b"r3.main", [bytes(f) for f in Codec(new_key(), "r3.main").sign(
        Kind.RESULT, [], call=5)])
    batch: list[Entry] = [
        result("r0.main", 5, meta={"n_out": 1}),  # output went before it
        result("r1.main", 5, meta={"ok": False, "error": {"type": "E", "msg": "", "tb": ""}}),
        result("r2.main", 6),  # another call
        forged,  # not the mesh's key: the controller drops and counts it
        result("r2.main", 5),  # r2's second message in the batch: its first is above
        (b"r0.main", CODECS["r1.main"].sign(Kind.RESULT, [], call=5)),  # r1's, said r0's
        result("r1.main", 7, b"x" * 40_000),  # too big to travel inline
        result("r3.main", 7, b"x" * 40_000),
    ]
    assert folder.fold(batch) == batch
    assert folder.folded == 0


def test_a_fold_of_many_ranks_is_cut_at_the_bound() -> None:
    names = [f"r{i}.main" for i in range(MAX_MEMBERS + 3)]
    codecs = {n: Codec(KEY, n) for n in names}
    batch = [(n.encode(), codecs[n].sign(Kind.RESULT, [], call=1)) for n in names]
    out = Folder(KEY, AGENT).fold(batch)
    assert [len(unpack_members(Codec(KEY, "c").verify(f).payload[0])) for _, f in out] == [
        MAX_MEMBERS, 3]


def test_members_refuse_what_does_not_name_distinct_ranks() -> None:
    assert unpack_members(pack_members([b"a", b"b"])) == [b"a", b"b"]
    for frame in (b"", b"a\n\nb", b"a\na", b"\n".join([b"x%d" % i for i in range(MAX_MEMBERS + 1)])):
        with pytest.raises(ProtocolError):
            unpack_members(frame)


message = st.tuples(
    st.sampled_from([*RANKS, *(r.replace("main", "ctl") for r in RANKS)]),
    st.sampled_from(["plain", "plain", "plain", "meta", "beat"]),
    st.integers(1, 3),  # the call
    st.sampled_from([None, 0, 1, "x"]),  # the value
)


@settings(max_examples=200, deadline=None)
@given(st.lists(message, max_size=24))
def test_a_folded_batch_reads_back_as_each_channel_sent_it(plan: list[tuple[str, str, int, Any]]
                                                           ) -> None:
    codecs = {name: Codec(KEY, name) for name in CODECS}  # fresh replay windows each example
    batch = []
    for name, what, call, value in plan:
        payload = [] if value is None else [bytes(f) for f in serialize.dumps(value)]
        if what == "beat":
            frames = codecs[name].sign(Kind.HEARTBEAT, meta={"busy": call})
        else:
            frames = codecs[name].sign(Kind.RESULT, payload, call=call,
                                       meta={"n_out": 0} if what == "meta" else None)
        batch.append((name.encode(), [bytes(f) for f in frames]))
    controller = Codec(KEY, "controller")
    expected = unfold(batch, controller)
    controller = Codec(KEY, "controller")  # (its replay windows saw them once already)
    got = unfold(Folder(KEY, AGENT).fold(batch), controller)

    def by_channel(rows: list[tuple[str, str, int, bytes]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for sender, *rest in rows:
            out.setdefault(sender, []).append(rest)
        return out

    assert by_channel(got) == by_channel(expected)


def beat(name: str, busy: int, codec: Codec | None = None) -> tuple[bytes, list[bytes]]:
    signer = codec or CODECS[name]
    return name.encode(), [bytes(f) for f in signer.sign(Kind.HEARTBEAT,
                                                          meta={"busy": busy, "h": {"cpu": 1.0}})]


def test_heartbeats_are_held_then_go_up_as_one_beats_of_each_ranks_newest() -> None:
    folder = Folder(KEY, AGENT, beat_hold=0.25)
    forged = beat("r2.ctl", 0, Codec(new_key(), "r2.ctl"))
    result0 = result("r0.main", 4, 1)
    assert folder.fold([beat("r0.ctl", 1), result0, beat("r1.ctl", 0)], now=10.0) == [result0]
    assert folder.due == 10.25
    assert folder.fold([beat("r0.ctl", 2), forged], now=10.1) == []  # not yet
    out = folder.fold([], now=10.3)
    assert folder.due is None and out[0] == forged and len(out) == 2, out  # forged: as it came
    ident, frames = out[1]
    msg = Codec(KEY, "controller").verify(frames, expected_sender=AGENT)
    assert ident == AGENT.encode() and msg.kind is Kind.BEATS
    assert unpack_beats(msg.payload[0]) == {b"r0.ctl": {"busy": 2, "h": {"cpu": 1.0}},
                                            b"r1.ctl": {"busy": 0, "h": {"cpu": 1.0}}}
    assert folder.beats_folded == 2
    # one heartbeat alone goes up as it came; without a clock none is held
    one = beat("r3.ctl", 0)
    assert folder.fold([one], now=20.0) == [] and folder.fold([], now=21.0) == [one]
    assert folder.fold([one]) == [one]


def test_a_heartbeat_that_enters_or_leaves_an_elastic_loop_goes_up_at_once() -> None:
    """A script's rank in an mnb.elastic loop carries on in place after a
    peer's death; the controller knows by this heartbeat, which must not
    wait behind the others (a host lost right after the loop began)."""
    folder = Folder(KEY, AGENT, beat_hold=0.25)

    def looping(name: str, el: bool, codec: Codec | None = None) -> tuple[bytes, list[bytes]]:
        signer = codec or CODECS[name]
        return name.encode(), [bytes(f) for f in signer.sign(Kind.HEARTBEAT,
                                                              meta={"busy": 3, "el": el})]

    def sent(out: list[Entry]) -> dict[bytes, dict[str, Any]]:
        (ident, frames), = out
        assert ident == AGENT.encode()
        return unpack_beats(Codec(KEY, "controller").verify(frames, expected_sender=AGENT).payload[0])

    plain = looping("r1.ctl", False)
    assert folder.fold([plain], now=10.0) == [] and folder.due == 10.25  # nothing new: held
    out = folder.fold([looping("r0.ctl", True)], now=10.1)  # news: up now, with the held one
    assert sent(out) == {b"r0.ctl": {"busy": 3, "el": True}, b"r1.ctl": {"busy": 3, "el": False}}
    assert folder.due is None
    assert folder.fold([looping("r0.ctl", True)], now=10.2) == [] and folder.due == 10.45  # said
    out = folder.fold([looping("r1.ctl", True)], now=10.3)
    assert sent(out) == {b"r0.ctl": {"busy": 3, "el": True}, b"r1.ctl": {"busy": 3, "el": True}}
    assert folder.fold([looping("r1.ctl", False)], now=10.4) != []  # leaving is news too
    # a forged one says nothing: held, then as it came
    forged = looping("r2.ctl", True, Codec(new_key(), "r2.ctl"))
    assert folder.fold([forged], now=11.0) == [] and folder.fold([], now=11.3) == [forged]


@settings(max_examples=300)
@given(st.binary(max_size=200) | st.builds(
    lambda d: json.dumps(d).encode(),
    st.dictionaries(st.text(max_size=8), st.dictionaries(
        st.sampled_from(["busy", "h", "x"]), st.integers() | st.text(max_size=4) | st.just({})),
        max_size=4)))
def test_any_beats_payload_is_heartbeats_or_a_protocol_error(data: bytes) -> None:
    try:
        beats = unpack_beats(data)
    except ProtocolError as exc:
        assert exc.reason == "malformed"
        return
    assert beats and all(isinstance(i, bytes) and i for i in beats)
    for meta in beats.values():
        assert set(meta) <= {"busy", "h"}
        assert type(meta.get("busy", 0)) is int and type(meta.get("h", {})) is dict


# -- the controller's side, real sockets ----------------------------------------------------
@pytest.fixture
def loop() -> Iterator[Loop]:
    """The relay tests' loop (tests/test_relay.py), with this module's key."""
    with contextlib.closing(Loop(KEY)) as lp:
        yield lp


def fold_of(members: list[bytes], signer: Codec, kind: Kind = Kind.FOLD) -> tuple[bytes, list[Any]]:
    return b"agentA", signer.sign(kind, [pack_members(members), b"value"], call=9)


def test_a_fold_is_delivered_with_its_ranks_and_a_bad_one_is_dropped(loop: Loop) -> None:
    agent = Codec(KEY, "agentA")
    loop.batch([
        fold_of([b"r0.main", b"r2.main"], agent),  # r2 is agent B's
        fold_of([b"r0.main", b"r1.main"], Codec(new_key(), "agentA")),  # another key
        fold_of([b"r0.main", b"r1.main"], Codec(KEY, "agentB")),  # B's fold, sent by A
        fold_of([b"r0.main", b"r1.main"], agent, Kind.READY),  # not a fold
        fold_of([b"r0.main", b"r1.main"], agent),  # the good one
    ])
    wait_for(lambda: loop.folds, what="the good fold")
    wait_for(lambda: sum(loop.io.dropped.values()) == 4, what="four dropped")
    [(members, msg)] = loop.folds
    assert members == [b"r0.main", b"r1.main"] and msg.call == 9
    assert [bytes(p) for p in msg.payload] == [b"value"]
    assert loop.io.dropped == {"relay-foreign": 1, "bad-signature": 1, "sender-mismatch": 1,
                               "relay-kind": 1}, loop.io.dropped
    assert loop.io.relayed["folds"] == 1 and loop.io.relayed["folded"] == 2
    assert not loop.got


def test_beats_are_delivered_for_the_agents_ranks_only(loop: Loop) -> None:
    agent = Codec(KEY, "agentA")
    meta = {"busy": 0, "h": {"rss": 5}}

    def beats(body: bytes) -> tuple[bytes, list[Any]]:
        return b"agentA", agent.sign(Kind.BEATS, [body])

    loop.batch([beats(json.dumps({"r0.ctl": meta, "r2.ctl": meta}).encode()),  # r2: B's
                beats(b"{not json"),
                beats(json.dumps({"r0.ctl": {"busy": "x"}}).encode()),  # off the schema
                beats(json.dumps({"r0.ctl": meta}).encode()),
                # r9: an id no agent relays any more (a replaced process's): left out
                beats(json.dumps({"r9.ctl": meta, "r0.ctl": meta}).encode())])
    wait_for(lambda: len(loop.beats) == 2, what="the good BEATS")
    wait_for(lambda: sum(loop.io.dropped.values()) == 3, what="three dropped")
    assert loop.beats == [{b"r0.ctl": meta}, {b"r0.ctl": meta}]
    assert loop.io.dropped == {"relay-foreign": 1, "malformed": 2}, loop.io.dropped
    assert loop.io.relayed["beats"] == 2 and loop.io.relayed["stale"] == 1


# -- the assembler ----------------------------------------------------------------------------
def test_a_fold_completes_each_rank_once_with_its_own_mutable_value() -> None:
    s = Story()
    call = s.call()
    done = threading.Event()
    call.future.add_done_callback(lambda f: done.set())
    fold = Message(Kind.FOLD, "agentA", 1, call.call_id, payload=list(serialize.dumps([1, 2])))
    s.asm.on_folded([s.ranks[0], s.ranks[1]], fold)
    assert done.is_set()
    results = call.future.result()
    assert results[0] == results[1] == [1, 2] and results[0] is not results[1]
    s.asm.on_folded([s.ranks[0]], fold)  # late or repeated: the call is over
    assert s.log == [f"end {call.call_id}"]
