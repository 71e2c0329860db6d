"""The JupyterLab extension's feed (monarch_nb/ui/labcomm.py).

Pure parts (the summary, when the hub sends) are tested directly; the comm
itself against a real IPython kernel through jupyter_client, speaking the
comm protocol the way the extension does (open to the kernel's target,
``hello``, ``stacks``, ``restart``), with real rank processes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from monarch_nb.ui.labcomm import TARGET, Hub, summarize

from .conftest import wait_for
from .kernel_util import KernelSession


def _row(rank: int, state: str, age: float | None = 0.2, inc: int = 0) -> dict[str, Any]:
    return {"rank": rank, "state": state, "pid": 100 + rank, "incarnation": inc,
            "restarts": inc, "heartbeat_age": age}


def test_summary_counts_ranks_up_and_dead() -> None:
    rows = [_row(0, "ready"), _row(1, "dead", None, 1), _row(2, "busy", 1.234),
            _row(3, "respawning")]
    s = summarize(rows, 4, "cpu", True)
    assert (s["world"], s["backend"], s["state"], s["up"], s["dead"]) == (4, "cpu", "running", 2, 1)
    assert s["ranks"][1] == {"rank": 1, "state": "dead", "incarnation": 1, "restarts": 1,
                             "pid": 101, "hb": None}
    assert s["ranks"][2]["hb"] == 1.2
    stopped = summarize(rows, 4, "cpu", False)
    assert stopped["state"] == "stopped" and stopped["up"] == 0
    assert {r["state"] for r in stopped["ranks"]} == {"stopped"}


class _Comm:
    """A comm endpoint that records what the hub sends (not under test)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, data: dict[str, Any]) -> None:
        self.sent.append(data)

    def on_msg(self, fn: Any) -> None:
        self.msg = fn

    def on_close(self, fn: Any) -> None:
        self.close = fn


class _Mesh:
    def __init__(self) -> None:
        self.running, self.world_size, self.backend = True, 2, "cpu"
        self.rows = [_row(0, "ready"), _row(1, "ready")]

    def status(self) -> list[dict[str, Any]]:
        return self.rows


def test_hub_sends_on_change_at_most_max_hz() -> None:
    mesh = _Mesh()
    hub = Hub(lambda: mesh, max_hz=4.0, background=False)
    quiet = _Comm()
    hub.add(quiet, confirmed=False)  # kernel-opened, never answered (nbclient, VS Code)
    t = 1000.0
    assert hub.tick(t)  # the first summary
    assert not hub.tick(t + 0.5)  # nothing changed
    mesh.rows[1]["heartbeat_age"] = 0.7  # a heartbeat's decimals are no change
    assert not hub.tick(t + 0.6)
    assert not hub.tick(t + 1.5)  # steady: no refresh for a comm that never said hello
    mesh.rows[1] = _row(1, "dead", None)
    assert hub.tick(t + 1.6)  # a change goes to every comm at once
    page = _Comm()
    hub.add(page)  # a page opened a comm: it gets a summary now
    assert not hub.tick(t + 1.7)  # ... once the throttle allows (1/4 s apart)
    assert hub.tick(t + 1.9)
    mesh.rows[1] = _row(1, "ready", inc=1)
    assert not hub.tick(t + 2.0)  # changed, throttled
    assert hub.tick(t + 2.15)
    assert not hub.tick(t + 2.5)
    assert hub.tick(t + 3.2)  # due: fresh heartbeat ages once a second, to the page only
    mesh.running = False
    assert hub.tick(t + 3.5)
    assert not hub.tick(t + 6.0)  # stopped and unchanged: quiet

    def ups(comm: _Comm) -> list[int]:
        return [m["mesh"]["up"] for m in comm.sent if m["t"] == "mesh"]

    assert ups(quiet) == [2, 1, 1, 2, 0]
    assert ups(page) == [1, 2, 2, 0]
    assert page.sent[-1]["mesh"]["state"] == "stopped"
    quiet.msg({"content": {"data": {"action": "hello"}}})  # the extension answered after all
    assert hub.confirmed == [quiet, page] or hub.confirmed == [page, quiet]


def test_a_rank_back_before_the_next_summary_is_shown_dead_once() -> None:
    # a forked rank is back in 0.2 s, quicker than the 1/4 s between two
    # summaries: the status bar must still go red for it
    mesh = _Mesh()
    mesh.rows[1] = _row(1, "ready", inc=1)  # a death before the hub: no news
    hub = Hub(lambda: mesh, max_hz=4.0, background=False)
    page = _Comm()
    hub.add(page)
    t = 1000.0
    assert hub.tick(t)
    assert page.sent[-1]["mesh"]["up"] == 2
    mesh.rows[1] = _row(1, "ready", inc=2)  # died and already back
    assert not hub.tick(t + 0.1)  # throttled
    assert hub.tick(t + 0.3)
    sent = page.sent[-1]["mesh"]
    assert (sent["up"], sent["dead"], sent["ranks"][1]["state"]) == (1, 1, "dead")
    assert hub.tick(t + 0.6)  # then as it is
    sent = page.sent[-1]["mesh"]
    assert (sent["up"], sent["dead"], sent["ranks"][1]["incarnation"]) == (2, 0, 2)
    assert not hub.tick(t + 0.9)  # the death was told once
    mesh.rows[1] = _row(1, "dead", None, inc=2)  # down for longer: shown as it is
    assert hub.tick(t + 1.2)
    assert page.sent[-1]["mesh"]["ranks"][1]["state"] == "dead"
    mesh.rows[1] = _row(1, "ready", inc=3)
    assert hub.tick(t + 1.5)
    assert page.sent[-1]["mesh"]["up"] == 2  # its death was shown already: not again
    mesh.running = False
    mesh.rows[0] = _row(0, "ready", inc=1)
    assert hub.tick(t + 1.8)
    assert page.sent[-1]["mesh"]["state"] == "stopped"  # a stopped mesh's ranks are stopped


# -- the comm in a real kernel ---------------------------------------------------------
@pytest.fixture(scope="module")
def ks() -> Iterator[KernelSession]:
    session = KernelSession()
    try:
        yield session
    finally:
        _run(session, "try:\n    get_ipython().run_line_magic('monarch', 'stop')\nexcept Exception:\n    pass")
        session.close()


def _run(ks: KernelSession, code: str, timeout: float = 120.0) -> str:
    """Run a cell keeping every iopub message in ``ks.late`` (the cell's own
    comm messages too, which ``ks.run`` would consume); its reply status."""
    # sent as JupyterLab sends it (with its execute metadata): the kernel
    # opens the comm only for a front end that has the extension's target
    content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
               "allow_stdin": False, "stop_on_error": True}
    request = ks.kc.session.msg("execute_request", content, metadata={
        "deletedCells": [], "recordTiming": False, "cellId": uuid.uuid4().hex})
    ks.kc.shell_channel.send(request)
    msg_id = request["header"]["msg_id"]
    deadline = time.monotonic() + timeout
    while True:
        msg = ks.kc.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.1))
        ks.late.setdefault(msg["parent_header"].get("msg_id"), []).append(msg)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            return ks.reply_status(msg_id, deadline)


def _send(ks: KernelSession, msg_type: str, content: dict[str, Any]) -> None:
    ks.kc.shell_channel.send(ks.kc.session.msg(msg_type, content))


def _comm_msgs(ks: KernelSession, comm_id: str | None = None) -> list[dict[str, Any]]:
    ks.drain(0.05)
    found = [m for msgs in ks.late.values() for m in msgs
             if m["msg_type"] in ("comm_open", "comm_msg", "comm_close")
             and (comm_id is None or m["content"].get("comm_id") == comm_id)]
    return sorted(found, key=lambda m: str(m["header"]["date"]))


def _data(ks: KernelSession, comm_id: str) -> list[dict[str, Any]]:
    return [m["content"]["data"] for m in _comm_msgs(ks, comm_id) if m["msg_type"] == "comm_msg"]


def _latest_mesh(ks: KernelSession, comm_id: str) -> Any:
    msgs = [d for d in _data(ks, comm_id) if d.get("t") == "mesh"]
    return msgs[-1]["mesh"] if msgs else "nothing yet"


@pytest.mark.kernel
@pytest.mark.timeout(240)
def test_comm_feeds_the_mesh_and_answers_requests(ks: KernelSession) -> None:
    early = uuid.uuid4().hex  # a page that opened before %load_ext: closed
    _send(ks, "comm_open", {"comm_id": early, "target_name": TARGET, "data": {"action": "hello"}})
    wait_for(lambda: any(m["msg_type"] == "comm_close" for m in _comm_msgs(ks, early)),
             timeout=30, what="the kernel to close a comm to a target it does not have yet")

    assert _run(ks, "%load_ext monarch_nb") == "ok"
    opened = wait_for(lambda: [m for m in _comm_msgs(ks) if m["msg_type"] == "comm_open"
                               and m["content"]["target_name"] == TARGET],
                      timeout=30, what="the kernel to open a comm to the front end")
    kernel_comm = opened[0]["content"]["comm_id"]  # type: ignore[index]

    cid = uuid.uuid4().hex  # a page opened after %load_ext
    _send(ks, "comm_open", {"comm_id": cid, "target_name": TARGET, "data": {"action": "hello"}})
    wait_for(lambda: _latest_mesh(ks, cid) is None, timeout=30, what="'no mesh'")

    assert _run(ks, "%monarch start -n 2 --backend cpu --no-dashboard") == "ok"
    wait_for(lambda: (_latest_mesh(ks, cid) or {}).get("up") == 2, timeout=60, what="2/2 ranks")
    mesh = _latest_mesh(ks, cid)
    assert (mesh["world"], mesh["backend"], mesh["state"]) == (2, "cpu", "running")

    assert _run(ks, "%monarch kill 1") == "ok"
    # the feed samples at 4 Hz: a rank forked back within a sample shows as
    # its new incarnation, not always as a moment at 1/2 ranks
    wait_for(lambda: any(d.get("t") == "mesh" and d["mesh"] and (
        d["mesh"]["up"] == 1 or d["mesh"]["ranks"][1]["incarnation"] == 1)
        for d in _data(ks, cid)), timeout=30, what="the kill in the feed")
    wait_for(lambda: (_latest_mesh(ks, cid) or {}).get("up") == 2
             and _latest_mesh(ks, cid)["ranks"][1]["incarnation"] == 1,
             timeout=60, what="rank 1 respawned")

    _send(ks, "comm_msg", {"comm_id": cid, "data": {"action": "stacks"}})
    stacks = wait_for(lambda: [d for d in _data(ks, cid) if d.get("t") == "stacks"],
                      timeout=60, what="the stacks")
    assert stacks[0]["text"].startswith("ranks 0,1: "), stacks  # type: ignore[index]

    _send(ks, "comm_msg", {"comm_id": cid, "data": {"action": "restart", "rank": 0}})
    wait_for(lambda: any(d == {"t": "ack", "text": "restarting rank 0"} for d in _data(ks, cid)),
             timeout=30, what="the restart's ack")
    wait_for(lambda: (_latest_mesh(ks, cid) or {}).get("up") == 2
             and _latest_mesh(ks, cid)["ranks"][0]["incarnation"] == 1,
             timeout=60, what="rank 0 restarted")
    _send(ks, "comm_msg", {"comm_id": cid, "data": {"action": "restart", "rank": 7}})
    errors = wait_for(lambda: [d for d in _data(ks, cid) if d.get("t") == "error"],
                      timeout=30, what="an error for rank 7")
    assert "7" in errors[0]["text"]  # type: ignore[index]

    assert _run(ks, "%monarch stop") == "ok"
    wait_for(lambda: _latest_mesh(ks, cid) is None, timeout=30, what="'no mesh' after stop")
    assert _run(ks, "%monarch start -n 2 --backend cpu --no-dashboard") == "ok"
    wait_for(lambda: (_latest_mesh(ks, cid) or {}).get("up") == 2, timeout=60,
             what="the second mesh")
    assert _run(ks, "%monarch stop") == "ok"
    wait_for(lambda: _latest_mesh(ks, cid) is None, timeout=30, what="'no mesh' again")
    # a mesh started with the Python API in this kernel is shown as well
    assert _run(ks, "import monarch_nb\n_api = monarch_nb.Mesh.start(n=2, backend='cpu')") == "ok"
    wait_for(lambda: (_latest_mesh(ks, cid) or {}).get("up") == 2, timeout=60,
             what="the Python API's mesh")
    assert _run(ks, "_api.stop()") == "ok"
    wait_for(lambda: _latest_mesh(ks, cid) is None, timeout=30, what="'no mesh' after _api.stop()")

    # the comm the kernel opened (never said hello to here) got the changes too
    quiet = [d["mesh"] for d in _data(ks, kernel_comm) if d.get("t") == "mesh"]
    assert any(m and m["up"] == 2 for m in quiet) and quiet[-1] is None, quiet
