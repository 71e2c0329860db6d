"""A remote rank's big frames to its host agent by shared memory (wire/link.py
``SHM``, shm.seal_frames / map_passed, the agent's side in wire/hostrelay.py).

* the link: big frames passed in one sealed memory file come back whole as
  views of one mapping, which goes with the last of them; a passed file
  that is not a sealed monarch_nb file, or an ``SHM`` packet on a link that
  takes no files, is dropped and the stream goes on;
* end to end over real sockets (the agent's relay, the controller's I/O
  loop): a frame altered in the passed file fails the rank's own signature
  at the controller and is dropped before anything reads it;
* real meshes: a big result from a rank on another "host" (``sh -c``) comes
  through its agent's shared memory (the agent's counts say so); a rank
  killed in the middle of passing a file leaves no mapping in its agent and
  nothing in /dev/shm; and between network namespaces, with CurveZMQ on.
"""

from __future__ import annotations

import array
import hashlib
import os
import select
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from monarch_nb import Mesh
from monarch_nb.wire import link as links
from monarch_nb.wire import shm
from monarch_nb.wire.hostrelay import Relay
from monarch_nb.wire.link import DROPPED, SHM, Link
from monarch_nb.wire.protocol import Codec, Kind

from .conftest import wait_for
from .test_relay import Loop

MB = 1 << 20


def _passed_maps(pid: int | None = None) -> list[str]:
    """The mappings of passed memory files in process ``pid`` (default: this one)."""
    path = f"/proc/{pid or 'self'}/maps"
    with open(path) as f:
        return [line for line in f if shm.PASSED_NAME in line]


def _recv(link: Link) -> Any:
    """The next message on a non-blocking end (or DROPPED)."""
    got = None
    while got is None:
        assert select.select([link.fd], [], [], 10)[0], "nothing came"
        got = link.read()
    return got


@pytest.fixture
def pair() -> Iterator[tuple[Link, Link]]:
    """(the rank's end, passing frames of 1 MiB and more; the agent's end, taking files)."""
    agent_end, rank_end = links.pair()
    rank = Link(rank_end, 1 << 30, blocking=True, shm_threshold=MB)
    agent = Link(agent_end, 1 << 30, take_fds=True)
    try:
        yield rank, agent
    finally:
        rank.close()
        agent.close()


def _send(rank: Link, frames: list[Any]) -> threading.Thread:
    # the socket holds only a few packets: the other end reads while this one writes
    t = threading.Thread(target=rank.send_blocking, args=(frames,))
    t.start()
    return t


def _pass_raw(sock: socket.socket, packet: bytes, fd: int) -> None:
    sock.sendmsg([packet], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


# -- the link -------------------------------------------------------------------------------
def test_big_frames_come_back_whole_from_one_mapping_that_goes_with_them(
        pair: tuple[Link, Link]) -> None:
    rank, agent = pair
    big = os.urandom(8 * MB)
    frames = [b"signed header", big, b"y" * 100_000, big[:2 * MB], b"tail"]
    before = shm.stats["mapped_passed"]
    fds_before = set(os.listdir("/proc/self/fd"))
    t = _send(rank, frames)
    got = _recv(agent)
    t.join()
    assert [bytes(f) for f in got] == frames
    # the big ones are views of the one file passed; the rest came in packets
    assert [type(f) for f in got] == [bytes, memoryview, bytearray, memoryview, bytes]
    assert shm.stats["mapped_passed"] == before + 1
    assert len(_passed_maps()) == 1
    assert set(os.listdir("/proc/self/fd")) == fds_before  # neither end kept an fd
    del got
    wait_for(lambda: not _passed_maps(), what="the mapping to go with its frames")


@pytest.mark.parametrize("what", ["pipe", "unsealed"])
def test_a_passed_file_that_is_not_ours_is_refused_and_the_stream_goes_on(
        pair: tuple[Link, Link], what: str) -> None:
    rank, agent = pair
    if what == "pipe":
        fd, w = os.pipe()
        os.close(w)
    else:  # could shrink under the agent's mapping (SIGBUS in the agent)
        fd = os.memfd_create(shm.PASSED_NAME)
        os.ftruncate(fd, 4 * MB)
    refused = shm.stats["link_refused"]
    try:
        _pass_raw(rank.sock, bytes([SHM]) + (0).to_bytes(8, "little") + (MB).to_bytes(8, "little"),
                  fd)
    finally:
        os.close(fd)
    assert _recv(agent) is DROPPED and agent.refused == "shm-refused"
    assert shm.stats["link_refused"] == refused + 1
    assert not _passed_maps()
    t = _send(rank, [b"next", b"z" * (2 * MB)])
    assert [bytes(f) for f in _recv(agent)] == [b"next", b"z" * (2 * MB)]
    t.join()


def test_a_passed_file_on_a_link_that_takes_none_is_junk() -> None:
    """The controller's links to its local ranks take no files: the kernel
    closes what came, the packet is dropped, the next message arrives."""
    ours, theirs = links.pair()
    ctl = Link(ours, 1 << 30)
    rank = Link(theirs, 1 << 30, blocking=True, shm_threshold=MB)
    try:
        t = _send(rank, [b"head", b"q" * (2 * MB)])
        assert _recv(ctl) is DROPPED  # the SHM packet (its file closed by the kernel)
        t.join()
        rank.shm_threshold = None
        rank.send_blocking([b"plain"])
        assert _recv(ctl) == [b"plain"]
    finally:
        ctl.close()
        rank.close()


# -- end to end: rank link, the agent's relay, the controller's I/O loop ----------------------
def test_a_frame_altered_in_the_passed_file_fails_the_ranks_signature_at_the_controller() -> None:
    loop = Loop()
    relay = Relay("agentZ", loop.io.endpoint, None, 1 << 30)
    loop.io.attach_relay(b"r5.main", b"agentZ")
    ours, theirs = links.pair()
    relay.add("r5.main", ours)
    rank = Link(theirs, 1 << 30, blocking=True, shm_threshold=MB)
    codec = Codec(loop.key, "r5.main")
    value = os.urandom(16 * MB)
    before = relay.counts()
    try:
        # the rank signs its frames; what is passed is another 16 MiB
        forged = codec.sign(Kind.RESULT, [value], call=7)
        altered = bytearray(value)
        altered[12345] ^= 1
        rank.send_blocking([forged[0], altered])
        wait_for(lambda: loop.io.dropped["bad-signature"] == 1, what="the altered frame dropped")
        # the same path with the frame as signed: verified as the rank's, intact
        rank.send_blocking(codec.sign(Kind.RESULT, [value], call=8))
        wait_for(lambda: any(m.call == 8 for _, m in loop.got), what="the good result")
        (msg,) = [m for _, m in loop.got if m.call == 8]
        assert msg.sender == "r5.main" and bytes(msg.payload[0]) == value
        assert not [m for _, m in loop.got if m.call == 7]
        after = relay.counts()  # (this process's: an agent has one relay)
        assert after["shm"] == before["shm"] + 2 and after["shm_refused"] == before["shm_refused"]
    finally:
        rank.close()
        relay.close()
        loop.close()
    wait_for(lambda: not _passed_maps(), what="the relay's mappings to go once sent")


# -- real meshes ----------------------------------------------------------------------------
@pytest.fixture
def agents_mesh(monkeypatch: pytest.MonkeyPatch) -> Iterator[Mesh]:
    monkeypatch.setenv("MONARCH_NB_SSH", "sh -c")
    mesh = Mesh.start(n=2, backend="cpu", launcher="ssh", hosts="hA,hB", bind="127.0.0.1",
                      master_addr="127.0.0.1", start_timeout=90)
    try:
        yield mesh
    finally:
        mesh.stop()


def _big(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest() * (n // 32)


def test_a_big_result_from_a_remote_rank_comes_through_its_agents_shared_memory(
        agents_mesh: Mesh) -> None:
    mesh = agents_mesh
    assert mesh.dataplane["agent_shm"] == 0
    n = 128 * MB
    got = mesh.ranks(1).run(_big, n)[1]
    assert got == _big(n)  # intact, end to end under the rank's signature
    wait_for(lambda: mesh.dataplane["agent_shm"] >= 1, what="the agent's count of passed files")
    plane = mesh.dataplane
    assert plane["agent_shm_bytes"] >= n and plane["agent_shm_refused"] == 0
    assert mesh.dropped == {}
    # a small result still goes by packets
    assert mesh.run(lambda: 3).values_list() == [3, 3]
    # the agent lets go of the file once the frames are sent
    agent = psutil.Process(mesh.ranks(1).run(os.getppid)[1])
    wait_for(lambda: not _passed_maps(agent.pid), what="the agent's mapping to go")


def _pass_half_a_message_and_die() -> None:
    """On a rank: pass a file with the first frame of a message whose other
    frame never comes, then die, as a rank killed in mid-send."""
    import gc

    # its main link: the one that passes files (the control link does not)
    (main,) = [o for o in gc.get_objects() if isinstance(o, Link) and o.shm_threshold]
    sock = socket.socket(fileno=os.dup(main.fd))
    fd, at = shm.seal_frames([b"m" * (4 * MB)])
    off, n = at[0]
    more = 2  # link.MORE_FRAMES: the message goes on (it never will)
    sock.sendmsg([bytes([SHM | more]) + off.to_bytes(8, "little") + n.to_bytes(8, "little")],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_rank_killed_mid_send_leaves_no_segment(agents_mesh: Mesh) -> None:
    mesh = agents_mesh
    shm_before = set(os.listdir("/dev/shm"))
    pid = mesh.ranks(1).run(os.getpid)[1]
    agent = psutil.Process(pid).ppid()
    passed = mesh.dataplane["agent_shm"]
    fut = mesh.ranks(1).run_async(_pass_half_a_message_and_die)
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie",
             what="the rank's death")
    with pytest.raises(Exception):  # noqa: B017 (whatever the death is reported as)
        fut.result(timeout=60)
    # the agent took the file (its count says so) and let go of it with the rank's link
    wait_for(lambda: mesh.dataplane["agent_shm"] == passed + 1, what="the agent's passed file")
    wait_for(lambda: not _passed_maps(agent), what="the agent to drop the partial message")
    assert psutil.pid_exists(agent)
    mesh.stop()
    assert set(os.listdir("/dev/shm")) <= shm_before


@pytest.mark.netns
def test_a_remote_ranks_big_result_crosses_namespaces_through_shared_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank and its agent in one namespace, the controller in another:
    the file passes on the rank's host, the bytes cross encrypted."""
    from .engines import netns_hosts

    monkeypatch.setenv("MONARCH_NB_SSH", "ip netns exec {host} sh -c")
    with netns_hosts(1) as hosts:
        mesh = Mesh.start(n=1, backend="cpu", launcher="ssh", hosts=hosts.names[0],
                          bind=hosts.bridge_addr, master_addr=hosts.addrs[0],
                          start_timeout=120)
        try:
            assert mesh._ctl.io.curve is not None  # across hosts: encrypted
            n = 64 * MB
            assert mesh.run(_big, n)[0] == _big(n)
            wait_for(lambda: mesh.dataplane["agent_shm"] >= 1, what="the agent's passed file")
            assert mesh.dataplane["agent_shm_refused"] == 0 and mesh.dropped == {}
        finally:
            mesh.stop()
