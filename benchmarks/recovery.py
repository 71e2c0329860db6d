#!/usr/bin/env python3
"""After a kill: a respawned rank's speed, and how long a DataLoader rank holds up recovery.

    .venv/bin/python benchmarks/recovery.py [--before TREE] [--after TREE] [--repeat 3] [--quick]
                                            [--json out.json]

Issue 28, items 1 and 2. Two cells a user would write (benchmarks/cells/), each
on a fresh 2-rank CPU mesh (gloo; OMP_NUM_THREADS=1 on each rank, as the
launcher sets) started with ``Mesh.start(n=2, backend="cpu")`` and sent as
``mesh.exec(cell, elastic=True, block=False)`` (a ``%%monarch --elastic``
cell). Once the mesh holds a spare, rank 1 is SIGKILLed mid-run with
``mesh.kill(1)`` and comes back from the spare (checked in ``mesh.events``):

- minGPT (cells/mingpt.py): a small character GPT under DDP, 8 epochs, the kill
  in epoch 4. Epoch time on rank 0 (every step waits for both ranks) before the
  kill (epochs 2-3; the first warms up) and after it (epochs 5-8; the first
  after the kill is left out), and ``torch.get_num_threads()`` of every rank
  before and after.
- DataLoader (cells/dataloader.py): ``num_workers=2`` on each rank, an
  all_reduce per step, the kill after step 100. Recovery: from the kill to the
  first step both ranks finish together again (the respawned rank's first
  step, on the two ranks' clocks, which are this host's); and how many of the
  killed rank's children (its workers) were still alive 0.5 s after the kill.

Each trial runs in a child process with the measured tree first on PYTHONPATH
(ranks inherit it) and cwd=/, so no rank imports the checkout it was started
from. ``--before TREE`` measures an older checkout the same way, side by side.
Medians over --repeat trials (--quick: one); the machine is noisy: read them
as such. No assertions: figures only. Every mesh is stopped in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CELLS = Path(__file__).resolve().parent / "cells"
RESULT = "RESULT "


def _until(mesh: Any, cond: Callable[[], Any], fut: Any = None, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        if fut is not None and fut.done():
            fut.result()  # the cell ended early: raise its error
            raise RuntimeError("the cell ended before the kill")
        if fut is not None:
            mesh.wait_any([fut], 0.05)
        else:
            time.sleep(0.05)


def trial(cell: str, kill_after: int) -> dict[str, Any]:
    """One mesh, one cell, one kill of rank 1 once rank 0 logged ``kill_after``."""
    import psutil

    from monarch_nb import Mesh

    mesh = Mesh.start(n=2, backend="cpu")
    try:
        # a settled mesh holds a spare (torch imported): the respawn uses it
        spare = mesh._ctl.supervisor.spare_ready
        _until(mesh, spare)
        fut = mesh.exec((CELLS / cell).read_text(), elastic=True, block=False)
        _until(mesh, lambda: (mesh.metrics.last_step(0) or 0) >= kill_after and spare(), fut)
        pid = mesh.status()[1]["pid"]
        children = psutil.Process(pid).children(recursive=True)
        threads = [int(mesh.metrics.last(r).get("threads", 0)) for r in (0, 1)]  # mingpt.py logs them
        seen = len(mesh.events)
        t_kill = time.time()
        mesh.kill(1)
        time.sleep(max(0.0, t_kill + 0.5 - time.time()))
        orphans = sum(1 for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE)
        fut.result(timeout=600)
        started = [e["detail"] for e in mesh.events[seen:]
                   if e["kind"] == "started" and e["rank"] == 1]
        name = "records" if cell == "mingpt.py" else "done"
        pulled = mesh.pull(name)
        return {"t_kill": t_kill, "workers": len(children), "orphans_0.5s": orphans,
                "threads_before": threads, "per_rank": [pulled[0], pulled[1]],
                "from_spare": bool(started) and "from a spare" in started[0]}
    finally:
        mesh.stop()


def mingpt(r: dict[str, Any]) -> dict[str, Any]:
    rank0 = r["per_rank"][0]
    killed_in = min(e["epoch"] for e in r["per_rank"][1])  # the new rank's first epoch
    return {"clean": statistics.median(e["s"] for e in rank0 if 1 < e["epoch"] < killed_in),
            "after": statistics.median(e["s"] for e in rank0 if e["epoch"] > killed_in),
            "threads before": r["threads_before"],
            "threads after": [rank0[-1]["threads"], r["per_rank"][1][-1]["threads"]],
            "OMP_NUM_THREADS after": r["per_rank"][1][-1]["OMP_NUM_THREADS"],
            "from spare": r["from_spare"]}


def dataloader(r: dict[str, Any]) -> dict[str, Any]:
    step, t1 = r["per_rank"][1][0]  # the new rank's first step: the group works again
    t0 = dict(r["per_rank"][0])[step]
    return {"recovery": max(t0, t1) - r["t_kill"], "orphans": r["orphans_0.5s"],
            "workers": r["workers"], "from spare": r["from_spare"]}


def child(tree: Path, which: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("OMP_NUM_THREADS", None)  # the controller's is the machine's default
    out = subprocess.run([sys.executable, __file__, "--trial", which], env=env, cwd="/",
                         capture_output=True, text=True, timeout=900)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)]
    if out.returncode or not lines:
        raise RuntimeError(f"{which} trial on {tree} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return dict(json.loads(lines[-1][len(RESULT):]))


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def measure(tree: Path, repeat: int) -> dict[str, Any]:
    gpt = [mingpt(child(tree, "mingpt")) for _ in range(repeat)]
    dl = [dataloader(child(tree, "dataloader")) for _ in range(repeat)]
    return {
        "minGPT epoch, clean (s)": _spread([g["clean"] for g in gpt]),
        "minGPT epoch after the kill (s)": _spread([g["after"] for g in gpt]),
        "minGPT after / clean, per trial": _spread([g["after"] / g["clean"] for g in gpt]),
        "torch threads, ranks 0,1 before": gpt[0]["threads before"],
        "torch threads, ranks 0,1 after": gpt[0]["threads after"],
        "rank 1 from the spare": all(g["from spare"] for g in gpt + dl),
        "DataLoader: kill to both ranks' next step (s)": _spread([d["recovery"] for d in dl]),
        "its workers alive 0.5 s after": f"{max(d['orphans'] for d in dl)} of {dl[0]['workers']}",
        "raw": {"minGPT": gpt, "DataLoader": dl},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, default=None, help="an older tree, measured alike")
    ap.add_argument("--after", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one trial of each")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trial", choices=["mingpt", "dataloader"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trial == "mingpt":
        print(RESULT + json.dumps(trial("mingpt.py", kill_after=3)))
        return
    if args.trial == "dataloader":
        print(RESULT + json.dumps(trial("dataloader.py", kill_after=100)))
        return
    repeat = 1 if args.quick else args.repeat
    trees = {"after": args.after.resolve()}
    if args.before is not None:
        trees = {"before": args.before.resolve(), **trees}
    figures = {name: measure(tree, repeat) for name, tree in trees.items()}
    print(f"\n2 CPU ranks, median (min-max) of {repeat} trial(s), {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f} at the end\n")
    print("| | " + " | ".join(f"{n} ({t})" for n, t in trees.items()) + " |")
    print("|---|" + "---:|" * len(trees))
    for key in figures["after"]:
        if key != "raw":
            print(f"| {key} | " + " | ".join(str(figures[n][key]) for n in trees) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
