"""Liveness without the GIL (procs/liveness.py): a stopped rank is found
by its process state, before its heartbeat timeout; a rank that holds the
GIL (silent, but running) is reported, never killed. The policy without
processes first, then on real ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from monarch_nb import Mesh, RankDied, RankErrors
from monarch_nb.procs.liveness import Liveness, Verdict, os_state

from .conftest import wait_for


# -- the policy -------------------------------------------------------------------------
def test_heartbeats_mean_alive_whatever_the_state() -> None:
    live = Liveness(heartbeat_timeout=3.0)
    for state in ("R", "S", "D", None, "t"):
        assert live.judge(0, 0.4, state, now=10.0) is Verdict.ALIVE


def test_a_stop_counts_after_the_grace_even_with_fresh_heartbeats() -> None:
    live = Liveness(heartbeat_timeout=3.0, stop_grace=0.5)
    assert live.judge(1, 0.1, "T", now=10.0) is Verdict.ALIVE  # just stopped: maybe resumed soon
    assert live.judge(1, 0.4, "T", now=10.3) is Verdict.ALIVE
    assert live.judge(1, 0.6, "T", now=10.5) is Verdict.FROZEN
    # resumed in time: the stop is forgotten
    live2 = Liveness(heartbeat_timeout=3.0, stop_grace=0.5)
    live2.judge(1, 0.1, "T", now=10.0)
    assert live2.judge(1, 0.3, "S", now=10.3) is Verdict.ALIVE
    assert live2.judge(1, 0.1, "T", now=10.4) is Verdict.ALIVE  # a new stop starts its own grace


def test_silent_but_running_on_this_host_is_busy_never_frozen() -> None:
    live = Liveness(heartbeat_timeout=3.0)
    for t, silent in ((10.0, 3.5), (40.0, 33.5), (3600.0, 3593.5)):
        assert live.judge(2, silent, "R", now=t) is Verdict.BUSY
    assert live.busy_for(2, now=3600.0) == pytest.approx(3593.5)
    assert live.judge(2, 0.2, "S", now=3601.0) is Verdict.ALIVE  # it answered again
    assert live.busy_for(2, now=3601.0) is None


def test_only_the_heartbeat_tells_for_remote_or_traced_ranks() -> None:
    live = Liveness(heartbeat_timeout=3.0)
    assert live.judge(3, 2.9, None, now=10.0) is Verdict.ALIVE
    assert live.judge(3, 3.1, None, now=10.2) is Verdict.FROZEN  # another host: as before
    assert live.judge(3, 3.1, "t", now=10.2) is Verdict.FROZEN  # held by a debugger
    assert live.judge(3, 9.0, "Z", now=10.2) is Verdict.ALIVE  # exiting: reported on its own


def test_the_state_is_read_only_for_ranks_silent_a_while_or_already_suspect() -> None:
    live = Liveness(heartbeat_timeout=3.0, stop_grace=0.5, look_after=0.1)
    assert not live.wants_state(0, 0.05)  # spoke just now: running then, no syscall
    assert live.wants_state(0, 0.1)
    # seen stopped once: read on every tick until it resumes, whatever its silence
    live.judge(1, 0.3, "T", now=10.0)
    assert live.wants_state(1, 0.0)
    assert live.judge(1, 0.1, "S", now=10.2) is Verdict.ALIVE
    assert not live.wants_state(1, 0.05)
    # busy (silent past the timeout, running): read until it speaks again
    assert live.judge(2, 3.5, "R", now=10.0) is Verdict.BUSY
    assert live.wants_state(2, 0.0)
    # skipped reads judge as "no state": alive below the timeout, as heartbeats say
    assert live.judge(3, 0.1, None, now=10.0) is Verdict.ALIVE


def test_os_state_reads_proc() -> None:
    assert os_state(os.getpid()) == "R"
    assert os_state(None) is None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_for(lambda: os_state(child.pid) == "S", what="the child asleep")
        child.send_signal(signal.SIGSTOP)
        wait_for(lambda: os_state(child.pid) == "T", what="the child stopped")
    finally:
        child.kill()
        child.wait()
    assert os_state(child.pid) is None  # reaped: gone


# -- real ranks -------------------------------------------------------------------------
def test_a_stopped_rank_is_found_by_its_state_not_its_silence() -> None:
    # heartbeat timeout far beyond the test's patience: only the process
    # state can have found it
    with Mesh.start(n=2, backend="cpu", respawn="off", heartbeat_timeout=60.0) as mesh:
        fut = mesh.exec_async("import time, monarch_nb as mnb\n"
                              "time.sleep(30 if mnb.rank() == 1 else 2)")
        wait_for(lambda: mesh.status()[1]["state"] == "busy", what="rank 1 busy")
        mesh.kill(1, signal="STOP")
        with pytest.raises(RankErrors) as info:
            mesh.wait(fut, timeout=20)
        died = info.value.errors[1]
        assert isinstance(died, RankDied) and died.frozen == "stopped by a signal"
        assert "(stopped by a signal); the controller killed it" in str(died), str(died)
        detail = [e["detail"] for e in mesh.events if e["kind"] == "died"]
        assert detail and detail[0].startswith("stopped by a signal; no heartbeat for"), detail


HOLD_GIL = """
import ctypes
# libc's sleep through PyDLL: a foreign call that keeps the GIL, as a C
# extension that never releases it would. The control thread cannot beat.
ctypes.PyDLL(None).sleep({seconds})
"ok"
"""


def test_a_rank_holding_the_gil_is_reported_not_killed() -> None:
    with Mesh.start(n=2, backend="cpu", heartbeat_timeout=1.0) as mesh:
        fut = mesh.ranks(1).exec(HOLD_GIL.format(seconds=6), block=False)
        wait_for(lambda: mesh.status()[1]["note"], timeout=15, what="rank 1 reported busy")
        assert "holding the GIL" in mesh.status()[1]["note"]
        assert mesh.wait(fut, timeout=30) == {1: "ok"}
        assert mesh.status()[1]["incarnation"] == 0  # never killed
        kinds = [(e["rank"], e["kind"]) for e in mesh.events]
        assert (1, "busy_silent") in kinds and (1, "died") not in kinds, kinds
        busy = next(e for e in mesh.events if e["kind"] == "busy_silent")
        assert "not killed" in busy["detail"], busy
        wait_for(lambda: not mesh.status()[1]["note"], what="rank 1 heard from again")
        assert mesh.run(lambda: 1) == {0: 1, 1: 1}


def test_a_large_result_that_holds_the_gil_arrives() -> None:
    # Pickling and sending 256 MiB keeps the rank's GIL for a while (longer
    # than this heartbeat timeout on a slow machine): silence, not death.
    with Mesh.start(n=1, backend="cpu", heartbeat_timeout=0.5) as mesh:
        t0 = time.monotonic()
        size = mesh.exec("blob = b'x' * (256 << 20)\nlen(blob)")[0]
        data = mesh.exec("blob", timeout=120)[0]
        assert size == len(data) == 256 << 20, time.monotonic() - t0
        assert mesh.status()[0]["incarnation"] == 0
        assert not [e for e in mesh.events if e["kind"] == "died"]
