"""The machine's transition table, row by row, against the original table with its three
footnotes (docs/state-machine.md). The policies the machine owns, random runs that check
its invariants, fencing, drain, the lease and probes have files of their own
(test_machine_*.py), on the hand-fed driver of tests/support/machine.py.

EXPECTED is written from docs/state-machine.md (the table, its footnotes and its
deviations; the decisions are docs/concepts.md's), independently of machine.TABLE: changing any row of the table makes its case here fail.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from pgleaderlock import (
    LockState,
)
from pgleaderlock.core.machine import (
    TABLE,
    Action,
    Conditions,
    IllegalTransitionError,
    Input,
    legal_inputs,
    render_markdown,
    render_mermaid,
    step,
)

S, I, A = LockState, Input, Action
ANY = (True, False)


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
