"""Random runs of the machine (an injected clock, no event loop) that check its
invariants after every step."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from pgleaderlock import (
    ConnectionError,
    FixedInterval,
    LockState,
)
from pgleaderlock.core.machine import (
    Action,
    Answered,
    Await,
    Call,
    Connected,
    CutShort,
    Emit,
    Failed,
    Input,
    Late,
    Machine,
    Op,
    Request,
    Result,
    Sleep,
    Started,
    Woke,
)
from pgleaderlock.core.models import Event
from pgleaderlock.core.session import FencedSessions
from support.machine import config

S, I, A = LockState, Input, Action
ANY = (True, False)


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
