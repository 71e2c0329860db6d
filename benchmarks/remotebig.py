#!/usr/bin/env python3
"""A big result from a rank on another host: through its agent with shared
memory (the default), through its agent by socket as before, and straight
to the controller (``relay=False``), side by side in one run.

    sudo .venv/bin/python benchmarks/remotebig.py [--gib 1] [--repeats 3] [--rounds 2] [--json out.json]

Two network namespaces on one bridge stand for two hosts (tests/engines.py
``netns_hosts``): the controller in the first, one rank (and its host
agent) in the second, started by the ssh launcher through ``ip netns exec``;
CurveZMQ is on between them (the default off loopback). Per mode a mesh is
started and a ``--gib`` GiB ``bytes`` result is taken from the rank
``--repeats`` times (after one of 64 MiB); modes alternate their order
round by round, so background load hits each alike. Modes:

* ``shm``: through the agent, the rank's big frames passed to it in a sealed
  memory file (wire/link.py ``SHM``), forwarded as zero-copy frames;
* ``socket``: through the agent, the frames copied through the rank's link
  (``shm_threshold=None``: what every remote rank did before);
* ``direct``: ``relay=False``, the rank's own DEALER to the controller.

Figures: the median seconds per mode and each relay mode's ratio to direct
(the target: shm at most 1.2x). The ``shm`` mode also checks that the
agent took the frames by shared memory (``mesh.dataplane["agent_shm"]``),
and every mode that the bytes arrived whole. Needs root (ip netns).
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

MODES = ("shm", "socket", "direct")

DRIVER = """
    import json, os, sys, time
    from monarch_nb import Mesh

    mode, host, master, bind, gib, repeats = sys.argv[1:7]
    size, repeats = int(float(gib) * (1 << 30)), int(repeats)
    os.environ["MONARCH_NB_SSH"] = "ip netns exec {host} sh -c"
    mesh = Mesh.start(n=1, backend="cpu", launcher="ssh", hosts=host, bind=bind,
                      master_addr=master, start_timeout=120, relay=(mode != "direct"),
                      shm_threshold=None if mode == "socket" else 1 << 20)
    try:
        assert mesh._ctl.io.curve is not None  # across hosts: encrypted
        warm = mesh.run(lambda: b"w" * (64 << 20))[0]
        assert len(warm) == 64 << 20
        samples = []
        for _ in range(repeats):
            t = time.perf_counter()
            got = mesh.run(lambda n=size: b"x" * n)[0]
            samples.append(time.perf_counter() - t)
            assert len(got) == size and got[:1] == b"x" and got[-1:] == b"x"
            del got
        time.sleep(0.5)  # the agent's next tick brings its counts
        plane = mesh.dataplane
        if mode == "shm":
            assert plane["agent_shm"] >= repeats + 1, plane
        else:
            assert plane["agent_shm"] == 0, plane
        out = {"mode": mode, "samples": samples, "dataplane": plane}
    finally:
        mesh.stop()
    print("RESULT " + json.dumps(out))
"""


def run_mode(hosts: Any, mode: str, gib: float, repeats: int, folder: str) -> dict[str, Any]:
    driver = Path(folder, "driver.py")
    driver.write_text(textwrap.dedent(DRIVER))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run(
        ["ip", "netns", "exec", hosts.names[0], sys.executable, str(driver), mode,
         hosts.names[1], hosts.addrs[1], hosts.addrs[0], str(gib), str(repeats)],
        capture_output=True, text=True, env=env, timeout=900, cwd=folder)
    if res.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{res.stdout}\n{res.stderr}")
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    if os.geteuid() != 0:
        print("remotebig.py needs root (ip netns)", file=sys.stderr)
        return 2
    from tests.engines import netns_hosts

    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", file=sys.stderr)
    results: dict[str, list[float]] = {m: [] for m in MODES}
    with netns_hosts(2) as hosts, tempfile.TemporaryDirectory() as folder:
        for i in range(ns.rounds):
            order = MODES[i % len(MODES):] + MODES[:i % len(MODES)]
            for mode in order:
                print(f"round {i + 1}: {mode} ...", file=sys.stderr, flush=True)
                results[mode] += run_mode(hosts, mode, ns.gib, ns.repeats, folder)["samples"]
    med = {m: statistics.median(results[m]) for m in MODES}
    labels = {"shm": "through its agent, shared memory (now)",
              "socket": "through its agent, by socket (before)",
              "direct": "straight to the controller (relay=False)"}
    print(f"| {ns.gib:g} GiB result from a rank on another host | median s | min s | vs direct |")
    print("|---|---:|---:|---:|")
    for m in MODES:
        print(f"| {labels[m]} | {med[m]:.2f} | {min(results[m]):.2f} "
              f"| {med[m] / med['direct']:.2f}x |")
    print(f"\n{ns.rounds} round(s) x {ns.repeats} results per mode, load average "
          f"{os.getloadavg()[0]:.2f} at the end.")
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
