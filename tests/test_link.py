"""Same-host links (wire/link.py): a local rank's main channel is a Unix
socket pair with its controller instead of a ZeroMQ DEALER.

The framing is tested alone (hypothesis: any message survives the packets
and comes back whole; oversized, malformed and interleaved garbage are
refused without losing the messages around them), then on real socket
pairs (a full socket queues in order), then with real ranks: the channel
is there, values above a packet go both ways, a forged or malformed message
written on a rank's own link is dropped and counted before anything is
unpickled, a killed rank's link is closed and its successor gets a new one,
and ``local_link=False`` puts every rank back on ZeroMQ.
"""

from __future__ import annotations

import os
import select
import socket
import stat
import threading
from typing import Any

import numpy as np
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monarch_nb import Mesh
from monarch_nb.wire import link as links
from monarch_nb.wire.link import DROPPED, MORE_PACKETS, PACKET_BYTES, SIZED, Assembler, Link

from .conftest import wait_for


def _roundtrip(frames: list[bytes], max_bytes: int = 1 << 30) -> list[Any]:
    return _roundtrip_on(Assembler(max_bytes), frames)


def _roundtrip_on(asm: Assembler, frames: list[bytes]) -> list[Any]:
    """What ``asm`` assembles from ``frames``' packets, each read whole."""
    return [got for flag, data in links.packets(frames)
            if (got := asm.feed(flag + bytes(data))) is not None]


# -- framing, alone ---------------------------------------------------------------------------
frame_sizes = st.sampled_from([0, 1, 100, PACKET_BYTES - 1, PACKET_BYTES, PACKET_BYTES + 1,
                               3 * PACKET_BYTES + 7])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(frame_sizes, min_size=1, max_size=4), min_size=1, max_size=4))
def test_any_messages_come_back_whole_and_in_order(shapes: list[list[int]]) -> None:
    messages = [[bytes([i % 251]) * n for i, n in enumerate(sizes)] for sizes in shapes]
    asm = Assembler(1 << 30)
    got = []
    for frames in messages:
        for flag, data in links.packets(frames):
            assert len(data) <= PACKET_BYTES
            out = asm.feed(flag + bytes(data))
            if out is not None:
                got.append(out)
    assert got == messages


def test_memoryview_and_numpy_frames_are_sent_as_bytes() -> None:
    arr = np.arange(100_000, dtype=np.float32)  # 400 KB: seven packets
    assert _roundtrip([b"head", memoryview(arr)]) == [[b"head", arr.tobytes()]]


def test_an_oversized_message_is_refused_whole_and_the_next_one_arrives() -> None:
    asm = Assembler(max_bytes=2 * PACKET_BYTES)
    results = []
    for frames in ([b"a" * (5 * PACKET_BYTES)], [b"ok"]):
        for flag, data in links.packets(frames):
            out = asm.feed(flag + bytes(data))
            if out is not None:
                results.append(out)
    assert results == [DROPPED, [b"ok"]] and asm.refused == "oversized"
    # a single-packet message over the bound too
    small = Assembler(max_bytes=10)
    assert small.feed(b"\x00" + b"x" * 11) is DROPPED and small.refused == "oversized"


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=64))
def test_a_packet_that_is_not_ours_is_dropped_and_the_stream_goes_on(junk: bytes) -> None:
    asm = Assembler(1 << 20)
    out = asm.feed(junk)
    flags = junk[0] if junk else 0xFF
    size = int.from_bytes(junk[1:], "little") if len(junk) == 9 else 0
    begins = not flags & ~3 or (flags == SIZED and PACKET_BYTES < size <= 1 << 20)
    if not begins:  # nothing of ours, or a size no sender announces
        assert out is DROPPED and asm.refused == "malformed"
    # whatever it was, a well-formed message after it comes back whole
    for flag, data in links.packets([b"x" * 10, b"y"]):
        last = asm.feed(flag + bytes(data))
    if begins and flags:
        return  # it began a message of its own: the next ones are its frames (signature fails later)
    assert last == [b"x" * 10, b"y"]


@pytest.mark.parametrize("case", ["short", "long", "unannounced", "oversized"])
def test_a_sized_frame_that_does_not_match_its_size_is_dropped_and_the_stream_goes_on(
        case: str) -> None:
    """A frame of several packets is announced with its size (SIZED) and
    read into one buffer: packets that end it early or run past it, packets
    of several without the announcement, and a size above the bound are
    refused, and the next message comes back whole."""
    asm = Assembler(4 * PACKET_BYTES)
    more, last = bytes([MORE_PACKETS]), b"\x00"
    chunk = b"z" * PACKET_BYTES
    size = {"short": 3 * PACKET_BYTES, "long": PACKET_BYTES + 10, "unannounced": 0,
            "oversized": 8 * PACKET_BYTES}[case]
    packets = [] if case == "unannounced" else [bytes([SIZED]) + size.to_bytes(8, "little")]
    packets += [more + chunk, last + chunk]  # two full packets: short of 3, past PACKET + 10
    outs = [asm.feed(p) for p in packets]
    assert outs[-1] is DROPPED and DROPPED not in outs[:-1]
    assert asm.refused == ("oversized" if case == "oversized" else "malformed")
    assert _roundtrip_on(asm, [b"x" * (2 * PACKET_BYTES + 3), b"y"]) == [
        [b"x" * (2 * PACKET_BYTES + 3), b"y"]]


def test_too_many_frames_are_refused() -> None:
    asm = Assembler(1 << 30)
    outs = [asm.feed(flag + bytes(data)) for flag, data in links.packets([b""] * 5000)]
    assert DROPPED in outs and asm.refused == "oversized"
    assert asm.feed(b"\x00ok") == [b"ok"]


# -- real socket pairs ------------------------------------------------------------------------
def test_a_full_socket_queues_in_order_and_flushes() -> None:
    ours, theirs = links.pair()
    sender = Link(ours, 1 << 30)
    receiver = Link(theirs, 1 << 30)
    big = [bytes([i]) * (PACKET_BYTES * 2 + i) for i in range(20)]  # far beyond the socket buffer
    waiting = False
    for frame in big:
        waiting = sender.send([b"h", frame]) or waiting
    assert waiting and sender.waiting
    got = []
    while len(got) < len(big):
        msg = receiver.read()
        if msg is None:
            sender.flush()
            continue
        got.append(msg)
    assert got == [[b"h", frame] for frame in big]
    assert not sender.flush()
    receiver.close()
    assert sender.send([b"after close"]) is False
    sender.read()
    assert sender.closed
    sender.close()


def test_a_sized_frame_is_received_in_place_and_a_packet_past_its_end_is_refused() -> None:
    """On a real socket a frame of several packets is read straight into
    its buffer (recvmsg_into). A packet longer than what is left of the
    frame is cut by the kernel (MSG_TRUNC): the message is refused, the next
    one arrives whole, and the blocking end (a rank's) reads the same way."""
    ours, theirs = links.pair()
    receiver = Link(theirs, 1 << 30)
    try:
        frame = bytes(range(256)) * (3 * PACKET_BYTES // 256) + b"tail"
        for flag, data in links.packets([b"h", frame]):
            ours.sendmsg([flag, data])
        got = receiver.read()
        assert got == [b"h", frame] and type(got[1]) is bytearray
        size = PACKET_BYTES + 10
        for packet in (bytes([SIZED]) + size.to_bytes(8, "little"),
                       bytes([MORE_PACKETS]) + b"a" * PACKET_BYTES,
                       b"\x00" + b"b" * PACKET_BYTES):  # 10 bytes were left
            ours.send(packet)
        assert receiver.read() is DROPPED and receiver.refused == "malformed"
        for flag, data in links.packets([frame]):
            ours.sendmsg([flag, data])
        assert receiver.read() == [frame]
        blocking = Link(ours, 1 << 30, blocking=True)
        back = Link(theirs, 1 << 30)  # (the same end, now sending: flushed as room comes)

        def flush() -> None:
            pending = back.send([b"back", frame])
            while pending:
                select.select([], [back.fd], [], 1.0)
                pending = back.flush()

        sending = threading.Thread(target=flush)
        sending.start()
        assert blocking.recv() == [b"back", frame]
        sending.join(10)
        assert not sending.is_alive()
    finally:
        ours.close()
        receiver.close()


def test_the_rank_end_is_not_inherited_by_its_children() -> None:
    ours, theirs = links.pair()
    fd = os.dup(theirs.fileno())
    os.set_inheritable(fd, True)
    end = Link.inherited(fd, 1 << 20)
    assert not os.get_inheritable(fd)
    end.close()
    ours.close()
    theirs.close()


# -- real ranks ----------------------------------------------------------------------------------
def _links_of(pid: int) -> list[Any]:
    return [c for c in psutil.Process(pid).net_connections(kind="unix")
            if c.type == socket.SOCK_SEQPACKET]


def test_every_local_rank_talks_over_its_link(mesh4: Mesh) -> None:
    assert mesh4._ctl.io.links == 4
    for proc in mesh4._ctl.supervisor.procs.values():
        assert len(_links_of(proc.pid)) == 1
        env = psutil.Process(proc.pid).environ()
        assert "MONARCH_NB_LINK_FD" in env  # set for it (and removed from os.environ inside)
    assert mesh4.run(lambda: os.environ.get("MONARCH_NB_LINK_FD")).values_list() == [None] * 4


def test_values_of_several_packets_go_both_ways(mesh4: Mesh) -> None:
    assert mesh4._ctl.dataplane.threshold == 1 << 20  # (the values below stay under it)
    arr = np.arange(200_000, dtype=np.float32)  # 800 KB: below the shared-memory threshold
    out = mesh4[1].run(lambda a: a * 2, arr)[1]
    np.testing.assert_array_equal(out, arr * 2)
    # to every rank at once: more than the sockets take, so the controller
    # queues packets and waits for room (EPOLLOUT) while the ranks read
    big = np.arange(240_000, dtype=np.float32)  # 960 KB each: still below shared memory
    mesh4.push(big=big)
    assert mesh4.exec("float(big.sum())").values_list() == [float(big.sum())] * 4
    code = "x = 1\n" + "# padding\n" * 20_000  # a 200 KB cell: its code spans packets
    mesh4.exec(code)
    assert mesh4.run(lambda: 1).values_list() == [1] * 4


def _write_on_own_link(packets: list[bytes]) -> int:
    """On a rank: write raw packets on its own link, as a bug or an attacker
    in the rank could; returns how many were written."""
    import os
    import socket

    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_SEQPACKET:
                for packet in packets:
                    sock.send(packet)
                return len(packets)
        finally:
            sock.close()
    return 0


def test_forged_and_malformed_messages_on_a_link_are_dropped_and_counted(mesh4: Mesh) -> None:
    import pickle

    dropped = mesh4._ctl.io.dropped
    before = dict(dropped)
    # a "RESULT" with a pickled payload but no valid signature, a packet with
    # unknown flags, and two frames of garbage
    evil = pickle.dumps(Exception("should never be unpickled"))
    junk = [b"\x00" + b"\x00" * 32 + evil, b"\xff" + b"nonsense", b"\x02abc", b"\x00def"]
    assert mesh4[2].run(_write_on_own_link, junk).values_list() == [4]
    wait_for(lambda: dropped["bad-signature"] + dropped["truncated"] + dropped["malformed"]
             >= sum(before.get(k, 0) for k in ("bad-signature", "truncated", "malformed")) + 3,
             what="the forged messages to be counted")
    assert mesh4.run(lambda: 7).values_list() == [7] * 4  # the mesh stays usable


def test_an_oversized_message_on_a_link_is_dropped_before_it_is_kept() -> None:
    with Mesh.start(n=1, backend="cpu", max_message_bytes=1 << 20) as mesh:
        # 2.5 MiB in one frame, announced as such: refused at its SIZED
        # packet (nothing made for it), its packets read and dropped
        size = 40 * PACKET_BYTES + 3
        huge = ([bytes([SIZED]) + size.to_bytes(8, "little")]
                + [b"\x01" + b"x" * PACKET_BYTES] * 40 + [b"\x00end"])
        assert mesh.run(_write_on_own_link, huge).values_list() == [42]
        wait_for(lambda: mesh._ctl.io.dropped["oversized"] >= 1, what="the oversized message")
        assert mesh.run(lambda: "still here").values_list() == ["still here"]


def test_a_killed_ranks_link_is_closed_and_its_successor_gets_a_new_one() -> None:
    with Mesh.start(n=2, backend="cpu", fork=False) as mesh:  # a spare process: fresh interpreters only
        io = mesh._ctl.io
        old_id = mesh._ctl.ranks[1].main_id
        old = io._links[old_id]
        mesh.kill(1)
        wait_for(lambda: mesh.status()[1]["incarnation"] >= 1 and mesh.status()[1]["state"] == "ready",
                 timeout=60, what="rank 1 back")
        wait_for(lambda: old.sock.fileno() == -1, what="the dead rank's link to close")
        assert old_id not in io._links and io.links == 2
        assert mesh.run(lambda: 3).values_list() == [3, 3]
        ends = [link.sock for link in io._links.values()]
        wait_for(lambda: mesh._ctl.supervisor.spare_link is not None, timeout=60,
                 what="a spare with its own link")
        spare_link = mesh._ctl.supervisor.spare_link
        assert spare_link is not None
        ends.append(spare_link[0])
    assert [end.fileno() for end in ends] == [-1] * len(ends)  # stop closed every end


def test_a_dead_spares_link_is_closed() -> None:
    with Mesh.start(n=1, backend="cpu", fork=False) as mesh:  # a spare process: fresh interpreters only
        sup = mesh._ctl.supervisor
        wait_for(lambda: sup.spare_link is not None, timeout=60, what="a spare with its link")
        assert sup.spare_link is not None and sup.spare is not None
        end, spare = sup.spare_link[0], sup.spare
        spare.kill()  # out of memory, say
        wait_for(lambda: end.fileno() == -1, timeout=30, what="the dead spare's link to close")
        assert mesh.run(lambda: 1).values_list() == [1]


def test_local_link_off_puts_every_rank_on_zeromq() -> None:
    with Mesh.start(n=2, backend="cpu", local_link=False, spare=False) as mesh:
        assert mesh._ctl.io.links == 0
        for proc in mesh._ctl.supervisor.procs.values():
            assert _links_of(proc.pid) == []
        assert mesh.run(lambda: 5).values_list() == [5, 5]


def test_a_link_is_no_file_anyone_can_open(mesh4: Mesh) -> None:
    """No path, no port: the socket pair exists only as the two processes'
    file descriptors (what docs/security.md says)."""
    for proc in mesh4._ctl.supervisor.procs.values():
        (conn,) = _links_of(proc.pid)
        assert conn.laddr == "" and conn.raddr == ""
        assert stat.S_ISSOCK(os.stat(f"/proc/{proc.pid}/fd/{conn.fd}").st_mode)
