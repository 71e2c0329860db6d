"""The collective flight recorder and what is read from it, without rank
processes: the recorder's wrapper over stand-in collectives (no process
group needed for the default group), the cross-rank analysis, stragglers,
the trace document and the death causes, all from scripted records."""

from __future__ import annotations

import json
import pickle
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from monarch_nb import flight
from monarch_nb.controller.analysis import collectives, timeline
from monarch_nb.controller.analysis.collectives import RankTail, analyze, stragglers
from monarch_nb.engine import context, flightrec
from monarch_nb.flight import OpRecord, mismatch_text
from monarch_nb.procs import deathcause
from monarch_nb.stacks import RankStacks, Stacks, hang_report

from .tracecheck import check_chrome_trace

CELL = "<mnb-cell-7>"


# -- the recorder --------------------------------------------------------------------
@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[flightrec.Recorder]:
    monkeypatch.setattr(context, "_state", {"rank": 0, "world_size": 4, "generation": 0})
    monkeypatch.setattr(flightrec, "_TORCH", [torch.__file__.rsplit("/", 1)[0] + "/"])
    yield flightrec.Recorder(size=5)


def fake_all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
    if isinstance(tensor, str):
        raise TypeError("not a tensor")


def fake_broadcast(tensor: Any, src: int | None = None, group: Any = None,
                   async_op: bool = False, group_src: int | None = None) -> None:
    return None


def test_records_op_tensors_caller_and_state(recorder: flightrec.Recorder) -> None:
    all_reduce = flightrec._wrap("all_reduce", fake_all_reduce, recorder)
    broadcast = flightrec._wrap("broadcast", fake_broadcast, recorder)
    all_reduce(torch.ones(8))
    broadcast(torch.zeros(4, 2, dtype=torch.float16), src=1)
    with pytest.raises(TypeError):
        all_reduce("bad")
    tail = recorder.tail()
    recs = [flight.decode(r) for r in tail["ops"]]
    assert [r.describe() for r in recs] == ["all_reduce(float32[8])",
                                            "broadcast(float16[4,2], src=1)", "all_reduce()"]
    assert [r.seq for r in recs] == [0, 1, 2]  # one count per group
    assert [r.state for r in recs] == ["done", "done", "failed"]
    assert recs[0].file == __file__ and recs[0].func == "test_records_op_tensors_caller_and_state"
    assert all(r.t1 is not None and r.t1 >= r.t0 for r in recs)
    assert tail["groups"] == {"0": [0, 1, 2, 3]}
    assert all_reduce.__name__ == "fake_all_reduce" and all_reduce.__wrapped__ is fake_all_reduce


def test_the_ring_keeps_the_newest(recorder: flightrec.Recorder) -> None:
    all_reduce = flightrec._wrap("all_reduce", fake_all_reduce, recorder)
    for _ in range(8):
        all_reduce(torch.ones(1))
    tail = recorder.tail()
    assert [r[2] for r in tail["ops"]] == [3, 4, 5, 6, 7] and tail["total"] == 8
    assert len(recorder.tail(2)["ops"]) == 2


def test_p2p_counts_apart_per_peer(recorder: flightrec.Recorder) -> None:
    def send(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
             group_dst: int | None = None) -> None:
        return None

    wrapped = flightrec._wrap("send", send, recorder)
    all_reduce = flightrec._wrap("all_reduce", fake_all_reduce, recorder)
    wrapped(torch.ones(2), 1)
    wrapped(torch.ones(2), dst=2)
    all_reduce(torch.ones(1))
    recs = [flight.decode(r) for r in recorder.tail()["ops"]]
    assert [(r.op, r.seq, r.peer) for r in recs] == [("send", 0, 1), ("send", 0, 2),
                                                      ("all_reduce", 0, None)]
    assert recs[0].describe() == "send(float32[2], dst=1)"


def test_install_wraps_the_namespace_and_keeps_torch_internals(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    real = dist.all_reduce
    internal = dist.distributed_c10d.all_reduce
    try:
        names = flightrec.install(flightrec.Recorder())
        assert "all_reduce" in names and "all_gather_object" in names
        assert dist.all_reduce is not real and dist.all_reduce.__wrapped__ is real  # type: ignore[attr-defined]
        assert flightrec.install() == []  # idempotent
        # torch's own helpers (all_gather_object -> all_gather) are not seen twice
        assert dist.distributed_c10d.all_reduce is internal
    finally:
        flightrec.uninstall()
    assert dist.all_reduce is real


def test_records_hold_no_tensor(recorder: flightrec.Recorder) -> None:
    import gc
    import weakref

    all_reduce = flightrec._wrap("all_reduce", fake_all_reduce, recorder)
    t = torch.ones(1000)
    ref = weakref.ref(t)
    all_reduce(t)
    del t
    gc.collect()
    assert ref() is None


# -- wording -----------------------------------------------------------------------
def rec(op: str, seq: int, tensors: str = "float32[8]", line: int = 12, state: str = "done",
        group: str = "0", root: int | None = None, t0: float = 0.0, t1: float | None = 0.0,
        func: str = "<module>") -> OpRecord:
    return OpRecord(op=op, group=group, seq=seq, tensors=tensors, root=root, file=CELL,
                    line=line, func=func, t0=t0, t1=None if state == "in flight" else t1,
                    state=state)


def test_mismatch_text_groups_ranks_by_call() -> None:
    text = mismatch_text("#58", "0", {0: rec("all_reduce", 58), 1: rec("all_reduce", 58),
                                      2: rec("broadcast", 58, "float32[4]", 14, root=0),
                                      3: rec("all_reduce", 58)})
    assert text == ("#58: ranks 0,1,3 called all_reduce(float32[8]) from <mnb-cell-7> line 12; "
                    "rank 2 called broadcast(float32[4], src=0) from <mnb-cell-7> line 14")
    text = mismatch_text("collective 1 of this call", "3", {0: rec("all_reduce", 0), 1: None},
                         {1: "finished the call without it"})
    assert text == ("collective 1 of this call on group 3: rank 0 called all_reduce(float32[8]) "
                    "from <mnb-cell-7> line 12; rank 1 finished the call without it")


def test_records_survive_the_wire() -> None:
    r = rec("reduce", 3, root=2, state="in flight")
    assert flight.decode(json.loads(json.dumps(flight.encode(r)))) == r


# -- analysis --------------------------------------------------------------------------
def tail(rank: int, *recs: OpRecord, world: int = 4) -> RankTail:
    return RankTail(rank, list(recs), {"0": tuple(range(world))})


def stack_at(rank: int, frames: list[list[Any]], busy: int = 5) -> RankStacks:
    return RankStacks(rank, "ok", [{"name": "MainThread", "main": True, "frames": frames}], busy)


def sleeping(rank: int) -> RankStacks:
    return stack_at(rank, [[CELL, 11, "<module>", "stuck_here()"],
                           [CELL, 9, "stuck_here", "time.sleep(600)"]])


def test_a_rank_that_skips_a_collective() -> None:
    done = [rec("all_reduce", s) for s in range(58)]
    tails = {r: tail(r, *done, rec("all_reduce", 58, state="in flight")) for r in (0, 1, 3)}
    tails[2] = tail(2, *done)
    report = analyze(tails, {2: sleeping(2)})
    assert report.summary() == [
        "ranks 0,1,3 wait in all_reduce #58 (<mnb-cell-7> line 12); rank 2 never entered it "
        "(its last was #57 all_reduce): it is in stuck_here (<mnb-cell-7> line 9): time.sleep(600)"]
    assert report.findings[0].kind == "missing" and report.findings[0].seq == 58
    assert ("the default group (ranks 0-3): ranks 0,1,3: #58 all_reduce(float32[8]) in flight; "
            "rank 2: #57 all_reduce(float32[8]) done") in report.render()


def test_a_different_op_on_one_rank() -> None:
    tails = {r: tail(r, rec("all_reduce", 0), rec("all_reduce", 1, state="in flight"))
             for r in (0, 1, 3)}
    tails[2] = tail(2, rec("all_reduce", 0), rec("broadcast", 1, "float32[4]", 14,
                                                 state="in flight", root=0))
    report = analyze(tails)
    assert report.findings[0].kind == "mismatch"
    assert report.summary()[0] == (
        "#1: ranks 0,1,3 called all_reduce(float32[8]) from <mnb-cell-7> line 12; "
        "rank 2 called broadcast(float32[4], src=0) from <mnb-cell-7> line 14")


def test_an_extra_collective_in_a_loop_on_one_rank() -> None:
    # ranks 0,1: all_reduce at line 4, five times; rank 2 also at line 6 each
    # time: its extras pair with the others' next ones, and it waits alone at the end
    normal = [rec("all_reduce", s, "float32[4]", 4) for s in range(5)]
    extra = [rec("all_reduce", s, "float32[4]", 4 if s % 2 == 0 else 6) for s in range(5)]
    extra.append(rec("all_reduce", 5, "float32[4]", 4, state="in flight"))
    idle = RankStacks(0, "ok", [{"name": "MainThread", "main": True, "frames": []}])
    report = analyze({0: tail(0, *normal, world=3), 1: tail(1, *normal, world=3),
                      2: tail(2, *extra, world=3)}, {0: idle, 1: idle})
    kinds = [f.kind for f in report.findings]
    assert kinds == ["missing", "diverged"]
    assert report.summary()[0] == (
        "rank 2 waits in all_reduce #5 (<mnb-cell-7> line 4); ranks 0,1 never entered it "
        "(their last was #4 all_reduce): they are idle (no call running)")
    assert report.summary()[1] == (
        "the ranks called the same collectives from different lines from #1: ranks 0,1 called "
        "all_reduce(float32[4]) from <mnb-cell-7> line 4; rank 2 called all_reduce(float32[4]) "
        "from <mnb-cell-7> line 6")


def test_agreeing_ranks_have_no_finding_and_old_generations_are_ignored() -> None:
    ok = {r: tail(r, rec("all_reduce", 0), rec("barrier", 1, "")) for r in range(4)}
    report = analyze(ok)
    assert report.ok and "the ranks agree" in repr(report)
    # rank 3 was respawned: its old records (generation 0) are not compared
    old = RankTail(3, [rec("broadcast", 0)], {"0": (0, 1, 2, 3)}, generation=0)
    new = {r: RankTail(r, [OpRecord("all_reduce", "0", 0, "float32[8]", generation=1)],
                       {"0": (0, 1, 2, 3)}, generation=1) for r in range(3)}
    assert analyze({**new, 3: old}).ok


def test_an_enqueued_collective_others_never_called() -> None:
    # NCCL: the call returns once enqueued; ranks 0,1,3 block later, at a sync
    done = [rec("all_reduce", s) for s in range(58)]
    tails = {r: tail(r, *done, rec("all_reduce", 58, state="issued")) for r in (0, 1, 3)}
    tails[2] = tail(2, *done)
    busy = {r: stack_at(r, [[CELL, 13, "<module>", "x.item()"]], busy=5) for r in (0, 1, 3)}
    report = analyze(tails, {**busy, 2: sleeping(2)})
    assert report.summary() == [
        "ranks 0,1,3 enqueued all_reduce #58 (<mnb-cell-7> line 12), which completes only "
        "once every member calls it; rank 2 never called it (its last was #57 all_reduce): "
        "it is in stuck_here (<mnb-cell-7> line 9): time.sleep(600)"]
    # the same records with ranks 0,1,3 idle (their call returned): nothing stuck
    idle = {r: stack_at(r, [], busy=0) for r in (0, 1, 3)}
    assert analyze(tails, {**idle, 2: sleeping(2)}).ok


def test_silent_ranks_and_every_member_waiting() -> None:
    tails = {r: tail(r, rec("all_reduce", 0, state="in flight"), world=2) for r in (0, 1)}
    report = analyze(tails, silent={2: "dead"})
    assert [f.kind for f in report.findings] == ["waiting", "silent"]
    assert "every member is in it" in report.summary()[0]
    assert report.summary()[1] == "rank 2 did not answer (dead)"


def test_subgroups_are_compared_among_their_members() -> None:
    sub = {"0": (0, 1, 2, 3), "1": (0, 1)}
    t0 = RankTail(0, [rec("all_reduce", 0, group="1", state="in flight")], sub)
    t1 = RankTail(1, [], sub)
    t2 = RankTail(2, [], sub)
    report = analyze({0: t0, 1: t1, 2: t2}, {1: sleeping(1)})
    assert report.summary() == [
        "rank 0 waits in all_reduce #0 (<mnb-cell-7> line 12); rank 1 never entered it "
        "(it made none yet): it is in stuck_here (<mnb-cell-7> line 9): time.sleep(600)"]
    assert report.findings[0].group == "1"


# -- torch's own recorder (DDP's and FSDP's collectives) ---------------------------------
def fr_entry(seq: int, name: str = "gloo:all_reduce", retired: bool = True, pg: int = 0,
             group: str = "0", sizes: Any = ((20,),), dtypes: Any = ("Float",)) -> dict[str, Any]:
    """One entry as torch's _dump_fr_trace_json writes it."""
    return {"collective_seq_id": seq, "profiling_name": name, "process_group": [group, "default_pg"],
            "pg_id": pg, "input_sizes": [list(x) for x in sizes], "input_dtypes": list(dtypes),
            "is_p2p": False, "retired": retired, "state": "scheduled",
            "time_created_ns": 1_000_000_000 * (100 + seq)}


def test_torch_entries_become_records() -> None:
    r = flight.from_torch(fr_entry(6, "gloo:broadcast", retired=False, dtypes=("Int",),
                                   sizes=((3,),)), generation=2)
    assert r == OpRecord("broadcast", "0", 6, "int32[3]", file=flight.INSIDE_TORCH, t0=106.0,
                         t1=None, state="in flight", generation=2)
    assert r.where() == "inside torch: DDP, FSDP or another C++ caller"
    done = flight.from_torch(fr_entry(7, "nccl:all_reduce", sizes=((4, 2), (4, 2)),
                                      dtypes=("Float", "Float")))
    assert done is not None and (done.op, done.tensors, done.state, done.t1) == (
        "all_reduce", "float32[4,2] x2", "done", 107.0)
    mixed = flight.from_torch(fr_entry(8, sizes=((2,), (3,)), dtypes=("BFloat16", "Long")))
    assert mixed is not None and mixed.tensors == "bfloat16[2], int64[3]"
    assert flight.from_torch({**fr_entry(9), "is_p2p": True}) is None
    assert flight.from_torch({"profiling_name": "gloo:x"}) is None  # malformed: dropped
    assert flight.from_torch({**fr_entry(9), "collective_seq_id": "nine"}) is None


def test_only_the_live_groups_torch_entries_count() -> None:
    # generation 0's default group (pg 0, an op aborted in flight) and its
    # subgroup (pg 1); the re-formed default group is pg 2, its subgroup pg 3
    old = [fr_entry(1, pg=0), fr_entry(2, pg=0, retired=False), fr_entry(1, pg=1, group="1")]
    new = [fr_entry(1, pg=2), fr_entry(1, pg=3, group="5")]
    stale_sub = [fr_entry(2, pg=1, group="1", retired=False)]
    kept = flight.current_torch_entries(old + stale_sub + new + [{"junk": 1}])
    assert [(e["process_group"][0], e["pg_id"]) for e in kept] == [("0", 2), ("5", 3)]


def test_a_hang_in_ddps_collectives_is_found_in_torchs_records() -> None:
    # the wrappers saw the cell's own all_reduces, all agreeing; DDP's
    # gradient all_reduce (#9 in torch's numbering) waits on ranks 0,1
    ours = [rec("all_reduce", 0)]
    mine = [flight.from_torch(fr_entry(s)) for s in range(1, 9)]
    stuck = flight.from_torch(fr_entry(9, retired=False))
    tails = {r: RankTail(r, list(ours), {"0": (0, 1, 2)},
                         torch_ops=[x for x in [*mine, stuck] if x is not None]) for r in (0, 1)}
    tails[2] = RankTail(2, list(ours), {"0": (0, 1, 2)},
                        torch_ops=[x for x in mine if x is not None])
    report = analyze(tails, {2: sleeping(2)})
    assert report.summary() == [
        "torch's own recorder (DDP's and FSDP's collectives too; its numbering): ranks 0,1 "
        "wait in all_reduce #9 (inside torch: DDP, FSDP or another C++ caller); rank 2 never "
        "entered it (its last was #8 all_reduce): it is in stuck_here (<mnb-cell-7> line 9): "
        "time.sleep(600)"]
    assert ("last collective per group in torch's own recorder (DDP's and FSDP's collectives "
            "too; its numbering):\n  the default group (ranks 0-2): ranks 0,1: #9 "
            "all_reduce(float32[20]) in flight; rank 2: #8 all_reduce(float32[20]) done"
            ) in report.render()
    # where the wrappers' own records already tell the story, torch's are not repeated
    wrapped = {r: RankTail(r, [rec("all_reduce", 0, state="in flight")], {"0": (0, 1, 2)},
                           torch_ops=[x for x in [*mine, stuck] if x is not None])
               for r in (0, 1)}
    wrapped[2] = RankTail(2, [], {"0": (0, 1, 2)}, torch_ops=[x for x in mine if x is not None])
    texts = analyze(wrapped, {2: sleeping(2)}).summary()
    assert len(texts) == 1 and texts[0].startswith("ranks 0,1 wait in all_reduce #0"), texts
    # every rank done in torch's records too: nothing to say
    calm = {r: RankTail(r, list(ours), {"0": (0, 1, 2)},
                        torch_ops=[x for x in mine if x is not None]) for r in range(3)}
    assert analyze(calm).ok and "in torch's own recorder" not in analyze(calm).render()


def test_the_oldest_collective_waited_in_is_the_one_named() -> None:
    # gloo's broadcast root (rank 0) waits in #8 for rank 2, which never
    # came; rank 1 got #8 and went on to wait in #9
    upto = [rec("all_reduce", s) for s in range(8)]
    tails = {0: tail(0, *upto, rec("broadcast", 8, root=0, state="in flight"), world=3),
             1: tail(1, *upto, rec("broadcast", 8, root=0), rec("broadcast", 9, root=0,
                                                                  state="in flight"), world=3),
             2: tail(2, *upto, world=3)}
    report = analyze(tails, {2: sleeping(2)})
    assert report.summary() == [
        "rank 0 waits in broadcast #8 (<mnb-cell-7> line 12); rank 2 never entered it (its last "
        "was #7 all_reduce): it is in stuck_here (<mnb-cell-7> line 9): time.sleep(600); "
        "rank 1 waits in broadcast #9 (<mnb-cell-7> line 12)"]


def test_stacks_print_the_findings_first() -> None:
    st = Stacks({0: sleeping(0)})
    st.collectives = ["ranks 1,2 wait in all_reduce #3; rank 0 never entered it"]
    text = st.render()
    assert text.splitlines()[:2] == ["collectives (flight recorder):",
                                     "  ranks 1,2 wait in all_reduce #3; rank 0 never entered it"]
    assert "collectives (flight recorder):" in hang_report(st, 5)


# -- stragglers -------------------------------------------------------------------------
def paced(rank: int, compute: float, steps: int = 25, wait_total: float = 0.09) -> RankTail:
    """A rank that computes ``compute`` s then waits in all_reduce until the
    slowest (``wait_total`` s per step in all) arrives."""
    t, recs = 0.0, []
    for s in range(steps):
        t += compute
        end = t + (wait_total - compute) + 0.001
        recs.append(rec("all_reduce", s, t0=t, t1=end))
        t = end
    return RankTail(rank, recs, {"0": (0, 1, 2, 3)})


def test_a_rank_three_times_slower_is_flagged() -> None:
    tails = {0: paced(0, 0.03), 1: paced(1, 0.09), 2: paced(2, 0.03), 3: paced(3, 0.03)}
    report = stragglers(tails)
    assert report.slow == [1]
    assert report.ranks[1].ratio == pytest.approx(3.0, rel=0.05)
    assert report.ranks[0].wait_s > 5 * report.ranks[1].wait_s  # the others wait for it
    text = report.render()
    assert text.startswith("stragglers: rank 1 consistently slower (>= 1.5x the median compute")
    assert "<- slow" in text and "the last 20 collectives of the default group" in text
    # steps from mnb.log set the window: 10 steps/s -> the last 2 s
    windowed = stragglers(tails, {0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0}, window_steps=5)
    assert "the last 5 steps" in windowed.window and windowed.slow == [1]


def test_a_straggler_in_ddps_collectives_is_found_by_arrival() -> None:
    # torch's own records only (the wrappers saw nothing): no end times
    # (gloo), so each collective ends when its last member arrives
    def arrivals(rank: int, compute: float) -> RankTail:
        recs = [OpRecord("all_reduce", "0", s, "float32[20]", file=flight.INSIDE_TORCH,
                         t0=s * 0.09 + compute, t1=s * 0.09 + compute) for s in range(1, 26)]
        return RankTail(rank, [], {"0": (0, 1, 2, 3)}, torch_ops=recs)

    tails = {0: arrivals(0, 0.03), 1: arrivals(1, 0.09), 2: arrivals(2, 0.03), 3: arrivals(3, 0.03)}
    report = stragglers(tails)
    assert report.slow == [1]
    assert report.ranks[0].wait_s > 5 * report.ranks[1].wait_s
    assert report.window.endswith("in torch's own recorder (DDP's and FSDP's collectives too; "
                                  "its numbering)")
    even = {r: arrivals(r, 0.05 + 0.002 * r) for r in range(4)}
    assert stragglers(even).slow == [] and stragglers(even).ranks
    # the wrappers' records, where there are some, come first
    mixed = {r: RankTail(r, paced(r, 0.09 if r == 2 else 0.03).ops, {"0": (0, 1, 2, 3)},
                         torch_ops=tails[r].torch_ops) for r in range(4)}
    assert stragglers(mixed).slow == [2]
    # ... unless the ranks trained through DDP since: torch's records are newer
    later = {r: RankTail(r, t.ops, t.groups, torch_ops=[
        OpRecord(x.op, x.group, x.seq, x.tensors, file=x.file, t0=x.t0 + 5, t1=x.t0 + 5)
        for x in tails[r].torch_ops]) for r, t in mixed.items()}
    assert stragglers(later).slow == [1]


def test_even_ranks_are_not_flagged_and_no_data_says_so() -> None:
    tails = {r: paced(r, 0.05 + 0.005 * r) for r in range(4)}
    assert stragglers(tails).slow == []
    assert "no collectives recorded" in stragglers({}).render()


# -- the dashboard's badge and straggler marks ----------------------------------------------
def test_the_badge_shows_the_findings_and_the_slow_ranks() -> None:
    from monarch_nb.controller.metricstore import MetricsStore
    from monarch_nb.ui.dashfeed import BADGE_WAIT_S, NO_FLIGHT, Feed, flight_view

    done = [rec("all_reduce", s) for s in range(58)]
    tails = {r: tail(r, *done, rec("all_reduce", 58, state="in flight", t0=1000.0))
             for r in (0, 1, 3)}
    tails[2] = tail(2, *done)
    for t in tails.values():  # ranks 0,1,3 have waited in #58 for 0.5 s
        t.now = 1000.5
    # a wait that short is a slower rank, not news: no badge
    assert flight_view(analyze(tails, {2: sleeping(2)}), None) == NO_FLIGHT
    for t in tails.values():
        t.now = 1000.0 + BADGE_WAIT_S
    view = flight_view(analyze(tails, {2: sleeping(2)}, {4: "dead"}),
                       stragglers({0: paced(0, 0.03), 1: paced(1, 0.09), 2: paced(2, 0.03),
                                   3: paced(3, 0.03)}))
    # a rank that did not answer is left out: its tile shows it down already
    assert view == {"findings": [
        "ranks 0,1,3 wait in all_reduce #58 (<mnb-cell-7> line 12); rank 2 never entered it "
        "(its last was #57 all_reduce): it is in stuck_here (<mnb-cell-7> line 9): "
        "time.sleep(600)"], "slow": {"1": 3.0}}
    json.dumps(view)
    rows = [{"rank": r, "state": "busy"} for r in range(4)]
    feed = Feed(MetricsStore(4), lambda: rows, lambda: [])
    snap = feed.next()
    assert snap is not None and snap["flight"] == NO_FLIGHT
    assert feed.next() is None
    feed.flight = view
    assert feed.next() == {"t": "delta", "flight": view}
    assert feed.next() is None  # sent once
    feed.flight = NO_FLIGHT
    assert feed.next() == {"t": "delta", "flight": NO_FLIGHT}  # cleared
    # a recv in flight for 0.1 s is not news, whatever an older recv of the
    # same number (from another peer, long done) says
    old = OpRecord(op="recv", group="0", seq=0, peer=3, t0=900.0, t1=901.0)
    new = OpRecord(op="recv", group="0", seq=0, peer=1, t0=999.9, t1=None, state="in flight")
    p2p = {0: RankTail(0, [old, new], {"0": (0, 1, 2, 3)}, now=1000.0)}
    found = analyze(p2p)
    assert [f.kind for f in found.findings] == ["p2p"]
    assert flight_view(found, None) == NO_FLIGHT
    p2p[0].now = 1000.0 + BADGE_WAIT_S
    assert flight_view(found, None)["findings"] == [
        "rank 0 waits in recv(src=1) (an unknown place)"]


def test_the_recorders_are_read_while_calls_run_and_once_after() -> None:
    from monarch_nb.ui.dashfeed import FlightWatch

    w = FlightWatch(every=2.0)
    assert not w.due(0.0, busy=False)  # idle mesh: never asked
    assert w.due(1.0, busy=True)
    assert not w.due(2.0, busy=True)  # not before 2 s
    assert w.due(3.0, busy=True)
    assert not w.due(4.0, busy=False)
    assert w.due(5.0, busy=False)  # once more after the call ended
    assert not w.due(9.0, busy=False) and not w.due(30.0, busy=False)



# -- dead incarnations -----------------------------------------------------------------
def _dead(rank: int, incarnation: int, *recs: OpRecord, call: dict[str, Any] | None = None,
          died_at: float | None = None) -> RankTail:
    """A dead incarnation's tail as the inspector makes it (flight.dead_tail)."""
    wire = flight.dead_tail(call or {}, list(recs), incarnation, died_at)
    return RankTail.from_wire(rank, json.loads(json.dumps(wire)))


def _gen(r: OpRecord, generation: int) -> OpRecord:
    return OpRecord(**{**r.__dict__, "generation": generation})


def test_a_dead_incarnation_of_an_earlier_generation_is_lined_up_with_its_peers() -> None:
    # rank 2 died in #5 of generation 0 (a shape the others did not use);
    # it was respawned, the group re-formed (generation 1), and the others'
    # rings still hold generation 0's records
    done = [rec("all_reduce", s) for s in range(5)]
    old = [*done, rec("all_reduce", 5, state="failed")]
    new = [_gen(rec("all_reduce", 0, line=20), 1)]
    tails = {r: RankTail(r, [*old, *new], {"0": (0, 1, 2)}, generation=1) for r in (0, 1)}
    tails[2] = RankTail(2, list(new), {"0": (0, 1, 2)}, generation=1)  # the new incarnation
    assert analyze(tails).ok  # without its dead incarnation nothing is seen
    dead = _dead(2, 0, *done, rec("all_reduce", 5, "float32[4]", state="in flight"),
                 call={"call": 9, "name": CELL, "t0": 0.0}, died_at=3.0)
    assert dead.dead == 0 and dead.ops[-1].state == flight.DIED and dead.ops[-1].t1 is None
    report = analyze(tails, dead=[dead])
    assert report.summary() == [
        "before rank 2 died: #5: ranks 0,1 called all_reduce(float32[8]) from <mnb-cell-7> "
        "line 12; rank 2 called all_reduce(float32[4]) from <mnb-cell-7> line 12",
        "rank 2 died in #5 all_reduce(float32[4]) from <mnb-cell-7> line 12 (incarnation 0; "
        "its persisted records)"]
    assert [f.kind for f in report.findings] == ["mismatch", "died"]
    text = report.render()
    assert ("  before rank 2 died: the default group (ranks 0-2): ranks 0,1: #5 "
            "all_reduce(float32[8]) failed; rank 2: #5 all_reduce(float32[4]) died in it") in text
    assert "  the default group (ranks 0-2): ranks 0-2: #0 all_reduce(float32[8]) done" in text
    assert report.dead == [dead]
    # a dead incarnation's records without a tensor of its own: "died" alone
    agreeing = _dead(2, 0, *done, rec("all_reduce", 5, state="in flight"))
    assert [f.kind for f in analyze(tails, dead=[agreeing]).findings] == ["died"]


def test_a_dead_rank_that_is_not_back_stands_for_itself() -> None:
    # respawn off: rank 2 did not answer; its persisted records are its last
    # word, in the current generation: the others wait in #5, it died in #4
    done = [rec("all_reduce", s) for s in range(5)]
    tails = {r: tail(r, *done, rec("all_reduce", 5, state="in flight"), world=3)
             for r in (0, 1)}
    dead = _dead(2, 0, *done[:4], rec("all_reduce", 4, "float32[4]", state="in flight"))
    report = analyze(tails, {}, {2: "dead"}, dead=[dead])
    assert report.summary() == [
        "#4: ranks 0,1 called all_reduce(float32[8]) from <mnb-cell-7> line 12; rank 2 called "
        "all_reduce(float32[4]) from <mnb-cell-7> line 12",
        "rank 2 died in #4 all_reduce(float32[4]) from <mnb-cell-7> line 12 (incarnation 0; its "
        "persisted records)",
        "ranks 0,1 wait in all_reduce #5 (<mnb-cell-7> line 12); rank 2 never entered it (its "
        "last was #4 all_reduce): it is dead (incarnation 0)",
        "rank 2 did not answer (dead)"]


def test_the_hang_summary_has_the_dead() -> None:
    from monarch_nb.controller.inspector import collective_summary

    stacks = Stacks({0: RankStacks(0, "ok"), 1: RankStacks(1, "dead")})
    assert collective_summary(stacks) == []  # no recorder answered, no dead: nothing to add
    stacks.dead = [_dead(1, 3, rec("broadcast", 0, root=0, state="in flight"))]
    assert collective_summary(stacks) == [
        "rank 1 died in #0 broadcast(float32[8], src=0) from <mnb-cell-7> line 12 (incarnation "
        "3; its persisted records)"]


def test_the_trace_draws_earlier_incarnations_on_their_ranks_track() -> None:
    t0 = 1_000.0
    new = RankTail(1, [rec("all_reduce", 0, t0=t0 + 2.0, t1=t0 + 2.1)], {"0": (0, 1)},
                   generation=1, now=t0 + 3.0, calls=[[9, CELL, t0 + 1.9, t0 + 2.2, "done"]])
    dead = _dead(1, 0, rec("all_reduce", 3, t0=t0 + 0.1, t1=t0 + 0.2),
                 rec("all_reduce", 4, "float32[4]", t0=t0 + 0.3, state="in flight"),
                 call={"call": 7, "name": "<mnb-cell-6>", "t0": t0}, died_at=t0 + 0.5)
    events = [{"time": t0 + 0.5, "rank": 1, "incarnation": 0, "kind": "died", "detail": ""},
              {"time": t0 + 1.0, "rank": 1, "incarnation": 1, "kind": "respawned", "detail": ""}]
    doc = json.loads(json.dumps(timeline.chrome_trace({1: new}, events, earlier=[dead])))
    check_chrome_trace(doc)
    ev = doc["traceEvents"]
    assert {(e["pid"], e["args"]["name"]) for e in ev if e["name"] == "process_name"} == {
        (1, "rank 1"), (2, "mesh")}
    slices = [(e["tid"], e["name"], e["ts"], e["dur"], e["args"].get("incarnation"))
              for e in ev if e["ph"] == "X"]
    assert slices == [
        (timeline.CALLS_TID, "<mnb-cell-6>", 0.0, 500000.0, 0),
        (timeline.COLLECTIVES_TID, "all_reduce #3", 100000.0, 100000.0, 0),
        (timeline.COLLECTIVES_TID, "all_reduce #4", 300000.0, 200000.0, 0),  # to its death
        (timeline.CALLS_TID, CELL, 1900000.0, 300000.0, None),
        (timeline.COLLECTIVES_TID, "all_reduce #0", 2000000.0, 100000.0, None)]
    assert all(e["pid"] == 1 for e in ev if e["ph"] == "X")
    inst = [(e["tid"], e["name"], e["ts"]) for e in ev if e["ph"] == "i"]
    assert (timeline.COLLECTIVES_TID, "died in all_reduce #4", 500000.0) in inst
    assert (timeline.CALLS_TID, "died", 500000.0) in inst
    assert (timeline.CALLS_TID, "respawned", 1000000.0) in inst
    died = next(e for e in ev if e["name"] == "all_reduce #4")
    assert died["args"]["state"] == flight.DIED and died["args"]["op"] == "all_reduce(float32[4])"


# -- the trace ---------------------------------------------------------------------------
def test_chrome_trace_has_a_track_per_rank() -> None:
    t0 = 1_000.0
    tails = {r: RankTail(r, [rec("all_reduce", 0, t0=t0 + 0.1, t1=t0 + 0.2),
                             rec("all_reduce", 1, t0=t0 + 0.3, state="in flight")],
                         {"0": (0, 1)}, now=t0 + 0.5,
                         calls=[[7, CELL, t0, t0 + 0.25, "done"]]) for r in (0, 1)}
    events = [{"time": t0 + 0.4, "rank": 1, "incarnation": 0, "kind": "died",
               "detail": "killed by SIGKILL"},
              {"time": t0 + 0.45, "rank": -1, "incarnation": 0, "kind": "reformed", "detail": ""}]
    doc = json.loads(json.dumps(timeline.chrome_trace(tails, events, {0: [(t0 + 0.2, 3)]})))
    ev = doc["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in ev if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1"), (2, "mesh")}
    slices = [e for e in ev if e["ph"] == "X" and e["pid"] == 0]
    assert [(s["name"], s["ts"], s["dur"]) for s in slices] == [
        (CELL, 0.0, 250000.0), ("all_reduce #0", 100000.0, 100000.0),
        ("all_reduce #1", 300000.0, 200000.0)]
    assert slices[2]["args"]["state"] == "in flight"
    assert slices[1]["args"]["op"] == "all_reduce(float32[8])"
    inst = {(e["pid"], e["name"]) for e in ev if e["ph"] == "i"}
    assert (1, "died: killed by SIGKILL") in inst and (2, "reformed") in inst
    assert [e["args"] for e in ev if e["ph"] == "C"] == [{"step": 3}]
    assert doc["otherData"]["start_unix_s"] == t0
    check_chrome_trace(doc)
    # the checker itself: slices that overlap without nesting, a slice with no dur
    bad = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}},
        {"ph": "X", "name": "a", "pid": 0, "tid": 2, "ts": 0, "dur": 10},
        {"ph": "X", "name": "b", "pid": 0, "tid": 2, "ts": 5, "dur": 10}]}
    with pytest.raises(AssertionError, match=r"'b' .* overlaps 'a' without nesting"):
        check_chrome_trace(bad)
    bad["traceEvents"][2] = {"ph": "X", "name": "b", "pid": 0, "tid": 2, "ts": 5}
    with pytest.raises(AssertionError, match="bad dur"):
        check_chrome_trace(bad)
    bad["traceEvents"][2] = {"ph": "X", "name": "b", "pid": 0, "tid": 2, "ts": 2, "dur": 3}
    check_chrome_trace(bad)  # nested: fine


# -- death causes --------------------------------------------------------------------------
FAULT = """\
Fatal Python error: Segmentation fault

Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/ctypes/__init__.py", line 519 in string_at
  File "<mnb-cell-3>", line 2 in <module>
  File "/work/main/monarch_nb/engine/worker.py", line 381 in _run_cell
  File "/work/main/monarch_nb/engine/worker.py", line 202 in _execute

Extension modules: torch._C (total: 1)""".splitlines()


def test_a_crash_names_the_crashing_frame_and_the_user_line() -> None:
    hint = deathcause.explain(-signal.SIGSEGV, FAULT)
    assert hint == ("Segmentation fault in string_at (ctypes/__init__.py line 519), "
                    "called from <mnb-cell-3> line 2")
    assert deathcause.explain(-signal.SIGABRT, ["no dump"]) == ""


# torch's own fatal-signal handler (c10's) writes every thread's native stack
# first; the crashing thread is the one that went through fatalSignalHandler
NATIVE = """\
SIGSEGV(11), PID: 7, Thread 8: \n\
 frame #0: c10::FatalSignalHandler::stacktraceSignalHandler(bool) + 0x8f (0x7f3d0099 in /v/torch/lib/libc10.so)
frame #1: <unknown function> + 0x3c050 (0x7f3d02c5 in /lib/x86_64-linux-gnu/libc.so.6)
frame #2: pthread_cond_wait + 0x1e8 (0x7f3d02c9 in /lib/x86_64-linux-gnu/libc.so.6)

SIGSEGV(11), PID: 7, Thread 7: \n\
 frame #0: c10::FatalSignalHandler::stacktraceSignalHandler(bool) + 0x8f (0x7f3d0099 in /v/torch/lib/libc10.so)
frame #1: c10::FatalSignalHandler::fatalSignalHandler(int, siginfo_t*) + 0x2da (0x7f3d0099 in /v/torch/lib/libc10.so)
frame #2: <unknown function> + 0x3c050 (0x7f3d02c5 in /lib/x86_64-linux-gnu/libc.so.6)
frame #3: <unknown function> + 0x167ad8 (0x7f3d02d7 in /lib/x86_64-linux-gnu/libc.so.6)
frame #4: at::native::add_kernel(at::TensorIterator&) + 0x10 (0x7f3d0286 in /v/torch/lib/libtorch_cpu.so)
frame #5: ffi_call + 0xcd (0x7f3d0284 in /lib/x86_64-linux-gnu/libffi.so.8)
<omitting python frames>
frame #9: __libc_start_main + 0x85 (0x7f3d02c3 in /lib/x86_64-linux-gnu/libc.so.6)

""".splitlines()


def test_a_crash_names_its_native_frames_and_gives_the_whole_stack() -> None:
    hint = deathcause.explain(-signal.SIGSEGV, NATIVE + FAULT)
    assert hint == ("Segmentation fault in string_at (ctypes/__init__.py line 519), "
                    "called from <mnb-cell-3> line 2; native: libc.so.6+0x167ad8 <- "
                    "at::native::add_kernel(at::TensorIterator&) (libtorch_cpu.so) <- "
                    "ffi_call (libffi.so.8)")
    assert deathcause.crash_stack(NATIVE + FAULT) == [
        "Python (most recent call first):",
        "  string_at (ctypes/__init__.py line 519)",
        "  <mnb-cell-3> line 2",
        "  _run_cell (/work/main/monarch_nb/engine/worker.py line 381)",
        "  _execute (/work/main/monarch_nb/engine/worker.py line 202)",
        "native (most recent call first):",
        "  libc.so.6+0x167ad8",
        "  at::native::add_kernel(at::TensorIterator&) (libtorch_cpu.so)",
        "  ffi_call (libffi.so.8)",
        "  (Python frames)",
        "  __libc_start_main (libc.so.6)"]
    # native frames alone (no faulthandler dump), and neither: nothing made up
    assert deathcause.explain(-signal.SIGSEGV, NATIVE).startswith("SIGSEGV; native: libc.so.6")
    assert deathcause.crash_stack(["plain output"]) == []
    # only the other threads' dumps (the crashing one cut off): no native part
    assert deathcause.crash_stack(NATIVE[:4]) == []
    assert deathcause.is_crash(-signal.SIGABRT) and not deathcause.is_crash(-signal.SIGKILL)
    assert not deathcause.is_crash(1)


def test_sigkill_not_ours_points_at_the_oom_killer() -> None:
    gib = 2**30
    assert deathcause.explain(-9, [], last_rss=6 * gib, mem_total=16 * gib) == (
        "probably the OOM killer, last RSS 6,144 MiB of 16,384 MiB")
    low = deathcause.explain(-9, [], last_rss=100 * 2**20, mem_total=16 * gib)
    assert low.startswith("SIGKILL that monarch_nb did not send, last RSS 100 MiB")
    assert deathcause.explain(-9, [], last_rss=6 * gib, mem_total=16 * gib,
                              sent=[signal.SIGKILL]) == ""  # %monarch kill: no guess


def test_sigkill_in_a_memory_cgroup_names_its_limit(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from monarch_nb.engine import health

    mib = 2**20
    assert deathcause.explain(-9, [], last_rss=500 * mib, mem_total=16 * 2**30,
                              mem_limit=256 * mib, mem_used=230 * mib) == (
        "probably the kernel's OOM killer: its memory cgroup was last seen at 230 MiB of its "
        "256 MiB limit, last RSS seen 500 MiB")
    assert deathcause.explain(-9, [], last_rss=500 * mib, mem_limit=256 * mib,
                              mem_used=20 * mib).startswith(
        "SIGKILL that monarch_nb did not send; its memory cgroup was last seen at 20 MiB of its "
        "256 MiB limit, last RSS seen 500 MiB: the kernel's OOM killer if memory grew fast")
    # the heartbeat's reading: v1 and v2 layouts, "max" and a limit above the machine's: none
    monkeypatch.setattr(health, "_CGROUP_ROOT", str(tmp_path))
    v1 = tmp_path / "memory" / "jobs" / "r0"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{256 * mib}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{100 * mib}\n")
    assert health._memory_files("5:memory:/jobs/r0\n0::/\n") == (
        str(v1 / "memory.limit_in_bytes"), str(v1 / "memory.usage_in_bytes"))
    v2 = tmp_path / "user.slice" / "job"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text("1234\n")
    assert health._memory_files("0::/user.slice/job\n") == (
        str(v2 / "memory.max"), str(v2 / "memory.current"))
    assert health._memory_files("0::/nowhere\n") is None
    monkeypatch.setattr(health, "_cgroup_files", {})
    real_open = open

    def fake_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if path == "/proc/self/cgroup":
            path = tmp_path / "cgroup"
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    (tmp_path / "cgroup").write_text("5:memory:/jobs/r0\n")
    assert health._cgroup_memory() == (256 * mib, 100 * mib)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited (v1)
    assert health._cgroup_memory() is None
    (tmp_path / "cgroup").write_text("0::/user.slice/job\n")
    assert health._cgroup_memory() is None  # "max"


def test_a_collective_timeout_is_named_from_the_backends_line() -> None:
    nccl = ["[rank1]:[E ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=58, OpType=ALLREDUCE, NumelIn=8, NumelOut=8, "
            "Timeout(ms)=600000) ran for 600042 milliseconds before timing out.",
            "Fatal Python error: Aborted"]
    assert deathcause.explain(-int(signal.SIGABRT), nccl).startswith(
        "a collective timed out: [rank1]:[E ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=58, OpType=ALLREDUCE")
    gloo = ["Traceback (most recent call last):", '  File "<mnb-cell-3>", line 2, in <module>',
            "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
            "1800000ms for recv operation to complete"]
    assert deathcause.explain(1, gloo) == (
        "a collective timed out: RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:81] Timed "
        "out waiting 1800000ms for recv operation to complete")
    assert deathcause.explain(0, gloo) == ""  # a clean exit is not a death's cause


def test_an_exit_after_an_exception_names_it() -> None:
    tail = ["Traceback (most recent call last):", '  File "<mnb-cell-4>", line 4, in <module>',
            "    bytearray(1 << 62)", "MemoryError"]
    assert deathcause.explain(1, tail) == "out of memory: its last exception was MemoryError"
    tail[-1] = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert deathcause.explain(1, tail).startswith("out of memory: its last exception was "
                                                  "torch.OutOfMemoryError: CUDA out of memory")
    assert deathcause.explain(3, ["controller silent for 10 s, exiting"]) == ""
    assert deathcause.explain(0, tail) == ""


def _rec(seq: int, tensors: str, state: str = flight.IN_FLIGHT, op: str = "all_reduce",
         line: int = 3) -> OpRecord:
    return OpRecord(op=op, group="0", seq=seq, tensors=tensors, file="<mnb-cell-7>", line=line,
                    func="<module>", t0=1.0, state=state)


def test_a_death_in_a_collective_names_the_other_ranks_side() -> None:
    dead = ({}, [_rec(3, "float32[8]", flight.DONE), _rec(4, "float32[4]")])
    theirs = [_rec(3, "float32[8]", flight.DONE), _rec(4, "float32[8]")]
    abort = -int(signal.SIGABRT)
    hint = deathcause.explain(abort, [], flight=dead, peers={0: theirs, 1: theirs})
    assert hint == ("in all_reduce #4 of float32[4] from <mnb-cell-7> line 3, while ranks 0,1 "
                    f"called all_reduce #4 of float32[8] ({deathcause.STRICT_HINT})"), hint
    assert "--check-collectives" in hint and "check_collectives=True" in hint
    # agreeing peers and one not there yet: no desync, no strict mode
    kill = -int(signal.SIGKILL)
    same = [_rec(4, "float32[4]")]
    hint = deathcause.flight_hint(kill, {}, dead[1], peers={0: same, 2: [_rec(3, "float32[8]")]})
    assert hint == ("in all_reduce #4 of float32[4] from <mnb-cell-7> line 3, with rank 0 in it "
                    "too, rank 2 had not reached it"), hint
    # a different op at the same number, from another line
    other = [_rec(4, "float32[4]", op="broadcast", line=5)]
    hint = deathcause.flight_hint(kill, {}, dead[1], peers={1: other})
    assert hint.startswith("in all_reduce #4 of float32[4] from <mnb-cell-7> line 3, while rank "
                           "1 called broadcast #4 of float32[4] from <mnb-cell-7> line 5 ("), hint
    # records of another generation are not this collective's
    old = [OpRecord(op="all_reduce", group="0", seq=4, tensors="float32[8]", generation=1)]
    hint = deathcause.flight_hint(abort, {}, dead[1], peers={1: old})
    assert hint.endswith("line 3, rank 1 had not reached it"), hint
    # no peer readable (a remote launcher): the hedged hint
    hint = deathcause.flight_hint(abort, {}, dead[1], peers={})
    assert hint.endswith("(if the ranks called different collectives there, strict mode, "
                         "check_collectives=True, names each rank's call before anything is sent)")


def test_an_exit_in_a_collective_names_it_and_an_exit_after_one_does_not() -> None:
    # the overrun of a mismatch may end the rank by an exit (a control thread
    # whose objects it corrupted): the collective is named all the same
    dead = ({}, [_rec(3, "float32[8]", flight.DONE), _rec(4, "float32[4]")])
    theirs = [_rec(4, "float32[8]")]
    hint = deathcause.explain(4, [], flight=dead, peers={0: theirs})
    assert hint.startswith("in all_reduce #4 of float32[4] from <mnb-cell-7> line 3, while rank 0 "
                           "called all_reduce #4 of float32[8]"), hint
    # out of any collective, an exit tells its own story (its traceback), not the call's
    done = ({"name": "<mnb-cell-7>"}, [_rec(3, "float32[8]", flight.DONE)])
    assert deathcause.explain(4, [], flight=done) == ""


def test_rank_died_shows_the_hint() -> None:
    from monarch_nb.errors import RankDied

    err = RankDied(1, None, "SIGSEGV", ("x",), cause_hint="Segmentation fault in f (a.py line 1)")
    assert str(err).startswith("rank 1 died (killed by SIGSEGV): Segmentation fault in f")
    crashed = RankDied(1, None, "SIGSEGV", ("dump",), cause_hint="Segmentation fault in f",
                       crash_stack=("Python (most recent call first):", "  f (a.py line 1)"))
    assert str(crashed) == ("rank 1 died (killed by SIGSEGV): Segmentation fault in f; the "
                            "crashing thread:\n    Python (most recent call first):\n"
                            "      f (a.py line 1)")
    assert crashed.headline == "rank 1 died (killed by SIGSEGV): Segmentation fault in f"
    assert pickle.loads(pickle.dumps(crashed)) == crashed
    assert RankDied(*err.__reduce__()[1]) == err


def test_modules_name_their_public_parts() -> None:
    assert "analyze" in collectives.__all__ and "chrome_trace" in timeline.__all__
