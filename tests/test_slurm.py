"""``--launcher slurm`` on a real SLURM cluster: munged, slurmctld and two
slurmd daemons (nodes n1, n2 on this machine) started by the fixture
(tests/engines.py); the launch runs inside ``salloc`` like a user's would.
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
    with slurm_cluster(nodes=2) as c:
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
