"""What a ``%%monarch`` cell says of what happened, and what its ranks'
namespaces hold, in a real IPython kernel (jupyter_client) against one
3-rank CPU mesh (issue 28, items 5 and 6).

Tests run in file order: the fresh-namespace test first, kills last.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from .conftest import wait_for
from .kernel_util import KernelSession, kernel_with_mesh
from .test_magics import MAGICS, _wait_for_iopub, failed, ok, py_value, started_ranks

pytestmark = pytest.mark.kernel

ALL = [0, 1, 2]
NAMESPACE_CHECK = ("%%monarch -o _ns\n"
                   "(dist.get_rank() == rank, dist.get_world_size() == world_size, rank,\n"
                   " mnb.rank() == rank, local_rank == rank, str(device), torch.ones(1).item(),\n"
                   " mnb.incarnation())")


@pytest.fixture(scope="module")
def mesh() -> Iterator[KernelSession]:
    with kernel_with_mesh(3) as ks:
        yield ks


def namespaces(ks: KernelSession) -> dict[int, tuple[object, ...]]:
    r = ok(ks, NAMESPACE_CHECK, timeout=90)
    assert "NameError" not in r.text, r.text
    return py_value(ks, "dict(_ns)")  # type: ignore[return-value]


def test_a_fresh_mesh_needs_no_imports(mesh: KernelSession) -> None:
    assert namespaces(mesh) == {r: (True, True, r, True, True, "cpu", 1.0, 0) for r in ALL}
    r = ok(mesh, "%monarch help")
    assert "rank, world_size, local_rank, device" in r.stdout


def test_rank_errors_show_the_values_of_the_ranks_that_succeeded(mesh: KernelSession) -> None:
    r = failed(mesh, "%%monarch\nif rank == 1:\n    raise ValueError('rank one fails')\nrank * 10")
    tb = r.traceback
    assert "--- ranks 0,2 succeeded: {0: 0, 2: 20} (kept in .results)" in tb, tb
    assert "--- rank 1: ValueError: rank one fails" in tb, tb
    assert py_value(mesh, "type(sys.last_value.results).__name__ if (sys := __import__('sys')) "
                          "else None") == "RankResults"
    assert py_value(mesh, "dict(__import__('sys').last_value.results)") == {0: 0, 2: 20}


def test_an_interrupted_cell_says_where_each_group_of_ranks_stopped(mesh: KernelSession) -> None:
    msg_id = mesh.execute("%%monarch\nimport time\nprint('started', flush=True)\n"
                          "if rank == 1:\n    time.sleep(60)\nelse:\n    time.sleep(61)")
    _wait_for_iopub(mesh, msg_id, lambda t: started_ranks(t) == set(ALL))
    mesh.km.interrupt_kernel()
    r = mesh.collect(msg_id, timeout=60)
    assert r.error is not None and r.error["ename"] == "KeyboardInterrupt", r
    lines = r.error["traceback"]
    text = "\n".join(lines)
    cell = re.search(r"<mnb-cell-\d+>", text)
    assert cell is not None, lines
    assert lines == [
        "KeyboardInterrupt: interrupted rank(s) 0-2",
        f"  ranks 0,2: stopped at {cell[0]}:6 in <module> (time.sleep(61))",
        f"  rank 1: stopped at {cell[0]}:4 in <module> (time.sleep(60))",
    ], lines
    for internal in ("monarch_nb", "zmq", "magics", "controller", "Traceback"):
        assert internal not in text, text
    assert namespaces(mesh)[1][2] == 1  # the ranks answer the next cell


def ready_again(ks: KernelSession, rank: int, incarnation: int) -> bool:
    rows = py_value(ks, f"[(r['state'], r['incarnation']) for r in {MAGICS}.mesh.status()]")
    return rows[rank] == ("ready", incarnation)  # type: ignore[index]


def test_a_respawn_between_cells_is_the_next_cells_first_line(mesh: KernelSession) -> None:
    ok(mesh, "%monarch kill 1")
    wait_for(lambda: ready_again(mesh, 1, 1), timeout=60, what="rank 1 to be respawned")
    r = ok(mesh, NAMESPACE_CHECK, timeout=90)
    first = r.stderr.splitlines()[0] if r.stderr else ""
    assert re.fullmatch(r"rank 1 was respawned at \d\d:\d\d:\d\d \(killed by SIGKILL\); "
                        r"its namespace is new: no setup cells", first), r.stderr
    # a respawned rank has its own rank and device, the group its world size
    assert py_value(mesh, "dict(_ns)") == {r: (True, True, r, True, True, "cpu", 1.0, int(r == 1))
                                           for r in ALL}
    again = ok(mesh, "%%monarch\nrank")
    assert "respawned" not in again.text, again.text  # said once


def test_a_respawn_with_setup_cells_says_they_were_replayed(mesh: KernelSession) -> None:
    ok(mesh, "%%monarch --setup\nmarker = rank + 100")
    ok(mesh, "%monarch kill 2")
    wait_for(lambda: ready_again(mesh, 2, 1), timeout=60, what="rank 2 to be respawned")
    r = ok(mesh, "%%monarch -o _m\nmarker", timeout=90)
    assert re.match(r"rank 2 was respawned at \d\d:\d\d:\d\d \(killed by SIGKILL\); its "
                    r"namespace is new: setup cells replayed\n", r.stderr), r.stderr
    assert py_value(mesh, "dict(_m)") == {0: 100, 1: 101, 2: 102}


def test_a_respawn_announced_inside_a_cell_is_not_repeated(mesh: KernelSession) -> None:
    r = failed(mesh, "%%monarch\nimport os, signal\nif rank == 0:\n"
                     "    os.kill(os.getpid(), signal.SIGKILL)", timeout=90)
    assert "rank 0 died (killed by SIGKILL)" in r.text + r.traceback, (r.text, r.traceback)
    wait_for(lambda: ready_again(mesh, 0, 1), timeout=60, what="rank 0 to be respawned")
    again = ok(mesh, "%%monarch\nrank", timeout=90)
    assert "respawned" not in again.text, again.text
