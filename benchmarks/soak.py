#!/usr/bin/env python3
"""Soak: one mesh, many mixed calls, some deaths and restarts; does anything grow?

    .venv/bin/python benchmarks/soak.py [--calls 5000] [--respawns 10] [--cycles 3]
                                        [--ranks 2] [--sample-every 100] [--json out.json]

One process, one mesh at a time (the Python API), a loop of mixed calls in a
fixed, seeded order: cells that print, functions, small and large (8 MiB)
push/pull, calls that raise, calls that time out (interrupted), futures
(``run_async``/``exec_async``), stack requests. ``--respawns`` times, spread
over the run, a rank is SIGKILLed and the loop waits until it is back;
``--cycles`` times the mesh is stopped and a new one started.

Every ``--sample-every`` calls it records, for the controller (this process)
and the sum over the ranks: open file descriptors, threads and RSS; the
controller's child processes, live ZeroMQ sockets (gc), pending calls in the
call table, and entries in /dev/shm. It prints the samples as a table, the
least-squares slope of each column per 1000 calls, and the p50/p99 latency
of a no-op ``mesh.run`` probe (one every 5 calls) in the first and the last
fifth of the run. A leak shows as a slope that does not go to zero as
``--calls`` grows; compare runs of different lengths, not absolute figures
(the machine is shared and noisy).

tests/test_soak.py runs a short version (``-m soak``) and bounds the growth.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from monarch_nb import Mesh, MonarchError

COLUMNS = ("call", "ctl_fds", "ctl_threads", "ctl_rss_mb", "children", "zmq_sockets", "pending",
           "shm", "rank_fds", "rank_threads", "rank_rss_mb")
LARGE = 8 << 20  # bytes pushed and pulled by the "large" kind


@dataclass
class Sample:
    call: int
    ctl_fds: int
    ctl_threads: int
    ctl_rss_mb: float
    children: int
    zmq_sockets: int
    pending: int
    shm: int
    rank_fds: int
    rank_threads: int
    rank_rss_mb: float


@dataclass
class SoakReport:
    calls: int
    respawns: int
    cycles: int
    ranks: int
    seconds: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    latency_start: list[float] = field(default_factory=list)  # no-op probe, seconds
    latency_end: list[float] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)
    kind_seconds: dict[str, float] = field(default_factory=dict)  # total time per kind
    errors_expected: int = 0

    def slopes(self, skip: int = 1) -> dict[str, float]:
        """Least-squares slope of each column per 1000 calls (the first
        ``skip`` samples, taken during warm-up, left out)."""
        rows = self.samples[skip:] if len(self.samples) > skip + 1 else self.samples
        return {c: 1000 * _slope([r.call for r in rows], [float(getattr(r, c)) for r in rows])
                for c in COLUMNS[1:]}


def _slope(xs: list[int], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


# -- what the loop calls ------------------------------------------------------------------
def _noop() -> None:
    return None


def _square(x: int) -> int:
    return x * x


def _boom(i: int) -> None:
    raise ValueError(f"soak error {i}")


def _mixed_kinds() -> list[str]:
    """One round of the mix (weights: the cheap kinds most often)."""
    return (["run"] * 6 + ["cell"] * 4 + ["push_small"] * 3 + ["pull_small"] * 3
            + ["error"] * 2 + ["future"] * 2 + ["exec_future"] * 2 + ["stacks"]
            + ["timeout"] + ["large"])


def one_call(mesh: Mesh, kind: str, i: int, report: SoakReport) -> None:
    if kind == "run":
        assert mesh.run(_square, i) == dict.fromkeys(range(mesh.world_size), i * i)
    elif kind == "cell":
        mesh.exec(f"print('soak {i}')\n{i}")
    elif kind == "push_small":
        mesh.push(small={"i": i, "s": "x" * 100})
    elif kind == "pull_small":
        mesh.pull("small")
    elif kind == "error":
        try:
            mesh.run(_boom, i)
        except MonarchError:
            report.errors_expected += 1
        else:
            raise AssertionError("a raising call did not raise")
    elif kind == "timeout":
        try:
            mesh.exec("import time\ntime.sleep(30)", timeout=0.3)
        except MonarchError:
            report.errors_expected += 1
        else:
            raise AssertionError("a call past its timeout did not raise")
    elif kind == "future":
        fut = mesh.run_async(_square, i)
        assert mesh.wait(fut, timeout=60) == dict.fromkeys(range(mesh.world_size), i * i)
    elif kind == "exec_future":
        fut = mesh.exec_async(f"{i} + 1")
        assert mesh.wait(fut, timeout=60) == dict.fromkeys(range(mesh.world_size), i + 1)
    elif kind == "stacks":
        mesh.stacks()
    elif kind == "large":
        import numpy as np

        mesh.push(big=np.full(LARGE, i % 251, dtype=np.uint8))
        got = mesh.pull("big")
        assert all(int(v[0]) == i % 251 and v.nbytes == LARGE for v in got.values())
    else:
        raise ValueError(kind)


# -- what is sampled ----------------------------------------------------------------------
def _zmq_sockets() -> int:
    import zmq

    return sum(1 for o in gc.get_objects() if isinstance(o, zmq.Socket) and not o.closed)


def sample(mesh: Mesh, call: int) -> Sample:
    me = psutil.Process()
    fds = threads = 0
    rss = 0.0
    for row in mesh.status():
        try:
            p = psutil.Process(row["pid"])
            fds += p.num_fds()
            threads += p.num_threads()
            rss += p.memory_info().rss
        except (psutil.Error, TypeError, ValueError):
            continue  # a rank between processes
    try:
        shm = len(os.listdir("/dev/shm"))
    except OSError:
        shm = -1
    return Sample(
        call=call, ctl_fds=me.num_fds(), ctl_threads=me.num_threads(),
        ctl_rss_mb=round(me.memory_info().rss / 2**20, 1),
        children=len([c for c in me.children() if c.status() != psutil.STATUS_ZOMBIE]),
        zmq_sockets=_zmq_sockets(), pending=len(mesh._ctl.calls), shm=shm,
        rank_fds=fds, rank_threads=threads, rank_rss_mb=round(rss / 2**20, 1))


def wait_all_ready(mesh: Mesh, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(r["state"] == "ready" for r in mesh.status()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks not back after {timeout} s: {mesh.status()}")
        time.sleep(0.05)


def _spread(count: int, total: int, offset: float) -> set[int]:
    """``count`` call indexes spread evenly over ``total`` (none in the first tenth)."""
    return {int(total * (0.1 + 0.85 * (k + offset) / count)) for k in range(count)} if count else set()


def soak(calls: int, respawns: int, cycles: int, ranks: int = 2, sample_every: int = 100,
         seed: int = 0, progress: Callable[[str], None] | None = None,
         mesh_options: dict[str, Any] | None = None) -> SoakReport:
    report = SoakReport(calls, respawns, cycles, ranks)
    if __name__ != "__main__":  # imported (tests/test_soak.py): the ranks cannot import us
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    rng = random.Random(seed)
    # every respawn is one rank's: a long run's would spend the default
    # budget (5 in 10 min) and end in a give-up, which is not what is measured
    opts = {"n": ranks, "backend": "cpu", "restart_budget": respawns + 5, **(mesh_options or {})}
    kill_at = _spread(respawns, calls, 0.3)
    cycle_at = _spread(cycles, calls, 0.7)
    mix = _mixed_kinds()
    t0 = time.monotonic()
    mesh = Mesh.start(**opts)
    # cells print on every rank each time: keep that out of the table
    sink = io.StringIO()
    try:
        mesh.push(small={})
        for i in range(calls):
            if i % sample_every == 0:
                report.samples.append(sample(mesh, i))
                if progress:
                    progress(_row(report.samples[-1]))
            if i in kill_at:
                mesh.kill(rng.randrange(mesh.world_size))
                wait_all_ready(mesh)
                mesh.push(small={})
            if i in cycle_at:
                mesh.stop()
                mesh = Mesh.start(**opts)
                mesh.push(small={})
            if i % 5 == 0:  # the latency probe
                t = time.perf_counter()
                mesh.run(_noop)
                dt = time.perf_counter() - t
                if i < calls // 5:
                    report.latency_start.append(dt)
                elif i >= calls - calls // 5:
                    report.latency_end.append(dt)
            kind = mix[rng.randrange(len(mix))]
            report.kinds[kind] = report.kinds.get(kind, 0) + 1
            t = time.perf_counter()
            with contextlib.redirect_stdout(sink):
                one_call(mesh, kind, i, report)
            sink.seek(0)
            sink.truncate()
            report.kind_seconds[kind] = report.kind_seconds.get(kind, 0.0) + time.perf_counter() - t
        wait_all_ready(mesh)
        report.samples.append(sample(mesh, calls))
        if progress:
            progress(_row(report.samples[-1]))
    finally:
        mesh.stop()
        report.seconds = time.monotonic() - t0
    return report


# -- output -------------------------------------------------------------------------------
def _row(s: Sample) -> str:
    return " ".join(f"{getattr(s, c):>12}" for c in COLUMNS)


def render(report: SoakReport) -> str:
    lines = [f"soak: {report.calls} calls, {report.respawns} respawns, {report.cycles} "
             f"stop/start cycles, {report.ranks} ranks, {report.seconds:.0f} s; kinds "
             + ", ".join(f"{k} {v}" for k, v in sorted(report.kinds.items())),
             "time per kind (s): " + ", ".join(f"{k} {v:.1f}" for k, v in
                                              sorted(report.kind_seconds.items())),
             "", " ".join(f"{c:>12}" for c in COLUMNS)]
    lines += [_row(s) for s in report.samples]
    slopes = report.slopes()
    lines += ["", "slope per 1000 calls (least squares, warm-up sample left out):",
              "  " + ", ".join(f"{c} {v:+.2f}" for c, v in slopes.items())]
    ms = [1000 * v for v in report.latency_start], [1000 * v for v in report.latency_end]
    lines += ["", "no-op mesh.run latency (ms)      p50      p99      n",
              f"  first fifth of the run    {percentile(ms[0], 50):8.3f} {percentile(ms[0], 99):8.3f} "
              f"{len(ms[0]):6d}",
              f"  last fifth of the run     {percentile(ms[1], 50):8.3f} {percentile(ms[1], 99):8.3f} "
              f"{len(ms[1]):6d}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--respawns", type=int, default=10)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sample-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the report here")
    args = ap.parse_args(argv)
    print(" ".join(f"{c:>12}" for c in COLUMNS), flush=True)
    report = soak(args.calls, args.respawns, args.cycles, args.ranks, args.sample_every,
                  args.seed, progress=lambda line: print(line, flush=True))
    print()
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**asdict(report), "slopes": report.slopes()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
