"""The call table and recovery, without processes: scripted event sequences,
as tests/test_policy.py does for the restart policy.

The call table is pure bookkeeping and is driven directly. Recovery is
driven through its event entry points (exit, ready, probe, tick) with a
stand-in supervisor and I/O loop that record what they were asked to do
(start a process, send frames): the decisions under test are Recovery's
and the call table's, not process handling (tests/test_recovery.py and
tests/test_chaos.py run the same stories on real ranks).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from typing import Any

import pytest

from monarch_nb.config import MeshConfig
from monarch_nb.controller.calls.calltable import CallTable, PendingCall
from monarch_nb.controller.calls.output import CallOutput
from monarch_nb.controller.life.events import EventKind
from monarch_nb.controller.life.policy import RestartPolicy
from monarch_nb.controller.life.rankstates import TRANSITIONS, IllegalTransition, RankState
from monarch_nb.controller.life.ranktable import RankTable
from monarch_nb.controller.life.recovery import REFORM_GRACE_S, Recovery
from monarch_nb.errors import MembershipChanged, MeshNotRunning, RankDied, RankErrors, RemoteError
from monarch_nb.futures import MeshFuture
from monarch_nb.results import Lost, RankResults
from monarch_nb.wire.protocol import Codec, Kind, Message, new_key

# -- the call table ------------------------------------------------------------------


def _call(table: CallTable, ranks: tuple[int, ...], *, elastic: bool = False,
          setup: dict[str, Any] | None = None) -> PendingCall:
    call_id = table.next_id()
    call = table.new(call_id, ranks, CallOutput(lambda s, t: None),
                     MeshFuture(call_id, ranks, lambda _id: None), frames=[b"f"],
                     elastic=elastic, setup=setup)
    table.sent(call)
    return call


def _died(rank: int) -> RankDied:
    return RankDied(rank, None, "SIGKILL", (), 0)


def test_a_call_finishes_once_every_rank_answered() -> None:
    table = CallTable()
    call = _call(table, (0, 1))
    table.complete(call, 0, "a")
    assert not call.future.done()
    table.complete(call, 1, "b")
    table.complete(call, 1, "late")  # a second answer changes nothing
    assert call.future.result() == RankResults({0: "a", 1: "b"})
    assert call.call_id not in table


def test_a_death_fails_plain_calls_and_survivors_read_membership_changed() -> None:
    table = CallTable()
    call = _call(table, (0, 1, 2))
    table.fail(1, _died(1), coming_back=True)  # not elastic: fails all the same
    table.complete(call, 0, error=RemoteError(0, "RuntimeError", "Connection reset by peer", ""))
    table.complete(call, 2, 7)
    with pytest.raises(RankErrors) as info:
        call.future.result()
    errors = info.value.errors
    assert isinstance(errors[1], RankDied)
    assert isinstance(errors[0], MembershipChanged) and errors[0].dead == (1,)
    assert "rank 1 died" in str(errors[0]) and info.value.results == {2: 7}


def test_an_elastic_call_is_reissued_on_the_new_process_and_then_finishes() -> None:
    table = CallTable()
    call = _call(table, (0, 1), elastic=True)
    table.fail(1, _died(1), coming_back=True)
    table.complete(call, 0, "s")
    assert not call.future.done() and call.reissue == {1}
    assert table.reissue(1) == [call] and table.reissue(1) == []
    table.complete(call, 1, "s")
    assert call.future.result() == {0: "s", 1: "s"}


def test_an_elastic_call_fails_for_a_rank_that_is_not_coming_back() -> None:
    table = CallTable()
    call = _call(table, (0, 1), elastic=True)
    table.fail(1, _died(1), coming_back=True)
    table.fail(1, RuntimeError("budget spent"), coming_back=False)  # the give-up
    table.complete(call, 0, "s")
    with pytest.raises(RankErrors, match="rank 1"):
        call.future.result()


def test_a_waiting_call_is_not_failed_by_a_death_of_its_rank() -> None:
    table = CallTable()
    call_id = table.next_id()
    call = table.new(call_id, (1,), CallOutput(lambda s, t: None),
                     MeshFuture(call_id, (1,), lambda _id: None), frames=[])
    table.wait(call)
    table.fail(1, _died(1), coming_back=True)
    assert not call.future.done() and table.take_waiting() == [call]


def test_stop_ends_every_call_sent_or_waiting_with_mesh_not_running() -> None:
    table = CallTable()
    sent = _call(table, (0,))
    call_id = table.next_id()
    waiting = table.new(call_id, (1,), CallOutput(lambda s, t: None),
                        MeshFuture(call_id, (1,), lambda _id: None), frames=[])
    table.wait(waiting)
    table.stop("the mesh was stopped")
    for call in (sent, waiting):
        with pytest.raises(MeshNotRunning, match="the mesh was stopped"):
            call.future.result(timeout=0)
    assert len(table) == 0 and table.waiting == []


def test_abandon_ends_a_call_for_ranks_still_running_it() -> None:
    table = CallTable()
    call = _call(table, (0, 1, 2), elastic=True)
    table.fail(1, _died(1), coming_back=False)
    table.abandon(call, {0, 2}, lambda r: MembershipChanged(r, (1,), "ended"))
    with pytest.raises(RankErrors) as info:
        call.future.result(timeout=0)
    assert set(info.value.errors) == {0, 1, 2}
    table.complete(call, 0, "late")  # ignored
    assert 0 not in info.value.results


def test_a_setup_cell_is_recorded_only_when_it_succeeded() -> None:
    table = CallTable()
    ok = _call(table, (0,), setup={"code": "x = 1", "name": "<s1>", "setup": True})
    bad = _call(table, (0,), setup={"code": "y", "name": "<s2>", "setup": True})
    table.complete(ok, 0, None)
    table.complete(bad, 0, error=RemoteError(0, "NameError", "y", ""))
    assert [c["name"] for c in table.setup_cells] == ["<s1>"]


def test_a_cancelled_future_is_left_alone() -> None:
    table = CallTable()
    call = _call(table, (0,))
    assert call.future.cancel()
    table.complete(call, 0, 1)
    assert call.future.cancelled()


# -- the rank table --------------------------------------------------------------------


def test_every_move_outside_the_transition_table_is_refused() -> None:
    for frm, allowed in TRANSITIONS.items():
        for to in RankState:
            table = RankTable(1)
            table[0].state = frm  # set up the start state (the test's own business)
            if to is frm or to in allowed:
                table.move(0, to)
                assert table[0].state is to
            else:
                with pytest.raises(IllegalTransition):
                    table.move(0, to)
    assert TRANSITIONS[RankState.STOPPED] == frozenset()


def test_a_new_process_gets_new_identities_and_old_ones_match_nothing() -> None:
    table = RankTable(2)
    first = table.bind(1, 0).main_id
    assert table.lookup(first) is table[1]
    table.move(1, RankState.READY)
    table.respawning(1, 1)
    table.bind(1, 1)
    assert table.lookup(first) is None and table.lookup(table[1].ctl_id) is table[1]


# -- recovery, scripted ----------------------------------------------------------------


class _Popen:
    def __init__(self) -> None:
        self.code: int | None = None
        self.stdin = None

    def poll(self) -> int | None:
        return self.code


@dataclass
class _Proc:
    rank: int
    incarnation: int
    popen: Any
    pid: int
    pidfd: int | None = None
    from_spare: bool = False
    forked: bool = False
    announced: bool = False
    link: Any = None  # no link: a simulated process
    flight: tuple[dict[str, Any], list[Any]] = ({}, [])  # (no flight records)


@dataclass
class _Supervisor:
    """Records what Recovery asks of process handling."""

    procs: dict[int, _Proc] = field(default_factory=dict)
    started: list[tuple[int, int]] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    spare: subprocess.Popen[bytes] | None = None
    master_port: int = 0
    generation: int = 0

    def spawn(self, rank: int, incarnation: int, identity: str) -> _Proc:
        proc = _Proc(rank, incarnation, _Popen(), 1000 + 10 * rank + incarnation)
        self.procs[rank] = proc
        self.started.append((rank, incarnation))
        return proc

    def reform(self, generation: int, master_port: int,
               group: tuple[int, ...] | None = None) -> None:
        self.generation, self.master_port = generation, master_port
        self.group = group

    def reap(self, rank: int, proc: Any = None) -> int | None:
        return (proc or self.procs[rank]).popen.code

    def kill_proc(self, proc: _Proc) -> None:
        proc.popen.code = -9
        self.killed.append(proc.rank)

    def tail(self, rank: int, lines: int = 10) -> list[str]:
        return []

    def master_addr(self) -> str:
        return "127.0.0.1"

    def lost_host(self, rank: int) -> str:
        return ""  # one host here: never lost

    def replacement_host(self, lost: str) -> str | None:
        return None

    def lost_with(self, host: str) -> list[int]:
        return []

    def death_hint(self, rank: int, health: dict[str, Any]) -> str:
        return ""

    def crash_stack(self, rank: int) -> tuple[str, ...]:
        return ()

    def start_spare(self) -> None:
        pass

    def forget_dead_spare(self) -> None:
        pass


@dataclass
class _IO:
    sent: list[tuple[bytes, str]] = field(default_factory=list)
    frames: list[tuple[bytes, list[Any]]] = field(default_factory=list)
    forgotten: list[bytes] = field(default_factory=list)  # ids of replaced processes

    def send(self, ident: bytes, frames: list[Any]) -> None:
        self.sent.append((ident, _peek_kind(frames)))
        self.frames.append((ident, frames))

    def send_many(self, idents: list[bytes], frames: list[Any]) -> None:
        for ident in idents:
            self.send(ident, frames)

    def watch_fd(self, fd: int, fn: Any) -> None:
        pass

    def forget(self, *idents: bytes) -> None:
        self.forgotten += [i for i in idents if i]

    def call_soon(self, fn: Any) -> None:
        fn()


_KEY = new_key()
_codec = Codec(_KEY, "controller")


def _peek_kind(frames: list[Any]) -> str:
    return Codec(_KEY, "rank").verify([bytes(f) for f in frames]).kind.value


class Story:
    """A 4-rank mesh's Recovery with stand-ins, started and settled."""

    def __init__(self, world: int = 4, budget: int = 5, min_ranks: int | None = None) -> None:
        self.ranks = RankTable(world)
        self.calls = CallTable()
        self.sup = _Supervisor()
        self.io = _IO()
        self.notes: list[str] = []
        self.policy = RestartPolicy(self.ranks, budget=budget, min_ranks=min_ranks)
        cfg = MeshConfig(n=world, backend="cpu", spare=False, restart_budget=budget,
                         min_ranks=min_ranks)
        self.rec = Recovery(cfg, self.ranks, self.calls, self.sup, self.io, _codec,  # type: ignore[arg-type]
                            self.policy, announce=self.notes.append,
                            dispatch=self.dispatch, default_output=lambda: None)
        for r in range(world):
            self.rec.start_process(r, 0)
            self.ready(r)
        self.rec.started = True

    def dispatch(self, call: PendingCall) -> None:
        if self.rec.must_wait(call.ranks):
            self.calls.wait(call)
            return
        self.calls.sent(call)
        for r in call.ranks:
            self.ranks.move(r, RankState.BUSY)
            self.io.send(self.ranks[r].main_id, call.frames)

    def ready(self, rank: int) -> None:
        self.rec.on_ready(self.ranks[rank], Message(Kind.READY, "r", 0, meta={"device": "cpu"}))

    def die(self, rank: int) -> None:
        self.sup.procs[rank].popen.code = -9
        self.rec.on_exit(rank, self.sup.procs[rank])

    def issue(self, ranks: tuple[int, ...], elastic: bool = False,
              kind: Kind = Kind.CALL, meta: dict[str, Any] | None = None) -> PendingCall:
        call_id = self.calls.next_id()
        frames = _codec.sign(kind, call=call_id, meta=meta)
        call = self.calls.new(call_id, ranks, CallOutput(lambda s, t: None),
                              MeshFuture(call_id, ranks, lambda _id: None), frames=frames,
                              elastic=elastic)
        self.dispatch(call)
        return call

    def sent_to(self, rank: int, kind: str) -> int:
        info = self.ranks[rank]
        return sum(1 for ident, k in self.io.sent if k == kind and ident in (info.main_id, info.ctl_id))

    def events(self, kind: EventKind) -> list[int]:
        return [e.rank for e in self.ranks.events if e.kind is kind]


def test_two_deaths_at_once_respawn_both_into_one_new_generation() -> None:
    s = Story()
    s.die(1)
    s.die(2)
    assert s.ranks[1].state == s.ranks[2].state == RankState.RESPAWNING
    assert (1, 1) in s.sup.started and (2, 1) in s.sup.started
    call = s.issue((0, 1, 2, 3))
    assert not call.sent  # waits for both new processes
    s.ready(1)
    assert not call.sent
    s.ready(2)
    assert call.sent and s.rec.generation == 2 == s.ranks.generation == s.sup.generation
    assert s.ranks[1].incarnation == s.ranks[2].incarnation == 1


def test_a_kill_during_re_formation_waits_out_the_backoff_and_calls_wait_too() -> None:
    s = Story()
    s.die(1)  # first death: at once
    s.die(1)  # the new process dies before it is ready: backoff
    assert s.ranks.reform_pending() and s.rec.must_wait((0,))
    assert s.ranks.coming_back(1) and s.ranks[1].state == RankState.WAITING
    call = s.issue((0,))  # even a call to a survivor: its group is about to change
    assert not call.sent
    s.rec.tick(s.policy.next_deadline() or 0.0)
    assert call.sent  # behind the REFORM on rank 0's socket
    kinds = [k for ident, k in s.io.sent if ident == s.ranks[0].main_id]
    assert kinds[-2:] == ["reform", "call"]


def test_a_kill_during_setup_replay_is_announced_with_how_the_rank_died() -> None:
    s = Story()
    s.calls.setup_cells.append({"code": "import torch", "name": "<mnb-cell-1>", "setup": True})
    s.die(3)
    s.ready(3)  # the setup replay is sent
    assert s.sent_to(3, "exec") == 1
    s.die(3)
    (note,) = [n for n in s.notes if "replaying setup" in n]
    assert note.endswith("on rank 3 failed: rank 3 died (killed by SIGKILL)"), note
    assert s.events(EventKind.SETUP_FAILED) == [3]


def test_a_setup_replay_failure_names_its_reason() -> None:
    s = Story()
    s.calls.setup_cells.append({"code": "boom()", "name": "<mnb-cell-1>", "setup": True})
    s.die(2)
    s.ready(2)
    (replay,) = list(s.calls)
    s.calls.complete(replay, 2, error=RemoteError(2, "RuntimeError", "boom on replay", "tb"))
    (note,) = [n for n in s.notes if "replaying setup" in n]
    assert note.endswith("failed: rank 2: RuntimeError: boom on replay"), note


def test_budget_give_up_mid_elastic_call_ends_it_and_interrupts_the_survivors() -> None:
    s = Story(budget=1)
    call = s.issue((0, 1, 2, 3), elastic=True)
    s.die(1)
    s.ready(1)  # re-issued on the new process
    assert s.sent_to(1, "call") == 1
    s.die(1)  # budget spent
    assert s.ranks[1].state == RankState.FAILED
    with pytest.raises(RankErrors) as info:
        call.future.result(timeout=0)
    text = str(info.value)
    assert "rank 1 died 2 times" in text and "restart 1" in text
    assert all(isinstance(info.value.errors[r], MembershipChanged) for r in (0, 2, 3))
    assert all(s.sent_to(r, "interrupt") == 1 for r in (0, 2, 3))


def test_a_stuck_survivor_is_probed_after_the_grace_and_replaced_only_if_in_a_collective() -> None:
    s = Story()
    s.issue((0, 1, 2, 3))
    s.die(2)
    assert 0 in s.rec.awaiting_reform
    start = max(s.rec.awaiting_reform.values()) - REFORM_GRACE_S
    s.rec.tick(start + REFORM_GRACE_S / 2)
    assert s.sent_to(0, "stacks") == 0  # not before the grace
    reforms = s.sent_to(0, "reform")
    s.rec.tick(start + REFORM_GRACE_S + 0.1)
    assert s.sent_to(0, "stacks") == 1
    # the REFORM again, the very frames (a copy the rank has is a replay to it)
    assert s.sent_to(0, "reform") == reforms + 1
    copies = [f for ident, f in s.io.frames if ident == s.ranks[0].main_id and f is s.rec.reform_frames]
    assert len(copies) == reforms + 1
    computing = [{"main": True, "frames": [["train.py", 3, "step", "x = y @ z"]]}]
    s.rec.on_probe(s.ranks[0], computing)
    assert s.events(EventKind.REPLACED) == []
    stuck = [{"main": True, "frames": [["/x/torch/distributed/c10d.py", 9, "all_reduce", ""]]}]
    s.rec.on_probe(s.ranks[1], stuck)
    assert s.events(EventKind.REPLACED) == [1] and s.ranks[1].state == RankState.RESPAWNING
    s.rec.on_reformed(s.ranks[3], Message(Kind.REFORMED, "r", 0, meta={"generation": 1, "joining": True}))
    assert 3 not in s.rec.awaiting_reform


# -- PendingCall changes only through its methods ------------------------------------

_MUTATORS = {"add", "discard", "pop", "clear", "remove", "append", "extend", "insert",
             "update", "setdefault", "popitem", "sort", "reverse"}
# Other classes' fields of the same name, written on their own objects.
_NOT_CALLS = {("collectives.py", "report.ranks"), ("supervisor.py", "proc.sent")}


def _call_field_writes(source: str) -> list[str]:
    """Assignments, deletions and in-place mutations of a PendingCall
    field on anything but ``self``: ``x.held[r] = m``, ``x.progress_at = t``,
    ``del x.held[r]``, ``x.remaining.discard(r)``."""
    import ast
    import dataclasses

    fields = {f.name for f in dataclasses.fields(PendingCall)}

    def field_of(node: ast.expr) -> str | None:
        while isinstance(node, (ast.Subscript, ast.Starred)):
            node = node.value
        if (isinstance(node, ast.Attribute) and node.attr in fields
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            return ast.unparse(node)
        return None

    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in _MUTATORS):
            targets = [node.func.value]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in fields):
            found.append(f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        for target in targets:
            for elt in target.elts if isinstance(target, ast.Tuple) else [target]:
                name = field_of(elt)
                if name is not None:
                    found.append(f"{node.lineno}: {name}")
    return found


def test_no_module_but_the_call_table_changes_a_pending_call() -> None:
    import pathlib

    import monarch_nb

    root = pathlib.Path(monarch_nb.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "controller" / "calls" / "calltable.py":
            continue
        for hit in _call_field_writes(path.read_text()):
            if (path.name, hit.split(": ", 1)[1]) not in _NOT_CALLS:
                found.append(f"{path.relative_to(root)}:{hit}")
    assert not found, ("PendingCall fields change only through its methods "
                       f"(controller/calls/calltable.py): {found}")


def test_the_pending_call_check_sees_every_kind_of_write() -> None:
    source = ("call.progress_at = 1\ncall.held[0] = m\ndel call.held[0]\n"
              "call.chunks_seen[0] += 1\ncall.remaining.discard(0)\n"
              "a, call.sent = 1, True\nsetattr(call, 'hang_reported', True)\n"
              "self.held = {}\ncall.progressed(1)\nx = call.held.get(0)\n")
    assert sorted(int(hit.split(":")[0]) for hit in _call_field_writes(source)) == [
        1, 2, 3, 4, 5, 6, 7]


def _reform_meta(s: Story, rank: int) -> dict[str, Any]:
    """The meta of the last REFORM sent to ``rank``."""
    info = s.ranks[rank]
    frames = [f for ident, f in s.io.frames if ident == info.main_id
              and _peek_kind(f) == "reform"][-1]
    return dict(Codec(_KEY, "rank").verify([bytes(f) for f in frames]).meta)


def test_a_shrink_mid_elastic_call_records_the_lost_rank_and_the_call_carries_on() -> None:
    s = Story(budget=0, min_ranks=2)
    call = s.issue((0, 1, 2, 3), elastic=True)
    s.die(1)  # respawns off: gone for good, 3 ranks left >= min_ranks
    assert s.ranks[1].state == RankState.FAILED and s.ranks.group == (0, 2, 3)
    # no interrupt: the survivors re-form without it, told the members in torch rank order
    assert all(s.sent_to(r, "interrupt") == 0 for r in (0, 2, 3))
    meta = _reform_meta(s, 2)
    assert meta["members"] == [0, 2, 3] and meta["generation"] == 1 == s.ranks.generation
    assert not call.future.done() and call.remaining == {0, 2, 3}
    assert s.events(EventKind.SHRUNK) == [-1]
    (note,) = [n for n in s.notes if "goes on without" in n]
    assert "without rank 1, at world size 3 of 4 (min_ranks 2)" in note, note
    for r in (0, 2, 3):
        s.calls.complete(call, r, f"model of {r}")
    got = call.future.result(timeout=0)  # no exception for the rank that is gone
    assert got.lost == (1,) and got.survivors() == {0: "model of 0", 2: "model of 2",
                                                    3: "model of 3"}
    assert isinstance(got[1], Lost) and "restart_budget=0" in got[1].reason and not got[1]


def test_after_a_shrink_a_respawn_keeps_the_smaller_group() -> None:
    s = Story(budget=1, min_ranks=2)
    s.die(3)
    s.ready(3)
    s.die(3)  # budget spent
    assert s.ranks.group == (0, 1, 2) and s.ranks.shed(3) and not s.rec.must_wait((0, 1, 2))
    # a later death within the budget: respawned into the same, smaller group
    s.die(0)
    assert s.ranks[0].state == RankState.RESPAWNING and s.ranks.group == (0, 1, 2)
    assert s.sup.group == (0, 1, 2) and _reform_meta(s, 1)["members"] == [0, 1, 2]


def test_a_shrink_below_min_ranks_ends_the_elastic_call_as_before() -> None:
    s = Story(budget=0, min_ranks=4)
    call = s.issue((0, 1, 2, 3), elastic=True)
    s.die(2)
    with pytest.raises(RankErrors) as info:
        call.future.result(timeout=0)
    assert all(isinstance(info.value.errors[r], MembershipChanged) for r in (0, 1, 3))
    assert "fewer than min_ranks=4" in str(info.value.errors[0])
    assert s.ranks.group == (0, 1, 2, 3) and s.events(EventKind.SHRUNK) == []
