"""The relay envelope: one message per host between the controller and a
host agent (procs/hostagent.py), carrying many ranks' signed messages.

Down (controller to agent): a call to several ranks of one host is one
message, ``[fan-out header, *signed frames]``; the header names the ranks
(their main routing ids) and the agent sends the same frames to each over
its link. Up (agent to controller): what the host's ranks sent within one
turn of the agent's loop is one message, ``[batch header, *frames of each]``;
the header says whose each message is and how many frames it has.

The envelope is never trusted with anything but routing. Every message in
it is still signed by its sender and verified by its receiver (a rank
checks the controller's signature, the controller each rank's, with the
rank's own id as the expected sender), and the controller accepts from an
agent only messages of the ranks it started there (transport.IOLoop). A
header that does not parse is dropped whole (:class:`~monarch_nb.errors.ProtocolError`)
before any frame is looked at.

Layout (little-endian): fan-out ``b"MNF1" u16 count (u8 len, id)*``;
batch ``b"MNB1" u16 count (u8 len, id, u16 frames)*``.

Non-goals: signing (protocol.py), the links to the ranks (link.py), who may
relay for whom (transport.py).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from ..errors import ProtocolError

FANOUT = b"MNF1"
BATCH = b"MNB1"
MAX_IDENT = 255  # a routing id's length fits one byte
MAX_ENTRIES = 4096  # ranks per host or messages per batch: far above any host
_U16 = struct.Struct("<H")


def pack_fanout(idents: Sequence[bytes]) -> bytes:
    """The header of a message to ``idents`` (ranks of one host)."""
    if not 0 < len(idents) <= MAX_ENTRIES:
        raise ValueError(f"a fan-out names 1 to {MAX_ENTRIES} ranks, not {len(idents)}")
    parts = [FANOUT, _U16.pack(len(idents))]
    for ident in idents:
        if not 0 < len(ident) <= MAX_IDENT:
            raise ValueError(f"a routing id is 1 to {MAX_IDENT} bytes, not {len(ident)}")
        parts += (bytes((len(ident),)), ident)
    return b"".join(parts)


def unpack_fanout(header: bytes | memoryview) -> list[bytes]:
    """The ranks a fan-out header names; ProtocolError if it does not parse."""
    data = bytes(header)
    count, at = _head(data, FANOUT)
    idents = []
    for _ in range(count):
        ident, at = _ident(data, at)
        idents.append(ident)
    if at != len(data):
        raise ProtocolError("relay-malformed", "trailing bytes after a fan-out header")
    return idents


def pack_batch(entries: Sequence[tuple[bytes, int]]) -> bytes:
    """The header of a batch: (sender's routing id, its message's frame count) each."""
    if not 0 < len(entries) <= MAX_ENTRIES:
        raise ValueError(f"a batch holds 1 to {MAX_ENTRIES} messages, not {len(entries)}")
    parts = [BATCH, _U16.pack(len(entries))]
    for ident, frames in entries:
        if not 0 < len(ident) <= MAX_IDENT or not 0 < frames <= 0xFFFF:
            raise ValueError(f"bad batch entry ({len(ident)}-byte id, {frames} frames)")
        parts += (bytes((len(ident),)), ident, _U16.pack(frames))
    return b"".join(parts)


def unpack_batch(header: bytes | memoryview, frames: int) -> list[tuple[bytes, int]]:
    """The entries of a batch header that came with ``frames`` frames after
    it; ProtocolError unless they parse and account for exactly those."""
    data = bytes(header)
    count, at = _head(data, BATCH)
    entries = []
    total = 0
    for _ in range(count):
        ident, at = _ident(data, at)
        if at + 2 > len(data):
            raise ProtocolError("relay-malformed", "a batch header ends inside an entry")
        (n,) = _U16.unpack_from(data, at)
        at += 2
        if n == 0:
            raise ProtocolError("relay-malformed", "an empty message in a batch")
        entries.append((ident, n))
        total += n
    if at != len(data):
        raise ProtocolError("relay-malformed", "trailing bytes after a batch header")
    if total != frames:
        raise ProtocolError("relay-malformed", f"a batch header counts {total} frames, "
                                               f"{frames} came")
    return entries


def _head(data: bytes, magic: bytes) -> tuple[int, int]:
    if len(data) < 6 or data[:4] != magic:
        raise ProtocolError("relay-malformed", f"not a {magic.decode()} header")
    (count,) = _U16.unpack_from(data, 4)
    if not 0 < count <= MAX_ENTRIES:
        raise ProtocolError("relay-malformed", f"{count} entries in a relay header")
    return count, 6


def _ident(data: bytes, at: int) -> tuple[bytes, int]:
    if at >= len(data):
        raise ProtocolError("relay-malformed", "a relay header ends early")
    n = data[at]
    if n == 0 or at + 1 + n > len(data):
        raise ProtocolError("relay-malformed", "a routing id past the header's end")
    return data[at + 1:at + 1 + n], at + 1 + n


__all__ = ["BATCH", "FANOUT", "pack_batch", "pack_fanout", "unpack_batch", "unpack_fanout"]
