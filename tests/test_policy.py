"""The restart policy, driven by scripted events: no process is started."""

from __future__ import annotations

import random

import pytest

from monarch_nb.controller.life.policy import (
    SPARE_DELAY_S,
    Action,
    Died,
    GiveUp,
    HostLost,
    Kill,
    Probed,
    RankPhase,
    Ready,
    Reform,
    ReplaceStuck,
    Report,
    Respawn,
    RestartPolicy,
    RestartRequested,
    Scheduled,
    SpareCheck,
    StartSpare,
    Timer,
)
from monarch_nb.controller.life.rankstates import IllegalTransition, RankState
from monarch_nb.controller.life.ranktable import RankTable


def test_first_death_respawns_at_once_and_reforms_the_group() -> None:
    p = RestartPolicy(world_size=4)
    actions = p.handle(Died(1, now=10.0, cause="SIGKILL"))
    assert actions == [Scheduled(1, at=10.0), Respawn(1, incarnation=1),
                       Reform(generation=1, ranks=(0, 1, 2, 3))]
    assert p.phase(1) == RankPhase.RESPAWNING
    assert p.handle(Ready(1, now=11.0)) == []
    assert p.phase(1) == RankPhase.RUNNING and p.incarnation(1) == 1


def test_repeated_deaths_back_off_exponentially_with_jitter() -> None:
    p = RestartPolicy(world_size=2, base=0.5, cap=30.0, rng=random.Random(7))
    now = 0.0
    delays = []
    for k in range(5):
        actions = p.handle(Died(0, now=now))
        scheduled = actions[0]
        assert isinstance(scheduled, Scheduled) and scheduled.rank == 0
        if actions[1:]:  # immediate respawn (first death)
            assert isinstance(actions[1], Respawn) and scheduled.at == now
            delays.append(0.0)
        else:
            deadline = p.next_deadline()
            assert deadline is not None and scheduled.at == deadline
            delays.append(deadline - now)
            assert p.handle(Timer(now=deadline - 0.001)) == []  # not yet
            actions = p.handle(Timer(now=deadline))
            assert isinstance(actions[0], Respawn) and actions[0].incarnation == k + 1
        p.handle(Ready(0, now=now + delays[-1] + 0.1))
        now += delays[-1] + 1.0
    assert delays[0] == 0.0
    for k in range(1, 5):  # base * 2**(k-1), +/- 25 %
        nominal = 0.5 * 2 ** (k - 1)
        assert 0.75 * nominal <= delays[k] <= 1.25 * nominal


def test_budget_exhausted_gives_up_with_a_message_that_says_what_to_do() -> None:
    p = RestartPolicy(world_size=2, budget=3, window=600.0, base=0.0)
    for i in range(3):
        p.handle(Died(1, now=float(i)))
        p.handle(Timer(now=float(i)))
        p.handle(Ready(1, now=float(i) + 0.5))
    actions = p.handle(Died(1, now=4.0, cause="exit code 1"))
    assert len(actions) == 1 and isinstance(actions[0], GiveUp)
    assert "4 times within 600 s" in actions[0].reason
    assert "%monarch restart 1" in actions[0].reason and "%monarch logs 1" in actions[0].reason
    assert p.phase(1) == RankPhase.FAILED
    assert p.handle(Timer(now=1000.0)) == []  # a failed rank is never respawned by itself
    assert p.handle(Died(1, now=5.0)) == []


def test_budget_counts_only_deaths_inside_the_window() -> None:
    p = RestartPolicy(world_size=1, budget=2, window=100.0, base=0.0)
    for t in (0.0, 50.0, 200.0, 250.0):  # never more than 2 within 100 s
        actions = p.handle(Died(0, now=t))
        assert len(actions) > 1 and isinstance(actions[1], Respawn), (t, actions)
        p.handle(Ready(0, now=t + 1))


def test_user_restart_revives_a_failed_rank_and_clears_its_record() -> None:
    p = RestartPolicy(world_size=2, budget=0)
    assert isinstance(p.handle(Died(0, now=1.0))[0], GiveUp)
    actions = p.handle(RestartRequested((0,), now=2.0))
    assert actions == [Scheduled(0, 2.0), Respawn(0, incarnation=1),
                       Reform(generation=1, ranks=(0, 1))]


def test_user_restart_of_a_live_rank_kills_it_first() -> None:
    p = RestartPolicy(world_size=3)
    actions = p.handle(RestartRequested((2,), now=0.0))
    assert actions == [Kill(2), Scheduled(2, 0.0), Respawn(2, 1), Reform(1, (0, 1, 2))]
    # the death we caused (of incarnation 0) is not a new failure
    assert p.handle(Died(2, now=0.1, incarnation=0)) == []
    assert p.phase(2) == RankPhase.RESPAWNING


def test_mode_off_reports_and_keeps_the_survivors() -> None:
    p = RestartPolicy(world_size=3, mode="off")
    actions = p.handle(Died(1, now=0.0, cause="SIGKILL"))
    assert len(actions) == 1 and isinstance(actions[0], Report)
    assert "respawn is off" in actions[0].message
    assert p.phase(1) == RankPhase.DEAD and p.phase(0) == RankPhase.RUNNING
    assert p.handle(Timer(now=99.0)) == []


def test_mode_all_replaces_every_rank() -> None:
    p = RestartPolicy(world_size=3, mode="all")
    actions = p.handle(Died(1, now=0.0))
    assert actions == [Scheduled(1, 0.0), Kill(0), Scheduled(0, 0.0), Kill(2), Scheduled(2, 0.0),
                       Respawn(0, 1), Respawn(1, 1), Respawn(2, 1), Reform(1, (0, 1, 2))]
    # the deaths of the killed survivors are expected, not new failures
    assert p.handle(Died(0, now=0.1, incarnation=0)) == []
    assert p.handle(Died(2, now=0.1, incarnation=0)) == []
    # but a death of a new incarnation is a failure again
    again = p.handle(Died(0, now=0.2, incarnation=1))
    assert Respawn(0, 2) in again and Kill(1) in again and Kill(2) in again



def test_a_death_during_respawn_is_counted_and_backs_off() -> None:
    p = RestartPolicy(world_size=2, base=1.0, rng=random.Random(1))
    p.handle(Died(0, now=0.0))
    assert p.phase(0) == RankPhase.RESPAWNING
    waiting = p.handle(Died(0, now=0.2))  # the new process died before it was ready
    assert len(waiting) == 1 and isinstance(waiting[0], Scheduled)
    assert p.phase(0) == RankPhase.WAITING
    deadline = p.next_deadline()
    assert deadline is not None and 0.2 + 0.75 <= deadline <= 0.2 + 1.25
    actions = p.handle(Timer(now=deadline))
    assert actions[0] == Respawn(0, 2) and actions[1] == Reform(2, (0, 1))


def test_two_deaths_at_once_form_one_new_generation() -> None:
    p = RestartPolicy(world_size=4, base=0.0)
    first = p.handle(Died(1, now=5.0))
    second = p.handle(Died(3, now=5.0))
    assert first[-1] == Reform(1, (0, 1, 2, 3)) and second[-1] == Reform(2, (0, 1, 2, 3))
    assert [a for a in first + second if isinstance(a, Respawn)] == [Respawn(1, 1), Respawn(3, 1)]


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError):
        RestartPolicy(world_size=1, mode="sometimes")


# -- host-level moves, probes (the host agent's and recovery's events) -----------------------
def test_host_lost_without_spare_moves_its_ranks_to_lost_without_spending_budget() -> None:
    p = RestartPolicy(world_size=4, budget=1)
    acts = p.handle(HostLost("h1", (1, 2), now=5.0))
    assert acts == [Report(1, "rank 1 lost: host h1 lost"), Report(2, "rank 2 lost: host h1 lost")]
    assert [p.phase(r) for r in range(4)] == [RankPhase.RUNNING, RankPhase.LOST,
                                              RankPhase.LOST, RankPhase.RUNNING]
    assert p.next_deadline() is None
    assert p.handle(Died(1, now=6.0, cause="SIGKILL")) == []  # its death is old news
    assert p.ranks[1].deaths == []  # no budget spent
    acts = p.handle(RestartRequested((1, 2), now=7.0))  # a restart revives LOST ranks
    assert [a for a in acts if isinstance(a, Respawn)] == [Respawn(1, 1), Respawn(2, 1)]
    assert p.phase(1) == RankPhase.RESPAWNING


def test_host_lost_with_a_spare_host_respawns_its_ranks_there() -> None:
    p = RestartPolicy(world_size=3)
    acts = p.handle(HostLost("h1", (0, 1), now=1.0, spare="h9"))
    assert [a for a in acts if isinstance(a, Respawn)] == [Respawn(0, 1, host="h9"),
                                                          Respawn(1, 1, host="h9")]
    assert acts[-1] == Reform(1, (0, 1, 2))
    assert p.phase(0) == RankPhase.RESPAWNING
    assert p.handle(Died(0, now=2.0, incarnation=0)) == []  # the lost host's process


def test_probed_in_collective_replaces_a_running_member_only() -> None:
    p = RestartPolicy(world_size=2)
    assert p.handle(Probed(1, in_collective=False, now=1.0)) == []
    assert p.handle(Probed(1, in_collective=True, now=1.0)) == [ReplaceStuck(1, 1)]
    assert p.phase(1) == RankPhase.RESPAWNING and p.generation == 0
    assert p.handle(Probed(1, in_collective=True, now=2.0)) == []  # already being replaced


def test_dying_is_a_legal_state_and_illegal_moves_are_refused() -> None:
    t = RankTable(2)
    t.move(0, RankState.READY)
    t.move(0, RankState.DYING)
    with pytest.raises(IllegalTransition):
        t.move(0, RankState.READY)  # a dying process never takes calls again
    t.move(0, RankState.DEAD)
    with pytest.raises(IllegalTransition):
        t.move(1, RankState.FAILED)  # STARTING -> FAILED skips the death


# -- "is it coming back?": one answer, the rank table's ---------------------------------------
def test_the_rank_table_answers_whether_a_rank_is_coming_back_in_every_state() -> None:
    t = RankTable(3)
    assert t.coming_back(0)  # STARTING: its first process is on its way
    t.move(0, RankState.READY)
    assert not t.coming_back(0) and not t.must_wait((0,)) and not t.gone_for_good(0)
    t.move(0, RankState.DYING)  # we killed it: respawned, calls wait
    assert t.coming_back(0) and t.must_wait((0,))
    t.move(0, RankState.DEAD)  # before the policy's answer, or respawn off
    assert not t.coming_back(0) and t.gone_for_good(0) and not t.reform_pending()
    t.schedule(0)  # the policy's Scheduled: waits out a backoff
    assert t.coming_back(0) and not t.gone_for_good(0)
    assert t.reform_pending() and t.must_wait((1,))  # even a survivor's call waits
    t.move(0, RankState.RESPAWNING)
    assert t.coming_back(0) and not t.reform_pending() and not t[0].comes_back
    t.move(0, RankState.DEAD)
    t.move(0, RankState.FAILED)  # budget spent: gone until a user's restart
    assert t.gone_for_good(0)
    t.schedule(0)  # a user's restart of a failed rank
    assert t.coming_back(0)
    t.move(1, RankState.READY)
    t.schedule(1)  # a live rank is not scheduled (the policy kills it first)
    assert not t.coming_back(1)
    t.move(2, RankState.STOPPED)
    t.schedule(2)
    assert t.gone_for_good(2)


def _carry_out(t: RankTable, actions: list[Action]) -> None:
    """What recovery does to the rank table for each action (no process)."""
    for a in actions:
        if isinstance(a, Scheduled):
            t.schedule(a.rank)
        elif isinstance(a, Respawn):
            t.move(a.rank, RankState.RESPAWNING)
            t[a.rank].incarnation = a.incarnation
        elif isinstance(a, GiveUp):
            t.move(a.rank, RankState.FAILED)
        elif isinstance(a, Kill):
            t.move(a.rank, RankState.DEAD)


def test_policy_actions_drive_the_rank_tables_answer() -> None:
    """Died -> Scheduled (+Respawn), mode off -> Report: the table, moved as
    recovery moves it, says coming back exactly when the policy will respawn."""
    for mode, back in (("rank", True), ("all", True), ("off", False)):
        p = RestartPolicy(world_size=2, mode=mode, budget=2, base=1.0)
        t = RankTable(2)
        for r in range(2):
            t.move(r, RankState.READY)
        for death in range(3):
            now = 10.0 * death
            t.move(0, RankState.DEAD)
            _carry_out(t, p.handle(Died(0, now=now, incarnation=t[0].incarnation)))
            expect = back and death < 2  # the third death is past the budget
            assert t.coming_back(0) is expect, (mode, death)
            assert p.phase(0) in ((RankPhase.WAITING, RankPhase.RESPAWNING) if expect
                                  else (RankPhase.DEAD, RankPhase.FAILED))
            if not expect:
                break
            if t[0].state != RankState.RESPAWNING:  # waiting out a backoff
                assert t.reform_pending() and t.must_wait((1,))
                deadline = p.next_deadline()
                assert deadline is not None
                _carry_out(t, p.handle(Timer(deadline)))
            for r in range(2):
                if t[r].state == RankState.RESPAWNING:
                    t.move(r, RankState.READY)
                    p.handle(Ready(r, now=now + 5.0))
            assert not t.coming_back(0) and not t.reform_pending()


def test_a_respawn_moves_the_rank_and_its_incarnation_only_forward() -> None:
    t = RankTable(1)
    t.move(0, RankState.READY)
    t.move(0, RankState.DEAD)
    t.respawning(0, 1)
    assert t[0].state == RankState.RESPAWNING and t[0].incarnation == 1
    with pytest.raises(ValueError):
        t.respawning(0, 1)  # a second Respawn to the same incarnation is a bug


def test_a_spare_is_started_once_settled_or_at_once_during_a_backoff() -> None:
    p = RestartPolicy(world_size=2, base=1.0)
    assert p.handle(SpareCheck(now=0.5, settled_for=0.5, all_live=True)) == []  # start-up
    assert p.handle(SpareCheck(now=5.0, settled_for=SPARE_DELAY_S, all_live=False)) == []
    assert p.handle(SpareCheck(now=5.0, settled_for=SPARE_DELAY_S, all_live=True)) == [StartSpare()]
    p.handle(Died(0, now=10.0))  # first death: respawned at once, no backoff
    p.handle(Died(0, now=10.1))  # its new process died too: a backoff starts
    assert p.next_deadline() is not None
    # the wait is idle time: a spare now, settled or not
    assert p.handle(SpareCheck(now=10.1, settled_for=0.0, all_live=False)) == [StartSpare()]
