"""Belief logs written by hand, for the tests of the checker itself
(tests/faults/test_checker*.py)."""

from __future__ import annotations

from pgleaderlock.testing.beliefs import BeliefLog


def log_with(*spans: tuple[str, float, float | None], slots: int = 1) -> BeliefLog:
    """A log (its clock stopped at 100.0) of ``spans``: ``(name, start, end)``, each
    belief ended as ``lost`` at ``end``, or still open when ``end`` is None."""
    log = BeliefLog(clock=lambda: 100.0, slots=slots)
    for name, start, end in spans:
        log.begin(name, start)
        if end is not None:
            log.end(name, "lost", end)
    return log
