"""Folding a host's answers: the same plain result from several of its
ranks goes up as one message, so the controller's work per call grows with
hosts, not ranks.

A call to all ranks of a mesh is mostly answered with the same bytes by
every rank (``None`` of a setup function, a step's ``True``, an ``int`` of
a collective). The host agent's relay (hostrelay.py) hands what its ranks
sent within one turn to :meth:`Folder.fold` before it goes up as a batch
(relay.py): the plain ``RESULT``\\ s (no meta: no output, no error, no
shared memory; no payload frame or one that travels inline) of the same
call with byte-identical payloads become one ``FOLD`` message: payload frame 0 the
ranks' main ids (:func:`pack_members`; a frame, not JSON meta: the
controller splits it in one C call), then the value's frame once. Anything
else passes through as it came.

Signing stays end to end. The agent verifies each rank's message with the
rank's own id as the sender, exactly as the controller would, before it
folds it, and signs the fold as itself (the mesh key: the agent already
holds it, it hands it to the ranks it starts, so a fold is no easier to
forge than a rank's result). The controller verifies the fold with the
agent's routing id as the sender and takes it only if every rank it names
is one the agent relays for (transport.IOLoop). A message that fails the
agent's check is passed through unchanged: the controller drops and counts
it, where the user sees it (``mesh.dropped``).

Heartbeats: each rank beats every half second at its own moment, so the
relay holds them (:data:`BEAT_HOLD_S`) and sends those of the moment as one
``BEATS`` message, verified and signed by the agent like a fold (payload:
JSON, each rank's control id and its heartbeat's meta). The controller's
liveness looks at heartbeats only after seconds of silence; a stopped rank
is seen through its process state, which the agent reports on its own. One
heartbeat is news, though: the one that says its rank entered or left an
``mnb.elastic`` loop (meta ``el``) goes up at once, with those held. The
controller decides by it whether a peer's death restarts a script's rank
in a new process or leaves it to re-form in place, and a host lost a
moment after the loop began must not find it still on its way.

Order: a rank's messages on one channel keep their order (a heartbeat
excepted: nothing waits for it). A result joins a
fold only if it is its channel's first message of the batch, and the fold
takes the place of its first member, so nothing a member sent before the
result comes after it, nor anything after it before.

Non-goals: the batch's envelope (relay.py), sockets (hostrelay.py), what
the controller does with a fold (controller/calls/assembler.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..errors import ProtocolError
from .protocol import INLINE, INLINE_MAX, SIGNATURE_BYTES, Codec, Kind, check_meta

MAX_MEMBERS = 1024  # ranks named by one fold (far above a host's)
# where the kind and flags sit in a signed first frame (protocol.HEAD: version, kind, flags)
_KIND_AT = SIGNATURE_BYTES + 1
_RESULT_CODE = list(Kind).index(Kind.RESULT)
_BEAT_CODE = list(Kind).index(Kind.HEARTBEAT)
_BEAT_MAX = 16 * 1024  # a heartbeat is a header with a few health figures
# heartbeats wait this long in the agent for others to go up with; the
# controller's liveness needs them only every few seconds (heartbeat_timeout),
# a stopped rank is seen through its process state, not its heartbeat
BEAT_HOLD_S = 0.25
_FLAGS = (0, INLINE)  # no payload frame (0), or the one inline

Entry = tuple[bytes, Sequence[Any]]  # (sender's routing id, its message's frames)


class Folder:
    """One host's folding of its ranks' plain results and heartbeats (the
    agent's relay thread). Between batches it keeps the heartbeats it holds
    and the replay windows of the ranks' messages it verified."""

    def __init__(self, key: bytes, ident: str, beat_hold: float = BEAT_HOLD_S) -> None:
        self.ident = ident.encode()
        self.codec = Codec(key, ident)  # verifies the ranks', signs the agent's own
        self.folded = 0  # results that went up inside a fold
        self.beats_folded = 0  # heartbeats that went up inside a BEATS
        self.beat_hold = beat_hold
        # held heartbeats, oldest first, each with its meta once verified
        # here (None: it failed the check and goes up as it came)
        self._beats: list[tuple[Entry, dict[str, Any] | None]] = []
        self._beats_due: float | None = None  # when they go up
        self._in_loop: set[bytes] = set()  # ranks whose last heartbeat said el

    @property
    def due(self) -> float | None:
        """When held heartbeats must go up (call :meth:`fold` then, with or
        without new entries); None while none is held."""
        return self._beats_due

    def make(self, idents: Sequence[bytes], call: int, payload: bytes | None) -> Entry:
        """The fold of ``idents``' plain result ``payload`` (None: no value
        frame) of ``call``, signed by this agent: the batch entry to send."""
        body = [pack_members(idents)]
        if payload is not None:
            body.append(payload)
        self.folded += len(idents)
        return self.ident, self.codec.sign(Kind.FOLD, body, call=call)

    def fold(self, entries: Sequence[Entry], now: float | None = None) -> list[Entry]:
        """``entries`` with the foldable results of each call folded (see the
        module's docstring); the rest, and every single result, unchanged.
        With ``now`` (the relay's clock), heartbeats are held too, and those
        held go up together once :attr:`due` (at the end of the batch)."""
        if now is not None:
            entries = self._hold_beats(entries, now)
        groups: dict[tuple[int, bytes | None], list[int]] = {}  # (call, payload) -> entries
        seen: set[bytes] = set()  # ids with an earlier message in this batch
        for i, (ident, frames) in enumerate(entries):
            first = ident not in seen
            seen.add(ident)
            if not first or len(frames) != 1 or not _plain_result(frames[0]):
                continue
            try:
                msg = self.codec.verify(frames, expected_sender=ident.decode())
            except Exception:  # ProtocolError (or a bad id): the controller drops it
                continue
            if msg.meta or len(msg.payload) > 1 or not msg.call:
                continue
            key = (msg.call, bytes(msg.payload[0]) if msg.payload else None)
            groups.setdefault(key, []).append(i)
        folds: dict[int, Entry] = {}  # first member's index -> the fold
        skip: set[int] = set()
        for (call, payload), members in groups.items():
            for at in range(0, len(members), MAX_MEMBERS):
                part = members[at:at + MAX_MEMBERS]
                if len(part) < 2:
                    continue
                folds[part[0]] = self.make([entries[i][0] for i in part], call, payload)
                skip.update(part)
        out: list[Entry] = []
        if not folds:
            out = list(entries)
        else:
            for i, entry in enumerate(entries):
                fold = folds.get(i)
                if fold is not None:
                    out.append(fold)
                elif i not in skip:
                    out.append(entry)
        if now is not None and self._beats_due is not None and (
                now >= self._beats_due or len(self._beats) >= MAX_MEMBERS):
            out += self._take_beats()
        return out

    def _hold_beats(self, entries: Sequence[Entry], now: float) -> Sequence[Entry]:
        """``entries`` without their heartbeats, which are held (a
        heartbeat only says its rank's control thread runs, and carries its
        health figures: nothing else on its channel waits for it, so it may
        go up later than what its rank sent after it)."""
        rest: list[Entry] = []
        beats = self._beats
        news = False
        for entry in entries:
            ident, frames = entry
            if not (len(frames) == 1 and _is_beat(frames[0])):
                rest.append(entry)
                continue
            try:  # (verified once, here: the replay window takes a message once)
                meta: dict[str, Any] | None = self.codec.verify(
                    frames, expected_sender=ident.decode()).meta
            except Exception:  # ProtocolError (or a bad id): the controller drops it
                meta = None
            beats.append((entry, meta))
            if meta is not None and bool(meta.get("el")) != (ident in self._in_loop):
                if meta.get("el"):
                    self._in_loop.add(ident)
                else:
                    self._in_loop.discard(ident)
                news = True  # entered or left an elastic loop: up at once
        if news:
            self._beats_due = now
        elif beats and self._beats_due is None:
            self._beats_due = now + self.beat_hold
        return rest if len(rest) != len(entries) else entries

    def _take_beats(self) -> list[Entry]:
        """The held heartbeats: one BEATS signed by this agent for those it
        verified (each rank's newest), the others as they came (the
        controller drops and counts them)."""
        held, self._beats, self._beats_due = self._beats, [], None
        newest: dict[bytes, dict[str, Any]] = {}
        out: list[Entry] = []
        for entry, meta in held:
            if meta is None:
                out.append(entry)
            else:
                newest[entry[0]] = meta
        if len(newest) == 1 and not out and len(held) == 1:
            return [held[0][0]]  # one heartbeat: as it came
        if newest:
            body = json.dumps({i.decode(): m for i, m in newest.items()},
                              separators=(",", ":")).encode()
            out.append((self.ident, self.codec.sign(Kind.BEATS, [body])))
            self.beats_folded += len(newest)
        return out


def pack_members(idents: Sequence[bytes]) -> bytes:
    """A fold's first payload frame: its ranks' main ids, one per line (a
    routing id never holds a newline: config.RankEnv names them)."""
    return b"\n".join(idents)


def unpack_members(frame: Any) -> list[bytes]:
    """The ranks a fold names; ProtocolError("malformed") unless 1 to
    :data:`MAX_MEMBERS` distinct, non-empty ids."""
    members = bytes(frame).split(b"\n")
    if not 0 < len(members) <= MAX_MEMBERS or not all(members):
        raise ProtocolError("malformed", f"a fold names {len(members)} ranks (or an empty id)")
    if len(set(members)) != len(members):
        raise ProtocolError("malformed", "a fold names a rank twice")
    return members


def unpack_beats(frame: Any) -> dict[bytes, dict[str, Any]]:
    """A BEATS payload: each rank's control id and its heartbeat's meta
    (checked against the HEARTBEAT schema); ProtocolError("malformed")
    unless it is exactly that."""
    try:
        beats = json.loads(bytes(frame))
        if type(beats) is not dict or not 0 < len(beats) <= MAX_MEMBERS:
            raise ValueError(f"not an object of 1 to {MAX_MEMBERS} heartbeats")
        out = {}
        for ident, meta in beats.items():
            if not ident or type(meta) is not dict:
                raise ValueError("a heartbeat is not an id and a meta object")
            check_meta(Kind.HEARTBEAT, meta)
            out[ident.encode()] = meta
        return out
    except (ValueError, TypeError, RecursionError) as exc:  # (UnicodeError is a ValueError)
        raise ProtocolError("malformed", f"BEATS: {str(exc)[:200]}") from None


def _is_beat(first: Any) -> bool:
    head = first if isinstance(first, (bytes, bytearray)) else memoryview(first)
    return len(head) > _KIND_AT and head[_KIND_AT] == _BEAT_CODE and len(head) <= _BEAT_MAX


def _plain_result(first: Any) -> bool:
    """A cheap look before verifying: a RESULT small enough that its value
    (if any) travels inline (verify checks the header again, signed)."""
    head = first if isinstance(first, (bytes, bytearray)) else memoryview(first)
    return (len(head) > _KIND_AT + 1 and head[_KIND_AT] == _RESULT_CODE
            and head[_KIND_AT + 1] in _FLAGS and len(head) <= INLINE_MAX + 1024)


__all__ = ["BEAT_HOLD_S", "MAX_MEMBERS", "Folder", "pack_members", "unpack_beats",
           "unpack_members"]
