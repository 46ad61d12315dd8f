"""The belief checker with ``slots=N`` (pure, no server): more than N believers at once
is an overlap; N is not."""

from __future__ import annotations

import pytest

from pgleaderlock.testing.beliefs import BeliefLog
from support.belief_spans import log_with


def test_n_believers_at_once_are_safe() -> None:
    log = log_with(("a", 100.0, 103.0), ("b", 100.5, 102.0), ("c", 102.0, 104.0), slots=2)
    report = log.report(until=105.0)
    report.assert_safe()
    assert report.other_overlaps == ()


def test_one_more_than_n_is_an_overlap_sized_until_one_ends() -> None:
    log = log_with(("a", 100.0, 103.0), ("b", 100.5, 102.0), ("c", 101.5, 104.0), slots=2)
    report = log.report(until=105.0)
    (overlap,) = report.other_overlaps
    assert overlap.later.candidate == "c"
    assert overlap.size_s == pytest.approx(0.5)  # 101.5 .. 102.0, when b ends
    with pytest.raises(AssertionError, match="OVERLAP"):
        report.assert_safe()


def test_the_same_log_with_one_slot_finds_every_pair() -> None:
    spans = [("a", 100.0, 103.0), ("b", 100.5, 102.0), ("c", 102.0, 104.0)]
    assert len(log_with(*spans, slots=1).report(until=105.0).other_overlaps) == 2
    assert log_with(*spans, slots=2).report(until=105.0).other_overlaps == ()


def test_an_excess_after_a_termination_is_a_terminate_overlap() -> None:
    log = log_with(("a", 100.0, None), ("b", 100.5, None), slots=2)
    log.fault("terminate", "b", 101.0)
    log.begin("c", 101.001)
    log.end("b", "lost", 101.003)
    report = log.report(until=102.0)
    assert report.other_overlaps == ()
    (overlap,) = report.terminate_overlaps
    assert overlap.earlier.candidate == "b"
    assert overlap.size_s == pytest.approx(0.002)
    report.assert_safe()


def test_slots_must_be_positive() -> None:
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="slots"):
            BeliefLog(slots=bad)
