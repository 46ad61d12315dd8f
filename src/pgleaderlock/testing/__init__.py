"""Helpers for testing code that uses pgleaderlock.

- [`FakeServer`][pgleaderlock.testing.FakeServer]: in-memory advisory locks with scriptable
  failures, a ready-made ``connect_fn`` for unit tests.
- [`ThrowawayPostgres`][pgleaderlock.testing.ThrowawayPostgres]: a private PostgreSQL
  cluster (``initdb``/``pg_ctl``) for integration tests and demos.
- [`pgleaderlock.testing.beliefs`][pgleaderlock.testing.beliefs]: the leadership-belief checker
  ([`BeliefLog`][pgleaderlock.testing.beliefs.BeliefLog]): did two candidates ever believe
  they led at once?
- [`pgleaderlock.testing.candidate`][pgleaderlock.testing.candidate]: a LeaderLock in a
  child process that prints its events as JSON lines (``python -m
  pgleaderlock.testing.candidate``), and
  [`CandidateProcess`][pgleaderlock.testing.candidate.CandidateProcess], its asyncio handle.

The two last modules are not imported here: ``python -m pgleaderlock.testing.candidate``
must find its module not yet imported.
"""

from .fake import FakeServer, FakeSession
from .postgres import ThrowawayPostgres, find_pg_bin

__all__ = ["FakeServer", "FakeSession", "ThrowawayPostgres", "find_pg_bin"]
