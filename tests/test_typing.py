"""The public API's static types, as a user's code sees them.

``mypy --strict`` checks this file with the tests (``files`` in pyproject.toml): each
``assert_type`` fails the type check if the API's annotations change. At run time
``assert_type`` returns its argument unchanged, so the same lines also run as tests,
on the in-memory ``FakeServer`` (no database).
"""

from __future__ import annotations

from typing import assert_type

import pytest

from pgleaderlock import (
    Callback,
    ConfigurationError,
    ErrorCallback,
    Fencing,
    LeaderLock,
    LockOptions,
    LockState,
    LockStatistics,
    StateChangeCallback,
    Timing,
    lock_keys,
)
from pgleaderlock.testing import FakeServer


def test_lock_keys_is_a_pair_of_ints() -> None:
    assert_type(lock_keys("billing-scheduler"), tuple[int, int])


def test_from_name_returns_the_class_it_is_called_on() -> None:
    class MyLock(LeaderLock):
        pass

    lock = assert_type(LeaderLock.from_name("typing", dsn="postgresql://u@h/db"), LeaderLock)
    assert_type(MyLock.from_name("typing", dsn="postgresql://u@h/db"), MyLock)
    assert_type(lock.keys, tuple[int, int])
    assert_type(lock.name, str | None)


def test_state_and_statistics() -> None:
    lock = LeaderLock.from_name("typing", dsn="postgresql://u@h/db")
    assert_type(lock.state, LockState)
    assert_type(lock.is_leader, bool)
    stats = assert_type(lock.statistics(), LockStatistics)
    assert_type(stats.state, LockState)
    assert_type(stats.acquisitions, int)
    assert_type(stats.last_error, Exception | None)
    assert_type(stats.leader_since, float | None)


def test_decorators_return_the_function() -> None:
    lock = LeaderLock.from_name("typing", dsn="postgresql://u@h/db")

    def started() -> None: ...

    async def stopped() -> None: ...

    def failed(exc: Exception) -> None: ...

    def changed(old: LockState, new: LockState) -> None: ...

    # The same object comes back; statically it has the event's callback type (not the
    # function's own narrower type).
    assert assert_type(lock.on_acquired(started), Callback) is started
    assert assert_type(lock.on_stopped(stopped), Callback) is stopped
    assert assert_type(lock.on_error(failed), ErrorCallback) is failed
    assert assert_type(lock.on_state_change(changed), StateChangeCallback) is changed


async def test_wait_for_leadership_is_a_bool() -> None:
    server = FakeServer()
    lock = LeaderLock.from_name("typing", connect_fn=server.connect)
    async with lock:
        assert assert_type(await lock.wait_for_leadership(1), bool)
    assert_type(await lock.wait_for_leadership(0), bool)


def test_options_are_typed_and_so_are_the_deprecated_keywords() -> None:
    options = LockOptions(timing=Timing(lease_s=20), fencing=Fencing(enabled=True))
    lock = LeaderLock.from_name("typing", dsn="postgresql://u@h/db", options=options)
    assert_type(lock.options, LockOptions)
    assert_type(lock.options.timing.lease_s, float | None)
    # The old keywords are typed (a TypedDict), not ``**kwargs: Any``: a wrong type or
    # an unknown keyword fails the type check (an unused ignore would fail it too).
    with pytest.raises(ConfigurationError):
        LeaderLock("postgresql://u@h/db", 1, 2, lease_s="3")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        LeaderLock("postgresql://u@h/db", 1, 2, lease=3.0)  # type: ignore[call-arg]
