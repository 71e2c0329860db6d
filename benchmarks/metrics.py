#!/usr/bin/env python3
"""mnb.log and dashboard costs: one command, one table.

    .venv/bin/python benchmarks/metrics.py [--quick] [--json out.json]

1. ``mnb.log`` on the rank, per call: measured inside a real rank of a
   2-rank CPU mesh (the control thread draining and sending concurrently),
   for 1 and 4 metrics per call: in a tight loop (best of 5 loops; the
   control thread's draining competes for the GIL at ~250,000 calls/s), and
   at a training-like pace of ~1000 calls/s (median of single timed calls);
   plus the same function in this process with no other thread around.
2. The controller's cost per second of dashboard updates, at 4 and 64
   ranks, each rank logging 100 steps/s with 2 metrics (loss, lr) in
   5 METRICS batches a second (the worker's flush period): decoding the
   batches, adding them to the store, and 10 dashboard messages a second
   (building the delta from the store and status rows, and JSON-encoding it
   as the comm does). Reported as CPU milliseconds per second of training
   (1000 ms = one core busy). The batches are made by the real encoder and
   fed to the real decoder and store: no process boundary, so the transport's
   share (signature check, zmq) is not in this figure.

No assertions: figures only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from monarch_nb.controller.metricstore import MetricsStore  # noqa: E402
from monarch_nb.engine import metrics as metrics_mod  # noqa: E402
from monarch_nb.ui.dashfeed import Feed, Throttle, count_points  # noqa: E402
from monarch_nb.wire.metricframes import decode, encode  # noqa: E402

RANK_CODE = """
import time, monarch_nb as mnb
def _bench(n, k):
    names = ["loss", "lr", "acc", "grad_norm"][:k]
    vals = {name: 0.5 for name in names}
    log = mnb.log
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        if k == 1:
            for i in range(n):
                log(loss=0.5)
        else:
            for i in range(n):
                log(**vals)
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e9
def _nop(**kw):
    pass
def _paced(n, k, fn=None):
    # a training-like pace (~1000 calls/s): each call timed on its own,
    # minus the cost of the two clock reads
    import statistics
    names = ["loss", "lr", "acc", "grad_norm"][:k]
    clock, log, costs, empty = time.perf_counter_ns, fn or mnb.log, [], []
    for i in range(n):
        t0 = clock(); t1 = clock(); empty.append(t1 - t0)
        vals = {name: 0.5 for name in names}
        t0 = clock(); log(**vals); t1 = clock(); costs.append(t1 - t0)
        time.sleep(0.001)
    return statistics.median(costs) - statistics.median(empty)
"""


def bench_rank(n: int) -> dict[str, float]:
    from monarch_nb import Mesh

    mesh = Mesh.start(n=2, backend="cpu")
    try:
        mesh.exec(RANK_CODE)
        out = {}
        for k in (1, 4):
            res = mesh.exec(f"_bench({n}, {k})")
            out[f"rank_ns_{k}"] = statistics.median(res.values())
            res = mesh.exec(f"_paced({min(n, 3000)}, {k})")
            out[f"paced_ns_{k}"] = statistics.median(res.values())
        res = mesh.exec(f"_paced({min(n, 3000)}, 1, _nop)")
        out["paced_nop_ns"] = statistics.median(res.values())
        return out
    finally:
        mesh.stop()


def bench_local(n: int) -> dict[str, float]:
    """mnb.log in this process, the buffer emptied every 1,000 calls (as the
    control thread would): the cost with no other thread around."""
    import monarch_nb as mnb

    buf, log = metrics_mod.buffer(), mnb.log
    best = float("inf")
    for _ in range(5):
        elapsed = 0.0
        for _chunk in range(n // 1000):
            t0 = time.perf_counter()
            for _i in range(1000):
                log(loss=0.5)
            elapsed += time.perf_counter() - t0
            buf._q.clear()
        best = min(best, elapsed / (n // 1000 * 1000))
    return {"local_ns_1": best * 1e9}


def _rows(world: int, t: float) -> list[dict[str, Any]]:
    return [{"rank": r, "state": "busy", "pid": 1000 + r, "incarnation": 0, "device": "cpu",
             "heartbeat_age": 0.2, "exit": "", "restarts": 0, "host": "h",
             "cpu": float(int(t * 2) % 100), "rss": 2e8, "gpu_mem": None, "gpu_mem_total": None,
             "gpu_mem_peak": None, "gpu_util": None, "gpu_temp": None, "gpu_power": None,
             "steps_per_s": 100.0, "last": {"loss": 0.5, "lr": 0.001}} for r in range(world)]


def bench_controller(world: int, seconds: float, steps_per_s: int = 100,
                     batches_per_s: int = 5) -> dict[str, float]:
    store = MetricsStore(world)
    clock = [0.0]
    feed = Feed(store, lambda: _rows(world, clock[0]), lambda: [])
    feed.next()  # the first view's snapshot (empty)
    throttle = Throttle(10)
    per_batch = steps_per_s // batches_per_s
    # the frames ranks would send, made by the real encoder
    frames: list[list[bytes]] = []
    ticks = int(seconds * batches_per_s)
    for b in range(ticks):
        frames.append([encode([(b * per_batch + i, 0.0, {"loss": 1.0 / (1 + b * per_batch + i),
                                                          "lr": 0.001})
                               for i in range(per_batch)]) for _r in range(world)])
    ingest = push = 0.0
    msgs = points = nbytes = 0
    for b in range(ticks):
        now = b / batches_per_s
        clock[0] = now
        t0 = time.process_time()
        for r in range(world):
            store.add(r, 0, decode(frames[b][r]), now=now)
        t1 = time.process_time()
        ingest += t1 - t0
        # the dashboard thread wakes up to 10 times a second; with 5 batch
        # rounds a second here, it sends at most twice per round
        for sub in (0.0, 0.1):
            if throttle.take(now + sub):
                t2 = time.process_time()
                msg = feed.next()
                if msg is not None:
                    nbytes += len(json.dumps(msg, separators=(",", ":")))
                    msgs += 1
                    points += count_points(msg)
                push += time.process_time() - t2
    return {"ranks": world, "ingest_ms_per_s": ingest / seconds * 1e3,
            "dashboard_ms_per_s": push / seconds * 1e3,
            "total_ms_per_s": (ingest + push) / seconds * 1e3,
            "msgs_per_s": msgs / seconds, "points_per_s": points / seconds,
            "kib_per_s": nbytes / seconds / 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-rank", action="store_true", help="skip the real-rank measurement")
    args = ap.parse_args()
    n = 20_000 if args.quick else 200_000
    seconds = 5.0 if args.quick else 20.0
    res: dict[str, Any] = {}
    res.update(bench_local(n))
    if not args.no_rank:
        res.update(bench_rank(n))
    res["controller"] = [bench_controller(w, seconds) for w in (4, 64)]
    print("| mnb.log per call | ns |\n|---|---|")
    print(f"| this process, emptied every 1,000 calls, no other thread, 1 metric | {res['local_ns_1']:.0f} |")
    if "rank_ns_1" in res:
        print(f"| on a rank while the control thread drains, 1 metric | {res['rank_ns_1']:.0f} |")
        print(f"| on a rank while the control thread drains, 4 metrics | {res['rank_ns_4']:.0f} |")
        print(f"| on a rank at ~1000 calls/s (median of single calls), 1 metric | {res['paced_ns_1']:.0f} |")
        print(f"| on a rank at ~1000 calls/s (median of single calls), 4 metrics | {res['paced_ns_4']:.0f} |")
        print(f"| same pace, an empty Python function instead (the cold-call floor) | {res['paced_nop_ns']:.0f} |")
    print("\n| ranks (100 steps/s, 2 metrics each) | ingest ms/s | dashboard ms/s | total ms/s "
          "| messages/s | points/s | KiB/s to the browser |\n|---|---|---|---|---|---|---|")
    for c in res["controller"]:
        print(f"| {c['ranks']} | {c['ingest_ms_per_s']:.1f} | {c['dashboard_ms_per_s']:.1f} | "
              f"{c['total_ms_per_s']:.1f} | {c['msgs_per_s']:.1f} | {c['points_per_s']:.0f} | "
              f"{c['kib_per_s']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
