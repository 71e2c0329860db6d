"""Recovery, end to end with real ranks: the cases where supervision used to
hang, cost a healthy process, raise a false alarm or lose a call.

* a rank given up (restart budget spent) ends an ``--elastic`` run with an
  error that says what to do, and ``restart`` brings the mesh back;
* a rank not respawned (``restart_budget=0``) ends a running ``--elastic``
  call within 2 s, saying why and how to turn respawns on, and the
  survivors answer the next call at once;
* a rank that was answering calls is respawned at once however often it is
  killed; one that dies before it answered anything is backed off;
* a rank respawned while a user thread led the I/O loop outlives that thread;
* a rank killed while idle costs no survivor its process;
* no false alarms: a logging elastic run is not "without progress", a failed
  setup replay says why, a survivor's error names the rank that died;
* a torchrun-style script (the DDP tutorial) survives the same rank dying twice;
* calls pending when the mesh stops fail at once, saying the mesh was stopped.

Only the public API is used (``monarch_nb``, ``python -m monarch_nb.launch``).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import monarch_nb as mnb
from monarch_nb import MembershipChanged, Mesh, MonarchError, RankDied, RankErrors
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]
DDP_TUTORIAL = ROOT / "tests" / "scripts" / "ddp_tutorial.py"

ALL_REDUCE = ("import torch, torch.distributed as dist\n"
              "x = torch.ones(1)\n"
              "dist.all_reduce(x)\n"
              "x.item()")

# An elastic training loop (as in test_elastic.py) that logs every step.
TRAIN = """
import time, torch, torch.distributed as dist, monarch_nb as mnb
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
state = mnb.elastic.State(model=model, optimizer=opt, step=0)

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
        opt.step()
        state.step += 1
        state.commit()
        mnb.log(loss=loss.item(), step=state.step)
        time.sleep(PAUSE)
    return state.step

train()
"""


def _train(steps: int, pause: float) -> str:
    return TRAIN.replace("STEPS", str(steps)).replace("PAUSE", str(pause))


def _back(mesh: Mesh, rank: int, incarnation: int) -> bool:
    row = mesh.status()[rank]
    return row["incarnation"] >= incarnation and row["state"] in ("ready", "busy")


def _step(mesh: Mesh, rank: int) -> int:
    return mesh.status()[rank]["step"] or 0


def _pids(mesh: Mesh) -> dict[int, int]:
    return {row["rank"]: row["pid"] for row in mesh.status()}


def _outcome(fut: concurrent.futures.Future, timeout: float, what: str) -> BaseException:
    """The exception ``fut`` ends with within ``timeout`` s (a hang fails the test)."""
    try:
        value = fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"{what}: still pending {timeout:g} s later")
    except BaseException as exc:  # the caller checks what it is
        return exc
    pytest.fail(f"{what}: succeeded ({value!r}) where it had to fail")


# -- 1 ---------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_rank_given_up_ends_the_elastic_run_and_restart_recovers() -> None:
    """Rank 1 dies twice with a restart budget of 1: the supervisor gives it
    up. The elastic call must end (the survivors used to wait for a group
    that never re-forms), say which rank, how often it died and what to do;
    ``restart(1)`` then gives a working 4-rank mesh."""
    with Mesh.start(n=4, backend="cpu", restart_budget=1) as mesh:
        fut = mesh.exec_async(_train(10**6, 0.05), elastic=True)
        wait_for(lambda: _step(mesh, 1) >= 5, timeout=30, what="the training loop to run")
        mesh.kill(1)
        wait_for(lambda: _back(mesh, 1, 1), timeout=30, what="rank 1 back after its first death")
        mesh.kill(1)  # a second death within the window: over the budget
        wait_for(lambda: mesh.status()[1]["state"] == "failed", timeout=10,
                 what="rank 1 to be given up")
        err = _outcome(fut, 20, "the elastic call after rank 1 was given up")
        assert isinstance(err, RankErrors), repr(err)
        text = str(err)
        assert 1 in err.errors, text
        assert "restart 1" in text, text
        assert re.search(r"\b(2 times|twice)\b", text), text  # its deaths
        mesh.restart(1)
        wait_for(lambda: _back(mesh, 1, 2), timeout=30, what="rank 1 restarted")
        assert mesh.exec(ALL_REDUCE, timeout=30) == dict.fromkeys(range(4), 4.0)


@pytest.mark.timeout(120)
def test_an_elastic_run_ends_at_once_when_the_dead_rank_is_not_respawned() -> None:
    """``restart_budget=0`` (what torchrun's flags default to): rank 1, killed
    in the middle of an elastic loop, is not respawned. The survivors wait
    for a re-formation that will not come (their own timeout is 300 s); the
    controller knows at once and tells them: the call ends within 2 s of
    the kill, rank 1's error saying why and how to turn respawns on, the
    survivors' naming rank 1; they answer the next call at once."""
    with Mesh.start(n=4, backend="cpu", restart_budget=0) as mesh:
        fut = mesh.exec_async(_train(10**6, 0.05), elastic=True)
        wait_for(lambda: min(_step(mesh, r) for r in range(4)) >= 5, timeout=30,
                 what="the training loop to run")
        t0 = time.monotonic()
        mesh.kill(1)
        err = _outcome(fut, 30, "the elastic call after rank 1 died, not respawned")
        ended = time.monotonic() - t0
        print(f"\nrank 1 not respawned: the elastic call ended {ended:.2f} s after the kill")
        assert isinstance(err, RankErrors), repr(err)
        text = str(err)
        assert ended < 2.0, text
        assert "not respawned: restart_budget=0" in str(err.errors[1]), text
        assert "restart_budget=N" in str(err.errors[1]), text
        for r in (0, 2, 3):
            assert isinstance(err.errors.get(r), MembershipChanged), text
            assert err.errors[r].dead == (1,), text
            assert "no re-formation" in str(err.errors[r]), text
        t1 = time.monotonic()
        assert mesh.ranks("0,2,3").run(mnb.rank, timeout=10) == {0: 0, 2: 2, 3: 3}
        print(f"the survivors answered the next call {time.monotonic() - t1:.2f} s later")
        mesh.restart(1)
        wait_for(lambda: _back(mesh, 1, 1), timeout=30, what="rank 1 restarted")
        assert mesh.exec(ALL_REDUCE, timeout=30) == dict.fromkeys(range(4), 4.0)


def _respawn_gaps(mesh: Mesh, rank: int) -> dict[int, float]:
    """incarnation -> seconds from the death of the one before it to its respawn
    (the policy's backoff, without the new process's start-up)."""
    died = {e["incarnation"]: e["time"] for e in mesh.events
            if e["rank"] == rank and e["kind"] == "died"}
    return {e["incarnation"]: e["time"] - died[e["incarnation"] - 1] for e in mesh.events
            if e["rank"] == rank and e["kind"] == "respawned"}


@pytest.mark.timeout(120)
def test_a_working_rank_is_respawned_at_once_and_a_crash_loop_backed_off() -> None:
    """The controller tells the policy whether a dead process had answered a
    call: rank 1, killed four times in a row each time after it answered a
    call, is respawned at once each time (it used to wait 0.5, 1 and 2 s);
    killed again before it answered anything, it waits out a backoff."""
    with Mesh.start(n=2, backend="cpu") as mesh:
        for k in range(1, 5):
            assert mesh.run(mnb.incarnation, timeout=60) == {0: 0, 1: k - 1}  # it answered
            mesh.kill(1)
            wait_for(lambda: _back(mesh, 1, k), timeout=30, what=f"rank 1 back ({k})")
        mesh.kill(1)  # incarnation 4 answered nothing: a crash loop's second death
        wait_for(lambda: _back(mesh, 1, 5), timeout=30, what="rank 1 back (5)")
        gaps = _respawn_gaps(mesh, 1)
        print(f"\ndeath to respawn, by incarnation: "
              f"{ {inc: round(gap, 2) for inc, gap in sorted(gaps.items())} }")
        # at once: below the shortest backoff (0.5 s - 25 %)
        assert all(gaps[inc] < 0.75 * 0.5 for inc in range(1, 5)), gaps
        assert 0.75 * 0.5 <= gaps[5] <= 1.25 * 0.5 + 1.0, gaps  # base 0.5 s +/- 25 % (+ ticks)
        assert mesh.run(mnb.incarnation, timeout=60) == {0: 0, 1: 5}


# -- 2 ---------------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_a_rank_respawned_on_a_user_thread_outlives_that_thread() -> None:
    """A call made from a user thread leads the I/O loop, so rank 1's death
    is handled, and its replacement spawned, on that thread. The replacement
    must not die when the thread ends (Linux delivers PR_SET_PDEATHSIG when
    the *thread* that forked the child exits). No spare process: the
    replacement is forked by whichever thread leads the loop."""

    def exit_on_rank_1() -> int:
        if mnb.rank() == 1:
            os._exit(3)
        return mnb.rank()

    with Mesh.start(n=2, backend="cpu", spare=False) as mesh:
        outcome: list[Any] = []

        def user_thread() -> None:
            try:
                outcome.append(mesh.run(exit_on_rank_1, timeout=60))
            except BaseException as exc:  # checked on the test's thread
                outcome.append(exc)
            # the thread lives on until the replacement is up (its parent-death
            # signal armed), then ends
            deadline = time.monotonic() + 60
            while not _back(mesh, 1, 1) and time.monotonic() < deadline:
                time.sleep(0.05)

        thread = threading.Thread(target=user_thread, name="user-thread")
        thread.start()
        thread.join(75)
        assert not thread.is_alive()
        err = outcome[0]
        assert isinstance(err, RankErrors) and isinstance(err.errors.get(1), RankDied), repr(err)
        row = mesh.status()[1]
        assert row["incarnation"] == 1 and row["state"] == "ready", row
        pid = row["pid"]
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # the thread is gone: does rank 1 live on?
            row = mesh.status()[1]
            deaths = [(e["incarnation"], e["detail"]) for e in mesh.events
                      if e["rank"] == 1 and e["kind"] == "died" and e["incarnation"] >= 1]
            assert not deaths, f"rank 1's replacement died after the thread ended: {deaths}"
            assert row["pid"] == pid and row["incarnation"] == 1, row
            time.sleep(0.1)
        assert mesh.run(mnb.incarnation, timeout=30) == {0: 0, 1: 1}


# -- 3 ---------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_an_idle_kill_costs_no_healthy_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """A rank killed while the mesh is idle, then at once a cell with an
    all_reduce. The first kill goes through ``mesh.kill`` (which waits until
    the controller saw the death); the others come from outside, like the
    OOM killer or a ``kill -9`` in a terminal, so the cell may reach the
    survivors before the death is noticed. Either way no survivor may be
    replaced (they used to be, as "stuck in a collective"), the call fails
    at most because of the victim, and the mesh then all_reduces."""
    with Mesh.start(n=4, backend="cpu") as mesh:
        for victim, outside in ((2, False), (1, True), (3, True)):
            before = _pids(mesh)
            if outside:
                os.kill(before[victim], signal.SIGKILL)
            else:
                mesh.kill(victim)
            err: RankErrors | None = None
            try:
                got = mesh.exec(ALL_REDUCE, timeout=60)
            except RankErrors as exc:
                got, err = None, exc
            after = _pids(mesh)
            replaced = sorted(r for r in before if r != victim and after[r] != before[r])
            assert not replaced, (f"killing rank {victim} cost rank(s) {replaced} their "
                                  f"process: {[e for e in mesh.events if e['kind'] == 'replaced']}"
                                  f"\n{err}")
            if err is not None:  # the cell reached the survivors before the death was seen
                assert outside, f"rank {victim} was killed by mesh.kill: {err}"
                assert isinstance(err.errors.get(victim), RankDied), str(err)
                others = [e for r, e in err.errors.items() if r != victim]
                assert not any(isinstance(e, RankDied) for e in others), str(err)
                assert all(victim in e.dead for e in others
                           if isinstance(e, MembershipChanged)), str(err)
                got = mesh.exec(ALL_REDUCE, timeout=60)
            assert got == dict.fromkeys(range(4), 4.0), (victim, got)
        assert not [e for e in mesh.events if e["kind"] == "replaced"], mesh.events
    captured = capsys.readouterr()
    assert "stuck in a collective" not in captured.out + captured.err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", ["TERM", "KILL"])
def test_a_call_right_after_mesh_kill_waits_and_runs_on_the_reformed_group(sig: str) -> None:
    """``mesh.kill`` makes the rank DYING at once (TERM does not even wait
    for the exit): a cell sent right after waits for the respawn like any
    other, and runs on the re-formed group, answering from every rank."""
    with Mesh.start(n=3, backend="cpu") as mesh:
        before = _pids(mesh)
        mesh.kill(1, signal=sig)
        got = mesh.exec(ALL_REDUCE, timeout=60)
        assert got == dict.fromkeys(range(3), 3.0), got
        after = _pids(mesh)
        assert after[1] != before[1]
        assert [after[r] for r in (0, 2)] == [before[r] for r in (0, 2)]
        assert mesh.status()[1]["incarnation"] == 1


# -- 4: false alarms -------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_logging_elastic_run_with_deaths_is_not_reported_without_progress(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every rank calls ``mnb.log`` each step: that is progress, in the first
    call of a process as in a re-issued one, and the hang watchdog must not
    print its "no progress" report, also not across two deaths of rank 1
    (each recovered within seconds, well under the watchdog's 20 s)."""
    with Mesh.start(n=4, backend="cpu", hang_timeout=20) as mesh:
        fut = mesh.exec_async(_train(200, 0.1), elastic=True)
        wait_for(lambda: _step(mesh, 1) >= 30, timeout=30, what="the training loop to run")
        mesh.kill(1)
        wait_for(lambda: _back(mesh, 1, 1) and _step(mesh, 1) >= 60, timeout=45,
                 what="rank 1 back and training after its first death")
        mesh.kill(1)
        wait_for(lambda: _back(mesh, 1, 2), timeout=45, what="rank 1 back after its second death")
        assert fut.result(timeout=90) == dict.fromkeys(range(4), 200)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "no progress for" not in text, text


@pytest.mark.timeout(90)
def test_a_failed_setup_replay_is_announced_with_its_reason(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A ``--setup`` cell that fails when it is replayed on a respawned rank:
    the announcement "replaying setup cell ... failed: REASON" must carry a
    reason, whether the replay raised (incarnation 1) or the rank died in it
    with output ending in a blank line, as a C++ stack trace does
    (incarnation 2)."""
    setup = ("import os, monarch_nb as mnb\n"
             "if mnb.incarnation() == 1:\n"
             "    raise RuntimeError('boom on replay')\n"
             "if mnb.incarnation() == 2:\n"
             "    print('loading the dataset failed:\\n', flush=True)\n"
             "    os._exit(7)\n")
    with Mesh.start(n=2, backend="cpu") as mesh:
        mesh.exec(setup, setup=True)
        mesh.kill(1)
        assert mesh.run(mnb.incarnation, timeout=60) == {0: 0, 1: 1}  # rank 1 still answers
        mesh.kill(1)
        try:
            mesh.run(mnb.incarnation, timeout=60)
        except RankErrors:
            pass  # the replay's death may take this call with it
        wait_for(lambda: _back(mesh, 1, 3), timeout=60, what="rank 1 back after the failed replay")
        assert mesh.run(mnb.incarnation, timeout=60) == {0: 0, 1: 3}
        failed = [e for e in mesh.events if e["kind"] == "setup_failed"]
        assert [(e["rank"], e["incarnation"]) for e in failed] == [(1, 1), (1, 2)], failed
        assert "boom on replay" in failed[0]["detail"], failed
        assert "exited with code 7" in failed[1]["detail"], failed
    captured = capsys.readouterr()
    text = captured.out + captured.err
    notes = re.findall(r"replaying setup cell .* failed:(.*)", text)
    assert len(notes) >= 2, text  # one per failed replay
    assert any("boom on replay" in note for note in notes), notes
    assert all(note.strip() for note in notes), f"a replay failure without a reason: {notes}"


LOOP = """
import time, torch, torch.distributed as dist, monarch_nb as mnb
for i in range(400):
    x = torch.ones(1)
    dist.all_reduce(x)
    mnb.log(step=i, value=float(i))
    time.sleep(0.02)
x.item()
"""


@pytest.mark.timeout(90)
def test_a_survivors_error_names_the_rank_that_died() -> None:
    """A non-elastic cell all_reduces in a loop and rank 2 is killed: the
    survivors' MembershipChanged errors name rank 2; none may read
    "(rank none died)" (what a survivor replaced for being stuck in the
    collective used to get)."""
    with Mesh.start(n=4, backend="cpu") as mesh:
        fut = mesh.exec_async(LOOP)
        wait_for(lambda: min(_step(mesh, r) for r in range(4)) >= 10, timeout=30,
                 what="the all_reduce loop to run")
        mesh.kill(2)
        err = _outcome(fut, 60, "the cell after rank 2 died")
        assert isinstance(err, RankErrors), repr(err)
        text = str(err)
        assert "none died" not in text, text
        assert isinstance(err.errors.get(2), RankDied), text
        changed = [e for r, e in err.errors.items() if isinstance(e, MembershipChanged)]
        assert changed, text
        assert all(e.dead == (2,) for e in changed), text


# -- 5 ---------------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_the_ddp_tutorial_survives_the_same_rank_dying_twice(tmp_path: Path) -> None:
    """pytorch/examples' multigpu_torchrun.py (CPU), run by the launcher: rank 1
    kills itself at epoch 7, and its replacement again at epoch 8. Each death
    is respawned and the script runs again; the launch must finish (exit 0)
    with every rank through the last epoch."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["DDP_TUTORIAL_KILL"] = "1:7,8"
    cmd = [sys.executable, "-m", "monarch_nb.launch", "-n", "2", "--backend", "cpu",
           str(DDP_TUTORIAL), "10", "5"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=130, env=env,
                         cwd=tmp_path)
    # both faults happened (each its own line; the restarts' lines name it too)
    assert res.stderr.count("monarch_nb: rank 1 died:") == 2, res.stderr[-4000:]
    assert res.returncode == 0, res.stderr[-4000:]
    for rank in (0, 1):
        assert f"[CPU{rank}] Epoch 9 |" in res.stdout, res.stdout[-4000:]
        assert f"[CPU{rank}] training finished after 10 epochs" in res.stdout, res.stdout[-4000:]


# -- 6 ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_call_waiting_for_a_respawn_fails_when_the_mesh_stops() -> None:
    """Rank 1 dies a second time, so its respawn waits out a backoff; a call
    issued meanwhile waits for it. Stopping the mesh must fail that call at
    once, saying so (it used to stay pending forever)."""
    with Mesh.start(n=2, backend="cpu") as mesh:
        mesh.kill(1)
        wait_for(lambda: _back(mesh, 1, 1), timeout=30, what="rank 1 back after its first death")
        mesh.kill(1)  # second death: the respawn comes after a backoff (0.5 s +- 25 %)
        fut = mesh.run_async(mnb.rank)
        mesh.stop()
        err = _outcome(fut, 5, "a call waiting for rank 1 when the mesh stopped")
        assert isinstance(err, MonarchError), repr(err)
        assert re.search(r"mesh was stopped", str(err)), str(err)


@pytest.mark.timeout(60)
def test_a_running_no_block_cell_fails_with_mesh_stopped_when_the_mesh_stops() -> None:
    """A ``--no-block`` cell still running when the mesh stops ends with "the
    mesh was stopped" on every rank, not with a rank that "died (exited with
    code 0)" (the rank leaving because it was told to stop)."""
    with Mesh.start(n=2, backend="cpu") as mesh:
        fut = mesh.exec_async("import time\ntime.sleep(30)")
        wait_for(lambda: all(row["state"] == "busy" for row in mesh.status()), timeout=10,
                 what="the cell to run")
        time.sleep(0.2)  # into the sleep
        mesh.stop()
        err = _outcome(fut, 10, "a running cell when the mesh stopped")
        assert isinstance(err, MonarchError), repr(err)
        text = str(err)
        assert "the mesh was stopped" in text, text
        assert "exited with code 0" not in text, text
        if isinstance(err, RankErrors):
            assert not any(isinstance(e, RankDied) for e in err.errors.values()), text
