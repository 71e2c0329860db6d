"""``--launcher ssh`` through a real sshd: one sshd in each of three network
namespaces (hosts), the controller in the root namespace on the bridge; the
host agents are started by the real ``ssh`` client and read their orders
(keys included) from its stdin. A rank killed is respawned by its agent. A
partition (a host's link down, nothing closed): the host is lost after
``host_timeout``, its rank comes back on the spare host, and what ran on the
cut-off host exits on its own.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import psutil
import pytest

import monarch_nb as mnb
from monarch_nb import Mesh

from .conftest import wait_for
from .engines import Sshd, netns_hosts, sshd_in

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def sshd() -> Iterator[Sshd]:
    with netns_hosts(3) as hosts, tempfile.TemporaryDirectory() as folder, \
            sshd_in(hosts, folder) as s:
        yield s


def _alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def test_ssh_launcher_over_real_ssh(sshd: Sshd, monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = sshd.hosts
    monkeypatch.setenv("MONARCH_NB_SSH", sshd.template)
    mesh = Mesh.start(n=2, backend="cpu", launcher="ssh", hosts=",".join(hosts.addrs),
                      bind=hosts.bridge_addr, start_timeout=90)
    pids: list[int] = []
    try:
        assert mesh._ctl.io.curve is not None
        info = mesh.run(lambda: (os.getpid(), os.environ["MASTER_ADDR"], os.environ["LOCAL_RANK"],
                                 os.environ.get("SSH_CONNECTION", "").split()[2:3]))
        pids = [info[0][0], info[1][0]]
        assert info[0][1:] == (hosts.addrs[0], "0", [hosts.addrs[0]])
        assert info[1][1:] == (hosts.addrs[0], "0", [hosts.addrs[1]])  # rank 1 on host 2
        assert mesh.exec("import torch, torch.distributed as dist\nx = torch.ones(1)\n"
                         "dist.all_reduce(x)\nx.item()") == {0: 2.0, 1: 2.0}
        mesh.kill(1)  # SIGKILL to rank 1's ssh: the remote rank's stdin closes
        wait_for(lambda: not _alive(pids[1]), timeout=10, what="the remote rank to exit")
        assert mesh.run(mnb.incarnation, timeout=90) == {0: 0, 1: 1}
        pids += [p for p in mesh.run(os.getpid).values() if p not in pids]
    finally:
        mesh.stop()
    wait_for(lambda: not any(_alive(p) for p in pids), timeout=15,
             what="every remote rank to exit with its mesh")


def _monarch_pids_in(ns: str) -> list[int]:
    import subprocess

    res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    out = []
    for pid in (int(p) for p in res.stdout.split()):
        try:
            if any("monarch_nb" in a for a in psutil.Process(pid).cmdline()):
                out.append(pid)
        except psutil.Error:
            pass
    return out


@pytest.mark.parametrize("cut", [1, 0], ids=["rank1-host", "master-host"])
def test_a_partitioned_host_is_lost_and_its_rank_moves_to_the_spare(
        sshd: Sshd, monkeypatch: pytest.MonkeyPatch, cut: int) -> None:
    """Host ``cut`` (rank 1's, or rank 0's: the master's, MASTER_ADDR left
    to its default) drops off the network: its rank comes back on the spare
    host with its number, the group re-forms (on the spare's address when
    the master moved) and answers a collective; the cut-off agent and rank
    exit on their own."""
    import subprocess

    hosts = sshd.hosts
    monkeypatch.setenv("MONARCH_NB_SSH", sshd.template)
    mesh = Mesh.start(n=2, backend="cpu", launcher="ssh", hosts=",".join(hosts.addrs[:2]),
                      spare_hosts=hosts.addrs[2], bind=hosts.bridge_addr, start_timeout=90,
                      host_timeout=3, controller_timeout=5)
    down = False
    try:
        where = lambda: (os.environ.get("SSH_CONNECTION", "").split()[2],  # noqa: E731
                         os.environ["MASTER_ADDR"])
        assert mesh.run(where) == {r: (hosts.addrs[r], hosts.addrs[0]) for r in (0, 1)}
        assert _monarch_pids_in(hosts.names[cut]), "the host runs its agent and rank"
        # the host drops off the network: nothing is closed, nothing is said
        subprocess.run(["ip", "link", "set", hosts.links[cut], "down"], check=True)
        down = True
        wait_for(lambda: mesh.status()[cut]["state"] == "ready"
                 and mesh.status()[cut]["incarnation"] >= 1, timeout=90,
                 what=f"rank {cut} back on the spare host")
        now_at = [hosts.addrs[2] if r == cut else hosts.addrs[r] for r in (0, 1)]
        master = now_at[0]  # rank 0's host: the spare's address if that host was cut
        assert mesh.run(where, timeout=60) == {r: (now_at[r], master) for r in (0, 1)}
        assert mesh.exec("import torch, torch.distributed as dist\nx = torch.ones(1)\n"
                         "dist.all_reduce(x)\nx.item()", timeout=60) == {0: 2.0, 1: 2.0}
        died = [e["detail"] for e in mesh.events if e["rank"] == cut and e["kind"] == "died"]
        assert any(f"host {hosts.addrs[cut]} lost" in d for d in died), died
        # on the cut-off host, the agent and its rank hear no controller: they exit
        wait_for(lambda: not _monarch_pids_in(hosts.names[cut]), timeout=30,
                 what="the partitioned host's agent and rank to exit on their own")
    finally:
        if down:
            subprocess.run(["ip", "link", "set", hosts.links[cut], "up"], check=False)
        mesh.stop()
