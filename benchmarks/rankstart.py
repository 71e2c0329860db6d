#!/usr/bin/env python3
"""Rank start and respawn, with and without the controller in a rank's imports.

    .venv/bin/python benchmarks/rankstart.py --before /work/main [--after .] [--repeat 5]

Runs every figure twice, in child processes whose PYTHONPATH is first the
``--before`` tree, then the ``--after`` tree (default: this checkout), and
prints them side by side (ranks inherit PYTHONPATH, so they run that tree's
code too):

- import: a fresh interpreter's ``import monarch_nb.worker`` (the rank's entry
  point, what every rank start and respawn pays before its own work), median
  of --repeat, and how many monarch_nb modules it loaded (controller side in
  brackets);
- cold start: ``Mesh.start(n=4, backend="cpu")`` until every rank is ready
  (torch's import dominates; the controller's share is the difference);
- respawn: ``mesh.restart(1)`` until a call on rank 1 answers.

Medians over --repeat; the machine is noisy (and shared): read them as such.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

IMPORT = """
import sys, time
t = time.perf_counter()
import monarch_nb.worker
dt = time.perf_counter() - t
mods = [m for m in sys.modules if m.startswith('monarch_nb')]
ctl = [m for m in mods if m.startswith(('monarch_nb.controller', 'monarch_nb.mesh', 'monarch_nb.ui',
                                        'monarch_nb.launch', 'monarch_nb.cli'))]
print(dt, len(mods), len(ctl))
"""

MESH = """
import json, time
from monarch_nb import Mesh
def noop():
    return 0
t = time.perf_counter()
mesh = Mesh.start(n=4, backend="cpu")
start = time.perf_counter() - t
mesh.run(noop)
respawns = []
for _ in range({respawns}):
    t = time.perf_counter()
    mesh.restart(1)
    mesh[1].run(noop)
    respawns.append(time.perf_counter() - t)
mesh.stop()
print(json.dumps({{"start": start, "respawn": respawns}}))
"""


def child(tree: Path, code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd="/", capture_output=True,
                          text=True, check=True, timeout=600).stdout.strip().splitlines()[-1]


def measure(tree: Path, repeat: int) -> dict[str, float | str]:
    imports = [child(tree, IMPORT).split() for _ in range(repeat)]
    starts, respawns = [], []
    for _ in range(max(1, repeat // 2)):
        out = json.loads(child(tree, MESH.format(respawns=2)))
        starts.append(out["start"])
        respawns.extend(out["respawn"])
    return {
        "import": statistics.median(float(i[0]) for i in imports),
        "modules": f"{imports[0][1]} ({imports[0][2]} controller side)",
        "cold start, 4 ranks": statistics.median(starts),
        "respawn": statistics.median(respawns),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the tree to compare with (e.g. main)")
    ap.add_argument("--after", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    before = measure(args.before.resolve(), args.repeat)
    after = measure(args.after.resolve(), args.repeat)
    print(f"{'':<28}{'before':>26}{'after':>26}")
    print(f"{'':<28}{str(args.before)[-26:]:>26}{str(args.after)[-26:]:>26}")
    for key in before:
        b, a = before[key], after[key]
        if isinstance(b, float) and isinstance(a, float):
            print(f"{key + ' (s)':<28}{b:>26.3f}{a:>26.3f}")
        else:
            print(f"{key:<28}{b!s:>26}{a!s:>26}")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
