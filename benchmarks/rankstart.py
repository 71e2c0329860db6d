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

    .venv/bin/python benchmarks/rankstart.py --fork [--repeat 3]

The warm process (issue 40, docs/warm-process.md): in one run, this tree's
ranks started as fresh interpreters (``fork=False``, before) and forked from
the warm process (``fork=True``, after), beside the floors measured in the
same run, each ratio beside its floor:

- cold start of 4 ranks (``Mesh.start`` until every rank is ready, in a new
  controller process) against four ``python -c "import torch"`` started
  together (until the last exits);
- kill to all ranks answering a collective: SIGKILL of one rank, then
  all_reduces until one is answered by every rank, right after
  ``Mesh.start`` returned, and once the mesh has settled (its spare, or the
  warm process, ready); two kills of different ranks there;
- the proportional set size (PSS) of the 4 idle ranks (after an
  all_reduce), alone and with the spare or warm process that the mesh
  holds, against four lone processes that imported torch.

Targets (issue 40): cold start <= 0.6x, every kill <= 0.5 s, PSS <= 0.6x.

    .venv/bin/python benchmarks/rankstart.py --fork --remote [--repeat 3]

The same for a remote host's 2 ranks behind its host agent (the ssh
launcher with ``MONARCH_NB_SSH="sh -c"``: the "host" is this machine, reached
as an ssh host is, its agent forking from its own warm process): cold start
of 2 ranks against two torch imports together, a kill right after the start
and two once settled (the agent's spare there), fork=False against fork=True.
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
from typing import Any

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


FORK_MESH = """
import json, os, signal, time
import psutil
import monarch_nb as mnb
from monarch_nb import Mesh

def _sum():
    import torch
    import torch.distributed as dist
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()

t = time.perf_counter()
mesh = Mesh.start(n=4, backend="cpu", fork={fork}, restart_budget=1000)
start = time.perf_counter() - t
sup = mesh._ctl.supervisor

def kill_to_collective(rank):
    pid = mesh.status()[rank]["pid"]
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    while True:
        try:
            mesh.run(_sum, timeout=120)
            return time.perf_counter() - t0
        except mnb.RankErrors:
            continue  # it reached the dead rank: the next one waits for its respawn

at_start = kill_to_collective(1)
deadline = time.monotonic() + 60
while not sup.spare_ready() and time.monotonic() < deadline:
    time.sleep(0.05)
settled = [kill_to_collective(r) for r in (2, 3)]
mesh.run(_sum)
time.sleep(1.0)

def pss(pid):
    return psutil.Process(pid).memory_full_info().pss

ranks = sum(pss(p.pid) for p in sup.procs.values())
helper = sup.warm.pid if sup.warm is not None else sup.spare.pid if sup.spare is not None else None
extra = pss(helper) if helper is not None else 0
forked = all(p.forked for p in sup.procs.values())
mesh.stop()
print(json.dumps({{"start": start, "at_start": at_start, "settled": settled, "pss": ranks,
                  "pss_helper": ranks + extra, "forked": forked}}))
"""

REMOTE_MESH = """
import json, os, signal, time
import monarch_nb as mnb
from monarch_nb import Mesh

os.environ["MONARCH_NB_SSH"] = "sh -c"

def _sum():
    import torch
    import torch.distributed as dist
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()

t = time.perf_counter()
mesh = Mesh.start(n=2, backend="cpu", launcher="ssh", hosts="hA", bind="127.0.0.1",
                  master_addr="127.0.0.1", start_timeout=120, fork={fork}, restart_budget=1000)
start = time.perf_counter() - t

def kill_to_collective(rank):
    pid = mesh.status()[rank]["pid"]  # on the "host", which is this machine
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    while True:
        try:
            mesh.run(_sum, timeout=120)
            return time.perf_counter() - t0
        except mnb.RankErrors:
            continue

at_start = kill_to_collective(1)
settled = []
for rank in (0, 1):
    time.sleep(6.0)  # the agent's spare (or warm process) ready again
    settled.append(kill_to_collective(rank))
hashes = mesh.run(hash, "forked?")  # one warm process: one string hash seed
mesh.stop()
print(json.dumps({{"start": start, "at_start": at_start, "settled": settled,
                  "forked": len(set(hashes.values())) == 1}}))
"""

LONE_TORCH = "import sys, torch; print('ready', flush=True); sys.stdin.read()"


def torch_floor(n: int = 4) -> tuple[float, int]:
    """Four ``python -c "import torch"`` started together: seconds until the
    last exits; and the summed PSS of four lone processes with torch imported."""
    import psutil

    t = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", "import torch"]) for _ in range(n)]
    for p in procs:
        p.wait(600)
    took = time.perf_counter() - t
    lone = [subprocess.Popen([sys.executable, "-c", LONE_TORCH], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True) for _ in range(n)]
    try:
        for p in lone:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        pss = sum(psutil.Process(p.pid).memory_full_info().pss for p in lone)
    finally:
        for p in lone:
            if p.stdin is not None:
                p.stdin.close()
            p.wait(60)
    return took, pss


def fork_table(repeat: int) -> None:
    """fork=False (before) and fork=True (after) beside the floors, one run."""
    tree = Path(__file__).resolve().parent.parent
    floors: list[tuple[float, int]] = []
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(repeat):  # interleaved: the machine's load hits both alike
        floors.append(torch_floor())
        for fork in (False, True):
            runs[fork].append(json.loads(child(tree, FORK_MESH.format(fork=fork))))
    assert all(r["forked"] for r in runs[True]) and not any(r["forked"] for r in runs[False])
    import_s = statistics.median(f[0] for f in floors)
    lone_mib = statistics.median(f[1] for f in floors) / 2**20

    def med(fork: bool, key: str) -> float:
        values = [v for r in runs[fork] for v in (r[key] if isinstance(r[key], list) else [r[key]])]
        return statistics.median(values)

    def worst(fork: bool, key: str) -> float:
        return max(v for r in runs[fork] for v in (r[key] if isinstance(r[key], list) else [r[key]]))

    print(f"\nwarm process, 4 CPU ranks, {repeat} runs, {os.cpu_count()} CPUs (medians; "
          f"worst kill in brackets)\n")
    print("| measure | floor | fork=False (before) | ratio | fork (after) | ratio | target |")
    print("|---|---:|---:|---:|---:|---:|---|")
    b, a = med(False, "start"), med(True, "start")
    print(f"| cold start of 4 ranks (s) | {import_s:.2f} | {b:.2f} | {b / import_s:.2f}x "
          f"| {a:.2f} | {a / import_s:.2f}x | <= 0.6x |")
    for label, key in (("kill right after start to all answering a collective (s)", "at_start"),
                       ("kill once settled to all answering a collective (s)", "settled")):
        b, a = med(False, key), med(True, key)
        print(f"| {label} | - | {b:.2f} ({worst(False, key):.2f}) | - "
              f"| {a:.2f} ({worst(True, key):.2f}) | - | <= 0.5 s |")
    for label, key in (("PSS of 4 idle ranks (MiB)", "pss"),
                       ("... with the spare / warm process (MiB)", "pss_helper")):
        b, a = med(False, key) / 2**20, med(True, key) / 2**20
        print(f"| {label} | {lone_mib:.0f} | {b:.0f} | {b / lone_mib:.2f}x "
              f"| {a:.0f} | {a / lone_mib:.2f}x | <= 0.6x |")
    print("\nfloor: four `python -c \"import torch\"` started together (until the last "
          "exits); four lone processes with torch imported (their PSS)")


def remote_table(repeat: int) -> None:
    """A remote host's 2 ranks behind its agent: fork=False (before) and
    fork=True (after) beside two torch imports, one run."""
    tree = Path(__file__).resolve().parent.parent
    floors: list[float] = []
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(repeat):
        floors.append(torch_floor(2)[0])
        for fork in (False, True):
            runs[fork].append(json.loads(child(tree, REMOTE_MESH.format(fork=fork))))
    assert all(r["forked"] for r in runs[True]) and not any(r["forked"] for r in runs[False])
    floor = statistics.median(floors)

    def values(fork: bool, key: str) -> list[float]:
        return [v for r in runs[fork] for v in (r[key] if isinstance(r[key], list) else [r[key]])]

    print(f"\nwarm process behind a host agent, 2 CPU ranks on one remote host, {repeat} runs, "
          f"{os.cpu_count()} CPUs (medians; worst kill in brackets)\n")
    print("| measure | floor | fork=False (before) | ratio | fork (after) | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    b, a = statistics.median(values(False, "start")), statistics.median(values(True, "start"))
    print(f"| cold start of 2 remote ranks (s) | {floor:.2f} | {b:.2f} | {b / floor:.2f}x "
          f"| {a:.2f} | {a / floor:.2f}x |")
    for label, key in (("kill right after start to both answering a collective (s)", "at_start"),
                       ("kill once settled to both answering a collective (s)", "settled")):
        bv, av = values(False, key), values(True, key)
        print(f"| {label} | - | {statistics.median(bv):.2f} ({max(bv):.2f}) | - "
              f"| {statistics.median(av):.2f} ({max(av):.2f}) | - |")
    print("\nfloor: two `python -c \"import torch\"` started together (until the last exits)")


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
    ap.add_argument("--before", type=Path, help="the tree to compare with (e.g. main)")
    ap.add_argument("--fork", action="store_true",
                    help="fork=False against fork=True in this tree, beside the floors")
    ap.add_argument("--remote", action="store_true",
                    help="with --fork: a remote host's 2 ranks behind its agent")
    ap.add_argument("--after", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if args.fork and args.remote:
        remote_table(args.repeat)
        return
    if args.fork:
        fork_table(args.repeat)
        return
    if args.before is None:
        ap.error("--before TREE (or --fork)")
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
