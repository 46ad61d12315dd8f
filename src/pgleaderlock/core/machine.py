"""The lock's finite-state machine: the transition table of spec §3.3 as data.

Everything that decides a transition lives in :data:`TABLE`; :func:`step` is a pure
lookup in it. The lifecycle task (:mod:`pgleaderlock.core.lock`) performs the returned
actions and nothing else decides a state. No I/O, no asyncio here.

The footnotes of the spec's table are expanded into explicit rows, each guarded by the
configuration it depends on:

1. ``auto_reacquire=False`` turns a transition to FOLLOWER after loss into STOPPED.
2. A release triggered by ``step_down()`` (with ``auto_reacquire=True``) ends in
   FOLLOWER instead of STOPPED.
3. With flap damping disabled (``reconnect_grace_s=None``) a failed health check goes
   straight to FOLLOWER (or STOPPED, footnote 1) and emits ``on_lost``.

Deviations from the spec's text, decided in DESIGN.md:

- ACQUIRING + DbError emits ``on_error``, not ``on_lost``: ``on_lost`` only ever follows
  an ``on_acquired`` (leadership that was held is lost).
- FOLLOWER + DbError (opening the session failed) stays in FOLLOWER and retries after
  the retry strategy's delay: connection establishment is retried (spec §6.2).
- A failed unlock during ``step_down()`` closes the session (which frees the lock) and,
  with ``auto_reacquire``, continues as FOLLOWER, like a successful one (footnote 2).
- Every transition to STOPPED emits ``on_stopped``, after the row's other actions.
- After a reconnect or a step-down, the next attempt waits one retry delay (``BACKOFF``)
  so that a failing server is not hammered and a stepped-down leader lets the others in.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

from .models import Input, LockState

__all__ = [
    "TABLE",
    "Action",
    "Conditions",
    "IllegalTransitionError",
    "Row",
    "Transition",
    "legal_inputs",
    "render_markdown",
    "step",
]

S = LockState
I = Input  # noqa: E741


class Action(enum.Enum):
    """What the lifecycle task does when a row fires, in the row's order."""

    OPEN_SESSION = "open a new session before the next attempt"
    CLOSE_SESSION = "close the session (frees any lock it holds)"
    TRY_LOCK = "execute pg_try_advisory_lock(k1, k2)"
    UNLOCK = "execute pg_advisory_unlock(k1, k2)"
    START_HEALTH_LOOP = "begin the health loop"
    START_GRACE = "start the grace timer; reconnect and re-acquire"
    SCHEDULE_ATTEMPT = "schedule an immediate AcquireAttempt"
    BACKOFF = "compute the retry delay, sleep, schedule the next AcquireAttempt"
    RESET_RETRY = "reset the retry state"
    LOG_SESSION_LOST = "log a warning: the session failed"
    LOG_RECOVERED = "log a notice: leadership recovered"
    EMIT_ACQUIRED = "emit on_acquired"
    EMIT_ACQUIRE_FAILED = "emit on_acquire_failed"
    EMIT_LOST = "emit on_lost"
    EMIT_RELEASED = "emit on_released"
    EMIT_ERROR = "emit on_error"
    EMIT_STOPPED = "emit on_stopped"


@dataclass(frozen=True)
class Conditions:
    """The configuration a transition may depend on."""

    auto_reacquire: bool = True
    grace_enabled: bool = False
    step_down: bool = False
    """The release in progress was requested by ``step_down()`` (not by a stop)."""


@dataclass(frozen=True)
class Row:
    """One row of the transition table.

    ``auto_reacquire``, ``grace_enabled`` and ``step_down`` are guards: ``None`` means
    "either"; a bool means the row applies only under that configuration.
    """

    source: LockState
    input: Input
    target: LockState
    actions: tuple[Action, ...]
    auto_reacquire: bool | None = None
    grace_enabled: bool | None = None
    step_down: bool | None = None
    note: str = ""

    def matches(self, state: LockState, input_: Input, cond: Conditions) -> bool:
        return (
            self.source is state
            and self.input is input_
            and self.auto_reacquire in (None, cond.auto_reacquire)
            and self.grace_enabled in (None, cond.grace_enabled)
            and self.step_down in (None, cond.step_down)
        )


@dataclass(frozen=True)
class Transition:
    """The result of :func:`step`: where to go and what to do on the way."""

    source: LockState
    input: Input
    target: LockState
    actions: tuple[Action, ...]

    @property
    def changes_state(self) -> bool:
        return self.source is not self.target


class IllegalTransitionError(RuntimeError):
    """An input arrived in a state whose table has no row for it."""


A = Action
_STOP = (A.CLOSE_SESSION, A.EMIT_STOPPED)
_REOPEN = (A.CLOSE_SESSION, A.OPEN_SESSION)


def _session_failed(input_: Input) -> tuple[Row, ...]:
    """LEADER + HealthFailed/DbError, with footnotes 3 and 1 expanded."""
    return (
        Row(S.LEADER, input_, S.RECONNECTING,
            (A.LOG_SESSION_LOST, A.CLOSE_SESSION, A.START_GRACE),
            grace_enabled=True),
        Row(S.LEADER, input_, S.FOLLOWER,
            (A.LOG_SESSION_LOST, A.EMIT_LOST, *_REOPEN, A.SCHEDULE_ATTEMPT),
            grace_enabled=False, auto_reacquire=True, note="footnote 3"),
        Row(S.LEADER, input_, S.STOPPED,
            (A.LOG_SESSION_LOST, A.EMIT_LOST, *_STOP),
            grace_enabled=False, auto_reacquire=False, note="footnotes 3, 1"),
    )  # fmt: skip


def _release_failed(input_: Input) -> tuple[Row, ...]:
    """RELEASING + ReleaseFailed/DbError; DESIGN.md decision 7 for step_down."""
    return (
        Row(S.RELEASING, input_, S.STOPPED, (A.EMIT_ERROR, *_STOP), step_down=False),
        Row(S.RELEASING, input_, S.STOPPED, (A.EMIT_ERROR, *_STOP),
            step_down=True, auto_reacquire=False),
        Row(S.RELEASING, input_, S.FOLLOWER, (A.EMIT_ERROR, *_REOPEN, A.BACKOFF),
            step_down=True, auto_reacquire=True, note="footnote 2, DESIGN decision 7"),
    )  # fmt: skip


TABLE: tuple[Row, ...] = (
    Row(S.STOPPED, I.START, S.FOLLOWER, (A.OPEN_SESSION, A.SCHEDULE_ATTEMPT)),
    Row(S.FOLLOWER, I.ACQUIRE_ATTEMPT, S.ACQUIRING, (A.TRY_LOCK,)),
    Row(S.FOLLOWER, I.STOP_REQUESTED, S.STOPPED, _STOP),
    Row(S.FOLLOWER, I.DB_ERROR, S.FOLLOWER, (A.EMIT_ERROR, *_REOPEN, A.BACKOFF),
        note="connection establishment failed: retried (spec §6.2)"),
    Row(S.ACQUIRING, I.ACQUIRE_SUCCEEDED, S.LEADER,
        (A.EMIT_ACQUIRED, A.RESET_RETRY, A.START_HEALTH_LOOP)),
    Row(S.ACQUIRING, I.ACQUIRE_FAILED, S.FOLLOWER, (A.EMIT_ACQUIRE_FAILED, A.BACKOFF)),
    Row(S.ACQUIRING, I.DB_ERROR, S.FOLLOWER, (A.EMIT_ERROR, *_REOPEN, A.BACKOFF),
        auto_reacquire=True, note="on_error, not on_lost (DESIGN decision 2)"),
    Row(S.ACQUIRING, I.DB_ERROR, S.STOPPED, (A.EMIT_ERROR, *_STOP),
        auto_reacquire=False, note="footnote 1"),
    Row(S.ACQUIRING, I.STOP_REQUESTED, S.STOPPED, _STOP),
    Row(S.LEADER, I.HEALTH_OK, S.LEADER, ()),
    *_session_failed(I.HEALTH_FAILED),
    *_session_failed(I.DB_ERROR),
    Row(S.LEADER, I.STOP_REQUESTED, S.RELEASING, (A.UNLOCK,)),
    Row(S.LEADER, I.RELEASE_REQUESTED, S.RELEASING, (A.UNLOCK,)),
    Row(S.RECONNECTING, I.REACQUIRE_SUCCEEDED, S.LEADER,
        (A.LOG_RECOVERED, A.RESET_RETRY, A.START_HEALTH_LOOP), note="no events"),
    Row(S.RECONNECTING, I.REACQUIRE_FAILED, S.FOLLOWER, (A.EMIT_LOST, A.SCHEDULE_ATTEMPT),
        auto_reacquire=True),
    Row(S.RECONNECTING, I.REACQUIRE_FAILED, S.STOPPED, (A.EMIT_LOST, *_STOP),
        auto_reacquire=False, note="footnote 1"),
    Row(S.RECONNECTING, I.GRACE_EXPIRED, S.FOLLOWER,
        (A.EMIT_LOST, *_REOPEN, A.SCHEDULE_ATTEMPT), auto_reacquire=True),
    Row(S.RECONNECTING, I.GRACE_EXPIRED, S.STOPPED, (A.EMIT_LOST, *_STOP),
        auto_reacquire=False, note="footnote 1"),
    Row(S.RECONNECTING, I.STOP_REQUESTED, S.STOPPED, _STOP),
    Row(S.RELEASING, I.RELEASE_SUCCEEDED, S.STOPPED, (A.EMIT_RELEASED, *_STOP),
        step_down=False),
    Row(S.RELEASING, I.RELEASE_SUCCEEDED, S.STOPPED, (A.EMIT_RELEASED, *_STOP),
        step_down=True, auto_reacquire=False),
    Row(S.RELEASING, I.RELEASE_SUCCEEDED, S.FOLLOWER,
        (A.EMIT_RELEASED, *_REOPEN, A.BACKOFF),
        step_down=True, auto_reacquire=True, note="footnote 2"),
    *_release_failed(I.RELEASE_FAILED),
    *_release_failed(I.DB_ERROR),
)  # fmt: skip
"""Every transition the lock can make. Pairs not listed here are illegal."""


def _rows(state: LockState, input_: Input, cond: Conditions) -> Iterator[Row]:
    return (row for row in TABLE if row.matches(state, input_, cond))


def step(state: LockState, input_: Input, cond: Conditions) -> Transition:
    """Return the transition for ``input_`` in ``state`` under ``cond``.

    Raises:
        IllegalTransitionError: if the table has no row (or, which the table's tests
            rule out, more than one row) for this state, input and configuration.
    """
    found = list(_rows(state, input_, cond))
    if len(found) != 1:
        what = "no row" if not found else f"{len(found)} rows"
        raise IllegalTransitionError(f"{what} for {state.name} + {input_.value} under {cond}")
    row = found[0]
    return Transition(state, input_, row.target, row.actions)


def legal_inputs(state: LockState) -> frozenset[Input]:
    """The inputs the table accepts in ``state`` (under some configuration)."""
    return frozenset(row.input for row in TABLE if row.source is state)


def render_markdown() -> str:
    """The table as Markdown, for the docs (generated from :data:`TABLE`, never by hand)."""

    def guard(row: Row) -> str:
        parts = []
        if row.auto_reacquire is not None:
            parts.append(f"auto_reacquire={row.auto_reacquire}")
        if row.grace_enabled is not None:
            parts.append("grace" if row.grace_enabled else "no grace")
        if row.step_down is not None:
            parts.append("step_down()" if row.step_down else "shutdown")
        return ", ".join(parts)

    lines = [
        "| From | Input | When | To | Actions | Note |",
        "|---|---|---|---|---|---|",
    ]
    for row in TABLE:
        actions = "; ".join(a.value for a in row.actions) or "*(none)*"
        lines.append(
            f"| {row.source.name} | `{row.input.value}` | {guard(row)} | {row.target.name} "
            f"| {actions} | {row.note} |"
        )
    return "\n".join(lines)
