"""The machine with an injected clock and no event loop: the table row by row against the
original table with its three footnotes (docs/state-machine.md), then every policy the
machine owns (on the hand-fed driver of tests/support/machine.py). Random runs, fencing
and what a leader does: test_machine_leader.py.

EXPECTED is written from docs/state-machine.md (the table, its footnotes and its
deviations; the decisions are docs/concepts.md's), independently of machine.TABLE: changing any row of the table makes its case here fail.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from pgleaderlock import (
    ConnectionError,
    LockNotHeldError,
    LockState,
    RetryContext,
    SessionNotDedicatedError,
)
from pgleaderlock.core.machine import (
    TABLE,
    Aborted,
    Action,
    Answered,
    Call,
    CloseSession,
    Conditions,
    Connected,
    CutShort,
    Emit,
    Failed,
    IllegalTransitionError,
    Input,
    Log,
    Op,
    ReleaseDone,
    Request,
    Result,
    Sleep,
    Started,
    WatchSession,
    Woke,
    legal_inputs,
    render_markdown,
    render_mermaid,
    step,
)
from pgleaderlock.core.models import Event
from support.machine import ANY, A, Driver, I, Recording, S

CLOSE_STOP = (A.CLOSE_SESSION, A.EMIT_STOPPED)


When = tuple[LockState, Input, bool | None, bool | None, bool | None]


Then = tuple[LockState, tuple[Action, ...]]


EXPECTED: list[tuple[When, Then]] = [
    # STOPPED --Start--> FOLLOWER: schedule an immediate attempt (the session opens then)
    ((S.STOPPED, I.START, None, None, None), (S.FOLLOWER, (A.SCHEDULE_ATTEMPT,))),
    ((S.FOLLOWER, I.ACQUIRE_ATTEMPT, None, None, None), (S.ACQUIRING, (A.TRY_LOCK,))),
    ((S.FOLLOWER, I.STOP_REQUESTED, None, None, None), (S.STOPPED, CLOSE_STOP)),
    # connection establishment failure: retried with the strategy
    ((S.FOLLOWER, I.DB_ERROR, None, None, None),
     (S.FOLLOWER, (A.EMIT_ERROR, A.CLOSE_SESSION, A.BACKOFF))),
    ((S.FOLLOWER, I.RETRIES_EXHAUSTED, None, None, None),
     (S.STOPPED, (A.LOG_GIVING_UP, *CLOSE_STOP))),
    ((S.ACQUIRING, I.ACQUIRE_SUCCEEDED, None, None, None),
     (S.LEADER, (A.EMIT_ACQUIRED, A.RESET_RETRY, A.START_HEALTH_LOOP))),
    ((S.ACQUIRING, I.ACQUIRE_FAILED, None, None, None),
     (S.FOLLOWER, (A.EMIT_ACQUIRE_FAILED, A.BACKOFF))),
    # DbError while acquiring: on_error (docs/concepts.md decision 2), footnote 1
    ((S.ACQUIRING, I.DB_ERROR, True, None, None),
     (S.FOLLOWER, (A.EMIT_ERROR, A.CLOSE_SESSION, A.BACKOFF))),
    ((S.ACQUIRING, I.DB_ERROR, False, None, None), (S.STOPPED, (A.EMIT_ERROR, *CLOSE_STOP))),
    ((S.ACQUIRING, I.STOP_REQUESTED, None, None, None), (S.STOPPED, CLOSE_STOP)),
    ((S.LEADER, I.HEALTH_OK, None, None, None), (S.LEADER, (A.START_HEALTH_LOOP,))),
    # a late probe suspends leadership without events; its answer decides
    ((S.LEADER, I.PROBE_LATE, None, None, None), (S.RECONNECTING, (A.LOG_PROBE_LATE,))),
    ((S.RECONNECTING, I.HEALTH_OK, None, None, None),
     (S.LEADER, (A.LOG_RECOVERED, A.START_HEALTH_LOOP))),
    ((S.RECONNECTING, I.HEALTH_FAILED, None, True, None),
     (S.RECONNECTING, (A.LOG_SESSION_LOST, A.CLOSE_SESSION, A.START_GRACE))),
    ((S.RECONNECTING, I.HEALTH_FAILED, True, False, None),
     (S.FOLLOWER, (A.LOG_SESSION_LOST, A.EMIT_LOST, A.CLOSE_SESSION, A.SCHEDULE_ATTEMPT))),
    ((S.RECONNECTING, I.HEALTH_FAILED, False, False, None),
     (S.STOPPED, (A.LOG_SESSION_LOST, A.EMIT_LOST, *CLOSE_STOP))),
    # HealthFailed / DbError in LEADER: RECONNECTING, or footnote 3 (+ footnote 1)
    *[
        row
        for inp in (I.HEALTH_FAILED, I.DB_ERROR)
        for row in (
            ((S.LEADER, inp, None, True, None),
             (S.RECONNECTING, (A.LOG_SESSION_LOST, A.CLOSE_SESSION, A.START_GRACE))),
            ((S.LEADER, inp, True, False, None),
             (S.FOLLOWER,
              (A.LOG_SESSION_LOST, A.EMIT_LOST, A.CLOSE_SESSION, A.SCHEDULE_ATTEMPT))),
            ((S.LEADER, inp, False, False, None),
             (S.STOPPED, (A.LOG_SESSION_LOST, A.EMIT_LOST, *CLOSE_STOP))),
        )
    ],
    # a graceful stop with drain_s > 0 drains first, still LEADER (the request stays)
    ((S.LEADER, I.DRAIN_REQUESTED, None, None, None), (S.LEADER, (A.START_DRAIN,))),
    ((S.LEADER, I.STOP_REQUESTED, None, None, None), (S.RELEASING, (A.UNLOCK,))),
    ((S.LEADER, I.RELEASE_REQUESTED, None, None, None), (S.RELEASING, (A.UNLOCK,))),
    # RECONNECTING: silent recovery emits nothing
    ((S.RECONNECTING, I.REACQUIRE_SUCCEEDED, None, None, None),
     (S.LEADER, (A.LOG_RECOVERED, A.RESET_RETRY, A.START_HEALTH_LOOP))),
    ((S.RECONNECTING, I.REACQUIRE_FAILED, True, None, None),
     (S.FOLLOWER, (A.EMIT_LOST, A.SCHEDULE_ATTEMPT))),
    ((S.RECONNECTING, I.REACQUIRE_FAILED, False, None, None),
     (S.STOPPED, (A.EMIT_LOST, *CLOSE_STOP))),
    ((S.RECONNECTING, I.RECONNECT_FAILED, None, None, None),
     (S.RECONNECTING, (A.CLOSE_SESSION, A.RETRY_RECONNECT))),
    ((S.RECONNECTING, I.GRACE_EXPIRED, True, None, None),
     (S.FOLLOWER, (A.EMIT_LOST, A.CLOSE_SESSION, A.SCHEDULE_ATTEMPT))),
    ((S.RECONNECTING, I.GRACE_EXPIRED, False, None, None),
     (S.STOPPED, (A.EMIT_LOST, *CLOSE_STOP))),
    # step_down() while the session is gone: the leadership was lost, not released
    ((S.RECONNECTING, I.RELEASE_REQUESTED, True, None, None),
     (S.FOLLOWER, (A.EMIT_LOST, A.CLOSE_SESSION, A.BACKOFF))),
    ((S.RECONNECTING, I.RELEASE_REQUESTED, False, None, None),
     (S.STOPPED, (A.EMIT_LOST, *CLOSE_STOP))),
    ((S.RECONNECTING, I.STOP_REQUESTED, None, None, None), (S.STOPPED, CLOSE_STOP)),
    # RELEASING: footnote 2 (step_down + auto_reacquire -> FOLLOWER); docs/concepts.md decision 7
    *[
        row
        for inp, emit in (
            (I.RELEASE_SUCCEEDED, A.EMIT_RELEASED),
            (I.RELEASE_FAILED, A.EMIT_ERROR),
            (I.DB_ERROR, A.EMIT_ERROR),
        )
        for row in (
            ((S.RELEASING, inp, None, None, False), (S.STOPPED, (emit, *CLOSE_STOP))),
            ((S.RELEASING, inp, False, None, True), (S.STOPPED, (emit, *CLOSE_STOP))),
            ((S.RELEASING, inp, True, None, True),
             (S.FOLLOWER, (emit, A.CLOSE_SESSION, A.BACKOFF))),
        )
    ],
    # a cancelled or crashed task stops from every running state
    *[
        ((state, I.TASK_ABORTED, None, None, None), (S.STOPPED, CLOSE_STOP))
        for state in (S.FOLLOWER, S.ACQUIRING, S.LEADER, S.RECONNECTING, S.RELEASING)
    ],
]  # fmt: skip


def _configs(auto: bool | None, grace: bool | None, step_down: bool | None) -> Iterator[Conditions]:
    for a, g, s in itertools.product(ANY, ANY, ANY):
        if auto in (None, a) and grace in (None, g) and step_down in (None, s):
            yield Conditions(auto_reacquire=a, grace_enabled=g, step_down=s)


@pytest.mark.parametrize(
    ("when", "then"),
    EXPECTED,
    ids=[f"{w[0].name}-{w[1].value}-{i}" for i, (w, _) in enumerate(EXPECTED)],
)
def test_row(when: When, then: Then) -> None:
    state, input_, auto, grace, step_down = when
    target, actions = then
    for cond in _configs(auto, grace, step_down):
        transition = step(state, input_, cond)
        assert transition.target is target, cond
        assert transition.actions == actions, cond


def test_every_table_row_is_expected() -> None:
    """No row exists beyond the ones above (an added row needs a case too)."""
    covered = {(S.STOPPED, I.TASK_ABORTED)}  # checked by test_aborted_when_stopped
    covered_conds = set()
    for (state, input_, auto, grace, step_down), _ in EXPECTED:
        for cond in _configs(auto, grace, step_down):
            covered_conds.add((state, input_, cond))
    for row in TABLE:
        if (row.source, row.input) in covered:
            continue
        for cond in _configs(row.auto_reacquire, row.grace_enabled, row.step_down):
            assert (row.source, row.input, cond) in covered_conds, row


def test_at_most_one_row_matches() -> None:
    for state, input_ in itertools.product(LockState, Input):
        for cond in _configs(None, None, None):
            for reported in ANY:
                c = Conditions(cond.auto_reacquire, cond.grace_enabled, cond.step_down, reported)
                matching = [row for row in TABLE if row.matches(state, input_, c)]
                assert len(matching) <= 1, (state, input_, c, matching)


@pytest.mark.parametrize(
    ("state", "input_"),
    [
        (S.STOPPED, I.ACQUIRE_ATTEMPT),
        (S.STOPPED, I.STOP_REQUESTED),
        (S.FOLLOWER, I.RELEASE_REQUESTED),
        (S.LEADER, I.ACQUIRE_ATTEMPT),
        (S.LEADER, I.ACQUIRE_SUCCEEDED),
        (S.RECONNECTING, I.ACQUIRE_SUCCEEDED),
        (S.RELEASING, I.STOP_REQUESTED),
        (S.ACQUIRING, I.HEALTH_FAILED),
    ],
)
def test_illegal_pairs_raise(state: LockState, input_: Input) -> None:
    with pytest.raises(IllegalTransitionError):
        step(state, input_, Conditions())


def test_never_try_lock_from_leader() -> None:
    """Never re-acquire while leader (docs/guarantees.md, "Mutual exclusion"): it would
    stack the re-entrant lock."""
    for row in TABLE:
        if row.source in (S.LEADER, S.RELEASING):
            assert A.TRY_LOCK not in row.actions
            assert A.SCHEDULE_ATTEMPT not in row.actions or row.target is not S.LEADER


def test_on_lost_only_leaving_leadership() -> None:
    """``on_lost`` fires only after leadership was held (docs/concepts.md, decision 2)."""
    for row in TABLE:
        if A.EMIT_LOST in row.actions:
            assert row.source in (S.LEADER, S.RECONNECTING)


def test_every_stop_emits_on_stopped_and_closes() -> None:
    for row in TABLE:
        if row.target is S.STOPPED and row.source is not S.STOPPED:
            assert row.actions[-2:] == (A.CLOSE_SESSION, A.EMIT_STOPPED), row


def test_legal_inputs_and_renderings() -> None:
    assert legal_inputs(S.STOPPED) == {I.START, I.TASK_ABORTED}
    assert I.RELEASE_REQUESTED in legal_inputs(S.LEADER)
    md = render_markdown()
    assert md.count("\n") == len(TABLE) + 1
    assert "| RECONNECTING | `ReacquireSucceeded` |" in md
    mermaid = render_mermaid()
    assert mermaid.startswith("stateDiagram-v2")
    for row in TABLE:
        if row.input is not I.TASK_ABORTED:
            assert f"{row.source.name} --> {row.target.name}: {row.input.value}" in mermaid


def test_start_connects_then_tries_then_leads() -> None:
    d = Driver()
    d.feed(Started())
    assert d.machine.state is S.FOLLOWER
    assert d.blocking == Call(Op.CONNECT, 3.0, interruptible=Request.STOP, what="connect")
    d.feed(Connected(can_wait=True))
    assert d.machine.state is S.ACQUIRING  # type: ignore[comparison-overlap]
    assert d.blocking == Call(Op.TRY_LOCK, 4.0, interruptible=Request.STOP, what="try_lock")
    d.feed(Answered(True), after=0.01)
    assert d.machine.state is S.LEADER
    assert d.emitted() == [Event.ACQUIRED]
    # LatestPhase: no jitter; the probe time is rounded down to the 0.1 s grid
    assert d.effects[-2:] == [WatchSession(), Sleep(105.0)]
    assert d.machine.leader_since == d.now


def test_busy_lock_waits_on_the_server_for_the_delay() -> None:
    retry = Recording(2.5, 7.0)
    d = Driver(retry)
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Answered(False), after=1)
    assert d.emitted() == [Event.ACQUIRE_FAILED]
    wait = d.blocking
    assert isinstance(wait, Call)
    assert (wait.op, wait.wait_s, wait.timeout_s) == (Op.WAIT_LOCK, 2.5, 2.5 + 4.0)
    assert not wait.abort_on_interrupt  # the driver cancels the wait on the server first
    d.feed(Answered(False), after=2.5)
    assert [c.attempt for c in retry.contexts] == [1, 2]
    assert retry.contexts[1].elapsed_s == pytest.approx(3.5)
    assert all(c.last_error is None for c in retry.contexts)


def test_a_waiting_follower_logs_its_cycle_at_info_once() -> None:
    """Each wait on the server ends (its budget) and begins again: FOLLOWER and
    ACQUIRING alternate. That is logged at INFO once, then at DEBUG, so a follower does
    not look broken in the logs; leading again is INFO as always."""
    d = Driver(Recording(1.0, 2.0, 4.0, 8.0, 16.0))
    logged: list[tuple[str, tuple[tuple[str, object], ...]]] = []

    def feed(result: Result, after: float = 0.0) -> None:
        d.feed(result, after)
        logged.extend((e.level, e.fields) for e in d.effects
                      if isinstance(e, Log) and e.message == "state_change")  # fmt: skip

    feed(Started())
    feed(Connected(can_wait=True))
    for wait_s in (0.0, 1.0, 2.0, 4.0, 8.0):
        feed(Answered(False), after=wait_s)
    feed(Answered(True), after=16.0)
    moves = [(level, dict(fields)["from"], dict(fields)["to"]) for level, fields in logged]
    assert [m for m in moves if m[0] == "info"] == [
        ("info", "stopped", "follower"),
        ("info", "follower", "acquiring"),
        ("info", "acquiring", "follower"),
        ("info", "acquiring", "leader"),
    ]
    assert len([m for m in moves if m[0] == "debug"]) == 9  # 4 more waits, 1 last try


def test_poll_mode_and_sessions_that_cannot_wait_sleep_instead() -> None:
    cases: list[tuple[dict[str, Any], bool]] = [({"follower_mode": "poll"}, True), ({}, False)]
    for kwargs, can_wait in cases:
        d = Driver(**kwargs)
        d.feed(Started())
        d.feed(Connected(can_wait=can_wait))
        d.feed(Answered(False))
        assert d.blocking == Sleep(d.now + 1.0)
        d.feed(Woke(), after=1.0)
        assert isinstance(d.blocking, Call)
        assert d.blocking.op is Op.TRY_LOCK


def test_connect_failure_reports_error_closes_nothing_and_sleeps() -> None:
    retry = Recording(0.5)
    d = Driver(retry)
    d.feed(Started())
    error = ConnectionError("refused")
    d.feed(Failed(error))
    assert d.machine.state is S.FOLLOWER
    assert d.emitted() == [Event.ERROR]
    assert not any(isinstance(e, CloseSession) for e in d.effects)  # none was open
    assert d.blocking == Sleep(d.now + 0.5)
    assert retry.contexts[0].last_error is error
    d.feed(Woke(), after=0.5)
    assert d.call.op is Op.CONNECT


def test_db_error_while_acquiring_closes_and_backs_off() -> None:
    d = Driver(Recording(0.25))
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Failed(ConnectionError("reset")))
    assert d.emitted() == [Event.ERROR]
    assert CloseSession() in d.effects
    assert d.blocking == Sleep(d.now + 0.25)  # an error sleeps, never waits on the server


def test_retry_strategy_giving_up_stops_without_an_error() -> None:
    d = Driver(Recording(None))
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Answered(False))
    assert d.machine.state is S.STOPPED
    assert d.emitted() == [Event.ACQUIRE_FAILED, Event.STOPPED]
    assert "giving_up" in d.logged()
    assert d.blocking is None


def test_a_retry_strategy_that_raises_gives_up() -> None:
    class Broken:
        def next_delay_s(self, ctx: RetryContext) -> float | None:
            raise RuntimeError("strategy bug")

    d = Driver(Broken())
    d.feed(Started())
    d.feed(Failed(ConnectionError("down")))
    assert d.machine.state is S.STOPPED
    assert "retry_strategy_failed" in d.logged()


def test_non_retryable_error_stops_after_on_error() -> None:
    retry = Recording()
    d = Driver(retry)
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Failed(SessionNotDedicatedError("pooler")))
    assert d.machine.state is S.STOPPED
    assert d.emitted() == [Event.ERROR, Event.STOPPED]
    assert retry.contexts == []  # not even asked


def test_stop_while_sleeping_stops() -> None:
    d = Driver()
    d.feed(Started())
    d.feed(Failed(ConnectionError("down")))
    assert d.machine.request(Request.STOP)
    d.feed(Woke())
    assert d.machine.state is S.STOPPED
    assert d.emitted() == [Event.STOPPED]


def test_stop_cuts_short_an_attempt_and_closes_its_session() -> None:
    d = Driver()
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    attempt = d.call
    assert not d.machine.preempted(attempt)
    d.machine.request(Request.STOP)
    assert d.machine.preempted(attempt)
    d.feed(CutShort())
    assert d.machine.state is S.STOPPED
    assert CloseSession() in d.effects  # the attempt may have been granted


def test_stop_before_the_first_decision_is_kept() -> None:
    d = Driver()
    d.machine.request(Request.STOP)  # shutdown() raced start()
    d.feed(Started())
    assert d.machine.state is S.STOPPED


def test_stop_while_leader_releases_then_stops() -> None:
    d = Driver()
    d.lead()
    d.request(Request.STOP)
    assert d.machine.state is S.RELEASING
    assert d.blocking == Call(Op.UNLOCK, 4.0, interruptible=Request.FORCE, what="unlock")
    d.feed(Answered(True))
    assert d.machine.state is S.STOPPED  # type: ignore[comparison-overlap]
    assert d.emitted() == [Event.RELEASED, Event.STOPPED]


def test_step_down_hands_over_and_waits_one_delay() -> None:
    d = Driver(Recording(0.75))
    d.lead()
    assert d.machine.request(Request.RELEASE) is True
    d.feed(Woke())
    assert d.machine.state is S.RELEASING
    d.feed(Answered(True))
    assert d.machine.state is S.FOLLOWER  # type: ignore[comparison-overlap]
    assert d.emitted() == [Event.RELEASED]
    assert CloseSession() in d.effects
    assert ReleaseDone() in d.effects
    assert d.blocking == Sleep(d.now + 0.75)  # the others had their chance first


def test_step_down_when_not_leading_asks_nothing() -> None:
    d = Driver()
    d.feed(Started())
    assert d.machine.request(Request.RELEASE) is False


def test_step_down_timeout_forces_the_release() -> None:
    d = Driver()
    d.lead()
    d.request(Request.RELEASE)
    d.machine.request(Request.FORCE)
    d.feed(CutShort())
    assert d.machine.state is S.FOLLOWER
    assert d.emitted() == [Event.ERROR]
    error = next(e.error for e in d.effects if isinstance(e, Emit) and e.error)
    assert "step_down timed out" in str(error)


def test_probe_schedule_alarm_and_loss() -> None:
    d = Driver()
    d.lead()
    d.feed(Woke(), after=2.0)  # woken early, nothing due
    assert d.blocking == Sleep(d.now + 3.0)
    d.request(Request.ALARM)
    assert d.call == Call(Op.PROBE, 9.0, soft_timeout_s=2.0, what="health check")
    # the alarm probes at once; late after health_timeout_s, given up at tcp_user_timeout_s
    d.feed(Answered(True))
    assert d.blocking == Sleep(d.now + 5.0)
    d.feed(Woke(), after=5.0)
    d.feed(Answered(False))
    assert d.machine.state is S.FOLLOWER
    assert d.emitted() == [Event.LOST]
    assert isinstance(d.machine.last_error, LockNotHeldError)
    assert d.call.op is Op.CONNECT  # right away: a lost lock is contested at once


def test_grace_reconnects_within_its_deadline() -> None:
    retry = Recording(1.0, 5.0)
    d = Driver(retry, reconnect_grace_s=4.0)
    d.lead()
    d.feed(Woke(), after=5.0)
    d.feed(Failed(ConnectionError("gone")))
    assert d.machine.state is S.RECONNECTING
    assert d.emitted() == []  # flap damping: no on_lost yet
    assert d.blocking == Call(Op.CONNECT, 3.0, interruptible=Request.STOP, what="reconnect")
    d.feed(Failed(ConnectionError("refused")), after=2.0)
    assert d.blocking == Sleep(d.now + 1.0)  # type: ignore[comparison-overlap]
    d.feed(Woke(), after=1.0)
    assert d.call.timeout_s == pytest.approx(1.0)  # the time left in the grace period
    d.feed(Failed(ConnectionError("refused")), after=0.5)
    assert d.blocking == Sleep(d.now + 0.5)  # type: ignore[comparison-overlap]  # the 5 s delay is cut at the deadline
    d.feed(Woke(), after=0.5)
    assert d.machine.state is S.FOLLOWER  # type: ignore[comparison-overlap]
    assert d.emitted() == [Event.LOST]


def test_grace_recovers_silently() -> None:
    d = Driver(reconnect_grace_s=4.0)
    d.lead()
    d.feed(Woke(), after=5.0)
    d.feed(Failed(ConnectionError("gone")))
    d.feed(Connected(can_wait=True))
    assert d.call.op is Op.TRY_LOCK
    d.feed(Answered(True))
    assert d.machine.state is S.LEADER
    assert d.emitted() == []
    assert "leadership_recovered" in d.logged()


def test_step_down_while_reconnecting_reports_the_loss() -> None:
    d = Driver(reconnect_grace_s=4.0)
    d.lead()
    d.feed(Woke(), after=5.0)
    d.feed(Failed(ConnectionError("gone")))
    assert d.machine.request(Request.RELEASE)
    d.feed(Failed(ConnectionError("refused")))
    assert d.machine.state is S.FOLLOWER
    assert d.emitted() == [Event.LOST]
    assert ReleaseDone() in d.effects


def test_aborted_task_stops_and_reports_a_crash() -> None:
    d = Driver()
    d.lead()
    crash = RuntimeError("bug")
    d.feed(Aborted(crash, stop_reported=False))
    assert d.machine.state is S.STOPPED
    assert d.emitted() == [Event.ERROR, Event.STOPPED]
    assert d.blocking is None


def test_aborted_when_stopped() -> None:
    """A forced stop that cut on_stopped short still reports it, once."""
    d = Driver()
    d.feed(Started())
    d.request(Request.STOP)
    assert d.machine.state is S.STOPPED
    d.feed(Aborted(None, stop_reported=False))
    assert d.emitted() == [Event.STOPPED]
    d.feed(Aborted(None, stop_reported=True))
    assert d.emitted() == []


def test_statistics_count_what_users_saw() -> None:
    d = Driver(reconnect_grace_s=None)
    d.lead()
    d.feed(Woke(), after=5.0)
    d.feed(Failed(ConnectionError("gone")))
    d.feed(Connected(can_wait=True))
    d.feed(Answered(False))
    stats = d.machine.statistics(leader_since=None, backend_pid=None)
    assert (stats.acquisitions, stats.losses, stats.failed_attempts) == (1, 1, 1)
    assert stats.transitions == 7  # F, A, L, F, A, F, A (waiting on the server)
    assert stats.state is S.ACQUIRING
    assert stats.errors == 0  # a failed probe is on_lost, not on_error


def test_results_that_make_no_sense_raise() -> None:
    d = Driver()
    with pytest.raises(IllegalTransitionError):
        d.feed(Answered(True))  # no call in flight
