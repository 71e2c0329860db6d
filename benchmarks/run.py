#!/usr/bin/env python3
"""monarch_nb benchmark: one command, one table, ratios to the raw ZeroMQ floor
and to ipyparallel, all measured in the same run on this machine.

    .venv/bin/python benchmarks/run.py [--ranks 4] [--calls 2000] [--json out.json] [--quick]
                                       [--floor-script PATH]   # default ../shared/bench/zmq_floor.py

What it measures (see benchmarks/README.md):

* raw ZeroMQ floor: ``<repo>/../shared/bench/zmq_floor.py --ranks N --json`` and
  ``--ranks 1`` run as subprocesses (before, between the no-op and the push
  measurements, and after the rest; medians of the runs); for pulls, which
  that script does not measure, ``benchmarks/pull_floor.py --ranks N`` (N
  DEALERs each send 64 MiB to a ROUTER) in the same passes;
* monarch_nb: no-op ``mesh.run(NOOP)`` to all N ranks and to one rank
  (``mesh[0].run``), 64 MiB ``mesh.push`` of a numpy array and of a torch tensor,
  64 MiB ``mesh.pull`` of a numpy array from every rank (shared memory with
  local ranks: see README, "Big values"), cold start of
  ``Mesh.start(n=N, backend="cpu")``;
* ipyparallel 9: the same through ``rc[:].apply_sync`` / ``rc[0].apply_sync``,
  ``view.push(..., block=True)``, ``view.pull(..., block=True)`` and
  ``Cluster(n=N).start_and_connect_sync()``.

monarch_nb and ipyparallel run side by side and their measurements are
interleaved block by block, so background noise hits both alike. No assertions:
figures only. Every process started here is stopped in ``finally`` blocks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FLOOR_SCRIPT = (REPO / ".." / "shared" / "bench" / "zmq_floor.py").resolve()
PULL_FLOOR_SCRIPT = HERE / "pull_floor.py"
NOOP_TARGET = 1.25  # issue 19: a no-op within 1.25x the ZeroMQ floor (median), 4 ranks and 1
if str(REPO) not in sys.path:  # run from anywhere: import the checkout's monarch_nb
    sys.path.insert(0, str(REPO))

MIB = 64
PUSH_BYTES = MIB * 2**20

# The no-op that both systems call: one lambda object, created once, defined in
# __main__ (so both cloudpickle and ipyparallel ship it by value).
NOOP = lambda: None  # noqa: E731
NOOP_KIND = "f = lambda: None (one lambda object defined once in __main__, reused every call)"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _sigterm(signum: int, frame: Any) -> None:
    # Turn SIGTERM into an exception so every finally block (mesh.stop,
    # cluster stop, floor subprocess kill) still runs.
    raise SystemExit(128 + signum)


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    perf = time.perf_counter
    for _ in range(n):
        t = perf()
        fn()
        out.append(perf() - t)
    return out


# --------------------------------------------------------------------------- floor

Bulk = dict[str, tuple[dict[str, Any], str, Callable[[], Any], int]]


def _bulk_rounds(what: str, jobs: Bulk, n_ranks: int, res: dict[str, Any],
                 check: Callable[[Any], None] | None = None) -> set[str]:
    """64 MiB transfers, round-robin: ``jobs`` maps a name to (where to
    store, key, the transfer, runs). One warm-up each (its result checked
    by ``check``), then ``runs`` timed rounds; a failing one is dropped
    and noted in ``res["errors"]``. Returns the names that failed."""
    samples: dict[str, list[float]] = {k: [] for k in jobs}
    failed: set[str] = set()

    def attempt(name: str, run: Callable[[], None]) -> None:
        try:
            run()
        except Exception as exc:
            failed.add(name)
            res["errors"].append(f"{what} {name}: {type(exc).__name__}: {exc}")
            log(f"{what} {name} failed: {exc}")

    log(f"{what} warm-up")
    for name, (_, _, fn, _) in jobs.items():
        attempt(name, lambda fn=fn: (check or (lambda _: None))(fn()))
    for i in range(max(j[3] for j in jobs.values())):
        log(f"{what} round {i + 1}")
        for name, (_, _, fn, runs) in jobs.items():
            if i < runs and name not in failed:
                gc.collect()
                attempt(name, lambda fn=fn, name=name: samples[name].extend(timed(fn, 1)))
    for name, (store, key, _, _) in jobs.items():
        xs = samples[name]
        if xs:
            store[key] = {"median_s": med(xs), "min_s": min(xs), "n": len(xs),
                          "mib_per_s_aggregate": MIB * n_ranks / med(xs), "samples_s": xs}
    return failed


def _check_pulled(n_ranks: int) -> Callable[[Any], None]:
    import numpy as np

    def check(got: Any) -> None:
        values = got.values() if isinstance(got, dict) else got
        if len(got) != n_ranks or any(int(np.asarray(x).nbytes) != PUSH_BYTES for x in values):
            raise RuntimeError(f"pulled {len(got)} values of the wrong size")
    return check

def run_floor(ranks: int, calls: int) -> dict[str, Any]:
    """One zmq_floor.py run (FLOOR_SCRIPT: ``--floor-script`` where the
    checkout is not beside shared/, e.g. a git worktree)."""
    cmd = [sys.executable, str(FLOOR_SCRIPT), "--ranks", str(ranks), "--calls", str(calls),
           "--mib", str(MIB), "--json"]
    # Own session: on timeout/interrupt the whole group (its rank processes too) is killed.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, cwd=str(FLOOR_SCRIPT.parent))
    try:
        out, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    if p.returncode != 0:
        raise RuntimeError(f"zmq_floor.py --ranks {ranks} exited {p.returncode}: {err.strip()[-500:]}")
    line = [ln for ln in out.splitlines() if ln.strip().startswith("{")][-1]
    return json.loads(line)


def run_pull_floor(ranks: int) -> dict[str, Any]:
    cmd = [sys.executable, str(PULL_FLOOR_SCRIPT), "--ranks", str(ranks), "--mib", str(MIB),
           "--json"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, cwd=str(HERE))
    try:
        out, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    if p.returncode != 0:
        raise RuntimeError(f"pull_floor.py --ranks {ranks} exited {p.returncode}: {err.strip()[-500:]}")
    line = [ln for ln in out.splitlines() if ln.strip().startswith("{")][-1]
    return json.loads(line)


def pull_floor_pass(ranks: int, res: dict[str, Any]) -> None:
    try:
        r = run_pull_floor(ranks)
        log(f"pull floor --ranks {ranks}: {r['pull_mib_per_s_aggregate']} MiB/s")
        res["floor"]["pull_runs"].append(r)
    except Exception as exc:
        log(f"pull floor failed: {exc}")
        res["errors"].append(f"pull floor ranks={ranks}: {exc}")


def floor_pass(ranks: int, calls: int, order: list[int], res: dict[str, Any]) -> None:
    for n in order:
        try:
            t = time.perf_counter()
            r = run_floor(n, calls)
            log(f"floor --ranks {n}: noop median {r['noop_median_us']} us, "
                f"push {r['push_mib_per_s_aggregate']} MiB/s ({time.perf_counter() - t:.1f} s)")
            res["floor"]["runs"].setdefault(str(n), []).append(r)
        except Exception as exc:
            log(f"floor --ranks {n} failed: {exc}")
            res["errors"].append(f"floor ranks={n}: {exc}")


# --------------------------------------------------------------------------- monarch_nb
def mesh_start(n: int, res: dict[str, Any], **options: Any) -> tuple[Any, float]:
    """Mesh.start(n) timed; one retry (recorded) if a start fails, since other
    processes on this machine may be interfering."""
    from monarch_nb import Mesh

    for attempt in (1, 2):
        t = time.perf_counter()
        try:
            mesh = Mesh.start(n=n, backend="cpu", **options)
        except Exception as exc:
            res["errors"].append(f"monarch_nb Mesh.start attempt {attempt}: {type(exc).__name__}: {exc}")
            log(f"monarch_nb Mesh.start failed (attempt {attempt}): {exc}")
            if attempt == 2:
                raise
            time.sleep(2)
            continue
        return mesh, time.perf_counter() - t
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- ipyparallel
def ipp_start(n: int) -> tuple[Any, Any, float]:
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=n, log_level=40)
    t = time.perf_counter()
    try:
        rc = cluster.start_and_connect_sync()
    except BaseException:
        _ipp_stop(cluster, None)
        raise
    return cluster, rc, time.perf_counter() - t


def _ipp_stop(cluster: Any, rc: Any) -> None:
    if rc is not None:
        try:
            rc.close()
        except Exception:
            pass
    if cluster is not None:
        try:
            cluster.stop_cluster_sync()
        except Exception as exc:
            log(f"ipyparallel stop_cluster_sync failed: {exc}")


# --------------------------------------------------------------------------- main
def main() -> int:
    global FLOOR_SCRIPT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="ranks/engines for the multi-rank rows")
    ap.add_argument("--calls", type=int, default=2000, help="monarch_nb no-op calls per target")
    ap.add_argument("--ipp-calls", type=int, default=300, help="ipyparallel no-op calls per target")
    ap.add_argument("--json", metavar="PATH", help="write every raw figure here")
    ap.add_argument("--quick", action="store_true", help="small sample counts (smoke test, ~1 min)")
    ap.add_argument("--no-zmq-mesh", action="store_true",
                    help="skip the second mesh with local_link=False (ranks on ZeroMQ)")
    ap.add_argument("--floor-script", metavar="PATH", default=str(FLOOR_SCRIPT),
                    help="shared/bench/zmq_floor.py (default: beside the checkout)")
    a = ap.parse_args()
    FLOOR_SCRIPT = Path(a.floor_script).resolve()
    signal.signal(signal.SIGTERM, _sigterm)

    N = a.ranks
    if a.quick:
        a.calls = min(a.calls, 300)
        a.ipp_calls = min(a.ipp_calls, 60)
    rounds = 2 if a.quick else 4        # interleaved blocks per no-op measurement
    push_runs = 3 if a.quick else 8     # monarch_nb pushes (numpy and torch each)
    ipp_push_runs = 3 if a.quick else 5
    cold_samples = 1 if a.quick else 2
    floor_calls = a.calls

    t_all = time.perf_counter()
    res: dict[str, Any] = {
        "config": {"ranks": N, "calls": a.calls, "ipp_calls": a.ipp_calls, "rounds": rounds,
                   "push_mib": MIB, "push_runs": push_runs, "ipp_push_runs": ipp_push_runs,
                   "cold_samples": cold_samples, "quick": a.quick, "noop": NOOP_KIND,
                   "one_rank": "mesh[0].run(f) on the N-rank mesh; rc[0].apply_sync(f) on the "
                               "N-engine cluster; floor: zmq_floor.py --ranks 1",
                   "python": sys.version.split()[0], "platform": platform.platform(),
                   "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
        "floor": {"script": str(FLOOR_SCRIPT), "runs": {}, "pull_runs": []},
        "monarch_nb": {}, "ipyparallel": {}, "errors": [],
    }
    M, P = res["monarch_nb"], res["ipyparallel"]

    # ---- imports / availability
    try:
        import numpy as np
    except ImportError:
        print("numpy is needed: pip install numpy", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    have_floor = FLOOR_SCRIPT.is_file()
    if not have_floor:
        print(f"zmq floor script not found at {FLOOR_SCRIPT}: skipping the floor column")
    try:
        import ipyparallel
        have_ipp = True
        P["version"] = ipyparallel.__version__
    except ImportError:
        have_ipp = False
        print("ipyparallel not installed (pip install 'monarch-nb[bench]')")
    try:
        import monarch_nb
        have_mnb = True
        M["version"] = getattr(monarch_nb, "__version__", "?")
    except Exception as exc:
        have_mnb = False
        res["errors"].append(f"import monarch_nb: {type(exc).__name__}: {exc}")
        print(f"monarch_nb import failed: {type(exc).__name__}: {exc}")

    # ---- floor, first pass (N then 1)
    order = [N, 1] if N != 1 else [1]
    if have_floor:
        floor_pass(N, floor_calls, order, res)
    pull_floor_pass(N, res)

    mesh = cluster = rc = zmq_mesh = None
    arr = np.zeros(PUSH_BYTES, dtype=np.uint8)
    tens = torch.zeros(PUSH_BYTES, dtype=torch.uint8) if torch is not None else None
    try:
        # ---- cold starts, interleaved: mnb, ipp, mnb (kept), ipp (kept)
        M["cold_start_s"], P["cold_start_s"] = [], []
        for i in range(cold_samples):
            keep = i == cold_samples - 1
            if have_mnb:
                try:
                    log(f"monarch_nb cold start {i + 1}/{cold_samples}: Mesh.start(n={N})")
                    m, dt = mesh_start(N, res)
                    M["cold_start_s"].append(dt)
                    log(f"  ready in {dt:.2f} s")
                    if keep:
                        mesh = m
                    else:
                        m.stop()
                except Exception as exc:
                    have_mnb = False
                    res["errors"].append(f"monarch_nb start: {type(exc).__name__}: {exc}")
            if have_ipp:
                try:
                    log(f"ipyparallel cold start {i + 1}/{cold_samples}: Cluster(n={N})")
                    c, r, dt = ipp_start(N)
                    P["cold_start_s"].append(dt)
                    log(f"  ready in {dt:.2f} s")
                    if keep:
                        cluster, rc = c, r
                    else:
                        _ipp_stop(c, r)
                except Exception as exc:
                    have_ipp = False
                    res["errors"].append(f"ipyparallel start: {type(exc).__name__}: {exc}")
                    log(f"ipyparallel start failed: {exc}")

        # ---- the same mesh with every rank on ZeroMQ (local_link=False): what
        # the same-host links (wire/link.py) change, measured in the same blocks
        if have_mnb and not a.no_zmq_mesh:
            try:
                log(f"monarch_nb with local_link=False: Mesh.start(n={N})")
                zmq_mesh, _ = mesh_start(N, res, local_link=False, spare=False)
            except Exception as exc:
                res["errors"].append(f"monarch_nb local_link=False start: {type(exc).__name__}: {exc}")

        # ---- no-op round trips, interleaved blocks
        targets: dict[str, tuple[dict[str, Any], str, Callable[[], Any], int]] = {}
        if mesh is not None:
            m_all, m_one = mesh, mesh[0]
            targets["mnb_all"] = (M, f"noop_{N}_us", lambda: m_all.run(NOOP), a.calls)
            targets["mnb_one"] = (M, "noop_1_us", lambda: m_one.run(NOOP), a.calls)
        if zmq_mesh is not None:
            z_all, z_one = zmq_mesh, zmq_mesh[0]
            targets["mnbz_all"] = (M, f"noop_{N}_zmq_us", lambda: z_all.run(NOOP), a.calls)
            targets["mnbz_one"] = (M, "noop_1_zmq_us", lambda: z_one.run(NOOP), a.calls)
        if rc is not None:
            v_all, v_one = rc[:], rc[0]
            targets["ipp_all"] = (P, f"noop_{N}_us", lambda: v_all.apply_sync(NOOP), a.ipp_calls)
            targets["ipp_one"] = (P, "noop_1_us", lambda: v_one.apply_sync(NOOP), a.ipp_calls)
        if targets:
            log("warm-up")
            for name, (_, _, fn, total) in targets.items():
                try:
                    timed(fn, max(20, total // 10))
                except Exception as exc:
                    res["errors"].append(f"warm-up {name}: {type(exc).__name__}: {exc}")
            samples: dict[str, list[float]] = {k: [] for k in targets}
            failed: set[str] = set()
            for rnd in range(rounds):
                log(f"no-op round {rnd + 1}/{rounds}")
                for name, (_, _, fn, total) in targets.items():
                    if name in failed:
                        continue
                    per = total // rounds + (1 if rnd < total % rounds else 0)
                    try:
                        timed(fn, 5)  # re-warm after the other system's block
                        gc.collect()
                        samples[name] += timed(fn, per)
                    except Exception as exc:
                        failed.add(name)
                        res["errors"].append(f"no-op {name}: {type(exc).__name__}: {exc}")
                        log(f"no-op {name} failed: {exc}")
            for name, (store, key, _, _) in targets.items():
                xs = samples[name]
                if xs:
                    store[key] = {"median": med(xs) * 1e6, "min": min(xs) * 1e6,
                                  "p90": statistics.quantiles(xs, n=10)[-1] * 1e6 if len(xs) > 10 else None,
                                  "p99": statistics.quantiles(xs, n=100)[-1] * 1e6 if len(xs) > 100 else None,
                                  "n": len(xs), "samples": [round(x * 1e6, 1) for x in xs]}

        # ---- floor, middle pass: under the no-op rounds' conditions (the
        # mesh and the cluster alive and idle), so one noisy floor run
        # before or after cannot skew the ratio alone
        if have_floor:
            floor_pass(N, floor_calls, order, res)
        pull_floor_pass(N, res)
        if zmq_mesh is not None:  # not needed for the pushes
            zmq_mesh.stop()
            zmq_mesh = None

        # ---- 64 MiB pushes, round-robin
        pushes: Bulk = {}
        if mesh is not None:
            pushes["mnb_numpy"] = (M, "push_numpy", lambda: mesh.push(x=arr), push_runs)
            if tens is not None:
                pushes["mnb_torch"] = (M, "push_torch", lambda: mesh.push(x=tens), push_runs)
        if rc is not None:
            v = rc[:]
            pushes["ipp_numpy"] = (P, "push_numpy", lambda: v.push({"x": arr}, block=True),
                                   ipp_push_runs)
        if pushes:
            pfailed = _bulk_rounds("push", pushes, N, res)
            # check the data actually arrived (once, not timed)
            try:
                if mesh is not None and "mnb_torch" not in pfailed:
                    M["push_check"] = str(mesh.exec("(type(x).__name__, int(x.numel() if hasattr(x, 'numel') else x.nbytes))"))
                if rc is not None and "ipp_numpy" not in pfailed:
                    rc[:].execute("_bench_n = int(x.nbytes)", block=True)
                    P["push_check"] = str(rc[:].pull("_bench_n", block=True))
            except Exception as exc:
                res["errors"].append(f"push check: {type(exc).__name__}: {exc}")

        # ---- 64 MiB pulls from every rank, round-robin (x is on the ranks
        # from the pushes: numpy in both systems)
        pulls: Bulk = {}
        if mesh is not None:
            mesh.push(x=arr)
            pulls["mnb_numpy"] = (M, "pull_numpy", lambda: mesh.pull("x"), push_runs)
        if rc is not None:
            v = rc[:]
            v.push({"x": arr}, block=True)
            pulls["ipp_numpy"] = (P, "pull_numpy", lambda: v.pull("x", block=True), ipp_push_runs)
        if pulls:
            _bulk_rounds("pull", pulls, N, res, check=_check_pulled(N))
        if mesh is not None:
            M["dataplane"] = mesh.dataplane
    finally:
        log("stopping mesh / cluster")
        for m in (mesh, zmq_mesh):
            if m is not None:
                try:
                    m.stop()
                except Exception as exc:
                    log(f"mesh.stop failed: {exc}")
        _ipp_stop(cluster, rc)

    # ---- floor, second pass (reverse order) to bracket the run
    if have_floor and not a.quick:
        floor_pass(N, floor_calls, list(reversed(order)), res)
        pull_floor_pass(N, res)

    res["config"]["loadavg_end"] = os.getloadavg()
    res["total_s"] = time.perf_counter() - t_all

    # ---- summary figures
    F: dict[str, Any] = {}
    runs = res["floor"]["runs"]
    for n, key in ((N, f"noop_{N}_us"), (1, "noop_1_us")):
        rs = runs.get(str(n), [])
        if rs:
            F[key] = med([r["noop_median_us"] for r in rs])
            F[key + "_min"] = min(r["noop_min_us"] for r in rs)
    rs = runs.get(str(N), [])
    if rs:
        F["push_mib_per_s"] = med([r["push_mib_per_s_aggregate"] for r in rs])
    prs = res["floor"]["pull_runs"]
    if prs:
        F["pull_mib_per_s"] = med([r["pull_mib_per_s_aggregate"] for r in prs])
    res["floor"]["summary"] = F

    def g(d: dict[str, Any], *path: str) -> Any:
        for p in path:
            if not isinstance(d, dict) or p not in d:
                return None
            d = d[p]
        return d

    rows = [
        # label, floor, monarch, ipp, mins (floor, mnb, ipp), higher_is_better
        ("no-op, 1 rank (µs, median)", F.get("noop_1_us"), g(M, "noop_1_us", "median"),
         g(P, "noop_1_us", "median"),
         (F.get("noop_1_us_min"), g(M, "noop_1_us", "min"), g(P, "noop_1_us", "min")), False),
        (f"no-op, {N} ranks (µs, median)", F.get(f"noop_{N}_us"), g(M, f"noop_{N}_us", "median"),
         g(P, f"noop_{N}_us", "median"),
         (F.get(f"noop_{N}_us_min"), g(M, f"noop_{N}_us", "min"), g(P, f"noop_{N}_us", "min")), False),
        ("no-op, 1 rank, ZeroMQ main channel (local_link=False)", F.get("noop_1_us"),
         g(M, "noop_1_zmq_us", "median"), g(P, "noop_1_us", "median"),
         (F.get("noop_1_us_min"), g(M, "noop_1_zmq_us", "min"), g(P, "noop_1_us", "min")), False),
        (f"no-op, {N} ranks, ZeroMQ main channel (local_link=False)", F.get(f"noop_{N}_us"),
         g(M, f"noop_{N}_zmq_us", "median"), g(P, f"noop_{N}_us", "median"),
         (F.get(f"noop_{N}_us_min"), g(M, f"noop_{N}_zmq_us", "min"), g(P, f"noop_{N}_us", "min")),
         False),
        (f"push {MIB} MiB numpy to {N} ranks (aggregate MiB/s)", F.get("push_mib_per_s"),
         g(M, "push_numpy", "mib_per_s_aggregate"), g(P, "push_numpy", "mib_per_s_aggregate"),
         None, True),
        (f"push {MIB} MiB torch tensor to {N} ranks (aggregate MiB/s)", F.get("push_mib_per_s"),
         g(M, "push_torch", "mib_per_s_aggregate"), None, None, True),
        (f"pull {MIB} MiB numpy from {N} ranks (aggregate MiB/s)", F.get("pull_mib_per_s"),
         g(M, "pull_numpy", "mib_per_s_aggregate"), g(P, "pull_numpy", "mib_per_s_aggregate"),
         None, True),
        (f"cold start, {N} ranks (s, median of {cold_samples})", None,
         med(M.get("cold_start_s") or []), med(P.get("cold_start_s") or []), None, False),
    ]

    def fmt(x: Any, unit_s: bool = False) -> str:
        if x is None:
            return "—"
        if unit_s:
            return f"{x:.2f}"
        return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"

    def ratio(x: Any, y: Any) -> str:
        return "—" if x is None or y is None or y == 0 else f"{x / y:.2f}x"

    lines = [
        "",
        f"monarch_nb benchmark — {N} ranks, backend cpu, {os.cpu_count()} CPUs, "
        f"load avg {res['config']['loadavg_start'][0]:.2f} -> {res['config']['loadavg_end'][0]:.2f}, "
        f"total {res['total_s']:.0f} s",
        "",
        "| measure | zmq floor | monarch_nb | ipyparallel | monarch_nb / floor | monarch_nb vs ipyparallel |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, fl, mn, ip, mins, higher in rows:
        is_s = label.startswith("cold")
        cells = [fmt(fl, is_s), fmt(mn, is_s), fmt(ip, is_s)]
        if mins is not None:
            cells = [c if m is None else f"{c} (min {fmt(m)})" for c, m in zip(cells, mins, strict=True)]
        # monarch/floor: plain value ratio (time: >1 = slower than floor;
        # throughput: fraction of the floor). vs ipyparallel: >1 = monarch_nb better.
        vs_ipp = ratio(mn, ip) if higher else ratio(ip, mn)
        lines.append(f"| {label} | {' | '.join(cells)} | {ratio(mn, fl)} | {vs_ipp} |")
    lines += [
        "",
        "monarch_nb / floor: for times, monarch_nb time ÷ floor time (1.00x = the floor); "
        "for throughput, monarch_nb MiB/s ÷ floor MiB/s.",
        "monarch_nb vs ipyparallel: how many times better monarch_nb is (ipyparallel time ÷ "
        "monarch_nb time; monarch_nb MiB/s ÷ ipyparallel MiB/s); > 1 = monarch_nb wins.",
        f"no-op function: {NOOP_KIND}. 1 rank = mesh[0] of the {N}-rank mesh / rc[0] of the "
        f"{N}-engine cluster / zmq_floor.py --ranks 1.",
        f"samples: monarch_nb {a.calls} calls per no-op figure, ipyparallel {a.ipp_calls}, in "
        f"{rounds} interleaved blocks after warm-up; pushes {push_runs} (monarch_nb) / "
        f"{ipp_push_runs} (ipyparallel) interleaved, pulls the same; floor = median of "
        f"{len(runs.get(str(N), []))} zmq_floor.py runs (pull: {len(prs)} pull_floor.py runs).",
        "monarch_nb moves values of 1 MiB or more to and from local ranks through shared "
        "memory (one copy in the sender; each rank maps its own copy-on-write view), so its "
        "push and pull may exceed the socket floor.",
    ]
    now = []
    for n, key in ((N, f"noop_{N}_us"), (1, "noop_1_us")):
        mn, fl, p99 = g(M, key, "median"), F.get(key), g(M, key, "p99")
        if mn is not None and fl:
            met = mn / fl <= NOOP_TARGET and (n == 1 or p99 is None or p99 <= 1000)
            tail = f", p99 {p99 / 1000:.2f} ms" if p99 is not None else ""
            now.append(f"no-op {n} rank(s) = {mn / fl:.2f}x floor{tail} ({'met' if met else 'not met'})")
    for what in ("push", "pull"):
        mp = g(M, f"{what}_numpy", "mib_per_s_aggregate")
        ipp_p = g(P, f"{what}_numpy", "mib_per_s_aggregate")
        if mp is not None and ipp_p:
            met = mp >= 4 * ipp_p and mp * 2**20 >= 2e9
            now.append(f"{what} = {mp / ipp_p:.2f}x ipyparallel, {mp * 2**20 / 1e9:.2f} GB/s "
                       f"({'met' if met else 'not met'})")
    lines.append("")
    lines.append(f"target: no-op {N} ranks <= {NOOP_TARGET}x floor with p99 <= 1 ms, 1 rank "
                 f"<= {NOOP_TARGET}x; push and pull {MIB} MiB >= 4x ipyparallel and >= 2 GB/s "
                 "aggregate"
                 + (f"   [now: {'; '.join(now)}]" if now else ""))
    if res["errors"]:
        lines.append("")
        lines.append("errors during the run:")
        lines += [f"  - {e}" for e in res["errors"]]
    print("\n".join(lines), flush=True)

    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
        print(f"\nraw figures written to {a.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.exit(130)
