"""Ranks behind a host agent forked from the agent's own warm process
(procs/hostagent.py, procs/warm.py), on real processes. Hosts are names
and the remote shell is ``sh -c`` (``MONARCH_NB_SSH``), as in
tests/test_agents.py.

How a forked rank is told from a fresh one here: every process forked from
one warm process has that process's string hash seed, so the ranks of one
host hash a string alike, and the two hosts' (two warm processes) and
fresh interpreters' differ.

* every rank's parent is its host's agent, which has one warm process;
* a killed remote rank comes back forked (from the spare or the warm process);
* the warm process goes with its agent: stopped with the mesh, and killed
  with it when the agent is killed (no orphans);
* ``fork=False`` keeps fresh interpreters and no warm process on the agents;
* a warm process that cannot fork (a preload that fails there) leaves the
  agent up, starting fresh interpreters, said once.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from monarch_nb import Mesh

from .conftest import wait_for
from .test_agents import _agents, _tidy, _workers

ALL_REDUCE = "x = torch.ones(1)\ndist.all_reduce(x)\nx.item()"
SALT = "monarch-nb-fork-check"


@pytest.fixture(autouse=True)
def two_hosts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("MONARCH_NB_SSH", "sh -c")
    yield


def _start(**options: Any) -> Mesh:
    mesh = Mesh.start(n=4, backend="cpu", launcher="ssh", hosts="hA,hB", bind="127.0.0.1",
                      master_addr="127.0.0.1", start_timeout=90, **options)
    mesh.exec("import torch, torch.distributed as dist")
    return mesh


def _warms(agent: psutil.Process) -> list[psutil.Process]:
    """``agent``'s warm processes (their output goes to warm<n>.log)."""
    out = []
    for proc in _workers(agent):
        try:
            if os.path.basename(os.readlink(f"/proc/{proc.pid}/fd/1")).startswith("warm"):
                out.append(proc)
        except OSError:
            pass
    return out


def _parents(pids: dict[int, int]) -> dict[int, int]:
    return {rank: psutil.Process(pid).ppid() for rank, pid in pids.items()}


def test_remote_ranks_are_forked_by_their_agent_and_come_back_forked() -> None:
    mesh = _start(fork=True)
    warm_pids: list[int] = []
    try:
        agents = _agents()
        assert len(agents) == 2, agents
        pids = mesh.run(os.getpid)
        parents = _parents(pids)
        assert set(parents.values()) == {int(a) for a in agents}, (parents, agents)
        for agent in agents.values():  # one warm process per agent
            warms = _warms(agent)
            assert len(warms) == 1, warms
            warm_pids.append(warms[0].pid)
        hashes = mesh.run(hash, SALT)
        # ranks 0,1 on hA, 2,3 on hB: one warm process each
        assert hashes[0] == hashes[1] and hashes[2] == hashes[3], hashes
        assert hashes[0] != hashes[2], hashes
        # killed right after the start (the spare may not be there yet): back
        # forked, the agent its parent, the group whole again
        mesh.kill(3)
        assert mesh.exec(ALL_REDUCE, timeout=60) == dict.fromkeys(range(4), 4.0)
        assert mesh.run(hash, SALT)[3] == hashes[2]
        again = mesh.run(os.getpid)
        assert again[3] != pids[3] and _parents(again)[3] == parents[3]
        mesh.kill(3)  # and again (from the forked spare once it is there)
        assert mesh.exec(ALL_REDUCE, timeout=60) == dict.fromkeys(range(4), 4.0)
        assert mesh.run(hash, SALT)[3] == hashes[2]
        assert _parents(mesh.run(os.getpid))[3] == parents[3]
        assert [len(_warms(a)) for a in agents.values()] == [1, 1]
    finally:
        mesh.stop()
    wait_for(lambda: not _agents(), timeout=20, what="the agents to end with the mesh")
    wait_for(lambda: not [p for p in warm_pids if psutil.pid_exists(p)], timeout=20,
             what="the warm processes to end with their agents")


def test_a_warm_process_slower_than_five_seconds_still_forks_every_rank(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A slow import (a loaded machine, a slow file system: here a preload that
    # takes 7 s) is waited for: the ranks are forked from it, not started as
    # fresh interpreters that would import torch again beside it, and the
    # controller learns each pid when its agent starts it (nothing blocks on it).
    (tmp_path / "monarch_nb_slow_preload.py").write_text("import time\ntime.sleep(7)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p))
    mesh = _start(fork=True, preload=["monarch_nb_slow_preload"])
    try:
        hashes = mesh.run(hash, SALT)
        assert hashes[0] == hashes[1] and hashes[2] == hashes[3], hashes
        assert hashes[0] != hashes[2], hashes
        pids = mesh.run(os.getpid)
        assert {row["rank"]: row["pid"] for row in mesh.status()} == dict(pids)
        started = [e for e in mesh.events if e["kind"] == "started"]
        assert sorted(e["rank"] for e in started) == [0, 1, 2, 3], started
        assert {e["rank"]: e["detail"] for e in started} == {
            r: f"pid {pid}" for r, pid in pids.items()}, started
    finally:
        mesh.stop()


def test_a_dead_warm_process_is_replaced_and_a_start_waiting_for_it_can_be_killed(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    # The warm process killed under a running mesh (as the OOM killer would):
    # the agent starts another at once rather than giving forking up; a rank
    # killed while its start waits for that import is not started at all (its
    # death is seen now, not after the import), and comes back forked.
    (tmp_path / "monarch_nb_slow_preload.py").write_text("import time\ntime.sleep(7)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p))
    mesh = _start(fork=True, preload=["monarch_nb_slow_preload"])
    try:
        pids = mesh.run(os.getpid)
        agent = next(a for a in _agents().values() if pids[1] in [c.pid for c in _workers(a)])
        (warm,) = _warms(agent)
        warm.send_signal(signal.SIGKILL)
        wait_for(lambda: [w.pid for w in _warms(agent)] not in ([], [warm.pid]), timeout=20,
                 what="the agent's new warm process")
        # a kill now takes the spare if there is one; a second finds none and waits
        mesh.kill(1)
        if mesh._ctl.supervisor.procs[1].popen.from_spare:
            mesh.kill(1)
        waiting = mesh.status()[1]["incarnation"]
        mesh.kill(1)  # while its start waits for the import
        assert mesh.exec(ALL_REDUCE, timeout=60) == dict.fromkeys(range(4), 4.0)
        # that incarnation never ran (a start made after the import would say so)
        events = [e for e in mesh.events if e["rank"] == 1 and e["incarnation"] == waiting]
        assert [e["kind"] for e in events] == ["respawned", "died"], events
        assert mesh.status()[1]["incarnation"] > waiting
        again = mesh.run(os.getpid)
        assert _parents(again)[1] == agent.pid
        assert [w.pid for w in _warms(agent)] != [warm.pid] and len(_warms(agent)) == 1
    finally:
        mesh.stop()
    assert "fresh interpreters from now on" not in capfd.readouterr().err


def test_a_killed_agent_takes_its_warm_process_and_ranks_with_it() -> None:
    mesh = _start(fork=True)
    try:
        pids = mesh.run(os.getpid)
        agent = next(a for a in _agents().values() if pids[2] in [c.pid for c in _workers(a)])
        (warm,) = _warms(agent)
        gone = [warm.pid, pids[2], pids[3]]
        agent.send_signal(signal.SIGKILL)  # only the agent: the rest must follow it
        agent.wait(10)
        wait_for(lambda: not [p for p in gone if psutil.pid_exists(p)
                              and psutil.Process(p).status() != psutil.STATUS_ZOMBIE],
                 timeout=20, what="the warm process and the ranks to die with their agent")
        _tidy(agent.pid)
    finally:
        mesh.stop()


def test_fork_false_keeps_fresh_interpreters_on_the_agents() -> None:
    mesh = _start(fork=False)
    try:
        agents = _agents()
        assert all(not _warms(a) for a in agents.values())
        hashes = mesh.run(hash, SALT)
        assert len(set(hashes.values())) == 4, hashes  # four interpreters, four seeds
        assert set(_parents(mesh.run(os.getpid)).values()) == {int(a) for a in agents}
    finally:
        mesh.stop()


def test_a_warm_process_that_cannot_fork_leaves_the_agent_starting_fresh(
        capfd: pytest.CaptureFixture[str]) -> None:
    # the module exists here (the controller checks names only), not on the "hosts"
    mesh = _start(fork=True, preload=["monarch_nb_no_such_module"])
    try:
        hashes = mesh.run(hash, SALT)
        assert len(set(hashes.values())) == 4, hashes
        mesh.kill(1)
        assert mesh.exec(ALL_REDUCE, timeout=60) == dict.fromkeys(range(4), 4.0)
        assert all(not _warms(a) for a in _agents().values())
    finally:
        mesh.stop()
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "fresh interpreters from now on" in line]
    assert len(said) == 2 and "monarch_nb_no_such_module" in said[0], err  # once per agent
