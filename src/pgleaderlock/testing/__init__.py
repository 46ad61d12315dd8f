"""Helpers for testing code that uses pgleaderlock.

- :class:`~pgleaderlock.testing.fake.FakeServer`: in-memory advisory locks with
  scriptable failures, a ready-made ``connect_fn`` for unit tests.
- :class:`~pgleaderlock.testing.postgres.ThrowawayPostgres`: a private PostgreSQL
  cluster (``initdb``/``pg_ctl``) for integration tests and demos.
- :mod:`pgleaderlock.testing.beliefs`: the leadership-belief checker
  (:class:`~pgleaderlock.testing.beliefs.BeliefLog`): did two candidates ever believe
  they led at once?
- :mod:`pgleaderlock.testing.candidate`: a LeaderLock in a child process that prints its
  events as JSON lines (``python -m pgleaderlock.testing.candidate``), and
  :class:`~pgleaderlock.testing.candidate.CandidateProcess`, its asyncio handle.

The two last modules are not imported here: ``python -m pgleaderlock.testing.candidate``
must find its module not yet imported.
"""

from .fake import FakeServer, FakeSession
from .postgres import ThrowawayPostgres, find_pg_bin

__all__ = ["FakeServer", "FakeSession", "ThrowawayPostgres", "find_pg_bin"]
