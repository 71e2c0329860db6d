"""A rank's life, driven by scripted events: the one state machine (rankstates.py),
the rank table that owns it, and the restart policy that reads the table and answers
with typed moves. No process is started."""

from __future__ import annotations

import random
from collections import deque

import pytest

from monarch_nb.controller.life import rankstates
from monarch_nb.controller.life.policy import (
    SPARE_DELAY_S,
    Action,
    Died,
    GiveUp,
    Grow,
    HostAdded,
    HostLost,
    Kill,
    Move,
    NotComingBack,
    Probed,
    Reform,
    ReplaceStuck,
    Report,
    Respawn,
    RestartPolicy,
    RestartRequested,
    Shrink,
    SpareCheck,
    StartSpare,
    Stimulus,
    Timer,
)
from monarch_nb.controller.life.rankstates import TRANSITIONS, IllegalTransition, RankState
from monarch_nb.controller.life.ranktable import RankTable

S = RankState


class Script:
    """A started mesh's rank table and its policy. Each stimulus's actions are
    carried to the table as recovery carries them (its moves through the
    table's methods; Kill, Report, GiveUp, StartSpare touch processes and
    calls only), so the next stimulus finds the table moved."""

    def __init__(self, world: int, **kw: object) -> None:
        self.t = RankTable(world)
        for r in range(world):
            self.t.move(r, S.READY)
        self.p = RestartPolicy(self.t, **kw)  # type: ignore[arg-type]

    def handle(self, event: Stimulus) -> list[Action]:
        actions = self.p.handle(event)
        for a in actions:
            if isinstance(a, Move):
                self.t.move(a.rank, a.to)
            elif isinstance(a, Respawn):
                self.t.respawning(a.rank, a.incarnation, a.host)
            elif isinstance(a, ReplaceStuck):
                self.t.respawning(a.rank, a.incarnation)
            elif isinstance(a, Reform):
                self.t.reformed(a.generation, a.group)
        return actions

    def ready(self, rank: int) -> None:
        """Its new process said READY (recorded by recovery, not decided)."""
        self.t.move(rank, S.READY)

    def state(self, rank: int) -> RankState:
        return self.t[rank].state

    def states(self) -> list[RankState]:
        return [info.state for info in self.t]


def test_first_death_respawns_at_once_and_reforms_the_group() -> None:
    s = Script(4)
    actions = s.handle(Died(1, now=10.0, cause="SIGKILL"))
    assert actions == [Move(1, S.DEAD), Move(1, S.WAITING), Respawn(1, incarnation=1),
                       Reform(generation=1, ranks=(0, 1, 2, 3))]
    assert s.state(1) == S.RESPAWNING and s.t[1].incarnation == 1 and s.t.generation == 1
    s.ready(1)
    assert s.states() == [S.READY] * 4


def test_repeated_deaths_back_off_exponentially_with_jitter() -> None:
    s = Script(2, base=0.5, cap=30.0, rng=random.Random(7))
    now = 0.0
    delays = []
    for k in range(5):
        actions = s.handle(Died(0, now=now))
        assert actions[:2] == [Move(0, S.DEAD), Move(0, S.WAITING)]
        if actions[2:]:  # immediate respawn (first death)
            assert actions[2] == Respawn(0, 1)
            delays.append(0.0)
        else:
            deadline = s.p.next_deadline()
            assert deadline is not None and s.state(0) == S.WAITING
            delays.append(deadline - now)
            assert s.handle(Timer(now=deadline - 0.001)) == []  # not yet
            actions = s.handle(Timer(now=deadline))
            assert actions[0] == Respawn(0, k + 1)
        s.ready(0)
        now += delays[-1] + 1.0
    assert delays[0] == 0.0
    for k in range(1, 5):  # base * 2**(k-1), +/- 25 %
        nominal = 0.5 * 2 ** (k - 1)
        assert 0.75 * nominal <= delays[k] <= 1.25 * nominal


def test_budget_exhausted_gives_up_with_a_message_that_says_what_to_do() -> None:
    s = Script(2, budget=3, window=600.0, base=0.0)
    for i in range(3):
        s.handle(Died(1, now=float(i)))
        s.handle(Timer(now=float(i)))
        s.ready(1)
    actions = s.handle(Died(1, now=4.0, cause="exit code 1"))
    assert actions[:2] == [Move(1, S.DEAD), Move(1, S.FAILED)] and len(actions) == 4
    assert isinstance(actions[2], GiveUp)
    assert "4 times within 600 s" in actions[2].reason
    assert "%monarch restart 1" in actions[2].reason and "%monarch logs 1" in actions[2].reason
    # whoever waits for a re-formation (an elastic call's survivors) is told now
    assert actions[3] == NotComingBack((1,), "rank 1 is not coming back (restart budget "
                                             "spent); %monarch restart 1 brings it back")
    assert s.state(1) == S.FAILED and s.t.gone_for_good(1)
    assert s.handle(Timer(now=1000.0)) == []  # a failed rank is never respawned by itself
    assert s.handle(Died(1, now=5.0)) == []


def _respawn_delay(s: Script, rank: int, died: Died) -> float:
    """How long after ``died`` the policy respawns ``rank`` (its Timer
    scripted to the due time); the new process then says READY."""
    actions = s.handle(died)
    assert actions[:2] == [Move(rank, S.DEAD), Move(rank, S.WAITING)], actions
    delay = 0.0
    if not any(isinstance(a, Respawn) for a in actions):
        deadline = s.p.next_deadline()
        assert deadline is not None and s.state(rank) == S.WAITING
        delay = deadline - died.now
        assert s.handle(Timer(now=deadline - 0.001)) == []  # not yet
        actions = s.handle(Timer(now=deadline))
    assert Respawn(rank, s.t[rank].incarnation) in actions, actions
    s.ready(rank)
    return delay


def test_a_working_rank_is_respawned_at_once_however_often_it_died() -> None:
    """The backoff is for crash loops only: a rank whose process answered a
    call (it was working) is respawned at once, the fifth kill in a row as
    the first; its budget still counts every death."""
    s = Script(2, base=0.5, rng=random.Random(3))
    delays = [_respawn_delay(s, 1, Died(1, now=10.0 * k, cause="SIGKILL", answered=True))
              for k in range(5)]
    assert delays == [0.0] * 5
    # the budget (5 respawns within the window) counts working deaths too
    assert isinstance(s.handle(Died(1, now=50.0, answered=True))[2], GiveUp)
    assert s.state(1) == S.FAILED


def test_a_rank_that_dies_before_it_answered_is_backed_off_as_a_crash_loop() -> None:
    """A process that dies again before it answered anything since it came
    back is backed off as before (0.5 s, 1 s, 2 s: base * 2**(k-1) +/- 25 %,
    k counting the deaths in a row since the last working process's);
    once a process answers, its death is respawned at once and the count
    starts afresh."""
    s = Script(2, base=0.5, rng=random.Random(5))
    died = [Died(0, now=0.0, answered=True),  # a working process: at once
            Died(0, now=1.0), Died(0, now=3.0), Died(0, now=6.0),  # a crash loop: backed off
            Died(0, now=20.0, answered=True),  # working again: at once
            Died(0, now=21.0)]  # and a loop starts afresh: the first backoff
    s.p.budget = len(died)
    delays = [_respawn_delay(s, 0, d) for d in died]
    assert delays[0] == delays[4] == 0.0, delays
    for k, delay in ((1, delays[1]), (2, delays[2]), (3, delays[3]), (1, delays[5])):
        nominal = 0.5 * 2 ** (k - 1)
        assert 0.75 * nominal <= delay <= 1.25 * nominal, (k, delays)


def test_a_restart_budget_of_0_says_respawns_are_off_and_how_to_turn_them_on() -> None:
    """Budget 0 is no respawn at all (torchrun's --max-restarts 0), not a
    budget spent: the line says so, in the words of the setting's front end."""
    s = Script(2, budget=0)
    actions = s.handle(Died(1, now=5.0, cause="SIGKILL"))
    assert actions == [Move(1, S.DEAD), Move(1, S.FAILED), GiveUp(1, (
        "rank 1 died (SIGKILL); not respawned: restart_budget=0; start the mesh with "
        "restart_budget=N (Mesh.start(..., restart_budget=N)) to respawn dead ranks")),
        NotComingBack((1,), "rank 1 is not respawned: restart_budget=0; start the mesh with "
                            "restart_budget=N (Mesh.start(..., restart_budget=N)) to respawn "
                            "dead ranks")]
    script = Script(2, budget=0, no_restarts="--max-restarts 0 (torchrun's default with "
                                             "torchrun's flags); pass --max-restarts N")
    give_up = script.handle(Died(0, now=1.0, cause="exit code 1"))[2]
    assert give_up == GiveUp(0, "rank 0 died (exit code 1); not respawned: --max-restarts 0 "
                                "(torchrun's default with torchrun's flags); pass --max-restarts N")
    assert "times within" not in give_up.reason and "Fix the cause" not in give_up.reason


def test_budget_counts_only_deaths_inside_the_window() -> None:
    s = Script(1, budget=2, window=100.0, base=0.0)
    for t in (0.0, 50.0, 200.0, 250.0):  # never more than 2 within 100 s
        actions = s.handle(Died(0, now=t))
        assert Respawn(0, s.t[0].incarnation) in actions, (t, actions)
        s.ready(0)


def test_user_restart_revives_a_failed_rank_and_clears_its_record() -> None:
    s = Script(2, budget=0)
    assert isinstance(s.handle(Died(0, now=1.0))[-2], GiveUp)
    actions = s.handle(RestartRequested((0,), now=2.0))
    assert actions == [Move(0, S.WAITING), Respawn(0, incarnation=1),
                       Reform(generation=1, ranks=(0, 1))]
    assert s.p.deaths[0] == []


def test_user_restart_of_a_live_rank_kills_it_first() -> None:
    s = Script(3)
    actions = s.handle(RestartRequested((2,), now=0.0))
    assert actions == [Kill(2), Move(2, S.DEAD), Move(2, S.WAITING), Respawn(2, 1),
                       Reform(1, (0, 1, 2))]
    # the death we caused (of incarnation 0) is not a new failure
    assert s.handle(Died(2, now=0.1, incarnation=0)) == []
    assert s.state(2) == S.RESPAWNING and s.p.deaths[2] == []


def test_mode_off_reports_and_keeps_the_survivors() -> None:
    s = Script(3, mode="off")
    actions = s.handle(Died(1, now=0.0, cause="SIGKILL"))
    assert actions[0] == Move(1, S.DEAD) and len(actions) == 3
    assert isinstance(actions[1], Report) and "respawn is off" in actions[1].message
    assert actions[2] == NotComingBack((1,), "rank 1 is not respawned (respawn is off)")
    assert s.states() == [S.READY, S.DEAD, S.READY] and s.t.gone_for_good(1)
    assert s.handle(Timer(now=99.0)) == []
    assert s.handle(Died(1, now=100.0)) == []  # a second report of the same death


def test_mode_all_replaces_every_rank() -> None:
    s = Script(3, mode="all")
    actions = s.handle(Died(1, now=0.0))
    assert actions == [Move(1, S.DEAD), Move(1, S.WAITING),
                       Kill(0), Move(0, S.DEAD), Move(0, S.WAITING),
                       Kill(2), Move(2, S.DEAD), Move(2, S.WAITING),
                       Respawn(0, 1), Respawn(1, 1), Respawn(2, 1), Reform(1, (0, 1, 2))]
    # the deaths of the killed survivors are expected, not new failures
    assert s.handle(Died(0, now=0.1, incarnation=0)) == []
    assert s.handle(Died(2, now=0.1, incarnation=0)) == []
    for r in range(3):
        s.ready(r)
    # but a death of a new incarnation is a failure again
    again = s.handle(Died(0, now=0.2, incarnation=1))
    assert Respawn(0, 2) in again and Kill(1) in again and Kill(2) in again


def test_a_death_during_respawn_is_counted_and_backs_off() -> None:
    s = Script(2, base=1.0, rng=random.Random(1))
    s.handle(Died(0, now=0.0))
    assert s.state(0) == S.RESPAWNING
    waiting = s.handle(Died(0, now=0.2))  # the new process died before it was ready
    assert waiting == [Move(0, S.DEAD), Move(0, S.WAITING)]
    assert s.state(0) == S.WAITING and s.t.reform_pending() and s.t.must_wait((1,))
    deadline = s.p.next_deadline()
    assert deadline is not None and 0.2 + 0.75 <= deadline <= 0.2 + 1.25
    actions = s.handle(Timer(now=deadline))
    assert actions == [Respawn(0, 2), Reform(2, (0, 1))]


def test_two_deaths_at_once_form_one_new_generation_each() -> None:
    s = Script(4, base=0.0)
    first = s.handle(Died(1, now=5.0))
    second = s.handle(Died(3, now=5.0))
    assert first[-1] == Reform(1, (0, 1, 2, 3)) and second[-1] == Reform(2, (0, 1, 2, 3))
    assert [a for a in first + second if isinstance(a, Respawn)] == [Respawn(1, 1), Respawn(3, 1)]
    assert s.t.generation == 2


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError):
        RestartPolicy(RankTable(1), mode="sometimes")


def test_the_policy_decides_from_the_table_not_from_a_copy_of_its_own() -> None:
    """A rank waiting out its backoff is stopped with the mesh (a move the
    policy did not make): the policy sees it and respawns nothing."""
    s = Script(2, base=1.0)
    s.handle(Died(0, now=0.0))
    s.ready(0)
    s.handle(Died(0, now=1.0))
    assert s.state(0) == S.WAITING and s.p.next_deadline() is not None
    for r in range(2):
        s.t.move(r, S.STOPPED)
    assert s.p.next_deadline() is None
    assert s.handle(Timer(now=99.0)) == []
    assert s.handle(RestartRequested((0,), now=100.0)) == []  # stopped is final
    assert s.handle(HostLost("h1", (0, 1), now=101.0, spare="h2")) == []


# -- host-level moves, probes (the host agent's and recovery's events) -----------------------
def test_host_lost_without_spare_moves_its_ranks_to_lost_without_spending_budget() -> None:
    s = Script(4, budget=1)
    acts = s.handle(HostLost("h1", (1, 2), now=5.0))
    assert acts == [Move(1, S.LOST), Move(2, S.LOST), Report(1, "rank 1 lost: host h1 lost; mesh.add_hosts('HOST') gives the mesh a host for rank 1: they start there"),
                    Report(2, "rank 2 lost: host h1 lost; mesh.add_hosts('HOST') gives the mesh a host for rank 2: they start there"),
                    # no re-formation brings them back: whoever waits for one is told now
                    NotComingBack((1, 2), "host h1 lost with rank 1,2, and no spare host; mesh.add_hosts('HOST') gives the mesh a host for rank 1,2: they start there")]
    assert s.states() == [S.READY, S.LOST, S.LOST, S.READY]
    # gone, awaiting a host (a user's restart): calls to it are refused, not held
    assert s.t.gone_for_good(1) and not s.t.coming_back(1) and not s.t.reform_pending()
    assert s.p.next_deadline() is None and s.t.generation == 0
    assert s.handle(Died(1, now=6.0, cause="SIGKILL")) == []  # its death is old news
    assert s.p.deaths[1] == []  # no budget spent
    acts = s.handle(RestartRequested((1, 2), now=7.0))  # a restart revives LOST ranks
    assert acts == [Move(1, S.WAITING), Move(2, S.WAITING), Respawn(1, 1), Respawn(2, 1),
                    Reform(1, (0, 1, 2, 3))]
    assert s.state(1) == S.RESPAWNING


def test_host_lost_with_a_spare_host_respawns_its_ranks_there_keeping_their_numbers() -> None:
    s = Script(3)
    s.t[0].host = s.t[1].host = "h1"
    s.t[2].host = "h2"
    acts = s.handle(HostLost("h1", (0, 1), now=1.0, spare="h9"))
    # no Report: that would end their calls, and they are coming back
    assert acts == [Move(0, S.LOST), Move(1, S.LOST),
                    Respawn(0, 1, host="h9"), Respawn(1, 1, host="h9"), Reform(1, (0, 1, 2))]
    assert [(i.rank, i.state, i.incarnation, i.host) for i in s.t] == [
        (0, S.RESPAWNING, 1, "h9"), (1, S.RESPAWNING, 1, "h9"), (2, S.READY, 0, "h2")]
    assert s.p.deaths == [[], [], []]  # no budget spent
    assert s.handle(Died(0, now=2.0, incarnation=0)) == []  # the lost host's process


def test_host_lost_for_ranks_already_dead() -> None:
    """Dead, failed or lost already: the host adds nothing (no report, no
    respawn, no budget). Waiting out a backoff: lost, its respawn (due where
    it was) cancelled, or moved to the spare host."""
    s = Script(5, budget=0)
    s.handle(Died(0, now=0.0))  # budget 0: FAILED
    off = Script(1, mode="off")
    off.handle(Died(0, now=0.0))  # respawn off: DEAD
    assert off.handle(HostLost("h1", (0,), now=1.0, spare="h9")) == []
    assert off.state(0) == S.DEAD
    s.p.budget = 5
    s.handle(Died(1, now=0.0))  # first death: respawned at once
    s.handle(Died(1, now=0.1))  # again: WAITING out a backoff
    assert s.states()[:2] == [S.FAILED, S.WAITING] and s.p.next_deadline() is not None
    acts = s.handle(HostLost("h1", (0, 1), now=0.2))
    assert acts == [Move(1, S.LOST), Report(1, "rank 1 lost: host h1 lost; mesh.add_hosts('HOST') gives the mesh a host for rank 1: they start there"),
                    NotComingBack((1,), "host h1 lost with rank 1, and no spare host; mesh.add_hosts('HOST') gives the mesh a host for rank 1: they start there")]
    assert s.states()[:2] == [S.FAILED, S.LOST] and s.p.next_deadline() is None
    assert s.handle(Timer(now=99.0)) == []
    assert s.handle(HostLost("h1", (0, 1), now=1.0)) == []  # lost twice: once is news
    # with a spare host, a rank waiting out its backoff is respawned there now
    s.handle(Died(2, now=2.0))
    s.handle(Died(2, now=2.1))
    assert s.state(2) == S.WAITING
    acts = s.handle(HostLost("h2", (0, 2), now=2.2, spare="h9"))
    assert acts == [Move(2, S.LOST), Respawn(2, 2, host="h9"), Reform(s.t.generation, (2, 3, 4))]
    assert s.state(0) == S.FAILED and s.p.next_deadline() is None


def test_host_lost_during_a_respawn_or_a_kill() -> None:
    s = Script(3)
    s.handle(Died(0, now=0.0))  # RESPAWNING
    s.t.move(1, S.DYING)  # we sent it a KILL, its exit not seen yet
    acts = s.handle(HostLost("h1", (0, 1), now=1.0))
    assert acts == [Move(0, S.LOST), Move(1, S.LOST), Report(0, "rank 0 lost: host h1 lost; mesh.add_hosts('HOST') gives the mesh a host for rank 0: they start there"),
                    Report(1, "rank 1 lost: host h1 lost; mesh.add_hosts('HOST') gives the mesh a host for rank 1: they start there"),
                    NotComingBack((0, 1), "host h1 lost with rank 0,1, and no spare host; mesh.add_hosts('HOST') gives the mesh a host for rank 0,1: they start there")]
    assert s.handle(Died(1, now=1.1, incarnation=0)) == []


def test_probed_in_collective_replaces_a_live_member_only() -> None:
    s = Script(2)
    assert s.handle(Probed(1, in_collective=False, now=1.0)) == []
    assert s.handle(Probed(1, in_collective=True, now=1.0)) == [ReplaceStuck(1, 1)]
    assert s.state(1) == S.RESPAWNING and s.t[1].incarnation == 1 and s.t.generation == 0
    assert s.handle(Probed(1, in_collective=True, now=2.0)) == []  # already being replaced


# -- the state machine ----------------------------------------------------------------------
def _path_to(target: RankState) -> list[RankState]:
    """The shortest run of legal moves from STARTING to ``target``."""
    came: dict[RankState, RankState | None] = {S.STARTING: None}
    todo = deque([S.STARTING])
    while todo:
        at = todo.popleft()
        for nxt in TRANSITIONS[at]:
            if nxt not in came:
                came[nxt] = at
                todo.append(nxt)
    assert target in came, f"{target} cannot be reached from STARTING"
    path: list[RankState] = []
    step: RankState | None = target
    while step is not None and step is not S.STARTING:
        path.append(step)
        step = came[step]
    return path[::-1]


@pytest.mark.parametrize("many", [False, True], ids=["move", "move_many"])
def test_every_allowed_move_is_reachable_and_every_other_one_refused(many: bool) -> None:
    """Walk the transition table through RankTable.move (or move_many, a
    call's moves, with a rank already there beside it) only: every state is
    reached from a rank's first process, every allowed move made, every
    other one refused (and leaves the state as it was)."""
    made = refused = 0
    for frm in RankState:
        for to in RankState:
            t = RankTable(2)
            for step in _path_to(frm):
                t.move(0, step)
            for step in _path_to(to):
                t.move(1, step)
            assert t[0].state is frm

            def move() -> None:
                if many:
                    t.move_many([1, 0], to)
                else:
                    t.move(0, to)

            if to in TRANSITIONS[frm] or to is frm:
                move()
                assert t[0].state is to
                made += 1
            else:
                with pytest.raises(IllegalTransition) as refusal:
                    move()
                assert t[0].state is frm and refusal.value.rank == 0
                refused += 1
    assert made == sum(len(v) for v in TRANSITIONS.values()) + len(RankState)
    assert made + refused == len(RankState) ** 2
    assert TRANSITIONS[S.STOPPED] == frozenset()
    assert all(S.STOPPED in TRANSITIONS[s] for s in RankState if s is not S.STOPPED)


def test_the_diagram_names_every_state_and_the_sets_agree_with_the_table() -> None:
    doc = rankstates.__doc__ or ""
    assert all(s.name in doc for s in RankState)
    # a rank without a process never takes a call, nor says READY
    assert not rankstates.GONE & rankstates.LIVE
    assert all(S.READY not in TRANSITIONS[s] for s in rankstates.GONE)
    # only a respawn (or a user's restart, through WAITING) brings one back
    assert all(TRANSITIONS[s] <= {S.WAITING, S.RESPAWNING, S.FAILED, S.LOST, S.STOPPED}
               for s in rankstates.GONE)


def test_dying_is_a_legal_state_and_illegal_moves_are_refused() -> None:
    t = RankTable(2)
    t.move(0, S.READY)
    t.move(0, S.DYING)
    with pytest.raises(IllegalTransition):
        t.move(0, S.READY)  # a dying process never takes calls again
    t.move(0, S.DEAD)
    with pytest.raises(IllegalTransition):
        t.move(1, S.FAILED)  # STARTING -> FAILED skips the death
    with pytest.raises(IllegalTransition):
        t.move(0, S.RESPAWNING)  # DEAD -> RESPAWNING skips the policy's WAITING


# -- "is it coming back?": one answer, the rank table's ---------------------------------------
@pytest.mark.parametrize("state", list(RankState), ids=lambda s: s.name)
def test_must_wait_in_one_pass_agrees_with_its_definition(state: RankState) -> None:
    """must_wait is one pass over the table (it runs for every call): in
    every state of rank 2 it says what its definition says, a call to the
    others waiting only for a re-formation ahead (rank 2 WAITING)."""
    t = RankTable(3)
    for r in (0, 1):
        t.move(r, S.READY)
    for step in _path_to(state):
        t.move(2, step)
    for ranks in ((0, 1), (2,), (0, 1, 2)):
        expected = t.reform_pending() or any(t.coming_back(r) for r in ranks)
        assert t.must_wait(ranks) is expected, ranks
    assert t.must_wait((0, 1)) is (state is S.WAITING)


def test_move_many_only_from_leaves_the_ranks_in_other_states() -> None:
    """A call's answered ranks go back to READY only if BUSY: one that is
    dying meanwhile stays dying, one already READY stays as it is."""
    t = RankTable(3)
    for r in range(3):
        t.move(r, S.READY)
    t.move_many([0, 1], S.BUSY)
    t.move(1, S.DYING)
    t.move_many([0, 1, 2], S.READY, only_from=S.BUSY)
    assert [t[r].state for r in range(3)] == [S.READY, S.DYING, S.READY]


def test_the_rank_table_answers_whether_a_rank_is_coming_back_in_every_state() -> None:
    t = RankTable(3)
    assert t.coming_back(0)  # STARTING: its first process is on its way
    t.move(0, S.READY)
    assert not t.coming_back(0) and not t.must_wait((0,)) and not t.gone_for_good(0)
    t.move(0, S.DYING)  # we killed it: respawned, calls wait
    assert t.coming_back(0) and t.must_wait((0,))
    t.move(0, S.DEAD)  # respawn off, or a first start that failed
    assert not t.coming_back(0) and t.gone_for_good(0) and not t.reform_pending()
    t.move(0, S.WAITING)  # the policy scheduled its respawn: waits out a backoff
    assert t.coming_back(0) and not t.gone_for_good(0)
    assert t.reform_pending() and t.must_wait((1,))  # even a survivor's call waits
    t.respawning(0, 1)
    assert t.coming_back(0) and not t.reform_pending()
    t.move(0, S.DEAD)
    t.move(0, S.FAILED)  # budget spent: gone until a user's restart
    assert t.gone_for_good(0)
    t.move(0, S.WAITING)  # a user's restart of a failed rank
    assert t.coming_back(0)
    t.move(1, S.READY)
    t.move(1, S.LOST)  # its host is gone, no spare host
    assert t.gone_for_good(1) and not t.coming_back(1)
    t.move(2, S.STOPPED)
    assert t.gone_for_good(2)


def test_policy_actions_drive_the_rank_tables_answer() -> None:
    """The table, moved by the policy's actions, says coming back exactly
    when the policy will respawn."""
    for mode, back in (("rank", True), ("all", True), ("off", False)):
        s = Script(2, mode=mode, budget=2, base=1.0)
        for death in range(3):
            now = 10.0 * death
            s.handle(Died(0, now=now, incarnation=s.t[0].incarnation))
            expect = back and death < 2  # the third death is past the budget
            assert s.t.coming_back(0) is expect, (mode, death)
            assert s.state(0) in ((S.WAITING, S.RESPAWNING) if expect else (S.DEAD, S.FAILED))
            if not expect:
                break
            if s.state(0) == S.WAITING:  # waiting out a backoff
                assert s.t.reform_pending() and s.t.must_wait((1,))
                deadline = s.p.next_deadline()
                assert deadline is not None
                s.handle(Timer(deadline))
            for r in range(2):
                if s.state(r) == S.RESPAWNING:
                    s.ready(r)
            assert not s.t.coming_back(0) and not s.t.reform_pending()


def test_incarnation_and_generation_move_only_forward_through_the_table() -> None:
    t = RankTable(1)
    t.move(0, S.READY)
    t.move(0, S.DEAD)
    t.move(0, S.WAITING)
    t.respawning(0, 1, host="h2")
    assert (t[0].state, t[0].incarnation, t[0].host) == (S.RESPAWNING, 1, "h2")
    with pytest.raises(ValueError):
        t.respawning(0, 1)  # a second Respawn to the same incarnation is a bug
    with pytest.raises(ValueError):
        t.bind(0, 2)  # a process of an incarnation the table never gave
    assert t.bind(0, 1).incarnation == 1
    t.reformed(1)
    with pytest.raises(ValueError):
        t.reformed(1)
    assert t.generation == 1


def test_a_spare_is_started_once_settled_or_at_once_during_a_backoff() -> None:
    s = Script(2, base=1.0)
    assert s.handle(SpareCheck(now=0.5, settled_for=0.5, all_live=True)) == []  # start-up
    assert s.handle(SpareCheck(now=5.0, settled_for=SPARE_DELAY_S, all_live=False)) == []
    assert s.handle(SpareCheck(now=5.0, settled_for=SPARE_DELAY_S, all_live=True)) == [StartSpare()]
    s.handle(Died(0, now=10.0))  # first death: respawned at once, no backoff
    s.handle(Died(0, now=10.1))  # its new process died too: a backoff starts
    assert s.p.next_deadline() is not None
    # the wait is idle time: a spare now, settled or not
    assert s.handle(SpareCheck(now=10.1, settled_for=0.0, all_live=False)) == [StartSpare()]


def test_a_forked_spare_is_started_at_once() -> None:
    # a fork from the warm process slows nothing: no settling first, so that
    # a second kill right after the first finds a spare too
    s = Script(2, base=1.0)
    assert s.handle(SpareCheck(now=0.5, settled_for=0.5, all_live=True, cheap=True)) == [StartSpare()]
    assert s.handle(SpareCheck(now=0.6, settled_for=0.0, all_live=False, cheap=True)) == [StartSpare()]
    assert s.handle(SpareCheck(now=0.6, settled_for=0.0, all_live=False)) == []


# -- elastic world size (min_ranks): the group goes on without ranks gone for good --

def test_a_rank_past_its_budget_shrinks_the_group_when_min_ranks_are_left() -> None:
    s = Script(4, budget=0, min_ranks=2)
    actions = s.handle(Died(1, now=1.0, cause="SIGKILL"))
    # Shrink before the rank's own GiveUp: an elastic call records it lost, not failed
    assert actions[:3] == [Move(1, S.DEAD), Move(1, S.FAILED),
                           Shrink((0, 2, 3), (1,), "rank 1 is not respawned: " + s.p.no_restarts)]
    assert isinstance(actions[3], GiveUp) and actions[3].rank == 1
    assert actions[4:] == [Reform(1, (0, 2, 3), group=(0, 2, 3))]
    assert not any(isinstance(a, NotComingBack) for a in actions)
    # the table: mesh ranks keep their numbers, torch ranks are dense
    assert s.t.group == (0, 2, 3) and s.t.generation == 1
    assert [s.t.torch_rank(r) for r in range(4)] == [0, None, 1, 2]
    assert s.t.shed(1) and not s.t.shed(0) and not s.t.must_wait((0, 2, 3))
    # and again, down to min_ranks: the budget spent this time
    s.p.budget = 1
    s.handle(Died(3, now=2.0))
    s.handle(Timer(now=2.0))
    s.ready(3)
    assert s.t.group == (0, 2, 3)  # a respawn keeps the group as it is
    actions = s.handle(Died(3, now=3.0))
    assert Shrink((0, 2), (3,), "rank 3 is not coming back (restart budget spent); "
                                "%monarch restart 3 brings it back") in actions
    assert actions[-1] == Reform(3, (0, 2), group=(0, 2)) and s.t.group == (0, 2)
    assert [s.t.torch_rank(r) for r in range(4)] == [0, None, 1, None]


def test_below_min_ranks_no_shrink_the_waiters_are_told_why() -> None:
    s = Script(3, budget=0, min_ranks=3)
    actions = s.handle(Died(2, now=0.0))
    assert not any(isinstance(a, (Shrink, Reform)) for a in actions)
    assert isinstance(actions[-1], NotComingBack) and actions[-1].ranks == (2,)
    assert actions[-1].reason.endswith("; 2 rank(s) left, fewer than min_ranks=3: the group "
                                       "does not go on without them")
    assert s.t.group == (0, 1, 2) and s.t.generation == 0


def test_without_min_ranks_the_group_keeps_every_rank() -> None:
    s = Script(3, budget=0)
    actions = s.handle(Died(1, now=0.0))
    assert actions[-1] == NotComingBack((1,), "rank 1 is not respawned: " + s.p.no_restarts)
    s.handle(Died(2, now=1.0))
    s.handle(RestartRequested((2,), now=2.0))  # a Reform with a FAILED rank: same group
    assert s.t.group == (0, 1, 2) and s.t.generation == 1


def test_a_host_lost_without_a_spare_shrinks_the_group() -> None:
    s = Script(4, min_ranks=2)
    acts = s.handle(HostLost("hB", (2, 3), now=5.0))
    assert acts[:3] == [Move(2, S.LOST), Move(3, S.LOST), Shrink((0, 1), (2, 3), (
        "host hB lost with rank 2,3, and no spare host; mesh.add_hosts('HOST') gives "
        "the mesh a host for rank 2,3: they start there"))]
    assert [type(a) for a in acts[3:]] == [Report, Report, Reform]
    assert acts[-1] == Reform(1, (0, 1), group=(0, 1))
    # a host back (a user's restart): the ranks rejoin, the group is whole again
    acts = s.handle(RestartRequested((2, 3), now=9.0))
    assert acts[-2:] == [Grow((0, 1, 2, 3), (2, 3)), Reform(2, (0, 1, 2, 3), group=(0, 1, 2, 3))]
    assert s.t.group == (0, 1, 2, 3)
    assert [s.t.torch_rank(r) for r in range(4)] == [0, 1, 2, 3]


def test_a_host_given_for_lost_ranks_grows_the_group_back() -> None:
    s = Script(4, budget=1, min_ranks=2)
    s.handle(HostLost("hB", (2, 3), now=5.0))
    assert s.t.group == (0, 1) and s.t.generation == 1
    # mesh.add_hosts("hC"): the lost ranks start there, keeping their numbers,
    # and the group takes them back (Grow) at the Reform that starts them
    acts = s.handle(HostAdded("hC", (2, 3), now=9.0))
    assert acts == [Respawn(2, 1, "hC"), Respawn(3, 1, "hC"), Grow((0, 1, 2, 3), (2, 3)),
                    Reform(2, (0, 1, 2, 3), group=(0, 1, 2, 3))]
    assert s.t.group == (0, 1, 2, 3) and [s.t[r].host for r in (2, 3)] == ["hC", "hC"]
    assert s.p.deaths[2] == [] and s.p.deaths[3] == []  # no budget spent on a lost host
    # a second host for the same ranks: they are back already, nothing to do
    s.ready(2)
    s.ready(3)
    assert s.handle(HostAdded("hD", (2, 3), now=10.0)) == []


def test_a_host_given_takes_only_the_ranks_still_lost() -> None:
    s = Script(4, budget=0, min_ranks=1)
    s.handle(HostLost("hB", (2, 3), now=5.0))
    s.handle(Died(1, now=6.0))  # FAILED: not the host's business
    s.handle(RestartRequested((3,), now=7.0))  # the user restarted rank 3 already
    assert [s.state(r) for r in (1, 2, 3)] == [S.FAILED, S.LOST, S.RESPAWNING]
    acts = s.handle(HostAdded("hC", (1, 2, 3), now=8.0))
    assert acts == [Respawn(2, 1, "hC"), Grow((0, 2, 3), (2,)), Reform(4, (0, 2, 3), group=(0, 2, 3))]


def test_a_host_given_without_min_ranks_restarts_the_lost_ranks_in_the_same_group() -> None:
    s = Script(4)
    acts = s.handle(HostLost("hB", (2, 3), now=5.0))
    assert isinstance(acts[-1], NotComingBack)
    acts = s.handle(HostAdded("hB", (2, 3), now=9.0))  # the host itself is back
    assert acts == [Respawn(2, 1, "hB"), Respawn(3, 1, "hB"), Reform(1, (0, 1, 2, 3))]
    assert s.t.group == (0, 1, 2, 3)


def test_respawn_off_with_min_ranks_shrinks_too() -> None:
    s = Script(3, mode="off", min_ranks=1)
    acts = s.handle(Died(0, now=0.0))
    assert acts[1] == Shrink((1, 2), (0,), "rank 0 is not respawned (respawn is off)")
    assert acts[-1] == Reform(1, (1, 2), group=(1, 2))
    assert [s.t.torch_rank(r) for r in range(3)] == [None, 0, 1]


def test_a_shrink_while_a_rank_waits_out_its_backoff_is_formed_by_the_timer() -> None:
    s = Script(4, budget=3, base=1.0, min_ranks=2)
    for t in (0.0, 0.1):  # rank 3 in a crash loop: its second death waits out a backoff
        s.handle(Died(3, now=t))
    assert s.state(3) == S.WAITING
    s.p.budget = 0
    acts = s.handle(Died(1, now=0.2))
    # rank 3 is coming back: it stays in the group, formed once it is respawned
    shrink = next(a for a in acts if isinstance(a, Shrink))
    assert shrink.ranks == (0, 2, 3) and shrink.gone == (1,)
    assert not any(isinstance(a, Reform) for a in acts) and s.t.group == (0, 1, 2, 3)
    deadline = s.p.next_deadline()
    assert deadline is not None
    acts = s.handle(Timer(deadline))
    assert acts == [Respawn(3, 2), Reform(2, (0, 2, 3), group=(0, 2, 3))]


def test_min_ranks_outside_the_mesh_is_refused() -> None:
    for bad in (0, 5):
        with pytest.raises(ValueError, match="min_ranks"):
            RestartPolicy(RankTable(4), min_ranks=bad)
    t = RankTable(3)
    for bad_group in ((), (2, 1), (0, 3), (1, 1)):
        with pytest.raises(ValueError, match="group"):
            t.reformed(1, bad_group)


# -- a script's group restart (restart_group: python -m monarch_nb.launch) ------------------
def test_a_scripts_death_restarts_every_other_rank_but_those_in_an_elastic_loop() -> None:
    s = Script(4, restart_group=True)
    s.t[2].elastic_loop = True  # carries on in place (its heartbeats said so)
    actions = s.handle(Died(1, now=0.0, cause="SIGKILL"))
    why = "rank 1 died"
    assert actions == [Move(1, S.DEAD), Move(1, S.WAITING),
                       Kill(0, why), Move(0, S.DEAD), Move(0, S.WAITING),
                       Kill(3, why), Move(3, S.DEAD), Move(3, S.WAITING),
                       Respawn(0, 1), Respawn(1, 1), Respawn(3, 1), Reform(1, (0, 1, 2, 3))]
    # every restarted rank has the new incarnation (TORCHELASTIC_RESTART_COUNT) but the
    # one in place; only the rank that died spent budget; the killed ones' exits are old news
    assert [s.t[r].incarnation for r in range(4)] == [1, 1, 0, 1]
    assert s.p.deaths[0] == [] and s.p.deaths[3] == [] and s.p.deaths[1] == [0.0]
    assert s.handle(Died(0, now=0.1, incarnation=0)) == []


def test_a_scripts_crash_loop_restarts_the_others_when_its_backoff_is_over() -> None:
    s = Script(2, restart_group=True, base=1.0, rng=random.Random(1))
    s.handle(Died(1, now=0.0))
    for r in (0, 1):
        s.ready(r)
    actions = s.handle(Died(1, now=0.2))  # died again before it answered anything
    assert actions == [Move(1, S.DEAD), Move(1, S.WAITING),
                       Kill(0, "rank 1 died"), Move(0, S.DEAD), Move(0, S.WAITING)]
    deadline = s.p.next_deadline()
    assert deadline is not None and deadline > 0.2
    assert s.handle(Timer(deadline)) == [Respawn(0, 2), Respawn(1, 2), Reform(2, (0, 1))]


def test_a_scripts_shrink_restarts_the_ranks_left_at_the_smaller_size() -> None:
    s = Script(4, restart_group=True, budget=0, min_ranks=2)
    s.t[0].elastic_loop = True
    actions = s.handle(Died(3, now=1.0))
    assert isinstance(actions[2], Shrink) and actions[2].ranks == (0, 1, 2)
    why = "the group goes on without rank 3"
    assert actions[4:] == [Kill(1, why), Move(1, S.DEAD), Move(1, S.WAITING),
                           Kill(2, why), Move(2, S.DEAD), Move(2, S.WAITING),
                           Respawn(1, 1), Respawn(2, 1), Reform(1, (0, 1, 2), group=(0, 1, 2))]
    # a host lost with no spare: its ranks are gone, the others restart in a group of 2
    s = Script(4, restart_group=True, min_ranks=2)
    actions = s.handle(HostLost("hB", (2, 3), now=5.0))
    assert actions[-3:] == [Respawn(0, 1), Respawn(1, 1), Reform(1, (0, 1), group=(0, 1))]
    assert Kill(0, "the group goes on without rank 2,3") in actions
    assert [s.t.torch_rank(r) for r in range(4)] == [0, 1, None, None]


def test_a_scripts_lost_host_with_a_spare_restarts_everyone_in_one_generation() -> None:
    s = Script(4, restart_group=True)
    actions = s.handle(HostLost("hB", (2, 3), now=5.0, spare="hC"))
    assert [a for a in actions if isinstance(a, (Respawn, Reform))] == [
        Respawn(2, 1, "hC"), Respawn(3, 1, "hC"), Respawn(0, 1), Respawn(1, 1),
        Reform(1, (0, 1, 2, 3))]
    assert Kill(0, "host hB lost") in actions and Kill(1, "host hB lost") in actions


def test_a_scripts_group_is_not_restarted_below_min_ranks_nor_with_respawn_off() -> None:
    s = Script(3, restart_group=True, budget=0, min_ranks=3)
    actions = s.handle(Died(2, now=0.0))
    assert not any(isinstance(a, (Kill, Respawn, Reform)) for a in actions)
    assert isinstance(actions[-1], NotComingBack)
    s = Script(3, restart_group=True, mode="off")
    assert not any(isinstance(a, Kill) for a in s.handle(Died(0, now=0.0)))
    # mode all restarts every rank, an elastic loop's too (a torchrun restart exactly)
    s = Script(2, restart_group=True, mode="all")
    s.t[0].elastic_loop = True
    assert Kill(0) in s.handle(Died(1, now=0.0))
