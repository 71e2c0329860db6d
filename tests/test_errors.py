"""Unit tests for monarch_nb.errors: the error tree and how it renders."""

from __future__ import annotations

import pickle

import pytest

from monarch_nb import errors
from monarch_nb.errors import (
    CallTimeout,
    MembershipChanged,
    MeshNotRunning,
    MonarchError,
    ProtocolError,
    RankDied,
    RankErrors,
    RemoteError,
    UsageError,
    collective_hint,
)
from monarch_nb.selection import SpecError

TB_VALUE = (
    "Traceback (most recent call last):\n"
    '  File "<mnb-cell-1>", line 2, in <module>\n'
    "    raise ValueError('boom')\n"
    "ValueError: boom\n"
)
TB_KEY = (
    "Traceback (most recent call last):\n"
    '  File "train.py", line 9, in step\n'
    "    batch['missing']\n"
    "KeyError: 'missing'\n"
)


def value_error(rank: int) -> RemoteError:
    return RemoteError(rank, "ValueError", "boom", TB_VALUE)


def key_error(rank: int) -> RemoteError:
    return RemoteError(rank, "KeyError", "'missing'", TB_KEY)


def examples() -> list[BaseException]:
    return [
        MeshNotRunning(),
        UsageError("bad option"),
        SpecError("bad spec"),
        ProtocolError("replay", "ctl #1"),
        value_error(0),
        RankDied(1, signal_name="SIGKILL"),
        MembershipChanged(0, [1]),
        CallTimeout(1.0, {0: "x.py:1"}),
        RankErrors({0: value_error(0)}),
    ]


# -- the tree -----------------------------------------------------------------

@pytest.mark.parametrize("err", examples(), ids=lambda e: type(e).__name__)
def test_every_error_is_a_monarch_error(err):
    assert isinstance(err, MonarchError)
    assert isinstance(err, Exception)


def test_every_exception_class_in_the_module_is_a_monarch_error():
    classes = [v for v in vars(errors).values()
               if isinstance(v, type) and issubclass(v, BaseException)]
    assert len(classes) >= 9
    for cls in classes:
        assert issubclass(cls, MonarchError), cls


def test_usage_error_is_a_value_error():
    assert issubclass(UsageError, ValueError)


@pytest.mark.parametrize("err", [e for e in examples() if not isinstance(e, RankErrors)],
                         ids=lambda e: type(e).__name__)
def test_render_traceback_is_one_entry(err):
    out = err._render_traceback_()
    assert isinstance(out, list) and len(out) == 1
    assert out[0] == f"{type(err).__name__}: {err}"


@pytest.mark.parametrize("err", [MeshNotRunning(), UsageError("bad option"), ProtocolError("replay"),
                                 value_error(3), RankDied(2, exitcode=1), MembershipChanged(0, [1])],
                         ids=lambda e: type(e).__name__)
def test_simple_errors_render_as_a_single_line(err):
    (line,) = err._render_traceback_()
    assert "\n" not in line


def test_mesh_not_running():
    assert "%monarch start" in str(MeshNotRunning())
    assert "Mesh.start" in str(MeshNotRunning())
    assert str(MeshNotRunning("controller died")) == "controller died"


def test_protocol_error():
    err = ProtocolError("bad-signature")
    assert err.reason == "bad-signature"
    assert str(err) == "bad-signature"
    assert str(ProtocolError("truncated", "1 frame(s)")) == "truncated: 1 frame(s)"


# -- RemoteError --------------------------------------------------------------

def test_remote_error_fields_and_str():
    err = value_error(3)
    assert (err.rank, err.type_name, err.message, err.traceback_text) == (3, "ValueError", "boom", TB_VALUE)
    assert str(err) == "rank 3: ValueError: boom"
    assert err.signature == ("ValueError", "boom", TB_VALUE)
    assert value_error(0).signature == value_error(5).signature


def test_remote_error_is_frozen():
    with pytest.raises(AttributeError):
        value_error(0).rank = 2


def test_remote_error_can_be_raised():
    with pytest.raises(RemoteError, match="rank 1: ValueError: boom"):
        raise value_error(1)


# -- RankDied -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs,cause", [
    ({"signal_name": "SIGKILL"}, "killed by SIGKILL"),
    ({"signal_name": "SIGSEGV", "exitcode": -11}, "killed by SIGSEGV"),
    ({"exitcode": 3}, "exited with code 3"),
    ({"exitcode": 0}, "exited with code 0"),
    ({}, "stopped answering"),
])
def test_rank_died_cause(kwargs, cause):
    err = RankDied(2, **kwargs)
    assert err.cause == cause
    assert str(err) == f"rank 2 died ({cause})"


def test_rank_died_last_lines():
    err = RankDied(1, signal_name="SIGKILL", last_lines=("step 10", "loss 0.5"), incarnation=2)
    text = str(err)
    assert text.startswith("rank 1 died (killed by SIGKILL)")
    assert "its last output:" in text
    assert text.splitlines()[-2:] == ["    step 10", "    loss 0.5"]
    assert err.incarnation == 2


# -- MembershipChanged / CallTimeout -----------------------------------------

def test_membership_changed_message():
    err = MembershipChanged(0, [3])
    assert err.rank == 0 and err.dead == (3,)
    assert str(err) == "rank 0: the group changed under a collective (rank 3 died)"


def test_membership_changed_several_dead_and_detail():
    err = MembershipChanged(5, {4, 2, 3}, "allreduce timed out")
    assert err.dead == (2, 3, 4)
    assert str(err) == ("rank 5: the group changed under a collective (rank 2-4 died): "
                        "allreduce timed out")


def test_call_timeout_lists_ranks_and_where():
    where = {2: "train.py:41 in step", 0: "<mnb-cell-3>:7 in <module>", 1: "dist.all_reduce"}
    err = CallTimeout(2.5, where)
    text = str(err)
    lines = text.splitlines()
    assert "2.5 s" in lines[0]
    assert "rank(s) 0-2" in lines[0]
    assert "stay usable" in lines[0]
    assert lines[1:] == [
        "  rank 0 was at <mnb-cell-3>:7 in <module>",
        "  rank 1 was at dist.all_reduce",
        "  rank 2 was at train.py:41 in step",
    ]
    assert err.timeout == 2.5
    where[3] = "later"
    assert 3 not in err.where  # a copy


def test_call_timeout_formats_whole_seconds():
    assert "within 10 s" in str(CallTimeout(10.0, {1: "x"}))
    assert "rank(s) 1,3" in str(CallTimeout(1, {1: "x", 3: "y"}))


def test_call_timeout_inside_a_collective_says_how_to_reform():
    c10d = ("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py line 3252 "
            "in all_reduce: work.wait() <- <mnb-cell-2> line 2 in <module>")
    err = CallTimeout(3, {0: c10d, 1: c10d, 2: "<mnb-cell-2> line 5 in <module>"})
    lines = str(err).splitlines()
    assert "stay usable" not in lines[0]
    assert lines[-1].startswith("rank(s) 0,1 were interrupted inside a torch.distributed collective")
    assert "%monarch restart all" in lines[-1]
    assert collective_hint({0: "C:\\py\\torch\\nn\\parallel\\distributed.py line 9"}).startswith("rank(s) 0 ")
    assert collective_hint({0: "train.py:3 in step"}) == ""


# -- RankErrors ---------------------------------------------------------------

def test_groups_identical_remote_errors_largest_first():
    err = RankErrors({0: value_error(0), 1: key_error(1), 2: value_error(2), 3: value_error(3)})
    groups = err.groups()
    assert [ranks for ranks, _ in groups] == [(0, 2, 3), (1,)]
    assert groups[0][1].type_name == "ValueError"
    assert groups[1][1].type_name == "KeyError"


def test_groups_ties_ordered_by_rank():
    err = RankErrors({3: key_error(3), 2: value_error(2), 0: RankDied(0, exitcode=1)})
    assert [ranks for ranks, _ in err.groups()] == [(0,), (2,), (3,)]


def test_groups_split_on_traceback_difference():
    other_tb = RemoteError(1, "ValueError", "boom", TB_VALUE.replace("line 2", "line 3"))
    err = RankErrors({0: value_error(0), 1: other_tb})
    assert len(err.groups()) == 2


def test_groups_rank_deaths_alike():
    err = RankErrors({1: RankDied(1, signal_name="SIGKILL"), 2: RankDied(2, signal_name="SIGKILL"),
                      3: RankDied(3, exitcode=1)})
    groups = err.groups()
    assert [ranks for ranks, _ in groups] == [(1, 2), (3,)]


def test_groups_membership_changed_alike():
    err = RankErrors({r: MembershipChanged(r, [3]) for r in range(3)} | {3: RankDied(3, signal_name="SIGKILL")})
    assert [ranks for ranks, _ in err.groups()] == [(0, 1, 2), (3,)]


def test_groups_membership_changed_alike_with_two_digit_ranks():
    err = RankErrors({0: MembershipChanged(0, [12]), 1: MembershipChanged(1, [12])})
    assert [ranks for ranks, _ in err.groups()] == [(0, 1)]


def test_headline_counts():
    err = RankErrors({1: value_error(1)}, results={0: 10, 2: 12, 3: 13})
    assert str(err).splitlines()[0] == "1 of 4 rank(s) failed"
    assert err.results == {0: 10, 2: 12, 3: 13}
    assert RankErrors({1: value_error(1)}, total=8).render_lines()[0] == "RankErrors: 1 of 8 rank(s) failed"
    assert err.args == ("1 of 4 rank(s) failed",)


def test_render_lines_contains_tracebacks_and_ranks():
    err = RankErrors({0: value_error(0), 1: key_error(1), 2: value_error(2), 3: value_error(3)})
    lines = err.render_lines()
    assert lines[0] == "RankErrors: 4 of 4 rank(s) failed"
    assert "--- ranks 0,2,3: ValueError: boom" in lines
    assert "--- rank 1: KeyError: 'missing'" in lines
    for tb_line in TB_VALUE.splitlines() + TB_KEY.splitlines():
        assert tb_line in lines
    # each traceback follows its own group heading, shown once
    assert lines.count("ValueError: boom") == 1
    v = lines.index("--- ranks 0,2,3: ValueError: boom")
    assert lines[v + 1:v + 1 + len(TB_VALUE.splitlines())] == TB_VALUE.splitlines()


def test_render_lines_remote_error_without_traceback():
    lines = RankErrors({0: RemoteError(0, "RuntimeError", "nope")}).render_lines()
    assert lines == ["RankErrors: 1 of 1 rank(s) failed", "--- rank 0: RuntimeError: nope"]


def test_render_lines_non_remote_errors():
    err = RankErrors({
        1: RankDied(1, signal_name="SIGKILL"),
        2: RankDied(2, signal_name="SIGKILL"),
        0: MembershipChanged(0, [1, 2]),
        3: CallTimeout(1.0, {3: "here"}),
    })
    lines = err.render_lines()
    assert "--- ranks 1,2: RankDied (2 ranks alike): rank 1 died (killed by SIGKILL)" in lines
    assert ("--- rank 0: MembershipChanged: rank 0: the group changed under a collective "
            "(rank 1,2 died)") in lines
    assert any(line.startswith("--- rank 3: CallTimeout: call did not finish") for line in lines)


def test_render_traceback_and_str():
    err = RankErrors({0: value_error(0), 1: RankDied(1, exitcode=9)})
    assert err._render_traceback_() == err.render_lines()
    assert len(err._render_traceback_()) > 1
    lines = err.render_lines()  # str() leaves out the "RankErrors: " IPython shows
    assert str(err) == "\n".join([lines[0].removeprefix("RankErrors: "), *lines[1:]])
    assert "ValueError: boom" in str(err)


def test_rank_errors_can_be_raised_and_caught_as_monarch_error():
    with pytest.raises(MonarchError) as info:
        raise RankErrors({0: value_error(0)})
    assert info.value.errors[0].type_name == "ValueError"


# -- pickling (RankErrors.__reduce__ promises this) ---------------------------

def test_rank_errors_pickle_with_plain_exceptions():
    err = RankErrors({0: ValueError("x")}, {1: 2}, 4)
    back = pickle.loads(pickle.dumps(err))
    assert (str(back.errors[0]), back.results, back.total) == ("x", {1: 2}, 4)


@pytest.mark.parametrize("err", [
    value_error(0), RankDied(1, signal_name="SIGKILL", last_lines=("x",)),
    MembershipChanged(0, [1], "d"), CallTimeout(1.0, {0: "here"}),
    RankErrors({0: value_error(0), 1: RankDied(1, exitcode=2)}),
], ids=lambda e: type(e).__name__)
def test_errors_pickle_round_trip(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err)


# -- the ranks that succeeded, and backend messages quoted (issue 28, item 5) ----------

def test_rank_errors_show_and_keep_the_values_of_the_ranks_that_succeeded():
    from monarch_nb.results import RankResults

    err = RankErrors({1: value_error(1), 3: value_error(3)}, results={0: 10, 2: 12})
    assert isinstance(err.results, RankResults) and dict(err.results) == {0: 10, 2: 12}
    lines = err.render_lines()
    assert lines[1] == "--- ranks 0,2 succeeded: {0: 10, 2: 12} (kept in .results)", lines
    assert err._render_traceback_() == lines
    assert "ranks 0,2 succeeded: {0: 10, 2: 12}" in str(err)
    same = RankErrors({1: value_error(1)}, results={0: 5, 2: 5, 3: 5})
    assert "--- ranks 0,2,3 succeeded: ranks 0,2,3: 5 (kept in .results)" in same.render_lines()
    one = RankErrors({1: value_error(1)}, results={0: "x" * 1000})
    shown = one.render_lines()[1]
    assert shown.startswith("--- rank 0 succeeded: 'xxx") and len(shown) < 500
    assert RankErrors({0: value_error(0)}).render_lines()[1].startswith("--- rank 0: ValueError")


def test_rank_errors_results_survive_pickling():
    err = pickle.loads(pickle.dumps(RankErrors({1: value_error(1)}, {0: 7}, 2)))
    assert type(err.results).__name__ == "RankResults" and err.results == {0: 7}


GLOO = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[127.0.0.1]:41234. This may indicate a possible application crash on rank 0 or a "
        "network set up issue; it can also be caused by bugs in the application that make "
        "one rank leave a collective early. Check the logs of every rank.\nsecond line")


def test_quoted_backend_messages_are_cut_at_a_sentence_never_mid_word():
    text = errors.quote_first_line(GLOO)
    assert text.endswith(" ...") and not text.endswith("applic ...")
    assert text.removesuffix(" ...")[-1] in ".;", text
    assert len(text) <= 204 and "second line" not in text
    assert errors.quote_first_line("short. message\nmore") == "short. message"
    no_end = "x" * 150 + " word" * 30
    assert errors.quote_first_line(no_end) == no_end  # no sentence end: kept whole
    assert errors.quote_first_line("") == ""


def test_membership_changed_quotes_gloo_without_cutting_a_word():
    from monarch_nb.controller.calls.calltable import classify_membership

    errs: dict[int, BaseException] = {0: RemoteError(0, "RuntimeError", GLOO),
                                      1: RankDied(1, signal_name="SIGKILL")}
    classify_membership(errs)
    changed = errs[0]
    assert isinstance(changed, MembershipChanged)
    assert "bugs in the applic" not in str(changed)
    assert changed.detail == errors.quote_first_line(GLOO)
