"""``%monarch`` / ``%%monarch`` in a real IPython kernel, driven the way a
notebook drives it (jupyter_client), against one 4-rank CPU mesh.

One kernel and ONE ``%monarch start -n 4`` for the whole module (start-up
costs seconds on this machine). Tests run in file order and rely on it:

* the first test runs before the mesh exists (``MeshNotRunning``);
* the last test kills rank 3, then stops the mesh and checks no rank is left.

Every test that provokes an error also checks that the mesh answers the next
cell (DESIGN rule 7: bad input loses nothing). Timing assertions are only
generous bounds: the machine has 2 cores and other suites run alongside.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import queue
import re
import tempfile
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

from monarch_nb.selection import parse_ranks

from .conftest import wait_for, worker_pids
from .kernel_util import CellResult, KernelSession

pytestmark = pytest.mark.kernel

ALL = [0, 1, 2, 3]
MAGICS = "get_ipython().find_magic('monarch').__self__"


# -- fixtures and helpers -------------------------------------------------------------
@pytest.fixture(scope="module")
def kernel() -> Iterator[KernelSession]:
    """A kernel with ``%load_ext monarch_nb`` and no mesh yet."""
    ks = KernelSession()
    try:
        r = ks.run("%load_ext monarch_nb")
        assert r.status == "ok", r
        yield ks
    finally:
        # If a test failed before the last one stopped the mesh, stop it here
        # (the kernel's atexit would too; this keeps the orphan check honest).
        with contextlib.suppress(Exception):  # best effort; the test already reported
            ks.run(f"_m = {MAGICS}.mesh\nif _m is not None and _m.running:\n    _m.stop()",
                   timeout=30)
        ks.close()


@pytest.fixture(scope="module")
def mesh(kernel: KernelSession) -> KernelSession:
    """The module's kernel with a running 4-rank mesh (started once)."""
    r = kernel.run("%monarch start -n 4 --backend cpu", timeout=180)
    assert r.status == "ok", r
    assert r.error is None, r.traceback
    return kernel


def ok(ks: KernelSession, code: str, timeout: float = 60.0) -> CellResult:
    r = ks.run(code, timeout=timeout)
    assert r.status == "ok" and r.error is None, f"{code!r} failed:\n{r.traceback}\n{r}"
    return r


def failed(ks: KernelSession, code: str, timeout: float = 60.0) -> CellResult:
    r = ks.run(code, timeout=timeout)
    assert r.status == "error" and r.error is not None, f"{code!r} did not fail: {r}"
    return r


def py_value(ks: KernelSession, expr: str) -> object:
    """Evaluate ``expr`` in the kernel (a plain Python cell) and return it."""
    r = ok(ks, f"print(repr({expr}))")
    return ast.literal_eval(r.stdout.strip())


def answered(ks: KernelSession, ranks: str | None = None) -> dict[int, int]:
    """Run ``mnb.rank()`` on ``ranks`` with ``-o`` and return {rank: value}
    as the kernel stored it (so the check does not depend on the repr)."""
    opt = f" --ranks {ranks}" if ranks is not None else ""
    ok(ks, f"%%monarch{opt} -o _answered\nimport monarch_nb as mnb\nmnb.rank()")
    return py_value(ks, "dict(_answered)")  # type: ignore[return-value]


def assert_mesh_answers(ks: KernelSession) -> None:
    assert answered(ks) == {r: r for r in ALL}


def rank_pids(ks: KernelSession) -> list[int]:
    return py_value(ks, f"[r['pid'] for r in {MAGICS}.mesh.status()]")  # type: ignore[return-value]


def started_ranks(text: str, word: str = "started") -> set[int]:
    """Ranks named by the labels of ``[0-3] started`` / ``[1] started`` lines."""
    found: set[int] = set()
    for label in re.findall(rf"^\[([^\]]+)\] {word}$", text, re.MULTILINE):
        found.update(parse_ranks(label, len(ALL)))
    return found


def _wait_for_iopub(ks: KernelSession, msg_id: str, done: Callable[[str], bool],
                    timeout: float = 60.0) -> str:
    """Read iopub until ``done(stream_text)`` is true for cell ``msg_id``'s
    messages (others are kept in ``ks.late``); returns the stream text."""
    text = ""
    deadline = time.monotonic() + timeout
    while not done(text):
        assert time.monotonic() < deadline, f"gave up waiting; cell output so far: {text!r}"
        try:
            msg = ks.kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        parent = msg["parent_header"].get("msg_id")
        if parent != msg_id:
            ks.late.setdefault(parent, []).append(msg)
            continue
        if msg["msg_type"] == "stream":
            text += msg["content"]["text"]
    return text


def _is_rank(p: psutil.Process) -> bool:
    try:
        return "monarch_nb.worker" in p.cmdline()
    except psutil.Error:
        return False


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- before start ---------------------------------------------------------------------
def test_cell_before_start_names_mesh_not_running(kernel: KernelSession) -> None:
    r = failed(kernel, "%%monarch\n1 + 1")
    assert r.error is not None
    assert r.error["ename"] == "MeshNotRunning"
    assert "MeshNotRunning" in r.traceback
    assert "%monarch start" in r.traceback  # says how to start one
    # other subcommands that need a mesh say the same
    r = failed(kernel, "%monarch status")
    assert r.error is not None and r.error["ename"] == "MeshNotRunning"
    r = failed(kernel, "import monarch_nb\nmonarch_nb.Mesh.current()")
    assert r.error is not None and r.error["ename"] == "MeshNotRunning"


def test_min_ranks_is_parsed_and_a_bad_value_refused_before_anything_starts(
        kernel: KernelSession) -> None:
    from monarch_nb.ui.magics import _P, _parse

    assert _parse(_P.start, "-n 4 --min-ranks 2").min_ranks == 2
    assert _parse(_P.start, "-n 4").min_ranks is None
    r = failed(kernel, "%monarch start -n 2 --backend cpu --min-ranks 3 --no-dashboard")
    assert r.error is not None and r.error["ename"] == "UsageError", r.traceback
    assert "min_ranks must be a number of ranks from 1 to the mesh's 2" in r.traceback
    assert not any("starting ranks" in d for d in r.displays)  # refused before saying so
    assert py_value(kernel, f"{MAGICS}.mesh is None") is True


def test_max_restarts_is_the_restart_budget_and_a_bad_value_refused(kernel: KernelSession) -> None:
    from monarch_nb.ui.magics import _P, _parse

    assert _parse(_P.start, "-n 4 --max-restarts 0").max_restarts == 0
    assert _parse(_P.start, "-n 4").max_restarts is None
    r = failed(kernel, "%monarch start -n 2 --backend cpu --max-restarts -1 --no-dashboard")
    assert r.error is not None and r.error["ename"] == "UsageError", r.traceback
    assert "--max-restarts must be 0 or more, not -1" in r.traceback
    assert py_value(kernel, f"{MAGICS}.mesh is None") is True
    # what it does (a dead rank not respawned, the group going on without it)
    # is shown by notebooks/03_fault_tolerance.ipynb, run by nbval


def test_preload_is_parsed_and_a_bad_name_refused_before_anything_starts(
        kernel: KernelSession) -> None:
    from monarch_nb.ui.magics import _P, _parse

    assert _parse(_P.start, "-n 2 --preload json,csv").preload == "json,csv"
    r = failed(kernel, "%monarch start -n 2 --backend cpu --preload json,9lives --no-dashboard")
    assert r.error is not None and r.error["ename"] == "UsageError", r.traceback
    assert "'9lives' is not a module name" in r.traceback
    assert not any("starting ranks" in d for d in r.displays)  # refused before saying so
    assert py_value(kernel, f"{MAGICS}.mesh is None") is True


def test_python_api_reaches_the_mesh_the_magics_started(mesh: KernelSession) -> None:
    r = ok(mesh, "import monarch_nb\n"
                 "m = monarch_nb.Mesh.current()\n"
                 f"m is {MAGICS}.mesh, sorted(m.run(lambda: 7).values())")
    assert r.results == ["(True, [7, 7, 7, 7])"], r


# -- running cells ----------------------------------------------------------------------
def test_issue_example_all_reduce(mesh: KernelSession) -> None:
    r = ok(mesh, "%%monarch\n"
                 "import torch, torch.distributed as dist, monarch_nb as mnb\n"
                 "x = torch.ones(1) * (mnb.rank() + 1)\n"
                 "dist.all_reduce(x)\n"
                 "print(mnb.rank(), x.item())")
    lines = r.stdout.splitlines()
    for rank in ALL:
        assert f"[{rank}] {rank} 10.0" in lines, r.stdout
    assert r.results == []  # print() is the last statement -> no value


def test_identical_lines_are_folded(mesh: KernelSession) -> None:
    r = ok(mesh, "%%monarch\nprint('hello')")
    assert r.stdout.splitlines().count("[0-3] hello") == 1, r.stdout
    assert "[0] hello" not in r.stdout


def test_last_expression_shown_per_rank(mesh: KernelSession) -> None:
    r = ok(mesh, "%%monarch\nimport monarch_nb as mnb\nmnb.rank() * 10 + 1")
    assert len(r.results) == 1, r
    text = r.results[0]
    assert text.startswith("RankResults("), text
    for rank in ALL:
        assert re.search(rf"\b{rank}: {rank * 10 + 1}\b", text), text


def test_statement_cell_has_no_result(mesh: KernelSession) -> None:
    r = ok(mesh, "%%monarch\nimport monarch_nb as mnb\ny_stmt = mnb.rank()")
    assert r.results == []
    assert r.stdout == ""


def test_grouped_errors_then_mesh_answers(mesh: KernelSession) -> None:
    r = failed(mesh, "%%monarch\nimport monarch_nb as mnb\nif mnb.rank() % 2:\n    1/0")
    tb = r.traceback
    assert "ranks 1,3" in tb, tb
    assert "ZeroDivisionError" in tb
    assert "1/0" in tb  # the cell's own source line
    assert tb.count("ZeroDivisionError: division by zero") <= 2, "ranks 1 and 3 are not grouped"
    assert_mesh_answers(mesh)


@pytest.mark.parametrize("spec,expected", [
    ("3", [3]),
    ("0,2", [0, 2]),
    ("1-3", [1, 2, 3]),
    ("::2", [0, 2]),
    ("all", ALL),
])
def test_ranks_spec_selects(mesh: KernelSession, spec: str, expected: list[int]) -> None:
    assert answered(mesh, spec) == {r: r for r in expected}


@pytest.mark.parametrize("spec", ["7", "x"])
def test_bad_ranks_spec_is_clear_and_harmless(mesh: KernelSession, spec: str) -> None:
    r = failed(mesh, f"%%monarch --ranks {spec}\nprint('should not run')")
    assert "should not run" not in r.stdout
    tb = r.traceback
    assert spec in tb, tb
    assert "rank" in tb.lower()
    assert "Traceback (most recent call last)" not in tb, "a user mistake should be one clear line"
    assert_mesh_answers(mesh)


def test_output_variable(mesh: KernelSession) -> None:
    r = ok(mesh, "%%monarch -o per_rank\nimport monarch_nb as mnb\nmnb.rank() + 100")
    assert len(r.results) == 1  # still displayed
    assert py_value(mesh, "type(per_rank).__name__") == "RankResults"
    assert py_value(mesh, "dict(per_rank)") == {r: r + 100 for r in ALL}


def test_push_use_pull(mesh: KernelSession) -> None:
    ok(mesh, "w = {'lr': 0.5, 'tags': ['a', 'b']}\n%monarch push w")
    r = ok(mesh, "%%monarch -o got\nimport monarch_nb as mnb\nw['lr'] * (mnb.rank() + 1)")
    assert py_value(mesh, "dict(got)") == {0: 0.5, 1: 1.0, 2: 1.5, 3: 2.0}, r
    ok(mesh, "%%monarch --ranks 1\nw['tags'].append('rank1')")
    ok(mesh, "pulled = %monarch pull w --ranks 1")
    assert py_value(mesh, "dict(pulled)") == {1: {"lr": 0.5, "tags": ["a", "b", "rank1"]}}
    # the kernel's own w is untouched
    assert py_value(mesh, "w") == {"lr": 0.5, "tags": ["a", "b"]}


def test_push_undefined_name_is_clear(mesh: KernelSession) -> None:
    r = failed(mesh, "%monarch push surely_undefined_name_42")
    assert "surely_undefined_name_42" in r.traceback
    assert "not defined" in r.traceback
    assert_mesh_answers(mesh)


def test_syntax_error_is_usage_error_and_sends_nothing(mesh: KernelSession) -> None:
    r = failed(mesh, "%%monarch\nsent_marker = 1\nx = (1,\nprint('nope')")
    assert r.error is not None and r.error["ename"] == "UsageError", r.error
    tb = r.traceback
    assert "syntax error" in tb.lower()
    assert "x = (1," in tb  # shows the line
    assert "nothing was sent" in tb
    assert "nope" not in r.stdout
    # nothing ran on the ranks: the valid first line did not execute either
    r = ok(mesh, "%%monarch -o marker\n'sent_marker' in globals()")
    assert py_value(mesh, "dict(marker)") == dict.fromkeys(ALL, False)


def test_unpicklable_result_is_clear(mesh: KernelSession) -> None:
    r = failed(mesh, "%%monarch\nimport threading\nthreading.Lock()")
    tb = r.traceback
    assert "cannot be sent back" in tb, tb
    assert "ranks 0-3" in tb  # grouped, not four copies
    assert_mesh_answers(mesh)


def timeout_report(tb: str) -> tuple[set[int], dict[int, str]]:
    """(ranks named as interrupted, {rank: where}) from a CallTimeout message."""
    m = re.search(r"interrupted rank\(s\) (\S+)", tb)
    assert m, tb
    named = set(parse_ranks(m.group(1), len(ALL)))
    where = {int(r): w for r, w in re.findall(r"rank (\d+) was at (.*)", tb)}
    return named, where


TIMEOUT_CELL = "%%monarch --timeout 1\nimport time\ntime.sleep(30)"


def test_timeout_interrupts_and_says_where(mesh: KernelSession) -> None:
    t0 = time.monotonic()
    r = failed(mesh, TIMEOUT_CELL, timeout=60)
    elapsed = time.monotonic() - t0
    assert elapsed < 20, f"a 1 s timeout took {elapsed:.1f} s"
    assert r.error is not None and r.error["ename"] == "CallTimeout", r.error
    tb = r.traceback
    assert "CallTimeout" in tb
    named, where = timeout_report(tb)  # which ranks ...
    assert named and named <= set(ALL), tb
    assert set(where) == named, tb
    for w in where.values():  # ... and where each one was: the cell's line
        assert "line 2" in w and "time.sleep(30)" in w, tb
    # the ranks stay usable, and were really interrupted (no 30 s wait)
    t1 = time.monotonic()
    assert_mesh_answers(mesh)
    assert time.monotonic() - t1 < 15


def test_timeout_names_every_interrupted_rank(mesh: KernelSession) -> None:
    # A race, so try several times; every try must name all four ranks.
    for attempt in range(8):
        r = failed(mesh, TIMEOUT_CELL, timeout=60)
        named, where = timeout_report(r.traceback)
        assert named == set(ALL) and set(where) == set(ALL), (attempt, r.traceback)
    assert_mesh_answers(mesh)


def test_kernel_interrupt_reaches_the_ranks(mesh: KernelSession) -> None:
    msg_id = mesh.execute("%%monarch\nimport time\nprint('started', flush=True)\ntime.sleep(60)")
    # every rank is inside the sleep before the button is pressed
    _wait_for_iopub(mesh, msg_id, lambda t: started_ranks(t) == set(ALL))
    t0 = time.monotonic()
    mesh.km.interrupt_kernel()
    r = mesh.collect(msg_id, timeout=60)
    elapsed = time.monotonic() - t0
    assert elapsed < 15, f"interrupt took {elapsed:.1f} s to end the cell"
    assert r.status == "error" and r.error is not None, r
    assert r.error["ename"] == "KeyboardInterrupt", r.error
    # the ranks were interrupted too: the next cell does not wait for sleep(60)
    t1 = time.monotonic()
    assert_mesh_answers(mesh)
    assert time.monotonic() - t1 < 30


def test_no_block_output_lands_in_its_own_cell(mesh: KernelSession) -> None:
    first = mesh.execute("%%monarch --no-block -o h\n"
                         "import time, monarch_nb as mnb\n"
                         "time.sleep(1.5)\n"
                         "print('late')\n"
                         "mnb.rank() * 3")
    r1 = mesh.collect(first)
    assert r1.status == "ok", r1
    assert "late" not in r1.stdout  # returned at once
    # Another cell at once: a Python cell, then a %%monarch cell that queues
    # behind the first on the ranks (so 'late' arrives while it runs).
    r2 = ok(mesh, "print('second')")
    r3 = ok(mesh, "%%monarch\nprint('third')")
    assert "[0-3] third" in r3.stdout
    for r in (r2, r3):
        assert "late" not in r.stdout + r.stderr, r

    def late_arrived() -> bool:
        mesh.drain(0.1)
        return "late" in mesh.output_for(first)

    wait_for(late_arrived, timeout=30, what="'late' output under the first cell's msg_id")
    assert "[0-3] late" in mesh.output_for(first)
    r = ok(mesh, "%monarch wait h")
    assert len(r.results) == 1 and r.results[0].startswith("RankResults("), r
    assert py_value(mesh, "type(h).__name__") == "RankResults"
    assert py_value(mesh, "dict(h)") == {r: 3 * r for r in ALL}


def test_interrupt_targets_the_running_cell_not_a_no_block_one(mesh: KernelSession) -> None:
    ok(mesh, "%%monarch --ranks 0 --no-block -o background\nimport time\ntime.sleep(6)\n'bg done'")
    cell = mesh.execute("%%monarch --ranks 1-3\nimport time\nprint('started', flush=True)\n"
                        "time.sleep(20)\nprint('not interrupted')")
    _wait_for_iopub(mesh, cell, lambda t: started_ranks(t) == {1, 2, 3})
    mesh.km.interrupt_kernel()
    r = mesh.collect(cell, timeout=60)
    bg = mesh.run("%monarch wait background", timeout=60)
    t0 = time.monotonic()
    answers = answered(mesh, "1-3")  # sits behind sleep(20) if ranks 1-3 were not interrupted
    took = time.monotonic() - t0
    mesh.drain(0.2)
    assert answers == {1: 1, 2: 2, 3: 3}
    assert r.error is not None and r.error["ename"] == "KeyboardInterrupt", r
    assert bg.status == "ok" and bg.error is None, f"the --no-block cell was hit:\n{bg.traceback}"
    assert "not interrupted" not in r.stdout + mesh.output_for(cell)
    assert took < 10, f"ranks 1-3 kept running the interrupted cell ({took:.1f} s)"


def test_timeout_of_a_queued_cell_cancels_it(mesh: KernelSession) -> None:
    ok(mesh, "%%monarch --no-block -o ahead\nimport time\ntime.sleep(3)")
    r = mesh.run("%%monarch --timeout 1\nimport time\nprint('queued cell ran', flush=True)\n"
                 "time.sleep(20)", timeout=60)
    queued = r.msg_id
    waited = mesh.run("%monarch wait ahead", timeout=60)
    t0 = time.monotonic()
    answers = answered(mesh)  # sits behind sleep(20) if the queued cell still runs
    took = time.monotonic() - t0
    mesh.drain(0.2)
    assert answers == {k: k for k in ALL}
    assert waited.status == "ok", waited.traceback
    assert r.error is not None and r.error["ename"] == "CallTimeout", r
    ran = "queued cell ran" in r.stdout + mesh.output_for(queued) + waited.stdout
    assert not ran, "the cell reported as interrupted ran anyway"
    assert took < 10, f"the next cell waited {took:.1f} s for the 'interrupted' one"


def test_pull_undefined_name_is_clear(mesh: KernelSession) -> None:
    r = failed(mesh, "%monarch pull surely_not_on_ranks_42 --ranks 0,1")
    tb = r.traceback
    assert "surely_not_on_ranks_42" in tb and "not defined" in tb, tb
    assert "ranks 0,1" in tb
    assert_mesh_answers(mesh)


@pytest.mark.parametrize("line,needle", [
    ("%%monarch --no-such-flag\n1", "no-such-flag"),
    ("%%monarch -o 1bad\n1", "1bad"),
    ("%monarch start -n 2", "already running"),
    ("%monarch kill 9", "9"),
])
def test_bad_magic_lines_are_clear(mesh: KernelSession, line: str, needle: str) -> None:
    r = failed(mesh, line)
    assert needle in r.traceback, r.traceback
    assert "Traceback (most recent call last)" not in r.traceback
    assert_mesh_answers(mesh)


def test_logs_show_rank_output(mesh: KernelSession) -> None:
    ok(mesh, "%%monarch --ranks 2\nprint('for the log file')")
    r = ok(mesh, "%monarch logs 2 --tail 5")
    assert "for the log file" in r.stdout, r.stdout


def test_wait_unknown_name_is_clear(mesh: KernelSession) -> None:
    r = failed(mesh, "%monarch wait no_such_handle")
    assert "no_such_handle" in r.traceback
    assert_mesh_answers(mesh)


def test_status_help_and_unknown_subcommand(mesh: KernelSession) -> None:
    r = ok(mesh, "%monarch status")
    rows = [line for line in r.stdout.splitlines()
            if re.match(r"^\s*[0-3]\s+(ready|busy)\s+\d+", line)]
    assert len(rows) == 4, r.stdout
    r = ok(mesh, "%monarch help")
    for word in ("%monarch start", "%%monarch", "--ranks", "push", "pull", "kill", "logs"):
        assert word in r.stdout, (word, r.stdout)
    r = failed(mesh, "%monarch frobnicate")
    assert "frobnicate" in r.traceback
    assert "help" in r.traceback
    assert_mesh_answers(mesh)


def test_check_collectives_and_the_collectives_report(mesh: KernelSession) -> None:
    r = failed(mesh, "%%monarch --check-collectives\nimport torch, torch.distributed as dist\n"
                     "import monarch_nb as mnb\nx = torch.ones(2 if mnb.rank() == 3 else 6)\n"
                     "dist.all_reduce(x)")
    assert ("collective 1 of this call: ranks 0-2 called all_reduce(float32[6]) from "
            "<mnb-cell-") in r.traceback, r.traceback
    assert "rank 3 called all_reduce(float32[2])" in r.traceback
    ok(mesh, "%%monarch\nimport torch, torch.distributed as dist\ndist.all_reduce(torch.ones(3))")
    out = ok(mesh, "%monarch collectives").stdout
    assert out.startswith("collectives: the ranks agree"), out
    assert "ranks 0-3: #" in out and "all_reduce(float32[3]) done" in out
    assert "stragglers:" in ok(mesh, "%monarch stragglers").stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        out = ok(mesh, f"%monarch trace {path}").stdout
        assert out.startswith(f"monarch_nb: trace written to {path} (open it in"), out
        with open(path) as f:
            names = {e["name"] for e in json.load(f)["traceEvents"]}
    assert any(n.startswith("all_reduce #") for n in names), names
    assert_mesh_answers(mesh)


def test_megabytes_of_output_are_truncated(mesh: KernelSession) -> None:
    msg_id = mesh.execute("%%monarch\nfor i in range(20000):\n    print('x' * 1000)")
    # Collect by hand: tens of MB may come back; keep sizes, not all the text.
    out_bytes, stderr, status, error = 0, "", "", None
    hung = False
    last = time.monotonic()
    deadline = last + 240
    while True:
        now = time.monotonic()
        assert now < deadline, "no answer in 240 s even after an interrupt"
        if not hung and now - last > 20:  # 20 s without a byte: stuck, not slow
            hung = True
            mesh.km.interrupt_kernel()
        try:
            msg = mesh.kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            mesh.late.setdefault(msg["parent_header"].get("msg_id"), []).append(msg)
            continue
        last = time.monotonic()
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            if content["name"] == "stdout":
                out_bytes += len(content["text"])
            else:
                stderr += content["text"]
        elif kind == "error":
            error = content
        elif kind == "status" and content["execution_state"] == "idle":
            assert isinstance(mesh, KernelSession)
            status = mesh.reply_status(msg_id, time.monotonic() + 10)
            break
    # whatever happened, the next cell must work (the ranks stay usable)
    assert_mesh_answers(mesh)
    assert not hung, (f"the cell stopped producing output after {out_bytes} bytes and never "
                      f"finished; stderr: {stderr[:500]!r}")
    assert status == "ok" and error is None, (status, error and error.get("evalue"))
    assert "%monarch logs" in stderr, stderr[-2000:]
    assert 0 < out_bytes < 4 * 20000 * 1000, out_bytes  # truncated, not everything


# -- last: a killed rank comes back, then stop ------------------------------------------
def test_kill_rank_then_stop_leaves_no_process(mesh: KernelSession) -> None:
    pids = rank_pids(mesh)
    assert len(pids) == 4 and all(pids)
    ok(mesh, "%%monarch --setup\nimport monarch_nb as mnb\nsetup_marker = 'replayed'")
    ok(mesh, "%monarch kill 3")
    wait_for(lambda: gone(pids[3]), timeout=10, what="rank 3 to die")
    # --respawn rank (the default): the cell waits for the new rank 3
    r = ok(mesh, "%%monarch\n(mnb.incarnation(), setup_marker)", timeout=90)
    assert "3: (1, 'replayed')" in r.results[0], r.results
    assert "0: (0, 'replayed')" in r.results[0] or "ranks 0-2: (0, 'replayed')" in r.results[0]
    r = ok(mesh, "%monarch status")
    assert re.search(r"^\s*3\s+ready\s+\d+\s+1\b", r.stdout, re.MULTILINE), r.stdout
    ok(mesh, "%monarch restart 2")
    r = ok(mesh, "%%monarch --ranks 2\nmnb.incarnation()", timeout=90)
    assert "2: 1" in r.results[0], r.results
    pids = pids + rank_pids(mesh)
    r = ok(mesh, "%monarch stop")
    assert "stopped" in r.stdout
    wait_for(lambda: all(gone(p) for p in pids), timeout=5, what="every rank process to end")
    assert not set(pids) & worker_pids()
    assert not [p for p in psutil.Process(mesh.pid).children(recursive=True)
                if not gone(p.pid) and _is_rank(p)]
    r = failed(mesh, "%%monarch\n1")
    assert r.error is not None and r.error["ename"] == "MeshNotRunning"
