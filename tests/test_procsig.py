"""A respawned rank is the rank it replaces, and a dead rank's process tree
goes with it (issue 28, items 1 and 2), with real ranks:

* a rank made from the spare has the fresh rank's torch threads, interop
  threads, environment, working directory, sys.path and device pinning;
* a rank SIGKILLed while its DataLoader workers run takes them with it at
  once (a ``sleep`` child too, which would never notice), and the mesh
  all_reduces again.
"""

from __future__ import annotations

from typing import Any

import psutil
import pytest

import monarch_nb as mnb
from monarch_nb import Mesh

from .conftest import wait_for

# Differ between two incarnations of one rank by design.
PER_INCARNATION = {"TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE",
                   "MONARCH_NB_INCARNATION", "MONARCH_NB_IDENTITY", "MONARCH_NB_LINK_FD",
                   "MONARCH_NB_GENERATION", "MONARCH_NB_FLIGHT_FILE",
                   "MASTER_PORT"}  # the re-formed group's store: every rank's changes


SNAPSHOT = """
import os as _os, sys as _sys, torch as _torch
snapshot = {
    "threads": _torch.get_num_threads(),
    "interop": _torch.get_num_interop_threads(),
    "env": dict(_os.environ),
    "cwd": _os.getcwd(),
    "sys.path": list(_sys.path),
    "cuda_initialized": _torch.cuda.is_initialized(),
    "pid": _os.getpid(),
}
"""


def _snapshot(mesh: Mesh, rank: int) -> dict[str, Any]:
    """Taken by source (a pickled function would import this test package in
    the rank, and its conftest sets variables)."""
    mesh.exec(SNAPSHOT)
    snap: dict[str, Any] = mesh.pull("snapshot")[rank]
    snap["env"] = {k: v for k, v in snap["env"].items() if k not in PER_INCARNATION}
    return snap


def _all_reduce_sum() -> float:
    import torch
    import torch.distributed as dist

    x = torch.ones(1) * (mnb.rank() + 1)
    dist.all_reduce(x)
    return float(x.item())


@pytest.mark.timeout(120)
def test_a_rank_made_from_the_spare_is_the_rank_it_replaces() -> None:
    with Mesh.start(n=2, backend="cpu", fork=False) as mesh:  # a spare process: fresh interpreters only
        sup = mesh._ctl.supervisor
        wait_for(sup.spare_ready, timeout=60, what="a spare with torch imported")
        before = _snapshot(mesh, 1)
        mesh.kill(1)
        wait_for(lambda: sup.procs[1].incarnation == 1 and sup.procs[1].popen.poll() is None
                 and mesh.status()[1]["state"] in ("ready", "busy"), timeout=60,
                 what="rank 1 respawned")
        assert sup.procs[1].from_spare, "the respawn did not use the spare"
        after = _snapshot(mesh, 1)
        assert after["pid"] != before["pid"]
        for field in ("threads", "interop", "cwd", "sys.path", "cuda_initialized"):
            assert after[field] == before[field], (field, before[field], after[field])
        missing = {k: v for k, v in before["env"].items() if after["env"].get(k) != v}
        extra = {k: v for k, v in after["env"].items() if k not in before["env"]}
        assert not missing and not extra, (missing, extra)
        assert mesh.run(_all_reduce_sum) == dict.fromkeys(range(2), 3.0)


DATALOADER = """
import os, psutil, torch
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.arange(10_000.0)), batch_size=4, num_workers=2,
                    persistent_workers=True)
batches = iter(loader)
next(batches)
worker_pids = [p.pid for p in psutil.Process().children()]
import subprocess
sleeper = subprocess.Popen(["sleep", "600"])  # never checks its parent
sleeper_pid = sleeper.pid
"""


@pytest.mark.timeout(120)
def test_a_killed_ranks_dataloader_workers_go_with_it() -> None:
    with Mesh.start(n=2, backend="cpu") as mesh:
        mesh.exec(DATALOADER)
        pids = mesh.pull("worker_pids")[1]
        assert len(pids) == 2, pids
        pids.append(mesh.pull("sleeper_pid")[1])
        assert all(psutil.pid_exists(p) for p in pids)

        def gone() -> bool:
            for pid in pids:
                try:
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        return False
                except psutil.NoSuchProcess:
                    pass
            return True

        mesh.kill(1)
        wait_for(gone, timeout=30, what="rank 1's DataLoader workers and child to go with it")
        assert mesh.run(_all_reduce_sum) == dict.fromkeys(range(2), 3.0)

