"""``mesh.trace(path)``: the recent past of a mesh as a Chrome / Perfetto
trace (the JSON ``traceEvents`` format). Pure: records in, a dict out.

One process per rank (``rank N``) with two tracks: ``calls`` (the rank's
cells and ``mesh.run`` calls) and ``collectives`` (its flight recorder's
records, named ``all_reduce #58`` with the tensors, group and caller in the
slice's args; p2p ops too), a ``step`` counter from ``mnb.log`` batches,
and instant events for what ``mesh.events`` lists about the rank (death,
respawn, ...). A rank's earlier incarnations (their persisted records,
``RankTail.dead`` set: the last call each ran and its last collectives)
are drawn on the same two tracks, so its history does not start at its
latest rebirth: their slices carry ``incarnation`` in their args, and a
collective one died in ends at its death with a ``died in all_reduce #58``
instant. A ``mesh`` process carries the mesh-wide events
(re-formations, stop). Times are microseconds from the earliest event
(``otherData.start_unix_s`` gives that instant); a slice still in flight
ends at the moment the rank answered, with ``state: in flight``.

Non-goals: asking the ranks (mesh.py, inspector.py), reading the records
(collectives.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ...flight import DIED, IN_FLIGHT, group_label
from .collectives import RankTail

CALLS_TID, COLLECTIVES_TID = 1, 2


def chrome_trace(tails: Mapping[int, RankTail], events: Iterable[Mapping[str, Any]] = (),
                 steps: Mapping[int, list[tuple[float, int]]] | None = None,
                 title: str = "monarch_nb", earlier: Iterable[RankTail] = ()) -> dict[str, Any]:
    """The trace document (``json.dump`` it). ``earlier``: the ranks'
    ended incarnations (flight.dead_tail), drawn on their ranks' tracks."""
    events = list(events)
    steps = steps or {}
    earlier = sorted(earlier, key=lambda t: (t.rank, t.dead or 0))
    every = [*earlier, *(t for _, t in sorted(tails.items()))]
    times = [rec.t0 for t in every for rec in t.ops]
    times += [c[2] for t in every for c in t.calls]
    times += [float(e["time"]) for e in events]
    times += [ts for marks in steps.values() for ts, _ in marks]
    start = min(times) if times else 0.0
    mesh_pid = 1 + max([*tails, *(t.rank for t in earlier), *(int(e["rank"]) for e in events),
                        -1])

    def us(t: float) -> float:
        return round((t - start) * 1e6, 1)

    out: list[dict[str, Any]] = []
    ranks = sorted(set(tails) | {t.rank for t in earlier}
                   | {int(e["rank"]) for e in events if int(e["rank"]) >= 0})
    for r in ranks:
        out.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
        out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": CALLS_TID,
                    "args": {"name": "calls"}})
        out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": COLLECTIVES_TID,
                    "args": {"name": "collectives"}})
    out.append({"ph": "M", "name": "process_name", "pid": mesh_pid, "args": {"name": "mesh"}})
    for tail in every:
        r = tail.rank
        mine = {} if tail.dead is None else {"incarnation": tail.dead}
        for call_id, name, t0, t1, state in tail.calls:
            end = t1 if t1 is not None else tail.now
            out.append({"ph": "X", "name": str(name), "cat": "call", "pid": r, "tid": CALLS_TID,
                        "ts": us(t0), "dur": max(0.0, round((end - t0) * 1e6, 1)),
                        "args": {"call": call_id, "state": state, **mine}})
        for rec in tail.ops:
            end = rec.t1 if rec.t1 is not None else tail.now
            out.append({"ph": "X", "name": f"{rec.op} #{rec.seq}", "cat": "p2p" if rec.p2p
                        else "collective", "pid": r, "tid": COLLECTIVES_TID, "ts": us(rec.t0),
                        "dur": max(0.0, round((end - rec.t0) * 1e6, 1)),
                        "args": {"op": rec.describe(), "group": group_label(rec.group),
                                 "seq": rec.seq, "from": rec.where(), "state": rec.state,
                                 "device": rec.device, "generation": rec.generation, **mine}})
            if rec.state in (IN_FLIGHT, DIED):
                what = "waiting in" if rec.state == IN_FLIGHT else "died in"
                out.append({"ph": "i", "name": f"{what} {rec.op} #{rec.seq}", "s": "t",
                            "pid": r, "tid": COLLECTIVES_TID, "ts": us(end)})
    for r, marks in sorted(steps.items()):
        for ts, step in marks:
            out.append({"ph": "C", "name": "step", "pid": r, "ts": us(ts), "args": {"step": step}})
    for e in events:
        rank = int(e["rank"])
        out.append({"ph": "i", "name": f"{e['kind']}" + (f": {e['detail']}" if e.get("detail")
                                                         else ""),
                    "cat": "mesh", "s": "p" if rank >= 0 else "g",
                    "pid": rank if rank >= 0 else mesh_pid, "tid": CALLS_TID,
                    "ts": us(float(e["time"])),
                    "args": {"kind": e["kind"], "incarnation": e.get("incarnation", 0)}})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"title": title, "start_unix_s": start}}


__all__ = ["chrome_trace"]
