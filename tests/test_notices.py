"""monarch_nb.notices: the respawn line a cell starts with, and the one line
per group of ranks an interrupted cell shows (issue 28, item 5)."""

from __future__ import annotations

import pickle
import time

from monarch_nb.notices import CellInterrupted, respawn_notices, user_location

T0 = 1_800_000_000.0


def ev(t: float, rank: int, inc: int, kind: str, detail: str = "") -> dict[str, object]:
    return {"time": T0 + t, "rank": rank, "incarnation": inc, "kind": kind, "detail": detail}


def hms(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(T0 + t))


def test_a_respawn_after_the_cursor_is_one_line():
    events = [ev(0, 1, 0, "ready", "cpu"), ev(5, 1, 0, "died", "killed by SIGKILL"),
              ev(5.1, 1, 1, "started", "pid 9"), ev(6, 1, 1, "ready", "cpu")]
    assert respawn_notices(events, T0 + 1, []) == [
        f"rank 1 was respawned at {hms(6)} (killed by SIGKILL); its namespace is new: "
        "no setup cells"]
    assert respawn_notices(events, T0 + 1, ["<mnb-cell-2>"])[0].endswith("setup cells replayed")
    assert respawn_notices(events, T0 + 6, []) == []  # already said (or announced)


def test_ranks_that_share_the_story_share_the_line():
    events = [ev(5, 0, 0, "died", "killed by SIGTERM"), ev(5, 2, 0, "died", "killed by SIGTERM"),
              ev(6, 0, 1, "ready"), ev(6, 2, 1, "ready"),
              ev(5, 3, 0, "died", "exited with code 1"), ev(6, 3, 1, "ready")]
    lines = respawn_notices(events, T0, [])
    assert f"ranks 0,2 were respawned at {hms(6)} (killed by SIGTERM); their namespaces are new: no setup cells" in lines
    assert any(line.startswith("rank 3 was respawned") and "exited with code 1" in line
               for line in lines)
    assert len(lines) == 2


def test_a_rank_not_back_yet_or_a_death_already_announced_says_nothing_here():
    assert respawn_notices([ev(5, 1, 0, "died", "killed by SIGKILL")], T0, []) == []
    # the death was announced inside a running cell: its READY alone is not news
    assert respawn_notices([ev(5, 1, 0, "died"), ev(8, 1, 1, "ready")], T0 + 6, []) == []


def test_a_failed_setup_replay_is_named():
    events = [ev(5, 1, 0, "died", "killed by SIGKILL"), ev(6, 1, 1, "ready"),
              ev(6.5, 1, 1, "setup_failed", "<mnb-cell-2>: NameError: name 'x' is not defined")]
    (line,) = respawn_notices(events, T0, ["<mnb-cell-2>"])
    assert line.endswith("its namespace is new: replaying setup cell <mnb-cell-2>: "
                         "NameError: name 'x' is not defined")


def test_interrupt_summary_groups_ranks_by_their_user_frame():
    where = {0: "<mnb-cell-4> line 3 in <module>: time.sleep(60)",
             1: "<mnb-cell-4> line 3 in <module>: time.sleep(60)",
             2: ("/usr/lib/python3/site-packages/torch/distributed/c10d.py line 2500 in "
                 "all_reduce: work.wait() <- <mnb-cell-4> line 7 in step: dist.all_reduce(t)"),
             3: "finished before the interrupt arrived"}
    exc = CellInterrupted(where)
    assert isinstance(exc, KeyboardInterrupt) and type(exc).__name__ == "KeyboardInterrupt"
    assert exc._render_traceback_() == [
        "KeyboardInterrupt: interrupted rank(s) 0-3",
        "  ranks 0,1: stopped at <mnb-cell-4>:3 in <module> (time.sleep(60))",
        "  rank 2: stopped at <mnb-cell-4>:7 in step (dist.all_reduce(t))",
        "  rank 3: finished before the interrupt arrived",
    ]
    assert "torch/distributed" not in "\n".join(exc._render_traceback_())
    assert pickle.loads(pickle.dumps(exc)).where == where
    assert user_location("f.py line 9 in g") == "stopped at f.py:9 in g"
    assert CellInterrupted({})._render_traceback_() == ["KeyboardInterrupt"]
