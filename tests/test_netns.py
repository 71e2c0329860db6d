"""Several hosts, simulated with network namespaces on one bridge
(tests/engines.py): the controller runs in one namespace, and ranks in two
others join it over their own addresses (the ssh launcher, its remote-shell
template set to ``ip netns exec {host} sh -c``); tcpdump on the bridge shows
the wire. (The controller has a namespace of its own because traffic between
the root namespace and a namespace does not reach packet capture under
gVisor, which runs these tests; between namespaces it does.)

* with Curve (the default off loopback) no marker string the test sends
  appears in the capture, in either direction;
* the same run with ``insecure_no_encryption=True`` shows the marker (so the
  capture does see the traffic: the first check can fail);
* a peer in another namespace without the keys is refused (ZAP) and nothing
  it sends is executed or even reaches the signature check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from .engines import Hosts, capture, netns_hosts

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[1]
MARKER = "mnb-secret-marker-7f3a9c"


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with netns_hosts(3) as h:  # controller, rank host A, rank host B
        yield h


DRIVER = """
    import json, os, subprocess, sys, time
    import psutil
    from monarch_nb import Mesh

    mode, hosts, master, bind, marker, attacker, flag = sys.argv[1:8]
    os.environ["MONARCH_NB_SSH"] = "ip netns exec {host} sh -c"

    def where():
        import psutil
        return sorted(a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                      if a.family == 2 and not a.address.startswith("127."))

    mesh = Mesh.start(n=2, backend="cpu", launcher="ssh", hosts=hosts, bind=bind,
                      master_addr=master, start_timeout=90,
                      insecure_no_encryption=(mode == "plain"))
    out = {"where": mesh.run(where), "curve": mesh._ctl.io.curve is not None,
           "key": mesh._ctl.key.hex()}
    try:
        if mode in ("curve", "plain"):
            out["upper"] = mesh.run(lambda s: s.upper(), marker)
            mesh.push(secret=marker)
            out["pulled"] = mesh.pull("secret")
            out["sum"] = mesh.exec("import torch, torch.distributed as dist\\n"
                                   "x = torch.ones(1)\\ndist.all_reduce(x)\\nx.item()")
            out["secret"] = mesh._ctl.curve.client_secret.decode() if mode == "curve" else ""
        else:
            ctl = mesh._ctl
            res = subprocess.run(["ip", "netns", "exec", attacker, sys.executable, flag + ".py",
                                  ctl.io.endpoint, flag, ctl.curve.server_public.decode()],
                                 capture_output=True, text=True, timeout=60)
            out["attacker"] = res.stdout + res.stderr
            deadline = time.monotonic() + 5
            while not ctl.io.dropped["curve-refused"] and time.monotonic() < deadline:
                mesh._ctl.pump(0.05)
            out["dropped"] = dict(ctl.io.dropped)
            out["executed"] = os.path.exists(flag)
            out["after"] = mesh.run(lambda: "ok")
    finally:
        mesh.stop()
    print("RESULT " + json.dumps(out, default=str))
"""

ATTACKER = """
    import sys, time, zmq
    endpoint, flag, server_public = sys.argv[1:4]
    ctx = zmq.Context()
    plain = ctx.socket(zmq.DEALER)               # no Curve at all
    keyed = ctx.socket(zmq.DEALER)               # Curve, but keys of its own
    keyed.curve_serverkey = server_public.encode()
    keyed.curve_publickey, keyed.curve_secretkey = zmq.curve_keypair()
    for s in (plain, keyed):
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        s.send_multipart([b"x" * 64, ("open(%r, 'w')" % flag).encode()])
    time.sleep(1.5)
    print("answers", sum(s.poll(200) for s in (plain, keyed)))
"""


def drive(hosts: Hosts, tmp_path: Path, mode: str) -> dict:
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER))
    flag = tmp_path / "pwned"
    Path(str(flag) + ".py").write_text(textwrap.dedent(ATTACKER))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(
        ["ip", "netns", "exec", hosts.names[0], sys.executable, str(driver), mode,
         f"{hosts.names[1]},{hosts.names[2]}", hosts.addrs[1], hosts.addrs[0], MARKER,
         hosts.names[2], str(flag)],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    # each rank is in its own namespace, on its own address
    assert out["where"] == {"0": [hosts.addrs[1]], "1": [hosts.addrs[2]]}, out
    return out


def test_ranks_in_other_namespaces_join_encrypted(hosts: Hosts, tmp_path: Path) -> None:
    pcap = tmp_path / "curve.pcap"
    with capture(hosts.bridge, pcap):
        out = drive(hosts, tmp_path, "curve")
    assert out["curve"] and out["upper"] == {"0": MARKER.upper(), "1": MARKER.upper()}
    assert out["pulled"] == {"0": MARKER, "1": MARKER} and out["sum"] == {"0": 2.0, "1": 2.0}
    wire = pcap.read_bytes()
    assert len(wire) > 10_000, "the capture saw no traffic"
    assert MARKER.encode() not in wire and MARKER.upper().encode() not in wire
    # keys never travel on the network (ranks got them on the launcher's stdin)
    assert out["key"].encode() not in wire and out["secret"].encode() not in wire


def test_without_encryption_the_marker_is_on_the_wire(hosts: Hosts, tmp_path: Path) -> None:
    pcap = tmp_path / "plain.pcap"
    with capture(hosts.bridge, pcap):
        out = drive(hosts, tmp_path, "plain")
    assert not out["curve"]
    wire = pcap.read_bytes()
    assert MARKER.encode() in wire  # so the check above can fail
    assert out["key"].encode() not in wire


def test_peer_without_keys_is_refused_and_executes_nothing(hosts: Hosts, tmp_path: Path) -> None:
    out = drive(hosts, tmp_path, "attack")
    assert "answers 0" in out["attacker"], out
    assert out["dropped"].get("curve-refused", 0) >= 1
    assert set(out["dropped"]) == {"curve-refused"}  # nothing reached the signature check
    assert out["executed"] is False
    assert out["after"] == {"0": "ok", "1": "ok"}


LOST = """
    import json, sys, time
    import psutil
    from monarch_nb import Mesh
    import os

    hosts, master, bind = sys.argv[1:4]
    os.environ["MONARCH_NB_SSH"] = "ip netns exec {host} sh -c"
    mesh = Mesh.start(n=2, backend="cpu", launcher="ssh", hosts=hosts, bind=bind,
                      master_addr=master, start_timeout=90, respawn="off",
                      controller_timeout=3.0, heartbeat_timeout=60.0)
    # (the controller must not kill them first for their own silence: the
    # ranks are to find out on their own)
    pids = mesh.run(os.getpid)
    print("READY " + json.dumps(dict(pids)), flush=True)
    sys.stdin.readline()  # the test cut this namespace's link
    t0 = time.monotonic()
    gone = {}
    while len(gone) < 2 and time.monotonic() - t0 < 60:
        for r, pid in pids.items():
            if r not in gone and not psutil.pid_exists(pid):
                gone[r] = round(time.monotonic() - t0, 1)
        time.sleep(0.1)
    logs = {r: mesh.logs(r) for r in pids}
    mesh.stop()
    print("RESULT " + json.dumps({"gone": gone, "logs": logs}), flush=True)
"""


def test_ranks_exit_when_their_controller_vanishes(hosts: Hosts, tmp_path: Path) -> None:
    """The controller's host drops off the network without closing anything
    (its link goes down): the ranks on the other hosts hear no ping, exit
    within their controller timeout and say so in their logs."""
    driver = tmp_path / "lost.py"
    driver.write_text(textwrap.dedent(LOST))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        ["ip", "netns", "exec", hosts.names[0], sys.executable, str(driver),
         f"{hosts.names[1]},{hosts.names[2]}", hosts.addrs[1], hosts.addrs[0]],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    link_down = False
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = ""
        for line in proc.stdout:
            if line.startswith("READY "):
                break
        assert line.startswith("READY "), "the mesh did not start"
        pids = {int(r): p for r, p in json.loads(line[len("READY "):]).items()}
        subprocess.run(["ip", "link", "set", hosts.links[0], "down"], check=True)
        link_down = True
        proc.stdin.write("cut\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=120)
    finally:
        if link_down:
            subprocess.run(["ip", "link", "set", hosts.links[0], "up"], check=False)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = json.loads([x for x in out.splitlines() if x.startswith("RESULT ")][-1][7:])
    assert sorted(result["gone"]) == ["0", "1"], result  # both exited on their own
    for r in ("0", "1"):
        assert any("controller silent for 3 s, exiting" in ln for ln in result["logs"][r]), \
            result["logs"][r]
    assert not [p for p in pids.values() if psutil.pid_exists(p)]
