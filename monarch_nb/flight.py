"""Flight-recorder records as plain data, and how they are put into words.

Shared by both sides: the rank's recorder (engine/flightrec.py) encodes its
records with :func:`encode` and, in strict mode, words a mismatch with
:func:`mismatch_text`; the controller's analysis (controller/collectives.py)
decodes them and words what it finds the same way, so the text a user sees
is one text whichever side found the problem.

A record is one torch.distributed call on one rank::

    OpRecord(op="all_reduce", group="0", seq=58, tensors="float32[8]",
             device="cpu", root=None, file="<mnb-cell-7>", line=12,
             func="<module>", t0=..., t1=..., state="done", generation=0)

``seq`` counts the collectives of one group on this rank (0 first); p2p ops
(send, recv, isend, irecv) count apart, per peer, and have ``peer`` set.
Times are the rank's wall clock (``time.time()``), ``t1`` is None while in
flight.

Non-goals: recording (engine/flightrec.py), cross-rank analysis
(controller/collectives.py). Pure: no torch, no sockets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .selection import format_ranks

RING_SIZE = 2000  # records each rank keeps (the newest)
IN_FLIGHT, DONE, FAILED, ISSUED = "in flight", "done", "failed", "issued"
P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})
DEFAULT_GROUP = "0"  # torch's name of the default (WORLD) group


@dataclass(frozen=True)
class OpRecord:
    op: str
    group: str
    seq: int
    tensors: str = ""  # "float32[8]", "float32[8] x4" (lists), "" (objects, barrier)
    device: str = ""
    root: int | None = None  # src/dst of broadcast, reduce, gather, scatter
    peer: int | None = None  # the other rank of a p2p op
    file: str = ""
    line: int = 0
    func: str = ""
    t0: float = 0.0
    t1: float | None = None
    state: str = DONE
    generation: int = 0

    @property
    def p2p(self) -> bool:
        return self.peer is not None

    def signature(self) -> tuple[str, str, int | None]:
        """What every rank of a collective must agree on (strict mode and
        the analysis): the op, the tensors' dtypes and shapes, the root."""
        return (self.op, self.tensors, self.root)

    def describe(self) -> str:
        """``all_reduce(float32[8])``, ``broadcast(float32[4], src=0)``."""
        args = [self.tensors] if self.tensors else []
        if self.root is not None:
            args.append(f"{'src' if self.op in _FROM_ROOT else 'dst'}={self.root}")
        if self.peer is not None:
            args.append(f"{'dst' if self.op in ('send', 'isend') else 'src'}={self.peer}")
        return f"{self.op}({', '.join(args)})"

    def where(self) -> str:
        """``<mnb-cell-7> line 12`` (in a function: ``f (<mnb-cell-7> line 12)``)."""
        if not self.file:
            return "an unknown place"
        at = f"{self.file} line {self.line}"
        return at if self.func in ("", "<module>") else f"{self.func} ({at})"

    def duration(self) -> float | None:
        return None if self.t1 is None else self.t1 - self.t0


_FROM_ROOT = frozenset({"broadcast", "scatter", "broadcast_object_list", "scatter_object_list"})
_FIELDS = ("op", "group", "seq", "tensors", "device", "root", "peer", "file", "line", "func",
           "t0", "t1", "state", "generation")


def encode(rec: OpRecord) -> list[Any]:
    """A JSON-ready list (field order of :data:`_FIELDS`)."""
    return [getattr(rec, f) for f in _FIELDS]


def decode(row: list[Any]) -> OpRecord:
    return OpRecord(**dict(zip(_FIELDS, row, strict=True)))


def group_label(group: str) -> str:
    return "the default group" if group == DEFAULT_GROUP else f"group {group}"


def label(ranks: list[int] | tuple[int, ...] | set[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(ranks)}"


def mismatch_text(heading: str, group: str, records: dict[int, OpRecord | None],
                  ended: dict[int, str] | None = None) -> str:
    """``#58: ranks 0,1,3 called all_reduce(float32[8]) from <mnb-cell-7>
    line 12; rank 2 called broadcast(float32[4]) from <mnb-cell-7> line 14``.

    Ranks with the same signature *and* call site are grouped; the largest
    group comes first. ``records[r]`` None: rank ``r`` made no such call;
    ``ended[r]`` says why (e.g. "finished the cell without it").
    ``heading``: ``#58`` (a sequence number), ``collective 3 of this call``."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    absent: list[int] = []
    for rank in sorted(records):
        rec = records[rank]
        if rec is None:
            absent.append(rank)
            continue
        groups.setdefault((rec.signature(), rec.where()), []).append(rank)
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    parts = []
    for _key, ranks in ordered:
        rec = records[ranks[0]]
        assert rec is not None
        parts.append(f"{label(ranks)} called {rec.describe()} from {rec.where()}")
    for rank in absent:
        why = (ended or {}).get(rank, "made no such call")
        parts.append(f"rank {rank} {why}")
    where = "" if group == DEFAULT_GROUP else f" on {group_label(group)}"
    return f"{heading}{where}: " + "; ".join(parts)


__all__ = ["OpRecord", "encode", "decode", "mismatch_text", "group_label", "label",
           "IN_FLIGHT", "DONE", "FAILED", "ISSUED", "P2P_OPS", "DEFAULT_GROUP"]
