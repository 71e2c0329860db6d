"""Typed metadata per message kind: one TypedDict per kind that carries meta.

protocol.META stays the one schema that ``sign`` and ``verify`` check; these
TypedDicts say the same for mypy, and tests/test_codecs.py checks that they
agree with META key by key and type by type (and that every kind in META has
one). Read a verified message's meta through :func:`meta_of`, which costs
nothing but a call: a TypedDict is a plain dict at run time.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict, overload

from .protocol import Kind, Message


class CallMeta(TypedDict, total=False):
    elastic: bool  # the call may run across a reform
    generation: int  # the group the call started in
    check: int  # strict mode (engine/flightrec.py)
    shm: dict[str, Any]  # payload frames in shared memory (wire/shm.py)
    parts: list[Any]  # big frames cut into pieces (wire/chunks.py)


class ExecMeta(TypedDict, total=False):
    code: str  # only before protocol.exec_parts moves it to payload 0
    name: str
    setup: bool
    elastic: bool
    generation: int
    check: int


class StacksMeta(TypedDict, total=False):
    flight: int  # also the flight recorder's newest N records


class InterruptMeta(TypedDict, total=False):
    leave: bool  # the call cannot finish: leave the group after it


class HelloMeta(TypedDict, total=False):
    pid: int
    incarnation: int
    host: str
    running: int  # a kept mesh's rank to a new controller: the call it runs
    kept: list[Any]  # ...and the calls whose RESULT it kept
    what: dict[str, Any]  # ...and what each of those is (a cell's name, a function's)


class PingMeta(TypedDict, total=False):
    ep: int  # a kept mesh's controller epoch (controller/keep.py)
    cp: int  # its pid
    low: int  # calls below this one are done with
    done: list[Any]  # and these
    resend: bool  # send what was kept now
    hi: bool  # say HELLO (again)


class ReadyMeta(TypedDict, total=False):
    device: str
    pid: int


class FailedStartMeta(TypedDict, total=False):
    error: str
    tb: str


class ResultMeta(TypedDict, total=False):
    ok: bool  # default true
    error: dict[str, Any]  # {type, msg, tb} when not ok
    n_out: int  # OUTPUT chunks sent before it
    n_m: int  # METRICS batches sent before it
    o: int  # payload frame 0 is the last output (JSON)
    shm: dict[str, Any]
    parts: list[Any]


class OutputMeta(TypedDict, total=False):
    n: int  # chunk number within the call, -1: uncounted


class MetricsMeta(TypedDict, total=False):
    n: int  # batch number within the call, -1: uncounted


class HeartbeatMeta(TypedDict, total=False):
    busy: int  # the call running, 0: idle
    h: dict[str, Any]  # health figures
    el: bool  # the main thread runs an mnb.elastic loop


class InterruptedMeta(TypedDict, total=False):
    where: str


class StacksReplyMeta(TypedDict, total=False):
    threads: list[Any]
    busy: int


class ReformMeta(TypedDict, total=False):
    generation: int
    port: int
    addr: str  # MASTER_ADDR of the new group (it moves when rank 0's host was replaced)
    # its members' mesh ranks, in the order of their torch ranks (fewer than
    # the mesh's after a shrink: engine/membership.py)
    members: list[int]


class ReformedMeta(TypedDict, total=False):
    generation: int
    joining: bool
    error: str
    # the call this member re-formed inside (mnb.elastic at a commit; 0: between
    # calls): the ranks the group took back join that call (a grow)
    call: int


class InputMeta(TypedDict, total=False):
    text: str


class PromptMeta(TypedDict, total=False):
    prompt: str


class ReleaseMeta(TypedDict, total=False):
    tok: str


class DebuggerMeta(TypedDict, total=False):
    seq: int  # the request's number (its answer carries it back)
    cmd: str  # configure, pause, continue, next, stepIn, stepOut, stackTrace, ...
    thread: str  # "live" (stopped in a call) or "pm" (the last failure's post-mortem)


class DebuggerEventMeta(TypedDict, total=False):
    seq: int  # the request answered; 0: an event
    cmd: str  # the request's command, or the event (stopped, continued)
    ok: bool  # the request succeeded (else the body's "message" says why)


# kind -> its TypedDict (for the test against META; nothing reads it per message)
TYPES: dict[Kind, type] = {
    Kind.CALL: CallMeta, Kind.EXEC: ExecMeta, Kind.STACKS: StacksMeta,
    Kind.INTERRUPT: InterruptMeta,
    Kind.HELLO: HelloMeta, Kind.READY: ReadyMeta, Kind.FAILED_START: FailedStartMeta,
    Kind.RESULT: ResultMeta, Kind.OUTPUT: OutputMeta, Kind.METRICS: MetricsMeta,
    Kind.HEARTBEAT: HeartbeatMeta, Kind.INTERRUPTED: InterruptedMeta,
    Kind.STACKS_REPLY: StacksReplyMeta, Kind.REFORM: ReformMeta,
    Kind.REFORMED: ReformedMeta, Kind.INPUT: InputMeta, Kind.PROMPT: PromptMeta,
    Kind.RELEASE: ReleaseMeta, Kind.PING: PingMeta,
    Kind.DEBUGGER: DebuggerMeta, Kind.DEBUGGER_EVENT: DebuggerEventMeta,
}


@overload
def meta_of(msg: Message, kind: Literal[Kind.CALL]) -> CallMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.EXEC]) -> ExecMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.STACKS]) -> StacksMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.INTERRUPT]) -> InterruptMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.HELLO]) -> HelloMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.PING]) -> PingMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.READY]) -> ReadyMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.FAILED_START]) -> FailedStartMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.RESULT]) -> ResultMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.OUTPUT]) -> OutputMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.METRICS]) -> MetricsMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.HEARTBEAT]) -> HeartbeatMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.INTERRUPTED]) -> InterruptedMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.STACKS_REPLY]) -> StacksReplyMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.REFORM]) -> ReformMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.REFORMED]) -> ReformedMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.INPUT]) -> InputMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.PROMPT]) -> PromptMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.RELEASE]) -> ReleaseMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.DEBUGGER]) -> DebuggerMeta: ...
@overload
def meta_of(msg: Message, kind: Literal[Kind.DEBUGGER_EVENT]) -> DebuggerEventMeta: ...
def meta_of(msg: Message, kind: Kind) -> Any:
    """``msg.meta`` typed as ``kind``'s TypedDict. ``kind`` is the kind the
    caller already dispatched on (verify checked the meta against META for
    ``msg.kind``); nothing is copied or checked again here."""
    return msg.meta
