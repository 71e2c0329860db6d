"""Flight-recorder records as plain data, and how they are put into words.

Shared by both sides: the rank's recorder (engine/flightrec.py) encodes its
records with :func:`encode` and, in strict mode, words a mismatch with
:func:`mismatch_text`; the controller's analysis (controller/analysis/collectives.py)
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

Torch's own flight recorder (``TORCH_FR_BUFFER_SIZE``, which ranks turn on)
sees the collectives the wrappers cannot: those DDP, FSDP and other C++
callers make on the process group directly. :func:`from_torch` turns one of
its entries into a record with ``file`` :data:`INSIDE_TORCH` and torch's
own sequence number (per process group, from 1, counting every collective
of the group, the wrappers' included).

Non-goals: recording (engine/flightrec.py), cross-rank analysis
(controller/analysis/collectives.py). Pure: no torch, no sockets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .selection import format_ranks

RING_SIZE = 2000  # records each rank keeps (the newest)
IN_FLIGHT, DONE, FAILED, ISSUED = "in flight", "done", "failed", "issued"
DIED = "died in it"  # a dead incarnation's record that was in flight when it died
P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})
DEFAULT_GROUP = "0"  # torch's name of the default (WORLD) group
INSIDE_TORCH = "<inside torch>"  # the ``file`` of a record from torch's own recorder


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
        if self.file == INSIDE_TORCH:
            return "inside torch: DDP, FSDP or another C++ caller"
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


# torch's scalar type names (c10's) -> the dtype names records use
_TORCH_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16",
                 "BFloat16": "bfloat16", "Long": "int64", "Int": "int32", "Short": "int16",
                 "Char": "int8", "Byte": "uint8", "Bool": "bool", "ComplexFloat": "complex64",
                 "ComplexDouble": "complex128", "Float8_e4m3fn": "float8_e4m3fn",
                 "Float8_e5m2": "float8_e5m2"}


def from_torch(entry: dict[str, Any], generation: int = 0) -> OpRecord | None:
    """One entry of torch's flight recorder dump (``_dump_fr_trace_json``)
    as a record; None for what is not a collective (p2p entries carry no
    peer) or not well formed. Torch does not time a gloo op's end: a
    retired entry is ``done`` with ``t1 = t0``, else ``in flight``."""
    try:
        if entry.get("is_p2p"):
            return None
        name = str(entry["profiling_name"])
        op = name.split(":", 1)[-1]
        group = str(entry["process_group"][0])
        seq = int(entry["collective_seq_id"])
        t0 = int(entry["time_created_ns"]) / 1e9
        done = bool(entry.get("retired"))
        dtypes = [_TORCH_DTYPES.get(str(d), str(d).lower()) for d in entry.get("input_dtypes") or []]
        sizes = [[int(x) for x in s] for s in entry.get("input_sizes") or []]
    except (KeyError, TypeError, ValueError, IndexError):
        return None
    if not op:
        return None
    shapes = [f"{d}[{','.join(map(str, s))}]" for d, s in zip(dtypes, sizes, strict=False)]
    if not shapes:
        tensors = ""
    elif len(set(shapes)) == 1:
        tensors = shapes[0] if len(shapes) == 1 else f"{shapes[0]} x{len(shapes)}"
    else:
        tensors = ", ".join(shapes)
    return OpRecord(op=op, group=group, seq=seq, tensors=tensors, file=INSIDE_TORCH, t0=t0,
                    t1=t0 if done else None, state=DONE if done else IN_FLIGHT,
                    generation=generation)


def current_torch_entries(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries of the live process groups. Torch's ring outlives a
    re-formation: the new default group keeps its name ("0") under a new,
    larger ``pg_id`` and counts from 1 again, and the old groups' entries
    stay, an op aborted by the re-formation unretired for ever. So only the
    newest group of each name counts, and none older than the newest
    default group (every group of a generation is made after its default
    group)."""
    newest: dict[str, int] = {}
    rows: list[tuple[str, int, dict[str, Any]]] = []
    for e in entries:
        try:
            name, pg = str(e["process_group"][0]), int(e["pg_id"])
        except (KeyError, TypeError, ValueError, IndexError):
            continue
        newest[name] = max(newest.get(name, pg), pg)
        rows.append((name, pg, e))
    floor = newest.get(DEFAULT_GROUP, min(newest.values(), default=0))
    return [e for name, pg, e in rows if pg == newest[name] and pg >= floor]


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


# -- the persisted ring: what a rank's records leave behind when it dies ----------
#
# A file per rank incarnation beside its log (``rank2.0.flight``), mapped in
# memory by the rank (engine/flightrec.py) and written with plain stores into
# the mapping (no system call per record): a header, the identity of the call
# it runs, and the last :data:`PERSIST_SLOTS` records. The page cache keeps
# what was stored whatever kills the process (SIGKILL, SIGABRT, SIGSEGV, the
# OOM killer); the controller reads it when it sees the death
# (:func:`read_persisted`), then removes it.
PERSIST_ENV = "MONARCH_NB_FLIGHT_FILE"
PERSIST_MAGIC = b"MNBFLT1\0"
PERSIST_HEAD = 1024  # magic, records made (<Q at 8), the call's identity (JSON at 64, NUL-ended)
PERSIST_CALL_AT = 64
PERSIST_SLOTS = 64
PERSIST_SLOT = 384  # state (1 byte), t1 (<d), then the record's fields joined by \x1f, NUL-ended
PERSIST_SIZE = PERSIST_HEAD + PERSIST_SLOTS * PERSIST_SLOT
PERSIST_STATES = {"i": IN_FLIGHT, "d": DONE, "f": FAILED, "s": ISSUED}


def persist_path(log_path: str) -> str:
    """The persisted ring of the rank incarnation logging to ``log_path``."""
    base = log_path[:-4] if log_path.endswith(".log") else log_path
    return base + ".flight"


def _opt_int(text: str) -> int | None:
    return None if text in ("", "None") else int(text)


def read_persisted(path: str, *, remove: bool = True) -> tuple[dict[str, Any], list[OpRecord]]:
    """The call identity and the records (oldest first) a rank left in
    ``path``; ({}, []) when there is none or it is not one; removed
    after reading unless ``remove`` is False. Malformed slots are skipped."""
    import json
    import os
    import struct

    try:
        with open(path, "rb") as f:
            data = f.read(PERSIST_SIZE)
    except OSError:
        return {}, []
    finally:
        if remove:
            try:
                os.unlink(path)
            except OSError:
                pass
    if len(data) < PERSIST_SIZE or not data.startswith(PERSIST_MAGIC):
        return {}, []
    (total,) = struct.unpack_from("<Q", data, 8)
    call: dict[str, Any] = {}
    raw = data[PERSIST_CALL_AT:PERSIST_HEAD].split(b"\0", 1)[0]
    if raw:
        try:
            loaded = json.loads(raw)
            call = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            call = {}
    records = []
    for index in range(max(0, total - PERSIST_SLOTS), total):
        at = PERSIST_HEAD + (index % PERSIST_SLOTS) * PERSIST_SLOT
        state = PERSIST_STATES.get(chr(data[at]))
        (t1,) = struct.unpack_from("<d", data, at + 1)
        body = data[at + 9:at + PERSIST_SLOT].split(b"\0", 1)[0]
        try:
            fields = body.decode("utf-8", "replace").split("\x1f")
            op, group, seq, tensors, device, root, peer, file, line, func, t0, gen = fields
            records.append(OpRecord(
                op=op, group=group, seq=int(seq), tensors=tensors, device=device,
                root=_opt_int(root), peer=_opt_int(peer), file=file, line=int(line), func=func,
                t0=float(t0), t1=None if state == IN_FLIGHT else t1,
                state=state or IN_FLIGHT, generation=int(gen)))
        except ValueError:
            continue
    return call, records


def dead_tail(call: dict[str, Any], records: list[OpRecord], incarnation: int,
              died_at: float | None) -> dict[str, Any]:
    """A dead incarnation's persisted records as a recorder tail (the wire
    form controller/analysis reads, ``dead`` set to its incarnation): what
    was in flight is :data:`DIED`, ending at ``died_at`` (wall clock; the
    newest record's start when unknown); the call it ran, when it ran one,
    is its one call."""
    starts = [r.t0 for r in records] + [float(call.get("t0") or 0.0)]
    end = died_at if died_at is not None else max(starts)
    ops = [encode(r if r.state != IN_FLIGHT else OpRecord(**{
        **{f: getattr(r, f) for f in _FIELDS}, "state": DIED})) for r in records]
    calls: list[list[Any]] = []
    if isinstance(call.get("call"), int) and isinstance(call.get("t0"), (int, float)):
        calls.append([call["call"], str(call.get("name") or "call"), float(call["t0"]), end, "died"])
    return {"ops": ops, "calls": calls, "groups": {}, "total": len(records), "now": end,
            "generation": max((r.generation for r in records), default=0), "dead": incarnation}


__all__ = ["OpRecord", "encode", "decode", "persist_path", "read_persisted", "dead_tail", "DIED", "PERSIST_ENV", "from_torch", "current_torch_entries", "INSIDE_TORCH", "mismatch_text", "group_label", "label",
           "IN_FLIGHT", "DONE", "FAILED", "ISSUED", "P2P_OPS", "DEFAULT_GROUP"]
