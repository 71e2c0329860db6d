"""Debugging from the Python API, with real ranks: stacks of a deadlocked
group, the hang watchdog, post-mortem and breakpoints through the prompt
relay, logs across incarnations. (The same through the magics in a real
kernel: test_debug_kernel.py.)"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import psutil
import pytest

from monarch_nb import CallTimeout, Mesh, UsageError
from monarch_nb.controller.calls.output import CallOutput

from .conftest import wait_for

DEADLOCK = """
import time, torch, torch.distributed as dist, monarch_nb as mnb
def waiting_for_peer():
    x = torch.ones(1)
    dist.all_reduce(x)
def stuck_here():
    time.sleep(60)
if mnb.rank() == 1:
    stuck_here()
else:
    waiting_for_peer()
"""


def _three_ranks() -> Iterator[Mesh]:
    mesh = Mesh.start(n=3, backend="cpu")
    try:
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture
def mesh3() -> Iterator[Mesh]:
    """A fresh mesh, for the tests that stop, kill or break it, or need
    ranks that never failed a call."""
    yield from _three_ranks()


@pytest.fixture(scope="module")
def _shared3() -> Iterator[Mesh]:
    yield from _three_ranks()


@pytest.fixture
def shared3(_shared3: Mesh) -> Iterator[Mesh]:
    """One mesh for the tests that leave its ranks usable (a rank start costs
    seconds of CPU); what a test sets on the controller is reset after it."""
    assert all(row["state"] == "ready" for row in _shared3.status()), _shared3.status()
    ctl = _shared3._ctl
    output = ctl.default_output
    yield _shared3
    ctl.ask, ctl.default_output = None, output


class Script:
    """Answers debugger prompts in order, recording them."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.prompts: list[str] = []

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        return self.answers.pop(0) if self.answers else "c"


def collected() -> tuple[CallOutput, list[str]]:
    lines: list[str] = []
    return CallOutput(lambda stream, text: lines.append(text)), lines


def test_stacks_of_a_deadlocked_group_and_stop(mesh3: Mesh) -> None:
    fut = mesh3.exec(DEADLOCK, name="<mnb-cell-5>", block=False)
    # wait until rank 1 sleeps and the others wait inside the collective
    # (a rank still on its way into all_reduce has other frames than one
    # already blocked in it: two groups only once both are blocked)
    def settled() -> object:
        st = mesh3.stacks()
        in_cell = st[0].collective() and st[2].collective() and "stuck_here" in st[1].where()
        return st if in_cell and len(st.groups()) == 2 else None

    st = wait_for(settled, timeout=30, interval=0.2, what="two groups of stacks")
    summary = st.summary()
    assert summary[0].startswith("ranks 0,2: in all_reduce (collective), from waiting_for_peer "
                                 "(<mnb-cell-5> line 5)"), summary
    assert summary[1] == "rank 1: in stuck_here (<mnb-cell-5> line 7): time.sleep(60)"
    assert "that rank 1 has not reached" in st.hint()
    assert set(mesh3.stacks("0,2")) == {0, 2}
    pids = [p.pid for p in mesh3._ctl.supervisor.procs.values()]
    t0 = time.monotonic()
    mesh3.stop()  # ranks stuck in gloo and in sleep: ended within a few seconds
    assert time.monotonic() - t0 < 15
    assert fut.done()
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_timeout_inside_a_collective_says_how_to_reform_the_group(mesh3: Mesh) -> None:
    skip = ("import torch, torch.distributed as dist, monarch_nb as mnb\n"
            "x = torch.ones(1)\nif mnb.rank() != 1:\n    dist.all_reduce(x)\nx.item()")
    with pytest.raises(CallTimeout) as info:
        mesh3.exec(skip, timeout=3)
    text = str(info.value)
    assert "stay usable" not in text.splitlines()[0]
    assert "rank(s) 0,2 were interrupted inside a torch.distributed collective" in text
    # what the message says to do works: the group is in step again
    mesh3.restart("all")
    assert mesh3.exec("import torch, torch.distributed as dist\nx = torch.ones(1)\n"
                      "dist.all_reduce(x)\nx.item()", timeout=60) == dict.fromkeys(range(3), 3.0)


def test_hang_watchdog_prints_grouped_stacks_once(shared3: Mesh) -> None:
    out, lines = collected()
    ctl = shared3._ctl
    from monarch_nb.wire.protocol import Kind

    code = ("import time, monarch_nb as mnb\n"
            "def slow():\n    time.sleep(2.5 if mnb.rank() == 2 else 0.01)\n"
            "slow()\n")
    fut = ctl.submit(Kind.EXEC, (0, 1, 2), [], {"code": code, "name": "<mnb-cell-8>"}, out,
                     hang_timeout=0.8)
    shared3.wait(fut, 30)
    text = "".join(lines)
    assert text.count("no progress for 0.8 s") == 1, text
    assert "rank 2: in slow (<mnb-cell-8> line 3)" in text
    assert "ranks 0" not in text  # finished ranks are not part of the report
    # progress (output) keeps the watchdog quiet
    out2, lines2 = collected()
    code2 = "import time\nfor i in range(6):\n    print(i, flush=True)\n    time.sleep(0.3)\n"
    fut2 = ctl.submit(Kind.EXEC, (0,), [], {"code": code2, "name": "<mnb-cell-9>"}, out2,
                      hang_timeout=1.0)
    shared3.wait(fut2, 30)
    assert "no progress" not in "".join(lines2)


def test_post_mortem_evaluates_in_the_failed_frame(shared3: Mesh) -> None:
    with pytest.raises(Exception, match="ZeroDivisionError"):
        shared3.exec("def f(x):\n    y = x - 4\n    return x / y\nf(4)\n", name="<mnb-cell-3>")
    script = Script("p x * 10", "up", "l", "q")
    shared3._ctl.ask = script
    out, _ = collected()
    shared3._ctl.default_output = out
    shared3.debug(1)
    assert script.prompts[0] == "[rank 1] (Pdb) "
    assert len(script.prompts) == 4
    # the rank stays usable, its namespace intact
    assert shared3.ranks(1).run(lambda: 7) == {1: 7}
    assert shared3.exec("f.__name__") == {0: "f", 1: "f", 2: "f"}


def test_post_mortem_output_reaches_the_caller(shared3: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(Exception, match="ZeroDivisionError"):
        shared3.exec("def g(x):\n    return x / 0\ng(21)\n", name="<mnb-cell-4>")
    capsys.readouterr()
    shared3._ctl.ask = Script("p x * 2", "q")
    shared3.debug(2)
    out = capsys.readouterr().out
    assert "[2] post-mortem of ZeroDivisionError" in out
    assert "[2] > <mnb-cell-4>(2)g()" in out
    assert "[2] 42" in out


def test_debug_without_an_error_is_a_clear_mistake(mesh3: Mesh) -> None:
    with pytest.raises(UsageError, match="no failed call to debug"):
        mesh3.debug(0)
    assert mesh3.run(lambda: 1) == {0: 1, 1: 1, 2: 1}


def test_breakpoints_are_served_one_rank_at_a_time(shared3: Mesh,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    script = Script("p a", "n", "p a", "c",  # rank in focus first: step, then continue
                    "p a + 100", "c",  # the next rank that stopped
                    "c")

    def ask(prompt: str) -> str:
        if not script.prompts:  # hold the first rank until the other one stopped too
            wait_for(lambda: shared3._ctl.prompts, timeout=60, what="the second rank's prompt")
        return script(prompt)

    shared3._ctl.ask = ask
    cell = "a = 1\nbreakpoint()\na = 2\na = a * 3\na\n"
    res = shared3.ranks("0,1").exec(cell, name="<mnb-cell-6>")
    assert res == {0: 6, 1: 6}
    cap = capsys.readouterr()
    out, err = cap.out, cap.err
    first = int(script.prompts[0].split()[1].rstrip("]"))
    second = 1 - first
    assert script.prompts[:4] == [f"[rank {first}] (Pdb) "] * 4
    assert script.prompts[4:6] == [f"[rank {second}] (Pdb) "] * 2
    assert f"[{first}] 1\n" in out and f"[{first}] 2\n" in out
    assert f"[{second}] 101\n" in out
    # the rank waiting its turn is named
    assert f"rank {second} also stopped and comes next" in err or \
        f"rank {second} stopped in the debugger too; it is next after rank {first}" in err, err
    assert shared3.run(lambda: "fine") == {0: "fine", 1: "fine", 2: "fine"}


def test_a_prompt_already_sent_as_output_is_still_the_prompt(shared3: Mesh,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # The rank's control thread sends output on its own clock: a prompt
    # written, then read a moment later, has gone out as output before the
    # read asks. It is still shown as the prompt, not printed as output.
    script = Script("blue")
    shared3._ctl.ask = script
    capsys.readouterr()
    code = ("import sys, time\nsys.stdout.write('colour? ')\nsys.stdout.flush()\n"
            "time.sleep(0.2)\ninput()\n")
    assert shared3.ranks(1).exec(code, name="<mnb-cell-13>") == {1: "blue"}
    assert script.prompts == ["[rank 1] colour? "]
    assert "colour?" not in capsys.readouterr().out


def test_interrupt_at_a_debugger_prompt_ends_the_call(shared3: Mesh) -> None:
    def interrupt(prompt: str) -> str:
        raise KeyboardInterrupt

    shared3._ctl.ask = interrupt
    with pytest.raises(KeyboardInterrupt):
        shared3.ranks(1).exec("x = 1\nbreakpoint()\nx = 2\n", name="<mnb-cell-12>")
    shared3._ctl.ask = Script()
    # the rank left pdb and takes calls; pdb left no SIGINT handler behind
    assert shared3.ranks(1).run(lambda: 3, timeout=30) == {1: 3}
    assert shared3.ranks(1).exec("import pdb\npdb.set_trace()\ny = 5\ny") == {1: 5}
    handler = shared3.ranks(1).exec("import signal\nsignal.getsignal(signal.SIGINT).__name__")
    assert handler == {1: "_on_sigint"}


def test_native_frames_through_py_spy(mesh3: Mesh) -> None:
    import shutil
    import sys
    from pathlib import Path

    if not (shutil.which("py-spy") or (Path(sys.executable).parent / "py-spy").exists()):
        pytest.skip("py-spy is not installed (it is in the dev extra)")
    fut = mesh3.ranks(0).exec("import time\ndef in_c_sleep():\n    time.sleep(30)\nin_c_sleep()\n",
                              name="<mnb-cell-11>", block=False)
    wait_for(lambda: "in_c_sleep" in mesh3.stacks("0")[0].where(), timeout=20, what="sleeping")
    st = mesh3.stacks("0", native=True)
    native = st[0].native
    assert "clock_nanosleep" in native or "time_sleep" in native, native
    assert "in_c_sleep (<mnb-cell-11>:3)" in native, native
    assert "native (py-spy):" in st.render()
    fut.cancel()
    mesh3.stop()


def test_logs_cover_earlier_incarnations(mesh3: Mesh) -> None:
    mesh3.ranks(2).exec("print('before the kill')")
    mesh3.kill(2)
    wait_for(lambda: mesh3.status()[2]["state"] == "ready", timeout=60, what="rank 2 back")
    mesh3.ranks(2).exec("print('after the kill')")
    lines = mesh3.logs(2, tail=50)
    text = "\n".join(lines)
    assert "--- rank 2, incarnation 0" in text and "killed by SIGKILL" in text
    assert "--- rank 2, incarnation 1" in text and "running" in text
    assert text.index("before the kill") < text.index("after the kill")
    assert mesh3.logs(2, tail=1)[-1] == "after the kill"
    with pytest.raises(UsageError):
        mesh3.logs(2, tail=0)


ABORTS = """\
import os, torch, torch.distributed as dist, monarch_nb as mnb
x = torch.ones(2)
dist.all_reduce(x)
def give_up():
    print("about to abort", flush=True)
    os.abort()
if mnb.rank() == 1:
    give_up()
"""


def test_debug_on_a_rank_killed_by_a_signal_shows_what_it_left(
        shared3: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    # no interpreter is left for pdb: its stacks, output and collectives instead
    from monarch_nb import RankErrors

    with pytest.raises(RankErrors):
        shared3.exec(ABORTS, name="<mnb-cell-61>", timeout=60)
    wait_for(lambda: all(s["state"] == "ready" for s in shared3.status()), timeout=90,
             what="rank 1 back")
    capsys.readouterr()
    shared3.debug(1)
    out = capsys.readouterr().out
    assert re.search(r"rank 1 \(incarnation \d+, pid \d+\) was killed by SIGABRT: no "
                     r"interpreter is left for pdb; what it left behind:", out), out
    assert "last stacks (from its log):\n  Python (most recent call first):\n" in out, out
    assert "    give_up (<mnb-cell-61> line 6)" in out, out
    # (a pdb prompt an earlier test left without a newline may start the line)
    assert "last output lines:" in out and re.search(r"^  .*about to abort$", out, re.M), out
    assert re.search(r"last collectives \(its flight records, oldest first\):\n(  .*\n)*"
                     r"  #\d+ all_reduce\(float32\[2\]\) from <mnb-cell-61> line 3: done", out), out
    # a rank killed with SIGKILL left no stack: the report says so
    was = shared3.status()[2]["incarnation"]
    shared3.kill(2)
    wait_for(lambda: shared3.status()[2]["state"] == "ready"
             and shared3.status()[2]["incarnation"] > was, timeout=90, what="rank 2 back")
    shared3.debug(2)
    out = capsys.readouterr().out
    assert f"rank 2 (incarnation {was}, pid " in out and "was killed by SIGKILL" in out, out
    assert "last stacks: none in its log (SIGKILL leaves none)" in out, out
