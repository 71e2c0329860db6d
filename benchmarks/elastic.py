#!/usr/bin/env python3
"""An elastic world size across hosts: the time to shrink when a host is lost,
and to grow back when a host is given (issue 39, item 6).

    sudo .venv/bin/python benchmarks/elastic.py [--repeat 3] [--quick] [--host-timeout 3]
                                                [--json out.json]

Network namespaces stand for hosts (tests/engines.py, as in
tests/test_netns_hosts.py): the controller in one, 2 + 2 CPU ranks on hosts
A and B through their host agents (the ssh launcher with
``MONARCH_NB_SSH="ip netns exec {host} sh -c"``), ``min_ranks=2``,
``host_timeout`` as given (3 s by default), no spare host. One trial is the
grow driver of tests/engines.py (``GROW_DRIVER``) on a fresh set of
namespaces:

1. an elastic training cell runs (``mesh.exec(cell, elastic=True)``, an
   all_reduce per step, ``state.commit()`` after each); host B is lost (every
   process in its namespace killed, the namespace deleted). **Shrink**: from
   the loss to the first step at world size 2 (the survivors' own clocks);
   target ``host_timeout`` + 1 s.
2. after 5 steps at world size 2, ``mesh.add_hosts(C)`` while the same cell
   runs: ranks 2, 3 start on C and join the loop at its next commit.
   **Grow**: from ``add_hosts`` to the first step at world size 4; target
   the cold start of the added ranks + 1 s.
3. the cold start of the added ranks, in the same run: with no call running,
   host C is lost, then ``mesh.add_hosts(D)``: from ``add_hosts`` until
   ranks 2, 3 are ready (agent on D, processes started, group joined), plus
   the cell's set-up on them (imports, model, optimizer: what a new process
   of the cell runs before its first step).

Times are wall clock on one machine. Medians (min-max) over --repeat trials
(--quick: one). No assertions: figures only (tests/test_netns_hosts.py
checks the behaviour). Needs root (ip netns).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def trial(host_timeout: float) -> dict[str, Any]:
    from tests.engines import netns_hosts, run_grow_driver

    # controller, host A, host B (lost), host C (given, lost idle), host D (given idle)
    with netns_hosts(5) as hosts, tempfile.TemporaryDirectory() as folder:
        r = run_grow_driver(hosts, Path(folder), REPO, host=2, add=3, add_idle=4,
                            host_timeout=host_timeout)
    outs = r["results"]
    if r["lost"] or sorted(outs) != ["0", "1", "2", "3"]:
        raise RuntimeError(f"the cell did not finish at world size 4: {r}")
    sizes = outs["0"]["sizes"]  # [(4, t), (2, t), (4, t)]
    ready = [t for t, rank, kind in r["timeline"] if kind == "ready" and rank in (2, 3)]
    return {
        "grow_ready_s": max(ready) if len(ready) == 2 else float("nan"),
        "shrink_s": sizes[1][1] - r["lost_at"],
        "grow_s": sizes[2][1] - r["add_at"],
        "ready_s": r["ready_idle_at"] - r["add_idle_at"],
        "setup_s": r["setup_s"],
        "cold_s": r["ready_idle_at"] - r["add_idle_at"] + r["setup_s"],
        "same_model": float(len({o["hash"] for o in outs.values()}) == 1),
    }


def _span(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one trial")
    p.add_argument("--host-timeout", type=float, default=3.0,
                   help="the mesh's host_timeout: how long a silent host agent is waited for")
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    if os.geteuid() != 0:
        print("elastic.py needs root (ip netns)", file=sys.stderr)
        return 2
    # a SIGTERM unwinds like an error: the driver's mesh stops, the namespaces go
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    repeat = 1 if ns.quick else ns.repeat
    runs: list[dict[str, Any]] = []
    for i in range(repeat):
        print(f"trial {i + 1} ...", file=sys.stderr, flush=True)
        runs.append(trial(ns.host_timeout))

    def col(key: str) -> list[float]:
        return [x[key] for x in runs]

    ht = ns.host_timeout
    cold = statistics.median(col("cold_s"))
    shrink, grow = statistics.median(col("shrink_s")), statistics.median(col("grow_s"))
    rows = [
        ("host B lost: to the first step at world size 2", f"<= host_timeout + 1 s = {ht + 1:.2f} s",
         _span(col("shrink_s")), f"{shrink / (ht + 1):.2f}"),
        ("`add_hosts(C)` mid-cell: to the first step at world size 4",
         f"<= cold start + 1 s = {cold + 1:.2f} s", _span(col("grow_s")),
         f"{grow / (cold + 1):.2f}"),
        ("... of which: `add_hosts(C)` to ranks 2, 3 ready (in the larger group)", "",
         _span(col("grow_ready_s")), ""),
        ("cold start of the added ranks (no call running): `add_hosts(D)` to ready",
         "", _span(col("ready_s")), ""),
        ("... plus the cell's set-up on them (imports, model, optimizer)", "",
         _span(col("setup_s")), ""),
    ]
    print(f"| 2 + 2 ranks, host_timeout {ht:g} s | target | measured (median, min-max) "
          "| measured / target |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    same = sum(int(x["same_model"]) for x in runs)
    print(f"\n{repeat} trial(s), one fresh mesh and set of namespaces each; the cell finished "
          f"at world size 4 with one model on every rank in {same}/{repeat}.")
    if ns.json:
        Path(ns.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
