"""Log directories left by a killed controller are swept by the next mesh
(procs/logdirs.py); live owners', other versions' and other users'
directories are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from monarch_nb import Mesh
from monarch_nb.procs import logdirs

from .conftest import wait_for


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _made_by_a_process_that_ended(root: Path) -> Path:
    code = ("import tempfile, sys\ntempfile.tempdir = sys.argv[1]\n"
            "from monarch_nb.procs import logdirs\nprint(logdirs.make())")
    out = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True,
                         text=True, check=True)
    return Path(out.stdout.strip())


def test_a_dead_owners_directory_is_swept_and_the_rest_kept(tmp_path: Path) -> None:
    dead = _made_by_a_process_that_ended(tmp_path)
    (dead / "rank0.0.log").write_text("left behind\n")
    old = tmp_path / "monarch-nb-oldversion"  # no owner file: not ours to judge
    old.mkdir()
    tempfile.tempdir, saved = str(tmp_path), tempfile.tempdir
    try:
        live = Path(logdirs.make())  # this process: alive
    finally:
        tempfile.tempdir = saved
    reused = tmp_path / "monarch-nb-reusedpid"  # this pid, another start time
    reused.mkdir()
    (reused / logdirs.OWNER).write_text(f"{os.getpid()} 12345.000\n")
    assert oct((live / logdirs.OWNER).stat().st_mode & 0o777) == "0o600"
    assert oct(live.stat().st_mode & 0o777) == "0o700"

    removed = logdirs.sweep(str(tmp_path))

    assert sorted(removed) == sorted([str(dead), str(reused)])
    assert not dead.exists() and not reused.exists()
    assert live.is_dir() and old.is_dir()


def test_a_mesh_start_sweeps_what_a_killed_controller_left(tmp_path: Path) -> None:
    # a controller SIGKILLed with its mesh running: its ranks end with it
    # (parent-death signal), its log directory stays
    code = ("import os, sys, tempfile\ntempfile.tempdir = sys.argv[1]\n"
            "from monarch_nb import Mesh\nm = Mesh.start(n=1, backend='cpu', spare=False)\n"
            "pids = [p.pid for p in m._ctl.supervisor.procs.values()]\n"
            "print(m._ctl.supervisor.log_dir, *pids, flush=True)\nos.kill(os.getpid(), 9)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == -9, out.stderr
    folder, *pids = out.stdout.split()
    left = Path(folder)
    assert left.is_dir() and left.parent == tmp_path
    wait_for(lambda: not any(_alive(int(p)) for p in pids),
             timeout=30, what="the killed controller's ranks to end with it")
    tempfile.tempdir, saved = str(tmp_path), tempfile.tempdir
    try:
        mesh = Mesh.start(n=1, backend="cpu", spare=False)
        try:
            assert not left.exists()
            assert Path(mesh._ctl.supervisor.log_dir).is_dir()
        finally:
            mesh.stop()
    finally:
        tempfile.tempdir = saved
