#!/usr/bin/env python3
"""The transport floor for pulls: N DEALER processes each send one 64 MiB
buffer to a pyzmq ROUTER on this machine (the other direction of
``../shared/bench/zmq_floor.py``'s push; that script measures no pull).

No signing, no pickling, no bookkeeping: the fastest a controller built on
ZeroMQ sockets can gather N big values here.

    python pull_floor.py --ranks 4 [--mib 64] [--runs 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import zmq


def _rank(addr: str, ident: bytes, mib: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, ident)
    s.connect(addr)
    payload = bytearray(mib * 2**20)
    s.send(b"ready")
    while True:
        frames = s.recv_multipart(copy=False)
        if frames[0].bytes == b"stop":
            break
        s.send(memoryview(payload), copy=False)
    s.close(linger=0)
    ctx.term()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    addr = f"tcp://127.0.0.1:{port}"
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=_rank, args=(addr, b"r%d" % i, a.mib)) for i in range(a.ranks)]
    for pr in procs:
        pr.start()
    idents = [router.recv_multipart()[0] for _ in procs]

    def gather() -> float:
        t = time.perf_counter()
        for ident in idents:
            router.send_multipart([ident, b"go"])
        for _ in idents:
            router.recv_multipart(copy=False)
        return time.perf_counter() - t

    gather()
    runs = [gather() for _ in range(a.runs)]
    for ident in idents:
        router.send_multipart([ident, b"stop"])
    for pr in procs:
        pr.join(10)
    router.close(linger=0)
    ctx.term()

    out = {"ranks": a.ranks, "pull_median_s": round(statistics.median(runs), 4),
           "pull_mib_per_s_aggregate": round(a.mib * a.ranks / statistics.median(runs), 1)}
    if a.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:26} {v}")


if __name__ == "__main__":
    main()
