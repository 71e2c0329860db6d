"""The Python API against real rank processes (gloo on CPU)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import psutil
import pytest
import torch

import monarch_nb as mnb
from monarch_nb import (
    CallTimeout,
    MembershipChanged,
    Mesh,
    MeshNotRunning,
    MonarchError,
    RankDied,
    RankErrors,
    RankResults,
    UsageError,
)

from .conftest import wait_for, worker_pids


def _all_reduce_sum() -> float:
    import torch.distributed as dist

    x = torch.ones(1) * (mnb.rank() + 1)
    dist.all_reduce(x)
    return x.item()


def test_group_is_formed_before_the_first_call(healthy: Mesh) -> None:
    def probe() -> dict:
        import torch.distributed as dist

        return {"init": dist.is_initialized(), "backend": dist.get_backend(),
                "rank": dist.get_rank(), "world": dist.get_world_size()}

    res = healthy.run(probe)
    assert sorted(res) == [0, 1, 2, 3]
    for r, v in res.items():
        assert v == {"init": True, "backend": "gloo", "rank": r, "world": 4}


def test_all_reduce_across_ranks(healthy: Mesh) -> None:
    assert healthy.run(_all_reduce_sum) == dict.fromkeys(range(4), 10.0)


def test_rank_environment_and_rank_api(healthy: Mesh) -> None:
    def env() -> dict:
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "CUDA_VISIBLE_DEVICES")
        return {"env": {k: os.environ.get(k) for k in keys}, "rank": mnb.rank(),
                "world": mnb.world_size(), "local": mnb.local_rank(), "device": str(mnb.device()),
                "inc": mnb.incarnation()}

    res = healthy.run(env)
    ports = {v["env"]["MASTER_PORT"] for v in res.values()}
    assert len(ports) == 1 and ports.pop().isdigit()
    for r, v in res.items():
        assert v["env"]["RANK"] == str(r) and v["env"]["LOCAL_RANK"] == str(r)
        assert v["env"]["WORLD_SIZE"] == "4" and v["env"]["LOCAL_WORLD_SIZE"] == "4"
        assert v["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert v["env"]["CUDA_VISIBLE_DEVICES"] == ""  # a CPU mesh never grabs GPUs
        assert (v["rank"], v["world"], v["local"], v["device"], v["inc"]) == (r, 4, r, "cpu", 0)


def test_rank_api_outside_a_rank_says_where_it_works() -> None:
    with pytest.raises(MonarchError, match="only works inside a rank"):
        mnb.rank()


def test_exec_keeps_a_namespace_and_returns_last_expression(healthy: Mesh) -> None:
    healthy.exec("import monarch_nb as mnb\ncounter = mnb.rank() * 10")
    assert healthy.exec("counter + 1") == {0: 1, 1: 11, 2: 21, 3: 31}
    assert healthy.exec("counter + 1;") == dict.fromkeys(range(4))
    assert healthy.exec("y = 5") == dict.fromkeys(range(4))
    # an unnamed exec is never called <mnb-cell-N>, the magics' name of notebook
    # cell N: two cells of one name would share the ranks' source lines
    with pytest.raises(RankErrors) as info:
        healthy[0].exec("x = 1\nraise ValueError('seen')")
    assert '"<mnb-cell-exec-' in str(info.value) and "line 2" in str(info.value), info.value


def test_a_cell_longer_than_a_header_runs(healthy: Mesh) -> None:
    """A cell's code travels as a payload frame: one over the header's 64 KiB
    bound (a notebook cell with a big literal, say) was dropped by the ranks
    as oversized, and its call waited for ever."""
    table = ", ".join(str(i) for i in range(40_000))  # ~230 KB of code
    out = healthy.exec(f"big = [{table}]\nlen(big)", timeout=60)
    assert out.values_list() == [40_000] * len(out)


def test_run_arguments_tensors_and_results(healthy: Mesh) -> None:
    big = torch.arange(200_000, dtype=torch.float32)
    res = healthy.run(lambda t, k=0: (t * (mnb.rank() + k)).sum().item(), big, k=1)
    base = float(big.sum())
    assert res == {r: base * (r + 1) for r in range(4)}
    back = healthy[2].run(lambda: torch.full((1000, 100), float(mnb.rank())))
    assert torch.equal(back[2], torch.full((1000, 100), 2.0))


def test_sub_meshes_select_ranks(healthy: Mesh) -> None:
    assert sorted(healthy[1:3].run(mnb.rank)) == [1, 2]
    assert sorted(healthy.ranks("::2").run(mnb.rank)) == [0, 2]
    assert sorted(healthy.ranks([3]).run(mnb.rank)) == [3]
    assert healthy[0].run(mnb.rank) == {0: 0}
    with pytest.raises(UsageError, match="does not exist"):
        healthy.ranks("7")
    with pytest.raises(UsageError, match="not in this sub-mesh"):
        healthy[0:2].ranks("3")


def test_push_and_pull(healthy: Mesh) -> None:
    arr = np.arange(6.0)
    healthy.push(w=arr, scale=3)
    assert healthy.exec("float(w.sum() * scale + mnb.rank())") == {r: 45.0 + r for r in range(4)}
    pulled = healthy.ranks("1").pull("w")
    assert list(pulled) == [1] and np.array_equal(pulled[1], arr)
    with pytest.raises(RankErrors) as info:
        healthy.pull("never_defined")
    assert "NameError" in str(info.value) and "never_defined" in str(info.value)
    with pytest.raises(UsageError):
        healthy.push()
    with pytest.raises(UsageError):
        healthy.pull("not a name")


def test_errors_are_grouped_with_cell_source(healthy: Mesh) -> None:
    code = "a = 1\nif mnb.rank() % 2:\n    1/0\nelse:\n    raise KeyError('even')\n"
    with pytest.raises(RankErrors) as info:
        healthy.exec(code)
    err = info.value
    groups = err.groups()
    assert [ranks for ranks, _ in groups] == [(0, 2), (1, 3)]
    text = str(err)
    assert "ranks 1,3: ZeroDivisionError" in text and "ranks 0,2: KeyError" in text
    assert "1/0" in text and "raise KeyError('even')" in text  # the cell's own lines
    assert err.results == {}
    assert healthy.run(lambda: 1) == dict.fromkeys(range(4), 1)  # still usable


def test_partial_failure_keeps_the_other_results(healthy: Mesh) -> None:
    def maybe() -> int:
        if mnb.rank() == 2:
            raise RuntimeError("only rank 2")
        return mnb.rank()

    with pytest.raises(RankErrors) as info:
        healthy.run(maybe)
    assert info.value.results == {0: 0, 1: 1, 3: 3}
    assert list(info.value.errors) == [2]


def test_syntax_error_is_caught_before_sending(healthy: Mesh) -> None:
    with pytest.raises(UsageError, match="line 2") as info:
        healthy.exec("x = 1\ny = (\n")
    assert "nothing was sent" in str(info.value)


def test_unpicklable_argument_and_result(healthy: Mesh) -> None:
    lock = threading.Lock()
    with pytest.raises(UsageError, match="argument 0"):
        healthy.run(lambda x: x, lock)
    with pytest.raises(RankErrors, match="cannot be sent back"):
        healthy.run(lambda: threading.Lock())
    assert healthy.run(lambda: 2) == dict.fromkeys(range(4), 2)
    with pytest.raises(UsageError, match="needs a function"):
        healthy.run(42)  # type: ignore[arg-type]


def test_result_the_kernel_cannot_rebuild_is_an_error_not_a_hang(healthy: Mesh) -> None:
    # An instance of a class from a module only the ranks have: it pickles
    # there (by reference) and cannot be unpickled in the kernel. With and
    # without output, so both result paths of the controller are crossed.
    make = """
import sys, types
mod = types.ModuleType("mnb_rank_only_module")
exec("class Thing:\\n    pass", mod.__dict__)
mod.Thing.__module__ = "mnb_rank_only_module"
sys.modules["mnb_rank_only_module"] = mod
"""
    healthy.exec(make)
    for code in ("mod.Thing()", "print('hi'); mod.Thing()"):
        with pytest.raises(RankErrors, match="cannot be rebuilt in the kernel"):
            healthy.exec(code, timeout=30)
    assert healthy.run(lambda: 3) == dict.fromkeys(range(4), 3)


def test_output_arrives_before_the_result(healthy: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    def chatty() -> int:
        for i in range(3):
            print(f"line {i}")
        print("oops", file=sys.stderr)
        return 7

    assert healthy.run(chatty) == dict.fromkeys(range(4), 7)
    out, err = capsys.readouterr()
    assert out.splitlines() == ["[0-3] line 0", "[0-3] line 1", "[0-3] line 2"]
    assert err.strip() == "[0-3] oops"


def test_megabytes_of_output_are_capped_not_fatal(healthy: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    healthy[0].exec("for i in range(12000):\n    print('x' * 1000)\n")
    out, err = capsys.readouterr()
    assert len(out) < 10 * 1024 * 1024
    assert "not shown; see %monarch logs" in err
    assert healthy[0].run(lambda: "ok") == {0: "ok"}


def test_timeout_interrupts_and_says_where(healthy: Mesh) -> None:
    with pytest.raises(CallTimeout) as info:
        healthy.ranks("1,2").exec("import time\nprint('sleeping')\ntime.sleep(60)\n", timeout=1.0)
    err = info.value
    assert set(err.where) == {1, 2}
    assert all("time.sleep(60)" in w for w in err.where.values()), err.where
    assert healthy.run(mnb.rank) == {r: r for r in range(4)}  # interrupted, not broken


def test_run_async_future_result_await_and_cancel(healthy: Mesh) -> None:
    fut = healthy.run_async(lambda: mnb.rank() * 2)
    assert fut.result(timeout=30) == {r: 2 * r for r in range(4)}
    assert fut.done()
    assert isinstance(fut.result(), RankResults)

    async def main() -> RankResults:
        return await healthy.run_async(mnb.world_size)

    assert asyncio.run(main()) == dict.fromkeys(range(4), 4)

    slow = healthy.exec_async("import time\ntime.sleep(60)")
    with pytest.raises(concurrent.futures.TimeoutError):
        slow.result(timeout=0.2)  # plain futures time out without interrupting
    assert not slow.done()
    assert slow.cancel()
    with pytest.raises(concurrent.futures.CancelledError):
        slow.result(timeout=1)
    # the ranks were interrupted and come back
    assert healthy.run(lambda: "back", timeout=30) == dict.fromkeys(range(4), "back")


def test_no_block_output_lands_in_the_issuing_context(healthy: Mesh) -> None:
    seen: list[tuple[str, str]] = []
    from monarch_nb.controller.calls.output import CallOutput
    from monarch_nb.wire.protocol import Kind

    out = CallOutput(lambda stream, text: seen.append((stream, text)))
    fut = healthy._ctl.submit(Kind.EXEC, (0,), [], {"code": "print('late')", "name": "<t>"}, out)
    assert healthy.wait(fut, timeout=30) == {0: None}
    assert ("stdout", "[0] late\n") in seen


def test_concurrent_callers_share_the_mesh(healthy: Mesh) -> None:
    results: list[RankResults] = []
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(20):
                results.append(healthy.run(lambda i=i: i))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(results) == 60


def test_kill_gives_rank_died_and_membership_changed() -> None:
    with Mesh.start(n=3, backend="cpu", respawn="off") as mesh:
        fut = mesh.exec_async(
            "import torch, torch.distributed as dist, os, time, monarch_nb as mnb\n"
            "if mnb.rank() == 1:\n"
            "    print('about to hang', flush=True)\n"
            "    time.sleep(120)\n"
            "x = torch.ones(1)\n"
            "dist.all_reduce(x)\n"
        )
        wait_for(lambda: mesh.status()[1]["state"] == "busy", what="rank 1 busy")
        mesh.kill(1)
        with pytest.raises(RankErrors) as info:
            mesh.wait(fut, timeout=60)
        errs = info.value.errors
        assert isinstance(errs[1], RankDied)
        assert errs[1].signal_name == "SIGKILL" and "killed by SIGKILL" in str(errs[1])
        assert isinstance(errs[0], MembershipChanged) and isinstance(errs[2], MembershipChanged)
        assert errs[0].dead == (1,)
        events = [(e["rank"], e["kind"]) for e in mesh.events]
        assert (1, "died") in events
        assert mesh.status()[1]["state"] == "dead"
        with pytest.raises(MonarchError, match="rank 1 is dead"):
            mesh.run(mnb.rank)
        with pytest.raises(UsageError, match="already dead"):
            mesh.kill(1)
        # calls that do not involve the dead rank still work (no collective)
        assert mesh.ranks("0,2").run(mnb.rank) == {0: 0, 2: 2}


def test_killed_rank_is_respawned_into_a_new_group() -> None:
    with Mesh.start(n=3, backend="cpu") as mesh:  # --respawn rank is the default
        mesh.exec("import torch, torch.distributed as dist, monarch_nb as mnb\n"
                  "weights = torch.full((4,), 7.0)", setup=True)
        # a kill in the middle of a collective: the call fails cleanly, no hang
        fut = mesh.exec_async("import time\n"
                              "if mnb.rank() == 1:\n    time.sleep(60)\n"
                              "x = torch.ones(1)\ndist.all_reduce(x)\n")
        wait_for(lambda: mesh.status()[1]["state"] == "busy", what="rank 1 busy")
        old_pid = mesh.status()[1]["pid"]
        mesh.kill(1)
        with pytest.raises(RankErrors) as info:
            mesh.wait(fut, timeout=60)
        assert isinstance(info.value.errors[1], RankDied)
        assert all(isinstance(info.value.errors[r], MembershipChanged) for r in (0, 2))
        # the next call waits for the new rank 1, which joined a new group and
        # got the setup cell replayed
        res = mesh.run(_all_reduce_sum, timeout=90)
        assert res == {0: 6.0, 1: 6.0, 2: 6.0}
        assert mesh.run(mnb.incarnation) == {0: 0, 1: 1, 2: 0}
        assert mesh.exec("float(weights.sum())") == dict.fromkeys(range(3), 28.0)
        row = mesh.status()[1]
        assert row["state"] == "ready" and row["pid"] != old_pid and row["incarnation"] == 1
        # the controller keeps no replay window of the process that died
        windows = set(mesh._ctl.codec._windows)
        assert {"r1.0." in w for w in windows} == {False} and any("r1.1." in w for w in windows), \
            windows
        kinds = [(e["rank"], e["kind"]) for e in mesh.events]
        for expected in [(1, "died"), (1, "respawned"), (-1, "reformed")]:
            assert expected in kinds
        assert kinds.index((1, "died")) < kinds.index((1, "respawned"))
        assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE
        # a deliberate restart of every rank
        mesh.restart("all")
        assert mesh.run(mnb.incarnation, timeout=90) == {0: 1, 1: 2, 2: 1}
        assert mesh.run(_all_reduce_sum) == dict.fromkeys(range(3), 6.0)


def test_frozen_rank_is_detected_by_missing_heartbeats() -> None:
    with Mesh.start(n=2, backend="cpu", respawn="off", heartbeat_timeout=1.5) as mesh:
        # rank 0 stays busy longer than the heartbeat timeout: busy is not frozen
        fut = mesh.exec_async("import time, monarch_nb as mnb\n"
                              "time.sleep(30 if mnb.rank() == 1 else 4)")
        wait_for(lambda: mesh.status()[1]["state"] == "busy", what="rank 1 busy")
        mesh.kill(1, signal="STOP")
        with pytest.raises(RankErrors) as info:
            mesh.wait(fut, timeout=20)
        died = info.value.errors[1]
        assert isinstance(died, RankDied) and died.silent_for is not None
        assert "no heartbeat" in str(died)
        assert info.value.results == {0: None}  # rank 0 finished its 4 s sleep
        assert mesh.status()[0]["state"] == "ready"
        detail = [e["detail"] for e in mesh.events if e["kind"] == "died"]
        assert detail and "no heartbeat" in detail[0]


def test_stop_leaves_no_process_and_refuses_calls() -> None:
    before = worker_pids()
    mesh = Mesh.start(n=2, backend="cpu")
    pids = {p.pid for p in mesh._ctl.supervisor.procs.values()}
    assert pids <= worker_pids() - before
    # a rank stuck in a busy loop must not hold up stop
    mesh.exec_async("while True:\n    pass\n")
    mesh.stop()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids)
    with pytest.raises(MeshNotRunning, match="start a new one"):
        mesh.run(lambda: 1)
    mesh.stop()  # idempotent


def test_stop_after_a_ctrl_c_left_the_sockets_with_this_thread() -> None:
    """A Ctrl-C can land between a caller taking the sockets (the I/O
    loop's lead) and the ``try`` that gives them back: the I/O thread then
    waited for them for ever, the STOPs never left, and the process hung at
    exit (a script launcher's Ctrl-C, now and then). stop gives them back
    first: the ranks leave on their STOP (exit 0), not by SIGKILL."""
    mesh = Mesh.start(n=2, backend="cpu", spare=False)
    procs = list(mesh._ctl.supervisor.procs.values())
    mesh._ctl.io.lead()  # taken, never given back: what the interrupt left
    mesh._ctl.io.lead()  # (twice: an RLock held at two levels)
    mesh.stop()
    assert [p.popen.wait(5) for p in procs] == [0, 0]  # their STOP arrived
    assert not mesh._ctl.io.thread.is_alive()  # the I/O thread ended and closed the sockets
    assert mesh._ctl.io.router.closed


def test_controller_killed_with_sigkill_takes_its_ranks_along(tmp_path) -> None:
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from monarch_nb import Mesh
        mesh = Mesh.start(n=2, backend="cpu")
        print(" ".join(str(r["pid"]) for r in mesh.status()), flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()

    def gone() -> bool:
        return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                       for p in pids)

    wait_for(gone, timeout=5.0, what="ranks to die with their controller")


def test_bad_start_arguments() -> None:
    with pytest.raises(UsageError, match="positive"):
        Mesh.start(n=0)
    with pytest.raises(UsageError, match="backend"):
        Mesh.start(n=1, backend="tpu")
    with pytest.raises(UsageError, match="CUDA build"):
        Mesh.start(n=1, backend="cuda")
    with pytest.raises(UsageError, match="SLURM allocation"):
        Mesh.start(n=1, launcher="slurm", extra_env=())  # outside an allocation


def test_survivors_stuck_in_a_collective_never_hang() -> None:
    # In a 4-rank ring, a survivor can wait on another survivor that already
    # gave up (gloo fails only peers of the dead rank): it is replaced.
    with Mesh.start(n=4, backend="cpu") as mesh:
        code = ("import torch, torch.distributed as dist, monarch_nb as mnb\n"
                "from monarch_nb import chaos\n"
                "for step in range(100000):\n"
                "    x = torch.ones(1000)\n"
                "    dist.all_reduce(x)\n"
                "    chaos.die_at(step, 50, rank=1)\n")
        with pytest.raises(RankErrors) as info:
            mesh.exec(code, timeout=60)
        errs = info.value.errors
        assert isinstance(errs[1], RankDied)
        assert all(isinstance(errs[r], MembershipChanged) for r in (0, 2, 3)), errs
        # (the respawned rank 1 has a fresh namespace: import what the cell uses)
        assert mesh.exec("import torch, torch.distributed as dist\nx = torch.ones(1)\n"
                         "dist.all_reduce(x)\nx.item()", timeout=60) == dict.fromkeys(range(4), 4.0)
