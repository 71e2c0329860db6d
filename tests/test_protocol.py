"""Unit tests for monarch_nb.wire.protocol: signing, verification, replay window.

Pure bytes: no sockets, no processes. ``forge`` builds header bytes by hand and
signs them with the *right* key, to reach the checks that run after the
signature (a buggy or confused key holder, not an outsider).

Wire layout (protocol.py): ``[signature(32 bytes) + header, *payload]``; the
helpers ``split`` and ``join`` go between that and (signature, header, payload).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import pickle
import struct
from pathlib import Path

import pytest

from monarch_nb.errors import MonarchError, ProtocolError
from monarch_nb.wire import protocol
from monarch_nb.wire.protocol import (
    HEAD,
    INLINE,
    INLINE_MAX,
    MAX_FRAMES,
    MAX_HEADER_BYTES,
    REPLAY_WINDOW,
    SIGNATURE_BYTES,
    SMALL,
    VERSION,
    Codec,
    Kind,
    Message,
    ReplayWindow,
    new_key,
)

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))

DOCUMENTED_REASONS = {"bad-signature", "replay", "truncated", "malformed", "oversized", "version"}


def code_of(kind: Kind) -> int:
    return list(Kind).index(kind)


def raw_header(*, version: int = VERSION, code: int = 0, seq: int = 1, call: int = 0,
               sender: bytes = b"ctl", lengths: tuple[int, ...] = (), nframes: int | None = None,
               meta: bytes = b"", flags: int = 0) -> bytes:
    n = len(lengths) if nframes is None else nframes
    return (HEAD.pack(version, code, flags, seq, call, len(sender), n) + sender
            + struct.pack(f"!{len(lengths)}Q", *lengths) + meta)


MIN_FIRST = SIGNATURE_BYTES + HEAD.size  # shortest first frame that is not "truncated"


def join(sig: bytes, header: bytes, payload=()) -> list:
    """Frames in the wire layout: signature and header share the first frame."""
    return [bytes(sig) + bytes(header), *payload]


def split(frames) -> tuple[bytes, bytes, list]:
    """(signature, header, payload frames) of a message in the wire layout."""
    first = bytes(frames[0])
    return first[:SIGNATURE_BYTES], first[SIGNATURE_BYTES:], list(frames[1:])


def header_of(body: bytes, payload) -> bytes:
    """The header part of a first frame (after the signature): without
    payload frame 0 when that travels inline."""
    flags = HEAD.unpack_from(body)[2]
    return body[:len(body) - len(payload[0])] if flags & INLINE else body


def forge(header: bytes, payload: list[bytes] = (), key: bytes = KEY) -> list[bytes]:
    """Frames signed with ``key`` over arbitrary header bytes."""
    sig = hmac.new(key, header + b"".join(payload), hashlib.sha256).digest()
    return join(sig, header, payload)


def reason_of(codec: Codec, frames, **kw) -> str:
    with pytest.raises(ProtocolError) as info:
        codec.verify(frames, **kw)
    return info.value.reason


@pytest.fixture
def sender() -> Codec:
    return Codec(KEY, "ctl")


@pytest.fixture
def receiver() -> Codec:
    return Codec(KEY, "rank0")


@pytest.fixture
def separate() -> Codec:
    """A sender that never puts payload frame 0 inside the first frame: the
    layout of payloads over INLINE_MAX, for tests about frame boundaries."""
    return Codec(KEY, "ctl", inline_max=-1)


# -- documentation ------------------------------------------------------------

def test_documented_reasons_are_in_the_module_docstring():
    doc = protocol.__doc__
    for reason in DOCUMENTED_REASONS:
        assert f"``{reason}``" in doc


def test_protocol_error_is_a_monarch_error():
    err = ProtocolError("replay", "ctl #3")
    assert isinstance(err, MonarchError)
    assert err.reason == "replay"
    assert str(err) == "replay: ctl #3"
    assert str(ProtocolError("bad-signature")) == "bad-signature"


def test_new_key_is_random_32_bytes():
    a, b = new_key(), new_key()
    assert len(a) == len(b) == 32
    assert a != b


@pytest.mark.parametrize("key", [b"", b"short", b"x" * 15])
def test_short_key_refused(key):
    with pytest.raises(ValueError, match="16 bytes"):
        Codec(key, "ctl")


# -- round trips --------------------------------------------------------------

def test_round_trip_no_payload_no_meta(sender, receiver):
    frames = sender.sign(Kind.PING)
    assert len(frames) == 1  # signature + header in one frame, no payload frames
    assert len(frames[0]) == SIGNATURE_BYTES + HEAD.size + len(b"ctl")  # no lengths, no meta
    msg = receiver.verify(frames)
    assert isinstance(msg, Message)
    assert msg.kind is Kind.PING
    assert msg.meta == {}
    assert msg.payload == []
    h = msg.header
    assert (h.sender, h.seq, h.call, h.lengths, h.version) == ("ctl", 1, 0, (), VERSION)


def test_round_trip_with_payload_and_meta(separate, receiver):
    payload = [b"fn-pickle", b"", b"\x00" * 100]
    meta = {"code": "print(1)", "name": "<cell>", "setup": True}
    frames = separate.sign(Kind.EXEC, payload, call=42, meta=meta)
    assert len(frames) == 1 + len(payload)
    assert [bytes(f) for f in frames[1:]] == payload  # payload frames travel as they are
    msg = receiver.verify(frames)
    assert msg.kind is Kind.EXEC
    assert msg.header.call == 42
    assert msg.meta == meta
    assert [bytes(p) for p in msg.payload] == payload
    assert msg.header.lengths == (9, 0, 100)


def test_small_first_payload_travels_inside_the_first_frame(sender, receiver):
    """The no-op path's layout: payload frame 0 up to INLINE_MAX is appended
    to signature + header, so a call to a cached function is one frame."""
    payload = [b"fn-pickle" * 10, b"\x00" * 100]
    frames = sender.sign(Kind.CALL, payload, call=5, meta={"generation": 1})
    assert len(frames) == len(payload)  # frame 0 merged into the first frame
    assert bytes(frames[0]).endswith(payload[0])
    assert [bytes(f) for f in frames[1:]] == payload[1:]
    assert HEAD.unpack_from(bytes(frames[0]), SIGNATURE_BYTES)[2] == INLINE
    msg = receiver.verify(frames)
    assert [bytes(p) for p in msg.payload] == payload
    assert (msg.call, msg.meta, msg.lengths) == (5, {"generation": 1}, (90, 100))
    assert len(sender.sign(Kind.CALL, [b"x"])) == 1


@pytest.mark.parametrize("size,inline", [(0, True), (INLINE_MAX, True), (INLINE_MAX + 1, False)])
def test_inline_threshold(sender, receiver, size, inline):
    frames = sender.sign(Kind.RESULT, [b"v" * size, b"w"])
    assert len(frames) == (2 if inline else 3)
    assert [bytes(p) for p in receiver.verify(frames).payload] == [b"v" * size, b"w"]


def test_inline_payload_byte_flips_fail_signature(sender, receiver):
    frames = sender.sign(Kind.CALL, [b"inline-part"], meta={"generation": 1})
    first = bytearray(frames[0])
    for i in range(len(first) - len(b"inline-part"), len(first)):
        bad = bytearray(first)
        bad[i] ^= 0x01
        assert reason_of(receiver, [bytes(bad)]) == "bad-signature"
    assert receiver.verify(frames).payload == [b"inline-part"]


def test_inline_payload_moved_to_a_frame_of_its_own_is_refused(sender, receiver):
    # Same signed bytes, split after the header: the INLINE flag (signed)
    # says payload 0 ends the first frame, which no longer has room for it.
    (first,) = sender.sign(Kind.CALL, [b"abcdef"])
    assert reason_of(receiver, [first[:-6], first[-6:]]) == "malformed"
    assert reason_of(receiver, [first[:-3], first[-3:]]) == "malformed"
    # ...and with meta in front of it, the meta is cut or the frame count is off
    (first,) = sender.sign(Kind.CALL, [b"abcdef"], meta={"generation": 1})
    assert reason_of(receiver, [first[:-6], first[-6:]]) in ("malformed", "truncated")
    assert receiver.verify([first]).payload == [b"abcdef"]


@pytest.mark.parametrize("lengths,tail,flags", [
    pytest.param((10,), b"x" * 4, INLINE, id="inline-longer-than-frame"),
    pytest.param((), b"", INLINE, id="inline-without-payload"),
    pytest.param((INLINE_MAX + 1,), b"x" * (INLINE_MAX + 1), INLINE, id="inline-over-limit"),
    pytest.param((1,), b"x", 0x02, id="unknown-flag"),
    pytest.param((1,), b"x", 0xFF, id="all-flags"),
])
def test_bad_inline_headers_are_malformed(receiver, lengths, tail, flags):
    header = raw_header(code=code_of(Kind.CALL), lengths=lengths, flags=flags) + tail
    assert reason_of(receiver, forge(header)) == "malformed"


def test_meta_only(sender, receiver):
    msg = receiver.verify(sender.sign(Kind.HELLO, meta={"pid": 123, "host": "h\u00e9"}))
    assert msg.meta == {"pid": 123, "host": "h\u00e9"}


def test_every_kind_round_trips(sender, receiver):
    for kind in Kind:
        assert receiver.verify(sender.sign(kind)).kind is kind


def test_non_ascii_sender_round_trips(receiver):
    codec = Codec(KEY, "r\u00e4nk-7")
    assert receiver.verify(codec.sign(Kind.HEARTBEAT)).header.sender == "r\u00e4nk-7"


@pytest.mark.parametrize("size", [0, 1, SMALL, SMALL + 1, 5 * SMALL])
def test_signature_is_hmac_sha256_over_header_then_payload(sender, receiver, size):
    """Both signing paths (one joined buffer below SMALL, frame by frame
    above) agree with the documented definition, and verify accepts them."""
    payload = [b"a" * size, b"b" * 7]
    frames = sender.sign(Kind.CALL, payload, meta={"generation": 1})
    sig, body, rest = split(frames)
    header = header_of(body, payload)
    expected = hmac.new(KEY, header + b"".join(payload), hashlib.sha256).digest()
    assert sig == expected
    assert bytes(frames[0]) == expected + body  # the signature comes first, then the header
    assert [bytes(p) for p in receiver.verify(join(sig, body, rest)).payload] == payload


@pytest.mark.parametrize("key_len", [16, 32, 63, 64, 65, 200])
@pytest.mark.parametrize("payload", [[], [b""], [b"p" * 100], [b"q" * (SMALL + 3), b"r"]],
                         ids=["none", "empty", "small", "large"])
def test_signature_equals_the_standard_hmac_for_any_key_length(key_len, payload):
    """The codec computes HMAC-SHA256 from precomputed keyed states (RFC 2104
    by hand, for speed): it must give the bytes hmac.new gives, keys longer
    than SHA-256's block (hashed first) included."""
    key = bytes(range(256))[:key_len] if key_len <= 256 else b""
    codec = Codec(key, "rank0")
    frames = codec.sign(Kind.RESULT, payload, call=3, meta={"ok": True} if payload else None)
    sig, body, _rest = split(frames)
    header = header_of(body, payload)
    assert sig == hmac.new(key, header + b"".join(payload), hashlib.sha256).digest()
    assert Codec(key, "ctl").verify(frames).call == 3


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview], ids=["bytes", "bytearray", "memoryview"])
def test_buffer_types_accepted(sender, receiver, wrap):
    payload = [wrap(b"x" * 10), wrap(b"y" * (SMALL + 10))]
    frames = sender.sign(Kind.CALL, payload)
    msg = receiver.verify([wrap(bytes(f)) for f in frames])
    assert [bytes(p) for p in msg.payload] == [b"x" * 10, b"y" * (SMALL + 10)]


def test_seq_increments_per_message(sender, receiver):
    seqs = [receiver.verify(sender.sign(Kind.PING)).header.seq for _ in range(5)]
    assert seqs == [1, 2, 3, 4, 5]


def test_header_is_not_pickled(separate):
    _, header, _ = split(separate.sign(Kind.CALL, [b"p"], meta={"generation": 1}))
    assert not header.startswith(b"\x80")  # no pickle protocol opcode
    version, code, _flags, seq, call, slen, n = HEAD.unpack_from(header)
    assert (version, code, seq, call, slen, n) == (VERSION, code_of(Kind.CALL), 1, 0, 3, 1)
    assert header.endswith(b'{"generation":1}')


# -- tampering ----------------------------------------------------------------

def _tamper_positions():
    # (frame index, byte index): first, middle and last byte of the signature
    # and of the header (both in frame 0), and of each of two payload frames
    frames = Codec(KEY, "ctl").sign(Kind.CALL, [b"first-payload", b"second"], call=7, meta={"generation": 1})
    first = len(frames[0])
    out = []
    for part, lo, hi in (("sig", 0, SIGNATURE_BYTES), ("header", SIGNATURE_BYTES, first)):
        for bi in sorted({lo, (lo + hi) // 2, hi - 1}):
            out.append(pytest.param(0, bi, id=f"{part}-byte{bi}"))
    for fi, frame in enumerate(frames[1:], start=1):
        for bi in sorted({0, len(frame) // 2, len(frame) - 1}):
            out.append(pytest.param(fi, bi, id=f"payload{fi}-byte{bi}"))
    return out


@pytest.mark.parametrize("frame_index,byte_index", _tamper_positions())
def test_any_flipped_byte_fails_signature(receiver, frame_index, byte_index):
    frames = Codec(KEY, "ctl").sign(Kind.CALL, [b"first-payload", b"second"], call=7, meta={"generation": 1})
    frames = [bytearray(f) for f in frames]
    frames[frame_index][byte_index] ^= 0x01
    assert reason_of(receiver, [bytes(f) for f in frames]) == "bad-signature"


def test_every_single_byte_of_every_frame_is_covered(receiver):
    frames = Codec(KEY, "ctl").sign(Kind.CALL, [b"abc", b"de"], meta={"generation": 0})
    for fi, frame in enumerate(frames):
        for bi in range(len(frame)):
            tampered = [bytearray(f) for f in frames]
            tampered[fi][bi] ^= 0x80
            assert reason_of(receiver, [bytes(f) for f in tampered]) == "bad-signature", (fi, bi)


def test_tampered_large_payload(sender, receiver):
    big = bytearray(b"z" * (4 * SMALL))
    frames = sender.sign(Kind.CALL, [bytes(big)])
    big[3 * SMALL] ^= 1
    assert reason_of(receiver, [frames[0], bytes(big)]) == "bad-signature"


def test_wrong_key(receiver):
    frames = Codec(OTHER_KEY, "ctl").sign(Kind.CALL, [b"p"], meta={"generation": 1})
    assert reason_of(receiver, frames) == "bad-signature"


@pytest.mark.parametrize("make_sig", [
    pytest.param(lambda good: b"\x00" * 32, id="zeros"),
    pytest.param(lambda good: b"\x00" * 31, id="31-zeros"),
    pytest.param(lambda good: b"\x00" * 33, id="33-zeros"),
    pytest.param(lambda good: good[:-1], id="good-sig-minus-last-byte"),
    pytest.param(lambda good: good[1:], id="good-sig-minus-first-byte"),
    pytest.param(lambda good: good + b"\x00", id="good-sig-plus-one-byte"),
    pytest.param(lambda good: b"", id="no-sig"),
])
def test_bad_signature_lengths(sender, receiver, make_sig):
    # The signature has no delimiter of its own: a wrong-length one shifts the
    # header boundary, and the message must still be refused.
    good, header, _ = split(sender.sign(Kind.EXEC, meta={"code": "x" * 40}))
    assert len(header) >= MIN_FIRST  # so that even "no-sig" is long enough to get to the HMAC
    assert reason_of(receiver, join(make_sig(good), header)) == "bad-signature"


def test_header_without_signature_short_is_truncated(sender, receiver):
    good, header, _ = split(sender.sign(Kind.PING))
    assert len(header) < MIN_FIRST
    assert reason_of(receiver, [header]) == "truncated"
    assert reason_of(receiver, [good]) == "truncated"  # signature alone
    assert receiver.verify(join(good, header)).header.seq == 1  # neither attempt used the seq


def test_appended_payload_frame_fails_signature(separate, receiver):
    frames = separate.sign(Kind.CALL, [b"p"])
    assert reason_of(receiver, [*frames, b"extra"]) == "bad-signature"


def test_swapped_payload_frames_fail_signature(separate, receiver):
    first, a, b = separate.sign(Kind.CALL, [b"aaaa", b"bbbb"])
    assert reason_of(receiver, [first, b, a]) == "bad-signature"


def test_failed_verify_does_not_consume_the_seq(separate, receiver):
    frames = separate.sign(Kind.CALL, [b"p"])
    with pytest.raises(ProtocolError):
        receiver.verify([frames[0], b"q"])
    assert receiver.verify(frames).header.seq == 1


# -- truncation ---------------------------------------------------------------

def test_no_frames_is_truncated(receiver):
    assert reason_of(receiver, []) == "truncated"
    assert reason_of(receiver, ()) == "truncated"


@pytest.mark.parametrize("length", [0, 1, SIGNATURE_BYTES - 1, SIGNATURE_BYTES,
                                    SIGNATURE_BYTES + 1, MIN_FIRST - 1])
def test_first_frame_shorter_than_signature_plus_head_is_truncated(receiver, length):
    assert reason_of(receiver, [b"\x00" * length]) == "truncated"
    assert reason_of(receiver, [b"\x00" * length, b"payload"]) == "truncated"


def test_first_frame_cut_anywhere_is_refused(separate, receiver):
    frames = separate.sign(Kind.CALL, [b"abc"], call=3, meta={"generation": 1})
    first = bytes(frames[0])
    for cut in range(len(first)):
        want = "truncated" if cut < MIN_FIRST else "bad-signature"
        assert reason_of(receiver, [first[:cut], *frames[1:]]) == want, cut
    assert receiver.verify(frames).header.seq == 1  # none of that consumed the seq


def test_first_frame_of_exactly_minimum_length_is_accepted(receiver):
    # The bound is tight: signature + bare HEAD (empty sender, no payload, no meta).
    frames = forge(raw_header(sender=b""))
    assert len(frames[0]) == MIN_FIRST
    msg = receiver.verify(frames)
    assert (msg.header.sender, msg.payload, msg.meta) == ("", [], {})


def test_old_layout_is_refused(separate, receiver):
    # A correctly signed message in the previous layout [signature, header, *payload]
    # (a peer on the old wire format) is never accepted.
    sig, header, payload = split(separate.sign(Kind.CALL, [b"p"], meta={"generation": 1}))
    assert reason_of(receiver, [sig, header, *payload]) == "truncated"


def test_dropped_first_frame_is_refused(separate, receiver):
    # Only payload frames left: the first payload frame is read as signature + header.
    frames = separate.sign(Kind.CALL, [b"x" * 100, b"y" * 5])
    assert reason_of(receiver, frames[1:]) == "bad-signature"
    frames = separate.sign(Kind.CALL, [b"x" * 10, b"y" * 5])
    assert reason_of(receiver, frames[1:]) == "truncated"


def test_dropped_payload_frame_fails_signature(separate, receiver):
    frames = separate.sign(Kind.CALL, [b"aaa", b"bbb"])
    assert reason_of(receiver, frames[:-1]) == "bad-signature"


def test_dropped_empty_payload_frame_is_truncated(separate, receiver):
    # The signed bytes are the same without an empty frame; only the lengths
    # listed in the header catch it.
    frames = separate.sign(Kind.CALL, [b"aaa", b""])
    assert reason_of(receiver, frames[:-1]) == "truncated"


def test_moved_frame_boundary_is_truncated(separate, receiver):
    # Same concatenated bytes (valid HMAC) split differently: the signed
    # lengths in the header reject it.
    first, a, b = separate.sign(Kind.CALL, [b"aaaa", b"bbbb"])
    assert reason_of(receiver, [first, a + b[:2], b[2:]]) == "truncated"
    assert reason_of(receiver, [first, a + b]) == "truncated"
    assert receiver.verify([first, a, b]).header.seq == 1  # none of that consumed the seq


def test_moved_header_payload_boundary_is_refused(separate, receiver):
    # Signature + header and the first payload frame: moving bytes between them
    # keeps the HMAC input (header then payload) identical; the header must
    # then fail to parse or disagree with the frames.
    first, a, b = separate.sign(Kind.CALL, [b'{}aaaa', b"bbbb"])  # payload that is a JSON object
    # payload bytes moved into the header (the header had no meta: it now "has" {})
    assert reason_of(receiver, [first + a[:2], a[2:], b]) == "truncated"
    assert reason_of(receiver, [first + a[:1], a[1:], b]) == "malformed"
    assert reason_of(receiver, [first + a, b]) == "malformed"
    # header bytes moved into the payload (the lengths are cut short)
    assert reason_of(receiver, [first[:-1], first[-1:] + a, b]) == "malformed"
    assert reason_of(receiver, [first[:-16], first[-16:] + a, b]) == "malformed"
    first, a = separate.sign(Kind.CALL, [b"aaaa"], meta={"generation": 1})
    assert reason_of(receiver, [first[:-1], first[-1:] + a]) == "malformed"
    assert reason_of(receiver, [first[:-16], first[-16:] + a]) == "truncated"  # whole meta moved


def test_shortened_payload_frame_fails_signature(separate, receiver):
    first, a = separate.sign(Kind.CALL, [b"aaaa"])
    assert reason_of(receiver, [first, a[:-1]]) == "bad-signature"


@pytest.mark.parametrize("claimed,actual", [
    ((10,), [b"x" * 5]),
    ((5,), [b"x" * 10]),
    ((5, 5), [b"x" * 5]),
    ((5,), [b"x" * 5, b""]),
])
def test_header_lengths_differ_from_frames(receiver, claimed, actual):
    header = raw_header(code=code_of(Kind.CALL), lengths=claimed)
    assert reason_of(receiver, forge(header, actual)) == "truncated"


# -- size limits --------------------------------------------------------------

def test_max_bytes(separate):
    small = Codec(KEY, "rank0", max_bytes=100)
    assert small.verify(separate.sign(Kind.CALL, [b"x" * 60, b"y" * 40])).payload
    assert reason_of(small, separate.sign(Kind.CALL, [b"x" * 60, b"y" * 41])) == "oversized"


def test_oversized_checked_before_signature():
    small = Codec(KEY, "rank0", max_bytes=10)
    frames = Codec(OTHER_KEY, "ctl", inline_max=-1).sign(Kind.CALL, [b"x" * 11])
    assert reason_of(small, frames) == "oversized"


def test_header_too_large(receiver):
    header = raw_header(code=1, meta=json.dumps({"code": "x" * MAX_HEADER_BYTES}).encode())
    assert len(header) > MAX_HEADER_BYTES
    assert reason_of(receiver, forge(header)) == "oversized"
    # by one byte
    base = raw_header(code=1, meta=b'{"code":""}')
    header = raw_header(code=1, meta=b'{"code":"' + b"x" * (MAX_HEADER_BYTES - len(base) + 1) + b'"}')
    assert len(header) == MAX_HEADER_BYTES + 1
    assert reason_of(receiver, forge(header)) == "oversized"


def test_header_at_limit_is_accepted(receiver):
    base = raw_header(code=1, meta=b'{"code":""}')
    pad = MAX_HEADER_BYTES - len(base)
    header = raw_header(code=1, meta=b'{"code":"' + b"x" * pad + b'"}')
    assert len(header) == MAX_HEADER_BYTES
    assert len(receiver.verify(forge(header)).meta["code"]) == pad


def test_too_many_frames(separate, receiver):
    ok = separate.sign(Kind.CALL, [b""] * (MAX_FRAMES - 1))
    assert len(ok) == MAX_FRAMES
    assert len(receiver.verify(ok).payload) == MAX_FRAMES - 1
    too_many = separate.sign(Kind.CALL, [b""] * MAX_FRAMES)
    assert len(too_many) == MAX_FRAMES + 1
    assert reason_of(receiver, too_many) == "oversized"


# -- malformed headers (signed with the right key) ----------------------------

@pytest.mark.parametrize("header", [
    pytest.param(b"", id="empty"),
    pytest.param(b"\x01\x02", id="two-bytes"),
    pytest.param(HEAD.pack(VERSION, 0, 0, 1, 0, 3, 0)[:-1], id="short-struct"),
])
def test_signed_header_shorter_than_head_is_truncated(receiver, header):
    # Validly signed, but signature + header is shorter than SIGNATURE_BYTES + HEAD.size.
    assert reason_of(receiver, forge(header)) == "truncated"


@pytest.mark.parametrize("header", [
    pytest.param(HEAD.pack(VERSION, 0, 0, 1, 0, 3, 0), id="sender-missing"),
    pytest.param(HEAD.pack(VERSION, 0, 0, 1, 0, 3, 0) + b"ct", id="sender-cut-short"),
    pytest.param(raw_header(meta=b"\x00garbage\xff"), id="garbage-after-struct"),
    pytest.param(raw_header(meta=b"not json"), id="non-json-meta"),
    pytest.param(raw_header(meta=b"[1, 2]"), id="list-meta"),
    pytest.param(raw_header(meta=b'"text"'), id="string-meta"),
    pytest.param(raw_header(meta=b"3"), id="number-meta"),
    pytest.param(raw_header(meta=b"null"), id="null-meta"),
    pytest.param(raw_header(meta=b'{"a": 1'), id="unterminated-meta"),
    pytest.param(raw_header(code=len(Kind)), id="unknown-kind"),
    pytest.param(raw_header(code=255), id="kind-255"),
    pytest.param(raw_header(sender=b"\xff\xfe"), id="sender-not-utf8"),
    pytest.param(raw_header(lengths=(), nframes=3), id="lengths-missing"),
])
def test_malformed_header_with_valid_signature(receiver, header):
    assert reason_of(receiver, forge(header)) == "malformed"


def test_deeply_nested_meta_is_malformed(receiver):
    header = raw_header(meta=b"[" * 50_000)
    assert len(header) < MAX_HEADER_BYTES
    assert reason_of(receiver, forge(header)) == "malformed"


@pytest.mark.parametrize("version", [0, VERSION + 1, 255])
def test_wrong_version(receiver, version):
    header = raw_header(version=version)
    with pytest.raises(ProtocolError) as info:
        receiver.verify(forge(header))
    assert info.value.reason == "version"
    assert f"v{version}" in str(info.value)


def test_wrong_version_with_bad_signature_is_bad_signature(receiver):
    header = raw_header(version=VERSION + 1)
    assert reason_of(receiver, forge(header, key=OTHER_KEY)) == "bad-signature"


def test_forged_header_with_valid_layout_is_accepted(receiver):
    # sanity check of the helpers used above
    header = raw_header(code=code_of(Kind.RESULT), seq=9, call=3, lengths=(2,),
                        meta=b'{"ok":true}')
    msg = receiver.verify(forge(header, [b"hi"]))
    assert (msg.kind, msg.header.seq, msg.header.call, msg.meta) == (Kind.RESULT, 9, 3, {"ok": True})


# -- replay -------------------------------------------------------------------

def test_same_frames_twice_is_replay(sender, receiver):
    frames = sender.sign(Kind.CALL, [b"p"], meta={"generation": 1})
    receiver.verify(frames)
    with pytest.raises(ProtocolError) as info:
        receiver.verify(frames)
    assert info.value.reason == "replay"
    assert "ctl" in str(info.value) and "#1" in str(info.value)


def test_out_of_order_accepted_once_each(sender, receiver):
    batch = [sender.sign(Kind.OUTPUT, [b"%d" % i]) for i in range(6)]
    order = [3, 0, 5, 1, 4, 2]
    for i in order:
        assert receiver.verify(batch[i]).header.seq == i + 1
    for i in order:
        assert reason_of(receiver, batch[i]) == "replay"


def test_seq_older_than_window_rejected(receiver):
    top = REPLAY_WINDOW + 1000
    receiver.verify(forge(raw_header(seq=top)))
    assert reason_of(receiver, forge(raw_header(seq=top - REPLAY_WINDOW))) == "replay"
    assert receiver.verify(forge(raw_header(seq=top - REPLAY_WINDOW + 1))).header.seq == top - REPLAY_WINDOW + 1
    assert reason_of(receiver, forge(raw_header(seq=1))) == "replay"


def test_replay_windows_are_per_sender(receiver):
    a, b = Codec(KEY, "rank1"), Codec(KEY, "rank2")
    assert receiver.verify(a.sign(Kind.PING)).header.seq == 1
    assert receiver.verify(b.sign(Kind.PING)).header.seq == 1


def test_forget_drops_the_window(sender, receiver):
    frames = sender.sign(Kind.PING)
    receiver.verify(frames)
    receiver.forget("ctl")
    receiver.forget("never-seen")  # no error
    assert receiver.verify(frames).header.seq == 1


def test_sign_once_send_to_many(sender):
    frames = sender.sign(Kind.CALL, [b"fn", b"x" * (SMALL + 1)], call=5, meta={"generation": 1})
    receivers = [Codec(KEY, f"rank{i}") for i in range(4)]
    for r in receivers:
        msg = r.verify(list(frames))
        assert (msg.kind, msg.header.seq, msg.header.call, msg.meta) == (Kind.CALL, 1, 5, {"generation": 1})
        assert [bytes(p) for p in msg.payload] == [b"fn", b"x" * (SMALL + 1)]
    for r in receivers:  # each still refuses a second copy
        assert reason_of(r, frames) == "replay"


# -- sender mismatch ----------------------------------------------------------

def test_expected_sender_matching_is_accepted(sender, receiver):
    msg = receiver.verify(sender.sign(Kind.PING), expected_sender="ctl")
    assert msg.header.sender == "ctl"


@pytest.mark.parametrize("claimed", ["rank0", "ctl ", "CTL", "", "ct"])
def test_signed_sender_must_equal_expected_sender(sender, receiver, claimed):
    with pytest.raises(ProtocolError) as info:
        receiver.verify(sender.sign(Kind.PING), expected_sender=claimed)
    assert info.value.reason == "sender-mismatch"
    assert "ctl" in str(info.value)


def test_sender_mismatch_does_not_touch_the_replay_window(receiver):
    """A key holder on another socket signs as "rank1" with a huge seq: refused
    before the window, so rank1's own messages still get through."""
    forger = Codec(KEY, "rank1")
    forger._seq = iter([2**62])
    forged = forger.sign(Kind.HEARTBEAT)
    assert reason_of(receiver, forged, expected_sender="x2") == "sender-mismatch"
    assert "rank1" not in receiver._windows
    genuine = Codec(KEY, "rank1")
    assert receiver.verify(genuine.sign(Kind.HEARTBEAT), expected_sender="rank1").header.seq == 1
    # The forged frames were not consumed either: from the right identity they verify once.
    assert receiver.verify(forged, expected_sender="rank1").header.seq == 2**62


def test_sender_mismatch_does_not_consume_the_seq(sender, receiver):
    frames = sender.sign(Kind.CALL, [b"p"])
    assert reason_of(receiver, frames, expected_sender="other") == "sender-mismatch"
    assert receiver.verify(frames, expected_sender="ctl").header.seq == 1
    assert reason_of(receiver, frames, expected_sender="ctl") == "replay"


def test_sender_mismatch_is_checked_before_replay(sender, receiver):
    frames = sender.sign(Kind.PING)
    receiver.verify(frames, expected_sender="ctl")
    assert reason_of(receiver, frames, expected_sender="rank9") == "sender-mismatch"
    assert reason_of(receiver, frames, expected_sender="ctl") == "replay"


def test_signature_and_framing_are_checked_before_sender(receiver):
    wrong_key = Codec(OTHER_KEY, "ctl").sign(Kind.PING)
    assert reason_of(receiver, wrong_key, expected_sender="rank9") == "bad-signature"
    assert reason_of(receiver, [], expected_sender="rank9") == "truncated"
    assert reason_of(receiver, forge(raw_header(lengths=(3,)), [b"ab"]), expected_sender="x") == "truncated"
    assert reason_of(receiver, forge(raw_header(meta=b"[]")), expected_sender="x") == "malformed"
    assert reason_of(receiver, forge(raw_header(version=0)), expected_sender="x") == "version"


@pytest.mark.parametrize("frames_fn,reason", [
    (lambda s: [], "truncated"),
    (lambda s: Codec(OTHER_KEY, "ctl").sign(Kind.PING), "bad-signature"),
    (lambda s: forge(raw_header(meta=b"[]")), "malformed"),
    (lambda s: forge(raw_header(version=VERSION + 1)), "version"),
    (lambda s: forge(raw_header(lengths=(3,)), [b"ab"]), "truncated"),
    (lambda s: forge(raw_header(code=1, meta=b'{"code":"' + b"x" * MAX_HEADER_BYTES + b'"}')), "oversized"),
    (lambda s: [b"\x00" * 32 + b"h" * 64] + [b""] * MAX_FRAMES, "oversized"),
    (lambda s: [b"\x00" * (SIGNATURE_BYTES + HEAD.size - 1)], "truncated"),
])
def test_every_reason_is_documented(sender, receiver, frames_fn, reason):
    got = reason_of(receiver, frames_fn(sender))
    assert got == reason
    assert got in DOCUMENTED_REASONS


def test_replay_reason_is_documented(sender, receiver):
    frames = sender.sign(Kind.PING)
    receiver.verify(frames)
    assert reason_of(receiver, frames) in DOCUMENTED_REASONS


# -- nothing is unpickled -----------------------------------------------------

def write_marker(path: str) -> str:
    Path(path).write_text("unpickled!")
    return path


class Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (write_marker, (self.path,))


@pytest.fixture
def evil_payload(tmp_path):
    marker = tmp_path / "marker"
    return marker, pickle.dumps(Evil(str(marker)))


def test_bad_signature_never_unpickles(sender, receiver, evil_payload, monkeypatch):
    marker, evil = evil_payload
    frames = Codec(OTHER_KEY, "ctl").sign(Kind.CALL, [evil])
    assert reason_of(receiver, frames) == "bad-signature"
    assert not marker.exists()


def test_verify_never_unpickles_and_returns_payload_untouched(separate, receiver, evil_payload,
                                                              monkeypatch):
    marker, evil = evil_payload

    def no_unpickling(*a, **k):
        raise AssertionError("verify must not unpickle")

    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "Unpickler", no_unpickling)
    frames = separate.sign(Kind.CALL, [evil])
    msg = receiver.verify(frames)
    assert not marker.exists()
    assert msg.payload[0] is frames[1]  # the very frame, not a copy or a decoding
    monkeypatch.undo()
    # The payload really is dangerous: this is what verify never did.
    assert pickle.loads(msg.payload[0]) == str(marker)
    assert marker.exists()


def test_verify_never_unpickles_an_inline_payload(sender, receiver, evil_payload, monkeypatch):
    marker, evil = evil_payload

    def no_unpickling(*a, **k):
        raise AssertionError("verify must not unpickle")

    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(pickle, "Unpickler", no_unpickling)
    frames = sender.sign(Kind.CALL, [evil])
    assert len(frames) == 1
    msg = receiver.verify(frames)
    assert bytes(msg.payload[0]) == evil
    assert not marker.exists()


@pytest.mark.parametrize("mutate", ["header", "payload", "signature"])
def test_tampered_evil_payload_never_unpickled(separate, receiver, evil_payload, mutate):
    marker, evil = evil_payload
    sig, header, (payload,) = split(separate.sign(Kind.CALL, [evil]))
    if mutate == "header":
        header = header[:-1] + bytes([header[-1] ^ 1])
    elif mutate == "payload":
        payload = payload + b"."
    else:
        sig = bytes(32)
    assert reason_of(receiver, join(sig, header, [payload])) == "bad-signature"
    assert not marker.exists()


# -- ReplayWindow -------------------------------------------------------------

def test_window_accepts_once():
    w = ReplayWindow(size=8)
    assert w.check_and_add(1)
    assert not w.check_and_add(1)
    assert w.highest == 1


def test_window_accepts_zero_first():
    w = ReplayWindow(size=8)
    assert w.check_and_add(0)
    assert not w.check_and_add(0)


def test_window_out_of_order():
    w = ReplayWindow(size=8)
    for seq in (5, 2, 7, 1, 3):
        assert w.check_and_add(seq)
    for seq in (5, 2, 7, 1, 3):
        assert not w.check_and_add(seq)
    assert w.check_and_add(4) and w.check_and_add(6)
    assert w.highest == 7


@pytest.mark.parametrize("size", [1, 4, 100])
def test_window_boundary(size):
    w = ReplayWindow(size=size)
    top = 10 * size
    assert w.check_and_add(top)
    assert not w.check_and_add(top - size)  # exactly ``size`` behind: too old
    assert not w.check_and_add(0)
    if size > 1:
        assert w.check_and_add(top - size + 1)  # newest seq still in the window


def test_window_slides():
    w = ReplayWindow(size=4)
    assert w.check_and_add(3)
    assert w.check_and_add(10)
    assert not w.check_and_add(3)  # now behind the window
    assert not w.check_and_add(6)
    assert w.check_and_add(7)


def test_window_memory_is_bounded_and_still_rejects_replays():
    w = ReplayWindow(size=16)
    for seq in range(1, 1000):
        assert w.check_and_add(seq)
    assert len(w._seen) <= 2 * 16 + 1
    for seq in range(1, 1000):  # every one of them is still refused
        assert not w.check_and_add(seq), seq
    assert w.check_and_add(1000)


def test_window_default_size():
    assert ReplayWindow().size == REPLAY_WINDOW


def test_every_kind_has_its_meta_written_down_and_signing_holds_to_it(separate):
    from monarch_nb.wire.protocol import META

    # a kind without a schema carries no meta; every schema field has JSON types
    assert set(META) <= set(Kind)
    with pytest.raises(ValueError, match="call meta has no field 'typo'"):
        separate.sign(Kind.CALL, [b"p"], meta={"typo": 1})
    with pytest.raises(ValueError, match="'generation' must be int, not str"):
        separate.sign(Kind.REFORM, meta={"generation": "1", "port": 2})
    with pytest.raises(ValueError, match="must be int, not bool"):
        separate.sign(Kind.OUTPUT, meta={"n": True})
    with pytest.raises(ValueError, match="stop meta has no field"):
        separate.sign(Kind.STOP, meta={"now": True})


def test_a_signed_meta_outside_the_schema_is_dropped_as_malformed(receiver):
    # signed with the right key (a key holder, or a newer sender): still dropped
    wrong_type = forge(raw_header(code=list(Kind).index(Kind.REFORM),
                                  meta=b'{"generation":"x","port":1}'))
    assert reason_of(receiver, wrong_type) == "malformed"
    unknown = forge(raw_header(code=list(Kind).index(Kind.RESULT), seq=2, meta=b'{"evil":1}'))
    assert reason_of(receiver, unknown) == "malformed"
