"""The host agent's relay: one ZeroMQ connection per host to the controller,
two links (wire/link.py) to each of the host's ranks.

Both of a remote rank's channels are socket pairs with its agent: main
(calls, cells, results, what goes ahead of them), as a local rank's is
with the controller, and control (heartbeats, output, metrics, interrupts,
stacks), so the host has no other connection to the controller. The relay
thread moves messages between those links and its one DEALER: a fan-out
from the controller (wire/relay.py) is sent to each rank it names, and what
the ranks sent within one turn goes up as one batch, in which the same
plain result of several ranks is one message, and so are the heartbeats of
a moment (fold.py).
So a call to a host's 8 ranks is one message each way on the network, and
the controller's work per call grows with hosts, not ranks.

Big frames come up without a copy through the link: a rank passes them in
a sealed memory file (link.py ``SHM``, shm.seal_frames), the relay maps it
and hands views of the mapping to ZeroMQ as zero-copy frames, so the bytes
are read once more, by the encryption or the kernel's send, and the file's
pages go when ZeroMQ lets go of the last frame over them. The rank's
signature covers those frames as any others; the controller checks it.
:meth:`Relay.counts` says how much came that way (the agent reports it
each tick: ``mesh.dataplane``).

The relay reads only the envelope. It cannot make a rank run anything:
every message keeps the controller's signature, which the rank verifies
(sender, replay window) before unpickling; the controller verifies each
rank's and takes from an agent only messages of the ranks it started
there. The DEALER is a CurveZMQ client with the mesh's keys where the
mesh is encrypted: the controller's ZAP allow-list admits it like a rank.

Non-goals: starting ranks (procs/hostagent.py), the envelope's layout (relay.py).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import socket
import threading
import time
from typing import Any

import zmq

from ..errors import ProtocolError
from . import shm
from .channels import recv_frames
from .fold import Folder
from .link import DROPPED, Link
from .relay import MAX_ENTRIES, pack_batch, unpack_fanout
from .transport import socket_send

log = logging.getLogger(__name__)

BATCH_BYTES = 64 << 20  # a batch going up is sent once it holds this much
_COPY_BELOW = 64 * 1024
_IN, _OUT = zmq.POLLIN, zmq.POLLOUT


class Relay:
    """The agent's end of the relay (a thread of its own)."""

    def __init__(self, ident: str, endpoint: str, curve: tuple[bytes, bytes, bytes] | None,
                 max_bytes: int, key: bytes | None = None) -> None:
        self.max_bytes = max_bytes
        self.ident = ident  # (a kept mesh's next controller routes through it: keptagent.py)
        # the mesh key (the ranks get it from us anyway): fold their equal results (fold.py)
        self.folder = None if key is None else Folder(key, ident)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        if curve is not None:
            self.sock.curve_serverkey, self.sock.curve_publickey, self.sock.curve_secretkey = curve
        self.sock.setsockopt(zmq.IDENTITY, ident.encode())
        self.sock.setsockopt(zmq.LINGER, 2000)  # the last results leave on a stop
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + (1 << 20))
        self.sock.connect(endpoint)
        self.dropped: collections.Counter[str] = collections.Counter()
        self._links: dict[bytes, Link] = {}  # by the rank's main id
        self._by_fd: dict[int, tuple[bytes, Link]] = {}
        self._new: collections.deque[tuple[bytes, socket.socket]] = collections.deque()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, _IN)
        self._poller.register(self._wake, _IN)
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name="monarch-nb-agent-relay",
                                       daemon=True)
        self.thread.start()

    def add(self, ident: str, sock: socket.socket) -> None:
        """Relay for the rank whose main id is ``ident`` over ``sock`` (our
        end of its link). Any thread."""
        self._new.append((ident.encode(), sock))
        os.eventfd_write(self._wake, 1)

    def counts(self) -> dict[str, int]:
        """What came up through shared memory: ``shm`` (messages whose big
        frames came in a passed file), ``shm_bytes`` (the files' bytes),
        ``shm_refused`` (passed files or packets refused: their messages
        dropped), ``dropped`` (messages dropped by the relay, any reason).
        The shared memory counts are this process's (an agent has one
        relay). Any thread."""
        return {"shm": shm.stats["mapped_passed"], "shm_bytes": shm.stats["bytes_mapped_passed"],
                "shm_refused": shm.stats["link_refused"], "dropped": sum(self.dropped.values())}

    def close(self) -> None:
        self._stopping = True
        os.eventfd_write(self._wake, 1)
        self.thread.join(5)
        if not self.thread.is_alive():
            for link in self._links.values():
                link.close()
            self.sock.close(linger=2000)
            self.ctx.term()
            os.close(self._wake)

    # -- the relay thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            try:
                self._turn()
            except Exception:  # a dead relay is a host whose ranks are cut off
                log.exception("monarch_nb agent: relay turn failed")

    def _turn(self) -> None:
        folder = self.folder
        timeout = 1000
        if folder is not None and folder.due is not None:  # held heartbeats go up then
            timeout = max(0, math.ceil((folder.due - time.monotonic()) * 1000))
        events = self._poller.poll(timeout)
        up: list[tuple[bytes, list[Any]]] = []
        for what, ev in events:
            if what is self.sock:
                self._down()
            elif what == self._wake:
                try:
                    os.eventfd_read(self._wake)
                except BlockingIOError:
                    pass
                self._attach()
            else:
                found = self._by_fd.get(what)
                if found is not None:
                    self._serve(found[0], found[1], ev, up)
        if folder is not None and (up or folder.due is not None):
            up = folder.fold(up, time.monotonic())  # type: ignore[assignment]
        if up:
            self._up(up)

    def _attach(self) -> None:
        while self._new:
            ident, sock = self._new.popleft()
            old = self._links.pop(ident, None)
            if old is not None:
                self._forget(ident, old)
            link = Link(sock, self.max_bytes, take_fds=True)  # (its rank passes big frames)
            self._links[ident] = link
            self._by_fd[link.fd] = (ident, link)
            self._poller.register(link.fd, _IN)

    def _down(self) -> None:
        """Fan-outs from the controller: the same frames to each rank named."""
        for _ in range(1000):
            try:
                frames = recv_frames(self.sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if len(frames) < 2:
                    raise ProtocolError("relay-malformed", "a fan-out without a message")
                idents = unpack_fanout(frames[0].bytes)
            except ProtocolError as exc:
                self.dropped[exc.reason] += 1
                continue
            body = [f.bytes if len(f) < _COPY_BELOW else f.buffer for f in frames[1:]]
            for ident in idents:
                link = self._links.get(ident)
                if link is None:
                    continue  # gone (its exit is reported by the agent)
                if link.send(body):
                    self._poller.register(link.fd, _IN | _OUT)

    def _serve(self, ident: bytes, link: Link, ev: int, up: list[tuple[bytes, list[Any]]]) -> None:
        if ev & _OUT and not link.flush():
            self._poller.register(link.fd, _IN)
        if ev & (_IN | zmq.POLLERR):
            for _ in range(64):
                got = link.read()
                if got is None:
                    break
                if got is DROPPED:
                    self.dropped[link.refused] += 1
                    continue
                up.append((ident, got))  # type: ignore[arg-type]
        if link.closed:
            self._forget(ident, link)

    def _forget(self, ident: bytes, link: Link) -> None:
        if self._links.get(ident) is link:
            del self._links[ident]
            if self.folder is not None:  # its rank is gone: so is its replay window
                self.folder.codec.forget(ident.decode(errors="replace"))
        if self._by_fd.pop(link.fd, None) is not None:
            try:
                self._poller.unregister(link.fd)
            except KeyError:
                pass
        link.close()

    def _up(self, up: list[tuple[bytes, list[Any]]]) -> None:
        """What the ranks sent this turn (folded: fold.py), as few batches
        as the bounds allow."""
        start = 0
        size = 0
        for i, (_, frames) in enumerate(up):
            size += sum(len(f) for f in frames)
            if size >= BATCH_BYTES or i - start + 1 >= MAX_ENTRIES:
                self._send_batch(up[start:i + 1])
                start, size = i + 1, 0
        if start < len(up):
            self._send_batch(up[start:])

    def _send_batch(self, part: list[tuple[bytes, list[Any]]]) -> None:
        header = pack_batch([(ident, len(frames)) for ident, frames in part])
        flat = [f for _, frames in part for f in frames]
        sock, last = self.sock, len(flat) - 1
        try:
            socket_send(sock, header, zmq.SNDMORE)
            for i, frame in enumerate(flat):
                socket_send(sock, frame, zmq.SNDMORE if i < last else 0, len(frame) < _COPY_BELOW)
        except zmq.ZMQError as exc:
            log.warning("monarch_nb agent: relay to the controller failed: %s", exc)


__all__ = ["Relay"]
