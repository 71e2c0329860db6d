"""``python -m monarch_nb.launch --nnodes 1:2 --nproc-per-node 2`` over two
hosts (network namespaces, the ssh launcher with ``ip netns exec {host} sh
-c``), one of which is lost mid-run: every process in its namespace killed
and the namespace removed. A node is a host: MIN=1 node is min_ranks 2. A
plain torchrun script restarts on the host left at WORLD_SIZE 2 (every rank
in a new process, ``TORCHELASTIC_RESTART_COUNT`` 1); a script using
``mnb.elastic`` carries on in place at world size 2; below ``--min-ranks``
the run ends, exit 1, naming the cause.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import wait_for
from .engines import Hosts, lose_host, netns_hosts, pids_in

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    # the launcher's, host A (kept), and one host B per test (lost)
    with netns_hosts(5) as h:
        yield h


PLAIN = """
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"start rank {rank} world {world} restart {restart}", flush=True)
    for step in range(2000 if restart == 0 else 5):
        t = torch.ones(1)
        dist.all_reduce(t)
        if rank == 0:
            print(f"step {step} world {world} sum {t.item():g}", flush=True)
        time.sleep(0.1)
    print(f"done rank {rank} world {world} restart {restart} sum {t.item():g}", flush=True)
"""

ELASTIC = """
    import os, time, torch, torch.distributed as dist
    import monarch_nb as mnb
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = mnb.elastic.State(model=model, step=0)

    @mnb.elastic.run(state)
    def train(state):
        while state.step < 150:
            t = torch.ones(1)
            dist.all_reduce(t)
            state.step += 1
            state.commit()
            if mnb.rank() == 0:
                print(f"step {state.step} world {mnb.world_size()} sum {t.item():g}", flush=True)
            time.sleep(0.1)

    train()
    print(f"final rank {mnb.mesh_rank()} world {mnb.world_size()} step {state.step} "
          f"incarnation {mnb.incarnation()}", flush=True)
"""


def launch_and_lose(hosts: Hosts, tmp_path: Path, body: str, lost: int,
                    *flags: str) -> tuple[int, str, str]:
    """Launch over host A and host ``lost``, lose that host once rank 0
    reported step 3 at world size 4; (exit status, stdout, stderr)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    a, b = hosts.names[1], hosts.names[lost]
    env = dict(os.environ, PYTHONPATH=str(ROOT), MONARCH_NB_SSH="ip netns exec {host} sh -c")
    err = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen(
        ["ip", "netns", "exec", hosts.names[0], sys.executable, "-m", "monarch_nb.launch",
         "--backend", "cpu", "--nnodes", "1:2", "--nproc-per-node", "2", "--hosts", f"{a},{b}",
         "--bind", hosts.addrs[0], "--master-addr", hosts.addrs[1], "--host-timeout", "3",
         "--rdzv-conf", "join_timeout=90", "--no-status", *flags, str(script)],
        stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True, env=env,
        cwd=tmp_path)
    out: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if "step 3 world 4" in line:
                lose_host(b)
                break
        out.extend(proc.stdout)
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.seek(0)
        errs = err.read()
        err.close()
    for ns in (hosts.names[0], a):  # nothing left on the hosts that stayed
        wait_for(lambda ns=ns: pids_in(ns) == [], timeout=30, what=f"{ns} empty")
    return code, "".join(out), errs


def test_a_plain_script_restarts_at_the_smaller_world_size(hosts: Hosts, tmp_path: Path) -> None:
    code, out, err = launch_and_lose(hosts, tmp_path, PLAIN, 2)
    assert "step 3 world 4" in out, err[-3000:]
    assert code == 0, err[-3000:]
    for rank in (0, 1):
        assert f"start rank {rank} world 2 restart 1" in out, out[-2000:]
        assert f"done rank {rank} world 2 restart 1 sum 2" in out, out[-2000:]
    assert "restart 2" not in out
    assert "at world size 2 of 4; rank 2,3 lost" in err, err[-3000:]


def test_an_elastic_script_carries_on_in_place(hosts: Hosts, tmp_path: Path) -> None:
    code, out, err = launch_and_lose(hosts, tmp_path, ELASTIC, 3)
    assert code == 0, err[-3000:]
    # the same processes (incarnation 0) finish the loop in a group of 2
    for rank in (0, 1):
        assert f"final rank {rank} world 2 step 150 incarnation 0" in out, (
            out[-1000:] + "\n--- stderr ---\n" + err[-3000:])
    assert "step 150 world 2 sum 2" in out
    assert "runs the script again" not in err and "restarted in a new process" not in err, err
    assert "at world size 2 of 4; rank 2,3 lost" in err, err[-3000:]


def test_below_min_ranks_the_run_ends_naming_the_cause(hosts: Hosts, tmp_path: Path) -> None:
    code, out, err = launch_and_lose(hosts, tmp_path, PLAIN, 4, "--min-ranks", "3")
    assert code == 1, err[-3000:]
    assert f"host {hosts.names[4]} lost" in err, err[-3000:]
    assert "the group cannot go on: 2 rank(s) left, fewer than --min-ranks 3" in err, err[-3000:]
    assert "restart 1" not in out
