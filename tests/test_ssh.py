"""``--launcher ssh`` through a real sshd: one sshd in each of two network
namespaces (hosts), the controller in the root namespace on the bridge; the
ranks are started by the real ``ssh`` client and read their keys from its
stdin. A rank whose ssh dies goes too (its stdin closes) and is respawned.
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
    with netns_hosts(2) as hosts, tempfile.TemporaryDirectory() as folder, \
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
