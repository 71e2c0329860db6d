"""The harness that reads ``mesh.trace()`` files back in Perfetto's own
trace processor (tests/tracecheck.py, tests/perfetto_wasm.py) reports what
Perfetto parsed, not what it was given: a hand-made trace comes back with
Perfetto's units and names, and a file Perfetto cannot read is an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .lab_util import IN_CI
from .tracecheck import perfetto_slices, trace_processor_reason


@pytest.fixture(autouse=True)
def _need_trace_processor() -> None:
    why = trace_processor_reason()
    if why and not IN_CI:
        pytest.skip(why)
    assert not why, f"in CI Perfetto's trace processor must run: {why}"


def test_a_hand_made_trace_comes_back_as_perfetto_parsed_it(tmp_path: Path) -> None:
    doc = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "rank 3"}},
        {"ph": "M", "name": "thread_name", "pid": 3, "tid": 1, "args": {"name": "calls"}},
        {"ph": "X", "name": "<mnb-cell-1>", "pid": 3, "tid": 1, "ts": 10.5, "dur": 100},
        {"ph": "X", "name": "all_reduce #0", "pid": 3, "tid": 1, "ts": 20, "dur": 7},
        {"ph": "i", "name": "died", "pid": 3, "tid": 1, "ts": 200, "s": "t"}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    slices = perfetto_slices(str(path))
    # microseconds in, nanoseconds out; the instant is a zero-length slice
    assert [(s["name"], s["ts"], s["dur"], s["thread"], s["process"]) for s in slices] == [
        ("<mnb-cell-1>", 10_500, 100_000, "calls", "rank 3"),
        ("all_reduce #0", 20_000, 7_000, "calls", "rank 3"),
        ("died", 200_000, 0, "calls", "rank 3")]


def test_a_file_perfetto_cannot_read_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "garbage.json"
    path.write_bytes(b"\x00\x01garbage, not a trace")
    with pytest.raises(ValueError, match="Perfetto could not parse the trace: Unknown trace type"):
        perfetto_slices(str(path))
