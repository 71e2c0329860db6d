"""Grouping and wording of stacks (stacks.py): pure, no processes."""

from __future__ import annotations

from monarch_nb.stacks import RankStacks, Stacks, hang_report, short_path

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
LOGGER = "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py"


def in_collective(rank: int, line: int = 5) -> RankStacks:
    frames = [
        ["<mnb-cell-5>", 9, "<module>", "waiting_for_peer()"],
        ["<mnb-cell-5>", line, "waiting_for_peer", "dist.all_reduce(x)"],
        [LOGGER, 83, "wrapper", "return func(*args, **kwargs)"],
        [C10D, 3252, "all_reduce", "work.wait()"],
    ]
    return RankStacks(rank, "ok", [{"name": "MainThread", "main": True, "frames": frames}], busy=7)


def sleeping(rank: int) -> RankStacks:
    frames = [["<mnb-cell-5>", 11, "<module>", "stuck_here()"],
              ["<mnb-cell-5>", 7, "stuck_here", "time.sleep(3600)"]]
    return RankStacks(rank, "ok", [{"name": "MainThread", "main": True, "frames": frames},
                                   {"name": "loader", "main": False,
                                    "frames": [["/usr/lib/python3.11/threading.py", 320, "wait", ""]]}],
                      busy=7)


def test_ranks_in_the_same_place_are_shown_once() -> None:
    st = Stacks({0: in_collective(0), 1: in_collective(1), 2: sleeping(2), 3: in_collective(3)})
    groups = st.groups()
    assert [ranks for ranks, _ in groups] == [[0, 1, 3], [2]]
    summary = st.summary()
    assert summary[0] == ("ranks 0,1,3: in all_reduce (collective), from waiting_for_peer "
                          "(<mnb-cell-5> line 5)")
    assert summary[1] == "rank 2: in stuck_here (<mnb-cell-5> line 7): time.sleep(3600)"
    text = st.render()
    assert text.count("dist.all_reduce(x)") == 1  # once for the group, not per rank
    assert "torch/distributed/distributed_c10d.py line 3252 in all_reduce" in text
    assert "other threads:" in text and "rank 2 thread 'loader'" in text


def test_different_lines_are_different_groups() -> None:
    st = Stacks({0: in_collective(0, line=5), 1: in_collective(1, line=6)})
    assert len(st.groups()) == 2


def test_hint_names_the_ranks_missing_from_a_collective() -> None:
    st = Stacks({0: in_collective(0), 1: sleeping(1), 2: in_collective(2)})
    hint = st.hint()
    assert "ranks 0,2 wait in a collective (all_reduce) that rank 1 has not reached" in hint
    report = hang_report(st, 30)
    assert report.startswith("monarch_nb: no progress for 30 s")
    assert "hint: ranks 0,2 wait" in report


def test_hint_for_different_collectives_and_silent_ranks() -> None:
    other = in_collective(1)
    other.threads[0]["frames"][-1][2] = "broadcast"
    st = Stacks({0: in_collective(0), 1: other, 2: RankStacks(2, status="no answer")})
    hint = st.hint()
    assert "different collectives (all_reduce on rank 0; broadcast on rank 1)" in hint
    assert "rank 2 did not answer (no answer)" in hint
    assert st[2].where() == "no answer"


def test_hint_when_nobody_is_in_a_collective() -> None:
    st = Stacks({0: sleeping(0), 1: sleeping(1)})
    assert "no rank is in a collective" in st.hint()
    assert st.summary() == ["ranks 0,1: in stuck_here (<mnb-cell-5> line 7): time.sleep(3600)"]


def test_idle_and_dead_ranks() -> None:
    st = Stacks({0: RankStacks(0, "ok", [{"name": "MainThread", "main": True, "frames": []}]),
                 1: RankStacks(1, status="dead")})
    assert st.summary() == ["rank 0: idle (no call running)", "rank 1: dead"]


def test_short_path() -> None:
    assert short_path(C10D) == "torch/distributed/distributed_c10d.py"
    assert short_path("<mnb-cell-3>") == "<mnb-cell-3>"


def test_a_frame_being_torn_down_has_no_line_and_is_still_listed() -> None:
    # f_lineno is None for a frame whose function is returning while a
    # destructor runs in it (gloo's group freed in backends._free_group):
    # the control thread died on it once, taking heartbeats and stacks along
    from types import SimpleNamespace

    from monarch_nb.engine.debug import frames_of

    code = SimpleNamespace(co_filename="/x/monarch_nb/backends.py", co_name="_free_group")
    outer = SimpleNamespace(f_code=SimpleNamespace(co_filename="<mnb-cell-3>", co_name="<module>"),
                            f_lineno=2, f_back=None)
    inner = SimpleNamespace(f_code=code, f_lineno=None, f_back=outer)
    assert frames_of(inner) == [["<mnb-cell-3>", 2, "<module>", ""],
                                ["/x/monarch_nb/backends.py", 0, "_free_group", ""]]
