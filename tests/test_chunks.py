"""Big frames in pieces (wire/chunks.py): split and join are exact inverses,
a layout that does not fit is refused before any copy, and a signed message
of pieces verifies and joins back to what was sent."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from monarch_nb.wire import chunks
from monarch_nb.wire.protocol import Codec, Kind, new_key


@given(st.lists(st.binary(max_size=200), max_size=6), st.integers(1, 40))
def test_join_undoes_split(payload: list[bytes], chunk: int) -> None:
    frames, parts = chunks.split(payload, chunk)
    if parts is None:
        assert frames == payload
        assert all(len(p) < 2 * chunk for p in payload)
        return
    assert len(parts) == len(payload) and sum(parts) == len(frames)
    owners = [(p, n) for p, n in zip(payload, parts, strict=True) for _ in range(n)]
    assert all(len(memoryview(f)) <= max(chunk, -(-len(p) // chunks.MAX_PIECES))
               for f, (p, n) in zip(frames, owners, strict=True) if n > 1)
    assert all(len(p) < 2 * chunk for p, n in zip(payload, parts, strict=True) if n == 1)
    joined = chunks.join(frames, parts)
    assert [bytes(f) for f in joined] == payload
    # pieces are views of the sender's buffers (no copy); joins are writable
    for f, n in zip(joined, parts, strict=True):
        if n > 1:
            assert isinstance(f, bytearray)


def test_a_huge_frame_gets_bigger_pieces_not_more() -> None:
    big = bytearray(chunks.MAX_PIECES * 3 * 64)
    frames, parts = chunks.split([big], chunk=64)
    assert parts == [chunks.MAX_PIECES]
    assert bytes(chunks.join(frames, parts)[0]) == bytes(big)


@pytest.mark.parametrize("parts", [None, [], [0, 2], [1, -1], ["2"], [True, 1], [1, 1, 1], [4], {"a": 1}])
def test_a_layout_that_does_not_fit_is_refused(parts: object) -> None:
    with pytest.raises(chunks.ChunkError):
        chunks.join([b"ab", b"cd"], parts)


@given(st.lists(st.integers(-3, 5), max_size=5), st.integers(0, 5))
def test_join_never_fails_otherwise(parts: list[int], n: int) -> None:
    frames = [bytes([i]) * 3 for i in range(n)]
    try:
        out = chunks.join(frames, parts)
    except chunks.ChunkError:
        return
    assert b"".join(bytes(f) for f in out) == b"".join(frames)


def test_pieces_are_signed_and_verified_like_one_frame() -> None:
    key = new_key()
    sender, receiver = Codec(key, "controller"), Codec(key, "rank-0")
    value = bytes(range(256)) * (3 * chunks.CHUNK // 256 + 7)
    frames, parts = chunks.split([b"pickle", value])
    assert parts is not None and parts[0] == 1 and parts[1] == 4
    signed = sender.sign(Kind.CALL, frames, call=1, meta={"parts": parts})
    msg = receiver.verify(signed)
    assert msg.meta["parts"] == parts
    assert [bytes(f) for f in chunks.join(msg.payload, msg.meta["parts"])] == [b"pickle", value]
    # a piece changed in flight fails the signature, as any frame does
    tampered = [*signed[:-1], b"x" * len(signed[-1])]
    with pytest.raises(Exception, match="bad-signature"):
        receiver.verify(tampered)
