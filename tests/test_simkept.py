"""The kept-mesh attach harness (benchmarks/simkept.py, benchmarks/kept.py
``--agents``) at a small size, and the hook it uses: a kept mesh started
with a Launcher object is attached with ``Mesh.attach(name, launcher=...)``
through the real path (home agent, each host's door and handshake, routes
through the relays, every rank's HELLO). Facts only, no timing."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from benchmarks.simkept import SimKeptHosts
from monarch_nb import Mesh
from monarch_nb.procs.agents import AgentLauncher

from .conftest import wait_for

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="the simulated doors are a small C program")


def _noop() -> None:
    return None


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A private runtime folder (short: a Unix socket lives there)."""
    path = tempfile.mkdtemp(prefix="mk")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", path)
    try:
        yield path
    finally:
        for row in Mesh.list():
            subprocess.run([sys.executable, "-m", "monarch_nb.cli", "stop", str(row["name"])],
                           capture_output=True, timeout=60)
        shutil.rmtree(path, ignore_errors=True)


def test_a_kept_mesh_on_simulated_hosts_is_attached_through_its_doors(runtime: str) -> None:
    hosts = SimKeptHosts(agents=3, per_agent=2, processes=2)
    hosts.start_hosts()
    mesh = None
    try:
        mesh = Mesh.start(n=6, backend="cpu", respawn="off", hang_timeout=None, spare=False,
                          launcher=AgentLauncher(hosts, spare=False), name="simk",
                          keep_alive=60)
        assert len(mesh.run(_noop)) == 6
        idents = [info.identity for info in mesh._ctl.ranks]
        mesh.detach()
        # the home agent holds it, nobody attached
        wait_for(lambda: Mesh.list()[0]["attached"] == "", timeout=10)

        mesh = Mesh.attach("simk", launcher=AgentLauncher(hosts, spare=False))
        ctl = mesh._ctl
        assert ctl.home_agent is not None and not ctl.home_agent.lost  # the real home agent
        launcher = ctl.supervisor.launcher
        assert isinstance(launcher, AgentLauncher)
        assert sorted(launcher.agents) == ["sim0", "sim1", "sim2"]
        # every host attached through its door, its relay's id as the agent said it
        assert all(a.attached and a.relay_id and not a.lost for a in launcher.agents.values())
        assert [info.identity for info in ctl.ranks] == idents  # the same ranks, adopted
        assert ctl.keep is not None and sorted(ctl.keep.hellos) == list(range(6))
        assert all("kept" in hello for hello in ctl.keep.hellos.values())
        assert len(mesh.run(_noop)) == 6  # through the relays again
        assert ctl.io.relayed  # (the answers came back through the agents)
    finally:
        if mesh is not None:
            mesh.stop()
        hosts.close()
    assert all(p.returncode == 0 for p in hosts.procs)  # every agent was stopped, then left
