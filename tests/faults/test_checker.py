"""The belief-interval checker itself (pure, no server): it must catch what it is for."""

from __future__ import annotations

import pytest

from pgleaderlock.testing.beliefs import BeliefReport
from support.belief_spans import log_with


def test_disjoint_beliefs_are_safe() -> None:
    log = log_with(("a", 100.0, 101.0), ("b", 101.0, 102.0), ("a", 102.5, 103.0))
    report = log.report(until=104.0)
    report.assert_safe()
    assert report.leader_changes == 2
    assert report.longest_gap is not None
    assert report.longest_gap.size_s == pytest.approx(1.0)  # 103 .. 104, nobody leads
    assert (report.longest_gap.start, report.longest_gap.end) == (103.0, 104.0)


def test_any_overlap_without_a_terminate_fails() -> None:
    log = log_with(("a", 100.0, 101.0001), ("b", 101.0, None))
    report = log.report(until=102.0)
    assert len(report.other_overlaps) == 1
    assert report.other_overlaps[0].size_s == pytest.approx(0.0001)
    with pytest.raises(AssertionError, match=r"OVERLAP 0\.100 ms: a"):
        report.assert_safe()


def test_open_belief_overlaps_until_the_end() -> None:
    log = log_with(("a", 100.0, None), ("b", 101.0, None))
    report = log.report(until=103.0)
    assert report.other_overlaps[0].size_s == pytest.approx(2.0)


def overlap_after_a_terminate_of(terminated: str) -> BeliefReport:
    """Candidate a leads; ``terminated`` is terminated; b begins 1 ms later; a notices
    its loss 2 ms after that."""
    log = log_with()
    log.begin("a", 100.0)
    log.fault("terminate", terminated, 101.0)
    log.begin("b", 101.001)
    log.end("a", "lost", 101.003)
    return log.report(until=102.0)


def test_terminate_overlap_is_reported_separately_and_bounded() -> None:
    report = overlap_after_a_terminate_of("a")
    assert report.other_overlaps == ()
    assert len(report.terminate_overlaps) == 1
    assert report.max_terminate_overlap_s == pytest.approx(0.002)
    report.assert_safe()
    with pytest.raises(AssertionError, match="terminate overlap"):
        report.assert_safe(terminate_limit_s=0.001)


def test_terminate_of_another_candidate_explains_nothing() -> None:
    report = overlap_after_a_terminate_of("c")
    assert len(report.other_overlaps) == 1


def test_a_frozen_leader_may_overlap_only_until_just_after_it_thaws() -> None:
    """A leader frozen while the next one begins (its lease ran out): a frozen overlap,
    safe if its belief ended within the resume limit of the thaw; late, or never thawed,
    it fails."""
    log = log_with()
    log.begin("a", 100.0)
    log.fault("freeze", "a", 101.0)
    log.begin("b", 111.0)
    log.fault("thaw", "a", 140.0)
    log.end("a", "lost", 140.004)
    report = log.report(until=150.0)
    assert report.other_overlaps == ()
    assert len(report.frozen_overlaps) == 1
    frozen = report.frozen_overlaps[0]
    assert frozen.size_s == pytest.approx(29.004)
    assert frozen.resumed_late_s == pytest.approx(0.004)
    report.assert_safe()
    with pytest.raises(AssertionError, match=r"frozen overlap \(ended 4\.000 ms after"):
        report.assert_safe(resume_limit_s=0.001)

    late = log_with(("a", 100.0, 142.0), ("b", 111.0, None))
    late.fault("freeze", "a", 101.0)
    late.fault("thaw", "a", 140.0)
    with pytest.raises(AssertionError, match="frozen overlap"):
        late.report(until=150.0).assert_safe()

    never = log_with(("a", 100.0, None), ("b", 111.0, None))
    never.fault("freeze", "a", 101.0)
    assert len(never.report(until=150.0).other_overlaps) == 1  # no thaw: explains nothing


def test_a_freeze_before_the_belief_or_after_the_next_began_explains_nothing() -> None:
    log = log_with(("a", 100.0, 120.0), ("b", 111.0, None))
    log.fault("freeze", "a", 99.0)  # before a led
    log.fault("thaw", "a", 99.5)
    log.fault("freeze", "a", 112.0)  # after b began: b's start is not explained by it
    log.fault("thaw", "a", 119.99)
    report = log.report(until=150.0)
    assert len(report.other_overlaps) == 1
    assert report.frozen_overlaps == ()


def test_begin_and_end_are_idempotent_and_the_earliest_wins() -> None:
    log = log_with()
    log.feed("a", "state", 100.0, old="acquiring", new="leader")
    log.feed("a", "acquired", 100.001)
    log.feed("a", "state", 101.0, old="leader", new="follower")
    log.feed("a", "lost", 101.002)
    log.feed("a", "stopped", 102.0)
    [interval] = log.intervals()
    assert (interval.start, interval.end, interval.end_reason) == (100.0, 101.0, "state:follower")
