"""Debugging through the magics in a real IPython kernel (jupyter_client), the
debugger driven by scripted answers to the kernel's input requests, the way a
user types into the notebook's input box.

One kernel, one 3-rank mesh; tests run in file order: post-mortem, a
breakpoint stepped through and continued, the hang watchdog, logs, then a
deliberately deadlocked group (rank 1 skips an all_reduce) whose grouped
stacks name both groups, and ``%monarch stop`` ending the stuck ranks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from .conftest import wait_for, worker_pids
from .kernel_util import MAGICS, CellResult, KernelSession, kernel_with_mesh

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def ks() -> Iterator[KernelSession]:
    with kernel_with_mesh(3) as ks:
        yield ks


def test_post_mortem_evaluates_in_the_failed_frame(ks: KernelSession) -> None:
    r = ks.run("%%monarch\ndef scale(x):\n    y = x - 4\n    return x / y\nscale(4)\n")
    assert r.status == "error" and "ZeroDivisionError" in r.traceback
    r = ks.run("%monarch debug 1", answers=["p x * 10", "p y", "where", "q"])
    assert r.status == "ok", r
    assert r.prompts == ["[rank 1] (Pdb) "] * 4
    assert "[1] post-mortem of ZeroDivisionError: division by zero" in r.stdout
    assert "[1] 40\n" in r.stdout and "[1] 0\n" in r.stdout
    assert "[1] -> return x / y" in r.stdout  # the cell's own source line
    # the rank stays usable, its state intact
    r = ks.run("%%monarch --ranks 1\nscale.__name__, 2 + 2")
    assert r.status == "ok" and "('scale', 4)" in r.text, r


def test_debug_mistakes_are_clear(ks: KernelSession) -> None:
    r = ks.run("%monarch debug")
    assert r.status == "error" and "see %monarch help" in r.traceback
    r = ks.run("%monarch debug 7")
    assert r.status == "error" and "7" in r.traceback
    assert ks.run("%%monarch\n1 + 1").status == "ok"


def test_breakpoint_is_stepped_through_and_continued(ks: KernelSession) -> None:
    cell = ("%%monarch --ranks 0,2\n"
            "a = 10\n"
            "breakpoint()\n"
            "a = a + 1\n"
            "a = a * 2\n"
            "a\n")
    # The first rank continues once the cell says the other stopped too:
    # when its breakpoint comes is up to the machine's load.
    def noted(res: CellResult) -> str | None:
        told = "also stopped" in res.stderr or "stopped in the debugger too" in res.stderr
        return "c" if told else None

    r = ks.run(cell, answers=["p a", "n", "n", "p a", noted, "p a", "c"])
    assert r.status == "ok", r
    first = r.prompts[0]
    assert first in ("[rank 0] (Pdb) ", "[rank 2] (Pdb) ")
    assert r.prompts[:5] == [first] * 5
    other = "[rank 2] (Pdb) " if first == "[rank 0] (Pdb) " else "[rank 0] (Pdb) "
    assert r.prompts[5:] == [other] * 2
    f = first[6]
    assert f"[{f}] 10\n" in r.stdout and f"[{f}] 22\n" in r.stdout
    assert "-> a = a + 1" in r.stdout  # the listing shows cell lines
    assert "22" in r.text
    assert "also stopped" in r.stderr or "stopped in the debugger too" in r.stderr
    # the mesh answers normally afterwards
    r = ks.run("%%monarch\nimport monarch_nb as mnb\nmnb.rank()")
    assert r.status == "ok" and "0" in r.text


def test_hang_watchdog_prints_stacks_into_the_running_cell(ks: KernelSession) -> None:
    cell = ("%%monarch --hang-timeout 1.5\n"
            "import time, torch, torch.distributed as dist, monarch_nb as mnb\n"
            "def late_joiner():\n"
            "    time.sleep(5)\n"
            "if mnb.rank() == 1:\n"
            "    late_joiner()\n"
            "x = torch.ones(1)\n"
            "dist.all_reduce(x)\n"
            "x.item()\n")
    r = ks.run(cell, timeout=60)
    assert r.status == "ok", r
    assert r.stderr.count("no progress for 1.5 s") == 1, r.stderr
    assert "ranks 0,2: in all_reduce (collective)" in r.stderr
    assert "rank 1: in late_joiner (<mnb-cell-" in r.stderr and "time.sleep(5)" in r.stderr
    assert "hint: ranks 0,2 wait in a collective (all_reduce) that rank 1 has not reached" in r.stderr
    assert "3.0" in r.text


def test_functions_from_cells_bring_their_source(ks: KernelSession) -> None:
    r = ks.run("def boom(x):\n    return x.missing_attribute\n")
    assert r.status == "ok"
    r = ks.run(f"{MAGICS}.mesh.ranks(0).run(boom, 3)")
    assert r.status == "error" and "AttributeError" in r.traceback
    assert "return x.missing_attribute" in r.traceback  # the cell line, shown by the rank


def test_logs_of_a_rank(ks: KernelSession) -> None:
    assert ks.run("%%monarch --ranks 2\nprint('hello from the log')").status == "ok"
    r = ks.run("%monarch logs 2 --tail 5")
    assert r.status == "ok" and "hello from the log" in r.stdout
    r = ks.run("%monarch logs 2 --tail 0")
    assert r.status == "error" and "positive number of lines" in r.traceback


def test_deadlocked_group_shows_both_groups_and_stop_ends_it(ks: KernelSession) -> None:
    cell = ("%%monarch --no-block -o hung\n"
            "import time, torch, torch.distributed as dist, monarch_nb as mnb\n"
            "def waiting_for_peer():\n"
            "    x = torch.ones(1)\n"
            "    dist.all_reduce(x)\n"
            "def stuck_here():\n"
            "    time.sleep(600)\n"
            "if mnb.rank() == 1:\n"
            "    stuck_here()  # skips the all_reduce: the others wait forever\n"
            "else:\n"
            "    waiting_for_peer()\n")
    assert ks.run(cell).status == "ok"

    def grouped() -> str | None:
        r = ks.run("%monarch stacks")
        ok = ("ranks 0,2: in all_reduce (collective), from waiting_for_peer" in r.stdout
              and "rank 1: in stuck_here" in r.stdout)
        return r.stdout if ok else None

    text = str(wait_for(grouped, timeout=60, interval=0.5, what="grouped stacks"))
    assert "dist.all_reduce(x)" in text and "time.sleep(600)" in text
    r = ks.run("%monarch stacks --ranks 1")
    assert "rank 1: in stuck_here" in r.stdout and "ranks 0,2" not in r.stdout
    before = worker_pids()
    assert before
    t0 = time.monotonic()
    r = ks.run("%monarch stop", timeout=60)
    assert r.status == "ok", r
    assert time.monotonic() - t0 < 15  # "within a few seconds", generously
    wait_for(lambda: not (worker_pids() & before), timeout=10, what="ranks gone")
