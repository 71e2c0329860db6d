"""The kernel's translation tables for JupyterLab's debugger on the ranks
(monarch_nb/ui/dapmap.py): pure, no kernel, no mesh."""

from __future__ import annotations

from monarch_nb.ui.dapmap import (
    BASE,
    Ids,
    SourceMap,
    frames_to_client,
    header_lines,
    is_mesh_cell,
    refs_to_client,
)


def test_mesh_cells_are_told_from_plain_ones() -> None:
    assert is_mesh_cell("%%monarch\nx = 1\n")
    assert is_mesh_cell("\n\n%%monarch --ranks 1\nx = 1")
    assert not is_mesh_cell("%%monarchy\nx = 1")
    assert not is_mesh_cell("x = 1\n%%monarch\n")
    assert not is_mesh_cell("")


def test_header_lines_count_what_comes_before_the_body() -> None:
    assert header_lines("%%monarch\nx = 1\ny = 2\n", "x = 1\ny = 2\n") == 1
    assert header_lines("\n%%monarch -o r\nx = 1", "x = 1\n") == 2  # IPython adds the newline
    assert header_lines("%%monarch\n", "") == 1
    assert header_lines("something else", "x = 1\n") == 1  # unknown: the magic's own line


def test_source_map_both_ways_and_every_run_of_a_cell() -> None:
    m = SourceMap()
    m.add("<mnb-cell-3>", "/tmp/k/11.py", 1)
    assert m.to_ranks("/tmp/k/11.py", [1, 2, 5]) == [("<mnb-cell-3>", [1, 4])]  # line 1: the magic
    assert m.to_ranks("/tmp/k/other.py", [2]) == []
    m.add("<mnb-cell-7>", "/tmp/k/11.py", 1)  # the same text run again
    assert [name for name, _ in m.to_ranks("/tmp/k/11.py", [2])] == ["<mnb-cell-3>", "<mnb-cell-7>"]
    assert m.to_notebook("<mnb-cell-3>", 4) == ("/tmp/k/11.py", 5)
    assert m.to_notebook("/usr/lib/x.py", 4) == ("/usr/lib/x.py", 4)


def test_thread_ids_never_meet_the_kernels() -> None:
    assert Ids.thread_of(1) is None and Ids.thread_of(True) is None and Ids.thread_of("7") is None
    for rank in (0, 1, 1023):
        for kind in ("live", "pm", "dead"):
            tid = Ids.thread(rank, kind)
            assert tid >= BASE and Ids.thread_of(tid) == (rank, kind)
    assert Ids.label(1, "pm") == "rank 1 (post-mortem)" and Ids.label(2, "dead") == "rank 2 (dead)"


def test_frames_and_references_are_numbered_per_thread_and_forgotten() -> None:
    ids, m = Ids(), SourceMap()
    m.add("<mnb-cell-2>", "/tmp/k/9.py", 1)
    body = {"stackFrames": [{"id": 1, "name": "f", "line": 3, "file": "<mnb-cell-2>"},
                            {"id": 2, "name": "g", "line": 8, "file": "/lib/x.py"},
                            {"id": 3, "name": "h", "line": 1, "file": "<string>"}],
            "totalFrames": 3}
    out = frames_to_client(ids, m, 1, "live", body)["stackFrames"]
    assert [(f["source"].get("path"), f["line"]) for f in out] == [
        ("/tmp/k/9.py", 4), ("/lib/x.py", 8), (None, 1)]
    assert ids.frames[out[0]["id"]] == (1, "live", 1)
    refs = refs_to_client(ids, 1, "pm", [{"name": "a", "variablesReference": 5},
                                         {"name": "b", "variablesReference": 0}])
    assert refs[1]["variablesReference"] == 0 and ids.refs[refs[0]["variablesReference"]] == (1, "pm", 5)
    ids.forget(1, "live")
    assert not ids.frames and ids.refs  # only the live thread's numbers went
