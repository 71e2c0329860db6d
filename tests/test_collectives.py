"""The collective flight recorder on real ranks (gloo): who is missing from
a collective, strict mode, an extra collective, a straggler, why a rank
died, and the trace. One 3-rank mesh for the module: each test leaves it
usable (a stuck collective is released by the test itself: the skipping
rank joins late, the others make the extra rank's last call), and the
death tests come last (the ranks are respawned)."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from monarch_nb import Mesh, RankErrors
from monarch_nb.controller.calls.output import CallOutput
from monarch_nb.errors import RankDied
from monarch_nb.wire.protocol import Kind

from .conftest import wait_for
from .lab_util import IN_CI
from .tracecheck import check_chrome_trace, perfetto_slices, trace_processor_reason


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    m = Mesh.start(n=3, backend="cpu")
    try:
        yield m
    finally:
        m.stop()


def in_step(mesh: Mesh) -> None:
    """The group still works: one all_reduce on every rank."""
    res = mesh.exec("import torch, torch.distributed as dist\n_x = torch.ones(1)\n"
                    "dist.all_reduce(_x)\n_x.item()", timeout=60)
    assert res == dict.fromkeys(range(3), 3.0)


SKIP = """\
import os, time, torch, torch.distributed as dist, monarch_nb as mnb
x = torch.ones(8)
dist.all_reduce(x)
def stuck_here(flag):
    while not os.path.exists(flag):
        time.sleep(0.05)
if mnb.rank() == 2:
    stuck_here(FLAG)   # skips the all_reduce below until the test lets it go
dist.all_reduce(x)
"""


def test_a_rank_that_skips_a_collective(mesh: Mesh, tmp_path: Path) -> None:
    flag = tmp_path / "go"
    lines: list[str] = []
    out = CallOutput(lambda stream, text: lines.append(text))
    code = SKIP.replace("FLAG", repr(str(flag)))
    fut = mesh._ctl.submit(Kind.EXEC, (0, 1, 2), [], {"code": code, "name": "<mnb-cell-7>"},
                           out, hang_timeout=1.5)
    try:
        def stuck() -> object:
            # (not the moment rank 2 is still on its way to the first all_reduce)
            rep = mesh.collectives()
            # (nor the instant rank 0 is still finishing the first all_reduce)
            return rep if any(f.kind == "missing" and "stuck_here" in f.text
                              and f.text.startswith("ranks 0,1 wait in")
                              for f in rep.findings) else None

        report = wait_for(stuck, timeout=30, interval=0.2, what="ranks 0,1 waiting for rank 2")
        text = report.summary()[0]  # type: ignore[attr-defined]
        assert text.startswith("ranks 0,1 wait in all_reduce #") and \
            "(<mnb-cell-7> line 9); rank 2 never entered it (its last was #" in text, text
        assert text.endswith("it is in stuck_here (<mnb-cell-7> line 6): time.sleep(0.05)"), text
        # mesh.stacks() prints it first
        rendered = mesh.stacks().render()
        assert rendered.startswith("collectives (flight recorder):\n  ranks 0,1 wait in all_reduce")
        # the hang watchdog too, once, before the grouped stacks
        wait_for(lambda: "no progress for 1.5 s" in "".join(lines), timeout=20,
                 what="the hang watchdog")
        note = "".join(lines)
        assert "collectives (flight recorder):\n  ranks 0,1 wait in all_reduce" in note, note
        assert note.index("collectives (flight recorder)") < note.index("ranks 0,1: in all_reduce")
    finally:
        flag.touch()  # rank 2 calls it late: the group stays in step
        mesh.wait(fut, 30)
    assert mesh.collectives().ok
    in_step(mesh)


DDP_SKIP = """\
import os, time, torch, monarch_nb as mnb
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
model(torch.ones(2, 4)).sum().backward()
def stuck_here(flag):
    while not os.path.exists(flag):
        time.sleep(0.05)
if mnb.rank() == 2:
    stuck_here(FLAG)   # skips this step's backward until the test lets it go
model(torch.ones(2, 4)).sum().backward()
"""


def test_a_rank_that_skips_a_ddp_step_is_found_in_torchs_own_records(mesh: Mesh,
                                                                    tmp_path: Path) -> None:
    # DDP calls the process group from C++: the wrappers see none of its
    # collectives, torch's own flight recorder (turned on in every rank) does
    flag = tmp_path / "go"
    fut = mesh.exec(DDP_SKIP.replace("FLAG", repr(str(flag))), name="<mnb-cell-8>", block=False)
    try:
        def stuck() -> object:
            rep = mesh.collectives()
            return rep if any(f.kind == "missing" and "stuck_here" in f.text
                              for f in rep.findings) else None

        report = wait_for(stuck, timeout=30, interval=0.2, what="ranks 0,1 waiting in DDP")
        text = report.summary()[0]  # type: ignore[attr-defined]
        # which of DDP's collectives holds depends on DDP's internals (in the
        # second step it first re-broadcasts its buckets): the form does not
        assert text.startswith("torch's own recorder (DDP's and FSDP's collectives too; its "
                               "numbering): rank"), text
        assert "(inside torch: DDP, FSDP or another C++ caller); rank 2 never entered it (its " \
            "last was #" in text, text
        assert "it is in stuck_here (<mnb-cell-8> line 6): time.sleep(0.05)" in text, text
        assert "in torch's own recorder" in str(report) and " in flight" in str(report)
    finally:
        flag.touch()  # rank 2 makes its step late: the group stays in step
        mesh.wait(fut, 60)
    assert mesh.collectives().ok
    in_step(mesh)


def test_the_dashboard_badge_shows_a_desync_while_the_cell_blocks(mesh: Mesh,
                                                                 tmp_path: Path) -> None:
    # the kernel's main thread blocks in the cell (leading the I/O loop);
    # the dashboard's watcher thread still reads the recorders
    board = mesh.dashboard()
    sent: list[dict[str, Any]] = []
    board.send = lambda msg, buffers=None: sent.append(msg)
    flag = tmp_path / "go"
    seen: list[dict[str, Any]] = []

    def release() -> None:
        try:
            def badge() -> object:
                found = board.feed.flight["findings"]
                return found if any("never entered it" in f for f in found) else None

            wait_for(badge, timeout=40, interval=0.1, what="the badge")
            seen.append(dict(board.feed.flight))
        finally:
            flag.touch()

    helper = threading.Thread(target=release)
    helper.start()
    try:
        t0 = time.monotonic()
        mesh.exec(SKIP.replace("FLAG", repr(str(flag))), name="<mnb-cell-9>", timeout=60)
        assert time.monotonic() - t0 < 45
    finally:
        flag.touch()
        helper.join(10)
    assert seen, "the badge never showed the desync"
    (finding,) = seen[0]["findings"]
    assert finding.startswith("ranks 0,1 wait in all_reduce #") and \
        "(<mnb-cell-9> line 9); rank 2 never entered it (its last was #" in finding, finding
    assert finding.endswith("it is in stuck_here (<mnb-cell-9> line 6): time.sleep(0.05)")
    # (rank 2 may be marked slow too: it reached its collectives late)
    assert set(seen[0]["slow"]) <= {"2"}, seen
    # the browser got it in a delta; once the call ended the badge clears
    wait_for(lambda: any(m.get("flight", {}).get("findings") == [finding]
                         for m in sent), timeout=5, what="the badge's delta")
    wait_for(lambda: board.feed.flight["findings"] == [], timeout=20, what="the badge to clear")
    assert board.flight_looks >= 2
    in_step(mesh)


ASYNC = """\
import os, time, torch, torch.distributed as dist, monarch_nb as mnb
x = torch.ones(8)
def stuck_here(flag):
    while not os.path.exists(flag):
        time.sleep(0.05)
if mnb.rank() == 2:
    stuck_here(FLAG)   # never calls the all_reduce below until the test lets it go
work = dist.all_reduce(x, async_op=True)   # returns at once, as NCCL's and RCCL's calls do
work.wait()
"""


def test_an_async_collective_others_never_called(mesh: Mesh, tmp_path: Path) -> None:
    # what NCCL looks like: the calls return, the ranks block later
    groups = mesh.collectives().groups
    before = groups[0].last[0] if groups else None
    seq = 0 if before is None else before.seq + 1
    last = "it made none yet" if seq == 0 else f"its last was #{seq - 1} all_reduce"
    flag = tmp_path / "go"
    fut = mesh.exec(ASYNC.replace("FLAG", repr(str(flag))), name="<mnb-cell-12>", block=False)
    try:
        def enqueued() -> object:
            rep = mesh.collectives()
            # settled: ranks 0,1 past the call, rank 2 in its loop (not still on
            # the cell's first lines, which a busy machine can catch)
            return rep if any(f.text.startswith("ranks 0,1 enqueued") and "stuck_here" in f.text
                              for f in rep.findings) else None

        report = wait_for(enqueued, timeout=30, interval=0.2,
                          what="ranks 0,1 in work.wait(), rank 2 in stuck_here")
        assert report.summary() == [  # type: ignore[attr-defined]
            f"ranks 0,1 enqueued all_reduce #{seq} (<mnb-cell-12> line 8), which completes "
            f"only once every member calls it; rank 2 never called it ({last}): it is in "
            "stuck_here (<mnb-cell-12> line 5): time.sleep(0.05)"]
    finally:
        flag.touch()
        mesh.wait(fut, 30)
    assert mesh.collectives().ok
    in_step(mesh)


P2P = """\
import os, time, torch, torch.distributed as dist, monarch_nb as mnb
if mnb.rank() == 0:
    dist.recv(torch.zeros(4), src=1)
elif mnb.rank() == 1:
    while not os.path.exists(FLAG):
        time.sleep(0.05)
    dist.send(torch.ones(4), dst=0)
"""


def test_a_recv_waiting_for_its_sender(mesh: Mesh, tmp_path: Path) -> None:
    flag = tmp_path / "go"
    fut = mesh.exec(P2P.replace("FLAG", repr(str(flag))), name="<mnb-cell-11>", block=False)
    try:
        def waiting() -> object:
            rep = mesh.collectives()
            return rep if any(f.kind == "p2p" for f in rep.findings) else None

        report = wait_for(waiting, timeout=30, interval=0.2, what="rank 0 in recv")
        assert "rank 0 waits in recv(float32[4], src=1) (<mnb-cell-11> line 3)" in \
            report.summary(), report  # type: ignore[attr-defined]
    finally:
        flag.touch()
        mesh.wait(fut, 30)
    assert mesh.collectives().ok
    in_step(mesh)


def test_strict_mode_fails_a_shape_mismatch_at_once(mesh: Mesh) -> None:
    code = ("import torch, torch.distributed as dist, monarch_nb as mnb\n"
            "x = torch.ones(4 if mnb.rank() == 1 else 8)\n"
            "dist.all_reduce(x)\n")
    t0 = time.monotonic()
    with pytest.raises(RankErrors) as info:
        mesh.exec(code, name="<mnb-cell-8>", check_collectives=True, timeout=60)
    assert time.monotonic() - t0 < 20
    text = str(info.value)
    assert "3 of 3 rank(s) failed" in text
    assert ("--- ranks 0-2: monarch_nb.errors.CollectiveMismatch: the ranks disagree on a "
            "collective (strict mode, check_collectives=True): collective 1 of this call: "
            "ranks 0,2 called all_reduce(float32[8]) from <mnb-cell-8> line 3; rank 1 called "
            "all_reduce(float32[4]) from <mnb-cell-8> line 3") in text, text
    in_step(mesh)  # nothing was sent: the group is in step


def test_strict_mode_fails_a_skipped_collective_instead_of_hanging(mesh: Mesh) -> None:
    code = ("import torch, torch.distributed as dist, monarch_nb as mnb\n"
            "x = torch.ones(8)\n"
            "if mnb.rank() != 2:\n"
            "    dist.all_reduce(x)   # rank 2 skips it\n")
    t0 = time.monotonic()
    with pytest.raises(RankErrors) as info:
        mesh.exec(code, name="<mnb-cell-8>", check_collectives=True, timeout=60)
    assert time.monotonic() - t0 < 20
    text = str(info.value)
    assert "2 of 3 rank(s) failed" in text, text
    assert ("--- ranks 0,1: monarch_nb.errors.CollectiveMismatch: the ranks disagree on a "
            "collective (strict mode, check_collectives=True): collective 1 of this call: "
            "ranks 0,1 called all_reduce(float32[8]) from <mnb-cell-8> line 4; rank 2 "
            "finished the call without it; nothing was sent") in text, text
    in_step(mesh)


def test_strict_mode_fails_a_different_op_and_passes_a_good_call(mesh: Mesh) -> None:
    def step(bad: bool) -> float:
        import torch
        import torch.distributed as dist

        import monarch_nb as mnb

        x = torch.ones(4)
        for _ in range(3):
            dist.all_reduce(x)
        if bad and mnb.rank() == 2:
            dist.broadcast(x, src=0)
        else:
            dist.all_reduce(x)
        return float(x[0])

    assert mesh.run(step, False, check_collectives=True) == dict.fromkeys(range(3), 81.0)
    with pytest.raises(RankErrors) as info:
        mesh.run(step, True, check_collectives=True, timeout=60)
    text = str(info.value)
    assert "collective 4 of this call: ranks 0,1 called all_reduce(float32[4]) from step (" in text
    assert "rank 2 called broadcast(float32[4], src=0) from step (" in text, text
    in_step(mesh)


EXTRA = """\
import torch, torch.distributed as dist, monarch_nb as mnb
for step in range(4):
    x = torch.ones(4)
    dist.all_reduce(x)
    if mnb.rank() == 2 and step == 1:
        dist.all_reduce(torch.ones(4))   # one extra, on one rank
"""


def test_an_extra_collective_on_one_rank(mesh: Mesh) -> None:
    before = mesh.collectives().groups[0].last[0]
    base = 0 if before is None else before.seq + 1
    fut = mesh.exec(EXTRA, name="<mnb-cell-21>", block=False)
    try:
        def stuck() -> object:
            rep = mesh.collectives()
            # (not while ranks 0,1 are still on their way out of the cell)
            return rep if [f.kind for f in rep.findings] == ["missing", "diverged"] and \
                "they are idle" in rep.findings[0].text else None

        report = wait_for(stuck, timeout=30, interval=0.2, what="rank 2 alone in all_reduce")
        missing, diverged = report.summary()  # type: ignore[attr-defined]
        assert missing == (f"rank 2 waits in all_reduce #{base + 4} (<mnb-cell-21> line 4); "
                           f"ranks 0,1 never entered it (their last was #{base + 3} all_reduce): "
                           "they are idle (no call running)")
        assert diverged == (
            f"the ranks called the same collectives from different lines from #{base + 2}: "
            "ranks 0,1 called all_reduce(float32[4]) from <mnb-cell-21> line 4; rank 2 called "
            "all_reduce(float32[4]) from <mnb-cell-21> line 6")
    finally:
        # ranks 0,1 make the call rank 2 waits in: the counts agree again
        mesh.ranks("0,1").exec("import torch, torch.distributed as dist\n"
                               "dist.all_reduce(torch.ones(4))", timeout=60)
        mesh.wait(fut, 30)
    in_step(mesh)


SLOW = """\
import time, torch, torch.distributed as dist, monarch_nb as mnb
for step in range(22):
    time.sleep(0.06 if mnb.rank() == 1 else 0.02)   # rank 1: 3x the work
    x = torch.ones(16)
    dist.all_reduce(x)
    mnb.log(step=step, loss=1.0 / (step + 1))
"""


def test_a_rank_three_times_slower_is_a_straggler(mesh: Mesh) -> None:
    board = mesh.dashboard()
    # a name the automatic ones (<mnb-cell-N>, one counter per process) cannot take
    mesh.exec(SLOW, name="<mnb-cell-slow>", timeout=60)
    report = mesh.stragglers()
    assert report.slow == [1], report
    assert report.ranks[1].ratio > 2.0
    assert report.ranks[0].wait_share > 0.5 > report.ranks[1].wait_share
    assert str(report).startswith("stragglers: rank 1 consistently slower (>= 1.5x the median")
    # the dashboard marks rank 1's tile (its look after the call ended)
    looks = board.flight_looks
    slow = wait_for(lambda: board.flight_looks > looks and board.feed.flight["slow"], timeout=20,
                    what="the dashboard's look after the call")
    assert list(slow) == ["1"] and slow["1"] > 2.0, slow  # type: ignore[call-overload, index]
    assert board.feed.flight["findings"] == []


DDP_SLOW = """\
import time, torch, monarch_nb as mnb
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
for step in range(25):
    time.sleep(0.06 if mnb.rank() == 2 else 0.02)   # rank 2: 3x the work
    model(torch.ones(8, 16)).sum().backward()
"""


def test_a_slow_rank_in_a_ddp_loop_is_a_straggler(mesh: Mesh) -> None:
    # DDP's gradient all_reduces come from C++: only torch's own recorder
    # has them, with no end times on gloo; the arrivals tell who is slow
    mesh.exec(DDP_SLOW, name="<mnb-cell-31>", timeout=90)
    report = mesh.stragglers()
    assert report.slow == [2], report
    assert report.ranks[2].ratio > 2.0, report
    assert report.ranks[0].wait_share > 0.5 > report.ranks[2].wait_share, report
    assert "in torch's own recorder" in report.window


def test_trace_has_calls_collectives_and_steps(mesh: Mesh, tmp_path: Path) -> None:
    path = mesh.trace(str(tmp_path / "mesh.json"))
    doc = json.loads(Path(path).read_text())
    ev = doc["traceEvents"]
    assert {e["args"]["name"] for e in ev if e["name"] == "process_name"} >= {
        "rank 0", "rank 1", "rank 2", "mesh"}
    calls = [e for e in ev if e["ph"] == "X" and e.get("cat") == "call" and e["pid"] == 1]
    assert any(c["name"] == "<mnb-cell-slow>" for c in calls)
    colls = [e for e in ev if e["ph"] == "X" and e.get("cat") == "collective" and e["pid"] == 1]
    assert len(colls) >= 22 and colls[-1]["args"]["op"] == "all_reduce(float32[16])"
    slow_cell = next(c for c in calls if c["name"] == "<mnb-cell-slow>")
    inside = [c for c in colls if slow_cell["ts"] <= c["ts"] <= slow_cell["ts"] + slow_cell["dur"]]
    assert len(inside) == 22 and inside[0]["args"]["from"] == "<mnb-cell-slow> line 5"
    assert any(e["ph"] == "C" and e["name"] == "step" for e in ev)
    assert sorted({e["ph"] for e in ev}) >= ["C", "M", "X"]
    check_chrome_trace(doc)  # loads in Perfetto / chrome://tracing as it is


def test_trace_reads_back_in_perfettos_trace_processor(mesh: Mesh, tmp_path: Path) -> None:
    why = trace_processor_reason()
    if why and not IN_CI:
        pytest.skip(why)
    assert not why, f"in CI Perfetto's trace processor must run: {why}"
    path = mesh.trace(str(tmp_path / "mesh.json"))
    slices = perfetto_slices(path)
    rank1 = [s for s in slices if s["process"] == "rank 1"]
    cells = [s for s in rank1 if s["thread"] == "calls" and s["name"] == "<mnb-cell-slow>"]
    assert len(cells) == 1, rank1
    cell = cells[0]
    inside = [s for s in rank1 if s["thread"] == "collectives"
              and cell["ts"] <= s["ts"] <= cell["ts"] + cell["dur"]]
    assert len(inside) == 22 and all(s["name"].startswith("all_reduce #") for s in inside)
    assert {s["process"] for s in slices} >= {"rank 0", "rank 1", "rank 2"}


DIFFERENT_OP = """\
import torch, torch.distributed as dist, monarch_nb as mnb
x = torch.ones(8)
if mnb.rank() == 2:
    dist.broadcast(torch.ones(4), src=0)   # a different op (and shape) on one rank
else:
    dist.all_reduce(x)
"""


def test_a_different_op_on_one_rank_is_named_while_they_hang(mesh: Mesh) -> None:
    # without strict mode gloo hangs (every rank in its own collective); the
    # recorders say which rank called what, from where
    groups = mesh.collectives().groups
    before = groups[0].last[0] if groups else None
    seq = 0 if before is None else before.seq + 1
    fut = mesh.exec(DIFFERENT_OP, name="<mnb-cell-7>", block=False)
    try:
        def mismatch() -> object:
            rep = mesh.collectives()
            return rep if rep.findings and rep.findings[0].kind == "mismatch" else None

        report = wait_for(mismatch, timeout=30, interval=0.2, what="the mismatch")
        assert report.summary() == [  # type: ignore[attr-defined]
            f"#{seq}: ranks 0,1 called all_reduce(float32[8]) from <mnb-cell-7> line 6; "
            "rank 2 called broadcast(float32[4], src=0) from <mnb-cell-7> line 4"]
        assert (f"ranks 0,1: #{seq} all_reduce(float32[8]) in flight; rank 2: #{seq} "
                "broadcast(float32[4], src=0) in flight") in str(report)
    finally:
        # the group is out of step: fresh processes (as %monarch restart all)
        fut.cancel()
        mesh.restart("all")
        wait_for(lambda: all(r["state"] == "ready" for r in mesh.status()), timeout=90,
                 what="the ranks back")
    with pytest.raises(concurrent.futures.CancelledError):
        mesh.wait(fut, 30)
    in_step(mesh)


def test_a_segfault_is_named_with_the_line(mesh: Mesh) -> None:
    with pytest.raises(RankErrors) as info:
        mesh.ranks(1).exec("import ctypes\nctypes.string_at(0)\n", name="<mnb-cell-40>",
                           timeout=60)
    text = str(info.value)
    assert ("--- rank 1: RankDied: rank 1 died (killed by SIGSEGV): Segmentation fault in "
            "string_at (ctypes/__init__.py line ") in text, text
    assert "called from <mnb-cell-40> line 2; native: libc.so.6+0x" in text, text
    # the crashing thread's whole stack, Python then native (torch's c10 handler)
    died_err = info.value.errors[1]
    assert isinstance(died_err, RankDied)
    stack = list(died_err.crash_stack)
    assert stack[0] == "Python (most recent call first):", stack
    assert stack[1].startswith("  string_at (ctypes/__init__.py line ") and stack[2] == (
        "  <mnb-cell-40> line 2"), stack
    native = stack[stack.index("native (most recent call first):") + 1:]
    assert any("_ctypes" in f for f in native) and "  (Python frames)" in native, stack
    assert "the crashing thread:\n    Python (most recent call first):" in text
    died = [e for e in mesh.events if e["kind"] == "died" and e["rank"] == 1][-1]
    assert "Segmentation fault in string_at" in died["detail"]
    assert "; native: libc.so.6+0x" in died["detail"]
    wait_for(lambda: mesh.status()[1]["state"] == "ready", timeout=60, what="rank 1 back")


def test_an_abort_is_named_with_the_line(mesh: Mesh) -> None:
    with pytest.raises(RankErrors) as info:
        mesh.ranks(2).exec("import os\ndef give_up():\n    os.abort()\ngive_up()\n",
                           name="<mnb-cell-43>", timeout=60)
    text = str(info.value)
    assert ("--- rank 2: RankDied: rank 2 died (killed by SIGABRT): Aborted in give_up "
            "(<mnb-cell-43> line 3); native: ") in text, text
    assert "  abort (libc.so.6)" in info.value.errors[2].crash_stack, text
    wait_for(lambda: mesh.status()[2]["state"] == "ready", timeout=60, what="rank 2 back")


MISMATCH = """\
import torch, torch.distributed as dist, monarch_nb as mnb
x = torch.ones(4 if mnb.rank() == 2 else 8)
dist.all_reduce(x)
"""


def _died(info: Any) -> tuple[int, RankDied]:
    dead = [(r, e) for r, e in info.value.errors.items() if isinstance(e, RankDied)]
    assert dead, str(info.value)
    return dead[0]


def test_a_shape_mismatch_that_aborts_a_rank_names_the_collective(mesh: Mesh) -> None:
    # no strict mode: gloo overruns the smaller buffer, and the corruption
    # ends that rank (an abort, or an exit when it hit the rank's own
    # objects, as in a forked rank); its persisted records say where
    with pytest.raises(RankErrors) as info:
        mesh.exec(MISMATCH, name="<mnb-cell-50>", timeout=60)
    text = str(info.value)
    rank, err = _died(info)
    # the user sees both sides: the dead rank's shape and the others'
    shape, others = ("float32[4]", "float32[8]") if rank == 2 else ("float32[8]", "float32[4]")
    them = "ranks 0,1" if rank == 2 else "rank 2"
    assert re.search(rf"rank {rank} died \((killed by SIG[A-Z]+|exited with code \d+)\): "
                     rf"in all_reduce #(\d+) of "
                     rf"{re.escape(shape)} from <mnb-cell-50> line 3, while {them} called "
                     rf"all_reduce #\2 of {re.escape(others)} \(the ranks called different "
                     r"collectives: strict mode, check_collectives=True or %monarch start "
                     r"--check-collectives, names each rank's call before anything is sent\)",
                     text), text
    died = [e for e in mesh.events if e["kind"] == "died" and e["rank"] == rank][-1]
    assert "in all_reduce #" in died["detail"] and "<mnb-cell-50> line 3" in died["detail"], died
    assert err.cause_hint.startswith("in all_reduce #"), err.cause_hint
    wait_for(lambda: all(s["state"] == "ready" for s in mesh.status()), timeout=90,
             what="every rank back")


KILLED_IN = """\
import os, signal, threading, time, torch, torch.distributed as dist, monarch_nb as mnb
x = torch.ones(8)
if mnb.rank() == 1:   # killed while it waits in the all_reduce below
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
if mnb.rank() == 2:
    time.sleep(4)
dist.all_reduce(x)
"""


def test_a_rank_killed_while_waiting_in_a_collective_names_it(mesh: Mesh) -> None:
    with pytest.raises(RankErrors) as info:
        mesh.exec(KILLED_IN, name="<mnb-cell-51>", timeout=60)
    text = str(info.value)
    assert re.search(r"--- rank 1: RankDied: rank 1 died \(killed by SIGKILL\): in all_reduce "
                     r"#\d+ of float32\[8\] from <mnb-cell-51> line 7, with rank 0 in it too, "
                     r"rank 2 had not reached it; SIGKILL that monarch_nb did not send", text), text
    assert "strict mode" not in info.value.errors[1].cause_hint  # a kill, not a crash
    wait_for(lambda: all(s["state"] == "ready" for s in mesh.status()), timeout=90,
             what="every rank back")
    in_step(mesh)


def test_a_memory_error_that_ends_a_rank_is_named(mesh: Mesh, tmp_path: Path) -> None:
    # a rank that cannot go on after a MemoryError (here: it exits, as a
    # framework's error handler does), its traceback in its log
    code = ("import os, traceback\ntry:\n    bytearray(1 << 62)\nexcept MemoryError:\n"
            "    traceback.print_exc()\n    os._exit(1)\n")
    with pytest.raises(RankErrors) as info:
        mesh.ranks(2).exec(code, name="<mnb-cell-41>", timeout=60)
    text = str(info.value)
    assert ("--- rank 2: RankDied: rank 2 died (exited with code 1): out of memory: its last "
            "exception was MemoryError; its last output:") in text, text
    wait_for(lambda: mesh.status()[2]["state"] == "ready", timeout=60, what="rank 2 back")
    # the trace shows the deaths and respawns as instants
    doc = json.loads(Path(mesh.trace(str(tmp_path / "t.json"))).read_text())
    check_chrome_trace(doc)
    instants = {(e["pid"], e["name"].split(":")[0]) for e in doc["traceEvents"] if e["ph"] == "i"}
    assert {(2, "died"), (2, "respawned")} <= instants  # the trace's pid is the rank
    in_step(mesh)


def _child_memory_cgroup(name: str, limit: int) -> Path:
    """A memory cgroup under this process's own, limited to ``limit``
    bytes (v1 or v2); pytest.skip, saying why, where the machine does not
    allow it (not root, no memory controller, a read-only cgroupfs)."""
    import os

    own = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = [path for _, controllers, path in (line.split(":", 2) for line in own)
          if "memory" in controllers.split(",")]
    if v1:
        parent, limit_file = Path("/sys/fs/cgroup/memory") / v1[0].lstrip("/"), \
            "memory.limit_in_bytes"
    else:
        v2 = [path for _, controllers, path in (line.split(":", 2) for line in own)
              if controllers == ""]
        parent, limit_file = Path("/sys/fs/cgroup") / (v2 or ["/"])[0].lstrip("/"), "memory.max"
        control = parent / "cgroup.subtree_control"
        if not control.exists() or "memory" not in control.read_text().split():
            pytest.skip("no cgroup memory controller this process may use "
                        "(neither a v1 'memory' hierarchy nor 'memory' in v2 subtree_control)")
    child = parent / name
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup under {parent}: {exc} "
                    f"(root with a writable cgroupfs is needed; uid {os.getuid()})")
    try:
        (child / limit_file).write_text(str(limit))
    except OSError as exc:
        child.rmdir()
        pytest.skip(f"cannot set a memory limit on {child}: {exc}")
    return child


OOM = """\
import os, time
open(CGROUP + "/cgroup.procs", "w").write(str(os.getpid()))   # into the limited cgroup
time.sleep(1.2)   # heartbeats report its limit
keep = []
while True:   # a leak: 8 MiB every 0.1 s, until the kernel's OOM killer steps in
    keep.append(b"x" * (8 << 20))
    time.sleep(0.1)
"""


def test_a_rank_killed_by_the_oom_killer_in_its_cgroup(mesh: Mesh) -> None:
    import os
    import re

    cgroup = _child_memory_cgroup(f"mnb-oom-{os.getpid()}", 256 << 20)
    try:
        with pytest.raises(RankErrors) as info:
            mesh.ranks(0).exec(OOM.replace("CGROUP", repr(str(cgroup))), name="<mnb-cell-42>",
                               timeout=90)
        text = str(info.value)
        assert re.search(r"--- rank 0: RankDied: rank 0 died \(killed by SIGKILL\): probably the "
                         r"kernel's OOM killer: its memory cgroup was last seen at \d+ MiB of its "
                         r"256 MiB limit, last RSS seen \d+ MiB; during <mnb-cell-42>", text), text
        died = [e for e in mesh.events if e["kind"] == "died" and e["rank"] == 0][-1]
        assert "probably the kernel's OOM killer" in died["detail"], died
        wait_for(lambda: mesh.status()[0]["state"] == "ready", timeout=60, what="rank 0 back")
        in_step(mesh)
    finally:
        def removed() -> bool:
            try:
                cgroup.rmdir()  # once the killed process is gone from it
            except FileNotFoundError:
                return True
            except OSError:
                return False
            return True

        wait_for(removed, timeout=30, interval=0.2, what=f"{cgroup} to empty")


# -- dead incarnations in collectives() and the trace (issue 29.3) ------------------------
def _all_ready(mesh: Mesh) -> None:
    wait_for(lambda: all(s["state"] == "ready" for s in mesh.status()), timeout=90,
             what="every rank back")


def _incarnation_died(mesh: Mesh, rank: int) -> int:
    return [e for e in mesh.events if e["kind"] == "died" and e["rank"] == rank][-1]["incarnation"]


def _died_finding(report: Any, rank: int, incarnation: int, op: str, cell: str) -> str:
    texts = [f.text for f in report.findings if f.kind == "died"]
    found = [t for t in texts if re.fullmatch(
        rf"rank {rank} died in #\d+ {re.escape(op)} from {re.escape(cell)} \(incarnation "
        rf"{incarnation}; its persisted records\)", t)]
    assert found, report.render()
    return found[0]


def _trace_keeps(mesh: Mesh, tmp_path: Path, rank: int, incarnation: int, op: str,
                 cell: str) -> None:
    """The trace has the dead incarnation's collective (ending in a 'died in'
    instant) and its cell on the rank's tracks, where the new incarnation's
    slices are too, with the death and respawn instants."""
    in_step(mesh)  # the new incarnation makes a collective of its own
    doc = json.loads(Path(mesh.trace(str(tmp_path / "dead.json"))).read_text())
    check_chrome_trace(doc)
    ev = doc["traceEvents"]
    old = [e for e in ev if e["ph"] == "X" and e["args"].get("incarnation") == incarnation
           and e["pid"] == rank]
    coll = [e for e in old if e["args"].get("state") == "died in it"]
    assert coll and coll[-1]["args"]["op"] == op and coll[-1]["name"].startswith(
        op.split("(")[0] + " #"), old
    calls = [e for e in old if e["name"] == cell]
    assert calls and calls[-1]["args"]["state"] == "died", old
    tids = {e["tid"] for e in ev if e["ph"] == "X" and e["pid"] == rank
            and "incarnation" not in e["args"]}
    assert {coll[-1]["tid"], calls[-1]["tid"]} <= tids, "the new incarnation's tracks"
    inst = {(e["pid"], e["name"].split(":")[0]) for e in ev if e["ph"] == "i"}
    assert {(rank, "died"), (rank, "respawned"),
            (rank, f"died in {coll[-1]['name']}")} <= inst, inst


def test_a_shape_mismatch_death_stays_in_collectives_and_the_trace(mesh: Mesh,
                                                                  tmp_path: Path) -> None:
    with pytest.raises(RankErrors) as info:
        mesh.exec(MISMATCH, name="<mnb-cell-52>", timeout=60)
    rank, _ = _died(info)
    _all_ready(mesh)
    inc = _incarnation_died(mesh, rank)
    report = mesh.collectives()
    shape = "float32[4]" if rank == 2 else "float32[8]"
    _died_finding(report, rank, inc, f"all_reduce({shape})", "<mnb-cell-52> line 3")
    # both sides: the dead incarnation's and the others' (of its generation)
    mismatch = [f.text for f in report.findings if f.kind == "mismatch"]
    assert any(re.fullmatch(
        r"before ranks? [0-9,-]+ died: #\d+: ranks 0,1 called all_reduce\(float32\[8\]\) from "
        r"<mnb-cell-52> line 3; rank 2 called all_reduce\(float32\[4\]\) from <mnb-cell-52> "
        r"line 3", t) for t in mismatch), report.render()
    assert any(t.rank == rank and t.dead == inc for t in report.dead)
    assert "died in it" in report.render()
    _trace_keeps(mesh, tmp_path, rank, inc, f"all_reduce({shape})", "<mnb-cell-52>")
    # the next call finished: that death is no longer "this call's"
    assert not [f for f in mesh.collectives().findings if f.kind == "died"]


OTHER_OP_UNTIL_KILLED = """\
import torch, torch.distributed as dist, monarch_nb as mnb
x = torch.ones(8)
if mnb.rank() == 2:
    dist.broadcast(x, src=0)
else:
    dist.all_reduce(x)
"""


def test_a_different_op_killed_while_stuck_stays_in_collectives_and_the_trace(
        mesh: Mesh, tmp_path: Path) -> None:
    fut = mesh.exec_async(OTHER_OP_UNTIL_KILLED, name="<mnb-cell-53>")
    try:
        def stuck() -> bool:
            return any(f.kind == "mismatch" and "broadcast" in f.text
                       for f in mesh.collectives().findings)

        wait_for(stuck, timeout=30, interval=0.2, what="the ranks stuck in different ops")
        mesh.kill(2)
        with pytest.raises(RankErrors) as info:
            fut.result(timeout=60)
    finally:
        if not fut.done():
            fut.cancel()
    assert isinstance(info.value.errors[2], RankDied), str(info.value)
    _all_ready(mesh)
    inc = _incarnation_died(mesh, 2)
    report = mesh.collectives()
    _died_finding(report, 2, inc, "broadcast(float32[8], src=0)", "<mnb-cell-53> line 4")
    mismatch = [f.text for f in report.findings if f.kind == "mismatch"]
    assert any(re.fullmatch(
        r"before rank 2 died: #\d+: ranks 0,1 called all_reduce\(float32\[8\]\) from "
        r"<mnb-cell-53> line 6; rank 2 called broadcast\(float32\[8\], src=0\) from "
        r"<mnb-cell-53> line 4", t) for t in mismatch), report.render()
    _trace_keeps(mesh, tmp_path, 2, inc, "broadcast(float32[8], src=0)", "<mnb-cell-53>")


def test_a_rank_killed_in_all_reduce_stays_in_collectives_and_the_trace(mesh: Mesh,
                                                                       tmp_path: Path) -> None:
    with pytest.raises(RankErrors) as info:
        mesh.exec(KILLED_IN, name="<mnb-cell-54>", timeout=60)
    assert isinstance(info.value.errors[1], RankDied), str(info.value)
    _all_ready(mesh)
    inc = _incarnation_died(mesh, 1)
    report = mesh.collectives()
    _died_finding(report, 1, inc, "all_reduce(float32[8])", "<mnb-cell-54> line 7")
    # its generation's progress, its side named
    assert re.search(r"  before rank 1 died: the default group \(ranks 0-2\): .*rank 1: #\d+ "
                     r"all_reduce\(float32\[8\]\) died in it", report.render()), report.render()
    _trace_keeps(mesh, tmp_path, 1, inc, "all_reduce(float32[8])", "<mnb-cell-54>")


ALONE_UNTIL_KILLED = """\
import os, signal, threading, time, torch, torch.distributed as dist, monarch_nb as mnb
x = torch.ones(8)
if mnb.rank() == 2:   # alone in it: the others wait for the test's flag
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
    dist.all_reduce(x)
while not os.path.exists(FLAG):
    time.sleep(0.05)
"""


def test_a_death_in_a_call_still_running_is_in_collectives(mesh: Mesh, tmp_path: Path) -> None:
    # the call runs on (ranks 0,1 wait for the flag); rank 2 is not back
    # (its re-formation waits for them): its dead incarnation stands for it
    flag = tmp_path / "go"
    fut = mesh.exec_async(ALONE_UNTIL_KILLED.replace("FLAG", repr(str(flag))),
                          name="<mnb-cell-55>")
    try:
        def dead_seen() -> object:
            rep = mesh.collectives()
            return rep if any(f.kind == "died" for f in rep.findings) else None

        report = wait_for(dead_seen, timeout=30, interval=0.2, what="rank 2's death")
        inc = _incarnation_died(mesh, 2)
        _died_finding(report, 2, inc, "all_reduce(float32[8])", "<mnb-cell-55> line 5")
        assert re.search(r"  the default group \(ranks 0-2\): ranks 0,1: (none yet|#\d+ "
                         r"all_reduce\(float32\[\d+\]\) done); rank 2: #\d+ all_reduce\(float32\[8\]\) "
                         r"died in it", str(report)), str(report)
        assert not fut.done()
    finally:
        flag.touch()
    with pytest.raises(RankErrors) as info:
        fut.result(timeout=60)
    # (RankDied, or, this late in the module, its restart budget spent)
    assert set(info.value.errors) == {2} and "rank 2 died" in str(info.value), str(info.value)
    if mesh.status()[2]["state"] == "failed":
        mesh.restart(2)
    _all_ready(mesh)
    in_step(mesh)
