"""The scale harness (benchmarks/simranks.py, benchmarks/scale.py) at a small
size: simulated ranks speak the real protocol to a real controller, every
one of them answers every call as itself, the controller drops nothing, and
nothing is left running. Facts only, no timing: the figures are the
benchmark's job."""

from __future__ import annotations

import psutil
import pytest

from benchmarks.simranks import SimLauncher
from monarch_nb import Mesh, UsageError

from .conftest import wait_for

N = 64
HOSTS = 2


def _noop() -> None:
    return None


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("links,agents", [(True, 0), (False, 0), (False, 8)],
                         ids=["links", "zmq", "agents"])
def test_simulated_ranks_answer_every_call_and_leave_nothing_behind(links: bool,
                                                                    agents: int) -> None:
    launcher = SimLauncher(hosts=HOSTS, links=links, agents=agents, per_agent=N // 8)
    mesh = Mesh.start(n=N, backend="cpu", respawn="off", launcher=launcher, spare=False,
                      hang_timeout=None)
    try:
        # main channels: every rank's link (as real local ranks), DEALERs, or agents
        assert mesh._ctl.io.links == (N if links else 0)
        relayed = mesh._ctl.io.relayed
        fanouts = relayed["fan-outs"]
        pids = launcher.host_pids()
        assert len(pids) == HOSTS  # N ranks in a few processes, not N processes
        status = mesh.status()
        assert [row["state"] for row in status] == ["ready"] * N
        # every rank reports its host's pid: liveness reads a real process
        assert {row["pid"] for row in status} == set(pids)
        for _ in range(5):
            res = mesh.run(_noop)
            assert sorted(res) == list(range(N)) and set(res.values()) == {None}
        # EXEC answers the rank number: each rank answered as itself
        assert dict(mesh.exec("rank")) == {r: r for r in range(N)}
        assert dict(mesh[3:7].exec("rank")) == {r: r for r in range(3, 7)}
        if agents:  # one message per simulated host for a call to all ranks
            assert relayed["fan-outs"] - fanouts >= 6 * agents
            before = relayed["fan-outs"]
            mesh.run(_noop)
            # (a ping may fall in between: it is one message per host too)
            assert relayed["fan-outs"] - before in (agents, 2 * agents), relayed
        assert mesh.dropped == {}  # every message signed and verified, none refused
    finally:
        mesh.stop()
        launcher.close()
    assert not mesh.running
    wait_for(lambda: all(_gone(pid) for pid in pids), timeout=10, what="host processes to exit")
    assert all(p.poll() is not None for p in launcher.procs.values())


def test_a_launcher_object_needs_the_number_of_ranks() -> None:
    launcher = SimLauncher(hosts=HOSTS)
    with pytest.raises(UsageError, match="needs n"):
        Mesh.start(launcher=launcher)
    assert launcher.procs == {}  # refused before anything started
