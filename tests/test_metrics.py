"""mnb.log and the controller's series: pure tests (no processes) of the
rank-side buffer, the store's ordering rules, the dashboard feed's deltas and
throttle, and 64 simulated ranks."""

from __future__ import annotations

import itertools
import json
import math
import threading

import pytest

import monarch_nb as mnb
from monarch_nb import UsageError
from monarch_nb.controller.metricstore import MetricsStore
from monarch_nb.engine import metrics as metrics_mod
from monarch_nb.engine.metrics import MetricsBuffer
from monarch_nb.ui.dashfeed import Feed, Throttle, count_points, tile
from monarch_nb.wire.metricframes import decode, encode


# -- rank side ---------------------------------------------------------------------
def test_auto_steps_and_values() -> None:
    buf = MetricsBuffer()
    buf.log(None, {"loss": 1})
    buf.log(None, {"loss": 0.5, "acc": 0.1})
    buf.log(10, {"loss": 0.25})
    buf.log(None, {"loss": 0.2})
    _, n, points = buf.take()  # type: ignore[misc]
    assert n == -1  # outside a call: not counted
    assert [p[0] for p in points] == [0, 1, 10, 11]
    assert points[1][2] == {"loss": 0.5, "acc": 0.1}
    assert all(type(v) is float for p in points for v in p[2].values())


def test_bad_values_are_usage_errors() -> None:
    buf = MetricsBuffer()
    with pytest.raises(UsageError, match="needs a number"):
        buf.log(None, {"loss": "low"})
    with pytest.raises(UsageError, match="whole number"):
        buf.log(1.5, {"loss": 1.0})
    with pytest.raises(UsageError, match="at least one metric"):
        mnb.log(step=3)


def test_log_outside_a_rank_never_fails() -> None:
    # plain Python (a launched script before its control thread exists): buffered
    before = len(metrics_mod.buffer()._q)
    mnb.log(loss=0.5)
    assert len(metrics_mod.buffer()._q) == before + 1
    metrics_mod.buffer().take()


def test_tensor_scalars_are_converted_at_once() -> None:
    import torch

    buf = MetricsBuffer()
    t = torch.tensor(2.0)
    buf.log(None, {"loss": t})
    t += 1  # an in-place update after logging must not change the point
    assert buf.take()[2][0][2] == {"loss": 2.0}  # type: ignore[index]


def test_batches_during_a_call_are_counted_exactly() -> None:
    """The control thread's batches and the main thread's end-of-call take
    race; the count in the RESULT must equal the batches taken for the call."""
    buf = MetricsBuffer()
    buf.begin(7)
    taken: list[tuple[int, int, list]] = []
    stop = threading.Event()

    def control() -> None:
        while not stop.is_set():
            got = buf.take()
            if got:
                taken.append(got)

    t = threading.Thread(target=control)
    t.start()
    for i in range(20000):
        buf.log(None, {"x": float(i)})
    n, rest = buf.finish()
    stop.set()
    t.join()
    counted = [b for b in taken if b[0] == 7]
    assert n == len(counted) and [b[1] for b in counted] == list(range(n))
    steps = [p[0] for b in counted for p in b[2]] + [p[0] for p in rest]
    steps += [p[0] for b in taken if b[0] == 0 for p in b[2]]
    # nothing twice, nothing lost but what over-full batches thinned (counted)
    assert len(set(steps)) == len(steps) and 19999 in steps
    assert len(steps) + buf.thinned == 20000


def test_a_runaway_log_loop_is_thinned_not_queued_without_bound() -> None:
    buf = MetricsBuffer()
    for i in range(10_000):
        buf.log(None, {"x": float(i)})
    _, _, points = buf.take()  # type: ignore[misc]
    steps = [p[0] for p in points]
    assert len(steps) <= metrics_mod.MAX_BATCH and steps[-1] == 9999 and steps == sorted(steps)
    assert buf.thinned == 10_000 - len(steps)


def test_wire_format_is_json_and_keeps_nan() -> None:
    frame = encode([(3, 1.5, {"loss": math.nan, "acc": 0.5})])
    assert json.loads(frame)[0][0] == 3  # strict JSON (no bare NaN)
    (step, _t, metrics), = decode(frame)
    assert step == 3 and math.isnan(metrics["loss"]) and metrics["acc"] == 0.5
    assert decode(b"not json") == [] and decode(b'[[1, 2], "x"]') == []


# -- controller store ---------------------------------------------------------------
def _pts(steps: list[int], name: str = "loss", base: float = 0.0) -> list:
    return [(s, 0.0, {name: base + s}) for s in steps]


def test_series_order_replace_insert_cut() -> None:
    store = MetricsStore(2)
    store.add(0, 0, _pts([0, 1, 2, 5]))
    store.add(0, 0, _pts([3]))  # late: inserted in order
    store.add(0, 0, [(5, 0.0, {"loss": 50.0})])  # same step: replaced
    assert store.series(0, "loss") == ([0, 1, 2, 3, 5], [0.0, 1.0, 2.0, 3.0, 50.0])
    # a respawned rank resumes from step 2: the old future is cut
    store.add(0, 1, _pts([2, 3], base=100))
    assert store.series(0, "loss") == ([0, 1, 2, 3], [0.0, 1.0, 102.0, 103.0])
    store.add(0, 0, _pts([9]))  # a straggler of the replaced process: ignored
    assert store.series(0, "loss")[0][-1] == 3
    assert store.last(0) == {"loss": 103.0} and store.last(1) == {}
    _cursor, changes = store.since(0)  # type: ignore[misc]
    assert [c for c in changes if c[4]] == [(0, "loss", 2, 0.0, True)]


def test_series_are_bounded_and_the_change_log_too() -> None:
    store = MetricsStore(1, max_points=100, max_log=50)
    store.add(0, 0, _pts(list(range(1000))))
    steps, _ = store.series(0, "loss")
    assert len(steps) <= 100 and steps[-1] == 999 and steps[0] == 0
    assert steps == sorted(steps)
    assert store.since(0) is None  # fell behind: a snapshot is needed
    store.add(0, 0, _pts([1000]))
    c = store.cursor
    store.add(0, 0, _pts([1001]))
    assert store.since(c)[1] == [(0, "loss", 1001, 1001.0, False)]  # type: ignore[index]


def test_steps_per_second() -> None:
    store = MetricsStore(1)
    assert store.steps_per_s(0, now=0.0) is None
    for i in range(11):
        store.add(0, 0, _pts([i * 10]), now=i * 0.5)  # 10 steps per 0.5 s
    assert store.steps_per_s(0, now=5.0) == pytest.approx(20.0)
    assert store.steps_per_s(0, now=100.0) == 0.0  # stopped logging


# -- the dashboard feed ------------------------------------------------------------
def _rows(world: int, state: str = "busy") -> list[dict]:
    return [{"rank": r, "state": state, "pid": 100 + r, "incarnation": 0, "device": "cpu",
             "heartbeat_age": 0.2, "exit": "", "restarts": 0, "host": "h", "cpu": 50.0,
             "rss": 1e8, "gpu_mem": None, "gpu_mem_total": None, "gpu_mem_peak": None,
             "gpu_util": None, "gpu_temp": None, "gpu_power": None, "steps_per_s": 10.0,
             "last": {"loss": 0.5}} for r in range(world)]


def test_throttle_spaces_messages() -> None:
    th = Throttle(10)
    sent = [t / 1000 for t in range(3000) if th.take(t / 1000)]  # polled every ms for 3 s
    assert len(sent) == 30
    assert all(b - a >= 0.1 - 1e-9 for a, b in itertools.pairwise(sent))
    assert th.wait(sent[-1] + 0.03) == pytest.approx(0.07)


def test_feed_sends_each_point_once_at_most_10_per_second() -> None:
    """Points pour in at 1 kHz; polled every ms, the feed sends <= 10
    messages a second, each with only the points since the last one."""
    store = MetricsStore(2)
    rows = _rows(2)
    feed, th = Feed(store, lambda: rows, lambda: []), Throttle(10)
    msgs = []
    for ms in range(2000):
        store.add(ms % 2, 0, [(ms // 2, 0.0, {"loss": float(ms)})], now=ms / 1000)
        if th.take(ms / 1000):
            msg = feed.next()
            if msg:
                msgs.append(msg)
    msgs.append(feed.next())  # the final flush
    assert msgs[0]["t"] == "snapshot" and all(m["t"] == "delta" for m in msgs[1:])
    assert len(msgs) <= 2 * 10 + 2
    got: dict[int, list[int]] = {0: [], 1: []}
    for m in msgs:
        for rank, name, steps, values in m.get("series", []):
            assert name == "loss" and len(steps) == len(values)
            got[rank] += steps
    assert got == {0: list(range(1000)), 1: list(range(1000))}
    assert "tiles" in msgs[0] and all("tiles" not in m for m in msgs[1:])  # unchanged rows
    rows[1]["state"] = "dead"
    store.add(0, 0, _pts([5000]))
    m = feed.next()
    assert m is not None and [t["rank"] for t in m["tiles"]] == [1] and count_points(m) == 1
    assert feed.next() is None  # nothing new: no message


def test_feed_events_and_names() -> None:
    store = MetricsStore(1)
    events = [{"time": 1.0, "rank": 0, "incarnation": 0, "kind": "started", "detail": ""}]
    feed = Feed(store, lambda: _rows(1), lambda: events)
    snap = feed.next()
    assert snap is not None and snap["events"] == [] and snap["names"] == []
    events.append({"time": 2.0, "rank": 0, "incarnation": 0, "kind": "died", "detail": "SIGKILL"})
    events.append({"time": 3.0, "rank": 0, "incarnation": 1, "kind": "respawned", "detail": "g1"})
    store.add(0, 0, [(0, 0.0, {"loss": 1.0, "lr": math.inf})])
    m = feed.next()
    assert m is not None and [e["kind"] for e in m["events"]] == ["died", "respawned"]
    assert m["names"] == ["loss", "lr"]
    assert [0, "lr", [0], [None]] in m["series"]  # non-finite: a gap, valid JSON
    json.dumps(m, allow_nan=False)


def test_a_death_between_two_messages_still_shows_the_rank_dead_once() -> None:
    """A spare replaces a killed rank within milliseconds, often between two
    dashboard messages: the tile still turns red for one message."""
    store = MetricsStore(2)
    events: list[dict] = []
    rows = _rows(2, "ready")
    feed = Feed(store, lambda: rows, lambda: events)
    assert feed.next() is not None  # snapshot
    events.append({"time": 2.0, "rank": 1, "incarnation": 0, "kind": "died", "detail": "SIGKILL"})
    events.append({"time": 2.1, "rank": 1, "incarnation": 1, "kind": "respawned", "detail": ""})
    rows = _rows(2, "ready")
    rows[1]["incarnation"] = 1
    m = feed.next()
    assert m is not None and [(t["rank"], t["state"]) for t in m["tiles"]] == [(1, "dead")]
    m = feed.next()
    assert m is not None and [(t["rank"], t["state"], t["incarnation"]) for t in m["tiles"]] == [
        (1, "ready", 1)]
    assert feed.next() is None
    # a death the tiles show anyway (respawning) is sent as it is
    events.append({"time": 3.0, "rank": 0, "incarnation": 0, "kind": "died", "detail": "SIGKILL"})
    rows = _rows(2, "ready")
    rows[1]["incarnation"] = 1
    rows[0]["state"] = "respawning"
    m = feed.next()
    assert m is not None and [(t["rank"], t["state"]) for t in m["tiles"]] == [(0, "respawning")]


def test_a_lost_host_is_sent_once_worded_as_status_words_it() -> None:
    """The feed sends the lost hosts' lines (``lost``) when they change, in
    the snapshot and in a delta, with the hint ``%monarch status`` prints."""
    store = MetricsStore(4)
    rows = _rows(4, "ready")
    feed = Feed(store, lambda: rows, lambda: [])
    snap = feed.next()
    assert snap is not None and snap["lost"] == []
    rows = _rows(4, "ready")
    for r in (3, 2):
        rows[r].update(state="lost", lost_host="hB")
    m = feed.next()
    assert m is not None and m["lost"] == [{
        "host": "hB", "ranks": "2,3",
        "hint": "mesh.add_hosts('HOST') gives the mesh a host for rank 2,3: they start there"}]
    assert feed.next() is None  # unchanged: not sent again
    rows = _rows(4, "ready")
    m = feed.next()
    assert m is not None and m["lost"] == []  # back: the page takes the line away
    assert feed.next() is None


def test_64_simulated_ranks_at_100_points_per_second() -> None:
    """64 ranks x 100 points/s for 5 s, polled like the dashboard thread:
    every message carries only new points, and a late view's snapshot is
    bounded per series."""
    world = 64
    store = MetricsStore(world)
    feed, th = Feed(store, lambda: _rows(world), lambda: []), Throttle(10)
    total, msgs = 0, 0
    for tick in range(500):  # 10 ms ticks: each rank logs one point per tick
        now = tick / 100
        for r in range(world):
            store.add(r, 0, [(tick, now, {"loss": 1.0 / (tick + 1), "acc": tick / 500})], now=now)
        if th.take(now):
            msg = feed.next()
            if msg:
                msgs += 1
                total += count_points(msg)
                json.dumps(msg, allow_nan=False)
    last = feed.next()
    total += count_points(last) if last else 0
    assert total == world * 500 * 2  # every point exactly once
    assert msgs <= 5 * 10 + 1
    snap = Feed(store, lambda: _rows(world), lambda: []).next()
    assert snap is not None and len(snap["series"]) == world * 2
    assert all(len(s) <= 2000 and s[-1] == 499 for _r, _n, s, _v in snap["series"])
    assert len(snap["tiles"]) == world


def test_tile_is_json_safe() -> None:
    row = _rows(1)[0]
    row["last"] = {"loss": math.nan}
    row["heartbeat_age"] = 7.4
    t = tile(row)
    assert t["last"] == {"loss": "nan"} and t["hb"] == 7
    json.dumps(t, allow_nan=False)


def test_health_probe_without_a_gpu_reports_cpu_and_rss_only() -> None:
    from monarch_nb.controller.metricstore import health_fields
    from monarch_nb.engine.health import HealthProbe

    h = HealthProbe().read()
    assert h["rss"] > 0 and h["cpu"] >= 0
    assert not {"mem", "mem_total", "util", "temp", "power"} & set(h)  # n/a, no error
    row = health_fields(h)
    assert row["gpu_mem_total"] is None and row["gpu_util"] is None and row["rss"] == h["rss"]
