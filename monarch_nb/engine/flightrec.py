"""The rank's collective flight recorder (on by default) and strict mode.

:func:`install` replaces the collective and p2p functions of the
``torch.distributed`` namespace (``dist.all_reduce``, ``dist.broadcast``,
... see :data:`OPS`) with thin wrappers that note each call in a ring
buffer of the last :data:`RING_SIZE`: the op, its group and the group's
sequence number on this rank, the tensors' dtypes, shapes and device, the
root or peer, the user's frame that called it (the first frame outside
torch and monarch_nb: ``<mnb-cell-7> line 12``), start and end time and its
state (in flight, done, failed; ``issued`` for async ops, whose wait is not
seen). The control thread reads the ring (:meth:`Recorder.tail`) to answer
the controller, even while the main thread is stuck inside a collective.

What it cannot see: calls that do not go through the ``torch.distributed``
namespace. DDP and FSDP call the C++ process group directly, and
``from torch.distributed import all_reduce`` done *before* the rank started
keeps the unwrapped function (cells and scripts run after, so they get the
wrapper). For those, :func:`enable_torch_recorder` turns on torch's own
flight recorder before the group is made, and :func:`torch_tail` sends its
records beside the ring's (no Python caller, torch's sequence numbers).

Cost: one wrapper call, two clock reads, a frame walk that stops at the
first frame (the caller's, in the usual case) and one deque append; no
formatting, no lock (the deque append is atomic under the GIL; records are
lists the wrapper finishes in place). ``benchmarks/flightrec.py`` measures
it. Records keep no tensor and no process group alive: only dtype, shape
and device objects and the group's name.

Strict mode (``check_collectives=True``): before each collective, every
member of its group publishes the call's signature (op, dtypes and shapes,
root) in the group's store and waits for the others'; a difference fails
the call at once on every rank with the same text
(:class:`~monarch_nb.errors.CollectiveMismatch`), instead of a hang or a
garbage result. The i-th collective of a group *in this call* is compared
(not the group's lifetime sequence number), so a group that was out of step
before the call still compares cleanly. A rank that ends the call publishes
that, so peers waiting for it learn it finished without the collective. It
uses the store, not a collective: it cannot itself get out of step.

Non-goals: sockets (loop.py), analysis across ranks (controller/analysis/collectives.py),
wording (flight.py).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import inspect
import json
import mmap
import os
import struct
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

from .. import flight
from ..errors import CollectiveMismatch
from . import context as _context

RING_SIZE = flight.RING_SIZE
CALLS_KEPT = 500  # spans of the rank's recent calls (cells, mesh.run), for mesh.trace()

# op -> (the argument whose tensor is described, the argument naming the root
# or peer). Objects and barrier describe no tensor.
OPS: dict[str, tuple[str | None, str | None]] = {
    "all_reduce": ("tensor", None),
    "broadcast": ("tensor", "src"),
    "all_gather": ("tensor", None),
    "all_gather_into_tensor": ("input_tensor", None),
    "reduce_scatter": ("input_list", None),
    "reduce_scatter_tensor": ("input", None),
    "reduce": ("tensor", "dst"),
    "gather": ("tensor", "dst"),
    "scatter": ("tensor", "src"),
    "barrier": (None, None),
    "monitored_barrier": (None, None),
    "all_to_all": ("input_tensor_list", None),
    "all_to_all_single": ("input", None),
    "all_reduce_coalesced": ("tensors", None),
    "send": ("tensor", "dst"),
    "recv": ("tensor", "src"),
    "isend": ("tensor", "dst"),
    "irecv": ("tensor", "src"),
    "all_gather_object": (None, None),
    "broadcast_object_list": (None, "src"),
    "gather_object": (None, "dst"),
    "scatter_object_list": (None, "src"),
}

# A record while it lives in the ring (a list: the wrapper finishes it in place).
_OP, _GROUP, _SEQ, _TENSOR, _ROOT, _PEER, _FILE, _LINE, _FUNC, _T0, _T1, _STATE, _GEN = range(13)

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH: list[str] = []  # torch's directory, learnt by install() (importing torch is slow)


class Recorder:
    """The ring of one rank. Written by the thread that calls the
    collective (the main thread), read by the control thread."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self.ring: collections.deque[list[Any]] = collections.deque(maxlen=size)
        self.total = 0  # records ever made (the ring keeps the newest ``size``)
        self.seqs: dict[tuple[Any, ...], int] = {}
        # id(group) -> (weak reference, name, member ranks); weak: a group
        # must be freed when the user (or leave_group) drops it
        self.groups: dict[int, tuple[Any, str, tuple[int, ...]]] = {}
        self.members: dict[str, tuple[int, ...]] = {}
        self.check: StrictCheck | None = None
        self._internal: dict[str, bool] = {}
        # [call id, name, start, end, state] of the rank's recent calls
        self.calls: collections.deque[list[Any]] = collections.deque(maxlen=CALLS_KEPT)
        self.persisted: Persisted | None = None  # the copy a death leaves behind

    # -- main thread -------------------------------------------------------------
    def group_name(self, group: Any) -> str:
        if group is None:
            return flight.DEFAULT_GROUP
        entry = self.groups.get(id(group))
        if entry is not None and entry[0]() is group:
            return str(entry[1])
        return self._learn(group)

    def _learn(self, group: Any) -> str:
        import torch.distributed as dist

        try:
            name = str(dist.distributed_c10d._get_process_group_name(group))
            ranks = tuple(dist.get_process_group_ranks(group))
        except Exception:  # not a group torch knows (the call will say so)
            return "?"
        if group is dist.group.WORLD:
            name = flight.DEFAULT_GROUP
        try:
            ref: Any = weakref.ref(group)
        except TypeError:
            ref = lambda: None  # noqa: E731  (not cached)
        self.groups[id(group)] = (ref, name, ranks)
        self.members[name] = ranks
        return name

    def caller(self, frame: Any) -> Any:
        """The first frame outside torch and monarch_nb."""
        internal = self._internal
        while frame is not None:
            name = frame.f_code.co_filename
            inside = internal.get(name)
            if inside is None:
                inside = internal[name] = (name.startswith(_PACKAGE) or any(
                    name.startswith(d) for d in _TORCH))
            if not inside:
                return frame
            frame = frame.f_back
        return None

    # -- control thread ------------------------------------------------------------
    def snapshot(self) -> list[list[Any]]:
        """A copy of the ring (retried: the main thread may append meanwhile)."""
        for _ in range(20):
            try:
                return [list(r) for r in self.ring]
            except RuntimeError:  # deque mutated during iteration
                continue
        return []

    def tail(self, n: int = RING_SIZE) -> dict[str, Any]:
        """The newest ``n`` records, encoded (flight.encode), with what the
        controller needs to read them: this rank's groups and their members,
        and its clock."""
        rows = self.snapshot()[-n:] if n > 0 else []
        # perf_counter -> wall clock, so ranks' records share one time axis
        offset = time.time() - time.perf_counter()
        out = [flight.encode(_finish(r, offset)) for r in rows]
        members = dict(self.members)
        world = _context._state.get("world_size")
        if world is not None:
            members[flight.DEFAULT_GROUP] = tuple(range(int(world)))
        try:
            calls = [[c[0], c[1], c[2] + offset, None if c[3] is None else c[3] + offset, c[4]]
                     for c in list(self.calls)[-n:]]
        except RuntimeError:  # appended meanwhile
            calls = []
        generation = int(_context._state.get("generation", 0))
        return {"ops": out, "total": self.total, "groups": {k: list(v) for k, v in members.items()},
                "generation": generation, "now": time.time(), "calls": calls,
                "torch_ops": torch_tail(n, generation)}


def torch_tail(n: int, generation: int) -> list[list[Any]]:
    """The newest ``n`` collectives of torch's own flight recorder, as
    encoded records (flight.from_torch); [] where it is off or this torch
    has none. Called by the control thread, also while the main thread is
    inside a collective: the dump takes only the recorder's own lock."""
    if n <= 0 or not os.environ.get(TORCH_FR_ENV):
        return []
    try:  # private torch API: absent in some versions
        dump = getattr(importlib.import_module("torch._C._distributed_c10d"),
                       "_dump_fr_trace_json", None)
    except ImportError:
        return []
    if dump is None:
        return []
    try:
        doc = json.loads(dump(True, False))
        entries = flight.current_torch_entries(list(doc.get("entries") or []))
    except Exception:  # no process group yet, or a dump this code cannot read
        return []
    records = (flight.from_torch(e, generation) for e in entries[-n:])
    return [flight.encode(r) for r in records if r is not None]


def _finish(row: list[Any], offset: float) -> flight.OpRecord:
    tensor = row[_TENSOR]
    return flight.OpRecord(
        op=row[_OP], group=row[_GROUP], seq=row[_SEQ], tensors=_describe(tensor),
        device=_device(tensor), root=row[_ROOT], peer=row[_PEER], file=row[_FILE],
        line=row[_LINE], func=row[_FUNC], t0=row[_T0] + offset,
        t1=None if row[_T1] is None else row[_T1] + offset, state=row[_STATE],
        generation=row[_GEN])


def _describe(tensor: Any) -> str:
    """``float32[8]``; a list of tensors: ``float32[8] x4``."""
    if tensor is None:
        return ""
    if isinstance(tensor, tuple) and len(tensor) == 4:  # (dtype, shape, device, count)
        dtype, shape, _dev, count = tensor
        text = f"{str(dtype).removeprefix('torch.')}[{','.join(str(int(d)) for d in shape)}]"
        return text if count is None else f"{text} x{count}"
    return ""


def _device(tensor: Any) -> str:
    if isinstance(tensor, tuple) and len(tensor) == 4:
        return str(tensor[2])
    return ""


def _grab(value: Any) -> Any:
    """What is kept of a tensor argument: (dtype, shape, device, list length)."""
    count = None
    if isinstance(value, (list, tuple)):
        count = len(value)
        value = value[0] if value else None
    try:
        return (value.dtype, value.shape, value.device, count)
    except AttributeError:
        return None


class Persisted:
    """The rank's records where its death cannot take them: a small file
    beside its log, mapped in memory (layout: flight.PERSIST_*). Each
    record is a few stores into the mapping, no system call; the kernel
    keeps the pages whatever kills the process, and the controller reads
    them at the death (flight.read_persisted). Written by the main thread
    only. The fields of a (dtype, shape) are worded once and cached."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            # the blocks reserved now: a sparse file's page written on a full
            # file system (a small TMPDIR) is a SIGBUS, not an error; here
            # ENOSPC is an OSError, and the rank goes on without the ring
            try:
                if hasattr(os, "posix_fallocate"):  # (not on macOS: sparse there)
                    os.posix_fallocate(fd, 0, flight.PERSIST_SIZE)
                else:
                    os.ftruncate(fd, flight.PERSIST_SIZE)
            except OSError:
                os.close(fd)
                fd = -1
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
            self.mm = mmap.mmap(fd, flight.PERSIST_SIZE)
        finally:
            if fd >= 0:
                os.close(fd)
        self.mm[0:8] = flight.PERSIST_MAGIC
        self.path = path
        self.total = 0
        self.offset = time.time() - time.perf_counter()  # perf_counter -> wall clock
        self.shapes: dict[Any, str] = {}

    def put(self, row: list[Any]) -> int:
        """Store a new record (in flight); its slot's offset, for :meth:`end`."""
        tensor = row[_TENSOR]
        desc = self.shapes.get(tensor) if tensor is not None else ""
        if desc is None:
            desc = self.shapes[tensor] = _describe(tensor) + "\x1f" + _device(tensor)
            if len(self.shapes) > 256:
                self.shapes.clear()
        elif not desc:
            desc = "\x1f"
        body = (f"{row[_OP]}\x1f{row[_GROUP]}\x1f{row[_SEQ]}\x1f{desc}\x1f{row[_ROOT]}\x1f"
                f"{row[_PEER]}\x1f{row[_FILE]}\x1f{row[_LINE]}\x1f{row[_FUNC]}\x1f"
                f"{row[_T0] + self.offset!r}\x1f{row[_GEN]}").encode("utf-8", "replace")
        body = body[:flight.PERSIST_SLOT - 10] + b"\0"
        at = flight.PERSIST_HEAD + (self.total % flight.PERSIST_SLOTS) * flight.PERSIST_SLOT
        mm = self.mm
        mm[at] = 105  # "i": in flight
        mm[at + 9:at + 9 + len(body)] = body
        self.total += 1
        _PACK_TOTAL.pack_into(mm, 8, self.total)
        return at

    def end(self, at: int, state: int, t1: float) -> None:
        _PACK_T1.pack_into(self.mm, at + 1, t1 + self.offset)
        self.mm[at] = state

    def call(self, call: int, name: str, t0: float, step: Any = None) -> None:
        """The identity of the call the rank starts (JSON, NUL-ended)."""
        doc = {"call": call, "name": name, "t0": t0 + self.offset}
        if step is not None:
            doc["step"] = step
        body = json.dumps(doc).encode()[:flight.PERSIST_HEAD - flight.PERSIST_CALL_AT - 1]
        at = flight.PERSIST_CALL_AT
        self.mm[at:at + len(body) + 1] = body + b"\0"

    def call_over(self) -> None:
        """No call runs (a death now is between calls)."""
        self.mm[flight.PERSIST_CALL_AT] = 0

    def close(self) -> None:
        try:
            self.mm.close()
            os.unlink(self.path)
        except (OSError, ValueError):
            pass


_PACK_TOTAL, _PACK_T1 = struct.Struct("<Q"), struct.Struct("<d")
_S_DONE, _S_FAILED, _S_ISSUED = ord("d"), ord("f"), ord("s")


def persist(path: str | None = None, recorder: Recorder | None = None) -> Persisted | None:
    """Keep the records in the file ``path`` too (default: the one the
    supervisor named in $MONARCH_NB_FLIGHT_FILE); None where none is named
    or it cannot be made (the recorder then keeps them in memory only)."""
    rec = recorder or RECORDER
    path = path or os.environ.get(flight.PERSIST_ENV)
    if not path:
        return None
    try:
        rec.persisted = Persisted(path)
    except OSError:
        rec.persisted = None
    return rec.persisted


RECORDER = Recorder()
_installed: dict[str, Callable[..., Any]] = {}


def _wrap(name: str, fn: Callable[..., Any], rec: Recorder) -> Callable[..., Any]:
    params = list(inspect.signature(fn).parameters)
    tensor_arg, root_arg = OPS[name]
    t_idx = params.index(tensor_arg) if tensor_arg in params else -1
    r_idx = params.index(root_arg) if root_arg in params else -1
    g_idx = params.index("group") if "group" in params else -1
    p2p = name in flight.P2P_OPS
    ring, seqs, state = rec.ring, rec.seqs, _context._state
    perf, getframe = time.perf_counter, sys._getframe
    IN_FLIGHT, DONE, FAILED, ISSUED = flight.IN_FLIGHT, flight.DONE, flight.FAILED, flight.ISSUED

    internal, caller, default = rec._internal, rec.caller, flight.DEFAULT_GROUP

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        n = len(args)
        group = args[g_idx] if -1 < g_idx < n else kwargs.get("group")
        gname = default if group is None else rec.group_name(group)
        tensor = None
        if t_idx >= 0:
            value: Any = args[t_idx] if t_idx < n else kwargs.get(tensor_arg)  # type: ignore[arg-type]
            try:
                tensor = (value.dtype, value.shape, value.device, None)
            except AttributeError:
                tensor = _grab(value)  # a list of tensors, or not a tensor
        root = None
        if r_idx >= 0:
            root = args[r_idx] if r_idx < n else kwargs.get(root_arg)  # type: ignore[arg-type]
            if root is None:  # group_src / group_dst
                root = kwargs.get(f"group_{root_arg}")
        gen = state.get("generation", 0)
        if p2p:
            key: tuple[Any, ...] = (gen, gname, root)
            peer, root = root, None
        else:
            key, peer = (gen, gname), None
            if rec.check is not None:
                mismatch = rec.check.before(name, gname, tensor, root, getframe(1), rec)
                if mismatch:
                    raise CollectiveMismatch(mismatch)
        seq = seqs.get(key, 0)
        seqs[key] = seq + 1
        frame = getframe(1)
        if internal.get(frame.f_code.co_filename, True):  # not known as the user's
            frame = caller(frame)
        if frame is not None:
            code = frame.f_code
            row = [name, gname, seq, tensor, root, peer, code.co_filename, frame.f_lineno,
                   code.co_name, perf(), None, IN_FLIGHT, gen]
        else:
            row = [name, gname, seq, tensor, root, peer, "", 0, "", perf(), None, IN_FLIGHT, gen]
        ring.append(row)
        rec.total += 1
        kept = rec.persisted
        at = kept.put(row) if kept is not None else 0
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            row[_T1] = perf()
            row[_STATE] = FAILED
            if kept is not None:
                kept.end(at, _S_FAILED, row[_T1])
            raise
        row[_T1] = perf()
        if out is not None and hasattr(out, "wait"):
            row[_STATE] = ISSUED
        else:
            row[_STATE] = DONE
        if kept is not None:
            kept.end(at, _S_ISSUED if row[_STATE] is ISSUED else _S_DONE, row[_T1])
        return out

    wrapper._mnb_flightrec = True  # type: ignore[attr-defined]
    return wrapper


TORCH_FR_ENV = "TORCH_FR_BUFFER_SIZE"
# torch's ring, smaller than ours: the control thread dumps it whole at each
# look (the dashboard's: every 2 s while a call runs), ~14 µs an entry under
# the GIL; 256 cover the hang analysis and 20 steps of a DDP loop's buckets
TORCH_RING_SIZE = 256


def enable_torch_recorder() -> None:
    """Turn on torch's own flight recorder (before the process group is
    made: torch reads the size once), which sees the collectives DDP, FSDP
    and other C++ callers make (:meth:`Recorder.torch_tail`). Its cost on a
    gloo all_reduce is below the noise (benchmarks/flightrec.py). A size
    the user set is kept; ``MONARCH_NB_FLIGHTREC=0`` leaves it off."""
    if os.environ.get("MONARCH_NB_FLIGHTREC", "1") != "0":
        os.environ.setdefault(TORCH_FR_ENV, str(TORCH_RING_SIZE))


def install(recorder: Recorder = RECORDER) -> list[str]:
    """Wrap the torch.distributed functions of :data:`OPS` (idempotent);
    returns the names wrapped. Turned off by ``MONARCH_NB_FLIGHTREC=0``."""
    if os.environ.get("MONARCH_NB_FLIGHTREC", "1") == "0":
        return []
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return []
    if not _TORCH:
        _TORCH.append(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    if recorder.persisted is None:
        persist(recorder=recorder)
    done = []
    for name in OPS:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_mnb_flightrec", False):
            continue
        _installed[name] = fn
        setattr(dist, name, _wrap(name, fn, recorder))
        done.append(name)
    return done


def uninstall() -> None:
    """Put the original functions back (benchmarks, tests)."""
    import torch.distributed as dist

    for name, fn in _installed.items():
        setattr(dist, name, fn)
    _installed.clear()


# -- strict mode ----------------------------------------------------------------------

POLL_MIN_S, POLL_MAX_S = 0.0002, 0.02
_KEY = "mnb-check"


class StrictCheck:
    """One call's collective check (see the module docstring). Lives on the
    main thread from :func:`begin_check` to :func:`end_check`."""

    def __init__(self, call: int, rank: int) -> None:
        self.call = call
        self.rank = rank
        self.counts: dict[str, int] = {}  # group -> collectives of this call so far
        self.mine: list[str] = []  # keys this rank wrote (deleted at the end)

    def _store(self) -> Any:
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()

    def _key(self, gen: int, group: str, index: int, rank: int) -> str:
        return f"{_KEY}/{self.call}/{gen}/{group}/{index}/{rank}"

    def before(self, op: str, group: str, tensor: Any, root: Any, frame: Any,
               rec: Recorder) -> str:
        """Compare this collective with the other members'; the mismatch
        text, or "" when they agree."""
        frame = rec.caller(frame)
        index = self.counts.get(group, 0)
        self.counts[group] = index + 1
        gen = int(_context._state.get("generation", 0))
        members = rec.members.get(group) if group != flight.DEFAULT_GROUP else None
        if members is None:
            members = tuple(range(int(_context._state.get("world_size", 1))))
        code = frame.f_code if frame is not None else None
        mine = flight.OpRecord(op=op, group=group, seq=index, tensors=_describe(tensor),
                               root=None if root is None else int(root),
                               file=code.co_filename if code else "",
                               line=frame.f_lineno if frame else 0,
                               func=code.co_name if code else "")
        records = self._exchange(gen, group, index, members, ["op", flight.encode(mine)])
        ended = {r: why for r, why in records.items() if isinstance(why, str)}
        ops = {r: v for r, v in records.items() if isinstance(v, flight.OpRecord)}
        sigs = {v.signature() for v in ops.values()}
        if len(sigs) > 1 or ended:
            text = flight.mismatch_text(
                f"collective {index + 1} of this call", group,
                {r: ops.get(r) for r in members}, ended)
            return (f"the ranks disagree on a collective (strict mode, check_collectives=True): "
                    f"{text}; nothing was sent, so the group stays in step")
        return ""

    def _exchange(self, gen: int, group: str, index: int, members: tuple[int, ...],
                  value: list[Any]) -> dict[int, Any]:
        """Publish ``value`` as this rank's entry, wait for every member's."""
        store = self._store()
        key = self._key(gen, group, index, self.rank)
        store.set(key, json.dumps(value))
        self.mine.append(key)
        others = {r: self._key(gen, group, index, r) for r in members}
        pause = POLL_MIN_S
        while not store.check(list(others.values())):
            time.sleep(pause)  # a sleep, not a blocking wait: interrupts get through
            pause = min(pause * 2, POLL_MAX_S)
        out: dict[int, Any] = {}
        for r, k in others.items():
            kind, body = json.loads(store.get(k))
            out[r] = flight.decode(body) if kind == "op" else str(body)
        if index > 0:  # every member has read the previous entry: drop ours
            try:
                store.delete_key(self._key(gen, group, index - 1, self.rank))
            except Exception:
                pass
        return out

    def end(self, reason: str, members: dict[str, tuple[int, ...]] | None = None) -> None:
        """The call is over on this rank: peers still waiting on a collective
        of it learn so (written where their next entry would be). Every
        group this rank belongs to gets the note, those it made no collective
        on in this call included (``members``: group -> ranks, as the
        recorder learnt them; the default group always): a rank that skips
        the only collective of a call must still release its peers."""
        try:
            store = self._store()
        except Exception:
            return
        gen = int(_context._state.get("generation", 0))
        nexts = dict(self.counts)
        nexts.setdefault(flight.DEFAULT_GROUP, 0)
        for group, ranks in (members or {}).items():
            if self.rank in ranks:
                nexts.setdefault(group, 0)
        for group, index in nexts.items():
            try:
                store.set(self._key(gen, group, index, self.rank), json.dumps(["end", reason]))
            except Exception:
                pass


def call_begin(call: int, meta: dict[str, Any], recorder: Recorder = RECORDER) -> bool:
    """Main thread, as a call starts: note its span; True if it checks its
    collectives (strict mode), which starts here too."""
    name, began = str(meta.get("name") or "mesh.run"), time.perf_counter()
    recorder.calls.append([call, name, began, None, flight.IN_FLIGHT])
    if recorder.persisted is not None:
        recorder.persisted.call(call, name, began, meta.get("step"))
    if meta.get("check"):
        begin_check(call, recorder)
        return True
    return False


def call_end(ok: bool, recorder: Recorder = RECORDER) -> None:
    """Main thread, as the call ends (``ok``: it returned)."""
    if recorder.calls:
        span = recorder.calls[-1]
        span[3], span[4] = time.perf_counter(), flight.DONE if ok else flight.FAILED
    if recorder.persisted is not None:
        recorder.persisted.call_over()
    if recorder.check is not None:
        end_check(ok, recorder)


def begin_check(call: int, recorder: Recorder = RECORDER) -> None:
    """Main thread, as a call with ``check_collectives`` starts."""
    rank = int(_context._state.get("rank", 0))
    recorder.check = StrictCheck(call, rank)


def end_check(ok: bool, recorder: Recorder = RECORDER) -> None:
    check, recorder.check = recorder.check, None
    if check is not None:
        check.end("finished the call without it" if ok else "failed before reaching it",
                  dict(recorder.members))


__all__ = ["Recorder", "RECORDER", "Persisted", "persist", "install", "uninstall", "call_begin", "call_end",
           "begin_check", "end_check",
           "OPS", "RING_SIZE"]
