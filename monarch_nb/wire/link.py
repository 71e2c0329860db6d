"""Same-host link: a local rank's main channel over a Unix socket pair.

Why: on one host every ZeroMQ message crosses two extra threads, the
sender's and the receiver's ZeroMQ I/O threads, and on two cores each
wake-up costs about what the network hop does. Measured with raw sockets
and no protocol on either side: a round trip to 4 local processes takes
~65 µs over socket pairs (~97 µs of CPU) against ~210 µs over ZeroMQ
(~320 µs of CPU). So a local rank's *main* channel (calls, cells, REFORM,
STOP, RELEASE one way; READY, RESULT and what goes ahead of it the other)
is an ``AF_UNIX``/``SOCK_SEQPACKET`` pair the controller makes when it
starts the process: the rank inherits one end (``pass_fds``, its number in
``MONARCH_NB_LINK``) and has no main DEALER at all. The control channel
(heartbeats, interrupts, output, stacks) stays on ZeroMQ, as do remote ranks.

Security: a socket pair has no name in any namespace (no port, no path),
so no other process can connect to it; only the rank's process holds the
other end. Every message on it is still signed, verified (signature,
sender, replay window) and parsed exactly as one from the ROUTER, and only
then unpickled.

Framing: SEQPACKET keeps packet boundaries, so a read never returns half a
packet and a non-blocking write sends a whole packet or nothing. Each packet
is one flag byte, then up to :data:`PACKET_BYTES` of one frame; a bigger
frame goes in several packets. Flags: ``MORE_PACKETS`` (this frame goes on
in the next packet), ``MORE_FRAMES`` (another frame of this message
follows). The reader bounds a message's size (``max_bytes``) and frame count
while it assembles it, before anything else sees it. Big frames between
local processes go by shared memory anyway (shm.py); packets matter for the
ones below its threshold and for the fall-back when /dev/shm is full.

Non-goals: signing (protocol.py), the ROUTER (transport.py).
"""

from __future__ import annotations

import collections
import os
import select
import socket
from collections.abc import Iterator, Sequence
from typing import Any

PACKET_BYTES = 64 * 1024  # data per packet (the kernel's default buffer holds three)
MORE_PACKETS = 1
MORE_FRAMES = 2
_FLAGS = [bytes([i]) for i in range(4)]
_LAST, _NEXT_FRAME = _FLAGS[0], _FLAGS[MORE_FRAMES]
_RECV_BYTES = PACKET_BYTES + 1
_NOSIGNAL = socket.MSG_NOSIGNAL
MAX_FRAMES = 4096  # as protocol.MAX_FRAMES: never more frames than verify takes
READ_BATCH = 64  # packets read per turn from one link (others wait their turn)

DROPPED = "dropped"  # (assembler) a message refused whole; the reason is in .refused


def pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair: (the controller's end, the rank's end). Neither is
    inheritable; the rank's is passed on explicitly (``pass_fds``)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return ours, theirs


def packets(frames: Sequence[Any]) -> Iterator[tuple[bytes, Any]]:
    """(flag byte, data) per packet of a message's ``frames``."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        more = MORE_FRAMES if i < last else 0
        if type(frame) is bytes and len(frame) <= PACKET_BYTES:
            yield _FLAGS[more], frame
            continue
        view = memoryview(frame).cast("B")
        size = view.nbytes
        if size <= PACKET_BYTES:
            yield _FLAGS[more], view
            continue
        for start in range(0, size, PACKET_BYTES):
            end = start + PACKET_BYTES
            yield _FLAGS[more | (MORE_PACKETS if end < size else 0)], view[start:end]


class Assembler:
    """Packets back into messages (lists of ``bytes`` frames), with the
    message's size and frame count bounded before anything is kept."""

    __slots__ = ("max_bytes", "frames", "chunks", "size", "refused", "_skipping")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.frames: list[bytes] = []
        self.chunks: list[memoryview] = []
        self.size = 0
        self.refused = ""  # why the last DROPPED message was refused
        self._skipping = ""  # a refused message's remaining packets are read and dropped

    def feed(self, packet: bytes) -> list[bytes] | str | None:
        """A whole message once its last packet came, :data:`DROPPED` for a
        refused one (``refused`` says why), else None."""
        flags = packet[0] if packet else 0xFF
        if flags & ~(MORE_PACKETS | MORE_FRAMES):
            # not a packet of ours at all: the stream is resynchronised at the
            # next packet, as if this one ended a message
            self._reset()
            self.refused = "malformed"
            return DROPPED
        if self._skipping:
            if flags:
                return None
            self.refused, self._skipping = self._skipping, ""
            return DROPPED
        if not flags and not self.frames and not self.chunks:  # one packet, one frame
            if len(packet) - 1 > self.max_bytes:
                self.refused = "oversized"
                return DROPPED
            return [packet[1:]]
        self.size += len(packet) - 1
        if self.size > self.max_bytes or len(self.frames) >= MAX_FRAMES:
            reason = "oversized"
            self._reset()
            if flags:
                self._skipping = reason
                return None
            self.refused = reason
            return DROPPED
        if flags & MORE_PACKETS:
            self.chunks.append(memoryview(packet)[1:])
            return None
        if self.chunks:
            self.chunks.append(memoryview(packet)[1:])
            frame = b"".join(self.chunks)
            self.chunks = []
        else:
            frame = packet[1:]
        self.frames.append(frame)
        if flags & MORE_FRAMES:
            return None
        frames, self.frames, self.size = self.frames, [], 0
        return frames

    def _reset(self) -> None:
        self.frames, self.chunks, self.size = [], [], 0


class Link:
    """One end of a link. Controller side: non-blocking, written by whoever
    leads the I/O loop (packets the socket cannot take yet wait in order,
    see :meth:`send` and :meth:`flush`). Rank side: blocking, used by the
    main thread only (:meth:`send_blocking`, :meth:`recv`, :meth:`poll`)."""

    def __init__(self, sock: socket.socket, max_bytes: int, *, blocking: bool = False) -> None:
        sock.setblocking(blocking)
        self.sock = sock
        self.fd = sock.fileno()
        self.closed = False
        self._out: collections.deque[tuple[bytes, Any]] = collections.deque()
        self._in = Assembler(max_bytes)
        self._poll: select.poll | None = None

    @classmethod
    def inherited(cls, fd: int, max_bytes: int) -> Link:
        """The rank's end, passed down by the controller as ``fd``."""
        os.set_inheritable(fd, False)  # never on to the user's subprocesses
        return cls(socket.socket(fileno=fd), max_bytes, blocking=True)

    @property
    def refused(self) -> str:
        return self._in.refused

    # -- controller side (non-blocking) ------------------------------------------
    def send(self, frames: Sequence[Any]) -> bool:
        """Send a message, or queue what the socket cannot take yet; True
        while packets wait (the caller watches the fd for POLLOUT and calls
        :meth:`flush`). A link whose peer is gone drops everything (the
        supervisor reports the death)."""
        if self.closed:
            return False
        out = self._out
        if not out and len(frames) == 1:  # most messages: one packet
            frame = frames[0]
            if type(frame) is bytes and len(frame) <= PACKET_BYTES:
                try:
                    self.sock.sendmsg((_LAST, frame), (), _NOSIGNAL)
                    return False
                except BlockingIOError:
                    out.append((_LAST, frame))
                    return True
                except OSError:
                    self._broken()
                    return False
        out.extend(packets(frames))
        return self.flush()

    def flush(self) -> bool:
        """Send queued packets; True while some still wait."""
        out, sendmsg = self._out, self.sock.sendmsg
        while out:
            try:
                sendmsg(out[0], (), _NOSIGNAL)
            except BlockingIOError:
                return True
            except OSError:
                self._broken()
                return False
            out.popleft()
        return False

    @property
    def waiting(self) -> bool:
        return bool(self._out)

    def read(self) -> list[bytes] | str | None:
        """The next whole message, :data:`DROPPED` (see :attr:`refused`),
        or None when nothing more is there now (or the peer closed:
        :attr:`closed`). Never blocks on a non-blocking end."""
        recv, feed = self.sock.recv, self._in.feed
        for _ in range(READ_BATCH):
            try:
                packet = recv(_RECV_BYTES)
            except BlockingIOError:
                return None
            except InterruptedError:
                continue
            except OSError:
                self._broken()
                return None
            if not packet:  # end of file: the other process is gone
                self._broken()
                return None
            got = feed(packet)
            if got is not None:
                return got
        return None

    # -- rank side (blocking) ----------------------------------------------------
    def send_blocking(self, frames: Sequence[Any]) -> None:
        """Send a whole message, waiting for room. A gone controller is
        left to the control thread (it exits the rank when pings stop)."""
        sendmsg = self.sock.sendmsg
        try:
            if len(frames) == 1 and type(frames[0]) is bytes and len(frames[0]) <= PACKET_BYTES:
                sendmsg((_LAST, frames[0]), (), _NOSIGNAL)
                return
            for packet in packets(frames):
                sendmsg(packet, (), _NOSIGNAL)
        except OSError:
            self.closed = True

    def recv(self) -> list[bytes] | str:
        """Wait for the next whole message (or :data:`DROPPED`). Raises
        EOFError once the controller's end is closed."""
        recv, feed = self.sock.recv, self._in.feed
        while True:
            packet = recv(_RECV_BYTES)
            if not packet:
                self.closed = True
                raise EOFError("the controller closed the link")
            got = feed(packet)
            if got is not None:
                return got

    def poll(self, timeout_ms: int) -> bool:
        """Is a packet there (within ``timeout_ms``)?"""
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(self.fd, select.POLLIN)
        return bool(self._poll.poll(timeout_ms))

    # -- both ---------------------------------------------------------------------
    def _broken(self) -> None:
        self.closed = True
        self._out.clear()

    def close(self) -> None:
        self.closed = True
        self._out.clear()
        try:
            self.sock.close()
        except OSError:
            pass


__all__ = ["DROPPED", "PACKET_BYTES", "Assembler", "Link", "packets", "pair"]
