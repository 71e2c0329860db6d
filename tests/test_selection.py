"""Unit tests for monarch_nb.selection: the rank spec grammar and its formatter."""

from __future__ import annotations

import random

import pytest

from monarch_nb.errors import MonarchError, UsageError
from monarch_nb.selection import SpecError, format_ranks, parse_ranks


def test_spec_error_is_a_usage_error():
    assert issubclass(SpecError, UsageError)
    assert issubclass(SpecError, MonarchError)
    assert issubclass(SpecError, ValueError)


@pytest.mark.parametrize("spec,world,expected", [
    ("3", 4, (3,)),
    ("0", 1, (0,)),
    ("0,2", 4, (0, 2)),
    ("2,0", 4, (0, 2)),
    ("1,1,1", 4, (1,)),
    ("1-3", 4, (1, 2, 3)),
    ("0-0", 4, (0,)),
    ("0-1,3", 4, (0, 1, 3)),
    ("0-2,1-3", 4, (0, 1, 2, 3)),
    ("::2", 4, (0, 2)),
    ("::2", 5, (0, 2, 4)),
    ("1::2", 6, (1, 3, 5)),
    ("1:3", 4, (1, 2)),
    (":2", 4, (0, 1)),
    ("2:", 4, (2, 3)),
    (":", 3, (0, 1, 2)),
    ("::-1", 3, (0, 1, 2)),
    ("-2:", 4, (2, 3)),
    ("0:100", 4, (0, 1, 2, 3)),
    ("0,2:4", 5, (0, 2, 3)),
    ("all", 3, (0, 1, 2)),
    ("ALL", 2, (0, 1)),
    ("*", 2, (0, 1)),
    (" 3 ", 4, (3,)),
    (" 0 , 2 ", 4, (0, 2)),
    (" 1 - 3 ", 4, (1, 2, 3)),
    (" : : 2 ", 4, (0, 2)),
    ("\tall\n", 2, (0, 1)),
])
def test_parse_strings(spec, world, expected):
    assert parse_ranks(spec, world) == expected


@pytest.mark.parametrize("spec,world,expected", [
    (None, 3, (0, 1, 2)),
    (0, 1, (0,)),
    (3, 4, (3,)),
    (slice(1, 3), 4, (1, 2)),
    (slice(None, None, 2), 5, (0, 2, 4)),
    (slice(None), 2, (0, 1)),
    (slice(-1, None), 4, (3,)),
    ([2, 0, 2], 4, (0, 2)),
    ((1, 3), 4, (1, 3)),
    (range(1, 4), 4, (1, 2, 3)),
    ({3, 1}, 4, (1, 3)),
    (iter([1, 2]), 4, (1, 2)),
])
def test_parse_python_values(spec, world, expected):
    assert parse_ranks(spec, world) == expected


def test_parse_numpy_ints():
    np = pytest.importorskip("numpy")
    assert parse_ranks([np.int64(2), np.int32(0)], 4) == (0, 2)


def test_result_is_sorted_unique_tuple():
    out = parse_ranks("3,1,2,1", 4)
    assert isinstance(out, tuple)
    assert out == (1, 2, 3)


@pytest.mark.parametrize("spec,world,bad", [
    ("4", 4, "4"),
    ("0,5", 4, "5"),
    ("2-6", 4, "4-6"),
    ("-1", 4, "-1"),
    (7, 4, "7"),
    (-1, 4, "-1"),
    ([0, 9], 4, "9"),
    ((4, 5), 4, "4,5"),
])
def test_out_of_range_says_which_ranks_exist(spec, world, bad):
    with pytest.raises(SpecError) as info:
        parse_ranks(spec, world)
    msg = str(info.value)
    assert f"rank {bad} does not exist" in msg
    assert "this mesh has ranks 0-3" in msg


def test_out_of_range_single_rank_mesh():
    with pytest.raises(SpecError, match="this mesh has only rank 0"):
        parse_ranks("1", 1)


def test_backwards_range():
    with pytest.raises(SpecError) as info:
        parse_ranks("3-1", 4)
    assert "runs backwards" in str(info.value)
    assert "1-3" in str(info.value)  # tells the user what to write


@pytest.mark.parametrize("spec", ["", "   ", "\t"])
def test_empty_spec(spec):
    with pytest.raises(SpecError, match="empty"):
        parse_ranks(spec, 4)


@pytest.mark.parametrize("spec", ["0,", ",1", "0,,2", " , "])
def test_empty_item(spec):
    with pytest.raises(SpecError, match="empty item"):
        parse_ranks(spec, 4)


@pytest.mark.parametrize("spec", [
    "x", "one", "1.5", "1-", "-", "1-2-3", "-1-2", "a:b", "1:2:3:4", "0;1", "rank 1",
    "0x1", "[0,1]",
])
def test_garbage_says_what_is_valid(spec):
    with pytest.raises(SpecError) as info:
        parse_ranks(spec, 4)
    assert "use a rank (3), a list (0,2), a range (1-3), a step (::2) or all" in str(info.value)


@pytest.mark.parametrize("spec", ["1--2", "1-x", "x-1", "1:x"])
def test_more_garbage(spec):
    with pytest.raises(SpecError):
        parse_ranks(spec, 4)


@pytest.mark.parametrize("spec", [1.5, object(), True, False, ["a"], [None], b"1"])
def test_garbage_python_values(spec):
    with pytest.raises(SpecError):
        parse_ranks(spec, 4)


@pytest.mark.parametrize("spec", ["::0", "0:4:0", "1::0"])
def test_step_zero_string(spec):
    with pytest.raises(SpecError, match="step of 0"):
        parse_ranks(spec, 4)


def test_step_zero_slice():
    with pytest.raises(SpecError):
        parse_ranks(slice(None, None, 0), 4)


@pytest.mark.parametrize("spec", ["3:1", "5:", slice(5, 9), slice(3, 1), [], ()])
def test_selects_nothing(spec):
    with pytest.raises(SpecError, match="selects no rank"):
        parse_ranks(spec, 4)


@pytest.mark.parametrize("world", [0, -1])
def test_no_ranks_in_mesh(world):
    with pytest.raises(SpecError, match="no ranks"):
        parse_ranks("all", world)


@pytest.mark.parametrize("ranks,text", [
    ([0, 1, 2, 5], "0-2,5"),
    ([0, 1], "0,1"),
    ([3], "3"),
    ([0, 1, 2, 3], "0-3"),
    ([5, 0, 2, 1], "0-2,5"),
    ([1, 1, 2, 2, 3], "1-3"),
    ([0, 2, 4], "0,2,4"),
    ([0, 1, 3, 4], "0,1,3,4"),
    ([0, 1, 2, 4, 5, 7, 8, 9], "0-2,4,5,7-9"),
    ((r for r in [9, 8]), "8,9"),
    ([], "none"),
])
def test_format_ranks(ranks, text):
    assert format_ranks(ranks) == text


def test_format_then_parse_round_trips():
    rng = random.Random(1234)
    for _ in range(300):
        world = rng.randint(1, 40)
        ranks = tuple(sorted(rng.sample(range(world), rng.randint(1, world))))
        assert parse_ranks(format_ranks(ranks), world) == ranks
