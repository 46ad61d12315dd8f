"""The implementations ``failover.py`` compares, and its scenarios.

pgleaderlock runs as the candidate process of pgleaderlock.testing (the one the fault
tests and the demo use), in the configurations of ``CANDIDATES``; the other
implementations are workers of ``failover.py`` (``--worker``, ``_failover_workers.py``)
that print the same JSON lines.
"""

from __future__ import annotations

from dataclasses import dataclass

from pgleaderlock.testing.candidate import CandidateOptions

SCENARIOS = ("crash", "graceful", "terminate")
FLOOR = "raw-block"


@dataclass(frozen=True)
class Impl:
    """One implementation under test."""

    key: str
    label: str
    coarse: bool  # polls in seconds: timings are not sensitive to a noisy neighbour


# pgleaderlock runs as the candidate process of pgleaderlock.testing (the one the fault
# tests and the demo use), in these configurations; the other implementations are
# workers of this script (--worker) that print the same JSON lines.
CANDIDATES = {
    "pgleaderlock-wait": CandidateOptions.library_defaults(quiet=True),
    "pgleaderlock-poll-exp": CandidateOptions.library_defaults(follower_mode="poll", quiet=True),
    "pgleaderlock-poll-1s": CandidateOptions.library_defaults(
        follower_mode="poll", retry_s=1.0, quiet=True
    ),
}

IMPLS = {
    impl.key: impl
    for impl in (
        Impl("pgleaderlock-wait", "pgleaderlock wait (default)", coarse=False),
        Impl("raw-block", "raw psycopg blocking waiter", coarse=False),
        Impl("tooz", "tooz (PostgreSQL driver)", coarse=False),
        Impl("pgleaderlock-poll-exp", "pgleaderlock poll, ExponentialBackoff()", coarse=True),
        Impl("pgleaderlock-poll-1s", "pgleaderlock poll, FixedInterval(1.0)", coarse=True),
        Impl("raw-poll-1s", "raw psycopg 1 s polling loop", coarse=True),
        Impl("asyncpg-lock", "asyncpg-lock (defaults)", coarse=True),
    )
}
