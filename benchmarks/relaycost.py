#!/usr/bin/env python3
"""What the host agent's relay costs where it cannot gain: 4 real ranks on 2
"hosts" that are this machine (``MONARCH_NB_SSH="sh -c"``), with the relay
(``relay=True``, the default: both channels through the agent; big frames
to the agent by shared memory, wire/link.py ``SHM``), with the relay but
its big frames copied through the rank's link as before
(``shm_threshold=None``), and without (``relay=False``: each rank its own
two DEALERs).

    .venv/bin/python benchmarks/relaycost.py [--calls 200] [--gib 1]

Per mode: the median of ``--calls`` no-op calls to all 4 ranks, and the time
for a ``--gib`` GiB result from rank 3. On one machine the relay is an extra
hop on the same cores; across hosts the hop is local to the ranks' host and
the network carries one connection per host (benchmarks/scale.py --agents
shows the gain at many ranks). No assertions: figures only; each mesh is
stopped in a ``finally``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from monarch_nb import Mesh  # noqa: E402


def measure(mode: str, calls: int, gib: float) -> dict[str, float]:
    os.environ["MONARCH_NB_SSH"] = "sh -c"
    mesh = Mesh.start(n=4, backend="cpu", launcher="ssh", hosts="hA,hB", bind="127.0.0.1",
                      master_addr="127.0.0.1", start_timeout=90, relay=mode != "direct",
                      shm_threshold=None if mode == "socket" else 1 << 20)
    try:
        for _ in range(20):
            mesh.run(lambda: None)
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            mesh.run(lambda: None)
            times.append(time.perf_counter() - t)
        size = int(gib * (1 << 30))
        t = time.perf_counter()
        got = mesh.ranks(3).run(lambda: b"x" * size)
        big = time.perf_counter() - t
        assert len(got[3]) == size  # a sanity check, not a figure
        return {"noop_ms": statistics.median(times) * 1e3, "big_s": big}
    finally:
        mesh.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--gib", type=float, default=1.0)
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", file=sys.stderr)
    rows = {mode: measure(mode, args.calls, args.gib) for mode in ("relay", "socket", "direct")}
    print(f"| 4 ranks on 2 hosts (this machine) | no-op median | {args.gib:g} GiB result |")
    print("|---|---:|---:|")
    for mode, r in rows.items():
        label = {"relay": "through the agents (relay)",
                 "socket": "through the agents, big frames by socket (shm_threshold=None)",
                 "direct": "own DEALERs (relay=False)"}[mode]
        print(f"| {label} | {r['noop_ms']:.2f} ms | {r['big_s']:.2f} s |")


if __name__ == "__main__":
    main()
