"""wire/metas.py agrees with protocol.META, and wire/payloads.py's codecs
round-trip and reject junk only with their own error."""

from __future__ import annotations

import json
import typing
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monarch_nb.controller.calls.output import decode_items
from monarch_nb.wire import metas, payloads
from monarch_nb.wire.protocol import META, Codec, Kind, new_key

_TYPE_OF = {str: str, int: int, bool: bool, dict: dict, list: list}


def test_every_kind_in_meta_has_a_typeddict_and_no_other_kind_does() -> None:
    assert set(metas.TYPES) == set(META)


@pytest.mark.parametrize("kind", list(META), ids=lambda k: k.value)
def test_typeddict_keys_and_types_match_meta(kind: Kind) -> None:
    td = metas.TYPES[kind]
    hints = typing.get_type_hints(td)
    assert set(hints) == set(META[kind]), kind
    assert not td.__required_keys__  # every meta field is optional on the wire
    for key, types in META[kind].items():
        hint = hints[key]
        origin = typing.get_origin(hint) or hint
        assert origin is _TYPE_OF[types[0]], (kind, key, hint, types)


def test_meta_of_returns_the_verified_meta_itself() -> None:
    key = new_key()
    frames = Codec(key, "rank0").sign(Kind.READY, meta={"device": "cpu", "pid": 7})
    msg = Codec(key, "controller").verify(frames)
    ready = metas.meta_of(msg, Kind.READY)
    assert ready is msg.meta and ready["device"] == "cpu" and ready.get("pid") == 7


_text = st.text(max_size=40)
_items = st.lists(st.tuples(st.sampled_from(["stdout", "stderr"]), _text), max_size=20)


@given(_items)
def test_output_round_trip(items: list[tuple[str, str]]) -> None:
    frame = payloads.encode_output([[s, t] for s, t in items])
    assert payloads.decode_output(frame) == items
    assert payloads.decode_output(memoryview(frame)) == items


_json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300)
@given(st.one_of(st.binary(max_size=200), _json_value.map(lambda v: json.dumps(v).encode())))
def test_junk_output_raises_only_payload_error(frame: bytes) -> None:
    try:
        items = payloads.decode_output(frame)
    except payloads.PayloadError:
        assert decode_items(frame) == [("stderr", "[monarch_nb: unreadable output chunk dropped]\n")]
    else:
        assert all(type(s) is str and type(t) is str for s, t in items)


def test_output_rejects_wrong_shapes_and_deep_nesting() -> None:
    for bad in (b'{"a": 1}', b'[["stdout"]]', b'[["stdout", 5]]', b"[1]", b"\xff",
                b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(payloads.PayloadError):
            payloads.decode_output(bad)


def test_output_bounds_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payloads, "MAX_OUTPUT_BYTES", 10)
    with pytest.raises(payloads.PayloadError, match="more than 10"):
        payloads.decode_output(payloads.encode_output([["stdout", "x" * 20]]))


_tail = st.fixed_dictionaries({
    "ops": st.lists(st.lists(st.integers(), max_size=3), max_size=3),
    "total": st.integers(min_value=0),
    "groups": st.dictionaries(_text, st.lists(st.integers(0, 8), max_size=4), max_size=3),
    "generation": st.integers(min_value=0),
    "now": st.floats(allow_nan=False, allow_infinity=False),
    "calls": st.lists(st.lists(_text, max_size=3), max_size=3),
    "torch_ops": st.lists(st.lists(st.integers(), max_size=3), max_size=3),
})


@given(_tail)
def test_flight_round_trip(tail: dict[str, Any]) -> None:
    assert payloads.decode_flight(payloads.encode_flight(tail)) == tail


@settings(max_examples=300)
@given(st.one_of(st.binary(max_size=200), _json_value.map(lambda v: json.dumps(v).encode())))
def test_junk_flight_raises_only_payload_error(frame: bytes) -> None:
    try:
        tail = payloads.decode_flight(frame)
    except payloads.PayloadError:
        return
    assert type(tail) is dict
    for key in ("ops", "calls", "torch_ops"):
        assert key not in tail or type(tail[key]) is list


def test_flight_rejects_wrong_shapes() -> None:
    for bad in (b"[]", b'{"ops": 3}', b'{"groups": []}', b"nope", b"[" * 100_000):
        with pytest.raises(payloads.PayloadError):
            payloads.decode_flight(bad)


@given(st.dictionaries(_text, _json_value, max_size=5))
def test_debugger_round_trip(body: dict[str, Any]) -> None:
    assert payloads.decode_debugger(payloads.encode_debugger(body)) == body


@settings(max_examples=300)
@given(st.one_of(st.binary(max_size=200), _json_value.map(lambda v: json.dumps(v).encode())))
def test_junk_debugger_frame_raises_only_payload_error(frame: bytes) -> None:
    try:
        body = payloads.decode_debugger(frame)
    except payloads.PayloadError:
        return
    assert type(body) is dict


def test_debugger_body_is_always_made() -> None:
    # a value JSON cannot hold (the rank's answer carries user values) is its repr
    assert payloads.decode_debugger(payloads.encode_debugger({"v": {1, 2}})) == {"v": "{1, 2}"}
    for bad in (b"[]", b"3", b"nope", b"[" * 100_000):
        with pytest.raises(payloads.PayloadError):
            payloads.decode_debugger(bad)
