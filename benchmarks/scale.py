#!/usr/bin/env python3
"""monarch_nb scale curve: the controller alone at many ranks, and one real big mesh.

    .venv/bin/python benchmarks/scale.py [--ranks 4,64,256,1024] [--hosts 2] [--calls 300]
                                         [--json out.json] [--profile N] [--zmq]
    .venv/bin/python benchmarks/scale.py --agents 8,32,128 [--per-agent 8] [--hosts 4]
    .venv/bin/python benchmarks/scale.py --real 32 [--json out.json]

Simulated ranks (default): for each N, ``Mesh.start(n=N, launcher=SimLauncher(hosts=K))``
(benchmarks/simranks.py: N protocol-speaking ranks, no torch, in K host
processes), then ``mesh.run(f)`` of a no-op ``f`` to all N ranks, as
benchmarks/run.py calls it. Per N:

Each simulated rank's main channel is a link (wire/link.py), as a real rank's
on the controller's host; ``--zmq`` puts it on a ZeroMQ DEALER instead, as a
rank on another host (the control channel is ZeroMQ either way).

* start: ``Mesh.start`` until every simulated rank is READY (the
  controller's start-up work: N spawns, N handshakes);
* no-op latency: median and p99 of the timed calls (after a warm-up);
* controller CPU per rank per call: this process's CPU time (every thread:
  the caller leading the I/O loop, the I/O thread, heartbeats and ticks
  included) over the timed calls, divided by calls x N. The simulated ranks
  are other processes: their CPU is not counted;
* the simulated ranks' own CPU per rank per call (their host processes:
  user + system), for scale: on two cores they compete with the controller,
  so the latency includes their share, the controller CPU figures do not;
* idle: the controller's CPU share while nobody calls (heartbeats, pings,
  liveness ticks of N ranks), measured over ``IDLE_S`` before the calls;
* the raw ZeroMQ floor at the same N, after the mesh stopped: a ROUTER here,
  N DEALERs in the same number of host processes answering ``b"ok"`` (no
  signing, no pickling, no bookkeeping): its round trip, and this process's
  CPU per rank per round trip (pyzmq calls, libzmq's I/O thread, syscalls:
  what no controller on ZeroMQ can go below).

``--agents 8,32,128``: across hosts. For each A, A simulated host agents of
``--per-agent`` (8) ranks each (benchmarks/simranks.py: each agent one
DEALER to the controller, as a real agent's relay, the agents dealt over
``--hosts`` processes): a call to all ranks is one message per agent, the
answers come back one batch per agent. Each row is printed beside the same
ranks without agents (each rank its own DEALER, as before host agents) and
the raw ZeroMQ floor with one DEALER per agent.

``--profile N``: cProfile (CPU time) the controller during the calls at N
ranks and print the top functions (the I/O loop runs on the calling thread
during a blocking call, so this profiles the call path). The profiler's own
cost inflates that row's figures: py-spy (``py-spy record -- python
benchmarks/scale.py``) gives proportions without it.

``--real N``: N real CPU ranks (gloo) on this machine: time to start (all
ranks ready), a cell (``all_reduce`` of one tensor through ``mesh.exec``;
first and median of the next ones), stop, and the dashboard's cost: the
controller's CPU per second with the dashboard widget attached and without,
idle and while cells log metrics (``mnb.log``). Outside a notebook the
widget's comm is ipywidgets' dummy; each message it would send is
``json.dumps``-ed here, as ipykernel would, so that cost counts.

No assertions: figures only. Every process started here is stopped in
``finally`` blocks (simulated hosts by the mesh's stop, which closes their
stdin; they also die with this process).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:  # run from anywhere: the checkout's monarch_nb
    sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from benchmarks.simranks import SimLauncher, floor  # noqa: E402
from monarch_nb import Mesh  # noqa: E402

NOOP = lambda: None  # noqa: E731  (one object, defined in __main__, as benchmarks/run.py)
IDLE_S = 2.0
WARMUP = 20
# Targets of issue 19 (item 7)
TARGET_LATENCY_MS = 10.0  # a no-op to 256 simulated ranks
TARGET_CPU_US = 20.0  # controller CPU per rank per call


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # so every finally (mesh.stop) runs


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def calls_for(n: int, calls: int) -> int:
    """Fewer calls at many ranks: each costs more, the run stays short. Never
    fewer than ``calls`` or 300, whichever is less: a median of 100 calls
    moved by a millisecond from run to run at 1,024 ranks on a shared machine."""
    return max(min(calls, 300), min(calls, 40_000 // n))


def _hosts_cpu(launcher: SimLauncher) -> float:
    """CPU seconds (user + system) the simulated ranks' hosts used so far."""
    total = 0.0
    for pid in launcher.host_pids():
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def start_sim(n: int, hosts: int, links: bool = True, agents: int = 0, per_agent: int = 8,
              agent_model: str = "host") -> tuple[Mesh, SimLauncher, float]:
    launcher = SimLauncher(hosts=min(hosts, n), links=links, agents=agents, per_agent=per_agent,
                           agent_model=agent_model)
    t0 = time.perf_counter()
    mesh = Mesh.start(n=n, backend="cpu", respawn="off", launcher=launcher, spare=False,
                      hang_timeout=None)
    return mesh, launcher, time.perf_counter() - t0


def measure_sim(n: int, hosts: int, calls: int, profile: bool, links: bool = True,
                agents: int = 0, per_agent: int = 8, agent_model: str = "host") -> dict[str, Any]:
    mesh, launcher, start_s = start_sim(n, hosts, links, agents, per_agent, agent_model)
    try:
        for _ in range(WARMUP):
            mesh.run(NOOP)
        # idle: heartbeats, pings and ticks of n ranks, nobody calling
        c0, t0 = time.process_time(), time.perf_counter()
        time.sleep(IDLE_S)
        idle = (time.process_time() - c0) / (time.perf_counter() - t0)
        m = calls_for(n, calls)
        lat = []
        # CPU time, not wall time: poll's waiting for the ranks is not the controller's cost
        prof = cProfile.Profile(time.process_time) if profile else None
        perf = time.perf_counter
        hosts0 = _hosts_cpu(launcher)
        c0, w0 = time.process_time(), perf()
        if prof is not None:
            prof.enable()
        for _ in range(m):
            t = perf()
            res = mesh.run(NOOP)
            lat.append(perf() - t)
        if prof is not None:
            prof.disable()
        cpu, wall = time.process_time() - c0, perf() - w0
        hosts_cpu = _hosts_cpu(launcher) - hosts0
        assert len(res) == n, f"{len(res)} answers from {n} ranks"  # a sanity check, not a figure
        out = {
            "ranks": n, "hosts": launcher.hosts, "calls": m, "start_s": start_s,
            "median_ms": statistics.median(lat) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3,
            "min_ms": min(lat) * 1e3,
            "cpu_us_per_rank_call": cpu / (m * n) * 1e6,
            "cpu_share_during_calls": cpu / wall, "idle_cpu_share": idle,
            "hosts_cpu_us_per_rank_call": hosts_cpu / (m * n) * 1e6,
            "dropped": mesh.dropped, "agents": agents, "agent_model": agent_model,
            "relayed": dict(mesh._ctl.io.relayed),
        }
        if prof is not None:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            out["profile"] = text.getvalue()
    finally:
        t0 = time.perf_counter()
        mesh.stop()
        launcher.close()
        log(f"{n} simulated ranks stopped in {time.perf_counter() - t0:.2f} s")
    # the raw ZeroMQ floor at this size, once the mesh is gone (simranks.floor):
    # one DEALER per agent when the ranks are behind agents (one message per host)
    times, floor_cpu = floor(agents or n, launcher.hosts, m)
    out["floor_median_ms"] = statistics.median(times) * 1e3
    out["floor_cpu_us_per_rank_call"] = floor_cpu * 1e6
    return out


def run_sim(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for n in args.ranks:
        log(f"{n} simulated ranks in {min(args.hosts, n)} host process(es)...")
        row = measure_sim(n, args.hosts, args.calls, profile=n == args.profile,
                          links=not args.zmq)
        rows.append(row)
        log(f"  start {row['start_s']:.2f} s, no-op median {row['median_ms']:.2f} ms, p99 "
            f"{row['p99_ms']:.2f} ms, controller CPU {row['cpu_us_per_rank_call']:.1f} µs/rank/call")
        if "profile" in row:
            print(row["profile"], file=sys.stderr)
    # marginal: what one more rank adds to a call's controller CPU (the
    # slope from the previous row; a call's fixed cost drops out of it)
    prev = None
    for r in rows:
        per_call = r["cpu_us_per_rank_call"] * r["ranks"]
        if prev is not None and r["ranks"] > prev[0]:
            r["cpu_us_marginal"] = (per_call - prev[1]) / (r["ranks"] - prev[0])
        prev = (r["ranks"], per_call)
    print()
    print("main channel: " + ("ZeroMQ DEALERs (--zmq: as ranks on other hosts)" if args.zmq else
                              "links (wire/link.py: as ranks on the controller's host)"))
    print("| ranks (simulated) | host processes | calls | start | no-op median | no-op p99 "
          "| zmq floor median | controller CPU / rank / call | marginal | zmq floor CPU / rank "
          "| controller CPU idle | sim hosts' CPU / rank / call |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        marginal = f"{r['cpu_us_marginal']:.1f} µs" if "cpu_us_marginal" in r else "—"
        ranks = f"{r['ranks']} (profiled: slower)" if "profile" in r else r["ranks"]
        print(f"| {ranks} | {r['hosts']} | {r['calls']} | {r['start_s']:.2f} s "
              f"| {r['median_ms']:.2f} ms | {r['p99_ms']:.2f} ms | {r['floor_median_ms']:.2f} ms "
              f"| {r['cpu_us_per_rank_call']:.1f} µs | {marginal} "
              f"| {r['floor_cpu_us_per_rank_call']:.1f} µs | {r['idle_cpu_share'] * 100:.1f} % "
              f"| {r['hosts_cpu_us_per_rank_call']:.1f} µs |")
    at = {r["ranks"]: r for r in rows}
    if 256 in at:
        ok = at[256]["median_ms"] <= TARGET_LATENCY_MS
        print(f"\ntarget: no-op to 256 ranks ≤ {TARGET_LATENCY_MS:g} ms: "
              f"{'met' if ok else 'missed'} ({at[256]['median_ms']:.2f} ms median)")
    big = [r for r in rows if r["ranks"] >= 64] or rows
    worst = max(big, key=lambda r: r["cpu_us_per_rank_call"])
    print(f"target: controller CPU ≤ {TARGET_CPU_US:g} µs per rank per call (64 ranks and up; "
          f"below, a call's fixed cost dominates): "
          f"{'met' if worst['cpu_us_per_rank_call'] <= TARGET_CPU_US else 'missed'} "
          f"(worst {worst['cpu_us_per_rank_call']:.1f} µs at {worst['ranks']} ranks)")
    return rows


def run_agents(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Simulated hosts (agents) of ``per_agent`` ranks: with the relay, and
    the same ranks without agents, side by side."""
    rows = []
    for agents in args.agents:
        n = agents * args.per_agent
        log(f"{agents} simulated hosts of {args.per_agent} ranks ({n} ranks) in "
            f"{min(args.hosts, n)} processes...")
        row = measure_sim(n, args.hosts, args.calls, profile=n == args.profile, links=False,
                          agents=agents, per_agent=args.per_agent, agent_model=args.agent_model)
        log(f"  through agents: start {row['start_s']:.2f} s, no-op median "
            f"{row['median_ms']:.2f} ms, controller CPU / call "
            f"{row['cpu_us_per_rank_call'] * n:.0f} µs")
        if "profile" in row:
            print(row["profile"], file=sys.stderr)
        if not args.no_baseline:
            base = measure_sim(n, args.hosts, args.calls, profile=False, links=False)
            row["without"] = base
            log(f"  without agents: start {base['start_s']:.2f} s, no-op median "
                f"{base['median_ms']:.2f} ms, controller CPU / call "
                f"{base['cpu_us_per_rank_call'] * n:.0f} µs")
        rows.append(row)
    print()
    print(f"simulated hosts answer as: {args.agent_model} (--agent-model; simranks.py)")
    print("| hosts x ranks | ranks | start | no-op median | p99 | zmq floor (1 DEALER / host) "
          "| controller CPU / call | per host | per rank | sim hosts' CPU / call "
          "| without agents: start, median, CPU / call |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        n, a = r["ranks"], r["agents"]
        per_call = r["cpu_us_per_rank_call"] * n
        base = r.get("without")
        was = "—" if base is None else (
            f"{base['start_s']:.2f} s, {base['median_ms']:.2f} ms, "
            f"{base['cpu_us_per_rank_call'] * n:.0f} µs")
        print(f"| {a} x {args.per_agent} | {n} | {r['start_s']:.2f} s | {r['median_ms']:.2f} ms "
              f"| {r['p99_ms']:.2f} ms | {r['floor_median_ms']:.2f} ms | {per_call:.0f} µs "
              f"| {per_call / a:.1f} µs | {r['cpu_us_per_rank_call']:.1f} µs "
              f"| {r['hosts_cpu_us_per_rank_call'] * n / 1e3:.1f} ms | {was} |")
    at = {r["agents"]: r for r in rows}
    if 128 in at:
        r = at[128]
        print(f"\ntarget: a no-op to {r['ranks']} ranks on 128 hosts ≤ 10 ms median: "
              f"{'met' if r['median_ms'] <= 10 else 'missed'} ({r['median_ms']:.2f} ms); "
              f"starting 128 hosts ≤ 5 s: {'met' if r['start_s'] <= 5 else 'missed'} "
              f"({r['start_s']:.2f} s)")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        grow = (last["cpu_us_per_rank_call"] * last["ranks"]) / (
            first["cpu_us_per_rank_call"] * first["ranks"])
        print(f"controller CPU per call grew {grow:.1f}x for {last['agents'] / first['agents']:.0f}x "
              f"the hosts (and ranks)")
    return rows


# -- a real mesh ---------------------------------------------------------------------------------
CELL = ("import torch, torch.distributed as dist\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
        "int(t.item())")
LOG_CELL = ("import monarch_nb as mnb\n"
            "for i in range(20):\n"
            "    mnb.log(step=i, loss=1.0 / (i + 1), lr=0.1)\n")


def _cpu_rate(seconds: float, work: Any = None) -> float:
    """The controller's CPU seconds per second over ``seconds`` (idle, or
    running ``work()`` in a loop)."""
    c0, t0 = time.process_time(), time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:
        if work is None:
            time.sleep(end - time.perf_counter())
        else:
            work()
    return (time.process_time() - c0) / (time.perf_counter() - t0)


def run_real(n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"ranks": n}
    t0 = time.perf_counter()
    mesh = Mesh.start(n=n, backend="cpu", spare=False)
    out["start_s"] = time.perf_counter() - t0
    log(f"{n} real CPU ranks ready in {out['start_s']:.1f} s")
    board = None
    try:
        t0 = time.perf_counter()
        first = mesh.exec(CELL)
        out["cell_first_s"] = time.perf_counter() - t0
        assert set(first.values()) == {n}, first  # sanity: the all_reduce summed n ones
        lat = []
        for _ in range(10):
            t0 = time.perf_counter()
            mesh.exec(CELL)
            lat.append(time.perf_counter() - t0)
        out["cell_median_s"] = statistics.median(lat)
        log(f"all_reduce cell: first {out['cell_first_s'] * 1e3:.0f} ms, "
            f"median {out['cell_median_s'] * 1e3:.0f} ms")

        def log_cell() -> None:
            mesh.exec(LOG_CELL)

        out["cpu_idle_no_dashboard"] = _cpu_rate(3.0)
        out["cpu_cells_no_dashboard"] = _cpu_rate(3.0, log_cell)
        board = mesh.dashboard()
        sent: list[int] = [0, 0]
        comm_send = board.comm.send

        def send(data: Any = None, *a: Any, **kw: Any) -> Any:
            sent[0] += 1
            sent[1] += len(json.dumps(data))  # what ipykernel would serialise
            return comm_send(data, *a, **kw)

        board.comm.send = send
        time.sleep(0.5)  # its first snapshot
        out["cpu_idle_dashboard"] = _cpu_rate(3.0)
        s0 = list(sent)
        out["cpu_cells_dashboard"] = _cpu_rate(3.0, log_cell)
        out["dashboard_msgs_per_s"] = (sent[0] - s0[0]) / 3.0
        out["dashboard_bytes_per_s"] = (sent[1] - s0[1]) / 3.0
        t0 = time.perf_counter()
        snap = 0
        for _ in range(20):
            board.feed.want_snapshot = True
            msg = board.feed.next()
            snap = len(json.dumps(msg))
        out["snapshot_ms"] = (time.perf_counter() - t0) / 20 * 1e3
        out["snapshot_bytes"] = snap
    finally:
        if board is not None:
            board.close()
        t0 = time.perf_counter()
        mesh.stop()
        out["stop_s"] = time.perf_counter() - t0
    log(f"stopped in {out['stop_s']:.2f} s")
    print()
    print(f"| {n} real CPU ranks | |")
    print("|---|---:|")
    print(f"| start (all ranks ready) | {out['start_s']:.1f} s |")
    print(f"| cell: all_reduce through mesh.exec, first | {out['cell_first_s'] * 1e3:.0f} ms |")
    print(f"| cell: the same, median of 10 more | {out['cell_median_s'] * 1e3:.0f} ms |")
    print(f"| stop | {out['stop_s']:.2f} s |")
    print(f"| controller CPU idle: no dashboard / dashboard | {out['cpu_idle_no_dashboard'] * 100:.1f} % "
          f"/ {out['cpu_idle_dashboard'] * 100:.1f} % |")
    print(f"| controller CPU, cells logging metrics back to back: no dashboard / dashboard "
          f"| {out['cpu_cells_no_dashboard'] * 100:.1f} % / {out['cpu_cells_dashboard'] * 100:.1f} % |")
    print(f"| dashboard messages while logging | {out['dashboard_msgs_per_s']:.1f}/s, "
          f"{out['dashboard_bytes_per_s'] / 1024:.1f} KiB/s |")
    print(f"| dashboard snapshot (a fresh page): build + JSON | {out['snapshot_ms']:.1f} ms, "
          f"{out['snapshot_bytes'] / 1024:.0f} KiB |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="4,64,256,1024",
                    type=lambda s: [int(x) for x in s.split(",") if x])
    ap.add_argument("--hosts", type=int, default=2, help="simulated-rank host processes")
    ap.add_argument("--calls", type=int, default=300, help="timed calls (fewer at many ranks, not below 300)")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the calls at this N")
    ap.add_argument("--real", type=int, default=0, help="N real CPU ranks instead")
    ap.add_argument("--zmq", action="store_true",
                    help="simulated ranks' main channel on ZeroMQ (as remote ranks), not links")
    ap.add_argument("--agents", default="", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="simulated hosts (agents) per row, e.g. 8,32,128")
    ap.add_argument("--per-agent", type=int, default=8, help="ranks per simulated host")
    ap.add_argument("--agent-model", choices=("host", "ranks"), default="host",
                    help="a simulated host's answer to a call: a real host's wall time (one "
                         "verify, the relay's fold) or every rank's CPU (simranks.py)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="--agents: skip the same ranks without agents")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _sigterm)
    log(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    result: Any = (run_real(args.real) if args.real else
                   run_agents(args) if args.agents else run_sim(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": os.getloadavg(), "result": result}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
