"""Fault injection against real ranks: every fault is noticed, reported with
its cause, and the rank comes back (``--respawn rank``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import monarch_nb as mnb
from monarch_nb import Mesh, MembershipChanged, RankDied, RankErrors, chaos

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
                      "x = torch.ones(1)\ndist.all_reduce(x)\nx.item()") == {r: 3.0 for r in range(3)}


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


def test_random_faults_are_reproducible() -> None:
    a = chaos.Random(seed=3, rate=0.5)
    b = chaos.Random(seed=3, rate=0.5)
    assert [a.rng.random() for _ in range(5)] == [b.rng.random() for _ in range(5)]
    with pytest.raises(ValueError, match="unknown fault"):
        chaos.die("explode")
