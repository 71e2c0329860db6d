"""Fault injection against real ranks: every fault is noticed, reported with
its cause, and the rank comes back (``--respawn rank``)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import psutil
import pytest

import monarch_nb as mnb
from monarch_nb import MembershipChanged, Mesh, RankDied, RankErrors, chaos

from .conftest import wait_for


@pytest.fixture(scope="module")
def mesh3() -> Iterator[Mesh]:
    mesh = Mesh.start(n=3, backend="cpu", heartbeat_timeout=1.5)
    yield mesh
    mesh.stop()


def _back(mesh: Mesh, rank: int, incarnation: int) -> bool:
    row = mesh.status()[rank]
    return row["state"] == "ready" and row["incarnation"] >= incarnation


@pytest.mark.parametrize(
    ("how", "cause"),
    [("sigkill", "killed by SIGKILL"), ("exit", "exited with code 13"),
     ("segfault", "killed by SIGSEGV"), ("sigstop", "no heartbeat")],
)
def test_each_fault_is_reported_and_recovered(mesh3: Mesh, how: str, cause: str) -> None:
    before = mesh3.status()[2]["incarnation"]
    with pytest.raises(RankErrors) as info:
        mesh3[2].run(chaos.die, how, timeout=60)
    err = info.value.errors[2]
    assert isinstance(err, RankDied) and cause in str(err), str(err)
    wait_for(lambda: _back(mesh3, 2, before + 1), timeout=60, what=f"rank 2 back after {how}")
    assert mesh3.run(mnb.incarnation)[2] == before + 1
    details = [e["detail"] for e in mesh3.events if e["kind"] == "died" and e["rank"] == 2]
    assert any(cause.split()[0] in d for d in details), details


def test_death_mid_collective_from_a_timer(mesh3: Mesh) -> None:
    code = ("import torch, torch.distributed as dist, time, monarch_nb as mnb\n"
            "from monarch_nb import chaos\n"
            "if mnb.rank() == 0:\n"
            "    chaos.die_later(0.3)\n"
            "    time.sleep(30)\n"  # rank 0 never reaches the all_reduce
            "x = torch.ones(1)\n"
            "dist.all_reduce(x)\n")
    before = mesh3.status()[0]["incarnation"]
    with pytest.raises(RankErrors) as info:
        mesh3.exec(code, timeout=60)
    assert isinstance(info.value.errors[0], RankDied)
    assert all(isinstance(info.value.errors[r], MembershipChanged) for r in (1, 2))
    wait_for(lambda: _back(mesh3, 0, before + 1), timeout=60, what="rank 0 back")
    assert mesh3.exec("import torch, torch.distributed as dist\n"
                      "x = torch.ones(1)\ndist.all_reduce(x)\nx.item()") == dict.fromkeys(range(3), 3.0)


def test_death_at_a_chosen_step_only_in_the_first_incarnation(mesh3: Mesh) -> None:
    inc = mesh3.status()[1]["incarnation"]
    loop = (f"from monarch_nb import chaos\n"
            f"done = 0\n"
            f"for step in range(10):\n"
            f"    chaos.die_at(step, 5, rank=1, incarnation={inc})\n"
            f"    done = step\n"
            f"done")
    with pytest.raises(RankErrors) as info:
        mesh3.exec(loop, timeout=60)
    assert isinstance(info.value.errors[1], RankDied)
    assert info.value.results == {0: 9, 2: 9}
    wait_for(lambda: _back(mesh3, 1, inc + 1), timeout=60, what="rank 1 back")
    assert mesh3.exec(loop, timeout=60) == {0: 9, 1: 9, 2: 9}  # the new process lives


def test_setup_replay_that_raises_is_reported() -> None:
    with Mesh.start(n=2, backend="cpu") as mesh:
        mesh.exec("from monarch_nb import chaos\nchaos.fail_after_respawn()", setup=True)
        mesh.kill(1)
        wait_for(lambda: _back(mesh, 1, 1), timeout=60, what="rank 1 back")
        wait_for(lambda: any(e["kind"] == "setup_failed" for e in mesh.events), timeout=30,
                 what="the failed setup replay to be recorded")
        failed = [e for e in mesh.events if e["kind"] == "setup_failed"]
        assert failed[0]["rank"] == 1 and "setup replay fails" in failed[0]["detail"]
        assert mesh.run(mnb.rank) == {0: 0, 1: 1}  # the rank still answers


def test_repeated_kills_past_the_budget_mark_the_rank_failed() -> None:
    with Mesh.start(n=2, backend="cpu", fork=False, restart_budget=2) as mesh:  # a spare process: fresh interpreters only
        for inc in (1, 2):
            mesh.kill(1)
            wait_for(lambda inc=inc: _back(mesh, 1, inc), timeout=60, what=f"incarnation {inc}")
        # the second death waited out a backoff, and a spare process started
        # meanwhile became incarnation 2 (the first was respawned at once)
        started = {e["incarnation"]: e["detail"] for e in mesh.events
                   if e["kind"] == "started" and e["rank"] == 1}
        assert "from a spare" in started[2], started
        mesh.kill(1)  # the third death within the window: over a budget of 2
        wait_for(lambda: mesh.status()[1]["state"] == "failed", timeout=30, what="rank 1 failed")
        gave_up = [e for e in mesh.events if e["kind"] == "gave_up"]
        assert [e["rank"] for e in gave_up] == [1]
        assert "died 3 times within 600 s" in gave_up[0]["detail"], gave_up
        # a call to it is refused at once, saying what to do; the other rank answers
        with pytest.raises(mnb.MonarchError, match=r"restart budget is spent.*restart 1"):
            mesh.run(mnb.rank, timeout=30)
        assert mesh.ranks("0").run(mnb.rank) == {0: 0}
        mesh.restart(1)  # the user's restart is not counted against the budget
        wait_for(lambda: _back(mesh, 1, 3), timeout=60, what="rank 1 restarted")
        assert mesh.run(mnb.rank) == {0: 0, 1: 1}


def test_a_kill_during_respawn_is_survived(tmp_path) -> None:
    # The first replacement of rank 1 takes 3 s to start (no spare), so it can
    # be killed while the mesh is waiting for it.
    (tmp_path / "sitecustomize.py").write_text(
        "import os, time\n"
        "if os.environ.get('RANK') == '1' and os.environ.get('MONARCH_NB_INCARNATION') == '1':\n"
        "    time.sleep(3)\n")
    env = (("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"),)
    with Mesh.start(n=2, backend="cpu", spare=False, extra_env=env) as mesh:
        old = mesh.status()[1]["pid"]
        mesh.kill(1)

        def starting() -> int | None:
            row = mesh.status()[1]
            return row["pid"] if row["incarnation"] == 1 and row["pid"] != old \
                and row["state"] in ("starting", "respawning") else None

        pid = wait_for(starting, timeout=30, what="rank 1's replacement starting")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: _back(mesh, 1, 2), timeout=60,
                 what="rank 1 back after two deaths")
        deaths = [e for e in mesh.events if e["kind"] == "died" and e["rank"] == 1]
        assert [e["incarnation"] for e in deaths] == [0, 1], deaths
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert mesh.exec("import torch, torch.distributed as dist\n"
                         "x = torch.ones(1)\ndist.all_reduce(x)\nx.item()") == {0: 2.0, 1: 2.0}


def test_respawn_all_replaces_every_rank_after_one_death() -> None:
    with Mesh.start(n=3, backend="cpu", respawn="all") as mesh:
        pids = {r["rank"]: r["pid"] for r in mesh.status()}
        mesh.kill(1)
        wait_for(lambda: all(_back(mesh, r, 1) for r in range(3)), timeout=90,
                 what="every rank replaced")
        assert all(r["pid"] != pids[r["rank"]] for r in mesh.status())
        assert mesh.run(mnb.incarnation) == dict.fromkeys(range(3), 1)
        respawned = sorted(e["rank"] for e in mesh.events if e["kind"] == "respawned")
        assert respawned == [0, 1, 2], mesh.events
        assert mesh.exec("import torch, torch.distributed as dist\n"
                         "x = torch.ones(1)\ndist.all_reduce(x)\nx.item()") == dict.fromkeys(range(3), 3.0)


def test_random_faults_are_reproducible() -> None:
    a = chaos.Random(seed=3, rate=0.5)
    b = chaos.Random(seed=3, rate=0.5)
    assert [a.rng.random() for _ in range(5)] == [b.rng.random() for _ in range(5)]
    with pytest.raises(ValueError, match="unknown fault"):
        chaos.die("explode")
