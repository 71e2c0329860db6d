#!/usr/bin/env python3
"""Script mode's restart: a rank SIGKILLed, until every rank runs the script again.

    .venv/bin/python benchmarks/rerun.py [--ranks 2] [--repeat 3] [--json out.json]

Launches ``python -m monarch_nb.launch --standalone --nproc-per-node N
--max-restarts 9`` on a torchrun-style script (no monarch_nb import) that
prints its start (``time.time()``, ``TORCHELASTIC_RESTART_COUNT``, pid) and
then all-reduces in a loop. Once every rank runs it and the mesh had time to
start its spare (a few seconds settled: procs/spares.py), rank 1 is SIGKILLed
from outside. Every rank then runs the script again in a new process
(torchrun's restart: controller/life/policy.py, ``restart_group``): the figure
is the time from the kill to the last rank's start line of restart 1, and to
the first one's. Beside it, the floor of a fresh process: one ``python -c
"import torch"`` in the same run. One launch per trial; medians.

Non-goals: notebook meshes' respawn (respawn.py), the elastic loop (recovery.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
    import os, sys, time
    t = time.time()
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"START {dist.get_rank()} {restart} {os.getpid()} {t:.6f}", flush=True)
    while restart == 0:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.01)
"""
SETTLE_S = 6.0  # the spare starts 2 s after the mesh settled and takes a torch import


def trial(ranks: int, folder: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "monarch_nb.launch", "--backend", "cpu", "--standalone",
         "--nproc-per-node", str(ranks), "--max-restarts", "9", "--no-status",
         str(folder / "train.py")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=folder)
    starts: dict[tuple[int, int], tuple[int, float]] = {}
    lock = threading.Lock()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = re.search(r"START (\d+) (\d+) (\d+) ([\d.]+)", line)
            if m:
                with lock:
                    starts[(int(m[1]), int(m[2]))] = (int(m[3]), float(m[4]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        def have(restart: int) -> bool:
            with lock:
                return all((r, restart) in starts for r in range(ranks))

        _wait(lambda: have(0), 120)
        time.sleep(SETTLE_S)
        victim = starts[(1, 0)][0]
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        _wait(lambda: have(1), 120)
        again = [starts[(r, 1)][1] - t_kill for r in range(ranks)]
        proc.wait(timeout=60)
        return {"kill_to_all_running_s": max(again), "kill_to_first_running_s": min(again)}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait(predicate, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the launch did not get there")
        time.sleep(0.005)


def torch_import_s() -> float:
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.monotonic() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    out: dict[str, list[float]] = {"kill_to_all_running_s": [], "kill_to_first_running_s": [],
                                   "python_import_torch_s": []}
    with tempfile.TemporaryDirectory(prefix="mnb-rerun-") as tmp:
        folder = Path(tmp)
        (folder / "train.py").write_text(textwrap.dedent(SCRIPT))
        for _ in range(a.repeat):
            for key, value in trial(a.ranks, folder).items():
                out[key].append(value)
            out["python_import_torch_s"].append(torch_import_s())
    print(f"script mode, {a.ranks} CPU ranks, rank 1 SIGKILLed ({a.repeat} trials, medians):")
    for key, values in out.items():
        print(f"  {key:28s} {statistics.median(values):6.2f}   "
              f"({', '.join(f'{v:.2f}' for v in values)})")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
