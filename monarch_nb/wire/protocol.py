"""Wire protocol: message schema, framing, HMAC signing, replay window.

Pure bytes in, bytes out — no sockets, no threads, no unpickling.

A message is a list of frames (after any routing identity)::

    [signature + header (+ payload_0 if small), payload_1, payload_2, ...]

(The signature, the header and a small first payload frame share the first
frame: every frame fewer is measurable on the no-op path, where a call is
one frame each way.)

* ``header`` is a fixed binary part (struct ``HEAD``: protocol version, kind,
  flags, sequence number, call id, sender-id length, number of payload
  frames), the sender id, the byte length of each payload frame, then
  optional compact JSON metadata. It is never pickled. (Binary because this
  is parsed on every message of the hot path: struct is ~10x cheaper than
  JSON here.)
* flag ``INLINE``: payload frame 0 (at most ``INLINE_MAX`` bytes) is not a
  frame of its own but the last ``lengths[0]`` bytes of the first frame.
* ``signature`` is HMAC-SHA256 under the per-mesh key over the header and then
  every payload frame, in order (the same bytes whether payload 0 is inline
  or not). Because the header lists the payload lengths, frame boundaries are
  signed too.
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

from ..errors import ProtocolError

VERSION = 3  # 2: signature and header share the first frame; 3: so may payload 0
SIGNATURE_BYTES = 32
MAX_HEADER_BYTES = 64 * 1024
MAX_FRAMES = 4096
REPLAY_WINDOW = 8192
# version, kind, flags, seq, call, len(sender), n payload frames
HEAD = struct.Struct("!BBBQQHH")
INLINE = 1  # flags: payload frame 0 ends the first frame
INLINE_MAX = 16 * 1024  # payload frame 0 up to this size travels inline
SMALL = 16 * 1024  # payloads below this are hashed as one joined buffer

Buffer = bytes | bytearray | memoryview


class Kind(str, enum.Enum):
    """Message kinds. Controller -> rank first, then rank -> controller.
    What each kind's meta holds is :data:`META` (the one schema; typed per
    kind in wire/metas.py); the comments below list the same keys."""

    CALL = "call"  # run a pickled function (payload: fn, args, kwargs;
    # meta: elastic, generation, check, shm, parts)
    EXEC = "exec"  # run cell code (payload: the code; meta: code (before
    # exec_parts moves it to payload 0), name, setup, elastic, generation, check)
    INTERRUPT = "interrupt"  # raise KeyboardInterrupt in the main thread for call c
    # (meta leave: the call cannot finish, a member is gone for good: leave the group after it)
    PING = "ping"  # controller liveness; ranks exit when pings stop (meta of a kept
    # mesh: ep, cp, low, done, resend)
    STOP = "stop"  # leave cleanly
    STACKS = "stacks"  # return every thread's stack (meta flight: N: also the flight
    # recorder's newest N records, as a JSON payload frame of the reply)

    HELLO = "hello"  # rank process is up (meta: pid, incarnation, host; to a controller
    # that attached to a kept mesh also running, kept)
    READY = "ready"  # rank joined torch.distributed (meta: device, pid)
    FAILED_START = "failed_start"  # rank could not start (meta: error, tb)
    RESULT = "result"  # call c finished (meta: ok, error, n_out, n_m, o, shm,
    # parts; payload: output?, value)
    OUTPUT = "output"  # stdout/stderr text of call c (meta: n, the chunk no.;
    # payload: JSON, wire/payloads.py)
    HEARTBEAT = "heartbeat"  # control thread alive (meta: busy: the call, h: health figures,
    # el: in an mnb.elastic loop)
    INTERRUPTED = "interrupted"  # answer to INTERRUPT (meta: where the main thread was)
    STACKS_REPLY = "stacks_reply"  # answer to STACKS (meta: threads, busy)
    REFORM = "reform"  # leave the group, join a new generation on a new port
    # (meta: generation, port)
    REFORMED = "reformed"  # answer to REFORM (meta: generation, joining, error, call)
    METRICS = "metrics"  # batched mnb.log points (meta: n; payload: metricframes JSON)
    INPUT = "input"  # a line typed for a rank's debugger (meta: text)
    PROMPT = "prompt"  # a rank's debugger waits for a line (meta: prompt)
    # (last, so the kinds above keep their codes: a remote rank of the same
    # protocol version never gets this one, as it never gets shared memory)
    RELEASE = "release"  # controller -> rank: its result's segment is mapped (meta: tok)
    # agent -> controller: the same plain RESULT (no meta, same payload) of
    # call c from several ranks of its host, verified and signed by their
    # agent (wire/fold.py; payload: the ranks' main ids, one per line, then
    # the value's frame if any)
    FOLD = "fold"
    # agent -> controller: its ranks' heartbeats of the last moment, verified
    # and signed by their agent (wire/fold.py; payload: JSON, control id ->
    # the heartbeat's meta)
    BEATS = "beats"
    # controller -> rank, on the control channel: a request to the rank's
    # debugger (engine/dap_rank.py; meta: seq, cmd, thread; payload: JSON
    # arguments, wire/payloads.py)
    DEBUGGER = "debugger"
    # rank -> controller: the answer to a DEBUGGER request (meta seq: its
    # seq, ok, cmd) or an event of the rank's debugger (seq 0, cmd: stopped,
    # continued; call: the call it stopped in; payload: JSON body)
    DEBUGGER_EVENT = "debugger_event"


# What each kind's meta may hold, and of what JSON type: the one place the
# wire's metadata is written down. ``sign`` refuses a key that is not here
# (a sender drifting from the schema fails at once, in its own process);
# ``verify`` drops a message whose meta does not match it ("malformed"),
# before anything else reads it. A kind not listed carries no meta.
_S, _I, _B, _D, _L = (str,), (int,), (bool,), (dict,), (list,)
_OPT_I = (int, type(None))
META: dict[Kind, dict[str, tuple[type, ...]]] = {
    # generation: the group the call started in; check: strict mode (engine/flightrec.py)
    # shm: a descriptor of payload frames in shared memory (wire/shm.py;
    # its fields are checked there, after verify, before anything is mapped)
    # parts: big frames cut into pieces for the socket (wire/chunks.py)
    Kind.CALL: {"elastic": _B, "generation": _I, "check": _I, "shm": _D, "parts": _L},
    Kind.EXEC: {"code": _S, "name": _S, "setup": _B, "elastic": _B, "generation": _I,
                "check": _I},
    Kind.STACKS: {"flight": _I},  # also the newest N flight-recorder records
    # leave: the interrupted call cannot finish (a member of the group is gone
    # for good): leave the group once out of it, releasing the peers still in
    # a collective with this rank (engine/membership.py)
    Kind.INTERRUPT: {"leave": _B},
    # HELLO of a kept mesh's rank to a controller that attached (engine/kept.py):
    # running: the call it runs (0: idle), kept: the calls whose RESULT it holds
    # what: call id -> the cell's name or the function's, of those calls
    Kind.HELLO: {"pid": _I, "incarnation": _I, "host": _S, "running": _I, "kept": _L,
                 "what": _D},
    # PING of a kept mesh (controller/keep.py): ep: the controller's epoch (a new
    # one is a new controller: say HELLO), cp: its pid (shared memory's peer),
    # low / done: the calls it has done with (their kept RESULTs are dropped),
    # resend: send what you kept for this controller now
    # hi: say HELLO (again: one may have been lost while the sockets reconnected)
    Kind.PING: {"ep": _I, "cp": _I, "low": _I, "done": _L, "resend": _B, "hi": _B},
    Kind.READY: {"device": _S, "pid": _I},
    Kind.FAILED_START: {"error": _S, "tb": _S},
    # RESULT: ok (default true), error {type, msg, tb} when not ok, n_out / n_m:
    # OUTPUT chunks / METRICS batches sent before it on the control socket,
    # o: payload frame 0 is the last output (JSON), then the value
    Kind.RESULT: {"ok": _B, "error": _D, "n_out": _I, "n_m": _I, "o": _I, "shm": _D,
                  "parts": _L},
    Kind.OUTPUT: {"n": _I},  # chunk number within the call, -1: uncounted
    Kind.METRICS: {"n": _I},  # batch number within the call, -1: uncounted
    # busy: the call running (0: idle); h: health; el: the main thread runs an
    # mnb.elastic loop (after a peer's death it carries on in place, so a
    # script's group restart leaves it alone: controller/life/policy.py)
    Kind.HEARTBEAT: {"busy": _I, "h": _D, "el": _B},
    Kind.INTERRUPTED: {"where": _S},
    Kind.STACKS_REPLY: {"threads": _L, "busy": _I},
    Kind.REFORM: {"generation": _I, "port": _I, "addr": _S, "members": _L},
    Kind.REFORMED: {"generation": _I, "joining": _B, "error": _S, "call": _I},
    Kind.INPUT: {"text": _S},
    Kind.PROMPT: {"prompt": _S},
    Kind.RELEASE: {"tok": _S},
    Kind.DEBUGGER: {"seq": _I, "cmd": _S, "thread": _S},
    Kind.DEBUGGER_EVENT: {"seq": _I, "cmd": _S, "ok": _B},
}


def exec_parts(meta: dict[str, Any]) -> tuple[list[bytes], dict[str, Any]]:
    """An EXEC's payload and meta: the cell's code travels as payload frame
    0 (UTF-8), never in the header, whose size is bounded (MAX_HEADER_BYTES:
    a cell longer than that was dropped by the rank as oversized, and its
    call waited for ever). ``meta``'s other fields stay."""
    if "code" not in meta:
        return [], meta
    rest = dict(meta)
    return [str(rest.pop("code")).encode()], rest


def check_meta(kind: Kind, meta: dict[str, Any]) -> None:
    """Raise ValueError unless ``meta`` fits ``kind``'s schema (:data:`META`)."""
    schema = META.get(kind, {})
    for key, value in meta.items():
        types = schema.get(key)
        if types is None:
            raise ValueError(f"{kind.value} meta has no field {key!r} "
                             f"(wire/protocol.py META: {sorted(schema)})")
        if not isinstance(value, types) or (types is _I and isinstance(value, bool)):
            raise ValueError(f"{kind.value} meta {key!r} must be {types[0].__name__}, "
                             f"not {type(value).__name__}")


def encode_meta(kind: Kind, meta: dict[str, Any] | None) -> bytes:
    """The meta part of a header: checked against the schema, compact JSON."""
    if not meta:
        return b""
    check_meta(kind, meta)
    return json.dumps(meta, separators=(",", ":")).encode()


def decode_meta(kind: Kind, raw: bytes) -> dict[str, Any]:
    """The meta of a verified header; ValueError/TypeError unless it is a
    JSON object that fits ``kind``'s schema."""
    meta = json.loads(raw)
    if type(meta) is not dict:
        raise TypeError("meta is not an object")
    check_meta(kind, meta)
    return meta


_CODES = {k: i for i, k in enumerate(Kind)}
_BY_CODE = list(Kind)

# Bound once: verify and sign run for every message of the hot path.
_pack_head = HEAD.pack
_unpack_head = HEAD.unpack_from
_HEAD_SIZE = HEAD.size
_MIN_FIRST = SIGNATURE_BYTES + HEAD.size
_MAX_FIRST = SIGNATURE_BYTES + MAX_HEADER_BYTES + INLINE_MAX
_compare_digest = hmac.compare_digest
_LENGTHS = [struct.Struct(f"!{n}Q") for n in range(9)]


def _lengths(n: int) -> struct.Struct:
    """The struct of ``n`` payload-frame lengths (cached for small ``n``)."""
    return _LENGTHS[n] if n < 9 else struct.Struct(f"!{n}Q")


def new_key() -> bytes:
    """A fresh random per-mesh key (32 bytes)."""
    return secrets.token_bytes(32)


class Message:
    """A verified message: the header's fields plus still-opaque payload
    frames. One plain slots object per message (this is built for every
    message of the hot path; a separate header object cost measurably)."""

    __slots__ = ("kind", "sender", "seq", "call", "meta", "lengths", "version", "payload")

    def __init__(self, kind: Kind, sender: str, seq: int, call: int = 0,
                 meta: dict[str, Any] | None = None, lengths: tuple[int, ...] = (),
                 version: int = VERSION, payload: list[Any] | None = None) -> None:
        self.kind, self.sender, self.seq, self.call = kind, sender, seq, call
        self.meta = meta if meta is not None else {}
        self.lengths, self.version = lengths, version
        self.payload = payload if payload is not None else []  # zmq.Frame or bytes

    @property
    def header(self) -> Message:
        """The header fields (``msg.header.call``): the message itself."""
        return self

    def __repr__(self) -> str:
        return f"Message({self.kind.value}, {self.sender}, #{self.seq}, call {self.call})"


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
        seen = self._seen
        if seq > self.highest:  # the newest so far (the usual case): never seen
            seen.add(seq)
            self.highest = seq
            if len(seen) > 2 * self.size:
                floor = seq - self.size
                self._seen = {s for s in seen if s > floor}
            return True
        if seq <= self.highest - self.size or seq in seen:
            return False
        seen.add(seq)
        return True


class Codec:
    """Signs outgoing and verifies incoming messages for one endpoint.

    One ``Codec`` per sender identity: its sequence counter is shared by every
    thread that signs through it (``itertools.count`` is atomic under the GIL).
    """

    def __init__(self, key: bytes, sender: str, *, max_bytes: int = 4 << 30,
                 inline_max: int = INLINE_MAX) -> None:
        """``inline_max``: the largest payload frame 0 that :meth:`sign`
        puts inside the first frame (-1: never; verify accepts both layouts)."""
        if len(key) < 16:
            raise ValueError("mesh key must be at least 16 bytes")
        self._key = key
        self.sender = sender
        self._sender_b = sender.encode()
        self._sender_len = len(self._sender_b)
        # the header of a message with no or one payload frame, own id included
        self._pack_own = struct.Struct(f"{HEAD.format}{self._sender_len}s").pack
        self._pack_one = struct.Struct(f"{HEAD.format}{self._sender_len}sQ").pack
        self._senders: dict[bytes, str] = {}  # decoded sender ids, by their bytes
        self.max_bytes = max_bytes
        self.inline_max = min(inline_max, INLINE_MAX)
        self._seq = itertools.count(1)
        self._windows: dict[str, ReplayWindow] = {}
        # HMAC-SHA256 (RFC 2104) from two keyed SHA-256 states computed once:
        # a message then costs two state copies and two updates. OpenSSL 3's
        # one-shot HMAC looks the algorithm up on every call, which made
        # signing a measurable part of a no-op call; the result is the
        # same bytes as hmac.new(key, msg, "sha256") (tests check it).
        block = key if len(key) <= 64 else hashlib.sha256(key).digest()
        block = block.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    # -- outgoing ---------------------------------------------------------
    def sign(
        self,
        kind: Kind,
        payload: Sequence[Buffer] = (),
        *,
        call: int = 0,
        meta: dict[str, Any] | None = None,
    ) -> list[Buffer]:
        """Frames ready to send: ``[signature + header + payload[0], *payload[1:]]``
        when ``payload[0]`` is small (``INLINE``), else ``[signature + header, *payload]``."""
        seq = next(self._seq)
        extra = encode_meta(kind, meta) if meta else b""
        if not payload:
            header = self._pack_own(VERSION, _CODES[kind], 0, seq, call, self._sender_len, 0,
                                    self._sender_b)
            if extra:
                header += extra
            return [self._mac(header) + header]
        n = len(payload)
        if n == 1:  # most calls and results: one struct for the whole header
            length = memoryview(payload[0]).nbytes
            inline = length <= self.inline_max
            header = self._pack_one(VERSION, _CODES[kind], INLINE if inline else 0, seq, call,
                                    self._sender_len, 1, self._sender_b, length)
            total = length
        else:
            lengths = [memoryview(p).nbytes for p in payload]
            inline = lengths[0] <= self.inline_max
            header = b"".join([_pack_head(VERSION, _CODES[kind], INLINE if inline else 0, seq, call,
                                          self._sender_len, n),
                               self._sender_b, _lengths(n).pack(*lengths)])
            total = sum(lengths)
        if extra:
            header += extra
        if not inline:
            return [self._digest(header, payload, total) + header, *payload]
        body = b"".join([header, payload[0]])
        if n == 1:
            return [self._mac(body) + body]
        rest = payload[1:]
        return [self._digest(body, rest, total - lengths[0]) + body, *rest]

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
        if n != 1:
            if n < 1:
                raise ProtocolError("truncated", "no frame")
            if n > MAX_FRAMES:
                raise ProtocolError("oversized", f"{n} frames")
        first = frames[0]
        if type(first) is not bytes:
            try:
                first = first.bytes  # a zmq.Frame (without importing zmq here)
            except AttributeError:
                first = bytes(first)
        size = len(first)
        if size < _MIN_FIRST:
            raise ProtocolError("truncated", "first frame shorter than signature + header")
        if size > _MAX_FIRST:
            raise ProtocolError("oversized", "header")
        body = first[SIGNATURE_BYTES:]  # header, then payload 0 if inline
        if n == 1:  # most messages: everything in one frame
            rest: list[Any] = []
            sizes: tuple[int, ...] = ()
            digest = self._mac(body)
        else:
            rest = list(frames[1:])
            sizes = tuple([memoryview(p).nbytes for p in rest])
            total = sum(sizes)
            if total > self.max_bytes:
                raise ProtocolError("oversized", f"{total} bytes")
            digest = self._digest(body, rest, total)
        if not _compare_digest(first[:SIGNATURE_BYTES], digest):
            raise ProtocolError("bad-signature")
        # Signed by a key holder from here on; still parse defensively.
        try:
            version, code, flags, seq, call, slen, nframes = _unpack_head(body)
            if version != VERSION:
                raise ProtocolError("version", f"v{version}, expected v{VERSION}")
            if flags & ~INLINE:
                raise ValueError(f"unknown flags {flags:#x}")
            pos = _HEAD_SIZE + slen
            if pos > size - SIGNATURE_BYTES:
                raise ValueError("the sender id runs past the header")
            sender = self._senders.get(body[_HEAD_SIZE:pos])
            if sender is None:
                sender = body[_HEAD_SIZE:pos].decode()
                if len(self._senders) < 1024:  # bounded: senders are few and known
                    self._senders[body[_HEAD_SIZE:pos]] = sender
            if nframes:
                lengths = (_LENGTHS[nframes] if nframes < 9 else _lengths(nframes)).unpack_from(
                    body, pos)
                pos += 8 * nframes
            else:
                lengths = ()
            end = size - SIGNATURE_BYTES
            if flags:  # INLINE: payload 0 is the end of this frame
                if not nframes or lengths[0] > INLINE_MAX or end - lengths[0] < pos:
                    raise ValueError("inline payload does not fit the first frame")
                end -= lengths[0]
            kind = _BY_CODE[code]
            if end > pos:
                if end > MAX_HEADER_BYTES:
                    raise ProtocolError("oversized", "header")
                meta = decode_meta(kind, body[pos:end])
            else:
                meta = {}
        except ProtocolError:
            raise
        except Exception as exc:  # RecursionError from nested JSON included
            raise ProtocolError("malformed", f"{type(exc).__name__}: {str(exc)[:200]}") from None
        if (lengths[1:] if flags else lengths) != sizes:
            raise ProtocolError("truncated", "payload lengths differ from header")
        if expected_sender is not None and sender != expected_sender:
            raise ProtocolError("sender-mismatch", f"{expected_sender!r} claims {sender!r}")
        window = self._windows.get(sender)
        if window is None:
            window = self._windows[sender] = ReplayWindow()
        if not window.check_and_add(seq):
            raise ProtocolError("replay", f"{sender} #{seq}")
        return Message(kind, sender, seq, call, meta, lengths, version,
                       [body[end:], *rest] if flags else rest)

    def forget(self, sender: str) -> None:
        """Drop the replay window of a sender that is gone for good."""
        self._windows.pop(sender, None)

    def _mac(self, data: Buffer) -> bytes:
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()

    def _digest(self, header: bytes, payload: Sequence[Any], total: int) -> bytes:
        inner = self._inner.copy()
        inner.update(header)
        if total <= SMALL:  # small frames: one update of their concatenation
            inner.update(b"".join(payload))
        else:
            for p in payload:
                inner.update(p)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()
