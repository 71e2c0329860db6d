"""``--launcher slurm`` on a real SLURM cluster: munged, slurmctld and three
slurmd daemons (nodes n1, n2, n3 on this machine) started by the fixture
(tests/engines.py); the launch runs inside ``salloc`` like a user's would.
One job step per node (its host agent), never one per rank; a node taken
down is replaced by the allocation's spare node; with no spare node, an
elastic loop shrinks, and grows back when the node returns.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from .engines import Slurm, slurm_cluster

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Slurm]:
    with slurm_cluster(nodes=3) as c:
        yield c


def salloc_launch(cluster: Slurm, tmp_path: Path, body: str,
                  *options: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    env = dict(cluster.env)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = ["salloc", "-N2", "-n2", sys.executable, "-m", "monarch_nb.launch",
           "--launcher", "slurm", "--backend", "cpu", "--nodes", "2", "--gpus-per-node", "1",
           *options, str(script)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150,
                          cwd=tmp_path)


SCRIPT = """
    import os, time, torch, torch.distributed as dist
    import monarch_nb as mnb
    from monarch_nb import chaos
    dist.init_process_group("gloo")
    for step in range(10):
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(0.05)
        if KILL:
            chaos.die_at(step, 3, rank=1)
    print("rank", os.environ["RANK"], "local", os.environ["LOCAL_RANK"],
          "node", os.environ["SLURMD_NODENAME"], "job", os.environ["SLURM_JOB_ID"],
          "incarnation", mnb.incarnation(), "sum", t.item())
"""


def test_launch_spans_the_allocation_nodes(cluster: Slurm, tmp_path: Path) -> None:
    res = salloc_launch(cluster, tmp_path, "KILL = False\n" + textwrap.dedent(SCRIPT))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[0] rank 0 local 0 node n1" in res.stdout, res.stdout
    assert "[1] rank 1 local 0 node n2" in res.stdout, res.stdout
    assert "sum 2.0" in res.stdout and "slurm launcher" in res.stderr
    assert "all 2 rank(s) finished" in res.stderr


def test_rank_killed_on_a_slurm_node_is_respawned_there(cluster: Slurm, tmp_path: Path) -> None:
    res = salloc_launch(cluster, tmp_path, "KILL = True\n" + textwrap.dedent(SCRIPT),
                        "--respawn", "rank")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rank 1 died" in res.stderr
    assert "[1] rank 1 local 0 node n2" in res.stdout and "incarnation 1 sum 2.0" in res.stdout


def test_slurm_launcher_outside_an_allocation_is_a_usage_error(cluster: Slurm,
                                                                tmp_path: Path) -> None:
    script = tmp_path / "x.py"
    script.write_text("pass\n")
    env = {k: v for k, v in cluster.env.items() if not k.startswith("SLURM_JOB")}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, "-m", "monarch_nb.launch", "--launcher", "slurm",
                          str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "inside a SLURM allocation" in res.stderr


KILL_DRIVER = """
    import os, time
    import monarch_nb as mnb
    from monarch_nb import Mesh
    with Mesh.start(n=2, backend="cpu", launcher="slurm", nodes=2, gpus_per_node=1) as mesh:
        pids = mesh.run(os.getpid)
        mesh.kill(1)                        # SIGKILL to rank 1's srun: seen at once
        print("state", mesh.status()[1]["state"])
        print("after", mesh.run(lambda: (mnb.rank(), mnb.incarnation()), timeout=90))
        print("pids", pids[0], pids[1])
"""


def test_mesh_kill_of_a_slurm_rank_respawns_it_and_leaves_nothing(cluster: Slurm,
                                                                   tmp_path: Path) -> None:
    import psutil

    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(KILL_DRIVER))
    env = dict(cluster.env)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(["salloc", "-N2", "-n2", sys.executable, str(driver)], env=env,
                         capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "state respawning" in res.stdout or "state dead" in res.stdout, res.stdout
    assert "after RankResults({0: (0, 0), 1: (1, 1)})" in res.stdout, res.stdout
    pids = [int(p) for p in res.stdout.split("pids ")[1].split()]
    alive = [p for p in pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"ranks outlived their mesh: {alive}"


NODE_DOWN_DRIVER = """
    import os, subprocess, time
    import psutil
    import monarch_nb as mnb
    from monarch_nb import Mesh

    job = os.environ["SLURM_JOB_ID"]

    def steps():
        out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"],
                             capture_output=True, text=True).stdout.split()
        return sorted(s for s in out if not s.endswith((".extern", ".interactive")))

    def node():
        return (mnb.rank(), mnb.incarnation(), os.environ["SLURMD_NODENAME"])

    # 3 nodes allocated, 2 placed: n3 is the spare host
    with Mesh.start(n=2, backend="cpu", launcher="slurm", nodes=2, gpus_per_node=1,
                    host_timeout=5, start_timeout=120) as mesh:
        print("placed", mesh.run(node))
        before = steps()
        mesh.kill(1)                       # a rank killed: its agent respawns it, no new step
        print("killed", mesh.run(node, timeout=90))
        print("steps", len(before), len(steps()), before == steps())
        # node n2 goes down: marked down, and everything it ran killed
        inc = mesh.status()[1]["incarnation"]
        subprocess.run(["scontrol", "update", "nodename=n2", "state=down", "reason=test"],
                       check=True)
        for p in psutil.process_iter():
            try:
                if (p.environ().get("SLURMD_NODENAME") == "n2"
                        and any("monarch_nb" in a for a in p.cmdline())):
                    p.kill()
            except psutil.Error:
                pass
        # back once a new process of rank 1 is ready (right after the kill the
        # old one may still read "ready": its death is not seen yet)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
                mesh.status()[1]["incarnation"] > inc and mesh.status()[1]["state"] == "ready"):
            time.sleep(0.2)
        print("moved", mesh.run(node, timeout=90))
        print("events", [e["detail"] for e in mesh.events if e["rank"] == 1 and e["kind"] == "died"])
"""


def test_a_node_taken_down_is_replaced_by_the_allocations_spare_node(cluster: Slurm,
                                                                       tmp_path: Path) -> None:
    """Three nodes allocated (``--no-kill``: a failed node must not end the
    job), two placed. A rank killed is respawned by its node's agent
    without a new job step; node n2 set down and its processes killed: its
    rank comes back on n3, the spare node, with its rank number."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(NODE_DOWN_DRIVER))
    env = dict(cluster.env)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    try:
        res = subprocess.run(["salloc", "-N3", "-n3", "--no-kill", sys.executable, str(driver)],
                             env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    finally:
        subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"], env=env,
                       capture_output=True, check=False)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "placed RankResults({0: (0, 0, 'n1'), 1: (1, 0, 'n2')})" in out, out
    assert "killed RankResults({0: (0, 0, 'n1'), 1: (1, 1, 'n2')})" in out, out
    assert "steps 2 2 True" in out, out  # one step per node, the respawn made none
    assert "moved RankResults({0: (0, 0, 'n1'), 1: (1, 2, 'n3')})" in out, out
    assert "host n2 lost" in out.split("events ")[1], out


SHRINK_GROW_DRIVER = '''
    import json, os, subprocess, time
    import psutil
    import monarch_nb as mnb
    from monarch_nb import Mesh, UsageError

    job = os.environ["SLURM_JOB_ID"]
    TRAIN = """
    import hashlib, os, time, torch, torch.distributed as dist, monarch_nb as mnb
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = mnb.elastic.State(model=model, optimizer=opt, step=0, small=0, after=0)
    sizes = []  # (world size, wall time of its first step), each time it changes

    @mnb.elastic.run(state)
    def train(state):
        while state.after < 10 and state.step < 100000:
            opt.zero_grad()
            model(torch.ones(8, 4) * (mnb.rank() + 1)).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            world = dist.get_world_size()
            state.step += 1
            if world < 2:
                state.small += 1
            elif state.small:
                state.after += 1
            state.commit()
            if not sizes or sizes[-1][0] != world:
                sizes.append((world, time.time()))
            mnb.log(step=state.step, world=world, small=state.small)
            time.sleep(0.05)
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                         for p in model.parameters())).hexdigest()
        return {"hash": digest, "world": mnb.world_size(), "sizes": sizes,
                "node": os.environ["SLURMD_NODENAME"], "job": os.environ["SLURM_JOB_ID"]}

    train()
    """

    def jobs():
        out = subprocess.run(["squeue", "-h", "-o", "%i %j %N"], capture_output=True,
                             text=True).stdout
        return sorted(line for line in out.splitlines() if line.strip())

    def steps():
        out = subprocess.run(["squeue", "-h", "-s", "-o", "%i"], capture_output=True,
                             text=True).stdout.split()
        return sorted(s for s in out if not s.endswith((".extern", ".interactive")))

    def until(cond, what, timeout=180):
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {json.dumps(out, default=str)} "
                                   f"{json.dumps(mesh.status(), default=str)}")
            time.sleep(0.1)

    out = {}
    mesh = Mesh.start(n=2, backend="cpu", launcher="slurm", nodes=2, gpus_per_node=1,
                      host_timeout=3, start_timeout=120, min_ranks=1)
    try:
        future = mesh.exec(TRAIN, elastic=True, block=False)
        until(lambda: min(r["step"] or 0 for r in mesh.status()) >= 5, "the loop to run")
        # node n2 goes down, no spare node: marked down, everything it ran killed
        out["lost_at"] = time.time()
        subprocess.run(["scontrol", "update", "nodename=n2", "state=down", "reason=test"],
                       check=True)
        for p in psutil.process_iter():
            try:
                if (p.environ().get("SLURMD_NODENAME") == "n2"
                        and any("monarch_nb" in a for a in p.cmdline())):
                    p.kill()
            except psutil.Error:
                pass
        until(lambda: mesh.group == (0,), "the group to shrink")
        until(lambda: (mesh.metrics.last(0).get("small") or 0) >= 5, "5 steps at world size 1")
        out["shrunk_world"] = mesh.metrics.last(0).get("world")
        out["lost"] = [(r["state"], r["lost_host"]) for r in mesh.status()]
        out["running"] = not future.done()
        try:
            mesh.add_hosts("n9")
        except UsageError as exc:
            out["n9"] = str(exc)
        # the node back: resumed until SLURM has it idle (it may be already:
        # ReturnToService=2; a resume while its failed step is cleaned up is refused)
        def back():
            subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"],
                           capture_output=True)
            state = subprocess.run(["sinfo", "-h", "-n", "n2", "-o", "%t"],
                                   capture_output=True, text=True).stdout.strip()
            out["n2_states"] = sorted(set(out.get("n2_states", [])) | {state})
            if state != "idle":  # what holds it, should it never be idle
                out["n2_node"] = subprocess.run(["scontrol", "show", "node", "-o", "n2"],
                                                capture_output=True, text=True).stdout
                out["n2_jobs"] = jobs()
            return state == "idle"
        until(back, "n2 idle")
        out["add_at"] = time.time()
        mesh.add_hosts(["n2"])
        until(lambda: mesh.status()[1]["state"] == "ready", "rank 1 back", timeout=240)
        out["jobs_grown"] = jobs()
        got = future.result(timeout=300)
        out["results"] = dict(got.items())
        out["group"] = list(mesh.group)
        out["events"] = [(e["kind"], e["rank"], e["detail"]) for e in mesh.events
                         if e["kind"] in ("shrunk", "grown", "rejoined")]
    finally:
        mesh.stop()
    # nothing left: no job step in the allocation, the n2 job ended, no process
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (steps() or len(jobs()) > 1):
        time.sleep(0.2)
    out["steps_after"] = steps()
    out["jobs_after"] = jobs()
    out["procs_after"] = [p.pid for p in psutil.process_iter()
                          if p.pid != os.getpid() and _mnb(p)]
    print("RESULT " + json.dumps(out, default=str), flush=True)
'''

MNB_PROC = '''
    def _mnb(p):
        try:
            return (p.environ().get("SLURM_CONF") == os.environ["SLURM_CONF"]
                    and any("monarch_nb" in a for a in p.cmdline()))
        except Exception:
            return False
'''


@pytest.mark.timeout(420)
def test_a_node_down_with_no_spare_shrinks_the_elastic_loop_and_its_return_grows_it_back(
        cluster: Slurm, tmp_path: Path) -> None:
    """Two nodes allocated (``--no-kill``), both placed: no spare node.
    ``min_ranks=1``, an elastic training loop running. Node n2 set down and
    its processes killed: the loop carries on at world size 1. The node
    back (SLURM took it out of the job: it returns in a one-node job of
    its own) and given with ``mesh.add_hosts``: rank 1 starts there and the
    same loop grows back to world size 2, one model on both ranks."""
    import json

    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(MNB_PROC) + textwrap.dedent(SHRINK_GROW_DRIVER))
    env = dict(cluster.env)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(["salloc", "-N2", "-n2", "--no-kill", sys.executable, str(driver)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=360)
    finally:
        if proc.poll() is None:  # salloc and the driver under it: none outlives the test
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"], env=env,
                       capture_output=True, check=False)
    assert proc.returncode == 0 and "RESULT " in stdout, stdout + stderr
    out = json.loads(stdout.split("RESULT ", 1)[1])
    context = json.dumps(out, indent=1) + stderr[-3000:]
    # shrink: the loop went on at world size 1, rank 1 lost with n2
    assert out["running"] and out["shrunk_world"] == 1, context
    assert out["lost"][1][1] == "n2", context
    assert "'n9' is not a node of this SLURM cluster" in out["n9"], context
    # grow: rank 1 back on n2, in a one-node job of its own, the same loop at world size 2
    assert any(line.endswith("monarch-nb-n2 n2") for line in out["jobs_grown"]), context
    results = out["results"]
    assert set(results) == {"0", "1"} and out["group"] == [0, 1], context
    sizes = results["0"]["sizes"]
    assert [w for w, _ in sizes] == [2, 1, 2] and results["0"]["world"] == 2, context
    assert results["1"]["node"] == "n2", context
    assert [w for w, _ in results["1"]["sizes"]] == [2], context
    assert results["1"]["job"] != results["0"]["job"], context
    assert results["0"]["hash"] == results["1"]["hash"], context
    kinds = [e[0] for e in out["events"]]
    assert "shrunk" in kinds and "grown" in kinds, context
    assert "rejoined" in kinds, context
    # nothing left: no step, the node's job ended with the mesh, no process
    assert out["steps_after"] == [] and len(out["jobs_after"]) == 1, context
    assert out["procs_after"] == [], context
    print(f"n2 down to the first step at world size 1: {sizes[1][1] - out['lost_at']:.2f} s; "
          f"add_hosts(n2) to the first step at world size 2: {sizes[2][1] - out['add_at']:.2f} s")
