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
follows). A frame of several packets is announced by a packet of its own
(flag ``SIZED``, the frame's size as 8 bytes): the reader checks the size
against the message's bound, makes the frame's buffer once, and reads the
packets that follow straight into it (``recvmsg_into``: the flag byte into
a byte of its own, the data where it belongs): no object per packet and no
join (for a big result through a host agent's relay those were most of the
agent's CPU). The reader bounds a message's size (``max_bytes``) and frame count
while it assembles it, before anything else sees it. Big frames between
local processes go by shared memory anyway (shm.py); packets matter for the
ones below its threshold and for the fall-back when /dev/shm is full.

Passed frames (flag ``SHM``): a remote rank's link to its host agent
(hostrelay.py) carries its big frames in a sealed memory file passed with
the packet (``SCM_RIGHTS``, shm.seal_frames) instead of copied through the
socket. A message's big frames share one file: its first ``SHM`` packet
carries the file, each ``SHM`` packet names one frame in it (offset and
length, 8 bytes each); the reader maps the file once and puts views of the
mapping in the frames' places. The signed message is the same either way:
the signature covers the passed frames as any others (the controller checks
it), so a link that passes files changes how bytes move, never what is
vouched for. Only a link made with ``take_fds`` reads the files (the
agent's ends); on any other, a passed file is closed by the kernel and its
packet is junk (dropped, the stream goes on). The sender closes its fd as
soon as the packet is sent, the reader once the file is mapped: the pages
live as long as the mapping, that is until the last frame over it is gone
(sent on and dropped, or a message refused whole).

Non-goals: signing (protocol.py), the ROUTER (transport.py).
"""

from __future__ import annotations

import array
import collections
import os
import select
import socket
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import shm

PACKET_BYTES = 64 * 1024  # data per packet (the kernel's default buffer holds three)
MORE_PACKETS = 1
MORE_FRAMES = 2
SIZED = 4  # a packet that only says the size of the next frame (of several packets)
SHM = 8  # a frame in a memory file passed with this packet or an earlier one of its message
_OURS = MORE_PACKETS | MORE_FRAMES | SIZED  # (SHM: only a link that takes fds reads it)
_FLAGS = [bytes([i]) for i in range(16)]
_LAST, _NEXT_FRAME = _FLAGS[0], _FLAGS[MORE_FRAMES]
_SIZE = struct.Struct("<Q")
_SPAN = struct.Struct("<QQ")  # a passed frame: its offset and length in the file
_ANC_BYTES = socket.CMSG_SPACE(4 * array.array("i").itemsize)  # room for a few fds (one is ours)
_CTRUNC = socket.MSG_CTRUNC
_RECV_BYTES = PACKET_BYTES + 1
_NOSIGNAL = socket.MSG_NOSIGNAL
_TRUNC = socket.MSG_TRUNC
MAX_FRAMES = 4096  # as protocol.MAX_FRAMES: never more frames than verify takes
READ_BATCH = 64  # packets read per turn from one link (others wait their turn)

DROPPED = "dropped"  # (assembler) a message refused whole; the reason is in .refused
# a frame read: bytes, a buffer filled in place, or a view of a passed memory file
Frame = bytes | bytearray | memoryview


def pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair: (the controller's end, the rank's end). Neither is
    inheritable; the rank's is passed on explicitly (``pass_fds``)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return ours, theirs


def packets(frames: Sequence[Any]) -> Iterator[tuple[bytes, Any]]:
    """(flag byte, data) per packet of a message's ``frames``."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        yield from _frame_packets(frame, MORE_FRAMES if i < last else 0)


def _frame_packets(frame: Any, more: int) -> Iterator[tuple[bytes, Any]]:
    if type(frame) is bytes and len(frame) <= PACKET_BYTES:
        yield _FLAGS[more], frame
        return
    view = memoryview(frame).cast("B")
    size = view.nbytes
    if size <= PACKET_BYTES:
        yield _FLAGS[more], view
        return
    yield _FLAGS[SIZED], _SIZE.pack(size)  # the reader makes the frame's buffer once
    for start in range(0, size, PACKET_BYTES):
        end = start + PACKET_BYTES
        yield _FLAGS[more | (MORE_PACKETS if end < size else 0)], view[start:end]


class Assembler:
    """Packets back into messages (lists of frames), with the message's size
    and frame count bounded before anything is kept. A frame of several
    packets is one ``bytearray`` made at its ``SIZED`` packet and filled in
    place (a buffer, not ``bytes``, as a frame mapped from shared memory is:
    shm.py); every other frame is ``bytes``."""

    __slots__ = ("max_bytes", "frames", "size", "refused", "_skipping", "_buf", "_pos", "_file")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.frames: list[Frame] = []
        self.size = 0
        self.refused = ""  # why the last DROPPED message was refused
        self._skipping = ""  # a refused message's remaining packets are read and dropped
        self._buf: bytearray | None = None  # the sized frame being filled
        self._pos = 0  # how much of it is there
        self._file: memoryview | None = None  # the message's passed memory file, mapped

    def slot(self) -> memoryview | None:
        """Where the next packet's data goes (a reader may receive it there
        and call :meth:`filled`), or None: read the next packet whole and
        :meth:`feed` it."""
        buf = self._buf
        if buf is None:
            return None
        return memoryview(buf)[self._pos:self._pos + PACKET_BYTES]

    def feed(self, packet: bytes) -> list[Frame] | str | None:
        """A whole message once its last packet came, :data:`DROPPED` for a
        refused one (``refused`` says why), else None."""
        flags = packet[0] if packet else 0xFF
        if flags & ~_OURS:
            # not a packet of ours at all: the stream is resynchronised at the
            # next packet, as if this one ended a message
            self._reset()
            self.refused = "malformed"
            return DROPPED
        if self._buf is not None:  # a packet of the sized frame, read whole: copy it in
            slot = self.slot()
            assert slot is not None
            n = len(packet) - 1
            if n > slot.nbytes:
                return self._fail(flags, "malformed")
            slot[:n] = memoryview(packet)[1:]
            return self.filled(flags, n)
        if self._skipping:
            if flags:
                return None
            self.refused, self._skipping = self._skipping, ""
            return DROPPED
        if flags & SIZED:
            return self._sized(flags, packet)
        if not flags and not self.frames:  # one packet, one frame
            if len(packet) - 1 > self.max_bytes:
                self.refused = "oversized"
                return DROPPED
            return [packet[1:]]
        self.size += len(packet) - 1
        if self.size > self.max_bytes or len(self.frames) >= MAX_FRAMES:
            return self._fail(flags, "oversized")
        if flags & MORE_PACKETS:  # only a sized frame has several packets
            return self._fail(flags, "malformed")
        self.frames.append(packet[1:])
        return self._frame_done(flags)

    def filled(self, flags: int, n: int, truncated: bool = False) -> list[Frame] | str | None:
        """``n`` bytes of a packet with ``flags`` were received into :meth:`slot`
        (``truncated``: the packet did not fit there)."""
        buf = self._buf
        if buf is None or truncated or flags & ~(MORE_PACKETS | MORE_FRAMES):
            return self._fail(flags, "malformed")
        self._pos += n
        self.size += n
        if flags & MORE_PACKETS:
            if self._pos >= len(buf):  # more packets than its size
                return self._fail(flags, "malformed")
            return None
        if self._pos != len(buf):  # its last packet came early
            return self._fail(flags, "malformed")
        self._buf, self._pos = None, 0
        self.frames.append(buf)
        return self._frame_done(flags)

    def _sized(self, flags: int, packet: bytes) -> list[Frame] | str | None:
        """The ``SIZED`` packet ahead of a frame of several packets: its size
        checked against the message's bound, then its buffer made."""
        (size,) = _SIZE.unpack_from(packet, 1) if len(packet) == 1 + _SIZE.size else (0,)
        if flags != SIZED or size <= PACKET_BYTES:  # (a sender never announces a one-packet frame)
            # nothing of ours: resynchronised at the next packet, as for junk
            self._reset()
            self.refused = "malformed"
            return DROPPED
        if self.size + size > self.max_bytes or len(self.frames) >= MAX_FRAMES:
            return self._fail(flags, "oversized")  # before anything is made
        # (a bytearray, not an anonymous mmap: the mmap measured slower)
        self._buf, self._pos = bytearray(size), 0
        return None

    def passed(self, packet: bytes, file: memoryview | None) -> list[Frame] | str | None:
        """An ``SHM`` packet (a link that takes fds): one frame of the
        message's memory file, ``file`` when this packet brought it (mapped
        by the link), else the one an earlier packet of the message brought."""
        flags = packet[0]
        if self._skipping:
            if flags & MORE_FRAMES:
                return None
            self.refused, self._skipping = self._skipping, ""
            return DROPPED
        if (self._buf is not None or flags & ~(SHM | MORE_FRAMES)
                or len(packet) != 1 + _SPAN.size):
            return self._fail(flags & MORE_FRAMES, "malformed")
        if file is not None:
            self._file = file
        file = self._file
        off, n = _SPAN.unpack_from(packet, 1)
        if file is None or off + n > file.nbytes:
            return self._fail(flags & MORE_FRAMES, "malformed")
        self.size += n
        if self.size > self.max_bytes or len(self.frames) >= MAX_FRAMES:
            return self._fail(flags & MORE_FRAMES, "oversized")
        self.frames.append(file[off:off + n])
        return self._frame_done(flags)

    def refuse(self, flags: int, reason: str) -> str | None:
        """Refuse the message a packet with ``flags`` belongs to (the link
        could not take what came with it)."""
        return self._fail(flags & (MORE_FRAMES | MORE_PACKETS), reason)

    def _frame_done(self, flags: int) -> list[Frame] | None:
        if flags & MORE_FRAMES:
            return None
        frames, self.frames, self.size, self._file = self.frames, [], 0, None
        return frames

    def _fail(self, flags: int, reason: str) -> str | None:
        """Refuse the message this packet belongs to: at once if it was its
        last packet, else once its last packet has been read and dropped."""
        self._reset()
        if flags:
            self._skipping = reason
            return None
        self.refused = reason
        return DROPPED

    def _reset(self) -> None:
        self.frames, self.size, self._buf, self._pos, self._file = [], 0, None, 0, None


class Link:
    """One end of a link. Controller side: non-blocking, written by whoever
    leads the I/O loop (packets the socket cannot take yet wait in order,
    see :meth:`send` and :meth:`flush`). Rank side: blocking, used by the
    main thread only (:meth:`send_blocking`, :meth:`recv`, :meth:`poll`)."""

    def __init__(self, sock: socket.socket, max_bytes: int, *, blocking: bool = False,
                 shm_threshold: int | None = None, take_fds: bool = False,
                 notice: Callable[[str], None] | None = None) -> None:
        """``shm_threshold``: frames at least this big are sent in a passed
        memory file (a remote rank's end towards its agent); ``take_fds``:
        read passed files (the agent's end); ``notice``: where the one line
        goes when no memory file can be made (stderr by default)."""
        sock.setblocking(blocking)
        self.sock = sock
        self.fd = sock.fileno()
        self.closed = False
        self.shm_threshold = shm_threshold
        self.take_fds = take_fds
        self._notice = notice or _stderr
        self._out: collections.deque[tuple[bytes, Any]] = collections.deque()
        self._in = Assembler(max_bytes)
        self._flag = bytearray(1)  # a packet's flag byte, when its data goes into a frame
        self._poll: select.poll | None = None

    @classmethod
    def inherited(cls, fd: int, max_bytes: int, shm_threshold: int | None = None) -> Link:
        """The rank's end, passed down by the controller (or its agent) as ``fd``."""
        os.set_inheritable(fd, False)  # never on to the user's subprocesses
        return cls(socket.socket(fileno=fd), max_bytes, blocking=True,
                   shm_threshold=shm_threshold)

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

    def read(self) -> list[Frame] | str | None:
        """The next whole message, :data:`DROPPED` (see :attr:`refused`),
        or None when nothing more is there now (or the peer closed:
        :attr:`closed`). Never blocks on a non-blocking end."""
        for _ in range(READ_BATCH):
            try:
                got = self._next()
            except BlockingIOError:
                return None
            except InterruptedError:
                continue
            except (OSError, EOFError):  # EOFError: the other process is gone
                self._broken()
                return None
            if got is not None:
                return got
        return None

    def _next(self) -> list[Frame] | str | None:
        """Read one packet and hand it to the assembler: into the sized
        frame's buffer when one is being filled, else whole. EOFError at the
        end of the stream."""
        asm = self._in
        slot = asm.slot()
        if slot is None:
            if self.take_fds:
                return self._next_with_fds()
            packet = self.sock.recv(_RECV_BYTES)
            if not packet:
                raise EOFError("the other end closed the link")
            return asm.feed(packet)
        flag = self._flag
        n, _, msg_flags, _ = self.sock.recvmsg_into((flag, slot))
        if not n:
            raise EOFError("the other end closed the link")
        return asm.filled(flag[0], n - 1, truncated=bool(msg_flags & _TRUNC))

    def _next_with_fds(self) -> list[Frame] | str | None:
        """A packet that may come with a passed memory file (the agent's end)."""
        asm = self._in
        packet, anc, msg_flags, _ = self.sock.recvmsg(_RECV_BYTES, _ANC_BYTES)
        fds = _fds_of(anc)
        if not packet:
            _close(fds)
            raise EOFError("the other end closed the link")
        flags = packet[0]
        if not fds and not flags & SHM:
            return asm.feed(packet)
        # what came with the packet is closed here whatever happens: the
        # mapping (if any) holds the pages, not the fd
        try:
            if not flags & SHM or len(fds) > 1 or msg_flags & _CTRUNC:
                shm.stats["link_refused"] += 1
                return asm.refuse(flags, "malformed")
            file = None
            if fds:
                try:
                    file = shm.map_passed(fds[0], asm.max_bytes)
                except shm.ShmError:
                    shm.stats["link_refused"] += 1
                    return asm.refuse(flags, "shm-refused")
            return asm.passed(packet, file)
        finally:
            _close(fds)

    # -- rank side (blocking) ----------------------------------------------------
    def send_blocking(self, frames: Sequence[Any]) -> None:
        """Send a whole message, waiting for room. A gone controller is
        left to the control thread (it exits the rank when pings stop)."""
        sendmsg = self.sock.sendmsg
        try:
            if len(frames) == 1 and type(frames[0]) is bytes and len(frames[0]) <= PACKET_BYTES:
                sendmsg((_LAST, frames[0]), (), _NOSIGNAL)
                return
            threshold = self.shm_threshold
            if threshold is not None and any(memoryview(f).nbytes >= threshold for f in frames):
                self._send_passed(frames, threshold)
                return
            for packet in packets(frames):
                sendmsg(packet, (), _NOSIGNAL)
        except OSError:
            self.closed = True

    def _send_passed(self, frames: Sequence[Any], threshold: int) -> None:
        """Send a message whose big frames go in one memory file, passed with
        its first ``SHM`` packet. Without a file (none could be made: a
        notice, once) every frame goes in packets."""
        sendmsg = self.sock.sendmsg
        big = [i for i, f in enumerate(frames) if memoryview(f).nbytes >= threshold]
        try:
            fd, at = shm.seal_frames([frames[i] for i in big])
        except OSError as exc:
            shm._fallback(exc, self._notice)
            for packet in packets(frames):
                sendmsg(packet, (), _NOSIGNAL)
            return
        try:
            spans = dict(zip(big, at, strict=True))
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            last = len(frames) - 1
            for i, frame in enumerate(frames):
                more = MORE_FRAMES if i < last else 0
                span = spans.get(i)
                if span is None:
                    for packet in _frame_packets(frame, more):
                        sendmsg(packet, (), _NOSIGNAL)
                    continue
                sendmsg((_FLAGS[SHM | more], _SPAN.pack(*span)), anc, _NOSIGNAL)
                anc = []  # the file goes once; the message's other SHM packets name it
        finally:
            # the file in flight is the kernel's now, then the reader's mapping
            os.close(fd)

    def recv(self) -> list[Frame] | str:
        """Wait for the next whole message (or :data:`DROPPED`). Raises
        EOFError once the controller's end is closed."""
        while True:
            try:
                got = self._next()
            except EOFError:
                self.closed = True
                raise EOFError("the controller closed the link") from None
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
        self._in._reset()  # a half-read message goes (a passed file's mapping with it)

    def close(self) -> None:
        self.closed = True
        self._out.clear()
        self._in._reset()
        try:
            self.sock.close()
        except OSError:
            pass


def _fds_of(anc: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[:len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
    return fds


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


__all__ = ["DROPPED", "PACKET_BYTES", "SHM", "SIZED", "Frame", "Assembler", "Link", "packets", "pair"]
