"""Transport: ZeroMQ sockets and the controller's I/O thread. Never unpickles.

Controller side: one ROUTER socket, bound to loopback by default, owned by one
I/O thread (:class:`IOLoop`). Other threads never touch it: they append a
command to a deque and wake the loop through an eventfd, which costs one
wake-up (the notes in shared/ measured every extra thread hand-off at about the
price of the network hop itself on two cores). The same poll also watches
extra file descriptors (the supervisor registers each child's pidfd, so a dead
rank is noticed the moment it exits, without waiting for heartbeats).

Every inbound message goes through :meth:`Codec.verify` on the I/O thread;
failures are counted in :attr:`IOLoop.dropped` by reason and discarded. The
routing identity must equal the signed sender id, so a key holder cannot
impersonate another rank's socket either.

Rank side: channels.py (a ``ctl`` DEALER per rank, and a ``main`` channel
that is a DEALER for a remote rank and a link, link.py, for a local one,
which the loop here serves beside the ROUTER, from one epoll set with the
pidfds).

Encryption: a non-loopback mesh uses CurveZMQ (endpoints.CurveKeys): the
ROUTER is a Curve server with a key pair made for this mesh, and a ZAP handler
on the same I/O thread (an inproc REP socket in the poll, so no extra thread)
admits only clients whose public key is on the allow-list. A peer without the
keys cannot complete the handshake: it never gets a message to the signature
check, let alone to a rank. Refusals are counted in ``dropped["curve-refused"]``.

Non-goals: decisions (controller), payload encoding (serialize).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import zmq
from zmq.utils import z85

from ..errors import ProtocolError, UsageError, no_free_port
from .endpoints import ZAP_ENDPOINT, CurveKeys, bind_host
from .fold import unpack_beats, unpack_members
from .link import DROPPED, Link
from .protocol import Codec, Kind, Message
from .relay import unpack_batch
from .routes import Routes

log = logging.getLogger(__name__)

MessageHandler = Callable[[bytes, Message], None]
# a host agent's fold (fold.py): the ranks' main ids, the verified FOLD
FoldHandler = Callable[[list[bytes], Message], None]
# a host agent's BEATS (fold.py): each rank's control id and its heartbeat's meta
BeatsHandler = Callable[[dict[bytes, dict[str, Any]]], None]

# After a blocking caller hands the sockets back, the I/O thread waits this
# long before taking them: a loop of calls then never pays for waking it, and
# heartbeats or output are at most this late.
LINGER_S = 0.005
BUSY_RETRY_S = 0.02


def _bind_again(sock: zmq.Socket, endpoint: str, wait: float = 5.0) -> None:
    """Bind ``endpoint``, waiting up to ``wait`` s for a controller that is
    letting it go (a takeover: the old controller closes its socket when
    the agent tells it)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class IOLoop:
    """The controller's I/O thread and ROUTER socket."""

    def __init__(
        self,
        codec: Codec,
        on_message: MessageHandler,
        *,
        bind: str = "127.0.0.1",
        on_tick: Callable[[float], float | None] | None = None,
        max_message_bytes: int = 4 << 30,
        curve: CurveKeys | None = None,
        on_fold: FoldHandler | None = None,
        on_beats: BeatsHandler | None = None,
        port: int | None = None,
    ) -> None:
        self.codec = codec
        self._on_message = on_message
        self._on_fold = on_fold
        self._on_beats = on_beats
        self._on_tick = on_tick
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.curve = curve
        self.zap: zmq.Socket | None = None
        self.allowed_clients: set[bytes] = set()
        if curve is not None:
            # The ZAP handler must exist before the first handshake: with no
            # handler libzmq would admit every Curve client.
            self.zap = self.ctx.socket(zmq.REP)
            self.zap.setsockopt(zmq.LINGER, 0)
            self.zap.bind(ZAP_ENDPOINT)
            self.allowed_clients.add(z85.decode(curve.client_public))
            self.router.curve_server = True
            self.router.curve_secretkey = curve.server_secret
            self.router.curve_publickey = curve.server_public
            self.router.setsockopt(zmq.ZAP_DOMAIN, b"monarch-nb")
        host, advertised = bind_host(bind)
        if ":" in host:
            self.router.setsockopt(zmq.IPV6, 1)
        # a kept mesh's port (controller/keep.py): its ranks reconnect to it;
        # bound by bind_kept() once the mesh's agent admitted us (a takeover's
        # old controller lets it go only then)
        self._kept_bind = None if port is None else f"tcp://{host}:{port}"
        try:
            if port is None:
                port = self.router.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            for sock in (self.router, self.zap):
                if sock is not None:
                    sock.close(linger=0)
            self.ctx.term()
            if exc.errno == errno.EADDRINUSE:  # a port of the kernel's choosing: none left
                raise no_free_port(f"the controller on {host}") from None
            raise UsageError(f"cannot bind the controller to {bind!r}: {exc}; use an address "
                             "of this host, or 127.0.0.1") from None
        self.endpoint = f"tcp://{advertised}:{port}"
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._fds: dict[int, Callable[[], None]] = {}
        # Local ranks' main channels (link.py), by routing id and by fd. The
        # first is written by any thread (a dict store), read by the leader.
        self._links: dict[bytes, Link] = {}
        self._link_fds: dict[int, tuple[bytes, Link]] = {}
        # Remote ranks behind a host agent (routes.py, relay.py): written by
        # any thread, read by the leader.
        self.routes = Routes()
        self.relayed = self.routes.counts  # (what went through agents, by kind)
        self.max_message_bytes = max_message_bytes
        # Pidfds and links (one each per rank) wait in one epoll set, which
        # is a single entry of ZeroMQ's poll: zmq_poll walks every entry on
        # every turn, which at hundreds of ranks cost more than the messages.
        self._epoll = select.epoll()
        self._epoll_fd = self._epoll.fileno()
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        self._poller.register(self._wake_fd, zmq.POLLIN)
        self._poller.register(self._epoll_fd, zmq.POLLIN)
        if self.zap is not None:
            self._poller.register(self.zap, zmq.POLLIN)
        self._stopping = False
        self._lead = threading.RLock()
        self._want = 0
        self._want_lock = threading.Lock()
        self._released_at = 0.0
        self._next_tick = time.monotonic()
        self.dropped: collections.Counter[str] = collections.Counter()
        self._idents: dict[bytes, str] = {}
        self.thread = threading.Thread(target=self._run, name="monarch-nb-io", daemon=True)

    def bind_kept(self) -> None:
        """Bind a kept mesh's port (see __init__); waits a moment for a
        controller that is letting it go."""
        if self._kept_bind is None:
            return
        try:
            _bind_again(self.router, self._kept_bind)
        except zmq.ZMQError as exc:
            raise UsageError(f"{self._kept_bind}, where this kept mesh's ranks reconnect, is "
                             f"busy ({exc}): another process holds it; stop that process, or "
                             "stop the mesh with monarch-nb stop NAME") from None
        self._kept_bind = None

    def unreachable(self, idents: list[bytes], frames: list[Any]) -> list[bytes]:
        """Send ``frames`` to each of ``idents`` that is connected; the ones
        that are not (yet): a kept mesh's new controller waits until its
        ranks' sockets are back, since the ROUTER drops a message to a
        routing id it does not know. Run it on the thread that leads."""
        router, missing = self.router, []
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            for ident in idents:
                try:
                    router.send_multipart([ident, *frames], zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    if exc.errno not in (errno.EHOSTUNREACH, errno.EAGAIN):
                        raise
                    missing.append(ident)
        finally:
            router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        return missing

    # -- thread-safe API ----------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the thread that leads the loop, in order with other
        commands (usually the I/O thread)."""
        self._commands.append(fn)
        os.eventfd_write(self._wake_fd, 1)

    def watch_fd(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the loop once ``fd`` becomes readable (a pidfd:
        the process exited). The registration is removed first."""

        def add() -> None:
            try:
                self._watch(fd, select.EPOLLIN)
            except OSError:  # closed already (the process was reaped): say so now
                callback()
                return
            self._fds[fd] = callback

        self.call_soon(add)

    def attach_link(self, ident: bytes, sock: socket.socket) -> None:
        """From now on, messages to ``ident`` (a local rank's main id) go
        over ``sock``, its end of a socket pair (link.py), and what comes
        in on it is verified as sent by ``ident``. Thread-safe: sends take
        the link at once, reading starts at the loop's next turn."""
        if self._stopping:  # a respawn racing stop: nothing will read it
            sock.close()
            return
        link = Link(sock, self.max_message_bytes)
        self._links[ident] = link
        if self.router.closed:  # closed meanwhile (stop's last step)
            self._links.pop(ident, None)
            link.close()
            return

        def watch() -> None:
            if self._links.get(ident) is not link:  # already gone again
                return
            self._link_fds[link.fd] = (ident, link)
            self._fds.pop(link.fd, None)  # a closed pidfd's number, taken again
            self._watch(link.fd, _EPOLL_IN_OUT if link.waiting else select.EPOLLIN)

        self.call_soon(watch)

    def attach_relay(self, ident: bytes, agent: bytes) -> None:
        """From now on, messages to ``ident`` (a remote rank's main id) go
        through ``agent`` (its host agent's routing id), one message per
        host for a call to several of its ranks, and ``agent`` may relay
        messages signed by ``ident`` (relay.py). Thread-safe; call it before
        the rank is started, so its first message is expected."""
        self.routes.attach(ident, agent)

    def detach_relay(self, ident: bytes) -> None:
        """``ident``'s process is gone: its agent may no longer speak for it."""
        self.routes.detach(ident)

    def forget(self, *idents: bytes) -> None:
        """``idents`` were a process's that is gone for good (a rank's
        earlier incarnation): its replay window, its route through an agent
        and its cached name go, so a mesh that respawns ranks for days does
        not grow. Its stragglers are dropped by the rank table (no rank has
        these ids any more). Thread-safe."""
        for ident in idents:
            if ident:
                self.detach_relay(ident)
                name = self._idents.pop(ident, None)
                self.codec.forget(name if name is not None else ident.decode(errors="replace"))

    @property
    def links(self) -> int:
        """How many local ranks are on links now."""
        return len(self._links)

    @contextlib.contextmanager
    def leadership(self) -> Iterator[None]:
        """Own the sockets for the duration of a blocking call.

        The sockets have exactly one owner at any time, the holder of
        ``_lead``: the I/O thread by default, or a thread that is blocked
        waiting on a call anyway. Such a thread sends its request and runs
        the loop itself (:meth:`run_once`) until its call is answered, so
        the blocking path has no thread hand-off at all; every handler still
        runs on exactly one thread at a time. On two cores each hand-off
        costs about as much as the network hop (shared/notes), so this is
        what keeps a no-op call near the ZeroMQ floor.

        After a caller gives the sockets back the I/O thread waits
        ``LINGER_S`` before taking them again, so a loop of calls never has
        to wake it.
        """
        self.lead()
        try:
            yield
        finally:
            self.unlead()

    def lead(self) -> None:
        """Take the sockets (see :meth:`leadership`); pair with :meth:`unlead`.
        A Ctrl-C while waiting for them leaves them with their owner."""
        lead = self._lead
        if not lead.acquire(blocking=False):
            with self._want_lock:
                self._want += 1
            try:
                os.eventfd_write(self._wake_fd, 1)
                lead.acquire()
                with self._want_lock:
                    self._want -= 1
            except BaseException:
                # (the interrupt may land right after the lock was taken)
                if lead._is_owned():  # type: ignore[attr-defined]
                    lead.release()
                with self._want_lock:
                    self._want -= 1
                raise

    def give_back(self) -> None:
        """Release every hold this thread has on the sockets. A Ctrl-C can
        land between taking them and the ``try`` that gives them back;
        stopping calls this first, so the I/O thread can send the STOPs and
        close the sockets (it would wait for them for ever)."""
        if threading.current_thread() is self.thread:
            return  # the I/O thread's own hold ends with its loop
        lead = self._lead
        while lead._is_owned():  # type: ignore[attr-defined]
            self.unlead()

    def unlead(self) -> None:
        self._released_at = time.monotonic()
        if self._lead._is_owned():  # type: ignore[attr-defined]  # (give_back may have)
            self._lead.release()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self, timeout: float = 5.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:
            pass
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)
        if not self.thread.is_alive():
            with self._lead:
                self._close()

    # -- whoever leads ----------------------------------------------------------
    def send(self, ident: bytes, frames: Sequence[Any]) -> None:
        """Send now; only call while leading (handlers, commands, or inside
        :meth:`leadership`)."""
        self.send_many((ident,), frames)

    def send_many(self, idents: Sequence[bytes], frames: Sequence[Any]) -> None:
        """The same frames to each of ``idents`` (a call to several ranks:
        signed once, sent N times); only call while leading."""
        router = self.router
        last = len(frames) - 1
        links = self._links
        small: list[bool] | None = None
        if self.routes:
            idents = self._send_relayed(idents, frames)
        for ident in idents:
            if links:
                link = links.get(ident)
                if link is not None:  # a local rank's link (link.py)
                    if link.send(frames):  # the socket is full: the rest waits for room
                        self._watch(link.fd, _EPOLL_IN_OUT)
                    continue
            if small is None:
                small = [isinstance(f, bytes) or memoryview(f).nbytes < _COPY_BELOW for f in frames]
            try:
                socket_send(router, ident, _SNDMORE)
                for i, frame in enumerate(frames):
                    socket_send(router, frame, _SNDMORE if i < last else 0, small[i])
            except zmq.ZMQError as exc:  # peer gone: the supervisor reports deaths
                log.debug("send to %r failed: %s", ident, exc)

    def _send_relayed(self, idents: Sequence[bytes], frames: Sequence[Any]) -> Sequence[bytes]:
        """Send to the ranks of ``idents`` behind host agents, one message
        per agent (relay.py); the others are left to the caller."""
        fanouts, rest = self.routes.plan(idents)
        if fanouts:
            small = [isinstance(f, bytes) or memoryview(f).nbytes < _COPY_BELOW for f in frames]
            last = len(frames) - 1
            router = self.router
            self.relayed["fan-outs"] += len(fanouts)
            for agent, header in fanouts:
                try:
                    socket_send(router, agent, _SNDMORE)
                    socket_send(router, header, _SNDMORE)
                    for i, frame in enumerate(frames):
                        socket_send(router, frame, _SNDMORE if i < last else 0, small[i])
                except zmq.ZMQError as exc:  # the agent is gone: its host is lost (agents.py)
                    log.debug("send to agent %r failed: %s", agent, exc)
        return rest

    def _deliver_batch(self, agent: bytes, frames: list[Any]) -> None:
        """A host agent's batch: each message in it verified as sent by its
        rank, which must be one of this agent's (relay.py)."""
        try:
            entries = unpack_batch(frames[0].bytes, len(frames) - 1)
        except ProtocolError as exc:
            self._drop(agent, exc)
            return
        self.relayed["batches"] += 1
        self.relayed["messages"] += len(entries)
        owns, at = self.routes.owns, 1
        for ident, n in entries:
            part, at = frames[at:at + n], at + n
            if ident == agent:  # the agent's own: a fold of its ranks' results
                self._deliver_fold(agent, part)
                continue
            try:
                if not owns(agent, ident):  # an earlier incarnation's straggler (IOLoop.forget)
                    continue
            except ProtocolError as exc:  # another agent's rank: this message only
                self._drop(agent, exc)
                continue
            self._deliver(ident, self._ident_str(ident), part)

    def _deliver_fold(self, agent: bytes, frames: list[Any]) -> None:
        """An agent's own message, a FOLD or BEATS (fold.py): verified as
        the agent's, taken only if every rank it names is one of this
        agent's."""
        try:
            msg = self.codec.verify(frames, expected_sender=self._ident_str(agent))
            kind = msg.kind
            if kind is Kind.FOLD and self._on_fold is not None and msg.payload:
                members = self.routes.own(agent, unpack_members(msg.payload[0]))
                beats = None
            elif kind is Kind.BEATS and self._on_beats is not None and len(msg.payload) == 1:
                beats = unpack_beats(msg.payload[0])
                members = self.routes.own(agent, list(beats))
                if len(members) < len(beats):
                    beats = {ident: beats[ident] for ident in members}
            else:
                raise ProtocolError("relay-kind", f"an agent sends folds and beats, not {kind.value}")
        except Exception as exc:
            self._drop(agent, exc)
            return
        if not members:
            return
        try:
            if beats is not None:
                self.relayed["beats"] += len(beats)
                self._on_beats(beats)  # type: ignore[misc]
                return
            self.relayed["folds"] += 1
            self.relayed["folded"] += len(members)
            msg.payload = msg.payload[1:]  # the value's frames, as a RESULT's
            self._on_fold(members, msg)  # type: ignore[misc]
        except Exception:
            log.exception("monarch_nb I/O thread fold handler failed")

    def run_once(self, timeout: float, until: Callable[[], bool] | None = None) -> None:
        """One turn of the loop: wait up to ``timeout`` s for anything, then
        run commands, inbound messages, exited processes and the tick.
        ``until``: the leader's condition; reading messages stops once it
        holds (the rest wait for the next turn), which spares the no-op
        path the zmq.Again that ends a full drain."""
        # ceil: pyzmq truncates, and a 0 ms poll would spin until the tick
        timeout_ms = math.ceil(max(0.0, min(timeout, self._next_tick - time.monotonic()) * 1000))
        try:
            events = dict(self._poller.poll(timeout_ms))
        except zmq.ZMQError as exc:
            if exc.errno == zmq.ETERM:
                self._stopping = True
                return
            raise
        if self._wake_fd in events:
            try:
                os.eventfd_read(self._wake_fd)
            except BlockingIOError:
                pass
        self._run_commands()
        if self.zap is not None and self.zap in events:
            self._answer_zap()
        if self.router in events:
            self._drain_router(until)
        if self._epoll_fd in events:
            link_fds, fds = self._link_fds, self._fds
            for fd, ev in self._epoll.poll(0, 4096):
                found = link_fds.get(fd)
                if found is not None:
                    self._serve_link(found[0], found[1], ev, until)
                elif fd in fds:
                    callback = fds.pop(fd)
                    self._unwatch(fd)
                    self._guard(callback)
        now = time.monotonic()
        tick = self._on_tick
        if now >= self._next_tick:
            delay = self._guard(lambda: tick(now)) if tick is not None else None
            self._next_tick = now + (delay if isinstance(delay, (int, float)) else 0.5)

    # -- I/O thread -----------------------------------------------------------
    def _run(self) -> None:
        lead = self._lead
        while not self._stopping:
            if self._want:
                # A caller is blocked on the lock: never race it. Taking the
                # lock back at once (it is free only for an instant) could
                # starve that caller under load.
                time.sleep(LINGER_S)
                continue
            idle = time.monotonic() - self._released_at
            if idle < LINGER_S:
                time.sleep(LINGER_S - idle)
                continue
            # Never queue on the lock: a queued I/O thread would grab the
            # sockets the moment a caller lets go, and the caller's next call
            # would have to wake it again.
            if not lead.acquire(blocking=False):
                # a caller leads (and runs the loop itself): check back rarely
                time.sleep(BUSY_RETRY_S)
                continue
            if time.monotonic() - self._released_at < LINGER_S:
                lead.release()
                continue
            try:
                while not self._stopping and not self._want:
                    try:
                        self.run_once(1.0)
                    except Exception:  # a dead I/O thread is a hung notebook
                        log.exception("monarch_nb I/O loop turn failed")
                    if self._released_at > time.monotonic() - LINGER_S:
                        break
            finally:
                lead.release()
        with lead:
            self._run_commands()
            self._close()

    def run_commands(self) -> None:
        """Run queued commands now (only while leading)."""
        self._run_commands()

    def _run_commands(self) -> None:
        commands = self._commands
        while commands:
            self._guard(commands.popleft())

    def _drain_router(self, until: Callable[[], bool] | None = None) -> None:
        recv, deliver = self.router.recv, self._deliver
        idents, agents = self._idents, self.routes.agents
        # Bounded so commands and ticks are not starved. Frames are read one
        # by one because a Frame knows whether more follow: recv_multipart
        # asks the socket with a getsockopt per frame, and pyzmq's
        # getsockopt builds an enum each time (measurable on the no-op path,
        # more than the one zmq.Again that ends the drain). The routing id
        # comes as bytes: a ROUTER always has the message's frames after it.
        for _ in range(1000):
            try:
                ident = recv(_NOBLOCK)
            except zmq.Again:
                return
            try:
                frame = recv(_NOBLOCK, copy=False)
            except zmq.Again:  # cannot happen (a message has a frame); never block here
                continue
            frames = [frame]
            while frame.more:
                frame = recv(0, copy=False)
                frames.append(frame)
            if agents and ident in agents:
                self._deliver_batch(ident, frames)
                if until is not None and until():
                    return
                continue
            sender = idents.get(ident)
            if sender is None:
                sender = self._ident_str(ident)
            deliver(ident, sender, frames)
            if until is not None and until():
                return

    def _deliver(self, ident: bytes, sender: str, frames: list[Any]) -> None:
        """Verify a message from ``sender`` (the ROUTER's routing id, or the
        link's rank) and hand it to the controller; one that fails is
        counted and dropped, before anything reads it."""
        try:
            msg = self.codec.verify(frames, expected_sender=sender)
        except Exception as exc:  # never let a message kill the I/O thread
            self._drop(ident, exc)
            return
        try:
            self._on_message(ident, msg)
        except Exception:  # as _guard, inlined: this runs for every message
            log.exception("monarch_nb I/O thread handler failed")

    def _drop(self, ident: bytes, exc: Exception) -> None:
        """Count (and rarely log) a message that failed verification."""
        if not isinstance(exc, ProtocolError):
            exc = ProtocolError("malformed", f"{type(exc).__name__}: {exc}")
        dropped = self.dropped
        dropped[exc.reason] += 1
        n = dropped[exc.reason]
        if n == 1 or n % 1000 == 0:  # a flood of forgeries must not flood the log
            log.warning("dropped %d message(s) (%s), latest from %r: %s",
                        n, exc.reason, ident[:64], exc)

    def _serve_link(self, ident: bytes, link: Link, events: int,
                    until: Callable[[], bool] | None) -> None:
        """A local rank's link is readable (or writable again): the same
        verification and handler as a message from the ROUTER."""
        if events & select.EPOLLOUT and not link.flush():
            self._watch(link.fd, select.EPOLLIN)  # all sent: stop watching for room
        if events & _EPOLL_IN_ERR:
            sender = self._ident_str(ident)
            for _ in range(1000):  # bounded, as the ROUTER's drain
                frames = link.read()
                if frames is None:
                    break
                if frames is DROPPED:
                    self._drop(ident, ProtocolError(link.refused, "on a local link"))
                    continue
                self._deliver(ident, sender, frames)  # type: ignore[arg-type]
                if until is not None and until():
                    break
        if link.closed:  # the rank's process is gone (its pidfd reports the death)
            self._forget_link(ident, link)

    def _forget_link(self, ident: bytes, link: Link) -> None:
        if self._links.get(ident) is link:
            del self._links[ident]
        if self._link_fds.pop(link.fd, None) is not None:
            self._unwatch(link.fd)
        link.close()

    def _watch(self, fd: int, events: int) -> None:
        try:
            self._epoll.register(fd, events)
        except FileExistsError:
            self._epoll.modify(fd, events)

    def _unwatch(self, fd: int) -> None:
        with contextlib.suppress(OSError):  # closed already: epoll forgot it itself
            self._epoll.unregister(fd)

    def _ident_str(self, ident: bytes) -> str:
        text = self._idents.get(ident)
        if text is None:
            text = ident.decode("utf-8", "replace")
            if len(self._idents) < 4096:  # routing ids are few; forgeries must not grow this
                self._idents[ident] = text
        return text

    def _answer_zap(self) -> None:
        """ZAP (RFC 27): admit Curve clients whose public key is allowed."""
        zap = self.zap
        assert zap is not None
        for _ in range(100):
            try:
                frames = zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # version, request id, domain, address, identity, mechanism, credentials...
            ok = (len(frames) >= 7 and frames[0] == b"1.0" and frames[5] == b"CURVE"
                  and frames[6] in self.allowed_clients)
            if not ok:
                self.dropped["curve-refused"] += 1
                n = self.dropped["curve-refused"]
                if n == 1 or n % 1000 == 0:
                    peer = frames[3].decode("ascii", "replace") if len(frames) > 3 else "?"
                    log.warning("refused %d connection(s) without the mesh's Curve keys, "
                                "latest from %s", n, peer)
            request_id = frames[1] if len(frames) > 1 else b""
            zap.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                b"OK" if ok else b"unknown client key", b"", b""])

    def _guard(self, fn: Callable[[], Any]) -> Any:
        # The I/O thread must survive any bug in a handler: a dead I/O thread
        # is a hung notebook.
        try:
            return fn()
        except Exception:
            log.exception("monarch_nb I/O thread handler failed")
            return None

    def _close(self) -> None:
        if self.router.closed:
            return
        for link in list(self._links.values()):
            link.close()
        self._links.clear()
        self._link_fds.clear()
        self._epoll.close()
        self.router.close(linger=0)
        if self.zap is not None:
            self.zap.close(linger=0)
        try:
            os.close(self._wake_fd)
        except OSError:
            pass
        self.ctx.term()


_EPOLL_IN_OUT = select.EPOLLIN | select.EPOLLOUT
_EPOLL_IN_ERR = select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_COPY_BELOW = 64 * 1024


# pyzmq's Socket.send is a Python wrapper (routing ids, groups) around the
# Cython send; the wrapper is a measurable part of a no-op call.
socket_send = zmq.backend.Socket.send


def send_frames(sock: zmq.Socket, frames: Sequence[Any]) -> None:
    """``send_multipart`` without its per-frame enum arithmetic (measurable on
    the no-op path); small frames are copied, big ones sent zero-copy."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        big = not isinstance(frame, bytes) and memoryview(frame).nbytes >= _COPY_BELOW
        socket_send(sock, frame, _SNDMORE if i < last else 0, not big)


def pidfd_open(pid: int) -> int | None:
    """A pidfd for ``pid`` (readable once the process exits), or None where
    the kernel lacks pidfd_open (Linux < 5.3): the supervisor then polls."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError:
        return None


__all__ = ["IOLoop", "pidfd_open", "send_frames", "socket_send"]
