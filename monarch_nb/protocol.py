"""Wire protocol: message schema, framing, HMAC signing, replay window.

Pure bytes in, bytes out — no sockets, no threads, no unpickling.

A message is a list of frames (after any routing identity)::

    [signature + header, payload_0, payload_1, ...]

(signature and header share the first frame: one frame fewer per message
is measurable on the no-op path.)

* ``header`` is a fixed binary part (struct ``HEAD``: protocol version, kind,
  sequence number, call id, sender-id length, number of payload frames), the
  sender id, the byte length of each payload frame, then optional compact JSON
  metadata. It is never pickled. (Binary because this is parsed on every
  message of the hot path: struct is ~10x cheaper than JSON here.)
* ``signature`` is HMAC-SHA256 under the per-mesh key over the header and then
  every payload frame. Because the header lists the payload lengths, frame
  boundaries are signed too.
* payload frames are opaque here (the serialize module owns them); they are
  only deserialised *after* :meth:`Codec.verify` accepted the message.

Verification order follows jupyter_client: signature first, then replay check,
then parse. A message that fails any step raises :class:`ProtocolError` with a
short reason that the transport counts (``bad-signature``, ``replay``,
``truncated``, ``malformed``, ``oversized``, ``version``, ``sender-mismatch``).

A payload sent to many ranks is signed once: the same frames (and sequence
number) go to every recipient; each recipient keeps its own replay window per
sender, so that is not a replay.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import itertools
import json
import secrets
import struct
from collections.abc import Sequence
from typing import Any

from .errors import ProtocolError

VERSION = 2  # 2: signature and header share the first frame
SIGNATURE_BYTES = 32
MAX_HEADER_BYTES = 64 * 1024
MAX_FRAMES = 4096
REPLAY_WINDOW = 8192
HEAD = struct.Struct("!BBQQHH")  # version, kind, seq, call, len(sender), n payload frames
SMALL = 16 * 1024  # below this, sign with one-shot hmac.digest (no HMAC object)

Buffer = bytes | bytearray | memoryview


class Kind(str, enum.Enum):
    """Message kinds. Controller -> rank first, then rank -> controller."""

    CALL = "call"  # run a pickled function (payload: fn, args, kwargs)
    EXEC = "exec"  # run cell code (meta: code, name, setup)
    INTERRUPT = "interrupt"  # raise KeyboardInterrupt in the main thread for call c
    PING = "ping"  # controller liveness; ranks exit when pings stop
    STOP = "stop"  # leave cleanly
    STACKS = "stacks"  # return every thread's stack

    HELLO = "hello"  # rank process is up (meta: pid, incarnation, host)
    READY = "ready"  # rank joined torch.distributed (meta: device, backend)
    FAILED_START = "failed_start"  # rank could not start (meta: error text)
    RESULT = "result"  # call c finished (meta: ok, n_out; payload: value or error)
    OUTPUT = "output"  # stdout/stderr text of call c (meta: chunk no., streams)
    HEARTBEAT = "heartbeat"  # control thread alive (meta: state, busy call)
    INTERRUPTED = "interrupted"  # answer to INTERRUPT (meta: where the main thread was)
    STACKS_REPLY = "stacks_reply"
    REFORM = "reform"  # leave the group, join generation g on a new port (meta: generation, port)
    REFORMED = "reformed"  # answer to REFORM (meta: generation, error)
    METRICS = "metrics"  # batched mnb.log points (payload: JSON [[step, t, {name: value}], ...])
    INPUT = "input"  # a line typed for a rank's debugger (meta: text)
    PROMPT = "prompt"  # a rank's debugger waits for a line (meta: prompt, text before it)


_CODES = {k: i for i, k in enumerate(Kind)}
_BY_CODE = list(Kind)


def new_key() -> bytes:
    """A fresh random per-mesh key (32 bytes)."""
    return secrets.token_bytes(32)


class Header:
    """A verified header (plain slots class: built for every message)."""

    __slots__ = ("kind", "sender", "seq", "call", "meta", "lengths", "version")

    def __init__(self, kind: Kind, sender: str, seq: int, call: int = 0,
                 meta: dict[str, Any] | None = None, lengths: tuple[int, ...] = (),
                 version: int = VERSION) -> None:
        self.kind, self.sender, self.seq, self.call = kind, sender, seq, call
        self.meta = meta if meta is not None else {}
        self.lengths, self.version = lengths, version

    def __repr__(self) -> str:
        return f"Header({self.kind.value}, {self.sender}, #{self.seq}, call {self.call})"


class Message:
    """A verified message: header plus still-opaque payload frames."""

    __slots__ = ("header", "payload")

    def __init__(self, header: Header, payload: list[Any]) -> None:
        self.header = header
        self.payload = payload  # zmq.Frame or bytes; buffer protocol either way

    @property
    def kind(self) -> Kind:
        return self.header.kind

    @property
    def meta(self) -> dict[str, Any]:
        return self.header.meta


class ReplayWindow:
    """Sliding-window replay check for one sender (as in IPsec).

    Accepts each sequence number once, in any order, as long as it is no more
    than ``size`` behind the highest seen. Out-of-order arrival is normal here:
    a rank talks to the controller over two sockets.
    """

    __slots__ = ("size", "highest", "_seen")

    def __init__(self, size: int = REPLAY_WINDOW) -> None:
        self.size = size
        self.highest = -1
        self._seen: set[int] = set()

    def check_and_add(self, seq: int) -> bool:
        if seq <= self.highest - self.size or seq in self._seen:
            return False
        self._seen.add(seq)
        if seq > self.highest:
            self.highest = seq
            if len(self._seen) > 2 * self.size:
                floor = self.highest - self.size
                self._seen = {s for s in self._seen if s > floor}
        return True


class Codec:
    """Signs outgoing and verifies incoming messages for one endpoint.

    One ``Codec`` per sender identity: its sequence counter is shared by every
    thread that signs through it (``itertools.count`` is atomic under the GIL).
    """

    def __init__(self, key: bytes, sender: str, *, max_bytes: int = 4 << 30) -> None:
        if len(key) < 16:
            raise ValueError("mesh key must be at least 16 bytes")
        self._key = key
        self.sender = sender
        self._sender_b = sender.encode()
        self.max_bytes = max_bytes
        self._seq = itertools.count(1)
        self._windows: dict[str, ReplayWindow] = {}
        self._hmac = hmac.new(key, digestmod=hashlib.sha256)

    # -- outgoing ---------------------------------------------------------
    def sign(
        self,
        kind: Kind,
        payload: Sequence[Buffer] = (),
        *,
        call: int = 0,
        meta: dict[str, Any] | None = None,
    ) -> list[Buffer]:
        """Frames ready to send: ``[signature + header, *payload]``."""
        lengths = [memoryview(p).nbytes for p in payload]
        parts = [
            HEAD.pack(VERSION, _CODES[kind], next(self._seq), call, len(self._sender_b), len(lengths)),
            self._sender_b,
            struct.pack(f"!{len(lengths)}Q", *lengths),
        ]
        if meta:
            parts.append(json.dumps(meta, separators=(",", ":")).encode())
        header = b"".join(parts)
        return [self._digest(header, payload, sum(lengths)) + header, *payload]

    # -- incoming ---------------------------------------------------------
    def verify(self, frames: Sequence[Any], expected_sender: str | None = None) -> Message:
        """Check signature, framing, sender and replay; return the message.

        ``expected_sender`` is the identity the transport saw (the ROUTER's
        routing id): it must match the signed sender *before* the replay
        window is touched, so a key holder on another socket cannot poison a
        live rank's window. Raises ProtocolError(reason) on any failure;
        nothing in the payload has been interpreted by then.
        """
        n = len(frames)
        if n < 1:
            raise ProtocolError("truncated", "no frame")
        if n > MAX_FRAMES:
            raise ProtocolError("oversized", f"{n} frames")
        first = _bytes(frames[0])
        if len(first) < SIGNATURE_BYTES + HEAD.size:
            raise ProtocolError("truncated", "first frame shorter than signature + header")
        sig, header = first[:SIGNATURE_BYTES], first[SIGNATURE_BYTES:]
        payload = list(frames[1:])
        if len(header) > MAX_HEADER_BYTES:
            raise ProtocolError("oversized", "header")
        sizes = tuple(memoryview(p).nbytes for p in payload)
        total = sum(sizes)
        if total > self.max_bytes:
            raise ProtocolError("oversized", f"{total} bytes")
        if len(sig) != SIGNATURE_BYTES or not hmac.compare_digest(sig, self._digest(header, payload, total)):
            raise ProtocolError("bad-signature")
        # Signed by a key holder from here on; still parse defensively.
        try:
            version, code, seq, call, slen, nframes = HEAD.unpack_from(header)
            if version != VERSION:
                raise ProtocolError("version", f"v{version}, expected v{VERSION}")
            pos = HEAD.size
            sender = header[pos:pos + slen].decode()
            pos += slen
            lengths = struct.unpack_from(f"!{nframes}Q", header, pos)
            pos += 8 * nframes
            meta = json.loads(header[pos:]) if len(header) > pos else {}
            if not isinstance(meta, dict):
                raise TypeError("meta is not an object")
            kind = _BY_CODE[code]
        except ProtocolError:
            raise
        except Exception as exc:  # RecursionError from nested JSON included
            raise ProtocolError("malformed", f"{type(exc).__name__}: {str(exc)[:200]}") from None
        if lengths != sizes:
            raise ProtocolError("truncated", "payload lengths differ from header")
        if expected_sender is not None and sender != expected_sender:
            raise ProtocolError("sender-mismatch", f"{expected_sender!r} claims {sender!r}")
        window = self._windows.get(sender)
        if window is None:
            window = self._windows[sender] = ReplayWindow()
        if not window.check_and_add(seq):
            raise ProtocolError("replay", f"{sender} #{seq}")
        return Message(Header(kind, sender, seq, call, meta, lengths, version), payload)

    def forget(self, sender: str) -> None:
        """Drop the replay window of a sender that is gone for good."""
        self._windows.pop(sender, None)

    def _digest(self, header: bytes, payload: Sequence[Any], total: int) -> bytes:
        if total <= SMALL:  # one OpenSSL call beats building an HMAC object
            return hmac.digest(self._key, b"".join([header, *payload]) if payload else header,
                               "sha256")
        h = self._hmac.copy()
        h.update(header)
        for p in payload:
            h.update(p)
        return h.digest()


def _bytes(frame: Any) -> bytes:
    if isinstance(frame, bytes):
        return frame
    b = getattr(frame, "bytes", None)  # zmq.Frame without importing zmq here
    if b is not None:
        return b
    return bytes(frame)
