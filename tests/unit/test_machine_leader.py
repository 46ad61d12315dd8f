"""The machine with an injected clock and no event loop, around and while it leads: random
runs that check its invariants after every step, fencing (the term bumped before
leadership is announced, the acquire delay, a failed or blocked bump), the drain of a
graceful stop, the lease callbacks keep, probes at spread phases and late probes, idle
steps, and the leader work queued when leadership ends."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from pgleaderlock import ConnectionError, FixedInterval, LockState
from pgleaderlock.core.machine import (
    Answered,
    Await,
    Call,
    CloseSession,
    Connected,
    CutShort,
    Emit,
    Failed,
    Late,
    Log,
    Machine,
    Op,
    Request,
    Result,
    Sleep,
    Started,
    StopLeaderWork,
    Woke,
    idle_step,
)
from pgleaderlock.core.models import Event
from pgleaderlock.core.session import FencedSessions
from support.machine import ANY, Driver, S, config


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


def granted_with_fencing(**kwargs: Any) -> Driver:
    """A driver of a fencing lock that the server has just granted: the term is next."""
    from pgleaderlock.core.config import TermTable

    d = Driver(term_table=TermTable(), **kwargs)
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Answered(True))
    return d


def test_fencing_bumps_the_term_before_announcing_leadership() -> None:
    from pgleaderlock.core.machine import TermBumped

    d = granted_with_fencing()
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

    d = granted_with_fencing(acquire_delay_s=0.25)
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

    d = granted_with_fencing(acquire_delay_s=1.0)
    d.feed(TermBumped(7))
    d.request(Request.STOP)
    assert d.machine.state is S.STOPPED
    assert CloseSession() in d.effects
    assert Event.ACQUIRED not in d.emitted()


def test_a_failed_term_bump_gives_the_lock_back() -> None:
    d = granted_with_fencing()
    d.feed(Failed(ConnectionError("fencing term timed out")))
    assert d.machine.state is S.FOLLOWER
    assert CloseSession() in d.effects  # closing the session frees the lock
    assert d.emitted() == [Event.ERROR]


def test_a_silent_recovery_bumps_the_term_too() -> None:
    from pgleaderlock.core.machine import TermBumped

    d = granted_with_fencing(reconnect_grace_s=4.0)
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

    d = granted_with_fencing(fencing_grace_s=1.5)
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

    d = granted_with_fencing()
    d.feed(TermBlocked())
    d.feed(Failed(ConnectionError("end fenced transactions timed out")))
    assert d.machine.state is S.FOLLOWER
    assert CloseSession() in d.effects
    assert d.emitted() == [Event.ERROR]


def test_no_drain_by_default() -> None:
    d = Driver()
    d.lead()
    d.request(Request.RELEASE)
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
    d.request(Request.RELEASE)
    d.request(Request.FORCE)  # step_down(timeout_s) ran out
    assert EndDrain() in d.effects
    assert d.machine.state is S.RELEASING
    assert d.machine.preempted(d.call)  # the unlock is cut short: the session closes

    d = Driver(drain_s=30.0)
    d.lead()
    d.request(Request.STOP)
    d.feed(Woke(), after=5.0)
    d.feed(Failed(ConnectionError("gone")))  # the probe fails mid-drain
    first_emit = next(i for i, e in enumerate(d.effects) if isinstance(e, Emit))
    assert d.effects.index(EndDrain()) < first_emit  # before anything else is told
    assert d.machine.state is S.STOPPED
    assert not d.machine.draining
    assert d.emitted() == [Event.LOST, Event.STOPPED]


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
    d.request(Request.RELEASE)
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
    d.request(Request.WORK)
    d.feed(Failed(ConnectionError("gone")))  # work that fails loses, as a probe would
    assert d.machine.state is not S.LEADER
    assert idle_step(d.effects) is None
    assert Event.LOST in d.emitted()
    assert not d.machine.request(Request.WORK)  # no session to work on now
    d = Driver()
    d.lead()
    d.request(Request.RELEASE)
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
            d.request(Request.RELEASE)
        case "shutdown":
            d.request(Request.STOP)
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
