"""The transition table as data: every transition the lock can make, one row each.

The original table with its footnotes expanded into rows guarded by configuration,
plus the inputs it lacks (docs/state-machine.md: "Footnotes", "Deviations from the
specification"). [`step`][pgleaderlock.core.machine.step] looks a row up;
a (state, input) pair without a row is illegal. The docs' table and state diagram are
rendered from [`TABLE`][pgleaderlock.core.machine.TABLE].
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterator
from dataclasses import dataclass

from ..models import LockState

__all__ = [
    "TABLE",
    "Action",
    "Conditions",
    "IllegalTransitionError",
    "Input",
    "Row",
    "Transition",
    "legal_inputs",
    "render_markdown",
    "render_mermaid",
    "step",
]

S = LockState


class Input(enum.Enum):
    """The inputs of the transition table: the specification's, plus the ones it lacks
    (docs/state-machine.md)."""

    START = "Start"
    STOP_REQUESTED = "StopRequested"
    ACQUIRE_ATTEMPT = "AcquireAttempt"
    ACQUIRE_SUCCEEDED = "AcquireSucceeded"
    ACQUIRE_FAILED = "AcquireFailed"
    DB_ERROR = "DbError"
    HEALTH_OK = "HealthOk"
    HEALTH_FAILED = "HealthFailed"
    PROBE_LATE = "ProbeLate"
    REACQUIRE_SUCCEEDED = "ReacquireSucceeded"
    REACQUIRE_FAILED = "ReacquireFailed"
    RECONNECT_FAILED = "ReconnectFailed"
    GRACE_EXPIRED = "GraceExpired"
    RELEASE_REQUESTED = "ReleaseRequested"
    RELEASE_SUCCEEDED = "ReleaseSucceeded"
    RELEASE_FAILED = "ReleaseFailed"
    RETRIES_EXHAUSTED = "RetriesExhausted"
    TASK_ABORTED = "TaskAborted"
    DRAIN_REQUESTED = "DrainRequested"


class Action(enum.Enum):
    """What a row does, in the row's order; the machine turns each into effects."""

    CLOSE_SESSION = "close the session (frees any lock it holds)"
    TRY_LOCK = "attempt: pg_try_advisory_lock, or wait on the server (wait budget)"
    UNLOCK = "execute pg_advisory_unlock(k1, k2)"
    START_HEALTH_LOOP = "schedule the health probe every health_interval_s"
    START_GRACE = "start the grace timer; reconnect and re-acquire at once"
    RETRY_RECONNECT = "ask the retry strategy; reconnect after its delay, within the grace period"
    SCHEDULE_ATTEMPT = "schedule an immediate attempt"
    BACKOFF = "ask the retry strategy; next attempt after its delay (or wait that long)"
    RESET_RETRY = "reset the retry state"
    LOG_SESSION_LOST = "log a warning: the session failed"
    LOG_RECOVERED = "log a notice: leadership recovered"
    LOG_PROBE_LATE = "log a warning: the probe is late; not leading until it answers"
    LOG_GIVING_UP = "log why the lock gives up"
    EMIT_ACQUIRED = "emit on_acquired"
    EMIT_ACQUIRE_FAILED = "emit on_acquire_failed"
    EMIT_LOST = "emit on_lost"
    EMIT_RELEASED = "emit on_released"
    EMIT_ERROR = "emit on_error"
    EMIT_STOPPED = "emit on_stopped"
    START_DRAIN = "run on_draining beside the task; release once they return, or after drain_s"


@dataclass(frozen=True)
class Conditions:
    """What a row may depend on besides state and input."""

    auto_reacquire: bool = True
    """The lock's `auto_reacquire` setting."""
    grace_enabled: bool = False
    """Flap damping is on (`reconnect_grace_s` is set)."""
    step_down: bool = False
    """The release in progress was requested by `step_down()` (not by a stop)."""
    stop_reported: bool = True
    """`on_stopped` has run for this run of the lifecycle task."""


@dataclass(frozen=True)
class Row:
    """One row of the transition table.

    The guards (`auto_reacquire`, `grace_enabled`, `step_down`, `stop_reported`, as in
    [`Conditions`][pgleaderlock.core.machine.Conditions]) are `None` for "either", or the
    value the row needs.
    """

    source: LockState
    input: Input
    target: LockState
    actions: tuple[Action, ...]
    auto_reacquire: bool | None = None
    grace_enabled: bool | None = None
    step_down: bool | None = None
    stop_reported: bool | None = None
    note: str = ""

    def matches(self, state: LockState, input_: Input, cond: Conditions) -> bool:
        return (
            self.source is state
            and self.input is input_
            and self.auto_reacquire in (None, cond.auto_reacquire)
            and self.grace_enabled in (None, cond.grace_enabled)
            and self.step_down in (None, cond.step_down)
            and self.stop_reported in (None, cond.stop_reported)
        )

    @property
    def guard(self) -> str:
        """The row's guards in words, for the docs."""
        parts = []
        if self.auto_reacquire is not None:
            parts.append(f"auto_reacquire={self.auto_reacquire}")
        if self.grace_enabled is not None:
            parts.append("grace" if self.grace_enabled else "no grace")
        if self.step_down is not None:
            parts.append("step_down()" if self.step_down else "shutdown")
        if self.stop_reported is not None:
            parts.append("on_stopped ran" if self.stop_reported else "on_stopped not yet run")
        return ", ".join(parts)


@dataclass(frozen=True)
class Transition:
    """The result of [`step`][pgleaderlock.core.machine.step]."""

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
I = Input  # noqa: E741
_STOP = (A.CLOSE_SESSION, A.EMIT_STOPPED)


def _session_failed(input_: Input, source: LockState = S.LEADER) -> tuple[Row, ...]:
    """LEADER (or RECONNECTING after a late probe) + HealthFailed/DbError, with footnotes
    3 and 1 expanded."""
    return (
        Row(source, input_, S.RECONNECTING,
            (A.LOG_SESSION_LOST, A.CLOSE_SESSION, A.START_GRACE),
            grace_enabled=True),
        Row(source, input_, S.FOLLOWER,
            (A.LOG_SESSION_LOST, A.EMIT_LOST, A.CLOSE_SESSION, A.SCHEDULE_ATTEMPT),
            grace_enabled=False, auto_reacquire=True, note="footnote 3"),
        Row(source, input_, S.STOPPED,
            (A.LOG_SESSION_LOST, A.EMIT_LOST, *_STOP),
            grace_enabled=False, auto_reacquire=False, note="footnotes 3, 1"),
    )  # fmt: skip


def _release_ended(input_: Input, emit: Action) -> tuple[Row, ...]:
    """RELEASING + the unlock's outcome; footnote 2 and decision 7 (docs/concepts.md,
    "Decisions beyond the specification") for step_down."""
    note = "footnote 2" if emit is A.EMIT_RELEASED else "footnote 2, decision 7"
    return (
        Row(S.RELEASING, input_, S.STOPPED, (emit, *_STOP), step_down=False),
        Row(S.RELEASING, input_, S.STOPPED, (emit, *_STOP),
            step_down=True, auto_reacquire=False),
        Row(S.RELEASING, input_, S.FOLLOWER, (emit, A.CLOSE_SESSION, A.BACKOFF),
            step_down=True, auto_reacquire=True, note=note),
    )  # fmt: skip


def _aborted(source: LockState) -> Row:
    return Row(source, I.TASK_ABORTED, S.STOPPED, _STOP,
               note="the task was cancelled (forced shutdown) or crashed")  # fmt: skip


TABLE: tuple[Row, ...] = (
    Row(S.STOPPED, I.START, S.FOLLOWER, (A.SCHEDULE_ATTEMPT,),
        note="the session is opened when an attempt is due"),
    Row(S.STOPPED, I.TASK_ABORTED, S.STOPPED, (A.EMIT_STOPPED,), stop_reported=False,
        note="a forced stop cut on_stopped short: report it"),
    Row(S.STOPPED, I.TASK_ABORTED, S.STOPPED, (), stop_reported=True),
    Row(S.FOLLOWER, I.ACQUIRE_ATTEMPT, S.ACQUIRING, (A.TRY_LOCK,)),
    Row(S.FOLLOWER, I.STOP_REQUESTED, S.STOPPED, _STOP),
    Row(S.FOLLOWER, I.DB_ERROR, S.FOLLOWER, (A.EMIT_ERROR, A.CLOSE_SESSION, A.BACKOFF),
        note="opening a session failed: retried"),
    Row(S.FOLLOWER, I.RETRIES_EXHAUSTED, S.STOPPED, (A.LOG_GIVING_UP, *_STOP),
        note="the retry strategy returned None, or the error cannot be mended"),
    _aborted(S.FOLLOWER),
    Row(S.ACQUIRING, I.ACQUIRE_SUCCEEDED, S.LEADER,
        (A.EMIT_ACQUIRED, A.RESET_RETRY, A.START_HEALTH_LOOP)),
    Row(S.ACQUIRING, I.ACQUIRE_FAILED, S.FOLLOWER, (A.EMIT_ACQUIRE_FAILED, A.BACKOFF)),
    Row(S.ACQUIRING, I.DB_ERROR, S.FOLLOWER, (A.EMIT_ERROR, A.CLOSE_SESSION, A.BACKOFF),
        auto_reacquire=True, note="on_error, not on_lost (decision 2)"),
    Row(S.ACQUIRING, I.DB_ERROR, S.STOPPED, (A.EMIT_ERROR, *_STOP),
        auto_reacquire=False, note="footnote 1"),
    Row(S.ACQUIRING, I.STOP_REQUESTED, S.STOPPED, _STOP,
        note="an interrupted attempt may have been granted: closing frees it"),
    _aborted(S.ACQUIRING),
    Row(S.LEADER, I.HEALTH_OK, S.LEADER, (A.START_HEALTH_LOOP,)),
    *_session_failed(I.HEALTH_FAILED),
    *_session_failed(I.DB_ERROR),
    Row(S.LEADER, I.PROBE_LATE, S.RECONNECTING, (A.LOG_PROBE_LATE,),
        note="no events: the session may be fine, the probe slow; its answer decides"),
    Row(S.LEADER, I.DRAIN_REQUESTED, S.LEADER, (A.START_DRAIN,),
        note="drain_s > 0: step_down() or shutdown() lets leader work finish first; "
        "probes go on, and the release (or the stop) follows"),
    Row(S.LEADER, I.STOP_REQUESTED, S.RELEASING, (A.UNLOCK,)),
    Row(S.LEADER, I.RELEASE_REQUESTED, S.RELEASING, (A.UNLOCK,)),
    _aborted(S.LEADER),
    Row(S.RECONNECTING, I.HEALTH_OK, S.LEADER, (A.LOG_RECOVERED, A.START_HEALTH_LOOP),
        note="the late probe answered: the session was alive and held the lock"),
    *_session_failed(I.HEALTH_FAILED, S.RECONNECTING),
    Row(S.RECONNECTING, I.REACQUIRE_SUCCEEDED, S.LEADER,
        (A.LOG_RECOVERED, A.RESET_RETRY, A.START_HEALTH_LOOP), note="no events"),
    Row(S.RECONNECTING, I.REACQUIRE_FAILED, S.FOLLOWER, (A.EMIT_LOST, A.SCHEDULE_ATTEMPT),
        auto_reacquire=True, note="another session holds the lock"),
    Row(S.RECONNECTING, I.REACQUIRE_FAILED, S.STOPPED, (A.EMIT_LOST, *_STOP),
        auto_reacquire=False, note="footnote 1"),
    Row(S.RECONNECTING, I.RECONNECT_FAILED, S.RECONNECTING,
        (A.CLOSE_SESSION, A.RETRY_RECONNECT), note="connection errors retried (decision 6)"),
    Row(S.RECONNECTING, I.GRACE_EXPIRED, S.FOLLOWER,
        (A.EMIT_LOST, A.CLOSE_SESSION, A.SCHEDULE_ATTEMPT), auto_reacquire=True),
    Row(S.RECONNECTING, I.GRACE_EXPIRED, S.STOPPED, (A.EMIT_LOST, *_STOP),
        auto_reacquire=False, note="footnote 1"),
    Row(S.RECONNECTING, I.RELEASE_REQUESTED, S.FOLLOWER,
        (A.EMIT_LOST, A.CLOSE_SESSION, A.BACKOFF), auto_reacquire=True,
        note="step_down() with the session gone: the leadership was lost, not released"),
    Row(S.RECONNECTING, I.RELEASE_REQUESTED, S.STOPPED, (A.EMIT_LOST, *_STOP),
        auto_reacquire=False, note="footnote 1"),
    Row(S.RECONNECTING, I.STOP_REQUESTED, S.STOPPED, _STOP),
    _aborted(S.RECONNECTING),
    *_release_ended(I.RELEASE_SUCCEEDED, A.EMIT_RELEASED),
    *_release_ended(I.RELEASE_FAILED, A.EMIT_ERROR),
    *_release_ended(I.DB_ERROR, A.EMIT_ERROR),
    _aborted(S.RELEASING),
)  # fmt: skip
"""Every transition the lock can make. Pairs not listed here are illegal."""


_BY_PAIR: dict[tuple[LockState, Input], list[Row]] = {}
for _row in TABLE:
    _BY_PAIR.setdefault((_row.source, _row.input), []).append(_row)


def _rows(state: LockState, input_: Input, cond: Conditions) -> Iterator[Row]:
    return (row for row in _BY_PAIR.get((state, input_), ()) if row.matches(state, input_, cond))


@functools.lru_cache(maxsize=1024)  # the table is fixed: a lookup runs on every probe
def step(state: LockState, input_: Input, cond: Conditions) -> Transition:
    """Return the transition for `input_` in `state` under `cond`.

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
    """The inputs the table accepts in `state` (under some configuration)."""
    return frozenset(row.input for row in TABLE if row.source is state)


# ---------------------------------------------------------------------- rendering


def render_markdown() -> str:
    """The table as Markdown, for the docs (generated from
    [`TABLE`][pgleaderlock.core.machine.TABLE], never by hand)."""
    lines = [
        "| From | Input | When | To | Actions | Note |",
        "|---|---|---|---|---|---|",
    ]
    for row in TABLE:
        actions = "; ".join(a.value for a in row.actions) or "*(none)*"
        lines.append(
            f"| {row.source.name} | `{row.input.value}` | {row.guard} | {row.target.name} "
            f"| {actions} | {row.note} |"
        )
    return "\n".join(lines)


def render_mermaid() -> str:
    """The table as a Mermaid state diagram: one arrow per (from, input, to), labelled
    with the input and, where the target depends on it, the guard."""
    lines = ["stateDiagram-v2", "    [*] --> STOPPED"]
    seen: set[tuple[LockState, Input, LockState]] = set()
    for row in TABLE:
        key = (row.source, row.input, row.target)
        if key in seen or row.input is I.TASK_ABORTED:
            continue
        seen.add(key)
        targets = {r.target for r in TABLE if (r.source, r.input) == (row.source, row.input)}
        label = row.input.value
        if len(targets) > 1 and row.guard:
            label += f" [{row.guard}]"
        lines.append(f"    {row.source.name} --> {row.target.name}: {label}")
    lines.append("    note right of STOPPED: TaskAborted leads here from every state")
    return "\n".join(lines)
