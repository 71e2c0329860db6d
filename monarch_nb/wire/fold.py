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

Order: a rank's messages on one channel keep their order. A result joins a
fold only if it is its channel's first message of the batch, and the fold
takes the place of its first member, so nothing a member sent before the
result comes after it, nor anything after it before.

Non-goals: the batch's envelope (relay.py), sockets (hostrelay.py), what
the controller does with a fold (controller/calls/assembler.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ProtocolError
from .protocol import INLINE, INLINE_MAX, SIGNATURE_BYTES, Codec, Kind

MAX_MEMBERS = 1024  # ranks named by one fold (far above a host's)
# where the kind and flags sit in a signed first frame (protocol.HEAD: version, kind, flags)
_KIND_AT = SIGNATURE_BYTES + 1
_RESULT_CODE = list(Kind).index(Kind.RESULT)
_FLAGS = (0, INLINE)  # no payload frame (0), or the one inline

Entry = tuple[bytes, Sequence[Any]]  # (sender's routing id, its message's frames)


class Folder:
    """One host's folding of its ranks' plain results (the agent's relay
    thread; :meth:`fold` keeps no state between batches but the replay
    windows of the ranks' messages it verified)."""

    def __init__(self, key: bytes, ident: str) -> None:
        self.ident = ident.encode()
        self.codec = Codec(key, ident)  # verifies the ranks', signs the agent's own
        self.folded = 0  # results that went up inside a fold

    def make(self, idents: Sequence[bytes], call: int, payload: bytes | None) -> Entry:
        """The fold of ``idents``' plain result ``payload`` (None: no value
        frame) of ``call``, signed by this agent: the batch entry to send."""
        body = [pack_members(idents)]
        if payload is not None:
            body.append(payload)
        self.folded += len(idents)
        return self.ident, self.codec.sign(Kind.FOLD, body, call=call)

    def fold(self, entries: Sequence[Entry]) -> list[Entry]:
        """``entries`` with the foldable results of each call folded (see the
        module's docstring); the rest, and every single result, unchanged."""
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
        if not folds:
            return list(entries)
        out: list[Entry] = []
        for i, entry in enumerate(entries):
            fold = folds.get(i)
            if fold is not None:
                out.append(fold)
            elif i not in skip:
                out.append(entry)
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


def _plain_result(first: Any) -> bool:
    """A cheap look before verifying: a RESULT small enough that its value
    (if any) travels inline (verify checks the header again, signed)."""
    head = first if isinstance(first, (bytes, bytearray)) else memoryview(first)
    return (len(head) > _KIND_AT + 1 and head[_KIND_AT] == _RESULT_CODE
            and head[_KIND_AT + 1] in _FLAGS and len(head) <= INLINE_MAX + 1024)


__all__ = ["MAX_MEMBERS", "Folder", "pack_members", "unpack_members"]
