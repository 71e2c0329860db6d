"""Shared memory for large payload frames between processes of one host.

A sender moves every payload frame of at least ``THRESHOLD`` bytes (the
out-of-band buffers of NumPy arrays and CPU tensors, usually) into one
anonymous memory file (``memfd_create``) and sends, in the *signed* header's
meta, a descriptor instead of the bytes::

    {"pid": sender pid, "fd": fd number, "size": file size, "mesh": mesh id,
     "tok": random token (hex), "at": [[frame position, offset, length], ...]}

The receiver opens ``/proc/<pid>/fd/<fd>`` (the kernel allows that only to
the same user, as for a 0600 file), checks the file (size, seals, the mesh id
and token written at its start), maps it ``MAP_PRIVATE`` and puts views of
the mapping back at the listed positions of the payload, so serialize.loads
sees the frames it always saw. One copy in the sender, whatever the number of
receivers; none in the receivers.

Semantics: each receiver gets its own *writable, copy-on-write* view. The
sender seals the file (no write, shrink or grow) before it names it, so no
process can change what a receiver sees after the fact; a receiver's writes
copy the pages it touches into its own memory. A value pushed to four ranks
therefore behaves in each exactly as four independent copies did over the
sockets (the tests write in one rank and read in the others and in the
controller).

Lifetime: the file has no name anywhere (nothing in /dev/shm, nothing to
clean up): it lives while the sender's fd is open or a receiver maps it.
The sender closes its fd once every receiver answered (``Segment.close``);
a SIGKILLed sender's fds close with it, a SIGKILLed receiver's mapping goes
with it. Receivers keep no fd: the mapping alone holds the pages, and it
is unmapped when the last array or tensor over it is garbage.

Trust: a descriptor is only ever read from a message whose HMAC and replay
checks passed (protocol.verify runs first); :func:`attach` then accepts it
only from the expected peer's pid (the rank's controller, or the rank the
result came from), and only a file that carries this mesh's id and the
descriptor's token. There is no digest over the mapped bytes: see
docs/security.md.

Passed files (:func:`seal_frames`, :func:`map_passed`): a rank on another
host than the controller's sends its big frames to its host agent the same
way, one sealed memory file per message, but the file itself travels over
their link (a Unix socket pair: ``SCM_RIGHTS``, wire/link.py) rather than a
descriptor in the signed meta. The frames stay *under* the signature there:
the rank signs every frame as it would over a socket, the agent forwards
the mapped frames as they are, and the controller checks the rank's HMAC
over all of them (docs/security.md). Such a file has no header: only the
rank holds the other end of the link, and it closes its fd once the file
is in flight, so nothing is left to release.

Non-goals: pickling (serialize), signing (protocol), who may use it (the
controller and the rank decide: local ranks, and remote ranks with their
agent), the link's packets (link.py).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import mmap
import os
import secrets
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

THRESHOLD = 1 << 20  # frames at least this big go through shared memory (default)
ALIGN = 64  # each frame starts on a 64-byte boundary (NumPy/SIMD alignment)
MAGIC = b"MNBSHM01"
HEADER = 64  # magic (8), mesh id (24, NUL-padded), token (16), spare (16)
_MESH_LEN = 24
_TOKEN_LEN = 16
PASSED_NAME = "monarch-nb-link"  # memory files passed over a link (seal_frames)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE

# What this process did (the controller shows its own in mesh.dataplane; a
# rank's are read by the tests): segments created and bytes written, frames
# and bytes mapped, descriptors refused, fallbacks to the sockets.
stats: collections.Counter[str] = collections.Counter()
_notice_lock = threading.Lock()
_noticed = False


class ShmError(Exception):
    """A descriptor was refused or its file could not be mapped."""


class Segment:
    """The sender's side of one memory file: its fd, closed once."""

    __slots__ = ("fd", "token", "size")

    def __init__(self, fd: int, token: bytes, size: int) -> None:
        self.fd, self.token, self.size = fd, token, size

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
            stats["released"] += 1

    def __del__(self) -> None:  # a segment dropped on an error path still closes
        self.close()


def pack(payload: Sequence[Any], mesh_id: str, threshold: int = THRESHOLD,
         notice: Callable[[str], None] | None = None,
         ) -> tuple[list[Any], dict[str, Any] | None, Segment | None]:
    """Move the frames of ``payload`` of at least ``threshold`` bytes into a
    new sealed memory file. Returns the frames left for the socket, the
    descriptor for the signed meta and the segment to close once every
    receiver answered; ``(payload, None, None)`` when nothing is big enough
    or the file cannot be made (then a one-line notice, once per process,
    to ``notice`` or else to stderr)."""
    sizes = [memoryview(p).nbytes for p in payload]
    big = [i for i, n in enumerate(sizes) if n >= threshold]
    if not big:
        return list(payload), None, None
    at: list[list[int]] = []
    off = HEADER
    for i in big:
        at.append([i, off, sizes[i]])
        off = _align(off + sizes[i])
    size = off
    token = secrets.token_bytes(_TOKEN_LEN)
    try:
        fd = os.memfd_create("monarch-nb", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        _fallback(exc, notice)
        return list(payload), None, None
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        _write_all(fd, _header(mesh_id, token), 0)
        for (i, start, _n) in at:
            _write_all(fd, payload[i], start)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
    except OSError as exc:  # ENOSPC/ENOMEM writing the pages, mostly
        os.close(fd)
        _fallback(exc, notice)
        return list(payload), None, None
    except BaseException:  # Ctrl-C while writing: no fd left behind
        os.close(fd)
        raise
    seg = Segment(fd, token, size)
    stats["created"] += 1
    stats["bytes_written"] += sum(n for _, _, n in at)
    moved = set(big)
    rest = [p for i, p in enumerate(payload) if i not in moved]
    desc = {"pid": os.getpid(), "fd": fd, "size": size, "mesh": mesh_id,
            "tok": token.hex(), "at": at}
    return rest, desc, seg


def attach(payload: Sequence[Any], desc: Any, *, peer_pid: int | None, mesh_id: str,
           max_bytes: int) -> list[Any]:
    """The full payload of a verified message whose meta carried ``desc``:
    ``payload`` (the frames that came by socket) with views of the mapped
    file put back at their positions. Raises :class:`ShmError` (counted in
    ``stats["refused"]``) for a descriptor that does not come from
    ``peer_pid``, names a file that is not this mesh's segment with this
    token, or does not fit its own sizes; nothing is mapped then."""
    try:
        pid, fd, size, token, at = _check(desc, peer_pid, mesh_id, max_bytes, len(payload))
        view = _map(pid, fd, size, mesh_id, token)
    except ShmError:
        stats["refused"] += 1
        raise
    full: list[Any] = [None] * (len(payload) + len(at))
    for pos, off, n in at:
        full[pos] = view[off:off + n]
    rest = iter(payload)
    for i, frame in enumerate(full):
        if frame is None:
            full[i] = next(rest)
    stats["mapped"] += 1
    stats["bytes_mapped"] += sum(n for _, _, n in at)
    return full


def seal_frames(frames: Sequence[Any]) -> tuple[int, list[tuple[int, int]]]:
    """A new sealed memory file holding ``frames`` one after the other (each
    64-byte aligned): its fd (the caller closes it) and each frame's
    (offset, length). OSError if it cannot be made; nothing is left open then."""
    sizes = [memoryview(f).nbytes for f in frames]
    at: list[tuple[int, int]] = []
    off = 0
    for n in sizes:
        at.append((off, n))
        off = _align(off + n)
    fd = os.memfd_create(PASSED_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, max(off, 1))
        for frame, (start, _n) in zip(frames, at, strict=True):
            _write_all(fd, frame, start)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
    except BaseException:  # ENOSPC/ENOMEM writing the pages, or Ctrl-C: no fd left behind
        os.close(fd)
        raise
    stats["passed"] += 1
    stats["bytes_passed"] += sum(sizes)
    return fd, at


def map_passed(fd: int, max_bytes: int) -> memoryview:
    """The whole of a memory file that came as ``fd`` over a link (the
    caller still closes ``fd``; the mapping holds the pages). Raises
    :class:`ShmError` (counted in ``stats["refused"]``) unless it is a
    monarch_nb file made by :func:`seal_frames`, sealed, at most
    ``max_bytes`` (and its alignment) long: a peer that passes anything else
    (a pipe, an unsealed file that could shrink under the mapping and raise
    SIGBUS here) gets its message dropped, never this process hurt."""
    try:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            st = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise ShmError(f"the file passed is not a sealed memory file: {exc.strerror}") from None
        if not link.startswith("/memfd:" + PASSED_NAME) or (seals & _SEALS) != _SEALS:
            raise ShmError("the file passed is not a sealed monarch_nb file")
        if not 0 < st.st_size <= max_bytes + ALIGN * 4096:
            raise ShmError(f"the file passed is {st.st_size} bytes, over this mesh's "
                           "max_message_bytes")
        view = _Mapping.view(fd, st.st_size)
    except ShmError:
        stats["refused"] += 1
        raise
    stats["mapped_passed"] += 1
    stats["bytes_mapped_passed"] += st.st_size
    return view


def token_of(desc: Any) -> str:
    """The token a descriptor names (the key to release its segment)."""
    return str(desc.get("tok", "")) if isinstance(desc, dict) else ""


# -- helpers --------------------------------------------------------------------------------
def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _header(mesh_id: str, token: bytes) -> bytes:
    mesh = mesh_id.encode()[:_MESH_LEN].ljust(_MESH_LEN, b"\0")
    return (MAGIC + mesh + token).ljust(HEADER, b"\0")


_CHUNK = 4 << 20  # pwrite in pieces: measured ~15% faster than one 64 MiB call here


def _write_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + _CHUNK], offset + done)


def _fallback(exc: OSError, notice: Callable[[str], None] | None) -> None:
    global _noticed
    # Whatever the reason (ENOMEM, ENOSPC, EPERM, EMFILE, ...): shared
    # memory is an optimisation, never an error.
    stats["fallback"] += 1
    with _notice_lock:
        if _noticed:
            return
        _noticed = True
    line = (f"monarch_nb: shared memory unavailable ({exc.strerror or exc}); large values go "
            "through the sockets instead")
    if notice is not None:
        notice(line)
    else:
        print(line, file=sys.stderr)


def _check(desc: Any, peer_pid: int | None, mesh_id: str, max_bytes: int,
           n_socket: int) -> tuple[int, int, int, bytes, list[tuple[int, int, int]]]:
    if peer_pid is None:
        raise ShmError("shared memory is only used between processes of one host")
    if not isinstance(desc, dict):
        raise ShmError("the descriptor is not an object")
    try:
        pid, fd, size = desc["pid"], desc["fd"], desc["size"]
        mesh, tok, raw_at = desc["mesh"], desc["tok"], desc["at"]
    except KeyError as exc:
        raise ShmError(f"the descriptor lacks {exc}") from None
    if not all(type(v) is int for v in (pid, fd, size)) or fd < 0 or size < HEADER:
        raise ShmError("the descriptor's pid, fd or size is not a valid number")
    if pid != peer_pid:
        raise ShmError(f"the descriptor names process {pid}, not the peer ({peer_pid})")
    if mesh != mesh_id:
        raise ShmError(f"the descriptor belongs to mesh {str(mesh)[:32]!r}, not this one")
    if size > max_bytes + HEADER + ALIGN * 4096:
        raise ShmError(f"the segment is {size} bytes, over this mesh's max_message_bytes")
    try:
        token = bytes.fromhex(tok)
    except (TypeError, ValueError):
        raise ShmError("the descriptor's token is not hex") from None
    if len(token) != _TOKEN_LEN or not isinstance(raw_at, list) or not raw_at \
            or len(raw_at) > 4096:
        raise ShmError("the descriptor's token or frame list is malformed")
    at: list[tuple[int, int, int]] = []
    positions = set()
    total = n_socket + len(raw_at)
    for item in raw_at:
        if (not isinstance(item, list) or len(item) != 3
                or not all(type(v) is int and v >= 0 for v in item)):
            raise ShmError("the descriptor's frame list is malformed")
        pos, off, n = item
        if pos >= total or pos in positions or off < HEADER or off + n > size:
            raise ShmError("the descriptor's frames do not fit its segment")
        positions.add(pos)
        at.append((pos, off, n))
    return pid, fd, size, token, at


def _map(pid: int, fd: int, size: int, mesh_id: str, token: bytes) -> memoryview:
    try:
        # O_RDONLY: a private writable mapping needs no more, and this
        # process can never write into the sender's file.
        rfd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ShmError(f"cannot open process {pid}'s segment: {exc.strerror}") from None
    try:
        try:
            link = os.readlink(f"/proc/self/fd/{rfd}")
            st = os.fstat(rfd)
            seals = fcntl.fcntl(rfd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise ShmError(f"process {pid}'s fd {fd} is not a sealed memory file: "
                           f"{exc.strerror}") from None
        # Sealed against shrinking: a mapping can never fault (SIGBUS) on
        # pages cut off under it. Sealed against writing: what was signed
        # for is what every receiver sees.
        if not link.startswith("/memfd:monarch-nb") or (seals & _SEALS) != _SEALS:
            raise ShmError(f"process {pid}'s fd {fd} is not a sealed monarch_nb segment")
        if st.st_size != size:
            raise ShmError(f"the segment is {st.st_size} bytes, the descriptor says {size}")
        header = os.pread(rfd, HEADER, 0)
        if header[:len(MAGIC)] != MAGIC:
            raise ShmError("the segment has no monarch_nb header")
        if header[len(MAGIC):len(MAGIC) + _MESH_LEN] != _header(mesh_id, token)[len(MAGIC):
                                                                              len(MAGIC) + _MESH_LEN]:
            raise ShmError("the segment belongs to another mesh")
        if header[len(MAGIC) + _MESH_LEN:len(MAGIC) + _MESH_LEN + _TOKEN_LEN] != token:
            raise ShmError("the segment's token differs from the descriptor's")
        return _Mapping.view(rfd, size)
    finally:
        os.close(rfd)


_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long]
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """A private mapping that holds no fd (Python's ``mmap.mmap`` keeps a
    duplicate of the fd for as long as it lives: one per pushed value).
    Unmapped when the last view over it (array, tensor) is garbage."""

    @staticmethod
    def view(fd: int, size: int) -> memoryview:
        addr = _mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise ShmError(f"cannot map the segment: {os.strerror(err)}")
        buf = (ctypes.c_char * size).from_address(addr)
        # every view (memoryview, NumPy array, tensor) holds ``buf``; the
        # pages go when the last of them does
        fin = weakref.finalize(buf, _munmap, addr, size)
        fin.atexit = False  # at exit views may still be alive: leave it to the OS
        return memoryview(buf).cast("B")


__all__ = ["THRESHOLD", "Segment", "ShmError", "attach", "map_passed", "pack", "seal_frames",
           "stats", "token_of"]
