#!/usr/bin/env python3
"""Faults across hosts with host agents: a killed, a stopped and a
GIL-holding remote rank, a lost host with and without a spare host.

    sudo .venv/bin/python benchmarks/hostfaults.py [--repeat 3] [--quick] [--only kill,stop,gil,lost_spare,lost]
                                              [--gil-seconds 30] [--json out.json]

Network namespaces stand for hosts (tests/engines.py, as in
tests/test_netns_hosts.py): the controller in one, 4 CPU ranks on two
others (2 each) through their host agents (the ssh launcher with
``MONARCH_NB_SSH="ip netns exec {host} sh -c"``), bound to the controller
namespace's address, ``master_addr`` host A's. Each figure is the median
(min-max) of ``--repeat`` trials, one fresh mesh per trial:

1. remote kill: once each agent holds a warm spare (a ``monarch_nb.worker``
   child of the agent whose log says ``config.SPARE_WAITING``),
   ``mesh.kill(3)`` on an idle mesh, until an all_reduce answers on all 4
   ranks; whether rank 3's new incarnation came from a spare.
2. remote SIGSTOP: ``os.kill(pid of rank 1, SIGSTOP)`` (the namespaces
   share the pid namespace), until rank 1 is replaced and the all_reduce
   answers on all ranks (spares warm first, as in 1).
3. remote GIL hold: rank 1 runs ``ctypes.PyDLL(None).sleep(S)`` (a C call
   that keeps the GIL: no heartbeat for S s; ``--gil-seconds``, 30 as in
   the issue); whether rank 1 survived
   (incarnation after the call) and a ``busy_silent`` event was recorded.
4. lost host with a spare host (a 4th namespace, ``spare_hosts=``,
   ``host_timeout=3``): every process of host B's namespace killed and the
   namespace deleted (as tests/test_netns_hosts.py does), until all 4 ranks
   answer the all_reduce again (ranks 2, 3 on the spare host). Fresh
   namespaces per trial.
5. lost host without a spare: the same loss while a loop of all_reduce
   calls runs (``block=False``); seconds until that call ends with an error
   naming the lost host, and until ``mesh.status()`` shows ranks 2, 3 lost.

Times of 4 and 5 run from the moment the benchmark starts killing the
host's processes (wall clock, the same machine). Needs root (ip netns).
No assertions: figures only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

DRIVER = """
    import json, os, signal, sys, time
    import psutil
    from monarch_nb import Mesh
    from monarch_nb.config import SPARE_WAITING

    fig, hosts, spare, master, bind, gil_s = sys.argv[1:7]
    os.environ["MONARCH_NB_SSH"] = "ip netns exec {host} sh -c"
    ALL_REDUCE = "x = torch.ones(1)\\ndist.all_reduce(x)\\nx.item()"
    LOOP = ("import time\\nfor _ in range(100000):\\n"
            "    x = torch.ones(1)\\n    dist.all_reduce(x)\\n    time.sleep(0.01)")

    def cmd(p):
        try:
            return p.cmdline()
        except psutil.Error:
            return []

    def agents():
        return [p for p in psutil.Process().children(recursive=True)
                if "monarch_nb.agent" in cmd(p)]

    def spare_waits(agent, ranks):
        try:
            kids = [c for c in agent.children() if "monarch_nb.worker" in cmd(c)]
        except psutil.Error:
            return False
        for c in kids:
            if c.pid in ranks:
                continue
            try:
                with open(os.readlink(f"/proc/{c.pid}/fd/1"), "rb") as log:
                    if SPARE_WAITING.encode() in log.read(4096):
                        return True
            except OSError:
                pass
        return False

    def wait(cond, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.05)
        raise TimeoutError(what)

    def warm_spares(mesh):
        pids = set(mesh.run(os.getpid).values())
        wait(lambda: len(agents()) == 2 and all(spare_waits(a, pids) for a in agents()),
             120, "a warm spare on each host")

    def started(mesh, rank):
        return [e for e in mesh.events if e["rank"] == rank and e["kind"] == "started"][-1]

    def where():  # this rank's addresses: which namespace it runs in
        import psutil
        return sorted(a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                      if a.family == 2 and not a.address.startswith("127."))

    def summed(res):
        return {str(k): v for k, v in res.items()}

    opts = dict(spare_hosts=spare, host_timeout=3) if spare else {}
    mesh = Mesh.start(n=4, backend="cpu", launcher="ssh", hosts=hosts, bind=bind,
                      master_addr=master, start_timeout=120, **opts)
    out = {"fig": fig}
    try:
        mesh.exec("import torch, torch.distributed as dist", setup=True)
        mesh.exec(ALL_REDUCE, timeout=60)
        if fig == "kill":
            warm_spares(mesh)
            t, wall = time.monotonic(), time.time()
            mesh.kill(3)
            out["kill_returned_s"] = time.monotonic() - t
            out["sum"] = summed(mesh.exec(ALL_REDUCE, timeout=90))
            out["s"] = time.monotonic() - t
            out["timeline"] = [(round(e["time"] - wall, 3), e["rank"], e["kind"])
                               for e in mesh.events if e["time"] >= wall]
            out["from_spare"] = "from a spare" in started(mesh, 3)["detail"]
            out["detail"] = started(mesh, 3)["detail"]
        elif fig == "stop":
            warm_spares(mesh)
            pid = mesh.run(os.getpid)[1]
            t = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            wait(lambda: mesh.status()[1]["incarnation"] >= 1
                 and mesh.status()[1]["state"] == "ready", 90, "rank 1 replaced")
            out["replaced_s"] = time.monotonic() - t
            out["sum"] = summed(mesh.exec(ALL_REDUCE, timeout=90))
            out["s"] = time.monotonic() - t
            out["died"] = [e["detail"] for e in mesh.events
                           if e["rank"] == 1 and e["kind"] == "died"]
            out["from_spare"] = "from a spare" in started(mesh, 1)["detail"]
        elif fig == "gil":
            t = time.monotonic()
            try:
                mesh.ranks(1).exec(f"import ctypes\\nctypes.PyDLL(None).sleep({gil_s})",
                                   timeout=float(gil_s) + 60)
                out["error"] = ""
            except Exception as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
            out["s"] = time.monotonic() - t
            time.sleep(1.0)  # a kill would be seen by now
            out["incarnation"] = mesh.status()[1]["incarnation"]
            out["busy_silent"] = [e["detail"] for e in mesh.events
                                  if e["rank"] == 1 and e["kind"] == "busy_silent"]
            out["died"] = [e["detail"] for e in mesh.events
                           if e["rank"] == 1 and e["kind"] == "died"]
            out["sum"] = summed(mesh.exec(ALL_REDUCE, timeout=90))
        elif fig == "lost_spare":
            print("READY", flush=True)
            t0 = float(sys.stdin.readline())  # time.time() when the host began to go
            wait(lambda: all(r["state"] == "ready" and r["incarnation"] >= 1
                             for r in mesh.status()[2:]), 120, "ranks 2,3 on the spare")
            out["back_s"] = time.time() - t0
            out["sum"] = summed(mesh.exec(ALL_REDUCE, timeout=90))
            out["s"] = time.time() - t0
            out["addrs"] = {str(k): v for k, v in mesh.run(where).items()}
            out["timeline"] = [(round(e["time"] - t0, 3), e["rank"], e["kind"])
                               for e in mesh.events if e["time"] >= t0]
            out["died"] = [e["detail"] for e in mesh.events if e["kind"] == "died"]
        elif fig == "lost":
            fut = mesh.exec(LOOP, block=False)
            time.sleep(1.0)  # the loop runs
            print("READY", flush=True)
            t0 = float(sys.stdin.readline())
            try:
                fut.result(timeout=120)
                out["error"] = ""
            except Exception as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
            out["s"] = time.time() - t0
            out["names_host"] = f"host {hosts.split(',')[1]} lost" in out["error"]
            wait(lambda: [r["state"] for r in mesh.status()][2:] == ["lost", "lost"], 60,
                 "ranks 2,3 lost")
            out["lost_s"] = time.time() - t0
            out["states"] = [r["state"] for r in mesh.status()]
            out["died"] = [e["detail"] for e in mesh.events if e["kind"] == "died"]
            out["restarts"] = [r["restarts"] for r in mesh.status()]
    finally:
        mesh.stop()
    print("RESULT " + json.dumps(out, default=str), flush=True)
"""


def run_trial(hosts: Any, fig: str, folder: str, gil_s: int = 30) -> dict[str, Any]:
    """One fresh mesh in the controller namespace (``hosts.names[0]``),
    ranks on names[1], names[2]; names[3] the spare host for lost_spare."""
    from tests.engines import lose_host  # the tests' own: its processes, then its network

    driver = Path(folder, "driver.py")
    driver.write_text(textwrap.dedent(DRIVER))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    errfile = open(Path(folder, f"{fig}.err"), "w+")  # not a pipe: read after the end
    a, b = hosts.names[1], hosts.names[2]
    spare = hosts.names[3] if fig == "lost_spare" else ""
    spare_addr = hosts.addrs[3] if fig == "lost_spare" else ""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", hosts.names[0], sys.executable, str(driver), fig, f"{a},{b}",
         spare, hosts.addrs[1], hosts.addrs[0], str(gil_s)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errfile, text=True,
        env=env, cwd=folder)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        if fig in ("lost", "lost_spare"):
            line = ""
            for line in proc.stdout:
                if line.startswith("READY"):
                    break
            if not line.startswith("READY"):
                proc.wait(60)
                errfile.seek(0)
                raise RuntimeError(f"{fig}: the mesh did not start:\n{errfile.read()[-4000:]}")
            t0 = time.time()
            lose_host(b)
            proc.stdin.write(f"{t0!r}\n")
            proc.stdin.flush()
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        errfile.seek(0)
        err = errfile.read()
        errfile.close()
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{fig} trial failed ({proc.returncode}):\n{out}\n{err[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    if spare_addr:  # ranks 2, 3 run on the spare host's address now
        result["on_spare"] = [result["addrs"].get(r) == [spare_addr] for r in ("2", "3")]
    return result


def _span(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one trial per figure")
    p.add_argument("--only", default="kill,stop,gil,lost_spare,lost",
                   help="figures to run, comma-separated (default: all)")
    p.add_argument("--gil-seconds", type=int, default=30,
                   help="how long rank 1 holds the GIL in the gil figure (the issue's 30 s)")
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    if os.geteuid() != 0:
        print("hostfaults.py needs root (ip netns)", file=sys.stderr)
        return 2
    from tests.engines import netns_hosts

    # a SIGTERM (timeout, pkill) unwinds like an error: every finally runs,
    # so the trial's mesh stops and its namespaces are removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    repeat = 1 if ns.quick else ns.repeat
    figs = [f for f in ns.only.split(",") if f]
    results: dict[str, list[dict[str, Any]]] = {f: [] for f in figs}
    with tempfile.TemporaryDirectory() as folder:
        same = [f for f in figs if f in ("kill", "stop", "gil")]
        if same:  # nothing is lost: one set of namespaces for these
            with netns_hosts(3) as hosts:
                for i in range(repeat):
                    for fig in same:
                        print(f"trial {i + 1}: {fig} ...", file=sys.stderr, flush=True)
                        results[fig].append(run_trial(hosts, fig, folder, ns.gil_seconds))
        for fig in (f for f in figs if f in ("lost_spare", "lost")):
            for i in range(repeat):  # the lost namespace is gone: a fresh set each time
                print(f"trial {i + 1}: {fig} ...", file=sys.stderr, flush=True)
                with netns_hosts(4 if fig == "lost_spare" else 3) as hosts:
                    results[fig].append(run_trial(hosts, fig, folder))

    rows = []
    if "kill" in results:
        r = results["kill"]
        spare = sum(x["from_spare"] for x in r)
        rows.append(("remote kill (`mesh.kill(3)`) until the all_reduce answers on 4 ranks",
                     "1.34 s", f"{_span([x['s'] for x in r])}; from a spare {spare}/{len(r)}"))
    if "stop" in results:
        r = results["stop"]
        rows.append(("remote SIGSTOP of rank 1 until replaced and the all_reduce answers",
                     "3.9 s", f"{_span([x['s'] for x in r])} (replaced in "
                     f"{statistics.median(x['replaced_s'] for x in r):.2f} s); died as: "
                     f"{r[-1]['died'][-1] if r[-1]['died'] else '?'}"))
    if "gil" in results:
        r = results["gil"]
        kept = sum(x["incarnation"] == 0 and not x["error"] for x in r)
        busy = sum(bool(x["busy_silent"]) for x in r)
        rows.append((f"remote GIL hold {ns.gil_seconds} s on rank 1 "
                     f"(`ctypes.PyDLL(None).sleep({ns.gil_seconds})`)",
                     "killed as \"frozen or hung host\"",
                     f"not killed {kept}/{len(r)}, busy_silent event {busy}/{len(r)}; call took "
                     f"{_span([x['s'] for x in r])}"))
    if "lost_spare" in results:
        r = results["lost_spare"]
        moved = sum(all(x["on_spare"]) for x in r)
        rows.append(("lost host, spare host given (`host_timeout=3`): until 4 ranks answer",
                     "respawned onto the dead host again and again; no spare",
                     f"{_span([x['s'] for x in r])} (ranks 2,3 ready in "
                     f"{statistics.median(x['back_s'] for x in r):.2f} s); ranks 2,3 on the "
                     f"spare host's address {moved}/{len(r)}"))
    if "lost" in results:
        r = results["lost"]
        named = sum(x["names_host"] for x in r)
        rows.append(("lost host, no spare: a running all_reduce loop ends with an error",
                     "six deaths in 7 s, 'rank 3 died 6 times'",
                     f"{_span([x['s'] for x in r])}, error names the lost host {named}/{len(r)}; "
                     f"ranks 2,3 \"lost\" in {statistics.median(x['lost_s'] for x in r):.2f} s, "
                     f"restarts {r[-1]['restarts']}"))
    print("| figure | before host agents | after (median, min-max) |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n{repeat} trial(s) per figure, one fresh mesh each.")
    for fig, rs in results.items():
        for x in rs:
            extra = x.get("error") or x.get("detail") or ""
            if "timeline" in x:
                extra += (f"; kill() returned after {x['kill_returned_s']:.2f} s"
                          if "kill_returned_s" in x else "")
                extra += f"; events (s after the fault, rank, kind): {x['timeline']}"
            if extra:
                print(f"{fig}: {extra[:300]}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
