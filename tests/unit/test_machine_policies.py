"""The policies the machine owns, with an injected clock and no event loop: connecting,
waiting and polling, retries and giving up, stops, step-down, probes and grace, aborts
and statistics; then random runs that check its invariants after every step."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from pgleaderlock import (
    ConnectionError,
    FixedInterval,
    LockNotHeldError,
    LockState,
    RetryContext,
    SessionNotDedicatedError,
)
from pgleaderlock.core.machine import (
    Aborted,
    Action,
    Answered,
    Await,
    Call,
    CloseSession,
    Connected,
    CutShort,
    Emit,
    Failed,
    IllegalTransitionError,
    Input,
    Late,
    Log,
    Machine,
    Op,
    ReleaseDone,
    Request,
    Result,
    Sleep,
    Started,
    WatchSession,
    Woke,
)
from pgleaderlock.core.models import Event
from pgleaderlock.core.session import FencedSessions
from support.machine import Driver, Recording, config

S, I, A = LockState, Input, Action
ANY = (True, False)


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
    d.machine.request(Request.STOP)
    d.feed(Woke())
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
    d.machine.request(Request.RELEASE)
    d.feed(Woke())
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
    d.machine.request(Request.ALARM)
    d.feed(Woke())
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
    d.machine.request(Request.STOP)
    d.feed(Woke())
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


def _outcomes(call: Call, rng: random.Random, requested: set[Request]) -> Sequence[Result]:
    from pgleaderlock.core.machine import FencedEnded, TermBlocked, TermBumped

    if call.interruptible in requested:
        return [CutShort()]
    error = Failed(ConnectionError("boom"))
    if call.op is Op.CONNECT:
        return [Connected(can_wait=rng.random() < 0.7), error]
    if call.op is Op.BUMP_TERM:
        return [TermBumped(rng.randrange(1, 100)), TermBlocked(), error]
    if call.op is Op.END_FENCED:
        return [FencedEnded(FencedSessions((7,))), FencedEnded(FencedSessions()), error]
    if call.soft_timeout_s is not None:
        return [Answered(True), Answered(False), error, Late(True), Late(False)]
    return [Answered(True), Answered(False), error]


@pytest.mark.parametrize("seed", range(40))
def test_random_runs_keep_the_invariants(seed: int) -> None:
    """Whatever the server answers and whenever users ask: exactly one blocking effect,
    last, while running; none once stopped; on_lost only after on_acquired; on_acquired
    never twice without the leadership ending between (lost, released, or a release that
    failed with on_error)."""
    from pgleaderlock.core.config import TermTable

    rng = random.Random(seed)
    auto, grace, mode = rng.choice(ANY), rng.choice([None, 3.0]), rng.choice(["wait", "poll"])
    fencing = TermTable() if rng.random() < 0.5 else None
    m = Machine(
        config(
            auto_reacquire=auto,
            reconnect_grace_s=grace,
            follower_mode=mode,
            term_table=fencing,
            acquire_delay_s=rng.choice([0.0, 0.05]) if fencing else 0.0,
            lease_s=rng.choice([0.0, 10.0]),
            drain_s=rng.choice([0.0, 0.5]),
        ),
        FixedInterval(rng.choice([0.1, 1.0])),
        random.Random(seed),
    )
    now, leading = 0.0, False
    effects = m.handle(Started(), now)
    for _ in range(400):
        blocking = [e for e in effects if isinstance(e, Call | Sleep | Await)]
        assert len(blocking) <= 1
        if blocking:
            assert effects[-1] is blocking[0]
        for e in effects:
            if isinstance(e, Emit) and e.event is Event.ACQUIRED:
                assert not leading
                leading = True
            elif isinstance(e, Emit) and e.event in (Event.LOST, Event.RELEASED):
                assert leading
                leading = False
            elif isinstance(e, Emit) and e.event is Event.STOPPED:
                leading = False
        events = [e.event for e in effects if isinstance(e, Emit)]
        if S.RELEASING in [e.old for e in effects if isinstance(e, Emit)]:
            assert Event.RELEASED in events or Event.ERROR in events
            leading = False  # a release that failed ends leadership with on_error
        if m.state is S.STOPPED:
            assert not blocking
            break
        assert blocking, effects
        requested = set()
        if rng.random() < 0.15:
            request = rng.choice(list(Request))
            m.request(request)
            requested.add(request)
        if rng.random() < 0.02:
            m.request(Request.STOP)
            requested.add(Request.STOP)
        effect = blocking[0]
        if isinstance(effect, Await):
            cut = effect.interruptible & requested or {
                r for r in effect.interruptible if m.requested(r)
            }
            answers: list[Result] = [Answered(True), Answered(False), Failed(ConnectionError("x"))]
            answer = rng.choice(answers)
            effects = m.handle(CutShort() if cut else answer, now)
        elif isinstance(effect, Sleep):
            now = max(now, effect.until) if rng.random() < 0.8 else now
            effects = m.handle(Woke(), now)
        else:
            now += rng.random() * effect.timeout_s
            if m.preempted(effect):
                effects = m.handle(CutShort(), now)
            else:
                effects = m.handle(rng.choice(_outcomes(effect, rng, requested)), now)
    else:
        m.request(Request.STOP)
    assert m.state in LockState
