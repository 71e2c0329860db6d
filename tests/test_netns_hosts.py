"""A lost host across network namespaces (tests/engines.py): the controller
in one namespace, ranks on two others through their host agents (the ssh
launcher with ``ip netns exec {host} sh -c``), a third kept as a spare
host. Losing a host is what it is on a real cluster: every process in its
namespace killed and the namespace removed. Its ranks come back on the
spare host with their rank numbers, on the spare's own address, and the
group answers a collective again; nothing is left in any namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from .engines import Hosts, netns_hosts

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with netns_hosts(4) as h:  # controller, host A, host B, spare host C
        yield h


DRIVER = """
    import json, os, sys, time
    import psutil
    from monarch_nb import Mesh

    hosts, spare, master, bind = sys.argv[1:5]
    os.environ["MONARCH_NB_SSH"] = "ip netns exec {host} sh -c"

    def where():
        import psutil
        return sorted(a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                      if a.family == 2 and not a.address.startswith("127."))

    ALL_REDUCE = "x = torch.ones(1)\\ndist.all_reduce(x)\\nx.item()"
    mesh = Mesh.start(n=4, backend="cpu", launcher="ssh", hosts=hosts, spare_hosts=spare,
                      bind=bind, master_addr=master, start_timeout=90, host_timeout=3)
    out = {}
    try:
        mesh.exec("import torch, torch.distributed as dist")
        out["before"] = mesh.run(where)
        print("READY", flush=True)
        sys.stdin.readline()  # the host is gone now
        t0 = time.monotonic()
        deadline = t0 + 90
        while time.monotonic() < deadline:
            rows = mesh.status()
            if all(r["state"] == "ready" and r["incarnation"] >= 1 for r in rows[2:]):
                break
            time.sleep(0.1)
        out["back_s"] = round(time.monotonic() - t0, 2)
        out["states"] = [r["state"] for r in mesh.status()]
        out["after"] = mesh.run(where)
        out["sum"] = mesh.exec(ALL_REDUCE, timeout=60)
        out["died"] = [e["detail"] for e in mesh.events if e["kind"] == "died"]
    finally:
        mesh.stop()
    print("RESULT " + json.dumps(out, default=str), flush=True)
"""


def _pids_in(ns: str) -> list[int]:
    res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(p) for p in res.stdout.split()]


def test_a_lost_host_comes_back_on_the_spare_host(hosts: Hosts, tmp_path: Path) -> None:
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    a, b, c = hosts.names[1:4]
    proc = subprocess.Popen(
        ["ip", "netns", "exec", hosts.names[0], sys.executable, str(driver), f"{a},{b}", c,
         hosts.addrs[1], hosts.addrs[0]],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = ""
        for line in proc.stdout:
            if line.startswith("READY"):
                break
        assert line.startswith("READY"), "the mesh did not start"
        victims = _pids_in(b)
        assert victims, "nothing runs on host B"
        for pid in victims:  # the host goes: its processes, then its network
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", b], check=True, timeout=30)
        for pid in victims:  # a killed agent's folder (a real lost host takes it along)
            for folder in Path("/tmp").glob(f"monarch-nb-agent-{pid}-*"):
                shutil.rmtree(folder, ignore_errors=True)
        proc.stdin.write("lost\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = json.loads([x for x in out.splitlines() if x.startswith("RESULT ")][-1][7:])
    addr = {name: hosts.addrs[i] for i, name in enumerate(hosts.names)}
    assert result["before"] == {"0": [addr[a]], "1": [addr[a]], "2": [addr[b]], "3": [addr[b]]}
    assert result["states"] == ["ready"] * 4, result
    # ranks 2,3 on the spare host, keeping their numbers
    assert result["after"] == {"0": [addr[a]], "1": [addr[a]], "2": [addr[c]], "3": [addr[c]]}
    assert result["sum"] == {str(r): 4.0 for r in range(4)}, result
    assert any(f"host {b} lost" in d for d in result["died"]), result["died"]
    print(f"lost host: ranks back on the spare host in {result['back_s']} s")
    for ns in (hosts.names[0], a, c):  # the mesh stopped: nothing left anywhere
        assert _pids_in(ns) == [], ns
