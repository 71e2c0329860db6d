#!/usr/bin/env python3
"""What encryption costs across hosts: no-op round trip and 64 MiB push with
CurveZMQ on and off, between network namespaces.

    sudo .venv/bin/python benchmarks/crosshost.py [--calls 500] [--pushes 5] [--rounds 2] [--json out.json]

Three namespaces on one bridge stand for three hosts (the set-up of
tests/test_netns.py): the controller in the first, one rank in each of the
others, started by the ssh launcher through ``ip netns exec``. Each round
starts a mesh with Curve (the default off loopback) and one with
``insecure_no_encryption=True``, alternating, so background noise hits both.
Figures: median (and min) of ``--calls`` no-op calls to both ranks and to one
rank; aggregate push throughput ``64 MiB x 2 / median seconds`` of
``--pushes`` pushes of a numpy array, in 4 MiB pieces as monarch_nb sends
them and, alternating with those, in one frame as before (wire/chunks.py);
aggregate pull throughput of that array from both ranks. Needs root (ip netns) and numpy.
No assertions: figures only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

DRIVER = """
    import json, os, statistics, sys, time
    import numpy as np
    from monarch_nb import Mesh

    mode, hosts, master, bind, calls, pushes = sys.argv[1:7]
    calls, pushes = int(calls), int(pushes)
    os.environ["MONARCH_NB_SSH"] = "ip netns exec {host} sh -c"
    noop = lambda: None
    mesh = Mesh.start(n=2, backend="cpu", launcher="ssh", hosts=hosts, bind=bind,
                      master_addr=master, start_timeout=120,
                      insecure_no_encryption=(mode == "plain"))
    try:
        assert (mesh._ctl.io.curve is not None) == (mode == "curve")
        out = {"mode": mode}
        for name, target in (("noop_all", mesh), ("noop_one", mesh[0])):
            for _ in range(50):
                target.run(noop)
            samples = []
            for _ in range(calls):
                t = time.perf_counter()
                target.run(noop)
                samples.append(time.perf_counter() - t)
            out[name] = (statistics.median(samples), min(samples))
        arr = np.zeros(64 * 2**20, dtype=np.uint8)
        mesh.push(x=arr)
        # In 4 MiB pieces (wire/chunks.py, what a push does) and, alternating
        # with it, in one frame as before pieces: the controller's split is
        # told to cut nothing (pushes only; the ranks are unchanged).
        from monarch_nb.wire import chunks
        pieces, whole = [], []
        for _ in range(pushes):
            for store, chunk in ((pieces, chunks.CHUNK), (whole, 1 << 62)):
                chunks.split.__defaults__ = (chunk,)
                t = time.perf_counter()
                mesh.push(x=arr)
                store.append(time.perf_counter() - t)
        chunks.split.__defaults__ = (chunks.CHUNK,)
        out["push"] = (statistics.median(pieces), min(pieces))
        out["push_whole"] = (statistics.median(whole), min(whole))
        for _ in range(2):
            mesh.pull("x")
        samples = []
        for _ in range(pushes):
            t = time.perf_counter()
            mesh.pull("x")
            samples.append(time.perf_counter() - t)
        out["pull"] = (statistics.median(samples), min(samples))
    finally:
        mesh.stop()
    print("RESULT " + json.dumps(out))
"""


def run_round(hosts: Any, mode: str, calls: int, pushes: int, folder: str) -> dict[str, Any]:
    driver = Path(folder, "driver.py")
    driver.write_text(textwrap.dedent(DRIVER))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run(
        ["ip", "netns", "exec", hosts.names[0], sys.executable, str(driver), mode,
         f"{hosts.names[1]},{hosts.names[2]}", hosts.addrs[1], hosts.addrs[0], str(calls),
         str(pushes)], capture_output=True, text=True, env=env, timeout=600, cwd=folder)
    if res.returncode != 0:
        raise RuntimeError(f"{mode} round failed:\n{res.stdout}\n{res.stderr}")
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--pushes", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    if os.geteuid() != 0:
        print("crosshost.py needs root (ip netns)", file=sys.stderr)
        return 2
    from tests.engines import netns_hosts

    results: dict[str, list[dict[str, Any]]] = {"curve": [], "plain": []}
    with netns_hosts(3) as hosts, tempfile.TemporaryDirectory() as folder:
        for i in range(ns.rounds):
            for mode in (("curve", "plain") if i % 2 == 0 else ("plain", "curve")):
                print(f"round {i + 1}: {mode} ...", file=sys.stderr, flush=True)
                results[mode].append(run_round(hosts, mode, ns.calls, ns.pushes, folder))

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key][0] for r in results[mode])

    def best(mode: str, key: str) -> float:
        return min(r[key][1] for r in results[mode])

    rows = []
    for key, label in (("noop_all", "no-op, 2 ranks (ms)"), ("noop_one", "no-op, 1 rank (ms)")):
        on, off = med("curve", key) * 1e3, med("plain", key) * 1e3
        rows.append((label, f"{on:.3f} (min {best('curve', key) * 1e3:.3f})",
                     f"{off:.3f} (min {best('plain', key) * 1e3:.3f})", f"{on / off:.2f}x"))
    total = 64 * 2  # MiB, to 2 ranks
    on, off = total / med("curve", "push"), total / med("plain", "push")
    rows.append(("push 64 MiB to 2 ranks (MiB/s, aggregate)", f"{on:.0f}", f"{off:.0f}",
                 f"{off / on:.2f}x slower"))
    on, off = total / med("curve", "push_whole"), total / med("plain", "push_whole")
    rows.append(("the same push in one frame (before wire/chunks.py)", f"{on:.0f}", f"{off:.0f}",
                 f"{off / on:.2f}x slower"))
    on, off = total / med("curve", "pull"), total / med("plain", "pull")
    rows.append(("pull 64 MiB from 2 ranks (MiB/s, aggregate)", f"{on:.0f}", f"{off:.0f}",
                 f"{off / on:.2f}x slower"))
    print("| between namespaces | Curve on (default) | Curve off (--insecure-no-encryption) "
          "| cost of encryption |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n{ns.rounds} round(s) each, medians of per-round medians; "
          f"{ns.calls} no-op calls, {ns.pushes} pushes per round.")
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
