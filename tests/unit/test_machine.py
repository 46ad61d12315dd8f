"""The transition table, row by row, against the spec (§3.3 with footnotes 1-3).

EXPECTED is written from the spec (and DESIGN.md's decisions), independently of
machine.TABLE: changing any row of the table makes its case here fail.
"""

from __future__ import annotations

import itertools

import pytest

from pgleaderlock.core.machine import (
    TABLE,
    Action,
    Conditions,
    IllegalTransitionError,
    legal_inputs,
    render_markdown,
    step,
)
from pgleaderlock.core.models import Input, LockState

S, I, A = LockState, Input, Action
ANY = (True, False)

CLOSE_STOP = (A.CLOSE_SESSION, A.EMIT_STOPPED)
REOPEN = (A.CLOSE_SESSION, A.OPEN_SESSION)

# (from, input, auto_reacquire, grace, step_down) -> (to, actions); None = any value.
EXPECTED = [
    # STOPPED --Start--> FOLLOWER: open connection; schedule immediate AcquireAttempt
    ((S.STOPPED, I.START, None, None, None), (S.FOLLOWER, (A.OPEN_SESSION, A.SCHEDULE_ATTEMPT))),
    ((S.FOLLOWER, I.ACQUIRE_ATTEMPT, None, None, None), (S.ACQUIRING, (A.TRY_LOCK,))),
    ((S.FOLLOWER, I.STOP_REQUESTED, None, None, None), (S.STOPPED, CLOSE_STOP)),
    # connection establishment failure: retried with the strategy (spec §6.2)
    ((S.FOLLOWER, I.DB_ERROR, None, None, None),
     (S.FOLLOWER, (A.EMIT_ERROR, *REOPEN, A.BACKOFF))),
    ((S.ACQUIRING, I.ACQUIRE_SUCCEEDED, None, None, None),
     (S.LEADER, (A.EMIT_ACQUIRED, A.RESET_RETRY, A.START_HEALTH_LOOP))),
    ((S.ACQUIRING, I.ACQUIRE_FAILED, None, None, None),
     (S.FOLLOWER, (A.EMIT_ACQUIRE_FAILED, A.BACKOFF))),
    # DbError while acquiring: on_error (DESIGN decision 2), footnote 1
    ((S.ACQUIRING, I.DB_ERROR, True, None, None),
     (S.FOLLOWER, (A.EMIT_ERROR, *REOPEN, A.BACKOFF))),
    ((S.ACQUIRING, I.DB_ERROR, False, None, None), (S.STOPPED, (A.EMIT_ERROR, *CLOSE_STOP))),
    ((S.ACQUIRING, I.STOP_REQUESTED, None, None, None), (S.STOPPED, CLOSE_STOP)),
    ((S.LEADER, I.HEALTH_OK, None, None, None), (S.LEADER, ())),
    # HealthFailed / DbError in LEADER: RECONNECTING, or footnote 3 (+ footnote 1)
    ((S.LEADER, I.HEALTH_FAILED, None, True, None),
     (S.RECONNECTING, (A.LOG_SESSION_LOST, A.CLOSE_SESSION, A.START_GRACE))),
    ((S.LEADER, I.HEALTH_FAILED, True, False, None),
     (S.FOLLOWER, (A.LOG_SESSION_LOST, A.EMIT_LOST, *REOPEN, A.SCHEDULE_ATTEMPT))),
    ((S.LEADER, I.HEALTH_FAILED, False, False, None),
     (S.STOPPED, (A.LOG_SESSION_LOST, A.EMIT_LOST, *CLOSE_STOP))),
    ((S.LEADER, I.DB_ERROR, None, True, None),
     (S.RECONNECTING, (A.LOG_SESSION_LOST, A.CLOSE_SESSION, A.START_GRACE))),
    ((S.LEADER, I.DB_ERROR, True, False, None),
     (S.FOLLOWER, (A.LOG_SESSION_LOST, A.EMIT_LOST, *REOPEN, A.SCHEDULE_ATTEMPT))),
    ((S.LEADER, I.DB_ERROR, False, False, None),
     (S.STOPPED, (A.LOG_SESSION_LOST, A.EMIT_LOST, *CLOSE_STOP))),
    ((S.LEADER, I.STOP_REQUESTED, None, None, None), (S.RELEASING, (A.UNLOCK,))),
    ((S.LEADER, I.RELEASE_REQUESTED, None, None, None), (S.RELEASING, (A.UNLOCK,))),
    # RECONNECTING: silent recovery emits nothing
    ((S.RECONNECTING, I.REACQUIRE_SUCCEEDED, None, None, None),
     (S.LEADER, (A.LOG_RECOVERED, A.RESET_RETRY, A.START_HEALTH_LOOP))),
    ((S.RECONNECTING, I.REACQUIRE_FAILED, True, None, None),
     (S.FOLLOWER, (A.EMIT_LOST, A.SCHEDULE_ATTEMPT))),
    ((S.RECONNECTING, I.REACQUIRE_FAILED, False, None, None),
     (S.STOPPED, (A.EMIT_LOST, *CLOSE_STOP))),
    ((S.RECONNECTING, I.GRACE_EXPIRED, True, None, None),
     (S.FOLLOWER, (A.EMIT_LOST, *REOPEN, A.SCHEDULE_ATTEMPT))),
    ((S.RECONNECTING, I.GRACE_EXPIRED, False, None, None),
     (S.STOPPED, (A.EMIT_LOST, *CLOSE_STOP))),
    ((S.RECONNECTING, I.STOP_REQUESTED, None, None, None), (S.STOPPED, CLOSE_STOP)),
    # RELEASING: footnote 2 (step_down + auto_reacquire -> FOLLOWER)
    ((S.RELEASING, I.RELEASE_SUCCEEDED, None, None, False),
     (S.STOPPED, (A.EMIT_RELEASED, *CLOSE_STOP))),
    ((S.RELEASING, I.RELEASE_SUCCEEDED, False, None, True),
     (S.STOPPED, (A.EMIT_RELEASED, *CLOSE_STOP))),
    ((S.RELEASING, I.RELEASE_SUCCEEDED, True, None, True),
     (S.FOLLOWER, (A.EMIT_RELEASED, *REOPEN, A.BACKOFF))),
    # ReleaseFailed / DbError: on_error; close; STOPPED (DESIGN decision 7 for step_down)
    *[
        row
        for inp in (I.RELEASE_FAILED, I.DB_ERROR)
        for row in (
            ((S.RELEASING, inp, None, None, False), (S.STOPPED, (A.EMIT_ERROR, *CLOSE_STOP))),
            ((S.RELEASING, inp, False, None, True), (S.STOPPED, (A.EMIT_ERROR, *CLOSE_STOP))),
            ((S.RELEASING, inp, True, None, True),
             (S.FOLLOWER, (A.EMIT_ERROR, *REOPEN, A.BACKOFF))),
        )
    ],
]  # fmt: skip


def _configs(auto, grace, step_down):
    for a, g, s in itertools.product(ANY, ANY, ANY):
        if auto in (None, a) and grace in (None, g) and step_down in (None, s):
            yield Conditions(auto_reacquire=a, grace_enabled=g, step_down=s)


@pytest.mark.parametrize(
    ("when", "then"),
    EXPECTED,
    ids=[f"{w[0].name}-{w[1].value}-{i}" for i, (w, _) in enumerate(EXPECTED)],
)
def test_row(when, then):
    state, input_, auto, grace, step_down = when
    target, actions = then
    for cond in _configs(auto, grace, step_down):
        transition = step(state, input_, cond)
        assert transition.target is target, cond
        assert transition.actions == actions, cond


def test_every_table_row_is_expected():
    """No row exists beyond the ones above (an added row needs a case too)."""
    covered = set()
    for (state, input_, auto, grace, step_down), _ in EXPECTED:
        for cond in _configs(auto, grace, step_down):
            covered.add((state, input_, cond))
    for row in TABLE:
        for cond in _configs(row.auto_reacquire, row.grace_enabled, row.step_down):
            assert (row.source, row.input, cond) in covered, row


def test_at_most_one_row_matches():
    for state, input_ in itertools.product(LockState, Input):
        for cond in _configs(None, None, None):
            matching = [row for row in TABLE if row.matches(state, input_, cond)]
            assert len(matching) <= 1, (state, input_, cond, matching)


@pytest.mark.parametrize(
    ("state", "input_"),
    [
        (S.STOPPED, I.ACQUIRE_ATTEMPT),
        (S.STOPPED, I.STOP_REQUESTED),
        (S.FOLLOWER, I.RELEASE_REQUESTED),
        (S.LEADER, I.ACQUIRE_ATTEMPT),
        (S.LEADER, I.ACQUIRE_SUCCEEDED),
        (S.RECONNECTING, I.HEALTH_OK),
        (S.RELEASING, I.STOP_REQUESTED),
        (S.ACQUIRING, I.HEALTH_FAILED),
    ],
)
def test_illegal_pairs_raise(state, input_):
    with pytest.raises(IllegalTransitionError):
        step(state, input_, Conditions())


def test_never_try_lock_from_leader():
    """Spec §2.3: re-acquiring while leader stacks the re-entrant lock."""
    for row in TABLE:
        if row.source in (S.LEADER, S.RELEASING):
            assert A.TRY_LOCK not in row.actions
            assert A.SCHEDULE_ATTEMPT not in row.actions or row.target is not S.LEADER


def test_on_lost_only_leaving_leadership():
    """DESIGN decision 2: on_lost only after leadership was held."""
    for row in TABLE:
        if A.EMIT_LOST in row.actions:
            assert row.source in (S.LEADER, S.RECONNECTING)


def test_every_stop_emits_on_stopped_and_closes():
    for row in TABLE:
        if row.target is S.STOPPED:
            assert row.actions[-2:] == (A.CLOSE_SESSION, A.EMIT_STOPPED), row


def test_legal_inputs_and_markdown():
    assert legal_inputs(S.STOPPED) == {I.START}
    assert I.RELEASE_REQUESTED in legal_inputs(S.LEADER)
    md = render_markdown()
    assert md.count("\n") == len(TABLE) + 1
    assert "| RECONNECTING | `ReacquireSucceeded` |" in md
