"""Script mode: ``python -m monarch_nb.launch`` / ``monarch-nb launch`` for real.

Each test runs the launcher as a subprocess on small scripts (2 CPU ranks):
success, a rank killed mid-run by chaos (respawned, exit 0), a failing script
(non-zero exit and a summary), ``sys.exit`` codes, Ctrl-C (exit 130, no
orphans). The pure parts (options, exit codes) are tested without processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from monarch_nb.errors import MembershipChanged, RankDied, RemoteError, UsageError
from monarch_nb.launch import (
    build_parser,
    exit_code_of,
    mesh_options,
    metrics_of,
    parse,
    retryable,
    user_traceback,
)

from .conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def launch(tmp_path: Path, body: str, *args: str, timeout: float = 90,
           module: tuple[str, ...] = ("monarch_nb.launch",),
           script_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run the launcher: ``args`` are its options, ``script_args`` the script's."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    cmd = [sys.executable, "-m", *module, "--backend", "cpu", "-n", "2", *args, str(script),
           *script_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(),
                          cwd=tmp_path)


# -- pure -----------------------------------------------------------------------------------
def test_options_map_onto_mesh_start() -> None:
    p = build_parser()
    ns = parse(p, ["--nodes", "2", "--gpus-per-node", "4", "--respawn=all", "--launcher", "ssh",
                   "train.py", "--lr", "0.1", "--", "--nodes", "9"])
    opts = mesh_options(ns)
    assert opts["n"] == 8 and opts["nodes"] == 2 and opts["gpus_per_node"] == 4
    assert opts["respawn"] == "all"
    assert ns.script == "train.py" and ns.args == ["--lr", "0.1", "--nodes", "9"]
    assert mesh_options(parse(p, ["-n", "3", "x.py"]))["n"] == 3
    # after the script, `--` ends the launcher's options and is not passed on
    assert parse(p, ["x.py", "--", "-a"]).args == ["-a"]
    assert parse(p, ["x.py", "--", "--", "-a"]).args == ["--", "-a"]
    assert parse(p, ["--", "x.py", "-a"]).args == ["-a"]
    with pytest.raises(UsageError, match="--nodes"):
        mesh_options(parse(p, ["--nodes", "0", "x.py"]))


def test_exit_codes_and_retry_rules() -> None:
    assert exit_code_of(RemoteError(0, "monarch_nb.engine.script.ScriptExit", "3")) == 3
    assert exit_code_of(RemoteError(0, "monarch_nb.engine.script.ScriptExit", "1: bad input")) == 1
    assert exit_code_of(RemoteError(0, "ValueError", "x")) == 1
    assert exit_code_of(RankDied(1, None, "SIGKILL")) == 128 + signal.SIGKILL
    assert exit_code_of(RankDied(1, 7)) == 7
    # by fact: the group changed under the run (a peer died), whatever the error says
    assert retryable(RankDied(1, None, "SIGKILL"), "rank", False)
    assert retryable(MembershipChanged(0, [1]), "all", False)
    assert retryable(RemoteError(0, "monarch_nb.engine.script.ScriptExit", "1"), "rank", True)
    assert not retryable(RemoteError(0, "RuntimeError", "Connection closed by peer"), "rank",
                         False)
    assert not retryable(RemoteError(0, "ValueError", "bad"), "rank", False)
    assert not retryable(RankDied(1, None, "SIGKILL"), "off", True)
    assert metrics_of({"last": {"loss": 0.5}, "step": 7}) == {"loss": 0.5, "step": 7}
    assert metrics_of({"rank": 0, "last": {}, "step": None}) == {}


def test_user_traceback_hides_the_launch_machinery() -> None:
    tb = ('Traceback (most recent call last):\n'
          '  File "/x/monarch_nb/script.py", line 80, in run_script\n'
          '    runpy.run_path(path, run_name="__main__")\n'
          '  File "<frozen runpy>", line 291, in run_path\n'
          '  File "/tmp/t.py", line 3, in <module>\n'
          '    raise ValueError("bad")\n'
          'ValueError: bad\n')
    assert user_traceback(tb) == ["Traceback (most recent call last):",
                                  '  File "/tmp/t.py", line 3, in <module>',
                                  '    raise ValueError("bad")', "ValueError: bad"]


# -- real launches ----------------------------------------------------------------------------
def test_script_runs_on_every_rank_with_torch_distributed_env(tmp_path: Path) -> None:
    res = launch(tmp_path, """
        import os, sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")          # torchrun-style script: a no-op here
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        env = [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")]
        print("env", *env, "argv", sys.argv[1:], "sum", t.item(), __name__)
        dist.destroy_process_group()
        """, script_args=("--", "--", "a", "b"))
    assert res.returncode == 0, res.stderr
    assert "[0] env 0 2 0 127.0.0.1 argv ['--', 'a', 'b'] sum 3.0 __main__" in res.stdout
    assert "[1] env 1 2 1 127.0.0.1 argv ['--', 'a', 'b'] sum 3.0 __main__" in res.stdout
    assert "all 2 rank(s) finished" in res.stderr


def test_rank_killed_mid_run_is_respawned_and_the_launch_succeeds(tmp_path: Path) -> None:
    res = launch(tmp_path, """
        import time, torch, torch.distributed as dist
        import monarch_nb as mnb
        from monarch_nb import chaos
        for step in range(12):
            t = torch.ones(1)
            dist.all_reduce(t)
            time.sleep(0.05)
            chaos.die_at(step, 4, rank=1)     # SIGKILL, first incarnation only
        print("finished rank", mnb.rank(), "incarnation", mnb.incarnation(), "sum", t.item())
        """, "--respawn", "rank")
    assert res.returncode == 0, res.stderr
    assert "rank 1 died: killed by SIGKILL" in res.stderr
    assert "[1] finished rank 1 incarnation 1 sum 2.0" in res.stdout
    assert "finished rank 0" in res.stdout


def test_failing_script_exits_non_zero_with_a_summary(tmp_path: Path) -> None:
    res = launch(tmp_path, """
        import monarch_nb as mnb
        if mnb.rank() == 1:
            raise ValueError("rank one is unhappy")
        """)
    assert res.returncode == 1
    assert "1 of 2 rank(s) finished; 1 failed" in res.stderr
    assert "rank 1: ValueError: rank one is unhappy (exit 1)" in res.stderr
    assert 'raise ValueError("rank one is unhappy")' in res.stderr
    assert "<frozen runpy>" not in res.stderr


def test_sys_exit_code_is_the_launch_exit_code(tmp_path: Path) -> None:
    res = launch(tmp_path, "import sys\nsys.exit(3)\n", module=("monarch_nb.cli", "launch"))
    assert res.returncode == 3, res.stderr
    assert "rank 0: sys.exit(3) (exit 3)" in res.stderr
    assert "runs the script again" not in res.stderr  # its own failure: no peer died


def test_respawn_off_reports_the_death(tmp_path: Path) -> None:
    res = launch(tmp_path, """
        import monarch_nb as mnb
        from monarch_nb import chaos
        if mnb.rank() == 0:
            chaos.die("exit", code=7)
        """, "--respawn", "off")
    assert res.returncode == 7, res.stderr
    assert "rank 0: exited with code 7 (exit 7)" in res.stderr


def _as_background_job() -> None:
    # what `sh -c 'launch ... &'` (a script, a CI runner) does to a job: Python
    # then starts with SIGINT ignored and never raises KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


@pytest.mark.parametrize("started", ["foreground", "background"])
def test_ctrl_c_stops_every_rank(tmp_path: Path, started: str) -> None:
    script = tmp_path / "sleepy.py"
    script.write_text("import os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(600)\n")
    out = tmp_path / "out.txt"
    # the foreground case also starts with SIGINT at its default when this
    # test itself runs as a background job
    pre = _as_background_job if started == "background" else \
        (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "monarch_nb.launch", "--backend", "cpu", "-n", "2", str(script)],
            stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=tmp_path, preexec_fn=pre)
    try:
        text = wait_for(lambda: out.read_text().count("pid ") >= 2 and out.read_text(),
                        timeout=60, what="both ranks running the script")
        pids = [int(line.split()[-1]) for line in str(text).splitlines() if "] pid " in line]
        assert len(pids) == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "interrupted; stopping every rank" in out.read_text()
    deadline = time.monotonic() + 5
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.05)
    assert not alive, f"ranks outlived the launcher: {alive}"


def test_cli_help_and_unknown_command() -> None:
    res = subprocess.run([sys.executable, "-m", "monarch_nb.cli"], capture_output=True,
                         text=True, env=_env())
    assert res.returncode == 2 and "launch" in res.stdout and "worker --join" in res.stdout
    res = subprocess.run([sys.executable, "-m", "monarch_nb.cli", "frobnicate"],
                         capture_output=True, text=True, env=_env())
    assert res.returncode == 2 and "unknown command 'frobnicate'" in res.stderr


ELASTIC = """
    import sys, torch, torch.distributed as dist
    import monarch_nb as mnb
    from monarch_nb import chaos
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = mnb.elastic.State(model=model, optimizer=opt, step=0)

    @mnb.elastic.run(state)
    def train(state):
        while state.step < 30:
            x = torch.ones(8, 4) * (state.step % 5 + mnb.rank())
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            state.step += 1
            state.commit()
            if sys.argv[1:] == ["kill"]:
                chaos.die_at(state.step, 10, rank=1)

    train()
    w = [round(v, 6) for v in model.weight.detach().flatten().tolist()]
    print("final", state.step, "incarnation", mnb.incarnation(), "w", w)
"""


def test_elastic_script_survives_a_death_in_place(tmp_path: Path) -> None:
    clean = launch(tmp_path, ELASTIC, script_args=("clean",))
    faulted = launch(tmp_path, ELASTIC, script_args=("kill",))
    assert clean.returncode == 0 and faulted.returncode == 0, faulted.stderr

    def finals(res: subprocess.CompletedProcess[str]) -> dict[str, str]:
        return {line[:3]: line.split(" w ")[1] for line in res.stdout.splitlines()
                if "] final 30" in line}

    assert "rank 1 died: killed by SIGKILL" in faulted.stderr
    assert "[0] final 30 incarnation 0" in faulted.stdout  # the survivor was not re-run
    assert "[1] final 30 incarnation 1" in faulted.stdout
    assert "rank 0 runs the script again" not in faulted.stderr
    assert finals(faulted) == finals(clean) and len(finals(clean)) == 2


def test_live_status_on_a_terminal(tmp_path: Path) -> None:
    import pty

    script = tmp_path / "slow.py"
    script.write_text("import time\nimport monarch_nb as mnb\nfor i in range(6):\n"
                      "    print('tick', i)\n    mnb.log(step=i, loss=1.1111 * (i + 1))\n"
                      "    time.sleep(0.4)\n")
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "monarch_nb.launch", "--backend", "cpu",
                             "-n", "2", str(script)], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, env=_env(), cwd=tmp_path)
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child side closed
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        proc.wait(timeout=60)
    text = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0, text
    # rich drew the per-rank table (its header) and the rank output still came through
    assert "heartbeat" in text and "loss" in text
    # mnb.log in a launched script reaches the table: a loss value of the
    # form 1.1111*(i+1) (rich redraws, so whichever steps were drawn)
    assert any(f"{1.1111 * (i + 1):.4g}" in text for i in range(1, 6)), text[-2000:]
    assert "tick 5" in text and "all 2 rank(s) finished" in text
