"""The ranks' debugger through the Python API (``mesh.debugger()``), the layer
JupyterLab's panel is built on (ui/labdebug.py): real ranks, real messages.

One 3-rank mesh, rank 1 debugged: a breakpoint in a cell stops rank 1 while
ranks 0 and 2 wait in their all_reduce; its frames, scopes, variables (paged)
and expressions are read, it is stepped and continued, and every rank's
output arrives. Then a pause, an interrupt while stopped, a post-mortem, and
the rank's debugger after a respawn; remote ranks through their host's agent.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from monarch_nb import Mesh
from monarch_nb.controller.rankdebug import RankDebugger
from monarch_nb.errors import RankErrors

from .conftest import wait_for

CELL = ("import torch, torch.distributed as dist\n"       # 1
        "scale = 3\n"                                     # 2
        "def work(x):\n"                                  # 3
        "    y = x * scale\n"                             # 4
        "    return y + 1\n"                              # 5
        "big = list(range(50))\n"                         # 6
        "v = work(rank + 1)\n"                            # 7
        "t = torch.ones(2) * v\n"                         # 8
        "dist.all_reduce(t)\n"                            # 9
        "print('rank', rank, 'got', t.tolist())\n")       # 10


@pytest.fixture(scope="module")
def mesh3() -> Iterator[Mesh]:
    mesh = Mesh.start(n=3, backend="cpu")
    try:
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture
def dbg(mesh3: Mesh) -> Iterator[tuple[RankDebugger, list[dict[str, Any]]]]:
    handle = mesh3.debugger(1)
    events: list[dict[str, Any]] = []
    handle.listeners.append(events.append)
    try:
        yield handle, events
    finally:
        handle.listeners.remove(events.append)
        for name in list(handle.breakpoints):
            handle.set_breakpoints(name, []).result(10)
        mesh3.debugger(off=True)


def _stopped(events: list[dict[str, Any]], n: int = 1) -> dict[str, Any]:
    wait_for(lambda: sum(e["event"] == "stopped" for e in events) >= n, timeout=30,
             what=f"stop number {n}")
    return [e for e in events if e["event"] == "stopped"][n - 1]


def test_breakpoint_stops_the_debugged_rank_only(mesh3: Mesh, dbg: Any) -> None:
    handle, events = dbg
    assert handle.selected == (1,)
    assert handle.set_breakpoints("<mnb-cell-rd1>", [4]).result(10)["answered"] == 3
    fut = mesh3.exec_async(CELL, name="<mnb-cell-rd1>")
    stop = _stopped(events)
    assert (stop["rank"], stop["reason"], stop["file"], stop["line"]) == (1, "breakpoint",
                                                                           "<mnb-cell-rd1>", 4)
    # the others went on to the all_reduce, where they wait as for a slow rank
    stacks = mesh3.stacks([0, 2]).render()
    assert "all_reduce" in stacks, stacks
    assert not fut.done()

    frames = handle.request(1, "stackTrace", {}).result(10)
    assert [(f["name"], f["file"], f["line"]) for f in frames["stackFrames"]] == [
        ("work", "<mnb-cell-rd1>", 4), ("<module>", "<mnb-cell-rd1>", 7)]
    scopes = handle.request(1, "scopes", {"frameId": 1}).result(10)["scopes"]
    assert [s["name"] for s in scopes] == ["Locals", "Globals"]
    local = handle.request(1, "variables", {"variablesReference": scopes[0]["variablesReference"]}
                           ).result(10)["variables"]
    assert [(v["name"], v["value"]) for v in local] == [("x", "2")]
    module = handle.request(1, "scopes", {"frameId": 2}).result(10)["scopes"]
    assert [s["name"] for s in module] == ["Globals"]  # a cell's frame: its locals are its globals
    names = {v["name"]: v for v in handle.request(
        1, "variables", {"variablesReference": module[0]["variablesReference"]}).result(10)["variables"]}
    assert names["scale"]["value"] == "3" and "__builtins__" not in names
    # a container, paged
    big = names["big"]
    assert big["indexedVariables"] == 50 and big["variablesReference"]
    page = handle.request(1, "variables", {"variablesReference": big["variablesReference"],
                                           "start": 10, "count": 5}).result(10)["variables"]
    assert [(v["name"], v["value"]) for v in page] == [(str(i), str(i)) for i in range(10, 15)]
    assert handle.request(1, "evaluate", {"expression": "x * 100 + scale", "frameId": 1}
                          ).result(10)["result"] == "203"
    with pytest.raises(RuntimeError, match="NameError"):
        handle.request(1, "evaluate", {"expression": "nope", "frameId": 1}).result(10)

    handle.request(1, "next", {}).result(10)
    step = _stopped(events, 2)
    assert (step["reason"], step["line"]) == ("step", 5)
    assert handle.request(1, "evaluate", {"expression": "y", "frameId": 1}).result(10)["result"] == "6"
    handle.request(1, "stepOut", {}).result(10)
    out = _stopped(events, 3)
    assert (out["line"], out["file"]) == (7, "<mnb-cell-rd1>")
    handle.request(1, "continue", {}).result(10)
    assert mesh3.wait(fut, 30) is not None
    assert handle.stopped == {}
    # a rank that is not stopped says so
    with pytest.raises(RuntimeError, match="not stopped"):
        handle.request(1, "stackTrace", {}).result(10)


def test_pause_and_interrupt_while_stopped(mesh3: Mesh, dbg: Any) -> None:
    handle, events = dbg
    cell = ("import time\n"
            "n = 0\n"
            "while n < 10**9:\n"
            "    n += 1\n"
            "    time.sleep(0.001)\n")
    fut = mesh3[1].exec_async(cell, name="<mnb-cell-rd2>")
    try:
        # "busy" is the controller's view (the call was sent); the rank
        # pauses once its main thread runs the call, and says so till then
        wait_for(lambda: _paused(handle), timeout=30, what="rank 1 to take the pause")
        stop = _stopped(events)
        assert stop["reason"] == "pause" and stop["file"] == "<mnb-cell-rd2>" and stop["line"] in (3, 4, 5)
    finally:  # an interrupt while it stands stopped ends the call cleanly
        mesh3._ctl.interrupt(fut.call_id)
    with pytest.raises(RankErrors, match="KeyboardInterrupt"):
        mesh3.wait(fut, 30)
    wait_for(lambda: not handle.stopped, what="the stop to end")
    assert mesh3.exec("1 + 1") == {0: 2, 1: 2, 2: 2}


def _paused(handle: RankDebugger) -> bool:
    try:
        handle.request(1, "pause", {}).result(10)
    except RuntimeError as exc:
        if "runs no call" in str(exc):
            return False
        raise
    return True


def test_post_mortem_of_a_failed_call(mesh3: Mesh, dbg: Any) -> None:
    handle, events = dbg
    with pytest.raises(RankErrors):
        mesh3.exec("def boom(a):\n    b = a - 1\n    return a / b\nboom(1)\n", name="<mnb-cell-rd3>")
    failed = wait_for(lambda: [e for e in events if e["event"] == "failed"], what="failed event")
    assert [e["rank"] for e in failed] == [1]  # the debugged rank only
    assert "ZeroDivisionError" in failed[0]["error"]
    frames = handle.request(1, "stackTrace", {}, thread="pm").result(10)["stackFrames"]
    assert [(f["name"], f["line"]) for f in frames] == [("boom", 3), ("<module>", 4)]
    scopes = handle.request(1, "scopes", {"frameId": 1}, thread="pm").result(10)["scopes"]
    local = handle.request(1, "variables", {"variablesReference": scopes[0]["variablesReference"]},
                           thread="pm").result(10)["variables"]
    assert {v["name"]: v["value"] for v in local} == {"a": "1", "b": "0"}
    # the post-mortem is read while the rank runs other calls
    assert mesh3[1].exec("boom.__name__") == {1: "boom"}


def test_a_respawned_rank_gets_its_breakpoints_again(mesh3: Mesh, dbg: Any) -> None:
    handle, events = dbg
    handle.set_breakpoints("<mnb-cell-rd4>", [2]).result(10)
    mesh3.kill(1)
    wait_for(lambda: mesh3.status()[1]["incarnation"] == 1 and mesh3.status()[1]["state"] == "ready",
             timeout=60, what="rank 1 back")
    box: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append(mesh3[1].exec("a = 1\na = 2\n", name="<mnb-cell-rd4>"))
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    stop = _stopped(events)
    assert (stop["rank"], stop["line"]) == (1, 2)
    handle.request(1, "continue", {}).result(10)
    assert done.wait(30)


def test_remote_ranks_through_their_agents(monkeypatch: pytest.MonkeyPatch) -> None:
    # ranks on "hosts" reached as the ssh launcher reaches them (tests/test_agents.py):
    # the debugger's requests go down, its answers and stops come up, through each
    # host's agent, as for a local rank
    monkeypatch.setenv("MONARCH_NB_SSH", "sh -c")
    mesh = Mesh.start(n=4, backend="cpu", launcher="ssh", hosts="hA,hB", bind="127.0.0.1",
                      master_addr="127.0.0.1", start_timeout=90)
    try:
        assert mesh._ctl.supervisor.launcher.remote  # every rank behind an agent
        handle = mesh.debugger(3)  # on hB
        events: list[dict[str, Any]] = []
        handle.listeners.append(events.append)
        handle.set_breakpoints("<mnb-cell-rd5>", [4]).result(10)
        fut = mesh.exec_async(CELL, name="<mnb-cell-rd5>")
        stop = _stopped(events)
        assert (stop["rank"], stop["line"]) == (3, 4)
        frames = handle.request(3, "stackTrace", {}).result(10)["stackFrames"]
        assert frames[-1]["file"] == "<mnb-cell-rd5>"
        assert handle.request(3, "evaluate", {"expression": "rank * 11"}).result(10)["result"] == "33"
        handle.set_breakpoints("<mnb-cell-rd5>", []).result(10)
        handle.request(3, "continue", {}).result(10)
        assert mesh.wait(fut, 60) is not None
        with pytest.raises(RankErrors):
            mesh.exec("def boom():\n    z = 7\n    return z / 0\nboom()\n", name="<mnb-cell-rd6>")
        wait_for(lambda: any(e["event"] == "failed" and e["rank"] == 3 for e in events),
                 what="rank 3's failure")
        scopes = handle.request(3, "scopes", {"frameId": 1}, thread="pm").result(10)["scopes"]
        local = handle.request(3, "variables", {"variablesReference": scopes[0]["variablesReference"]},
                               thread="pm").result(10)["variables"]
        assert [(v["name"], v["value"]) for v in local] == [("z", "7")]
    finally:
        mesh.stop()
