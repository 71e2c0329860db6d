"""Unit tests for monarch_nb.controller.calls.output: labelling and folding of rank output.

Time is passed explicitly with ``now=``; nothing sleeps.
"""

from __future__ import annotations

import re

import pytest

from monarch_nb.controller.calls.output import FOLD_S, PARTIAL_S, CallOutput, describe_where, render
from monarch_nb.selection import parse_ranks

LABEL = re.compile(r"^\[([0-9,\-]+)\] (.*)$")


class Sink:
    """Collects (stream, text) emissions."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, stream: str, text: str) -> None:
        self.calls.append((stream, text))

    def text(self, stream: str | None = None) -> str:
        return "".join(t for s, t in self.calls if stream is None or s == stream)

    def lines(self, stream: str | None = None) -> list[str]:
        return self.text(stream).splitlines()


def per_rank(lines: list[str], world: int = 64) -> dict[int, list[str]]:
    """Undo the labels: what each rank printed, in the order shown."""
    out: dict[int, list[str]] = {}
    for line in lines:
        m = LABEL.match(line)
        assert m, line
        for r in parse_ranks(m.group(1), world):
            out.setdefault(r, []).append(m.group(2))
    return out


@pytest.fixture
def sink() -> Sink:
    return Sink()


@pytest.fixture
def out(sink) -> CallOutput:
    return CallOutput(sink)


def test_constants():
    assert 0 < FOLD_S < PARTIAL_S


# -- labelling and timing -------------------------------------------------------

def test_label(out, sink):
    out.feed(3, "stdout", "loss 0.1\n", now=0.0)
    out.flush(now=FOLD_S)
    assert sink.calls == [("stdout", "[3] loss 0.1\n")]
    assert not out.pending


def test_lines_wait_for_the_fold_window(out, sink):
    out.feed(0, "stdout", "hello\n", now=0.0)
    assert out.pending
    out.flush(now=0.0)
    out.flush(now=FOLD_S * 0.99)
    assert sink.calls == []
    out.flush(now=FOLD_S)  # exactly FOLD_S later: due
    assert sink.calls == [("stdout", "[0] hello\n")]


def test_window_counts_from_the_oldest_line(out, sink):
    out.feed(0, "stdout", "a\n", now=0.0)
    out.feed(1, "stdout", "b\n", now=FOLD_S * 0.9)  # does not extend the wait
    out.flush(now=FOLD_S)
    assert sink.lines() == ["[0] a", "[1] b"]


def test_multiple_lines_in_one_chunk(out, sink):
    out.feed(2, "stdout", "one\ntwo\n\nthree\n", now=0.0)
    out.flush(force=True)
    assert sink.lines() == ["[2] one", "[2] two", "[2] ", "[2] three"]


def test_flush_without_output_emits_nothing(out, sink):
    out.flush(force=True)
    out.flush(now=1e9)
    assert sink.calls == []
    assert not out.pending


# -- folding --------------------------------------------------------------------

def test_fold_identical_lines(out, sink):
    for r in range(4):
        out.feed(r, "stdout", "epoch 1\n", now=0.01 * r)
    out.flush(now=FOLD_S)
    assert sink.calls == [("stdout", "[0-3] epoch 1\n")]


def test_fold_names_exactly_the_ranks(out, sink):
    for r in (0, 2, 3, 5):
        out.feed(r, "stdout", "same\n", now=0.0)
    out.feed(1, "stdout", "other\n", now=0.0)
    out.flush(force=True)
    assert sink.lines() == ["[0,2,3,5] same", "[1] other"]


def test_no_fold_across_windows(out, sink):
    out.feed(0, "stdout", "epoch 1\n", now=0.0)
    out.flush(now=FOLD_S)
    out.feed(1, "stdout", "epoch 1\n", now=FOLD_S + 0.01)
    out.flush(now=2 * FOLD_S + 0.02)
    assert sink.lines() == ["[0] epoch 1", "[1] epoch 1"]


def test_feed_order_of_ranks_does_not_matter(out, sink):
    for r in (3, 1, 0, 2):
        out.feed(r, "stdout", "x\n", now=0.0)
    out.flush(force=True)
    assert sink.lines() == ["[0-3] x"]


def test_per_rank_order_preserved_with_different_sequences(out, sink):
    printed = {
        0: ["start", "a", "b", "done"],
        1: ["start", "b", "a", "done"],
        2: ["start", "done"],
        3: ["x", "start", "a", "b", "done", "extra"],
    }
    for r, lines in printed.items():
        for line in lines:  # one line per chunk, interleaved by rank
            out.feed(r, "stdout", line + "\n", now=0.0)
    out.flush(force=True)
    assert per_rank(sink.lines()) == printed
    assert sink.lines()[0] == "[0-2] start"


def test_per_rank_order_with_interleaved_chunks(out, sink):
    printed = {r: [f"step {i}" if i % 2 else f"rank-{r} {i}" for i in range(6)] for r in range(4)}
    for i in range(6):
        for r in range(4):
            out.feed(r, "stdout", printed[r][i] + "\n", now=0.0)
    out.flush(force=True)
    assert per_rank(sink.lines()) == printed
    assert "[0-3] step 1" in sink.lines()


def test_fold_disabled_emits_each_feed_at_once(sink):
    out = CallOutput(sink, fold=False)
    out.feed(0, "stdout", "same\n", now=0.0)
    out.feed(1, "stdout", "same\n", now=0.0)
    assert sink.lines() == ["[0] same", "[1] same"]


# -- partial lines --------------------------------------------------------------

def test_partial_line_held_until_newline(out, sink):
    out.feed(0, "stdout", "abc", now=0.0)
    assert out.pending
    out.flush(now=FOLD_S * 2)
    assert sink.calls == []
    out.feed(0, "stdout", "def", now=0.1)
    out.feed(0, "stdout", "\nnext", now=0.2)
    out.flush(now=0.2 + FOLD_S * 1.01)
    assert sink.calls == [("stdout", "[0] abcdef\n")]
    assert out.pending  # "next" is still waiting


def test_partial_line_forced_flush(out, sink):
    out.feed(1, "stdout", "progress 50%", now=0.0)
    out.flush(force=True)
    assert sink.calls == [("stdout", "[1] progress 50%\n")]
    assert not out.pending


def test_a_forced_flush_for_some_ranks_keeps_the_others_half_lines(out, sink):
    # script mode: one output shared by every rank's call; rank 0's call ends
    # while rank 1 has written "rank" of print("rank", 1, ...)
    out.feed(1, "stdout", "rank", now=0.0)
    out.feed(0, "stdout", "done\nbye", now=0.0)
    out.flush(force=True, now=0.01, ranks=(0,))
    assert sink.lines() == ["[0] done", "[0] bye"]
    out.feed(1, "stdout", " 1 local 0\n", now=0.02)
    out.flush(force=True, now=0.03, ranks=(1,))
    assert sink.lines() == ["[0] done", "[0] bye", "[1] rank 1 local 0"]
    out.feed(1, "stdout", "late", now=0.0)
    out.flush(now=PARTIAL_S, ranks=(0,))  # not forced: the usual wait still holds
    assert sink.lines()[-1] == "[1] late"


def test_partial_line_flushed_after_partial_timeout(out, sink):
    out.feed(1, "stdout", "waiting", now=0.0)
    out.flush(now=PARTIAL_S * 0.99)
    assert sink.calls == []
    out.flush(now=PARTIAL_S)
    assert sink.calls == [("stdout", "[1] waiting\n")]


def test_partials_of_several_ranks_are_kept_apart(out, sink):
    out.feed(1, "stdout", "b1", now=0.0)
    out.feed(0, "stdout", "a1", now=0.0)
    out.feed(1, "stdout", "b2\n", now=0.0)
    out.feed(0, "stdout", "a2\n", now=0.0)
    out.flush(force=True)
    assert sorted(sink.lines()) == ["[0] a1a2", "[1] b1b2"]


def test_complete_lines_before_partial_of_same_rank(out, sink):
    out.feed(0, "stdout", "line\npart", now=0.0)
    out.flush(force=True)
    assert sink.lines() == ["[0] line", "[0] part"]


def test_new_partial_gets_its_own_timeout(out, sink):
    out.feed(0, "stdout", "abc", now=0.0)
    out.feed(0, "stdout", "def\n", now=0.4)  # completes the line; nothing partial now
    out.flush(now=0.4 + FOLD_S * 1.01)
    assert sink.lines() == ["[0] abcdef"]
    out.feed(0, "stdout", "xyz", now=0.45)  # a new partial line, just started
    out.flush(now=PARTIAL_S)  # only 0.05 s later: must still wait
    assert sink.lines() == ["[0] abcdef"]


def test_partial_never_overtakes_earlier_lines_of_its_rank(out, sink):
    out.feed(0, "stdout", "ab", now=0.0)
    out.feed(0, "stdout", "c\nd", now=PARTIAL_S - 0.01)  # "abc" complete, "d" partial
    out.flush(now=PARTIAL_S)  # "abc" is not due yet (FOLD_S); "d" must not jump ahead
    out.flush(force=True)
    assert sink.lines() == ["[0] abc", "[0] d"]


# -- streams ------------------------------------------------------------------

def test_stderr_kept_separate(out, sink):
    out.feed(0, "stdout", "same\n", now=0.0)
    out.feed(1, "stderr", "same\n", now=0.0)
    out.feed(1, "stdout", "same\n", now=0.0)
    out.feed(0, "stderr", "warning\n", now=0.0)
    out.flush(force=True)
    assert sink.lines("stdout") == ["[0,1] same"]
    assert sink.lines("stderr") == ["[0] warning", "[1] same"]  # same position: by rank
    assert {s for s, _ in sink.calls} == {"stdout", "stderr"}


def test_stderr_partial_separate_from_stdout_partial(out, sink):
    out.feed(0, "stdout", "out-", now=0.0)
    out.feed(0, "stderr", "err-", now=0.0)
    out.feed(0, "stdout", "done\n", now=0.0)
    out.flush(force=True)
    assert sink.lines("stdout") == ["[0] out-done"]
    assert sink.lines("stderr") == ["[0] err-"]


# -- note -----------------------------------------------------------------------

def test_note_flushes_pending_output_first(out, sink):
    out.feed(0, "stdout", "before\n", now=0.0)
    out.feed(1, "stdout", "partial", now=0.0)
    out.note("rank 2 died (killed by SIGKILL)")
    assert sink.calls == [
        ("stdout", "[0] before\n"),
        ("stdout", "[1] partial\n"),
        ("stderr", "rank 2 died (killed by SIGKILL)\n"),
    ]
    assert not out.pending


def test_note_does_not_cut_a_line_that_is_still_arriving(out, sink):
    import time

    out.feed(1, "stdout", "rank", now=time.monotonic())  # print() writes in pieces
    out.note("rank 0 ready")
    out.feed(1, "stdout", " 1 sum 2.0\n")
    out.flush(force=True)
    assert sink.lines("stdout") == ["[1] rank 1 sum 2.0"]
    assert sink.lines("stderr") == ["rank 0 ready"]


def test_note_stream_and_newline(out, sink):
    out.note("already terminated\n", stream="stdout")
    assert sink.calls == [("stdout", "already terminated\n")]


# -- render -------------------------------------------------------------------

@pytest.mark.parametrize("by_rank,expected", [
    ({}, ""),
    ({2: ["x"]}, "[2] x\n"),
    ({0: ["a", "b"], 1: ["a", "c"]}, "[0,1] a\n[0] b\n[1] c\n"),
    ({0: ["a"], 1: ["a"], 2: ["a"], 3: ["a"]}, "[0-3] a\n"),
    ({1: ["a"], 0: ["b"]}, "[0] b\n[1] a\n"),
    ({0: ["a", "b", "c"], 1: ["a"]}, "[0,1] a\n[0] b\n[0] c\n"),
    ({0: [], 1: ["z"]}, "[1] z\n"),
    ({0: [""], 1: [""]}, "[0,1] \n"),
])
def test_render(by_rank, expected):
    assert render(by_rank) == expected


def test_render_preserves_each_rank_order():
    by_rank = {0: ["b", "a"], 1: ["a", "b"], 2: ["a", "a"]}
    assert per_rank(render(by_rank).splitlines()) == by_rank


def test_describe_where():
    assert describe_where({2: "train.py:10", 0: "<cell>:3"}) == "rank 0: <cell>:3; rank 2: train.py:10"
