"""The shared-memory data plane (wire/shm.py, controller/calls/dataplane.py) with
real rank processes and sockets.

What is checked: pushes, pulls, big call arguments and big results of NumPy
arrays and CPU tensors go through shared memory (counted in
``mesh.dataplane`` and in the ranks' ``shm.stats``, never judged by timing)
and arrive equal; each rank's copy is its own (copy-on-write); small values
stay on the sockets; a forged or replayed descriptor is dropped before
anything is mapped, one naming another process or another mesh's segment is
refused; a controller that cannot make a segment falls back to the sockets
with one notice; and nothing is left behind: no /dev/shm entry, no open
segment in the controller or in a rank, after pushes, a rank SIGKILLed
mid-push, a kill storm, a stop and a SIGKILLed kernel.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil
import pytest
import torch

from monarch_nb import Mesh
from monarch_nb.errors import RankErrors
from monarch_nb.wire import serialize, shm
from monarch_nb.wire.protocol import Codec, Kind

from .conftest import wait_for

BIG = 4 << 20  # bytes: well over the 1 MiB threshold
_RANK_STATS = "from monarch_nb.wire import shm\ndict(shm.stats)"
_RANK_DROPPED = ("import gc\nfrom monarch_nb.engine.loop import Worker\n"
                 "dict(next(o for o in gc.get_objects() if isinstance(o, Worker)).dropped)")


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def memfds(pid: int) -> list[str]:
    """The monarch_nb segments process ``pid`` holds open."""
    out = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("/memfd:monarch-nb"):
            out.append(fd)
    return out


def rank_stats(mesh: Mesh) -> dict[int, dict[str, int]]:
    return dict(mesh.exec(_RANK_STATS))


def rank_pids(mesh: Mesh) -> list[int]:
    return [p.pid for p in mesh._ctl.supervisor.procs.values()]


def settled(mesh: Mesh) -> bool:
    """Nothing held open: no segment in the controller or any rank."""
    return (mesh.dataplane["open"] == 0 and not memfds(os.getpid())
            and not any(memfds(pid) for pid in rank_pids(mesh)))


def checksum(name: str) -> Any:
    import __main__

    value = getattr(__main__, name)
    if hasattr(value, "numpy"):
        value = value.numpy()
    return (type(getattr(__main__, name)).__name__, float(np.asarray(value, dtype=np.float64).sum()),
            bool(np.asarray(value).flags.writeable))


@pytest.fixture(scope="module")
def dev_shm_before() -> set[str]:
    return dev_shm()


# -- the shm path is taken, values arrive equal -----------------------------------------------
def test_push_of_arrays_and_tensors_goes_by_shared_memory(mesh4: Mesh, dev_shm_before: set[str]) -> None:
    arr = np.random.default_rng(0).random(BIG // 8)
    ten = torch.randn(BIG // 4)
    before, ranks_before = mesh4.dataplane, rank_stats(mesh4)
    mesh4.push(arr=arr, ten=ten)
    after = mesh4.dataplane
    assert after["segments"] == before["segments"] + 1  # one segment for 4 ranks
    assert after["bytes"] - before["bytes"] >= arr.nbytes + ten.numel() * 4
    assert after["open"] == 0  # every rank answered: closed
    ranks_after = rank_stats(mesh4)
    for r in range(4):
        assert ranks_after[r]["mapped"] == ranks_before[r].get("mapped", 0) + 1
    want_a = ("ndarray", float(arr.sum()), True)
    want_t = ("Tensor", float(ten.double().sum()), True)
    assert mesh4.run(checksum, "arr") == dict.fromkeys(range(4), want_a)
    got = mesh4.run(checksum, "ten")
    for r in range(4):
        assert got[r][0] == "Tensor" and got[r][2] is True
        assert got[r][1] == pytest.approx(want_t[1], rel=1e-9)
    assert mesh4.exec(f"bool((arr == arr).all()) and arr.shape == ({BIG // 8},)") \
        == dict.fromkeys(range(4), True)
    assert mesh4.run(lambda: __import__("__main__").ten.dtype) == dict.fromkeys(range(4), torch.float32)
    assert settled(mesh4)
    assert dev_shm() == dev_shm_before


def test_pull_and_big_results_come_back_by_shared_memory(mesh4: Mesh) -> None:
    mesh4.exec(f"import numpy as np, torch\nimport monarch_nb as mnb\n"
               f"big = np.full({BIG // 8}, float(mnb.rank()))\n"
               f"bigt = torch.full(({BIG // 4},), float(mnb.rank()))")
    before = mesh4.dataplane
    pulled = mesh4.pull("big")
    assert mesh4.dataplane["mapped"] == before["mapped"] + 4
    for r in range(4):
        assert isinstance(pulled[r], np.ndarray) and pulled[r].shape == (BIG // 8,)
        assert (pulled[r] == r).all() and pulled[r].flags.writeable
    tens = mesh4.run(lambda: __import__("__main__").bigt * 2)
    assert mesh4.dataplane["mapped"] == before["mapped"] + 8
    for r in range(4):
        assert tens[r].dtype == torch.float32 and torch.equal(tens[r], torch.full((BIG // 4,), 2.0 * r))
    # with output ahead of the value in the same RESULT (the frames move one down)
    said = mesh4.run(lambda: (print("here it comes"), __import__("__main__").big)[1])
    assert mesh4.dataplane["mapped"] == before["mapped"] + 12
    assert all((said[r] == r).all() for r in range(4))
    # each rank closed its segments once the controller had mapped them (RELEASE)
    wait_for(lambda: settled(mesh4), timeout=10, what="the ranks to release their segments")
    stats = rank_stats(mesh4)
    for r in range(4):
        assert stats[r]["created"] == stats[r]["released"] >= 3


def test_big_call_arguments_go_by_shared_memory(mesh4: Mesh) -> None:
    x = torch.arange(BIG // 8, dtype=torch.float64)
    before = mesh4.dataplane["segments"]
    out = mesh4.run(lambda t, k: float(t.sum()) * k, x, k=2)
    assert out == dict.fromkeys(range(4), float(x.sum()) * 2)
    assert mesh4.dataplane["segments"] == before + 1
    assert settled(mesh4)


def test_small_values_stay_on_the_sockets(mesh4: Mesh) -> None:
    small = np.ones((shm.THRESHOLD - 4096) // 8)
    before, ranks_before = mesh4.dataplane, rank_stats(mesh4)
    mesh4.push(small=small)
    assert mesh4.pull("small")[2].sum() == small.sum()
    assert mesh4.dataplane == before
    assert rank_stats(mesh4) == ranks_before


def n_mapped(pid: int) -> int:
    """Segment mappings of process ``pid``."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if "/memfd:monarch-nb" in line)


def test_mappings_go_with_the_last_value_over_them(mesh4: Mesh) -> None:
    pids = rank_pids(mesh4)
    before = [n_mapped(p) for p in pids]
    for _ in range(3):  # each push replaces the last: its mapping goes with it
        mesh4.push(gone=np.ones(BIG // 8))
    assert [n_mapped(p) for p in pids] == [n + 1 for n in before]
    mesh4.exec("del gone\nimport gc\ngc.collect()")
    assert [n_mapped(p) for p in pids] == before
    mine = n_mapped(os.getpid())
    pulled = [mesh4.pull("arr") for _ in range(2)]
    assert n_mapped(os.getpid()) == mine + 8
    del pulled
    import gc

    gc.collect()
    assert n_mapped(os.getpid()) == mine


# -- semantics: every copy is its own -----------------------------------------------------------
def test_pushed_values_are_independent_copies(mesh4: Mesh) -> None:
    arr = np.zeros(BIG // 8)
    ten = torch.zeros(BIG // 4)
    mesh4.push(cow=arr, cowt=ten)
    arr[:] = 5.0  # the controller's own array after the push: the ranks keep theirs
    ten[:] = 5.0
    mesh4[1].exec("cow[:10] = 1.0\ncowt[:10] = 1.0")
    mesh4[2].exec("cow += 2.0\ncowt += 2.0")
    sums = mesh4.exec("(float(cow.sum()), float(cowt.sum()))")
    n = BIG // 8
    assert sums == {0: (0.0, 0.0), 1: (10.0, 10.0), 2: (2.0 * n, 2.0 * (BIG // 4)), 3: (0.0, 0.0)}
    # pulled values too: writing one does not touch another, nor the rank's own
    pulled = mesh4.pull("cow")
    pulled[0][:] = 9.0
    assert pulled[3].sum() == 0.0 and pulled[1].sum() == 10.0
    assert mesh4[0].exec("float(cow.sum())") == {0: 0.0}


# -- trust ----------------------------------------------------------------------------------
def _mark(x: Any) -> None:
    import __main__

    __main__.shm_runs = getattr(__main__, "shm_runs", 0) + 1
    __main__.shm_sum = float(x.sum())


def _signed_call(mesh: Mesh, codec: Codec, call_id: int, mesh_id: str | None = None,
                 edit: Any = None) -> tuple[list[bytes], shm.Segment]:
    """A CALL of ``_mark(big)`` whose big frame is in a segment made here
    (in the controller's process, so the pid is the controller's)."""
    payload = serialize.dumps_call(_mark, (np.ones(BIG // 8),), {})
    rest, desc, seg = shm.pack(payload, mesh_id or mesh._ctl.mesh_id)
    assert seg is not None and desc is not None
    if edit is not None:
        edit(desc)
    frames = [bytes(memoryview(f)) for f in codec.sign(Kind.CALL, rest, call=call_id,
                                                          meta={"shm": desc})]
    return frames, seg


def _deliver(mesh: Mesh, frames: list[bytes], rank: int = 0) -> None:
    io = mesh._ctl.io
    ident = mesh._ctl.ranks[rank].main_id
    io.call_soon(lambda: io.send(ident, frames))


def _rank0(mesh: Mesh, code: str) -> Any:
    return mesh[0].exec(code)[0]


def test_forged_descriptor_is_dropped_and_nothing_mapped(mesh4: Mesh) -> None:
    mesh4[0].exec("shm_runs = 0")
    stats, dropped = _rank0(mesh4, _RANK_STATS), _rank0(mesh4, _RANK_DROPPED)
    frames, seg = _signed_call(mesh4, Codec(os.urandom(32), "controller"), 2**40)
    try:
        _deliver(mesh4, frames)
        wait_for(lambda: _rank0(mesh4, _RANK_DROPPED).get("bad-signature", 0)
                 > dropped.get("bad-signature", 0), what="the forgery to be dropped")
        assert _rank0(mesh4, "shm_runs") == 0
        assert _rank0(mesh4, _RANK_STATS).get("mapped", 0) == stats.get("mapped", 0)
    finally:
        seg.close()


def test_forged_result_descriptor_is_dropped_by_the_controller(mesh4: Mesh) -> None:
    import zmq

    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, b"ghost.0.main")
    s.connect(mesh4._ctl.io.endpoint)
    payload = serialize.dumps(np.ones(BIG // 8))
    rest, desc, seg = shm.pack(payload, mesh4._ctl.mesh_id)
    try:
        before, mapped = mesh4.dropped, mesh4.dataplane["mapped"]
        s.send_multipart(Codec(os.urandom(32), "ghost.0.main").sign(
            Kind.RESULT, rest, call=1, meta={"shm": desc}))
        wait_for(lambda: mesh4.dropped.get("bad-signature", 0) > before.get("bad-signature", 0),
                 what="the forged result to be dropped")
        assert mesh4.dataplane["mapped"] == mapped
    finally:
        s.close(linger=0)
        seg.close()


def test_replayed_descriptor_is_dropped(mesh4: Mesh) -> None:
    mesh4[0].exec("shm_runs = 0")
    stats, dropped = _rank0(mesh4, _RANK_STATS), _rank0(mesh4, _RANK_DROPPED)
    frames, seg = _signed_call(mesh4, mesh4._ctl.codec, 2**40 + 1)
    try:
        _deliver(mesh4, frames)
        wait_for(lambda: _rank0(mesh4, "shm_runs") == 1, what="the signed call to run")
        assert _rank0(mesh4, "shm_sum") == BIG // 8
        for _ in range(3):
            _deliver(mesh4, frames)
        wait_for(lambda: _rank0(mesh4, _RANK_DROPPED).get("replay", 0)
                 >= dropped.get("replay", 0) + 3, what="the replays to be dropped")
        assert _rank0(mesh4, "shm_runs") == 1
        assert _rank0(mesh4, _RANK_STATS)["mapped"] == stats.get("mapped", 0) + 1
    finally:
        seg.close()


@pytest.mark.parametrize("case", ["other-process", "not-a-segment", "other-mesh", "wrong-token"])
def test_signed_descriptor_naming_a_foreign_segment_is_refused(mesh4: Mesh, case: str) -> None:
    """Correctly signed (a buggy key holder), but naming a file that is not
    this call's segment from this rank's controller: refused, not mapped."""
    mesh4[0].exec("shm_runs = 0")
    stats = _rank0(mesh4, _RANK_STATS)
    other_pid = rank_pids(mesh4)[1]

    def edit(desc: dict[str, Any]) -> None:
        if case == "other-process":  # another process's fd (rank 1's socket, say)
            desc["pid"], desc["fd"] = other_pid, 3
        elif case == "not-a-segment":  # the controller's own fd, but no segment (its eventfd)
            desc["fd"] = mesh4._ctl.io._wake_fd
        elif case == "other-mesh":  # a segment made for another mesh, relabelled
            desc["mesh"] = mesh4._ctl.mesh_id
        else:
            desc["tok"] = os.urandom(16).hex()

    frames, seg = _signed_call(mesh4, mesh4._ctl.codec, 2**40 + 10 + len(case),
                               mesh_id="other-mesh" if case == "other-mesh" else None, edit=edit)
    try:
        _deliver(mesh4, frames)
        wait_for(lambda: _rank0(mesh4, _RANK_STATS).get("refused", 0) > stats.get("refused", 0),
                 what="the descriptor to be refused")
        assert _rank0(mesh4, "shm_runs") == 0
        assert _rank0(mesh4, _RANK_STATS).get("mapped", 0) == stats.get("mapped", 0)
    finally:
        seg.close()
    assert mesh4.run(lambda: 1) == dict.fromkeys(range(4), 1)


def test_the_descriptor_is_signed_and_a_changed_one_is_dropped() -> None:
    """The descriptor is meta of the signed header: changing which fd it
    names breaks the signature, so verify drops it before anything reads it."""
    from monarch_nb.errors import ProtocolError

    key = os.urandom(32)
    rest, desc, seg = shm.pack(serialize.dumps(np.ones(BIG // 8)), "m1")
    assert seg is not None and desc is not None
    try:
        frames = [bytes(memoryview(f)) for f in Codec(key, "controller").sign(
            Kind.CALL, rest, call=1, meta={"shm": desc})]
        assert Codec(key, "r0.0.main").verify(frames).meta["shm"] == desc
        named = f'"fd":{desc["fd"]},'.encode()
        assert frames[0].count(named) == 1
        other = f'"fd":{(desc["fd"] + 1) % 10 + 10 * (desc["fd"] // 10)},'.encode()
        forged = [frames[0].replace(named, other), *frames[1:]]
        with pytest.raises(ProtocolError) as info:
            Codec(key, "r0.0.main").verify(forged)
        assert info.value.reason == "bad-signature"
        with pytest.raises(ValueError, match="shm"):  # the schema: a descriptor is an object
            Codec(key, "controller").sign(Kind.RESULT, rest, call=1, meta={"shm": "fd 3"})
    finally:
        seg.close()


def test_attach_refuses_a_peer_that_is_not_the_sender() -> None:
    """The controller's check of a result, in-process: a descriptor is
    taken only from the rank it came from."""
    rest, desc, seg = shm.pack(serialize.dumps(np.ones(BIG // 8)), "m1")
    assert seg is not None
    try:
        with pytest.raises(shm.ShmError, match="names process"):
            shm.attach(rest, desc, peer_pid=os.getpid() + 1, mesh_id="m1", max_bytes=1 << 30)
        with pytest.raises(shm.ShmError, match="mesh"):
            shm.attach(rest, desc, peer_pid=os.getpid(), mesh_id="m2", max_bytes=1 << 30)
        with pytest.raises(shm.ShmError, match="host"):
            shm.attach(rest, desc, peer_pid=None, mesh_id="m1", max_bytes=1 << 30)
        out = serialize.loads(shm.attach(rest, desc, peer_pid=os.getpid(), mesh_id="m1",
                                         max_bytes=1 << 30))
        assert out.sum() == BIG // 8 and out.flags.writeable
    finally:
        seg.close()


# -- fallback -------------------------------------------------------------------------------
def test_no_shared_memory_falls_back_to_the_sockets_with_one_notice(
        mesh4: Mesh, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "memfd_create", full)  # in the controller's process only
    monkeypatch.setattr(shm, "_noticed", False)
    before, ranks_before = mesh4.dataplane, rank_stats(mesh4)
    arr = np.arange(BIG // 8, dtype=np.float64)
    mesh4.push(fb=arr)
    mesh4.push(fb2=arr)
    after = mesh4.dataplane
    assert after["fallbacks"] == before["fallbacks"] + 2
    assert after["segments"] == before["segments"]
    assert rank_stats(mesh4) == ranks_before  # nothing mapped: it came by socket
    assert mesh4.exec("float(fb.sum()) + float(fb2.sum())") == dict.fromkeys(
        range(4), 2 * float(arr.sum()))
    err = capsys.readouterr().err
    notices = [line for line in err.splitlines() if "shared memory unavailable" in line]
    assert len(notices) == 1, err
    assert "through the sockets" in notices[0]


def test_a_rank_without_shared_memory_sends_its_result_by_socket(
        mesh4: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    mesh4[3].exec("import os, errno\n_real_memfd = os.memfd_create\n"
                  "def _full(*a):\n    raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))\n"
                  "os.memfd_create = _full\n"
                  f"import numpy as np\nfbr = np.arange({BIG // 8}, dtype=np.float64)")
    try:
        mapped = mesh4.dataplane["mapped"]
        got = mesh4[3].pull("fbr")[3]
        got2 = mesh4[3].pull("fbr")[3]
        assert got.sum() == got2.sum() == np.arange(BIG // 8, dtype=np.float64).sum()
        assert mesh4.dataplane["mapped"] == mapped  # it came by socket
        assert mesh4[3].exec("__import__('monarch_nb.wire.shm').wire.shm.stats['fallback']")[3] >= 2
    finally:
        mesh4[3].exec("os.memfd_create = _real_memfd")
    out = capsys.readouterr()
    notices = [line for line in (out.out + out.err).splitlines()
               if "shared memory unavailable" in line]
    assert len(notices) == 1, out


def test_big_values_on_an_encrypted_link_go_in_pieces_and_arrive_whole() -> None:
    # What a rank on another host gets: Curve on (a non-loopback bind, as in
    # test_curve.py) and no shared memory. A 20 MiB push, a 20 MiB argument
    # and a 20 MiB result cross the sockets in 4 MiB pieces (wire/chunks.py)
    # and arrive equal, as writable arrays of their own.
    from monarch_nb.wire import chunks

    mesh = Mesh.start(n=2, backend="cpu", spare=False, shm_threshold=None, bind="127.0.0.2")
    try:
        assert mesh._ctl.io.curve is not None
        joined = chunks.stats["joined"]
        src = np.arange(20 << 17, dtype=np.float64)  # 20 MiB
        mesh.push(sock_big=src, sock_t=torch.arange(5 << 20, dtype=torch.int32))
        check = ("import numpy as np\n"
                 "(float(sock_big.sum()), sock_big.flags.writeable, int(sock_t[-1]), "
                 "__import__('monarch_nb.wire.chunks').wire.chunks.stats['joined'])")
        got = mesh.exec(check)
        for r in (0, 1):
            total, writable, last, rank_joined = got[r]
            assert total == float(src.sum()) and writable and last == (5 << 20) - 1
            assert rank_joined >= 2  # both values came in pieces
        assert mesh.run(lambda a: float(a[::1024].sum()), src) == \
            dict.fromkeys((0, 1), float(src[::1024].sum()))
        back = mesh.pull("sock_big")
        assert all(np.array_equal(back[r], src) for r in (0, 1))
        assert chunks.stats["joined"] >= joined + 2  # the results came in pieces too
        assert mesh.dataplane["segments"] == 0  # nothing went by shared memory
    finally:
        mesh.stop()


# -- nothing leaks ------------------------------------------------------------------------------
def _store(**values: Any) -> None:
    import __main__

    vars(__main__).update(values)


@pytest.fixture
def mesh2() -> Iterator[Mesh]:
    mesh = Mesh.start(n=2, backend="cpu", spare=False)
    try:
        yield mesh
    finally:
        mesh.stop()


def test_nothing_left_after_a_rank_is_killed_mid_push_a_kill_storm_and_stop(mesh2: Mesh) -> None:
    shm_before = dev_shm()
    big = np.ones(BIG // 8)
    # rank 1 is busy: the push waits in its queue, holding the segment open
    busy = mesh2[1].run_async(time.sleep, 30)
    push = mesh2.run_async(_store, x=big)
    wait_for(lambda: maps_a_segment(rank_pids(mesh2)[0]), what="rank 0 to map the push")
    assert mesh2.dataplane["open"] == 1 and len(memfds(os.getpid())) == 1
    mesh2.kill(1)
    with pytest.raises(RankErrors):
        mesh2.wait(push, timeout=30)
    with pytest.raises(RankErrors):
        mesh2.wait(busy, timeout=30)
    assert mesh2.dataplane["open"] == 0 and memfds(os.getpid()) == []
    # a kill storm: ranks die while pushes, pulls and big results fly
    wait_for(lambda: all(r["state"] == "ready" for r in mesh2.status()), timeout=60,
             what="rank 1 to come back")
    for i in range(4):
        victim = i % 2
        incarnation = mesh2.status()[victim]["incarnation"]
        mesh2[victim].run_async(_die_soon)
        for _ in range(3):
            try:
                mesh2.push(x=big)
                mesh2.pull("x")
            except RankErrors:
                pass
        wait_for(lambda v=victim, n=incarnation: mesh2.status()[v]["incarnation"] > n
                 and all(r["state"] == "ready" for r in mesh2.status()), timeout=60,
                 what="the killed rank to come back")
    mesh2.push(x=big)
    assert mesh2.pull("x")[1].sum() == big.sum()
    wait_for(lambda: settled(mesh2), timeout=10, what="every segment to be closed")
    assert dev_shm() == shm_before
    pids = rank_pids(mesh2)
    mesh2.stop()
    assert mesh2.dataplane["open"] == 0 and memfds(os.getpid()) == []
    assert not any(psutil.pid_exists(p) and memfds(p) for p in pids)
    assert dev_shm() == shm_before


def _sum_or_die_once(x: Any) -> float:
    import monarch_nb as mnb
    from monarch_nb import chaos

    if mnb.rank() == 1 and mnb.incarnation() == 0:
        chaos.die("sigkill")
    return float(x.sum())


def test_an_elastic_call_keeps_its_segment_for_the_respawned_rank(mesh2: Mesh) -> None:
    """The segment stays open while the call is in flight: the rank's new
    process, given the re-issued call, maps the same segment."""
    big = np.arange(BIG // 8, dtype=np.float64)
    before = mesh2.dataplane["segments"]
    out = mesh2.run(_sum_or_die_once, big, elastic=True, timeout=120)
    assert out == dict.fromkeys(range(2), float(big.sum()))
    assert mesh2.status()[1]["incarnation"] == 1
    assert mesh2.dataplane["segments"] == before + 1
    assert mesh2[1].exec(_RANK_STATS)[1]["mapped"] == 1  # the new process mapped it
    wait_for(lambda: settled(mesh2), timeout=10, what="the segment to be closed")


def maps_a_segment(pid: int) -> bool:
    """Process ``pid`` has a segment mapped (read from outside: it may be busy)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "/memfd:monarch-nb" in f.read()
    except OSError:
        return False


def _die_soon() -> None:
    from monarch_nb import chaos

    chaos.die_later(0.05)


@pytest.mark.kernel
def test_kernel_sigkilled_mid_push_leaves_nothing() -> None:
    from .test_lifecycle_hostile import (
        MAGICS,
        ORPHAN_LIMIT_S,
        gone,
        kernel,
        start_mesh,
        wait_iopub_text,
    )

    shm_before = dev_shm()
    with kernel() as ks:
        info = start_mesh(ks, 2)
        pids = info["pids"]
        assert isinstance(pids, list)
        r = ks.run(f"import numpy as np\nbig = np.ones({64 << 17})")  # 64 MiB
        assert r.status == "ok", r
        msg_id = ks.execute(f"_m = {MAGICS}.mesh\nprint('pushing', flush=True)\n"
                            "for _ in range(10000):\n    _m.push(big=big)\n")
        wait_iopub_text(ks, msg_id, "pushing")
        kernel_pid = ks.pid
        wait_for(lambda: memfds(kernel_pid), timeout=30, what="a push to be in flight")
        os.kill(kernel_pid, 9)
        wait_for(lambda: all(gone(p) for p in pids), timeout=ORPHAN_LIMIT_S,
                 what="the ranks to end with their kernel")
        # The ranks get their death signal while the kernel is still being
        # torn down (a big address space takes a while to unmap).
        wait_for(lambda: gone(kernel_pid), timeout=30, what="the kernel to end")
    assert dev_shm() == shm_before
