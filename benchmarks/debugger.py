#!/usr/bin/env python3
"""What JupyterLab's debugger on the ranks costs: one command, one table.

    .venv/bin/python benchmarks/debugger.py [--ranks 4] [--calls 2000] [--json out.json]

On one CPU mesh, in interleaved rounds (the machine's noise hits every
state alike), three states of the ranks' debugger (engine/dap_rank.py):

* **off**: no rank debugged (the default, and after ``mesh.debugger(off=True)``):
  a call costs the rank one attribute check;
* **debugged, no breakpoint**: ``mesh.debugger("all")``: still unarmed (the
  tracer is armed only by a breakpoint);
* **armed**: every rank debugged with a breakpoint in a cell the calls never
  run: each call runs under ``sys.settrace``, and each Python function call
  in it meets the tracer once (a dictionary lookup; no line events outside
  the files with breakpoints).

Two calls are timed in each state: a no-op ``mesh.run(f)`` to every rank
(what benchmarks/run.py measures against the ZeroMQ floor) and a call that
makes 10,000 Python function calls on each rank (where the tracer's per-call
price shows). Figures: the median over all rounds, and the ratio to "off".
No assertions: figures only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from monarch_nb import Mesh  # noqa: E402

NOOP = lambda: None  # noqa: E731


def calls_10k() -> int:
    def f(n: int) -> int:
        return n + 1
    total = 0
    for _ in range(10_000):
        total = f(total)
    return total


def timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--calls", type=int, default=2000, help="no-op calls per state")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    mesh = Mesh.start(n=ns.ranks, backend="cpu")
    def off() -> None:
        mesh.debugger(off=True)

    def debugged() -> None:
        mesh.debugger("all")

    def armed() -> None:
        mesh.debugger("all").set_breakpoints("<never-run>", [1]).result(10)

    states: dict[str, Callable[[], None]] = {
        "off": off, "debugged, no breakpoint": debugged, "armed (a breakpoint elsewhere)": armed}
    samples: dict[str, dict[str, list[float]]] = {s: {"noop": [], "calls": []} for s in states}
    try:
        for _ in range(50):
            mesh.run(NOOP)
        for r in range(ns.rounds):
            for name, enter in states.items():
                enter()
                mesh.run(NOOP)
                samples[name]["noop"] += timed(lambda: mesh.run(NOOP), ns.calls // ns.rounds)
                samples[name]["calls"] += timed(lambda: mesh.run(calls_10k), 20)
                if name.startswith("armed"):
                    mesh.debugger("all").set_breakpoints("<never-run>", []).result(10)
            print(f"round {r + 1}/{ns.rounds}", file=sys.stderr)
    finally:
        mesh.debugger(off=True)
        mesh.stop()
    base = {k: statistics.median(samples["off"][k]) for k in ("noop", "calls")}
    print(f"\n{ns.ranks} CPU ranks, {ns.calls} no-op calls and {20 * ns.rounds} calls of "
          "10,000 Python function calls per state, interleaved\n")
    print("| state | no-op to all ranks (µs) | vs off | 10,000 function calls (ms) | vs off |")
    print("|---|---|---|---|---|")
    out: dict[str, Any] = {}
    for name in states:
        noop = statistics.median(samples[name]["noop"])
        calls = statistics.median(samples[name]["calls"])
        out[name] = {"noop_median_s": noop, "calls_median_s": calls}
        print(f"| {name} | {noop * 1e6:.0f} | {noop / base['noop']:.2f}x | {calls * 1e3:.2f} | "
              f"{calls / base['calls']:.2f}x |")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"states": out, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
