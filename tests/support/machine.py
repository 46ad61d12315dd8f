"""A hand-fed state machine for the machine's tests (tests/unit/test_machine*.py): an
injected clock, no event loop, the effects kept for assertions; and the short names
those tests write the transitions with."""

from __future__ import annotations

import random
from typing import Any

from pgleaderlock import FixedInterval, LockState, RetryContext, RetryStrategy
from pgleaderlock.core.config import LockConfig
from pgleaderlock.core.machine import (
    Action,
    Answered,
    Await,
    Call,
    Connected,
    Effect,
    Emit,
    Input,
    Log,
    Machine,
    Request,
    Result,
    Sleep,
    Started,
    Woke,
)
from pgleaderlock.core.models import Event

S, I, A = LockState, Input, Action
ANY = (True, False)
"""Either value of a boolean condition of a transition."""


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

    def request(self, request: Request) -> list[Effect]:
        """``request``, as a caller of the lock makes it: asked of the machine, which is
        then woken from what it waits for."""
        self.machine.request(request)
        return self.feed(Woke())

    def lead(self) -> None:
        self.feed(Started())
        self.feed(Connected(can_wait=True))
        self.feed(Answered(True))
        assert self.machine.state is LockState.LEADER
