"""Host agents (procs/hostagent.py, procs/agents.py): one per host, on real
rank processes. Hosts are names here and the remote shell is ``sh -c``
(``MONARCH_NB_SSH``), so every "host" is this machine but reached the way
the ssh launcher reaches one; tests/test_netns.py does it across network
namespaces, where a lost host is a namespace removed.

* one agent per host, never one session per rank; a call to its ranks is
  one message to the host, their results come back batched;
* a killed remote rank comes back from its host's warm spare;
* a stopped (SIGSTOP) remote rank is seen as stopped through its agent;
* a lost host (its agent and ranks killed): without a spare host its ranks
  are LOST with the host named and the mesh stays usable, and a host given
  later (``add_hosts``) takes them at once; with a spare host they
  come back there on their own, with their rank numbers;
* without a spare host, an elastic call running when the host is lost (its
  agent killed, or frozen) ends within ``host_timeout`` + 2 s naming the
  host, and a call waiting for a rank's respawn backoff there goes out;
* the agent channel drops what is not one of its messages.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from monarch_nb import MembershipChanged, Mesh, MonarchError, RankDied, RankErrors, UsageError
from monarch_nb.procs import agentwire
from monarch_nb.ui.status import format_status
from monarch_nb.wire.protocol import Kind

from .conftest import wait_for

ALL_REDUCE = "x = torch.ones(1)\ndist.all_reduce(x)\nx.item()"


def _agents() -> dict[str, psutil.Process]:
    """This process's host agents, by host (the name is the last word of
    the ``sh -c`` parent's command)."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if "monarch_nb.agent" in cmd:
            out[str(p.pid)] = p
    return out


def _workers(agent: psutil.Process) -> list[psutil.Process]:
    try:
        return [c for c in agent.children() if "monarch_nb.worker" in c.cmdline()]
    except psutil.Error:
        return []


def _spare_waits(agent: psutil.Process, ranks: set[int]) -> bool:
    """``agent`` holds a spare that imported torch (it says so in its log)."""
    from monarch_nb.config import SPARE_WAITING

    for proc in _workers(agent):
        if proc.pid in ranks:
            continue
        try:
            path = os.readlink(f"/proc/{proc.pid}/fd/1")
            if not os.path.basename(path).startswith("spare"):
                continue  # the agent's warm process (warm<n>.log), which forks ranks
            with open(path, "rb") as log:
                return SPARE_WAITING.encode() in log.read(4096)
        except OSError:
            return False
    return False


def _agent_of(pid: int) -> psutil.Process:
    return next(a for a in _agents().values() if pid in [c.pid for c in _workers(a)])


def _lose(agent: psutil.Process) -> None:
    """The host is gone: its agent and everything it started, at once."""
    procs = [agent, *agent.children(recursive=True)]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    _tidy(agent.pid)


def _tidy(pid: int) -> None:
    """A killed agent leaves its folder (on a real lost host it goes with the host)."""
    import glob
    import shutil
    import tempfile

    for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"monarch-nb-agent-{pid}-*")):
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def two_hosts(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    monkeypatch.setenv("MONARCH_NB_SSH", "sh -c")
    yield {"n": "4", "hosts": "hA,hB"}


def _start(spare_hosts: str = "", **options: Any) -> Mesh:
    mesh = Mesh.start(n=4, backend="cpu", launcher="ssh", hosts="hA,hB", bind="127.0.0.1",
                      master_addr="127.0.0.1", start_timeout=90, spare_hosts=spare_hosts,
                      **options)
    mesh.exec("import torch, torch.distributed as dist")
    return mesh


def test_one_agent_per_host_and_a_killed_rank_comes_from_its_spare(two_hosts: dict) -> None:
    mesh = _start()
    try:
        agents = _agents()
        assert len(agents) == 2, agents  # 4 ranks, 2 hosts: 2 sessions
        assert not [p for p in psutil.Process().children(recursive=True)
                    if "worker" in p.cmdline() and "--key-file" in p.cmdline()]  # no per-rank session
        pids = mesh.run(os.getpid)
        # each agent started two of the ranks (and maybe its spare already)
        by_agent = [{c.pid for c in _workers(a)} for a in agents.values()]
        assert sorted(len(set(pids.values()) & mine) for mine in by_agent) == [2, 2], by_agent
        # one message per host each way: a call to the 4 ranks is 2 fan-outs,
        # their 4 results come back in the agents' batches (wire/relay.py)
        relayed = mesh._ctl.io.relayed
        before = dict(relayed)
        assert mesh.run(lambda: 7) == dict.fromkeys(range(4), 7)
        # (a ping may fall in between: it is one message per host too)
        assert relayed["fan-outs"] - before["fan-outs"] in (2, 4), relayed
        # (equal results of one host's ranks may come folded: one message for them, fold.py)
        carried = Counter(relayed)
        carried.subtract(before)
        assert carried["messages"] - carried["folds"] + carried["folded"] >= 4, relayed
        assert carried["batches"] <= carried["messages"], relayed
        # a host's ranks that answer alike within one turn of its relay come up
        # as one fold, verified and signed by their agent (wire/fold.py)
        for _ in range(200):
            if relayed["folds"]:
                break
            assert mesh.run(abs, -3) == dict.fromkeys(range(4), 3)
        assert relayed["folds"] and relayed["folded"] >= 2 * relayed["folds"], relayed
        assert not mesh.dropped, mesh.dropped
        # each host keeps a warm spare once its ranks started
        wait_for(lambda: all(_spare_waits(a, set(pids.values())) for a in _agents().values()),
                 timeout=90, what="a spare with torch imported on each host")
        mesh.ranks(3).exec("print('before the kill', flush=True)")
        mesh.kill(3)
        assert mesh.exec(ALL_REDUCE, timeout=60) == dict.fromkeys(range(4), 4.0)
        started = [e for e in mesh.events if e["rank"] == 3 and e["kind"] == "started"]
        assert started[-1]["incarnation"] == 1 and "from a spare" in started[-1]["detail"], started
        # the dead process's routes and replay windows are gone, the new one's are there
        io = mesh._ctl.io
        assert set(io.routes) == {i for info in mesh._ctl.ranks
                                  for i in (info.main_id, info.ctl_id)}, set(io.routes)
        assert not [w for w in mesh._ctl.codec._windows if w.startswith("r3.0.")]
        # its log came back through the agent, both incarnations
        text = "\n".join(mesh.logs(3, tail=20))
        assert "before the kill" in text and "killed by SIGKILL" in text, text
        assert mesh.status()[3]["state"] == "ready"
    finally:
        mesh.stop()
    wait_for(lambda: not _agents(), timeout=20, what="the agents to end with the mesh")


def test_output_stacks_interrupts_and_heartbeats_go_through_the_agents(two_hosts: dict) -> None:
    """Both of a remote rank's channels are links to its agent: output,
    stacks, an interrupt and the heartbeats all travel in the host's one
    connection, and no rank has a socket of its own to the controller."""
    from monarch_nb.controller.calls.output import CallOutput

    mesh = _start()
    try:
        io = mesh._ctl.io
        assert set(io.routes) == {i for info in mesh._ctl.ranks
                                  for i in (info.main_id, info.ctl_id)}, set(io.routes)
        # no rank has a connection of its own to the controller; each agent has one
        port = int(io.endpoint.rsplit(":", 1)[1])

        def to_controller(proc: psutil.Process) -> int:
            return sum(1 for c in proc.net_connections(kind="tcp")
                       if c.raddr and c.raddr.port == port)

        pids = mesh.run(os.getpid)
        assert [to_controller(psutil.Process(p)) for p in pids.values()] == [0, 0, 0, 0]
        assert sorted(to_controller(a) for a in _agents().values()) == [1, 1]
        heard_before = dict(io.relayed)
        seen: list[tuple[str, str]] = []
        out = CallOutput(lambda stream, text: seen.append((stream, text)))
        code = "import os\nprint('hello from', os.environ['RANK'])"
        fut = mesh._ctl.submit(Kind.EXEC, (0, 1, 2, 3), [], {"code": code, "name": "<t>"}, out)
        assert mesh.wait(fut, timeout=60) == dict.fromkeys(range(4))
        text = "".join(t for stream, t in seen if stream == "stdout")
        for r in range(4):
            assert f"[{r}] hello from {r}\n" in text, seen
        stacks = mesh.stacks()
        assert sorted(stacks) == [0, 1, 2, 3], stacks
        slow = mesh.exec_async("import time\ntime.sleep(60)")
        wait_for(lambda: all(r["state"] == "busy" for r in mesh.status()), timeout=30,
                 what="the ranks to be busy")
        assert slow.cancel()
        assert mesh.run(lambda: "back", timeout=30) == dict.fromkeys(range(4), "back")
        # heartbeats keep coming while nobody calls, a host's of a moment in one
        # BEATS of its agent (wire/fold.py), and the ranks' health with them
        before = io.relayed["beats"]
        wait_for(lambda: io.relayed["beats"] >= before + 8, timeout=10,
                 what="heartbeats through the agents")
        assert all(r["rss"] for r in mesh.status()), mesh.status()  # from their heartbeats
        assert io.relayed["batches"] > heard_before["batches"]
        assert not mesh.dropped, mesh.dropped
        assert all(r["incarnation"] == 0 for r in mesh.status())  # none died on the way
    finally:
        mesh.stop()


def test_a_stopped_remote_rank_is_seen_through_its_agent(two_hosts: dict) -> None:
    mesh = _start()
    try:
        pid = mesh.run(os.getpid)[1]
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: mesh.status()[1]["incarnation"] == 1
                 and mesh.status()[1]["state"] == "ready", timeout=60, what="rank 1 replaced")
        died = [e for e in mesh.events if e["rank"] == 1 and e["kind"] == "died"]
        assert "stopped by a signal" in died[-1]["detail"], died
        assert mesh.exec(ALL_REDUCE, timeout=60) == dict.fromkeys(range(4), 4.0)
    finally:
        mesh.stop()


def test_the_debugger_relay_and_a_breakpoint_through_the_agents(
        two_hosts: dict, capsys: pytest.CaptureFixture[str]) -> None:
    # prompts (PROMPT) come up and typed lines (INPUT) go down each rank's
    # control link through its agent, as for a local rank's
    from .test_debugging import Script

    mesh = _start()
    try:
        with pytest.raises(Exception, match="ZeroDivisionError"):
            mesh.ranks(3).exec("def g(x):\n    return x / 0\ng(21)\n", name="<mnb-cell-4>")
        capsys.readouterr()
        script = Script("p x * 2", "q")
        mesh._ctl.ask = script
        mesh.debug(3)
        out = capsys.readouterr().out
        assert script.prompts == ["[rank 3] (Pdb) "] * 2, script.prompts
        assert "[3] post-mortem of ZeroDivisionError" in out and "[3] 42" in out, out
        script = Script("p a + 100", "c")
        mesh._ctl.ask = script
        assert mesh.ranks(2).exec("a = 1\nbreakpoint()\na * 5\n", name="<mnb-cell-5>") == {2: 5}
        assert script.prompts[0] == "[rank 2] (Pdb) " and "[2] 101\n" in capsys.readouterr().out
        assert mesh.run(lambda: "fine") == dict.fromkeys(range(4), "fine")
    finally:
        mesh._ctl.ask = None
        mesh.stop()


HOLD_GIL = "import ctypes\nctypes.PyDLL(None).sleep({seconds})\n'ok'"  # keeps the GIL


def test_a_remote_rank_holding_the_gil_past_the_controller_timeout_stays(two_hosts: dict
                                                                         ) -> None:
    # Its control thread cannot read the pings its agent relays while the main
    # thread holds the GIL; once it runs again they are waiting there: that is
    # not a silent controller (the rank used to exit, "controller silent").
    mesh = Mesh.start(n=2, backend="cpu", launcher="ssh", hosts="hA,hB", bind="127.0.0.1",
                      master_addr="127.0.0.1", start_timeout=90, heartbeat_timeout=1.0,
                      controller_timeout=2.0)
    try:
        for _ in range(2):
            assert mesh.ranks(1).exec(HOLD_GIL.format(seconds=5), timeout=60) == {1: "ok"}
        assert mesh.status()[1]["incarnation"] == 0
        assert not [e for e in mesh.events if e["kind"] == "died"], mesh.events
        busy = [e for e in mesh.events if e["kind"] == "busy_silent"]
        assert busy and busy[0]["rank"] == 1, mesh.events  # seen busy through its agent, kept
    finally:
        mesh.stop()


def test_a_lost_host_without_a_spare_then_a_host_given_later(two_hosts: dict) -> None:
    mesh = _start()
    try:
        pid = mesh.run(os.getpid)[2]
        _lose(_agent_of(pid))
        wait_for(lambda: [s["state"] for s in mesh.status()][2:] == ["lost", "lost"], timeout=30,
                 what="ranks 2,3 lost with their host")
        died = [e for e in mesh.events if e["kind"] == "died" and e["rank"] in (2, 3)]
        assert all("host hB lost" in e["detail"] for e in died), died
        assert mesh.status()[2]["restarts"] == 0  # no restart budget spent on a host that is gone
        # status and its table name the host: the dashboard shows the same (lost_host)
        rows = mesh.status()
        assert [(r["lost_host"], r["exit"]) for r in rows] == [("", ""), ("", "")] + [
            ("hB", "its host hB was lost")] * 2, rows
        assert "lost: host hB (rank 2,3): mesh.add_hosts('HOST') gives the mesh a host for " \
            "rank 2,3: they start there" in format_status(mesh), format_status(mesh)
        with pytest.raises(MonarchError, match=r"rank 2 is dead \(its host was lost\); .*"
                           r"mesh.add_hosts"):
            mesh.exec(ALL_REDUCE, timeout=30)
        assert mesh.ranks(0).run(lambda: "still here") == {0: "still here"}  # usable
        with pytest.raises(UsageError, match="already run ranks"):
            mesh.add_hosts("hA")
        mesh.add_hosts("hC")  # ranks 2,3 start there: no restart asked
        wait_for(lambda: all(s["state"] == "ready" for s in mesh.status()), timeout=90,
                 what="ranks 2,3 back on hC")
        mesh.exec("import torch, torch.distributed as dist")
        assert mesh.exec(ALL_REDUCE, timeout=60) == dict.fromkeys(range(4), 4.0)
        assert mesh._ctl.supervisor.launcher.hosts() == ["hA", "hC"]  # type: ignore[attr-defined]
        assert [r["lost_host"] for r in mesh.status()] == [""] * 4
        assert "lost:" not in format_status(mesh)
    finally:
        mesh.stop()


def test_a_lost_host_with_a_spare_host_comes_back_there(two_hosts: dict) -> None:
    mesh = _start(spare_hosts="hC")
    try:
        pid = mesh.run(os.getpid)[3]
        _lose(_agent_of(pid))
        wait_for(lambda: all(s["state"] == "ready" and s["incarnation"] >= 1
                             for s in mesh.status()[2:]), timeout=90, what="ranks 2,3 on hC")
        assert [s["state"] for s in mesh.status()[:2]] == ["ready", "ready"]
        assert mesh._ctl.supervisor.launcher.hosts() == ["hA", "hC"]  # type: ignore[attr-defined]
        assert [r["lost_host"] for r in mesh.status()] == [""] * 4
        assert "lost:" not in format_status(mesh)
        mesh.exec("import torch, torch.distributed as dist")  # (setup cells are replayed too)
        assert mesh.exec(ALL_REDUCE, timeout=60) == dict.fromkeys(range(4), 4.0)
        assert any("host hB lost" in e["detail"] for e in mesh.events if e["kind"] == "died")
    finally:
        mesh.stop()
    wait_for(lambda: not _agents(), timeout=20, what="the agents to end with the mesh")


def test_a_spare_host_must_be_free_and_needs_a_multi_host_launcher(two_hosts: dict) -> None:
    with pytest.raises(UsageError, match="already run ranks"):
        Mesh.start(n=2, backend="cpu", launcher="ssh", hosts="hA,hB", spare_hosts="hB")
    with pytest.raises(UsageError, match="spare hosts need"):
        Mesh.start(n=2, backend="cpu", spare_hosts="hB")
    with pytest.raises(UsageError, match="host_timeout"):
        Mesh.start(n=2, backend="cpu", host_timeout=0)


# -- the channel ----------------------------------------------------------------------------
def test_agent_messages_round_trip_and_wrong_fields_are_refused() -> None:
    line = agentwire.encode("spawn", sid=1, rank=2, inc=0, env={"A": "b"}, spare=True, relay="agent.a.1",
                            fork=True, preload=["json"])
    assert agentwire.decode(line, agentwire.TO_AGENT)["env"] == {"A": "b"}
    for bad in (b"", b"[]", b'{"op": "spawn"}', b'{"op": "nope"}',
                agentwire.encode("spawn", sid=True, rank=2, inc=0, env={}, spare=True, relay="",
                                 fork=True, preload=[]),
                agentwire.encode("exit", sid=1, code="0", flight=""),
                agentwire.encode("started", sid=1, pid=3, spare=True)):  # not to an agent
        with pytest.raises(ValueError):
            agentwire.decode(bad, agentwire.TO_AGENT)
    with pytest.raises(ValueError):
        agentwire.string_map({"A": 1})


@given(st.binary(max_size=200))
def test_any_bytes_are_a_message_or_a_value_error(data: bytes) -> None:
    for kinds in (agentwire.TO_AGENT, agentwire.FROM_AGENT):
        try:
            msg = agentwire.decode(data, kinds)
        except ValueError:
            continue
        assert msg["op"] in kinds


@given(st.dictionaries(st.sampled_from(["op", "sid", "pid", "code", "flight", "data", "spare"]),
                       st.one_of(st.integers(), st.text(max_size=5), st.booleans(), st.none(),
                                 st.sampled_from(list(agentwire.FROM_AGENT)))))
def test_json_objects_of_the_wrong_shape_are_refused(obj: dict) -> None:
    try:
        msg = agentwire.decode(json.dumps(obj).encode(), agentwire.FROM_AGENT)
    except ValueError:
        return
    for name, typ in agentwire.FROM_AGENT[msg["op"]].items():
        assert isinstance(msg[name], typ) and (typ is bool or not isinstance(msg[name], bool))


TRAIN = """
import time, torch, torch.distributed as dist, monarch_nb as mnb
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
state = mnb.elastic.State(model=model, optimizer=opt, step=0)

@mnb.elastic.run(state)
def train(state):
    ddp = DDP(model, find_unused_parameters=True)
    while state.step < 60:
        g = torch.Generator().manual_seed(1000 * state.step + mnb.rank())
        x = torch.randn(16, 8, generator=g)
        y = x.sum(1, keepdim=True)
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
        state.step += 1
        state.commit()
        if mnb.rank() == 0:
            open(PROGRESS, "w").write(str(state.step))
        time.sleep(PAUSE)
    return [p.detach().clone() for p in model.parameters()], state.step

train()
"""


def _step(progress: Path) -> int:
    """The step rank 0 wrote last; 0 before it writes (or while it writes)."""
    text = progress.read_text() if progress.exists() else ""
    return int(text) if text.isdigit() else 0


def test_an_elastic_training_cell_survives_a_lost_host_on_a_spare(two_hosts: dict,
                                                                  tmp_path: Path) -> None:
    import torch

    progress = tmp_path / "step"
    cell = TRAIN.replace("PROGRESS", repr(str(progress)))
    mesh = _start(spare_hosts="hC")
    try:
        clean = mesh.exec(cell.replace("PAUSE", "0"), elastic=True, timeout=300)
        progress.unlink()
        future = mesh.exec(cell.replace("PAUSE", "0.05"), elastic=True, block=False)
        wait_for(lambda: _step(progress) >= 20, timeout=120, what="step 20")
        _lose(_agent_of(mesh.status()[3]["pid"]))
        faulted = future.result(timeout=300)
        for rank in range(4):  # the same model as the unfaulted run, every step done
            params, steps = faulted[rank]
            assert steps == 60
            assert all(torch.equal(a, b) for a, b in zip(params, clean[rank][0], strict=True)), rank
        assert mesh._ctl.supervisor.launcher.hosts() == ["hA", "hC"]  # type: ignore[attr-defined]
        assert [r["lost_host"] for r in mesh.status()] == [""] * 4
        assert "lost:" not in format_status(mesh)
        assert [s["incarnation"] for s in mesh.status()] == [0, 0, 1, 1]
    finally:
        mesh.stop()


@pytest.mark.parametrize("how", ["killed", "silent"])
def test_a_lost_host_without_a_spare_ends_a_running_elastic_call(two_hosts: dict, tmp_path: Path,
                                                                 how: str) -> None:
    """No spare host: the elastic training cell cannot go on without host
    hB's ranks. The survivors wait for a re-formation that will not come
    (their own timeout is 300 s); the controller knows when it declares the
    host lost and tells them: the call ends within ``host_timeout`` + 2 s of
    the loss, every error naming the host, and the survivors answer the next
    call at once. ``killed``: the agent and its ranks killed (its session
    ends: lost at once); ``silent``: the ranks killed, the agent frozen
    (lost after ``host_timeout`` of silence)."""
    host_timeout = 3.0
    progress = tmp_path / "step"
    cell = (TRAIN.replace("PROGRESS", repr(str(progress))).replace("PAUSE", "0.05")
            .replace("state.step < 60", "state.step < 10**6"))
    mesh = _start(host_timeout=host_timeout)
    agent = None
    try:
        future = mesh.exec(cell, elastic=True, block=False)
        wait_for(lambda: _step(progress) >= 5, timeout=120, what="the training loop to run")
        agent = _agent_of(mesh.status()[3]["pid"])
        t0 = time.monotonic()
        if how == "killed":
            _lose(agent)
        else:
            agent.suspend()
            for proc in _workers(agent):  # (zombies until the agent is killed with its host)
                proc.kill()
        err = future.exception(timeout=host_timeout + 30)  # a hang fails here
        ended = time.monotonic() - t0
        assert isinstance(err, RankErrors), repr(err)
        print(f"\nlost host ({how}): the elastic call ended {ended:.2f} s after the loss "
              f"(host_timeout {host_timeout:g} s)")
        text = str(err)
        assert ended <= host_timeout + 2, text
        assert sorted(err.errors) == [0, 1, 2, 3], text
        for r in (2, 3):
            assert isinstance(err.errors[r], RankDied) and "host hB lost" in str(err.errors[r]), text
        for r in (0, 1):
            assert isinstance(err.errors[r], MembershipChanged), text
            assert err.errors[r].dead == (2, 3), text
            assert "host hB lost" in str(err.errors[r]), text
            assert "no re-formation" in str(err.errors[r]), text
        t1 = time.monotonic()
        assert mesh.ranks("0,1").run(lambda: "here", timeout=10) == {0: "here", 1: "here"}
        print(f"the survivors answered the next call {time.monotonic() - t1:.2f} s later")
        assert [s["state"] for s in mesh.status()] == ["ready", "ready", "lost", "lost"]
    finally:
        mesh.stop()
        if agent is not None:
            _tidy(agent.pid)


def test_a_call_waiting_for_a_backoff_goes_out_when_the_host_is_lost(two_hosts: dict) -> None:
    """Rank 2 died again before it answered anything: its respawn waits out a
    backoff (made 30 s here), and so does a call issued meanwhile. Its host is
    then lost with no spare: the re-formation that call waits for will not
    come, so it goes out at once to the ranks that are there, and fails for
    the lost ones naming the host."""
    mesh = _start(host_timeout=3.0)
    try:
        mesh._ctl.recovery.policy.base = 30.0  # a long backoff: the call waits for sure
        assert mesh.run(lambda: 1)[2] == 1  # rank 2 answered: its first death is no loop
        mesh.kill(2)
        wait_for(lambda: mesh.status()[2]["state"] == "ready" and mesh.status()[2]["incarnation"]
                 == 1, timeout=60, what="rank 2 back")
        mesh.kill(2)  # before it answered anything: backed off
        wait_for(lambda: mesh.status()[2]["state"] == "waiting", timeout=10,
                 what="rank 2 waiting out its backoff")
        future = mesh.run_async(lambda: "ran")
        agent = _agent_of(mesh.status()[3]["pid"])
        t0 = time.monotonic()
        _lose(agent)
        err = future.exception(timeout=30)  # (it waited for the backoff: 30 s)
        ended = time.monotonic() - t0
        assert isinstance(err, RankErrors), repr(err)
        assert ended < 3.0 + 2, ended
        assert err.results == {0: "ran", 1: "ran"}, err
        assert sorted(err.errors) == [2, 3] and "host hB lost" in str(err), str(err)
        assert [(r["state"], r["lost_host"]) for r in mesh.status()[2:]] == [("lost", "hB")] * 2
    finally:
        mesh.stop()


def test_open_all_opens_every_door_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """At attach every host's door is opened side by side: 128 slow doors
    (ssh, the door's interpreter) cost one door's time, not one per round of
    a smaller pool. No process: HostAgent is a stand-in."""
    import threading

    from monarch_nb.procs import agents as agents_mod

    at_once = [0, 0]  # now, most
    lock = threading.Lock()
    all_in = threading.Event()

    class SlowDoor:
        def __init__(self, host: str, *args: Any) -> None:
            with lock:
                at_once[0] += 1
                at_once[1] = max(at_once[1], at_once[0])
                if at_once[0] == 128:
                    all_in.set()
            # each door stays open until every one is (a pool of fewer than
            # 128 never gets there: its doors give up after 10 s, the test fails)
            all_in.wait(10)
            with lock:
                at_once[0] -= 1
            self.host, self.lost = host, ""

    monkeypatch.setattr(agents_mod, "HostAgent", SlowDoor)
    hosts = [f"h{i}" for i in range(128)]
    launcher = agents_mod.AgentLauncher(
        agents_mod.SshLauncher(nodes=list(hosts), per_node=1, master="h0"))
    launcher._closed = True  # (no watcher pinging the stand-ins)
    opened = launcher.open_all(hosts, "/nonexistent")
    assert [a.host for a in opened] == hosts
    assert at_once[1] == 128
