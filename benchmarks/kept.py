"""A kept mesh's attach, and its call path before and after (issue 38).

    .venv/bin/python benchmarks/kept.py [--ranks 4] [--calls 300]
    .venv/bin/python benchmarks/kept.py --agents 8,32,128 [--per-agent 8] [--processes 4]
                                        [--door-ms 300]

Prints, side by side in one run: a no-op call and a 64 MiB push on a mesh
that is not kept (the floor of this machine's call path), on a kept mesh
before its controller lets go, and on the same kept mesh after a new
controller attached (here: the same process detaches and attaches; a
killed kernel's successor attaches the same way); and the time the attach
took. Each figure is the median of ``--calls`` calls.

``--agents 8,32,128``: a kept mesh across that many simulated hosts of
``--per-agent`` ranks each (benchmarks/simkept.py: the hosts' agents, ranks
and relays simulated in ``--processes`` processes; everything on the
controller's side real: the home agent, each host's door and handshake,
``Controller.attach``). Per row: the attach (``Mesh.attach`` until it
returns: every rank adopted, routed, its HELLO heard, its calls adopted),
the no-op median before the detach and after the attach, and the raw
ZeroMQ floor for as many hosts (one DEALER per host, as scale.py
``--agents`` prints it). ``--door-ms``: one more row at the largest size,
each simulated door answering that late (what ssh's connection and the
door's interpreter start cost on a real host, which the simulation
otherwise leaves out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __name__ == "__main__" and str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.simkept

from monarch_nb import Mesh


def noop() -> None:
    return None


def measure(mesh: Mesh, calls: int) -> tuple[float, float]:
    for _ in range(20):
        mesh.run(noop)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        mesh.run(noop)
        times.append(time.perf_counter() - t)
    big = np.ones(64 << 20, dtype=np.uint8)
    pushes = []
    for _ in range(5):
        t = time.perf_counter()
        mesh.push(big=big)
        pushes.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, statistics.median(pushes) * 1e3


def noop_median(mesh: Mesh, calls: int) -> float:
    for _ in range(20):
        mesh.run(noop)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        mesh.run(noop)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def simulated(agents: int, per_agent: int, processes: int, calls: int,
              door_ms: float = 0.0) -> dict[str, float]:
    """One row of ``--agents``: start, calls, detach, attach, calls, stop."""
    from benchmarks.simkept import SimKeptHosts
    from benchmarks.simranks import floor
    from monarch_nb.procs.agents import AgentLauncher

    n = agents * per_agent
    hosts = SimKeptHosts(agents, per_agent, processes, door_ms)
    hosts.start_hosts()
    name = f"sim{agents}x{per_agent}d{door_ms:g}"
    row: dict[str, float] = {"hosts": agents, "ranks": n}
    mesh = None
    try:
        t = time.perf_counter()
        mesh = Mesh.start(n=n, backend="cpu", respawn="off", hang_timeout=None, spare=False,
                          launcher=AgentLauncher(hosts, spare=False), name=name, keep_alive=300)
        row["start_s"] = time.perf_counter() - t
        idents = [info.identity for info in mesh._ctl.ranks]
        row["before_ms"] = noop_median(mesh, calls)
        mesh.detach()
        t = time.perf_counter()
        mesh = Mesh.attach(name, launcher=AgentLauncher(hosts, spare=False))
        row["attach_s"] = time.perf_counter() - t
        # sanity, not a figure: every rank adopted, none restarted
        assert [i.identity for i in mesh._ctl.ranks] == idents, "a rank was restarted at attach"
        assert len(mesh.run(noop)) == n
        row["after_ms"] = noop_median(mesh, calls)
    finally:
        if mesh is not None:
            mesh.stop()
        hosts.close()
    times, _ = floor(agents, processes, calls)
    row["floor_ms"] = statistics.median(times) * 1e3
    return row


def run_simulated(args: argparse.Namespace) -> None:
    rows = []
    for agents in args.agents:
        row = simulated(agents, args.per_agent, args.processes, args.calls)
        print(f"{agents} hosts x {args.per_agent}: attach {row['attach_s']:.3f} s", flush=True)
        rows.append(row)
    if args.door_ms:  # the last size again, each door waiting as a real one would
        agents = args.agents[-1]
        row = simulated(agents, args.per_agent, args.processes, args.calls, args.door_ms)
        row["door_ms"] = args.door_ms
        print(f"{agents} hosts x {args.per_agent}, doors of {args.door_ms:g} ms: attach "
              f"{row['attach_s']:.3f} s", flush=True)
        rows.append(row)
    print(f"\nkept mesh across simulated hosts ({args.processes} host processes), "
          f"no-op medians of {args.calls} calls; load {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    print("| hosts x ranks | ranks | start | attach | no-op before detach | after attach "
          "| zmq floor (1 DEALER / host) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        door = f", doors {r['door_ms']:g} ms" if r.get("door_ms") else ""
        print(f"| {r['hosts']:.0f} x {args.per_agent}{door} | {r['ranks']:.0f} "
              f"| {r['start_s']:.2f} s "
              f"| {r['attach_s']:.2f} s | {r['before_ms']:.2f} ms | {r['after_ms']:.2f} ms "
              f"| {r['floor_ms']:.2f} ms |")
    at = {int(r["ranks"]): r for r in rows if not r.get("door_ms")}
    if 1024 in at:
        ok = at[1024]["attach_s"] <= 3.0
        print(f"\ntarget: attach ≤ 3 s for 1,024 simulated ranks: "
              f"{'met' if ok else 'missed'} ({at[1024]['attach_s']:.2f} s)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--agents", default="", type=lambda s: [int(x) for x in s.split(",") if x],
                   help="simulated hosts per row, e.g. 8,32,128 (benchmarks/simkept.py)")
    p.add_argument("--per-agent", type=int, default=8, help="ranks per simulated host")
    p.add_argument("--processes", type=int, default=4, help="simulated hosts' processes")
    p.add_argument("--door-ms", type=float, default=0.0,
                   help="also the largest size with each door answering this late (ssh's "
                        "connection and the door interpreter's start on a real host)")
    args = p.parse_args()
    os.environ.setdefault("JUPYTER_RUNTIME_DIR", tempfile.mkdtemp(prefix="mkb"))
    if args.agents:
        run_simulated(args)
        return
    rows = []
    with Mesh.start(n=args.ranks, backend="cpu", hang_timeout=None) as plain:
        rows.append(("not kept", *measure(plain, args.calls)))
    kept = Mesh.start(n=args.ranks, backend="cpu", hang_timeout=None, name="bench",
                      keep_alive=120)
    try:
        rows.append(("kept, first controller", *measure(kept, args.calls)))
        kept.detach()
        t = time.perf_counter()
        kept = Mesh.attach("bench")
        attach_s = time.perf_counter() - t
        rows.append(("kept, after attach", *measure(kept, args.calls)))
    finally:
        kept.stop()
    print(f"{args.ranks} CPU ranks, median of {args.calls} no-op calls / 5 pushes")
    print(f"{'mesh':<24} {'no-op ms':>9} {'64 MiB push ms':>15} {'no-op / not kept':>17}")
    for name, op, push in rows:
        print(f"{name:<24} {op:>9.3f} {push:>15.1f} {op / rows[0][1]:>17.2f}")
    print(f"attach: {attach_s:.3f} s")


if __name__ == "__main__":
    main()
