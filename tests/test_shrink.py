"""An elastic world size (``min_ranks``), end to end with real ranks.

* a rank that spends its restart budget in the middle of an ``mnb.elastic``
  loop: the survivors re-form at world size 3 with dense torch ranks, the loop
  finishes there with the same model on each, and the call's results hold the
  survivors' values and a :class:`Lost` entry for the rank that is gone;
* the two numberings: the mesh's rank numbers stay (results, ``status()``,
  ``--ranks``), ``mnb.rank()`` / ``dist.get_rank()`` / ``RANK`` are the
  group's; calls after the shrink leave the lost rank out without an error;
  ``restart`` brings it back and the group is whole again;
* a second loss that would leave fewer than ``min_ranks``: the call ends
  with the error naming the cause, as without ``min_ranks``;
* a call that is not elastic ends with MembershipChanged for the survivors
  cut short, and the survivors answer the next call in the smaller group.

Only the public API is used.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import pytest
import torch

import monarch_nb as mnb
from monarch_nb import Lost, MembershipChanged, Mesh, RankErrors, UsageError
from monarch_nb.ui.status import format_status
from tests.conftest import wait_for

# An elastic loop that records, per world size it ran at, the wall-clock time
# of its first step there (ranks and the test share this machine's clock).
TRAIN = """
import os, time, torch, torch.distributed as dist, monarch_nb as mnb
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
state = mnb.elastic.State(model=model, optimizer=opt, step=0)
first_step_at = {}

@mnb.elastic.run(state)
def train(state):
    while state.step < STEPS:
        g = torch.Generator().manual_seed(1000 * state.step + mnb.rank())
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        state.step += 1
        state.commit()
        first_step_at.setdefault(dist.get_world_size(), time.time())
        mnb.log(loss=loss.item(), step=state.step)
        time.sleep(PAUSE)
    return {"params": [p.detach().clone() for p in model.parameters()], "step": state.step,
            "rank": mnb.rank(), "world": mnb.world_size(), "mesh_rank": mnb.mesh_rank(),
            "dist": (dist.get_rank(), dist.get_world_size()),
            "env": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
            "first_step_at": first_step_at}

train()
"""

ALL_REDUCE = ("import torch, torch.distributed as dist\n"
              "x = torch.ones(1)\n"
              "dist.all_reduce(x)\n"
              "x.item()")


def _train(steps: int, pause: float) -> str:
    return TRAIN.replace("STEPS", str(steps)).replace("PAUSE", str(pause))


def _step(mesh: Mesh, rank: int) -> int:
    return mesh.status()[rank]["step"] or 0


def _numbers() -> tuple[int, int, int]:
    return mnb.mesh_rank(), mnb.rank(), mnb.world_size()


def _outcome(fut: concurrent.futures.Future, timeout: float, what: str) -> Any:
    try:
        return fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"{what}: still pending {timeout:g} s later")
    except BaseException as exc:  # the caller checks what it is
        return exc


@pytest.mark.timeout(180)
def test_a_rank_past_its_budget_shrinks_the_group_and_the_elastic_loop_finishes() -> None:
    with Mesh.start(n=4, backend="cpu", restart_budget=0, min_ranks=2) as mesh:
        steps = 60
        fut = mesh.exec_async(_train(steps, 0.05), elastic=True)
        wait_for(lambda: min(_step(mesh, r) for r in range(4)) >= 10, timeout=60,
                 what="the training loop to run")
        killed_at = time.time()
        mesh.kill(1)
        got = _outcome(fut, 60, "the elastic call after rank 1 was lost")
        assert not isinstance(got, BaseException), repr(got)
        # results: the survivors' values, and an entry that says rank 1 is lost
        assert sorted(got) == [0, 1, 2, 3] and got.lost == (1,)
        assert isinstance(got[1], Lost) and "restart_budget=0" in got[1].reason, got[1]
        survivors = got.survivors()
        assert sorted(survivors) == [0, 2, 3]
        first = survivors[0]["params"]
        for mesh_rank, dense in ((0, 0), (2, 1), (3, 2)):
            out = survivors[mesh_rank]
            assert out["step"] == steps
            assert all(torch.equal(a, b) for a, b in zip(out["params"], first, strict=True))
            # the two numberings: the mesh's stays, the group's is dense
            assert out["mesh_rank"] == mesh_rank
            assert (out["rank"], out["world"]) == (dense, 3) == out["dist"]
            assert out["env"] == (str(dense), "3")
        resumed = min(out["first_step_at"][3] for out in survivors.values())
        print(f"\nrank 1 lost: first step at world size 3 {resumed - killed_at:.2f} s "
              "after the kill")
        assert resumed - killed_at < 10

        # status, events, %monarch status: the lost rank and the world size now
        rows = mesh.status()
        assert rows[1]["state"] == "failed" and rows[1]["torch_rank"] is None
        assert [rows[r]["torch_rank"] for r in (0, 2, 3)] == [0, 1, 2]
        assert mesh.group == (0, 2, 3) and mesh.world_size == 4
        (shrunk,) = [e for e in mesh.events if e["kind"] == "shrunk"]
        assert shrunk["detail"].startswith("world size 3: rank 0,2,3 (without rank 1: ")
        table = format_status(mesh)
        assert "world size now: 3 of 4 (rank 0,2,3; the group went on without rank 1)" in table

        # later calls leave rank 1 out, without an error
        numbers = mesh.run(_numbers, timeout=30)
        assert numbers.survivors() == {0: (0, 0, 3), 2: (2, 1, 3), 3: (3, 2, 3)}
        assert numbers.lost == (1,)
        reduced = mesh.exec(ALL_REDUCE, timeout=30)
        assert reduced.survivors() == {0: 3.0, 2: 3.0, 3: 3.0} and reduced.lost == (1,)
        assert mesh.ranks("1").run(_numbers, timeout=10).lost == (1,)

        # a restart brings rank 1 back: the group is whole again, numbers as one
        mesh.restart(1)
        wait_for(lambda: mesh.status()[1]["state"] in ("ready", "busy"), timeout=60,
                 what="rank 1 restarted")
        assert mesh.group == (0, 1, 2, 3)
        assert mesh.exec(ALL_REDUCE, timeout=30) == dict.fromkeys(range(4), 4.0)
        assert mesh.run(_numbers, timeout=30) == {r: (r, r, 4) for r in range(4)}


@pytest.mark.timeout(180)
def test_below_min_ranks_the_elastic_call_ends_with_the_cause() -> None:
    with Mesh.start(n=4, backend="cpu", restart_budget=0, min_ranks=3) as mesh:
        fut = mesh.exec_async(_train(10**6, 0.05), elastic=True)
        wait_for(lambda: min(_step(mesh, r) for r in range(4)) >= 5, timeout=60,
                 what="the training loop to run")
        mesh.kill(1)  # 3 left: the loop goes on at world size 3
        wait_for(lambda: mesh.group == (0, 2, 3), timeout=30, what="the group to shrink")
        before = _step(mesh, 0)
        wait_for(lambda: _step(mesh, 0) >= before + 5, timeout=60,
                 what="the loop to go on at world size 3")
        assert not fut.done()
        t0 = time.monotonic()
        mesh.kill(3)  # 2 left, fewer than min_ranks: as without min_ranks
        err = _outcome(fut, 30, "the elastic call after rank 3 was lost")
        ended = time.monotonic() - t0
        print(f"\nbelow min_ranks: the elastic call ended {ended:.2f} s after the kill")
        assert isinstance(err, RankErrors), repr(err)
        text = str(err)
        assert ended < 5, text
        assert "not respawned: restart_budget=0" in str(err.errors[3]), text
        for r in (0, 2):
            assert isinstance(err.errors[r], MembershipChanged), text
            assert "fewer than min_ranks=3" in str(err.errors[r]), text
        # rank 1's entry: it was lost earlier, while the group went on
        assert isinstance(err.results.get(1), Lost), text
        assert mesh.group == (0, 2, 3)  # not re-formed below min_ranks


@pytest.mark.timeout(120)
def test_a_call_that_is_not_elastic_ends_with_membership_changed() -> None:
    loop = ("import torch, torch.distributed as dist, monarch_nb as mnb\n"
            "x = torch.ones(1)\n"
            "for i in range(10**6):\n"
            "    dist.all_reduce(x)\n"
            "    x.fill_(1.0)\n"
            "    if i % 100 == 0:\n"
            "        mnb.log(step=i, n=i)\n")
    with Mesh.start(n=3, backend="cpu", restart_budget=0, min_ranks=2) as mesh:
        fut = mesh.exec_async(loop)
        wait_for(lambda: min(_step(mesh, r) for r in range(3)) >= 100, timeout=30,
                 what="the collectives to run")
        mesh.kill(2)
        err = _outcome(fut, 30, "the call after rank 2 was lost")
        assert isinstance(err, RankErrors), repr(err)
        for r in (0, 1):
            assert isinstance(err.errors[r], MembershipChanged), str(err)
            assert err.errors[r].dead == (2,), str(err)
        wait_for(lambda: mesh.group == (0, 1), timeout=30, what="the group to shrink")
        reduced = mesh.exec(ALL_REDUCE, timeout=30)
        assert reduced.survivors() == {0: 2.0, 1: 2.0} and reduced.lost == (2,)


def test_min_ranks_is_checked_before_anything_starts() -> None:
    with pytest.raises(UsageError, match="min_ranks"):
        Mesh.start(n=2, backend="cpu", min_ranks=3)
    with pytest.raises(UsageError, match="min_ranks"):
        Mesh.start(n=2, backend="cpu", min_ranks=0)


@pytest.mark.timeout(240)
def test_a_rank_past_its_budget_shrinks_then_grows_back_into_the_running_loop() -> None:
    """restart_budget=1: rank 2 killed once comes back (the loop goes on at
    world size 3), killed again it has spent its budget and the group goes
    on at world size 2; ``mesh.restart(2)`` while the same elastic loop runs
    grows it back: the loop takes rank 2 at its next commit and finishes at
    world size 3, with the same model on every rank (rank 2's included)."""
    with Mesh.start(n=3, backend="cpu", restart_budget=1, min_ranks=2) as mesh:
        steps = 400
        fut = mesh.exec_async(_train(steps, 0.02), elastic=True)
        wait_for(lambda: min(_step(mesh, r) for r in range(3)) >= 5, timeout=60,
                 what="the training loop to run")
        mesh.kill(2)  # respawned: its budget of one is spent now
        wait_for(lambda: mesh.status()[2]["incarnation"] == 1 and _step(mesh, 2) >= 5,
                 timeout=60, what="rank 2 back in the loop")
        mesh.kill(2)  # past its budget: the group goes on without it
        wait_for(lambda: mesh.group == (0, 1), timeout=30, what="the group to shrink")
        assert mesh.status()[2]["state"] == "failed"
        before = _step(mesh, 0)
        wait_for(lambda: _step(mesh, 0) >= before + 5, timeout=60,
                 what="the loop to go on at world size 2")
        assert not fut.done() and before + 5 < steps
        grown_at = time.time()
        mesh.restart(2)  # capacity back: it joins the running loop at its next commit
        wait_for(lambda: mesh.group == (0, 1, 2), timeout=30, what="the group to grow")
        got = _outcome(fut, 120, "the elastic call after rank 2 came back")
        assert not isinstance(got, BaseException), repr(got)
        assert sorted(got) == [0, 1, 2] and got.lost == (), got
        first = got[0]["params"]
        for r in range(3):
            out = got[r]
            assert out["step"] == steps and (out["rank"], out["world"]) == (r, 3) == out["dist"]
            assert all(torch.equal(a, b) for a, b in zip(out["params"], first, strict=True)), r
        assert 2 in got[0]["first_step_at"] and 2 not in got[2]["first_step_at"]
        back = got[2]["first_step_at"][3] - grown_at
        print(f"\nrank 2 restarted into the running loop: its first step {back:.2f} s later")
        kinds = [e["kind"] for e in mesh.events]
        assert kinds.count("shrunk") == 1 and kinds.count("grown") == 1, kinds
        (grown,) = [e for e in mesh.events if e["kind"] == "grown"]
        assert grown["detail"] == "world size 3: rank 0-2 (rank 2 back; whole again)", grown
        assert any(e["kind"] == "rejoined" and e["rank"] == 2 for e in mesh.events), kinds
        assert [r["torch_rank"] for r in mesh.status()] == [0, 1, 2]
        assert "world size now" not in format_status(mesh)
