"""Launchers: placement and commands (pure), and joining a mesh by hand with
``monarch-nb worker --join ... --key-file FILE`` (real processes).

ssh and slurm run for real in tests/test_netns.py and tests/test_slurm.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from monarch_nb import Mesh, backends, config
from monarch_nb.errors import UsageError
from monarch_nb.procs.launchers import (
    SlurmLauncher,
    SshLauncher,
    from_config,
    rank_spec,
    world_and_per_node,
)
from monarch_nb.procs.supervisor import Supervisor

from .conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]


def test_placement_fills_nodes_in_order() -> None:
    assert world_and_per_node(None, 2, 4) == (8, 4)
    assert world_and_per_node(6, 2, None) == (6, 3)
    assert world_and_per_node(None, 3, None) == (3, 1)
    with pytest.raises(UsageError, match="does not fit"):
        world_and_per_node(9, 2, 4)
    ssh = SshLauncher(["a", "b"], 2, "10.0.0.1", template=["ssh", "{host}"])
    places = [ssh.placement(r, 3) for r in range(3)]
    assert [(p.host, p.node, p.local_rank, p.local_world_size) for p in places] == [
        ("a", 0, 0, 2), ("a", 0, 1, 2), ("b", 1, 0, 1)]


def test_remote_commands_carry_no_secret() -> None:
    ssh = SshLauncher(["h1"], 1, "10.0.0.1", python="/opt/py", cwd="/w d",
                      template=["ip", "netns", "exec", "{host}", "sh", "-c"])
    cmd = ssh.command(ssh.placement(0, 1))
    assert cmd[:5] == ["ip", "netns", "exec", "h1", "sh"]
    assert cmd[-1] == "cd '/w d' 2>/dev/null; exec /opt/py -m monarch_nb.cli worker --key-file -"
    srun = SlurmLauncher(["n1", "n2"], 1, "10.0.0.1", python="/opt/py")
    assert srun.command(srun.placement(1, 2))[:4] == ["srun", "--nodes=1", "--ntasks=1",
                                                      "--nodelist=n2"]
    env = {"RANK": "1", config.ENV_KEY: "ab" * 32, config.ENV_CURVE_SECRET: "s" * 40,
           config.ENV_PARENT_PID: "1", "HOME": "/root", "PYTHONPATH": "/src"}
    spec = json.loads(rank_spec(env))["env"]
    assert spec[config.ENV_KEY] == "ab" * 32 and spec["RANK"] == "1"
    assert "HOME" not in spec and config.ENV_PARENT_PID not in spec  # only what a rank needs


def test_remote_ranks_get_torchruns_environment_too() -> None:
    # what supervisor.env_for sets for a local rank reaches a remote one
    sup = Supervisor(world_size=2, backend=backends.resolve("cpu"), controller_endpoint="tcp://x:1",
                     key=b"k" * 32, mesh_id="m", master_port=1, restart_budget=7,
                     launcher=SshLauncher(["h1", "h2"], 1, "10.0.0.1"))
    try:
        env = sup.env_for(1, 2, "ident")
        spec = json.loads(rank_spec(env))["env"]
        for var in ("ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "GROUP_RANK",
                    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                    "TORCHELASTIC_RUN_ID"):
            assert spec[var] == env[var], var
        assert (spec["ROLE_RANK"], spec["GROUP_RANK"], spec["TORCHELASTIC_RESTART_COUNT"],
                spec["TORCHELASTIC_MAX_RESTARTS"]) == ("1", "1", "2", "7")
    finally:
        sup.spawner.stop()
        sup.cleanup_logs()


def test_ssh_needs_hosts_and_local_has_one_node() -> None:
    with pytest.raises(UsageError, match="--hosts"):
        config.MeshConfig(launcher="ssh")
    with pytest.raises(UsageError, match="--nodes 2"):
        from_config(config.MeshConfig(nodes=2), None)
    ssh, world = from_config(config.MeshConfig(launcher="ssh", hosts=("me@127.0.0.1", "b"),
                                               gpus_per_node=2), None)
    assert world == 4 and ssh.master_addr(world) == "127.0.0.1"
    with pytest.raises(UsageError, match="only 1 host"):
        from_config(config.MeshConfig(launcher="ssh", hosts=("a",), nodes=2), None)


def _join(path: str, endpoint: str | None = None) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "monarch_nb.cli", "worker", "--key-file", path]
    if endpoint:
        cmd[4:4] = ["--join", endpoint]
    return subprocess.Popen(cmd, env=env)


def test_join_by_hand_and_rejoin_after_a_death(tmp_path: Path) -> None:
    folder = tmp_path / "join"
    box: dict[str, object] = {}

    def start() -> None:
        try:
            box["mesh"] = Mesh.start(n=2, backend="cpu", launcher="join", bind="127.0.0.2",
                                     join_dir=str(folder), start_timeout=90)
        except BaseException as exc:
            box["error"] = exc

    starter = threading.Thread(target=start)
    starter.start()
    files = [str(folder / f"rank{r}.json") for r in range(2)]
    wait_for(lambda: all(os.path.exists(f) for f in files), timeout=30, what="spec files")
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    endpoint = json.loads(Path(files[0]).read_text())["env"][config.ENV_CONTROLLER]
    procs = [_join(f, endpoint) for f in files]
    try:
        starter.join(120)
        assert "error" not in box, box
        mesh = box["mesh"]
        assert isinstance(mesh, Mesh)
        try:
            assert mesh._ctl.io.curve is not None  # joins over Curve
            assert mesh.run(lambda: __import__("os").getpid()) == {0: procs[0].pid,
                                                                  1: procs[1].pid}
            procs[1].kill()  # the pod dies: missed heartbeats declare the rank dead
            procs[1].wait()
            wait_for(lambda: mesh.status()[1]["incarnation"] == 1, timeout=30,
                     what="rank 1 declared dead and its spec rewritten")
            procs.append(_join(files[1]))  # the replacement uses the same file
            import monarch_nb as mnb

            assert mesh.run(mnb.incarnation, timeout=90) == {0: 0, 1: 1}
        finally:
            mesh.stop()
        assert procs[0].wait(timeout=15) == 0 and procs[2].wait(timeout=15) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_worker_refuses_a_readable_key_file(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"env": {"RANK": "0"}}))
    os.chmod(spec, 0o644)
    res = subprocess.run([sys.executable, "-m", "monarch_nb.cli", "worker", "--key-file",
                          str(spec)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert res.returncode == 2 and "chmod 600" in res.stderr
