"""Script mode's restarts are torchrun's: when a rank dies, every rank that
runs the script again does so in a new process, with the new
``TORCHELASTIC_RESTART_COUNT``; nothing of the earlier run lingers (a
DataLoader's persistent workers stay 2 per rank, not 4). A script using
``mnb.elastic`` carries on in place instead (tests/test_launch.py); losing
ranks for good with ``--min-ranks`` restarts a plain script at the smaller
``WORLD_SIZE``. Real launches of scripts written as for torchrun (no
monarch_nb import); the hosts' case is tests/test_launch_hosts.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A torchrun elastic DDP script as users write it: the restart count decides
# whether to load a checkpoint; rank 1 is SIGKILLed in epoch 1 of the first run.
DDP = """
    import os, signal, sys, time
    import psutil, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    def main():
        dist.init_process_group("gloo")
        restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        rank, world = dist.get_rank(), dist.get_world_size()
        assert (rank, world) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        print(f"start rank {rank} world {world} restart {restart} pid {os.getpid()}", flush=True)
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data),
                            num_workers=2, persistent_workers=True)
        for epoch in range(3):
            for x, y in loader:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            kids = len(psutil.Process().children())
            print(f"epoch {epoch} rank {rank} restart {restart} children {kids}", flush=True)
            if restart == 0 and rank == int(sys.argv[1]) and epoch == 1:
                time.sleep(0.3)  # the peers are in epoch 2's collectives
                os.kill(os.getpid(), signal.SIGKILL)
        print(f"done rank {rank} world {world} restart {restart}", flush=True)
        dist.destroy_process_group()

    main()
"""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def launch(tmp_path: Path, body: str, *flags: str,
           args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, "-m", "monarch_nb.launch", "--backend", "cpu", *flags,
                           str(script), *args], capture_output=True, text=True, timeout=240,
                          env=_env(), cwd=tmp_path)


def starts(out: str) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, restart) -> (world size, pid) of each run's start line."""
    found = re.findall(r"start rank (\d+) world (\d+) restart (\d+) pid (\d+)", out)
    return {(int(r), int(c)): (int(w), int(p)) for r, w, c, p in found}


def test_a_dead_ranks_restart_restarts_every_rank_in_a_new_process(tmp_path: Path) -> None:
    res = launch(tmp_path, DDP, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
                 args=("1",))
    out = res.stdout
    assert res.returncode == 0, res.stderr[-3000:]
    runs = starts(out)
    # both ranks ran twice, the second time in a new process with restart count 1
    assert set(runs) == {(0, 0), (1, 0), (0, 1), (1, 1)}, out
    for rank in (0, 1):
        assert runs[(rank, 1)][1] != runs[(rank, 0)][1], out  # a new pid
        assert runs[(rank, 1)][0] == 2
        assert f"done rank {rank} world 2 restart 1" in out
    # nothing of the first run lingers: 2 DataLoader workers per rank, never 4
    kids = re.findall(r"epoch \d rank \d restart (\d) children (\d+)", out)
    assert ("1", "2") in kids and all(n == "2" for _, n in kids), kids
    assert "rank 1 died: killed by SIGKILL" in res.stderr
    assert ("rank 0 replaced: restarted in a new process with the group (rank 1 died)"
            in res.stderr), res.stderr[-3000:]
    assert "rank 0 runs the script again in a new process" in res.stderr
    assert "all 2 rank(s) finished" in res.stderr


def test_a_rank_gone_for_good_restarts_the_others_at_the_smaller_world_size(
        tmp_path: Path) -> None:
    """--min-ranks 1 and --max-restarts 0 (torchrun's default): rank 1's death
    is for good, the group goes on without it, and rank 0 runs the script
    again in a new process with WORLD_SIZE=1, as torchrun restarts its
    workers when a node left."""
    res = launch(tmp_path, DDP, "--standalone", "--nproc-per-node", "2", "--min-ranks", "1",
                 args=("1",))
    out = res.stdout
    assert res.returncode == 0, res.stderr[-3000:]
    runs = starts(out)
    assert set(runs) == {(0, 0), (1, 0), (0, 1)}, out
    assert runs[(0, 1)][0] == 1 and runs[(0, 1)][1] != runs[(0, 0)][1]
    assert "done rank 0 world 1 restart 1" in out
    assert ("rank 0 replaced: restarted in a new process with the group (the group goes on "
            "without rank 1)" in res.stderr), res.stderr[-3000:]
    assert "all 1 rank(s) of the group finished, at world size 1 of 2; rank 1 lost" in res.stderr


def test_below_min_ranks_the_run_ends_naming_the_cause(tmp_path: Path) -> None:
    res = launch(tmp_path, DDP, "--standalone", "--nproc-per-node", "2", "--min-ranks", "2",
                 args=("1",))
    assert res.returncode == 1, res.stderr[-3000:]  # torchrun's: no rank's own status
    assert "rank 1 died (SIGKILL); not respawned: --max-restarts 0" in res.stderr
    assert "the group cannot go on: 1 rank(s) left, fewer than --min-ranks 2" in res.stderr
    assert "restart 1" not in res.stdout  # nothing ran again
