"""The dashboard in a real IPython kernel with 2 real ranks: what the widget
sends while a blocking ``%%monarch`` cell logs metrics, its text fallback,
and a dead rank turning red and coming back."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest

from .kernel_util import KernelSession

pytestmark = pytest.mark.kernel

WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def ks() -> Iterator[KernelSession]:
    session = KernelSession()
    try:
        r = session.run("%load_ext monarch_nb")
        assert r.status == "ok", r
        yield session
    finally:
        session.run("%monarch stop", timeout=60)
        session.close()


def _run_all(ks: KernelSession, code: str, timeout: float = 120,
             linger: float = 0.0) -> tuple[list[dict[str, Any]], float, float]:
    """Run a cell; every iopub message (any parent), with the times the
    kernel went busy and idle for this cell; keep reading ``linger`` s more."""
    msg_id = ks.execute(code)
    msgs: list[dict[str, Any]] = []
    busy = idle = 0.0
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"cell did not finish: {code!r}"
        if idle and time.monotonic() > idle + linger:
            break
        try:
            msg = ks.kc.get_iopub_msg(timeout=min(left, 0.05))
        except queue.Empty:
            continue
        msg["_at"] = time.monotonic()
        msgs.append(msg)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status":
            if msg["content"]["execution_state"] == "busy":
                busy = msg["_at"]
            elif msg["content"]["execution_state"] == "idle":
                idle = msg["_at"]
    errors = [m for m in msgs if m["msg_type"] == "error"]
    assert not errors, errors[0]["content"]["traceback"]
    return msgs, busy, idle


def _custom(msgs: list[dict[str, Any]], model_id: str) -> list[dict[str, Any]]:
    out = []
    for m in msgs:
        c = m["content"]
        if m["msg_type"] == "comm_msg" and c.get("comm_id") == model_id \
                and c["data"].get("method") == "custom":
            c["data"]["content"]["_at"] = m["_at"]
            out.append(c["data"]["content"])
    return out


def test_dashboard_updates_during_a_blocking_cell(ks: KernelSession) -> None:
    msgs, _, _ = _run_all(ks, "%monarch start -n 2 --backend cpu", timeout=180, linger=0.5)
    shown = [m["content"]["data"] for m in msgs if m["msg_type"] == "display_data"
             and WIDGET in m["content"]["data"]]
    assert len(shown) == 1, [m["msg_type"] for m in msgs]
    model_id = shown[0][WIDGET]["model_id"]
    # text fallback: the status table, as %monarch status prints it
    text = shown[0]["text/plain"]
    assert "mesh: 2 ranks" in text and "steps/s" in text and "n/a" in text, text
    first = _custom(msgs, model_id)
    assert first and first[0]["t"] == "snapshot" and first[0]["world"] == 2
    assert {t["rank"] for t in first[0]["tiles"]} == {0, 1}

    # a blocking training cell: 3 s of logging, 2 metrics per step
    cell = ("%%monarch\nimport monarch_nb as mnb, time\n"
            "for i in range(60):\n"
            "    mnb.log(loss=1.0 / (i + 1) + mnb.rank(), lr=0.1)\n"
            "    time.sleep(0.05)\n")
    msgs, busy, idle = _run_all(ks, cell, linger=1.0)
    updates = _custom(msgs, model_id)
    during = [u for u in updates if busy < u["_at"] < idle]
    # it kept updating while the kernel's main thread was blocked in the cell
    assert len(during) >= 5, (len(during), len(updates))
    assert any(u.get("series") for u in during)
    assert any(t["state"] == "busy" for u in during for t in u.get("tiles", []))
    # throttled: at most ~10 messages a second (delivery may bunch a little)
    span = updates[-1]["_at"] - updates[0]["_at"]
    assert len(updates) <= 10 * span + 3, (len(updates), span)
    # deltas: each point exactly once, all of them, the new metric names announced
    got: dict[tuple[int, str], list[int]] = {}
    for u in updates:
        assert u["t"] == "delta"
        for rank, name, steps, _values in u.get("series", []):
            got.setdefault((rank, name), []).extend(steps)
    assert got == {(r, n): list(range(60)) for r in (0, 1) for n in ("loss", "lr")}
    assert any(u.get("names") == ["loss", "lr"] for u in updates)
    last_tiles = {t["rank"]: t for u in updates for t in u.get("tiles", [])}
    assert last_tiles[1]["last"]["loss"].startswith("1.01"), last_tiles[1]
    assert last_tiles[0]["cpu"] is not None and last_tiles[0]["rss"] > 0

    # the status table shows the same figures
    r = ks.run("%monarch status")
    assert "loss=1.017" in r.stdout and "lr=0.1" in r.stdout, r.stdout

    # %monarch dashboard shows the same widget again (another view)
    msgs, _, _ = _run_all(ks, "%monarch dashboard")
    again = [m["content"]["data"][WIDGET]["model_id"] for m in msgs
             if m["msg_type"] == "display_data" and WIDGET in m["content"]["data"]]
    assert again == [model_id]


def test_a_dead_rank_turns_red_and_comes_back(ks: KernelSession) -> None:
    model_id = ks.run("_d = get_ipython().find_magic('monarch').__self__.mesh.dashboard(); "
                      "print(_d.model_id)").stdout.strip()
    msgs, _, _ = _run_all(ks, "%monarch kill 1")
    more, _, _ = _run_all(ks, "%%monarch --ranks 1\nimport monarch_nb as mnb\nmnb.incarnation()",
                          linger=1.0)
    msgs += more
    results = [m["content"]["data"]["text/plain"] for m in more if m["msg_type"] == "execute_result"]
    assert results == ["RankResults({1: 1})"], results
    updates = _custom(msgs, model_id)
    states = [t["state"] for u in updates for t in u.get("tiles", []) if t["rank"] == 1]
    assert "dead" in states or "respawning" in states, states
    assert states[-1] in ("ready", "busy"), states
    events = [e["kind"] for u in updates for e in u.get("events", []) if e["rank"] == 1]
    assert "died" in events and "respawned" in events, events
    incs = [t["incarnation"] for u in updates for t in u.get("tiles", []) if t["rank"] == 1]
    assert incs[-1] == 1


def test_stop_marks_the_dashboard_stopped(ks: KernelSession) -> None:
    model_id = ks.run("print(_d.model_id)").stdout.strip()
    msgs, _, _ = _run_all(ks, "%monarch stop", linger=1.0)
    updates = _custom(msgs, model_id)
    assert updates and updates[-1] == {"t": "delta", "state": "stopped", "_at": updates[-1]["_at"]}
    final = {t["rank"]: t["state"] for u in updates for t in u.get("tiles", [])}
    assert final == {0: "stopped", 1: "stopped"}, final
