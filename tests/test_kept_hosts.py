"""A kept mesh across hosts (issue 38, item 8), in network namespaces
(tests/engines.py): the controller in one namespace, 4 ranks on two others
through their host agents (the ssh launcher with ``ip netns exec``). The
controller is SIGKILLed; a new controller attaches: the same rank processes
on both hosts, their variables, a collective across the hosts. Then it
detaches, a host is lost while nobody is attached, and the next attach
handles it as a lost host. Nothing is left in any namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import wait_for
from .engines import Hosts, netns_hosts
from .engines import lose_host as _lose_host
from .engines import pids_in as _pids_in

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with netns_hosts(3) as h:  # the controller's, host A, host B
        yield h


START = """
    import os, sys
    from monarch_nb import Mesh
    hosts, master, bind = sys.argv[1:4]
    os.environ["MONARCH_NB_SSH"] = "ip netns exec {host} sh -c"
    mesh = Mesh.start(n=4, backend="cpu", launcher="ssh", hosts=hosts, bind=bind,
                      master_addr=master, start_timeout=90, host_timeout=3,
                      name="far", keep_alive=120)
    mesh.exec("x = rank * 3")
    print("PIDS", *[r["pid"] for r in mesh.status()], flush=True)
    os.kill(os.getpid(), 9)
"""

ATTACH = """
    import json, os, sys, time
    from monarch_nb import Mesh
    os.environ["MONARCH_NB_SSH"] = "ip netns exec {host} sh -c"
    what = sys.argv[1]
    t0 = time.monotonic()
    mesh = Mesh.attach("far")
    out = {"attach_s": round(time.monotonic() - t0, 2)}
    if what == "check":
        out["pids"] = [r["pid"] for r in mesh.status()]
        out["x"] = mesh.exec("x")
        out["sum"] = mesh.exec("t = torch.ones(1)\\ndist.all_reduce(t)\\nt.item()", timeout=60)
        mesh.detach()
    else:  # a host was lost while detached
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and [r["state"] for r in mesh.status()][2:] != ["lost"] * 2:
            time.sleep(0.1)
        out["states"] = [r["state"] for r in mesh.status()]
        out["lost_host"] = [r["lost_host"] for r in mesh.status()]
        out["x"] = mesh.ranks("0,1").exec("x")
        mesh.stop()
    print("RESULT " + json.dumps(out, default=str), flush=True)
"""


def _run(hosts: Hosts, code: str, *args: str, env: dict[str, str], timeout: float = 180,
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", hosts.names[0], sys.executable, "-c",
                           textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _result(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[-1][7:])


def test_a_kept_mesh_across_hosts(hosts: Hosts) -> None:
    runtime = tempfile.mkdtemp(prefix="mkh")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JUPYTER_RUNTIME_DIR=runtime)
    a, b = hosts.names[1:3]
    try:
        started = _run(hosts, START, f"{a},{b}", hosts.addrs[1], hosts.addrs[0], env=env)
        assert started.returncode == -9, started.stderr
        pids = [int(p) for p in started.stdout.split("PIDS", 1)[1].split()]
        checked = _result(_run(hosts, ATTACH, "check", env=env))
        print(f"attach across 2 hosts took {checked['attach_s']} s")
        assert checked["pids"] == pids  # the same processes on both hosts
        assert checked["x"] == {str(r): r * 3 for r in range(4)}
        assert checked["sum"] == {str(r): 4.0 for r in range(4)}
        _lose_host(b)  # while nobody is attached
        lost = _result(_run(hosts, ATTACH, "lose", env=env))
        assert lost["states"] == ["ready", "ready", "lost", "lost"], lost
        assert lost["lost_host"][2:] == [b, b], lost
        assert lost["x"] == {"0": 0, "1": 3}
        for ns in (hosts.names[0], a):  # stopped: nothing left anywhere (the agents
            # leave once their ranks are gone)
            wait_for(lambda ns=ns: _pids_in(ns) == [], 15, what=f"namespace {ns} to be empty")
    finally:
        subprocess.run([sys.executable, "-m", "monarch_nb.cli", "stop", "far"], env=env,
                       capture_output=True, timeout=60)
        shutil.rmtree(runtime, ignore_errors=True)
