"""Security of the controller <-> rank channel, with real processes and sockets.

DESIGN.md, architecture rules 3 (trust) and 7 (bad input is dropped and
counted, never executed). An "attacker" here is a zmq DEALER that connects to
the controller's ROUTER endpoint like a rank does, with an identity of its
choice, and sends frames ``[signature + header, *payload]`` (protocol.py: the
32-byte signature and the header share the first frame).
Some tests use the real mesh key to play a compromised-but-buggy key holder.

Nothing is mocked: the shared ``mesh4`` fixture is a real 4-rank CPU mesh.
Tests that must break a mesh to show a bug (marked xfail) start their own
throw-away 1-rank mesh so that ``mesh4`` stays healthy for the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import os
import pathlib
import stat
import struct
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import psutil
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from monarch_nb import Mesh
from monarch_nb.errors import RankErrors, UsageError
from monarch_nb.wire import serialize
from monarch_nb.wire.protocol import (
    HEAD,
    INLINE_MAX,
    MAX_FRAMES,
    MAX_HEADER_BYTES,
    SIGNATURE_BYTES,
    VERSION,
    Codec,
    Kind,
)

from .conftest import wait_for, worker_pids

_KIND_CODE = {k: i for i, k in enumerate(Kind)}
_MIN_FIRST = SIGNATURE_BYTES + HEAD.size  # a shorter first frame is "truncated"


# -- helpers ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def attacker(zctx: zmq.Context) -> Iterator[Any]:
    """``attacker(identity, endpoint)`` -> a connected DEALER (closed after the test)."""
    socks: list[zmq.Socket] = []

    def make(identity: str | bytes, endpoint: str) -> zmq.Socket:
        s = zctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.IDENTITY, identity.encode() if isinstance(identity, str) else identity)
        s.connect(endpoint)
        socks.append(s)
        return s

    yield make
    for s in socks:
        s.close(linger=0)


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)
            if after.get(k, 0) != before.get(k, 0)}


def _wait_dropped(mesh: Mesh, before: dict[str, int], total: int, timeout: float = 15.0) -> dict[str, int]:
    """Wait until ``total`` more messages were dropped (any reason); return the delta."""
    wait_for(lambda: sum(_delta(before, mesh.dropped).values()) >= total, timeout=timeout,
             what=f"{total} more dropped message(s); now {_delta(before, mesh.dropped)}")
    return _delta(before, mesh.dropped)


def _header(sender: bytes, *, kind: int = _KIND_CODE[Kind.HEARTBEAT], seq: int = 1, call: int = 0,
            lengths: tuple[int, ...] = (), meta: bytes = b"", version: int = VERSION,
            nframes: int | None = None, flags: int = 0) -> bytes:
    """A header laid out as protocol.py documents it, built by hand so that
    tests can make it wrong in exactly one way."""
    n = len(lengths) if nframes is None else nframes
    return (HEAD.pack(version, kind, flags, seq, call, len(sender), n) + sender
            + struct.pack(f"!{len(lengths)}Q", *lengths) + meta)


def _sign(key: bytes, header: bytes, payload: tuple[bytes, ...] | list[bytes] = ()) -> list[bytes]:
    """Frames signed as the spec says: HMAC-SHA256 over header then every payload
    frame, the signature then the header in the first frame."""
    h = hmac.new(key, header, hashlib.sha256)
    for p in payload:
        h.update(p)
    return [h.digest() + header, *payload]


class _Evil:
    """Unpickling this creates ``path`` (a stand-in for arbitrary code)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def _evil_payload(marker: pathlib.Path, tmp_path: pathlib.Path) -> list[bytes]:
    frames = [bytes(f) for f in serialize.dumps(_Evil(marker))]
    # Sanity: the payload really is live — unpickling it elsewhere makes the file.
    probe = tmp_path / "sanity-marker"
    sanity = [bytes(f) for f in serialize.dumps(_Evil(probe))]
    serialize.loads(sanity)
    assert probe.exists(), "test payload is not live; the test would prove nothing"
    return frames


def _my_workers() -> set[int]:
    """Rank processes started by this test process (other engineers run meshes
    too), without spare processes: other meshes of this module start those in
    the background (they hold no endpoint or key until they become a rank)."""
    mine = {c.pid for c in psutil.Process().children(recursive=True)}
    out = set()
    for pid in worker_pids() & mine:
        try:
            if "MONARCH_NB_SPARE" not in psutil.Process(pid).environ():
                out.add(pid)
        except psutil.Error:
            continue
    return out


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _assert_alive(mesh: Mesh) -> None:
    assert mesh._ctl.io.thread.is_alive(), "the controller's I/O thread died"
    assert mesh.run(lambda: 1) == dict.fromkeys(range(mesh.world_size), 1)


@contextlib.contextmanager
def _throwaway_mesh(**options: Any) -> Iterator[Mesh]:
    mesh = Mesh.start(n=1, backend="cpu", **options)
    try:
        yield mesh
    finally:
        mesh.stop()


# -- 1. unsigned garbage ------------------------------------------------------------------
def test_unsigned_garbage_is_dropped_and_counted(mesh4: Mesh, attacker: Any) -> None:
    before = mesh4.dropped
    s = attacker("garbage.0.main", mesh4._ctl.io.endpoint)
    s.send_multipart([b""])                                          # 1 empty frame -> truncated
    s.send_multipart([os.urandom(_MIN_FIRST - 1)])                   # too short for sig + head
    s.send_multipart([os.urandom(32), os.urandom(64)])               # old layout -> truncated
    s.send_multipart([b"short", os.urandom(40), os.urandom(3000)])   # short first frame
    s.send_multipart([os.urandom(100)])                              # 1 frame -> bad-signature
    s.send_multipart([os.urandom(32 + 64), os.urandom(3000)])        # 2 random frames -> bad-signature
    s.send_multipart([os.urandom(32 + 40)] + [os.urandom(17) for _ in range(20)])
    delta = _wait_dropped(mesh4, before, 7)
    assert delta == {"truncated": 4, "bad-signature": 3}
    _assert_alive(mesh4)


# -- 2. forged pickles ------------------------------------------------------------------------
def test_wrong_key_malicious_pickle_is_never_unpickled(
        mesh4: Mesh, attacker: Any, tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "pwned"
    payload = _evil_payload(marker, tmp_path)
    forger = Codec(os.urandom(32), "evil.0.main")  # right layout, wrong key
    frames = forger.sign(Kind.RESULT, payload, call=1, meta={"ok": True, "n_out": 0})
    before = mesh4.dropped
    attacker("evil.0.main", mesh4._ctl.io.endpoint).send_multipart(frames)
    assert _wait_dropped(mesh4, before, 1) == {"bad-signature": 1}
    _assert_alive(mesh4)  # a full round trip after the forgery was handled
    assert not marker.exists(), "a forged pickle was unpickled by the controller"


def test_key_holder_with_unknown_identity_cannot_inject_a_result(
        mesh4: Mesh, attacker: Any, tmp_path: pathlib.Path) -> None:
    """Correctly signed RESULT for a call in flight, from a socket that is no
    rank: verified (so not counted as dropped) but ignored, never unpickled."""
    marker = tmp_path / "pwned"
    payload = _evil_payload(marker, tmp_path)

    def slow() -> str:
        import time
        time.sleep(0.3)
        return "real"

    fut = mesh4.run_async(slow)
    before = mesh4.dropped
    forger = Codec(mesh4._ctl.key, "ghost.0.main")
    ghost = attacker("ghost.0.main", mesh4._ctl.io.endpoint)
    ghost.send_multipart(
        forger.sign(Kind.RESULT, payload, call=fut.call_id, meta={"ok": True, "n_out": 0}))
    # Ranks now leave the defaults (ok, no output chunks) out of a RESULT's meta:
    # the same forgery in that form.
    ghost.send_multipart(forger.sign(Kind.RESULT, payload, call=fut.call_id))
    assert mesh4.wait(fut, timeout=60) == dict.fromkeys(range(4), "real")
    _assert_alive(mesh4)
    assert not marker.exists(), "a RESULT from an unknown socket was unpickled"
    assert _delta(before, mesh4.dropped) == {}


# -- 3. sender mismatch ----------------------------------------------------------------------
def test_signed_sender_must_match_the_socket_identity(mesh4: Mesh, attacker: Any) -> None:
    # Claim a rank id the mesh does not have (r7 of 4): claiming a live rank's
    # id would also touch that rank's replay window (see the xfail test below).
    forger = Codec(mesh4._ctl.key, "r7.0.main")
    before = mesh4.dropped
    attacker("x3.0.main", mesh4._ctl.io.endpoint).send_multipart(
        forger.sign(Kind.RESULT, [b"\x80\x05N."], call=1, meta={"ok": True, "n_out": 0}))
    assert _wait_dropped(mesh4, before, 1) == {"sender-mismatch": 1}
    _assert_alive(mesh4)


def test_sender_mismatch_forgery_does_not_poison_a_rank_replay_window(attacker: Any) -> None:
    with _throwaway_mesh() as mesh:
        forger = Codec(mesh._ctl.key, "r0.0.main")
        forger._seq = iter([2**62])  # a buggy key holder with a huge sequence number
        before = mesh.dropped
        attacker("x2.0.main", mesh._ctl.io.endpoint).send_multipart(forger.sign(Kind.HEARTBEAT))
        assert _wait_dropped(mesh, before, 1) == {"sender-mismatch": 1}
        fut = mesh.run_async(lambda: 1)
        # Rank 0's RESULT now carries a seq "older" than 2**62 - REPLAY_WINDOW:
        # it is dropped as a replay and the call never finishes.
        assert mesh.wait(fut, timeout=10) == {0: 1}
        assert "replay" not in mesh.dropped


# -- 4. replay ---------------------------------------------------------------------------
def test_replayed_message_is_dropped(mesh4: Mesh, attacker: Any) -> None:
    codec = Codec(mesh4._ctl.key, "x9.0.ctl")
    frames = [bytes(f) for f in codec.sign(Kind.HEARTBEAT, meta={"busy": 0})]
    s = attacker("x9.0.ctl", mesh4._ctl.io.endpoint)
    before = mesh4.dropped
    s.send_multipart(frames)  # accepted (then ignored: not a rank)
    s.send_multipart(frames)  # same seq again
    assert _wait_dropped(mesh4, before, 1) == {"replay": 1}
    # A fresh seq from the same key holder is still accepted, the old one never.
    s.send_multipart(codec.sign(Kind.HEARTBEAT))
    s.send_multipart(frames)
    assert _wait_dropped(mesh4, before, 2) == {"replay": 2}
    _assert_alive(mesh4)


# -- 5. truncated and oversized -------------------------------------------------------------
def test_signed_message_with_a_frame_removed_is_dropped(mesh4: Mesh, attacker: Any) -> None:
    # every payload frame a frame of its own (the layout of big payloads)
    codec = Codec(mesh4._ctl.key, "x5.0.main", inline_max=-1)
    s = attacker("x5.0.main", mesh4._ctl.io.endpoint)
    before = mesh4.dropped
    frames = codec.sign(Kind.RESULT, [b"a" * 10, b"b" * 20], call=1, meta={"ok": True})
    first = bytes(frames[0])
    s.send_multipart(frames[:-1])  # last payload frame removed
    s.send_multipart(frames[:1])   # every payload frame removed
    big = codec.sign(Kind.RESULT, [b"a" * 40_000, b"b" * 40_000], call=1)  # HMAC-object path
    s.send_multipart(big[:-1])
    s.send_multipart([first[:SIGNATURE_BYTES]])                   # the signature alone
    s.send_multipart([first[:SIGNATURE_BYTES], first[SIGNATURE_BYTES:], *frames[1:]])  # old layout
    s.send_multipart([first[:_MIN_FIRST - 1]])                    # first frame cut inside HEAD
    s.send_multipart([first[:-1], *frames[1:]])                   # first frame lost its last byte
    s.send_multipart([first[SIGNATURE_BYTES:], *frames[1:]])      # header without signature
    delta = _wait_dropped(mesh4, before, 8)
    assert delta == {"bad-signature": 5, "truncated": 3}, delta
    # Moving bytes across a payload frame boundary keeps the HMAC input
    # identical; the signed lengths in the header catch it.
    first, p0, p1 = codec.sign(Kind.RESULT, [b"a" * 10, b"b" * 20], call=1)
    s.send_multipart([first, p0 + p1[:5], p1[5:]])
    # So does moving bytes from the first payload frame into the header frame.
    s.send_multipart([first + p0, p1])
    delta = _wait_dropped(mesh4, before, 10)
    assert delta == {"bad-signature": 5, "truncated": 4, "malformed": 1}, delta
    # A small payload 0 travels inside the first frame: cut out into a frame
    # of its own (same signed bytes), or cut short, it is refused too.
    inline = Codec(mesh4._ctl.key, "x5.0.main")
    (first,) = inline.sign(Kind.RESULT, [b"\x80\x05N."], call=1)
    first = bytes(first)
    s.send_multipart([first[:-5], first[-5:]])
    s.send_multipart([first[:-1]])
    delta = _wait_dropped(mesh4, before, 12)
    assert delta == {"bad-signature": 6, "truncated": 4, "malformed": 2}, delta
    _assert_alive(mesh4)


@pytest.fixture(scope="module")
def mesh1_1mib() -> Iterator[Mesh]:
    """One extra 1-rank mesh whose controller accepts at most 1 MiB per message."""
    mesh = Mesh.start(n=1, backend="cpu", max_message_bytes=1 << 20)
    try:
        yield mesh
    finally:
        mesh.stop()


def test_oversized_messages_are_dropped(mesh1_1mib: Mesh, attacker: Any, zctx: zmq.Context,
                                        tmp_path: pathlib.Path) -> None:
    mesh = mesh1_1mib
    assert mesh._ctl.codec.max_bytes == 1 << 20
    ep = mesh._ctl.io.endpoint
    marker = tmp_path / "pwned"
    evil = _evil_payload(marker, tmp_path)
    before = mesh.dropped

    # A single 2 MiB frame: zmq's MAXMSGSIZE makes the controller drop the
    # connection (so it may never reach the counters). Watch for that.
    s = attacker("big.0.main", ep)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
    codec = Codec(mesh._ctl.key, "big.0.main")
    s.send_multipart(codec.sign(Kind.RESULT, [*evil, b"\0" * (2 << 20)], call=1,
                                meta={"ok": True, "n_out": 0}))

    def cut_off() -> bool:
        while mon.poll(0):
            if recv_monitor_message(mon)["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                return True
        return mesh.dropped.get("oversized", 0) > before.get("oversized", 0)

    wait_for(cut_off, timeout=15, what="the 2 MiB message to be refused")
    s.disable_monitor()
    mon.close(linger=0)

    # Frames each under MAXMSGSIZE but together over max_message_bytes: the
    # codec counts them, before even looking at the signature.
    before = mesh.dropped
    s2 = attacker("big.1.main", ep)
    s2.send_multipart([os.urandom(32) + b"h" * 64, b"\0" * (600 << 10), b"\0" * (600 << 10)])
    # a first frame longer than a header plus an inline payload may be
    s2.send_multipart([os.urandom(32) + b"h" * (MAX_HEADER_BYTES + INLINE_MAX + 1)])
    s2.send_multipart([os.urandom(32) + b"h" * 64] + [b"x"] * MAX_FRAMES)  # too many frames
    assert _wait_dropped(mesh, before, 3) == {"oversized": 3}

    _assert_alive(mesh)
    assert not marker.exists()


def test_result_over_the_limit_gives_a_clear_error(mesh1_1mib: Mesh) -> None:
    fut = mesh1_1mib.run_async(lambda: b"x" * (2 << 20))
    with pytest.raises(RankErrors, match=r"(?i)max_message_bytes|too large|limit"):
        mesh1_1mib.wait(fut, timeout=10)


# -- 6. malformed but validly signed ------------------------------------------------------------
def test_signed_but_malformed_headers_are_dropped(mesh4: Mesh, attacker: Any) -> None:
    key = mesh4._ctl.key
    ep = mesh4._ctl.io.endpoint
    sender = b"x6.0.ctl"
    s = attacker(sender, ep)

    cases: list[tuple[str, list[bytes]]] = [
        ("version", _sign(key, _header(sender, version=VERSION + 1))),
        ("version", _sign(key, _header(sender, version=0))),
        ("malformed", _sign(key, _header(sender, meta=b"{not json"))),
        ("malformed", _sign(key, _header(sender, meta=b"[1, 2, 3]"))),        # not an object
        ("malformed", _sign(key, _header(sender, meta=b"\xff\xfe"))),         # not UTF-8
        ("malformed", _sign(key, _header(sender, kind=200))),                 # unknown kind
        ("malformed", _sign(key, HEAD.pack(VERSION, 0, 0, 1, 0, 3, 0) + b"\xff\xfe\xfd")),  # sender
        ("malformed", _sign(key, _header(sender, nframes=3))),                # lengths missing
        ("malformed", _sign(key, _header(sender, lengths=(10,), flags=1) + b"abc")),  # inline cut
        ("malformed", _sign(key, _header(sender, lengths=(1,), flags=4) + b"a")),  # unknown flag
        ("truncated", _sign(key, b"\x01\x02")),                               # shorter than HEAD
        ("truncated", _sign(key, _header(sender)[:HEAD.size - 1])),            # by one byte
        ("truncated", _sign(key, _header(sender, lengths=(5,)), [b"1234"])),  # lengths disagree
        ("truncated", _sign(key, _header(sender, lengths=()), [b""])),        # extra empty frame
    ]
    before = mesh4.dropped
    for _, frames in cases:
        s.send_multipart(frames)
    expected: dict[str, int] = {}
    for reason, _ in cases:
        expected[reason] = expected.get(reason, 0) + 1
    assert _wait_dropped(mesh4, before, len(cases)) == expected
    # The same sender's well-formed message still gets through verification.
    ok = _sign(key, _header(sender, seq=99, meta=json.dumps({"busy": 0}).encode()))
    s.send_multipart(ok)
    s.send_multipart(ok)  # and its replay is the only new drop
    assert _wait_dropped(mesh4, before, len(cases) + 1) == {**expected, "replay": 1}
    _assert_alive(mesh4)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_deeply_nested_meta_is_malformed_not_fatal(attacker: Any) -> None:
    with _throwaway_mesh() as mesh:
        sender = b"x6.1.ctl"
        before = mesh.dropped
        attacker(sender, mesh._ctl.io.endpoint).send_multipart(
            _sign(mesh._ctl.key, _header(sender, meta=b"[" * 50_000)))
        wait_for(lambda: _delta(before, mesh.dropped) or not mesh._ctl.io.thread.is_alive(),
                 timeout=15, what="the nested-JSON message to be handled")
        assert _delta(before, mesh.dropped) == {"malformed": 1}
        _assert_alive(mesh)


# -- 7. flood ----------------------------------------------------------------------------------
def test_flood_of_forgeries_is_counted_and_survived(mesh4: Mesh, attacker: Any) -> None:
    ep = mesh4._ctl.io.endpoint
    wrong = Codec(os.urandom(32), "flood.0.main")
    right = Codec(mesh4._ctl.key, "flood.1.ctl")
    s_bad = attacker("flood.0.main", ep)
    s_short = attacker("flood.2.main", ep)
    s_replay = attacker("flood.1.ctl", ep)
    replayed = [bytes(f) for f in right.sign(Kind.HEARTBEAT)]
    n_bad, n_short, n_replay = 7000, 2000, 1000
    before = mesh4.dropped
    s_replay.send_multipart(replayed)  # the original: accepted, ignored
    for i in range(max(n_bad, n_short, n_replay)):
        if i < n_bad:
            s_bad.send_multipart(wrong.sign(Kind.RESULT, [b"x" * 64], call=i, meta={"ok": True}))
        if i < n_short:
            s_short.send_multipart([os.urandom(16)])
        if i < n_replay:
            s_replay.send_multipart(replayed)
    # The mesh answers while the flood is still being drained...
    _assert_alive(mesh4)
    delta = _wait_dropped(mesh4, before, n_bad + n_short + n_replay, timeout=120)
    # ...and every forgery is accounted for, under the right reason.
    assert delta == {"bad-signature": n_bad, "truncated": n_short, "replay": n_replay}
    _assert_alive(mesh4)
    assert all(row["state"] == "ready" for row in mesh4.status()), mesh4.status()


# -- 8. where the key lives --------------------------------------------------------------
def test_key_is_never_on_a_command_line_and_logs_are_private(mesh4: Mesh) -> None:
    key_hex = mesh4._ctl.key.hex()
    sup = mesh4._ctl.supervisor
    assert len(sup.procs) == 4
    for rank, proc in sup.procs.items():
        p = psutil.Process(proc.pid)
        cmd = p.cmdline()
        assert "monarch_nb.worker" in cmd
        assert not any(key_hex in arg or key_hex.upper() in arg for arg in cmd), (rank, cmd)
        assert p.environ().get("MONARCH_NB_KEY") == key_hex, f"rank {rank} lacks its key"
    # Only the ranks' environments hold it, not the controller's.
    assert key_hex not in os.environ.values()
    assert key_hex not in " ".join(psutil.Process().cmdline())
    # Rank logs: a private directory, and the key is never written to them.
    assert stat.S_IMODE(os.stat(sup.log_dir).st_mode) == 0o700
    assert os.stat(sup.log_dir).st_uid == os.getuid()
    for proc in sup.procs.values():
        assert stat.S_IMODE(os.stat(proc.log_path).st_mode) == 0o600, proc.log_path
        with open(proc.log_path, "rb") as f:
            assert key_hex.encode() not in f.read()


# -- 9. loopback only ------------------------------------------------------------------------------
def test_controller_listens_on_loopback_only(mesh4: Mesh) -> None:
    ep = urlsplit(mesh4._ctl.io.endpoint)
    assert ep.scheme == "tcp" and ep.hostname == "127.0.0.1"
    listening = [c for c in psutil.Process().net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == ep.port]
    assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening), listening


# Non-loopback binds turn CurveZMQ on: tests/test_curve.py. An address this
# host does not have is refused before any process starts.
@pytest.mark.parametrize("bind", ["10.1.2.3", "no-such-host.invalid", "bad host"])
def test_unusable_bind_is_refused_before_any_process_starts(bind: str) -> None:
    before = _my_workers()
    with pytest.raises(UsageError, match="bind"):
        Mesh.start(n=2, backend="cpu", bind=bind)
    assert _my_workers() - before == set()


# -- 10. ranks only connect ----------------------------------------------------------------------
def _rank_sockets(mesh: Mesh) -> dict[int, tuple[int, list[Any]]]:
    out = {}
    for rank, proc in mesh._ctl.supervisor.procs.items():
        p = psutil.Process(proc.pid)
        out[rank] = (int(p.environ()["MASTER_PORT"]), p.net_connections(kind="inet"))
    return out


def test_ranks_only_connect_to_the_controller(mesh4: Mesh) -> None:
    ctl_port = _port(mesh4._ctl.io.endpoint)
    for rank, (master_port, conns) in _rank_sockets(mesh4).items():
        listen = [c for c in conns if c.status == psutil.CONN_LISTEN]
        assert all(c.laddr.port != ctl_port for c in listen), (rank, listen)
        # Exactly one DEALER (ctl), connected out to the controller; the main
        # channel of a local rank is its link, a socket pair with no address
        # (wire/link.py; tests/test_link.py).
        to_ctl = [c for c in conns if c.raddr and c.raddr.port == ctl_port]
        assert len(to_ctl) == 1 and all(c.status == psutil.CONN_ESTABLISHED for c in to_ctl), to_ctl
        assert all(_is_loopback(c.raddr.ip) for c in to_ctl), to_ctl
        # Nothing else listens, except rank 0's TCPStore on MASTER_PORT and
        # gloo's pair listeners, which must at least be on loopback.
        others = [c for c in listen if not (rank == 0 and c.laddr.port == master_port)]
        assert all(_is_loopback(c.laddr.ip) for c in others), (rank, others)


def test_rank_listeners_are_all_loopback(mesh4: Mesh) -> None:
    for rank, (_, conns) in _rank_sockets(mesh4).items():
        listen = [c for c in conns if c.status == psutil.CONN_LISTEN]
        assert all(_is_loopback(c.laddr.ip) for c in listen), (rank, listen)


# -- identity squatting --------------------------------------------------------------------------
def test_local_process_cannot_squat_a_rank_identity(
        attacker: Any, tmp_path: pathlib.Path) -> None:
    # Make the rank pause 1.5 s at interpreter start-up (before it connects),
    # so the squatter deterministically connects first: a real attacker just
    # has to win a race against a Python start-up.
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(1.5)\n")
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    result: dict[str, Any] = {}

    def start() -> None:
        try:
            # a fresh interpreter (fork=False): the pause is its start-up's
            # (a forked rank has none, and connects within milliseconds)
            result["mesh"] = Mesh.start(n=1, backend="cpu", start_timeout=60, fork=False,
                                        extra_env=(("PYTHONPATH", pythonpath),))
        except BaseException as exc:
            result["error"] = exc

    before = _my_workers()
    t = threading.Thread(target=start, daemon=True)
    t.start()
    try:
        # What any same-user process can read: the rank's environment.
        rank_pid = wait_for(lambda: next(iter(_my_workers() - before), None), timeout=30,
                            what="the rank process")
        endpoint = wait_for(lambda: psutil.Process(rank_pid).environ().get("MONARCH_NB_CONTROLLER"),
                            what="the rank's environment")
        squatter = attacker("r0.0.ctl", endpoint)
        t.join(90)
        assert "error" not in result, result.get("error")
        mesh = result["mesh"]
        stolen = squatter.poll(2000)  # the controller PINGs ctl every heartbeat_interval
        assert not stolen, "the controller sent a rank's control traffic to a squatter"
        _assert_alive(mesh)
    finally:
        t.join(90)
        if "mesh" in result:
            result["mesh"].stop()
