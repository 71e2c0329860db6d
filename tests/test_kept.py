"""Kept meshes: a mesh that outlives its controller, and attach (issue 38).

The real thing throughout: controllers are real processes (a kernel through
jupyter_client, or a Python script) that are SIGKILLed; the ranks, the host
agent and its door are real processes; the attach goes through the agent's
Unix socket with its HMAC challenge. Each test has its own runtime folder
(``JUPYTER_RUNTIME_DIR``) so their kept meshes never meet.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from monarch_nb import Mesh
from monarch_nb.config import MeshConfig, parse_duration
from monarch_nb.engine import kept
from monarch_nb.errors import MeshNotRunning, UsageError
from monarch_nb.procs import agentwire, keptfiles

from .conftest import wait_for
from .kernel_util import KernelSession


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A private runtime folder (short: a Unix socket lives there)."""
    path = tempfile.mkdtemp(prefix="mk")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", path)
    try:
        yield path
    finally:
        for row in _rows():
            subprocess.run([sys.executable, "-m", "monarch_nb.cli", "stop", row["name"]],
                           capture_output=True, timeout=60)
        shutil.rmtree(path, ignore_errors=True)


def _rows() -> list[dict[str, object]]:
    try:
        return Mesh.list()
    except OSError:
        return []


def _mesh_pids(name: str) -> set[int]:
    """The agent and every rank (and spare) of kept mesh ``name``."""
    status = keptfiles.read_status(name)
    pid = status.get("agent_pid")
    if not isinstance(pid, int):
        return set()
    try:
        agent = psutil.Process(pid)
        return {pid, *(p.pid for p in agent.children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def _controller(name: str, body: str, keep_alive: float = 60) -> subprocess.Popen[str]:
    """A Python process that starts kept mesh ``name`` (2 ranks), prints
    READY, then runs ``body`` (``mesh`` is the mesh)."""
    code = textwrap.dedent(f"""
        import os, sys, time
        from monarch_nb import Mesh
        mesh = Mesh.start(n=2, backend="cpu", name={name!r}, keep_alive={keep_alive})
        mesh.exec("x = rank * 10")
        print("PIDS", *[r["pid"] for r in mesh.status()], flush=True)
        print("READY", flush=True)
    """) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.PIPE, text=True)


def _until_ready(proc: subprocess.Popen[str]) -> list[int]:
    assert proc.stdout is not None
    pids: list[int] = []
    for line in proc.stdout:
        if line.startswith("PIDS"):
            pids = [int(p) for p in line.split()[1:]]
        if line.strip() == "READY":
            return pids
    raise AssertionError(f"the controller ended before READY: {proc.stderr.read() if proc.stderr else ''}")


# -- pure -----------------------------------------------------------------------------------
def test_durations() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "30m", "2h", "1h30m", "1.5h", "1d")] == \
        [90, 90, 1800, 7200, 5400, 5400, 86400]
    for bad in ("", "x", "30x", "1h30", "-5", "0s", "h", "5 m m"):
        with pytest.raises(UsageError, match="duration"):
            parse_duration(bad)


@given(st.integers(1, 10_000), st.sampled_from(["s", "m", "h", ""]))
def test_duration_roundtrip(n: int, unit: str) -> None:
    assert parse_duration(f"{n}{unit}") == n * {"s": 1, "m": 60, "h": 3600, "": 1}[unit]


@given(st.text(max_size=12))
def test_duration_never_crashes(text: str) -> None:
    try:
        assert parse_duration(text) > 0
    except UsageError:
        pass


def test_kept_config() -> None:
    cfg = MeshConfig(name="exp1")
    assert cfg.kept and cfg.keep_alive == 1800.0
    assert MeshConfig(name="exp1", keep_alive="2h").keep_alive == 7200.0
    assert MeshConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(UsageError, match="needs a name"):
        MeshConfig(keep_alive=60)
    with pytest.raises(UsageError, match="mesh name"):
        MeshConfig(name="../etc")
    with pytest.raises(UsageError, match="keep_alive must be"):
        MeshConfig(name="a", keep_alive=-1)
    with pytest.raises(UsageError, match="SLURM job step"):
        MeshConfig(name="a", launcher="slurm")
    assert MeshConfig(name="a", launcher="ssh", hosts=("h",)).kept
    assert not MeshConfig().kept


def test_keeper_bounds_and_acks() -> None:
    k = kept.Keeper(epoch=1)
    for call in range(1, kept.MAX_RESULTS + 5):
        k.keep(call, {"n_out": 2}, [b"x" * 10])
    assert len(k.kept_calls()) == kept.MAX_RESULTS  # the oldest let go
    assert k.kept_calls()[0] == 5
    k.done_with(low=10, done=[12, 13])
    assert 9 not in k.kept_calls() and 12 not in k.kept_calls() and 11 in k.kept_calls()
    assert all("n_out" not in meta for _, meta, _ in k.take_results())  # never waited for
    k.keep(99, {}, [b"y" * (kept.MAX_RESULT_BYTES + 1)])
    assert 99 not in k.kept_calls()
    for _ in range(3):
        k.hold_output(7, {"n": -1}, [b"z" * (kept.MAX_OUTBOX_BYTES // 2)])
    assert k.outbox_bytes <= kept.MAX_OUTBOX_BYTES and len(k.take_outbox()) == 2
    assert kept.detached(10.0, 7.5) and not kept.detached(10.0, 9.0)


def test_agentwire_kept_ops() -> None:
    line = agentwire.encode("attach", mac="ab", pid=1, host="h", force=False)
    assert agentwire.decode(line, agentwire.TO_AGENT)["op"] == "attach"
    with pytest.raises(ValueError):
        agentwire.decode(agentwire.encode("attach", mac=1, pid=1, host="h", force=False),
                         agentwire.TO_AGENT)


# -- real processes -------------------------------------------------------------------------------
def test_controller_sigkilled_attach_lease(runtime: str) -> None:
    """A controller SIGKILLed with a call in flight: the ranks go on; a new
    controller attaches to the same processes, gets the call's result and
    output, the variables, the metric curve; the mesh stops with nothing left."""
    ctl = _controller("k1", """
        fut = mesh.exec_async("import time\\nfor i in range(8):\\n    mnb.log(loss=1.0 / (i + 1))\\n"
                              "    time.sleep(0.25)\\nprint('trained', rank)\\nrank + 100")
        time.sleep(0.5)
        os.kill(os.getpid(), 9)
    """)
    pids = _until_ready(ctl)
    ctl.wait(30)
    assert ctl.returncode == -signal.SIGKILL
    rows = Mesh.list()
    assert [r["name"] for r in rows] == ["k1"] and rows[0]["ranks"] == 2
    wait_for(lambda: not Mesh.list()[0]["attached"], 15)
    assert all(psutil.pid_exists(p) for p in pids)  # the ranks outlived their controller
    t0 = time.monotonic()
    mesh = Mesh.attach("k1")
    took = time.monotonic() - t0
    try:
        print(f"attach took {took:.2f} s")
        assert [r["pid"] for r in mesh.status()] == pids  # the same processes
        pending = mesh.pending()
        assert len(pending) == 1
        assert dict(pending[0].result(timeout=30)) == {0: 100, 1: 101}
        assert dict(mesh.exec("x")) == {0: 0, 1: 10}  # the variables
        wait_for(lambda: all(mesh._ctl.metrics.last_step(r) == 7 for r in range(2)), 10)
        assert any(e["kind"] == "attached" for e in mesh.events)
        assert any(e["kind"] == "ready" for e in mesh.events)  # the first controller's events
        assert mesh.run(os.getpid) == {0: pids[0], 1: pids[1]}
        # supervision resumed: a killed rank comes back
        mesh.kill(1)
        assert dict(mesh.exec("rank")) == {0: 0, 1: 1}
        assert mesh.status()[1]["pid"] != pids[1]
    finally:
        agent_and_ranks = _mesh_pids("k1")
        mesh.stop()
    wait_for(lambda: not any(psutil.pid_exists(p) for p in agent_and_ranks | set(pids)), 15)
    assert Mesh.list() == []
    assert not os.path.exists(keptfiles.record_path("k1"))
    assert os.path.isdir(keptfiles.log_dir("k1"))  # the logs stay


def test_lease_runs_out(runtime: str) -> None:
    ctl = _controller("short", "os.kill(os.getpid(), 9)\n", keep_alive=3)
    pids = _until_ready(ctl)
    ctl.wait(30)
    everything = _mesh_pids("short") | set(pids)
    assert len(everything) >= 3
    wait_for(lambda: not any(psutil.pid_exists(p) for p in everything), 25)
    assert not os.path.exists(keptfiles.record_path("short"))
    assert not os.path.exists(keptfiles.socket_path("short"))
    with pytest.raises(UsageError, match="no kept mesh named 'short'"):
        Mesh.attach("short")


def test_one_controller_at_a_time_and_forged_attach(runtime: str) -> None:
    ctl = _controller("held", """
        sys.stdin.readline()
        try:
            mesh.run(os.getpid)
            print("STILL MINE", flush=True)
        except Exception as exc:
            print("REFUSED", type(exc).__name__, exc, flush=True)
        sys.stdin.readline()
    """)
    pids = _until_ready(ctl)
    try:
        # a forged attach (a wrong answer to the challenge) is dropped and counted
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(keptfiles.socket_path("held"))
        f = sock.makefile("rb")
        challenge = agentwire.decode(f.readline(), agentwire.FROM_AGENT)
        assert challenge["op"] == "challenge"
        sock.sendall(agentwire.encode("attach", mac="00" * 32, pid=1, host="x", force=True))
        answer = agentwire.decode(f.readline(), agentwire.FROM_AGENT)
        assert answer["op"] == "refused" and "key" in answer["text"]
        sock.close()
        log = os.path.join(keptfiles.log_dir("held"), "agent.log")
        wait_for(lambda: "forged attach" in open(log).read(), 5)

        with pytest.raises(UsageError, match=f"attached to pid {ctl.pid} on .* force=True"):
            Mesh.attach("held")
        mesh = Mesh.attach("held", force=True)
        try:
            assert [r["pid"] for r in mesh.status()] == pids
            assert dict(mesh.exec("x")) == {0: 0, 1: 10}
            assert ctl.stdin is not None and ctl.stdout is not None
            ctl.stdin.write("\n")
            ctl.stdin.flush()
            said = ctl.stdout.readline()
            assert said.startswith("REFUSED MeshNotRunning") and "taken over" in said, said
            assert Mesh.list()[0]["attached"].startswith(f"pid {os.getpid()} ")
        finally:
            mesh.stop()
    finally:
        ctl.kill()
        ctl.wait(10)


def test_detach_and_cli(runtime: str) -> None:
    mesh = Mesh.start(n=2, backend="cpu", name="cli1", keep_alive="5m")
    pids = [r["pid"] for r in mesh.status()]
    with pytest.raises(UsageError, match="runs already"):
        Mesh.start(n=1, backend="cpu", name="cli1")
    mesh.detach()
    with pytest.raises(MeshNotRunning):
        mesh.run(os.getpid)
    out = subprocess.run([sys.executable, "-m", "monarch_nb.cli", "ls"], capture_output=True,
                         text=True, timeout=30).stdout
    assert "cli1" in out and "detached, lease left" in out, out
    everything = _mesh_pids("cli1") | set(pids)
    out = subprocess.run([sys.executable, "-m", "monarch_nb.cli", "stop", "cli1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "stopped kept mesh 'cli1' (2 ranks)" in out.stdout, out
    wait_for(lambda: not any(psutil.pid_exists(p) for p in everything), 15)
    out = subprocess.run([sys.executable, "-m", "monarch_nb.cli", "stop", "cli1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no kept mesh named 'cli1'" in out.stderr


def test_the_door_closing_after_a_detach_is_not_a_lost_host(tmp_path: Path) -> None:
    """A detach's answer is the door closing at once; the reader thread that
    sees it close must not take it for a lost host, whose ranks' ends the
    controller reaps (under load, both ranks of a detached mesh were
    SIGKILLed so: their variables gone at the next attach)."""
    from monarch_nb import backends
    from monarch_nb.procs.agents import AgentLauncher, HomeLauncher, HostAgent
    from monarch_nb.procs.supervisor import RankProcess, Supervisor

    door = [sys.executable, "-c", "import sys\nfor line in sys.stdin:\n"
            "    if 'detach' in line: sys.exit(0)"]
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    try:
        agent = HostAgent("localhost", door, dict(os.environ), str(tmp_path / "door.log"), 30.0)
        assert agent.popen is not None
        handle = agent.adopt({"sid": 1, "rank": 0, "inc": 0, "pid": rank.pid}, os.devnull)
        reader = next(t for t in threading.enumerate() if t.name == "monarch-nb-agent-localhost")
        agent.detach()
        agent.popen.wait(timeout=30)
        reader.join(timeout=30)
        assert not reader.is_alive() and agent.lost == "detached"
        assert handle.returncode is None and rank.poll() is None  # the rank lives on
        agent.detach()  # twice: nothing more is said
        # and should a kept rank of this machine read as ended while it
        # runs, the controller still leaves its process to its agent
        handle.ended(255, "host localhost lost")
        sup = Supervisor(world_size=1, backend=backends.resolve("cpu"),
                         controller_endpoint="tcp://x:1", key=b"k" * 32, mesh_id="m",
                         master_port=1, launcher=AgentLauncher(HomeLauncher("door", 60.0)))
        try:
            sup.procs[0] = RankProcess(0, 0, handle, os.devnull)
            assert sup.reap(0) == 255
            sup.kill_proc(sup.procs[0])
            with pytest.raises(subprocess.TimeoutExpired):  # (a SIGKILL lands in microseconds)
                rank.wait(timeout=0.5)
        finally:
            sup.spawner.stop()
            sup.cleanup_logs()
    finally:
        rank.kill()
        rank.wait()


def test_kernel_killed_with_training_cell_in_flight(runtime: str) -> None:
    """Through real kernels: a training cell runs on a kept mesh, the kernel
    is SIGKILLed (as the OOM killer would), a new kernel attaches, and
    ``%monarch wait`` shows the cell's output and result."""
    first = KernelSession()
    second = None
    try:
        assert first.run("%load_ext monarch_nb").status == "ok"
        r = first.run("%monarch start -n 2 --backend cpu --no-dashboard --name nb1 "
                      "--keep-alive 2m", timeout=180)
        assert r.status == "ok" and "kept mesh 'nb1'" in r.text, r
        assert first.run("%%monarch --setup\nw = torch.ones(2) * (rank + 1)").status == "ok"
        pids = first.run("%%monarch\nimport os\nos.getpid()").text
        started = os.path.join(runtime, "training-started")
        first.execute("%%monarch\nimport os, time\nfor step in range(10):\n    mnb.log(loss=1 / (step + 1))\n"
                      f"    if step == 1 and rank == 0:\n        open({started!r}, 'w').close()\n"
                      "    time.sleep(0.3)\nprint('epoch done', rank)\nfloat(w.sum())")
        wait_for(lambda: os.path.exists(started), 30)  # the cell runs on the ranks
        os.kill(first.pid, signal.SIGKILL)
        first.km.provisioner.process.wait(10)  # type: ignore[union-attr]  # (reaped: not a zombie)
        second = KernelSession()
        assert second.run("%load_ext monarch_nb").status == "ok"
        r = second.run("%monarch attach nb1", timeout=60)
        assert r.status == "ok" and "attached to kept mesh 'nb1'" in r.text, r
        # (running, or finished already on a loaded machine: either way it is the new kernel's)
        assert "from the last kernel: cell In [" in r.text and "on ranks 0,1" in r.text, r
        r = second.run("%monarch wait", timeout=60)
        assert r.status == "ok" and "epoch done" in r.text, r
        r = second.run("%%monarch\nimport os\nos.getpid()")
        assert r.text == pids  # the same processes
        r = second.run("%%monarch\nfloat(w.sum())")
        assert "2.0" in r.text and "4.0" in r.text, r
        assert second.run("%monarch stop").status == "ok"
        wait_for(lambda: Mesh.list() == [], 10)
    finally:
        first.end()
        if second is not None:
            second.end()


def test_a_rank_that_died_in_a_call_while_detached_fails_its_part(runtime: str) -> None:
    """A call in flight at the detach; rank 1 is killed in it while no
    controller is attached. The next controller's pending call is that of
    both ranks: rank 0's value, rank 1's death (not a result of rank 0
    alone), and pending_info says so; rank 1 is back for the next call."""
    from monarch_nb.errors import RankDied, RankErrors

    mesh = Mesh.start(n=2, backend="cpu", name="died1", keep_alive="2m")
    attached = None
    try:
        pids = [r["pid"] for r in mesh.status()]
        started = os.path.join(runtime, "call-started")
        mesh.exec(f"import os, time\nif rank == 1:\n    open({started!r}, 'w').close()\n"
                  "time.sleep(2 if rank == 0 else 60)\nrank + 10", block=False)
        wait_for(lambda: os.path.exists(started), 30)
        mesh.detach()
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: not psutil.pid_exists(pids[1]), 10)
        attached = Mesh.attach("died1")
        (fut,) = attached.pending()
        with pytest.raises(RankErrors) as caught:
            fut.result(timeout=60)
        assert dict(caught.value.results) == {0: 10}, caught.value
        assert set(caught.value.errors) == {1} and isinstance(caught.value.errors[1], RankDied)
        assert "SIGKILL" in str(caught.value.errors[1]), caught.value.errors[1]
        assert "rank 1 died in it" in attached.pending_info(fut), attached.pending_info(fut)
        assert attached.run(os.getpid)[0] == pids[0]  # rank 0 the same, rank 1 back
    finally:
        (attached or mesh).stop()


def test_record_is_private(runtime: str) -> None:
    mesh = Mesh.start(n=1, backend="cpu", name="priv", keep_alive=60)
    try:
        for path in (keptfiles.record_path("priv"), keptfiles.status_path("priv"),
                     keptfiles.socket_path("priv")):
            assert os.stat(path).st_mode & 0o077 == 0, path
        assert os.stat(keptfiles.runtime_dir()).st_mode & 0o777 == 0o700
        record = json.load(open(keptfiles.record_path("priv")))
        assert record["key"] == mesh._ctl.key.hex()
        for proc in psutil.process_iter(["cmdline"]):
            assert record["key"] not in " ".join(proc.info["cmdline"] or [])
    finally:
        mesh.stop()


def test_budgets_travel() -> None:
    from monarch_nb.controller.life.policy import RestartPolicy
    from monarch_nb.controller.life.ranktable import RankTable

    old = RestartPolicy(RankTable(2))
    old.deaths[1] = [10.0, 11.5]
    new = RestartPolicy(RankTable(2))
    new.restore_budgets(json.loads(json.dumps(old.budgets())))  # as it travels
    assert new.deaths == [[], [10.0, 11.5]]
    new.restore_budgets({"deaths": [[1.0]]})  # another mesh's size: left out
    assert new.deaths == [[], [10.0, 11.5]]
def test_attach_asks_again_only_the_ranks_not_heard() -> None:
    """At attach, the epoch's first PING asks every rank for HELLO; a rank
    not heard is asked again alone (``hello_meta`` to it): the regular PING
    asks nobody, so the ranks that answered are not asked each round."""
    from monarch_nb.controller.calls.calltable import CallTable
    from monarch_nb.controller.keep import Keep
    from monarch_nb.controller.life.policy import RestartPolicy
    from monarch_nb.controller.life.ranktable import RankTable

    ranks = RankTable(4)
    keep = Keep("k", 7, CallTable(first_id=7 << 32), ranks, lambda call: None,
                RestartPolicy(ranks))
    keep.on_hello(2, {"kept": []})  # early (its process was adopted just after)
    for rank in range(4):
        keep.expecting(rank)
    assert keep.unheard() == {0, 1, 3}
    assert "hi" not in keep.ping_meta() and keep.ping_meta()["ep"] == 7
    assert keep.hello_meta()["hi"] is True and keep.hello_meta()["ep"] == 7
    keep.on_hello(0, {"kept": []})
    keep.on_hello(3, {"kept": [5]})
    assert keep.wait_hellos(0.01) == {1}
    keep.on_hello(1, {"kept": [], "running": 9})
    assert keep.wait_hellos(5.0) == set() and keep.unheard() == set()
    keep.adopt()
    assert sorted(f.call_id for f in keep.pending()) == [5, 9]
    assert "low" in keep.ping_meta()  # adopted: the ranks may let go of what is done


def test_kernel_restarted_by_its_manager(runtime: str) -> None:
    """"Restart Kernel" with a training cell in flight: the kernel manager
    asks the kernel to shut down (and kills it if it does not in time); the
    kept mesh goes on, and the restarted kernel attaches to it."""
    ks = KernelSession()
    try:
        assert ks.run("%load_ext monarch_nb").status == "ok"
        r = ks.run("%monarch start -n 2 --backend cpu --no-dashboard --name nb2 "
                   "--keep-alive 2m", timeout=180)
        assert r.status == "ok", r
        pids = ks.run("%%monarch\nimport os\nos.getpid()").text
        started = os.path.join(runtime, "restart-started")
        ks.execute("%%monarch\nimport time\nfor step in range(12):\n"
                   f"    if step == 1 and rank == 0:\n        open({started!r}, 'w').close()\n"
                   "    time.sleep(0.25)\nprint('restart survived', rank)\nrank * 7")
        wait_for(lambda: os.path.exists(started), 30)
        old = ks.pid
        ks.km.restart_kernel(now=False)
        assert ks.pid != old
        wait_for(lambda: ks.km.is_alive(), 30)
        ks.drain(1.0)
        assert ks.run("%load_ext monarch_nb", timeout=60).status == "ok"
        r = ks.run("%monarch attach nb2", timeout=60)
        assert r.status == "ok" and "attached to kept mesh 'nb2'" in r.text, r
        attached = r.text
        r = ks.run("%monarch wait", timeout=60)
        assert "restart survived" in r.text, (attached, r)
        assert ks.run("%%monarch\nimport os\nos.getpid()").text == pids
        assert ks.run("%monarch stop").status == "ok"
        wait_for(lambda: Mesh.list() == [], 10)
    finally:
        ks.end()
