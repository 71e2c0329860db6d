"""JupyterLab's visual debugger on the ranks, through a real kernel: the
exact Jupyter debugger protocol messages JupyterLab 4 sends (DAP in
``debug_request`` on the control channel, ``debug_event`` on IOPub), driven
by jupyter_client, against a real 3-rank mesh.

One kernel, tests in file order: JupyterLab's start-up sequence; a gutter
breakpoint in a ``%%monarch`` cell (``dumpCell``, ``debugInfo``,
``setBreakpoints``) stops rank 1, read and stepped from the panel's
requests, then continued with every rank's output; a breakpoint in a
function an earlier cell defined; a plain cell still stops in the kernel's
own debugpy; the pause button and an interrupt while stopped; a failed cell's
post-mortem thread; a crashed rank's last stack; ``--off``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from monarch_nb.ui.dapmap import BASE

from .kernel_util import KernelSession, kernel_with_mesh

pytestmark = pytest.mark.kernel
ROOT = Path(__file__).resolve().parent.parent

# JupyterLab 4's own arguments (packages/debugger/src/session.ts)
INITIALIZE = {"clientID": "jupyterlab", "clientName": "JupyterLab", "adapterID": "python3",
              "pathFormat": "path", "linesStartAt1": True, "columnsStartAt1": True,
              "supportsVariableType": True, "supportsVariablePaging": True,
              "supportsRunInTerminalRequest": True, "locale": "en"}

CELL = ("%%monarch\n"                                   # 1
        "import torch, torch.distributed as dist\n"     # 2
        "def work(x):\n"                                # 3
        "    y = x * 3\n"                               # 4
        "    return y + 1\n"                            # 5
        "big = list(range(30))\n"                       # 6
        "v = work(rank + 1)\n"                          # 7
        "t = torch.ones(1) * v\n"                       # 8
        "dist.all_reduce(t)\n"                          # 9
        "print('rank', rank, 'got', t.item())\n")       # 10


@pytest.fixture(scope="module")
def ks() -> Iterator[KernelSession]:
    with kernel_with_mesh(3) as ks:
        yield ks


def _gutter_breakpoint(ks: KernelSession, code: str, lines: list[int]) -> str:
    """What JupyterLab sends when a breakpoint is clicked in a cell's gutter
    (DebuggerService.updateBreakpoints): its path."""
    path = str(ks.dap("dumpCell", {"code": code})["body"]["sourcePath"])
    ks.dap("debugInfo")
    reply = ks.dap("setBreakpoints", {"breakpoints": [{"line": n} for n in lines],
                                      "source": {"path": path}, "sourceModified": False})
    assert reply["success"], reply
    assert [b["line"] for b in reply["body"]["breakpoints"]] == lines
    return path


def _stopped(ks: KernelSession, after: int, **match: Any) -> dict[str, Any]:
    def fits(e: dict[str, Any]) -> bool:
        return e["event"] == "stopped" and all(e["body"].get(k) == v for k, v in match.items())
    return ks.debug_event(fits, timeout=90, after=after)["body"]


def _frames(ks: KernelSession, thread: int) -> list[dict[str, Any]]:
    reply = ks.dap("stackTrace", {"threadId": thread})
    assert reply["success"], reply
    return list(reply["body"]["stackFrames"])


def _variables(ks: KernelSession, ref: int, **paging: int) -> dict[str, dict[str, Any]]:
    reply = ks.dap("variables", {"variablesReference": ref, **paging})
    assert reply["success"], reply
    return {v["name"]: v for v in reply["body"]["variables"]}


def test_the_kernel_runs_this_checkout_and_starts_the_debugger(ks: KernelSession) -> None:
    r = ks.run("import monarch_nb\nprint(monarch_nb.__file__)")
    assert r.stdout.strip().startswith(str(ROOT)), r.stdout
    # JupyterLab's start: restoreState (debugInfo), then initialize and attach
    info = ks.dap("debugInfo")["body"]
    assert info["isStarted"] is False and info["hashMethod"] == "Murmur2"
    assert ks.dap("initialize", INITIALIZE)["success"]
    assert ks.dap("attach", {})["success"]
    assert ks.dap("configurationDone", {})["success"]
    assert ks.dap("debugInfo")["body"]["isStarted"] is True
    r = ks.run("%monarch debugger --ranks 1")
    assert r.status == "ok" and "debugs %%monarch cells on rank 1" in r.stdout, r
    r = ks.run("%monarch debugger --ranks 1 --off")
    assert r.status == "error" and "do not go together" in r.traceback


def test_gutter_breakpoint_stops_rank_1_and_the_panel_reads_it(ks: KernelSession) -> None:
    path = _gutter_breakpoint(ks, CELL, [4])
    assert {"source": path, "breakpoints": [{"line": 4}]} in ks.dap("debugInfo")["body"]["breakpoints"]
    seen = len(ks.debug_events)
    msg_id = ks.execute(CELL)
    stop = _stopped(ks, seen, reason="breakpoint")
    thread = stop["threadId"]
    threads = {t["id"]: t["name"] for t in ks.dap("threads")["body"]["threads"]}
    assert threads[thread] == "rank 1"
    assert thread in ks.dap("debugInfo")["body"]["stoppedThreads"]

    # the panel: call stack at the cell's own path and lines
    frames = _frames(ks, thread)
    assert [(f["name"], f["source"]["path"], f["line"]) for f in frames] == [
        ("work", path, 4), ("<module>", path, 7)]
    # variables of the top frame, as _onCurrentFrameChanged asks for them
    scopes = ks.dap("scopes", {"frameId": frames[0]["id"]})["body"]["scopes"]
    assert [s["name"] for s in scopes] == ["Locals", "Globals"]
    assert _variables(ks, scopes[0]["variablesReference"])["x"]["value"] == "2"
    module = ks.dap("scopes", {"frameId": frames[1]["id"]})["body"]["scopes"]
    glob = _variables(ks, module[0]["variablesReference"])
    assert glob["rank"]["value"] == "1" and glob["big"]["indexedVariables"] == 30
    page = _variables(ks, glob["big"]["variablesReference"], start=20, count=3)
    assert [(k, v["value"]) for k, v in page.items()] == [("20", "20"), ("21", "21"), ("22", "22")]
    evaluated = ks.dap("evaluate", {"expression": "x * 7 + rank", "frameId": frames[0]["id"],
                                    "context": "repl"})
    assert evaluated["success"] and evaluated["body"]["result"] == "15"
    rich = ks.dap("richInspectVariables", {"variableName": "x", "frameId": frames[0]["id"]})
    assert rich["body"]["data"] == {"text/plain": "2"}

    # stepping: next, then out to the caller's line
    seen = len(ks.debug_events)
    assert ks.dap("next", {"threadId": thread})["success"]
    _stopped(ks, seen, reason="step", threadId=thread)
    frames = _frames(ks, thread)
    assert (frames[0]["name"], frames[0]["line"]) == ("work", 5)
    y = ks.dap("evaluate", {"expression": "y", "frameId": frames[0]["id"], "context": "watch"})
    assert y["body"]["result"] == "6"
    seen = len(ks.debug_events)
    assert ks.dap("stepOut", {"threadId": thread})["success"]
    _stopped(ks, seen, reason="step", threadId=thread)
    frames = _frames(ks, thread)
    assert [(f["name"], f["line"]) for f in frames] == [("<module>", 7)]
    seen = len(ks.debug_events)
    assert ks.dap("stepIn", {"threadId": thread})["success"]
    _stopped(ks, seen, reason="step", threadId=thread)
    assert [(f["name"], f["line"]) for f in _frames(ks, thread)] == [("<module>", 8)]

    # continue: the cell completes with every rank's output
    seen = len(ks.debug_events)
    assert ks.dap("continue", {"threadId": thread})["success"]
    ks.debug_event(lambda e: e["event"] == "continued" and e["body"]["threadId"] == thread,
                   after=seen)
    r = ks.collect(msg_id, timeout=90)
    assert r.status == "ok", r
    for rank in range(3):
        assert f"[{rank}] rank {rank} got 21.0" in r.stdout, r.stdout
    assert thread not in ks.dap("debugInfo")["body"]["stoppedThreads"]
    # the breakpoint stays: clearing it lets the cell run through
    ks.dap("setBreakpoints", {"breakpoints": [], "source": {"path": path}, "sourceModified": False})
    assert ks.run(CELL, timeout=90).status == "ok"


def test_continue_as_jupyterlab_sends_it(ks: KernelSession) -> None:
    """JupyterLab 4's continue button (DebuggerService.continue) drops the
    thread it shows stopped from its model *before* it sends the request,
    which then names the first thread left, else thread 1: the kernel's main
    thread, which the kernel's debugpy has not stopped (forwarded there, the
    request is never answered and the control channel waits behind it). With
    ranks 0 and 1 debugged and both stopped, each press continues the rank
    shown (the last announced), and the other is shown next."""
    assert ks.run("%monarch debugger --ranks 0,1").status == "ok"
    cell = ("%%monarch\n"
            "v = rank + 100\n"
            "w = v * 2\n"
            "print('rank', rank, 'w', w)\n")
    path = _gutter_breakpoint(ks, cell, [3])
    seen = len(ks.debug_events)
    msg_id = ks.execute(cell)
    threads = {BASE + 0, BASE + 3}  # ranks 0 and 1
    for tid in threads:
        _stopped(ks, seen, threadId=tid)
    shown = [e["body"]["threadId"] for e in ks.debug_events[seen:] if e["event"] == "stopped"][-1]
    other = (threads - {shown}).pop()
    # the first press: JupyterLab's model held only the thread shown, so thread 1
    seen = len(ks.debug_events)
    reply = ks.dap("continue", {"threadId": 1}, timeout=30)
    assert reply["success"], reply
    ks.debug_event(lambda e: e["event"] == "continued" and e["body"]["threadId"] == shown,
                   after=seen)
    _stopped(ks, seen, threadId=other)  # shown again: JupyterLab shows the last stopped thread
    assert ks.dap("debugInfo")["body"]["stoppedThreads"] == [other]
    # the second press: the same request; the other rank runs on
    seen = len(ks.debug_events)
    assert ks.dap("continue", {"threadId": 1}, timeout=30)["success"]
    ks.debug_event(lambda e: e["event"] == "continued" and e["body"]["threadId"] == other,
                   after=seen)
    r = ks.collect(msg_id, timeout=90)
    assert r.status == "ok", r
    assert "[0] rank 0 w 200" in r.stdout and "[1] rank 1 w 202" in r.stdout, r.stdout
    ks.dap("setBreakpoints", {"breakpoints": [], "source": {"path": path}, "sourceModified": False})
    assert ks.run("%monarch debugger --ranks 1").status == "ok"


def test_breakpoint_in_a_function_an_earlier_cell_defined(ks: KernelSession) -> None:
    define = ("%%monarch --ranks 1\n"
              "def helper(a):\n"
              "    b = a + 100\n"
              "    return b\n")
    assert ks.run(define).status == "ok"
    path = _gutter_breakpoint(ks, define, [3])  # set after the cell ran
    call = "%%monarch --ranks 1\nout = helper(5)\nout\n"
    seen = len(ks.debug_events)
    msg_id = ks.execute(call)
    thread = _stopped(ks, seen)["threadId"]
    frames = _frames(ks, thread)
    call_path = str(ks.dap("dumpCell", {"code": call})["body"]["sourcePath"])
    assert [(f["name"], f["source"]["path"], f["line"]) for f in frames] == [
        ("helper", path, 3), ("<module>", call_path, 2)]
    ks.dap("setBreakpoints", {"breakpoints": [], "source": {"path": path}, "sourceModified": False})
    ks.dap("continue", {"threadId": thread})
    r = ks.collect(msg_id, timeout=60)
    assert r.status == "ok" and "105" in r.text, r


def test_plain_cells_keep_the_kernels_debugger(ks: KernelSession) -> None:
    plain = "p = 1\np = p + 41\nprint(p)\n"
    path = _gutter_breakpoint(ks, plain, [2])
    seen = len(ks.debug_events)
    msg_id = ks.execute(plain)
    stop = _stopped(ks, seen)
    assert stop["threadId"] < BASE  # the kernel's own thread, from debugpy
    frames = _frames(ks, stop["threadId"])
    assert (frames[0]["source"]["path"], frames[0]["line"]) == (path, 2)
    ks.dap("setBreakpoints", {"breakpoints": [], "source": {"path": path}, "sourceModified": False})
    ks.dap("continue", {"threadId": stop["threadId"]})
    r = ks.collect(msg_id, timeout=60)
    assert r.status == "ok" and "42" in r.stdout, r


def test_pause_button_then_interrupt_while_stopped(ks: KernelSession) -> None:
    spin = ("%%monarch\n"
            "import time, torch, torch.distributed as dist\n"
            "n = 0\n"
            "print('spinning', flush=True)\n"
            "while n < 10**9:\n"
            "    n += 1\n"
            "    time.sleep(0.001)\n")
    msg_id = ks.execute(spin)
    ks.wait_output(msg_id, "spinning")
    seen = len(ks.debug_events)
    # nothing is stopped: JupyterLab's pause button names thread 1 (the kernel's)
    assert ks.dap("pause", {"threadId": 1})["success"]
    stop = _stopped(ks, seen, reason="pause")
    assert stop["threadId"] == BASE + 3  # rank 1's
    frames = _frames(ks, stop["threadId"])
    assert frames[0]["line"] in (5, 6, 7)
    # the interrupt button: the call ends cleanly, the mesh answers the next cell
    seen = len(ks.debug_events)
    ks.km.interrupt_kernel()
    r = ks.collect(msg_id, timeout=90)
    assert r.status == "error" and "interrupted" in r.traceback.lower(), r
    ks.debug_event(lambda e: e["event"] == "continued" and e["body"]["threadId"] == BASE + 3,
                   after=seen)
    r = ks.run("%%monarch\nrank * 10", timeout=60)
    assert r.status == "ok" and "20" in r.text, r


def test_failed_cell_is_a_post_mortem_thread(ks: KernelSession) -> None:
    cell = ("%%monarch\n"
            "def ratio(a):\n"
            "    b = a - a\n"
            "    return a / b\n"
            "ratio(rank + 1)\n")
    path = str(ks.dap("dumpCell", {"code": cell})["body"]["sourcePath"])
    seen = len(ks.debug_events)
    r = ks.run(cell)
    assert r.status == "error" and "ZeroDivisionError" in r.traceback
    stop = _stopped(ks, seen, reason="exception")
    thread = stop["threadId"]
    assert "ZeroDivisionError" in stop["text"]
    threads = {t["id"]: t["name"] for t in ks.dap("threads")["body"]["threads"]}
    assert threads[thread] == "rank 1 (post-mortem)"
    frames = _frames(ks, thread)
    assert [(f["name"], f["source"]["path"], f["line"]) for f in frames] == [
        ("ratio", path, 4), ("<module>", path, 5)]
    scopes = ks.dap("scopes", {"frameId": frames[0]["id"]})["body"]["scopes"]
    local = _variables(ks, scopes[0]["variablesReference"])
    assert (local["a"]["value"], local["b"]["value"]) == ("2", "0")
    seen = len(ks.debug_events)
    assert ks.dap("continue", {"threadId": thread})["success"]  # dismissed
    ks.debug_event(lambda e: e["event"] == "continued" and e["body"]["threadId"] == thread,
                   after=seen)
    assert thread not in ks.dap("debugInfo")["body"]["stoppedThreads"]


def test_crashed_rank_shows_its_last_stack(ks: KernelSession) -> None:
    cell = ("%%monarch\n"
            "import ctypes\n"
            "def crash():\n"
            "    ctypes.string_at(0)\n"
            "if rank == 1:\n"
            "    crash()\n")
    path = str(ks.dap("dumpCell", {"code": cell})["body"]["sourcePath"])
    seen = len(ks.debug_events)
    r = ks.run(cell, timeout=120)
    assert r.status == "error" and "SIGSEGV" in r.traceback, r
    stop = _stopped(ks, seen, reason="exception")
    thread = stop["threadId"]
    assert stop["description"].startswith("rank 1 (dead): killed by SIGSEGV")
    frames = _frames(ks, thread)
    mine = [(f["name"], f["source"].get("path"), f["line"]) for f in frames
            if f["source"].get("path") == path]
    assert mine == [("crash", path, 4), ("<module>", path, 6)], frames
    assert ks.dap("scopes", {"frameId": frames[0]["id"]})["body"]["scopes"] == []
    ks.dap("continue", {"threadId": thread})
    # the next cell dismisses what is left and runs on the respawned rank
    r = ks.run("%%monarch\nimport monarch_nb as mnb\nmnb.incarnation()", timeout=120)
    assert r.status == "ok", r


def test_off_and_disconnect(ks: KernelSession) -> None:
    path = _gutter_breakpoint(ks, CELL, [4])
    assert ks.run("%monarch debugger --off").status == "ok"
    seen = len(ks.debug_events)
    r = ks.run(CELL, timeout=90)
    assert r.status == "ok" and "[1] rank 1 got 21.0" in r.stdout, r
    assert not [e for e in ks.debug_events[seen:] if e["event"] == "stopped"]
    assert ks.dap("disconnect", {"restart": False, "terminateDebuggee": False})["success"]
    assert ks.dap("debugInfo")["body"]["isStarted"] is False
    assert path not in {b["source"] for b in ks.dap("debugInfo")["body"]["breakpoints"]}
