"""Fixtures of the HA tier: a real Patroni cluster (``support.patroni``).

- ``patroni_sync`` (module): etcd, three Patroni nodes with ``synchronous_mode`` on, and
  HAProxy; the tests of a module may switch it over and crash it (it is not healed).
- ``make_patroni``: ``make_patroni(synchronous=False)`` starts a private cluster (from
  async code through ``asyncio.to_thread``); closed at teardown.

The tier skips, with the reason, when Patroni, etcd, HAProxy or PostgreSQL 15 are not
installed (``scripts/test.sh`` installs the Debian packages when run as root).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from support.patroni import PatroniCluster, patroni_unavailable_reason


@pytest.fixture(scope="module")
def patroni_sync() -> Iterator[PatroniCluster]:
    reason = patroni_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with PatroniCluster(synchronous=True) as cluster:
        yield cluster


@pytest.fixture
def make_patroni() -> Iterator[Callable[..., PatroniCluster]]:
    reason = patroni_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:

        def make(**kwargs: object) -> PatroniCluster:
            return stack.enter_context(PatroniCluster(**kwargs))  # type: ignore[arg-type]

        yield make
