"""Signals sent to the launcher reach the ranks (issue 28.3), for real.

``python -m monarch_nb.launch`` runs a script whose SIGTERM / SIGUSR1 handler
writes a checkpoint file, as code written for SLURM or Kubernetes preemption
does; the test signals the launcher as a batch system would and checks that
every rank's handler ran, the exit status (143 for SIGTERM) and that no rank
outlives the launcher. The option parsing is tested without processes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from monarch_nb.errors import UsageError
from monarch_nb.launchopts import Plan, build_parser, parse, plan

from .conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]

CHECKPOINTER = """\
import os, signal, time
rank = os.environ["RANK"]
stop = False

def on_signal(signum, frame):
    global stop
    name = signal.Signals(signum).name
    with open(f"ckpt{rank}.{name}", "w") as f:  # the checkpoint
        f.write(str(os.getpid()))
    stop = stop or signum == signal.SIGTERM

signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGUSR1, on_signal)
print("pid", os.getpid(), flush=True)
while not stop:
    time.sleep(0.02)
print("checkpoint saved", flush=True)
"""

NO_HANDLER = """\
import os, time
print("pid", os.getpid(), flush=True)
time.sleep(600)
"""


def _start(tmp_path: Path, body: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    (tmp_path / "script.py").write_text(textwrap.dedent(body))
    out = tmp_path / "out.txt"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "monarch_nb.launch", "--backend", "cpu", "-n", "2", *args,
             "script.py"], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    return proc, out


def _rank_pids(out: Path) -> list[int]:
    """Each rank's pid, in rank order ("[1] pid 13425": the ranks print in
    whatever order they get there)."""
    text = str(wait_for(lambda: out.read_text().count("] pid ") >= 2 and out.read_text(),
                        timeout=60, what="both ranks running the script"))
    found = dict(_PID_LINE.findall(text))
    return [int(found[str(r)]) for r in range(len(found))]


_PID_LINE = re.compile(r"^\[(\d+)\] pid (\d+)$", re.M)


def _gone(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_sigterm_runs_every_ranks_handler_and_exits_143(tmp_path: Path) -> None:
    proc, out = _start(tmp_path, CHECKPOINTER, "--shutdown-timeout", "60")
    try:
        pids = _rank_pids(out)
        # SLURM's --signal USR1@60: passed on, the run goes on
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: all((tmp_path / f"ckpt{r}.SIGUSR1").exists() for r in (0, 1)),
                 timeout=20, what="both ranks' SIGUSR1 handlers")
        assert proc.poll() is None, out.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, out.read_text()
    finally:
        _stop(proc)
    text = out.read_text()
    for r, pid in enumerate(pids):
        assert (tmp_path / f"ckpt{r}.SIGTERM").read_text() == str(pid)  # the rank's own handler
    assert text.count("checkpoint saved") == 2, text
    assert "SIGTERM: passed on to every rank" in text
    assert "stopped by SIGTERM: 2 of 2 rank(s) finished" in text
    assert "KeyboardInterrupt" not in text
    wait_for(lambda: not _gone(pids), timeout=10, what="the ranks to be gone")


def test_sigterm_without_a_handler_ends_the_ranks_and_none_is_respawned(tmp_path: Path) -> None:
    proc, out = _start(tmp_path, NO_HANDLER)
    try:
        pids = _rank_pids(out)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, out.read_text()
    finally:
        _stop(proc)
    text = out.read_text()
    assert "ended by it" in text and "SIGTERM" in text, text
    assert "respawn" not in text.split("passed on to every rank", 1)[1], text
    wait_for(lambda: not _gone(pids), timeout=10, what="the ranks to be gone")


def test_a_second_sigterm_stops_at_once(tmp_path: Path) -> None:
    body = "import signal, os, time\nsignal.signal(signal.SIGTERM, lambda *a: None)\n" \
           "print('pid', os.getpid(), flush=True)\ntime.sleep(600)\n"
    proc, out = _start(tmp_path, body, "--shutdown-timeout", "600")
    try:
        pids = _rank_pids(out)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "passed on to every rank" in out.read_text(), timeout=20,
                 what="the first SIGTERM passed on")
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143, out.read_text()
    finally:
        _stop(proc)
    assert "SIGTERM again: stopping every rank now" in out.read_text()
    wait_for(lambda: not _gone(pids), timeout=10, what="the ranks to be gone")


# -- pure ------------------------------------------------------------------------------------
def _plan(*argv: str) -> Plan:
    return plan(parse(build_parser(), [*argv, "x.py"]))


def test_signal_options() -> None:
    p = _plan()
    assert p.stop_signals == {signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                              signal.SIGQUIT}
    assert {signal.SIGUSR1, signal.SIGUSR2} <= p.forward_signals
    assert p.shutdown_timeout == 30
    p = _plan("--signals-to-handle", "SIGUSR1,SIGINT", "--shutdown_timeout", "5")
    # SIGTERM always stops: a launcher that died of it would leave ranks behind
    assert p.stop_signals == {signal.SIGTERM, signal.SIGINT,
                              signal.SIGUSR1}
    assert p.shutdown_timeout == 5
    with pytest.raises(UsageError, match="SIGBOGUS"):
        _plan("--signals-to-handle", "SIGBOGUS")
    with pytest.raises(UsageError, match="0 or more"):
        _plan("--shutdown-timeout", "-1")


def test_shutdown_timeout_from_torch_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert _plan().shutdown_timeout == 7
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")
    with pytest.raises(UsageError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        _plan()


# -- a notebook's mesh: Mesh.signal_all, Mesh.stop(signal=...) --------------------------------
CELL = """\
import os, signal, time
_stop = False

def _on_signal(signum, frame):
    global _stop
    name = signal.Signals(signum).name
    with open(os.path.join(FOLDER, f"ckpt{os.environ['RANK']}.{name}"), "w") as f:
        f.write(str(os.getpid()))
    _stop = _stop or signum == signal.SIGTERM

signal.signal(signal.SIGTERM, _on_signal)
signal.signal(signal.SIGUSR1, _on_signal)
open(os.path.join(FOLDER, f"armed{os.environ['RANK']}"), "w").close()
while not _stop:
    time.sleep(0.02)
"""


def test_mesh_stop_with_sigterm_lets_the_running_cell_checkpoint(tmp_path: Path) -> None:
    from monarch_nb import Mesh

    mesh = Mesh.start(n=2, backend="cpu")
    try:
        pids = [p.pid for p in mesh._ctl.supervisor.procs.values()]
        mesh.exec(f"FOLDER = {str(tmp_path)!r}")
        fut = mesh.exec_async(CELL)
        wait_for(lambda: all((tmp_path / f"armed{r}").exists() for r in (0, 1)), timeout=30,
                 what="the cell's handlers installed")
        assert sorted(mesh.signal_all("USR1")) == [0, 1]
        wait_for(lambda: all((tmp_path / f"ckpt{r}.SIGUSR1").exists() for r in (0, 1)),
                 timeout=20, what="both ranks' SIGUSR1 handlers")
        assert not fut.done() and mesh.running  # USR1 only passes on
        mesh.stop(signal="TERM", grace=60)
        assert fut.done() and fut.exception() is None  # the cell ended in the grace
        for r, pid in enumerate(pids):
            assert (tmp_path / f"ckpt{r}.SIGTERM").read_text() == str(pid)
        wait_for(lambda: not _gone(pids), timeout=10, what="the ranks to be gone")
    finally:
        if mesh.running:
            mesh.stop()


def test_monarch_stop_takes_a_signal_and_a_grace() -> None:
    from monarch_nb.ui.magics import _P, _parse

    args = _parse(_P.stop, "--signal TERM --grace 5")
    assert (args.signal, args.grace) == ("TERM", 5.0)
    plain = _parse(_P.stop, "")
    assert (plain.signal, plain.grace) == (None, None)
