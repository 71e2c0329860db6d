"""Big frames cut into pieces for an encrypted socket, and put back together.

One job: a payload frame of many MiB that goes through a CurveZMQ-encrypted
socket (a rank on another host) is sent as consecutive pieces of
:data:`CHUNK` bytes, and the receiver joins them into one writable buffer
again before anything reads the payload.

Why: ZeroMQ encrypts (CurveZMQ) and decrypts one whole message part at a
time, on one I/O thread each side. One 64 MiB part is encrypted completely
before its first byte leaves, then crosses the network, then is decrypted
completely: three steps in a row. In pieces, the sender encrypts piece k+1
while piece k travels and the receiver decrypts piece k-1, so the three
overlap (about 2x the throughput of one part with raw pyzmq under Curve
between two processes; 1.3x to 1.45x for a whole ``mesh.push`` between network
namespaces, benchmarks/crosshost.py). Without encryption there is nothing to
overlap: a push in pieces was slower there (the join's copy), so plain links
send one frame as before. The join costs one copy at memory speed.

The cut is made after shared memory took what it takes and before signing,
and undone after verifying and before shared memory maps its frames: the
signature covers the pieces (the hash of consecutive pieces is the hash of
the whole), and the layers above see the frames the sender meant.

The layout travels in the signed meta as ``parts``: for each original frame,
how many pieces it became. :func:`join` checks it against the frames it
got before touching them (a key holder's malformed message is an error, not
a crash).

Non-goals: signing (protocol), sockets (transport), shared memory (shm).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

CHUNK = 4 << 20  # pieces of 4 MiB: a few per 64 MiB value, few enough frames for 1 GiB
MAX_PIECES = 256  # a bigger frame gets bigger pieces (the protocol caps a message's frames)

# What this process cut and joined (frames), for tests and ``mesh.dataplane``-like
# accounting: ``split``, ``joined``.
stats: collections.Counter[str] = collections.Counter()


class ChunkError(ValueError):
    """A ``parts`` layout that does not fit the frames received."""


def _nbytes(frame: Any) -> int:
    return len(frame) if type(frame) is bytes else memoryview(frame).nbytes


def split(payload: Sequence[Any], chunk: int = CHUNK) -> tuple[list[Any], list[int] | None]:
    """``payload`` with every frame of at least ``2 * chunk`` bytes cut into
    pieces of ``chunk`` bytes (views, no copy; at most :data:`MAX_PIECES` per
    frame, bigger pieces for a frame over 1 GiB), and the layout for the meta;
    ``(list(payload), None)`` when nothing is big enough to cut."""
    least = 2 * chunk
    if not any(_nbytes(p) >= least for p in payload):
        return list(payload), None
    frames: list[Any] = []
    parts: list[int] = []
    for p in payload:
        size = _nbytes(p)
        if size < least:
            frames.append(p)
            parts.append(1)
            continue
        view = memoryview(p).cast("B")
        step = max(chunk, -(-size // MAX_PIECES))
        pieces = [view[i:i + step] for i in range(0, size, step)]
        frames.extend(pieces)
        parts.append(len(pieces))
        stats["split"] += 1
    return frames, parts


def join(frames: Sequence[Any], parts: Any) -> list[Any]:
    """The frames before :func:`split`: each run of pieces copied into one
    ``bytearray`` (writable), single frames passed through. ``parts`` comes
    from a verified message and is checked here first."""
    if (type(parts) is not list or not parts
            or any(type(n) is not int or n < 1 for n in parts)):
        raise ChunkError("parts must be a non-empty list of positive piece counts")
    if sum(parts) != len(frames):
        raise ChunkError(f"parts count {sum(parts)} frames, the message has {len(frames)}")
    out: list[Any] = []
    at = 0
    for n in parts:
        if n == 1:
            out.append(frames[at])
        else:
            views = [memoryview(f).cast("B") for f in frames[at:at + n]]
            whole = bytearray(sum(v.nbytes for v in views))
            pos = 0
            for v in views:
                whole[pos:pos + v.nbytes] = v
                pos += v.nbytes
            out.append(whole)
            stats["joined"] += 1
        at += n
    return out
