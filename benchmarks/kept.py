"""A kept mesh's attach, and its call path before and after (issue 38).

    .venv/bin/python benchmarks/kept.py [--ranks 4] [--calls 300]

Prints, side by side in one run: a no-op call and a 64 MiB push on a mesh
that is not kept (the floor of this machine's call path), on a kept mesh
before its controller lets go, and on the same kept mesh after a new
controller attached (here: the same process detaches and attaches; a
killed kernel's successor attaches the same way); and the time the attach
took. Each figure is the median of ``--calls`` calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    os.environ.setdefault("JUPYTER_RUNTIME_DIR", tempfile.mkdtemp(prefix="mkb"))
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
