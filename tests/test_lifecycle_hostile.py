"""Kernel lifecycle at its worst moments, and meshes that must not hear each other.

tests/test_kernel_lifecycle.py ends an *idle* kernel every way there is. This
file ends a kernel ("Restart kernel", "Shut down kernel" through
jupyter_client, as JupyterLab's menu does) while it is busy:

* while a cell runs on the mesh (the ranks are inside user code), and
* while ``%monarch push big`` of a ~200 MB NumPy array is in flight,

and checks what the user would: every rank process is gone within 5 s, no
file the mesh left behind holds its key, and (after a restart) a new mesh
starts in the new kernel and runs a cell.

Isolation: two meshes in one process (Python API), and two kernels on one
machine, each with its own mesh. A message signed with one mesh's key is
dropped, and counted, by the other mesh's controller *and* by its rank
process (delivered through that mesh's own ROUTER, the only way in to a
rank), and a call replayed across meshes never runs.
"""

from __future__ import annotations

import ast
import contextlib
import os
import pathlib
import queue
import signal
import tempfile
import time
from collections.abc import Callable, Iterator

import psutil
import pytest
import zmq

from monarch_nb import Mesh
from monarch_nb.wire import serialize
from monarch_nb.wire.protocol import Codec, Kind

from .conftest import wait_for, worker_pids
from .kernel_util import KernelSession

ORPHAN_LIMIT_S = 5.0
MAGICS = "get_ipython().find_magic('monarch').__self__"
PUSH_MB = 200


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def files_holding(secret: bytes, since: float, root: str | None = None) -> list[str]:
    """Files under the temp directory changed since ``since`` whose first
    MiB contains ``secret`` (a key file, a log that printed the key...)."""
    hits = []
    for dirpath, _dirs, files in os.walk(root or tempfile.gettempdir()):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
                if st.st_mtime < since or not os.path.isfile(path):
                    continue
                with open(path, "rb") as f:
                    if secret in f.read(1 << 20):
                        hits.append(path)
            except OSError:
                continue
    return hits


def wait_iopub_text(ks: KernelSession, msg_id: str, text: str, timeout: float = 60) -> None:
    """Wait until cell ``msg_id`` has printed ``text`` (the cell is past that point)."""
    seen = ""
    deadline = time.monotonic() + timeout
    while text not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"cell never printed {text!r}; got {seen!r}")
        try:
            msg = ks.kc.get_iopub_msg(timeout=left)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            seen += msg["content"]["text"]
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "error":
            pytest.fail(f"cell failed: {msg['content']}")


def start_mesh(ks: KernelSession, n: int) -> dict[str, object]:
    """Load the extension, start ``n`` CPU ranks; their pids, log dir and key."""
    r = ks.run("%load_ext monarch_nb")
    assert r.status == "ok", r
    r = ks.run(f"%monarch start -n {n} --backend cpu --no-dashboard", timeout=180)
    assert r.status == "ok" and r.error is None, r.traceback or r
    r = ks.run(f"_m = {MAGICS}.mesh\n"
               "print(repr({'pids': [r['pid'] for r in _m.status()], "
               "'log_dir': _m._ctl.supervisor.log_dir, 'key': _m._ctl.key.hex(), "
               "'endpoint': _m._ctl.io.endpoint}))")
    assert r.status == "ok", r
    info: dict[str, object] = ast.literal_eval(r.stdout.strip())
    pids = info["pids"]
    assert isinstance(pids, list) and len(pids) == n and set(pids) <= worker_pids()
    return info


@contextlib.contextmanager
def kernel() -> Iterator[KernelSession]:
    ks = KernelSession()
    try:
        yield ks
    finally:
        ks.end()


def _busy_cell(ks: KernelSession) -> str:
    """A cell running on every rank (inside user code) until interrupted."""
    msg_id = ks.execute("%%monarch\nimport time\nprint('running', flush=True)\n"
                        "for _ in range(3000):\n    time.sleep(0.1)\n")
    wait_iopub_text(ks, msg_id, "running")
    return msg_id


def _push_in_flight(ks: KernelSession) -> str:
    """``%monarch push big`` of ~200 MB, caught after it started."""
    r = ks.run(f"import numpy as np\nbig = np.ones({PUSH_MB} << 17)  # {PUSH_MB} MB of float64")
    assert r.status == "ok", r
    msg_id = ks.execute("print('pushing', flush=True)\n%monarch push big")
    wait_iopub_text(ks, msg_id, "pushing")
    return msg_id


def _restart(ks: KernelSession) -> None:
    ks.km.restart_kernel(now=False)


def _shutdown(ks: KernelSession) -> None:
    ks.km.shutdown_kernel(now=False)


@pytest.mark.kernel
@pytest.mark.parametrize("busy", [_busy_cell, _push_in_flight], ids=["cell-running", "push-in-flight"])
@pytest.mark.parametrize("action", [_restart, _shutdown], ids=["restart", "shutdown"])
def test_kernel_ended_while_busy_leaves_no_rank_and_no_key(
        action: Callable[[KernelSession], None], busy: Callable[[KernelSession], str]) -> None:
    since = time.time() - 1
    with kernel() as ks:
        old_kernel = ks.pid
        info = start_mesh(ks, 2)
        pids = info["pids"]
        assert isinstance(pids, list)
        busy(ks)
        assert all(not gone(p) for p in pids), "a rank ended before the kernel did"
        t0 = time.monotonic()
        action(ks)
        took = time.monotonic() - t0
        wait_for(lambda: all(gone(p) for p in pids), timeout=ORPHAN_LIMIT_S,
                 what=f"ranks {pids} to end after {action.__name__} ({took:.1f} s)")
        assert took < 30, f"{action.__name__} took {took:.1f} s"
        # Nothing on disk holds the key: no key file (local ranks get it by
        # environment), and no log or leftover that printed it.
        key = str(info["key"]).encode()
        assert files_holding(key, since) == []
        # and the mesh's private log directory went with it (atexit: stop_all)
        wait_for(lambda: not os.path.exists(str(info["log_dir"])), timeout=ORPHAN_LIMIT_S,
                 what=f"the mesh's log directory {info['log_dir']} to be removed")
        if action is _shutdown:
            assert gone(old_kernel)
            return
        # The restarted kernel is a new process that starts a new mesh.
        ks.kc.wait_for_ready(timeout=60)
        assert ks.pid != old_kernel and gone(old_kernel)
        new = start_mesh(ks, 1)
        assert new["key"] != info["key"]
        r = ks.run("%%monarch\n6 * 7")
        assert r.status == "ok" and "42" in r.results[0], r
        r = ks.run("%monarch stop", timeout=60)
        assert r.status == "ok", r
        new_pids = new["pids"]
        assert isinstance(new_pids, list)
        wait_for(lambda: all(gone(p) for p in new_pids), timeout=ORPHAN_LIMIT_S,
                 what="the new mesh's ranks to end")


@pytest.mark.kernel
def test_a_kernel_sigtermed_while_busy_kills_its_ranks_and_removes_the_logs() -> None:
    """The kernel manager's escalation: a kernel that did not finish its
    shutdown in the manager's wait gets SIGTERM, which skips atexit. The
    ranks and the log directory go anyway, and the kernel still dies of
    the SIGTERM (its status says so)."""
    with kernel() as ks:
        info = start_mesh(ks, 2)
        pids = info["pids"]
        assert isinstance(pids, list)
        _busy_cell(ks)
        proc = ks.km.provisioner.process  # type: ignore[union-attr]
        os.kill(ks.pid, signal.SIGTERM)
        wait_for(lambda: proc.poll() is not None, timeout=ORPHAN_LIMIT_S, what="the kernel to end")
        assert proc.poll() == -signal.SIGTERM
        wait_for(lambda: all(gone(p) for p in pids), timeout=ORPHAN_LIMIT_S,
                 what=f"ranks {pids} to end with the kernel")
        assert not os.path.exists(str(info["log_dir"]))


# -- isolation ------------------------------------------------------------------------------
_RANK_DROPPED = ("import gc\nfrom monarch_nb.engine.loop import Worker\n"
                 "dict(next(o for o in gc.get_objects() if isinstance(o, Worker)).dropped)")


def rank_dropped(mesh: Mesh) -> dict[str, int]:
    return mesh.exec(_RANK_DROPPED)[0]


def _bump_frames(signer: Codec) -> list[bytes]:
    """A correctly signed CALL (under ``signer``'s key) that counts its runs."""

    def bump() -> None:
        import __main__
        __main__.cross_count = getattr(__main__, "cross_count", 0) + 1

    return [bytes(f) for f in signer.sign(Kind.CALL, serialize.dumps_call(bump, (), {}),
                                          call=2**41)]


def test_two_meshes_in_one_process_do_not_hear_each_other() -> None:
    a = Mesh.start(n=1, backend="cpu")
    try:
        b = Mesh.start(n=1, backend="cpu")
        try:
            assert a._ctl.key != b._ctl.key and a._ctl.io.endpoint != b._ctl.io.endpoint
            a.exec("secret = 'a'")
            assert b.exec("'secret' in globals()") == {0: False}
            # A's correctly signed call, delivered to B's rank over B's own
            # ROUTER (the only way in): dropped there, never run.
            frames = _bump_frames(a._ctl.codec)
            before = sum(rank_dropped(b).values())
            info, io_loop = b._ctl.ranks[0], b._ctl.io
            for ident in (info.main_id, info.ctl_id):
                io_loop.call_soon(lambda ident=ident: io_loop.send(ident, frames))
            wait_for(lambda: sum(rank_dropped(b).values()) >= before + 2,
                     what="B's rank to drop A's messages")
            assert rank_dropped(b).get("bad-signature", 0) >= 2
            assert b.exec("globals().get('cross_count', 0)") == {0: 0}
            # The same call delivered to A's rank runs (the frames are live).
            a_info, a_io = a._ctl.ranks[0], a._ctl.io
            a_io.call_soon(lambda: a_io.send(a_info.main_id, frames))
            wait_for(lambda: a.exec("globals().get('cross_count', 0)") == {0: 1},
                     what="A's rank to run its own call")
            # A's rank's heartbeat, sent to B's controller from a socket that
            # claims A's rank identity: dropped and counted by B.
            ctx = zmq.Context()
            try:
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.IDENTITY, a_info.ctl_id)
                s.connect(b._ctl.io.endpoint)
                before_b = dict(b.dropped)
                s.send_multipart(Codec(a._ctl.key, a_info.ctl_id.decode()).sign(
                    Kind.HEARTBEAT, meta={"busy": 0}))
                wait_for(lambda: b.dropped.get("bad-signature", 0)
                         > before_b.get("bad-signature", 0), what="B to drop A's heartbeat")
                s.close(linger=0)
            finally:
                ctx.term()
            assert a.run(lambda: "a") == {0: "a"} and b.run(lambda: "b") == {0: "b"}
        finally:
            b.stop()
    finally:
        a.stop()


@pytest.mark.kernel
def test_two_kernels_on_one_machine_do_not_hear_each_other() -> None:
    with kernel() as ka, kernel() as kb:
        a = start_mesh(ka, 1)
        b = start_mesh(kb, 1)
        assert a["key"] != b["key"] and a["endpoint"] != b["endpoint"]
        a_pids, b_pids = a["pids"], b["pids"]
        assert isinstance(a_pids, list) and isinstance(b_pids, list)
        assert set(a_pids) <= {p.pid for p in psutil.Process(ka.pid).children(recursive=True)}
        assert set(b_pids) <= {p.pid for p in psutil.Process(kb.pid).children(recursive=True)}
        # Kernel A's key signs a call; kernel B delivers it to its own rank.
        # B's rank drops it; B's controller drops the same frames from outside.
        frames = _bump_frames(Codec(bytes.fromhex(str(a["key"])), "outsider"))
        code = "\n".join([
            "import time",
            f"_m = {MAGICS}.mesh",
            f"_f = {frames!r}",
            f"_d = lambda: sum(_m.exec({_RANK_DROPPED!r})[0].values())",
            "_i, _b = _m._ctl.ranks[0], _d()",
            "_m._ctl.io.call_soon(lambda: _m._ctl.io.send(_i.main_id, _f))",
            "_t = time.monotonic()",
            "while _d() == _b and time.monotonic() - _t < 20:",
            "    time.sleep(0.05)",
            "print(_d() - _b, _m.exec(\"globals().get('cross_count', 0)\")[0])",
        ])
        r = kb.run(code)
        assert r.status == "ok", r.traceback or r
        assert r.stdout.split() == ["1", "0"], r.stdout
        ctx = zmq.Context()
        try:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, b"outsider")
            s.connect(str(b["endpoint"]))
            s.send_multipart(frames)
            r = kb.run(f"_m = {MAGICS}.mesh\nimport time\n_t = time.monotonic()\n"
                       "while not _m.dropped.get('bad-signature') and time.monotonic() - _t < 20:\n"
                       "    time.sleep(0.05)\nprint(_m.dropped)")
            s.close(linger=0)
        finally:
            ctx.term()
        assert r.status == "ok" and "'bad-signature': 1" in r.stdout, r.stdout
        for ks in (ka, kb):
            r = ks.run("%%monarch\n1 + 1")
            assert r.status == "ok" and "2" in r.results[0], r
            r = ks.run("%monarch stop", timeout=60)
            assert r.status == "ok", r
        wait_for(lambda: all(gone(p) for p in a_pids + b_pids), timeout=ORPHAN_LIMIT_S,
                 what="both kernels' ranks to end")


def test_files_holding_finds_a_key_file(tmp_path: pathlib.Path) -> None:
    """The scan above can fail: it finds a key written where it looks."""
    secret = os.urandom(32).hex().encode()
    (tmp_path / "k").write_bytes(b"x" + secret)
    assert files_holding(secret, time.time() - 60, str(tmp_path)) == [str(tmp_path / "k")]
