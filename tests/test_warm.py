"""Ranks forked from the host's warm process (issue 40, item 1), with real
processes:

* fidelity: a forked rank is the fresh one (``fork=False``) it stands for:
  threads, environment, working directory, sys.path, signal handlers and
  mask, its own session and process group, the parent-death signal (armed,
  and its parent the controller), open fds and stdio, device pinning; and
  its random seeds are its own; ps and psutil see its environment;
* a killed forked rank comes back forked, as the controller's child; a
  spare forked from the warm process becomes the rank it replaces;
* the controller's death takes its forked ranks (and the warm process) with
  it;
* a preload that fails to import fails ``Mesh.start`` saying what to do;
  a warm process that must not fork (a preloaded module started a thread)
  says why and the ranks start as fresh interpreters;
* the environment variable and the parameters turn it off.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest

import monarch_nb as mnb
from monarch_nb import Mesh
from monarch_nb.config import ENV_FORK, MeshConfig
from monarch_nb.errors import UsageError

from .conftest import wait_for

# Differ between two meshes (or two processes of one rank) by design.
PER_MESH = {"MONARCH_NB_MESH_ID", "MONARCH_NB_KEY", "MONARCH_NB_CONTROLLER", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MONARCH_NB_FLIGHT_FILE",
            "MONARCH_NB_IDENTITY", "MONARCH_NB_LINK_FD", "TORCHELASTIC_RESTART_COUNT",
            "MONARCH_NB_INCARNATION", "MONARCH_NB_GENERATION"}

# Run by source (a pickled function would import this test package in the rank).
SNAPSHOT = """
import ctypes as _ct, os as _os, random as _random, signal as _signal, sys as _sys
import torch as _torch


def _fd_kind(fd):
    try:
        target = _os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    if target.startswith(("socket:", "pipe:", "anon_inode:")):
        return target.split("[")[0].rstrip(":")
    if target == _os.devnull:
        return "devnull"
    return "log" if target.endswith(".log") else "file ." + target.rsplit(".", 1)[-1]


def _threads():
    # A thread just started carries its creator's name until it names itself
    # (gloo's runloops do so first thing): read until four reads 50 ms apart agree.
    import time as _time

    last, same = None, 0
    for _ in range(100):
        names = []
        for t in _os.listdir("/proc/self/task"):
            try:
                names.append(open(f"/proc/self/task/{t}/comm").read().strip())
            except OSError:  # it ended meanwhile
                pass
        names.sort()
        same = same + 1 if names == last else 0
        if same >= 3:
            break
        last = names
        _time.sleep(0.05)
    return names


def _handler(sig):
    h = _signal.getsignal(sig)
    return getattr(h, "__qualname__", None) or str(int(h) if h is not None else None)


_pdeath = _ct.c_int(-1)
_ct.CDLL(None).prctl(2, _ct.byref(_pdeath), 0, 0, 0)  # PR_GET_PDEATHSIG
_fds = sorted(int(x) for x in _os.listdir("/proc/self/fd"))
snapshot = {
    "torch_threads": _torch.get_num_threads(),
    "interop": _torch.get_num_interop_threads(),
    "threads": _threads(),
    "env": dict(_os.environ),
    "cwd": _os.getcwd(),
    "sys.path": list(_sys.path),
    "main": getattr(_sys.modules["__main__"], "__file__", None),
    "cuda_initialized": _torch.cuda.is_initialized(),
    "pid": _os.getpid(),
    "ppid": _os.getppid(),
    "session_leader": _os.getsid(0) == _os.getpid(),
    "group_leader": _os.getpgid(0) == _os.getpid(),
    "pdeathsig": _pdeath.value,
    "handlers": {int(s): _handler(s) for s in _signal.valid_signals()
                 if s not in (_signal.SIGKILL, _signal.SIGSTOP)},
    "mask": sorted(int(s) for s in _signal.pthread_sigmask(_signal.SIG_BLOCK, [])),
    "fds": sorted(k for k in map(_fd_kind, _fds) if k is not None),
    "stdio": [_fd_kind(0), _fd_kind(1), _fd_kind(2)],
    "random": _random.random(),
    "umask": _os.umask(0o022),
}
_os.umask(snapshot["umask"])
"""


def _snapshots(mesh: Mesh) -> dict[int, dict[str, Any]]:
    mesh.exec(SNAPSHOT)
    snaps: dict[int, dict[str, Any]] = dict(mesh.pull("snapshot"))
    for snap in snaps.values():
        snap["env"] = {k: v for k, v in snap["env"].items() if k not in PER_MESH}
    return snaps


def _all_reduce_sum() -> float:
    import torch
    import torch.distributed as dist

    x = torch.ones(1) * (mnb.rank() + 1)
    dist.all_reduce(x)
    return float(x.item())


@pytest.mark.timeout(240)
def test_a_forked_rank_is_the_fresh_rank_it_stands_for() -> None:
    with Mesh.start(n=2, backend="cpu", fork=False) as fresh_mesh:
        assert not any(p.forked for p in fresh_mesh._ctl.supervisor.procs.values())
        fresh = _snapshots(fresh_mesh)
        fresh_seen = {r: {k for k in psutil.Process(s["pid"]).environ() if k not in PER_MESH}
                      for r, s in fresh.items()}
    with Mesh.start(n=2, backend="cpu") as mesh:
        sup = mesh._ctl.supervisor
        assert sup.warm is not None and all(p.forked for p in sup.procs.values())
        forked = _snapshots(mesh)
        for rank in (0, 1):
            a, b = fresh[rank], forked[rank]
            for name in ("torch_threads", "interop", "threads", "cwd", "sys.path", "main",
                         "cuda_initialized", "session_leader", "group_leader", "pdeathsig",
                         "handlers", "mask", "fds", "stdio", "umask"):
                assert a[name] == b[name], (rank, name, a[name], b[name])
            missing = {k: v for k, v in a["env"].items() if b["env"].get(k) != v}
            extra = {k: v for k, v in b["env"].items() if k not in a["env"]}
            assert not missing and not extra, (rank, missing, extra)
            # its parent is the controller (whose death is its signal), armed
            assert b["ppid"] == os.getpid() and b["pdeathsig"] == int(signal.SIGKILL)
            assert b["session_leader"] and b["stdio"] == ["devnull", "log", "log"]
            assert psutil.Process(b["pid"]).ppid() == os.getpid()
            # what ps and psutil read (/proc/<pid>/environ): the rank's, as a fresh one's
            seen = {k: v for k, v in psutil.Process(b["pid"]).environ().items()
                    if k not in PER_MESH}
            assert seen.get("RANK") == str(rank) and "MONARCH_NB_WARM" not in seen
            assert set(seen) == set(fresh_seen[rank]), set(seen) ^ set(fresh_seen[rank])
        # each rank drew its own seeds, not the warm process's
        assert forked[0]["random"] != forked[1]["random"]
        # the pid the supervisor holds is the rank's own
        assert {r: p.pid for r, p in sup.procs.items()} == {r: s["pid"] for r, s in forked.items()}
        assert mesh.run(_all_reduce_sum) == dict.fromkeys(range(2), 3.0)


@pytest.mark.timeout(180)
def test_a_killed_forked_rank_comes_back_forked() -> None:
    with Mesh.start(n=2, backend="cpu") as mesh:
        sup = mesh._ctl.supervisor
        old = sup.procs[1].pid
        mesh.kill(1)
        wait_for(lambda: sup.procs[1].incarnation == 1 and sup.procs[1].popen.poll() is None
                 and mesh.status()[1]["state"] in ("ready", "busy"), timeout=60,
                 what="rank 1 respawned")
        proc = sup.procs[1]
        assert proc.forked and proc.pid != old
        assert psutil.Process(proc.pid).ppid() == os.getpid()
        assert sup.history[1].popen.poll() == -signal.SIGKILL  # reaped by us: its status is known
        assert mesh.run(_all_reduce_sum) == dict.fromkeys(range(2), 3.0)
        assert mesh.run(lambda: os.getppid()).values_list() == [os.getpid()] * 2
        # a SIGTERM the supervisor sends reaches the rank itself
        mesh.kill(0, signal="TERM")
        wait_for(lambda: sup.procs[0].incarnation == 1
                 and mesh.status()[0]["state"] in ("ready", "busy"), timeout=60,
                 what="rank 0 respawned after SIGTERM")
        assert sup.history[0].popen.poll() is not None


@pytest.mark.timeout(180)
def test_a_forked_spare_becomes_the_rank_it_replaces() -> None:
    with Mesh.start(n=2, backend="cpu") as mesh:
        sup = mesh._ctl.supervisor
        wait_for(sup.spare_ready, timeout=60, what="a spare forked from the warm process")
        assert sup.spare is not None and sup.spare_link is not None
        spare_pid = sup.spare.pid
        assert psutil.Process(spare_pid).ppid() == os.getpid()
        before = _snapshots(mesh)[1]
        mesh.kill(1)
        wait_for(lambda: sup.procs[1].incarnation == 1 and sup.procs[1].popen.poll() is None
                 and mesh.status()[1]["state"] in ("ready", "busy"), timeout=60,
                 what="rank 1 respawned")
        proc = sup.procs[1]
        assert proc.from_spare and proc.forked and proc.pid == spare_pid
        after = _snapshots(mesh)[1]
        for name in ("torch_threads", "interop", "threads", "cwd", "sys.path", "main",
                     "session_leader", "group_leader", "pdeathsig", "handlers", "mask", "fds",
                     "stdio", "ppid"):
            assert after[name] == before[name], (name, before[name], after[name])
        assert after["env"] == before["env"]
        assert mesh.run(_all_reduce_sum) == dict.fromkeys(range(2), 3.0)


CONTROLLER = textwrap.dedent("""
    import os, sys, time
    from monarch_nb import Mesh
    mesh = Mesh.start(n=2, backend="cpu")
    sup = mesh._ctl.supervisor
    print("PIDS", sup.warm.pid, *[p.pid for p in sup.procs.values()], flush=True)
    time.sleep(600)
""")


@pytest.mark.timeout(180)
def test_the_controllers_death_takes_its_forked_ranks_and_warm_process() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    ctl = subprocess.Popen([sys.executable, "-c", CONTROLLER], env=env, stdout=subprocess.PIPE,
                           text=True)
    try:
        assert ctl.stdout is not None
        line = ctl.stdout.readline()
        assert line.startswith("PIDS"), line
        pids = [int(p) for p in line.split()[1:]]
        assert all(psutil.pid_exists(p) for p in pids)
        ctl.kill()
        ctl.wait(30)

        def gone() -> bool:
            for pid in pids:
                try:
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        return False
                except psutil.NoSuchProcess:
                    pass
            return True

        wait_for(gone, timeout=30, what="the ranks and the warm process to die with the controller")
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait(30)


def test_a_preload_that_fails_says_what_to_do() -> None:
    with pytest.raises(UsageError, match=r"preload 'no_such_module_x' failed.*leave it out"):
        Mesh.start(n=1, backend="cpu", preload=["no_such_module_x"])
    with pytest.raises(UsageError, match="not a module name"):
        MeshConfig(preload=("transformers", "not a module"))


@pytest.mark.timeout(180)
def test_a_warm_process_that_must_not_fork_refuses_and_ranks_start_fresh(tmp_path: Path,
                                                                         monkeypatch: Any) -> None:
    (tmp_path / "threaded_mod.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with Mesh.start(n=2, backend="cpu", preload="threaded_mod") as mesh:
        sup = mesh._ctl.supervisor
        assert "threads" in sup.fork_off and sup.warm is None, sup.fork_off
        assert not any(p.forked for p in sup.procs.values())
        assert mesh.run(_all_reduce_sum) == dict.fromkeys(range(2), 3.0)


@pytest.mark.timeout(180)
def test_a_preloaded_module_is_imported_in_every_rank() -> None:
    with Mesh.start(n=2, backend="cpu", preload=["json.tool", "csv"]) as mesh:
        assert mesh.run(lambda: "json.tool" in sys.modules and "csv" in sys.modules
                        ).values_list() == [True, True]


def test_fork_is_on_by_default_and_the_environment_turns_it_off(monkeypatch: Any) -> None:
    monkeypatch.delenv(ENV_FORK, raising=False)
    assert MeshConfig().fork is True
    monkeypatch.setenv(ENV_FORK, "0")
    assert MeshConfig().fork is False
    assert MeshConfig(fork=True).fork is True
    with pytest.raises(UsageError, match="fork must be True or False"):
        MeshConfig(fork="yes")  # type: ignore[arg-type]
