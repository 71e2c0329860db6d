"""A lost host across network namespaces (tests/engines.py): the controller
in one namespace, ranks on two others through their host agents (the ssh
launcher with ``ip netns exec {host} sh -c``), a third kept as a spare
host. Losing a host is what it is on a real cluster: every process in its
namespace killed and the namespace removed. Its ranks come back on the
spare host with their rank numbers, on the spare's own address, and the
group answers a collective again; nothing is left in any namespace.
Without a spare host, an elastic training cell running when the host is
lost ends within ``host_timeout`` + 2 s with an error naming the host, and
the survivors answer the next call; with ``min_ranks`` it carries on at the
smaller world size instead, and grows back to the full size in the same
running cell when a host is given (``mesh.add_hosts``), or at the next call
when none runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .engines import Hosts, lose_host, netns_hosts, pids_in, run_grow_driver

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    # controller, host A, host B, spare host C; host D (lost without a spare)
    # and host E (lost without a spare, the group shrinking): each test loses its
    # own; hosts F (lost), G (given, then lost), H (given): the group growing back
    with netns_hosts(9) as h:
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
        lose_host(b)
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
        assert pids_in(ns) == [], ns


ELASTIC_DRIVER = '''
    import json, os, sys, time
    from monarch_nb import Mesh

    hosts, master, bind = sys.argv[1:4]
    os.environ["MONARCH_NB_SSH"] = "ip netns exec {host} sh -c"
    TRAIN = """
    import time, torch, torch.distributed as dist, monarch_nb as mnb
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = mnb.elastic.State(model=model, optimizer=opt, step=0)

    @mnb.elastic.run(state)
    def train(state):
        while True:
            opt.zero_grad()
            model(torch.ones(8, 4)).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            state.step += 1
            state.commit()
            mnb.log(step=state.step, loss=float(state.step))
            time.sleep(0.05)

    train()
    """
    mesh = Mesh.start(n=4, backend="cpu", launcher="ssh", hosts=hosts, bind=bind,
                      master_addr=master, start_timeout=90, host_timeout=3)
    out = {}
    try:
        future = mesh.exec(TRAIN, elastic=True, block=False)
        deadline = time.monotonic() + 60
        while min(r["step"] or 0 for r in mesh.status()) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not future.done(), future.result()  # training, not failed
        print("READY", flush=True)
        sys.stdin.readline()  # the host is gone now
        try:
            future.result(timeout=60)
            out["error"] = None
        except Exception as exc:
            out["ended_at"] = time.time()
            out["error"] = str(exc)
            out["types"] = {r: type(e).__name__ for r, e in getattr(exc, "errors", {}).items()}
        t0 = time.monotonic()
        out["next"] = mesh.ranks("0,1").run(lambda: "here", timeout=10)
        out["next_s"] = round(time.monotonic() - t0, 2)
        out["states"] = [r["state"] for r in mesh.status()]
    finally:
        mesh.stop()
    print("RESULT " + json.dumps(out, default=str), flush=True)
'''


def test_a_lost_host_without_a_spare_ends_a_running_elastic_call(hosts: Hosts,
                                                                 tmp_path: Path) -> None:
    """4 ranks on hosts A and D, no spare host, an elastic training cell
    running: host D is lost. The survivors' wait for a re-formation that
    cannot come ends at once: the cell ends within host_timeout (3 s) + 2 s
    of the loss, with an error naming the host, and ranks 0,1 answer the
    next call."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(ELASTIC_DRIVER))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    a, d = hosts.names[1], hosts.names[4]
    proc = subprocess.Popen(
        ["ip", "netns", "exec", hosts.names[0], sys.executable, str(driver), f"{a},{d}",
         hosts.addrs[1], hosts.addrs[0]],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = ""
        for line in proc.stdout:
            if line.startswith("READY"):
                break
        assert line.startswith("READY"), "the mesh did not start"
        lost_at = time.time()
        lose_host(d)
        proc.stdin.write("lost\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = json.loads([x for x in out.splitlines() if x.startswith("RESULT ")][-1][7:])
    assert result["error"], result
    ended = result["ended_at"] - lost_at
    print(f"lost host without a spare: the elastic call ended {ended:.2f} s after the loss "
          f"(host_timeout 3 s); the survivors answered the next call in {result['next_s']} s")
    assert ended <= 3 + 2, result
    assert f"host {d} lost" in result["error"], result
    assert result["types"] == {"0": "MembershipChanged", "1": "MembershipChanged",
                               "2": "RankDied", "3": "RankDied"}, result
    assert result["next"] == {"0": "here", "1": "here"}, result
    assert result["states"] == ["ready", "ready", "lost", "lost"], result
    for ns in (hosts.names[0], a):  # the mesh stopped: nothing left anywhere
        assert pids_in(ns) == [], ns


SHRINK_DRIVER = '''
    import json, os, sys, time
    from monarch_nb import Mesh

    hosts, master, bind = sys.argv[1:4]
    os.environ["MONARCH_NB_SSH"] = "ip netns exec {host} sh -c"
    TRAIN = """
    import time, torch, torch.distributed as dist, monarch_nb as mnb
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = mnb.elastic.State(model=model, optimizer=opt, step=0)
    at = {}

    @mnb.elastic.run(state)
    def train(state):
        while state.step < 150:
            opt.zero_grad()
            model(torch.ones(8, 4) * (mnb.rank() + 1)).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            state.step += 1
            state.commit()
            at.setdefault(dist.get_world_size(), time.time())
            mnb.log(step=state.step, loss=float(state.step))
            time.sleep(0.05)
        return ([p.detach().tolist() for p in model.parameters()], state.step,
                mnb.rank(), mnb.world_size(), at.get(2))

    train()
    """
    mesh = Mesh.start(n=4, backend="cpu", launcher="ssh", hosts=hosts, bind=bind,
                      master_addr=master, start_timeout=90, host_timeout=3, min_ranks=2)
    out = {}
    try:
        future = mesh.exec(TRAIN, elastic=True, block=False)
        deadline = time.monotonic() + 60
        while min(r["step"] or 0 for r in mesh.status()) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not future.done(), future.result()  # training, not failed
        print("READY", flush=True)
        sys.stdin.readline()  # the host is gone now
        got = future.result(timeout=120)
        out["lost"] = list(got.lost)
        out["survivors"] = {r: v for r, v in got.survivors().items()}
        out["states"] = [r["state"] for r in mesh.status()]
        out["group"] = list(mesh.group)
        out["next"] = mesh.run(lambda: "here", timeout=10).survivors()
    finally:
        mesh.stop()
    print("RESULT " + json.dumps(out, default=str), flush=True)
'''


def test_a_lost_host_without_a_spare_shrinks_the_group_with_min_ranks(hosts: Hosts,
                                                                      tmp_path: Path) -> None:
    """As above, with ``min_ranks=2``: host D (ranks 2,3) is lost and the
    elastic cell does not end: ranks 0,1 re-form at world size 2 (torch
    ranks 0,1) and finish the loop with the same model; ranks 2,3's entries
    say lost; the next call answers on 0,1 without an error."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(SHRINK_DRIVER))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    a, d = hosts.names[1], hosts.names[5]  # (the elastic test above lost names[4])
    proc = subprocess.Popen(
        ["ip", "netns", "exec", hosts.names[0], sys.executable, str(driver), f"{a},{d}",
         hosts.addrs[1], hosts.addrs[0]],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = ""
        for line in proc.stdout:
            if line.startswith("READY"):
                break
        assert line.startswith("READY"), "the mesh did not start"
        lost_at = time.time()
        lose_host(d)
        proc.stdin.write("lost\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = json.loads([x for x in out.splitlines() if x.startswith("RESULT ")][-1][7:])
    assert result["lost"] == [2, 3], result
    survivors = result["survivors"]
    assert sorted(survivors) == ["0", "1"], result
    (params0, steps0, rank0, world0, at0), (params1, steps1, rank1, world1, at1) = (
        survivors["0"], survivors["1"])
    assert (steps0, steps1) == (150, 150) and params0 == params1, result
    assert (rank0, world0, rank1, world1) == (0, 2, 1, 2), result
    resumed = min(at0, at1) - lost_at
    print(f"lost host without a spare, min_ranks=2: first step at world size 2 {resumed:.2f} s "
          "after the loss (host_timeout 3 s)")
    assert resumed <= 3 + 5, result
    assert result["states"] == ["ready", "ready", "lost", "lost"], result
    assert result["group"] == [0, 1] and result["next"] == {"0": "here", "1": "here"}, result
    for ns in (hosts.names[0], a):
        assert pids_in(ns) == [], ns


@pytest.mark.timeout(600)
def test_a_host_given_later_grows_the_group_back_into_the_running_cell(hosts: Hosts,
                                                                     tmp_path: Path) -> None:
    """``min_ranks=2``, no spare host, an elastic cell running on hosts A and
    F: F is lost, ranks 0,1 go on at world size 2; ``mesh.add_hosts(G)``
    while the same cell runs starts ranks 2,3 on G and they join the loop at
    its next commit: the cell finishes at world size 4, every rank with the
    same model (hashed), no rank lost. Then, with no call running, G is lost
    (the group shrinks) and ``mesh.add_hosts(H)`` brings ranks 2,3 back for
    the next call, which runs at world size 4 (tests/engines.py GROW_DRIVER)."""
    a, h = hosts.names[1], hosts.names[8]
    result = run_grow_driver(hosts, tmp_path, ROOT, host=6, add=7, add_idle=8)
    # shrunk while the cell ran: the status said so
    assert "world size now: 2 of 4 (rank 0,1; the group went on without rank 2,3)" in \
        result["shrunk_status"], result["shrunk_status"]
    # grown back into the same cell: every rank finished at world size 4, same model
    assert result["lost"] == [], result
    outs = result["results"]
    assert sorted(outs) == ["0", "1", "2", "3"], result
    assert len({o["hash"] for o in outs.values()}) == 1, outs
    assert len({o["step"] for o in outs.values()}) == 1, outs
    assert [(o["rank"], o["world"]) for o in (outs[str(r)] for r in range(4))] == [
        (r, 4) for r in range(4)], outs
    for r in ("0", "1"):  # the survivors: 4, then 2, then 4 again
        assert [w for w, _ in outs[r]["sizes"]] == [4, 2, 4], outs[r]
    assert [w for w, _ in outs["2"]["sizes"]] == [4], outs["2"]  # the new process: 4 only
    assert result["group"] == [0, 1, 2, 3] and result["torch_ranks"] == [0, 1, 2, 3], result
    kinds = [k for k, _, _ in result["events"]]
    assert kinds[:2] == ["shrunk", "grown"] and kinds.count("rejoined") == 2, result["events"]
    assert result["events"][1][2] == "world size 4: rank 0-3 (rank 2,3 back; whole again)"
    assert "world size now" not in result["grown_status"], result["grown_status"]
    lost_to_small = outs["0"]["sizes"][1][1] - result["lost_at"]
    add_to_full = outs["0"]["sizes"][2][1] - result["add_at"]
    cold = result["ready_idle_at"] - result["add_idle_at"] + result["setup_s"]
    print(f"host lost: first step at world size 2 {lost_to_small:.2f} s later (host_timeout "
          f"3 s); add_hosts: first step at world size 4 {add_to_full:.2f} s later (cold start "
          f"of the added ranks, no call running, to ready and the cell's set-up done: {cold:.2f} s)")
    # with no call running: back for the next call, at world size 4
    assert result["next"] == {str(r): [r, r, 4] for r in range(4)}, result
    assert result["sum"] == {str(r): 4.0 for r in range(4)}, result
    for ns in (hosts.names[0], a, h):  # the mesh stopped: nothing left anywhere
        assert pids_in(ns) == [], ns
