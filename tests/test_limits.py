"""The machine's limits (procs/limits.py): an open-file limit too low is
raised where allowed and refused with what to change where not; a nearly
full log directory earns a notice and the mesh still works, kills and
respawns included. Each case runs a mesh in its own process, under the
limit it is about."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from monarch_nb.procs import limits

SCRIPT = textwrap.dedent("""
    import resource, monarch_nb as mnb
    try:
        with mnb.Mesh.start({n}, backend="cpu") as m:
            print("limit", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            print(m.exec("for i in range({lines}): print('x' * 100)\\n'done'")[0])
            m.kill(1)
            print("after respawn", sorted(m.run(lambda: 1, timeout=60).values()))
    except mnb.UsageError as e:
        print("refused:", e)
""")


def run_mesh(n: int, lines: int = 0, soft: int | None = None, hard: int | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        if soft is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard if hard is not None else soft))

    return subprocess.run([sys.executable, "-c", SCRIPT.format(n=n, lines=lines)],
                          capture_output=True, text=True, timeout=180, preexec_fn=limit,
                          env={**os.environ, **(env or {})})


def test_files_needed_grows_with_the_mesh() -> None:
    assert limits.files_needed(4) < limits.files_needed(64) < limits.files_needed(1024)


def test_a_low_soft_limit_is_raised_for_the_mesh() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < limits.files_needed(4):
        pytest.skip(f"this machine's own hard limit ({hard}) is below a 4-rank mesh's need")
    # 30 is below what 4 ranks need (gloo failed with "Too many open files" here)
    r = run_mesh(4, soft=30, hard=hard)
    assert "refused" not in r.stdout, r.stdout + r.stderr
    assert "done" in r.stdout and "after respawn [1, 1, 1, 1]" in r.stdout, r.stdout + r.stderr
    raised = int(r.stdout.split("limit ", 1)[1].split()[0])
    assert raised >= limits.files_needed(4)


def test_a_hard_limit_too_low_is_refused_with_what_to_change() -> None:
    r = run_mesh(4, soft=30, hard=40)
    assert "refused: the open-file limit is 40 (ulimit -n, hard), and a mesh of 4 ranks needs " \
           "about" in r.stdout, r.stdout + r.stderr
    assert "ulimit -n" in r.stdout and "or start fewer ranks" in r.stdout


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small tmpfs needs root")
def test_a_nearly_full_log_directory_earns_a_notice_and_the_mesh_works() -> None:
    where = tempfile.mkdtemp(prefix="mnb-small-")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", where]).returncode:
        os.rmdir(where)
        pytest.skip("cannot mount a tmpfs here")
    try:
        with open(os.path.join(where, "fill"), "wb") as f:
            f.write(b"\0" * (900 << 10))  # ~120 KiB left: less than the output below
        r = run_mesh(2, lines=2000, env={"TMPDIR": where})
        assert "KiB free for the ranks' logs in " + where in r.stderr, r.stderr
        assert "done" in r.stdout and "after respawn [1, 1]" in r.stdout, r.stdout + r.stderr
        assert os.listdir(where) == ["fill"]  # the logs went with the mesh
    finally:
        subprocess.run(["umount", where])
        os.rmdir(where)


PORTS = textwrap.dedent("""
    import socket, monarch_nb as mnb
    held = []
    for port in range(40000, 40006):  # the whole local port range of this namespace
        s = socket.socket()
        s.bind(("127.0.0.1", port))
        s.listen()
        held.append(s)
    try:
        mnb.Mesh.start(2, backend="cpu", start_timeout=30).stop()
        print("started")
    except mnb.UsageError as e:
        print("refused:", e)
""")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="network namespaces need root")
def test_an_exhausted_port_range_is_refused_with_what_to_change() -> None:
    ns = f"mnbports{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", ns]).returncode:
        pytest.skip("cannot create a network namespace here")
    try:
        for cmd in (["ip", "link", "set", "lo", "up"],
                    ["sysctl", "-qw", "net.ipv4.ip_local_port_range=40000 40005"]):
            subprocess.run(["ip", "netns", "exec", ns, *cmd], check=True)
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", PORTS],
                           capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["ip", "netns", "del", ns])
    assert ("refused: no free port for the controller on 127.0.0.1: every port of the local "
            "port range (40000-40005, net.ipv4.ip_local_port_range) is in use") in r.stdout, \
        r.stdout + r.stderr
    assert "widen the range" in r.stdout
