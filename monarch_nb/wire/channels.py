"""A rank's channels to its controller (the rank side of the wire).

Two per rank process (engine/loop.py): ``ctl``, used only by the control
thread (heartbeats, interrupts, output, stacks), and ``main``, used only by
the main thread (calls, cells, their results). Each is a DEALER
(:class:`SocketChannel`) or the rank's end of a link (:class:`LinkChannel`,
link.py): a local rank's main channel is a link with the controller, both
channels of a rank behind a host agent are links with the agent
(hostrelay.py), a joined rank (or ``relay=False``) has two DEALERs. Both
verify every message before anyone reads it.

Non-goals: the controller's side (transport.py), framing (link.py), signing
(protocol.py).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import zmq

from ..errors import ProtocolError
from .link import DROPPED, Link
from .protocol import Codec, Message
from .transport import send_frames, socket_send


def dealer(ctx: zmq.Context, identity: str, endpoint: str,
           curve: tuple[bytes, bytes, bytes] | None = None) -> zmq.Socket:
    """A rank-side DEALER connected to the controller; ``curve`` = (server
    public, own public, own secret) keys for an encrypted mesh."""
    sock = ctx.socket(zmq.DEALER)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 2000)  # let the last result leave on exit
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.IMMEDIATE, 0)
    sock.connect(endpoint)
    return sock


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """``recv_multipart(copy=False)`` without a getsockopt per frame."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    return frames


class SocketChannel:
    """A rank's main channel over its DEALER (a remote or joined rank; a
    local one uses its link: link.LinkChannel). Main thread only."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))

    def recv(self, codec: Codec, dropped: collections.Counter[str]) -> Message | None:
        return recv_verified(self.sock, codec, dropped)

    def send(self, frames: Sequence[Any]) -> None:
        if len(frames) == 1:  # one frame: no send_frames loop
            socket_send(self.sock, frames[0])
        else:
            send_frames(self.sock, frames)

    def close(self) -> None:
        self.sock.close()


def recv_verified(sock: zmq.Socket, codec: Codec, dropped: collections.Counter[str]) -> Message | None:
    """Receive one message and verify it; None (and counted) if it fails."""
    frames = recv_frames(sock)
    try:
        return codec.verify(frames)
    except ProtocolError as exc:
        dropped[exc.reason] += 1
        return None


class LinkChannel:
    """A local rank's main channel over its end of the link (see
    transport.SocketChannel for the same over a DEALER). Main thread only."""

    def __init__(self, link: Link) -> None:
        self.link = link

    def poll(self, timeout_ms: int) -> bool:
        return self.link.poll(timeout_ms)

    def recv(self, codec: Codec, dropped: collections.Counter[str]) -> Message | None:
        """Wait for a message and verify it; None (and counted) if it fails.
        EOFError once the controller's end is gone."""
        frames = self.link.recv()
        if frames is DROPPED:
            dropped[self.link.refused] += 1
            return None
        try:
            return codec.verify(frames)
        except ProtocolError as exc:
            dropped[exc.reason] += 1
            return None

    def send(self, frames: Sequence[Any]) -> None:
        self.link.send_blocking(frames)

    def close(self) -> None:
        self.link.close()


MainChannel = SocketChannel | LinkChannel  # a rank's main channel, either way


__all__ = ["LinkChannel", "MainChannel", "SocketChannel", "dealer", "recv_frames", "recv_verified"]
