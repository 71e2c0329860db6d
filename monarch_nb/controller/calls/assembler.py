"""The result assembler: what a rank sends back for a call, made into the
call table's answer (a value, or the rank's :class:`RemoteError`).

A rank's answer to a call travels on two sockets that race each other: its
OUTPUT chunks and METRICS batches on the control socket, its RESULT on the
main channel. For one rank and one call:

1. Each OUTPUT chunk is fed to the call's output (or, outside any call, to
   the default output); each METRICS batch goes to the metrics store. Both
   are progress for the hang watchdog, and both are *counted* when the rank
   numbered them (``n >= 0``: sent during the call).
2. The RESULT's frames are put back first: pieces joined (wire/chunks.py),
   then frames mapped from the rank's shared-memory segment (wire/shm.py,
   dataplane.py; the rank is told at once to close its side, whatever
   became of the mapping). Frames that do not fit answer the call with the
   rank's SerializationError instead.
3. A RESULT nobody waits for (the call ended or was cancelled, the rank was
   lost to it) is dropped; if it holds GPU shares (wire/gpuipc.py) they are
   opened and dropped, so its rank may release them.
4. A plain success (no meta: no output, no chunks, no error) is unpickled
   and completes the rank at once: the no-op call's path.
5. Otherwise the RESULT is *held* (``PendingCall.hold``) until the chunks it
   announced (``n_out`` + ``n_m``) have been counted, so a cell shows all of
   a rank's output before its result; then its own output is fed, its value
   unpickled (GPU shares copied, then released) or its error built, and the
   call table completes the rank. A held result keeps its call open
   (:meth:`CallTable.finish_if_done`); a rank lost to the call drops it
   (:meth:`CallTable.fail`).

Runs on the thread that leads the I/O loop, like every handler; owns no
state beyond its references to the other parts (the per-call counts and
held results are the call's, changed through PendingCall's methods).
Tested without processes in tests/test_assembler.py.

Non-goals: a call's fate (calltable.py), the mechanisms (wire/chunks.py,
wire/shm.py, wire/gpuipc.py, dataplane.py), sending calls (caller.py),
routing messages by kind (core.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ...errors import RemoteError
from ...wire import chunks, gpuipc, serialize, shm
from ...wire.metas import meta_of
from ...wire.metricframes import decode as decode_metrics
from ...wire.protocol import Codec, Kind, Message
from ..life.ranktable import RankInfo
from ..metricstore import MetricsStore
from .calltable import CallTable, PendingCall
from .dataplane import DataPlane
from .output import CallOutput, decode_items

log = logging.getLogger(__name__)

Send = Callable[[bytes, list[Any]], None]  # (socket identity, signed frames)


class Assembler:
    """Turns the OUTPUT, METRICS and RESULT messages of the ranks into the
    call table's answers (see the module docstring)."""

    def __init__(self, calls: CallTable, dataplane: DataPlane, metrics: MetricsStore,
                 send: Send, codec: Codec, pid_of: Callable[[int], int | None],
                 default_output: Callable[[], CallOutput | None]) -> None:
        self.calls = calls
        self.dataplane = dataplane
        self._gpu_ipc = dataplane.gpu_ipc  # fixed for the mesh's life
        self.metrics = metrics
        self._send = send
        self._codec = codec
        self._pid_of = pid_of  # a rank's process id (its segments are mapped from it only)
        self._default_output = default_output

    # -- the control socket: chunks ----------------------------------------------------
    def on_output(self, info: RankInfo, msg: Message) -> None:
        call = self.calls.get(msg.call)
        items = decode_items(msg.payload[0]) if msg.payload else []
        target = call.output if call is not None else self._default_output()
        if call is not None:
            call.progressed(time.monotonic())
        if target is not None:
            for stream, text in items:
                target.feed(info.rank, str(stream), str(text))
        self._count_chunk(call, info, msg)

    def on_metrics(self, info: RankInfo, msg: Message) -> None:
        call = self.calls.get(msg.call)
        now = time.monotonic()
        if call is not None:
            call.progressed(now)  # a metric is progress (hang watchdog)
        else:
            # points logged by a process's first mnb.log call come uncounted
            # (call 0): still progress for whatever the rank is running
            for running in self.calls:
                if info.rank in running.remaining:
                    running.progressed(now)
        if msg.payload:
            self.metrics.add(info.rank, info.incarnation, decode_metrics(msg.payload[0]))
        self._count_chunk(call, info, msg)

    def _count_chunk(self, call: PendingCall | None, info: RankInfo, msg: Message) -> None:
        """OUTPUT chunks and METRICS batches sent on the control socket
        during a call are counted; the RESULT waits for all of them."""
        if call is not None and int(meta_of(msg, Kind.OUTPUT).get("n", -1)) >= 0:  # (METRICS: the same n)
            seen = call.chunk_seen(info.rank)
            held = call.held.get(info.rank)
            if held is not None and seen >= announced(held):
                call.unhold(info.rank)
                self._complete_rank(call, info, held)

    # -- the main channel: the result ----------------------------------------------------
    def on_result(self, info: RankInfo, msg: Message) -> None:
        call = self.calls.get(msg.call)
        meta = msg.meta
        if meta:
            if "parts" in meta and not self._join(info, msg, call):
                return
            if "shm" in meta and not self._attach(info, msg, call):
                return
        if call is None or info.rank not in call.remaining:
            if self._gpu_ipc:
                self._drop_result(info, msg)
            return
        if not meta:  # a plain success: no output, no chunks to wait for, no error
            try:
                value = self._loads(info, msg.payload)
            except serialize.SerializationError as exc:
                self.calls.complete(call, info.rank, error=_unloadable(info.rank, exc))
            else:
                self.calls.complete(call, info.rank, value)
            return
        if not call.adopted and call.chunks_seen.get(info.rank, 0) < announced(msg):
            call.hold(info.rank, msg)  # output chunks still on their way
            return
        self._complete_rank(call, info, msg)

    def on_folded(self, infos: list[RankInfo], msg: Message) -> None:
        """The same plain result (no meta, one payload) from each of
        ``infos`` (a host agent's FOLD: wire/fold.py), unpickled once."""
        call = self.calls.get(msg.call)
        if call is None or self._gpu_ipc:  # (shares are per rank: each as its own result)
            for info in infos:
                self.on_result(info, msg)
            return
        ranks = [info.rank for info in infos if info.rank in call.remaining]
        if not ranks:
            return
        try:
            value = self._loads(infos[0], msg.payload)
        except serialize.SerializationError as exc:
            for rank in ranks:
                self.calls.complete(call, rank, error=_unloadable(rank, exc))
            return
        if type(value) in _SHARED:
            self.calls.complete_many(call, ranks, value)
            return
        # a mutable value: each rank its own object, as if each had sent it
        self.calls.complete(call, ranks[0], value)
        for rank in ranks[1:]:
            self.calls.complete(call, rank, serialize.loads(msg.payload))

    def _join(self, info: RankInfo, msg: Message, call: PendingCall | None) -> bool:
        """Put a result's big frames back together from their pieces
        (wire/chunks.py). False: the layout did not fit (the call gets the
        rank's error instead)."""
        try:
            msg.payload = chunks.join(msg.payload, meta_of(msg, Kind.RESULT)["parts"])
            return True
        except chunks.ChunkError as exc:
            self._refuse(info, call, f"its pieces do not fit together: {exc}")
            return False

    def _attach(self, info: RankInfo, msg: Message, call: PendingCall | None) -> bool:
        """Put the frames a rank sent by shared memory back into ``msg``
        (mapped from the rank's own process only), then let the rank close
        its segment, whatever became of the mapping. False: refused (the
        call gets the rank's error instead)."""
        desc = meta_of(msg, Kind.RESULT)["shm"]
        peer = None if self.dataplane.threshold is None else self._pid_of(info.rank)
        try:
            msg.payload = self.dataplane.attach(msg.payload, desc, peer)
            return True
        except shm.ShmError as exc:
            self._refuse(info, call, f"its shared memory was refused: {exc}")
            return False
        finally:
            self._send(info.ctl_id, self._codec.sign(Kind.RELEASE, meta={"tok": shm.token_of(desc)}))

    def _refuse(self, info: RankInfo, call: PendingCall | None, why: str) -> None:
        """A result whose frames could not be put back: the call gets the
        rank's error, and the log says why."""
        log.warning("monarch_nb: rank %d's result: %s", info.rank, why)
        if call is not None and info.rank in call.remaining:
            self.calls.complete(call, info.rank, error=RemoteError(
                info.rank, "SerializationError", f"the result arrived but {why}", ""))

    def _complete_rank(self, call: PendingCall, info: RankInfo, msg: Message) -> None:
        payload, meta = msg.payload, meta_of(msg, Kind.RESULT)
        if meta.get("o") and payload:
            for stream, text in decode_items(payload[0]):
                call.output.feed(info.rank, stream, text)
            payload = payload[1:]
        if meta.get("ok", True):
            try:
                value = self._loads(info, payload)
            except serialize.SerializationError as exc:
                self.calls.complete(call, info.rank, error=_unloadable(info.rank, exc))
            else:
                self.calls.complete(call, info.rank, value)
        else:
            err = meta_of(msg, Kind.RESULT).get("error") or {}
            self.calls.complete(call, info.rank, error=RemoteError(
                info.rank, str(err.get("type", "Exception")), str(err.get("msg", "")),
                str(err.get("tb", ""))))

    def _loads(self, info: RankInfo, payload: list[Any]) -> Any:
        """A result's value. With gpu_ipc, the CUDA tensors a rank shared
        are copied while unpickling; then the rank may release them."""
        if not payload:
            return None
        if not self._gpu_ipc:
            return serialize.loads(payload)
        with gpuipc.consuming() as opened:
            try:
                return serialize.loads(payload)
            finally:
                for tok in opened:
                    self._send(info.ctl_id, self._codec.sign(Kind.RELEASE, meta={"tok": tok}))

    def _drop_result(self, info: RankInfo, msg: Message) -> None:
        """A result nobody waits for (its call was cancelled or is over):
        if it holds GPU shares, open and drop them, so its rank can release
        them (a share is held until the controller says so)."""
        payload = msg.payload[1:] if meta_of(msg, Kind.RESULT).get("o") else msg.payload
        if not meta_of(msg, Kind.RESULT).get("ok", True) or not gpuipc.mentioned(payload):
            return
        try:
            self._loads(info, payload)
        except serialize.SerializationError as exc:
            log.warning("monarch_nb: rank %d's late result could not be opened: %s", info.rank, exc)


# values that may be one object for several ranks (a folded result): nothing can change them
_SHARED = frozenset({type(None), bool, int, float, complex, str, bytes})


def announced(result: Message) -> int:
    """Control-socket messages a RESULT says preceded it: output chunks
    (``n_out``) and mnb.log batches (``n_m``)."""
    meta = meta_of(result, Kind.RESULT)
    return int(meta.get("n_out", 0)) + int(meta.get("n_m", 0))


def _unloadable(rank: int, exc: Exception) -> RemoteError:
    return RemoteError(rank, "SerializationError",
                       f"the result arrived but cannot be rebuilt in the kernel: {exc}", "")
