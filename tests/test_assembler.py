"""The result assembler's ordering rules, without processes: a rank's
OUTPUT chunks, METRICS batches and RESULT fed in scripted orders to a real
Assembler over a real CallTable, DataPlane and MetricsStore (the one stand-in
records the frames it is asked to send). tests/test_output.py,
tests/test_metrics.py, tests/test_chunks.py and tests/test_dataplane.py run
the same paths on real ranks.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from monarch_nb.controller.calls.assembler import Assembler
from monarch_nb.controller.calls.calltable import CallTable, PendingCall
from monarch_nb.controller.calls.dataplane import DataPlane
from monarch_nb.controller.calls.output import CallOutput
from monarch_nb.controller.life.ranktable import RankTable
from monarch_nb.controller.metricstore import MetricsStore
from monarch_nb.errors import RankDied, RankErrors, RemoteError
from monarch_nb.futures import MeshFuture
from monarch_nb.results import RankResults
from monarch_nb.wire import chunks, metricframes, serialize
from monarch_nb.wire.protocol import Codec, Kind, Message, new_key


class Story:
    """An assembler over a two-rank mesh; ``log`` records, in order, the
    output emitted and each call's end."""

    def __init__(self) -> None:
        self.calls = CallTable()
        self.ranks = RankTable(2)
        self.metrics = MetricsStore(2)
        self.sent: list[tuple[bytes, list[Any]]] = []
        self.log: list[str] = []
        self.default: list[str] = []
        self.default_out = CallOutput(lambda s, t: self.default.append(t), fold=False)
        self.calls.on_finished = lambda call: call.output.flush(force=True)
        self.asm = Assembler(self.calls, DataPlane("t", None, 1 << 20), self.metrics,
                             lambda ident, frames: self.sent.append((ident, frames)),
                             Codec(new_key(), "controller"), lambda rank: None,
                             default_output=lambda: self.default_out)
        self._seq = 0

    def call(self, ranks: tuple[int, ...] = (0, 1)) -> PendingCall:
        call_id = self.calls.next_id()
        future = MeshFuture(call_id, ranks, lambda _id: None)
        future.add_done_callback(lambda f: self.log.append(f"end {call_id}"))
        call = self.calls.new(call_id, ranks, CallOutput(lambda s, t: self.log.append(t),
                                                         fold=False),
                              future, frames=[b"f"])
        self.calls.sent(call)
        return call

    def msg(self, kind: Kind, call: PendingCall, meta: dict[str, Any] | None = None,
            payload: list[Any] | None = None) -> Message:
        self._seq += 1
        return Message(kind, "rank", self._seq, call.call_id, meta, payload=payload)

    def output(self, rank: int, call: PendingCall, text: str, n: int = 0) -> None:
        frame = json.dumps([["stdout", text]]).encode()
        self.asm.on_output(self.ranks[rank], self.msg(Kind.OUTPUT, call, {"n": n}, [frame]))

    def metric(self, rank: int, call: PendingCall, value: float, n: int = 0) -> None:
        frame = metricframes.encode([(1, 0.0, {"loss": value})])
        self.asm.on_metrics(self.ranks[rank], self.msg(Kind.METRICS, call, {"n": n}, [frame]))

    def result(self, rank: int, call: PendingCall, value: Any,
               meta: dict[str, Any] | None = None, payload: list[Any] | None = None) -> None:
        frames = serialize.dumps(value) if payload is None else payload
        self.asm.on_result(self.ranks[rank], self.msg(Kind.RESULT, call, meta, frames))


def test_a_plain_result_completes_its_rank_at_once() -> None:
    s = Story()
    call = s.call()
    s.result(0, call, 1)
    s.result(1, call, 2)
    assert call.future.result(0) == RankResults({0: 1, 1: 2})


def test_a_result_waits_for_the_chunks_it_announced() -> None:
    s = Story()
    call = s.call((0,))
    s.result(0, call, "v", {"n_out": 2, "n_m": 1})  # overtook its chunks
    assert not call.future.done() and 0 in call.held
    s.output(0, call, "a\n")
    s.metric(0, call, 0.5)
    assert not call.future.done()
    s.output(0, call, "b\n")
    assert call.future.result(0) == RankResults({0: "v"}) and not call.held
    assert s.log == ["[0] a\n", "[0] b\n", f"end {call.call_id}"]
    assert s.metrics.series(0, "loss")[1] == [0.5]


def test_a_result_after_its_chunks_completes_at_once() -> None:
    s = Story()
    call = s.call((0,))
    s.output(0, call, "a\n")
    s.result(0, call, "v", {"n_out": 1})
    assert call.future.result(0) == RankResults({0: "v"})


def test_uncounted_chunks_do_not_release_a_held_result() -> None:
    s = Story()
    call = s.call((0,))
    s.result(0, call, "v", {"n_out": 1})
    s.output(0, call, "late\n", n=-1)  # not numbered: sent outside the call's count
    assert not call.future.done()
    s.output(0, call, "x\n")
    assert call.future.done()


def test_a_held_result_keeps_the_call_open_until_released() -> None:
    s = Story()
    call = s.call()
    s.result(0, call, 0, {"n_out": 1})
    s.result(1, call, 1)
    assert not call.future.done() and call.call_id in s.calls
    s.output(0, call, "x\n")
    assert call.future.result(0) == RankResults({0: 0, 1: 1})


def test_a_rank_lost_with_its_result_held_ends_the_call_with_its_death() -> None:
    s = Story()
    call = s.call()
    s.result(0, call, 0, {"n_out": 1})
    s.result(1, call, 1)
    s.calls.fail(0, RankDied(0, None, "SIGKILL", (), 0), coming_back=False)
    assert not call.held
    with pytest.raises(RankErrors) as info:
        call.future.result(0)
    assert isinstance(info.value.errors[0], RankDied) and info.value.results == {1: 1}
    s.output(0, call, "x\n")  # a straggler of the ended call: nothing happens


def test_the_results_own_output_comes_before_its_value_and_errors_are_remote() -> None:
    s = Story()
    call = s.call()
    own = json.dumps([["stdout", "mine\n"]]).encode()
    s.result(0, call, None, {"o": 1, "ok": True}, [own, *serialize.dumps(5)])
    s.result(1, call, None, {"ok": False, "error": {"type": "ValueError", "msg": "bad",
                                                    "tb": "tb"}}, [])
    with pytest.raises(RankErrors) as info:
        call.future.result(0)
    err = info.value.errors[1]
    assert isinstance(err, RemoteError) and (err.type_name, err.message) == ("ValueError", "bad")
    assert info.value.results == {0: 5}
    assert s.log[0] == "[0] mine\n"


def test_an_unloadable_result_is_the_ranks_serialization_error() -> None:
    s = Story()
    call = s.call((0,))
    s.result(0, call, None, payload=[b"not a pickle"])
    with pytest.raises(RankErrors) as info:
        call.future.result(0)
    err = info.value.errors[0]
    assert isinstance(err, RemoteError) and err.type_name == "SerializationError"


def test_pieces_are_joined_and_a_bad_layout_is_the_ranks_error() -> None:
    s = Story()
    call = s.call()
    value = b"x" * 100
    frames, parts = chunks.split(serialize.dumps(value), chunk=16)
    assert parts is not None and len(frames) > 3
    s.result(0, call, None, {"parts": parts}, frames)
    s.result(1, call, None, {"parts": parts}, frames[:-1])  # a piece missing
    with pytest.raises(RankErrors) as info:
        call.future.result(0)
    assert info.value.results == {0: value}
    assert "pieces do not fit" in info.value.errors[1].message


def test_results_nobody_waits_for_are_dropped() -> None:
    s = Story()
    call = s.call((0,))
    s.result(0, call, 1)
    s.result(0, call, 2)  # a second answer
    other = s.call((1,))
    s.calls.stop("stopped")
    s.result(1, other, 3)  # after its call ended
    assert call.future.result(0) == RankResults({0: 1})
    assert not s.sent


def test_output_outside_a_call_goes_to_the_default_output() -> None:
    s = Story()
    call = s.call((0,))
    s.calls.complete(call, 0, None)
    s.output(0, call, "after\n")  # its call is over
    s.default_out.flush(force=True)
    assert s.default == ["[0] after\n"]
