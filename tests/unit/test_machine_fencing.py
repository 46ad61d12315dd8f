"""The machine's fencing (an injected clock, no event loop): the term is bumped before
leadership is announced, the acquire delay, and a failed or blocked term bump."""

from __future__ import annotations

from typing import Any

from pgleaderlock import (
    ConnectionError,
    LockState,
)
from pgleaderlock.core.machine import (
    Action,
    Answered,
    Call,
    CloseSession,
    Connected,
    Failed,
    Input,
    Log,
    Op,
    Request,
    Sleep,
    Started,
    Woke,
)
from pgleaderlock.core.models import Event
from pgleaderlock.core.session import FencedSessions
from support.machine import Driver

S, I, A = LockState, Input, Action


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
