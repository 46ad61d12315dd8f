"""The machine with an injected clock and no event loop: the table row by row against the
original table with its three footnotes (docs/state-machine.md), then every policy the machine owns, then random runs that
check its invariants.

EXPECTED is written from docs/state-machine.md (the table, its footnotes and its
deviations; the decisions are docs/concepts.md's), independently of machine.TABLE: changing any row of the table makes its case here fail.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from pgleaderlock import (
    ConnectionError,
    FixedInterval,
    LockNotHeldError,
    LockState,
    RetryContext,
    RetryStrategy,
    SessionNotDedicatedError,
)
from pgleaderlock.core.config import LockConfig
from pgleaderlock.core.machine import (
    TABLE,
    Aborted,
    Action,
    Answered,
    Await,
    Call,
    CloseSession,
    Conditions,
    Connected,
    CutShort,
    Effect,
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
    StopLeaderWork,
    WatchSession,
    Woke,
    idle_step,
    legal_inputs,
    render_markdown,
    render_mermaid,
    step,
)
from pgleaderlock.core.models import Event
from pgleaderlock.core.session import FencedSessions

S, I, A = LockState, Input, Action
ANY = (True, False)

CLOSE_STOP = (A.CLOSE_SESSION, A.EMIT_STOPPED)

# (from, input, auto_reacquire, grace, step_down) -> (to, actions); None = any value.
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


# ---------------------------------------------------------------------- policies


def config(**kwargs: Any) -> LockConfig:
    values: dict[str, Any] = {
        "health_interval_s": 5.0,
        "health_timeout_s": 2.0,
        "reconnect_grace_s": None,
        "connect_timeout_s": 3.0,
        "command_timeout_s": 4.0,
        "tcp_user_timeout_s": 9.0,
        "auto_reacquire": True,
        "follower_mode": "wait",
    }
    values.update(kwargs)
    return LockConfig(**values)


class Recording:
    """A retry strategy that records its contexts and answers from a list (then 1 s)."""

    def __init__(self, *delays: float | None) -> None:
        self.delays = list(delays)
        self.contexts: list[RetryContext] = []

    def next_delay_s(self, ctx: RetryContext) -> float | None:
        self.contexts.append(ctx)
        return self.delays.pop(0) if self.delays else 1.0


class LatestPhase(random.Random):
    """A random source whose draws are the top of their range: a new leadership's first
    probe comes a full interval later, as without jitter."""

    def uniform(self, a: float, b: float) -> float:
        return b


class Driver:
    """Feeds a machine by hand: the clock is ``now``, effects are kept for assertions."""

    def __init__(
        self, retry: RetryStrategy | None = None, rng: random.Random | None = None, **kwargs: Any
    ) -> None:
        self.machine = Machine(config(**kwargs), retry or FixedInterval(1.0), rng or LatestPhase())
        self.now = 100.0
        self.effects: list[Effect] = []

    def feed(self, result: Result, after: float = 0.0) -> list[Effect]:
        self.now += after
        self.effects = self.machine.handle(result, self.now)
        return self.effects

    @property
    def blocking(self) -> Effect | None:
        last = self.effects[-1] if self.effects else None
        return last if isinstance(last, Call | Sleep | Await) else None

    @property
    def call(self) -> Call:
        """The blocking effect, which must be a database call."""
        blocking = self.blocking
        assert isinstance(blocking, Call), blocking
        return blocking

    def emitted(self) -> list[Event]:
        return [
            e.event
            for e in self.effects
            if isinstance(e, Emit) and e.event is not Event.STATE_CHANGE
        ]

    def logged(self) -> list[str]:
        return [e.message for e in self.effects if isinstance(e, Log)]

    def lead(self) -> None:
        self.feed(Started())
        self.feed(Connected(can_wait=True))
        self.feed(Answered(True))
        assert self.machine.state is S.LEADER


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


# ---------------------------------------------------------------------- random runs


def _outcomes(call: Call, rng: random.Random, requested: set[Request]) -> Sequence[Result]:
    from pgleaderlock.core.machine import FencedEnded, Late, TermBlocked, TermBumped

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


# ---------------------------------------------------------------------- fencing


def fencing_driver(**kwargs: Any) -> Driver:
    from pgleaderlock.core.config import TermTable

    return Driver(term_table=TermTable(), **kwargs)


def test_fencing_bumps_the_term_before_announcing_leadership() -> None:
    from pgleaderlock.core.machine import TermBumped

    d = fencing_driver()
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Answered(True))
    assert d.machine.state is S.ACQUIRING  # not LEADER before the term is known
    assert d.emitted() == []
    bump = d.blocking
    assert isinstance(bump, Call)
    assert bump.op is Op.BUMP_TERM
    assert d.machine.term is None
    d.feed(TermBumped(42))
    assert d.machine.state is S.LEADER  # type: ignore[comparison-overlap]
    assert d.emitted() == [Event.ACQUIRED]
    assert d.machine.term == 42


def test_acquire_delay_holds_on_acquired_back() -> None:
    from pgleaderlock.core.machine import TermBumped

    d = fencing_driver(acquire_delay_s=0.25)
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Answered(True))
    d.feed(TermBumped(7))
    assert d.machine.state is S.ACQUIRING
    assert d.blocking == Sleep(d.now + 0.25)
    d.feed(Woke(), after=0.1)  # woken early (a request that is not a stop)
    assert d.blocking == Sleep(d.now + 0.15)
    d.feed(Woke(), after=0.15)
    assert d.machine.state is S.LEADER  # type: ignore[comparison-overlap]
    assert d.machine.term == 7


def test_a_stop_during_the_acquire_delay_closes_the_session() -> None:
    from pgleaderlock.core.machine import TermBumped

    d = fencing_driver(acquire_delay_s=1.0)
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Answered(True))
    d.feed(TermBumped(7))
    d.machine.request(Request.STOP)
    d.feed(Woke())
    assert d.machine.state is S.STOPPED
    assert CloseSession() in d.effects
    assert Event.ACQUIRED not in d.emitted()


def test_a_failed_term_bump_gives_the_lock_back() -> None:
    d = fencing_driver()
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Answered(True))
    d.feed(Failed(ConnectionError("fencing term timed out")))
    assert d.machine.state is S.FOLLOWER
    assert CloseSession() in d.effects  # closing the session frees the lock
    assert d.emitted() == [Event.ERROR]


def test_a_silent_recovery_bumps_the_term_too() -> None:
    from pgleaderlock.core.machine import TermBumped

    d = fencing_driver(reconnect_grace_s=4.0)
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Answered(True))
    d.feed(TermBumped(1))
    d.feed(Woke(), after=5.0)
    d.feed(Failed(ConnectionError("gone")))
    assert d.machine.state is S.RECONNECTING
    assert d.machine.term is None  # not leading: no valid term
    d.feed(Connected(can_wait=True))
    d.feed(Answered(True))
    assert getattr(d.blocking, "op", None) is Op.BUMP_TERM
    d.feed(TermBumped(2))
    assert d.machine.state is S.LEADER  # type: ignore[comparison-overlap]
    assert d.machine.term == 2


def test_a_blocked_term_bump_ends_the_old_terms_fenced_sessions_then_bumps_again() -> None:
    """The bump waits fencing_grace_s for the old term's fenced transactions; then their
    sessions are ended (those this role may end) and the bump runs again; leadership is
    announced only once it has bumped. Sessions it may not end keep it waiting, logged
    as an error, and the bump is tried again every grace."""
    from pgleaderlock.core.machine import FencedEnded, TermBlocked, TermBumped

    d = fencing_driver(fencing_grace_s=1.5)
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Answered(True))
    bump = d.call
    assert (bump.op, bump.wait_s, bump.timeout_s) == (Op.BUMP_TERM, 1.5, 1.5 + 4.0)
    d.feed(TermBlocked(), after=1.5)
    assert d.machine.state is S.ACQUIRING
    assert d.call == Call(Op.END_FENCED, 4.0, interruptible=Request.STOP,
                          what="end fenced transactions")  # fmt: skip
    assert "term_bump_blocked" in d.logged()
    d.feed(FencedEnded(FencedSessions(ended=(11,), refused=((12, "other"),))))
    assert d.logged() == ["fenced_sessions_ended", "fenced_sessions_not_ended"]
    refused = next(e for e in d.effects if isinstance(e, Log) and e.level == "error")
    assert dict(refused.fields)["sessions"] == ["12 (other)"]
    assert d.call.op is Op.BUMP_TERM
    assert d.emitted() == []  # not leading yet
    d.feed(TermBumped(8))
    assert d.machine.state is S.LEADER  # type: ignore[comparison-overlap]
    assert d.machine.term == 8
    d.machine.request(Request.STOP)  # a stop cuts the bump (or the ending) short
    assert d.machine.preempted(Call(Op.END_FENCED, 1.0, interruptible=Request.STOP))


def test_ending_fenced_sessions_that_fails_gives_the_lock_back() -> None:
    from pgleaderlock.core.machine import TermBlocked

    d = fencing_driver()
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Answered(True))
    d.feed(TermBlocked())
    d.feed(Failed(ConnectionError("end fenced transactions timed out")))
    assert d.machine.state is S.FOLLOWER
    assert CloseSession() in d.effects
    assert d.emitted() == [Event.ERROR]


# ---------------------------------------------------------------------- drain


def test_no_drain_by_default() -> None:
    d = Driver()
    d.lead()
    d.machine.request(Request.RELEASE)
    d.feed(Woke())
    assert d.machine.state is S.RELEASING
    assert d.call.op is Op.UNLOCK


def test_a_graceful_stop_drains_first_and_keeps_probing() -> None:
    """With drain_s, step_down() stays LEADER and starts the on_draining callbacks; the
    probes go on (sleeps end at the next probe or the drain's end); once the callbacks
    have returned (DRAINED) the drain ends, then the lock is released."""
    from pgleaderlock.core.machine import EndDrain, StartDrain

    d = Driver(drain_s=3.0)
    d.lead()  # next probe at now + 5
    d.machine.request(Request.RELEASE)
    d.feed(Woke(), after=1.0)
    assert d.machine.state is S.LEADER
    assert d.machine.draining
    assert StartDrain() in d.effects
    assert "draining" in d.logged()
    assert d.blocking == Sleep(d.now + 3.0)  # the drain ends before the next probe
    d.feed(Woke(), after=1.0)  # woken by another request: nothing new
    assert StartDrain() not in d.effects
    assert d.blocking == Sleep(d.now + 2.0)
    d.machine.request(Request.DRAINED)
    d.feed(Woke(), after=0.5)
    assert not d.machine.draining
    assert d.effects.index(EndDrain()) < len(d.effects) - 1
    assert d.machine.state is S.RELEASING
    assert d.call.op is Op.UNLOCK
    d.feed(Answered(True))
    assert d.emitted() == [Event.RELEASED]


def test_a_drain_ends_at_drain_s_and_probes_meanwhile() -> None:
    from pgleaderlock.core.machine import EndDrain

    d = Driver(drain_s=8.0)
    d.lead()
    d.machine.request(Request.STOP)
    d.feed(Woke(), after=1.0)
    assert d.blocking == Sleep(105.0)  # the probe comes first
    d.feed(Woke(), after=4.0)
    assert d.call.op is Op.PROBE
    d.feed(Answered(True))
    assert d.machine.draining
    assert d.blocking == Sleep(109.0)  # the drain's end
    d.feed(Woke(), after=4.0)
    assert EndDrain() in d.effects
    assert d.machine.state is S.RELEASING
    assert d.call.op is Op.UNLOCK  # type: ignore[comparison-overlap]


def test_a_forced_step_down_or_a_loss_ends_the_drain() -> None:
    from pgleaderlock.core.machine import EndDrain

    d = Driver(drain_s=30.0)
    d.lead()
    d.machine.request(Request.RELEASE)
    d.feed(Woke())
    d.machine.request(Request.FORCE)  # step_down(timeout_s) ran out
    d.feed(Woke())
    assert EndDrain() in d.effects
    assert d.machine.state is S.RELEASING
    assert d.machine.preempted(d.call)  # the unlock is cut short: the session closes

    d = Driver(drain_s=30.0)
    d.lead()
    d.machine.request(Request.STOP)
    d.feed(Woke())
    d.feed(Woke(), after=5.0)
    d.feed(Failed(ConnectionError("gone")))  # the probe fails mid-drain
    first_emit = next(i for i, e in enumerate(d.effects) if isinstance(e, Emit))
    assert d.effects.index(EndDrain()) < first_emit  # before anything else is told
    assert d.machine.state is S.STOPPED
    assert not d.machine.draining
    assert d.emitted() == [Event.LOST, Event.STOPPED]


# ---------------------------------------------------------------------- the lease


def test_callbacks_keep_the_lease_while_a_session_holds_the_lock() -> None:
    """While the session holds the lock (LEADER, RELEASING), callbacks run with
    keep-alives every health_interval_s: slow callbacks must not cost the lock to its
    lease. Not without a lease, and not once the session is gone or has unlocked."""
    d = Driver(lease_s=10.0)
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Answered(True))
    emits = [e for e in d.effects if isinstance(e, Emit)]
    assert emits
    assert {e.keepalive_s for e in emits} == {5.0}
    d.machine.request(Request.RELEASE)
    d.feed(Woke())
    assert {e.keepalive_s for e in d.effects if isinstance(e, Emit)} == {5.0}
    d.feed(Answered(True))  # unlocked: the session holds nothing any more
    assert Event.RELEASED in d.emitted()
    assert {e.keepalive_s for e in d.effects if isinstance(e, Emit)} == {None}

    d = Driver(lease_s=10.0)
    d.lead()
    d.feed(Woke(), after=5.0)
    d.feed(Failed(ConnectionError("gone")))
    assert {e.keepalive_s for e in d.effects if isinstance(e, Emit)} == {None}

    d = Driver()  # no lease
    d.lead()
    assert {e.keepalive_s for e in d.effects if isinstance(e, Emit)} == {None}


# ---------------------------------------------------------------------- probes


def test_new_leaderships_probe_at_spread_phases() -> None:
    """Locks that lead from the same moment must not probe in one burst, and no first
    probe comes later than health_interval_s (the partition bound). Probe times fall on
    a 0.1 s grid, so that the probes of one step share the event loop's wake-ups."""
    firsts, slots = [], set()
    for seed in range(200):
        d = Driver(rng=random.Random(seed))
        d.lead()
        sleep = d.blocking
        assert isinstance(sleep, Sleep)
        firsts.append(sleep.until - d.now)
        slot = round(sleep.until / 0.1)
        assert sleep.until == pytest.approx(slot * 0.1, abs=1e-9)
        slots.add(slot)
    assert all(0.4 - 1e-9 <= first <= 5.0 for first in firsts)
    buckets = {int(first) for first in firsts}
    assert buckets == {0, 1, 2, 3, 4}  # spread over the whole interval
    assert len(slots) >= 35  # of the 45 steps between 0.5 s and 5 s
    d.feed(Woke(), after=firsts[-1])
    d.feed(Answered(True))
    assert d.blocking == Sleep(d.now + 5.0)  # then every interval


def late_leader() -> Driver:
    from pgleaderlock.core.machine import Late

    d = Driver()
    d.lead()
    d.feed(Woke(), after=5.0)
    assert d.call.op is Op.PROBE
    d.feed(Late(acknowledged=True), after=2.0)  # the server has our probe: slow
    return d


def test_a_late_probe_demotes_without_events_and_waits_for_the_answer() -> None:
    d = late_leader()
    assert d.machine.state is S.RECONNECTING  # not leading from health_timeout_s on
    assert d.emitted() == []  # no on_lost: the session may well be fine
    assert "probe_late" in d.logged()
    assert d.blocking == Await(frozenset({Request.STOP, Request.RELEASE}))
    d.feed(Answered(True), after=1.5)  # a slow server answered, same backend
    assert d.machine.state is S.LEADER  # type: ignore[comparison-overlap]
    assert d.emitted() == []
    assert d.machine.statistics(leader_since=None, backend_pid=None).losses == 0


def test_a_late_probe_that_fails_loses_the_lock() -> None:
    d = late_leader()
    d.feed(Failed(ConnectionError("health check timed out after 9 s")), after=7.0)
    assert d.machine.state is S.FOLLOWER
    assert d.emitted() == [Event.LOST]
    assert CloseSession() in d.effects


def test_a_late_probe_the_server_never_acknowledged_is_a_loss_at_the_bound() -> None:
    """A silent network (the partition the bound is about) is not given more time."""
    from pgleaderlock.core.machine import Late

    for acknowledged in (False, None):
        d = Driver()
        d.lead()
        d.feed(Woke(), after=5.0)
        d.feed(Late(acknowledged=acknowledged), after=2.0)
        assert d.machine.state is S.FOLLOWER
        assert d.emitted() == [Event.LOST]
        assert CloseSession() in d.effects
        assert "not acknowledged" in str(d.machine.last_error)


def test_a_stop_cuts_a_late_probe_short() -> None:
    d = late_leader()
    d.machine.request(Request.STOP)
    d.feed(CutShort())
    assert d.machine.state is S.STOPPED
    assert CloseSession() in d.effects


def test_an_idle_leader_asks_only_for_idle_steps_until_asked_for_more() -> None:
    """The idle contract (``idle_step``): once LEADER with nothing asked of it, every
    answer of the machine is logs, the watch, and a sleep or a probe with a soft
    timeout, which the runner may perform outside its task. Queued work, a step-down
    and a failed probe are not: the task performs them."""
    d = Driver()
    d.lead()
    d.feed(Woke(), after=0.0)  # on_acquired ran: the first sleep of the leadership
    for _ in range(20):
        step = idle_step(d.effects)
        assert step is not None, d.effects
        if isinstance(step.wait, Sleep):
            assert step.watch
            d.feed(Woke(), after=step.wait.until - d.now)
        else:
            assert step.wait.op is Op.PROBE
            assert step.wait.soft_timeout_s is not None
            d.feed(Answered(True), after=0.001)
    assert d.machine.request(Request.WORK)
    d.feed(Woke())
    assert d.call.op is Op.WORK
    assert idle_step(d.effects) is None
    d.feed(Answered(True))  # the work answered: the session lives, idle again
    assert idle_step(d.effects) is not None
    assert d.machine.state is S.LEADER
    d.machine.request(Request.WORK)
    d.feed(Woke())
    d.feed(Failed(ConnectionError("gone")))  # work that fails loses, as a probe would
    assert d.machine.state is not S.LEADER
    assert idle_step(d.effects) is None
    assert Event.LOST in d.emitted()
    assert not d.machine.request(Request.WORK)  # no session to work on now
    d = Driver()
    d.lead()
    d.machine.request(Request.RELEASE)
    d.feed(Woke())
    assert idle_step(d.effects) is None
    assert d.call.op is Op.UNLOCK


@pytest.mark.parametrize("how", ["probe fails", "probe late", "step_down", "shutdown"])
def test_queued_work_fails_before_anything_is_told_when_leader_ends(how: str) -> None:
    """Leaving LEADER, for whatever reason, fails the calls queued for the session
    first (StopLeaderWork), before the state-change and every other callback: leader work
    that waits for such a call is what those callbacks stop and await (issue 37)."""
    d = Driver(lease_s=3.0)
    d.lead()
    d.feed(Woke())
    assert d.machine.request(Request.WORK)
    match how:
        case "probe fails":
            d.feed(Woke(), after=10.0)  # the probe is due before the work
            assert d.call.op is Op.PROBE
            d.feed(Failed(ConnectionError("gone")))
        case "probe late":
            d.feed(Woke(), after=10.0)
            d.feed(Late(acknowledged=True))
        case "step_down":
            d.machine.request(Request.RELEASE)
            d.feed(Woke())
        case "shutdown":
            d.machine.request(Request.STOP)
            d.feed(Woke())
    assert d.machine.state is not S.LEADER
    first = next(i for i, e in enumerate(d.effects) if not isinstance(e, Log))
    assert d.effects[first] == StopLeaderWork(), d.effects
    assert d.effects.count(StopLeaderWork()) == 1
    assert not d.machine.request(Request.WORK)


def test_a_leader_that_stays_leader_drops_no_work() -> None:
    d = Driver()
    d.lead()
    d.feed(Woke())
    d.machine.request(Request.WORK)
    d.feed(Woke(), after=10.0)
    d.feed(Answered(True))  # the probe answered: still LEADER, the work runs next
    assert StopLeaderWork() not in d.effects
    assert d.call.op is Op.WORK
