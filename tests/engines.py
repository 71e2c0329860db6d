"""Real engines for tests: network namespaces (simulated hosts), a packet
capture, and a single-machine SLURM cluster.

Each set-up either works or says why not: :func:`unavailable` skips the test
with the reason, except under CI (``CI=true``), where the environment is
supposed to be complete (.ci/run installs slurm-wlm, munge and tcpdump) and
the test fails instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest


def unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must provide this environment: {reason}")
    pytest.skip(reason)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=check)


# -- network namespaces -----------------------------------------------------------------------
@dataclass
class Hosts:
    """Namespaces ``names`` on one bridge; ``addrs[i]`` is namespace i's
    address, ``bridge_addr`` the controller's (root namespace)."""

    names: list[str]
    addrs: list[str]
    bridge: str
    bridge_addr: str
    links: list[str] = field(default_factory=list)  # namespace i's veth end on the bridge


_netns_count = itertools.count()


# Held while a set of namespaces exists: the suite runs in two processes
# (pytest-xdist), and two sets at once could pick the same subnet.
_NETNS_LOCK = "/run/lock/monarch-nb-tests-netns.lock"


@contextlib.contextmanager
def steady_network() -> Iterator[None]:
    """Held (shared) by a test that drives chromium: no set of namespaces is
    made or removed meanwhile (netns_hosts holds the same lock exclusively).
    Chromium cancels its requests with ERR_NETWORK_CHANGED when an address
    or a link of its network changes, as the bridge's and the veth pairs' in
    the root namespace do (CI once saw JupyterLab's page load fail so while
    the other worker ran the netns tests). Perfetto's engine page
    (perfetto_wasm.py) goes without it: a few seconds of loading, under a
    test timeout that a wait for a netns module would use up."""
    try:
        os.makedirs(os.path.dirname(_NETNS_LOCK), exist_ok=True)
        lock = open(_NETNS_LOCK, "a")
    except OSError:  # not root: no namespaces are made here either
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # released when the file closes
        yield


@contextlib.contextmanager
def netns_hosts(count: int = 2) -> Iterator[Hosts]:
    if os.geteuid() != 0:
        unavailable("network namespaces need root")
    if shutil.which("ip") is None:
        unavailable("the ip command (iproute2) is missing")
    os.makedirs(os.path.dirname(_NETNS_LOCK), exist_ok=True)
    with open(_NETNS_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        with _netns_hosts(count) as hosts:
            yield hosts


@contextlib.contextmanager
def _netns_hosts(count: int) -> Iterator[Hosts]:
    n = next(_netns_count)  # several sets in one process never collide
    tag = f"m{os.getpid() % 100000}{n}"
    subnet = f"10.{200 + (os.getpid() + n) % 50}.{os.getpid() % 250}"
    bridge = f"{tag}br"
    names = [f"{tag}ns{i}" for i in range(count)]
    hosts = Hosts(names, [f"{subnet}.{11 + i}" for i in range(count)], bridge, f"{subnet}.1",
                  [f"{tag}x{i}" for i in range(count)])
    made_ns: list[str] = []
    made_links: list[str] = []
    try:
        try:
            _run("ip", "link", "add", bridge, "type", "bridge")
            made_links.append(bridge)
            _run("ip", "addr", "add", f"{hosts.bridge_addr}/24", "dev", bridge)
            _run("ip", "link", "set", bridge, "up")
            for i, ns in enumerate(names):
                outer, inner = f"{tag}x{i}", f"{tag}y{i}"
                _run("ip", "netns", "add", ns)
                made_ns.append(ns)
                _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
                made_links.append(outer)
                _run("ip", "link", "set", outer, "master", bridge)
                _run("ip", "link", "set", outer, "up")
                _run("ip", "link", "set", inner, "netns", ns)
                _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{hosts.addrs[i]}/24",
                     "dev", inner)
                _run("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
                _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, OSError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            unavailable(f"cannot create network namespaces here: {detail.strip()}")
        yield hosts
    finally:
        for ns in made_ns:
            _run("ip", "netns", "del", ns, check=False)
        for link in made_links:
            _run("ip", "link", "del", link, check=False)


def pids_in(ns: str) -> list[int]:
    """The processes in namespace ``ns`` (the namespaces share the pid namespace)."""
    res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(p) for p in res.stdout.split()]


def lose_host(ns: str) -> None:
    """The host goes, as on a real cluster: every process in its namespace
    killed, then its network removed (and a killed agent's folder, which a
    real lost host takes along)."""
    victims = pids_in(ns)
    assert victims, f"nothing runs on host {ns}"
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", ns], check=True, timeout=30)
    for pid in victims:
        for folder in Path("/tmp").glob(f"monarch-nb-agent-{pid}-*"):
            shutil.rmtree(folder, ignore_errors=True)


# The elastic world size across hosts, shrink then grow, driven step by step
# (tests/test_netns_hosts.py, benchmarks/elastic.py). Run in the controller's
# namespace: ``python driver.py HOSTS ADD ADD_IDLE MASTER BIND HOST_TIMEOUT``.
# 4 CPU ranks on HOSTS (2 each), ``min_ranks=2``, an elastic training cell:
# READY -> (the parent loses the second host, writes the time) -> the group
# shrinks, 5 steps at world size 2, ``add_hosts(ADD)`` -> the cell goes on
# until 20 steps at world size 4 after the grow -> IDLE -> (the parent loses
# ADD, writes the time) -> shrunk with no call running, ``add_hosts(ADD_IDLE)``,
# until all 4 ranks are ready, then the cell's set-up on them (with the wait,
# the cold start of the added ranks), a call at world size 4 -> RESULT {json}.
# Times are wall clock (one machine).
GROW_DRIVER = '''
    import json, os, sys, time
    from monarch_nb import Mesh
    from monarch_nb.ui.status import format_status

    hosts, add, add_idle, master, bind, host_timeout = sys.argv[1:7]
    os.environ["MONARCH_NB_SSH"] = "ip netns exec {host} sh -c"
    SETUP = """
    import hashlib, time, torch, torch.distributed as dist, monarch_nb as mnb
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = mnb.elastic.State(model=model, optimizer=opt, step=0, small=0, after=0)
    sizes = []  # (world size, wall time of its first step), each time it changes
    """
    TRAIN = SETUP + """
    @mnb.elastic.run(state)
    def train(state):
        while state.after < 20 and state.step < 100000:
            opt.zero_grad()
            model(torch.ones(8, 4) * (mnb.rank() + 1)).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            world = dist.get_world_size()
            state.step += 1
            if world < 4:
                state.small += 1
            elif state.small:
                state.after += 1
            state.commit()
            if not sizes or sizes[-1][0] != world:
                sizes.append((world, time.time()))
            mnb.log(step=state.step, small=state.small)
            time.sleep(0.05)
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                         for p in model.parameters())).hexdigest()
        return {"hash": digest, "step": state.step, "rank": mnb.rank(),
                "world": mnb.world_size(), "sizes": sizes}

    train()
    """

    def numbers():
        import monarch_nb as mnb
        return mnb.mesh_rank(), mnb.rank(), mnb.world_size()

    def until(cond, what, timeout=180):
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            time.sleep(0.02)

    mesh = Mesh.start(n=4, backend="cpu", launcher="ssh", hosts=hosts, bind=bind,
                      master_addr=master, start_timeout=120, host_timeout=float(host_timeout),
                      min_ranks=2)
    out = {}
    try:
        future = mesh.exec(TRAIN, elastic=True, block=False)
        until(lambda: min(r["step"] or 0 for r in mesh.status()) >= 5, "the loop to run")
        assert not future.done(), future.result()
        print("READY", flush=True)
        out["lost_at"] = float(sys.stdin.readline())  # the host is gone now
        until(lambda: mesh.group == (0, 1), "the group to shrink")
        out["shrunk_status"] = format_status(mesh)
        until(lambda: mesh.metrics.last(0).get("small", 0) >= 5, "5 steps at world size 2")
        out["add_at"] = time.time()
        mesh.add_hosts(add)
        got = future.result(timeout=300)
        out["lost"] = list(got.lost)
        out["results"] = dict(got.items())
        out["group"] = list(mesh.group)
        out["torch_ranks"] = [r["torch_rank"] for r in mesh.status()]
        out["events"] = [(e["kind"], e["rank"], e["detail"]) for e in mesh.events
                         if e["kind"] in ("shrunk", "grown", "rejoined")]
        out["grown_status"] = format_status(mesh)
        out["timeline"] = [(round(e["time"] - out["add_at"], 2), e["rank"], e["kind"])
                           for e in mesh.events if e["time"] >= out["add_at"]]
        print("IDLE", flush=True)
        out["lost_idle_at"] = float(sys.stdin.readline())
        until(lambda: mesh.group == (0, 1), "the group to shrink (idle)")
        out["add_idle_at"] = time.time()
        mesh.add_hosts(add_idle)
        until(lambda: all(r["state"] == "ready" for r in mesh.status()), "ranks 2,3 back (idle)")
        out["ready_idle_at"] = time.time()
        # what a new process of the cell does before its first step: the
        # cell's set-up (its first optimizer imports torch._dynamo, ...)
        mesh.ranks("2,3").exec(SETUP, timeout=120)
        out["setup_s"] = time.time() - out["ready_idle_at"]
        out["next"] = mesh.run(numbers, timeout=60)
        out["sum"] = mesh.exec("import torch, torch.distributed as dist\\n"
                               "x = torch.ones(1)\\ndist.all_reduce(x)\\nx.item()", timeout=60)
    finally:
        mesh.stop()
    print("RESULT " + json.dumps(out, default=str), flush=True)
'''


def run_grow_driver(hosts: Hosts, folder: Path, root: Path, *, host: int, add: int,
                    add_idle: int, host_timeout: float = 3.0) -> dict[str, Any]:
    """:data:`GROW_DRIVER` on namespaces ``hosts.names``: the controller in
    names[0], ranks on names[1] and names[``host``] (lost mid-cell); hosts
    names[``add``] (given mid-cell, lost later with no call running) and
    names[``add_idle``] (given then). Its RESULT; stops nothing of its own."""
    driver = folder / "grow_driver.py"
    driver.write_text(textwrap.dedent(GROW_DRIVER))
    names = hosts.names
    errfile = open(folder / "grow_driver.err", "w+")  # not a pipe: read after the end
    proc = subprocess.Popen(
        ["ip", "netns", "exec", names[0], sys.executable, str(driver), f"{names[1]},{names[host]}",
         names[add], names[add_idle], hosts.addrs[1], hosts.addrs[0], f"{host_timeout:g}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errfile, text=True,
        env=dict(os.environ, PYTHONPATH=str(root)), cwd=folder)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        for mark, victim in (("READY", names[host]), ("IDLE", names[add])):
            line = ""
            for line in proc.stdout:
                if line.startswith(mark):
                    break
            if not line.startswith(mark):
                proc.wait(60)
                errfile.seek(0)
                raise AssertionError(f"the driver did not reach {mark}:\n{errfile.read()[-4000:]}")
            lost_at = time.time()
            lose_host(victim)
            proc.stdin.write(f"{lost_at!r}\n")
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
    if not lines:
        raise AssertionError(f"the driver failed ({proc.returncode}):\n{out}\n{err[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    return result


@contextlib.contextmanager
def capture(interface: str, path: Path) -> Iterator[Path]:
    """tcpdump on ``interface`` into ``path`` for the duration of the block."""
    if shutil.which("tcpdump") is None:
        unavailable("tcpdump is not installed (apt-get install tcpdump)")
    proc = subprocess.Popen(["tcpdump", "-i", interface, "-U", "-n", "-s", "0", "-Z", "root",
                             "-w", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # armed once it says "listening on ..." (on stderr)
        first = proc.stderr.readline().decode() if proc.stderr else ""
        if proc.poll() is not None or "listening" not in first:
            rest = proc.stderr.read().decode() if proc.stderr and proc.poll() is not None else ""
            unavailable(f"tcpdump could not capture on {interface}: {first.strip()} {rest.strip()}")
        time.sleep(0.5)
        yield path
    finally:
        time.sleep(1.0)  # let the last packets be written (-U: per packet)
        _end(proc, signal.SIGINT)  # tcpdump writes out what it captured


def _end(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Stop a daemon the fixtures started: ``sig``, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stderr:
        proc.stderr.close()


# -- SLURM -------------------------------------------------------------------------------------
SLURM_CONF = """\
ClusterName=mnbtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.%n.pid
SlurmdSpoolDir={d}/spool.%n
StateSaveLocation={d}/state
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.%n.log
SchedulerType=sched/backfill
InactiveLimit=0
KillWait=5
MinJobAge=5
{nodes}
PartitionName=main Nodes={node_names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


@dataclass
class Slurm:
    conf: str
    env: dict[str, str]
    nodes: list[str]
    folder: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_pid_files(paths: list[str]) -> None:
    """SIGTERM every daemon at once, then wait for all of them (each takes a
    few seconds to save its state; one after the other they took ~9 s)."""
    pids = []
    for path in paths:
        try:
            pid = int(Path(path).read_text().strip())
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            continue
        pids.append(pid)
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _exists(pid)]
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def slurm_cluster(nodes: int = 2) -> Iterator[Slurm]:
    """munged + slurmctld + ``nodes`` slurmd daemons on this machine (one
    ``NodeName`` each, all at 127.0.0.1 on their own ports), stopped by
    their pid files afterwards."""
    if os.geteuid() != 0:
        unavailable("the SLURM fixture runs daemons as root")
    for tool in ("munged", "slurmctld", "slurmd", "srun", "salloc", "scontrol", "sinfo"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is missing (apt-get install slurm-wlm munge)")
    folder = tempfile.mkdtemp(prefix="mnb-slurm-")
    os.chmod(folder, 0o755)
    host = socket.gethostname().split(".")[0]
    probe = _run("slurmd", "-C", check=False).stdout.splitlines()
    spec = probe[0].split(None, 1)[1] if probe and probe[0].startswith("NodeName=") else "CPUs=2"
    # drop the host name from `slurmd -C`'s line, keep CPUs/Boards/Sockets/...
    spec = " ".join(p for p in spec.split() if not p.startswith("NodeName="))
    names = [f"n{i + 1}" for i in range(nodes)]
    node_lines = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} {spec}"
        for n in names)
    conf = os.path.join(folder, "slurm.conf")
    Path(conf).write_text(SLURM_CONF.format(host=host, ctld_port=_free_port(), d=folder,
                                            nodes=node_lines, node_names=",".join(names)))
    os.makedirs(os.path.join(folder, "state"))
    env = {**os.environ, "SLURM_CONF": conf}
    pid_files = []
    try:
        # munged as the munge user (as root it refuses: "logfile is insecure");
        # the default socket path /run/munge is what slurm's auth/munge uses.
        os.makedirs("/run/munge", exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        munge_pid = "/run/munge/munged.pid"
        if not _alive(munge_pid):
            res = _run("runuser", "-u", "munge", "--", "munged", check=False)
            if res.returncode != 0:
                unavailable(f"munged did not start: {res.stderr.strip()}")
            pid_files.append(munge_pid)
        res = subprocess.run(["slurmctld"], env=env, capture_output=True, text=True, timeout=30)
        pid_files.append(os.path.join(folder, "slurmctld.pid"))
        if res.returncode != 0:
            unavailable(f"slurmctld did not start: {res.stderr.strip()}")
        for n in names:
            res = subprocess.run(["slurmd", "-N", n], env=env, capture_output=True, text=True,
                                 timeout=30)
            pid_files.append(os.path.join(folder, f"slurmd.{n}.pid"))
            if res.returncode != 0:
                unavailable(f"slurmd -N {n} did not start: {res.stderr.strip()}")
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run(["sinfo", "-h", "-o", "%t %D"], env=env, capture_output=True,
                                 text=True, timeout=30).stdout.split()
            if out[:2] == ["idle", str(nodes)]:
                break
            if time.monotonic() > deadline:
                log = Path(folder, "slurmctld.log").read_text()[-2000:]
                unavailable(f"SLURM nodes not idle within 30 s (sinfo: {out}); log:\n{log}")
            time.sleep(0.2)
        yield Slurm(conf, env, names, folder)
    finally:
        _stop_pid_files(pid_files)
        shutil.rmtree(folder, ignore_errors=True)


def _alive(pid_file: str) -> bool:
    try:
        os.kill(int(Path(pid_file).read_text().strip()), 0)
        return True
    except (OSError, ValueError):
        return False


# -- sshd ----------------------------------------------------------------------------------------
@dataclass
class Sshd:
    """An sshd per namespace of ``hosts``; ``template`` is the ssh command
    (for MONARCH_NB_SSH) that logs in to them as root with a fresh key."""

    hosts: Hosts
    template: str


@contextlib.contextmanager
def sshd_in(hosts: Hosts, folder: str) -> Iterator[Sshd]:
    for tool in ("/usr/sbin/sshd", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is missing (apt-get install openssh-server openssh-client)")
    os.chmod(folder, 0o700)
    key = os.path.join(folder, "id")
    host_key = os.path.join(folder, "host_key")
    for path in (key, host_key):
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path)
    Path(folder, "authorized_keys").write_text(Path(key + ".pub").read_text())
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation directory
    procs = []
    try:
        for ns, addr in zip(hosts.names, hosts.addrs, strict=True):
            conf = Path(folder, f"sshd_{ns}.conf")
            conf.write_text(textwrap.dedent(f"""\
                ListenAddress {addr}
                Port 22
                HostKey {host_key}
                PermitRootLogin prohibit-password
                AuthorizedKeysFile {folder}/authorized_keys
                PasswordAuthentication no
                KbdInteractiveAuthentication no
                UsePAM no
                StrictModes no
                PidFile {folder}/sshd_{ns}.pid
                """))
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "/usr/sbin/sshd", "-D", "-e",
                                           "-f", str(conf)], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE))
        template = (f"ssh -T -i {key} -o BatchMode=yes -o StrictHostKeyChecking=no "
                    f"-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR root@{{host}}")
        deadline = time.monotonic() + 15
        for addr, proc in zip(hosts.addrs, procs, strict=True):
            while True:
                probe = subprocess.run([*template.replace("{host}", addr).split(), "true"],
                                       capture_output=True, text=True, timeout=30)
                if probe.returncode == 0:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode() if proc.poll() is not None and proc.stderr \
                        else probe.stderr
                    unavailable(f"sshd in a namespace is not reachable: {err.strip()}")
                time.sleep(0.2)
        yield Sshd(hosts, template)
    finally:
        # Each connection has its own sshd process ("sshd: root@notty"), a
        # child of the daemon, reparented to init when the daemon ends. One
        # whose client is cut off (a partition test) would wait for its peer
        # for ever, holding a removed namespace: ended here with the daemons.
        sessions = []
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                sessions += psutil.Process(proc.pid).children(recursive=True)
        for proc in procs:
            _end(proc, signal.SIGTERM)
        for session in sessions:
            with contextlib.suppress(psutil.Error):
                session.kill()
        psutil.wait_procs(sessions, timeout=10)
