"""The rendezvous store of a (re-)forming group: members are counted in, and
a member's wait can be abandoned when a newer generation supersedes it (a
peer died while the group formed). Real TCPStores on loopback, in-process."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from monarch_nb.backends import JoinAborted, make_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_all_members_counted_in() -> None:
    port = _free_port()
    stores: dict[int, object] = {}

    def member(rank: int) -> None:
        stores[rank] = make_store(rank, 3, "127.0.0.1", port, timeout_s=30)

    threads = [threading.Thread(target=member, args=(r,)) for r in (2, 1, 0)]  # rank 0 last
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(stores) == [0, 1, 2]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_wait_for_a_member_that_never_comes_can_be_abandoned(rank: int) -> None:
    # rank 0 hosts the store and waits for rank 1; rank 1 waits to reach a
    # store nobody hosts. Either gives up as soon as abort() says so.
    port = _free_port()
    flag = threading.Event()
    threading.Timer(0.5, flag.set).start()
    t0 = time.monotonic()
    with pytest.raises(JoinAborted):
        make_store(rank, 2, "127.0.0.1", port, timeout_s=60, abort=flag.is_set)
    assert time.monotonic() - t0 < 30  # not torch's own timeout (60 s here)


def test_without_abort_a_missing_member_is_a_timeout() -> None:
    with pytest.raises(TimeoutError, match="1 of 2 members"):
        make_store(0, 2, "127.0.0.1", _free_port(), timeout_s=1)


def test_a_member_early_for_the_store_joins_once_it_listens() -> None:
    # members reach a re-formation before rank 0 (which leaves its old group
    # first): they wait for its store in short steps (torch's client, refused,
    # backs off up to half a second); the probe's connections leave the store
    # working
    port = _free_port()
    stores: dict[int, object] = {}

    def member(rank: int) -> None:
        stores[rank] = make_store(rank, 3, "127.0.0.1", port, timeout_s=30)

    early = [threading.Thread(target=member, args=(r,)) for r in (1, 2)]
    for t in early:
        t.start()
    time.sleep(0.2)  # refused meanwhile: the members are probing
    assert not stores
    member(0)
    for t in early:
        t.join(30)
    assert sorted(stores) == [0, 1, 2]
    for _ in range(3):
        socket.create_connection(("127.0.0.1", port)).close()  # a probe, after the fact
    stores[1].set("k", "v")  # type: ignore[attr-defined]
    assert stores[2].get("k") == b"v"  # type: ignore[attr-defined]


def test_the_store_port_held_for_an_instant_is_bound_once_free() -> None:
    # a local connection's source port can hold the store's (ephemeral) port
    # for an instant; rank 0 binds it once it is free, and a port that stays
    # taken still fails
    from monarch_nb.backends import _bind

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    threading.Timer(0.1, holder.close).start()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _bind(sock, "127.0.0.1", port)
        assert sock.getsockname()[1] == port
        with socket.socket() as late, pytest.raises(OSError):
            _bind(late, "127.0.0.1", port, patience_s=0.05)
