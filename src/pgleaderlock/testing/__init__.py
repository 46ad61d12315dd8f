"""Helpers for testing code that uses pgleaderlock.

- :class:`~pgleaderlock.testing.fake.FakeServer`: in-memory advisory locks with
  scriptable failures, a ready-made ``connect_fn`` for unit tests.
- :class:`~pgleaderlock.testing.postgres.ThrowawayPostgres`: a private PostgreSQL
  cluster (``initdb``/``pg_ctl``) for integration tests and demos.
"""

from .fake import FakeServer, FakeSession
from .postgres import ThrowawayPostgres, find_pg_bin, resolve_test_dsn

__all__ = ["FakeServer", "FakeSession", "ThrowawayPostgres", "find_pg_bin", "resolve_test_dsn"]
