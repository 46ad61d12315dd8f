"""The `CallGuard` a lock's calls run under: a call cut short is reported as cut short
even when the driver turns the cancellation into an error of its own."""

from __future__ import annotations

import asyncio

import pytest

from pgleaderlock.core.calls import CallGuard, CallInterrupted


class DriverError(Exception):
    """What psycopg raises when it cleans up on a connection dropped under it."""


async def _driver_call(started: asyncio.Event, dropped: list[bool]) -> int:
    """A driver call that, cancelled on a dropped connection, raises its own error."""
    started.set()
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        if dropped:
            raise DriverError("consuming input failed: connection pointer is NULL") from None
        raise
    return 1


async def _cut(reason: object, *, abort: bool, timeout_s: float = 30.0) -> BaseException:
    dropped: list[bool] = []
    guard = CallGuard(lambda: dropped.append(True))
    started = asyncio.Event()

    async def call() -> BaseException:
        try:
            await guard(_driver_call(started, dropped), timeout_s, "stop", abort)
        except BaseException as exc:
            task = asyncio.current_task()
            assert task is not None
            assert task.cancelling() == 0  # no cancel request left over for later awaits
            await asyncio.sleep(0)  # and the task goes on
            return exc
        raise AssertionError("not cut short")

    task = asyncio.create_task(call())
    await started.wait()
    if reason is not None:
        guard.interrupt(reason)
    try:
        return await task
    finally:
        guard.close()


async def test_a_cut_short_call_whose_driver_raises_its_own_error_is_interrupted() -> None:
    assert isinstance(await _cut("stop", abort=True), CallInterrupted)


async def test_a_timed_out_call_whose_driver_raises_its_own_error_is_a_timeout() -> None:
    assert isinstance(await _cut(None, abort=True, timeout_s=0.05), TimeoutError)


async def test_a_driver_error_of_a_call_nobody_cut_short_is_the_callers() -> None:
    guard = CallGuard(lambda: None)

    async def fails() -> None:
        raise DriverError("the server said no")

    with pytest.raises(DriverError):
        await guard(fails(), 5.0, "stop")
    guard.close()
