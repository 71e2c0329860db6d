"""``--launcher slurm`` on a real SLURM cluster: munged, slurmctld and three
slurmd daemons (nodes n1, n2, n3 on this machine) started by the fixture
(tests/engines.py); the launch runs inside ``salloc`` like a user's would.
One job step per node (its host agent), never one per rank; a node taken
down is replaced by the allocation's spare node.
"""

from __future__ import annotations

import os
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
