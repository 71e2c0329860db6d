#!/usr/bin/env python3
"""Where a no-op call's CPU goes, thread by thread, beside the ZeroMQ floor's.

    .venv/bin/python benchmarks/threads.py [--ranks 4] [--calls 3000] [--floor-script PATH]

Three runs, one after the other: a mesh with its local ranks on links
(the default), the same with ``local_link=False`` (every rank on ZeroMQ), and
``zmq_floor.py``'s ROUTER and DEALER processes driven the same way. For each:
the median and p99 of the calls, then every thread's CPU time (user +
system, from ``/proc``) and context switches per call, summed over the ranks'
threads of one name. On two cores a no-op call is CPU-bound, so this says
where its time goes. No assertions; every process is stopped.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import zmq

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FLOOR_SCRIPT = REPO.parent / "shared" / "bench" / "zmq_floor.py"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

Snapshot = dict[tuple[int, int], tuple[str, float, int, int, bool]]


def snapshot(me: psutil.Process, children: list[psutil.Process]) -> Snapshot:
    """(pid, tid) -> (thread name, CPU s, voluntary, involuntary switches, is ours)."""
    out: Snapshot = {}
    for proc in [me, *children]:
        try:
            threads = proc.threads()
        except psutil.NoSuchProcess:
            continue
        for t in threads:
            try:
                with open(f"/proc/{proc.pid}/task/{t.id}/status") as f:
                    status = f.read()
                with open(f"/proc/{proc.pid}/task/{t.id}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue
            vol = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
            invol = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
            name = "main thread" if t.id == proc.pid else name
            out[(proc.pid, t.id)] = (name, t.user_time + t.system_time, vol, invol,
                                     proc.pid == me.pid)
    return out


def measure(call: Callable[[], Any], children: list[psutil.Process], calls: int,
            title: str) -> None:
    for _ in range(300):
        call()
    me = psutil.Process()
    before = snapshot(me, children)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    after = snapshot(me, children)
    times.sort()
    print(f"\n{title}: median {statistics.median(times) * 1e6:.0f} µs, "
          f"p99 {times[int(len(times) * 0.99)] * 1e6:.0f} µs")
    rows: dict[str, list[float]] = {}
    total = 0.0
    for key, (name, cpu, vol, invol, ours) in after.items():
        if key not in before:
            continue
        _, cpu0, vol0, invol0, _ = before[key]
        row = rows.setdefault(("controller: " if ours else "each rank: ") + name, [0.0, 0.0, 0.0, 0.0])
        row[0] += cpu - cpu0
        row[1] += vol - vol0
        row[2] += invol - invol0
        row[3] += 1
        total += cpu - cpu0
    print("| thread | threads | CPU per call (each) | sleeps per call | preemptions per call |")
    print("|---|---:|---:|---:|---:|")
    for label, (used, sleeps, preempted, n) in sorted(rows.items()):
        if used == 0 and sleeps == 0:
            continue
        print(f"| {label} | {n:.0f} | {used / n / calls * 1e6:.1f} µs | {sleeps / n / calls:.2f} "
              f"| {preempted / n / calls:.2f} |")
    print(f"| all of it | | {total / calls * 1e6:.0f} µs per call | | |")


def mesh_run(ranks: int, calls: int, local_link: bool) -> None:
    from monarch_nb import Mesh

    mesh = Mesh.start(n=ranks, backend="cpu", spare=False, local_link=local_link)
    try:
        def f() -> None:
            return None

        children = psutil.Process().children(recursive=True)
        measure(lambda: mesh.run(f), children, calls,
                f"monarch_nb, {ranks} ranks, " + ("links" if local_link else "local_link=False"))
    finally:
        mesh.stop()


def floor_run(ranks: int, calls: int, script: Path) -> None:
    if not script.exists():
        print(f"\n(no floor: {script} not found)")
        return
    sys.path.insert(0, str(script.parent))  # (the spawned ranks import it by name too)
    floor = importlib.import_module(script.stem)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    addr = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    procs = [mp.get_context("spawn").Process(target=floor._rank, args=(addr, b"r%d" % i))
             for i in range(ranks)]
    for p in procs:
        p.start()
    try:
        idents = [router.recv_multipart()[0] for _ in procs]

        def round_trip() -> None:
            for ident in idents:
                router.send_multipart([ident, b"x"], copy=False)
            for _ in idents:
                router.recv_multipart()

        measure(round_trip, [psutil.Process(p.pid) for p in procs], calls,
                f"zmq floor, {ranks} ranks")
        for ident in idents:
            router.send_multipart([ident, b"stop"])
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        router.close(linger=0)
        ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--floor-script", default=str(FLOOR_SCRIPT))
    a = ap.parse_args()
    mesh_run(a.ranks, a.calls, local_link=True)
    mesh_run(a.ranks, a.calls, local_link=False)
    floor_run(a.ranks, a.calls, Path(a.floor_script))


if __name__ == "__main__":
    main()
