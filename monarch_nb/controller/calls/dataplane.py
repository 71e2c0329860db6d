"""The controller's shared-memory data plane: the segments of its calls.

One job: a call's big payload frames (``mesh.push``, ``mesh.run`` arguments)
go into one shared-memory segment for all its ranks (wire/shm.py), which
stays open while the call is in flight (a deferred call, or an elastic one
re-issued to a respawned rank, maps it later) and is closed when the call
finishes, when it is never sent, or when the mesh stops. Big results come
back the same way: the controller maps a rank's segment and tells the rank
(``Kind.RELEASE``) to close its side. Local ranks only: the controller turns
this part off for remote launchers, and a rank started elsewhere has no
shared memory either.

With ``gpu_ipc`` on, the same holds for the CUDA tensors of a call's
arguments shared by IPC handle (wire/gpuipc.py): the shares made while its
payload was pickled are the call's, and are released when it finishes.

Counts what it did, per mesh (:meth:`stats`, ``mesh.dataplane``).

Non-goals: the mechanism (wire/shm.py), sending (caller.py), which process a
descriptor may name (the assembler, assembler.py, asks for the
rank's pid).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from ...wire import gpuipc, shm


class DataPlane:
    """Segments of the calls in flight, by call id."""

    def __init__(self, mesh_id: str, threshold: int | None, max_bytes: int,
                 gpu_ipc: bool = False) -> None:
        self.mesh_id = mesh_id
        self.gpu_ipc = gpu_ipc  # off: no GPU shares to claim (every call's path skips it)
        self.threshold = threshold  # None: off (every byte through the sockets)
        self.max_bytes = max_bytes
        self._segments: dict[int, shm.Segment] = {}
        self._gpu: dict[int, list[str]] = {}  # GPU IPC shares by call id (gpuipc tokens)
        self.counts: collections.Counter[str] = collections.Counter()

    def pack_call(self, call_id: int, payload: Sequence[Any]) -> tuple[list[Any], dict[str, Any] | None]:
        """The frames to send and the descriptor for the call's meta (None:
        everything by socket). Any thread: the caller's, before signing
        (the thread that pickled the payload: its GPU shares become the
        call's)."""
        if self.gpu_ipc:
            shares = gpuipc.claim()
            if shares:
                self._gpu[call_id] = shares
                self.counts["gpu_shares"] += len(shares)
        threshold = self.threshold
        if threshold is None:
            return list(payload), None
        for p in payload:  # on every call's path: the no-op's one bytes frame costs a len()
            if (len(p) if type(p) is bytes else memoryview(p).nbytes) >= threshold:
                break
        else:
            return list(payload), None
        rest, desc, seg = shm.pack(payload, self.mesh_id, threshold)
        if seg is None:
            self.counts["fallbacks"] += 1
            return rest, None
        self._segments[call_id] = seg
        self.counts["segments"] += 1
        self.counts["bytes"] += seg.size
        return rest, desc

    def release(self, call_id: int) -> None:
        """The call finished (or was never sent): close its segment. Ranks
        that mapped it keep their views."""
        seg = self._segments.pop(call_id, None)
        if seg is not None:
            seg.close()
        if self._gpu:
            for tok in self._gpu.pop(call_id, ()):
                gpuipc.release(tok)

    def close_all(self) -> None:
        """The mesh stops."""
        for call_id in [*self._segments, *self._gpu]:
            self.release(call_id)

    def attach(self, payload: Sequence[Any], desc: Any, peer_pid: int | None) -> list[Any]:
        """A verified result's full payload, mapped from ``peer_pid``'s
        segment (raises shm.ShmError, counted, if refused)."""
        try:
            full = shm.attach(payload, desc, peer_pid=peer_pid, mesh_id=self.mesh_id,
                              max_bytes=self.max_bytes)
        except shm.ShmError:
            self.counts["refused"] += 1
            raise
        self.counts["mapped"] += 1
        return full

    def stats(self) -> dict[str, int]:
        """segments (calls sent through shared memory) and their bytes,
        mapped (results taken from ranks' segments), open (segments not yet
        released), fallbacks (sent by socket: no shared memory), refused
        (descriptors refused)."""
        out = {k: self.counts[k] for k in ("segments", "bytes", "mapped", "fallbacks", "refused")}
        out["open"] = len(self._segments)
        return out
