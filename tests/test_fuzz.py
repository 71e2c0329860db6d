"""Property tests (hypothesis) for every parser of input from outside.

DESIGN rule 8: bad input gets a clear error and loses nothing; a malformed or
forged message is dropped and counted, never executed. Each property below
says what must hold for *every* input hypothesis can make:

* the message verifier (``Codec.verify``): random frames, frames of a real
  message cut, flipped, re-split, dropped or appended, headers signed with
  the right key but laid out wrong, replays and reordering. It raises only
  :class:`ProtocolError` with a documented reason, returns a message only
  when the signed content is exactly what was sent, and never unpickles
  (checked with an audit hook on ``pickle.find_class``, and with a payload
  that creates a file when it is unpickled);
* the replay window, against a two-line model of what it must accept;
* the rank-spec parser: a sorted tuple of distinct ranks in range, or
  :class:`UsageError`, and nothing else (no hang on ``0-99999999999``);
* the magic argument parsers, and the ``%monarch`` dispatcher without a
  mesh: only ``UsageError``/``MeshNotRunning``;
* the METRICS frame decoder: never raises, returns only well-typed points;
* the lab comm handler: a malformed message gets an error reply (or none)
  and never raises, never restarts a rank;
* and a real 1-rank CPU mesh fed garbage over real ZeroMQ sockets, both at
  the controller's ROUTER and at the rank's own DEALERs: everything is
  counted as dropped, nothing runs, and the rank answers a call afterwards.

Example counts are kept small (the file runs in well under a minute on two
cores); ``database=None`` keeps hypothesis from writing into the checkout.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import math
import os
import pathlib
import struct
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from monarch_nb import Mesh
from monarch_nb.config import MeshConfig
from monarch_nb.errors import MeshNotRunning, ProtocolError, UsageError
from monarch_nb.selection import parse_ranks
from monarch_nb.ui import magics as magics_mod
from monarch_nb.ui.labcomm import Hub
from monarch_nb.wire import metricframes, protocol, serialize
from monarch_nb.wire.protocol import (
    HEAD,
    INLINE_MAX,
    SMALL,
    VERSION,
    Codec,
    Kind,
    Message,
    ReplayWindow,
)

from .conftest import wait_for

KEY = bytes(range(32))
REASONS = {"bad-signature", "replay", "truncated", "malformed", "oversized", "version",
           "sender-mismatch"}
FAST = settings(max_examples=150, deadline=None, database=None)
SLOW = settings(max_examples=25, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

# -- "never unpickled": an audit hook sees every global a pickle looks up -----------------
_armed = threading.local()
_unpickled: list[str] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "pickle.find_class" and getattr(_armed, "on", False):
        _unpickled.append(f"{args[0]}.{args[1]}")


sys.addaudithook(_audit)  # (cannot be removed; costs nothing while not armed)


@contextlib.contextmanager
def no_unpickling() -> Iterator[None]:
    """Fail if anything is unpickled on this thread inside the block."""
    _unpickled.clear()
    _armed.on = True
    try:
        yield
    finally:
        _armed.on = False
    assert not _unpickled, f"unpickled during verification: {_unpickled}"


class _Evil:
    """Unpickling this creates ``path`` (a stand-in for arbitrary code)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def evil_payload(marker: pathlib.Path) -> list[bytes]:
    return [bytes(f) for f in serialize.dumps(_Evil(marker))]


def test_the_unpickling_detectors_can_fail(tmp_path: pathlib.Path) -> None:
    """The audit hook and the marker file really see an unpickle (else the
    properties below could not fail)."""
    marker = tmp_path / "pwned"
    payload = evil_payload(marker)
    with pytest.raises(AssertionError, match="unpickled during verification"), no_unpickling():
        serialize.loads(payload)
    assert marker.exists()


# -- strategies -----------------------------------------------------------------------------
json_scalars = (st.none() | st.booleans() | st.integers() | st.floats()
                | st.text(max_size=12))
json_like = st.recursive(
    json_scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12)
# meta must survive a JSON round trip unchanged: no NaN (NaN != NaN)
meta_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=8)
_BY_TYPE: dict[type, st.SearchStrategy[Any]] = {
    str: st.text(max_size=12), int: st.integers(-2**70, 2**70), bool: st.booleans(),
    dict: st.dictionaries(st.text(max_size=8), meta_values, max_size=3),
    list: st.lists(meta_values, max_size=3), type(None): st.none()}


def metas_for(kind: Kind) -> st.SearchStrategy[dict[str, Any] | None]:
    """Meta that fits ``kind``'s schema (protocol.META, where the protocol
    has one: sign refuses anything else), any subset of its fields."""
    schema = getattr(protocol, "META", None)
    if schema is None:
        return st.none() | st.dictionaries(st.text(max_size=10), meta_values, max_size=4)
    fields = schema.get(kind, {})
    return st.none() | st.fixed_dictionaries(
        {}, optional={k: st.one_of(*(_BY_TYPE[t] for t in types)) for k, types in fields.items()})


kinds_and_metas = st.sampled_from(list(Kind)).flatmap(
    lambda k: st.tuples(st.just(k), metas_for(k)))
# payload frames: small random ones, and sizes at every boundary of the codec
# (inline or not, hashed joined or frame by frame)
sized = st.sampled_from([0, 1, INLINE_MAX, INLINE_MAX + 1, SMALL + 1]).map(lambda n: b"p" * n)
payloads = st.lists(st.binary(max_size=200) | sized, max_size=4)
inline_maxes = st.sampled_from([-1, 0, 64, INLINE_MAX])
random_frames = st.lists(st.binary(max_size=300), min_size=0, max_size=6)

# A mutation of a message: (what, frame index, position, amount). Indexes and
# positions are taken modulo what the message has.
mutations = st.tuples(
    st.sampled_from(["flip", "truncate", "drop", "append", "resplit", "merge", "swap",
                     "duplicate", "extend"]),
    st.integers(0, 1 << 20), st.integers(0, 1 << 30), st.integers(1, 64))


def mutate(frames: list[bytes], how: tuple[str, int, int, int]) -> list[bytes]:
    what, i, pos, amount = how
    out = [bytes(f) for f in frames]
    i %= len(out)
    if what == "flip" and out[i]:
        b = bytearray(out[i])
        b[pos % len(b)] ^= 1 << (amount % 8)
        out[i] = bytes(b)
    elif what == "truncate":
        out[i] = out[i][:max(0, len(out[i]) - amount)]
    elif what == "drop":
        del out[i]
    elif what == "append":
        out.append(os.urandom(amount % 8))
    elif what == "extend":
        out[i] += os.urandom(amount)
    elif what == "resplit" and len(out) > 1:
        # move bytes across the boundary between frames i and i+1 (the HMAC
        # input stays the same: only the signed lengths can catch it)
        j = min(i, len(out) - 2)
        joined = out[j] + out[j + 1]
        cut = pos % (len(joined) + 1)
        out[j], out[j + 1] = joined[:cut], joined[cut:]
    elif what == "merge" and len(out) > 1:
        j = min(i, len(out) - 2)
        out[j:j + 2] = [out[j] + out[j + 1]]
    elif what == "swap" and len(out) > 1:
        j = pos % len(out)
        out[i], out[j] = out[j], out[i]
    elif what == "duplicate":
        out.insert(i, out[i])
    return out


def sign_raw(body: bytes, rest: list[bytes], key: bytes = KEY) -> list[bytes]:
    """``body`` (header and maybe an inline payload) signed as the spec says."""
    h = hmac.new(key, body, hashlib.sha256)
    for p in rest:
        h.update(p)
    return [h.digest() + body, *rest]


@st.composite
def signed_headers(draw: st.DrawFn) -> list[bytes]:
    """A first frame whose header fields are each right or wrong, signed with
    the right key: what a buggy key holder could send."""
    rest = draw(st.lists(st.binary(max_size=40), max_size=4))
    sender = draw(st.binary(max_size=12) | st.just(b"rank.0.main"))
    lengths = draw(st.one_of(st.just([len(p) for p in rest]),
                             st.lists(st.integers(0, 2**64 - 1), max_size=5)))
    nframes = draw(st.one_of(st.just(len(lengths)), st.integers(0, 0xFFFF)))
    slen = draw(st.one_of(st.just(len(sender)), st.integers(0, 0xFFFF)))
    head = HEAD.pack(draw(st.sampled_from([VERSION, VERSION, 0, 255])),
                     draw(st.integers(0, 255)), draw(st.sampled_from([0, 0, 1, 2, 255])),
                     draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**64 - 1)),
                     slen, nframes)
    meta = draw(st.one_of(st.just(b""), json_like.map(lambda v: json.dumps(v).encode()),
                          st.binary(max_size=30)))
    inline = draw(st.binary(max_size=30))
    body = head + sender + struct.pack(f"!{len(lengths)}Q", *lengths) + meta + inline
    return sign_raw(body, rest)


def check_message(msg: Message) -> None:
    """A message verify returned is well typed and matches its framing."""
    assert isinstance(msg.kind, Kind)
    assert isinstance(msg.sender, str) and isinstance(msg.meta, dict)
    assert isinstance(msg.seq, int) and isinstance(msg.call, int)
    assert len(msg.payload) == len(msg.lengths)
    assert [len(bytes(p)) for p in msg.payload] == list(msg.lengths)


# -- 1. the verifier ----------------------------------------------------------------------
@FAST
@given(frames=random_frames, key=st.binary(min_size=16, max_size=64))
def test_random_frames_raise_only_protocol_errors(frames: list[bytes], key: bytes) -> None:
    """Unsigned bytes: always refused, with a documented reason, never unpickled."""
    with no_unpickling(), pytest.raises(ProtocolError) as info:
        Codec(key, "rx").verify(frames)
    assert info.value.reason in REASONS


@FAST
@given(kind_meta=kinds_and_metas, payload=payloads, call=st.integers(0, 2**64 - 1),
       inline_max=inline_maxes)
def test_sign_then_verify_round_trips(kind_meta: tuple[Kind, Any], payload: list[bytes],
                                      call: int, inline_max: int) -> None:
    kind, meta = kind_meta
    tx = Codec(KEY, "tx.0.main", inline_max=inline_max)
    frames = [bytes(f) for f in tx.sign(kind, payload, call=call, meta=meta)]
    with no_unpickling():
        msg = Codec(KEY, "rx").verify(frames, expected_sender="tx.0.main")
    check_message(msg)
    assert (msg.kind, msg.sender, msg.call, msg.meta) == (kind, "tx.0.main", call, meta or {})
    assert [bytes(p) for p in msg.payload] == payload


@FAST
@given(kind_meta=kinds_and_metas, payload=payloads, inline_max=inline_maxes,
       how=st.lists(mutations, min_size=1, max_size=3), right_key=st.booleans())
def test_mutated_messages_are_refused_or_unchanged(
        kind_meta: tuple[Kind, Any], payload: list[bytes], inline_max: int,
        how: list[tuple[str, int, int, int]], right_key: bool) -> None:
    """A real message cut, flipped, re-split, merged, reordered or padded:
    verify refuses it with ProtocolError, or (when the mutations cancel out)
    returns exactly what was signed. Signed with the wrong key, always refused."""
    kind, meta = kind_meta
    tx = Codec(KEY if right_key else bytes(32), "tx", inline_max=inline_max)
    original = [bytes(f) for f in tx.sign(kind, payload, call=7, meta=meta)]
    frames = original
    for m in how:
        if not frames:
            break
        frames = mutate(frames, m)
    rx = Codec(KEY, "rx")
    try:
        with no_unpickling():
            msg = rx.verify(frames)
    except ProtocolError as exc:
        assert exc.reason in REASONS
        assert frames != original or not right_key, "an untouched message was refused"
        return
    assert right_key, "a message signed with another key was accepted"
    check_message(msg)
    assert (msg.kind, msg.call, msg.meta) == (kind, 7, meta or {})
    assert [bytes(p) for p in msg.payload] == payload


@FAST
@given(frames=signed_headers())
def test_signed_but_malformed_headers_raise_only_protocol_errors(frames: list[bytes]) -> None:
    """Right signature, header fields each right or wrong: ProtocolError, or a
    well-typed message whose payload matches the signed lengths."""
    try:
        with no_unpickling():
            msg = Codec(KEY, "rx").verify(frames)
    except ProtocolError as exc:
        assert exc.reason in REASONS
        return
    check_message(msg)


@FAST
@given(n=st.integers(1, 25), data=st.data())
def test_each_message_is_accepted_once_in_any_order(n: int, data: st.DataObject) -> None:
    """Delivered in any order with any repeats: the first delivery of each is
    accepted, every later one is a replay."""
    tx = Codec(KEY, "tx")
    sent = [[bytes(f) for f in tx.sign(Kind.HEARTBEAT, [b"%d" % i])] for i in range(n)]
    order = data.draw(st.lists(st.integers(0, n - 1), max_size=3 * n))
    order += data.draw(st.permutations(range(n)))  # and each at least once
    rx = Codec(KEY, "rx")
    seen: set[int] = set()
    for i in order:
        if i in seen:
            with pytest.raises(ProtocolError, match="replay"):
                rx.verify(sent[i])
        else:
            assert bytes(rx.verify(sent[i]).payload[0]) == b"%d" % i
            seen.add(i)


@FAST
@given(size=st.integers(1, 16), seqs=st.lists(st.integers(0, 120), max_size=200))
def test_replay_window_matches_its_model(size: int, seqs: list[int]) -> None:
    """Accept a sequence number iff never seen and no more than ``size``
    behind the highest seen (also after the window prunes its memory)."""
    window = ReplayWindow(size)
    seen: set[int] = set()
    highest = -1
    for seq in seqs:
        expected = seq not in seen and seq > highest - size
        assert window.check_and_add(seq) == expected, (seq, sorted(seen), highest)
        if expected:
            seen.add(seq)
            highest = max(highest, seq)


def test_wrong_key_evil_payload_is_not_run(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "pwned"
    frames = Codec(bytes(32), "evil").sign(Kind.RESULT, evil_payload(marker), call=1)
    with no_unpickling(), pytest.raises(ProtocolError, match="bad-signature"):
        Codec(KEY, "rx").verify(frames)
    assert not marker.exists()


# -- 2. rank specs ------------------------------------------------------------------------
spec_text = st.one_of(
    st.text(alphabet="0123456789,-: *al", max_size=14),
    st.text(max_size=12),
    st.integers(-10**15, 10**15).map(str),
    st.tuples(st.integers(-10**12, 10**12), st.integers(-10**12, 10**12)).map(
        lambda t: f"{t[0]}-{t[1]}"),
    st.lists(st.integers(-5, 70).map(str), min_size=1, max_size=5).map(",".join),
)
specs = st.one_of(
    spec_text, st.none(), st.booleans(), st.integers(-10**20, 10**20),
    st.lists(st.one_of(st.integers(-3, 70), st.floats(), st.text(max_size=3)), max_size=6),
    st.builds(slice, st.none() | st.integers(-70, 70) | st.text(max_size=2),
              st.none() | st.integers(-70, 70) | st.floats(),
              st.none() | st.integers(-5, 5)),
)


@FAST
@given(spec=specs, world=st.integers(-2, 64))
def test_parse_ranks_returns_ranks_in_range_or_a_usage_error(spec: Any, world: int) -> None:
    try:
        ranks = parse_ranks(spec, world)
    except UsageError as exc:
        assert str(exc)  # says what is wrong
        return
    assert isinstance(ranks, tuple) and ranks
    assert all(type(r) is int and 0 <= r < world for r in ranks)
    assert list(ranks) == sorted(set(ranks))


def test_a_huge_range_is_refused_at_once() -> None:
    """Found by the property above: ``0-99999999999`` built the whole list
    before checking it against the mesh (minutes and gigabytes)."""
    with pytest.raises(UsageError, match=r"rank 4-99999999999 does not exist"):
        parse_ranks("0-99999999999", 4)
    with pytest.raises(UsageError, match=r"rank 4-99999999999 does not exist"):
        parse_ranks("1,2-99999999999", 4)


# -- 3. the magics' argument parsers ------------------------------------------------------
words = st.one_of(
    st.sampled_from(["-n", "2", "--backend", "cpu", "cuda", "--respawn", "off", "--ranks", "all",
                     "0", "1-3", "::2", "--timeout", "nan", "inf", "-1", "1e999", "--setup",
                     "--elastic", "--no-block", "-o", "x", "1x", "--signal", "KILL", "--tail",
                     "--native", "--hosts", "--launcher", "ssh", "--hang-timeout", "-h", "--help",
                     "'", '"', "\\", "=", "--ranks=0", "--", "-", "--nope", "name"]),
    st.text(max_size=8))
lines = st.lists(words, max_size=7).map(" ".join)
SUBCOMMANDS = ["start", "stacks", "debug", "push", "pull", "kill", "logs", "restart", "wait",
               "cell"]


@FAST
@given(sub=st.sampled_from(SUBCOMMANDS), line=lines)
def test_magic_parsers_raise_only_usage_errors(sub: str, line: str) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            args = magics_mod._parse(getattr(magics_mod._P, sub), line)
        except UsageError:
            return
    if sub == "start":  # what %monarch start checks before it starts anything
        try:
            MeshConfig(n=args.n, backend=args.backend, respawn=args.respawn,
                       launcher=args.launcher, hosts=tuple(h for h in args.hosts.split(",") if h),
                       hang_timeout=args.hang_timeout)
        except UsageError:
            pass


@FAST
@given(cmd=st.one_of(st.sampled_from(["stop", "status", "push", "pull", "kill", "logs", "wait",
                                      "restart", "dashboard", "stacks", "debug", "help"]),
                     st.text(max_size=6)),
       line=lines, cell=st.none() | st.text(max_size=20))
def test_monarch_magic_without_a_mesh_raises_only_monarch_errors(
        cmd: str, line: str, cell: str | None) -> None:
    """``%monarch`` and ``%%monarch`` with any line and no mesh: a clear
    UsageError or MeshNotRunning, never a crash (``start`` would start one)."""
    assume(not cmd.strip().startswith("start"))
    magics = magics_mod.MonarchMagics(None)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            magics.monarch(f"{cmd} {line}", cell)
        except (UsageError, MeshNotRunning):
            pass
    assert magics.mesh is None


# -- 4. the METRICS frame -----------------------------------------------------------------
def check_points(points: Any) -> None:
    assert isinstance(points, list)
    for p in points:
        assert isinstance(p, tuple) and len(p) == 3
        step, t, values = p
        assert type(step) is int and type(t) is float and type(values) is dict
        assert all(type(k) is str and type(v) is float for k, v in values.items())


point_like = st.lists(st.one_of(
    st.tuples(json_like, json_like, st.dictionaries(st.text(max_size=5), json_like, max_size=3)),
    st.tuples(st.integers() | st.floats() | st.text(max_size=4), st.floats() | st.integers(),
              st.dictionaries(st.text(max_size=5), st.floats() | st.integers()
                              | st.sampled_from(["nan", "inf", "-inf", "x"]), max_size=3)),
    json_like), max_size=5).map(lambda v: json.dumps(v).encode())


@FAST
@given(frame=st.one_of(st.binary(max_size=200), json_like.map(lambda v: json.dumps(v).encode()),
                       point_like, st.integers(0, 50).map(lambda n: b"[" * n + b"]" * n)))
def test_metrics_decode_never_raises_and_returns_typed_points(frame: bytes) -> None:
    check_points(metricframes.decode(frame))


def test_metrics_decode_survives_deep_nesting_and_huge_numbers() -> None:
    """Found by the property above: ``1e999`` steps (int(inf)), 400-digit
    values (float() overflows) and deep nesting escaped decode's guard."""
    assert metricframes.decode(b"[" * 100_000) == []
    assert metricframes.decode(b"[[1e999, 0, {}], [1, 2, {\"a\": 1}]]") == [(1, 2.0, {"a": 1.0})]
    huge = b"[[1, 2, {\"a\": " + b"9" * 400 + b"}], [3, 4, {}]]"
    assert metricframes.decode(huge) == [(3, 4.0, {})]


finite_or_not = st.floats(allow_nan=True, allow_infinity=True)


@FAST
@given(points=st.lists(st.tuples(st.integers(-2**53, 2**53),
                                 st.floats(0, 4e9, allow_nan=False),
                                 st.dictionaries(st.text(max_size=6), finite_or_not, max_size=3)),
                       max_size=5))
def test_metrics_encode_decode_round_trip(points: list[Any]) -> None:
    back = metricframes.decode(metricframes.encode(points))
    assert len(back) == len(points)
    for (step, t, values), (step2, t2, values2) in zip(points, back, strict=True):
        assert step2 == step and t2 == pytest.approx(t, abs=1e-3)
        assert values2.keys() == values.keys()
        for k, v in values.items():
            assert (math.isnan(v) and math.isnan(values2[k])) or values2[k] == v


# -- 5. the lab comm handler --------------------------------------------------------------
class _Comm:
    """The front end's end of a comm: records what the hub sends."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.handler: Any = None

    def send(self, data: Any) -> None:
        self.sent.append(data)

    def on_msg(self, fn: Any) -> None:
        self.handler = fn

    def on_close(self, fn: Any) -> None:
        pass


# Never a valid restart of rank 0 (a 1-rank mesh has no other): so every
# restart message here is malformed and must not restart anything.
bad_ranks = st.one_of(
    st.none(), st.booleans(), st.integers().filter(lambda r: r != 0), st.floats(),
    st.text(max_size=5), st.lists(st.integers(0, 3), max_size=3), st.just("all"), st.just("0"),
    st.just([0]), st.dictionaries(st.text(max_size=3), json_scalars, max_size=2))
actions = st.one_of(st.sampled_from(["hello", "stacks", "restart", "", "HELLO", "kill"]),
                    json_like)
datas = st.one_of(json_like, st.fixed_dictionaries({"action": actions}, optional={"rank": bad_ranks}))
comm_msgs = st.one_of(
    json_like,
    st.fixed_dictionaries({"content": st.one_of(json_like,
                                                st.fixed_dictionaries({"data": datas}))}))


def _fuzz_hub(mesh: Mesh | None, msgs: list[Any]) -> None:
    hub = Hub(lambda: mesh, background=False)
    comm = _Comm()
    hub.add(comm, confirmed=False)
    for msg in msgs:
        before = len(comm.sent)
        comm.handler(msg)  # what ipykernel calls for a comm_msg: must not raise
        replies = comm.sent[before:]
        assert len(replies) <= 1, replies
        for reply in replies:
            assert isinstance(reply, dict) and reply.get("t") in ("error", "stacks"), reply
            assert isinstance(reply.get("text"), str)
        data = msg.get("content", {}).get("data") if isinstance(msg, dict) and isinstance(
            msg.get("content"), dict) else None
        if not (isinstance(data, dict) and data.get("action") == "hello"):
            assert replies, f"no answer to {msg!r}"


@FAST
@given(msgs=st.lists(comm_msgs, min_size=1, max_size=5))
def test_lab_comm_answers_malformed_messages_without_a_mesh(msgs: list[Any]) -> None:
    _fuzz_hub(None, msgs)


# -- 6. a real mesh fed garbage over real sockets -----------------------------------------
@pytest.fixture(scope="module")
def mesh1() -> Iterator[Mesh]:
    mesh = Mesh.start(n=1, backend="cpu")
    try:
        yield mesh
    finally:
        mesh.stop()


def test_lab_comm_never_restarts_a_rank_on_a_malformed_message(mesh1: Mesh) -> None:
    before = mesh1.status()[0]

    @settings(max_examples=40, deadline=None, database=None)
    @given(msgs=st.lists(comm_msgs, min_size=1, max_size=4))
    def prop(msgs: list[Any]) -> None:
        _fuzz_hub(mesh1, msgs)

    prop()
    after = mesh1.status()[0]
    assert (after["pid"], after["incarnation"]) == (before["pid"], before["incarnation"])
    assert mesh1.run(lambda: 2) == {0: 2}


@pytest.fixture(scope="module")
def dealers(mesh1: Mesh) -> Iterator[list[zmq.Socket]]:
    """Attacker sockets connected to the controller like ranks are."""
    ctx = zmq.Context()
    socks = []
    for i in range(3):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, f"fuzz.{i}.main".encode())
        s.connect(mesh1._ctl.io.endpoint)
        socks.append(s)
    yield socks
    for s in socks:
        s.close(linger=0)
    ctx.term()


_RANK_DROPPED = ("import gc\nfrom monarch_nb.engine.loop import Worker\n"
                 "dict(next(o for o in gc.get_objects() if isinstance(o, Worker)).dropped)")


def rank_dropped(mesh: Mesh) -> int:
    """Messages the rank process itself dropped so far (all reasons)."""
    return sum(mesh.exec(_RANK_DROPPED)[0].values())


@st.composite
def hostile(draw: st.DrawFn, key: bytes, evil: list[bytes]) -> list[bytes]:
    """One message that must be dropped: random bytes; a live pickle signed
    with another key; or one signed with the mesh key and then damaged in a
    way that always breaks the signature or the signed framing."""
    what = draw(st.sampled_from(["random", "wrong-key", "damaged"]))
    if what == "random":
        return draw(st.lists(st.binary(max_size=200), min_size=1, max_size=5))
    kind, meta = draw(st.sampled_from([
        (Kind.CALL, {"generation": 0}), (Kind.RESULT, {"ok": True, "n_out": 0}),
        (Kind.EXEC, {"code": "open('/tmp/x','w')"}), (Kind.HEARTBEAT, {"busy": 0})]))
    if what == "wrong-key":
        other = draw(st.binary(min_size=16, max_size=32).filter(lambda k: k != key))
        return Codec(other, "x").sign(kind, evil, call=1, meta=meta)
    frames = [bytes(f) for f in Codec(key, "x", inline_max=draw(inline_maxes)).sign(
        kind, evil, call=1, meta=meta)]
    i = draw(st.integers(0, len(frames) - 1))
    damage = draw(st.sampled_from(["flip", "truncate", "resplit"]))
    if damage == "resplit" and len(frames) > 1:
        j = min(i, len(frames) - 2)
        joined = frames[j] + frames[j + 1]
        cut = draw(st.integers(0, len(joined)).filter(lambda c: c != len(frames[j])))
        frames[j:j + 2] = [joined[:cut], joined[cut:]]
    elif damage == "truncate" and frames[i]:
        frames[i] = frames[i][:draw(st.integers(0, len(frames[i]) - 1))]
    else:
        b = bytearray(frames[i] or b"\0")
        b[draw(st.integers(0, len(b) - 1))] ^= 1 << draw(st.integers(0, 7))
        frames[i] = bytes(b)
    return frames


def test_live_mesh_drops_garbage_and_still_answers(
        mesh1: Mesh, dealers: list[zmq.Socket], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Hostile frames at the controller's ROUTER (from attacker DEALERs) and
    at the rank's own DEALERs (through the controller's ROUTER, which is the
    only way in to a rank): every one is counted as dropped on the side that
    got it, nothing is unpickled on either side, and the rank answers a call
    afterwards."""
    mesh = mesh1
    key = mesh._ctl.key
    marker = tmp_path_factory.mktemp("fuzz") / "pwned"
    evil = evil_payload(marker)
    info = mesh._ctl.ranks[0]
    io_loop = mesh._ctl.io
    sent = {"controller": 0, "rank": 0}
    base_ctl = sum(mesh.dropped.values())
    base_rank = rank_dropped(mesh)

    @SLOW
    @given(batch=st.lists(hostile(key, evil), min_size=1, max_size=6),
           target=st.sampled_from(["controller", "rank-main", "rank-ctl"]),
           sock=st.integers(0, len(dealers) - 1))
    def prop(batch: list[list[bytes]], target: str, sock: int) -> None:
        if target == "controller":
            for frames in batch:
                dealers[sock].send_multipart(frames)
            sent["controller"] += len(batch)
            want = base_ctl + sent["controller"]
            wait_for(lambda: sum(mesh.dropped.values()) >= want, timeout=20,
                     what=f"{want - base_ctl} messages dropped by the controller")
        else:
            ident = info.main_id if target == "rank-main" else info.ctl_id
            for frames in batch:
                io_loop.call_soon(lambda f=frames: io_loop.send(ident, f))
            sent["rank"] += len(batch)
            want = base_rank + sent["rank"]
            wait_for(lambda: rank_dropped(mesh) >= want, timeout=20,
                     what=f"{want - base_rank} messages dropped by the rank")

    prop()
    # exactly the hostile messages were dropped: none got through, none twice
    assert sum(mesh.dropped.values()) - base_ctl == sent["controller"], mesh.dropped
    assert rank_dropped(mesh) - base_rank == sent["rank"]
    assert sent["controller"] and sent["rank"]
    assert mesh.run(lambda: 41 + 1) == {0: 42}
    assert mesh.status()[0]["incarnation"] == 0, "the rank died on the way"
    assert not marker.exists(), "a hostile pickle was unpickled"


def test_live_rank_runs_a_replayed_call_once(mesh1: Mesh) -> None:
    """A correctly signed CALL delivered to the rank, then replayed 20 times
    over both of its sockets: it runs once (the replays are counted)."""
    mesh = mesh1
    mesh.exec("replay_count = 0")
    before = rank_dropped(mesh)

    def bump() -> None:
        import __main__
        __main__.replay_count += 1

    frames = [bytes(f) for f in mesh._ctl.codec.sign(
        Kind.CALL, serialize.dumps_call(bump, (), {}), call=2**40)]
    info = mesh._ctl.ranks[0]
    io_loop = mesh._ctl.io
    io_loop.call_soon(lambda: io_loop.send(info.main_id, frames))
    wait_for(lambda: mesh.exec("replay_count")[0] == 1, what="the signed call to run once")
    for i in range(20):
        ident = info.main_id if i % 2 == 0 else info.ctl_id
        io_loop.call_soon(lambda ident=ident: io_loop.send(ident, frames))
    # 10 replays on main; on ctl the first copy is new to that socket's
    # window (verified, then ignored: ctl takes no calls) and 9 are replays
    wait_for(lambda: rank_dropped(mesh) - before >= 19, what="the replays to be dropped")
    assert mesh.exec("replay_count")[0] == 1
    assert rank_dropped(mesh) - before == 19
    assert mesh.run(lambda: 1) == {0: 1}
