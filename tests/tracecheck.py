"""Reading a ``mesh.trace()`` file back, as a trace viewer would.

:func:`check_chrome_trace` holds a document to the rules of the Chrome
trace-event JSON format that Perfetto's JSON importer and chrome://tracing
rely on (every event typed and placed, times in µs, complete slices that
nest on their thread, counters numeric, instants scoped), so a trace that
passes loads without dropped or misplaced slices.

:func:`perfetto_slices` loads the file in Perfetto's own trace processor
(the ``perfetto`` package) and returns its slices. That package does not
ship the ``trace_processor_shell`` binary: at first use it downloads a
prebuilt from Perfetto's artifact storage, which is no package registry,
so where it cannot (an offline machine, this project's CI) the caller is
told why; ``MNB_TRACE_PROCESSOR_SHELL`` names a binary to use instead.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

_PHASES = {"X", "M", "C", "i", "I"}


def check_chrome_trace(doc: dict[str, Any]) -> None:
    """AssertionError naming the first event that breaks the format."""
    assert isinstance(doc.get("traceEvents"), list), "no traceEvents list"
    assert doc.get("displayTimeUnit") in (None, "ms", "ns")
    threads: dict[tuple[int, int], list[tuple[float, float, str]]] = defaultdict(list)
    named: set[int] = set()
    for e in doc["traceEvents"]:
        ph = e.get("ph")
        assert ph in _PHASES, f"unknown phase in {e}"
        assert isinstance(e.get("name"), str) and e["name"], f"unnamed event {e}"
        assert isinstance(e.get("pid"), int), f"no integer pid in {e}"
        if ph == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name"), e
            if e["name"] == "thread_name":
                assert isinstance(e.get("tid"), int), e
            if e["name"] == "process_name":
                named.add(e["pid"])
            continue
        ts = e.get("ts")
        assert isinstance(ts, (int, float)) and ts >= 0, f"bad ts in {e}"
        if ph == "X":
            assert isinstance(e.get("tid"), int), f"slice without a thread: {e}"
            dur = e.get("dur")
            assert isinstance(dur, (int, float)) and dur >= 0, f"bad dur in {e}"
            threads[(e["pid"], e["tid"])].append((float(ts), float(ts) + float(dur), e["name"]))
        elif ph == "C":
            args = e.get("args")
            assert isinstance(args, dict) and args and all(
                isinstance(v, (int, float)) for v in args.values()), f"counter without numbers: {e}"
        else:
            assert e.get("s", "t") in ("t", "p", "g"), f"bad instant scope in {e}"
    for (pid, tid), slices in threads.items():
        assert pid in named, f"slices of pid {pid}, which has no process_name"
        open_ends: list[tuple[float, str]] = []  # the enclosing slices' ends
        for start, end, name in sorted(slices, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1][0] <= start:
                open_ends.pop()
            if open_ends:
                assert end <= open_ends[-1][0], (
                    f"pid {pid} tid {tid}: {name!r} [{start}, {end}] overlaps "
                    f"{open_ends[-1][1]!r} without nesting in it")
            open_ends.append((end, name))


def trace_processor_reason() -> str:
    """"" when Perfetto's trace processor can run here, else why not."""
    try:
        import perfetto.trace_processor  # noqa: F401
    except ImportError:
        return "the perfetto package is not installed"
    shell = os.environ.get("MNB_TRACE_PROCESSOR_SHELL")
    if shell:
        return "" if os.access(shell, os.X_OK) else f"MNB_TRACE_PROCESSOR_SHELL={shell} is not executable"
    cached = Path.home() / ".local" / "share" / "perfetto" / "prebuilts"
    if cached.is_dir() and any(p.name.startswith("trace_processor_shell") and
                               not p.name.endswith(".tmp") for p in cached.iterdir()):
        return ""
    return ("perfetto's TraceProcessor needs the trace_processor_shell binary, which the "
            "perfetto package does not ship but downloads from Perfetto's artifact storage "
            "at first use (not a package registry, unreachable here); set "
            "MNB_TRACE_PROCESSOR_SHELL to a trace_processor_shell binary to run this check")


def perfetto_slices(path: str) -> list[dict[str, Any]]:
    """Every slice of the trace as Perfetto reads it: name, ts and dur in
    ns, its thread's and process's names."""
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    shell = os.environ.get("MNB_TRACE_PROCESSOR_SHELL")
    config = TraceProcessorConfig(bin_path=shell) if shell else TraceProcessorConfig()
    tp = TraceProcessor(trace=path, config=config)
    try:
        rows = tp.query(
            "select slice.name as name, slice.ts as ts, slice.dur as dur, "
            "thread.name as thread, process.name as process "
            "from slice join thread_track on slice.track_id = thread_track.id "
            "join thread using (utid) left join process using (upid) order by slice.ts")
        return [{"name": r.name, "ts": r.ts, "dur": r.dur, "thread": r.thread,
                 "process": r.process} for r in rows]
    finally:
        tp.close()
